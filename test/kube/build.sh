#!/usr/bin/env bash
# Builds the test cluster's programs from the Go module proxy: kubelet,
# kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy and
# kubectl from k8s.io/kubernetes, and etcd from go.etcd.io/etcd/server/v3 at
# the version that Kubernetes release requires, into OUT/bin.
#
# k8s.io/kubernetes points its k8s.io/* staging modules at ./staging, which
# its module download does not carry, and a dependency's replace directives
# do not apply anyway. So this script writes a module of its own into
# OUT/src: Kubernetes' go.mod with each staging replacement pointed at the
# published module of the same release (v1.X.Y -> v0.X.Y), plus a require
# of k8s.io/kubernetes itself, and builds the commands from there; every
# other dependency is at the version Kubernetes pins. Programs already
# built for this version and these settings are kept.
set -euo pipefail
K8S_VERSION=${K8S_VERSION:?set K8S_VERSION, e.g. v1.37.2}
OUT=${1:?usage: build.sh OUTDIR}
GO=${GO:-go}
staging=v0.${K8S_VERSION#v1.}
bins=(kubelet kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl etcd)

# The stamp changes with what the binaries are built as.
stamp="$K8S_VERSION static"
missing=0
for b in "${bins[@]}"; do [ -x "$OUT/bin/$b" ] || missing=1; done
if [ "$missing" = 0 ] && [ "$(cat "$OUT/bin/.version" 2>/dev/null)" = "$stamp" ]; then
	echo "kube: $K8S_VERSION present in $OUT/bin"
	exit 0
fi

start=$(date +%s)
src=$OUT/src
mkdir -p "$src" "$OUT/bin"
gomod=$(cd / && GOFLAGS= "$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
test -n "$gomod" || { echo "kube: go mod download k8s.io/kubernetes@$K8S_VERSION gave no go.mod" >&2; exit 1; }
{
	sed -e 's#^module k8s.io/kubernetes$#module kata-fsx.test/kube#' \
	    -e "s#^\([[:space:]]*\)\(k8s.io/[a-z0-9-]*\) => ./staging/src/k8s.io/[a-z0-9-]*\$#\1\2 => \2 $staging#" "$gomod"
	echo
	echo "require k8s.io/kubernetes $K8S_VERSION"
} > "$src/go.mod.new"
if grep -q '=> ./staging' "$src/go.mod.new"; then
	echo "kube: a staging replacement of $K8S_VERSION's go.mod was not rewritten:" >&2
	grep '=> ./staging' "$src/go.mod.new" >&2
	exit 1
fi
mv "$src/go.mod.new" "$src/go.mod"
# The package clause only: the module needs a package to be a build root.
printf 'package kube\n' > "$src/doc.go"

etcd=$(sed -n 's#^[[:space:]]*go.etcd.io/etcd/server/v3 \(v[^ ]*\).*#\1#p' "$src/go.mod" | head -1)
echo "kube: building Kubernetes $K8S_VERSION (staging modules $staging) and etcd $etcd into $OUT/bin"
pkg=k8s.io/component-base/version
ldflags="-X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2) -X $pkg.gitTreeState=clean"
(
	cd "$src"
	# Static, as Kubernetes releases them (kubectl also runs in the
	# installer's busybox image, which has no libc); one build setting, so
	# the programs share every compiled package.
	GOFLAGS=-mod=mod CGO_ENABLED=0 "$GO" build -trimpath -ldflags "$ldflags" -o "$OUT/bin/" \
		k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-apiserver \
		k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
		k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubectl
	GOFLAGS=-mod=mod CGO_ENABLED=0 "$GO" build -trimpath -o "$OUT/bin/etcd" go.etcd.io/etcd/server/v3
)
echo "$stamp" > "$OUT/bin/.version"
echo "kube: built in $(( $(date +%s) - start )) s"
