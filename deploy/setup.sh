#!/usr/bin/env bash
# The README's main command: on a fresh Debian machine, install what kata-fsx
# needs, build it and the test guest kit, show what it sees on this host, and
# run one pod VM on each backend.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBIAN_FRONTEND=noninteractive
sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
echo "==> installing system packages: $(tr '\n' ' ' < .ci/packages)"
sudo_ apt-get update -q
sudo_ apt-get install -y -q --no-install-recommends $(cat .ci/packages)
export PATH=/usr/local/go/bin:$PATH

echo "==> building kata-fsx and the guest kit (kernel + initramfs from Debian packages)"
make build guest

echo "==> bin/kata-fsx env (configuration: build/configuration.toml)"
bin/kata-fsx env
echo "==> bin/kata-fsx check"
bin/kata-fsx check || echo "(check reported failures: see the FAIL lines above and their fixes)"

# The main job: a private containerd (never the system's) runs one pod on
# virtio-fs and one on imagefs-blk through containerd-shim-kata-fsx-v2.
echo "==> two pods through containerd: deploy/demo.sh"
sudo_ deploy/demo.sh
