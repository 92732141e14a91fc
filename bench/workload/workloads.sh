#!/bin/bash
t_script=${EPOCHREALTIME//[!0-9]/}
echo "@@START $t_script"
# kata-fsx bench workload script: runs the same filesystem workloads as the
# container process of a pod VM (one row per backend) and on the host (the
# reference row), and reports them as a line protocol on stdout. Nothing
# else goes to stdout: every tool's chatter goes to stderr or /dev/null.
#
#   @@START <epoch microseconds>           first thing the script does
#   @@INFO <key> <value...>                facts about the run
#   @@RESULT <workload> <rep> <value> <unit>   unit: s | MB/s | IOPS | ops/s
#   @@FAIL <workload> <rep> <message>      a repetition failed; the run goes on
#   @@DONE                                 last line of a complete run
#
# Repetitions count from 1; rep 0 in a @@FAIL is about the workload or the
# run as a whole (an unknown name in BENCH_ONLY, a bad setting, a setup step).
# Workloads, in the order each repetition runs them: fio-seqread fio-seqwrite
# fio-randread fio-randwrite dbench install chown stat find rg rm
# sqlite-insert sqlite-select; install, chown and rm also report
# install-sync, chown-sync and rm-sync (see timed). The loop is
# repetition-major: repetition r runs every wanted workload once before r+1
# starts.
#
# Settings (environment, defaults in brackets): BENCH_WORK [/bench/work]
# work directory (must be absent or empty; removed at the end), BENCH_REPS [3],
# BENCH_FIO_MB [128] fio file size, BENCH_FIO_SECS [4] runtime of each fio
# job, BENCH_DBENCH_SECS [8], BENCH_DBENCH_CLIENTS [nproc] (handed to dbench
# as is), BENCH_ONLY [all] comma-separated workload names, BENCH_SQLITE_ROWS
# [20000], BENCH_BUDGET_SECS [0 = none] time budget of the run in seconds.
#
# The budget: repetition 1 always runs in full; before each later one the
# script stops if the time since its start plus its longest repetition so far
# exceeds BENCH_BUDGET_SECS, and says so. Without a budget it runs
# BENCH_REPS repetitions. The run's INFO keys about repetitions:
#   @@INFO reps_done <r>                   after repetition r completed
#   @@INFO rep_seconds <s1> <s2> ...       wall time of each completed one
#   @@INFO budget_stop <message>           the budget ended the run early
#   @@INFO page_cache_kib <n>              guest page cache after repetition
#                                          1's read workloads (stat find rg)
#
# Every measurement starts from `sync; echo 3 > /proc/sys/vm/drop_caches` so
# it measures the filesystem, not the page cache left by the one before, and
# is timed here with EPOCHREALTIME (no fork) rather than by the caller, so the
# numbers do not include VM or agent overheads. Phases that write end with a
# sync inside the timed part: data still in the guest's page cache has not
# reached the backend yet. The fio file is laid out once, on first use, and
# removed at the end; install.<r> is the tree repetition r's rm removes.

exec 3>&1 1>&2 # protocol on fd 3; anything a tool prints by mistake goes to stderr

all="fio-seqread fio-seqwrite fio-randread fio-randwrite dbench install chown stat find rg rm sqlite-insert sqlite-select"
nm=/bench/nm
nmtar=/bench/node_modules.tar

say() { printf '%s\n' "$*" >&3; }
now() { REPLY=${EPOCHREALTIME//[!0-9]/}; }
# One line, bounded, safe for the protocol.
oneline() {
	local s=${1//$'\r'/}
	s=${s//$'\n'/ }
	s=${s//$'\t'/ }
	[ ${#s} -gt 240 ] && s="${s:0:240}..."
	printf '%s' "${s:-(no message)}"
}
fail() { say "@@FAIL $1 $2 $(oneline "$3")"; }
# A tool's number is a result only when it measured some work.
positive() { awk -v v="$1" 'BEGIN { exit !(v + 0 > 0) }'; }
# Seconds with 6 decimals from a microsecond count.
secs() { printf '%d.%06d' $(($1 / 1000000)) $(($1 % 1000000)); }
lastline() { # last non-empty line of a file
	local l last=""
	[ -f "$1" ] || { printf '(no stderr)'; return; }
	while IFS= read -r l || [ -n "$l" ]; do [ -n "${l//[[:space:]]/}" ] && last=$l; done <"$1"
	printf '%s' "${last:-(no stderr)}"
}

posint() { [[ $2 =~ ^[1-9][0-9]{0,8}$ ]] || { fail config 0 "$1=$2 is not a positive integer"; return 1; }; }
nonneg() { [[ $2 =~ ^(0|[1-9][0-9]{0,8})$ ]] || { fail config 0 "$1=$2 is not a non-negative integer"; return 1; }; }
BENCH_WORK=${BENCH_WORK:-/bench/work}
BENCH_REPS=${BENCH_REPS:-3}
BENCH_FIO_MB=${BENCH_FIO_MB:-128}
BENCH_FIO_SECS=${BENCH_FIO_SECS:-4}
BENCH_DBENCH_SECS=${BENCH_DBENCH_SECS:-8}
BENCH_SQLITE_ROWS=${BENCH_SQLITE_ROWS:-20000}
BENCH_ONLY=${BENCH_ONLY:-}
BENCH_BUDGET_SECS=${BENCH_BUDGET_SECS:-0}
ok=1
posint BENCH_REPS "$BENCH_REPS" || ok=
posint BENCH_FIO_MB "$BENCH_FIO_MB" || ok=
posint BENCH_FIO_SECS "$BENCH_FIO_SECS" || ok=
posint BENCH_DBENCH_SECS "$BENCH_DBENCH_SECS" || ok=
posint BENCH_SQLITE_ROWS "$BENCH_SQLITE_ROWS" || ok=
nonneg BENCH_BUDGET_SECS "$BENCH_BUDGET_SECS" || ok=
[[ $BENCH_WORK == /* && $BENCH_WORK != / ]] || { fail config 0 "BENCH_WORK=$BENCH_WORK is not an absolute directory below /"; ok=; }
if [ -z "$ok" ]; then say "@@DONE"; exit 2; fi
if [ -z "${BENCH_DBENCH_CLIENTS:-}" ]; then
	BENCH_DBENCH_CLIENTS=$(nproc 2>/dev/null) || BENCH_DBENCH_CLIENTS=1
fi

IFS=, read -r -a only <<<"$BENCH_ONLY"
for w in "${only[@]}"; do
	w=${w//[[:space:]]/}
	[ -z "$w" ] || [[ " $all " == *" $w "* ]] || fail "$w" 0 "unknown workload (known: $all)"
done
want() {
	[ -z "${BENCH_ONLY//[[:space:],]/}" ] && return 0
	[[ ",${BENCH_ONLY//[[:space:]]/}," == *",$1,"* ]]
}

# The work directory must be ours alone: it is removed at the end.
if [ -e "$BENCH_WORK" ] && [ -n "$(ls -A "$BENCH_WORK" 2>&1)" ]; then
	fail setup 0 "BENCH_WORK $BENCH_WORK exists and is not empty"
	say "@@DONE"
	exit 2
fi
if ! mkdir -p "$BENCH_WORK" 2>"/dev/null"; then
	fail setup 0 "cannot create BENCH_WORK $BENCH_WORK"
	say "@@DONE"
	exit 2
fi
W=$BENCH_WORK
# Scratch files (stderr of the tool being timed, fio/dbench reports) are kept
# off the filesystem under test where possible.
meta=""
for d in /dev/shm /run /tmp; do
	meta=$(mktemp -d "$d/bench-meta.XXXXXX" 2>/dev/null) && break
	meta=""
done
[ -n "$meta" ] || meta=$(mktemp -d "$W/.meta.XXXXXX") || {
	fail setup 0 "cannot create a scratch directory"
	rm -rf "$W"
	say "@@DONE"
	exit 2
}
err=$meta/stderr
cleanup() { rm -rf "$meta" "$W"; sync; }
trap cleanup EXIT
trap 'exit 130' INT TERM

say "@@INFO kernel $(uname -r)"
say "@@INFO dbench_clients $(oneline "$BENCH_DBENCH_CLIENTS")"
say "@@INFO nm_entries $(find "$nm" 2>/dev/null | wc -l)"

dropped_warned=
drop_caches() {
	sync
	if ! { echo 3 >/proc/sys/vm/drop_caches; } 2>"$meta/drop"; then
		[ -n "$dropped_warned" ] || say "@@INFO drop_caches failed: $(oneline "$(lastline "$meta/drop")")"
		dropped_warned=1
	fi
}

# timed WORKLOAD REP CMD...: one repetition of a workload whose result is its
# elapsed time. CMD sets $tool before each step so a failure names it. A
# writing CMD calls synced_from just before its final sync: WORKLOAD is then
# the command's own time (what a user or the seeds' `time chown -R` sees)
# and WORKLOAD-sync the time until the data reached the backend, both from
# the same repetition.
timed() {
	local w=$1 r=$2 t0 rc
	shift 2
	drop_caches
	tool=$1
	t_sync=
	now; t0=$REPLY
	"$@" >/dev/null 2>"$err"
	rc=$?
	now
	if [ $rc -ne 0 ]; then
		fail "$w" "$r" "$tool exited $rc: $(lastline "$err")"
		[ -n "$t_sync" ] && fail "$w-sync" "$r" "$tool exited $rc: $(lastline "$err")"
		return 1
	fi
	if [ -n "$t_sync" ]; then
		say "@@RESULT $w $r $(secs $((t_sync - t0))) s"
		say "@@RESULT $w-sync $r $(secs $((REPLY - t0))) s"
		return 0
	fi
	say "@@RESULT $w $r $(secs $((REPLY - t0))) s"
}
# synced_from marks the end of a writing command, before its sync.
synced_from() {
	now; t_sync=$REPLY
	tool="sync"
	sync
}

# --- fio -------------------------------------------------------------------
fiofile=$W/fio.dat
fio_ready=
fio_args=()
fio_setup() {
	[ -n "$fio_ready" ] && return "$fio_ready"
	fio_ready=1
	local probe=$W/.odirect
	if dd if=/dev/zero of="$probe" bs=4096 count=1 oflag=direct 2>"$meta/dd" >/dev/null; then
		fio_args=(--ioengine=libaio --direct=1 --iodepth=16)
		say "@@INFO fio_mode libaio direct=1"
	else
		# A synchronous engine has no queue: depth 1 says so instead of fio warning.
		fio_args=(--ioengine=psync --direct=0 --iodepth=1)
		say "@@INFO fio_mode psync buffered (O_DIRECT refused: $(oneline "$(lastline "$meta/dd")"))"
	fi
	rm -f "$probe"
	# Lay the file out once, with fio's own (incompressible) buffers; not timed.
	if ! fio --name=layout --filename="$fiofile" --size="${BENCH_FIO_MB}M" --rw=write --bs=1M \
		--ioengine=psync --end_fsync=1 --output=/dev/null >/dev/null 2>"$err"; then
		fio_ready=2
		fio_layout_err="fio layout of ${BENCH_FIO_MB}M exited $?: $(lastline "$err")"
		return 2
	fi
	fio_ready=0
}

# fio_json FILE DIR FIELD: prints read|write bw_bytes or iops of the first job.
fio_json() {
	awk -v dir="$2" -v field="$3" '
		/^[ \t]*"(read|write|trim|sync)"[ \t]*:[ \t]*\{/ { sec = $1; gsub(/"/, "", sec); next }
		sec == dir && $1 == "\"" field "\"" && !done { v = $3; sub(/,$/, "", v); print v; done = 1 }
	' "$1"
}

run_fio() { # WORKLOAD REP RW BS DIR FIELD UNIT [extra fio args]
	local w=$1 r=$2 rw=$3 bs=$4 dir=$5 field=$6 unit=$7 rc v
	shift 7
	if ! fio_setup; then
		fail "$w" "$r" "$fio_layout_err"
		return 1
	fi
	drop_caches
	fio --name="$w" --filename="$fiofile" --size="${BENCH_FIO_MB}M" --rw="$rw" --bs="$bs" \
		"${fio_args[@]}" --numjobs=1 --time_based --runtime="$BENCH_FIO_SECS" "$@" \
		--output-format=json --output="$meta/fio.json" >/dev/null 2>"$err"
	rc=$?
	if [ $rc -ne 0 ]; then
		fail "$w" "$r" "fio exited $rc: $(lastline "$err")"
		return 1
	fi
	v=$(fio_json "$meta/fio.json" "$dir" "$field")
	if ! [[ $v =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
		fail "$w" "$r" "fio exited 0 without $dir $field in its JSON output: $(lastline "$err")"
		return 1
	fi
	if ! positive "$v"; then
		fail "$w" "$r" "fio exited 0 with $dir $field $v: $(lastline "$err")"
		return 1
	fi
	case $unit in
	MB/s) v=$(awk -v b="$v" 'BEGIN { printf "%.3f", b / 1e6 }') ;;
	*) v=$(awk -v b="$v" 'BEGIN { printf "%.1f", b }') ;;
	esac
	say "@@RESULT $w $r $v $unit"
}

# --- dbench ----------------------------------------------------------------
run_dbench() {
	local r=$1 rc v
	rm -rf "$W/dbench"
	mkdir -p "$W/dbench"
	drop_caches
	dbench -c /usr/share/dbench/client.txt -t "$BENCH_DBENCH_SECS" -D "$W/dbench" \
		"$BENCH_DBENCH_CLIENTS" >"$meta/dbench.out" 2>"$err"
	rc=$?
	v=$(awk '$1 == "Throughput" && $3 == "MB/sec" { v = $2 } END { print v }' "$meta/dbench.out")
	local why=""
	if [ $rc -ne 0 ]; then
		why="dbench exited $rc"
	elif ! [[ $v =~ ^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$ ]]; then
		why="dbench exited 0 without a Throughput line"
	elif ! positive "$v"; then
		# dbench takes a client count it cannot parse as 0 clients and
		# reports 0 MB/sec: nothing was measured.
		why="dbench exited 0 with Throughput $v MB/sec"
	fi
	if [ -n "$why" ]; then
		local last
		last=$(lastline "$err")
		[ "$last" = "(no stderr)" ] && last=$(lastline "$meta/dbench.out")
		fail dbench "$r" "$why: $last"
		return 1
	fi
	say "@@RESULT dbench $r $(awk -v b="$v" 'BEGIN { printf "%.3f", b }') MB/s"
	rm -rf "$W/dbench"
}

# --- node_modules: install, chown, stat, find, rg, rm ------------------------
ph_install() {
	tool="tar"
	tar -xf "$nmtar" -C "$1" || return
	synced_from
}
ph_chown() {
	tool="chown"
	chown -R "$1:$1" "$nm/node_modules" || return
	synced_from
}
# stat(1) without -L uses lstat (statx AT_SYMLINK_NOFOLLOW) on every entry
# that find lists, as `ls -lR` or a package manager's tree walk would.
ph_stat() {
	tool="find"
	find "$nm" -print0 | xargs -0 stat -c %s >/dev/null
	local s=("${PIPESTATUS[@]}")
	[ "${s[0]}" -eq 0 ] || return "${s[0]}"
	tool="stat"
	return "${s[1]}"
}
ph_find() {
	tool="find"
	find "$nm" -name '*.json' | wc -l
	return "${PIPESTATUS[0]}"
}
ph_rg() { # rg exits 1 when nothing matched: a result, not a failure
	tool="rg"
	rg -c --no-ignore require "$nm" >/dev/null
	local rc=$?
	[ $rc -le 1 ] && return 0
	return $rc
}
ph_rm() {
	tool="rm"
	rm -rf "$1" || return
	synced_from
}

# install.$r is also what rm removes; when rm runs without install, the tree
# is laid out untimed first so rm always has the same work to do.
install_dir() {
	[ -d "$W/install.$1" ] && return 0
	mkdir -p "$W/install.$1" && tar -xf "$nmtar" -C "$W/install.$1" 2>"$err" && return 0
	fail rm "$1" "untimed tar -xf for rm exited $?: $(lastline "$err")"
	return 1
}

# --- sqlite ----------------------------------------------------------------
db=$W/bench.db
sqlite_insert_sql() { # rows in transactions of 1000, into an indexed table
	local left=$BENCH_SQLITE_ROWS base=0 n
	echo "CREATE TABLE t(id INTEGER PRIMARY KEY, k INTEGER NOT NULL, v TEXT NOT NULL);"
	echo "CREATE INDEX t_k ON t(k);"
	while [ "$left" -gt 0 ]; do
		n=$((left < 1000 ? left : 1000))
		echo "BEGIN;"
		echo "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < $n)"
		echo "  INSERT INTO t(k, v) SELECT $base + x, hex(randomblob(32)) FROM c;"
		echo "COMMIT;"
		base=$((base + n))
		left=$((left - n))
	done
}
sqlite_select_sql() { # 2000 point selects spread over the key range
	local i
	for ((i = 0; i < 2000; i++)); do
		echo "SELECT v FROM t WHERE k = $(((i * 7919) % BENCH_SQLITE_ROWS + 1));"
	done
}
ph_sqlite() {
	tool="sqlite3"
	sqlite3 -batch -bail "$db" <"$1" || return
	tool="sync"
	sync
}
ph_sqlite_select() {
	tool="sqlite3"
	sqlite3 -batch -bail "$db" <"$1" >/dev/null
}

# --- the run -----------------------------------------------------------------
# Repetition-major: repetition r runs every wanted workload once, in the order
# of $all, before r+1 starts, so a run cut short (the time budget, a timeout)
# still has whole repetitions of every workload.
if want sqlite-insert || want sqlite-select; then
	sqlite_insert_sql >"$meta/insert.sql"
	sqlite_select_sql >"$meta/select.sql"
fi
# Each chown repetition really changes every owner: it flips between uid
# 1000 and root, starting from whatever the tree has, and the tree gets its
# first owner back at the end (untimed).
chown_first=
want chown && chown_first=$(stat -c %u "$nm/node_modules" 2>/dev/null)
chown_uid=$chown_first

run_rep() {
	local r=$1 w read_ran=
	want fio-seqread && run_fio fio-seqread "$r" read 128k read bw_bytes MB/s
	want fio-seqwrite && run_fio fio-seqwrite "$r" write 128k write bw_bytes MB/s --end_fsync=1
	want fio-randread && run_fio fio-randread "$r" randread 4k read iops IOPS
	want fio-randwrite && run_fio fio-randwrite "$r" randwrite 4k write iops IOPS --end_fsync=1
	want dbench && run_dbench "$r"
	if want install; then
		rm -rf "$W/install.$r"
		mkdir -p "$W/install.$r"
		timed install "$r" ph_install "$W/install.$r"
	fi
	if want chown; then
		if [ "$chown_uid" = 1000 ]; then chown_uid=0; else chown_uid=1000; fi
		timed chown "$r" ph_chown "$chown_uid"
	fi
	for w in stat find rg; do
		want $w || continue
		read_ran=1
		timed $w "$r" ph_$w
	done
	if [ -n "$read_ran" ] && [ "$r" -eq 1 ]; then
		# What the read workloads left in the page cache (DAX and
		# cache=always trade guest page cache for host page cache); read
		# before the next drop, and from repetition 1, which every row runs.
		say "@@INFO page_cache_kib $(awk '$1 == "Cached:" { print $2 }' /proc/meminfo)"
	fi
	if want rm; then
		install_dir "$r" && timed rm "$r" ph_rm "$W/install.$r"
	fi
	# A tree rm did not take must not pile up under the next repetitions.
	rm -rf "$W/install.$r"
	if want sqlite-insert; then
		rm -f "$db" "$db-journal"
		timed sqlite-insert "$r" ph_sqlite "$meta/insert.sql"
	fi
	if want sqlite-select; then
		if [ ! -s "$db" ] || ! sqlite3 -batch "$db" "SELECT 1 FROM t LIMIT 1" >/dev/null 2>&1; then
			rm -f "$db" "$db-journal"
			if ! sqlite3 -batch -bail "$db" <"$meta/insert.sql" >/dev/null 2>"$err"; then
				fail sqlite-select "$r" "untimed table fill exited $?: $(lastline "$err")"
			fi
		fi
		[ -s "$db" ] && timed sqlite-select "$r" ph_sqlite_select "$meta/select.sql"
	fi
	return 0
}

# The budget check runs before every repetition but the first, which always
# runs in full so every workload has a sample: the next repetition starts
# only if it fits, taking the slowest one so far as its cost.
longest=0
rep_secs=
for ((r = 1; r <= BENCH_REPS; r++)); do
	if [ "$r" -gt 1 ] && [ "$BENCH_BUDGET_SECS" -gt 0 ]; then
		now
		elapsed=$((REPLY - t_script))
		if [ $((elapsed + longest)) -gt $((BENCH_BUDGET_SECS * 1000000)) ]; then
			say "@@INFO budget_stop after repetition $((r - 1)) of $BENCH_REPS: $(secs $elapsed) s elapsed + $(secs $longest) s for the longest repetition > BENCH_BUDGET_SECS=$BENCH_BUDGET_SECS"
			break
		fi
	fi
	now
	t_rep=$REPLY
	run_rep "$r"
	now
	t_rep=$((REPLY - t_rep))
	[ "$t_rep" -gt "$longest" ] && longest=$t_rep
	rep_secs="${rep_secs:+$rep_secs }$(secs $t_rep)"
	say "@@INFO reps_done $r"
	say "@@INFO rep_seconds $rep_secs"
done
rm -f "$fiofile"
rm -rf "$W/dbench" "$W"/install.*
if [ -n "$chown_first" ] && [ "$chown_uid" != "$chown_first" ]; then
	chown -R "$chown_first:$chown_first" "$nm/node_modules" 2>/dev/null
fi

cleanup
trap - EXIT
say "@@DONE"
