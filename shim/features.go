package shim

import (
	"encoding/json"
	"fmt"

	"github.com/opencontainers/runtime-spec/specs-go"
	"github.com/opencontainers/runtime-spec/specs-go/features"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/kata-fsx/kata-fsx/mount"
)

// featuresTypeURL is the type containerd registers for the runtime-spec
// features document it reads from RuntimeInfo (JSON, not protobuf).
const featuresTypeURL = "types.containerd.io/opencontainers/runtime-spec/1/features/Features"

// runtimeFeatures is what the runtime tells containerd's introspection it
// understands. Only mount options are stated: containerd's CRI offers
// recursively read-only volumes only to a runtime that lists rro, and the
// guest agent applies it. Hooks, namespaces and the rest are left unset,
// which the features document reads as "unknown", not "none".
func runtimeFeatures() (*anypb.Any, error) {
	f := features.Features{
		OCIVersionMin: "1.0.0",
		OCIVersionMax: specs.Version,
		MountOptions:  mount.OptionWords(),
	}
	b, err := json.Marshal(&f)
	if err != nil {
		return nil, fmt.Errorf("encode runtime features: %w", err)
	}
	return &anypb.Any{TypeUrl: featuresTypeURL, Value: b}, nil
}
