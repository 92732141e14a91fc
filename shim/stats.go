package shim

import (
	"fmt"

	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// metricsTypeURL is the name containerd (ctr task metrics, CRI stats)
// resolves cgroup v2 metrics by: the proto name, without a URL prefix, as
// its typeurl registry records it.
const metricsTypeURL = "io.containerd.cgroups.v2.Metrics"

// marshalMetrics packs metrics the way containerd unpacks them.
func marshalMetrics(m *cgroupstats.Metrics) (*anypb.Any, error) {
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("marshal cgroup metrics: %w", err)
	}
	return &anypb.Any{TypeUrl: metricsTypeURL, Value: b}, nil
}
