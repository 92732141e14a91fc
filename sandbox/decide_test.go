package sandbox

import (
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/config"
)

func TestDecideReason(t *testing.T) {
	overlay := config.Rootfs{Kind: config.RootfsOverlay, Layers: []string{"/l", "/u"}, UpperDir: "/u"}
	for _, tc := range []struct {
		name              string
		spec              Spec
		backend, inReason string
	}{
		{"policy", Spec{}, config.SharedFSImagefsBlk, "can be indexed"},
		{"flag", Spec{Backend: config.SharedFS9P}, config.SharedFS9P, "requested explicitly (--backend virtio-9p)"},
		{"given reason", Spec{Backend: config.SharedFSImagefsBlk, BackendReason: "annotation x requests a lazy image"}, config.SharedFSImagefsBlk, "annotation x requests a lazy image"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config.Default()
			cfg.KataFSX.SharedFS = config.SharedFSAuto
			tc.spec.Config, tc.spec.Rootfs = cfg, overlay
			d, err := Decide(tc.spec)
			if err != nil {
				t.Fatal(err)
			}
			if d.Backend != tc.backend || !strings.Contains(d.Reason, tc.inReason) {
				t.Errorf("decided %s (%s), want %s with %q", d.Backend, d.Reason, tc.backend, tc.inReason)
			}
			// A decision carried in the spec is taken as it is.
			tc.spec.Decision = &d
			tc.spec.Backend = config.SharedFSVirtioFS
			if again, err := Decide(tc.spec); err != nil || again.Backend != d.Backend || again.Reason != d.Reason {
				t.Errorf("carried decision changed: %+v, %v", again, err)
			}
		})
	}
}
