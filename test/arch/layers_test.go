// Package arch holds tests of the module's import graph: each package
// sits in one layer and imports only from its own layer or those below,
// and nothing but the binaries imports the front ends (shim, cli).
package arch

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

const module = "github.com/kata-fsx/kata-fsx/"

// layers lists every package of the module, bottom first. A package may
// import packages of its own layer and of the layers below it, never one
// above: the arrows run down, so a lower package can be read, tested and
// changed without the ones that use it. A new package must be placed
// here; TestLayers fails until it is.
var layers = []struct {
	name string
	pkgs []string
}{
	{"formats: configuration, wire protocols, on-disk and in-memory formats, test kit", []string{
		"config", "atomicfile",
		"agent/protocols", "agent/portfwd",
		"hypervisor/qmp",
		"virtio/virtq/internal/ring", "virtio/virtq",
		"blk/blockmap", "blk/iovec", "blk/ext4/disklayout",
		"blk/index", "blk/index/indextest",
		"content/registry",
		"metrics",
		"bench/chart", "bench/workload",
		"test/testenv", "test/helperproc", "test/logtest", "test/registrytest",
	}},
	{"host mechanisms: processes, mounts, devices, the VM, the agent client, the cache contract", []string{
		"childproc", "mount", "network",
		"nodecache",
		"vhostuser", "vsock",
		"hypervisor", "agent",
		"virtiofs", "host",
		"virtio/virtq/testdriver", "vhostuser/vhostusertest",
	}},
	{"the guest agent: what runs inside the VM, beside the host's mechanisms", []string{
		"guest/agent/boot", "guest/agent/cgroups", "guest/agent/channel", "guest/agent/forward", "guest/agent/initproc",
		"guest/agent/modules", "guest/agent/network", "guest/agent/pci", "guest/agent/process",
		"guest/agent/pty", "guest/agent/seccomp", "guest/agent/service", "guest/agent/storage",
	}},
	{"storage: the block backend and the lazy content path", []string{
		"blk", "blk/ext4", "blk/imagestore", "blk/overlay", "blk/rawimage", "blk/vhostblk",
		"blk/index/hostfs", "blk/index/oci", "blk/index/overlayfs", "blk/index/tarlayer",
		"blk/vhostblk/blktest",
		"content/lazyindex", "content/lazyimage", "content/store", "content/lazyroot",
		"content/lazyimage/lazyimagetest",
	}},
	{"node: the node's layout and caches", []string{
		"node",
	}},
	{"pods and layers: a sandbox, a materialized snapshot layer", []string{
		"sandbox", "sandbox/rootfs", "content/layerdir",
	}},
	{"services: the snapshotter, benchmarks", []string{
		"snapshotter", "bench",
	}},
	{"front ends: the shim, the CLI", []string{
		"shim", "cli",
	}},
	{"programs and the module's own tests", []string{
		"cmd/containerd-shim-kata-fsx-v2", "cmd/kata-fsx", "cmd/kata-fsx-overlay",
		"test/bench/blkbench", "test/bench/coldbench", "test/bench/densitybench", "test/bench/densitybench/density", "test/bench/imagebench",
		"cmd/kata-fsx-agent", "guest/image/mkimage",
		"test/guest", "test/guest/hostileagent",
		"test/e2e", "test/arch", "test/critest", "test/critest/fixture", "test/critest/report", "test/kube",
	}},
}

// frontEnds may be imported only by the binaries that run them: the
// shim and the CLI are where behaviour is wired, not libraries.
var frontEnds = map[string]string{
	"shim": "cmd/containerd-shim-kata-fsx-v2",
	"cli":  "cmd/kata-fsx",
}

// frontEndTests are the external test packages that import a front end
// anyway, each with why; the list only shrinks.
var frontEndTests = map[string]string{
	// TestEnvReportsWhatThePodGets checks that `kata-fsx env` reports what
	// the sandbox boots, through sandbox.PlanForTest, which only sandbox's
	// own tests see; it moves to cli once the sandbox exposes its plan.
	"sandbox -> cli": "env and the sandbox agree",
}

