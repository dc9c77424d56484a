#!/usr/bin/env bash
# bench/goals.sh — the performance goals table (relay, snapshot, route, index, bytes) from one run on the current tree.
#
#   bench/goals.sh [--only PARTS] [--runs N] [--latency-runs N] [--out DIR]
#                    [--python PATH] [--trace TRACE.jsonl] [--llmd-bin PATH]
#                    [--rust-target DIR] [--corpus FILE] [--budget-scale F]
#
# Runs every row's existing measurement (kvrelay bench parts, the packages'
# go benchmarks, bench/indexers/run.sh) in a fixed order, each part under a
# time budget, and writes DIR/ (default bench-out/goals-<UTC time>):
#   context.txt          git commit (and whether the tree was dirty), machine, tools
#   parts.tsv            part, exit code, seconds, budget, load average before/after
#   <part>/uptime.txt    `uptime` before and after the part
#   <part>/...           the part's raw output (results.json/.md, go bench lines)
#   results.md           the goals table (goal | measured | met? | ...) by goals_table.py
# Parts, in the order they run (--only takes a comma-separated subset):
#   sidebyside  kvrelay serve vs SMG's Python relay: CPU per block at 1k/s, sustained rate
#   latency     added latency at 1k/s (p50) and 10k/s (p99) vs the no-relay control
#   decode      engines/wire: decode + normalize to wire bytes (the relay's path) per CPU-second; decode alone, Normalize's messages
#   snapshot    1 M live blocks delivered over gRPC; the relay's order + encode; the cut's COW
#   route       kvrelay bench --only route (8k tokens × 128 and × 512 workers)
#   indexers    bench/indexers/run.sh: ours vs SMG's and Dynamo's Rust indexers (and llm-d)
#   indexbytes  gateway/index: bytes per indexed block at block size 128
#   recordbytes relay/record: bytes per live block, plain and namespaced
# --runs N (default 3) repeats each part N times (go benchmarks: -count N);
# the latency part runs --latency-runs times (default 1: it already runs 3
# interleaved rounds). The indexers part needs --trace (a Mooncake FAST'25
# trace, e.g. traces/conversation_trace.jsonl of kvcache-ai/Mooncake); it is
# recorded as skipped without one. --budget-scale F multiplies every part's
# time budget (a slower or busier machine). See BENCHMARKS.md, "How to reproduce".
set -euo pipefail

self=$(realpath "$0")
root=$(git -C "$(dirname "$self")" rev-parse --show-toplevel)
export GOTOOLCHAIN=${GOTOOLCHAIN:-go1.27.3} GOFLAGS=${GOFLAGS:--mod=mod}

all_parts=(sidebyside latency decode snapshot route indexers indexbytes recordbytes)

# Budgets in seconds: a fixed part plus one per run (timeout(1) ends a part
# that overruns, with its children; the table then says so). From the dry
# run of 2026-12-03 at load average 6-25, with room: a quiet machine takes
# about half, but ramps that pass go further (sidebyside, latency).
budget_of() { # part runs
  local fixed per
  case $1 in
    sidebyside) fixed=30 per=400 ;;   # ramp 250..60k batches/s, 5 s a step, three relays: 2.3 min a run at load 6-15
    latency) fixed=30 per=600 ;;      # 3 rounds × 2 pacings × 3 rates × 3 s × 2 contenders + probes: 5.5 min at load 15-22
    decode) fixed=30 per=80 ;;        # 42 s for 3 runs at load 21 before the wire runs were added (a third more)
    snapshot) fixed=60 per=180 ;;     # 1 M-block relays built per benchmark: 4.6 min for 3 runs at load 21
    route) fixed=30 per=60 ;;         # 25 s a run at load 22
    indexers) fixed=600 per=200 ;;    # build + corpus derivation once (~5 min at load 25); llm-d's replay is most of a run
    indexbytes) fixed=300 per=0 ;;    # planning 8,000 sessions is most of it; one run
    recordbytes) fixed=30 per=60 ;;
  esac
  echo $((fixed + per * $2))
}

