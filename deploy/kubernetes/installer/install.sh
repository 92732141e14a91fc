#!/bin/sh
# The kata-fsx-deploy DaemonSet's program, as kata-deploy is Kata's: on start
# it installs kata-fsx from this image onto the node, registers the runtime
# handlers in containerd's configuration, restarts containerd and labels the
# node; on SIGTERM (the DaemonSet's removal) it undoes each step, so the
# node's containerd configuration is again the file it was.
#
# The node must have QEMU (qemu-system-x86) and virtiofsd: kata-fsx drives
# the node's own, where kata-deploy ships Kata's.
#
# Settings (the DaemonSet's env):
#   NODE_NAME               the node (downward API spec.nodeName)
#   KATA_FSX_INSTALL_DIR    where kata-fsx goes on the node [/opt/kata-fsx]
#                           (a hostPath mounted at the same path)
#   CONTAINERD_CONF         containerd's configuration [/etc/containerd/config.toml]
#                           (its directory a hostPath mounted at the same path)
#   CONTAINERD_RESTART      how to restart containerd [systemctl through nsenter
#                           into PID 1's namespaces: needs hostPID]
#   KATA_FSX_STATE_DIR, KATA_FSX_RUN_DIR   kata-fsx's state and run directories
#                           [/var/lib/kata-fsx, /run/kata-fsx]
#   QEMU_PATH, VIRTIOFSD_PATH   the node's QEMU and virtiofsd
#                           [/usr/bin/qemu-system-x86_64, /usr/lib/qemu/virtiofsd]
set -eu

ARTIFACTS=/opt/kata-fsx-artifacts
INSTALL_DIR=${KATA_FSX_INSTALL_DIR:-/opt/kata-fsx}
CONF=${CONTAINERD_CONF:-/etc/containerd/config.toml}
RESTART=${CONTAINERD_RESTART:-nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl restart containerd}
STATE_DIR=${KATA_FSX_STATE_DIR:-/var/lib/kata-fsx}
RUN_DIR=${KATA_FSX_RUN_DIR:-/run/kata-fsx}
QEMU=${QEMU_PATH:-/usr/bin/qemu-system-x86_64}
VIRTIOFSD=${VIRTIOFSD_PATH:-/usr/lib/qemu/virtiofsd}
LABEL=katacontainers.io/kata-fsx-runtime
BACKUP=$CONF.kata-fsx-orig
BEGIN='# BEGIN kata-fsx-deploy: removed with the DaemonSet'
END='# END kata-fsx-deploy'

say() { echo "kata-fsx-deploy: $*"; }
die() { say "$*" >&2; exit 1; }

: "${NODE_NAME:?NODE_NAME is unset: give the DaemonSet env NODE_NAME from fieldRef spec.nodeName}"
[ -f "$CONF" ] || die "containerd configuration $CONF does not exist: set CONTAINERD_CONF to the node's file and mount its directory"

# configVersion prints the configuration's `version` (2: containerd 1.x
# keys, 3: containerd 2.x keys).
configVersion() {
	sed -n 's/^[[:space:]]*version[[:space:]]*=[[:space:]]*\([0-9]*\).*/\1/p' "$1" | head -1
}

# snippet prints the handlers' tables for configuration version $1.
snippet() {
	case $1 in
	3) cri="plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes" ;;
	2) cri="plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes" ;;
	*) die "$CONF: configuration version '$1': kata-fsx-deploy knows versions 2 (containerd 1.x) and 3 (containerd 2.x)" ;;
	esac
	echo "$BEGIN"
	for h in kata-fsx:configuration-fsx.toml kata-fsx-blk:configuration-fsx-blk.toml kata-fsx-fs:configuration-fsx-fs.toml; do
		name=${h%%:*}
		file=${h#*:}
		cat <<SNIP
[$cri.$name]
  runtime_type = 'io.containerd.kata-fsx.v2'
  runtime_path = '$INSTALL_DIR/bin/containerd-shim-kata-fsx-v2'
  pod_annotations = ['io.katacontainers.*']
  privileged_without_host_devices = true
[$cri.$name.options]
  ConfigPath = '$INSTALL_DIR/share/defaults/$file'
SNIP
	done
	echo "$END"
}

