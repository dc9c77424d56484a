#!/usr/bin/env bash
# Runs every fuzz target in the module for a short time each. go test runs
# one -fuzz target per invocation, so the targets are listed from the source.
set -euo pipefail
fuzztime=${1:-10s}
export GOTOOLCHAIN=${GOTOOLCHAIN:-go1.27.3}
count=0
while IFS=: read -r file name; do
  pkg="./$(dirname "$file")"
  echo "fuzz: $pkg $name ($fuzztime)"
  go test -run='^$' -fuzz="^${name}\$" -fuzztime="$fuzztime" "$pkg"
  count=$((count + 1))
done < <(git ls-files '*_test.go' | xargs grep -Ho '^func Fuzz[A-Za-z0-9_]*' | sed 's/func //' | sort -u)
echo "fuzz: $count targets ran"
