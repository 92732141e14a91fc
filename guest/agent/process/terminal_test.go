package process

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/guest/agent/pty"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// startOnHostTerminal starts a shell script on a new pty of the host's
// /dev/pts the way ExecProcess does in a container (without joining one).
func startOnHostTerminal(t *testing.T, script string, size *pty.Size) *Process {
	t.Helper()
	testenv.Root(t, "a new pty's slave is opened through its master")
	sh := testenv.Tool(t, "sh", "dash")
	testenv.Tool(t, "stty", "coreutils")
	p := New("tty")
	cmd := exec.Command(sh, "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{}
	err := p.startTerminal(cmd, func() (*os.File, error) {
		master, slave, err := pty.ForExec(cmd, size, 0)
		if err != nil {
			return nil, err
		}
		err = cmd.Start()
		slave.Close()
		if err != nil {
			master.Close()
			return nil, err
		}
		return master, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
	})
	return p
}

// readUntil reads b until what it read contains want.
func readUntil(t *testing.T, b *outputBuffer, want string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	var got []byte
	for !strings.Contains(string(got), want) {
		data, err := b.read(ctx, 4096)
		if err != nil || len(data) == 0 {
			t.Fatalf("waiting for %q: read %q, then %v (end: %v)", want, got, err, len(data) == 0)
		}
		got = append(got, data...)
	}
	return string(got)
}

// TestTerminalProcess: a process started on a pty sees a terminal of the
// size asked for, sees it resized, reads what is written to its stdin, and
// its output (echo included, with the terminal's CR LF) is its stdout.
func TestTerminalProcess(t *testing.T) {
	p := startOnHostTerminal(t, `stty size; [ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo is-a-tty; read line; stty size; echo "got $line"; exit 3`, &pty.Size{Rows: 24, Cols: 80})
	out := readUntil(t, p.stdout, "is-a-tty\r\n")
	if !strings.HasPrefix(out, "24 80\r\n") {
		t.Fatalf("initial size: %q, want 24 80", out)
	}
	if err := p.resizeTerminal(50, 132); err != nil {
		t.Fatal(err)
	}
	if _, err := p.stdin.Load().Write([]byte("hello\n")); err != nil {
		t.Fatal(err)
	}
	out = readBuffer(t, p.stdout)
	within(t, p.done, "not reaped")
	if want := "hello\r\n50 132\r\ngot hello\r\n"; out != want {
		t.Errorf("after the resize: %q, want %q", out, want)
	}
	if p.status != 3 {
		t.Errorf("status %d, want 3", p.status)
	}
	if errOut := readBuffer(t, p.stderr); errOut != "" {
		t.Errorf("a terminal process has one output stream; stderr got %q", errOut)
	}
	if err := p.resizeTerminal(10, 10); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("resize after exit: %v, want FailedPrecondition", err)
	}
	if p.stdin.Load() != nil {
		t.Error("terminal input still open after exit")
	}
}

// TestTerminalEndOfInput: CloseStdin on a terminal types its end-of-file
// character, which ends a reader's input without hanging the terminal up:
// the process still writes after it.
func TestTerminalEndOfInput(t *testing.T) {
	p := startOnHostTerminal(t, `echo ready; cat; echo "cat ended"`, nil)
	readUntil(t, p.stdout, "ready\r\n")
	if _, err := p.stdin.Load().Write([]byte("line\n")); err != nil {
		t.Fatal(err)
	}
	readUntil(t, p.stdout, "line\r\nline\r\n") // the echo, then cat
	if err := p.endTerminalInput(); err != nil {
		t.Fatal(err)
	}
	out := readBuffer(t, p.stdout)
	within(t, p.done, "cat did not end at the end-of-file character")
	if !strings.HasSuffix(out, "cat ended\r\n") || p.status != 0 {
		t.Errorf("after end of input: %q status %d", out, p.status)
	}
	if f := p.stdin.Load(); f != nil {
		t.Error("terminal input still open after its end")
	}
}

// TestTerminalRefusals: a size beyond a winsize is refused, in the spec and
// in a resize, and a process without a terminal cannot be resized.
func TestTerminalRefusals(t *testing.T) {
	if _, err := pty.SizeOf(&pb.Process{Terminal: true, ConsoleSize: &pb.Box{Height: 70000, Width: 80}}); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "70000x80") {
		t.Errorf("out-of-range console size: %v", err)
	}
	if s, err := pty.SizeOf(&pb.Process{Terminal: false, ConsoleSize: &pb.Box{Height: 70000, Width: 80}}); s != nil || err != nil {
		t.Errorf("console size without a terminal: %v %v, want it ignored", s, err)
	}
	if s, err := pty.SizeOf(&pb.Process{Terminal: true, ConsoleSize: &pb.Box{Height: 24, Width: 80}}); err != nil || *s != (pty.Size{Rows: 24, Cols: 80}) {
		t.Errorf("24x80: %v %v", s, err)
	}
	sh := testenv.Tool(t, "sh", "dash")
	p := New("pipes")
	cmd := exec.Command(sh, "-c", "sleep 30")
	if err := p.start(cmd, cmd.Start); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); <-p.done }()
	if err := p.resizeTerminal(24, 80); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "no terminal") {
		t.Errorf("resize of a process without a terminal: %v", err)
	}
	if err := p.resizeTerminal(1<<16, 80); status.Code(err) != codes.InvalidArgument {
		t.Errorf("resize out of range: %v", err)
	}
	if err := New("unstarted").resizeTerminal(24, 80); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("resize of an unstarted process: %v", err)
	}
	// The init helper's console socket: an end without a descriptor is an error naming it.
	a, h, err := pty.SocketPair()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	h.Close()
	if _, err := pty.RecvFile(a, "pty master"); err == nil || !strings.Contains(err.Error(), "ended without sending it") {
		t.Errorf("helper gone before the master: %v", err)
	}
}
