package sandbox

import (
	"errors"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/containerd/ttrpc"
)

// explainWait bounds how long Explain waits for a component's death to be
// recorded after the agent's channel broke.
const explainWait = 2 * time.Second

// brokenChannel says whether err is the agent's connection ending under a
// request, which is what a dying VM looks like from the host's side.
func brokenChannel(err error) bool {
	return err != nil && (errors.Is(err, ttrpc.ErrClosed) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE))
}
