package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// guestScript runs every workload inside the one guest, in the container
// whose root is a separate tools disk, on each disk under test in turn: disk
// X is mounted at /disks/X. Each phase runs on every disk before the next
// phase starts, and the disk order rotates by one every repetition, so the
// disks share the same stretch of time (and of the host's noise) and no
// disk always goes first. Phases are timed in the guest so boot time and
// the agent round trips stay out of the numbers; bash's EPOCHREALTIME reads
// the clock without a fork. Every phase starts from a dropped page cache
// and ends with sync where it writes, so the device does the work.
//
// Arguments: files dirs reps fio-runtime-seconds fio-size-MiB only disk...,
// where only is "all" or a comma-separated list of workload groups to run:
// files (create, chown, ls, cat, rm), seqwrite, randread, seqread,
// imgrandread, imgseqread (randread and seqread read the file seqwrite
// writes). Output lines: "@@PHASE name disk rep microseconds", and fio's
// JSON between "@@FIO name disk rep" and "@@END status".
const guestScript = `#!/bin/bash
set -u
FILES=$1 DIRS=$2 REPS=$3 RT=$4 FSIZE=$5 ONLY=$6
shift 6
DISKS=("$@")
n=${#DISKS[@]}
want() { [[ $ONLY == all || ",$ONLY," == *",$1,"* ]]; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
phase() { echo "@@PHASE $1 $2 $3 $(( $5 - $4 ))"; }
per=$((FILES / DIRS))
payload=$(printf '%01536d' 0)
# order R: the disks of repetition R, rotated by R-1.
order() { ORDER=(); local i; for ((i = 0; i < n; i++)); do ORDER+=("${DISKS[$(( (i + $1 - 1) % n ))]}"); done; }
create() {
	local base=$1 d i
	mkdir $base
	for ((d = 0; d < DIRS; d++)); do
		mkdir $base/d$d
		for ((i = 0; i < per; i++)); do
			printf '%s\n' "$payload" > $base/d$d/f$i
		done
	done
	sync
}
catall() { local d; for d in $1/d*; do cat $d/* > /dev/null; done; }
chownsync() { chown -R 1000:1000 $1; sync; }
rmsync() { rm -rf $1; sync; }
lsall() { ls -lR $1 > /dev/null; }
# timed NAME DISK REP CMD ARG: one phase on one disk.
timed() {
	local t0 t1
	drop
	t0=${EPOCHREALTIME/./}
	$4 $5
	t1=${EPOCHREALTIME/./}
	phase $1 $2 $3 $t0 $t1
}
fio_run() {
	local name=$1 x=$2 r=$3
	shift 3
	drop
	echo "@@FIO $name $x $r"
	fio --output-format=json "$@"
	echo "@@END $?"
}
common="--ioengine=libaio --direct=1 --iodepth=16"
for ((r = 1; r <= REPS; r++)); do
	order $r
	if want files; then
		for x in "${ORDER[@]}"; do timed create $x $r create /disks/$x/t$r; done
		for x in "${ORDER[@]}"; do timed chown $x $r chownsync /disks/$x/t$r; done
		for x in "${ORDER[@]}"; do timed ls $x $r lsall /disks/$x/t$r; done
		for x in "${ORDER[@]}"; do timed cat $x $r catall /disks/$x/t$r; done
		for x in "${ORDER[@]}"; do timed rm $x $r rmsync /disks/$x/t$r; done
	fi
	if want seqwrite; then
		# A new file every repetition, as the row says.
		for x in "${ORDER[@]}"; do rm -f /disks/$x/fio.dat; done
		sync
		for x in "${ORDER[@]}"; do
			fio_run seqwrite $x $r --name=seqwrite --filename=/disks/$x/fio.dat --rw=write --bs=1M --size=${FSIZE}M $common --end_fsync=1
		done
	fi
	if want randread; then
		for x in "${ORDER[@]}"; do
			fio_run randread $x $r --name=randread --filename=/disks/$x/fio.dat --rw=randread --bs=4k --runtime=$RT --time_based $common
		done
	fi
	if want seqread; then
		for x in "${ORDER[@]}"; do
			fio_run seqread $x $r --name=seqread --filename=/disks/$x/fio.dat --rw=read --bs=128k --runtime=$RT --time_based $common
		done
	fi
	if want imgrandread; then
		for x in "${ORDER[@]}"; do
			fio_run imgrandread $x $r --name=imgrandread --filename=/disks/$x/bench/image.dat --readonly --rw=randread --bs=4k --runtime=$RT --time_based $common
		done
	fi
	if want imgseqread; then
		for x in "${ORDER[@]}"; do
			fio_run imgseqread $x $r --name=imgseqread --filename=/disks/$x/bench/image.dat --readonly --rw=read --bs=128k --runtime=$RT --time_based $common
		done
	fi
done
for x in "${DISKS[@]}"; do rm -f /disks/$x/fio.dat; done
sync
echo "@@DONE"
`

