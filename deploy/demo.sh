#!/usr/bin/env bash
# kata-fsx under a real containerd: start a private containerd (its own root,
# state, socket and config.toml under a temporary directory; a system
# containerd is never touched), import a small locally built busybox image,
# run one pod on virtio-fs and one on imagefs-blk with
# `ctr run --runtime io.containerd.kata-fsx.v2`, show what each guest sees and
# which backend the shim chose, then stop containerd and remove everything.
#
# Needs root, containerd (1.6+) with ctr, busybox-static, and `make build guest`
# done (bin/containerd-shim-kata-fsx-v2, build/configuration.toml, the guest kit).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

say() { echo "==> $*"; }
die() { echo "demo: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (pod VMs need mounts and virtiofsd)"
for f in /usr/bin/containerd /usr/bin/ctr; do
	[ -x "$f" ] || die "$f missing: apt-get install containerd"
done
[ -x bin/containerd-shim-kata-fsx-v2 ] || die "bin/containerd-shim-kata-fsx-v2 missing: run 'make build guest' first"
[ -f build/configuration.toml ] || die "build/configuration.toml missing: run 'make build guest' first"
command -v busybox >/dev/null || die "busybox missing: apt-get install busybox-static"
busybox=$(command -v busybox)
if ldd "$busybox" >/dev/null 2>&1; then
	die "$busybox is dynamically linked: apt-get install busybox-static"
fi

# A short path: a pod's sockets live under state_dir/<pod id>/ and a unix
# socket path has 107 bytes at most.
tmp=$(mktemp -d /tmp/kfsx-demo.XXXXXX)
sock=$tmp/containerd.sock
ns=kata-fsx-demo
image=kata-fsx.demo/busybox:latest
containerd_pid=

ctr_() { ctr -a "$sock" -n "$ns" "$@"; }

cleanup() {
	local rc=$? pid i
	trap - EXIT INT TERM
	set +e
	say "cleaning up ($tmp)"
	if [ -n "$containerd_pid" ] && kill -0 "$containerd_pid" 2>/dev/null; then
		# A failed run may leave tasks: their shims outlive containerd by
		# design, so take them down through it first.
		for id in $(ctr_ tasks ls -q 2>/dev/null); do
			ctr_ tasks kill -s SIGKILL "$id" >/dev/null 2>&1
			ctr_ tasks delete -f "$id" >/dev/null 2>&1
		done
		for id in $(ctr_ containers ls -q 2>/dev/null); do
			ctr_ containers delete "$id" >/dev/null 2>&1
		done
		for id in $(ctr_ images ls -q 2>/dev/null); do
			ctr_ images rm "$id" >/dev/null 2>&1
		done
		kill -TERM "$containerd_pid"
		for i in $(seq 100); do kill -0 "$containerd_pid" 2>/dev/null || break; sleep 0.2; done
		kill -KILL "$containerd_pid" 2>/dev/null
		wait "$containerd_pid" 2>/dev/null
		say "containerd stopped"
	fi
	# Anything still running with our directory on its command line (shim,
	# QEMU, virtiofsd) was started by this demo.
	for pid in $(grep -lsF "$tmp" /proc/[0-9]*/cmdline | cut -d/ -f3); do
		# grep and cut above had the directory in their own command lines.
		[ "$pid" = "$$" ] && continue
		grep -qsF "$tmp" "/proc/$pid/cmdline" || continue
		echo "demo: killing leftover process $pid: $(tr '\0' ' ' < /proc/"$pid"/cmdline 2>/dev/null | cut -c1-120)" >&2
		kill -KILL "$pid" 2>/dev/null
		[ "$rc" -ne 0 ] || rc=1
	done
	# Deepest first; never remove files through a mount.
	while read -r mnt; do
		echo "demo: unmounting leftover $mnt" >&2
		umount -l "$mnt"
		[ "$rc" -ne 0 ] || rc=1
	done < <(awk -v d="$tmp/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r)
	if grep -qF "$tmp/" /proc/self/mountinfo; then
		echo "demo: mounts remain under $tmp; leaving it" >&2
	else
		rm -rf "$tmp"
	fi
	say "done (exit $rc)"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The demo configuration: the build's configuration.toml with its pod state
# under the temporary directory, and the shared_fs annotation enabled so
# each pod can pick its backend.
say "configuration: build/configuration.toml -> $tmp/configuration.toml"
sed -e "s|^state_dir = \"/run/kata-fsx\"|state_dir = \"$tmp/run\"|" \
	-e "s|^state_dir = \"/var/lib/kata-fsx/imagefs-blk\"|state_dir = \"$tmp/blk\"|" \
	build/configuration.toml > "$tmp/configuration.toml"
grep -q "^state_dir = \"$tmp/run\"" "$tmp/configuration.toml" || die "build/configuration.toml has no [kata_fsx] state_dir to redirect"
grep -Eq '^enable_annotations = .*"shared_fs' "$tmp/configuration.toml" ||
	sed -i 's|^enable_annotations = \[|enable_annotations = ["shared_fs", |' "$tmp/configuration.toml"
grep -Eq '^enable_annotations = .*"shared_fs' "$tmp/configuration.toml" || die "could not enable the shared_fs annotation"

# The private containerd registers kata-fsx for the CRI as
# deploy/containerd/config-1.6.toml does; ctr run below names the runtime
# type itself and hands the shim the same ConfigPath.
mkdir -p "$tmp/cni/net.d" "$tmp/cni/bin" "$tmp/opt"
cat > "$tmp/containerd.toml" <<EOF
version = 2
root = "$tmp/root"
state = "$tmp/state"

[grpc]
  address = "$sock"

[debug]
  level = "debug"

[plugins."io.containerd.internal.v1.opt"]
  path = "$tmp/opt"

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "$tmp/cni/bin"
  conf_dir = "$tmp/cni/net.d"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata-fsx]
  runtime_type = "io.containerd.kata-fsx.v2"
  pod_annotations = ["io.katacontainers.*"]
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata-fsx.options]
  ConfigPath = "$tmp/configuration.toml"
EOF

say "starting a private containerd $(/usr/bin/containerd --version | awk '{print $3}') on $sock"
# containerd finds containerd-shim-kata-fsx-v2 on its PATH.
PATH="$repo/bin:$PATH" /usr/bin/containerd --config "$tmp/containerd.toml" > "$tmp/containerd.log" 2>&1 &
containerd_pid=$!
for i in $(seq 150); do
	ctr -a "$sock" version >/dev/null 2>&1 && break
	kill -0 "$containerd_pid" 2>/dev/null || { tail -20 "$tmp/containerd.log" >&2; die "containerd exited"; }
	sleep 0.2
done
ctr -a "$sock" version >/dev/null 2>&1 || { tail -20 "$tmp/containerd.log" >&2; die "containerd did not come up"; }
if ! ctr -a "$sock" plugins ls | grep -Eq '^io\.containerd\.grpc\.v1 +cri +\S+ +ok'; then
	tail -20 "$tmp/containerd.log" >&2
	die "the CRI plugin did not accept the kata-fsx runtime table"
fi
say "containerd is up; its CRI plugin loaded the kata-fsx runtime (ConfigPath $tmp/configuration.toml)"

# A docker-archive image built here, so no registry is needed: one layer
# holding the static busybox and a few applets.
say "building and importing $image (static busybox, one layer)"
rootfs=$tmp/image/rootfs
mkdir -p "$rootfs"/{bin,proc,sys,dev,tmp,etc,root}
cp "$busybox" "$rootfs/bin/busybox"
for a in sh echo cat ls grep head hostname uname sleep; do ln -s busybox "$rootfs/bin/$a"; done
echo "root:x:0:0:root:/root:/bin/sh" > "$rootfs/etc/passwd"
echo "root:x:0:" > "$rootfs/etc/group"
arc=$tmp/image/archive
mkdir -p "$arc"
tar --numeric-owner --owner=0 --group=0 -C "$rootfs" -cf "$arc/layer.tar" .
diff_id=$(sha256sum "$arc/layer.tar" | cut -d' ' -f1)
printf '{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin"],"Cmd":["/bin/sh"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
	"$diff_id" > "$arc/config.json"
cfg_id=$(sha256sum "$arc/config.json" | cut -d' ' -f1)
mv "$arc/config.json" "$arc/$cfg_id.json"
printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["layer.tar"]}]' "$cfg_id" "$image" > "$arc/manifest.json"
tar -C "$arc" -cf "$tmp/image/busybox.tar" manifest.json "$cfg_id.json" layer.tar
ctr_ images import "$tmp/image/busybox.tar" | sed 's/^/    /'

