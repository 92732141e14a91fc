package ext4

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"testing"
	"time"
)

// planDigest hashes everything a plan holds, so a change by emit shows.
func planDigest(p *plan) [32]byte {
	return sha256.Sum256(fmt.Appendf(nil, "%+v|%+v|%+v|%v|%v|%+v", *p.tree, *p.content, *p.layout, p.stored, p.zero, *p.groups))
}

// TestEmitOnlyReadsPlan emits one plan twice: emit must leave the plan as
// it found it and write the same bytes both times.
func TestEmitOnlyReadsPlan(t *testing.T) {
	for _, opts := range []Options{{Time: time.Unix(testTime, 0)}, {BlockSize: 2048, NoJournal: true, WritableSize: -1}} {
		must(t, opts.normalize())
		p, err := makePlan(context.Background(), goldenIndex(1, 0), opts)
		must(t, err)
		before := planDigest(p)
		md1, err := emit(context.Background(), p, t.TempDir())
		must(t, err)
		defer md1.f.Close()
		if planDigest(p) != before {
			t.Fatalf("%+v: emit changed the plan", opts)
		}
		md2, err := emit(context.Background(), p, t.TempDir())
		must(t, err)
		defer md2.f.Close()
		b1, b2 := make([]byte, md1.size), make([]byte, md2.size)
		_, err = md1.f.ReadAt(b1, 0)
		must(t, err)
		_, err = md2.f.ReadAt(b2, 0)
		must(t, err)
		if !bytes.Equal(b1, b2) {
			t.Fatalf("%+v: two emits of one plan differ", opts)
		}
	}
}

// TestPlanCancelled stops Build at each phase boundary it checks.
func TestPlanCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	opts := Options{}
	must(t, opts.normalize())
	if _, err := makePlan(ctx, goldenIndex(1, 0), opts); err == nil || !bytes.Contains([]byte(err.Error()), []byte("context canceled")) {
		t.Errorf("makePlan with a cancelled context: %v", err)
	}
	p, err := makePlan(context.Background(), goldenIndex(1, 0), opts)
	must(t, err)
	if _, err := emit(ctx, p, t.TempDir()); err == nil {
		t.Error("emit with a cancelled context succeeded")
	}
}
