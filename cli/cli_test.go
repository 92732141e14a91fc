package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

const debianVirtiofsd = "/usr/lib/qemu/virtiofsd"

func run(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := Main(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

func writeConfig(t *testing.T, body string) string {
	t.Helper()
	dir := t.TempDir()
	p := filepath.Join(dir, "configuration.toml")
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func fakeDaemon(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "virtiofsd")
	if err := os.WriteFile(p, []byte("#!/bin/sh\necho 'usage: virtiofsd [options]'; echo '    -o source=PATH'; echo 'virtiofsd version 7.2.0'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestEnvJSONReportsConfiguredSharedFSAndDaemon(t *testing.T) {
	d := fakeDaemon(t)
	for _, fs := range []string{"virtio-fs", "imagefs-blk", "auto", "virtio-9p"} {
		cfg := writeConfig(t, "[hypervisor.qemu]\nshared_fs = \""+fs+"\"\nvirtio_fs_daemon = \""+d+"\"\n")
		code, out, stderr := run(t, "env", "--json", "--config", cfg)
		if code != 0 {
			t.Fatalf("%s: exit %d: %s", fs, code, stderr)
		}
		var info EnvInfo
		if err := json.Unmarshal([]byte(out), &info); err != nil {
			t.Fatal(err)
		}
		if info.Hypervisor.SharedFS != fs || info.Hypervisor.VirtioFSDaemon != d || info.Runtime.Config.Path != cfg {
			t.Fatalf("%s: got SharedFS %q VirtioFSDaemon %q config %q", fs, info.Hypervisor.SharedFS, info.Hypervisor.VirtioFSDaemon, info.Runtime.Config.Path)
		}
	}
}

func TestEnvTOMLHasKataSections(t *testing.T) {
	cfg := writeConfig(t, "[hypervisor.qemu]\nvirtio_fs_daemon = \""+fakeDaemon(t)+"\"\n")
	code, out, stderr := run(t, "env", "--config", cfg)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, s := range []string{"[Kernel]", "[Meta]", "[Image]", "[Initrd]", "[Hypervisor]", "[Runtime]", "[Runtime.Config]", "[Host]", "[Agent]", "[ImagefsBlk]",
		"MachineType =", "SharedFS =", "VirtioFSDaemon =", "BlockDeviceDriver =", "VirtioFSDaemonFlavour =", "DAXSupported =", "Accelerator =", "Transport =", "[Hypervisor.SecurityInfo]", "[Runtime.Version.Version]"} {
		if !strings.Contains(out, s) {
			t.Errorf("env output lacks %q", s)
		}
	}
}

func TestEnvWithQEMUAndDaemonMissing(t *testing.T) {
	cfg := writeConfig(t, "[hypervisor.qemu]\npath = \"/nonexistent/qemu\"\nvirtio_fs_daemon = \"/nonexistent/virtiofsd\"\n")
	code, out, stderr := run(t, "env", "--json", "--config", cfg)
	if code != 0 {
		t.Fatalf("env failed with QEMU and virtiofsd missing: exit %d: %s", code, stderr)
	}
	var info EnvInfo
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		t.Fatal(err)
	}
	if info.Hypervisor.Version != "not found" || info.Hypervisor.VirtioFSDaemonFlavour != "not found" {
		t.Fatalf("want not found, got %q / %q", info.Hypervisor.Version, info.Hypervisor.VirtioFSDaemonFlavour)
	}
	if !strings.Contains(stderr, "virtio_fs_daemon") {
		t.Fatalf("no warning naming virtio_fs_daemon: %s", stderr)
	}
}

func TestEnvFailsNamingTheKey(t *testing.T) {
	cases := map[string]string{
		"hypervisor.qemu.shared_fs":        "[hypervisor.qemu]\nshared_fs = \"nfs\"\n",
		"hypervisor.qemu.default_vcpus":    "[hypervisor.qemu]\ndefault_vcpus = nan\nshared_fs = \"virtio-9p\"\n",
		"hypervisor.qemu.virtio_fs_daemon": "[hypervisor.qemu]\nshared_fs = \"virtio-fs\"\nvirtio_fs_daemon = \"\"\n",
		"kata_fsx.imagefs_blk.queue_size":  "[hypervisor.qemu]\nshared_fs = \"virtio-9p\"\n[kata_fsx.imagefs_blk]\nqueue_size = 3\n",
		":3:":                              "[hypervisor.qemu]\n\nshared_fs = virtio\n",
	}
	for key, body := range cases {
		code, _, stderr := run(t, "env", "--config", writeConfig(t, body))
		if code == 0 || !strings.Contains(stderr, key) {
			t.Errorf("%s: exit %d, stderr %q", key, code, stderr)
		}
	}
}

func TestCheckFailsOnHostDependentErrors(t *testing.T) {
	d := fakeDaemon(t)
	cases := map[string]string{
		"hypervisor.qemu.virtio_fs_cache":      "[hypervisor.qemu]\nvirtio_fs_daemon = \"" + d + "\"\nvirtio_fs_cache = \"metadata\"\n",
		"hypervisor.qemu.virtio_fs_extra_args": "[hypervisor.qemu]\nvirtio_fs_daemon = \"" + d + "\"\nvirtio_fs_extra_args = [\"--cache=always\"]\n",
		"hypervisor.qemu.virtio_fs_daemon":     "[hypervisor.qemu]\nvirtio_fs_daemon = \"/etc/passwd\"\n",
	}
	for key, body := range cases {
		code, out, _ := run(t, "check", "--config", writeConfig(t, body))
		if code == 0 || !strings.Contains(out, "FAIL") || !strings.Contains(out, key) {
			t.Errorf("%s: exit %d, output:\n%s", key, code, out)
		}
	}
}

func TestCheckOnThisHost(t *testing.T) {
	if _, err := os.Stat(debianVirtiofsd); err != nil {
		testenv.Missing(t, "Debian's C virtiofsd is not installed (apt-get install qemu-system-x86): %v", err)
	}
	dir := t.TempDir()
	for _, f := range []string{"vmlinux", "initrd.img"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cfg := writeConfig(t, "[hypervisor.qemu]\npath = \"/usr/bin/qemu-system-x86_64\"\nkernel = \""+dir+"/vmlinux\"\ninitrd = \""+dir+"/initrd.img\"\nvirtio_fs_daemon = \""+debianVirtiofsd+"\"\ndefault_memory = 256\n")
	code, out, _ := run(t, "check", "--config", cfg)
	if code != 0 {
		t.Fatalf("check failed:\n%s", out)
	}
	for _, want := range []string{"PASS  virtiofsd              " + debianVirtiofsd + ": C (QEMU) flavour", "not supported by this QEMU (no cache-size property)", "PASS  vhost-user-blk-pci"} {
		if !strings.Contains(out, want) {
			t.Errorf("check output lacks %q:\n%s", want, out)
		}
	}
	// auto is vhost-vsock where /dev/vhost-vsock opens, else hybrid vsock
	// (this QEMU has vhost-user-vsock-pci); either way pods boot, so a
	// missing /dev/vhost-vsock is no problem to fix.
	want := "PASS  agent transport        hybrid-vsock (auto: no vhost-vsock ("
	if f, err := os.OpenFile("/dev/vhost-vsock", os.O_RDWR, 0); err == nil {
		f.Close()
		want = "PASS  agent transport        vsock (auto: vhost-vsock: "
	}
	if !strings.Contains(out, want) {
		t.Errorf("check output lacks %q:\n%s", want, out)
	}
	if strings.Contains(out, "vhost_vsock") {
		t.Errorf("check advises loading vhost_vsock where pods boot without it:\n%s", out)
	}
}

// fakeQEMU is a QEMU that answers the probe's help queries with only
// the devices given.
func fakeQEMU(t *testing.T, devices ...string) string {
	t.Helper()
	var list strings.Builder
	for _, d := range devices {
		list.WriteString("echo 'name \"" + d + "\", bus PCI'\n")
	}
	p := filepath.Join(t.TempDir(), "qemu-system-x86_64")
	script := "#!/bin/sh\ncase \"$*\" in\n*-version*) echo 'QEMU emulator version 7.2.0';;\n" +
		"*'-device help'*)\n" + list.String() + ";;\n" +
		"*'-machine help'*) echo 'Supported machines are:'; echo 'q35                  Standard PC (Q35 + ICH9, 2009) (alias of pc-q35-7.2)';;\nesac\n"
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestCheckTransportChoices: vsock on a host without /dev/vhost-vsock is
// hybrid vsock, as Kata; an explicit transport the host cannot give is a
// failure of check, and env reports the shim's refusal, naming the key
// and the fix.
func TestCheckTransportChoices(t *testing.T) {
	if _, err := os.Stat("/dev/vhost-vsock"); err == nil {
		t.Skip("this host has /dev/vhost-vsock")
	}
	q := fakeQEMU(t, "virtio-serial-pci", "vhost-vsock-pci", "vhost-user-vsock-pci", "virtio-9p-pci")
	cfg := writeConfig(t, "[hypervisor.qemu]\npath = \""+q+"\"\nshared_fs = \"virtio-9p\"\n[kata_fsx]\nagent_transport = \"vsock\"\naccelerator = \"tcg\"\n")
	_, out, _ := run(t, "check", "--config", cfg)
	if !strings.Contains(out, "PASS  agent transport        hybrid-vsock (kata_fsx.agent_transport = \"vsock\": no vhost-vsock") {
		t.Errorf("vsock without /dev/vhost-vsock is not hybrid vsock:\n%s", out)
	}

	q = fakeQEMU(t, "virtio-serial-pci", "vhost-vsock-pci", "virtio-9p-pci")
	for _, setting := range []string{"vsock", "hybrid-vsock"} {
		cfg := writeConfig(t, "[hypervisor.qemu]\npath = \""+q+"\"\nshared_fs = \"virtio-9p\"\n[kata_fsx]\nagent_transport = \""+setting+"\"\naccelerator = \"tcg\"\n")
		code, out, _ := run(t, "check", "--config", cfg)
		if code == 0 || !strings.Contains(out, "FAIL  agent transport        "+setting+": the shim refuses every pod: kata_fsx.agent_transport = \""+setting+"\"") ||
			!strings.Contains(out, "no vhost-user-vsock-pci") || !strings.Contains(out, "(fix: ") {
			t.Errorf("%s: exit %d:\n%s", setting, code, out)
		}
		code, jsonOut, stderr := run(t, "env", "--json", "--config", cfg)
		if code != 0 {
			t.Fatalf("%s: env: exit %d: %s", setting, code, stderr)
		}
		var info EnvInfo
		if err := json.Unmarshal([]byte(jsonOut), &info); err != nil {
			t.Fatal(err)
		}
		if info.Agent.Transport != setting || !strings.Contains(info.Agent.TransportError, "kata_fsx.agent_transport") || !strings.Contains(stderr, "refuses every pod") {
			t.Errorf("%s: env: %+v; stderr %s", setting, info.Agent, stderr)
		}
	}

	// auto falls back to virtio-serial, which Kata's agent cannot use: a warning.
	q = fakeQEMU(t, "virtio-serial-pci", "virtio-9p-pci")
	cfg = writeConfig(t, "[hypervisor.qemu]\npath = \""+q+"\"\nshared_fs = \"virtio-9p\"\n[kata_fsx]\naccelerator = \"tcg\"\n")
	_, out, _ = run(t, "check", "--config", cfg)
	if !strings.Contains(out, "WARN  agent transport        virtio-serial (auto: ") || !strings.Contains(out, "modprobe vhost_vsock") {
		t.Errorf("auto on virtio-serial:\n%s", out)
	}
}

func TestCheckDAXRefusedOnDebianQEMU(t *testing.T) {
	if _, err := os.Stat("/usr/bin/qemu-system-x86_64"); err != nil {
		testenv.Missing(t, "Debian's QEMU is not installed (apt-get install qemu-system-x86): %v", err)
	}
	cfg := writeConfig(t, "[hypervisor.qemu]\nshared_fs = \"virtio-9p\"\nvirtio_fs_cache_size = 1024\n")
	code, out, _ := run(t, "check", "--config", cfg)
	if code == 0 || !strings.Contains(out, "hypervisor.qemu.virtio_fs_cache_size") {
		t.Fatalf("DAX on a QEMU without cache-size passed:\n%s", out)
	}
}

func TestEnvPodAnnotations(t *testing.T) {
	cfg := writeConfig(t, "[hypervisor.qemu]\nvirtio_fs_daemon = \""+fakeDaemon(t)+"\"\nenable_annotations = [\"shared_fs\"]\n[kata_fsx]\nshared_fs = \"auto\"\n")
	ann := filepath.Join(t.TempDir(), "ann.json")
	os.WriteFile(ann, []byte(`{"io.katacontainers.config.hypervisor.shared_fs": "virtio-fs"}`), 0o644)
	code, out, stderr := run(t, "env", "--json", "--config", cfg, "--pod-annotations", ann)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var info EnvInfo
	json.Unmarshal([]byte(out), &info)
	if info.Policy == nil || info.Policy.Backend != "virtio-fs" || !strings.Contains(info.Policy.Reason, "annotation") {
		t.Fatalf("policy %+v", info.Policy)
	}
	os.WriteFile(ann, []byte(`{}`), 0o644)
	_, out, _ = run(t, "env", "--json", "--config", cfg, "--pod-annotations", ann)
	json.Unmarshal([]byte(out), &info)
	if info.Policy.Backend != "imagefs-blk" {
		t.Fatalf("auto with an overlay rootfs: %+v", info.Policy)
	}
	os.WriteFile(ann, []byte(`{"io.katacontainers.config.hypervisor.virtio_fs_cache": "always"}`), 0o644)
	code, _, stderr = run(t, "env", "--config", cfg, "--pod-annotations", ann)
	if code == 0 || !strings.Contains(stderr, "annotation io.katacontainers.config.hypervisor.virtio_fs_cache is not enabled") {
		t.Fatalf("refused annotation: exit %d %s", code, stderr)
	}
}

// TestEnvAsNonRoot runs the real binary as nobody.
func TestEnvAsNonRoot(t *testing.T) {
	testenv.Root(t, "switching to an unprivileged user")
	dir, err := os.MkdirTemp("", "kata-fsx-nonroot-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	bin := filepath.Join(dir, "kata-fsx")
	build := exec.Command("go", "build", "-o", bin, "../cmd/kata-fsx")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	cfg := filepath.Join(dir, "configuration.toml")
	os.WriteFile(cfg, []byte("[hypervisor.qemu]\nvirtio_fs_daemon = \"/usr/lib/qemu/virtiofsd\"\n"), 0o644)
	cmd := exec.Command(bin, "env", "--json", "--config", cfg)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("env as nobody: %v", err)
	}
	var info EnvInfo
	if err := json.Unmarshal(out, &info); err != nil || info.Hypervisor.VirtioFSDaemon != "/usr/lib/qemu/virtiofsd" {
		t.Fatalf("env as nobody: %v %+v", err, info.Hypervisor)
	}
}

func TestCheckNamesIgnoredKataKeys(t *testing.T) {
	_, out, _ := run(t, "check", "--config", "../config/testdata/kata-configuration-qemu.toml")
	for _, key := range []string{"hypervisor.qemu.block_device_driver", "hypervisor.qemu.cpu_features", "hypervisor.qemu.disable_block_device_use"} {
		if !strings.Contains(out, "WARN  "+key+"  ignored by kata-fsx: ") {
			t.Errorf("no WARN line for %s in:\n%s", key, out)
		}
	}
	// The guest image is booted, so it is no longer named.
	if strings.Contains(out, "hypervisor.qemu.image  ignored") {
		t.Errorf("image reported as ignored:\n%s", out)
	}
}
