package density

import (
	"encoding/json"
	"strings"
	"testing"
)

func pod(id string, procs ...Process) Pod { return Pod{ID: id, Procs: procs} }

// TestMarkdownPerAddedPod: the table's per-pod figures come from the
// processes' PSS and RssAnon, and the growth per added pod is the slope
// between two counts, not the average.
func TestMarkdownPerAddedPod(t *testing.T) {
	shim := func(pss, anon int64) Process { return Process{Kind: KindShim, PssKiB: pss, RssAnonKiB: anon} }
	qemu := func(pss, shm int64) Process { return Process{Kind: KindQEMU, PssKiB: pss, PssShmemKiB: shm} }
	res := Result{Backends: []Backend{{
		Name: "imagefs-blk",
		Runs: []Run{
			{N: 1, LastSeconds: 9, FirstSeconds: 9, MemAvailableDropKiB: 300 << 10, ClientsPSSKiB: 20 << 10,
				Pods: []Pod{pod("a", shim(30<<10, 10<<10), qemu(270<<10, 100<<10))}},
			{N: 3, LastSeconds: 20, FirstSeconds: 12, MetadataEntries: 1, MetaFiles: 1, MetaInUse: 1,
				Pods: []Pod{
					pod("a", shim(10<<10, 5<<10), qemu(200<<10, 100<<10)),
					pod("b", shim(10<<10, 6<<10), qemu(200<<10, 100<<10)),
					pod("c", shim(10<<10, 7<<10), qemu(200<<10, 100<<10)),
				}},
		},
	}}}
	md := res.Markdown()
	for _, want := range []string{
		"| imagefs-blk | 1 | 9.0 s | 9.0 s | 300 MiB | 300.0 MiB | — | 100.0 MiB | 170.0 MiB | 30.0 MiB | 0.0 MiB | 10.0 MiB (10.0) | 280.0 MiB |",
		// (630-300)/(3-1) = 165 per added pod; median RssAnon 6 of 5, 6, 7.
		"| imagefs-blk | 3 | 20.0 s | 12.0 s | 630 MiB | 210.0 MiB | 165.0 MiB | 100.0 MiB | 100.0 MiB | 10.0 MiB | 0.0 MiB | 6.0 MiB (7.0) |",
		"| 3 | 1 | 1 | 1 |",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}
}

// TestMarkdownOddResults: a result file with runs but no pods, or no
// runs at all, renders without a panic.
func TestMarkdownOddResults(t *testing.T) {
	for js, want := range map[string]string{
		`{}`:                                  "| backend |",
		`{"backends":[{"name":"virtio-fs"}]}`: "| backend |",
		`{"backends":[{"name":"virtio-fs","runs":[{"n":0}]}]}`:             "| virtio-fs | 0 | no pod measured |",
		`{"backends":[{"name":"imagefs-blk","runs":[{"n":2,"pods":[]}]}]}`: "| imagefs-blk | 2 | no pod measured |",
	} {
		var res Result
		if err := json.Unmarshal([]byte(js), &res); err != nil {
			t.Fatal(err)
		}
		if md := res.Markdown(); !strings.Contains(md, want) {
			t.Errorf("%s: markdown lacks %q:\n%s", js, want, md)
		}
	}
}