usage() {
  sed -n '2,30p' "$self" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# --- the internal entry point: one part, run under timeout by the driver ---
if [[ ${1:-} == --run-part ]]; then
  part=$2
  dir=$GOALS_OUT/$part
  bin=$GOALS_OUT/bin
  runs=$GOALS_RUNS
  status=0 # a failed run is recorded and the part goes on with its next run
  set +e
  load() { cut -d' ' -f1-3 /proc/loadavg; }
  gobench() { # pkgdir binary outfile args...: a go test binary's benchmarks, run in its package
    local pkg=$1 tb=$2 f=$3; shift 3
    echo "# load before: $(load)" >> "$f"
    (cd "$root/$pkg" && "$tb" -test.run '^$' "$@") >> "$f" 2>&1 || { echo "# FAILED: exit $?" >> "$f"; status=1; }
    echo "# load after: $(load)" >> "$f"
  }
  kvbench() { # run-dir args...
    local rd=$1; shift
    local py=()
    [[ -n $GOALS_PYTHON ]] && py=(--python "$GOALS_PYTHON")
    echo "load before: $(load)" > "$rd.load"
    "$bin/kvrelay" bench --repo "$root" "${py[@]}" --out "$rd" "$@" > "$rd.md" 2> "$rd.log" || { echo "FAILED: exit $?" >> "$rd.load"; status=1; }
    echo "load after: $(load)" >> "$rd.load"
  }
  case $part in
    sidebyside)
      for ((k = 1; k <= runs; k++)); do kvbench "$dir/run-$k" --only sidebyside; done ;;
    latency)
      for ((k = 1; k <= GOALS_LATENCY_RUNS; k++)); do kvbench "$dir/run-$k" --only latency; done ;;
    route)
      for ((k = 1; k <= runs; k++)); do kvbench "$dir/run-$k" --only route; done ;;
    decode)
      # Realistic streams (removals, LoRA, salts; 512 distinct batches per
      # form): AppendNormalized (wire, the relay's path: decode, normalize,
      # wire bytes), the decoder alone and Normalize's messages; then the
      # repeated 64-block payloads the goal was first stated on.
      gobench engines/wire "$bin/wire.test" "$dir/stream.txt" \
        -test.bench '^BenchmarkDecodeAndNormalize$/^(decode|normalize|wire)$' -test.benchtime 5120x -test.count "$runs"
      gobench engines/wire "$bin/wire.test" "$dir/repeated.txt" \
        -test.bench '^BenchmarkNormalize$' -test.benchtime 20000x -test.count "$runs" ;;
    snapshot)
      # Delivered over gRPC (relay, gRPC both ways, client; medians of 3
      # snapshots a run), the relay's stages in process, and the writers'
      # cost while a cut is held or streamed.
      gobench bench "$bin/bench.test" "$dir/delivery.txt" \
        -test.bench '^BenchmarkSnapshotDelivery$' -test.benchtime 3x -test.count "$runs"
      gobench relay/record "$bin/record.test" "$dir/stages.txt" \
        -test.bench '^BenchmarkSnapshot$/^blocks=1000000$' -test.benchtime 3x -test.count "$runs"
      gobench relay/record "$bin/record.test" "$dir/cow.txt" \
        -test.bench '^BenchmarkApplyDuringCut$' -test.benchtime 3x -test.count "$runs" ;;
    indexers)
      if [[ -z $GOALS_TRACE ]]; then
        echo "skipped: no --trace (a Mooncake FAST'25 trace)" | tee "$dir/skipped.txt"
        exit 0
      fi
      mkdir -p "$dir/ixrun"
      if [[ -n $GOALS_CORPUS ]]; then
        # A corpus derived earlier from the same trace (run.sh derives it
        # only when DIR/corpus-dup4.kvr is missing); recorded in context.
        ln -sf "$GOALS_CORPUS" "$dir/ixrun/corpus-dup4.kvr"
        echo "corpus reused: $GOALS_CORPUS" > "$dir/corpus-reused.txt"
      fi
      args=("$GOALS_TRACE" --runs "$runs" --out "$dir/ixrun")
      [[ -n $GOALS_LLMD_BIN ]] && args+=(--llmd-bin "$GOALS_LLMD_BIN")
      [[ -n $GOALS_RUST_TARGET ]] && export CARGO_TARGET_DIR=$GOALS_RUST_TARGET
      "$root/bench/indexers/run.sh" "${args[@]}" > "$dir/run.txt" 2>&1 || status=1 ;;
    indexbytes)
      # Bytes are deterministic for a given tree (the replay is seeded), so
      # one run; the replay's ops per CPU-second are a by-product here.
      KVRELAY_REPLAY_SESSIONS=8000 gobench gateway/index "$bin/index.test" "$dir/replay.txt" \
        -test.bench '^BenchmarkReplaySynthetic$/^bs128$/^hashed-input$' -test.benchtime 1x -test.cpu 1 -test.count 1 ;;
    recordbytes)
      gobench relay/record "$bin/record.test" "$dir/memory.txt" \
        -test.bench '^BenchmarkRecordMemory$' -test.benchtime 1x -test.count "$runs" ;;
    *) echo "goals.sh: unknown part $part" >&2; exit 2 ;;
  esac
  exit $status
