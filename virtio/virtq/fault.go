package virtq

import (
	"errors"
	"fmt"
)

// ErrFault reports an access to guest memory that faulted: a page of the
// shared mapping has no backing any more (the memory file was truncated,
// or the file system behind it ran out of space), which the kernel
// signals with SIGBUS. Without runtime/debug.SetPanicOnFault that signal
// kills the whole process, and with it every pod of the shim.
var ErrFault = errors.New("virtq: guest memory fault")

// FaultError turns r, a value recovered from a panic, into an error
// wrapping ErrFault when the panic was a memory fault raised under
// runtime/debug.SetPanicOnFault, and panics again with r otherwise (a bug
// must not pass for a guest's doing). r must not be nil.
func FaultError(r any) error {
	f, ok := r.(interface{ Addr() uintptr })
	if !ok {
		panic(r)
	}
	return fmt.Errorf("%w at address %#x", ErrFault, f.Addr())
}