// sample is one measured value of one workload in one guest.
type sample struct {
	workload string
	disk     string
	rep      int
	value    float64
}

// fioJSON is the part of fio's JSON output the benchmark reads.
type fioJSON struct {
	Jobs []struct {
		Error int `json:"error"`
		Read  struct {
			IOPS     float64 `json:"iops"`
			BWBytes  float64 `json:"bw_bytes"`
			IOBytes  float64 `json:"io_bytes"`
			Runtime  float64 `json:"runtime"`
			TotalIOs float64 `json:"total_ios"`
		} `json:"read"`
		Write struct {
			IOPS    float64 `json:"iops"`
			BWBytes float64 `json:"bw_bytes"`
		} `json:"write"`
	} `json:"jobs"`
}

// parseGuestOutput turns the script's stdout into samples: phases in
// seconds, fio reads and writes in IOPS or MB/s (10^6 bytes) as the
// workload table says.
func parseGuestOutput(out string) ([]sample, error) {
	var samples []sample
	done := false
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "@@PHASE "):
			f := strings.Fields(line)
			if len(f) != 5 {
				return nil, fmt.Errorf("malformed phase line %q", line)
			}
			rep, err1 := strconv.Atoi(f[3])
			us, err2 := strconv.ParseInt(f[4], 10, 64)
			if err1 != nil || err2 != nil || us < 0 {
				return nil, fmt.Errorf("malformed phase line %q", line)
			}
			samples = append(samples, sample{workload: f[1], disk: f[2], rep: rep, value: float64(us) / 1e6})
		case strings.HasPrefix(line, "@@FIO "):
			f := strings.Fields(line)
			if len(f) != 4 {
				return nil, fmt.Errorf("malformed fio line %q", line)
			}
			rep, err := strconv.Atoi(f[3])
			if err != nil {
				return nil, fmt.Errorf("malformed fio line %q", line)
			}
			var body strings.Builder
			status := ""
			for sc.Scan() {
				l := sc.Text()
				if strings.HasPrefix(l, "@@END ") {
					status = strings.TrimPrefix(l, "@@END ")
					break
				}
				body.WriteString(l)
				body.WriteByte('\n')
			}
			if status != "0" {
				return nil, fmt.Errorf("fio %s on %s rep %d failed (status %q): %s", f[1], f[2], rep, status, truncate(body.String(), 2000))
			}
			js := body.String()
			if i := strings.Index(js, "{"); i > 0 {
				js = js[i:] // fio may print notes before its JSON
			}
			var res fioJSON
			if err := json.Unmarshal([]byte(js), &res); err != nil {
				return nil, fmt.Errorf("fio %s rep %d: parse JSON: %w", f[1], rep, err)
			}
			if len(res.Jobs) != 1 || res.Jobs[0].Error != 0 {
				return nil, fmt.Errorf("fio %s rep %d: want one job without error, got %s", f[1], rep, truncate(js, 500))
			}
			j := res.Jobs[0]
			switch f[1] {
			case "seqwrite":
				samples = append(samples, sample{workload: f[1], disk: f[2], rep: rep, value: j.Write.BWBytes / 1e6})
			case "randread", "imgrandread":
				samples = append(samples, sample{workload: f[1], disk: f[2], rep: rep, value: j.Read.IOPS})
			case "seqread", "imgseqread":
				samples = append(samples, sample{workload: f[1], disk: f[2], rep: rep, value: j.Read.BWBytes / 1e6})
			default:
				return nil, fmt.Errorf("unknown fio workload %q", f[1])
			}
		case line == "@@DONE":
			done = true
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if !done {
		return samples, fmt.Errorf("guest script did not finish")
	}
	return samples, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
