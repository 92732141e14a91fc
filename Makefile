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

.PHONY: all build test lint fuzz install clean guest guest-kernel guest-image bench bench-suite bench-image bench-blk

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

# The full test suite, as CI runs it: unit and integration tests, then a
# short run of every fuzz target.
test: build guest guest-image
	KATA_FSX_GUEST_DIR=$(GUESTDIR) $(GO) test -count=1 -timeout 25m ./...
	FUZZTIME=$(FUZZTIME) test/fuzz.sh

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

# The test guest kit: kernel, initramfs and test agent, from Debian packages.
# build.sh skips the work when its inputs are unchanged.
guest:
	test/guest/build.sh $(GUESTDIR)

# The test guest as Kata boots its own: a kernel with every pod driver built
# in (vmlinux-kata, Kata's vmlinux.container, from Debian's linux-source
# package; 30 CPU-minutes, 16-35 min on 2 cores the first time, then cached) and
# a root filesystem image (kata-containers.img) with the test agent as
# /sbin/init, booted with `image =` and no initrd. Both scripts skip the
# work when their inputs are unchanged.
guest-kernel:
	test/guest/build-kernel.sh $(GUESTDIR)

guest-image: guest-kernel
	test/guest/build-image.sh $(GUESTDIR)

clean:
	rm -rf bin $(BUILD)/configuration.toml
