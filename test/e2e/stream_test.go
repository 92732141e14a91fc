package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

const streamBytes = 100 << 20

// patternReader yields n deterministic, incompressible-looking bytes
// (xorshift64) and hashes what it hands out.
type patternReader struct {
	left  int64
	state uint64
	sum   hash.Hash
}

func newPatternReader(n int64) *patternReader {
	return &patternReader{left: n, state: 0x9e3779b97f4a7c15, sum: sha256.New()}
}

func (r *patternReader) Read(p []byte) (int, error) {
	if r.left == 0 {
		return 0, io.EOF
	}
	p = p[:min(int64(len(p)), r.left)&^7]
	if len(p) == 0 { // n is a multiple of 8 in these tests; a tiny p is not
		return 0, io.ErrShortBuffer
	}
	for i := 0; i < len(p); i += 8 {
		r.state ^= r.state << 13
		r.state ^= r.state >> 7
		r.state ^= r.state << 17
		for j := 0; j < 8; j++ {
			p[i+j] = byte(r.state >> (8 * j))
		}
	}
	r.left -= int64(len(p))
	r.sum.Write(p)
	return len(p), nil
}

// slowWriter hashes what it gets and stalls the writer: a short sleep on
// every write and a long one every stallEvery bytes, so that every buffer
// between the guest process and here fills and the flow control of the
// agent channel has to hold the guest back.
type slowWriter struct {
	n          atomic.Int64
	sum        hash.Hash
	next       int64
	stallEvery int64
}

func (w *slowWriter) Write(p []byte) (int, error) {
	w.sum.Write(p)
	n := w.n.Add(int64(len(p)))
	time.Sleep(time.Millisecond)
	if n >= w.next {
		w.next += w.stallEvery
		time.Sleep(time.Second)
	}
	return len(p), nil
}

// TestShimExecStream100MiB sends 100 MiB through an exec's stdin into
// cat and reads them back from its stdout through a slow reader, over the
// agent transport the default configuration picks (hybrid vsock on a host
// without /dev/vhost-vsock): the bytes must arrive intact and in order.
func TestShimExecStream100MiB(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	const id = "stream"
	ce.startLongRunning(ctx, t, id, "imagefs-blk")
	in := newPatternReader(streamBytes)
	out := &slowWriter{sum: sha256.New(), stallEvery: 16 << 20}
	out.next = out.stallEvery
	cmd := exec.CommandContext(ctx, containerdBin("ctr"), "-a", ce.sock, "-n", "test", "tasks", "exec", "--exec-id", "cat", id, "/bin/cat")
	cmd.Stdin, cmd.Stdout = in, out
	var stderr strings.Builder
	cmd.Stderr = &stderr
	began := time.Now()
	if err := cmd.Run(); err != nil {
		t.Fatalf("ctr task exec cat: %v after %d of %d bytes\n%s", err, out.n.Load(), streamBytes, stderr.String())
	}
	took := time.Since(began)
	if got := out.n.Load(); got != streamBytes {
		t.Fatalf("cat returned %d bytes, sent %d", got, streamBytes)
	}
	if a, b := hex.EncodeToString(in.sum.Sum(nil)), hex.EncodeToString(out.sum.Sum(nil)); a != b {
		t.Fatalf("stdout sha256 %s, stdin sha256 %s: the stream was corrupted", b, a)
	}
	t.Logf("100 MiB through exec stdin and stdout intact in %v (%.1f MiB/s, with %d s of deliberate stalls)",
		took.Round(time.Millisecond), float64(streamBytes>>20)/took.Seconds(), streamBytes/out.stallEvery)
	ce.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id)
	ce.waitTaskStatus(ctx, id, "STOPPED")
	ce.ctr(ctx, "tasks", "delete", id)
	ce.ctr(ctx, "containers", "delete", id)
}

