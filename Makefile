# kata-fsx build. Binaries land in bin/, generated files in build/.

GO         ?= go
PREFIX     ?= /usr/local
DESTDIR    ?=
VERSION    ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo 0.0.0-dev)
TOP        := $(abspath .)
BUILD      := $(TOP)/build
GUESTDIR   ?= $(BUILD)/guest

QEMUPATH   ?= $(firstword $(wildcard /usr/bin/qemu-system-x86_64) /usr/bin/qemu-system-x86_64)
VIRTIOFSD  ?= $(firstword $(wildcard /usr/libexec/virtiofsd /usr/lib/qemu/virtiofsd) /usr/libexec/virtiofsd)
KERNELPATH ?= $(GUESTDIR)/vmlinux
INITRDPATH ?= $(GUESTDIR)/initrd.img
RUNDIR     ?= /run/kata-fsx
STATEDIR   ?= /var/lib/kata-fsx/imagefs-blk

LDFLAGS    := -X github.com/kata-fsx/kata-fsx/cli.Version=$(VERSION) -X github.com/kata-fsx/kata-fsx/shim.Version=$(VERSION)
BINARIES   := kata-fsx containerd-shim-kata-fsx-v2 kata-fsx-overlay

.PHONY: all build test lint fuzz install clean guest guest-kernel guest-image bench bench-suite bench-image bench-blk bench-hostcost

all: build

build: $(addprefix bin/,$(BINARIES)) $(BUILD)/configuration.toml

