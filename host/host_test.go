package host

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/test/testenv"
	"github.com/kata-fsx/kata-fsx/virtiofs"
)

const debianVirtiofsd = "/usr/lib/qemu/virtiofsd"

func thisHostConfig(t *testing.T) *config.Config {
	t.Helper()
	qemu := testenv.Tool(t, "qemu-system-x86_64", "qemu-system-x86")
	if _, err := os.Stat(debianVirtiofsd); err != nil {
		testenv.Missing(t, "Debian's C virtiofsd is not installed (apt-get install qemu-system-common): %v", err)
	}
	c := config.Default()
	c.QEMU().Path = qemu
	c.QEMU().VirtioFSDaemon = debianVirtiofsd
	c.KataFSX.StateDir = t.TempDir()
	return c
}

// TestProbeThisHost probes the real host and checks each answer against
// the host itself, whatever it has: QEMU and the C virtiofsd are required,
// KVM and /dev/vhost-vsock are compared, not assumed.
func TestProbeThisHost(t *testing.T) {
	c := thisHostConfig(t)
	h := Probe(context.Background(), c)

	if h.QEMUErr != nil || h.QEMU == nil {
		t.Fatalf("QEMU probe: %v", h.QEMUErr)
	}
	if !h.QEMU.VhostUserBlk || !h.QEMU.VhostUserFS || !h.QEMU.VirtioSerial {
		t.Errorf("QEMU lacks devices kata-fsx uses: %+v", h.QEMU)
	}
	if h.DaemonErr != nil || h.Daemon == nil || h.Daemon.Flavour != virtiofs.FlavourC {
		t.Errorf("virtiofsd: %+v, %v", h.Daemon, h.DaemonErr)
	}

	wantAccel, wantWhy := hypervisor.DetectAccel(context.Background(), c.QEMU().Path)
	if wantAccel == hypervisor.AccelTCG && (h.Accel != hypervisor.AccelTCG || h.AccelReason != wantWhy) {
		t.Errorf("accelerator %s (%s), want TCG (%s)", h.Accel, h.AccelReason, wantWhy)
	}
	if h.AccelReason == "" {
		t.Error("accelerator without a reason")
	}
	if h.AccelCacheDir != AccelCacheDir(c) {
		t.Errorf("accelerator cache %q, want %q", h.AccelCacheDir, AccelCacheDir(c))
	}

	f, openErr := os.OpenFile("/dev/vhost-vsock", os.O_RDWR, 0)
	if openErr == nil {
		f.Close()
	}
	if h.Vsock != (openErr == nil) {
		t.Errorf("Vsock = %v, but opening /dev/vhost-vsock gives %v", h.Vsock, openErr)
	}
	if !h.Vsock && !strings.Contains(h.VsockReason, "/dev/vhost-vsock") {
		t.Errorf("vsock reason %q does not name the device", h.VsockReason)
	}
	wantTransport := config.TransportVirtioSerial
	switch {
	case h.Vsock && h.QEMU.VhostVsock:
		wantTransport = config.TransportVsock
	case h.QEMU.VhostUserVsock:
		wantTransport = config.TransportHybridVsock
	}
	if h.Transport != wantTransport || h.TransportErr != nil || !strings.HasPrefix(h.TransportReason, "auto: ") {
		t.Errorf("auto transport: %s (%s), %v; want %s", h.Transport, h.TransportReason, h.TransportErr, wantTransport)
	}

	if !h.Memfd {
		t.Errorf("memfd_create fails here: %s", h.MemfdReason)
	}
	if h.GuestRAM != hypervisor.SharedMemoryMemfd || h.GuestRAMDir != "" {
		t.Errorf("guest RAM %s in %q (%s), want a memfd where memfd_create works", h.GuestRAM, h.GuestRAMDir, h.GuestRAMReason)
	}
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err != nil {
		if h.ShmErr == nil {
			t.Errorf("statfs /dev/shm fails (%v) but the probe says %d MiB free", err, h.ShmFreeMiB)
		}
	} else if h.ShmErr != nil {
		t.Errorf("/dev/shm: %v", h.ShmErr)
	}

	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		t.Fatal(err)
	}
	if h.MemoryErr != nil || h.Memory.TotalKiB != si.Totalram*uint64(si.Unit)>>10 {
		t.Errorf("memory %+v (%v), sysinfo says %d KiB", h.Memory, h.MemoryErr, si.Totalram*uint64(si.Unit)>>10)
	}
	if h.System.Kernel == "" || h.System.CPUs < 1 || h.System.Architecture == "" {
		t.Errorf("system %+v", h.System)
	}

	facts := h.Facts()
	want := config.HostFacts{
		Dialect: virtiofs.FlavourC, QEMUProbed: true, QEMUHasDAX: h.QEMU.DAX,
		HostMemMiB: h.Memory.TotalKiB >> 10, ShmProbed: h.ShmErr == nil, ShmFreeMiB: h.ShmFreeMiB,
		GuestRAMMemfd:     true, // memfd_create works here (checked above)
		AgentSharesMemory: wantTransport == config.TransportHybridVsock,
	}
	if facts != want {
		t.Errorf("facts %+v, want %+v", facts, want)
	}
}

