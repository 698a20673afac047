#!/usr/bin/env bash
# The measurements issues 27 (fp8) and 28 (head sizes, short rows) ask of the H200, in one device
# call, trimmed to a deadline: bench_fp8.py's four cases (diffkv fp8 against cuDNN fp8 and
# diffkv bf16, accuracy included), the short rows against cuDNN (1-2 rows of 1k-4k tokens, head
# 128), every head size at 16k tokens causal against cuDNN, and last, if time is left, the
# mma.sync kernel's e4m3 form against its bf16 form (the kernel choice sm80, head 128: what an
# A100 runs, issue 27's "not slower"). Logs and JSON go to $OUT
# (default ./out); each step prints its table rows. With REQUIRE_H200=1 it exits (status 3) on
# any other GPU before running anything, so a call that lands on an H100 costs only its start.
# Usage (repo root, the extension built in place, cudnn-frontend's wheel in .whl/ as
# dev/prepare.sh leaves it): [REQUIRE_H200=1] bash dev/issue_runs.sh [DEADLINE_SECONDS=360]
set -u
T0=$(date +%s)
DL=${1:-360}
W=${OUT:-out}
mkdir -p "$W"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$W/gpu.txt"
if [ "${REQUIRE_H200:-0}" = 1 ] && ! grep -q H200 "$W/gpu.txt"; then
    echo "not an H200: nothing run"
    exit 3
fi
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=python:/tmp/site
el() { echo "[$(($(date +%s) - T0)) s] $*"; }
left() {
    local l=$((DL - ($(date +%s) - T0)))
    if [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi
}
el fp8
timeout "$(left 130)" python3 benchmarks/bench_fp8.py --reps 15 --no-profile --json "$W/fp8.json" \
    > "$W/fp8.log" 2>&1
echo "rc=$?" >> "$W/fp8.log"
grep -E "^\| (long|hunyuan)" "$W/fp8.log" | cut -d'|' -f2,3,5,6,8,11,12
el short rows
timeout "$(left 90)" python3 -m diffkv bench --head-sizes 128 --seq-lens 1k,2k,4k --rows 1,2 \
    --block-sizes 16 --baselines cudnn --reps 50 --no-plot --out "$W/short" > "$W/short.log" 2>&1
echo "rc=$?" >> "$W/short.log"
grep -E "^ +[0-9]+ +[12] +128" "$W/short.log" | tr -s ' '
el head sizes, causal
timeout "$(left 100)" python3 -m diffkv bench --head-sizes all --seq-lens 16k --rows 1 \
    --block-sizes 16 --baselines cudnn --mask causal --reps 20 --no-plot --out "$W/heads_causal" \
    > "$W/heads_causal.log" 2>&1
echo "rc=$?" >> "$W/heads_causal.log"
grep -E "^ +16384 " "$W/heads_causal.log" | tr -s ' '
el sm80-fp8 against the sm80 bf16 kernel
timeout "$(left 60)" python3 benchmarks/bench_fp8.py --kernel sm80 --baselines diffkv_bf16 --no-layer \
    --data gaussian --no-accuracy --no-profile --reps 10 --json "$W/sm80.json" > "$W/sm80.log" 2>&1
echo "rc=$?" >> "$W/sm80.log"
grep -E "^\| (long|hunyuan)" "$W/sm80.log" | cut -d'|' -f2,5,6,7,12
el done
