#!/usr/bin/env bash
# Runs every prebuilt fuzz target to RUNS executions (default 10^7, #13), one process per target in
# parallel, on a machine without Rust: the binaries are built on the dev box (fuzz/README.md) and
# copied, stripped, into BIN_DIR (default .dev/fuzzbin).
#   usage: fuzz/run-device.sh [BIN_DIR]        env: RUNS (10000000), OUT (/tmp/kvtier-fuzz-out)
# Each target starts from a copy of its committed corpus under /tmp (the committed one is not
# touched). Into $OUT go, per target: <t>.stats (libFuzzer's final stats and the last lines of its
# log), <t>.rc, and crashes/<t>/ (any crash, leak, timeout or OOM input); plus summary.txt.
# Exits nonzero when any target failed or left a crash file.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(cd "${1:-$here/../.dev/fuzzbin}" && pwd) || { echo "no binary dir" >&2; exit 2; }
runs=${RUNS:-10000000}
out=${OUT:-/tmp/kvtier-fuzz-out}
mkdir -p "$out"
work=$(mktemp -d /tmp/kvtier-fuzz.XXXXXX)

targets=()
for f in "$bin"/*; do
  [ -x "$f" ] && [ -f "$f" ] && targets+=("$(basename "$f")")
done
if [ ${#targets[@]} -eq 0 ]; then
  echo "no fuzz binaries in $bin" >&2
  exit 2
fi

# PARTS processes per target (default 1), each RUNS/PARTS executions with its own seed, sharing the
# corpus directory: 10^7 executions of a slow target within one device call.
parts=${PARTS:-1}
for t in "${targets[@]}"; do
  mkdir -p "$work/$t/corpus" "$work/$t/artifacts"
  if [ -d "$here/corpus/$t" ]; then
    cp -r "$here/corpus/$t/." "$work/$t/corpus/"
  elif [ -d "$here/seeds/$t" ]; then
    cp -r "$here/seeds/$t/." "$work/$t/corpus/"
  fi
  for p in $(seq 1 "$parts"); do
    (
      cd "$work/$t" || exit 2
      "$bin/$t" "$work/$t/corpus" -runs=$((runs / parts)) -seed="$p" -max_total_time="${MAX_TIME:-0}" -rss_limit_mb=2048 -timeout=20 \
        -print_final_stats=1 -artifact_prefix="$work/$t/artifacts/" >"$work/$t/log.$p" 2>&1
      echo $? >"$work/$t/rc.$p"
    ) &
  done
done
wait
for t in "${targets[@]}"; do
  rc=0
  for p in $(seq 1 "$parts"); do
    r=$(cat "$work/$t/rc.$p" 2>/dev/null || echo 99)
    [ "$r" = 0 ] || rc=$r
  done
  echo "$rc" >"$work/$t/rc"
  cat "$work/$t"/log.* >"$work/$t/log"
done

status=0
printf '%-16s %5s %14s %8s %s\n' target rc executions crashes last >"$out/summary.txt"
for t in "${targets[@]}"; do
  rc=$(cat "$work/$t/rc" 2>/dev/null || echo 99)
  { grep '^stat::' "$work/$t/log"; echo '--- last lines'; tail -n 15 "$work/$t/log"; } >"$out/$t.stats"
  echo "$rc" >"$out/$t.rc"
  n=$(find "$work/$t/artifacts" -type f | wc -l)
  if [ "$n" -gt 0 ]; then
    mkdir -p "$out/crashes/$t"
    cp "$work/$t/artifacts/"* "$out/crashes/$t/"
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t/log" | awk '{s += $1} END {print s}')
  last=$(grep -E '^(#[0-9]+|Done)' "$work/$t/log" | tail -n 1)
  printf '%-16s %5s %14s %8s %s\n' "$t" "$rc" "${execs:-?}" "$n" "$last" >>"$out/summary.txt"
  if [ "$rc" != 0 ] || [ "$n" -gt 0 ]; then
    status=1
  fi
done
cat "$out/summary.txt"
rm -rf "$work"
exit "$status"
