package layerdir

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// maxData is the most bytes of mount data the kernel copies (one page, its
// terminating NUL included).
const maxData = 4096 - 1

// maxParallel bounds the layers materialized at once by one Mount.
const maxParallel = 4

// mountSpec is a parsed option list: the generic flags and overlayfs's own
// options.
type mountSpec struct {
	flags  uintptr // MS_* of the mount
	pflags uintptr // propagation to set after it (MS_SHARED, ... with MS_REC)
	bind   bool
	data   []string // overlayfs options, as given
	// lowers are the overlay's lower directories, unescaped, top first.
	lowers  []string
	dropped []string // options neither overlayfs's nor generic flags
}

// flagOptions are the generic mount options: the flags they set and clear.
var flagOptions = map[string]struct{ set, clear uintptr }{
	"ro":          {unix.MS_RDONLY, 0},
	"rw":          {0, unix.MS_RDONLY},
	"nosuid":      {unix.MS_NOSUID, 0},
	"suid":        {0, unix.MS_NOSUID},
	"nodev":       {unix.MS_NODEV, 0},
	"dev":         {0, unix.MS_NODEV},
	"noexec":      {unix.MS_NOEXEC, 0},
	"exec":        {0, unix.MS_NOEXEC},
	"sync":        {unix.MS_SYNCHRONOUS, 0},
	"async":       {0, unix.MS_SYNCHRONOUS},
	"dirsync":     {unix.MS_DIRSYNC, 0},
	"noatime":     {unix.MS_NOATIME, 0},
	"atime":       {0, unix.MS_NOATIME},
	"nodiratime":  {unix.MS_NODIRATIME, 0},
	"diratime":    {0, unix.MS_NODIRATIME},
	"relatime":    {unix.MS_RELATIME, 0},
	"norelatime":  {0, unix.MS_RELATIME},
	"strictatime": {unix.MS_STRICTATIME, 0},
	"lazytime":    {unix.MS_LAZYTIME, 0},
	"nolazytime":  {0, unix.MS_LAZYTIME},
	"silent":      {unix.MS_SILENT, 0},
	"loud":        {0, unix.MS_SILENT},
	"mand":        {0, 0},
	"nomand":      {0, 0},
	"bind":        {unix.MS_BIND, 0},
	"rbind":       {unix.MS_BIND | unix.MS_REC, 0},
}

// propagationOptions change the mount's propagation once it is made.
var propagationOptions = map[string]uintptr{
	"private": unix.MS_PRIVATE, "rprivate": unix.MS_PRIVATE | unix.MS_REC,
	"shared": unix.MS_SHARED, "rshared": unix.MS_SHARED | unix.MS_REC,
	"slave": unix.MS_SLAVE, "rslave": unix.MS_SLAVE | unix.MS_REC,
	"unbindable": unix.MS_UNBINDABLE, "runbindable": unix.MS_UNBINDABLE | unix.MS_REC,
}

// overlayOptions are overlayfs's options (KEY or KEY=VALUE).
var overlayOptions = map[string]bool{
	"lowerdir": true, "lowerdir+": true, "datadir+": true, "upperdir": true, "workdir": true,
	"redirect_dir": true, "index": true, "nfs_export": true, "xino": true, "metacopy": true,
	"volatile": true, "userxattr": true, "uuid": true, "verity": true, "default_permissions": true,
}

// ignoredOptions are fstab and mount.fuse3 words with no meaning for the
// mount itself.
var ignoredOptions = map[string]bool{
	"defaults": true, "auto": true, "noauto": true, "user": true, "nouser": true, "users": true,
	"_netdev": true, "nofail": true, "owner": true, "group": true,
}

// refusedOptions would change what the container sees in ways this helper
// does not implement; dropping them silently would be worse than failing.
var refusedOptions = map[string]string{
	"uidmap":          "idmapped layers (uidmap/gidmap) are not supported by " + HelperName,
	"gidmap":          "idmapped layers (uidmap/gidmap) are not supported by " + HelperName,
	"loop":            "loop devices are not layers",
	"remount":         "a remount is not a layer mount",
	"move":            "a move is not a layer mount",
	"setuid":          "mount.fuse3's setuid= is not supported",
	"drop_privileges": "mount.fuse3's drop_privileges is not supported",
}

// splitUnescaped splits s at sep bytes not escaped by a backslash.
func splitUnescaped(s string, sep byte) []string {
	var out []string
	start := 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case sep:
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return append(out, s[start:])
}

