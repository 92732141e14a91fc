package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// benchLayer writes the layer stacked on the Debian root: the host's fio
// with the shared libraries the Debian root lacks, the guest script, and
// a file of random data that is part of the image (for imagefs-blk it is
// read through the block map from this layer, not from the overlay).
func benchLayer(dir, lower string, imageMiB int) error {
	fio, err := exec.LookPath("fio")
	if err != nil {
		return fmt.Errorf("fio is not installed (apt-get install fio): %w", err)
	}
	if err := copyFile(fio, filepath.Join(dir, "usr/bin/fio"), 0o755); err != nil {
		return err
	}
	libs, err := sharedLibs(fio)
	if err != nil {
		return err
	}
	for _, lib := range libs {
		// Debian's /lib is a symlink to usr/lib: place every library under
		// its real directory so this layer never shadows the symlink with a
		// directory.
		realDir, err := filepath.EvalSymlinks(filepath.Dir(lib))
		if err != nil {
			return fmt.Errorf("library %s: %w", lib, err)
		}
		rel := filepath.Join(realDir, filepath.Base(lib))
		if _, err := os.Lstat(filepath.Join(lower, rel)); err == nil {
			continue // the Debian root has its own copy
		}
		if err := copyFile(lib, filepath.Join(dir, rel), 0o644); err != nil {
			return err
		}
	}
	// The container's root is read-only: the mount points of the disks
	// under test must already be in the image.
	for _, d := range []string{"bench", "disks/a", "disks/b", "disks/c", "disks/d"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return err
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "bench/run.sh"), []byte(guestScript), 0o755); err != nil {
		return err
	}
	return randomFile(filepath.Join(dir, "bench/image.dat"), int64(imageMiB)<<20)
}

// sharedLibs lists the libraries ldd resolves for bin (the dynamic loader included).
func sharedLibs(bin string) ([]string, error) {
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w", bin, err)
	}
	var libs []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) >= 3 && f[1] == "=>" && strings.HasPrefix(f[2], "/"):
			libs = append(libs, f[2])
		case len(f) >= 1 && strings.HasPrefix(f[0], "/"):
			libs = append(libs, f[0])
		case len(f) >= 2 && f[1] == "=>" && (len(f) < 3 || f[2] == "not"):
			return nil, fmt.Errorf("ldd %s: %s is not found on the host", bin, f[0])
		}
	}
	return libs, nil
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copy %s: %w", src, err)
	}
	return out.Close()
}

// randomFile writes size bytes that neither compress nor read as zeros, so
// no layer of the stack can shortcut them.
func randomFile(path string, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	r := rand.NewChaCha8([32]byte{'b', 'l', 'k', 'b', 'e', 'n', 'c', 'h'})
	buf := make([]byte, 1<<20)
	for done := int64(0); done < size; done += int64(len(buf)) {
		r.Read(buf)
		if _, err := f.Write(buf[:min(int64(len(buf)), size-done)]); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}
