#!/usr/bin/env bash
# Runs every Go fuzz target of the module for a short time each
# (FUZZTIME, default 10s). Called by 'make test', so CI fuzzes every parser.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZTIME=${FUZZTIME:-10s}
status=0
for pkg in $(go list ./...); do
	for target in $(go test -list '^Fuzz' "$pkg" 2>/dev/null | grep '^Fuzz' || true); do
		echo "==> fuzz $pkg $target ($FUZZTIME)"
		if ! go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" -fuzzminimizetime 5s "$pkg"; then
			status=1
		fi
	done
done
exit $status
