package layerdir

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"

	"golang.org/x/sys/unix"
)

// helperArgs is the mount helper's command line.
type helperArgs struct {
	source, target string
	options        []string
}

// usage is the command line mount.fuse3 3.14 gives the helper (found by
// running it with a helper that logged its argv): the program, SOURCE,
// TARGET, then "-o" and every option joined by commas, with options of its
// own (dev, suid) added and fstab words (noauto, user, _netdev, nofail)
// removed; no -o at all when there is no option.
const usage = "usage: " + HelperName + " SOURCE TARGET [-o OPTIONS] (as mount.fuse3 runs it for a mount of type " + MountType + ")"

// parseArgs reads the helper's argv (args[0] is the program).
func parseArgs(args []string) (helperArgs, error) {
	if len(args) < 3 {
		return helperArgs{}, fmt.Errorf("%d arguments; %s", max(len(args)-1, 0), usage)
	}
	a := helperArgs{source: args[1], target: args[2]}
	if a.source == "" || a.target == "" {
		return helperArgs{}, fmt.Errorf("empty source or target; %s", usage)
	}
	for i := 3; i < len(args); i++ {
		switch o := args[i]; {
		case o == "-o" && i+1 < len(args):
			i++
			a.options = append(a.options, args[i])
		case strings.HasPrefix(o, "-o") && len(o) > 2:
			a.options = append(a.options, o[2:])
		default:
			return helperArgs{}, fmt.Errorf("argument %q; %s", trunc(o), usage)
		}
	}
	return a, nil
}

// HelperMain is the kata-fsx-overlay mount helper: mount.fuse3 runs it for
// a mount of type MountType, and it materializes the remote layers the
// mount needs and mounts them (see Mount). It returns the exit status;
// errors and progress go to stderr, which containerd shows when a mount
// fails.
func HelperMain(args []string) int {
	return helperMain(args, os.Stderr)
}

func helperMain(args []string, stderr io.Writer) int {
	logf := func(format string, a ...any) {
		fmt.Fprintf(stderr, HelperName+": "+format+"\n", a...)
	}
	a, err := parseArgs(args)
	if err != nil {
		logf("%v", err)
		return 2
	}
	// containerd kills a helper it gives up on; a TERM or an interrupt
	// stops the materialization cleanly instead (no marker, stage removed).
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, unix.SIGTERM)
	defer stop()
	if err := Mount(ctx, a.source, a.target, a.options, logf); err != nil {
		logf("%v", err)
		if errors.Is(err, unix.EPERM) && os.Geteuid() != 0 {
			logf("the mount needs root: containerd runs this helper as root")
		}
		return 1
	}
	return 0
}
