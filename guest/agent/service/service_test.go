package service

import (
	"context"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/guest/agent/modules"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

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

// TestCreateContainerFailureKeepsSharedStorage: a CreateContainer that
// fails after mounting its storages gives back its uses of them, and a
// storage the sandbox (or another container) also uses stays mounted.
func TestCreateContainerFailureKeepsSharedStorage(t *testing.T) {
	testenv.Root(t, "the agent mounts the storages")
	mods := modules.Start(filepath.Join(t.TempDir(), "none"), func() {})
	<-mods.Done()
	a := New(mods)
	shm := filepath.Join(t.TempDir(), "shm")
	shared := &pb.Storage{Driver: "ephemeral", Source: "shm", Fstype: "tmpfs", MountPoint: shm}
	if _, err := a.CreateSandbox(context.Background(), &pb.CreateSandboxRequest{SandboxId: "sb", Storages: []*pb.Storage{shared}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(shm, unix.MNT_DETACH) })
	_, err := a.CreateContainer(context.Background(), &pb.CreateContainerRequest{
		ContainerId: "c1",
		Storages:    []*pb.Storage{shared},
		OCI: &pb.Spec{
			Root:    &pb.Root{Path: t.TempDir()},
			Process: &pb.Process{Args: []string{"true"}, Capabilities: &pb.LinuxCapabilities{Bounding: []string{"CAP_FLY"}}},
		},
	})
	if err == nil {
		t.Fatal("a process with an unknown capability was accepted")
	}
	var st, parent unix.Stat_t
	if err := unix.Stat(shm, &st); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(filepath.Dir(shm), &parent); err != nil {
		t.Fatal(err)
	}
	if st.Dev == parent.Dev {
		t.Fatal("the failed create unmounted the sandbox's storage")
	}
}
