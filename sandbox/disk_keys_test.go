package sandbox

import (
	"reflect"
	"testing"

	"github.com/kata-fsx/kata-fsx/config"
)

// Only an overlay's committed lowerdirs are vouched for: an upperdir or a
// directory rootfs changes under the pod, and a cached index would serve
// the old tree.
func TestLayerKeysVouchOnlyForLowerdirs(t *testing.T) {
	ov := config.Rootfs{Kind: config.RootfsOverlay, Layers: []string{"/l2", "/l1", "/up"}, UpperDir: "/up"}
	if got, want := layerKeys(ov), []string{"committed-snapshot", "committed-snapshot", ""}; !reflect.DeepEqual(got, want) {
		t.Errorf("overlay keys %q, want %q", got, want)
	}
	if got := layerKeys(config.Rootfs{Kind: config.RootfsDir, Layers: []string{"/rootfs"}}); got != nil {
		t.Errorf("directory rootfs keys %q, want none", got)
	}
}
