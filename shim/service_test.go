package shim

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	eventsapi "github.com/containerd/containerd/api/events"
	taskapi "github.com/containerd/containerd/api/runtime/task/v2"
	taskv3 "github.com/containerd/containerd/api/runtime/task/v3"
	evttrpc "github.com/containerd/containerd/api/services/ttrpc/events/v1"
	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	tasktypes "github.com/containerd/containerd/api/types/task"
	"github.com/containerd/ttrpc"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/kata-fsx/kata-fsx/mount"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

func TestPodGroup(t *testing.T) {
	for _, c := range []struct {
		name string
		ann  map[string]string
		want string
	}{
		{"plain ctr run", nil, "c1"},
		{"CRI sandbox", map[string]string{annContainerType: "sandbox", annSandboxID: "c1"}, "c1"},
		{"CRI workload", map[string]string{annContainerType: "container", annSandboxID: "pod1"}, "pod1"},
		{"CRI-O workload", map[string]string{annContainerTypeCRIO: "container", annSandboxIDCRIO: "pod2"}, "pod2"},
		{"workload without sandbox id", map[string]string{annContainerType: "container"}, "c1"},
	} {
		if got := podGroup("c1", c.ann); got != c.want {
			t.Errorf("%s: podGroup = %q, want %q", c.name, got, c.want)
		}
	}
}

func TestSocketPath(t *testing.T) {
	a := socketPath("/run/containerd/containerd.sock", "k8s.io", "pod")
	for _, b := range []string{
		socketPath("/run/containerd/containerd.sock", "default", "pod"),
		socketPath("/tmp/other.sock", "k8s.io", "pod"),
		socketPath("/run/containerd/containerd.sock", "k8s.io", "pod2"),
	} {
		if a == b {
			t.Fatalf("socket paths collide: %s", a)
		}
	}
	if a != socketPath("/run/containerd/containerd.sock", "k8s.io", "pod") {
		t.Fatal("socket path is not stable")
	}
	if !strings.HasPrefix(a, socketDir+"/") || len(a) >= 108 {
		t.Fatalf("socket path %q: want below %s and shorter than sun_path", a, socketDir)
	}
}

func TestParseShimFlags(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	f, err := parseShimFlags([]string{"-namespace", "ns", "-address", "/a.sock", "-publish-binary", "/usr/bin/containerd", "-id", "c1", "-debug", "start"}, &strings.Builder{})
	if err != nil {
		t.Fatal(err)
	}
	if f.action != "start" || f.id != "c1" || f.namespace != "ns" || !f.debug || f.bundle != dir {
		t.Fatalf("parsed %+v", f)
	}
	for _, args := range [][]string{
		{"-namespace", "ns", "start"},                       // no id
		{"-namespace", "ns", "-id", "../x", "start"},        // id escapes directories
		{"-namespace", "ns", "-id", "c1"},                   // no action
		{"-namespace", "ns", "-id", "c1", "start", "x"},     // two actions
		{"-namespace", "ns", "-id", "c1", "-nope", "start"}, // unknown flag
	} {
		if _, err := parseShimFlags(args, &strings.Builder{}); err == nil {
			t.Errorf("%q: accepted", args)
		}
	}
	var out, errb strings.Builder
	if code := ShimMain([]string{"-namespace", "ns", "-id", "c1", "frobnicate"}, &out, &errb, ""); code != 2 || !strings.Contains(errb.String(), "unknown action") {
		t.Fatalf("unknown action: code %d, stderr %q", code, errb.String())
	}
}

func TestConfigPathOption(t *testing.T) {
	if p, err := configPathOption(nil); p != "" || err != nil {
		t.Fatalf("nil options: %q %v", p, err)
	}
	b, err := proto.Marshal(&runtimeoptions.Options{ConfigPath: "/etc/kata-fsx/configuration.toml"})
	if err != nil {
		t.Fatal(err)
	}
	// containerd 1.6 sends the bare proto name as type URL.
	for _, url := range []string{"runtimeoptions.v1.Options", "type.googleapis.com/runtimeoptions.v1.Options"} {
		p, err := configPathOption(&anypb.Any{TypeUrl: url, Value: b})
		if err != nil || p != "/etc/kata-fsx/configuration.toml" {
			t.Fatalf("%s: %q %v", url, p, err)
		}
	}
	if p, err := configPathOption(&anypb.Any{TypeUrl: "containerd.runc.v1.Options", Value: []byte{0x0a, 0x01, 'x'}}); p != "" || err != nil {
		t.Fatalf("runc options: %q %v", p, err)
	}
	if _, err := configPathOption(&anypb.Any{TypeUrl: "runtimeoptions.v1.Options", Value: []byte{0x0a, 0xff}}); err == nil {
		t.Fatal("truncated options accepted")
	}
}

