package cli

import (
	"encoding/json"
	"sort"
	"strings"
	"testing"

	"github.com/BurntSushi/toml"
)

// kataEnvPaths is the output of `kata-runtime env` (format 1.0.27,
// src/runtime/cmd/kata-runtime/kata-env.go in Kata's repository): every
// field's path and its kind. A tool written against kata-runtime env reads
// these paths; kata-fsx env must have each one with the same kind.
var kataEnvPaths = map[string]string{
	"Kernel":                                    "object",
	"Kernel.Path":                               "string",
	"Kernel.Parameters":                         "string",
	"Meta":                                      "object",
	"Meta.Version":                              "string",
	"Image":                                     "object",
	"Image.Path":                                "string",
	"Initrd":                                    "object",
	"Initrd.Path":                               "string",
	"Hypervisor":                                "object",
	"Hypervisor.MachineType":                    "string",
	"Hypervisor.Version":                        "string",
	"Hypervisor.Path":                           "string",
	"Hypervisor.BlockDeviceDriver":              "string",
	"Hypervisor.EntropySource":                  "string",
	"Hypervisor.SharedFS":                       "string",
	"Hypervisor.VirtioFSDaemon":                 "string",
	"Hypervisor.SocketPath":                     "string",
	"Hypervisor.Msize9p":                        "number",
	"Hypervisor.MemorySlots":                    "number",
	"Hypervisor.HotPlugVFIO":                    "string",
	"Hypervisor.ColdPlugVFIO":                   "string",
	"Hypervisor.PCIeRootPort":                   "number",
	"Hypervisor.PCIeSwitchPort":                 "number",
	"Hypervisor.Debug":                          "bool",
	"Hypervisor.SecurityInfo":                   "object",
	"Hypervisor.SecurityInfo.Rootless":          "bool",
	"Hypervisor.SecurityInfo.DisableSeccomp":    "bool",
	"Hypervisor.SecurityInfo.GuestHookPath":     "string",
	"Hypervisor.SecurityInfo.EnableAnnotations": "[]string",
	"Hypervisor.SecurityInfo.ConfidentialGuest": "bool",
	"Runtime":                                   "object",
	"Runtime.Config":                            "object",
	"Runtime.Config.Path":                       "string",
	"Runtime.Path":                              "string",
	"Runtime.GuestSeLinuxLabel":                 "string",
	"Runtime.Experimental":                      "[]object",
	"Runtime.Version":                           "object",
	"Runtime.Version.OCI":                       "string",
	"Runtime.Version.Version":                   "object",
	"Runtime.Version.Version.Semver":            "string",
	"Runtime.Version.Version.Commit":            "string",
	"Runtime.Version.Version.Major":             "number",
	"Runtime.Version.Version.Minor":             "number",
	"Runtime.Version.Version.Patch":             "number",
	"Runtime.Debug":                             "bool",
	"Runtime.Trace":                             "bool",
	"Runtime.DisableGuestSeccomp":               "bool",
	"Runtime.DisableNewNetNs":                   "bool",
	"Runtime.SandboxCgroupOnly":                 "bool",
	"Host":                                      "object",
	"Host.AvailableGuestProtections":            "[]string",
	"Host.Kernel":                               "string",
	"Host.Architecture":                         "string",
	"Host.Distro":                               "object",
	"Host.Distro.Name":                          "string",
	"Host.Distro.Version":                       "string",
	"Host.CPU":                                  "object",
	"Host.CPU.Vendor":                           "string",
	"Host.CPU.Model":                            "string",
	"Host.CPU.CPUs":                             "number",
	"Host.Memory":                               "object",
	"Host.Memory.Total":                         "number",
	"Host.Memory.Free":                          "number",
	"Host.Memory.Available":                     "number",
	"Host.VMContainerCapable":                   "bool",
	"Host.SupportVSocks":                        "bool",
	"Agent":                                     "object",
	"Agent.Debug":                               "bool",
	"Agent.Trace":                               "bool",
}

// lookup walks a dotted path through decoded JSON or TOML objects.
func lookup(doc map[string]any, path string) (any, bool) {
	var v any = doc
	for _, k := range strings.Split(path, ".") {
		m, ok := v.(map[string]any)
		if !ok {
			return nil, false
		}
		if v, ok = m[k]; !ok {
			return nil, false
		}
	}
	return v, true
}

// kindOf names a decoded value's kind in kataEnvPaths' terms; JSON numbers
// decode as float64, TOML integers as int64.
func kindOf(v any) string {
	switch x := v.(type) {
	case string:
		return "string"
	case bool:
		return "bool"
	case float64, int64:
		return "number"
	case map[string]any:
		return "object"
	case []any:
		if len(x) == 0 {
			return "[]"
		}
		return "[]" + kindOf(x[0])
	case []map[string]any:
		return "[]object"
	}
	return "unknown"
}

func checkKataPaths(t *testing.T, format string, doc map[string]any) {
	t.Helper()
	paths := make([]string, 0, len(kataEnvPaths))
	for p := range kataEnvPaths {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		want := kataEnvPaths[p]
		v, ok := lookup(doc, p)
		if !ok {
			t.Errorf("%s: kata-runtime env's %s is missing", format, p)
			continue
		}
		got := kindOf(v)
		if got == "[]" && strings.HasPrefix(want, "[]") {
			continue // an empty list has no element kind to compare
		}
		if got != want {
			t.Errorf("%s: %s is %s (%#v), kata-runtime env has %s", format, p, got, v, want)
		}
	}
}

// TestEnvKeepsKataRuntimeEnvStructure holds every field of kata-runtime
// env at its path with its kind, in --json and in TOML.
func TestEnvKeepsKataRuntimeEnvStructure(t *testing.T) {
	cfg := writeConfig(t, "[hypervisor.qemu]\nvirtio_fs_daemon = \""+fakeDaemon(t)+"\"\nenable_annotations = [\"shared_fs\"]\n")
	code, out, stderr := run(t, "env", "--json", "--config", cfg)
	if code != 0 {
		t.Fatalf("env --json: exit %d: %s", code, stderr)
	}
	var doc map[string]any
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatal(err)
	}
	checkKataPaths(t, "json", doc)

	code, out, stderr = run(t, "env", "--config", cfg)
	if code != 0 {
		t.Fatalf("env: exit %d: %s", code, stderr)
	}
	doc = nil
	if _, err := toml.Decode(out, &doc); err != nil {
		t.Fatalf("env's TOML does not decode: %v\n%s", err, out)
	}
	checkKataPaths(t, "toml", doc)
}

func TestVersionInfo(t *testing.T) {
	cases := map[string]VersionInfo{
		"1.2.3":                    {Semver: "1.2.3", Major: 1, Minor: 2, Patch: 3},
		"v3.10.1-4-gabc1234":       {Semver: "3.10.1-4-gabc1234", Commit: "abc1234", Major: 3, Minor: 10, Patch: 1},
		"v3.10.1-4-gabc1234-dirty": {Semver: "3.10.1-4-gabc1234-dirty", Commit: "abc1234", Major: 3, Minor: 10, Patch: 1},
		"0.0.0-dev":                {Semver: "0.0.0-dev"},
		"2234567-dirty":            {Semver: "2234567-dirty", Commit: "2234567"},
	}
	for in, want := range cases {
		got := versionInfo(in)
		if want.Commit == "" {
			want.Commit = got.Commit // whatever the toolchain recorded for this test binary
		}
		if got != want {
			t.Errorf("versionInfo(%q) = %+v, want %+v", in, got, want)
		}
	}
}
