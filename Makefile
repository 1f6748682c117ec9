# kettlefleet — `make demo` runs the case study end to end, `make test` runs
# every test (vet + race) against SQLite and a throwaway PostgreSQL.

GO      ?= go
BIN     := bin/kettle
PKGS    := ./...
# A fresh clone needs only Go for `make demo`; `make test` also needs the
# Debian packages installed by `make deps` (PostgreSQL, Chromium, Mosquitto,
# Prometheus, wrk, Locust).
DEB_PKGS := postgresql chromium mosquitto prometheus prometheus-node-exporter wrk python3-locust openssl \
	gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static systemd ca-certificates tzdata file curl

.PHONY: all build demo test test-short vet deps bench bench-ingest chaos clean docs results screenshots release image

all: build

build:
	$(GO) build -o $(BIN) ./cmd/kettle

demo: build
	./$(BIN) demo $(DEMO_ARGS)

vet:
	$(GO) mod tidy -diff
	@unformatted=$$("$$($(GO) env GOROOT)/bin/gofmt" -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt: not formatted (run gofmt -w):"; echo "$$unformatted"; exit 1; fi
	$(GO) vet $(PKGS)
	cd deploy/dist && $(GO) mod tidy -diff && $(GO) vet ./...

test: vet
	$(GO) test -race -timeout 12m -count=1 $(PKGS)
	cd deploy/dist && $(GO) test -timeout 12m -count=1 ./...

test-short: vet
	$(GO) test -short -count=1 $(PKGS)

# Installs the Debian packages the tests use (root; CI calls this).
deps:
	@missing=""; for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	else echo "deps: all installed"; fi
	deploy/deps/schemathesis.sh
	deploy/deps/kafka.sh
	deploy/deps/ha.sh
	deploy/deps/machines.sh

# Acknowledged measurements/s on the embedded store vs a bare JSON handler.
bench-ingest: build
	bench/ingest.sh

bench: bench-ingest
	$(GO) test -run '^$$' -bench . -benchmem ./httpapi/ ./sqlite/ ./

# Faults, overload, hostile input against real processes (≈15 min); writes
# docs/reliability.md. One part: go run ./chaos/cmd/chaos crash|outage|overload|slow|badinput|auth
chaos:
	$(GO) run ./chaos/cmd/chaos $(CHAOS_ARGS) all

# The references, generated from the code: docs/configuration.md from every
# command's flag set, docs/api.md from httpapi/openapi.json. `make test`
# fails while they differ from what this writes.
docs:
	$(GO) test -count=1 -run '^TestReferenceCurrent$$' ./cmd/kettle/ -update

# docs/results.md and the README's headline table, from bench/results.jsonl
# (every bench/*.sh appends its run there). `make test` fails while they are stale.
results:
	$(GO) test -count=1 -run '^TestRenderedResultsCurrent$$' ./internal/results/ -update

# The README's images, taken in Chromium (make deps) by the browser tests:
# the report of a recorded demo run (report/testdata) and the dashboard on a
# real kettle serve; written to docs/img/.
SHOTS := .deps/screenshots
screenshots:
	rm -rf $(SHOTS)
	KETTLE_TEST_OUT=$(CURDIR)/$(SHOTS) $(GO) test -count=1 -run '^(TestReportInBrowser|TestDashboardInBrowser)$$' ./report/ ./web/
	mkdir -p docs/img
	cp $(SHOTS)/report.png docs/img/report.png
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
