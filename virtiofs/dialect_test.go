package virtiofs

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/config"
)

// validConfig is a configuration Validate accepts with any dialect: an
// executable virtiofsd, a kernel and an initrd.
func validConfig(t *testing.T) *config.Config {
	t.Helper()
	c := config.Default()
	c.QEMU().VirtioFSDaemon = filepath.Join(t.TempDir(), "virtiofsd")
	if err := os.WriteFile(c.QEMU().VirtioFSDaemon, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	c.QEMU().Kernel = "/k"
	c.QEMU().Initrd = "/i"
	return c
}

func annotate(t *testing.T, c *config.Config, key, value string) (*config.Config, error) {
	t.Helper()
	c.QEMU().EnableAnnotations = []string{".*"}
	return config.ApplyAnnotations(c, map[string]string{key: value})
}

func jsonArgs(t *testing.T, args ...string) string {
	t.Helper()
	b, err := json.Marshal(args)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestValidateSpeaksTheDialect: config.Validate refuses, by key and with
// a fix, the settings the host's daemon would not take in its dialect.
func TestValidateSpeaksTheDialect(t *testing.T) {
	host := config.HostFacts{Dialect: FlavourC, QEMUProbed: true, HostMemMiB: 16384, ShmProbed: true, ShmFreeMiB: 8192}
	if err := config.Validate(validConfig(t), host); err != nil {
		t.Fatalf("valid configuration refused with the C daemon: %v", err)
	}
	cases := []struct {
		name  string
		edit  func(c *config.Config, h *config.HostFacts)
		key   string
		words string
	}{
		{"C daemon metadata cache", func(c *config.Config, h *config.HostFacts) { c.QEMU().VirtioFSCache = "metadata" }, "hypervisor.qemu.virtio_fs_cache", "C virtiofsd accepts only"},
		{"Rust daemon none-like bogus cache", func(c *config.Config, h *config.HostFacts) {
			c.QEMU().VirtioFSCache = "sometimes"
			h.Dialect = FlavourRust
		}, "hypervisor.qemu.virtio_fs_cache", "Rust virtiofsd accepts only"},
		{"-o cache to Rust", func(c *config.Config, h *config.HostFacts) {
			c.QEMU().VirtioFSExtraArgs = []string{"-o", "cache=always"}
			h.Dialect = FlavourRust
		}, "hypervisor.qemu.virtio_fs_extra_args", "C virtiofsd's -o dialect"},
		{"--cache to C", func(c *config.Config, h *config.HostFacts) { c.QEMU().VirtioFSExtraArgs = []string{"--cache=always"} }, "hypervisor.qemu.virtio_fs_extra_args", "Rust virtiofsd's dialect"},
		{"-o source to C", func(c *config.Config, h *config.HostFacts) { c.QEMU().VirtioFSExtraArgs = []string{"-o", "source=/x"} }, "hypervisor.qemu.virtio_fs_extra_args", "sets -o source itself"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := validConfig(t)
			h := host
			tc.edit(c, &h)
			err := config.Validate(c, h)
			var found bool
			for _, e := range unjoin(err) {
				var ce *config.Error
				if errors.As(e, &ce) && ce.Key == tc.key && strings.Contains(ce.Error(), tc.words) && ce.Fix != "" {
					found = true
				}
			}
			if !found {
				t.Fatalf("no error for key %s containing %q with a fix; got:\n%v", tc.key, tc.words, err)
			}
		})
	}
}

func unjoin(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	if err == nil {
		return nil
	}
	return []error{err}
}

// FuzzExtraArgs feeds arbitrary argument lists to both dialects:
// translation returns words or an error, never panics.
func FuzzExtraArgs(f *testing.F) {
	f.Add("--thread-pool-size", "4", "-o", "xattr,announce_submounts")
	f.Add("-o", "", "--no-xattr", "--xattrmap=:map::")
	f.Add("-o", "cache=always", "--cache", "-o")
	f.Fuzz(func(t *testing.T, a, b, c, d string) {
		args := []string{a, b, c, d}
		_, _ = FlavourC.ExtraArgs(args)
		_, _ = FlavourRust.ExtraArgs(args)
		_, _ = FlavourUnknown.ExtraArgs(args)
	})
}

// TestAnnotationExtraArgsAllowList checks that what a pod may ask for
// reaches both daemons, in their own dialects, whichever spelling it used.
func TestAnnotationExtraArgsAllowList(t *testing.T) {
	c := validConfig(t)
	c.QEMU().VirtioFSExtraArgs = nil
	eff, err := annotate(t, c, config.AnnotationVirtioFSExtraArgs, jsonArgs(t,
		"--thread-pool-size", "4", "-o", "xattr,announce_submounts", "-owriteback", "--allow-direct-io", "-o", "no_readdirplus"))
	if err != nil {
		t.Fatal(err)
	}
	args := eff.QEMU().VirtioFSExtraArgs
	if got, want := strings.Join(args, " "), "--thread-pool-size=4 --xattr --announce-submounts --writeback --allow-direct-io --no-readdirplus"; got != want {
		t.Fatalf("canonical: %q, want %q", got, want)
	}
	for flavour, want := range map[Flavour]string{
		FlavourC:    "--thread-pool-size=4 -o xattr -o announce_submounts -o writeback -o allow_direct_io -o no_readdirplus",
		FlavourRust: "--thread-pool-size=4 --xattr --announce-submounts --writeback --allow-direct-io --no-readdirplus",
	} {
		got, err := flavour.ExtraArgs(args)
		if err != nil || strings.Join(got, " ") != want {
			t.Errorf("%s: %q, %v; want %q", flavour, got, err, want)
		}
	}
}

// TestAnnotationOverridesFileArgs checks a pod's words against the shipped
// file's: the C daemon takes the last of each, and the Rust daemon, whose
// parser refuses an option given twice, gets each once, the pod's value.
func TestAnnotationOverridesFileArgs(t *testing.T) {
	c := validConfig(t)
	c.QEMU().VirtioFSExtraArgs = []string{"--thread-pool-size", "1", "--announce-submounts"}
	eff, err := annotate(t, c, config.AnnotationVirtioFSExtraArgs, `["--thread-pool-size=4", "-o", "announce_submounts"]`)
	if err != nil {
		t.Fatal(err)
	}
	args := eff.QEMU().VirtioFSExtraArgs
	if got, err := FlavourRust.ExtraArgs(args); err != nil || strings.Join(got, " ") != "--thread-pool-size=4 --announce-submounts" {
		t.Errorf("Rust: %q, %v", got, err)
	}
	if got, err := FlavourC.ExtraArgs(args); err != nil || strings.Join(got, " ") != "--thread-pool-size 1 -o announce_submounts --thread-pool-size=4 -o announce_submounts" {
		t.Errorf("C: %q, %v", got, err)
	}
}

// TestAnnotationTurnsXattrOff checks the off switch against a configuration
// that turns xattr on: the C daemon takes the last word, and the Rust one,
// which has no off switch, does not get --xattr at all.
func TestAnnotationTurnsXattrOff(t *testing.T) {
	c := validConfig(t)
	c.QEMU().VirtioFSExtraArgs = []string{"--thread-pool-size=1", "--xattr"}
	eff, err := annotate(t, c, config.AnnotationVirtioFSExtraArgs, `["-o", "no_xattr"]`)
	if err != nil {
		t.Fatal(err)
	}
	args := eff.QEMU().VirtioFSExtraArgs
	if got, err := FlavourC.ExtraArgs(args); err != nil || strings.Join(got, " ") != "--thread-pool-size=1 -o xattr -o no_xattr" {
		t.Errorf("C: %q, %v", got, err)
	}
	if got, err := FlavourRust.ExtraArgs(args); err != nil || strings.Join(got, " ") != "--thread-pool-size=1" {
		t.Errorf("Rust: %q, %v", got, err)
	}
	c.QEMU().VirtioFSExtraArgs = []string{"--xattrmap=:map::user.virtiofs.:"}
	eff, err = annotate(t, c, config.AnnotationVirtioFSExtraArgs, `["--no-xattr"]`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := FlavourRust.ExtraArgs(eff.QEMU().VirtioFSExtraArgs); err == nil || !strings.Contains(err.Error(), "--xattrmap") {
		t.Errorf("Rust with --xattrmap: xattr off accepted or not explained: %v", err)
	}
}

// TestConfigFileExtraArgsAreOperatorTrusted documents the other side of the
// boundary: the configuration file is the operator's, as in Kata, and its
// virtio_fs_extra_args are not held to the pod allow-list.
func TestConfigFileExtraArgsAreOperatorTrusted(t *testing.T) {
	got, err := FlavourRust.ExtraArgs([]string{"--log-level=debug", "--rlimit-nofile=4096"})
	if err != nil || strings.Join(got, " ") != "--log-level=debug --rlimit-nofile=4096" {
		t.Fatalf("operator's arguments: %q, %v", got, err)
	}
}

func TestCacheModeTranslation(t *testing.T) {
	for _, tc := range []struct {
		mode string
		f    Flavour
		want string
	}{
		{"never", FlavourC, "none"}, {"none", FlavourRust, "never"}, {"always", FlavourC, "always"}, {"metadata", FlavourRust, "metadata"},
	} {
		got, err := tc.f.CacheMode(tc.mode)
		if err != nil || got != tc.want {
			t.Errorf("%s.CacheMode(%s) = %q, %v; want %q", tc.mode, tc.f, got, err, tc.want)
		}
	}
}

func TestExtraArgsTranslation(t *testing.T) {
	got, err := FlavourC.ExtraArgs([]string{"--thread-pool-size=1", "--announce-submounts"})
	if err != nil || strings.Join(got, " ") != "--thread-pool-size=1 -o announce_submounts" {
		t.Fatalf("C: %q %v", got, err)
	}
	got, err = FlavourRust.ExtraArgs([]string{"--thread-pool-size=4", "-o", "xattr,announce_submounts"})
	if err != nil || strings.Join(got, " ") != "--thread-pool-size=4 --xattr --announce-submounts" {
		t.Fatalf("Rust: %q %v", got, err)
	}
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
		c0 := config.Default()
		c0.QEMU().EnableAnnotations = []string{".*"}
		lists := []string{raw}
		for n := 1; n <= 4; n++ {
			words, _ := json.Marshal([]string{a, b, c, d}[:n])
			lists = append(lists, string(words))
		}
		for _, v := range lists {
			eff, err := config.ApplyAnnotations(c0, map[string]string{config.AnnotationVirtioFSExtraArgs: v})
			if err != nil {
				if !strings.Contains(err.Error(), config.AnnotationVirtioFSExtraArgs) && !strings.Contains(err.Error(), "virtiofsd extra arguments") {
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
			cargs, err := FlavourC.ExtraArgs(args)
			if err != nil {
				t.Fatalf("%s: accepted for the pod but not translatable for C: %v", v, err)
			}
			for _, w := range cargs {
				if !podCWord.MatchString(w) {
					t.Fatalf("%s: C daemon gets %q", v, w)
				}
			}
			rargs, err := FlavourRust.ExtraArgs(args)
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
