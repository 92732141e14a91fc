package main

import (
	"bytes"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// hostileParam is the kernel parameter that turns this agent into a
// compromised one, for the hostile-guest tests:
//
//	kata_fsx.hostile=<host dir>[,<container id>...]
//
// It then attacks the share the host shim mounts in, as root in the guest
// with the share mounted where the shim asked: at every step of a pod
// (sandbox, create, exec, delete, teardown) it plants symlinks to the host
// dir, renames and replaces every directory of the share, plants the
// named container ids ahead of their create, makes device nodes and
// set-user-id files, writes to every volume and fills the share; from
// CreateSandbox to DestroySandbox a racer keeps swapping the named ids
// in, for the window between the shim's mkdir and its mount. Every
// attempt and its outcome is kept in a log written into each container
// rootfs (/.hostile in the container), so the test can read
// it; the host dir itself is a canary the test watches.
const hostileParam = "kata_fsx.hostile="

// hostileLogName is the log's name in each container's rootfs.
const hostileLogName = ".hostile"

// sharedContainersDir is where Kata's shared directory is mounted in the
// guest, with a directory per container.
const sharedContainersDir = "/run/kata-containers/shared/containers"

// sharedVolumesDir is where an imagefs-blk pod mounts its volumes' share.
const sharedVolumesDir = "/run/kata-containers/shared/volumes"

type hostile struct {
	target string
	ids    []string

	mu    sync.Mutex // guards lines alone, a leaf lock
	lines []string
	stop  chan struct{}
	done  chan struct{}
}

// hostileFromCmdline returns the hostile mode the kernel command line
// asks for, or nil.
func hostileFromCmdline() *hostile {
	b, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return nil
	}
	for _, f := range strings.Fields(string(b)) {
		if v, ok := strings.CutPrefix(f, hostileParam); ok {
			parts := strings.Split(v, ",")
			log.Printf("hostile mode: symlinks to %s, containers %v", parts[0], parts[1:])
			return &hostile{target: parts[0], ids: parts[1:]}
		}
	}
	return nil
}

// record notes one attempt. kind "tree" is an attack on the directories
// the shim resolves paths through, which must fail; "content" is a write
// inside a container's rootfs or a volume, which a guest may do.
func (h *hostile) record(phase, kind, what string, err error) {
	outcome := "ok"
	if err != nil {
		outcome = errnoName(err)
	}
	h.mu.Lock()
	h.lines = append(h.lines, fmt.Sprintf("%s %s %s: %s", phase, kind, what, outcome))
	h.mu.Unlock()
}

func errnoName(err error) string {
	var errno unix.Errno
	if errors.As(err, &errno) {
		return unix.ErrnoName(errno)
	}
	return err.Error()
}

// shareRoots are the share's mount points in the guest that are mounted now.
func shareRoots() []string {
	var out []string
	for _, d := range []string{sharedContainersDir, sharedVolumesDir} {
		var st, parent unix.Stat_t
		if unix.Stat(d, &st) == nil && unix.Stat(filepath.Dir(d), &parent) == nil && st.Dev != parent.Dev {
			out = append(out, d)
		}
	}
	return out
}

// attack runs one round of attacks on the share and writes the log.
func (h *hostile) attack(phase string) {
	if h == nil {
		return
	}
	for _, root := range shareRoots() {
		h.attackRoot(phase, root)
	}
	h.writeLog()
}

