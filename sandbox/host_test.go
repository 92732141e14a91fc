package sandbox_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/cli"
	"github.com/kata-fsx/kata-fsx/config"
	"github.com/kata-fsx/kata-fsx/hypervisor"
	"github.com/kata-fsx/kata-fsx/sandbox"
	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// TestEnvReportsWhatThePodGets: for the same configuration, the
// accelerator, agent transport and agent socket `kata-fsx env` reports are
// the ones the sandbox boots with, and a transport env marks as refused is
// refused by the sandbox with the same error.
func TestEnvReportsWhatThePodGets(t *testing.T) {
	qemu := testenv.Tool(t, "qemu-system-x86_64", "qemu-system-x86")
	const virtiofsd = "/usr/lib/qemu/virtiofsd"
	if _, err := os.Stat(virtiofsd); err != nil {
		testenv.Missing(t, "Debian's C virtiofsd is not installed (apt-get install qemu-system-common): %v", err)
	}
	dir := t.TempDir()
	for _, f := range []string{"vmlinux", "initrd.img"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	qemuTable := "[hypervisor.qemu]\npath = \"" + qemu + "\"\nkernel = \"" + dir + "/vmlinux\"\ninitrd = \"" + dir + "/initrd.img\"\n" +
		"virtio_fs_daemon = \"" + virtiofsd + "\"\ndefault_memory = 256\n"
	kataFSXTable := "[kata_fsx]\nstate_dir = \"" + filepath.Join(dir, "run") + "\"\n"
	// Where /dev/vhost-vsock opens, auto and vsock are vhost-vsock; here
	// (none) they are hybrid vsock, which this QEMU has.
	vsock := config.TransportHybridVsock
	if f, err := os.OpenFile("/dev/vhost-vsock", os.O_RDWR, 0); err == nil {
		f.Close()
		vsock = config.TransportVsock
	}
	virtioFS := "shared_fs = \"virtio-fs\"\n"
	cases := []struct{ name, qemu, kataFSX, transport string }{
		{"defaults", virtioFS, "", vsock},
		{"tcg, auto transport", virtioFS, "accelerator = \"tcg\"\nagent_transport = \"auto\"\n", vsock},
		{"virtio-serial", virtioFS, "agent_transport = \"virtio-serial\"\n", config.TransportVirtioSerial},
		{"vsock", virtioFS, "agent_transport = \"vsock\"\n", vsock},
		{"hybrid-vsock", virtioFS, "agent_transport = \"hybrid-vsock\"\n", config.TransportHybridVsock},
		{"kvm as written", virtioFS, "accelerator = \"kvm\"\n", ""},
		{"file_mem_backend", virtioFS + "file_mem_backend = \"" + dir + "\"\n", "", vsock},
		{"virtio-9p over virtio-serial", "shared_fs = \"virtio-9p\"\n", "agent_transport = \"virtio-serial\"\n", config.TransportVirtioSerial},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, "configuration-"+string(rune('a'+i))+".toml")
			if err := os.WriteFile(p, []byte(qemuTable+tc.qemu+kataFSXTable+tc.kataFSX), 0o644); err != nil {
				t.Fatal(err)
			}
			var out, errb bytes.Buffer
			if code := cli.Main(context.Background(), []string{"env", "--json", "--config", p}, &out, &errb); code != 0 {
				t.Fatalf("env: exit %d: %s", code, errb.String())
			}
			var env cli.EnvInfo
			if err := json.Unmarshal(out.Bytes(), &env); err != nil {
				t.Fatal(err)
			}
			cfg, err := config.LoadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			const id = "env-agrees"
			vmc, err := sandbox.PlanForTest(context.Background(), cfg, id)
			if env.Agent.TransportError != "" {
				if err == nil || !strings.Contains(err.Error(), env.Agent.TransportError) {
					t.Fatalf("env says the shim refuses the pod (%s), the sandbox says %v", env.Agent.TransportError, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("env reports a bootable pod (transport %s), the sandbox refuses: %v", env.Agent.Transport, err)
			}
			if string(vmc.Accel) != env.Hypervisor.Accelerator {
				t.Errorf("env reports accelerator %s (%s), the sandbox boots %s", env.Hypervisor.Accelerator, env.Hypervisor.AcceleratorReason, vmc.Accel)
			}
			want := map[string]hypervisor.AgentTransport{
				config.TransportVirtioSerial: hypervisor.AgentSerial,
				config.TransportVsock:        hypervisor.AgentVsock,
				config.TransportHybridVsock:  hypervisor.AgentHybridVsock,
			}[env.Agent.Transport]
			if vmc.Agent.Transport != want {
				t.Errorf("env reports transport %s (%s), the sandbox uses %s", env.Agent.Transport, env.Agent.TransportReason, vmc.Agent.Transport)
			}
			// Guest RAM as env reports it is what QEMU gets.
			wantRAM := map[hypervisor.SharedMemory]string{hypervisor.SharedMemoryMemfd: "memfd", hypervisor.SharedMemoryFile: "file", hypervisor.SharedMemoryOff: "private"}[vmc.SharedMemory]
			if env.Hypervisor.GuestRAM != wantRAM || env.Hypervisor.GuestRAMPath != hypervisor.GuestRAMDir(vmc) {
				t.Errorf("env reports guest RAM %s in %q (%s), the sandbox gives QEMU %q in %q",
					env.Hypervisor.GuestRAM, env.Hypervisor.GuestRAMPath, env.Hypervisor.GuestRAMReason, vmc.SharedMemory, hypervisor.GuestRAMDir(vmc))
			}
			// And QEMU's argv says the same: no file in /dev/shm unless asked.
			built := *vmc
			built.QMPSocket = filepath.Join(built.Dir, "qmp.sock") // hypervisor.Start's default
			if plan, err := hypervisor.Build(&built); err != nil {
				t.Errorf("argv: %v", err)
			} else {
				argv := strings.Join(plan.Args, " ")
				want := map[string]string{"memfd": "memory-backend-memfd,id=dimm1,size=256M,share=on", "file": "memory-backend-file,id=dimm1,size=256M,mem-path=" + env.Hypervisor.GuestRAMPath + ",share=on", "private": "-m 256M"}[wantRAM]
				if !strings.Contains(argv, want) || (wantRAM != "file" && strings.Contains(argv, "mem-path=")) {
					t.Errorf("argv lacks %q or names a mem-path: %s", want, argv)
				}
			}
			if tc.transport != "" && env.Agent.Transport != tc.transport {
				t.Errorf("env reports transport %s (%s), want %s on this host", env.Agent.Transport, env.Agent.TransportReason, tc.transport)
			}
			// The socket env names is the one the shim dials.
			got := strings.ReplaceAll(env.Hypervisor.SocketPath, "{ID}", id)
			switch vmc.Agent.Transport {
			case hypervisor.AgentSerial:
				if got != vmc.Agent.SocketPath {
					t.Errorf("env reports agent socket %s, the sandbox uses %s", got, vmc.Agent.SocketPath)
				}
			case hypervisor.AgentHybridVsock:
				if got != sandbox.HybridVsockSocket(cfg, id) || filepath.Dir(got) != filepath.Dir(vmc.Agent.SocketPath) {
					t.Errorf("env reports hybrid vsock socket %s, the sandbox's device is on %s", got, vmc.Agent.SocketPath)
				}
				if vmc.SharedMemory == hypervisor.SharedMemoryOff {
					t.Error("hybrid vsock without shared guest memory")
				}
			}
		})
	}
}
