#!/bin/sh
# Build the kata-fsx initrd guest kit: OUTDIR/vmlinux, OUTDIR/initrd.img and
# OUTDIR/manifest.
#
#   [GUEST_AGENT=PKG] guest/initrd/build.sh OUTDIR
#
# Everything comes from Debian packages (apt-get download + dpkg-deb -x) plus
# the agent built from this tree: the kernel of linux-image-amd64 (the
# uncompressed ELF vmlinux, booted through PVH with -kernel), its virtio, 9p,
# virtio-fs, ext4, overlay and vsock modules resolved through modules.dep,
# busybox-static, and the agent as /init: the Go package GUEST_AGENT,
# ./cmd/kata-fsx-agent unless set (make guest, the kit the tests boot, sets
# ./test/guest/hostileagent: the same agent with the hostile-guest tests'
# attacker, idle unless the kernel command line asks for it).
#
# Rebuilds are skipped when the manifest's key (package versions, the agent
# package and its sources, this script) matches. Needs: apt-get, dpkg-deb, depmod (kmod),
# cpio, xz, gzip, go. Run as root so that /dev/console can be created in the
# archive (without it the kernel starts /init with no stdio; the agent then
# reopens the console itself).
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

log() { echo "guest-build: $*" >&2; }

# Top-level modules; their dependencies come from modules.dep. crc32c is a
# soft dependency of ext4 (metadata_csum) that modules.dep does not list, and
# without modprobe in the guest the kernel cannot request it later. virtio_net
# brings net_failover and failover through modules.dep. bridge (with stp and
# llc) is what guest/kernel's kernel builds in: a privileged container that
# makes a bridge (brctl addbr, as CRI's conformance suite does) needs it
# loaded, and the guest has no modprobe for the kernel to ask.
# The channel modules load first: the agent serves as soon as they are in and
# loads the storage modules meanwhile (the marker line tells it where).
CHANNEL_MODULES="virtio_pci virtio_console vmw_vsock_virtio_transport"
STORAGE_MODULES="virtio_blk virtiofs 9p 9pnet_virtio crc32c_generic crc32c-intel ext4 overlay virtio_net bridge"
CHANNELS_MARKER="#channels-ready"

# --- inputs and cache key ---------------------------------------------------
KPKG=$(apt-cache show --no-all-versions linux-image-amd64 |
	sed -n 's/^Depends:.*\(linux-image-[0-9][^ ,]*-amd64\).*/\1/p' | head -n1)
[ -n "$KPKG" ] || { log "cannot resolve linux-image-amd64 to a kernel package"; exit 1; }
KVERSION=$(apt-cache show --no-all-versions "$KPKG" | sed -n 's/^Version: //p' | head -n1)
BBVERSION=$(apt-cache show --no-all-versions busybox-static | sed -n 's/^Version: //p' | head -n1)
[ -n "$KVERSION" ] && [ -n "$BBVERSION" ] || { log "apt-cache knows no version for $KPKG or busybox-static (run apt-get update)"; exit 1; }
GOVERSION=$(cd "$ROOT" && go env GOVERSION)
AGENT=${GUEST_AGENT:-./cmd/kata-fsx-agent}
# The agent's sources: every file of this module it is built from.
AGENTSRCS=$(cd "$ROOT" && go list -deps -f '{{if and .Module .Module.Main}}{{range .GoFiles}}{{$.Dir}}/{{.}}{{"\n"}}{{end}}{{end}}' "$AGENT")
[ -n "$AGENTSRCS" ] || { log "go list found no sources of $AGENT"; exit 1; }
AGENTSUM=$(cd "$ROOT" && { echo "$AGENT"; cat go.mod go.sum $AGENTSRCS; } | sha256sum | cut -d' ' -f1)
SCRIPTSUM=$(sha256sum "$HERE/build.sh" | cut -d' ' -f1)
KEY=$(printf '%s\n' "$KPKG=$KVERSION" "busybox-static=$BBVERSION" "$GOVERSION" "$AGENTSUM" "$SCRIPTSUM" "$CHANNEL_MODULES" "$STORAGE_MODULES" |
	sha256sum | cut -d' ' -f1)

if [ -f "$OUT/manifest" ] && [ -f "$OUT/vmlinux" ] && [ -f "$OUT/initrd.img" ] &&
	grep -qx "key=$KEY" "$OUT/manifest"; then
	log "up to date ($OUT)"
	exit 0
fi

# --- fetch packages (Debian mirrors only) -----------------------------------
fetch() { # fetch PACKAGE VERSION -> prints the .deb path
	# apt-get download names files PACKAGE_VERSION_ARCH.deb, epoch colon as %3a.
	pattern="$1_$(echo "$2" | sed 's/:/%3a/')_*.deb"
	deb=$(find "$CACHE" -maxdepth 1 -name "$pattern" | head -n1)
	if [ -z "$deb" ]; then
		(cd "$CACHE" && apt-get download "$1=$2" >/dev/null 2>"$CACHE/apt.err") || {
			cat "$CACHE/apt.err" >&2
			exit 1
		}
		deb=$(find "$CACHE" -maxdepth 1 -name "$pattern" | head -n1)
		[ -n "$deb" ] || { log "apt-get download $1=$2 left no $pattern"; exit 1; }
	fi
	echo "$deb"
}
KDEB=$(fetch "$KPKG" "$KVERSION")
BBDEB=$(fetch busybox-static "$BBVERSION")

