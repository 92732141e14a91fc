package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// guestScript runs every workload inside the guest, in the container whose
// root is the disk under test, and times each phase there so boot time and
// the agent round trips stay out of the numbers. bash's EPOCHREALTIME reads
// the clock without a fork. Every phase starts from a dropped page cache and
// ends with sync where it writes, so the device does the work.
//
// Arguments: files dirs reps fio-runtime-seconds fio-size-MiB [only], where
// only is "all" or a comma-separated list of workload groups to run: files
// (create, chown, ls, cat, rm), seqwrite, randread, seqread, imgrandread,
// imgseqread (randread and seqread read the file seqwrite writes).
// Output lines: "@@PHASE name rep microseconds", and fio's JSON between
// "@@FIO name rep" and "@@END status".
const guestScript = `#!/bin/bash
set -u
FILES=$1 DIRS=$2 REPS=$3 RT=$4 FSIZE=$5 ONLY=${6:-all}
want() { [[ $ONLY == all || ",$ONLY," == *",$1,"* ]]; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
phase() { echo "@@PHASE $1 $2 $(( $4 - $3 ))"; }
per=$((FILES / DIRS))
payload=$(printf '%01536d' 0)
for ((r = 1; r <= REPS; r++)); do
	want files || break
	base=/bench/t$r
	drop
	t0=${EPOCHREALTIME/./}
	mkdir $base
	for ((d = 0; d < DIRS; d++)); do
		mkdir $base/d$d
		for ((i = 0; i < per; i++)); do
			printf '%s\n' "$payload" > $base/d$d/f$i
		done
	done
	sync
	t1=${EPOCHREALTIME/./}; phase create $r $t0 $t1
	drop
	t0=${EPOCHREALTIME/./}; chown -R 1000:1000 $base; sync; t1=${EPOCHREALTIME/./}; phase chown $r $t0 $t1
	drop
	t0=${EPOCHREALTIME/./}; ls -lR $base > /dev/null; t1=${EPOCHREALTIME/./}; phase ls $r $t0 $t1
	drop
	t0=${EPOCHREALTIME/./}
	for d in $base/d*; do cat $d/* > /dev/null; done
	t1=${EPOCHREALTIME/./}; phase cat $r $t0 $t1
	drop
	t0=${EPOCHREALTIME/./}; rm -rf $base; sync; t1=${EPOCHREALTIME/./}; phase rm $r $t0 $t1
done
fio_run() {
	local name=$1 r=$2
	shift 2
	drop
	echo "@@FIO $name $r"
	fio --output-format=json "$@"
	echo "@@END $?"
}
common="--ioengine=libaio --direct=1 --iodepth=16"
for ((r = 1; r <= REPS; r++)); do
	want seqwrite || break
	fio_run seqwrite $r --name=seqwrite --filename=/bench/fio.dat --rw=write --bs=1M --size=${FSIZE}M $common --end_fsync=1
done
for ((r = 1; r <= REPS; r++)); do
	want randread || break
	fio_run randread $r --name=randread --filename=/bench/fio.dat --rw=randread --bs=4k --runtime=$RT --time_based $common
done
for ((r = 1; r <= REPS; r++)); do
	want seqread || break
	fio_run seqread $r --name=seqread --filename=/bench/fio.dat --rw=read --bs=128k --runtime=$RT --time_based $common
done
for ((r = 1; r <= REPS; r++)); do
	want imgrandread || break
	fio_run imgrandread $r --name=imgrandread --filename=/bench/image.dat --readonly --rw=randread --bs=4k --runtime=$RT --time_based $common
done
for ((r = 1; r <= REPS; r++)); do
	want imgseqread || break
	fio_run imgseqread $r --name=imgseqread --filename=/bench/image.dat --readonly --rw=read --bs=128k --runtime=$RT --time_based $common
done
rm -f /bench/fio.dat
sync
echo "@@DONE"
`

// sample is one measured value of one workload in one guest.
type sample struct {
	workload string
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
			if len(f) != 4 {
				return nil, fmt.Errorf("malformed phase line %q", line)
			}
			rep, err1 := strconv.Atoi(f[2])
			us, err2 := strconv.ParseInt(f[3], 10, 64)
			if err1 != nil || err2 != nil || us < 0 {
				return nil, fmt.Errorf("malformed phase line %q", line)
			}
			samples = append(samples, sample{workload: f[1], rep: rep, value: float64(us) / 1e6})
		case strings.HasPrefix(line, "@@FIO "):
			f := strings.Fields(line)
			if len(f) != 3 {
				return nil, fmt.Errorf("malformed fio line %q", line)
			}
			rep, err := strconv.Atoi(f[2])
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
				return nil, fmt.Errorf("fio %s rep %d failed (status %q): %s", f[1], rep, status, truncate(body.String(), 2000))
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
				samples = append(samples, sample{workload: f[1], rep: rep, value: j.Write.BWBytes / 1e6})
			case "randread", "imgrandread":
				samples = append(samples, sample{workload: f[1], rep: rep, value: j.Read.IOPS})
			case "seqread", "imgseqread":
				samples = append(samples, sample{workload: f[1], rep: rep, value: j.Read.BWBytes / 1e6})
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