// TestProbeMissingBinaries: what cannot be probed is recorded with the
// configuration key to fix, and leaves its facts unprobed.
func TestProbeMissingBinaries(t *testing.T) {
	c := config.Default()
	c.QEMU().Path = "/nonexistent/qemu-system-x86_64"
	c.QEMU().VirtioFSDaemon = "/nonexistent/virtiofsd"
	c.KataFSX.Accelerator = config.AccelTCG
	c.KataFSX.StateDir = t.TempDir()
	h := Probe(context.Background(), c)
	if h.QEMU != nil || h.QEMUErr == nil || !strings.Contains(h.QEMUErr.Error(), "hypervisor.qemu.path") {
		t.Errorf("QEMU: %+v, %v", h.QEMU, h.QEMUErr)
	}
	if h.Daemon != nil || h.DaemonErr == nil || !strings.Contains(h.DaemonErr.Error(), "hypervisor.qemu.virtio_fs_daemon") {
		t.Errorf("daemon: %+v, %v", h.Daemon, h.DaemonErr)
	}
	if h.Accel != hypervisor.AccelTCG || h.AccelReason != `kata_fsx.accelerator = "tcg"` {
		t.Errorf("explicit tcg: %s (%s)", h.Accel, h.AccelReason)
	}
	f := h.Facts()
	if f.QEMUProbed || f.Dialect != nil {
		t.Errorf("facts of missing binaries: %+v", f)
	}

	c.QEMU().VirtioFSDaemon = ""
	if h := Probe(context.Background(), c); h.Daemon != nil || h.DaemonErr != nil {
		t.Errorf("no daemon configured: %+v, %v", h.Daemon, h.DaemonErr)
	}
}

