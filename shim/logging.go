package shim

import (
	"context"

	"github.com/containerd/log"
)

func logWarn(ctx context.Context, format string, args ...any) {
	log.G(ctx).Warnf(format, args...)
}
