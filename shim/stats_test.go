package shim

import (
	"testing"

	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	"google.golang.org/protobuf/proto"
)

func TestMarshalMetrics(t *testing.T) {
	a, err := marshalMetrics(&cgroupstats.Metrics{Pids: &cgroupstats.PidsStat{Current: 3, Limit: 100}})
	if err != nil {
		t.Fatal(err)
	}
	// containerd resolves the type by this bare name (typeurl), not by a URL.
	if a.TypeUrl != "io.containerd.cgroups.v2.Metrics" {
		t.Errorf("type url %q", a.TypeUrl)
	}
	var m cgroupstats.Metrics
	if err := proto.Unmarshal(a.Value, &m); err != nil {
		t.Fatal(err)
	}
	if m.Pids.Current != 3 || m.Pids.Limit != 100 {
		t.Errorf("pids %v", m.Pids)
	}
}
