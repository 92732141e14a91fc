#!/bin/sh
# Build the kata-fsx test guest kernel, OUTDIR/vmlinux-kata, as Kata builds
# its guest kernel (tools/packaging/kernel/build-kernel.sh): `allnoconfig`
# plus config fragments merged with the kernel's merge_config.sh, every
# driver a pod needs built in, so a root filesystem image boots without an
# initrd. Kata installs the same ELF as vmlinux.container.
#
#   guest/kernel/build.sh OUTDIR
#
# The source is Debian's linux-source-6.1 package (the one behind the
# linux-source metapackage; apt-get download + dpkg-deb); the fragment is
# guest/kernel/kernel.conf. The build is skipped when the key matches
# OUTDIR/vmlinux-kata.manifest: the key is the real inputs alone (source
# package version, compiler, the fragment's settings), not this script, so
# moving or editing the script or a comment of the fragment costs no
# 30-minute rebuild. A kernel whose manifest an earlier version of this
# script wrote (its key hashed the script) is taken as it is when its
# manifest records the same inputs.
# The unpacked source and the object tree stay in OUTDIR/.cache, so a changed
# fragment rebuilds incrementally.
#
# Needs: apt-get, dpkg-deb, xz, gcc, make, bc, flex, bison, libelf-dev
# (objtool), perl. The first build takes 30 CPU-minutes (about 1400
# objects; 35 min of wall time on 2 busy cores, see guest/README.md).
set -eu

if [ $# -ne 1 ]; then
	echo "usage: $0 OUTDIR" >&2
	exit 2
fi
export LC_ALL=C
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=$OUT/.cache
mkdir -p "$CACHE"
FRAGMENT=$HERE/kernel.conf
JOBS=${JOBS:-$(nproc)}

log() { echo "guest-kernel: $*" >&2; }

# --- inputs and cache key ---------------------------------------------------
SRCPKG=$(apt-cache show --no-all-versions linux-source |
	sed -n 's/^Depends:.*\(linux-source-[0-9][0-9.]*\).*/\1/p' | head -n1)
SRCPKG=${SRCPKG:-linux-source-6.1}
SRCVERSION=$(apt-cache show --no-all-versions "$SRCPKG" | sed -n 's/^Version: //p' | head -n1)
[ -n "$SRCVERSION" ] || { log "apt-cache knows no version for $SRCPKG (run apt-get update)"; exit 1; }
CCVERSION=$(gcc --version | head -n1)
# The fragment's settings, the lines merge_config.sh reads (CONFIG_X=...
# and "# CONFIG_X is not set"), so an edit of its comments keeps the key.
FRAGMENT_CONFIG_SUM=$(grep -E '^(CONFIG_[A-Za-z0-9_]+=|# CONFIG_[A-Za-z0-9_]+ is not set)' "$FRAGMENT" | sha256sum | cut -d' ' -f1)
FRAGMENT_SUM=$(sha256sum "$FRAGMENT" | cut -d' ' -f1)
KEY=$(printf '%s\n' "inputs-v2" "$SRCPKG=$SRCVERSION" "$CCVERSION" "$FRAGMENT_CONFIG_SUM" |
	sha256sum | cut -d' ' -f1)
MANIFEST=$OUT/vmlinux-kata.manifest

if [ -f "$MANIFEST" ] && [ -f "$OUT/vmlinux-kata" ]; then
	if grep -qx "key=$KEY" "$MANIFEST"; then
		log "up to date ($OUT/vmlinux-kata)"
		exit 0
	fi
	# A manifest of the earlier script (no fragment_config_sha256; its key
	# hashed that script too): the kernel is still good when the manifest
	# records the same source package, compiler and fragment, and the
	# kernel it describes. Its manifest then gets this key.
	if ! grep -q '^fragment_config_sha256=' "$MANIFEST" &&
		grep -qxF "source_package=$SRCPKG=$SRCVERSION" "$MANIFEST" &&
		grep -qxF "compiler=$CCVERSION" "$MANIFEST" &&
		grep -qxF "fragment_sha256=$FRAGMENT_SUM" "$MANIFEST" &&
		grep -qxF "vmlinux_sha256=$(sha256sum "$OUT/vmlinux-kata" | cut -d' ' -f1)" "$MANIFEST"; then
		{
			echo "key=$KEY"
			grep -v '^key=' "$MANIFEST"
			echo "fragment_config_sha256=$FRAGMENT_CONFIG_SUM"
		} >"$MANIFEST.tmp"
		mv "$MANIFEST.tmp" "$MANIFEST"
		log "up to date ($OUT/vmlinux-kata, built by the earlier script from the same inputs; manifest rekeyed)"
		exit 0
	fi
fi

# --- source -----------------------------------------------------------------
pattern="${SRCPKG}_$(echo "$SRCVERSION" | sed 's/:/%3a/')_*.deb"
deb=$(find "$CACHE" -maxdepth 1 -name "$pattern" | head -n1)
if [ -z "$deb" ]; then
	log "downloading $SRCPKG=$SRCVERSION"
	(cd "$CACHE" && apt-get download "$SRCPKG=$SRCVERSION" >/dev/null 2>"$CACHE/apt.err") || {
		cat "$CACHE/apt.err" >&2
		exit 1
	}
	deb=$(find "$CACHE" -maxdepth 1 -name "$pattern" | head -n1)
	[ -n "$deb" ] || { log "apt-get download $SRCPKG=$SRCVERSION left no $pattern"; exit 1; }
fi

SRC=$CACHE/$SRCPKG-$SRCVERSION
if [ ! -f "$SRC/.unpacked" ]; then
	log "unpacking $(basename "$deb")"
	rm -rf "$SRC" "$SRC.tmp"
	mkdir -p "$SRC.tmp"
	# The .deb carries one tarball of the tree, usr/src/linux-source-X.Y.tar.xz.
	dpkg-deb --fsys-tarfile "$deb" | tar -xO --wildcards './usr/src/linux-source-*.tar.xz' |
		xz -dc | tar -x -C "$SRC.tmp" --strip-components=1
	mv "$SRC.tmp" "$SRC"
	touch "$SRC/.unpacked"
fi
# Old source trees (another package version) are dropped with their objects.
for d in "$CACHE"/linux-source-*; do
	case $d in "$SRC" | "$SRC".*) ;; *) [ -d "$d" ] && rm -rf "$d" ;; esac
