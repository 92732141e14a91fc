package qmp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"regexp"
	"syscall"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// startQEMU runs a real QEMU with no machine and returns a negotiated client.
func startQEMU(t *testing.T) (*Client, *exec.Cmd) {
	t.Helper()
	qemu := testenv.Tool(t, "qemu-system-x86_64", "qemu-system-x86")
	sock := filepath.Join(t.TempDir(), "qmp.sock")
	cmd := exec.Command(qemu, "-machine", "none", "-nodefaults", "-nographic", "-S", "-qmp", "unix:"+sock+",server=on,wait=off")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		c, err := dial(ctx, sock)
		if err == nil {
			t.Cleanup(func() { c.Close() })
			return c, cmd
		}
		if !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatal(err)
		}
		select {
		case <-exited:
			t.Fatal("QEMU exited before QMP was up")
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-tick.C:
		}
	}
}

func TestRealQEMU(t *testing.T) {
	c, cmd := startQEMU(t)
	ctx := context.Background()

	out, err := exec.Command(cmd.Path, "-version").Output()
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`version ` + regexp.QuoteMeta(c.Version().String()) + `\b`).Match(out) {
		t.Errorf("greeting version %s not in %q", c.Version(), out)
	}

	st, err := c.QueryStatus(ctx)
	if err != nil || st.Status != "prelaunch" || st.Running {
		t.Errorf("status %+v %v", st, err)
	}

	// query-qmp-schema is far larger than a 64 KiB scanner line.
	var schema []json.RawMessage
	if err := c.Execute(ctx, "query-qmp-schema", nil, &schema); err != nil {
		t.Fatal(err)
	}
	size := 0
	for _, s := range schema {
		size += len(s)
	}
	if size <= 64<<10 {
		t.Errorf("schema only %d bytes: large-line path not exercised", size)
	}

	var qe *Error
	if err := c.Execute(ctx, "no-such-command", nil, nil); !errors.As(err, &qe) || qe.Class != "CommandNotFound" {
		t.Errorf("unknown command: %#v", err)
	}
	if err := c.ChardevRemove(ctx, "missing"); !errors.As(err, &qe) || qe.Desc == "" {
		t.Errorf("chardev-remove missing: %#v", err)
	}

	// Concurrent commands are matched to their own replies.
	errs := make(chan error, 16)
	for i := 0; i < 16; i++ {
		go func() {
			var s Status
			errs <- c.Execute(ctx, "query-status", nil, &s)
		}()
	}
	for i := 0; i < 16; i++ {
		if err := recvWithin(t, errs, fmt.Sprintf("concurrent query-status: %d of 16 replies", i)); err != nil {
			t.Error(err)
		}
	}

	shutdown := c.Subscribe("SHUTDOWN", nil)
	if err := c.Quit(ctx); err != nil {
		t.Fatal(err)
	}
	if ev, err := shutdown.Wait(ctx); err != nil || ev.Name != "SHUTDOWN" {
		t.Errorf("SHUTDOWN: %+v %v", ev, err)
	}
	recvWithin(t, c.Done(), "the client did not close after quit")
	if !errors.Is(c.Err(), ErrClosed) {
		t.Errorf("Err() = %v", c.Err())
	}
}

// dial connects to the QMP unix socket at path and negotiates capabilities.
func dial(ctx context.Context, path string) (*Client, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("qmp: dial %s: %w", path, err)
	}
	c, err := NewClient(ctx, conn, Options{})
	if err != nil {
		conn.Close()
		return nil, err
	}
	return c, nil
}
