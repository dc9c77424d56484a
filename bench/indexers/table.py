#!/usr/bin/env python3
"""Summarises bench/indexers/run.sh's results.jsonl as a Markdown table.

Per indexer: the median over runs of block ops per CPU-second (process
user+system CPU of the replay, single-threaded replay) and of the lookup
p50/p99 (wall clock per lookup, nearest rank), each with its min–max spread;
ratios are to the fastest Rust indexer (highest median ops per CPU-second):
throughput ratio = this ÷ fastest (higher is better), latency ratio = this ÷
fastest's (lower is better). "answers" says whether the replay's lookup
checksum (sum of every lookup's best prefix depth) equals ours.
"""
import json
import statistics
import sys

RUST = {"smg-chain", "smg-chain-score", "dynamo-radix", "dynamo-positional"}


def main(results, context):
    rows = {}
    for line in open(results):
        rec = json.loads(line)
        r = rec["result"]
        rows.setdefault(r["indexer"], []).append((rec, r))
    if not rows:
        sys.exit("table.py: no results")

    def med(xs):
        return statistics.median(xs)

    stats = {}
    for ix, rs in rows.items():
        ops = [r["block_ops"] / r["cpu_s"] for _, r in rs]
        stats[ix] = {
            "name": rs[0][1]["name"], "version": rs[0][1]["version"],
            "ops": ops, "p50": [r["p50_ns"] for _, r in rs], "p99": [r["p99_ns"] for _, r in rs],
            "cpu": [r["cpu_s"] for _, r in rs], "load": [rec["load1"] for rec, _ in rs],
            "checksums": {r["checksum"] for _, r in rs}, "errors": sum(r["apply_errors"] for _, r in rs),
            "lookups": rs[0][1]["lookups"], "block_ops": rs[0][1]["block_ops"],
        }
    rust = [ix for ix in stats if ix in RUST]
    ref = max(rust, key=lambda ix: med(stats[ix]["ops"])) if rust else None
    ours = stats.get("kvrelay", {}).get("checksums")
    print(open(context).read().rstrip("\n").replace("\n", "  \n"))
    print()
    print(f"{len(next(iter(rows.values())))} runs each, interleaved; fastest Rust indexer: `{ref}`.")
    print()
    print("| indexer | what is timed | M block ops / CPU-s (min–max) | × fastest Rust | lookup p50 µs (min–max) | × | lookup p99 µs (min–max) | × | answers |")
    print("|---|---|---|---|---|---|---|---|---|")
    order = sorted(stats, key=lambda ix: -med(stats[ix]["ops"]))
    for ix in order:
        s = stats[ix]
        def rng(xs, scale):
            return f"{med(xs) / scale:.2f} ({min(xs) / scale:.2f}–{max(xs) / scale:.2f})"
        def ratio(key):
            if ref is None:
                return "–"
            return f"{med(s[key]) / med(stats[ref][key]):.2f}"
        ans = "same" if ours is not None and s["checksums"] == ours else f"differ ({sorted(s['checksums'])})"
        if s["errors"]:
            ans += f", {s['errors']} apply errors"
        print(f"| `{ix}` ({s['version']}) | {s['name']} | {rng(s['ops'], 1e6)} | {ratio('ops')} | "
              f"{rng(s['p50'], 1e3)} | {ratio('p50')} | {rng(s['p99'], 1e3)} | {ratio('p99')} | {ans} |")
    loads = [l for s in stats.values() for l in s["load"]]
    print()
    print(f"1-minute load average at each replay's start: {min(loads):.2f}–{max(loads):.2f} on {open('/proc/cpuinfo').read().count('processor')} CPUs.")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
