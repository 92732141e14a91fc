#!/usr/bin/env bash
# The README's main command: on a fresh Debian machine, install what kata-fsx
# needs, build it, and show what it sees on this host.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBIAN_FRONTEND=noninteractive
sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
echo "==> installing system packages: $(tr '\n' ' ' < .ci/packages)"
sudo_ apt-get update -q
sudo_ apt-get install -y -q --no-install-recommends $(cat .ci/packages)
export PATH=/usr/local/go/bin:$PATH

echo "==> building"
make build

echo "==> bin/kata-fsx env (configuration: build/configuration.toml)"
bin/kata-fsx env
echo "==> bin/kata-fsx check"
# check exits non-zero while the guest kit is missing; show it all the same.
bin/kata-fsx check || echo "(check reported failures: see the FAIL lines above and their fixes)"
