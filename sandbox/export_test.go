package sandbox

import (
	"context"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
)

// PlanForTest is what New boots for a pod with configuration cfg and a
// directory rootfs, without starting anything: the probe, validation and
// VM configuration New uses.
func PlanForTest(ctx context.Context, cfg *config.Config, id string) (*hypervisor.VMConfig, error) {
	spec := Spec{ID: id, Config: cfg, Rootfs: config.Rootfs{Kind: config.RootfsDir, Layers: []string{"/rootfs"}}}
	d, err := Decide(spec)
	if err != nil {
		return nil, err
	}
	s, err := newSandbox(ctx, id, d)
	if err != nil {
		return nil, err
	}
	_, vmc, err := s.plan(ctx, spec)
	return vmc, err
}