// eventsRecorder stands in for containerd's ttrpc events service.
type eventsRecorder struct {
	mu  sync.Mutex
	got []*evttrpc.ForwardRequest
}

func (r *eventsRecorder) Forward(ctx context.Context, req *evttrpc.ForwardRequest) (*emptypb.Empty, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, req)
	return &emptypb.Empty{}, nil
}

func TestForwarderPublishesInOrder(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "events.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	rec := &eventsRecorder{}
	evttrpc.RegisterEventsService(srv, rec)
	go srv.Serve(context.Background(), ln)
	defer srv.Close()

	f := newForwarder(context.Background(), "ns1", sock)
	f.send(&eventsapi.TaskCreate{ContainerID: "c1"})
	f.send(&eventsapi.TaskStart{ContainerID: "c1"})
	f.send(&eventsapi.TaskExit{ContainerID: "c1", ExitStatus: 3})
	f.send(&eventsapi.TaskDelete{ContainerID: "c1"})
	f.Close()
	f.send(&eventsapi.TaskStart{ContainerID: "late"}) // after Close: dropped, no panic

	want := []struct{ topic, url string }{
		{"/tasks/create", "containerd.events.TaskCreate"},
		{"/tasks/start", "containerd.events.TaskStart"},
		{"/tasks/exit", "containerd.events.TaskExit"},
		{"/tasks/delete", "containerd.events.TaskDelete"},
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.got) != len(want) {
		t.Fatalf("got %d events, want %d", len(rec.got), len(want))
	}
	for i, w := range want {
		e := rec.got[i].Envelope
		if e.Topic != w.topic || e.Namespace != "ns1" || e.Event.TypeUrl != w.url || e.Timestamp == nil {
			t.Errorf("event %d: topic %q ns %q type %q", i, e.Topic, e.Namespace, e.Event.TypeUrl)
		}
	}
	var exit eventsapi.TaskExit
	if err := proto.Unmarshal(rec.got[2].Envelope.Event.Value, &exit); err != nil || exit.ExitStatus != 3 {
		t.Fatalf("exit event: %v %v", &exit, err)
	}
}

func TestForwarderWithoutContainerd(t *testing.T) {
	f := newForwarder(context.Background(), "ns", "")
	for i := 0; i < 2*eventBuffer; i++ { // more than the buffer: never blocks
		f.send(&eventsapi.TaskStart{ContainerID: "c"})
	}
	f.Close()
	f2 := newForwarder(context.Background(), "ns", filepath.Join(t.TempDir(), "nobody.sock"))
	f2.send(&eventsapi.TaskStart{ContainerID: "c"})
	f2.Close() // a containerd that is not there costs a log line, not a hang
}

func TestProcessStateMachine(t *testing.T) {
	p := newProcess("c", "", "c", stdio{})
	if err := p.setRunning(); err != nil {
		t.Fatal(err)
	}
	if err := p.setRunning(); err == nil {
		t.Fatal("started twice")
	}
	if !p.setExited(7) || p.setExited(9) {
		t.Fatal("exit not recorded exactly once")
	}
	<-p.waitBlock
	if st, code, at := p.status(); st != procStopped || code != 7 || at.IsZero() {
		t.Fatalf("state %v code %d at %v", st, code, at)
	}
	if err := p.setRunning(); err == nil {
		t.Fatal("a stopped process started")
	}
}

func newTestService(t *testing.T) *service {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ev := newForwarder(ctx, "ns", "")
	t.Cleanup(ev.Close)
	return newService(ctx, serviceOptions{namespace: "ns", group: "c1", events: ev})
}

