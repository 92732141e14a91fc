package config

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/BurntSushi/toml"
)

// annotate applies one annotation with every annotation key enabled, so
// that what is tested is the check on the value, not enable_annotations.
func annotate(t *testing.T, c *Config, key, value string) (*Config, error) {
	t.Helper()
	c.QEMU().EnableAnnotations = []string{".*"}
	return ApplyAnnotations(c, map[string]string{key: value})
}

func jsonArgs(t *testing.T, args ...string) string {
	t.Helper()
	b, err := json.Marshal(args)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestAnnotationExtraArgsRefusedOutsideAllowList passes, with every
// annotation enabled, the arguments that would loosen a root daemon (its
// sandbox, seccomp filter, capabilities, shared directory, sockets) in
// every spelling both daemons parse, and some that no daemon parses but a
// deny-list would miss: each is refused with an error naming it.
func TestAnnotationExtraArgsRefusedOutsideAllowList(t *testing.T) {
	cases := []struct {
		args []string
		name string // what the error must quote
	}{
		{[]string{"--sandbox=none"}, "--sandbox=none"},
		{[]string{"--sandbox", "none"}, "--sandbox"},
		{[]string{"--seccomp=none"}, "--seccomp=none"},
		{[]string{"--seccomp", "none"}, "--seccomp"},
		{[]string{"--shared-dir=/"}, "--shared-dir=/"},
		{[]string{"--shared-dir", "/"}, "--shared-dir"},
		{[]string{"--modcaps=+sys_admin"}, "--modcaps=+sys_admin"},
		{[]string{"-o", "modcaps=+sys_admin"}, "modcaps=+sys_admin"},
		{[]string{"-omodcaps=+sys_admin:+dac_read_search"}, "modcaps=+sys_admin:+dac_read_search"},
		{[]string{"-o", "xattr,modcaps=+sys_admin"}, "modcaps=+sys_admin"},
		{[]string{"-o", "xattr", "-o", "source=/"}, "source=/"},
		{[]string{"-o", "sandbox=chroot"}, "sandbox=chroot"},
		{[]string{"--socket-path=/run/other.sock"}, "--socket-path=/run/other.sock"},
		{[]string{"--socket-group=root"}, "--socket-group=root"},
		{[]string{"--fd=0"}, "--fd=0"},
		{[]string{"--inode-file-handles"}, "--inode-file-handles"},
		{[]string{"--inode-file-handles=mandatory"}, "--inode-file-handles=mandatory"},
		{[]string{"--uid-map=:0:0:4294967295:"}, "--uid-map=:0:0:4294967295:"},
		{[]string{"--translate-uid=squash-host:0:0:4294967295"}, "--translate-uid=squash-host:0:0:4294967295"},
		{[]string{"--xattrmap=:map::trusted.:"}, "--xattrmap=:map::trusted.:"},
		{[]string{"-o", "xattrmap=:map::trusted.:"}, "xattrmap=:map::trusted.:"},
		{[]string{"--posix-acl"}, "--posix-acl"},
		{[]string{"--security-label"}, "--security-label"},
		{[]string{"--killpriv-v2"}, "--killpriv-v2"},
		{[]string{"--rlimit-nofile=1048576"}, "--rlimit-nofile=1048576"},
		{[]string{"--log-level=debug"}, "--log-level=debug"},
		{[]string{"-o", "log_level=debug"}, "log_level=debug"},
		{[]string{"-d"}, "-d"},
		{[]string{"-f"}, "-f"},
		{[]string{"--daemonize"}, "--daemonize"},
		{[]string{"--syslog"}, "--syslog"},
		{[]string{"--print-capabilities"}, "--print-capabilities"},
		{[]string{"--cache=always"}, "--cache=always"},
		{[]string{"-o", "cache=always"}, "cache=always"},
		{[]string{"-o", "allow_root"}, "allow_root"},
		{[]string{"-o", "posix_lock"}, "posix_lock"},
		{[]string{"-o", "flock"}, "flock"},
		// The -- of getopt and clap ends the options: whatever follows is
		// read as a positional argument, so -- is not on the list.
		{[]string{"--", "--sandbox=none"}, "--"},
		// A value-taking option must not swallow the next argument.
		{[]string{"--thread-pool-size", "--sandbox=none"}, "--sandbox=none"},
		{[]string{"--thread-pool-size"}, "--thread-pool-size"},
		{[]string{"--thread-pool-size=1 --sandbox=none"}, "--thread-pool-size=1 --sandbox=none"},
		{[]string{"--thread-pool-size=99999"}, "--thread-pool-size=99999"},
		{[]string{"--thread-pool-size=-1"}, "--thread-pool-size=-1"},
		{[]string{"--thread-pool-size=+4"}, "--thread-pool-size=+4"},
		{[]string{"--thread-pool-size=0x10"}, "--thread-pool-size=0x10"},
		{[]string{"--thread-pool-size=\uff14"}, "--thread-pool-size=\uff14"}, // fullwidth 4
		{[]string{"--xattr=true"}, "--xattr=true"},
		{[]string{"--XATTR"}, "--XATTR"},
		{[]string{"\u2014sandbox=none"}, "\u2014sandbox=none"},               // em dash
		{[]string{"\u2212\u2212xattr"}, "\u2212\u2212xattr"},                 // minus signs
		{[]string{"--x\u0430ttr"}, "--x\u0430ttr"},                           // Cyrillic a
		{[]string{"--xattr\x00--sandbox=none"}, "--xattr\x00--sandbox=none"}, // NUL
		{[]string{"-o"}, "-o"},
		{[]string{"-o", ""}, "-o"},
		{[]string{"-o", "xattr,"}, "xattr,"},
		{[]string{"-o", "xattr, sandbox=none"}, " sandbox=none"},
		{[]string{""}, "empty argument"},
		{[]string{"--xattr", "-o", "no_xattr"}, "no_xattr"}, // contradicts itself
		{[]string{"--xattr", "--xattr"}, "--xattr"},
	}
	// The check is the same for both daemon flavours: it runs on the
	// annotation, before the daemon is known, and only what passes it is
	// translated for the daemon (TestAnnotationExtraArgsAllowList).
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%q", tc.args), func(t *testing.T) {
			_, err := annotate(t, policyConfig(t), AnnotationVirtioFSExtraArgs, jsonArgs(t, tc.args...))
			if err == nil {
				t.Fatalf("%q accepted", tc.args)
			}
			if !strings.Contains(err.Error(), fmt.Sprintf("%q", tc.name)) && !strings.Contains(err.Error(), tc.name) {
				t.Fatalf("error does not name %q: %v", tc.name, err)
			}
			var ce *Error
			if !asError(err, &ce) || ce.Key != "annotation "+AnnotationVirtioFSExtraArgs {
				t.Fatalf("error does not name the annotation: %v", err)
			}
		})
	}
}