// TestGuestRAM: a memfd wherever memfd_create works, so no other user's
// files can take the room guest RAM grows into; file_mem_backend keeps
// Kata's meaning, a share=on file in that directory; /dev/shm only where
// memfd fails, saying what that risks.
func TestGuestRAM(t *testing.T) {
	shmGone := errors.New("statfs /dev/shm: no such file or directory")
	noMemfd := "memfd_create: function not implemented"
	cases := []struct {
		name   string
		f      transportFacts
		mem    hypervisor.SharedMemory
		dir    string
		whyHas string
	}{
		{"memfd works", transportFacts{memfd: true}, hypervisor.SharedMemoryMemfd, "", "memfd"},
		{"memfd works, no /dev/shm", transportFacts{memfd: true, shmErr: shmGone}, hypervisor.SharedMemoryMemfd, "", "memfd"},
		{"file_mem_backend", transportFacts{memfd: true, fileMemBackend: "/dev/hugepages"}, hypervisor.SharedMemoryFile, "/dev/hugepages", "file_mem_backend"},
		{"file_mem_backend without /dev/shm", transportFacts{fileMemBackend: "/srv/ram", shmErr: shmGone}, hypervisor.SharedMemoryFile, "/srv/ram", "/srv/ram"},
		{"no memfd", transportFacts{memfdWhy: noMemfd}, hypervisor.SharedMemoryFile, "/dev/shm", "SIGBUS"},
		{"neither", transportFacts{memfdWhy: noMemfd, shmErr: shmGone}, hypervisor.SharedMemoryOff, "", "cannot be shared"},
	}
	for _, tc := range cases {
		mem, dir, why := tc.f.guestRAM()
		if mem != tc.mem || dir != tc.dir || !strings.Contains(why, tc.whyHas) {
			t.Errorf("%s: %s in %q (%s), want %s in %q saying %q", tc.name, mem, dir, why, tc.mem, tc.dir, tc.whyHas)
		}
	}
}

func TestChooseTransport(t *testing.T) {
	all := &hypervisor.Caps{Devices: []string{"vhost-user-vsock-pci", "vhost-vsock-pci", "virtio-serial-pci"}}
	noHybrid := &hypervisor.Caps{Devices: []string{"vhost-vsock-pci", "virtio-serial-pci"}}
	serialOnly := &hypervisor.Caps{Devices: []string{"virtio-serial-pci"}}
	none := &hypervisor.Caps{Devices: []string{"pci-bridge"}}
	noDev := "/dev/vhost-vsock: no such file"
	shmGone := errors.New("statfs /dev/shm: no such file or directory")
	kataHost := transportFacts{caps: all, vsock: true, memfd: true}
	thisHost := transportFacts{caps: all, vsockWhy: noDev, memfd: true}
	noSharing := transportFacts{caps: all, vsockWhy: noDev, memfdWhy: "memfd_create: permission denied", shmErr: shmGone}
	cases := []struct {
		name    string
		setting string
		f       transportFacts
		want    string
		whyHas  []string
		refused bool
	}{
		{"auto on a Kata host", config.TransportAuto, kataHost, config.TransportVsock, []string{"auto: vhost-vsock", "/dev/vhost-vsock opens"}, false},
		{"auto without /dev/vhost-vsock", config.TransportAuto, thisHost, config.TransportHybridVsock, []string{"auto: no vhost-vsock (" + noDev + ")", "memfd"}, false},
		{"auto, /dev/shm only", config.TransportAuto, transportFacts{caps: all, vsockWhy: noDev, memfdWhy: "memfd_create: permission denied"}, config.TransportHybridVsock, []string{"/dev/shm"}, false},
		{"auto, QEMU without vhost-vsock-pci", config.TransportAuto, transportFacts{caps: &hypervisor.Caps{Devices: []string{"vhost-user-vsock-pci"}}, vsock: true, memfd: true}, config.TransportHybridVsock, []string{"QEMU has no vhost-vsock-pci"}, false},
		{"auto, memfd only", config.TransportAuto, transportFacts{caps: all, vsockWhy: noDev, memfd: true, shmErr: shmGone}, config.TransportHybridVsock, []string{"memfd"}, false},
		{"auto, no shared memory", config.TransportAuto, noSharing, config.TransportVirtioSerial, []string{"guest RAM cannot be shared", "permission denied", "test agent"}, false},
		{"auto, QEMU without vhost-user-vsock-pci", config.TransportAuto, transportFacts{caps: noHybrid, vsockWhy: noDev, memfd: true}, config.TransportVirtioSerial, []string{"no vhost-user-vsock-pci"}, false},
		{"auto, QEMU not probed", config.TransportAuto, transportFacts{vsockWhy: noDev, memfd: true}, config.TransportHybridVsock, nil, false},
		{"auto, nothing works", config.TransportAuto, transportFacts{caps: none, vsockWhy: noDev, memfd: true}, config.TransportAuto, nil, true},
		{"vsock on a Kata host", config.TransportVsock, kataHost, config.TransportVsock, []string{`"vsock": vhost-vsock`}, false},
		{"vsock falls to hybrid as Kata", config.TransportVsock, thisHost, config.TransportHybridVsock, []string{`"vsock": no vhost-vsock`, "hybrid vsock"}, false},
		{"vsock, neither works", config.TransportVsock, transportFacts{caps: serialOnly, vsockWhy: noDev, memfd: true}, config.TransportVsock, nil, true},
		{"hybrid-vsock on a Kata host", config.TransportHybridVsock, kataHost, config.TransportHybridVsock, []string{`"hybrid-vsock"`}, false},
		{"hybrid-vsock without sharing", config.TransportHybridVsock, noSharing, config.TransportHybridVsock, nil, true},
		{"hybrid-vsock, QEMU without it", config.TransportHybridVsock, transportFacts{caps: noHybrid, memfd: true}, config.TransportHybridVsock, nil, true},
		{"virtio-serial everywhere", config.TransportVirtioSerial, kataHost, config.TransportVirtioSerial, []string{`"virtio-serial"`, "test agent only"}, false},
		{"virtio-serial, QEMU without it", config.TransportVirtioSerial, transportFacts{caps: none}, config.TransportVirtioSerial, nil, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, why, err := chooseTransport(tc.setting, tc.f)
			if got != tc.want || why == "" || (err != nil) != tc.refused {
				t.Fatalf("%s (%s), %v; want %s, refused %v", got, why, err, tc.want, tc.refused)
			}
			for _, w := range tc.whyHas {
				if !strings.Contains(why, w) {
					t.Errorf("reason %q lacks %q", why, w)
				}
			}
			if err != nil {
				// The refusal names the key, the setting and a fix.
				for _, w := range []string{"kata_fsx.agent_transport = \"" + tc.setting + "\"", "fix: "} {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("refusal %q lacks %q", err, w)
					}
				}
				if !errors.Is(err, ErrTransportUnavailable) {
					t.Errorf("refusal %v is not ErrTransportUnavailable", err)
				}
			}
		})
	}
}