// pkg is one package of the module as `go list -json` describes it, its
// paths relative to the module.
type pkg struct {
	ImportPath   string
	Imports      []string
	TestImports  []string
	XTestImports []string
}

// graph lists the module's packages with their imports of the module's
// own packages.
func graph(t *testing.T) []pkg {
	t.Helper()
	gobin := testenv.Tool(t, "go", "golang-go")
	cmd := exec.Command(gobin, "list", "-e", "-json=ImportPath,Imports,TestImports,XTestImports", "./...")
	cmd.Dir = "../.."
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.String())
	}
	var pkgs []pkg
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p pkg
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("go list output: %v", err)
		}
		p.ImportPath = strings.TrimPrefix(p.ImportPath, module)
		if strings.HasPrefix(p.ImportPath, "build/") {
			// build/ holds generated files and fetched fixtures (an npm
			// tree may carry Go files), none of them the module's code.
			continue
		}
		p.Imports, p.TestImports, p.XTestImports = own(p.Imports), own(p.TestImports), own(p.XTestImports)
		pkgs = append(pkgs, p)
	}
	if len(pkgs) == 0 {
		t.Fatal("go list found no package")
	}
	return pkgs
}

// own keeps the module's packages of imports, relative to the module.
func own(imports []string) []string {
	var out []string
	for _, i := range imports {
		if rel, ok := strings.CutPrefix(i, module); ok {
			out = append(out, rel)
		}
	}
	return out
}

// layerOf maps each listed package to its layer's index, failing on a
// package listed twice.
func layerOf(t *testing.T) map[string]int {
	t.Helper()
	m := map[string]int{}
	for i, l := range layers {
		for _, p := range l.pkgs {
			if j, ok := m[p]; ok {
				t.Errorf("%s is listed in layer %d (%s) and layer %d (%s)", p, j, layers[j].name, i, l.name)
			}
			m[p] = i
		}
	}
	return m
}

// TestLayers: every package is in a layer, and none imports a package of
// a higher layer, in its code or in its in-package tests (which compile
// into it). External test packages (package x_test) may import upwards,
// as a test of a format may use a higher layer's fixtures.
func TestLayers(t *testing.T) {
	layer := layerOf(t)
	seen := map[string]bool{}
	var problems []string
	for _, p := range graph(t) {
		seen[p.ImportPath] = true
		from, ok := layer[p.ImportPath]
		if !ok {
			problems = append(problems, fmt.Sprintf("%s is in no layer: add it to one in test/arch/layers_test.go", p.ImportPath))
			continue
		}
		for _, set := range []struct {
			what    string
			imports []string
		}{{"imports", p.Imports}, {"imports in its tests", p.TestImports}} {
			for _, i := range set.imports {
				to, ok := layer[i]
				if ok && to > from {
					problems = append(problems, fmt.Sprintf("%s (layer %d, %s) %s %s (layer %d, %s)",
						p.ImportPath, from, layers[from].name, set.what, i, to, layers[to].name))
				}
			}
		}
	}
	for p := range layer {
		if !seen[p] {
			problems = append(problems, fmt.Sprintf("%s is listed in a layer but is no package of the module: remove it", p))
		}
	}
	sort.Strings(problems)
	for _, p := range problems {
		t.Error(p)
	}
}

// TestNothingImportsFrontEnds: shim and cli are imported by their binary
// alone, in code and in tests (but the listed frontEndTests).
func TestNothingImportsFrontEnds(t *testing.T) {
	used := map[string]bool{}
	for _, p := range graph(t) {
		for _, i := range append(append(p.Imports, p.TestImports...), p.XTestImports...) {
			bin, ok := frontEnds[i]
			if !ok || p.ImportPath == bin || p.ImportPath == i {
				continue
			}
			if k := p.ImportPath + " -> " + i; frontEndTests[k] != "" && !slices.Contains(p.Imports, i) && !slices.Contains(p.TestImports, i) {
				used[k] = true
				continue
			}
			t.Errorf("%s imports %s: only %s may", p.ImportPath, i, bin)
		}
	}
	for k := range frontEndTests {
		if !used[k] {
			t.Errorf("frontEndTests lists %s, which no external test imports any more: remove it", k)
		}
	}
}
