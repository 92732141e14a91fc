package kube

import (
	"bufio"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/testenv"
)

// repoRoot is the checkout: the tests run in test/kube.
func repoRoot(t *testing.T) string {
	t.Helper()
	abs, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return abs
}

// install builds the kata-fsx-deploy image from this tree, imports it and
// applies the DaemonSet with the node's paths pointed into the cluster's
// private directory, then waits for the node's label; it returns the
// containerd configuration as it was before.
func (c *cluster) install(ctx context.Context, t *testing.T) []byte {
	t.Helper()
	top := repoRoot(t)
	guest := os.Getenv(envGuestDir)
	if guest == "" {
		guest = filepath.Join(top, "build", "guest")
	}
	for _, f := range []string{filepath.Join(top, "bin", "containerd-shim-kata-fsx-v2"), filepath.Join(guest, "initrd.img")} {
		if _, err := os.Stat(f); err != nil {
			testenv.Missing(t, "%v (make build guest)", err)
		}
	}
	before, err := os.ReadFile(c.containerdConf())
	if err != nil {
		t.Fatal(err)
	}
	image := c.path("kata-fsx-deploy.tar")
	timed(t, "kata-fsx-deploy image", func() error {
		cmd := exec.CommandContext(ctx, filepath.Join(top, "deploy/kubernetes/installer/build-image.sh"), image)
		cmd.Env = append(os.Environ(), "KUBECTL="+filepath.Join(c.bin, "kubectl"), "GUEST_DIR="+guest)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%w\n%s", err, out)
		}
		_, err := c.ctr(ctx, "images", "import", image)
		return err
	})
	manifest, err := os.ReadFile(filepath.Join(top, "deploy/kubernetes/kata-fsx-deploy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	// The node's paths, as a node would have them, are the cluster's own.
	install := c.path("opt-kata-fsx")
	m := string(manifest)
	for _, r := range [][2]string{
		{"value: /opt/kata-fsx", "value: " + install},
		{"mountPath: /opt/kata-fsx", "mountPath: " + install},
		{"path: /opt/kata-fsx", "path: " + install},
		{"value: /etc/containerd/config.toml", "value: " + c.containerdConf() + `
            - name: CONTAINERD_RESTART
              value: "kill -TERM $(cat ` + c.containerdPidFile() + `)"
            - name: KATA_FSX_STATE_DIR
              value: ` + c.path("kata-fsx-state") + `
            - name: KATA_FSX_RUN_DIR
              value: ` + c.runDir},
		{"mountPath: /etc/containerd", "mountPath: " + filepath.Dir(c.containerdConf())},
		{"path: /etc/containerd", "path: " + filepath.Dir(c.containerdConf())},
	} {
		if !strings.Contains(m, r[0]) {
			t.Fatalf("deploy/kubernetes/kata-fsx-deploy.yaml has no %q to point at the test's directory", r[0])
		}
		m = strings.ReplaceAll(m, r[0], r[1])
	}
	c.deployManifest = m
	starts := c.starts("containerd")
	timed(t, "kata-fsx installed by its DaemonSet", func() error {
		if out, err := c.kubectlIn(ctx, m, "apply", "-f", "-"); err != nil {
			return fmt.Errorf("%w\n%s", err, out)
		}
		return c.waitFor(ctx, "the node's kata-fsx label", func() error {
			out, err := c.kubectl(ctx, "get", "node", nodeName, "-o", `jsonpath={.metadata.labels.katacontainers\.io/kata-fsx-runtime}`)
			if err != nil {
				return err
			}
			if out != "true" {
				logs, _ := c.kubectl(ctx, "logs", "-n", "kube-system", "daemonset/kata-fsx-deploy", "--tail", "5")
				return fmt.Errorf("label %q; installer: %s", out, logs)
			}
			return nil
		})
	})
	rc, err := os.ReadFile(filepath.Join(top, "deploy/kubernetes/runtimeclasses.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if out, err := c.kubectlIn(ctx, string(rc), "apply", "-f", "-"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	// containerd came back with the handlers.
	if err := c.waitFor(ctx, "containerd with the kata-fsx handlers", func() error {
		if _, err := c.ctr(ctx, "version"); err != nil {
			return err
		}
		b, err := os.ReadFile(c.containerdConf())
		if err != nil || !strings.Contains(string(b), "runtimes.kata-fsx-blk]") {
			return fmt.Errorf("the configuration has no kata-fsx-blk handler (%v)", err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := c.waitFor(ctx, "containerd's restart", func() error {
		if n := c.starts("containerd"); n <= starts {
			return fmt.Errorf("containerd started %d times, %d before the DaemonSet", n, starts)
		}
		return nil
	}); err != nil {
		t.Errorf("the installer did not restart containerd: %v", err)
	}
	return before
}

// uninstall deletes the DaemonSet and waits for the installer to have
// undone its work.
func (c *cluster) uninstall(ctx context.Context, t *testing.T, before []byte) {
	t.Helper()
	starts := c.starts("containerd")
	timed(t, "kata-fsx removed with its DaemonSet", func() error {
		// The DaemonSet first: its pods undo their work with the service
		// account's rights, which the rest of the manifest holds.
		if out, err := c.kubectl(ctx, "delete", "daemonset", "kata-fsx-deploy", "-n", "kube-system", "--wait=true"); err != nil {
			return fmt.Errorf("%w\n%s", err, out)
		}
		defer func() {
			if out, err := c.kubectlIn(ctx, c.deployManifest, "delete", "-f", "-", "--ignore-not-found"); err != nil {
				t.Errorf("delete the rest of kata-fsx-deploy.yaml: %v\n%s", err, out)
			}
		}()
		if err := c.waitFor(ctx, "the installer's undo", func() error {
			out, err := c.kubectl(ctx, "get", "node", nodeName, "-o", `jsonpath={.metadata.labels.katacontainers\.io/kata-fsx-runtime}`)
			if err != nil {
				return err
			}
			if out != "" {
				return fmt.Errorf("the node still has label %q", out)
			}
			return nil
		}); err != nil {
			return err
		}
		_, err := c.kubectl(ctx, "wait", "--for=delete", "pod", "-l", "name=kata-fsx-deploy", "-n", "kube-system", "--timeout=3m")
		return err
	})
	// The restart is a kill, then the supervisor's start a second later.
	if err := c.waitFor(ctx, "containerd's restart", func() error {
		if n := c.starts("containerd"); n <= starts {
			return fmt.Errorf("containerd started %d times, %d before the removal", n, starts)
		}
		return nil
	}); err != nil {
		t.Errorf("the removal did not restart containerd: %v", err)
	}
	after, err := os.ReadFile(c.containerdConf())
	if err != nil {
		t.Fatal(err)
	}
	if string(after) != string(before) {
		t.Errorf("containerd's configuration after the DaemonSet's removal differs from before its installation:\n--- before\n%s\n--- after\n%s", before, after)
	}
	if _, err := os.Stat(c.path("opt-kata-fsx", "bin")); err == nil {
		t.Errorf("%s is still there after the DaemonSet's removal", c.path("opt-kata-fsx", "bin"))
	}
	if _, err := os.Stat(c.containerdConf() + ".kata-fsx-orig"); err == nil {
		t.Errorf("the installer's backup of containerd's configuration is still there")
	}
}

// podYAML is a pod of the busybox image under runtimeClass running sh -c
// cmd, with a configMap, a secret, downward API and a memory emptyDir
// mounted, and the configMap it reads.
func podYAML(name, runtimeClass, cmd string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: ConfigMap
metadata:
  name: %[1]s-cfg
data:
  greeting: v1
---
apiVersion: v1
kind: Secret
metadata:
  name: %[1]s-secret
stringData:
  password: s3cret
---
apiVersion: v1
kind: Pod
metadata:
  name: %[1]s
  labels: {app: %[1]s}
spec:
  runtimeClassName: %[2]s
  terminationGracePeriodSeconds: 5
  containers:
  - name: main
    image: %[3]s
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", %[4]q]
    ports:
    - containerPort: 8080
    # The kubelet's three kinds of probe: exec through CRI's ExecSync,
    # HTTP and TCP to the pod's address on the bridge.
    startupProbe:
      exec: {command: ["cat", "/www/index.html"]}
      periodSeconds: 1
      failureThreshold: 60
    readinessProbe:
      httpGet: {path: /, port: 8080}
      periodSeconds: 2
    livenessProbe:
      tcpSocket: {port: 8080}
      periodSeconds: 2
    volumeMounts:
    - {name: cfg, mountPath: /cfg}
    - {name: secret, mountPath: /secret}
    - {name: podinfo, mountPath: /podinfo}
    - {name: scratch, mountPath: /scratch}
    - {name: disk, mountPath: /disk}
    - {name: token, mountPath: /token}
  volumes:
  - name: cfg
    configMap: {name: %[1]s-cfg}
  - name: secret
    secret: {secretName: %[1]s-secret}
  - name: podinfo
    downwardAPI:
      items:
      - path: labels
        fieldRef: {fieldPath: metadata.labels}
  - name: scratch
    emptyDir: {medium: Memory}
  - name: disk
    emptyDir: {}
  - name: token
    projected:
      sources:
      - serviceAccountToken: {path: token, expirationSeconds: 3600, audience: kata-fsx-test}
`, name, runtimeClass, busyboxImage, cmd)
}

// TestKube: a real kubelet creates kata-fsx pods through containerd. The
// installer DaemonSet installs kata-fsx, the RuntimeClasses pick the
// backend, kubectl reaches the pods (exec, logs, port-forward), and the
// DaemonSet's removal leaves containerd's configuration as it was.
func TestKube(t *testing.T) {
	c := startCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	before := c.install(ctx, t)

	backends := []struct {
		class, root string
		rootRe      *regexp.Regexp
	}{
		{"kata-fsx-blk", "ext4 on a virtio-blk disk", regexp.MustCompile(`^/dev/vd[a-z]+ / ext4 `)},
		{"kata-fsx-fs", "virtiofs", regexp.MustCompile(`^\S+ / virtiofs `)},
	}
	for _, b := range backends {
		t.Run(b.class, func(t *testing.T) {
			name := "web-" + strings.TrimPrefix(b.class, "kata-fsx-")
			cmd := "echo started; mkdir -p /www && echo from-" + name + " > /www/index.html && exec httpd -f -p 8080 -h /www"
			timed(t, "pod "+name+" Ready", func() error {
				if out, err := c.kubectlIn(ctx, podYAML(name, b.class, cmd), "apply", "-f", "-"); err != nil {
					return fmt.Errorf("%w\n%s", err, out)
				}
				_, err := c.kubectl(ctx, "wait", "--for=condition=Ready", "pod/"+name, "--timeout=5m")
				return err
			})
			defer func() {
				if out, err := c.kubectl(ctx, "delete", "pod/"+name, "configmap/"+name+"-cfg", "secret/"+name+"-secret", "--wait=true", "--timeout=3m"); err != nil {
					t.Errorf("delete pod %s: %v\n%s", name, err, out)
				}
			}()
			// Ready needed the probes to pass; the liveness probe keeps
			// passing while the checks below run (restart count 0 at the end).
			defer func() {
				out, err := c.kubectl(ctx, "get", "pod", name, "-o", `jsonpath={.status.containerStatuses[0].restartCount}`)
				if err != nil || out != "0" {
					t.Errorf("pod %s: restart count %q (%v), want 0: its liveness probe failed", name, out, err)
				}
			}()
			mounts, err := c.kubectl(ctx, "exec", name, "--", "cat", "/proc/mounts")
			if err != nil {
				t.Fatal(err)
			}
			root := ""
			for _, l := range strings.Split(mounts, "\n") {
				if f := strings.Fields(l); len(f) > 2 && f[1] == "/" {
					root = l
				}
			}
			if !b.rootRe.MatchString(root) {
				t.Errorf("runtimeClassName %s: the container's root is %q, want %s", b.class, root, b.root)
			}
			// A VM: the guest's own kernel, not the node's.
			if out, err := c.kubectl(ctx, "exec", name, "--", "cat", "/proc/version"); err != nil {
				t.Error(err)
			} else if host, _ := os.ReadFile("/proc/version"); out == string(host) {
				t.Errorf("the pod runs on the node's kernel: %s", out)
			}
			if out, err := c.kubectl(ctx, "logs", name); err != nil || !strings.Contains(out, "started") {
				t.Errorf("kubectl logs %s: %q, %v", name, out, err)
			}
			if out, err := c.kubectlIn(ctx, "from stdin\n", "exec", "-i", name, "--", "cat"); err != nil || out != "from stdin\n" {
				t.Errorf("kubectl exec -i %s -- cat: %q, %v", name, out, err)
			}
			if got := c.portForwardGet(ctx, t, name, 8080); got != "from-"+name+"\n" {
				t.Errorf("kubectl port-forward %s 8080: %q, want from-%s", name, got, name)
			}
			c.checkVolumes(ctx, t, name)
			c.checkService(ctx, t, name, b.class)
			c.checkExits(ctx, t, b.class)
			c.checkTermination(ctx, t, b.class)
		})
	}
	c.uninstall(ctx, t, before)
	c.checkNothingLeft(t)
}

// checkVolumes reads the pod's volumes through kubectl exec, copies a file
// in with kubectl cp, and updates the configMap: the kubelet's new file
// must reach the running pod.
func (c *cluster) checkVolumes(ctx context.Context, t *testing.T, name string) {
	t.Helper()
	for _, v := range []struct{ path, want string }{
		{"/cfg/greeting", "v1"},
		{"/secret/password", "s3cret"},
		{"/podinfo/labels", `app="` + name + `"`},
	} {
		if out, err := c.kubectl(ctx, "exec", name, "--", "cat", v.path); err != nil || out != v.want {
			t.Errorf("pod %s: %s is %q (%v), want %q", name, v.path, out, err, v.want)
		}
	}
	if out, err := c.kubectl(ctx, "exec", name, "--", "sh", "-c", "grep ' /scratch ' /proc/mounts"); err != nil || !strings.Contains(out, "tmpfs") {
		t.Errorf("pod %s: emptyDir medium Memory at /scratch: %q (%v), want a tmpfs", name, out, err)
	}
	if out, err := c.kubectl(ctx, "exec", name, "--", "sh", "-c", "echo on-disk > /disk/f && cat /disk/f"); err != nil || out != "on-disk\n" {
		t.Errorf("pod %s: the disk emptyDir at /disk: %q (%v)", name, out, err)
	}
	// A JSON web token: three base64url parts, the payload naming the
	// audience asked for.
	if out, err := c.kubectl(ctx, "exec", name, "--", "cat", "/token/token"); err != nil {
		t.Errorf("pod %s: projected service account token: %v", name, err)
	} else if parts := strings.Split(out, "."); len(parts) != 3 {
		t.Errorf("pod %s: projected service account token %.40q is not a JWT", name, out)
	} else if payload, err := base64.RawURLEncoding.DecodeString(parts[1]); err != nil || !strings.Contains(string(payload), `"aud":["kata-fsx-test"]`) {
		t.Errorf("pod %s: the token's payload %q (%v) names no audience kata-fsx-test", name, payload, err)
	}
	local := filepath.Join(t.TempDir(), "copied")
	if err := os.WriteFile(local, []byte("through kubectl cp\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := c.kubectl(ctx, "cp", local, name+":/tmp/copied"); err != nil {
		t.Errorf("kubectl cp into %s: %v\n%s", name, err, out)
	} else if out, err := c.kubectl(ctx, "exec", name, "--", "cat", "/tmp/copied"); err != nil || out != "through kubectl cp\n" {
		t.Errorf("pod %s: the file kubectl cp wrote reads %q (%v)", name, out, err)
	}
	start := time.Now()
	if out, err := c.kubectl(ctx, "patch", "configmap", name+"-cfg", "--type=merge", "-p", `{"data":{"greeting":"v2"}}`); err != nil {
		t.Fatalf("update configmap: %v\n%s", err, out)
	}
	err := testenv.Wait(3*time.Minute, func() (bool, error) {
		out, err := c.kubectl(ctx, "exec", name, "--", "cat", "/cfg/greeting")
		if err != nil {
			return false, err
		}
		return out == "v2", fmt.Errorf("/cfg/greeting is %q", out)
	})
	if err != nil {
		t.Errorf("pod %s: the configMap's update did not reach the running pod: %v", name, err)
	} else {
		t.Logf("pod %s: the configMap's update reached the pod in %s", name, time.Since(start).Round(100*time.Millisecond))
	}
}

// checkService runs a Deployment of 3 replicas under runtimeClass behind
// a ClusterIP Service, and from pod client reaches each replica at its
// pod IP and the Service's address (kube-proxy's rules in the cluster's
// namespace), which must spread the requests over the replicas.
func (c *cluster) checkService(ctx context.Context, t *testing.T, client, runtimeClass string) {
	t.Helper()
	name := "svc-" + strings.TrimPrefix(runtimeClass, "kata-fsx-")
	manifest := fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata:
  name: %[1]s
spec:
  replicas: 3
  selector:
    matchLabels: {app: %[1]s}
  template:
    metadata:
      labels: {app: %[1]s}
    spec:
      runtimeClassName: %[2]s
      terminationGracePeriodSeconds: 5
      containers:
      - name: web
        image: %[3]s
        imagePullPolicy: Never
        command: ["/bin/sh", "-c", "mkdir -p /www && hostname > /www/index.html && exec httpd -f -p 8080 -h /www"]
        ports:
        - containerPort: 8080
---
apiVersion: v1
kind: Service
metadata:
  name: %[1]s
spec:
  selector: {app: %[1]s}
  ports:
  - port: 80
    targetPort: 8080
`, name, runtimeClass, busyboxImage)
	timed(t, "Deployment "+name+" of 3 replicas available", func() error {
		if out, err := c.kubectlIn(ctx, manifest, "apply", "-f", "-"); err != nil {
			return fmt.Errorf("%w\n%s", err, out)
		}
		_, err := c.kubectl(ctx, "rollout", "status", "deployment/"+name, "--timeout=6m")
		return err
	})
	defer func() {
		if out, err := c.kubectlIn(ctx, manifest, "delete", "-f", "-", "--wait=true", "--timeout=3m"); err != nil {
			t.Errorf("delete %s: %v\n%s", name, err, out)
		}
		if _, err := c.kubectl(ctx, "wait", "--for=delete", "pod", "-l", "app="+name, "--timeout=3m"); err != nil {
			t.Errorf("the replicas of %s did not go: %v", name, err)
		}
	}()
	out, err := c.kubectl(ctx, "get", "pods", "-l", "app="+name, "-o", `jsonpath={range .items[*]}{.metadata.name} {.status.podIP}{"\n"}{end}`)
	if err != nil {
		t.Fatal(err)
	}
	replicas := map[string]bool{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(l)
		if len(f) != 2 {
			t.Fatalf("replicas of %s: %q", name, out)
		}
		replicas[f[0]] = true
		got, err := c.kubectl(ctx, "exec", client, "--", "sh", "-c", httpGet(f[1], "8080"))
		if err != nil || strings.TrimSpace(got) != f[0] {
			t.Errorf("pod %s reaching replica %s at %s: %q, %v", client, f[0], f[1], got, err)
		}
	}
	if len(replicas) != 3 {
		t.Fatalf("%d replicas of %s, want 3: %q", len(replicas), name, out)
	}
	ip, err := c.kubectl(ctx, "get", "service", name, "-o", "jsonpath={.spec.clusterIP}")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for i := 0; i < 20; i++ {
		got, err := c.kubectl(ctx, "exec", client, "--", "sh", "-c", httpGet(ip, "80"))
		if err != nil {
			t.Errorf("pod %s reaching Service %s at %s: %v", client, name, ip, err)
			break
		}
		host := strings.TrimSpace(got)
		if !replicas[host] {
			t.Errorf("Service %s answered %q, not one of its replicas", name, host)
		}
		seen[host]++
	}
	if len(seen) < 2 {
		t.Errorf("20 requests to Service %s reached %v: want them spread over the replicas", name, seen)
	}
	t.Logf("Service %s (%s): 20 requests from pod %s reached %v", name, ip, client, seen)
}

// jobYAML is a Job of one busybox container under runtimeClass running
// sh -c cmd once, never retried.
func jobYAML(name, runtimeClass, cmd string) string {
	return fmt.Sprintf(`apiVersion: batch/v1
kind: Job
metadata:
  name: %s
spec:
  backoffLimit: 0
  template:
    spec:
      runtimeClassName: %s
      restartPolicy: Never
      containers:
      - name: main
        image: %s
        imagePullPolicy: Never
        command: ["/bin/sh", "-c", %q]
`, name, runtimeClass, busyboxImage, cmd)
}

// checkExits: a Job's container exit code reaches the Job's pod status
// and the Job fails, one that exits 0 completes, and a crash-looping
// container is restarted by the kubelet, its restart count rising.
func (c *cluster) checkExits(ctx context.Context, t *testing.T, runtimeClass string) {
	t.Helper()
	short := strings.TrimPrefix(runtimeClass, "kata-fsx-")
	job, crash := "job-"+short, "crash-"+short
	manifest := jobYAML(job, runtimeClass, "echo working; exit 3") + "---\n" + jobYAML(job+"-ok", runtimeClass, "echo done") + fmt.Sprintf(`---
apiVersion: v1
kind: Pod
metadata:
  name: %[1]s
spec:
  runtimeClassName: %[2]s
  terminationGracePeriodSeconds: 5
  containers:
  - name: main
    image: %[3]s
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", "echo crashing; exit 1"]
`, crash, runtimeClass, busyboxImage)
	if out, err := c.kubectlIn(ctx, manifest, "apply", "-f", "-"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	defer func() {
		if out, err := c.kubectlIn(ctx, manifest, "delete", "-f", "-", "--wait=true", "--timeout=3m", "--cascade=foreground"); err != nil {
			t.Errorf("delete %s and %s: %v\n%s", job, crash, err, out)
		}
	}()
	timed(t, "Job "+job+" failed with its exit code", func() error {
		if _, err := c.kubectl(ctx, "wait", "--for=condition=Failed", "job/"+job, "--timeout=4m"); err != nil {
			return err
		}
		out, err := c.kubectl(ctx, "get", "pods", "-l", "job-name="+job, "-o", `jsonpath={.items[0].status.containerStatuses[0].state.terminated.exitCode}`)
		if err != nil {
			return err
		}
		if out != "3" {
			return fmt.Errorf("the Job's pod reports exit code %q, want 3", out)
		}
		return nil
	})
	timed(t, "Job "+job+"-ok complete", func() error {
		if _, err := c.kubectl(ctx, "wait", "--for=condition=Complete", "job/"+job+"-ok", "--timeout=4m"); err != nil {
			return err
		}
		out, err := c.kubectl(ctx, "logs", "job/"+job+"-ok")
		if err != nil || out != "done\n" {
			return fmt.Errorf("the Job's log %q (%v), want done", out, err)
		}
		return nil
	})
	timed(t, "pod "+crash+" restarted twice by the kubelet", func() error {
		return c.waitFor(ctx, "restarts", func() error {
			out, err := c.kubectl(ctx, "get", "pod", crash, "-o", `jsonpath={.status.containerStatuses[0].restartCount} {.status.containerStatuses[0].lastState.terminated.exitCode}`)
			if err != nil {
				return err
			}
			var n, code int
			if _, err := fmt.Sscan(out, &n, &code); err != nil || n < 2 || code != 1 {
				return fmt.Errorf("restartCount and last exit code %q, want 2 or more and 1", out)
			}
			return nil
		})
	})
}

// checkTermination deletes a pod whose preStop hook and SIGTERM handler
// write to a hostPath volume: both must have run, in that order, and the
// process must have ended on the signal, not on the grace period's kill.
func (c *cluster) checkTermination(ctx context.Context, t *testing.T, runtimeClass string) {
	t.Helper()
	name := "term-" + strings.TrimPrefix(runtimeClass, "kata-fsx-")
	dir := c.path("hostpath", name)
	if err := os.MkdirAll(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	manifest := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %[1]s
spec:
  runtimeClassName: %[2]s
  terminationGracePeriodSeconds: 60
  containers:
  - name: main
    image: %[3]s
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", "trap 'echo term >> /host/events; exit 0' TERM; echo started >> /host/events; while :; do sleep 1; done"]
    lifecycle:
      preStop:
        exec: {command: ["/bin/sh", "-c", "echo prestop >> /host/events"]}
    volumeMounts:
    - {name: host, mountPath: /host}
  volumes:
  - name: host
    hostPath: {path: %[4]s, type: Directory}
`, name, runtimeClass, busyboxImage, dir)
	events := filepath.Join(dir, "events")
	timed(t, "pod "+name+" with a hostPath volume started", func() error {
		if out, err := c.kubectlIn(ctx, manifest, "apply", "-f", "-"); err != nil {
			return fmt.Errorf("%w\n%s", err, out)
		}
		return c.waitFor(ctx, "the pod's first line in the hostPath volume", func() error {
			b, err := os.ReadFile(events)
			if err != nil || string(b) != "started\n" {
				return fmt.Errorf("%s: %q (%v)", events, b, err)
			}
			return nil
		})
	})
	start := time.Now()
	if out, err := c.kubectl(ctx, "delete", "pod", name, "--wait=true", "--timeout=3m"); err != nil {
		t.Fatalf("delete pod %s: %v\n%s", name, err, out)
	}
	took := time.Since(start).Round(100 * time.Millisecond)
	b, err := os.ReadFile(events)
	if err != nil || string(b) != "started\nprestop\nterm\n" {
		t.Errorf("pod %s: the hostPath file after deletion is %q (%v), want started, prestop, term", name, b, err)
	}
	t.Logf("pod %s deleted in %s (grace period 60 s): %q", name, took, b)
}

// httpGet is a shell command that prints the body of GET / from
// host:port with busybox's nc (its wget, static glibc, crashes resolving
// in the guest).
func httpGet(host, port string) string {
	return fmt.Sprintf(`printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 10 %s %s | sed '1,/^\r*$/d'`, host, port)
}

// forwardingRe is what kubectl port-forward prints once it listens.
var forwardingRe = regexp.MustCompile(`Forwarding from 127\.0\.0\.1:(\d+) -> (\d+)`)

// portForwardGet runs kubectl port-forward to the pod's port and GETs /
// through it; kubectl ends its session at the first connection the
// runtime cannot make, so a GET that comes too early is retried with a new
// session, up to 2 minutes.
func (c *cluster) portForwardGet(ctx context.Context, t *testing.T, pod string, port int) string {
	t.Helper()
	var body string
	err := testenv.Wait(2*time.Minute, func() (bool, error) {
		b, err := c.portForwardOnce(ctx, pod, port)
		body = b
		return err == nil, err
	})
	if err != nil {
		t.Errorf("GET / through kubectl port-forward %s %d: %v", pod, port, err)
	}
	return body
}

func (c *cluster) portForwardOnce(ctx context.Context, pod string, port int) (string, error) {
	pctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(pctx, "nsenter", "--net=/run/netns/"+c.netns, "--", filepath.Join(c.bin, "kubectl"),
		"--kubeconfig", c.kubeconfig, "port-forward", "pod/"+pod, fmt.Sprintf("0:%d", port))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return "", err
	}
	if err := cmd.Start(); err != nil {
		return "", err
	}
	defer func() {
		cancel()
		_ = cmd.Wait()
	}()
	local := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := forwardingRe.FindStringSubmatch(sc.Text()); m != nil {
				local <- m[1]
				break
			}
		}
		close(local)
		_, _ = io.Copy(io.Discard, stdout)
	}()
	lport, ok := <-local
	if !ok {
		return "", fmt.Errorf("kubectl port-forward printed no \"Forwarding from\" line: %s", stderr.String())
	}
	// kubectl listens in the cluster's namespace: GET from there.
	out, err := run(pctx, "nsenter", "--net=/run/netns/"+c.netns, "--", "busybox", "wget", "-q", "-O", "-", "http://127.0.0.1:"+lport+"/")
	if err != nil {
		return "", fmt.Errorf("%w (kubectl: %s)", err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// checkNothingLeft: no shim, QEMU or virtiofsd of the cluster's pods, no
// tap in its namespace, no sandbox directory in kata-fsx's run directory.
func (c *cluster) checkNothingLeft(t *testing.T) {
	t.Helper()
	out, _ := exec.Command("sh", "-c", "ps -eo pid,args | grep -E 'containerd-shim-kata-fsx-v2|qemu-system|virtiofsd' | grep -e '"+c.dir+"' -e '"+c.runDir+"' | grep -v grep").CombinedOutput()
	if s := strings.TrimSpace(string(out)); s != "" {
		t.Errorf("processes of the cluster's kata-fsx pods are left:\n%s", s)
	}
	if out, err := run(context.Background(), "ip", "-n", c.netns, "-o", "link", "show"); err == nil && strings.Contains(out, "_kata") {
		t.Errorf("taps left in the cluster's namespace:\n%s", out)
	}
	if ents, err := os.ReadDir(c.runDir); err == nil && len(ents) > 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("kata-fsx's run directory %s still holds %v", c.runDir, names)
	}
}
