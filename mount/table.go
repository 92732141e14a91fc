package mount

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Under lists the mount points at or below dir, in mount table order
// (parents before what is stacked on them), from /proc/self/mountinfo.
func Under(dir string) ([]string, error) {
	dir = filepath.Clean(dir)
	all, err := table()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range all {
		if m.point == dir || strings.HasPrefix(m.point, dir+"/") {
			out = append(out, m.point)
		}
	}
	return out, nil
}

// RemoveUnmounted removes dir recursively, but only when nothing is
// mounted at or below it: a recursive remove that crossed into a
// container's rootfs bind would delete the container's files.
func RemoveUnmounted(dir string) error {
	dir = filepath.Clean(dir)
	mounts, err := Under(dir)
	if err != nil {
		return err
	}
	if len(mounts) > 0 {
		return fmt.Errorf("%s still has mounts (%s): left in place so no file behind them is deleted", dir, strings.Join(mounts, ", "))
	}
	return os.RemoveAll(dir)
}

// mountEntry is one line of the mount table: the mount's id and where.
type mountEntry struct {
	id    uint64
	point string
}

// table reads /proc/self/mountinfo's mount ids and mount points.
func table() ([]mountEntry, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	defer f.Close()
	var out []mountEntry
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		id, err := strconv.ParseUint(fields[0], 10, 64)
		if err != nil {
			continue
		}
		out = append(out, mountEntry{id: id, point: unescape(fields[4])})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	return out, nil
}

// unescape undoes the octal escapes (\040 for a space) of mountinfo paths.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
