package rootfs

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/content/layerdir"
)

// snapDirs makes n snapshot directories as the kata-fsx snapshotter lays
// them out (snapshots/N/fs), the ones in remote with a sidecar.
func snapDirs(t *testing.T, n int, remote map[int]layerdir.Remote) []string {
	t.Helper()
	root := t.TempDir()
	var fs []string
	for i := 0; i < n; i++ {
		d := filepath.Join(root, "snapshots", string(rune('1'+i)))
		if err := os.MkdirAll(filepath.Join(d, "fs"), 0o755); err != nil {
			t.Fatal(err)
		}
		if r, ok := remote[i]; ok {
			if err := layerdir.WriteRemote(d, r); err != nil {
				t.Fatal(err)
			}
		}
		fs = append(fs, filepath.Join(d, "fs"))
	}
	return fs
}

func TestParseRemoteRootfs(t *testing.T) {
	l1 := digest.FromString("layer1")
	l2 := digest.FromString("layer2")
	dirs := snapDirs(t, 4, map[int]layerdir.Remote{
		0: {Ref: "reg.test/img@" + digest.FromString("m").String(), Layer: l2},
		1: {Ref: "reg.test/img@" + digest.FromString("m").String(), Layer: l1},
	})
	upper, work := dirs[2], dirs[3]
	lower := dirs[0] + ":" + dirs[1]
	m := config.Mount{Type: layerdir.MountType, Source: "overlay",
		Options: []string{"index=off", "workdir=" + work, "upperdir=" + upper, "lowerdir=" + lower}}

	if _, ok, err := ParseRemote([]config.Mount{{Type: "overlay", Options: m.Options}}); ok || err != nil {
		t.Fatalf("a plain overlay is not remote: ok %v, %v", ok, err)
	}
	r, ok, err := ParseRemote([]config.Mount{m})
	if !ok || err != nil {
		t.Fatalf("remote mount not recognized: %v, %v", ok, err)
	}
	if len(r.lowers) != 2 || r.remotes[0].Layer != l2 || r.remotes[1].Layer != l1 || r.upper != upper {
		t.Fatalf("parsed %+v", r)
	}
	if got := r.TopRef(); !strings.HasPrefix(got, "reg.test/img@sha256:") {
		t.Errorf("topRef %q", got)
	}
	// The policy sees the overlay the mount stands for: indexable layers.
	pm := r.PolicyMounts()
	if pm[0].Type != "overlay" {
		t.Errorf("policy mount type %q, want overlay", pm[0].Type)
	}
	if rf := config.RootfsFromMounts(pm, ""); rf.Kind != config.RootfsOverlay || len(rf.Layers) != 3 {
		t.Errorf("policy rootfs %+v, want an overlay of 2 layers and the upper", rf)
	}

	// Something in the container's own layer already: not the image alone.
	if err := os.WriteFile(filepath.Join(upper, "x"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	root, why, err := r.OpenLazy(context.Background(), &config.Config{}, t.Logf)
	if root != nil || err != nil || !strings.Contains(why, "is not empty") {
		t.Errorf("openLazy with a written upper: %v %q %v; want a reason to materialize", root, why, err)
	}

	// A corrupt sidecar is an error naming the layer, not a silent local layer.
	if err := os.WriteFile(filepath.Join(filepath.Dir(dirs[1]), layerdir.SidecarName), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := ParseRemote([]config.Mount{m}); !ok || err == nil || !strings.Contains(err.Error(), dirs[1]) {
		t.Errorf("corrupt sidecar: ok %v err %v; want an error naming %s", ok, err, dirs[1])
	}
	// A bind view of one remote layer.
	b := config.Mount{Type: layerdir.MountType, Source: dirs[0], Options: []string{"ro", "rbind"}}
	r, ok, err = ParseRemote([]config.Mount{b})
	if !ok || err != nil || len(r.lowers) != 1 || r.PolicyMounts()[0].Type != "bind" {
		t.Errorf("bind view: %+v %v %v", r, ok, err)
	}
}
