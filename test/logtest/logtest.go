// Package logtest records the lines a component under test logs through a
// printf-style function, for tests that check what it said.
package logtest

import (
	"fmt"
	"strings"
	"sync"
)

// Lines is a concurrency-safe record of logged lines; its zero value is
// ready to use.
type Lines struct {
	// mu guards lines alone, a leaf lock.
	mu    sync.Mutex
	lines []string
}

// Logf records one line.
func (l *Lines) Logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
}

// Has reports whether one line contains every part.
func (l *Lines) Has(parts ...string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
next:
	for _, line := range l.lines {
		for _, p := range parts {
			if !strings.Contains(line, p) {
				continue next
			}
		}
		return true
	}
	return false
}

// String is every line recorded so far, one per line.
func (l *Lines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

// Len is the number of lines recorded so far.
func (l *Lines) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.lines)
}
