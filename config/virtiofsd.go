package config

import (
	"fmt"
	"strings"
)

// DaemonFlavour is which virtiofsd implementation a daemon binary is.
type DaemonFlavour string

// The two virtiofsd implementations found in the wild.
const (
	// FlavourC is the daemon shipped with QEMU up to 7.2 (/usr/lib/qemu/virtiofsd).
	FlavourC DaemonFlavour = "c"
	// FlavourRust is the standalone Rust daemon (gitlab.com/virtio-fs/virtiofsd).
	FlavourRust DaemonFlavour = "rust"
	// FlavourUnknown means detection did not run or failed.
	FlavourUnknown DaemonFlavour = ""
)

// Cache modes accepted by each flavour, and the Kata spellings.
var (
	cacheModesC    = []string{"none", "auto", "always"}
	cacheModesRust = []string{"never", "metadata", "auto", "always"}
)

// DaemonCacheMode translates virtio_fs_cache into the flavour's spelling:
// "never" and "none" mean the same thing; "metadata" has no C equivalent.
func DaemonCacheMode(mode string, f DaemonFlavour) (string, error) {
	switch f {
	case FlavourC:
		switch mode {
		case "none", "never":
			return "none", nil
		case "auto", "always":
			return mode, nil
		}
		return "", &Error{Key: "hypervisor.qemu.virtio_fs_cache", Value: mode,
			Problem: fmt.Sprintf("the C virtiofsd accepts only %s", strings.Join(cacheModesC, "|")),
			Fix:     "use never, auto or always, or point virtio_fs_daemon at the Rust virtiofsd"}
	case FlavourRust:
		switch mode {
		case "none":
			return "never", nil
		case "never", "metadata", "auto", "always":
			return mode, nil
		}
		return "", &Error{Key: "hypervisor.qemu.virtio_fs_cache", Value: mode,
			Problem: fmt.Sprintf("the Rust virtiofsd accepts only %s", strings.Join(cacheModesRust, "|")),
			Fix:     "use never, metadata, auto or always"}
	}
	switch mode {
	case "none", "never", "metadata", "auto", "always":
		return mode, nil
	}
	return "", &Error{Key: "hypervisor.qemu.virtio_fs_cache", Value: mode,
		Problem: "unknown cache mode", Fix: "use never, metadata, auto or always"}
}

// DaemonExtraArgs checks virtio_fs_extra_args against the flavour's dialect
// and returns them in it. Options with the same meaning in both dialects
// are translated; options that belong to keys of their own (cache mode,
// shared directory, socket) or exist in one flavour only are refused. It
// translates, it does not police: the words are the operator's, or a
// pod's that PodExtraArgs already let through.
func DaemonExtraArgs(args []string, f DaemonFlavour) ([]string, error) {
	const key = "hypervisor.qemu.virtio_fs_extra_args"
	var out []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch f {
		case FlavourC:
			name, _, _ := strings.Cut(a, "=")
			switch name {
			case "--announce-submounts":
				out = append(out, "-o", "announce_submounts")
				continue
			case "--xattr", "--no-xattr", "--writeback", "--allow-direct-io", "--no-readdirplus":
				if a != name {
					break
				}
				out = append(out, "-o", strings.ReplaceAll(strings.TrimPrefix(a, "--"), "-", "_"))
				continue
			case "--cache", "--shared-dir", "--sandbox", "--inode-file-handles", "--xattrmap", "--posix-acl":
				return nil, &Error{Key: key, Value: a,
					Problem: "this is the Rust virtiofsd's dialect but virtio_fs_daemon is the C virtiofsd",
					Fix:     cFix(name)}
			case "-o":
				if i+1 >= len(args) {
					return nil, &Error{Key: key, Value: a, Problem: "-o without an option", Fix: "add the option, e.g. \"-o\", \"xattr\""}
				}
				if err := checkCOption(args[i+1]); err != nil {
					return nil, err
				}
				out = append(out, a, args[i+1])
				i++
				continue
			}
			if strings.HasPrefix(a, "-o") && len(a) > 2 {
				if err := checkCOption(strings.TrimPrefix(a[2:], "=")); err != nil {
					return nil, err
				}
			}
			out = append(out, a)
		case FlavourRust:
			opt := ""
			switch {
			case a == "-o":
				if i+1 >= len(args) {
					return nil, &Error{Key: key, Value: a, Problem: "-o without an option", Fix: "remove it"}
				}
				opt = args[i+1]
				i++
			case strings.HasPrefix(a, "-o"):
				opt = strings.TrimPrefix(a[2:], "=")
			case a == "--no-xattr":
				var err error
				if out, err = rustXattrOff(out, a); err != nil {
					return nil, err
				}
				continue
			default:
				out = rustOverride(out, a)
				continue
			}
			for _, o := range strings.Split(opt, ",") {
				name, _, _ := strings.Cut(o, "=")
				switch name {
				case "announce_submounts", "xattr", "writeback", "allow_direct_io", "no_readdirplus":
					if o != name {
						return nil, &Error{Key: key, Value: "-o " + opt, Problem: "-o " + name + " takes no value", Fix: "write -o " + name}
					}
					out = rustOverride(out, "--"+strings.ReplaceAll(name, "_", "-"))
				case "no_xattr":
					var err error
					if out, err = rustXattrOff(out, "-o "+opt); err != nil {
						return nil, err
					}
				default:
					return nil, &Error{Key: key, Value: "-o " + opt,
						Problem: "this is the C virtiofsd's -o dialect but virtio_fs_daemon is the Rust virtiofsd",
						Fix:     rustFix(name)}
				}
			}
		default:
			out = append(out, a)
		}
	}
	return out, nil
}

