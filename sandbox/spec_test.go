package sandbox

import (
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func TestProcessSpec(t *testing.T) {
	if _, err := NewProcessSpec(&specs.Process{}); err == nil {
		t.Fatal("a process without args was accepted")
	}
	ps, err := NewProcessSpec(&specs.Process{Args: []string{"ls", "-l"}, Env: []string{"A=1"}})
	if err != nil {
		t.Fatal(err)
	}
	p := ps.p
	if p.Cwd != "/" || len(p.Args) != 2 || p.Env[0] != "A=1" {
		t.Fatalf("process %+v", p)
	}
}

func TestSharesPodPID(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec *specs.Spec
		want bool
	}{
		{"no spec", nil, false},
		{"no linux section", &specs.Spec{}, false},
		{"host PID namespace (none listed)", &specs.Spec{Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.MountNamespace}}}}, false},
		{"a PID namespace of its own", &specs.Spec{Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}}}}, false},
		{"the pod's PID namespace", &specs.Spec{Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.NetworkNamespace, Path: "/var/run/netns/x"}, {Type: specs.PIDNamespace, Path: "/proc/42/ns/pid"}}}}, true},
	} {
		if got := sharesPodPID(tc.spec); got != tc.want {
			t.Errorf("%s: sharesPodPID %v, want %v", tc.name, got, tc.want)
		}
	}
}
