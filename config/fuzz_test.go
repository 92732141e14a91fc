package config

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// FuzzLoadFile feeds arbitrary bytes as configuration.toml: loading and
// validating must return an error or a configuration, never panic.
//
// fuzz.sh: slow: an input grown from the Kata stock file seed is a
// 700-line TOML document that BurntSushi/toml parses twice per load (about
// 4.5 ms here), so the target runs at about 200 executions a second.
func FuzzLoadFile(f *testing.F) {
	stock, _ := os.ReadFile("testdata/kata-stock.toml")
	f.Add(stock)
	kata, _ := os.ReadFile("testdata/kata-configuration-qemu.toml")
	f.Add(kata)
	f.Add([]byte("[hypervisor.qemu]\nshared_fs = \"auto\"\n[kata_fsx.imagefs_blk]\nqueue_size = 0\n"))
	f.Add([]byte("[hypervisor.qemu]\nvirtio_fs_extra_args = [\"-o\"]\n"))
	f.Add([]byte("[hypervisor]\nqemu = 3\n"))
	// One file rewritten per input: a temporary directory per input cost
	// more than the load itself (about 200 executions a second).
	p := filepath.Join(f.TempDir(), "c.toml")
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		c, err := LoadFile(p)
		if err != nil {
			return
		}
		_ = Validate(c, HostFacts{DaemonFlavour: FlavourC})
		_ = Validate(c, HostFacts{DaemonFlavour: FlavourRust})
		_, _ = DaemonExtraArgs(c.QEMU().VirtioFSExtraArgs, FlavourRust)
		_, _ = DaemonExtraArgs(c.QEMU().VirtioFSExtraArgs, FlavourC)
	})
}

// FuzzApplyAnnotations checks that hostile annotation values (bad JSON,
// huge numbers, odd regexes in the config) give errors, never panics.
func FuzzApplyAnnotations(f *testing.F) {
	f.Add("shared_fs", "imagefs-blk", ".*")
	f.Add("virtio_fs_extra_args", `["--xattr"`, "virtio")
	f.Add("default_memory", "99999999999999999999", "(")
	f.Add("virtio_fs_daemon", "/usr/bin/../bin/sh", "daemon")
	f.Fuzz(func(t *testing.T, key, value, enable string) {
		c := Default()
		c.QEMU().EnableAnnotations = []string{enable}
		c.QEMU().ValidVirtioFSDaemonPaths = []string{"/usr/lib/qemu/*"}
		_, _ = Decide(c, Pod{Annotations: map[string]string{AnnotationHypervisorPrefix + key: value}, Rootfs: Rootfs{Kind: RootfsDir, Layers: []string{"/r"}}})
	})
}

// podWord is the oracle of FuzzPodExtraArgs, written apart from the parser:
// every word a pod's arguments may become, in the canonical dialect, and
// in the C daemon's once translated.
var (
	podWord  = regexp.MustCompile(`^--(thread-pool-size=([0-9]|[1-5][0-9]|6[0-4])|xattr|no-xattr|announce-submounts|writeback|allow-direct-io|no-readdirplus)$`)
	podCWord = regexp.MustCompile(`^(--thread-pool-size=([0-9]|[1-5][0-9]|6[0-4])|-o|xattr|no_xattr|announce_submounts|writeback|allow_direct_io|no_readdirplus)$`)
)

// FuzzPodExtraArgs feeds hostile virtio_fs_extra_args annotations, as raw
// JSON and as lists of up to four arbitrary words: whatever is accepted
// must reach either daemon as allow-listed words only.
func FuzzPodExtraArgs(f *testing.F) {
	f.Add(`["--thread-pool-size","4","-o","xattr,announce_submounts"]`, "--writeback", "-ono_xattr", "--", "--sandbox=none")
	f.Add(`["-o","modcaps=+sys_admin"]`, "--thread-pool-size", "--seccomp=none", "-o", "source=/")
	f.Add(`["--shared-dir=/"]`, "\u2014xattr", "--thread-pool-size=64", "-o", "xattr,,writeback")
	f.Fuzz(func(t *testing.T, raw, a, b, c, d string) {
		c0 := Default()
		c0.QEMU().EnableAnnotations = []string{".*"}
		lists := []string{raw}
		for n := 1; n <= 4; n++ {
			words, _ := json.Marshal([]string{a, b, c, d}[:n])
			lists = append(lists, string(words))
		}
		for _, v := range lists {
			eff, err := ApplyAnnotations(c0, map[string]string{AnnotationVirtioFSExtraArgs: v})
			if err != nil {
				if !strings.Contains(err.Error(), AnnotationVirtioFSExtraArgs) && !strings.Contains(err.Error(), "virtiofsd extra arguments") {
					t.Fatalf("%s: error does not name the annotation: %v", v, err)
				}
				continue
			}
			args := eff.QEMU().VirtioFSExtraArgs
			for _, w := range args {
				if !podWord.MatchString(w) {
					t.Fatalf("%s: accepted %q", v, w)
				}
			}
			cargs, err := DaemonExtraArgs(args, FlavourC)
			if err != nil {
				t.Fatalf("%s: accepted for the pod but not translatable for C: %v", v, err)
			}
			for _, w := range cargs {
				if !podCWord.MatchString(w) {
					t.Fatalf("%s: C daemon gets %q", v, w)
				}
			}
			rargs, err := DaemonExtraArgs(args, FlavourRust)
			if err != nil {
				t.Fatalf("%s: accepted for the pod but not translatable for Rust: %v", v, err)
			}
			for _, w := range rargs {
				if !podWord.MatchString(w) || w == "--no-xattr" {
					t.Fatalf("%s: Rust daemon gets %q", v, w)
				}
			}
		}
	})
}