// unescape drops the backslashes overlayfs reads as escapes.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+1 < len(s) {
			i++
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// parseOptions reads a mount's options (each may hold several, comma
// separated, as mount.fuse3 passes them).
func parseOptions(options []string) (mountSpec, error) {
	var s mountSpec
	for _, group := range options {
		for _, o := range splitUnescaped(group, ',') {
			if o == "" {
				continue
			}
			if n := len(o) - len(strings.TrimRight(o, `\`)); n%2 == 1 {
				// Joined to the next option, it would escape the comma.
				return mountSpec{}, fmt.Errorf("option %q ends in a backslash", trunc(o))
			}
			key, val, hasVal := strings.Cut(o, "=")
			if f, ok := flagOptions[o]; ok {
				s.flags = s.flags&^f.clear | f.set
				continue
			}
			if p, ok := propagationOptions[o]; ok {
				s.pflags = p
				continue
			}
			if why, ok := refusedOptions[key]; ok {
				return mountSpec{}, fmt.Errorf("option %q: %s", trunc(o), why)
			}
			switch {
			case ignoredOptions[o] || strings.HasPrefix(o, "x-") || strings.HasPrefix(o, "X-") || key == "comment":
				continue
			case !overlayOptions[key]:
				s.dropped = append(s.dropped, o)
				continue
			}
			switch key {
			case "lowerdir":
				if !hasVal || val == "" {
					return mountSpec{}, errors.New("option lowerdir= without directories")
				}
				if s.lowers != nil {
					return mountSpec{}, errors.New("option lowerdir= given twice")
				}
				for _, l := range splitUnescaped(val, ':') {
					if l == "" {
						return mountSpec{}, fmt.Errorf("option %q: an empty lower directory", trunc(o))
					}
					s.lowers = append(s.lowers, unescape(l))
				}
			case "lowerdir+":
				if val == "" {
					return mountSpec{}, fmt.Errorf("option %q: no directory", trunc(o))
				}
				s.lowers = append(s.lowers, unescape(val))
			}
			s.data = append(s.data, o)
		}
	}
	s.bind = s.flags&unix.MS_BIND != 0
	if s.bind && len(s.data) > 0 {
		return mountSpec{}, fmt.Errorf("options %s are overlayfs's, but bind asks for a bind mount", trunc(strings.Join(s.data, ",")))
	}
	if !s.bind && len(s.lowers) == 0 {
		return mountSpec{}, errors.New("no lowerdir= option and no bind: want overlayfs options (lowerdir=...,upperdir=...,workdir=...) or bind")
	}
	return s, nil
}

// setLowers replaces the overlay's lower directories (one lowerdir=
// option in place of the lowerdir= and lowerdir+= ones).
func (s *mountSpec) setLowers(lowers []string) {
	data := []string{}
	for _, o := range s.data {
		if !strings.HasPrefix(o, "lowerdir=") && !strings.HasPrefix(o, "lowerdir+=") {
			data = append(data, o)
		}
	}
	esc := make([]string, len(lowers))
	for i, l := range lowers {
		esc[i] = escape(l)
	}
	s.data = append(data, "lowerdir="+strings.Join(esc, ":"))
	s.lowers = lowers
}

func trunc(s string) string {
	if len(s) > 200 {
		return s[:120] + "..." + s[len(s)-60:]
	}
	return s
}

// Mount mounts what containerd asked a MountType mount for: each remote
// layer among the overlay's lower directories (or the bind source) is
// materialized first (see Materialize), then overlayfs (or the bind) is
// mounted on target with options' overlayfs options and generic flags.
// Options mount.fuse3 adds and fstab words are dropped.
func Mount(ctx context.Context, source, target string, options []string, logf func(format string, args ...any)) error {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	s, err := parseOptions(options)
	if err != nil {
		return fmt.Errorf("mount %s on %s: %w", source, target, err)
	}
	if len(s.dropped) > 0 {
		logf("options %s are neither overlayfs's nor mount flags: dropped", trunc(strings.Join(s.dropped, ",")))
	}
	layers := s.lowers
	if s.bind {
		layers = []string{source}
	}
	pending, err := Pending(layers)
	if err != nil {
		return err
	}
	if isTempMount(target) {
		// containerd's own look into the rootfs (the user's groups, the
		// image's volumes): skeletons, not the layers' whole data.
		layers = append([]string(nil), layers...)
		for _, l := range pending {
			if layers[l.Index], err = MaterializeSkeleton(ctx, l.Dir, logf); err != nil {
				return err
			}
		}
		if s.bind {
			source = layers[0]
		} else {
			s.setLowers(layers)
		}
	} else if err := materializeAll(ctx, pending, logf); err != nil {
		return err
	}
	if s.bind {
		return bindMount(source, target, s)
	}
	return overlayMount(target, s)
}

// PendingLayer is a remote layer not yet materialized: its position in the
// directories Pending looked at and its absolute path.
type PendingLayer struct {
	Index int
	Dir   string
}

// Pending returns the remote layers among the overlay lower directories
// (or bind source) dirs that are not materialized yet: what a mount of
// them has the helper do.
func Pending(dirs []string) ([]PendingLayer, error) {
	var out []PendingLayer
	for i, d := range dirs {
		abs, err := filepath.Abs(d)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", d, err)
		}
		_, remote, err := ReadRemote(abs)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w (remove the snapshot and pull the image again)", abs, err)
		}
		if remote && !Materialized(abs) {
			out = append(out, PendingLayer{Index: i, Dir: abs})
		}
	}
	return out, nil
}

// materializeAll materializes the pending layers, a few at once.
func materializeAll(ctx context.Context, todo []PendingLayer, logf func(string, ...any)) error {
	errs := make([]error, len(todo))
	sem := make(chan struct{}, maxParallel)
	var wg sync.WaitGroup
	for i, l := range todo {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			errs[i] = Materialize(ctx, l.Dir, logf)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func bindMount(source, target string, s mountSpec) error {
	if err := unix.Mount(source, target, "", s.flags&(unix.MS_BIND|unix.MS_REC), ""); err != nil {
		return fmt.Errorf("bind mount %s on %s: %w", source, target, err)
	}
	// A bind mount takes its flags (ro above all) only on a remount.
	if rest := s.flags &^ (unix.MS_BIND | unix.MS_REC); rest != 0 {
		if err := unix.Mount("", target, "", rest|unix.MS_BIND|unix.MS_REMOUNT, ""); err != nil {
			unix.Unmount(target, unix.MNT_DETACH)
			return fmt.Errorf("remount the bind mount on %s with flags %#x: %w", target, rest, err)
		}
	}
	return propagate(target, s)
}

func propagate(target string, s mountSpec) error {
	if s.pflags == 0 {
		return nil
	}
	if err := unix.Mount("", target, "", s.pflags, ""); err != nil {
		unix.Unmount(target, unix.MNT_DETACH)
		return fmt.Errorf("set the propagation of %s: %w", target, err)
	}
	return nil
}

func overlayMount(target string, s mountSpec) error {
	data := strings.Join(s.data, ",")
	dir := ""
	if len(data) > maxData {
		// As containerd does for its own overlay mounts: the lower
		// directories relative to their common parent, mounted from it.
		var err error
		if dir, data, err = compact(s); err != nil {
			return err
		}
	}
	if err := mountIn(dir, target, s.flags, data); err != nil {
		return fmt.Errorf("mount overlayfs on %s (%d lower directories, top %s): %w", target, len(s.lowers), s.lowers[0], err)
	}
	return propagate(target, s)
}

// compact rewrites the lowerdir option relative to the lower directories'
// common parent, or says why the options stay too long.
func compact(s mountSpec) (string, string, error) {
	common := filepath.Dir(s.lowers[0])
	for _, l := range s.lowers[1:] {
		for common != "/" && !strings.HasPrefix(l, common+"/") {
			common = filepath.Dir(common)
		}
	}
	var rel []string
	if common != "/" && common != "." {
		for _, l := range s.lowers {
			rel = append(rel, escape(strings.TrimPrefix(l, common+"/")))
		}
	}
	var data []string
	for _, o := range s.data {
		switch {
		case strings.HasPrefix(o, "lowerdir+="), strings.HasPrefix(o, "lowerdir=") && rel == nil:
			return "", "", fmt.Errorf("overlayfs options of %d bytes exceed the kernel's page for mount data, and the %d lower directories have no common parent to shorten them against",
				len(strings.Join(s.data, ",")), len(s.lowers))
		case strings.HasPrefix(o, "lowerdir="):
			data = append(data, "lowerdir="+strings.Join(rel, ":"))
		default:
			data = append(data, o)
		}
	}
	d := strings.Join(data, ",")
	if len(d) > maxData {
		return "", "", fmt.Errorf("overlayfs options of %d bytes exceed the kernel's page for mount data even with the %d lower directories relative to %s (%d bytes): too many layers for one overlay mount",
			len(strings.Join(s.data, ",")), len(s.lowers), common, len(d))
	}
	return common, d, nil
}

func escape(p string) string {
	r := strings.NewReplacer(`\`, `\\`, `:`, `\:`, `,`, `\,`)
	return r.Replace(p)
}

// mountIn mounts overlayfs with its relative paths resolved from dir (""
// for none), on a thread of its own whose working directory no other code
// shares.
func mountIn(dir, target string, flags uintptr, data string) error {
	if dir == "" {
		return unix.Mount("overlay", target, "overlay", flags, data)
	}
	if !filepath.IsAbs(target) {
		wd, err := os.Getwd()
		if err != nil {
			return err
		}
		target = filepath.Join(wd, target)
	}
	ch := make(chan error, 1)
	go func() {
		// The thread is never unlocked: Go ends it with the goroutine,
		// so its own working directory never serves other code.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			ch <- fmt.Errorf("unshare the working directory: %w", err)
			return
		}
		if err := unix.Chdir(dir); err != nil {
			ch <- fmt.Errorf("chdir %s: %w", dir, err)
			return
		}
		ch <- unix.Mount("overlay", target, "overlay", flags, data)
	}()
	return <-ch
}
