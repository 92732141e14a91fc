package initproc

import (
	"testing"

	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
)

func TestProcessPrivileges(t *testing.T) {
	p, err := ProcessPrivileges(&pb.Process{
		User:            &pb.User{UID: 1000, GID: 100, AdditionalGids: []uint32{10}},
		NoNewPrivileges: true,
		Capabilities:    &pb.LinuxCapabilities{Bounding: []string{"CAP_CHOWN", "CAP_KILL"}, Effective: []string{"cap_kill"}},
		Rlimits:         []*pb.POSIXRlimit{{Type: "RLIMIT_NOFILE", Soft: 1024, Hard: 4096}},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if p.UID != 1000 || p.GID != 100 || len(p.Groups) != 1 || !p.NoNewPrivs {
		t.Errorf("user: %+v", p)
	}
	if p.Caps == nil || p.Caps.Bounding != 1<<0|1<<5 || p.Caps.Effective != 1<<5 || p.Caps.Permitted != 0 {
		t.Errorf("caps: %+v", p.Caps)
	}
	if len(p.Rlimits) != 1 || p.Rlimits[0].Resource != 7 || p.Rlimits[0].Soft != 1024 || p.Rlimits[0].Hard != 4096 {
		t.Errorf("rlimits: %+v", p.Rlimits)
	}
	// No capabilities in the spec: the process keeps the agent's.
	if p, _ := ProcessPrivileges(&pb.Process{}, nil); p.Caps != nil {
		t.Errorf("caps without a spec: %+v", p.Caps)
	}
	for _, bad := range []*pb.Process{
		{Capabilities: &pb.LinuxCapabilities{Ambient: []string{"CAP_FLY"}}},
		{Rlimits: []*pb.POSIXRlimit{{Type: "RLIMIT_BOGUS"}}},
		{Rlimits: []*pb.POSIXRlimit{{Type: "RLIMIT_NOFILE", Soft: 2, Hard: 1}}},
	} {
		if _, err := ProcessPrivileges(bad, nil); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}