fi

# --- the driver ---
only="" runs=3 latency_runs=1 budget_scale=1 out="" python=${KVRELAY_PYTHON:-} trace="" llmd_bin="" rust_target="" corpus=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --only) only=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --latency-runs) latency_runs=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --trace) trace=$(realpath "$2"); shift 2 ;;
    --llmd-bin) llmd_bin=$(realpath "$2"); shift 2 ;;
    --rust-target) rust_target=$(realpath "$2"); shift 2 ;;
    --corpus) corpus=$(realpath "$2"); shift 2 ;;
    --budget-scale) budget_scale=$2; shift 2 ;;
    -h|--help) usage ;;
    *) echo "goals.sh: unknown argument $1" >&2; usage ;;
  esac
done
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "goals.sh: --runs wants a positive integer, got '$runs'" >&2; exit 2; }
[[ $budget_scale =~ ^[0-9]+([.][0-9]+)?$ && $budget_scale != 0 ]] || { echo "goals.sh: --budget-scale wants a positive number, got '$budget_scale'" >&2; exit 2; }
[[ $latency_runs =~ ^[1-9][0-9]*$ ]] || { echo "goals.sh: --latency-runs wants a positive integer, got '$latency_runs'" >&2; exit 2; }
parts=()
if [[ -z $only ]]; then
  parts=("${all_parts[@]}")
else
  IFS=, read -ra want <<< "$only"
  for w in "${want[@]}"; do
    [[ " ${all_parts[*]} " == *" $w "* ]] || { echo "goals.sh: --only: unknown part '$w' (want: ${all_parts[*]})" >&2; exit 2; }
  done
  for p in "${all_parts[@]}"; do # the fixed order, whatever order --only named them in
    [[ ",$only," == *",$p,"* ]] && parts+=("$p")
  done
fi
[[ -z $trace || -r $trace ]] || { echo "goals.sh: cannot read trace $trace" >&2; exit 1; }
[[ -z $llmd_bin || -x $llmd_bin ]] || { echo "goals.sh: --llmd-bin $llmd_bin is not executable" >&2; exit 1; }
[[ -z $corpus || -s $corpus ]] || { echo "goals.sh: --corpus $corpus is empty or missing" >&2; exit 1; }
[[ -z $python || -x $python ]] || { echo "goals.sh: --python $python is not executable" >&2; exit 1; }
[[ -n $out ]] || out=$root/bench-out/goals-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out/bin"; out=$(realpath "$out")
: > "$out/parts.tsv"
started=$(date +%s)

has() { [[ " ${parts[*]} " == *" $1 "* ]]; }

