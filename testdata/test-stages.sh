#!/usr/bin/env bash
# make test: runs each stage (a make target) in turn and says which one runs
# ("==> [2/7] vet"). Each stage's output goes to .bin/test-logs/<stage>.log;
# only test-go's progress lines and the fuzz counter ("fuzz 3/34 ...") are
# also shown as they come, so benchmark and fuzz chatter stay in the logs
# (go test's fuzz output in test-fuzz-go.log).
# It stops at the first failing stage and shows the tail of its log, ends
# with a table of the stages, their results and times, and exits with the
# failing stage's code.
set -uo pipefail
cd "$(dirname "$0")/.."
make=${MAKE:-make}
logs=.bin/test-logs
mkdir -p "$logs"
stages=("$@")
n=${#stages[@]}
declare -a result secs
code=0
for i in "${!stages[@]}"; do
  s=${stages[$i]}
  log=$logs/$s.log
  : >"$log"
  printf '==> [%d/%d] %s (log: %s)\n' $((i + 1)) "$n" "$s" "$log"
  start=$SECONDS
  case $s in
  test-go)
    # testprogress prints slow and failing tests and the packages still
    # running: the useful part, shown and kept.
    "$make" --no-print-directory "$s" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    ;;
  test-fuzz)
    : >"$logs/test-fuzz-go.log"
    FUZZ_LOG=$PWD/$logs/test-fuzz-go.log "$make" --no-print-directory "$s" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    ;;
  *)
    "$make" --no-print-directory "$s" >"$log" 2>&1
    rc=$?
    ;;
  esac
  secs[$i]=$((SECONDS - start))
  if [ "$rc" -ne 0 ]; then
    result[$i]="FAILED ($rc)"
    code=$rc
    echo "==> $s failed (exit $rc); the end of $log:"
    tail -n 40 "$log" | sed 's/^/    /'
    break
  fi
  result[$i]=ok
done

echo
echo "==> make test summary"
printf '    %-14s %-12s %8s  %s\n' stage result time log
for i in "${!stages[@]}"; do
  s=${stages[$i]}
  r=${result[$i]:-not run}
  t=-
  if [ -n "${secs[$i]:-}" ]; then t=$(printf '%dm%02ds' $((secs[i] / 60)) $((secs[i] % 60))); fi
  printf '    %-14s %-12s %8s  %s\n' "$s" "$r" "$t" "$logs/$s.log"
done
exit "$code"
