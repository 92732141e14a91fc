package cli

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// lockedBuffer is an io.Writer safe for the command's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestSnapshotterCommand: kata-fsx snapshotter serves on its socket,
// refuses a second instance on it, and on its signal (ctx) stops with
// status 0 and removes the socket; a bad key is refused by name.
func TestSnapshotterCommand(t *testing.T) {
	testenv.Root(t, "the overlay snapshotter makes root-owned directories")
	dir := t.TempDir()
	sock := filepath.Join(dir, "s.sock")
	cfg := filepath.Join(dir, "configuration.toml")
	if err := os.WriteFile(cfg, []byte("[hypervisor.qemu]\n[kata_fsx.imagefs_blk]\nstate_dir = \""+filepath.Join(dir, "state")+"\"\n[kata_fsx.snapshotter]\naddress = \""+sock+"\"\nroot = \""+filepath.Join(dir, "root")+"\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr lockedBuffer
	done := make(chan int, 1)
	go func() { done <- Main(ctx, []string{"snapshotter", "--config", cfg}, &lockedBuffer{}, &stderr) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		select {
		case rc := <-done:
			t.Fatalf("exited with status %d before serving: %s", rc, stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no socket: %s", stderr.String())
		}
	}
	var second lockedBuffer
	if rc := Main(context.Background(), []string{"snapshotter", "--config", cfg, "--root", filepath.Join(dir, "root2")}, &lockedBuffer{}, &second); rc != 1 || !strings.Contains(second.String(), "another snapshotter serves it") {
		t.Fatalf("second snapshotter on the socket: status %d, %s", rc, second.String())
	}
	cancel()
	if rc := <-done; rc != 0 {
		t.Fatalf("status %d after the signal: %s", rc, stderr.String())
	}
	if _, err := os.Stat(sock); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("socket after exit: %v, want it removed", err)
	}
	if !strings.Contains(stderr.String(), "serving "+sock) {
		t.Errorf("no start line: %s", stderr.String())
	}

	if err := os.WriteFile(cfg, []byte("[hypervisor.qemu]\n[kata_fsx.snapshotter]\naddress = \"relative.sock\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var bad lockedBuffer
	if rc := Main(context.Background(), []string{"snapshotter", "--config", cfg}, &lockedBuffer{}, &bad); rc != 1 || !strings.Contains(bad.String(), "kata_fsx.snapshotter.address") {
		t.Fatalf("relative address: status %d, %s", rc, bad.String())
	}
}
