package store

import (
	"container/list"
	"sync"
)

// memKind says what a memory-tier entry holds.
type memKind uint8

const (
	memChunk memKind = iota + 1 // a verified chunk of the stored blob
	memSpan                     // the inflated bytes between two checkpoints
)

type memKey struct {
	l    *layer
	kind memKind
	i    int64
}

type memEntry struct {
	key memKey
	b   []byte
}

// memTier is the bounded LRU of verified chunks and inflated spans. The
// slices it hands out are shared and never written after insertion.
type memTier struct {
	// mu is the last lock of the package's order (a layer's mu and the
	// Store's may be held when it is taken); nothing else is taken or
	// waited for under it.
	mu    sync.Mutex
	limit int64
	used  int64
	ll    *list.List // front: most recently used
	m     map[memKey]*list.Element
}

func newMemTier(limit int64) *memTier {
	return &memTier{limit: limit, ll: list.New(), m: make(map[memKey]*list.Element)}
}

func (c *memTier) get(k memKey) []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.m[k]
	if e == nil {
		return nil
	}
	c.ll.MoveToFront(e)
	return e.Value.(*memEntry).b
}

// put keeps b under k, evicting the least recently used entries beyond the
// limit; an entry larger than the whole tier is not kept.
func (c *memTier) put(k memKey, b []byte) {
	n := int64(len(b))
	if n > c.limit {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.m[k]; e != nil {
		c.ll.MoveToFront(e)
		return
	}
	c.m[k] = c.ll.PushFront(&memEntry{key: k, b: b})
	c.used += n
	for c.used > c.limit {
		e := c.ll.Back()
		me := e.Value.(*memEntry)
		c.ll.Remove(e)
		delete(c.m, me.key)
		c.used -= int64(len(me.b))
	}
}

func (c *memTier) bytes() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.used
}

// has reports whether k is held, without making it recently used.
func (c *memTier) has(k memKey) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[k] != nil
}