func asError(err error, target **Error) bool {
	e, ok := err.(*Error)
	if ok {
		*target = e
	}
	return ok
}

// TestAnnotationMemoryBounded checks default_memory against the ceiling
// Kata's default_maxmemory sets (the host's RAM when 0 or larger).
func TestAnnotationMemoryBounded(t *testing.T) {
	c := policyConfig(t)
	c.QEMU().DefaultMaxMemory = 4096
	if _, err := annotate(t, c, AnnotationDefaultMemory, "4096"); err != nil {
		t.Fatalf("at the ceiling: %v", err)
	}
	_, err := annotate(t, c, AnnotationDefaultMemory, "4097")
	if err == nil || !strings.Contains(err.Error(), AnnotationDefaultMemory) || !strings.Contains(err.Error(), "default_maxmemory") {
		t.Fatalf("above default_maxmemory: %v", err)
	}
	host := hostMemMiB()
	if host == 0 {
		t.Fatal("cannot read the host's memory")
	}
	c.QEMU().DefaultMaxMemory = 0
	_, err = annotate(t, c, AnnotationDefaultMemory, fmt.Sprint(host+1))
	if err == nil || !strings.Contains(err.Error(), AnnotationDefaultMemory) {
		t.Fatalf("above the host's %d MiB: %v", host, err)
	}
	c.QEMU().DefaultMaxMemory = 1 << 40
	if _, err = annotate(t, c, AnnotationDefaultMemory, "4294967295"); err == nil {
		t.Fatal("4 PiB accepted: default_maxmemory above the host's RAM must be capped at it")
	}
}

// TestAnnotationVCPUsBounded checks default_vcpus against default_maxvcpus.
func TestAnnotationVCPUsBounded(t *testing.T) {
	if hostCPUs() < 2 {
		t.Skip("needs 2 host CPUs to tell default_maxvcpus from the host's count")
	}
	c := policyConfig(t)
	c.QEMU().DefaultMaxVCPUs = 1
	if _, err := annotate(t, c, AnnotationDefaultVCPUs, "1"); err != nil {
		t.Fatalf("at the ceiling: %v", err)
	}
	_, err := annotate(t, c, AnnotationDefaultVCPUs, "1.5")
	if err == nil || !strings.Contains(err.Error(), "default_maxvcpus") {
		t.Fatalf("above default_maxvcpus: %v", err)
	}
	c.QEMU().DefaultMaxVCPUs = 0
	if _, err := annotate(t, c, AnnotationDefaultVCPUs, fmt.Sprint(hostCPUs()+1)); err == nil {
		t.Fatal("above the host's CPUs accepted")
	}
}

