package shim

import (
	"bytes"
	"testing"

	apitypes "github.com/containerd/containerd/api/types"
	"google.golang.org/protobuf/proto"
)

// TestInfoFlag: `-info` (containerd 2.x's runtime introspection) writes a
// RuntimeInfo naming the runtime and its version, and nothing else.
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
}
