package snapshotter

import (
	"context"
	"sync"
	"time"

	"github.com/kata-fsx/kata-fsx/content/lazyimage"
	"github.com/kata-fsx/kata-fsx/content/registry"
)

const (
	// maxImages bounds the resolved images a snapshotter keeps: CRI
	// prepares an image's layers within seconds of each other, so a few
	// recent images are all that is ever asked again.
	maxImages = 8
	// resolveTimeout bounds one resolve, a streaming build of a large
	// image included; it runs apart from any one request, as every layer
	// of the image waits for it.
	resolveTimeout = 30 * time.Minute
)

// resolver resolves each image manifest once at a time: the layers of one
// image, prepared concurrently by containerd, wait for the first one's
// resolve and share its result.
type resolver struct {
	opts lazyimage.Options
	// life ends with the snapshotter: resolves in flight stop.
	life context.Context

	// mu guards the tables; it is never held across a resolve or a wait.
	// A caller waits for a resolve on its done channel, within its own
	// context; the resolve itself runs within resolveTimeout and the
	// snapshotter's life, holding no lock.
	mu     sync.Mutex
	images map[string]*resolve // by HOST/REPO@MANIFEST
	order  []string            // finished resolves, oldest first
}

// resolve is one image's resolve; done closes when img or err is set.
type resolve struct {
	done chan struct{}
	img  *lazyimage.Image
	err  error
}

func newResolver(life context.Context, opts lazyimage.Options) *resolver {
	return &resolver{opts: opts, life: life, images: make(map[string]*resolve)}
}

// get returns ref's image, resolving it unless a resolve of it is done or
// under way. A failed resolve is not kept: the next layer tries again.
func (r *resolver) get(ctx context.Context, ref registry.Reference) (*lazyimage.Image, error) {
	key := ref.String()
	r.mu.Lock()
	c := r.images[key]
	if c == nil {
		c = &resolve{done: make(chan struct{})}
		r.images[key] = c
		go r.run(key, ref, c)
	}
	r.mu.Unlock()
	select {
	case <-c.done:
		return c.img, c.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (r *resolver) run(key string, ref registry.Reference, c *resolve) {
	ctx, cancel := context.WithTimeout(r.life, resolveTimeout)
	defer cancel()
	c.img, c.err = lazyimage.Resolve(ctx, r.opts, ref)
	r.mu.Lock()
	defer r.mu.Unlock()
	if c.err != nil {
		delete(r.images, key)
	} else {
		r.order = append(r.order, key)
		for len(r.order) > maxImages {
			delete(r.images, r.order[0])
			r.order = r.order[1:]
		}
	}
	close(c.done)
}
