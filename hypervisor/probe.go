package hypervisor

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

// ErrNotFound reports that the QEMU binary does not exist or is not executable.
var ErrNotFound = errors.New("qemu binary not found")

// probeTimeout bounds every QEMU invocation made while probing; a help query
// that takes longer than this is a broken binary, not a slow one.
const probeTimeout = 10 * time.Second

// maxProbeOutput bounds how much output of a help query is kept.
const maxProbeOutput = 4 << 20

// Version is a QEMU release number.
type Version struct {
	Major, Minor, Micro int
}

// String formats the version as major.minor.micro.
func (v Version) String() string {
	return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Micro)
}

// AtLeast reports whether v is the same as or newer than major.minor.
func (v Version) AtLeast(major, minor int) bool {
	if v.Major != major {
		return v.Major > major
	}
	return v.Minor >= minor
}

// Machine is one entry of `-machine help`.
type Machine struct {
	Name        string
	Description string
	// Alias is the versioned machine this name stands for ("pc-q35-7.2"), if any.
	Alias   string
	Default bool
}

// Caps describes what one QEMU binary supports.
type Caps struct {
	// Path is the binary that was probed.
	Path string
	// Version is the parsed release number; VersionLine is the raw first line of -version.
	Version     Version
	VersionLine string
	// Devices lists every device name of `-device help`, sorted.
	Devices []string
	// Machines lists every machine type of `-machine help`.
	Machines []Machine
	// FSProperties lists the properties of vhost-user-fs-pci (empty when the device is missing).
	FSProperties []string

	VhostUserFS  bool // vhost-user-fs-pci (virtio-fs)
	VhostUserBlk bool // vhost-user-blk-pci (imagefs-blk)
	Virtio9P     bool // virtio-9p-pci
	VhostVsock   bool // vhost-vsock-pci (agent channel)
	// VhostUserVsock is vhost-user-vsock-pci (the agent over hybrid vsock).
	VhostUserVsock bool
	VirtioBlk      bool // virtio-blk-pci
	VirtioSerial   bool // virtio-serial-pci (agent channel without vsock)
	PCIBridge      bool // pci-bridge (hot-plug slots)
	// DAX reports whether vhost-user-fs-pci has the cache-size property; upstream QEMU never merged it.
	DAX bool
}

// HasDevice reports whether the binary knows the device driver name.
func (c *Caps) HasDevice(name string) bool {
	i := sort.SearchStrings(c.Devices, name)
	return i < len(c.Devices) && c.Devices[i] == name
}

// HasMachine reports whether the binary knows the machine type, by name or alias.
func (c *Caps) HasMachine(name string) bool {
	for _, m := range c.Machines {
		if m.Name == name || m.Alias == name {
			return true
		}
	}
	return false
}

// Probe runs the QEMU binary at qemuPath in its help modes (never starting a
// VM) and reports its version, devices, machine types and virtio-fs DAX support.
func Probe(ctx context.Context, qemuPath string) (*Caps, error) {
	path, err := resolveBinary(qemuPath)
	if err != nil {
		return nil, err
	}
	caps := &Caps{Path: path}

	out, err := runQuery(ctx, path, "-version")
	if err != nil {
		return nil, err
	}
	caps.VersionLine, caps.Version, err = ParseVersion(out)
	if err != nil {
		return nil, fmt.Errorf("probe %s: %w", path, err)
	}

	out, err = runQuery(ctx, path, "-nodefaults", "-machine", "none", "-device", "help")
	if err != nil {
		return nil, err
	}
	caps.Devices = ParseDeviceList(out)
	if len(caps.Devices) == 0 {
		return nil, fmt.Errorf("probe %s: -device help listed no devices", path)
	}
	caps.VhostUserFS = caps.HasDevice("vhost-user-fs-pci")
	caps.VhostUserBlk = caps.HasDevice("vhost-user-blk-pci")
	caps.Virtio9P = caps.HasDevice("virtio-9p-pci")
	caps.VhostVsock = caps.HasDevice("vhost-vsock-pci")
	caps.VhostUserVsock = caps.HasDevice("vhost-user-vsock-pci")
	caps.VirtioBlk = caps.HasDevice("virtio-blk-pci")
	caps.VirtioSerial = caps.HasDevice("virtio-serial-pci")
	caps.PCIBridge = caps.HasDevice("pci-bridge")

	if caps.VhostUserFS {
		out, err = runQuery(ctx, path, "-nodefaults", "-machine", "none", "-device", "vhost-user-fs-pci,help")
		if err != nil {
			return nil, err
		}
		caps.FSProperties = ParseDeviceProperties(out)
		for _, p := range caps.FSProperties {
			if p == "cache-size" {
				caps.DAX = true
			}
		}
	}

	// -machine none would make `-machine help` describe the none machine's
	// options instead of listing machine types.
	out, err = runQuery(ctx, path, "-nodefaults", "-machine", "help")
	if err != nil {
		return nil, err
	}
	caps.Machines = ParseMachines(out)
	if len(caps.Machines) == 0 {
		return nil, fmt.Errorf("probe %s: -machine help listed no machine types", path)
	}
	return caps, nil
}

