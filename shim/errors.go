package shim

import (
	"fmt"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
)

// classed is an error in one of containerd's errdefs classes, keeping its
// own message.
type classed struct {
	error
	class error
}

// Unwrap gives the class first, which errdefs.Resolve takes.
func (e classed) Unwrap() []error { return []error{e.class, e.error} }

func errNotFound(format string, a ...any) error {
	return classed{fmt.Errorf(format, a...), errdefs.ErrNotFound}
}
func errAlreadyExists(format string, a ...any) error {
	return classed{fmt.Errorf(format, a...), errdefs.ErrAlreadyExists}
}
func errPrecondition(format string, a ...any) error {
	return classed{fmt.Errorf(format, a...), errdefs.ErrFailedPrecondition}
}
func errInvalid(format string, a ...any) error {
	return classed{fmt.Errorf(format, a...), errdefs.ErrInvalidArgument}
}
func errUnimplemented(format string, a ...any) error {
	return classed{fmt.Errorf(format, a...), errdefs.ErrNotImplemented}
}

// toGRPC converts the error a Task API method returns into the gRPC status
// containerd maps back to its errdefs, as containerd's runc shim does with
// errgrpc.ToGRPC: an errdefs class (the sandbox's errors have theirs)
// gives the code, a status from the guest agent passes as it is, and an
// error of no class reaches containerd as Unknown.
func toGRPC(err *error) { *err = errgrpc.ToGRPC(*err) }
