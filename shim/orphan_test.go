package shim

import (
	"context"
	"testing"
	"time"
)

func TestOrphaned(t *testing.T) {
	s := newService(context.Background(), serviceOptions{})
	start := s.idleSince
	grace := time.Minute
	if s.orphaned(start.Add(grace-time.Second), grace) {
		t.Fatal("orphaned before the grace ran out")
	}
	if !s.orphaned(start.Add(grace), grace) {
		t.Fatal("not orphaned with no container and no Create for the grace")
	}

	end := s.beginCreate()
	if s.orphaned(start.Add(time.Hour), grace) {
		t.Fatal("orphaned while a Create runs")
	}
	end()
	if s.orphaned(time.Now().Add(grace-time.Second), grace) {
		t.Fatal("a Create's end did not restart the grace")
	}

	s.containers["c1"] = &container{id: "c1"}
	if s.orphaned(time.Now().Add(time.Hour), grace) {
		t.Fatal("orphaned while it holds a container")
	}
}

func TestWatchOrphanEndsServer(t *testing.T) {
	s := newService(context.Background(), serviceOptions{group: "p"})
	go s.watchOrphan(60 * time.Millisecond)
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("an idle server with no container did not end")
	}

	busy := newService(context.Background(), serviceOptions{group: "p"})
	busy.containers["c1"] = &container{id: "c1"}
	go busy.watchOrphan(60 * time.Millisecond)
	select {
	case <-busy.Done():
		t.Fatal("a server holding a container ended")
	case <-time.After(500 * time.Millisecond):
	}
	busy.doneOnce.Do(func() { close(busy.done) })
}
