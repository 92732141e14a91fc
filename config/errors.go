package config

import (
	"fmt"
	"strings"
)

// Error is a configuration problem: the key, the bad value, what is wrong and how to fix it.
type Error struct {
	Key     string
	Value   string
	Problem string
	Fix     string
	// Host marks a problem of the host rather than of the file (a missing
	// binary, too little memory): reports may show it without failing.
	Host bool
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.Key)
	if e.Value != "" {
		fmt.Fprintf(&b, " = %q", e.Value)
	}
	if e.Problem != "" {
		b.WriteString(": ")
		b.WriteString(e.Problem)
	}
	if e.Fix != "" {
		b.WriteString(" (fix: ")
		b.WriteString(e.Fix)
		b.WriteString(")")
	}
	return b.String()
}
