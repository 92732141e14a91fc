package config

import (
	"fmt"
	"strings"
)

// DaemonDialect is how one virtiofsd daemon spells its command line
// (virtiofs.Flavour): Validate checks virtio_fs_cache and
// virtio_fs_extra_args against the host's daemon through it, so that the
// dialects live with the daemon and the configuration only holds the
// settings as written.
type DaemonDialect interface {
	// CacheMode translates virtio_fs_cache into the daemon's spelling.
	CacheMode(mode string) (string, error)
	// ExtraArgs checks virtio_fs_extra_args against the daemon's dialect
	// and returns them in it.
	ExtraArgs(args []string) ([]string, error)
}

// CheckVirtioFSCache checks virtio_fs_cache against Kata's spellings, the
// check that holds whichever daemon runs.
func CheckVirtioFSCache(mode string) error {
	switch mode {
	case "none", "never", "metadata", "auto", "always":
		return nil
	}
	return &Error{Key: "hypervisor.qemu.virtio_fs_cache", Value: mode,
		Problem: "unknown cache mode", Fix: "use never, metadata, auto or always"}
}

// PodOption reports whether name, a --long option, is one a pod may set
// (--thread-pool-size or a podLongOptions key): a daemon that refuses an
// option given twice keeps only the last of these words, the pod's.
func PodOption(name string) bool {
	_, ok := podLongOptions[name]
	return ok || name == "--thread-pool-size"
}

// podCOptions maps each -o option a pod may pass (the C daemon's dialect)
// to its Kata (Rust daemon) spelling; podLongOptions maps each long option
// a pod may pass to the setting it changes, so that two words about one
// setting are refused rather than left to each daemon's parser to settle.
// Every option here changes only how the pod's own shared directory is
// served (caching, xattr, submount hints); none changes the daemon's
// sandbox, seccomp filter, capabilities, identity mapping, sockets, shared
// directory, logging or resource limits, which stay the operator's.
var (
	podCOptions = map[string]string{
		"xattr":              "--xattr",
		"no_xattr":           "--no-xattr",
		"announce_submounts": "--announce-submounts",
		"writeback":          "--writeback",
		"allow_direct_io":    "--allow-direct-io",
		"no_readdirplus":     "--no-readdirplus",
	}
	podLongOptions = map[string]string{
		"--xattr":              "xattr",
		"--no-xattr":           "xattr",
		"--announce-submounts": "announce_submounts",
		"--writeback":          "writeback",
		"--allow-direct-io":    "allow_direct_io",
		"--no-readdirplus":     "readdirplus",
	}
)

const (
	// maxPodThreadPool bounds --thread-pool-size from a pod: each thread is
	// a host thread of a root daemon, and the C daemon's own default is 64.
	maxPodThreadPool = 64
	// maxPodExtraArgs bounds the argument count: the allow-list has seven
	// settings, so a longer list is noise or an attack on the parser.
	maxPodExtraArgs = 32
)

// podExtraArgsFix lists what a pod may pass, for every refusal.
const podExtraArgsFix = "a pod may pass only --thread-pool-size=N (0-64), --xattr or --no-xattr, --announce-submounts, " +
	"--writeback, --allow-direct-io, --no-readdirplus, or their -o forms (xattr, no_xattr, announce_submounts, writeback, " +
	"allow_direct_io, no_readdirplus); other daemon options belong in virtio_fs_extra_args of the configuration file"

// PodExtraArgs checks the virtiofsd arguments of a pod's
// virtio_fs_extra_args annotation against the allow-list and returns them
// in Kata's (the Rust daemon's) spelling, one --option[=value] word each,
// which virtiofs.Flavour.ExtraArgs translates for either daemon. Anything not on the
// list is refused by name, in any spelling: the list is matched exactly,
// byte for byte, so lookalike characters, a "--", an option glued to its
// value with a space, or a value that is itself an option never match.
func PodExtraArgs(args []string) ([]string, error) {
	refuse := func(arg, problem string) error {
		return &Error{Key: "annotation " + AnnotationVirtioFSExtraArgs, Value: arg, Problem: problem, Fix: podExtraArgsFix}
	}
	if len(args) > maxPodExtraArgs {
		return nil, refuse(fmt.Sprintf("%d arguments", len(args)), fmt.Sprintf("more than %d arguments", maxPodExtraArgs))
	}
	var out []string
	setBy := map[string]string{}
	add := func(setting, canonical, from string) error {
		if prev, ok := setBy[setting]; ok {
			return refuse(from, fmt.Sprintf("sets %s, which %q already set", setting, prev))
		}
		setBy[setting] = from
		out = append(out, canonical)
		return nil
	}
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "-o" || (strings.HasPrefix(a, "-o") && !strings.HasPrefix(a, "--")):
			list := a[2:]
			if a == "-o" {
				if i+1 >= len(args) || args[i+1] == "" {
					return nil, refuse(a, "-o without an option")
				}
				i++
				list = args[i]
			}
			for _, o := range strings.Split(list, ",") {
				canonical, ok := podCOptions[o]
				if !ok {
					if o == "" {
						return nil, refuse(list, "empty option in an -o list")
					}
					return nil, refuse(o, "not an option a pod may pass to virtiofsd")
				}
				if err := add(podLongOptions[canonical], canonical, o); err != nil {
					return nil, err
				}
			}
		case a == "--thread-pool-size" || strings.HasPrefix(a, "--thread-pool-size="):
			v, glued := strings.CutPrefix(a, "--thread-pool-size=")
			if !glued {
				if i+1 >= len(args) {
					return nil, refuse(a, "--thread-pool-size without a number")
				}
				i++
				v = args[i]
			}
			n, ok := smallDecimal(v)
			if !ok || n > maxPodThreadPool {
				if glued {
					v = a
				}
				return nil, refuse(v, fmt.Sprintf("--thread-pool-size needs a number from 0 to %d, in decimal digits", maxPodThreadPool))
			}
			if err := add("thread_pool_size", fmt.Sprintf("--thread-pool-size=%d", n), a); err != nil {
				return nil, err
			}
		default:
			setting, ok := podLongOptions[a]
			if !ok {
				if a == "" {
					return nil, refuse(a, "an empty argument is not an option a pod may pass to virtiofsd")
				}
				return nil, refuse(a, "not an option a pod may pass to virtiofsd")
			}
			if err := add(setting, a, a); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// smallDecimal parses one to four ASCII digits: no sign, no base prefix,
// no Unicode digits, nothing a daemon's own parser might read otherwise.
func smallDecimal(s string) (int, bool) {
	if len(s) == 0 || len(s) > 4 {
		return 0, false
	}
	n := 0
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, false
		}
		n = n*10 + int(s[i]-'0')
	}
	return n, true
}