// TestAnnotationVirtioFSNumbersBounded checks the queue size and the DAX
// window a pod may ask for.
func TestAnnotationVirtioFSNumbersBounded(t *testing.T) {
	for _, v := range []string{"0", "3", "2048", "4294967296"} {
		if _, err := annotate(t, policyConfig(t), AnnotationVirtioFSQueueSize, v); err == nil || !strings.Contains(err.Error(), AnnotationVirtioFSQueueSize) {
			t.Errorf("queue size %s: %v", v, err)
		}
	}
	if eff, err := annotate(t, policyConfig(t), AnnotationVirtioFSQueueSize, "256"); err != nil || eff.QEMU().VirtioFSQueueSize != 256 {
		t.Errorf("queue size 256: %v", err)
	}
	c := policyConfig(t)
	c.QEMU().DefaultMaxMemory = 4096
	c.QEMU().DefaultMemory = 2048
	if _, err := annotate(t, c, AnnotationVirtioFSCacheSize, "2048"); err != nil {
		t.Errorf("DAX window that fits: %v", err)
	}
	if _, err := annotate(t, c, AnnotationVirtioFSCacheSize, "2049"); err == nil || !strings.Contains(err.Error(), AnnotationVirtioFSCacheSize) {
		t.Errorf("DAX window above default_maxmemory - default_memory: %v", err)
	}
	// The window is checked against the pod's memory, annotated or not.
	c.QEMU().EnableAnnotations = []string{".*"}
	if _, err := ApplyAnnotations(c, map[string]string{AnnotationVirtioFSCacheSize: "1024", AnnotationDefaultMemory: "3584"}); err == nil {
		t.Error("DAX window plus annotated memory above default_maxmemory accepted")
	}
}

// TestAnnotationsOfIgnoredKeysWarn checks that an annotation for a Kata key
// kata-fsx does not implement is reported the way the same key in the file
// is (config.Ignored, which the shim logs), and that annotations kata-fsx
// neither honours nor knows as ignored are refused, not dropped.
func TestAnnotationsOfIgnoredKeysWarn(t *testing.T) {
	eff, err := annotate(t, policyConfig(t), AnnotationHypervisorPrefix+"enable_hugepages", "true")
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, k := range eff.Ignored {
		if k.Key == "annotation "+AnnotationHypervisorPrefix+"enable_hugepages" && k.Value == "true" && strings.Contains(k.String(), "ignored by kata-fsx") {
			found = true
		}
	}
	if !found {
		t.Fatalf("enable_hugepages=true not reported: %v", eff.Ignored)
	}
	// Kata's annotation names differ from its file keys in places.
	eff, err = annotate(t, policyConfig(t), AnnotationHypervisorPrefix+"blk_logical_sector_size", "4096")
	if err != nil || len(eff.Ignored) != 1 || !strings.Contains(eff.Ignored[0].Reason, "sector") {
		t.Fatalf("blk_logical_sector_size: %v %v", eff.Ignored, err)
	}
	// The value that asks for nothing is not worth a warning.
	eff, err = annotate(t, policyConfig(t), AnnotationHypervisorPrefix+"enable_hugepages", "false")
	if err != nil || len(eff.Ignored) != 0 {
		t.Fatalf("enable_hugepages=false: %v %v", eff.Ignored, err)
	}
	for _, k := range []string{"path", "kernel", "initrd", "image", "jailer_path", "machine_type", "msize_9p", "default_max_vcpus", "no_such_key"} {
		_, err := annotate(t, policyConfig(t), AnnotationHypervisorPrefix+k, "1")
		if err == nil || !strings.Contains(err.Error(), AnnotationHypervisorPrefix+k) {
			t.Errorf("%s: %v", k, err)
		}
	}
}

// TestShippedEnableAnnotationsNarrow reads configuration.toml.in: the
// annotations it enables are the ones that cannot weaken the host or the
// guest, and every one of them is honoured.
func TestShippedEnableAnnotationsNarrow(t *testing.T) {
	data, err := os.ReadFile("../configuration.toml.in")
	if err != nil {
		t.Fatal(err)
	}
	line := regexp.MustCompile(`(?m)^enable_annotations\s*=.*$`).Find(data)
	if line == nil {
		t.Fatal("no enable_annotations in configuration.toml.in")
	}
	var v struct {
		EnableAnnotations []string `toml:"enable_annotations"`
	}
	if _, err := toml.Decode(string(line), &v); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"kernel_params", "virtio_fs_daemon", "default_memory", "default_vcpus", "virtio_fs_cache_size", "path", "kernel", "initrd", "image", "enable_hugepages"} {
		if regexpContains(v.EnableAnnotations, k) {
			t.Errorf("the shipped enable_annotations %q enables %s", v.EnableAnnotations, k)
		}
	}
	for _, k := range []string{"shared_fs", "virtio_fs_cache", "virtio_fs_extra_args"} {
		if !regexpContains(v.EnableAnnotations, k) {
			t.Errorf("the shipped enable_annotations %q no longer enables %s", v.EnableAnnotations, k)
		}
	}
}
