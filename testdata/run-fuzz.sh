#!/usr/bin/env bash
# Runs every fuzz target in the module for a short time each. go test runs
# one -fuzz target per invocation, so the targets are listed from the source.
#
# Each target is announced as "fuzz 3/34 ./pkg FuzzX"; go test's own output
# (its "elapsed" lines) goes to $FUZZ_LOG when set (make test keeps it in
# .bin/test-logs/), else to stdout. A failing target's output is shown
# either way. FUZZ_MATCH (an extended regexp) runs only the targets it
# matches.
set -euo pipefail
fuzztime=${1:-10s}
export GOTOOLCHAIN=${GOTOOLCHAIN:-go1.27.3}
log=${FUZZ_LOG:-/dev/stdout}
mapfile -t targets < <(git ls-files '*_test.go' | xargs grep -Ho '^func Fuzz[A-Za-z0-9_]*' | sed 's/func //' | sort -u |
  grep -E -- "${FUZZ_MATCH:-.}" || true)
total=${#targets[@]}
if [ "$total" -eq 0 ]; then
  echo "fuzz: no targets${FUZZ_MATCH:+ match $FUZZ_MATCH}" >&2
  exit 1
fi
count=0
for entry in "${targets[@]}"; do
  file=${entry%%:*}
  name=${entry#*:}
  pkg="./$(dirname "$file")"
  count=$((count + 1))
  echo "fuzz $count/$total $pkg $name ($fuzztime)"
  out=$(mktemp)
  if ! go test -run='^$' -fuzz="^${name}\$" -fuzztime="$fuzztime" "$pkg" >"$out" 2>&1; then
    cat "$out" >>"$log" 2>/dev/null || true
    echo "fuzz $count/$total $name FAILED:"
    tail -n 40 "$out"
    rm -f "$out"
    exit 1
  fi
  if [ "$log" = /dev/stdout ]; then cat "$out"; else cat "$out" >>"$log"; fi
  rm -f "$out"
done
echo "fuzz: $count targets ran"
