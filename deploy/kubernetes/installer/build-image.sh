#!/usr/bin/env bash
# Builds the kata-fsx-deploy image as a docker archive (the format
# `ctr images import` and `docker load` read), from this tree's build:
# busybox-static for the shell, kubectl to label the node, kata-fsx's
# binaries, the guest kit, the configuration template and install.sh.
#
#   build-image.sh OUT.tar [NAME]
#
# Inputs: BIN_DIR [bin], GUEST_DIR [build/guest], KUBECTL [kubectl on PATH],
# BUSYBOX [/bin/busybox, busybox-static]. NAME defaults to
# localhost/kata-fsx-deploy:latest. Import it on each node, e.g.
# `ctr -n k8s.io images import OUT.tar`: nothing is pulled.
set -euo pipefail
out=${1:?usage: build-image.sh OUT.tar [NAME]}
name=${2:-localhost/kata-fsx-deploy:latest}
top=$(cd "$(dirname "$0")/../../.." && pwd)
bin=${BIN_DIR:-$top/bin}
guest=${GUEST_DIR:-$top/build/guest}
kubectl=${KUBECTL:-$(command -v kubectl || true)}
busybox=${BUSYBOX:-/bin/busybox}
for f in "$bin/kata-fsx" "$bin/containerd-shim-kata-fsx-v2" "$guest/vmlinux" "$guest/initrd.img" "$top/configuration.toml.in"; do
	[ -f "$f" ] || { echo "build-image: $f is missing (make build guest)" >&2; exit 1; }
done
[ -n "$kubectl" ] && [ -x "$kubectl" ] || { echo "build-image: no kubectl: set KUBECTL (make kube builds one)" >&2; exit 1; }
"$busybox" --list >/dev/null 2>&1 || { echo "build-image: $busybox is not a busybox (apt-get install busybox-static)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/root
mkdir -p "$root/bin" "$root/usr/bin" "$root/opt/kata-fsx-artifacts/bin" "$root/opt/kata-fsx-artifacts/guest" "$root/tmp"
cp "$busybox" "$root/bin/busybox"
for a in $("$busybox" --list); do
	[ "$a" = busybox ] || ln -s busybox "$root/bin/$a"
done
cp "$kubectl" "$root/usr/bin/kubectl"
cp "$bin/kata-fsx" "$bin/containerd-shim-kata-fsx-v2" "$root/opt/kata-fsx-artifacts/bin/"
cp "$guest/vmlinux" "$guest/initrd.img" "$root/opt/kata-fsx-artifacts/guest/"
cp "$top/configuration.toml.in" "$root/opt/kata-fsx-artifacts/"
cp "$top/deploy/kubernetes/installer/install.sh" "$root/install.sh"
chmod 1777 "$root/tmp"

tar -C "$root" --numeric-owner --owner=0 --group=0 --sort=name --mtime=@0 -cf "$work/layer.tar" .
diff=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
cat > "$work/config.json" <<JSON
{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/bin:/bin"],"Entrypoint":["/bin/sh","/install.sh"]},"rootfs":{"type":"layers","diff_ids":["sha256:$diff"]}}
JSON
cfg=$(sha256sum "$work/config.json" | cut -d' ' -f1)
mv "$work/config.json" "$work/$cfg.json"
printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["layer.tar"]}]\n' "$cfg" "$name" > "$work/manifest.json"
tar -C "$work" --numeric-owner --owner=0 --group=0 -cf "$out" manifest.json "$cfg.json" layer.tar
echo "build-image: $out ($name, $(du -h "$out" | cut -f1))"
