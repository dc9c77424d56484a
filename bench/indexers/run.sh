#!/usr/bin/env bash
# bench/indexers/run.sh — issue 19.3: our gateway index side by side with
# SMG's and Dynamo's Rust indexers (and, given its binary, llm-d's Go index)
# on one Mooncake trace, on this machine. Not run by CI. See README.md here.
#
#   bench/indexers/run.sh TRACE.jsonl [--dup N] [--runs N] [--out DIR] [--llmd-bin PATH]
#
# TRACE is a Mooncake FAST'25 trace (e.g. traces/conversation_trace.jsonl of
# kvcache-ai/Mooncake). The corpus is derived from it once (DIR/corpus.kvr);
# every indexer then replays that file, one process per replay, the
# indexers in a rotated order each round. Writes DIR/results.jsonl (one line
# per replay) and DIR/results.md (the table).
set -euo pipefail

usage() { echo "usage: $0 TRACE.jsonl [--dup N] [--runs N] [--out DIR] [--llmd-bin PATH]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
trace=$(realpath "$1"); shift
dup=4 runs=3 out=bench-out/indexers llmd_bin=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --dup) dup=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --llmd-bin) llmd_bin=$(realpath "$2"); shift 2 ;;
    *) usage ;;
  esac
done
[[ -r $trace ]] || { echo "run.sh: cannot read trace $trace" >&2; exit 1; }
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
mkdir -p "$out"; out=$(realpath "$out")
export GOTOOLCHAIN=${GOTOOLCHAIN:-go1.27.3} GOFLAGS=${GOFLAGS:--mod=mod}

echo "== build (load: $(cut -d' ' -f1-3 /proc/loadavg))"
(cd "$root" && go test -c -tags indexerbench -o "$out/ix.test" ./gateway/index)
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$out/target} cargo build --release --quiet \
  --manifest-path "$root/bench/indexers/rust/Cargo.toml"
rust_bin=${CARGO_TARGET_DIR:-$out/target}/release/kvrelay-indexer-harness

corpus=$out/corpus-dup$dup.kvr
if [[ ! -s $corpus ]]; then
  echo "== derive corpus from $trace (duplication $dup)"
  (cd "$root/gateway/index" && KVRELAY_CORPUS_TRACE=$trace KVRELAY_CORPUS_OUT=$corpus.tmp KVRELAY_CORPUS_DUP=$dup \
    "$out/ix.test" -test.run '^TestIndexerCorpusWrite$' -test.v | grep '^CORPUS ' | sed 's/^CORPUS //' > "$out/corpus.json")
  mv "$corpus.tmp" "$corpus"
fi

indexers=(kvrelay smg-chain smg-chain-score dynamo-radix)
[[ -n $llmd_bin ]] && indexers+=(llmd)
run_one() {
  case $1 in
    kvrelay) (cd "$root/gateway/index" && KVRELAY_CORPUS=$corpus "$out/ix.test" -test.run '^TestIndexerCorpusReplay$' -test.v | grep '^RESULT ' | sed 's/^RESULT //') ;;
    llmd) "$llmd_bin" "$corpus" ;;
    *) "$rust_bin" "$1" "$corpus" ;;
  esac
}

: > "$out/results.jsonl"
n=${#indexers[@]}
for ((r = 1; r <= runs; r++)); do
  for ((k = 0; k < n; k++)); do
    ix=${indexers[(k + r - 1) % n]}
    load=$(cut -d' ' -f1 /proc/loadavg)
    line=$(run_one "$ix")
    echo "run $r $ix load $load: $line"
    echo "{\"run\":$r,\"load1\":$load,\"result\":$line}" >> "$out/results.jsonl"
  done
done

{
  echo "trace: $trace (sha256 $(sha256sum "$trace" | cut -c1-16)…)"
  echo "corpus: $(cat "$out/corpus.json" 2>/dev/null)"
  echo "kvrelay: $(git -C "$root" rev-parse HEAD)$(git -C "$root" diff --quiet || echo ' (dirty)')"
  echo "rust crates: $(grep -A1 -E '^name = "(kv-index|dynamo-kv-router)"' "$root/bench/indexers/rust/Cargo.lock" | paste -sd' ' | tr -s ' ')"
  echo "machine: $(nproc) cores, $(uname -r), $(go version | cut -d' ' -f3), $(rustc --version | cut -d' ' -f1-2)"
  echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$out/context.txt"
python3 "$root/bench/indexers/table.py" "$out/results.jsonl" "$out/context.txt" > "$out/results.md"
cat "$out/results.md"
