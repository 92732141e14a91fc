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
// shared directory, socket) or exist in one flavour only are refused.
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
			case "--xattr":
				out = append(out, "-o", "xattr")
				continue
			case "--cache", "--shared-dir", "--sandbox", "--inode-file-handles", "--xattrmap", "--posix-acl", "--allow-direct-io":
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
			default:
				out = append(out, a)
				continue
			}
			for _, o := range strings.Split(opt, ",") {
				name, _, _ := strings.Cut(o, "=")
				switch name {
				case "announce_submounts":
					out = append(out, "--announce-submounts")
				case "xattr":
					out = append(out, "--xattr")
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
