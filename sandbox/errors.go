package sandbox

import (
	"fmt"

	"github.com/containerd/errdefs"
)

// classed is an error in one of containerd's errdefs classes, keeping its
// own message: the shim turns the class into the gRPC code containerd
// maps back (errgrpc), as containerd's own shims do.
type classed struct {
	error
	class error
}

// Unwrap gives the class first, which errdefs.Resolve takes.
func (e classed) Unwrap() []error { return []error{e.class, e.error} }

// withClass puts err in errdefs class.
func withClass(err, class error) error { return classed{err, class} }

// ErrFailed is wrapped by errors caused by the death of the VM or of a
// backend daemon while the pod runs; its class is errdefs.ErrUnavailable.
var ErrFailed = withClass(fmt.Errorf("sandbox failed"), errdefs.ErrUnavailable)

// Unwrap puts a refused operation in errdefs.ErrFailedPrecondition.
func (e *StateError) Unwrap() error { return errdefs.ErrFailedPrecondition }