bin/%: FORCE
	$(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $@ ./cmd/$*

FORCE:

$(BUILD)/configuration.toml: configuration.toml.in Makefile
	@mkdir -p $(BUILD)
	sed -e 's|@QEMUPATH@|$(QEMUPATH)|g' \
	    -e 's|@KERNELPATH@|$(KERNELPATH)|g' \
	    -e 's|@INITRDPATH@|$(INITRDPATH)|g' \
	    -e 's|@GUESTDIR@|$(GUESTDIR)|g' \
	    -e 's|@VIRTIOFSDPATH@|$(VIRTIOFSD)|g' \
	    -e 's|@RUNDIR@|$(RUNDIR)|g' \
	    -e 's|@STATEDIR@|$(STATEDIR)|g' $< > $@.tmp
	mv $@.tmp $@

# The full test suite, as CI runs it: unit and integration tests (the
# end-to-end ones against Debian's containerd 1.6), then the end-to-end
# subset CONTAINERD_E2E against each containerd of CONTAINERD_VERSIONS
# (test/e2e reads KATA_FSX_CONTAINERD), one version after the other (the
# e2e package checks for leftover processes globally), then a short run of
# every fuzz target.
test: build guest guest-image containerd
	KATA_FSX_GUEST_DIR=$(GUESTDIR) $(GO) test -count=1 -timeout 45m ./...
	@for v in $(CONTAINERD_VERSIONS); do \
	  echo "==> test/e2e against containerd $$v: $(CONTAINERD_E2E)"; \
	  KATA_FSX_CONTAINERD=$(CONTAINERD_DIR)/$$v KATA_FSX_GUEST_DIR=$(GUESTDIR) \
	    $(GO) test -count=1 -timeout 15m -run '$(CONTAINERD_E2E)' ./test/e2e || exit 1; \
	done
	FUZZTIME=$(FUZZTIME) test/fuzz.sh

# The per-version subset, 3-4 min a version on 2 cores: what differs
# between containerd releases. ctr: the shim's start/bootstrap and Task API
# (run on both backends, exec/kill/delete with events, a second container
# joining a pod, a refused create and annotation, the VM or the shim
# killed, a terminal, stats/pause/update, a network namespace) and the
# runtime introspection (TestContainerdVersion); CRI: pods on both
# backends, a runc pod beside them, CNI networking, a terminal, limits,
# newCRIEnvWith's settings; the version's deploy/containerd/ snippet; the
# kata-fsx snapshotter (TestSnapshotterCRI: lazy CRI pull, kata-fsx and
# runc pods, snapshotter restart, GC; it needs 1.7+ and skips on 1.6).
# Left to Debian's 1.6 run: the image, block, lazy, volume, hotplug,
# stream and guest-image tests, whose code paths do not involve containerd.
CONTAINERD_E2E ?= ^(TestContainerdVersion|TestSnapshotterCRI|TestCRIEnvOptions|TestDeployContainerdSnippet|TestShimContainerdRun|TestShimContainerdExecKillDelete|TestShimContainerdPodJoin|TestShimContainerdCreateRefused|TestShimRefusesDaemonLooseningAnnotation|TestShimContainerdVMDeath|TestShimContainerdDeadShim|TestShimContainerdTerminal|TestLimitsStatsPauseUpdate|TestNetworkCtrWithNS|TestCRIPods|TestCRIRuncBeside|TestNetworkCRIWithCNI|TestCRITerminal|TestLimitsCRI)$$

# containerd 1.7 and 2.x daemons (containerd, ctr, containerd-shim-runc-v2)
# built from their Go modules into build/containerd/<version>/, for the
# per-version end-to-end runs; a version whose binaries are present is
# skipped. 2.x builds with `go install module@version`; 1.7's go.mod has
# exclude directives, which `go install` refuses outside the main module,
# so 1.7 builds inside its module in the module cache (about 2-3 min each,
# once). no_btrfs: the btrfs snapshotter needs libbtrfs headers.
CONTAINERD_VERSIONS ?= v1.7.35 v2.2.9
CONTAINERD_DIR     ?= $(BUILD)/containerd

.PHONY: containerd
containerd:
	@set -e; for v in $(CONTAINERD_VERSIONS); do \
	  out=$(CONTAINERD_DIR)/$$v; \
	  case $$v in \
	    v1.*) mod=github.com/containerd/containerd ;; \
	    *) mod=github.com/containerd/containerd/$${v%%.*} ;; \
	  esac; \
	  ldflags="-X $$mod/version.Version=$${v#v}"; \
	  for b in containerd ctr containerd-shim-runc-v2; do \
	    if [ -x $$out/$$b ]; then echo "containerd $$v: $$out/$$b present"; continue; fi; \
	    echo "containerd $$v: building $$out/$$b from $$mod@$$v"; \
	    mkdir -p $$out; \
	    case $$v in \
	    v1.*) dir=$$(cd / && GOFLAGS= $(GO) mod download -json $$mod@$$v | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p'); \
	          test -n "$$dir" || { echo "go mod download $$mod@$$v: no module directory"; exit 1; }; \
	          GOFLAGS=-tags=no_btrfs $(GO) build -C $$dir -trimpath -ldflags "$$ldflags" -o $$out/$$b ./cmd/$$b ;; \
	    *)    GOBIN=$$out GOFLAGS=-tags=no_btrfs $(GO) install -trimpath -ldflags "$$ldflags" $$mod/cmd/$$b@$$v ;; \
	    esac; \
	  done; \
	done

# The test cluster's programs (test/kube): kubelet, kube-apiserver,
# kube-controller-manager, kube-scheduler, kube-proxy and kubectl from
# k8s.io/kubernetes, and etcd at the version that release requires, built
# from the Go module proxy into $(KUBE_DIR)/bin and kept (test/kube/build.sh).
KUBE_VERSION ?= v1.37.2
KUBE_DIR     ?= $(BUILD)/kube/$(KUBE_VERSION)

.PHONY: kube test-kube
kube:
	K8S_VERSION=$(KUBE_VERSION) GO=$(GO) test/kube/build.sh $(KUBE_DIR)

# The cluster tests (test/kube): a single-node cluster of the programs
# above in a network namespace of its own, containerd 2.x, kata-fsx
# installed by its DaemonSet, pods made with kubectl on both backends.
test-kube: build guest kube containerd
	flock $(CRITEST_LOCK) env KATA_FSX_KUBE_DIR=$(KUBE_DIR) KATA_FSX_CONTAINERD=$(CONTAINERD_DIR)/$(lastword $(CONTAINERD_VERSIONS)) \
	  KATA_FSX_GUEST_DIR=$(GUESTDIR) $(GO) test -count=1 -timeout 40m -v -run '^TestKube$$' ./test/kube

FUZZTIME ?= 10s

fuzz:
	FUZZTIME=$(FUZZTIME) test/fuzz.sh

lint:
	test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); exit 1; }
	$(GO) vet ./...
	$(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...

# Installs beside Kata: our configuration is configuration-fsx.toml under
# Kata's defaults directory (an admin overrides it with
# /etc/kata-containers/configuration-fsx.toml); Kata's own configuration.toml
# is never written.
CONFDIR    ?= /usr/share/defaults/kata-containers

install: build
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(CONFDIR)
	install -m 0755 $(addprefix bin/,$(BINARIES)) $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 $(BUILD)/configuration.toml $(DESTDIR)$(CONFDIR)/configuration-fsx.toml

# Benchmarks write their tables into docs/benchmarks.md and raw numbers
# into docs/bench/*.json. bench-suite is `kata-fsx bench`: every backend
# side by side on the bench image (built once from Debian packages and
# the npm registry, cached in build/cache); BENCH_FLAGS passes options.
bench: bench-suite bench-image bench-blk

bench-suite: build guest
	img=$$(test/fixtures/bench-image.sh $(BUILD)/cache) && bin/kata-fsx bench --image "$$img" $(BENCH_FLAGS)

# bench-hostcost is `kata-fsx bench --hostcost`: per backend and workload,
# the requests the host served and the system calls of the process serving
# the rootfs (strace), into docs/bench/hostcost.json and the host-cost
# section of docs/benchmarks.md; about 6 minutes here.
bench-hostcost: build guest
	img=$$(test/fixtures/bench-image.sh $(BUILD)/cache) && bin/kata-fsx bench --hostcost --image "$$img" $(BENCH_FLAGS)

bench-image:
	$(GO) run ./test/bench/imagebench -reps 5

# Boots one guest per block backend (imagefs-blk, virtio-blk, qemu-storage-
# daemon, virtio-blk writeback); needs root, the guest kit and fio. ~10 min.
bench-blk: build guest
	$(GO) run ./test/bench/blkbench

# Cold start from a registry (docker-registry in a network namespace of its
# own, the link shaped with tc): pull-and-unpack against lazy registry:
# images, on the bench image and a ~1 GiB variant; needs root, skopeo and
# docker-registry. ~30 min, most of it the 100 Mbit/s pulls.
.PHONY: bench-coldstart
bench-coldstart: build guest
	$(GO) run ./test/bench/coldbench

# The density benchmark (issue 19): N pods of one image started at once on
# imagefs-blk and on virtio-fs (test/e2e's TestDensityBench through a
# private containerd), the host memory of every pod's processes and the
# start of the last pod, for each count of DENSITY_N within
# DENSITY_BUDGET; docs/bench/density.json, rendered into docs/benchmarks.md
# by test/bench/densitybench with the earlier runs kept for comparison
# (DENSITY_EARLIER). Needs root, containerd and the guest kit;
# ~25 min on 2 cores under TCG. Not part of `make test`.
DENSITY_N      ?= 1,5,10,20,40
DENSITY_BUDGET ?= 40m
# Earlier committed runs rendered below the new one.
DENSITY_EARLIER ?= $(wildcard docs/bench/density-before-*.json)
.PHONY: bench-density
bench-density: build guest
	cd test/e2e && KATA_FSX_GUEST_DIR=$(GUESTDIR) KATA_FSX_DENSITY_N=$(DENSITY_N) KATA_FSX_DENSITY_BUDGET=$(DENSITY_BUDGET) \
	  KATA_FSX_DENSITY_OUT=$(TOP)/docs/bench/density.json $(GO) test -count=1 -timeout 120m -run '^TestDensityBench$$' -v .
	$(GO) run ./test/bench/densitybench -doc docs/benchmarks.md docs/bench/density.json $(DENSITY_EARLIER)

# The concurrency stress suite: STRESS_PODS pods of an image no pod has
# used, released at the same instant through a private containerd, for
# STRESS_ROUNDS rounds with a fresh image each, on virtio-fs, imagefs-blk
# and lazy registry images (test/e2e's TestStressNewImagePods). Every pod
# must start within a hang bound and read its image, each image's
# imagefs-blk metadata must be built once, nothing may be left; the start
# times go to docs/reliability.md between its stress markers. Needs root,
# containerd, docker-registry and the guest kit; a round of the three
# kinds takes about 7 min on 2 cores under TCG (each kind's pods start
# twice: the image new, then in the store), so 10 rounds about 70 min.
# Not part of `make test` (the test skips without KATA_FSX_STRESS_ROUNDS);
# STRESS_ROUNDS=2 is the CI-sized run.
STRESS_PODS   ?= 8
STRESS_ROUNDS ?= 10
.PHONY: stress
stress: build guest
	KATA_FSX_GUEST_DIR=$(GUESTDIR) KATA_FSX_STRESS_PODS=$(STRESS_PODS) KATA_FSX_STRESS_ROUNDS=$(STRESS_ROUNDS) \
	  KATA_FSX_STRESS_REPORT=$(TOP)/docs/reliability.md $(GO) test -count=1 -timeout 240m -run '^TestStressNewImagePods$$' -v ./test/e2e

# The fault suite: TestFaultLoop's 36 pod lifecycles, each with one of
# the pod's shim, QEMU, virtiofsd or containerd SIGKILLed at a random
# point of create, start, exec or delete, every third pod on the kata-fsx
# snapshotter, which is then the one killed (FAULT_SEED replays a run;
# the log prints the seed), writing its counts into docs/reliability.md
# between the faults markers. Needs root, containerd and the guest kit
# (make guest); ~20 min (about 30 s a lifecycle) on 2 shared cores
# under TCG, so make test runs no part of it (TestFaultLoop skips unless
# KATA_FSX_FAULT_LIFECYCLES is set).
FAULT_LIFECYCLES ?= 36
FAULT_SEED       ?=
.PHONY: faults
faults: build
	cd test/e2e && KATA_FSX_GUEST_DIR=$(GUESTDIR) KATA_FSX_FAULT_LIFECYCLES=$(FAULT_LIFECYCLES) KATA_FSX_FAULT_SEED=$(FAULT_SEED) \
	  KATA_FSX_FAULT_REPORT=$(TOP)/docs/reliability.md $(GO) test -count=1 -timeout 60m -run '^TestFaultLoop$$' -v .

# The initrd guest kit: kernel, initramfs and agent, from Debian packages
# and this tree. The kit the tests boot carries GUEST_AGENT, the hostile-
# guest tests' wrapper of the agent (test/guest/hostileagent), which is
# the product agent unless its kernel parameter asks it to attack.
# guest/initrd/build.sh skips the work when its inputs are unchanged.
GUEST_AGENT ?= ./test/guest/hostileagent

guest:
	GUEST_AGENT=$(GUEST_AGENT) guest/initrd/build.sh $(GUESTDIR)

# The guest as Kata boots its own: a kernel with every pod driver built
# in (vmlinux-kata, Kata's vmlinux.container, from Debian's linux-source
# package; 30 CPU-minutes, 16-35 min on 2 cores the first time, then cached) and
# a root filesystem image (kata-containers.img) with the product agent
# (cmd/kata-fsx-agent) as /sbin/init, booted with `image =` and no initrd.
# Both scripts skip the work when their inputs are unchanged.
guest-kernel:
	guest/kernel/build.sh $(GUESTDIR)

guest-image: guest-kernel
	guest/image/build.sh $(GUESTDIR)

clean:
	rm -rf bin $(BUILD)/configuration.toml

# CRI conformance: cri-tools' critest (built with `go test -c` from its
# module, as crictl is, into build/tools; kept once built) against a
# private containerd of each CRITEST_CONTAINERD version whose CRI runtime
# handlers are runc, kata-fsx (default policy), kata-fsx-virtiofs and
# kata-fsx-imagefs-blk, with look-alike test images on a loopback
# registry (test/critest). Each handler runs in CRITEST_CHUNKS parts,
# each under the e2e lock, with its own containerd; the JUnit reports in
# build/critest/<containerd>/ become docs/conformance.md. Needs root, the
# guest kit, containerd (make containerd), docker-registry, skopeo,
# busybox-static and containernetworking-plugins. Not part of `make test`.
# make critest-ci, which .ci/run calls, is the focused subset
# CRITEST_FOCUS on containerd 2.x, runc and the kata-fsx handlers pinned
# to each backend, with two ginkgo nodes: 24 specs that pass on all three
# in docs/conformance.md, about 4 min in all on 2 cores under TCG (3 min 52 s with portforward added).
CRITEST_VERSION    ?= v1.37.0
CRITEST            ?= $(BUILD)/tools/critest-$(CRITEST_VERSION)/critest
CRITEST_CONTAINERD ?= v2.2.9 v1.7.35
CRITEST_HANDLERS   ?= runc kata-fsx kata-fsx-virtiofs kata-fsx-imagefs-blk
CRITEST_CHUNKS     ?= pod container security image
CRITEST_LOCK       ?= /tmp/kata-fsx-e2e.lock
CRITEST_NODES      ?= 1
CRITEST_FOCUS      ?= Runtime info|basic operations on PodSandbox|Networking runtime|runtime should support (attach|exec with tty|portforward \[|creating container|starting container|execSync \[|listing container stats \[|removing created container|removing running container|reopening container log)
CRITEST_CI_HANDLERS ?= runc kata-fsx-virtiofs kata-fsx-imagefs-blk
CRITEST_CI_NODES    ?= 2

.PHONY: critest critest-bin critest-run critest-ci critest-report
critest:
	rm -rf $(BUILD)/critest
	$(MAKE) critest-run; s=$$?; $(MAKE) critest-report; exit $$s

critest-bin: $(CRITEST) $(dir $(CRITEST))ginkgo

# critest -parallel N runs the ginkgo CLI, of the version critest's module
# requires.
$(dir $(CRITEST))ginkgo:
	@mkdir -p $(dir $@)
	dir=$$(cd / && GOFLAGS= $(GO) mod download -json sigs.k8s.io/cri-tools@$(CRITEST_VERSION) | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p'); \
	$(GO) build -C $$dir -trimpath -o $@ github.com/onsi/ginkgo/v2/ginkgo

$(CRITEST):
	@mkdir -p $(dir $@)
	dir=$$(cd / && GOFLAGS= $(GO) mod download -json sigs.k8s.io/cri-tools@$(CRITEST_VERSION) | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p'); \
	test -n "$$dir" || { echo "go mod download cri-tools@$(CRITEST_VERSION): no module directory"; exit 1; }; \
	$(GO) test -C $$dir -c -trimpath -ldflags "-X sigs.k8s.io/cri-tools/pkg/version.Version=$(CRITEST_VERSION)" -o $@.tmp ./cmd/critest
	mv $@.tmp $@

# One go test a containerd, handler and chunk; a failed spec does not stop
# the run (the table records it), a leftover or a harness failure does.
critest-run: build critest-bin containerd guest
	@fail=0; for v in $(CRITEST_CONTAINERD); do for h in $(CRITEST_HANDLERS); do for c in $(CRITEST_CHUNKS); do \
	  echo "==> critest: containerd $$v, $$h, $$c"; \
	  flock $(CRITEST_LOCK) env KATA_FSX_CONTAINERD=$(CONTAINERD_DIR)/$$v KATA_FSX_GUEST_DIR=$(GUESTDIR) \
	    KATA_FSX_CRITEST=$(CRITEST) KATA_FSX_CRITEST_HANDLERS=$$h KATA_FSX_CRITEST_CHUNK=$$c KATA_FSX_CRITEST_KEEP_GOING=1 KATA_FSX_CRITEST_NODES=$(CRITEST_NODES) \
	    KATA_FSX_CRITEST_OUT=$(BUILD)/critest $(GO) test -count=1 -timeout 25m -run '^TestCritest$$' ./test/critest || fail=1; \
	done; done; done; exit $$fail

critest-report:
	$(GO) run ./test/critest/report -dir $(BUILD)/critest -out docs/conformance.md -reasons test/critest/reasons.txt

# The CI subset: every spec of CRITEST_FOCUS must pass on each handler.
critest-ci: build critest-bin containerd guest
	flock $(CRITEST_LOCK) env KATA_FSX_CONTAINERD=$(CONTAINERD_DIR)/$(firstword $(CRITEST_CONTAINERD)) KATA_FSX_GUEST_DIR=$(GUESTDIR) \
	  KATA_FSX_CRITEST=$(CRITEST) KATA_FSX_CRITEST_HANDLERS=$$(echo $(CRITEST_CI_HANDLERS) | tr ' ' ,) KATA_FSX_CRITEST_FOCUS='$(CRITEST_FOCUS)' \
	  KATA_FSX_CRITEST_NODES=$(CRITEST_CI_NODES) KATA_FSX_CRITEST_OUT=$(BUILD)/critest-ci $(GO) test -count=1 -timeout 25m -v -run '^TestCritest$$' ./test/critest
