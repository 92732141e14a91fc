// Package workload holds the workload script of `kata-fsx bench`, the one
// program every backend row runs as its container process, and runs it on the
// host for the reference row.
package workload

import _ "embed" // for Script

// Script is the bash workload script (bench/workload/workloads.sh): it runs
// fio, dbench, node_modules and sqlite workloads and reports them on stdout as
// the @@START/@@INFO/@@RESULT/@@FAIL/@@DONE line protocol described in its
// header.
//
//go:embed workloads.sh
var Script string