func (h *hostile) attackRoot(phase, root string) {
	ents, err := os.ReadDir(root)
	if err != nil {
		h.record(phase, "tree", "readdir "+root, err)
		return
	}
	for _, e := range ents {
		p := filepath.Join(root, e.Name())
		if e.Name() == hostileLogName {
			continue
		}
		if e.IsDir() {
			rootfs := filepath.Join(p, "rootfs")
			if _, err := os.Stat(rootfs); err == nil {
				// A container: its directory and rootfs mount point are the
				// shim's; what is inside the rootfs is the container's.
				h.record(phase, "tree", "symlink "+filepath.Join(p, "planted"), os.Symlink(h.target, filepath.Join(p, "planted")))
				h.record(phase, "tree", "rename "+rootfs, os.Rename(rootfs, rootfs+".moved"))
				h.record(phase, "tree", "mkdir "+filepath.Join(p, "x"), os.Mkdir(filepath.Join(p, "x"), 0o755))
				h.contentAttacks(phase, rootfs)
			} else {
				// A directory volume: writing inside it is the guest's
				// right unless it is read-only.
				h.record(phase, "content", "write "+filepath.Join(p, "hostile-w"), os.WriteFile(filepath.Join(p, "hostile-w"), []byte("guest\n"), 0o644))
				h.contentAttacks(phase, p)
			}
		} else {
			h.record(phase, "content", "write "+p, appendFile(p, "guest\n"))
		}
		moved := p + ".moved"
		err := os.Rename(p, moved)
		h.record(phase, "tree", "rename "+p, err)
		if err == nil {
			h.record(phase, "tree", "symlink "+p, os.Symlink(h.target, p))
		}
		h.record(phase, "tree", "remove "+p, os.Remove(p))
	}
	for _, id := range h.ids {
		p := filepath.Join(root, id)
		h.record(phase, "tree", "symlink "+p, os.Symlink(h.target, p))
		err := os.Mkdir(p, 0o755)
		h.record(phase, "tree", "mkdir "+p, err)
		if err == nil {
			h.record(phase, "tree", "symlink "+p+"/rootfs", os.Symlink(h.target, filepath.Join(p, "rootfs")))
		}
	}
	h.record(phase, "tree", "mknod "+filepath.Join(root, "hostile-null"), unix.Mknod(filepath.Join(root, "hostile-null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	h.record(phase, "tree", "setuid file "+filepath.Join(root, "hostile-suid"), os.WriteFile(filepath.Join(root, "hostile-suid"), []byte("#!/bin/sh\n"), 0o4755))
	h.record(phase, "tree", "fill "+root, fill(filepath.Join(root, "hostile-fill"), 8<<20))
}

// contentAttacks plants what would be dangerous on the host if the share
// were mounted there with devices or set-user-id programs honoured.
func (h *hostile) contentAttacks(phase, dir string) {
	h.record(phase, "content", "mknod "+filepath.Join(dir, "hostile-null"), unix.Mknod(filepath.Join(dir, "hostile-null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	err := os.WriteFile(filepath.Join(dir, "hostile-suid"), []byte("#!/bin/sh\nid\n"), 0o755)
	if err == nil {
		err = os.Chmod(filepath.Join(dir, "hostile-suid"), 0o4755)
	}
	h.record(phase, "content", "setuid file "+filepath.Join(dir, "hostile-suid"), err)
	h.record(phase, "content", "symlink "+filepath.Join(dir, "hostile-link"), os.Symlink(h.target, filepath.Join(dir, "hostile-link")))
}

func appendFile(p, s string) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(s)
	return errors.Join(err, f.Close())
}

// fill writes up to n bytes to a new file p (kept small: the test checks
// the refusal, not the host's disk).
func fill(p string, n int) error {
	f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	buf := bytes.Repeat([]byte{'x'}, 1<<20)
	for i := 0; i < n>>20 && err == nil; i++ {
		_, err = f.Write(buf)
	}
	return errors.Join(err, f.Close())
}

// race keeps planting the named ids until stop: a shim that resolved a
// path through the share between its mkdir and its mount would follow
// one of these.
func (h *hostile) race() {
	if h == nil {
		return
	}
	h.stop, h.done = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(h.done)
		tries, planted := 0, 0
		for {
			select {
			case <-h.stop:
				h.mu.Lock()
				h.lines = append(h.lines, fmt.Sprintf("race tree %d symlink and rename attempts: %d ok", tries, planted))
				h.mu.Unlock()
				return
			default:
			}
			for _, root := range shareRoots() {
				for _, id := range h.ids {
					p := filepath.Join(root, id)
					tries++
					if os.Symlink(h.target, p) == nil {
						planted++
					}
					tries++
					if os.Rename(p, p+".moved") == nil {
						planted++
					}
					tries++
					if os.Symlink(h.target, filepath.Join(p, "rootfs")) == nil {
						planted++
					}
				}
			}
			time.Sleep(time.Millisecond)
		}
	}()
}

// endRace stops the racer and records its count.
func (h *hostile) endRace() {
	if h == nil || h.stop == nil {
		return
	}
	close(h.stop)
	<-h.done
	h.stop = nil
	h.writeLog()
}

// writeLog writes the whole log into every container rootfs it can.
func (h *hostile) writeLog() {
	h.mu.Lock()
	text := strings.Join(h.lines, "\n") + "\n"
	h.mu.Unlock()
	// A share's container rootfs is <cid>/rootfs; a block rootfs (not on
	// the share) is mounted at <cid> itself.
	ents, _ := os.ReadDir(sharedContainersDir)
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		dir := filepath.Join(sharedContainersDir, e.Name())
		if fi, err := os.Stat(filepath.Join(dir, "rootfs")); err == nil && fi.IsDir() {
			dir = filepath.Join(dir, "rootfs")
		}
		os.WriteFile(filepath.Join(dir, hostileLogName), []byte(text), 0o644)
	}
	log.Printf("hostile: %d attempts so far", strings.Count(text, "\n"))
}
