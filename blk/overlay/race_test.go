//go:build race

package overlay

// raceEnabled reports a -race build, where sync.Pool drops items on
// purpose, so pooled buffers cannot be asserted allocation-free.
const raceEnabled = true
