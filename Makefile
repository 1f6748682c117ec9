# kettlefleet — `make demo` runs the case study end to end, `make test` runs
# every test (vet + race) against SQLite and a throwaway PostgreSQL.

GO      ?= go
BIN     := bin/kettle
PKGS    := ./...
# A fresh clone needs Go and gcc for `make demo` (cgo: the SQLite driver);
# `make test` also needs the Debian packages of `make deps` (gcc and libc6-dev
# for cgo and the race detector, PostgreSQL, Chromium, Mosquitto,
# Prometheus, wrk, Locust; jq, time and curl for the benchmarks' smoke runs;
# the arm64 cross compiler, qemu-user and systemd for the release, image and
# unit tests), and installs them itself when one is missing (deps-check).
DEB_PKGS := gcc libc6-dev postgresql chromium mosquitto prometheus prometheus-node-exporter wrk python3-locust openssl jq time curl git \
	gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static systemd ca-certificates tzdata file

.PHONY: all build demo test test-short vet deps deps-check deps-ensure bench bench-ingest chaos clean docs results screenshots release image

all: build

# Without a C compiler Go builds with cgo off and the SQLite driver's
# symbols are missing: say what to install instead of a compiler error.
build:
	@command -v "$$($(GO) env CC)" >/dev/null || { echo "make: $$($(GO) env CC) not found: the SQLite driver needs cgo (apt-get install gcc libc6-dev)"; exit 1; }
	$(GO) build -o $(BIN) ./cmd/kettle

demo: build
	./$(BIN) demo $(DEMO_ARGS)

