package virtiofs

import (
	"fmt"
	"strings"

	"github.com/kata-fsx/kata-fsx/config"
)

// Flavour is which virtiofsd implementation a daemon binary is, and so
// the dialect its command line speaks. It is a config.DaemonDialect, so
// that config.Validate checks the settings against the daemon the host
// has without config knowing either dialect.
type Flavour string

// The two virtiofsd implementations found in the wild.
const (
	// FlavourC is the daemon shipped with QEMU up to 7.2 (/usr/lib/qemu/virtiofsd).
	FlavourC Flavour = "c"
	// FlavourRust is the standalone Rust daemon (gitlab.com/virtio-fs/virtiofsd).
	FlavourRust Flavour = "rust"
	// FlavourUnknown means detection did not run or failed.
	FlavourUnknown Flavour = ""
)

var _ config.DaemonDialect = FlavourC

// Cache modes accepted by each flavour, and the Kata spellings.
var (
	cacheModesC    = []string{"none", "auto", "always"}
	cacheModesRust = []string{"never", "metadata", "auto", "always"}
)

// CacheMode translates virtio_fs_cache into the flavour's spelling:
// "never" and "none" mean the same thing; "metadata" has no C equivalent.
func (f Flavour) CacheMode(mode string) (string, error) {
	switch f {
	case FlavourC:
		switch mode {
		case "none", "never":
			return "none", nil
		case "auto", "always":
			return mode, nil
		}
		return "", &config.Error{Key: "hypervisor.qemu.virtio_fs_cache", Value: mode,
			Problem: fmt.Sprintf("the C virtiofsd accepts only %s", strings.Join(cacheModesC, "|")),
			Fix:     "use never, auto or always, or point virtio_fs_daemon at the Rust virtiofsd"}
	case FlavourRust:
		switch mode {
		case "none":
			return "never", nil
		case "never", "metadata", "auto", "always":
			return mode, nil
		}
		return "", &config.Error{Key: "hypervisor.qemu.virtio_fs_cache", Value: mode,
			Problem: fmt.Sprintf("the Rust virtiofsd accepts only %s", strings.Join(cacheModesRust, "|")),
			Fix:     "use never, metadata, auto or always"}
	}
	if err := config.CheckVirtioFSCache(mode); err != nil {
		return "", err
	}
	return mode, nil
}

// ExtraArgs checks virtio_fs_extra_args against the flavour's dialect and
// returns them in it. Options with the same meaning in both dialects
// are translated; options that belong to keys of their own (cache mode,
// shared directory, socket) or exist in one flavour only are refused. It
// translates, it does not police: the words are the operator's, or a
// pod's that config.PodExtraArgs already let through.
func (f Flavour) ExtraArgs(args []string) ([]string, error) {
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
				return nil, &config.Error{Key: key, Value: a,
					Problem: "this is the Rust virtiofsd's dialect but virtio_fs_daemon is the C virtiofsd",
					Fix:     cFix(name)}
			case "-o":
				if i+1 >= len(args) {
					return nil, &config.Error{Key: key, Value: a, Problem: "-o without an option", Fix: "add the option, e.g. \"-o\", \"xattr\""}
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
					return nil, &config.Error{Key: key, Value: a, Problem: "-o without an option", Fix: "remove it"}
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
						return nil, &config.Error{Key: key, Value: "-o " + opt, Problem: "-o " + name + " takes no value", Fix: "write -o " + name}
					}
					out = rustOverride(out, "--"+strings.ReplaceAll(name, "_", "-"))
				case "no_xattr":
					var err error
					if out, err = rustXattrOff(out, "-o "+opt); err != nil {
						return nil, err
					}
				default:
					return nil, &config.Error{Key: key, Value: "-o " + opt,
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
	if !config.PodOption(name) {
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
			return nil, &config.Error{Key: "hypervisor.qemu.virtio_fs_extra_args", Value: from,
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
			return &config.Error{Key: "hypervisor.qemu.virtio_fs_extra_args", Value: "-o " + opt,
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
