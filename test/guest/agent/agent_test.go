package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func TestParsePCIPath(t *testing.T) {
	good := map[string][]uint8{"02": {2}, "02/01": {2, 1}, "1f/0a/3": {0x1f, 0x0a, 3}}
	for in, want := range good {
		got, err := parsePCIPath(in)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("parsePCIPath(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "/", "02/", "02//01", "zz", "20", "123", "-1", "1/2/3/4/5/6/7/8/9", "0x2"} {
		if got, err := parsePCIPath(in); err == nil {
			t.Errorf("parsePCIPath(%q) = %v, want an error", in, got)
		}
	}
}

func FuzzParsePCIPath(f *testing.F) {
	for _, s := range []string{"02", "02/01", "1f/1f/1f/1f/1f/1f/1f/1f", "", "20", "0/0/"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		slots, err := parsePCIPath(s)
		if err != nil {
			return
		}
		if len(slots) == 0 || len(slots) > 8 {
			t.Fatalf("%q gave %d slots", s, len(slots))
		}
		parts := make([]string, len(slots))
		for i, v := range slots {
			if v > 0x1f {
				t.Fatalf("%q gave slot %#x", s, v)
			}
			parts[i] = fmt.Sprintf("%02x", v)
		}
		again, err := parsePCIPath(strings.Join(parts, "/"))
		if err != nil || !slices.Equal(again, slots) {
			t.Fatalf("round trip of %q: %v, %v", s, again, err)
		}
	})
}

func TestBlockNodeAtWalksBridges(t *testing.T) {
	sys := t.TempDir()
	disk := filepath.Join(sys, "pci0000:00", "0000:00:02.0", "0000:01:01.0", "virtio3", "block", "vdb")
	if err := os.MkdirAll(disk, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(sys, "pci0000:00", "0000:00:01.0", "virtio1", "block", "vda"), 0o755); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{"02/01": "/dev/vdb", "01": "/dev/vda"} {
		slots, err := parsePCIPath(path)
		if err != nil {
			t.Fatal(err)
		}
		got, err := blockNodeAt(sys, slots)
		if err != nil || got != want {
			t.Errorf("blockNodeAt(%s) = %q, %v; want %s", path, got, err, want)
		}
	}
	for _, path := range []string{"03", "02/02", "02"} {
		slots, _ := parsePCIPath(path)
		if got, err := blockNodeAt(sys, slots); err == nil {
			t.Errorf("blockNodeAt(%s) = %q, want an error", path, got)
		}
	}
}

func TestAddDefault(t *testing.T) {
	if got := addDefault("trans=fd", "trans", "virtio"); got != "trans=fd" {
		t.Errorf("addDefault overrode an explicit value: %q", got)
	}
	if got := addDefault("", "version", "9p2000.L"); got != "version=9p2000.L" {
		t.Errorf("addDefault on empty data: %q", got)
	}
	if got := addDefault("cache=mmap", "trans", "virtio"); got != "cache=mmap,trans=virtio" {
		t.Errorf("addDefault appended %q", got)
	}
}

// hangLimit bounds waits that would otherwise block for ever when the code
// under test is wrong; it is a failure message, not a speed assertion.
const hangLimit = 10 * time.Second

// within waits for ch to be closed, failing the test with what if it is
// not within hangLimit.
func within(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(hangLimit):
		t.Fatalf("%s within %v", what, hangLimit)
	}
}

func TestOutputBuffer(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	b := newOutputBuffer()
	go b.fill(r, make(chan struct{}))
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	go func() {
		w.Write([]byte("hello "))
		w.Write([]byte("world"))
		w.Close()
	}()
	var got []byte
	for {
		data, err := b.read(ctx, 4)
		if errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("no data or end of stream within %v after %q", hangLimit, got)
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(data) > 4 {
			t.Fatalf("read returned %d bytes for a 4-byte request", len(data))
		}
		if len(data) == 0 {
			break
		}
		got = append(got, data...)
	}
	if string(got) != "hello world" {
		t.Errorf("got %q", got)
	}
	// After EOF every read is an immediate empty answer.
	if data, err := b.read(ctx, 10); len(data) != 0 || err != nil {
		t.Errorf("read after EOF: %q, %v", data, err)
	}

	idle := newOutputBuffer()
	cctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if _, err := idle.read(cctx, 10); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("read with nothing written: %v, want deadline exceeded", err)
	}
}