func TestReadMeminfo(t *testing.T) {
	p := filepath.Join(t.TempDir(), "meminfo")
	os.WriteFile(p, []byte("MemTotal:        4030460 kB\nMemFree:          123456 kB\nMemAvailable:    3000000 kB\nBuffers: 1 kB\n"), 0o644)
	m, err := readMeminfo(p)
	if err != nil || m != (Memory{TotalKiB: 4030460, FreeKiB: 123456, AvailableKiB: 3000000}) {
		t.Fatalf("%+v, %v", m, err)
	}
	os.WriteFile(p, []byte("Buffers: 1 kB\n"), 0o644)
	if _, err := readMeminfo(p); err == nil {
		t.Fatal("meminfo without MemTotal accepted")
	}
	if _, err := readMeminfo(filepath.Join(t.TempDir(), "none")); err == nil {
		t.Fatal("missing meminfo accepted")
	}
}

func TestOSReleaseAndCPUInfo(t *testing.T) {
	dir := t.TempDir()
	osr := filepath.Join(dir, "os-release")
	os.WriteFile(osr, []byte("PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nNAME=\"Debian GNU/Linux\"\nVERSION_ID=\"12\"\n"), 0o644)
	if n, v := osRelease(osr); n != "Debian GNU/Linux" || v != "12" {
		t.Errorf("os-release: %q %q", n, v)
	}
	cpu := filepath.Join(dir, "cpuinfo")
	os.WriteFile(cpu, []byte("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Some CPU @ 2.00GHz\n\nprocessor\t: 1\nvendor_id\t: Other\n"), 0o644)
	if v, m := cpuInfo(cpu); v != "GenuineIntel" || m != "Some CPU @ 2.00GHz" {
		t.Errorf("cpuinfo: %q %q", v, m)
	}
}