func TestServiceRefusals(t *testing.T) {
	s := newTestService(t)
	ctx := context.Background()
	code := func(err error) codes.Code { return status.Code(err) }
	if _, err := s.State(ctx, &taskapi.StateRequest{ID: "nope"}); code(err) != codes.NotFound {
		t.Errorf("State of unknown task: %v", err)
	}
	if _, err := s.Kill(ctx, &taskapi.KillRequest{ID: "nope", Signal: 9}); code(err) != codes.NotFound {
		t.Errorf("Kill of unknown task: %v", err)
	}
	if _, err := s.Create(ctx, &taskapi.CreateTaskRequest{ID: "c1", Bundle: t.TempDir()}); code(err) != codes.InvalidArgument {
		t.Errorf("Create without config.json: %v", err)
	}
	if _, err := s.Exec(ctx, &taskapi.ExecProcessRequest{ID: "c1", ExecID: "e", Spec: &anypb.Any{Value: []byte(`{"args":["true"]}`)}}); code(err) != codes.NotFound {
		t.Errorf("Exec in unknown task: %v", err)
	}
	if _, err := s.Exec(ctx, &taskapi.ExecProcessRequest{ID: "c1", ExecID: "e", Spec: &anypb.Any{Value: []byte(`{`)}}); code(err) != codes.InvalidArgument {
		t.Errorf("Exec with a broken spec: %v", err)
	}
	if _, err := s.ResizePty(ctx, &taskapi.ResizePtyRequest{ID: "nope"}); code(err) != codes.NotFound {
		t.Errorf("ResizePty of unknown task: %v", err)
	}
	if _, err := s.Pause(ctx, &taskapi.PauseRequest{ID: "c1"}); code(err) != codes.NotFound {
		t.Errorf("Pause of unknown task: %v", err)
	}
	if _, err := s.Resume(ctx, &taskapi.ResumeRequest{ID: "c1"}); code(err) != codes.NotFound {
		t.Errorf("Resume of unknown task: %v", err)
	}
	if _, err := s.Update(ctx, &taskapi.UpdateTaskRequest{ID: "c1"}); code(err) != codes.NotFound {
		t.Errorf("Update of unknown task: %v", err)
	}
	if _, err := s.Stats(ctx, &taskapi.StatsRequest{ID: "c1"}); code(err) != codes.NotFound {
		t.Errorf("Stats of unknown task: %v", err)
	}
	select {
	case <-s.Done():
		t.Fatal("done before Shutdown")
	default:
	}
	if _, err := s.Shutdown(ctx, &taskapi.ShutdownRequest{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	<-s.Done()
}

// TestTerminalRequests: a terminal is given when containerd's flag and the
// spec agree and its size fits; anything else is refused before a VM boots.
func TestTerminalRequests(t *testing.T) {
	s := newTestService(t)
	ctx := context.Background()
	bundle := func(process string) string {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"ociVersion":"1.0.2","process":`+process+`,"root":{"path":"rootfs"}}`), 0o600); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	for _, c := range []struct {
		name     string
		terminal bool
		process  string
		want     string
	}{
		{"flag without the spec's terminal", true, `{"args":["sh"],"cwd":"/"}`, "disagree"},
		{"spec's terminal without the flag", false, `{"terminal":true,"args":["sh"],"cwd":"/"}`, "disagree"},
		{"console size out of range", true, `{"terminal":true,"consoleSize":{"height":70000,"width":80},"args":["sh"],"cwd":"/"}`, "70000x80"},
	} {
		_, err := s.Create(ctx, &taskapi.CreateTaskRequest{ID: "c1", Bundle: bundle(c.process), Terminal: c.terminal})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Create, %s: %v, want InvalidArgument naming %q", c.name, err, c.want)
		}
		_, err = s.Exec(ctx, &taskapi.ExecProcessRequest{ID: "c1", ExecID: "e", Spec: &anypb.Any{Value: []byte(c.process)}, Terminal: c.terminal})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Exec, %s: %v, want InvalidArgument naming %q", c.name, err, c.want)
		}
	}
	if len(s.containers) != 0 || s.sandbox != nil {
		t.Fatal("a refused terminal request created something")
	}
	// An agreeing request passes the check and fails only for the missing container.
	_, err := s.Exec(ctx, &taskapi.ExecProcessRequest{ID: "c1", ExecID: "e", Spec: &anypb.Any{Value: []byte(`{"terminal":true,"consoleSize":{"height":24,"width":80},"args":["sh"],"cwd":"/"}`)}, Terminal: true})
	if status.Code(err) != codes.NotFound {
		t.Errorf("Exec with a terminal in an unknown container: %v, want NotFound", err)
	}

	// Resizes of processes that exist only in the shim: none needs the VM.
	s.containers["c1"] = &container{id: "c1", init: newProcess("c1", "", "c1", stdio{stdout: "out", terminal: true}), execs: map[string]*process{
		"piped": newProcess("c1", "piped", "piped.1", stdio{stdout: "out", stderr: "err"}),
	}}
	if _, err := s.ResizePty(ctx, &taskapi.ResizePtyRequest{ID: "c1", ExecID: "piped", Width: 80, Height: 24}); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "no terminal") {
		t.Errorf("resize of an exec without a terminal: %v", err)
	}
	if _, err := s.ResizePty(ctx, &taskapi.ResizePtyRequest{ID: "c1", Width: 80, Height: 1 << 16}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("resize out of range: %v", err)
	}
	// Before the agent started the process, the last size waits for it.
	for _, sz := range [][2]uint32{{24, 80}, {50, 132}} {
		if _, err := s.ResizePty(ctx, &taskapi.ResizePtyRequest{ID: "c1", Height: sz[0], Width: sz[1]}); err != nil {
			t.Fatalf("resize of a created process: %v", err)
		}
	}
	init := s.containers["c1"].init
	if got := init.setStartedInGuest(); got == nil || *got != (terminalSize{Height: 50, Width: 132}) {
		t.Errorf("size kept for the start: %v, want 50x132", got)
	}
	if got := init.setStartedInGuest(); got != nil {
		t.Errorf("the kept size was handed out twice: %v", got)
	}
	init.setExited(0)
	if _, err := s.ResizePty(ctx, &taskapi.ResizePtyRequest{ID: "c1", Height: 24, Width: 80}); status.Code(err) != codes.NotFound {
		t.Errorf("resize of a finished process: %v, want NotFound", err)
	}
}

func TestShutdownWaitsForContainers(t *testing.T) {
	s := newTestService(t)
	s.containers["c1"] = &container{id: "c1", init: newProcess("c1", "", "c1", stdio{}), execs: map[string]*process{}}
	if _, err := s.Shutdown(context.Background(), &taskapi.ShutdownRequest{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Done():
		t.Fatal("Shutdown ended the server while a container remains")
	default:
	}
	// A created, never started task killed then deleted reports 128+signal.
	if _, err := s.Kill(context.Background(), &taskapi.KillRequest{ID: "c1", Signal: 9}); err != nil {
		t.Fatal(err)
	}
	w, err := s.Wait(context.Background(), &taskapi.WaitRequest{ID: "c1"})
	if err != nil || w.ExitStatus != 137 {
		t.Fatalf("wait: %v %v", w, err)
	}
	if _, err := s.Kill(context.Background(), &taskapi.KillRequest{ID: "c1", Signal: 9}); status.Code(err) != codes.NotFound {
		t.Fatalf("kill of a stopped task: %v", err)
	}
}

// TestDeleteCleansUpAfterDeadShim runs the delete command over a sandbox
// directory with a live process and a mount below it, as a killed shim
// leaves them.
func TestDeleteCleansUpAfterDeadShim(t *testing.T) {
	testenv.Root(t, "mounting below a sandbox directory")
	base := t.TempDir()
	bundle := filepath.Join(base, "bundle")
	sbDir := filepath.Join(base, "state", "pod1")
	for _, d := range []string{filepath.Join(bundle, "rootfs"), filepath.Join(sbDir, "shared")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mount("tmpfs", filepath.Join(sbDir, "shared"), "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", filepath.Join(bundle, "rootfs"), "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Unmount(filepath.Join(sbDir, "shared"), unix.MNT_DETACH)
		unix.Unmount(filepath.Join(bundle, "rootfs"), unix.MNT_DETACH)
	})
	// A stand-in for the orphaned QEMU: its command line names the sandbox directory.
	consoleLog := filepath.Join(sbDir, "console.log")
	if err := os.WriteFile(consoleLog, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	orphan := exec.Command("tail", "-f", consoleLog)
	if err := orphan.Start(); err != nil {
		t.Fatal(err)
	}
	reaped := make(chan error, 1)
	go func() { reaped <- orphan.Wait() }()
	if err := writeBundleState(bundle, bundleState{SandboxID: "pod1", SandboxDir: sbDir, OwnsSandbox: true}); err != nil {
		t.Fatal(err)
	}
	var out, errb strings.Builder
	code := ShimMain([]string{"-namespace", "ns", "-address", filepath.Join(base, "nobody.sock"), "-id", "pod1", "-bundle", bundle, "delete"}, &out, &errb, "")
	if code != 0 {
		t.Fatalf("delete: code %d: %s", code, errb.String())
	}
	var resp taskapi.DeleteResponse
	if err := proto.Unmarshal([]byte(out.String()), &resp); err != nil || resp.ExitStatus != 137 || resp.ExitedAt == nil {
		t.Fatalf("delete response %v %v", &resp, err)
	}
	select {
	case <-reaped:
	case <-time.After(10 * time.Second):
		t.Fatal("the orphaned process survived delete")
	}
	if _, err := os.Stat(sbDir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("sandbox directory survived delete: %v", err)
	}
	if m, _ := mount.Under(bundle); len(m) > 0 {
		t.Fatalf("bundle rootfs still mounted: %v", m)
	}
	// A bundle without state (Create never ran) deletes cleanly too.
	empty := t.TempDir()
	out.Reset()
	if code := ShimMain([]string{"-namespace", "ns", "-id", "c2", "-bundle", empty, "delete"}, &out, &errb, ""); code != 0 || out.Len() == 0 {
		t.Fatalf("delete of an empty bundle: code %d out %d bytes", code, out.Len())
	}
}

// TestTaskAPIOverTTRPC serves the service on a unix socket and calls it
// as containerd does, through both the v2 and the v3 Task API clients.
func TestTaskAPIOverTTRPC(t *testing.T) {
	s := newTestService(t)
	sock := filepath.Join(t.TempDir(), "shim.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	taskapi.RegisterTaskService(srv, s)
	registerTaskV3(srv, s)
	go srv.Serve(context.Background(), ln)
	defer srv.Close()
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	client := ttrpc.NewClient(conn)
	defer client.Close()
	ctx := context.Background()

	v2 := taskapi.NewTaskClient(client)
	c, err := v2.Connect(ctx, &taskapi.ConnectRequest{ID: "c1"})
	if err != nil || c.ShimPid != uint32(os.Getpid()) {
		t.Fatalf("v2 Connect: %v %v", c, err)
	}
	if _, err := v2.State(ctx, &taskapi.StateRequest{ID: "nope"}); status.Code(err) != codes.NotFound {
		t.Fatalf("v2 State of an unknown task: %v", err)
	}
	v3 := taskv3.NewTTRPCTaskClient(client)
	c3, err := v3.Connect(ctx, &taskv3.ConnectRequest{ID: "c1"})
	if err != nil || c3.ShimPid != uint32(os.Getpid()) || c3.Version != RuntimeType {
		t.Fatalf("v3 Connect: %v %v", c3, err)
	}
	if _, err := v3.Wait(ctx, &taskv3.WaitRequest{ID: "nope"}); status.Code(err) != codes.NotFound {
		t.Fatalf("v3 Wait of an unknown task: %v", err)
	}
	if _, err := v3.Shutdown(ctx, &taskv3.ShutdownRequest{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	<-s.Done()
}

func TestBundleRootfs(t *testing.T) {
	for _, tc := range []struct {
		name      string
		root      *specs.Root
		hasMounts bool
		want      string
	}{
		{"containerd's mounts", &specs.Root{Path: "/elsewhere"}, true, "/b/rootfs"},
		{"no root", nil, false, "/b/rootfs"},
		{"absolute root", &specs.Root{Path: "/srv/rootfs/../root"}, false, "/srv/root"},
		{"relative root", &specs.Root{Path: "rootfs"}, false, "/b/rootfs"},
		{"relative other", &specs.Root{Path: "fs"}, false, "/b/fs"},
	} {
		if got := bundleRootfs("/b", &specs.Spec{Root: tc.root}, tc.hasMounts); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestPauseUpdateStatsRefusals(t *testing.T) {
	s := newTestService(t)
	ctx := context.Background()
	code := func(err error) codes.Code { return status.Code(err) }
	c := &container{id: "c1", execs: map[string]*process{}, init: newProcess("c1", "", "c1", stdio{})}
	s.containers["c1"] = c
	if _, err := s.Pause(ctx, &taskapi.PauseRequest{ID: "c1"}); code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "created state") {
		t.Errorf("Pause of a created task: %v", err)
	}
	if err := c.init.setRunning(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Resume(ctx, &taskapi.ResumeRequest{ID: "c1"}); code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "running already") {
		t.Errorf("Resume of a running task: %v", err)
	}
	if _, err := s.Pause(ctx, &taskapi.PauseRequest{ID: "c1"}); code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "no sandbox") {
		t.Errorf("Pause without a sandbox: %v", err)
	}
	if _, err := s.Update(ctx, &taskapi.UpdateTaskRequest{ID: "c1"}); code(err) != codes.InvalidArgument {
		t.Errorf("Update without resources: %v", err)
	}
	if _, err := s.Update(ctx, &taskapi.UpdateTaskRequest{ID: "c1", Resources: &anypb.Any{Value: []byte(`{"memory":`)}}); code(err) != codes.InvalidArgument {
		t.Errorf("Update with broken resources: %v", err)
	}
	if _, err := s.Stats(ctx, &taskapi.StatsRequest{ID: "c1"}); code(err) != codes.FailedPrecondition {
		t.Errorf("Stats without a sandbox: %v", err)
	}
	if st, err := s.State(ctx, &taskapi.StateRequest{ID: "c1"}); err != nil || st.Status != tasktypes.Status_RUNNING {
		t.Errorf("State: %v %v", st, err)
	}
	c.paused = true
	if st, err := s.State(ctx, &taskapi.StateRequest{ID: "c1"}); err != nil || st.Status != tasktypes.Status_PAUSED {
		t.Errorf("State of a paused task: %v %v", st, err)
	}
}

// TestExecEventDoesNotHoldThePod: an Exec whose TaskExecAdded waits for
// room in a full event queue (containerd slow or gone) leaves the pod's
// requests answerable meanwhile, the new exec's own included.
func TestExecEventDoesNotHoldThePod(t *testing.T) {
	// A forwarder whose queue has no room and no reader: every send waits.
	ev := &forwarder{namespace: "ns", ch: make(chan proto.Message), done: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s := newService(ctx, serviceOptions{namespace: "ns", group: "c1", events: ev})
	c := &container{id: "c1", init: newProcess("c1", "", "c1", stdio{}), execs: map[string]*process{}}
	if err := c.init.setRunning(); err != nil {
		t.Fatal(err)
	}
	s.containers["c1"] = c
	execDone := make(chan error, 1)
	go func() {
		_, err := s.Exec(ctx, &taskapi.ExecProcessRequest{ID: "c1", ExecID: "e1", Spec: &anypb.Any{Value: []byte(`{"args":["true"],"cwd":"/"}`)}})
		execDone <- err
	}()
	// The bound only turns a hang into a failure.
	bound, stop := context.WithTimeout(ctx, time.Minute)
	defer stop()
	// The exec's State is NotFound until Exec records it, and must then
	// answer while the exec's event waits for the queue.
	for {
		st := make(chan error, 1)
		go func() {
			_, err := s.State(ctx, &taskapi.StateRequest{ID: "c1", ExecID: "e1"})
			st <- err
		}()
		var err error
		select {
		case err = <-st:
		case <-bound.Done():
			t.Fatal("State did not answer while an Exec's event waited for room in the event queue")
		}
		if err == nil {
			break
		}
		if status.Code(err) != codes.NotFound {
			t.Fatalf("State of the exec being added: %v", err)
		}
	}
	select {
	case err := <-execDone:
		t.Fatalf("Exec returned (%v) before its event was taken from a full queue", err)
	default:
	}
	var queued proto.Message
	select {
	case queued = <-ev.ch:
	case <-bound.Done():
		t.Fatal("Exec never queued its event")
	}
	if e, ok := queued.(*eventsapi.TaskExecAdded); !ok || e.ContainerID != "c1" || e.ExecID != "e1" {
		t.Fatalf("queued event %v, want TaskExecAdded of c1/e1", queued)
	}
	if err := <-execDone; err != nil {
		t.Fatal(err)
	}
}
