package sandbox

import (
	"errors"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kata-fsx/kata-fsx/virtiofs"
)

// fakeSharer records what guestMounts asks to share (a mock of the
// virtio-fs share, whose binds TestShareVolume checks on the host).
type fakeSharer struct {
	shared   []string
	opts     []virtiofs.VolumeOptions
	emptyDir map[string]uint32
	// below: sources with mounts below them.
	below map[string]bool
	fail  error
}

func (f *fakeSharer) shareBind(m specs.Mount, o virtiofs.VolumeOptions) (string, bool, error) {
	if f.fail != nil {
		return "", false, f.fail
	}
	f.shared = append(f.shared, m.Source)
	f.opts = append(f.opts, o)
	writableBelow := f.below[m.Source] && o.ReadOnly && !o.RecursiveReadOnly && o.Recursive
	return virtiofs.GuestSharedMount + "c-0011-" + m.Destination[1:], writableBelow, nil
}

func (f *fakeSharer) memoryEmptyDir(src string) (uint32, bool) {
	gid, ok := f.emptyDir[src]
	return gid, ok
}

func TestGuestMounts(t *testing.T) {
	const emptyDir = "/var/lib/kubelet/pods/p/volumes/kubernetes.io~empty-dir/cache"
	in := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/sys/fs/cgroup", Type: "cgroup"},
		{Destination: "/hosts", Type: "bind", Source: "/host/hosts", Options: []string{"rbind", "rw"}},
		{Destination: "/dev/shm", Type: "bind", Source: "/host/shm", Options: []string{"rbind"}},
		{Destination: "/ro", Type: "none", Source: "/host/ro", Options: []string{"bind", "ro"}},
		{Destination: "/cache", Type: "bind", Source: emptyDir, Options: []string{"rbind"}},
	}
	sh := &fakeSharer{emptyDir: map[string]uint32{emptyDir: 2000}}
	out, storages, err := guestMounts(in, sh)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range out {
		got = append(got, m.Destination+"="+m.Type+":"+m.Source+":"+strings.Join(m.Options, ","))
	}
	// In the spec's order; every host bind shared, none dropped.
	want := []string{
		"/proc=proc:proc:",
		"/hosts=bind:" + virtiofs.GuestSharedMount + "c-0011-hosts:rbind,rw",
		"/dev/shm=bind:" + guestSandboxShm + ":rbind",
		"/ro=bind:" + virtiofs.GuestSharedMount + "c-0011-ro:bind,ro",
		"/cache=bind:" + guestEphemeral + "/cache:rbind",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("guest mounts:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if strings.Join(sh.shared, " ") != "/host/hosts /host/ro" {
		t.Errorf("shared %q", sh.shared)
	}
	if sh.opts[0] != (virtiofs.VolumeOptions{Recursive: true}) || sh.opts[1] != (virtiofs.VolumeOptions{ReadOnly: true}) {
		t.Errorf("share options %+v, want rbind rw then bind ro", sh.opts)
	}
	if len(storages) != 1 || storages[0].Driver != "ephemeral" || storages[0].MountPoint != guestEphemeral+"/cache" ||
		strings.Join(storages[0].Options, ",") != "fsgid=2000" {
		t.Errorf("storages %v, want the emptyDir's ephemeral tmpfs with its group", storages)
	}
}

// TestGuestMountsReadOnlyBelow: a read-only volume with host mounts below
// it keeps those writable (ro) or closes them too (rro); for ro the
// guest's bind stays read-write, the host holding the top read-only.
func TestGuestMountsReadOnlyBelow(t *testing.T) {
	in := []specs.Mount{
		{Destination: "/ro", Type: "bind", Source: "/host/tree", Options: []string{"rbind", "ro", "rprivate"}},
		{Destination: "/rro", Type: "bind", Source: "/host/tree", Options: []string{"rbind", "rro", "rprivate"}},
		{Destination: "/flat", Type: "bind", Source: "/host/flat", Options: []string{"rbind", "ro"}},
	}
	sh := &fakeSharer{below: map[string]bool{"/host/tree": true}}
	out, _, err := guestMounts(in, sh)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range out {
		got = append(got, m.Destination+":"+strings.Join(m.Options, ","))
	}
	want := []string{"/ro:rbind,rw,rprivate", "/rro:rbind,rro,rprivate", "/flat:rbind,ro"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("guest mounts %q, want %q", got, want)
	}
	wantOpts := []virtiofs.VolumeOptions{
		{Recursive: true, ReadOnly: true},
		{Recursive: true, ReadOnly: true, RecursiveReadOnly: true},
		{Recursive: true, ReadOnly: true},
	}
	for i, o := range sh.opts {
		if o != wantOpts[i] {
			t.Errorf("%s: share options %+v, want %+v", in[i].Destination, o, wantOpts[i])
		}
	}
}

func TestGuestMountsRefused(t *testing.T) {
	for _, c := range []struct {
		m    specs.Mount
		fail error
		want string
	}{
		{specs.Mount{Destination: "/x", Type: "nosuchfs", Source: "none"}, nil, `mount /x (type nosuchfs, source none): type "nosuchfs" cannot be mounted`},
		{specs.Mount{Destination: "/x", Source: "/a"}, nil, `mount /x (no type, source /a): type "" cannot be mounted`},
		{specs.Mount{Destination: "x", Type: "bind", Source: "/a"}, nil, "the destination must be an absolute path"},
		{specs.Mount{Destination: "/x", Type: "bind", Source: "a", Options: []string{"rbind"}}, nil, "a bind needs an absolute host path"},
		{specs.Mount{Destination: "/x", Type: "bind", Source: "/dev/null", Options: []string{"rbind"}}, errors.New("source /dev/null is a character device"), "mount /x (type bind, source /dev/null): source /dev/null is a character device"},
	} {
		_, _, err := guestMounts([]specs.Mount{c.m}, &fakeSharer{fail: c.fail})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: error %v, want %q", c.m, err, c.want)
		}
	}
}
