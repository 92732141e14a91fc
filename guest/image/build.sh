#!/bin/sh
# Build the kata-fsx guest image, OUTDIR/kata-containers.img: a root
# filesystem image in the layout of Kata's image_builder.sh, booted with
# `image =` on an nvdimm (root=/dev/pmem0p1, DAX) or a virtio-blk disk
# (root=/dev/vda1), with no initrd, by the kernel of guest/kernel/build.sh.
#
#   guest/image/build.sh OUTDIR
#
# Contents, from Debian packages plus this tree: busybox-static (its applets
# in /bin) and the agent (cmd/kata-fsx-agent), installed as Kata's
# AGENT_INIT=yes images install kata-agent: the binary is /sbin/init
# (rootfs.sh moves the agent there), here also hard-linked as
# /usr/bin/kata-agent, Kata's agent path.
#
# Layout (mkimage): MBR #1 at 0 with one partition at 3 MiB, the nvdimm pfn
# info block at 4 KiB (Kata's nsdax), MBR #2 at 2 MiB with the same
# partition at 1 MiB of the pfn device, and ext4 from 3 MiB to the end. The
# filesystem is written in place with `mkfs.ext4 -d -E offset=`: no loop
# device, no mount, no root-only step except the /dev/console node.
#
# Rebuilds are skipped when the manifest's key (busybox version, Go version,
# agent and mkimage sources, this script) matches. Needs: apt-get, dpkg-deb,
# mkfs.ext4 (e2fsprogs), go.
set -eu

if [ $# -ne 1 ]; then
	echo "usage: $0 OUTDIR" >&2
	exit 2
fi
export LC_ALL=C
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE=$OUT/.cache
mkdir -p "$CACHE"
IMAGE=$OUT/kata-containers.img
MANIFEST=$IMAGE.manifest
# Kata rounds its images up to IMAGE_SIZE_ALIGNMENT_MB (128); ours fits in one step.
IMAGE_MB=${IMAGE_MB:-128}
FS_OFFSET=3145728

log() { echo "guest-image: $*" >&2; }

# --- inputs and cache key ---------------------------------------------------
BBVERSION=$(apt-cache show --no-all-versions busybox-static | sed -n 's/^Version: //p' | head -n1)
[ -n "$BBVERSION" ] || { log "apt-cache knows no version of busybox-static (run apt-get update)"; exit 1; }
GOVERSION=$(cd "$ROOT" && go env GOVERSION)
# The sources of the agent and of mkimage: every file of this module they
# are built from.
SRCS=$(cd "$ROOT" && go list -deps -f '{{if and .Module .Module.Main}}{{range .GoFiles}}{{$.Dir}}/{{.}}{{"\n"}}{{end}}{{end}}' ./cmd/kata-fsx-agent ./guest/image/mkimage)
[ -n "$SRCS" ] || { log "go list found no sources of the agent and mkimage"; exit 1; }
SRCSUM=$(cd "$ROOT" && cat go.mod go.sum $SRCS | sha256sum | cut -d' ' -f1)
SCRIPTSUM=$(sha256sum "$HERE/build.sh" | cut -d' ' -f1)
KEY=$(printf '%s\n' "busybox-static=$BBVERSION" "$GOVERSION" "$SRCSUM" "$SCRIPTSUM" "$IMAGE_MB" | sha256sum | cut -d' ' -f1)

if [ -f "$MANIFEST" ] && [ -f "$IMAGE" ] && grep -qx "key=$KEY" "$MANIFEST"; then
	log "up to date ($IMAGE)"
	exit 0
fi

# --- busybox (Debian mirrors only) ------------------------------------------
pattern="busybox-static_$(echo "$BBVERSION" | sed 's/:/%3a/')_*.deb"
BBDEB=$(find "$CACHE" -maxdepth 1 -name "$pattern" | head -n1)
if [ -z "$BBDEB" ]; then
	(cd "$CACHE" && apt-get download "busybox-static=$BBVERSION" >/dev/null 2>"$CACHE/apt.err") || {
		cat "$CACHE/apt.err" >&2
		exit 1
	}
	BBDEB=$(find "$CACHE" -maxdepth 1 -name "$pattern" | head -n1)
	[ -n "$BBDEB" ] || { log "apt-get download busybox-static=$BBVERSION left no $pattern"; exit 1; }
fi

WORK=$(mktemp -d "$OUT/.work-image.XXXXXX")
trap 'rm -rf "$WORK"' EXIT INT TERM
dpkg-deb -x "$BBDEB" "$WORK/busybox"

# --- root filesystem tree ---------------------------------------------------
log "staging the root filesystem"
STAGE=$WORK/rootfs
# Every directory the agent mounts on or writes under must exist: the root
# is mounted read-only.
for d in bin sbin usr/bin usr/sbin etc dev proc sys run tmp mnt root var lib; do
	mkdir -p "$STAGE/$d"
done
chmod 1777 "$STAGE/tmp"
chmod 0700 "$STAGE/root"

cp "$WORK/busybox/bin/busybox" "$STAGE/bin/busybox"
# `busybox --list` names busybox itself; linking it to itself would make a
# symlink loop. init stays the agent's.
for applet in $("$STAGE/bin/busybox" --list); do
	case $applet in busybox | init | linuxrc) continue ;; esac
	[ -e "$STAGE/bin/$applet" ] || ln -s busybox "$STAGE/bin/$applet"
done

(cd "$ROOT" && CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go build -trimpath -ldflags='-s -w' \
	-o "$STAGE/sbin/init" ./cmd/kata-fsx-agent)
ln "$STAGE/sbin/init" "$STAGE/usr/bin/kata-agent"
(cd "$ROOT" && go build -trimpath -o "$WORK/mkimage" ./guest/image/mkimage)

printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$STAGE/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$STAGE/etc/group"
# The agent binds the sandbox's DNS over this file.
: >"$STAGE/etc/resolv.conf"
printf 'NAME="kata-fsx guest"\nID=kata-fsx-guest\nVERSION_ID=%s\n' "$BBVERSION" >"$STAGE/etc/os-release"
if ! mknod -m 600 "$STAGE/dev/console" c 5 1 2>/dev/null; then
	log "cannot mknod /dev/console (not root?): the agent takes the console after mounting devtmpfs"
fi

# --- image --------------------------------------------------------------------
log "writing the ext4 filesystem (${IMAGE_MB} MiB image)"
truncate -s "${IMAGE_MB}M" "$WORK/image"
# 4 KiB blocks: DAX maps filesystem blocks as pages. Ownership is root's
# for every file (-E root_owner, and the stage is ours).
mkfs.ext4 -q -F -b 4096 -L kata-rootfs -E "offset=$FS_OFFSET,root_owner=0:0" -d "$STAGE" \
	"$WORK/image" "$((IMAGE_MB * 1024 - FS_OFFSET / 1024))k"
"$WORK/mkimage" "$WORK/image"

# --- publish ----------------------------------------------------------------
mv "$WORK/image" "$IMAGE"
{
	echo "key=$KEY"
	echo "busybox_static=$BBVERSION"
	echo "go=$GOVERSION"
	echo "sources_sha256=$SRCSUM"
	echo "size_mib=$IMAGE_MB"
	echo "image_sha256=$(sha256sum "$IMAGE" | cut -d' ' -f1)"
} >"$MANIFEST"
log "built $IMAGE"
