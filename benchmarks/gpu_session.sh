#!/usr/bin/env bash
# One GPU session's worth of checks, in the order that matters: build, the GPU suite, the demo
# at full size, then every benchmark.  Logs and JSON records go to $OUT (default ./out).
# Usage (repo root, on the GPU machine): bash benchmarks/gpu_session.sh [attention-bench args]
# DIFFKV_COMMIT=<sha of the tree copied there> names the commit in the JSON records (the copy's
# .git, if any, may be stale).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=python TORCHINDUCTOR_CACHE_DIR=$PWD/build/inductor_cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1
if ! DIFFKV_WERROR=1 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    exit 1
fi
python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
(cd /tmp && PYTHONPATH=$OLDPWD/python python3 -m diffkv demo --steps 3) 2>&1 | tee "$OUT/demo.log"
python3 benchmarks/bench_host.py --json "$OUT/host.json" 2>&1 | tee "$OUT/host.log" | tail -12
python3 benchmarks/bench_kv_write.py --json "$OUT/kv_write.json" 2>&1 | tee "$OUT/kv_write.log" | tail -14
python3 benchmarks/bench_attention.py --json "$OUT/attention.json" "$@" 2>&1 | tee "$OUT/attention.log" | tail -40
python3 benchmarks/bench_layer.py --json "$OUT/layer.json" 2>&1 | tee "$OUT/layer.log" | tail -8
python3 benchmarks/bench_dense.py --json "$OUT/dense.json" 2>&1 | tee "$OUT/dense.log" | tail -10
