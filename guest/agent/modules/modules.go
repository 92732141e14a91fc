// Package modules loads the guest kernel's modules the initrd ships, in the
// order its build wrote them (/etc/modules.load), in the background while
// the agent already serves: the channel modules first, then the storage
// and network ones. A guest whose kernel has its drivers built in (the
// image) ships no list and loads nothing.
package modules

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// List is where the initrd build writes the module paths in load order,
// with ChannelsMarker after the modules the agent channels need. The
// guest image has none: its kernel has every driver built in.
const (
	List           = "/etc/modules.load"
	ChannelsMarker = "#channels-ready"
)

// Loading is the background load of the module list.
type Loading struct {
	done chan struct{}
	err  error
}

// Start loads the modules of list in the background, calling
// channelsReady once at the marker line (or at the end).
func Start(list string, channelsReady func()) *Loading {
	l := &Loading{done: make(chan struct{})}
	go func() {
		l.err = load(list, channelsReady)
		close(l.done)
	}()
	return l
}

// Done is closed when the load has ended.
func (l *Loading) Done() <-chan struct{} { return l.done }

// Err is the load's result, valid once Done is closed.
func (l *Loading) Err() error { return l.err }

// load loads the kernel modules listed in path, in order, calling
// channelsReady once at the marker line (or at the end).
func load(path string, channelsReady func()) error {
	var once sync.Once
	defer once.Do(channelsReady)
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name := strings.TrimSpace(sc.Text())
		if name == ChannelsMarker {
			once.Do(channelsReady)
			continue
		}
		if name == "" || strings.HasPrefix(name, "#") {
			continue
		}
		if err := loadModule(name); err != nil {
			return err
		}
	}
	return sc.Err()
}

func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("load module: %w", err)
	}
	defer f.Close()
	err = unix.FinitModule(int(f.Fd()), "", 0)
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("load module %s: %w", path, err)
	}
	return nil
}

// LoadByName loads a module of the guest's module list by its name; a
// guest without loadable modules has it built in or not at all.
func LoadByName(name string) error {
	b, err := os.ReadFile(List)
	if errors.Is(err, fs.ErrNotExist) {
		// The image's kernel has its drivers built in and ships no
		// modules: a built-in one is there already.
		if _, err := os.Stat(filepath.Join("/sys/module", strings.ReplaceAll(name, "-", "_"))); err == nil {
			return nil
		}
		return status.Errorf(codes.NotFound, "kernel module %s is not built into the guest kernel, and this guest has no loadable modules", name)
	}
	if err != nil {
		return fmt.Errorf("kernel module %s: %w", name, err)
	}
	want := strings.ReplaceAll(name, "-", "_")
	for _, line := range strings.Split(string(b), "\n") {
		base := strings.TrimSuffix(filepath.Base(line), ".ko")
		if strings.ReplaceAll(base, "-", "_") == want {
			return loadModule(line)
		}
	}
	return status.Errorf(codes.NotFound, "kernel module %s is not in the guest's initramfs", name)
}
