#!/usr/bin/env bash
# Runs the Go fuzz targets of the given packages (default: the whole module)
# for FUZZTIME each (default 10s). Called by 'make test', so CI fuzzes every
# parser.
#
# A target fails when:
#  - the engine reports a failing input: the input's file and the command
#    that reruns it are printed;
#  - it makes fewer than FUZZ_MIN_RATE executions per second on average
#    (default 100): a target that hardly runs is a slow path a hostile input
#    drives or a harness doing too much, and must be fixed, or say why in
#    its doc comment with a line "fuzz.sh: slow: REASON", which this script
#    honours;
#  - it ends in any other error.
# An input that hangs names no input: go1.26's engine kills the stuck worker
# at the deadline and reports PASS without writing it (tried with a target
# that sleeps an hour on inputs longer than 6 bytes). The rate floor is what
# fails such a target; its report shows the progress lines stopping.
#
# Minimizing an input that widened coverage is bounded by a count of runs
# (-fuzzminimizetime 1000x), not a time: the engine counts no executions
# while it minimizes, so a time bound let a fast target whose corpus holds
# kilobyte JSON documents spend most of its FUZZTIME minimizing and fall
# under the rate floor. A count keeps the pause proportional to the cost
# of one run, so a slow or hanging input still shows as a stall.
#
# One case is retried, once and loudly: a bare "context deadline exceeded"
# with no failing input. That is a race in the Go toolchain's fuzzing
# coordinator (internal/fuzz.CoordinateFuzzing, go1.26 and earlier): at the
# -fuzztime deadline the timeout context closes its Done channel before it
# cancels its child fuzzCtx, and stop() only swallows an error equal to
# fuzzCtx.Err(), which can still be nil, so the normal end of fuzzing is
# reported as a failure (go.dev/issue/75804, fixed in Go 1.27). The retry
# also has to meet the rate floor, so a target stalled by a hung input
# still fails.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZTIME=${FUZZTIME:-10s}
FUZZ_MIN_RATE=${FUZZ_MIN_RATE:-100}
if [ $# -eq 0 ]; then
	set -- ./...
fi
status=0
failed=()

# rate prints the average executions per second of a fuzz log: the last
# progress line's execs over its elapsed seconds.
rate() {
	awk '/^fuzz: elapsed: [0-9hms]+, execs: [0-9]+/ {
		t = $3; sub(/,$/, "", t); e = 0
		if (t ~ /h/) { split(t, a, "h"); e += a[1] * 3600; t = a[2] }
		if (t ~ /m/) { split(t, a, "m"); e += a[1] * 60; t = a[2] }
		sub(/s$/, "", t); e += t; n = $5
	} END { if (e > 0) printf "%d\n", n / e; else print 0 }' "$1"
}

# slow_ok reports whether the target's doc comment says why it is slow.
slow_ok() {
	local dir=$1 target=$2
	grep -h -B30 "^func ${target}(" "$dir"/*_test.go 2>/dev/null | grep -q 'fuzz.sh: slow:'
}

# fuzz_once runs one target once into $log; it returns go test's status.
fuzz_once() {
	go test -run '^$' -fuzz "^${2}\$" -fuzztime "$FUZZTIME" -fuzzminimizetime 1000x "$1" 2>&1 | tee "$log"
	return "${PIPESTATUS[0]}"
}

for pkg in $(go list "$@"); do
	targets=$(go test -list '^Fuzz' "$pkg" 2>/dev/null | grep '^Fuzz' || true)
	[ -n "$targets" ] || continue
	dir=$(go list -f '{{.Dir}}' "$pkg")
	for target in $targets; do
		echo "==> fuzz $pkg $target ($FUZZTIME)"
		log=$(mktemp)
		ok=1
		if ! fuzz_once "$pkg" "$target"; then
			if input=$(grep -o 'Failing input written to [^ ]*' "$log"); then
				echo "==> FAIL fuzz $pkg $target: ${input#Failing input written to }" \
					"(rerun: go test -run=$target/$(basename "${input##* }") $pkg)"
				ok=0
			elif grep -q 'context deadline exceeded' "$log"; then
				echo "==> WARNING fuzz $pkg $target: 'context deadline exceeded' without a failing input:" \
					"the $(go env GOVERSION) fuzzing coordinator's deadline race (go.dev/issue/75804, see test/fuzz.sh);" \
					"retrying once"
				if ! fuzz_once "$pkg" "$target"; then
					echo "==> FAIL fuzz $pkg $target: failed again after the retry (see above)"
					ok=0
				fi
			else
				echo "==> FAIL fuzz $pkg $target: go test failed without naming an input (see above)"
				ok=0
			fi
		fi
		r=$(rate "$log")
		echo "==> fuzz $pkg $target: $r executions/s"
		if [ "$ok" = 1 ] && [ "$r" -lt "$FUZZ_MIN_RATE" ]; then
			if slow_ok "$dir" "$target"; then
				echo "==> fuzz $pkg $target: below $FUZZ_MIN_RATE/s, as its doc comment explains"
			else
				echo "==> FAIL fuzz $pkg $target: $r executions/s, below $FUZZ_MIN_RATE/s:" \
					"a slow path or a harness doing too much (fix it, or say why in the doc comment: 'fuzz.sh: slow: REASON')"
				ok=0
			fi
		fi
		if [ "$ok" = 0 ]; then
			status=1
			failed+=("$pkg $target")
		fi
		rm -f "$log"
	done
done
if [ "$status" != 0 ]; then
	echo "==> fuzz failures:"
	printf '    %s\n' "${failed[@]}"
fi
exit $status