WORK=$(mktemp -d "$OUT/.work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT INT TERM
dpkg-deb -x "$KDEB" "$WORK/kernel"
dpkg-deb -x "$BBDEB" "$WORK/busybox"

KVER=$(ls "$WORK/kernel/lib/modules" | head -n1)
VMLINUZ=$WORK/kernel/boot/vmlinuz-$KVER
[ -f "$VMLINUZ" ] || { log "no $VMLINUZ in $KDEB"; exit 1; }

# --- vmlinux: the ELF inside the bzImage ------------------------------------
# The bzImage carries the kernel as one compressed stream. Try each XZ (then
# gzip, zstd) magic offset until one decompresses to an ELF image: booting
# the ELF through PVH saves the in-guest decompression (seconds under TCG).
extract_vmlinux() { # extract_vmlinux MAGIC_REGEX DECOMPRESSOR...
	magic=$1
	shift
	for off in $(grep -aboP "$magic" "$VMLINUZ" | cut -d: -f1); do
		tail -c +"$((off + 1))" "$VMLINUZ" | "$@" >"$WORK/vmlinux" 2>/dev/null || true
		if [ "$(head -c 4 "$WORK/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ]; then
			return 0
		fi
	done
	return 1
}
extract_vmlinux '\xfd7zXZ\x00' xz -dc --single-stream ||
	extract_vmlinux '\x1f\x8b\x08' gzip -dc ||
	extract_vmlinux '\x28\xb5\x2f\xfd' zstd -dcq ||
	{ log "no ELF kernel found inside $VMLINUZ"; exit 1; }

# --- modules ----------------------------------------------------------------
MODROOT=$WORK/kernel
depmod -b "$MODROOT" "$KVER"
MODDEP=$MODROOT/lib/modules/$KVER/modules.dep
MODBUILTIN=$MODROOT/lib/modules/$KVER/modules.builtin

# modpath NAME -> path relative to lib/modules/KVER, or empty when built in.
modpath() {
	want=$(echo "$1" | tr - _)
	awk -F: -v want="$want" '{
		n = $1; sub(/.*\//, "", n); sub(/\.ko(\.[a-z]+)?$/, "", n); gsub(/-/, "_", n)
		if (n == want) { print $1; exit }
	}' "$MODDEP"
}

ORDER=$WORK/modules.order
: >"$ORDER"
add_module() { # add_module RELPATH (its dependencies first)
	grep -qx "$1" "$ORDER" && return 0
	# modules.dep lists the full closure, the deepest last: load it in reverse.
	deps=$(grep "^$1:" "$MODDEP" | cut -d: -f2)
	for d in $(echo "$deps" | tr ' ' '\n' | sed '/^$/d' | tac); do
		grep -qx "$d" "$ORDER" || echo "$d" >>"$ORDER"
	done
	echo "$1" >>"$ORDER"
}
for m in $CHANNEL_MODULES "$CHANNELS_MARKER" $STORAGE_MODULES; do
	if [ "$m" = "$CHANNELS_MARKER" ]; then
		echo "$m" >>"$ORDER"
		continue
	fi
	p=$(modpath "$m")
	if [ -z "$p" ]; then
		if grep -q "/$(echo "$m" | tr - _)\.ko\$\|/$m\.ko\$" "$MODBUILTIN" 2>/dev/null; then
			log "module $m is built into $KVER"
			continue
		fi
		log "module $m not found in $KVER"
		exit 1
	fi
	add_module "$p"
done

# --- initramfs tree ---------------------------------------------------------
STAGE=$WORK/initramfs
mkdir -p "$STAGE/bin" "$STAGE/dev" "$STAGE/proc" "$STAGE/sys" "$STAGE/tmp" "$STAGE/run" \
	"$STAGE/etc" "$STAGE/lib/modules/$KVER" "$STAGE/mnt"
while read -r p; do
	if [ "$p" = "$CHANNELS_MARKER" ]; then
		echo "$p"
		continue
	fi
	mkdir -p "$STAGE/lib/modules/$KVER/$(dirname "$p")"
	cp "$MODROOT/lib/modules/$KVER/$p" "$STAGE/lib/modules/$KVER/$p"
	echo "/lib/modules/$KVER/$p"
done <"$ORDER" >"$STAGE/etc/modules.load"

cp "$WORK/busybox/bin/busybox" "$STAGE/bin/busybox"
# `busybox --list` names busybox itself; linking it to itself would make a
# symlink loop.
for applet in $("$STAGE/bin/busybox" --list); do
	case $applet in busybox | init | linuxrc) continue ;; esac
	[ -e "$STAGE/bin/$applet" ] || ln -s busybox "$STAGE/bin/$applet"
done

(cd "$ROOT" && CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go build -trimpath -ldflags='-s -w' \
	-o "$STAGE/init" "$AGENT")

if ! mknod -m 600 "$STAGE/dev/console" c 5 1 2>/dev/null; then
	log "cannot mknod /dev/console (not root?): the agent will reopen it after mounting devtmpfs"
fi

(cd "$STAGE" && find . | sort | cpio -o -H newc --quiet -R 0:0) | gzip -6 -n >"$WORK/initrd.img"

# --- publish ----------------------------------------------------------------
mv "$WORK/vmlinux" "$OUT/vmlinux"
mv "$WORK/initrd.img" "$OUT/initrd.img"
{
	echo "key=$KEY"
	echo "kernel_package=$KPKG=$KVERSION"
	echo "kernel_release=$KVER"
	echo "busybox_static=$BBVERSION"
	echo "go=$GOVERSION"
	echo "agent=$AGENT"
	echo "agent_sources_sha256=$AGENTSUM"
	echo "vmlinux_sha256=$(sha256sum "$OUT/vmlinux" | cut -d' ' -f1)"
	echo "initrd_sha256=$(sha256sum "$OUT/initrd.img" | cut -d' ' -f1)"
	grep -v '^#' "$STAGE/etc/modules.load" | sed 's/^/module=/'
} >"$OUT/manifest"
log "built $OUT/vmlinux $OUT/initrd.img ($KPKG $KVERSION)"
