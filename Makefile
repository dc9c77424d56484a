# kvrelay build, test and tooling. Every target runs on a fresh machine.
export GOTOOLCHAIN := go1.27.3
export GOFLAGS := -mod=mod

GO      ?= go
PYTHON  ?= python3
VENV    := $(CURDIR)/.venv
VPY     := $(VENV)/bin/python
BIN     := $(CURDIR)/.bin

# Interop tests find the venv's interpreter and the built binary through
# these variables.
export KVRELAY_PYTHON := $(VPY)
export KVRELAY_BIN := $(BIN)/kvrelay
# The engines' own publisher modules, extracted from their pinned wheels.
ENGINES := $(VENV)/engines
export KVRELAY_ENGINES := $(ENGINES)
# A test that needs the venv or the engine releases skips on a plain
# `go test` (naming the command that fetches them) but fails under make:
# a full run can never pass by skipping (testkit/prereq).
export KVRELAY_REQUIRE_PREREQS := 1

.PHONY: release image golden bench-smoke engines engines-long test-long all build test test-go test-fuzz vet fmt-check proto proto-check venv run bench vulncheck clean

all: build

build:
	$(GO) build -o $(BIN)/kvrelay ./cmd/kvrelay

# A release-style build: static, trimmed paths, the version stamped (the VCS
# revision is stamped by go build itself; `kvrelay version` prints both).
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
GOARCH  ?= $(shell $(GO) env GOARCH)
RELEASE := $(BIN)/linux-$(GOARCH)/kvrelay
release:
	CGO_ENABLED=0 GOOS=linux GOARCH=$(GOARCH) $(GO) build -trimpath \
		-ldflags "-s -w -X github.com/kvrelay/kvrelay/internal/buildinfo.Version=$(VERSION)" \
		-o $(RELEASE) ./cmd/kvrelay

# The container image as a tarball (docker/podman load), built without a
# container daemon or a base image: see deploy/image.
IMAGE_TAG ?= kvrelay:$(VERSION)
image: release
	$(GO) run ./deploy/image -binary $(RELEASE) -arch $(GOARCH) -tag $(IMAGE_TAG) -out $(BIN)/kvrelay-image.tar

# The Python peers (pyzmq, msgspec, the SMG packages) live in a venv built
# from the pinned requirements, so tests never depend on what a machine has.
venv: $(VENV)/.stamp
$(VENV)/.stamp: testdata/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r testdata/requirements.txt
	touch $@

# Each engine release's own kv_events module (testdata/engines/releases.json:
# the wheel pinned by hash, downloaded without dependencies, only the module
# kept). engines: the newest release of each engine, for make test;
# engines-long: every release in the matrix, for make test-long.
engines: venv
	$(VPY) testdata/engines/fetch.py $(ENGINES) --tier newest

engines-long: venv
	$(VPY) testdata/engines/fetch.py $(ENGINES) --tier all

# The compiler (bufbuild/protocompile, driven by proto/generate) and the
# plugins are Go modules pinned in go.mod: no protoc needed.
PROTO_FILES := $(patsubst proto/%,%,$(wildcard proto/smg/*.proto))
proto:
	$(GO) build -o $(BIN)/ google.golang.org/protobuf/cmd/protoc-gen-go google.golang.org/grpc/cmd/protoc-gen-go-grpc
	$(GO) run ./proto/generate -I proto -out proto/kvpb \
		-plugin $(BIN)/protoc-gen-go -plugin $(BIN)/protoc-gen-go-grpc \
		-param paths=import,module=github.com/kvrelay/kvrelay/proto/kvpb \
		$(PROTO_FILES)

# Fails when the committed generated code differs from a fresh generation.
proto-check: proto
	git diff --exit-code -- proto/
	test -z "$$(git status --porcelain -- proto/)"

# Rewrites the golden vectors with real msgspec and SMG's Python relay as
# the oracle, then checks our decoder against them.
golden: venv
	$(VPY) testdata/golden/gen.py
	$(GO) test -count=1 -run TestGoldenVectors ./engines/

vet:
	$(GO) vet ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# The race tests take minutes per package: testprogress prints slow and
# failing tests, the packages still running every 30 s, and go test's own
# "ok pkg" / "FAIL pkg" summary lines.
test-go: venv engines build
	$(GO) build -o $(BIN)/testprogress ./testkit/testprogress
	bash -o pipefail -c '$(GO) test -race -count=1 -timeout 20m -json ./... | $(BIN)/testprogress'

# The longer tier (not run by .ci/run): the interop tests against every
# engine release in the matrix, the oldest ones whose wire we decode too.
# It also holds the NATS failover drill (three gateway replicas on an
# in-process 3-node JetStream cluster losing one node per round, ~1 min)
# and the heavy interop run: a 1 M-block snapshot and a
# 131,072-block batch through SMG's gateway and ours (minutes, ~2 GiB).
test-long: engines-long build
	KVRELAY_ENGINE_TIER=long $(GO) test -race -count=1 -timeout 30m -run 'EngineRelease' ./relay/ ./cmd/kvrelay/
	KVRELAY_HEAVY_INTEROP=1 $(GO) test -count=1 -timeout 30m -run 'TestGatewaysTakeAMillionBlockSnapshot' ./interop/
	KVRELAY_NATS_DRILL=1 $(GO) test -race -count=1 -timeout 10m -run 'TestNATSClusterDrill' ./cmd/kvrelay/
	KVRELAY_JETSTREAM_DRILL=10 $(GO) test -race -count=1 -timeout 20m -run 'TestJetStreamRestartDrill' ./natsevents/

# Each fuzz target runs briefly; a crash fails the build.
FUZZTIME ?= 10s
test-fuzz:
	./testdata/run-fuzz.sh $(FUZZTIME)

# make test runs the stages in this order through testdata/test-stages.sh:
# it announces each one, keeps its output in .bin/test-logs/<stage>.log
# (test-go's progress and the fuzz counter are shown as they come), stops
# at the first failure with the tail of its log, and ends with a summary
# table of stages and times. Any stage runs alone as its own target.
TEST_STAGES := fmt-check vet proto-check test-go bench-smoke test-fuzz vulncheck
test:
	MAKE="$(MAKE)" ./testdata/test-stages.sh $(TEST_STAGES)

run: build
	$(BIN)/kvrelay demo

# The side-by-side against SMG's Python relay, the scale curves and the
# plots; BENCHFLAGS=--quick for a short run. Writes bench-out/. The plots
# are drawn by cmd/kvrelay-plot, so the daemon links no plotting code.
BENCHFLAGS ?=
BENCHOUT ?= bench-out
bench: build venv
	$(BIN)/kvrelay bench --out $(BENCHOUT) $(BENCHFLAGS)
	$(GO) run ./cmd/kvrelay-plot $(BENCHOUT)

# Every Go benchmark once, so none of them rots; asserts no timing.
bench-smoke: venv
	$(GO) test -run '^$$' -bench . -benchtime 1x ./...

# govulncheck against an offline copy of the Go vulnerability database,
# built from the golang.org/x/vulndb module.
VULNDB_VERSION := v0.0.0-20261105234957-e22db6528018
vulncheck:
	./testdata/vulncheck.sh $(VULNDB_VERSION)

clean:
	rm -rf $(BIN) $(VENV)
