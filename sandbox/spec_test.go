package sandbox

import (
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func TestAgentSpecDropsHostOnlyMounts(t *testing.T) {
	in := &specs.Spec{Process: &specs.Process{Args: []string{"true"}}, Mounts: []specs.Mount{
		{Destination: "/proc", Type: "proc"},
		{Destination: "/sys/fs/cgroup", Type: "cgroup"},
		{Destination: "/sys/fs/cgroup", Type: "cgroup2"},
		{Destination: "/dev/shm", Type: "tmpfs"},
		{Destination: "/data", Type: "bind", Source: "/host/data", Options: []string{"rbind"}},
		{Destination: "/dev/shm", Type: "bind", Source: "/host/shm", Options: []string{"rbind"}},
	}}
	out, err := agentSpec(in, "/root", false)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range out.Mounts {
		got = append(got, m.Destination+"="+m.Source)
	}
	// The pod's /dev/shm bind becomes the sandbox's shm storage; other host
	// binds are not handed to the guest as host paths.
	want := []string{"/proc=", "/dev/shm=", "/dev/shm=" + guestSandboxShm}
	if len(got) != len(want) {
		t.Fatalf("guest mounts %q, want %q", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("guest mounts %q, want %q", got, want)
		}
	}
	if len(in.Mounts) != 6 {
		t.Fatal("agentSpec modified containerd's spec")
	}
}

func TestProcessSpec(t *testing.T) {
	if _, err := ProcessSpec(&specs.Process{}); err == nil {
		t.Fatal("a process without args was accepted")
	}
	p, err := ProcessSpec(&specs.Process{Args: []string{"ls", "-l"}, Env: []string{"A=1"}})
	if err != nil {
		t.Fatal(err)
	}
	if p.Cwd != "/" || len(p.Args) != 2 || p.Env[0] != "A=1" {
		t.Fatalf("process %+v", p)
	}
}