func TestOutputBufferBackpressure(t *testing.T) {
	b := newOutputBuffer()
	blocked := make(chan struct{})
	b.waiting = sync.OnceFunc(func() { close(blocked) })
	done := make(chan struct{})
	go func() {
		stop := make(chan struct{})
		b.append(make([]byte, maxBuffered), stop)
		b.append([]byte("x"), stop) // must wait for a reader
		close(done)
	}()
	select {
	case <-blocked:
	case <-done:
		t.Fatal("append went past maxBuffered without a reader")
	case <-time.After(hangLimit):
		t.Fatalf("append neither waited for a reader nor returned within %v", hangLimit)
	}
	// Only a reader (or stop, which nobody closes) releases the wait.
	select {
	case <-done:
		t.Fatal("append went past maxBuffered without a reader")
	default:
	}
	if _, err := b.read(context.Background(), 1<<20); err != nil {
		t.Fatal(err)
	}
	within(t, done, "append did not return after a reader emptied the buffer")
}

// TestOutputBufferCut checks that cutting a stream a descendant holds open
// still delivers what is in the pipe, even past a full buffer.
func TestOutputBufferCut(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close() // the "descendant" keeps the write end open
	b := newOutputBuffer()
	b.append(make([]byte, maxBuffered), nil) // full: the copier will block
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { b.fill(r, stop); close(done) }()
	if _, err := w.Write([]byte("tail")); err != nil {
		t.Fatal(err)
	}
	close(stop)
	if err := r.SetReadDeadline(time.Now()); err != nil {
		t.Fatal(err)
	}
	within(t, done, "fill did not end after the stream was cut")
	var got []byte
	for {
		data, err := b.read(context.Background(), 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		if len(data) == 0 {
			break
		}
		got = append(got, data...)
	}
	if len(got) != maxBuffered+4 || string(got[maxBuffered:]) != "tail" {
		t.Errorf("got %d bytes ending %q, want %d ending \"tail\"", len(got), got[max(0, len(got)-4):], maxBuffered+4)
	}
}

// TestProcessOutputComplete runs real processes through process.start and
// checks that the whole output arrives, and that a descendant holding stdout
// open does not keep the process from being reaped.
func TestProcessOutputComplete(t *testing.T) {
	sh := testenv.Tool(t, "sh", "dash")
	for i := range 20 {
		p := newProcess(fmt.Sprint("p", i))
		cmd := exec.Command(sh, "-c", "i=0; while [ $i -lt 2000 ]; do echo line$i; i=$((i+1)); done; echo err >&2; exit 4")
		if err := p.start(cmd, cmd.Start); err != nil {
			t.Fatal(err)
		}
		out, errOut := readBuffer(t, p.stdout), readBuffer(t, p.stderr)
		within(t, p.done, fmt.Sprintf("run %d: not reaped", i))
		if p.status != 4 || !strings.HasSuffix(out, "line1999\n") || strings.Count(out, "\n") != 2000 || errOut != "err\n" {
			t.Fatalf("run %d: status %d, %d lines ending %q, stderr %q", i, p.status, strings.Count(out, "\n"), out[max(0, len(out)-20):], errOut)
		}
	}
	// The descendant outlives hangLimit, so a stream it keeps open fails
	// the bounded waits below instead of ending when it does.
	p := newProcess("bg")
	cmd := exec.Command(sh, "-c", "echo fg; sleep 30 & exit 0")
	if err := p.start(cmd, cmd.Start); err != nil {
		t.Fatal(err)
	}
	within(t, p.done, "a descendant holding stdout kept the process from being reaped")
	if out := readBuffer(t, p.stdout); out != "fg\n" {
		t.Errorf("with a descendant holding stdout: %q, want fg", out)
	}
	if p.stdin.Load() != nil {
		t.Error("stdin still open after exit")
	}
}

// readBuffer reads b to its end, failing the test if the end does not come
// within hangLimit.
func readBuffer(t *testing.T, b *outputBuffer) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	var got []byte
	for {
		data, err := b.read(ctx, 4096)
		if errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("stream did not end within %v; read %d bytes", hangLimit, len(got))
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(data) == 0 {
			return string(got)
		}
		got = append(got, data...)
	}
}