install_files() {
	say "installing kata-fsx into $INSTALL_DIR"
	mkdir -p "$INSTALL_DIR/bin" "$INSTALL_DIR/share/kata-fsx" "$INSTALL_DIR/share/defaults"
	for f in kata-fsx containerd-shim-kata-fsx-v2; do
		cp "$ARTIFACTS/bin/$f" "$INSTALL_DIR/bin/$f.new"
		mv "$INSTALL_DIR/bin/$f.new" "$INSTALL_DIR/bin/$f"
	done
	for f in vmlinux initrd.img; do
		cp "$ARTIFACTS/guest/$f" "$INSTALL_DIR/share/kata-fsx/$f.new"
		mv "$INSTALL_DIR/share/kata-fsx/$f.new" "$INSTALL_DIR/share/kata-fsx/$f"
	done
	guest=$INSTALL_DIR/share/kata-fsx
	sed -e "s|@QEMUPATH@|$QEMU|g" -e "s|@KERNELPATH@|$guest/vmlinux|g" -e "s|@INITRDPATH@|$guest/initrd.img|g" \
	    -e "s|@GUESTDIR@|$guest|g" -e "s|@VIRTIOFSDPATH@|$VIRTIOFSD|g" -e "s|@RUNDIR@|$RUN_DIR|g" \
	    -e "s|@STATEDIR@|$STATE_DIR|g" "$ARTIFACTS/configuration.toml.in" > "$INSTALL_DIR/share/defaults/configuration-fsx.toml"
	# The pinned handlers differ in [kata_fsx] shared_fs only.
	for b in blk:imagefs-blk fs:virtio-fs; do
		sed -e "/^\[kata_fsx\]/,/^\[/s|^shared_fs = .*|shared_fs = \"${b#*:}\"|" \
		    "$INSTALL_DIR/share/defaults/configuration-fsx.toml" > "$INSTALL_DIR/share/defaults/configuration-fsx-${b%%:*}.toml"
	done
	grep -q '^shared_fs = "imagefs-blk"' "$INSTALL_DIR/share/defaults/configuration-fsx-blk.toml" ||
		die "configuration-fsx-blk.toml: [kata_fsx] shared_fs was not pinned"
}

configure_containerd() {
	if grep -qF "$BEGIN" "$CONF"; then
		say "$CONF already has kata-fsx's handlers (a previous run that did not clean up): replacing them"
		[ -f "$BACKUP" ] || die "$CONF has kata-fsx's handlers but $BACKUP, the file before them, is gone: remove the lines between the kata-fsx-deploy markers by hand"
		cp "$BACKUP" "$CONF"
	else
		cp -p "$CONF" "$BACKUP"
	fi
	v=$(configVersion "$CONF")
	tmp=$CONF.kata-fsx-new
	{ cat "$CONF"; echo; snippet "$v"; } > "$tmp"
	mv "$tmp" "$CONF"
	say "registered handlers kata-fsx, kata-fsx-blk, kata-fsx-fs in $CONF (configuration version $v)"
}

restart_containerd() {
	say "restarting containerd: $RESTART"
	sh -c "$RESTART" || { say "restarting containerd failed: $RESTART" >&2; return 1; }
}

label() {
	kubectl label node "$NODE_NAME" "$@" --overwrite >/dev/null
}

uninstall() {
	# Restarting containerd breaks the kubelet's stop request, which it
	# then repeats with another SIGTERM: the undo must not die of it.
	trap '' TERM INT
	say "removing kata-fsx from node $NODE_NAME"
	if [ -f "$BACKUP" ]; then
		cp -p "$BACKUP" "$CONF"
		rm -f "$BACKUP"
		say "restored $CONF"
		restart_containerd || true
	fi
	rm -rf "$INSTALL_DIR/bin" "$INSTALL_DIR/share"
	rmdir "$INSTALL_DIR" 2>/dev/null || true
	# Last, so that the label's absence means the node is as it was.
	label "$LABEL-" || say "removing label $LABEL from node $NODE_NAME failed: remove it with kubectl label node $NODE_NAME $LABEL-" >&2
	say "removed"
	exit 0
}

trap uninstall TERM INT
install_files
configure_containerd
restart_containerd || die "containerd was not restarted: the handlers take effect at its next start"
# Without the label no pod of the RuntimeClasses is scheduled here: fail,
# and the DaemonSet's restart tries again (the steps above are repeatable).
label "$LABEL=true" || die "labelling node $NODE_NAME $LABEL=true failed (the DaemonSet's service account needs get and patch on nodes)"
say "installed on node $NODE_NAME; waiting for the DaemonSet's removal"
# A shell waits for a foreground child before it runs a trap, so sleep in
# the background and wait for it, which a signal interrupts.
while :; do
	sleep 3600 &
	wait $! || true
done