done

# --- configuration: allnoconfig + fragment ----------------------------------
OBJ=$SRC.obj
mkdir -p "$OBJ"
log "configuring (allnoconfig + $(basename "$FRAGMENT"))"
# merge_config.sh -n starts from allnoconfig; -O puts .config in the object
# tree. It warns about symbols that did not make it; we check them ourselves.
(cd "$SRC" && ARCH=x86_64 ./scripts/kconfig/merge_config.sh -n -O "$OBJ" "$FRAGMENT" >"$OBJ/merge.log" 2>&1) || {
	tail -n 40 "$OBJ/merge.log" >&2
	exit 1
}
missing=0
for line in $(grep '^CONFIG_' "$FRAGMENT"); do
	if ! grep -qx "$line" "$OBJ/.config"; then
		log "$line is not in the final .config (misspelt, or a dependency is missing)"
		missing=1
	fi
done
[ "$missing" -eq 0 ] || exit 1

# --- build ------------------------------------------------------------------
# Only the ELF vmlinux: it is booted with -kernel through PVH, so no
# compressed bzImage is needed. Output goes to a log; a progress line is
# printed every 500 compiled objects.
START=$(date +%s)
log "building vmlinux with $JOBS jobs (log: $OBJ/build.log)"
status=0
(make -C "$SRC" O="$OBJ" ARCH=x86_64 -j"$JOBS" vmlinux 2>&1 || echo "BUILD-FAILED") |
	tee "$OBJ/build.log" |
	awk -v start="$START" '/^  CC / { n++; if (n % 500 == 0) { "date +%s" | getline now; close("date +%s"); printf "guest-kernel: %d objects compiled (%ds)\n", n, now - start > "/dev/stderr" } }'
if grep -q '^BUILD-FAILED$' "$OBJ/build.log" || [ ! -f "$OBJ/vmlinux" ]; then
	tail -n 60 "$OBJ/build.log" >&2
	log "kernel build failed"
	exit 1
fi
END=$(date +%s)

# --- publish ----------------------------------------------------------------
cp "$OBJ/vmlinux" "$OUT/vmlinux-kata.tmp"
mv "$OUT/vmlinux-kata.tmp" "$OUT/vmlinux-kata"
{
	echo "key=$KEY"
	echo "source_package=$SRCPKG=$SRCVERSION"
	echo "kernel_release=$(cat "$OBJ/include/config/kernel.release" 2>/dev/null || echo unknown)"
	echo "compiler=$CCVERSION"
	echo "fragment_sha256=$FRAGMENT_SUM"
	echo "fragment_config_sha256=$FRAGMENT_CONFIG_SUM"
	echo "build_seconds=$((END - START))"
	echo "vmlinux_sha256=$(sha256sum "$OUT/vmlinux-kata" | cut -d' ' -f1)"
} >"$MANIFEST"
log "built $OUT/vmlinux-kata ($SRCPKG $SRCVERSION, $((END - START)) s, $(($(stat -c %s "$OUT/vmlinux-kata") >> 20)) MiB)"