func TestLookPath(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "tool"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "data"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	env := []string{"PATH=/nonexistent:" + dir}
	if p, err := lookPath("tool", env); err != nil || p != filepath.Join(dir, "tool") {
		t.Errorf("lookPath(tool) = %q, %v", p, err)
	}
	for _, cmd := range []string{"data", "missing", filepath.Join(dir, "missing")} {
		_, err := lookPath(cmd, env)
		if err == nil || !strings.Contains(err.Error(), cmd) {
			t.Errorf("lookPath(%q): want an error naming it, got %v", cmd, err)
		}
	}
	if _, err := lookPath("missing", env); !errors.Is(err, exec.ErrNotFound) {
		t.Errorf("missing command: want exec.ErrNotFound, got %v", err)
	}
}

func TestMkdirNoSymlinks(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	if err := os.Symlink(outside, filepath.Join(root, "escape")); err != nil {
		t.Fatal(err)
	}
	if err := mkdirNoSymlinks(root, filepath.Join(root, "escape", "proc")); err == nil {
		t.Error("created a mount point through a symlink")
	}
	if _, err := os.Stat(filepath.Join(outside, "proc")); err == nil {
		t.Error("directory created outside the rootfs")
	}
	if err := mkdirNoSymlinks(root, filepath.Join(root, "dev", "pts")); err != nil {
		t.Error(err)
	}
	if err := mkdirNoSymlinks(root, filepath.Join(root, "..", "x")); err == nil {
		t.Error("accepted a destination outside the rootfs")
	}
}

func TestMountInRootfsRejectsRelative(t *testing.T) {
	if err := mountInRootfs(t.TempDir(), mountEntry{Destination: "proc", Type: "proc"}); err == nil {
		t.Error("accepted a relative destination")
	}
}

func TestCloneFlagsFollowTheSpecsPIDNamespace(t *testing.T) {
	own := uintptr(unix.CLONE_NEWNS | unix.CLONE_NEWUTS | unix.CLONE_NEWPID)
	shared := uintptr(unix.CLONE_NEWNS | unix.CLONE_NEWUTS)
	for _, tc := range []struct {
		name string
		spec *pb.Spec
		want uintptr
	}{
		{"no linux section", &pb.Spec{}, own},
		{"no namespaces listed", &pb.Spec{Linux: &pb.Linux{}}, own},
		{"pid listed", &pb.Spec{Linux: &pb.Linux{Namespaces: []*pb.LinuxNamespace{{Type: "mount"}, {Type: "pid"}}}}, own},
		{"pid left out", &pb.Spec{Linux: &pb.Linux{Namespaces: []*pb.LinuxNamespace{{Type: "mount"}, {Type: "uts"}}}}, shared},
	} {
		if got := cloneFlags(tc.spec); got != tc.want {
			t.Errorf("%s: flags %#x, want %#x", tc.name, got, tc.want)
		}
	}
}

func TestRootMount(t *testing.T) {
	mi := `22 1 259:1 / / ro,relatime shared:1 - ext4 /dev/pmem0p1 ro,dax=always,errors=remount-ro,data=ordered
23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs devtmpfs rw,size=10k
`
	src, typ, opts, ok := rootMount(mi)
	if !ok || src != "/dev/pmem0p1" || typ != "ext4" || opts != "ro,relatime ro,dax=always,errors=remount-ro,data=ordered" {
		t.Fatalf("got %q %q %q %v", src, typ, opts, ok)
	}
	if _, _, _, ok := rootMount("23 22 0:5 / /dev rw - devtmpfs devtmpfs rw\n"); ok {
		t.Fatal("found a root in a table without one")
	}
}
