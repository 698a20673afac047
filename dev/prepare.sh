#!/usr/bin/env bash
# Builds what the device calls of dev/README.md carry, on this machine (no GPU needed): main's
# extension in place (sm_90a only: half the binary, and the mma.sync kernels are in the sm_90a
# code too), each pending patch's tree under devrun/<name>/ (its python/ with its own build,
# its tests/ and benchmarks/), the stamped persistent kernel (benchmarks/persist_phases.py) under
# devrun/ps/, and cudnn-frontend's wheel (cuDNN's fp8 SDPA for bench_fp8.py) in .whl/.
# devrun/ and .whl/ are ignored by git; a worktree per patch goes to /tmp/dk-<name>.
# Usage (repo root): bash dev/prepare.sh [patch names, default: every dev/pending/*.patch]
set -euo pipefail
root=$(pwd)
export DIFFKV_CUDA_ARCHS=90a
DIFFKV_WERROR=1 python3 setup.py -q build_ext --inplace
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    for p in dev/pending/*.patch; do
        [ -e "$p" ] && names+=("$(basename "$p" .patch)")
    done
fi
for name in "${names[@]}"; do
    tree=/tmp/dk-$name
    if [ ! -d "$tree" ]; then
        git worktree add -q --detach "$tree" HEAD
        (cd "$tree" && git apply "$root/dev/pending/$name.patch")
    fi
    (cd "$tree" && DIFFKV_WERROR=1 python3 setup.py -q build_ext --inplace)
    rm -rf "devrun/$name" && mkdir -p "devrun/$name"
    cp -r "$tree/python" "$tree/tests" "$tree/benchmarks" "devrun/$name/"
    echo "devrun/$name: $(ls devrun/"$name"/python/diffkv/_C*.so)"
done
rm -rf /tmp/dk-ps
PYTHONPATH=python python3 benchmarks/persist_phases.py patch /tmp/dk-ps
(cd /tmp/dk-ps && python3 setup.py -q build_ext --inplace)
rm -rf devrun/ps && mkdir -p devrun/ps && cp -r /tmp/dk-ps/python devrun/ps/
if ! ls .whl/nvidia_cudnn_frontend-*.whl > /dev/null 2>&1; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl nvidia-cudnn-frontend
fi
du -sh python/diffkv/_C*.so devrun/* .whl