// TestShimAgentKilledMidStream kills the guest agent while an exec streams
// through it: the exec must fail, the task must stop, and the shim must
// say what happened, all within a bound, never hanging. The container
// shares the agent's PID namespace (its spec has none of its own), so a
// process in it can signal the agent, PID 1 of the guest.
func TestShimAgentKilledMidStream(t *testing.T) {
	ce := newContainerdEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const id = "agentkill"
	spec := ce.specWithoutPIDNamespace(ctx, t, []string{"/bin/sleep", "600"}, map[string]string{"io.katacontainers.config.hypervisor.shared_fs": "imagefs-blk"})
	if r := ce.ctr(ctx, ce.runArgs("-d", "--config", spec, id)...); r.code != 0 {
		t.Fatalf("ctr run -d: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if st := ce.waitTaskStatus(ctx, id, "RUNNING"); st != "RUNNING" {
		t.Fatalf("task %s is %q, want RUNNING", id, st)
	}
	if r := ce.ctr(ctx, "tasks", "exec", "--exec-id", "who", id, "/bin/cat", "/proc/1/comm"); r.code != 0 || strings.TrimSpace(r.stdout) != "init" {
		t.Fatalf("PID 1 seen from the container: exit %d %q %q, want the agent (init)", r.code, r.stdout, r.stderr)
	}
	out := &slowWriter{sum: sha256.New(), stallEvery: 8 << 20}
	out.next = out.stallEvery
	streamCtx, streamCancel := context.WithTimeout(ctx, 4*time.Minute)
	defer streamCancel()
	cmd := exec.CommandContext(streamCtx, containerdBin("ctr"), "-a", ce.sock, "-n", "test", "tasks", "exec", "--exec-id", "cat", id, "/bin/cat")
	cmd.Stdin, cmd.Stdout = newPatternReader(streamBytes), out
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	for out.n.Load() < 4<<20 {
		select {
		case err := <-done:
			t.Fatalf("the stream ended before the agent was killed: %v after %d bytes\n%s", err, out.n.Load(), stderr.String())
		case <-time.After(100 * time.Millisecond):
		}
	}
	killedAt := out.n.Load()
	kill := ce.ctr(ctx, "tasks", "exec", "--exec-id", "kill", id, "/bin/sh", "-c", "kill -TERM 1")
	t.Logf("kill -TERM 1 in the guest after %d MiB: exit %d %q %q", killedAt>>20, kill.code, kill.stdout, kill.stderr)
	var err error
	select {
	case err = <-done:
	case <-streamCtx.Done():
		t.Fatalf("the exec still streams 4 min after the agent was killed (%d bytes out): a hang", out.n.Load())
	}
	if err == nil {
		t.Fatalf("the exec succeeded though the agent was killed after %d of %d bytes", killedAt, streamBytes)
	}
	if out.n.Load() >= streamBytes {
		t.Fatalf("all %d bytes arrived though the agent was killed after %d", streamBytes, killedAt)
	}
	t.Logf("exec after the kill: %v; stderr %q", err, stderr.String())
	if st := ce.waitTaskStatus(ctx, id, "STOPPED"); st != "STOPPED" {
		t.Fatalf("task %s is %q after its agent was killed, want STOPPED", id, st)
	}
	// The shim reports the task's exit as soon as it sees it and logs the
	// VM's death when its watcher has read the console: wait a little.
	seen := testenv.Wait(15*time.Second, func() (bool, error) {
		return strings.Contains(ce.logTail(1<<22), "guest kernel panic: Attempted to kill init"), nil
	}) == nil
	if !seen {
		t.Errorf("the shim's log does not show why the pod died (the guest console's panic)")
	}
	r := ce.ctr(ctx, "tasks", "delete", id)
	if r.code != 0 {
		t.Fatalf("ctr task delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r := ce.ctr(ctx, "containers", "delete", id); r.code != 0 {
		t.Fatalf("ctr container delete: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// specWithoutPIDNamespace writes ctr's default OCI spec for args, with the
// PID namespace removed and the busybox rootfs as its root.path, for `ctr
// run --config` (which takes no image).
func (ce *containerdEnv) specWithoutPIDNamespace(ctx context.Context, t *testing.T, args []string, annotations map[string]string) string {
	t.Helper()
	r := ce.ctr(ctx, "oci", "spec")
	if r.code != 0 {
		t.Fatalf("ctr oci spec: exit %d %s", r.code, r.stderr)
	}
	var spec map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &spec); err != nil {
		t.Fatalf("ctr oci spec: %v", err)
	}
	proc, _ := spec["process"].(map[string]any)
	linux, _ := spec["linux"].(map[string]any)
	nss, _ := linux["namespaces"].([]any)
	if proc == nil || nss == nil {
		t.Fatalf("ctr oci spec has no process or linux.namespaces:\n%s", r.stdout)
	}
	proc["args"] = args
	spec["root"] = map[string]any{"path": busyboxRootfs(t)}
	spec["annotations"] = annotations
	var kept []any
	for _, ns := range nss {
		if m, _ := ns.(map[string]any); m["type"] != "pid" {
			kept = append(kept, ns)
		}
	}
	if len(kept) == len(nss) {
		t.Fatalf("ctr oci spec has no pid namespace to remove: %v", nss)
	}
	linux["namespaces"] = kept
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(ce.dir, fmt.Sprintf("spec-%d.json", time.Now().UnixNano()))
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}