echo "== goals: ${parts[*]} (runs $runs) -> $out"
echo "== build the current tree (load: $(cut -d' ' -f1-3 /proc/loadavg))"
(
  cd "$root"
  go build -o "$out/bin/kvrelay" ./cmd/kvrelay
  if has decode; then go test -c -o "$out/bin/wire.test" ./engines/wire; fi
  if has snapshot; then go test -c -o "$out/bin/bench.test" ./bench; fi
  if has snapshot || has recordbytes; then go test -c -o "$out/bin/record.test" ./relay/record; fi
  if has indexbytes; then go test -c -o "$out/bin/index.test" ./gateway/index; fi
)

{
  echo "commit: $(git -C "$root" rev-parse HEAD)$(git -C "$root" diff --quiet HEAD || echo ' (dirty: uncommitted changes measured)')"
  echo "branch: $(git -C "$root" rev-parse --abbrev-ref HEAD)"
  echo "started: $(date -u +%FT%TZ)"
  echo "parts: ${parts[*]}"
  echo "runs: $runs (latency: $latency_runs run(s) of 3 interleaved rounds)"
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(awk '/MemTotal/ {print $2, $3}' /proc/meminfo), $(uname -r)"
  echo "go: $(go version | cut -d' ' -f3)"
  echo "python: ${python:-(the default of kvrelay bench: \$KVRELAY_PYTHON or <repo>/.venv/bin/python)}"
  echo "trace: ${trace:-(none: indexers part skipped)}"
  echo "llmd harness: ${llmd_bin:-(none)}"
  if [[ -n $trace ]]; then echo "corpus: ${corpus:-(derived from the trace in this run)}"; fi
} > "$out/context.txt"

export GOALS_OUT=$out GOALS_RUNS=$runs GOALS_LATENCY_RUNS=$latency_runs GOALS_PYTHON=$python \
  GOALS_TRACE=$trace GOALS_LLMD_BIN=$llmd_bin GOALS_RUST_TARGET=$rust_target GOALS_CORPUS=$corpus
failed=0
for p in "${parts[@]}"; do
  n=$runs
  [[ $p == latency ]] && n=$latency_runs
  budget=$(budget_of "$p" "$n")
  budget=$(awk -v b="$budget" -v f="$budget_scale" 'BEGIN { x = int(b * f + 0.5); print (x < 1 ? 1 : x) }')
  mkdir -p "$out/$p"
  before=$(cut -d' ' -f1-3 /proc/loadavg)
  { echo "before: $(uptime)"; } > "$out/$p/uptime.txt"
  echo "== $p (budget ${budget}s; load $before)"
  t0=$(date +%s)
  set +e
  timeout --kill-after=30 "$budget" "$self" --run-part "$p"
  rc=$?
  set -e
  t1=$(date +%s)
  after=$(cut -d' ' -f1-3 /proc/loadavg)
  echo "after: $(uptime)" >> "$out/$p/uptime.txt"
  [[ $rc == 124 || $rc == 137 ]] && echo "   $p: TIMED OUT after ${budget}s"
  [[ $rc != 0 ]] && failed=1
  echo "   $p: exit $rc, $((t1 - t0)) s; load $before -> $after"
  ix=$out/indexers/ixrun
  if [[ $p == indexers && -s $ix/results.jsonl && ! -s $ix/results.md ]]; then
    # run.sh was stopped before its table: tabulate the replays that finished.
    python3 "$root/bench/indexers/table.py" "$ix/results.jsonl" <(echo "partial: the part stopped (exit $rc) before every replay ran") > "$ix/results.md" || true
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$p" "$rc" "$((t1 - t0))" "$budget" "$before" "$after" >> "$out/parts.tsv"
done
echo "finished: $(date -u +%FT%TZ) ($(($(date +%s) - started)) s in all)" >> "$out/context.txt"

python3 "$root/bench/goals_table.py" "$out" > "$out/results.md"
cat "$out/results.md"
echo "== results in $out/results.md"
exit $failed
