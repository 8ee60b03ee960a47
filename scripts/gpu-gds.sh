#!/usr/bin/env bash
# The disk tier against GPUDirect Storage and fio on a CUDA machine, in one command (issue 27 item 4):
#   OUT=$OUT bash scripts/gpu-gds.sh [FIO_PATH]
# Runs scripts/probe_gds.py (its docstring says what it measures; a figure is printed only for verified bytes) on a
# file of KVTIER_GDS_GIB GiB (default 4) in KVTIER_GDS_DIR (default /tmp/kvtier-gds: a folder on the disk under test),
# with FIO_PATH (default $KVTIER_FIO, else fio on PATH; the H200 image has none: carry a static build) reading the same
# file before and after; then again on 1 GiB with --compat off (cuFile may not fall back to POSIX reads: GDS or a
# refusal, the verdict either way). OUT (default ./gpu-gds-out) receives gds.md / gds.json (the main run),
# gds-nocompat.md / .json, gdscheck.txt (`gdscheck -p` where found) and cufile.log (cuFile's own log).
# Environment: PYTHON (default python3, with torch's CUDA build), KVTIER_GDS_THREADS (8), KVTIER_GDS_REPS (2).
# Exit status: the main run's (0, or 3 when read bytes failed verification).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$PWD/gpu-gds-out}
mkdir -p "$out"
py=${PYTHON:-python3}
fio=${1:-${KVTIER_FIO:-$(command -v fio || true)}}
dir=${KVTIER_GDS_DIR:-/tmp/kvtier-gds}
export CUFILE_LOGFILE_PATH=${CUFILE_LOGFILE_PATH:-$out/cufile.log}
gds=$(command -v gdscheck || command -v gdscheck.py || ls /usr/local/cuda*/gds/tools/gdscheck* 2>/dev/null | head -1 || true)
if [ -n "$gds" ]; then
  case $gds in
    *.py) "$py" "$gds" -p > "$out/gdscheck.txt" 2>&1 || echo "gdscheck -p exited $?" >> "$out/gdscheck.txt" ;;
    *) "$gds" -p > "$out/gdscheck.txt" 2>&1 || echo "gdscheck -p exited $?" >> "$out/gdscheck.txt" ;;
  esac
else
  echo "no gdscheck found (PATH, /usr/local/cuda*/gds/tools)" > "$out/gdscheck.txt"
fi
cat "$out/gdscheck.txt"
common=(--dir "$dir" --threads "${KVTIER_GDS_THREADS:-8}")
args=("${common[@]}" --gib "${KVTIER_GDS_GIB:-4}" --reps "${KVTIER_GDS_REPS:-2}" --out "$out/gds.json")
if [ -n "$fio" ]; then args+=(--fio "$fio"); else echo "no fio: the run has no fio baseline (pass FIO_PATH)" >&2; fi
rc=0
"$py" "$here/scripts/probe_gds.py" "${args[@]}" 2>&1 | tee "$out/gds.md" || rc=$?
# The crisp verdict: with compatibility mode disallowed a cuFile read is GDS or it fails (the rows say which).
nc=0
"$py" "$here/scripts/probe_gds.py" "${common[@]}" --gib 1 --reps 1 --compat off --out "$out/gds-nocompat.json" 2>&1 \
  | tee "$out/gds-nocompat.md" || nc=$?
[ "$nc" = 0 ] || echo "the --compat off run exited $nc (see gds-nocompat.md)" >&2
[ "$rc" = 0 ] || echo "the main run exited $rc: some read bytes failed verification (see gds.md)" >&2
exit "$rc"
