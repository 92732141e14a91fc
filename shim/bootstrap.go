package shim

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"time"

	versionapi "github.com/containerd/containerd/api/services/version/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/emptypb"
)

// bootstrapParams is the JSON a shim's `start` may print instead of a
// plain address (containerd's core/runtime/v2 parseStartResponse): the
// Task API version containerd is to speak, the address and the protocol.
type bootstrapParams struct {
	Version  int    `json:"version"`
	Address  string `json:"address"`
	Protocol string `json:"protocol"`
}

// startResponse is what `start` prints for the containerd at
// containerdAddress to reach the shim at addr. containerd 1.6, 1.7 and
// 2.x all read a plain address and then speak Task API v2; 2.x speaks v3
// to a shim whose JSON says version 3, which 1.6 and 1.7 refuse
// ("unsupported shim version (3)"). containerd tells a shim nothing of its
// own version, so start asks its Version service, and prints the plain
// address when that fails: every containerd accepts it, and start has
// nowhere to say why (containerd reads its stderr as the response too).
func startResponse(ctx context.Context, containerdAddress, addr string) string {
	major, err := containerdMajor(ctx, containerdAddress)
	if err != nil || major < 2 {
		return addr
	}
	b, err := json.Marshal(bootstrapParams{Version: 3, Address: addr, Protocol: "ttrpc"})
	if err != nil {
		return addr
	}
	return string(b)
}

// releaseMajor finds the major release in containerd's Version ("2.2.9",
// "v1.7.35", Debian's "1.6.20~ds1").
var releaseMajor = regexp.MustCompile(`^v?(\d+)\.\d+`)

// containerdMajor asks the containerd at address (its gRPC socket, as
// containerd passes -address) for its major release.
func containerdMajor(ctx context.Context, address string) (int, error) {
	if address == "" {
		return 0, fmt.Errorf("no -address: cannot ask containerd its version")
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return 0, fmt.Errorf("containerd at %s: %w", address, err)
	}
	defer conn.Close()
	v, err := versionapi.NewVersionClient(conn).Version(ctx, &emptypb.Empty{})
	if err != nil {
		return 0, fmt.Errorf("containerd at %s: version: %w", address, err)
	}
	m := releaseMajor.FindStringSubmatch(v.Version)
	if m == nil {
		return 0, fmt.Errorf("containerd at %s: version %q has no major.minor", address, v.Version)
	}
	return strconv.Atoi(m[1])
}
