package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/BurntSushi/toml"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// deploySnippet is the deploy/containerd/ file for containerd v.
func deploySnippet(v containerdVersion) string {
	name := "config-2.x.toml"
	switch {
	case v.Major < 2 && v.Minor <= 6:
		name = "config-1.6.toml"
	case v.Major < 2:
		name = "config-1.7.toml"
	}
	return filepath.Join(repoRoot, "deploy", "containerd", name)
}

// TestDeployContainerdSnippet starts the containerd under test with its
// deploy/containerd/ snippet as the whole configuration (root, state and
// socket of the test's own): it must load the snippet's kata-fsx proxy
// snapshotter and the CRI plugin with the kata-fsx runtime handler, and
// (1.7 and newer) that handler's snapshotter.
func TestDeployContainerdSnippet(t *testing.T) {
	v := containerdUnderTest(t)
	snippet, err := os.ReadFile(deploySnippet(v))
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("/tmp", "kds")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "containerd.sock")
	cfg, err := mergedDeployConfig(v, snippet, dir, sock)
	if err != nil {
		t.Fatalf("%s: %v", deploySnippet(v), err)
	}
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, cfg, 0o600); err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	var logMu sync.Mutex
	cmd := exec.Command(containerdBin("containerd"), "--config", cfgPath)
	cmd.Stdout = lockedWriter{&logMu, &log}
	cmd.Stderr = lockedWriter{&logMu, &log}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	logText := func() string { logMu.Lock(); defer logMu.Unlock(); return log.String() }
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("containerd log:\n%s", logText())
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var plugins string
	for {
		out, err := exec.CommandContext(ctx, containerdBin("ctr"), "-a", sock, "plugins", "ls").CombinedOutput()
		if err == nil {
			plugins = string(out)
			break
		}
		select {
		case <-exited:
			t.Fatalf("containerd %s exited with %s", v, deploySnippet(v))
		case <-ctx.Done():
			t.Fatalf("containerd %s never answered with %s: %v\n%s", v, deploySnippet(v), err, out)
		case <-time.After(200 * time.Millisecond):
		}
	}
	for _, want := range []string{`io\.containerd\.snapshotter\.v1\s+kata-fsx`, `io\.containerd\.grpc\.v1\s+cri`} {
		if !regexp.MustCompile(`(?m)^` + want + `\s+\S+\s+ok\s*$`).MatchString(plugins) {
			t.Errorf("containerd %s with %s: plugin %s not loaded:\n%s", v, filepath.Base(deploySnippet(v)), want, plugins)
		}
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	st, err := runtimeapi.NewRuntimeServiceClient(conn).Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		t.Fatalf("CRI status: %v", err)
	}
	var c struct {
		Containerd struct {
			Runtimes map[string]struct {
				Type        string `json:"runtimeType"`
				Snapshotter string `json:"snapshotter"`
			} `json:"runtimes"`
		} `json:"containerd"`
	}
	if err := json.Unmarshal([]byte(st.Info["config"]), &c); err != nil {
		t.Fatalf("CRI status config: %v\n%s", err, st.Info["config"])
	}
	rt, ok := c.Containerd.Runtimes[criRuntime]
	if !ok || rt.Type != "io.containerd.kata-fsx.v2" {
		t.Fatalf("containerd %s with %s: CRI has no kata-fsx runtime handler of type io.containerd.kata-fsx.v2: %s", v, filepath.Base(deploySnippet(v)), st.Info["config"])
	}
	want := "kata-fsx"
	if !v.AtLeast(1, 7) {
		want = ""
	}
	if rt.Snapshotter != want {
		t.Errorf("containerd %s: the kata-fsx handler's snapshotter is %q, want %q", v, rt.Snapshotter, want)
	}
	if v.Major >= 2 && !strings.Contains(logText(), `for snapshotter \"kata-fsx\"`) {
		t.Errorf("containerd %s: the images plugin has no runtime platform with snapshotter kata-fsx", v)
	}
}

// mergedDeployConfig is what an operator following deploy/containerd/
// runs: containerd v's default configuration (`containerd config default`,
// the usual /etc/containerd/config.toml) with the snippet merged in, table
// by table, then the test's own root, state, sockets and ports so that
// nothing of the host's containerd is touched.
func mergedDeployConfig(v containerdVersion, snippet []byte, dir, sock string) ([]byte, error) {
	out, err := exec.Command(containerdBin("containerd"), "config", "default").Output()
	if err != nil {
		return nil, fmt.Errorf("containerd config default: %w", err)
	}
	var base, add map[string]any
	if _, err := toml.Decode(string(out), &base); err != nil {
		return nil, fmt.Errorf("containerd %s's default configuration: %w", v, err)
	}
	if _, err := toml.Decode(string(snippet), &add); err != nil {
		return nil, fmt.Errorf("not TOML: %w", err)
	}
	if base["version"] != add["version"] {
		return nil, fmt.Errorf("configuration version %v, but containerd %s writes version %v", add["version"], v, base["version"])
	}
	mergeTables(base, add)
	cri := "io.containerd.grpc.v1.cri"
	over := map[string]any{
		"root": dir + "/root", "state": dir + "/state",
		"grpc":  map[string]any{"address": sock},
		"debug": map[string]any{"level": "debug"},
		"plugins": map[string]any{
			"io.containerd.internal.v1.opt": map[string]any{"path": dir + "/opt"},
			cri:                             map[string]any{"stream_server_address": "127.0.0.1", "stream_server_port": "0"},
			// One NRI socket per host (enabled by default in 2.x).
			"io.containerd.nri.v1.nri": map[string]any{"disable": true},
		},
	}
	mergeTables(base, over)
	var b bytes.Buffer
	if err := toml.NewEncoder(&b).Encode(base); err != nil {
		return nil, fmt.Errorf("encode: %w", err)
	}
	return b.Bytes(), nil
}

// mergeTables merges src into dst: tables key by key, other values replaced.
func mergeTables(dst, src map[string]any) {
	for k, sv := range src {
		st, sok := sv.(map[string]any)
		dt, dok := dst[k].(map[string]any)
		if sok && dok {
			mergeTables(dt, st)
			continue
		}
		dst[k] = sv
	}
}
