#!/usr/bin/env bash
# Interleaved pairs of two builds of gateway/index on one corpus, with layout
# controls (see README.md, "Pairs").
#
#   bench/indexers/pairs.sh CORPUS.kvr BASE NEW [--rounds N] [--pads "0 2 4 5"] [--out DIR]
#
# BASE and NEW are git revisions, or "." for the working tree as it is. Each
# is built once per pad: a never-called function of about 32*pad bytes in a
# file that sorts before the package's others, so that every function of the
# package sits at a different offset (the loops' alignment changes with it).
# Every round replays the corpus once per (build, pad), in an order rotated
# each round; a pair is NEW against BASE with the same pad in the same round.
set -euo pipefail

usage() { sed -n 2,12p "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 3 ] || usage
corpus=$1 base=$2 new=$3
shift 3
rounds=6 pads="0 2 4 5" out=""
while [ $# -gt 0 ]; do
	case $1 in
	--rounds) rounds=$2; shift 2 ;;
	--pads) pads=$2; shift 2 ;;
	--out) out=$2; shift 2 ;;
	*) usage ;;
	esac
done
[ -f "$corpus" ] || { echo "pairs.sh: no corpus file $corpus" >&2; exit 2; }
corpus=$(cd "$(dirname "$corpus")" && pwd)/$(basename "$corpus")
root=$(git rev-parse --show-toplevel)
out=${out:-$(mktemp -d /tmp/kvrelay-pairs.XXXXXX)}
mkdir -p "$out/bin"
out=$(cd "$out" && pwd)
src=$(mktemp -d /tmp/kvrelay-pairs-src.XXXXXX)
trap 'rm -rf "$src"' EXIT

# tree REV DIR: the tree of REV ("." is the working tree, untracked files
# that git would list included) in DIR.
tree() {
	mkdir -p "$2"
	if [ "$1" = . ]; then
		(cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - 2>/dev/null) | tar -xf - -C "$2"
	else
		(cd "$root" && git archive "$1") | tar -xf - -C "$2"
	fi
}

# pad N DIR: the layout pad of about 32*N bytes in DIR's gateway/index.
pad() {
	local f=$2/gateway/index/aaa_layoutpad_indexerbench.go
	{
		echo '//go:build indexerbench'
		echo
		echo 'package index'
		echo
		echo 'import "os"'
		echo
		echo '//go:noinline'
		echo 'func layoutPad(x int) int {'
		for ((i = 0; i < 2 * $1; i++)); do echo "	x = x*$((2 * i + 3)) ^ $((i + 1))"; done
		echo '	return x'
		echo '}'
		echo
		echo 'func init() {'
		echo '	if os.Getenv("KVRELAY_LAYOUT_PAD_NEVER") == "yes" {'
		echo '		println(layoutPad(len(os.Args)))'
		echo '	}'
		echo '}'
	} >"$f"
}

names=()
for side in base new; do
	rev=${!side}
	tree "$rev" "$src/$side"
	for p in $pads; do
		pad "$p" "$src/$side"
		(cd "$src/$side" && go test -c -tags indexerbench -o "$out/bin/$side-p$p.test" ./gateway/index)
		names+=("$side-p$p")
	done
done
# describe REV: its commit, and whether the working tree's changes were in.
describe() {
	if [ "$1" = . ]; then
		echo "$(cd "$root" && git rev-parse --short HEAD) and the working tree"
	else
		(cd "$root" && git rev-parse --short "$1^{commit}")
	fi
}
{
	echo "base: $base ($(describe "$base"))"
	echo "new: $new ($(describe "$new"))"
	echo "corpus: $corpus"
	echo "rounds: $rounds, pads: $pads"
	echo "machine: $(nproc) CPUs, $(go version)"
} >"$out/context.txt"

: >"$out/runs.txt"
n=${#names[@]}
for ((r = 1; r <= rounds; r++)); do
	for ((j = 0; j < n; j++)); do
		name=${names[$(((j + r - 1) % n))]}
		load=$(cut -d' ' -f1 /proc/loadavg)
		res=$(cd "$src/base/gateway/index" && KVRELAY_CORPUS=$corpus "$out/bin/$name.test" -test.run '^TestIndexerCorpusReplay$' -test.v | sed -n 's/^RESULT //p')
		[ -n "$res" ] || { echo "pairs.sh: $name printed no RESULT" >&2; exit 1; }
		echo "$r ${name%-p*} ${name##*-p} $load $res" >>"$out/runs.txt"
	done
	echo "round $r of $rounds done (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
done

python3 - "$out/runs.txt" <<'EOF' | tee "$out/summary.txt"
import json, statistics as st, sys
runs = {}
loads = []
for line in open(sys.argv[1]):
    r, side, pad, load, res = line.split(' ', 4)
    j = json.loads(res)
    runs[(r, side, pad)] = j
    loads.append(float(load))
sums = {j['checksum'] for j in runs.values()}
if len(sums) != 1:
    sys.exit(f'answers differ: checksums {sorted(sums)}')
mops = lambda j: j['block_ops'] / j['cpu_s'] / 1e6
pads = sorted({k[2] for k in runs}, key=int)
ratios, by_pad = [], {}
for (r, side, pad), j in runs.items():
    b = runs.get((r, 'base', pad))
    if side == 'new' and b:
        x = mops(j) / mops(b)
        ratios.append(x)
        by_pad.setdefault(pad, []).append(x)
def show(side):
    xs = [mops(j) for k, j in runs.items() if k[1] == side]
    p50 = st.median(j['p50_ns'] for k, j in runs.items() if k[1] == side) / 1000
    p99 = st.median(j['p99_ns'] for k, j in runs.items() if k[1] == side) / 1000
    return f'{st.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f}) M block ops/CPU-s, lookup p50 {p50:.2f} us, p99 {p99:.2f} us'
if not ratios:
    sys.exit('no pairs: every round needs a base and a new run with the same pad')
q = st.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
print(f'base: {show("base")}')
print(f'new:  {show("new")}')
print(f'new / base, {len(ratios)} pairs: median {st.median(ratios):.3f}, quartiles {q[0]:.3f}-{q[2]:.3f}, '
      f'min-max {min(ratios):.3f}-{max(ratios):.3f}, {sum(x > 1 for x in ratios)} above 1')
print('by pad (median): ' + ', '.join(f'{p}: {st.median(by_pad[p]):.3f}' for p in pads if p in by_pad))
print('base by pad (median M/CPU-s): ' + ', '.join(
    f'{p}: {st.median(mops(j) for k, j in runs.items() if k[1] == "base" and k[2] == p):.2f}' for p in pads))
print(f'checksum {sums.pop()}; load (1-min) {min(loads):.2f}-{max(loads):.2f}')
EOF
echo "runs and binaries in $out" >&2