say "this host: $(hostname), kernel $(uname -r); each pod below is a QEMU VM with its own kernel"
fail=0
for backend in virtio-fs imagefs-blk; do
	id=demo-${backend//-/}
	say "pod $id on $backend: ctr run --rm --runtime io.containerd.kata-fsx.v2 --annotation io.katacontainers.config.hypervisor.shared_fs=$backend ..."
	start=$(date +%s%N)
	if ! out=$(ctr_ run --rm --runtime io.containerd.kata-fsx.v2 --runtime-config-path "$tmp/configuration.toml" \
		--annotation io.katacontainers.config.hypervisor.shared_fs="$backend" \
		"$image" "$id" /bin/sh -c 'echo "hostname: $(hostname)"; echo "guest kernel: $(uname -r)"; grep " / " /proc/mounts' 2>&1); then
		echo "$out" | sed 's/^/    /'
		echo "demo: pod $id failed; containerd log: $tmp/containerd.log (tail below)" >&2
		tail -15 "$tmp/containerd.log" >&2
		fail=1
		continue
	fi
	ms=$((($(date +%s%N) - start) / 1000000))
	took=$(printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100)))
	echo "$out" | sed 's/^/    /'
	# The shim logs its choice and the reason into containerd's log.
	reason=$(sed -n "s/.*msg=\"\(sandbox $id: config .*\)\" container=.*/\1/p" "$tmp/containerd.log" | tail -1 | sed 's/\\"/"/g')
	echo "    shim: ${reason:-(no backend line in the containerd log)}"
	if [ "$backend" = virtio-fs ]; then
		# The first pod resolved accelerator = "auto"; say what it found.
		accel=$(sed -n 's/.*msg="\(no KVM .*\)/\1/p' "$tmp/containerd.log" | head -1 |
			sed -E 's/"( [a-z_]+=[^ ]*)*$//; s/\\"/"/g' | cut -c1-200)
		[ -z "$accel" ] || echo "    shim: $accel"
	fi
	fstype=$(echo "$out" | awk '$2 == "/" {print $3}')
	case "$backend:$fstype" in
	virtio-fs:virtiofs | imagefs-blk:ext4)
		say "pod $id: / is $fstype in the guest, so it ran on $backend (${took}s including the VM boot)" ;;
	*)
		echo "demo: pod $id asked for $backend but its / is '$fstype'" >&2
		fail=1 ;;
	esac
done

[ "$fail" -eq 0 ] || die "a pod failed (see above)"
say "both pods ran; stopping containerd and removing everything"
