"""The standalone probes in benchmarks/ still compile against the kernels' headers.

benchmarks/probe_*.cu are run by hand on a GPU (docs/fp8-log.md quotes their numbers); probe_wgmma.cu
includes cuda/sm90_wgmma.cuh and cuda/sm90_tiles.cuh and runs the kernel's own softmax, so a
change to those headers could break it unnoticed.  Each is compiled to PTX for sm_90a here, and
the PTX must hold the instructions the probe exists to time.  No GPU needed, nvcc is (skipped
without it)."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from toolchain import find_nvcc

ROOT = pathlib.Path(__file__).resolve().parent.parent

# probe: instructions its PTX must contain
PROBES = {
    "probe_sfu.cu": ("ex2.approx.ftz.f32", "cvt.rn.satfinite.e4m3x2.f32"),
    "probe_gather.cu": ("cp.async.bulk.tensor",),
    "probe_wgmma.cu": (
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
        "ex2.approx.ftz.f32",
        "cvt.rn.satfinite.e4m3x2.f32",
        "bar.sync",
    ),
}


def test_every_probe_is_listed():
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("probe_*.cu")) == sorted(PROBES)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_compiles(tmp_path, name):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found ($CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin)")
    out = tmp_path / (name + ".ptx")
    includes = ["-I", str(ROOT / "cuda"), "-I", str(ROOT / "csrc")]
    cmd = [str(nvcc), "-std=c++17", "-O3", "--use_fast_math", *includes, "-arch=sm_90a", "-ptx"]
    cmd += [str(ROOT / "benchmarks" / name), "-o", str(out)]
    # not the sanitizers' preload of `make asan`: nvcc's own binaries crash under it
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    ptx = out.read_text()
    for instr in PROBES[name]:
        assert instr in ptx, f"{name}: no {instr} in its PTX"