// rustOverride appends word, first removing the earlier words that set the
// same pod-settable option: the Rust daemon's parser (clap) refuses an
// option given twice, where the C daemon takes the last, and a pod's words
// come after the file's so as to override them.
func rustOverride(out []string, word string) []string {
	name, _, _ := strings.Cut(word, "=")
	if _, ok := podLongOptions[name]; !ok && name != "--thread-pool-size" {
		return append(out, word)
	}
	kept := out[:0:0]
	for i := 0; i < len(out); i++ {
		if n, _, _ := strings.Cut(out[i], "="); n != name {
			kept = append(kept, out[i])
			continue
		}
		if out[i] == "--thread-pool-size" && i+1 < len(out) {
			i++ // and its value, the next word
		}
	}
	return append(kept, word)
}

// rustXattrOff turns xattr off for the Rust daemon, which has no switch
// for it: xattr is off unless asked for, so the earlier --xattr words go;
// options that need xattr cannot be undone that way and are an error.
func rustXattrOff(out []string, from string) ([]string, error) {
	kept := out[:0:0]
	for _, a := range out {
		name, _, _ := strings.Cut(a, "=")
		switch name {
		case "--xattr":
			continue
		case "--xattrmap", "--posix-acl":
			return nil, &Error{Key: "hypervisor.qemu.virtio_fs_extra_args", Value: from,
				Problem: "the Rust virtiofsd cannot turn xattr off: " + name + " needs it",
				Fix:     "remove " + name + " or the xattr off switch"}
		}
		kept = append(kept, a)
	}
	return kept, nil
}

func checkCOption(opt string) error {
	for _, o := range strings.Split(opt, ",") {
		name, _, _ := strings.Cut(o, "=")
		switch name {
		case "cache", "source":
			return &Error{Key: "hypervisor.qemu.virtio_fs_extra_args", Value: "-o " + opt,
				Problem: "kata-fsx sets -o " + name + " itself",
				Fix:     cFix("--" + name)}
		}
	}
	return nil
}

func cFix(name string) string {
	switch name {
	case "--cache":
		return "remove it and set virtio_fs_cache instead"
	case "--shared-dir", "--source":
		return "remove it: kata-fsx passes the shared directory itself"
	}
	return "remove it, or point virtio_fs_daemon at the Rust virtiofsd"
}

func rustFix(name string) string {
	switch name {
	case "cache":
		return "remove it and set virtio_fs_cache instead"
	case "source":
		return "remove it: kata-fsx passes the shared directory itself"
	}
	return "use the Rust daemon's --long-option form, or point virtio_fs_daemon at the C virtiofsd"
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
// which DaemonExtraArgs translates for either daemon. Anything not on the
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
