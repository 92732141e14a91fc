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