vet:
	$(GO) mod tidy -diff
	@unformatted=$$("$$($(GO) env GOROOT)/bin/gofmt" -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt: not formatted (run gofmt -w):"; echo "$$unformatted"; exit 1; fi
	$(GO) vet $(PKGS)
	cd deploy/dist && $(GO) mod tidy -diff && $(GO) vet ./...

# deploy/dist (releases, the image, the chart: a module of its own) runs
# beside the main suite, whose packages wait on servers much of the time.
# Under -race internal/rawio is syscall.Read/Write: the packages that import
# it run once more without -race, on the raw system calls they ship.
test: deps-ensure vet
	@mkdir -p .deps; rm -f .deps/dist-test.rc; \
	( cd deploy/dist && $(GO) test -timeout 30m -count=1 ./... >../../.deps/dist-test.log 2>&1; echo $$? >../../.deps/dist-test.rc ) & \
	rc=0; $(GO) test -race -timeout 14m -count=1 $(PKGS) || rc=$$?; \
	$(GO) test -timeout 5m -count=1 $$($(GO) list -f '{{.ImportPath}}{{range .Imports}} {{.}}{{end}}' $(PKGS) | awk '/internal\/rawio/ {print $$1}') || rc=$$?; \
	wait; echo "== deploy/dist"; cat .deps/dist-test.log; \
	[ "$$(cat .deps/dist-test.rc 2>/dev/null)" = 0 ] || rc=1; exit $$rc

test-short: vet
	$(GO) test -short -count=1 $(PKGS)

# Installs what the tests use: the Debian packages, then each installer in
# deploy/deps/ (root; idempotent).
# apt.sh is a library the others source, not an installer.
DEPS_SCRIPTS := $(filter-out deploy/deps/apt.sh,$(sort $(wildcard deploy/deps/*.sh)))
# The packages of DEB_PKGS not installed, from one dpkg query.
MISSING_DEBS = dpkg-query -W -f='$${db:Status-Status} $${Package}\n' $(DEB_PKGS) 2>/dev/null | awk '$$1 == "installed" { ok[$$2] = 1 } END { n = split("$(DEB_PKGS)", p, " "); for (i = 1; i <= n; i++) if (!ok[p[i]]) printf " %s", p[i] }'
deps:
	@missing=$$($(MISSING_DEBS)); \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	else echo "deps: all installed"; fi
	@set -e; for s in $(DEPS_SCRIPTS); do $$s; done

# Whether everything `make deps` installs is there, in well under a second:
# one dpkg query and each installer's --check. Exits 1 naming what is missing.
deps-check:
	@missing=$$($(MISSING_DEBS)); \
	[ -z "$$missing" ] || { echo "deps: missing Debian packages:$$missing"; exit 1; }
	@set -e; for s in $(DEPS_SCRIPTS); do $$s --check; done

# `make test` on a fresh machine: `make deps` only when deps-check finds
# something missing (as root; otherwise it says what to install).
deps-ensure:
	@$(MAKE) --no-print-directory deps-check || \
	if [ "$$(id -u)" = 0 ]; then echo "deps: installing what is missing (make deps)"; $(MAKE) --no-print-directory deps; \
	else echo "deps: run 'sudo make deps' (make test needs what it installs)"; exit 1; fi

# Acknowledged measurements/s on the embedded store vs a bare JSON handler.
bench-ingest: build
	bench/ingest.sh

bench: bench-ingest
	$(GO) test -run '^$$' -bench . -benchmem ./httpapi/ ./sqlite/ ./

# Faults, overload, hostile input against real processes; writes
# docs/reliability.md. One part: go run ./chaos/cmd/chaos PART, PART one of
# crash outage outage-blackhole overload slow badinput auth failover pause
# log-outage log-broker log-broker-pause log-controller log-writer
# log-failover mqttstorm nemesis nem-primary-cut nem-primary-pause nem-node-cut nem-wal-full
# nem-broker-disk-full nem-sqlite-disk-full nem-clock nem-worker-cut machines bench-smoke
# (every part of chaos/cmd/chaos; bench/docs_test.go holds this list to it).
# The seeded nemesis (3 seeds × 10 min on the machines of deploy/cluster.sh)
# runs here only, its 2-minute form too: the machines' up and down, the
# run, the audit and the members' catch-up take minutes on this 2-core
# machine under the heavy lock, more than make test's 15-minute budget has left
# (docs/reliability.md, Findings, gives a seed's cost from the recorded run).
chaos:
	$(GO) run ./chaos/cmd/chaos $(CHAOS_ARGS) all

# The references, generated from the code: docs/configuration.md from every
# command's flag set, docs/api.md from httpapi/openapi.json. `make test`
# fails while they differ from what this writes.
docs:
	$(GO) test -count=1 -run '^TestReferenceCurrent$$' ./cmd/kettle/ -update

# docs/results.md, the README's headline table and the figures
# docs/performance.md cites (<!--fig bench.sh:LINE "name"-->), from
# bench/results.jsonl (every bench/*.sh appends its run there through
# internal/results/cmd/record). `make test` fails while they are stale.
results:
	$(GO) test -count=1 -run '^TestRenderedResultsCurrent$$' ./internal/results/ -update

# The README's images, taken in Chromium (make deps) by the browser tests:
# the report of a recorded demo run (report/testdata), the comparison of two
# recorded runs, the dashboard on a real kettle serve and kettle swarm --ui
# live against one (a shaped run); written to docs/img/.
SHOTS := .deps/screenshots
screenshots:
	rm -rf $(SHOTS)
	KETTLE_TEST_OUT=$(CURDIR)/$(SHOTS) $(GO) test -count=1 -run '^(TestReportInBrowser|TestCompareInBrowser|TestDashboardInBrowser)$$' ./report/ ./web/
	KETTLE_TEST_OUT=$(CURDIR)/$(SHOTS) $(GO) test -count=1 -run '^TestLiveInBrowser$$' ./cmd/kettle/
	mkdir -p docs/img
	cp $(SHOTS)/report.png docs/img/report.png
	cp $(SHOTS)/compare.png docs/img/compare.png
	cp $(SHOTS)/live.png docs/img/live.png
	cp $(SHOTS)/fleet-1280.png docs/img/dashboard.png

# Static binaries for linux/amd64 and linux/arm64, tarballs and SHA256SUMS
# in dist/: reproducible (deploy/release/release.sh; VERSION=1.2.3 to name it).
release:
	deploy/release/release.sh dist

# The OCI image of both binaries in dist/oci (an OCI layout: push it with
# skopeo or crane), its SBOM in dist/oci.cdx.json; the same commit gives
# the same digest.
image: release
	cd deploy/dist && $(GO) run ./cmd/image --amd64 ../../dist/kettle_linux_amd64 --arm64 ../../dist/kettle_linux_arm64 \
		--out ../../dist/oci --version "$$(git describe --tags --always --dirty 2>/dev/null | sed 's/^v//')" \
		--revision "$$(git rev-parse HEAD)" --epoch "$$(git log -1 --format=%ct)"

clean:
	rm -rf bin kettle-data results chaos-results dist
