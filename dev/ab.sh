#!/usr/bin/env bash
# A/B of two builds of the extension on the GPU machine: the same benchmark command run against
# build A and build B in turn, ROUNDS times (A B A B ...), so that clock and thermal drift fall on
# both.  A and B are PYTHONPATH entries, each holding a diffkv package with its own _C*.so (e.g.
# `python` for the tree's in-place build and `devrun/exp/python` for a copy of another build's).
# Logs go to $OUT (default ./out) as ab_<round>_<A|B>.log; the command's own ratios against its
# baselines, measured in the same process, are what compare (each run times its baselines too).
# Usage (repo root): bash dev/ab.sh A B ROUNDS -- python3 benchmarks/bench_fp8.py --no-accuracy ...
set -uo pipefail
if [ $# -lt 5 ] || [ "$4" != "--" ]; then
    echo "usage: bash dev/ab.sh A_PYTHONPATH B_PYTHONPATH ROUNDS -- COMMAND..." >&2
    exit 2
fi
A=$1 B=$2 ROUNDS=$3
shift 4
OUT=${OUT:-out}
mkdir -p "$OUT"
declare -A PATHS=([A]=$A [B]=$B)
for side in A B; do
    ls "${PATHS[$side]}"/diffkv/_C*.so > /dev/null 2>&1 || { echo "no diffkv/_C*.so under ${PATHS[$side]}" >&2; exit 2; }
done
for round in $(seq 1 "$ROUNDS"); do
    for side in A B; do
        path=${PATHS[$side]}
        echo "== round $round, $side ($path): $*" > "$OUT/ab_${round}_${side}.log"
        PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 "$@" >> "$OUT/ab_${round}_${side}.log" 2>&1
        tail -12 "$OUT/ab_${round}_${side}.log"
    done
done
