package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/kata-fsx/kata-fsx/agent"
	pb "github.com/kata-fsx/kata-fsx/agent/protocols"
	"github.com/kata-fsx/kata-fsx/hypervisor"
)

// vmSettings is what every guest of the run shares.
type vmSettings struct {
	kit       string
	caps      *hypervisor.Caps
	accel     hypervisor.Accel
	memoryMiB uint64
	files     int
	dirs      int
	reps      int
	fioSecs   int
	fioMiB    int
	only      string // guest script workload groups, "all" or comma-separated
}

// guestRun is one boot's outcome.
type guestRun struct {
	samples []sample
	// bootSeconds runs from QEMU's start to the container process running
	// (agent up, disk found and mounted).
	bootSeconds float64
	stdout      string
	stderr      string
}

// benchDisk is one disk under test: its label is its mount point's name
// in the container (/disks/LABEL) and its column in the table.
type benchDisk struct {
	label string
	dev   hypervisor.Device
}

// bootAndMeasure boots one guest with every disk under test attached at
// once, plus root, a read-only tools disk that is the container's root so
// no disk under test also serves the binaries. Each disk is mounted the way
// the shim mounts an imagefs-blk rootfs (storage driver "blk", source the
// device's PCI path) and appears in the container at /disks/LABEL; the
// benchmark script then runs in the container and the VM is torn down.
func bootAndMeasure(ctx context.Context, s vmSettings, dir string, root hypervisor.Device, disks []benchDisk) (_ *guestRun, err error) {
	sock := filepath.Join(dir, "agent.sock")
	devs := []hypervisor.Device{root}
	for _, d := range disks {
		devs = append(devs, d.dev)
	}
	vmc := &hypervisor.VMConfig{
		Name:         "blkbench",
		Dir:          filepath.Join(dir, "vm"),
		QEMUPath:     s.caps.Path,
		Caps:         s.caps,
		MachineType:  "q35",
		Accel:        s.accel,
		VCPUs:        1,
		MemoryMiB:    s.memoryMiB,
		SharedMemory: hypervisor.SharedMemoryMemfd,
		Kernel:       filepath.Join(s.kit, "vmlinux"),
		Initrd:       filepath.Join(s.kit, "initrd.img"),
		ConsoleLog:   filepath.Join(dir, "console.log"),
		Agent:        hypervisor.AgentChannel{Transport: hypervisor.AgentSerial, SocketPath: sock},
		Devices:      devs,
	}
	start := time.Now()
	vm, err := hypervisor.Start(ctx, vmc)
	if err != nil {
		return nil, fmt.Errorf("start QEMU: %w", err)
	}
	var client *agent.Client
	defer func() {
		if client != nil {
			dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_ = client.DestroySandbox(dctx) // powers the guest off; Stop covers a hung one
			cancel()
			client.Close()
		}
		sctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if stopErr := vm.StopWith(sctx, hypervisor.StopOptions{QuitGrace: 5 * time.Second}); stopErr != nil {
			err = errors.Join(err, fmt.Errorf("stop QEMU: %w", stopErr))
		}
		if err != nil {
			err = fmt.Errorf("%w%s", err, consoleTail(vmc.ConsoleLog))
		}
	}()
	// A dead QEMU fails whatever is waiting on the guest at once.
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() {
		select {
		case <-vm.Exited():
			cancel(fmt.Errorf("QEMU exited: %v: %s", vm.Wait(), vm.Stderr()))
		case <-ctx.Done():
		}
	}()
	wrap := func(what string, err error) error {
		if c := context.Cause(ctx); c != nil && !errors.Is(c, context.Canceled) {
			return fmt.Errorf("%s: %w (%w)", what, err, c)
		}
		return fmt.Errorf("%s: %w", what, err)
	}
	client, err = agent.Dial(ctx, agent.SerialTransport{Path: sock}, 3*time.Minute)
	if err != nil {
		return nil, wrap("guest agent", err)
	}
	if err := client.CreateSandbox(ctx, &pb.CreateSandboxRequest{Hostname: "blkbench", SandboxId: "blkbench"}); err != nil {
		return nil, wrap("CreateSandbox", err)
	}
	pciPath := func(dev hypervisor.Device) (string, error) {
		p, ok := vm.Plan().PCIPaths[dev.DeviceID()]
		if !ok {
			return "", fmt.Errorf("device %s has no PCI path", dev.DeviceID())
		}
		return string(p), nil
	}
	cid := "bench"
	mp := "/run/kata-containers/shared/containers/" + cid
	rootPath, err := pciPath(root)
	if err != nil {
		return nil, err
	}
	// The disks under test are mounted on /disks/X inside the root's mount
	// point, after it: the container's root is bound recursively, so they
	// appear there, and the agent's default mounts (proc, sys, dev) stay.
	storages := []*pb.Storage{{Driver: "blk", Source: rootPath, Fstype: "ext4", MountPoint: mp, Options: []string{"ro"}}}
	args := []string{"/bin/bash", "/bench/run.sh", strconv.Itoa(s.files), strconv.Itoa(s.dirs), strconv.Itoa(s.reps),
		strconv.Itoa(s.fioSecs), strconv.Itoa(s.fioMiB), s.only}
	for _, d := range disks {
		p, err := pciPath(d.dev)
		if err != nil {
			return nil, err
		}
		storages = append(storages, &pb.Storage{Driver: "blk", Source: p, Fstype: "ext4", MountPoint: mp + "/disks/" + d.label})
		args = append(args, d.label)
	}
	spec := &pb.Spec{
		Version:  "1.1.0",
		Hostname: "blkbench",
		Root:     &pb.Root{Path: mp, Readonly: true},
		Process: &pb.Process{
			User: &pb.User{},
			Args: args,
			Env:  []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LC_ALL=C"},
			Cwd:  "/",
		},
		Annotations: map[string]string{},
	}
	if err := client.CreateContainer(ctx, &pb.CreateContainerRequest{ContainerId: cid, ExecId: cid, OCI: spec, Storages: storages}); err != nil {
		return nil, wrap("CreateContainer", err)
	}
	if err := client.StartContainer(ctx, cid); err != nil {
		return nil, wrap("StartContainer", err)
	}
	boot := time.Since(start).Seconds()
	var stdout, stderr bytes.Buffer
	var copies sync.WaitGroup
	copies.Add(2)
	go func() { defer copies.Done(); io.Copy(&stdout, client.StreamReader(ctx, cid, cid, false)) }()
	go func() { defer copies.Done(); io.Copy(&stderr, client.StreamReader(ctx, cid, cid, true)) }()
	code, err := client.WaitProcess(ctx, cid, cid)
	if err != nil {
		return nil, wrap("WaitProcess", err)
	}
	// The streams end once the process is gone; bound the wait in case the
	// agent never reports it.
	streamsDone := make(chan struct{})
	go func() { copies.Wait(); close(streamsDone) }()
	select {
	case <-streamsDone:
	case <-time.After(10 * time.Second):
		return nil, fmt.Errorf("guest script exited with status %d but its output streams did not end", code)
	}
	run := &guestRun{bootSeconds: boot, stdout: stdout.String(), stderr: stderr.String()}
	if code != 0 {
		return run, fmt.Errorf("guest script exited with status %d; stderr:\n%s", code, truncate(run.stderr, 4000))
	}
	run.samples, err = parseGuestOutput(run.stdout)
	if err != nil {
		return run, fmt.Errorf("guest output: %w; stderr:\n%s", err, truncate(run.stderr, 4000))
	}
	return run, nil
}

// consoleTail is the end of the guest console, for errors about a guest.
func consoleTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil || len(b) == 0 {
		return ""
	}
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return "\nguest console (end):\n" + string(b)
}
