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
		log=$(mktemp)
		if ! go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" -fuzzminimizetime 5s "$pkg" 2>&1 | tee "$log"; then
			# A found bug names its input; a bare "context deadline exceeded"
			# is the fuzzing engine losing a worker at the deadline (seen even on an
			# idle machine): retry that, at most twice, never a real failure.
			if ! grep -q 'Failing input written' "$log" && grep -q 'context deadline exceeded' "$log"; then
				echo "==> fuzz $pkg $target: engine timeout without a failing input; retrying"
				if ! go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" -fuzzminimizetime 5s "$pkg" 2>&1 | tee "$log"; then
					if ! grep -q 'Failing input written' "$log" && grep -q 'context deadline exceeded' "$log"; then
						echo "==> fuzz $pkg $target: engine timeout again; last retry"
						go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" -fuzzminimizetime 5s "$pkg" || status=1
					else
						status=1
					fi
				fi
			else
				status=1
			fi
		fi
		rm -f "$log"
	done
done
exit $status
