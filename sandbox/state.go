package sandbox

import (
	"fmt"
	"slices"
)

// State is where a sandbox is in its life. The moves are:
//
//	booting -> ready -> failed -> stopping -> stopped
//	   |         '-------------------^
//	   '---------> failed, stopping
//
// A sandbox fails when its VM or a backend daemon dies; only Stop leaves
// failed. Every operation checks the state it needs, so a container
// cannot be created in a failed pod and no disk can be added to one that
// is stopping.
type State int

// The sandbox states, in the order a sandbox goes through them.
const (
	StateBooting  State = iota // New prepares the backend, boots QEMU and dials the agent
	StateReady                 // the agent created the sandbox: containers may come and go
	StateFailed                // the VM or a backend daemon died under the pod
	StateStopping              // Stop is tearing the pod down
	StateStopped               // every process, socket, mount and file of the pod is gone
)

func (s State) String() string {
	switch s {
	case StateBooting:
		return "booting"
	case StateReady:
		return "ready"
	case StateFailed:
		return "failed"
	case StateStopping:
		return "stopping"
	case StateStopped:
		return "stopped"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

// next lists the states each state may move to.
var next = map[State][]State{
	StateBooting:  {StateReady, StateFailed, StateStopping},
	StateReady:    {StateFailed, StateStopping},
	StateFailed:   {StateStopping},
	StateStopping: {StateStopped},
	StateStopped:  nil,
}

// canMove reports whether from -> to is one of the moves above.
func canMove(from, to State) bool { return slices.Contains(next[from], to) }

// StateError is an operation refused because of the sandbox's state.
type StateError struct {
	ID    string
	Op    string
	State State
}

func (e *StateError) Error() string {
	return fmt.Sprintf("sandbox %s: cannot %s: sandbox is %s", e.ID, e.Op, e.State)
}
