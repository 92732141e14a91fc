package shim

import (
	"bytes"
	"slices"
	"testing"

	apitypes "github.com/containerd/containerd/api/types"
	_ "github.com/containerd/containerd/v2/core/runtime" // registers the features type, as containerd does
	"github.com/containerd/typeurl/v2"
	"github.com/opencontainers/runtime-spec/specs-go/features"
	"google.golang.org/protobuf/proto"
)

// TestInfoFlag: `-info` (containerd 2.x's runtime introspection) writes a
// RuntimeInfo naming the runtime and its version, with a runtime-spec
// features document containerd can decode that lists rro, so CRI offers
// recursively read-only volumes on kata-fsx's handlers.
func TestInfoFlag(t *testing.T) {
	var out, errb bytes.Buffer
	if code := ShimMain([]string{"-info"}, &out, &errb, ""); code != 0 {
		t.Fatalf("-info: exit %d: %s", code, errb.String())
	}
	var info apitypes.RuntimeInfo
	if err := proto.Unmarshal(out.Bytes(), &info); err != nil {
		t.Fatalf("-info wrote %q, not a RuntimeInfo: %v", out.String(), err)
	}
	if info.Name != RuntimeType || info.Version.GetVersion() != Version {
		t.Fatalf("RuntimeInfo %v, want name %s, version %s", &info, RuntimeType, Version)
	}
	if errb.Len() != 0 {
		t.Errorf("-info wrote to stderr: %s", errb.String())
	}
	if info.Features == nil {
		t.Fatal("RuntimeInfo has no features: containerd's CRI then offers no recursive read-only mounts")
	}
	// As containerd's CRI reads it (introspectRuntimeFeatures).
	v, err := typeurl.UnmarshalAny(info.Features)
	if err != nil {
		t.Fatalf("containerd cannot decode the features (%s): %v", info.Features.GetTypeUrl(), err)
	}
	f, ok := v.(*features.Features)
	if !ok {
		t.Fatalf("features decode as %T, want *features.Features", v)
	}
	if !slices.Contains(f.MountOptions, "rro") {
		t.Errorf("features list mount options %q, without rro", f.MountOptions)
	}
}