// resolveBinary turns qemuPath into an executable path, resolving bare names
// through $PATH, and reports ErrNotFound with the path when it is missing.
func resolveBinary(qemuPath string) (string, error) {
	if qemuPath == "" {
		return "", fmt.Errorf("%w: empty path", ErrNotFound)
	}
	if !strings.Contains(qemuPath, "/") {
		p, err := exec.LookPath(qemuPath)
		if err != nil {
			return "", fmt.Errorf("%w: %s: %w", ErrNotFound, qemuPath, err)
		}
		return p, nil
	}
	st, err := os.Stat(qemuPath)
	if err != nil {
		return "", fmt.Errorf("%w: %s: %w", ErrNotFound, qemuPath, err)
	}
	if st.IsDir() || st.Mode().Perm()&0o111 == 0 {
		return "", fmt.Errorf("%w: %s: not an executable file", ErrNotFound, qemuPath)
	}
	return qemuPath, nil
}

// runQuery runs one help query with a timeout and returns its stdout.
func runQuery(ctx context.Context, path string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	var stdout, stderr limitedBuffer
	stdout.limit, stderr.limit = maxProbeOutput, 64<<10
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if ctxErr := ctx.Err(); ctxErr != nil {
		return nil, fmt.Errorf("%s %s: %w", path, strings.Join(args, " "), ctxErr)
	}
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w: %s", path, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	if stdout.truncated {
		return nil, fmt.Errorf("%s %s: output larger than %d bytes", path, strings.Join(args, " "), maxProbeOutput)
	}
	return stdout.Bytes(), nil
}

// limitedBuffer keeps the first limit bytes written and drops the rest
// without failing the writer, so a chatty child never blocks.
type limitedBuffer struct {
	bytes.Buffer
	limit     int
	truncated bool
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	room := b.limit - b.Len()
	if room <= 0 {
		b.truncated = b.truncated || len(p) > 0
		return len(p), nil
	}
	if len(p) > room {
		b.Buffer.Write(p[:room])
		b.truncated = true
		return len(p), nil
	}
	return b.Buffer.Write(p)
}

var versionRE = regexp.MustCompile(`version ([0-9]{1,6})\.([0-9]{1,6})(?:\.([0-9]{1,6}))?`)

// ParseVersion parses the output of `qemu -version` into its first line and release number.
func ParseVersion(out []byte) (string, Version, error) {
	line, _, _ := bytes.Cut(out, []byte("\n"))
	line = bytes.TrimSpace(line)
	m := versionRE.FindSubmatch(line)
	if m == nil {
		return "", Version{}, fmt.Errorf("unrecognised -version output %q", truncate(string(line), 120))
	}
	var v Version
	// The regexp bounds every number to six digits, so Atoi cannot fail or overflow.
	v.Major, _ = strconv.Atoi(string(m[1]))
	v.Minor, _ = strconv.Atoi(string(m[2]))
	if len(m[3]) > 0 {
		v.Micro, _ = strconv.Atoi(string(m[3]))
	}
	return string(line), v, nil
}

// ParseDeviceList extracts the device names of `-device help`, sorted and unique.
func ParseDeviceList(out []byte) []string {
	seen := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 0, 4096), maxProbeOutput)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), `name "`)
		if !ok {
			continue
		}
		name, _, ok := strings.Cut(rest, `"`)
		if ok && name != "" {
			seen[name] = true
		}
	}
	return slices.Sorted(maps.Keys(seen))
}

// ParseDeviceProperties extracts the property names of `-device NAME,help`, sorted.
func ParseDeviceProperties(out []byte) []string {
	var props []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 0, 4096), maxProbeOutput)
	for sc.Scan() {
		line := sc.Text()
		// Property lines are indented "  name=<type> ..."; the header is not.
		if !strings.HasPrefix(line, " ") {
			continue
		}
		name, _, ok := strings.Cut(strings.TrimSpace(line), "=")
		if ok && name != "" && !strings.ContainsAny(name, " \t") {
			props = append(props, name)
		}
	}
	sort.Strings(props)
	return props
}

// ParseMachines extracts the machine types of `-machine help`.
func ParseMachines(out []byte) []Machine {
	var ms []Machine
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 0, 4096), maxProbeOutput)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == ' ' || strings.HasPrefix(line, "Supported machines") {
			continue
		}
		name, desc, _ := strings.Cut(line, " ")
		desc = strings.TrimSpace(desc)
		m := Machine{Name: name}
		if d, ok := strings.CutSuffix(desc, " (default)"); ok {
			m.Default, desc = true, d
		}
		if i := strings.LastIndex(desc, " (alias of "); i >= 0 && strings.HasSuffix(desc, ")") {
			m.Alias = desc[i+len(" (alias of ") : len(desc)-1]
			desc = desc[:i]
		}
		m.Description = desc
		ms = append(ms, m)
	}
	return ms
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// ProbeIOUring says whether QEMU's block layer can use io_uring on file
// here (seccomp or an old kernel can forbid it): "io_uring" or "threads",
// with the reason. It needs qemu-io.
func ProbeIOUring(ctx context.Context, file string) (aio, why string) {
	qio, err := exec.LookPath("qemu-io")
	if err != nil {
		return "threads", "qemu-io not found to probe io_uring"
	}
	out, err := exec.CommandContext(ctx, qio, "-f", "raw", "-n", "-i", "io_uring", "-r", "-c", "read 0 4k", file).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "read 4096/4096") {
		return "threads", fmt.Sprintf("io_uring probe failed: %v %s", err, strings.TrimSpace(string(out)))
	}
	return "io_uring", "qemu-io -n -i io_uring reads a raw file here"
}
