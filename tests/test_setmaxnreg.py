"""The warp-specialized Hopper kernels' register split is checked when they compile.

setmaxnreg moves registers between warpgroups out of the pool the CTA was launched with: the
launch's registers per thread (65,536 over the CTA's threads, down to a multiple of 8) times its
warpgroups -- 504 at 384 threads, not 512.  A split that asks for more hangs the consumers in
setmaxnreg.inc; an e4m3 form asking 32 / 240 did on the H200 (docs/fp8-log.md).  ``h90_ws_regs``
(cuda/sm90_wgmma.cuh) refuses such a split with a static_assert; this compiles it to PTX for
sm_90a with both kinds of split.  No GPU needed, nvcc is (skipped without it)."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from toolchain import find_nvcc

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESSAGE = "setmaxnreg: the warpgroups ask for more registers than the CTA was launched with"

# (producer, consumer, consumer warpgroups): what the kernels use, and what must not compile
FITS = ((56, 224, 2), (24, 240, 2), (72, 216, 2), (32, 160, 3))
TOO_MANY = ((32, 240, 2), (48, 232, 2), (40, 160, 3))


def _compile(tmp_path: pathlib.Path, splits) -> subprocess.CompletedProcess:
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found ($CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin)")
    uses = "\n".join(
        f"    h90_ws_regs<{p}, {c}, {n}>::producer();\n    h90_ws_regs<{p}, {c}, {n}>::consumer();"
        for p, c, n in splits
    )
    src = tmp_path / "regs.cu"
    src.write_text(
        '#include "sm90_wgmma.cuh"\n'
        "__global__ void probe()\n{\n#ifdef H90_DEVICE_CODE\n" + uses + "\n#endif\n}\n"
    )
    includes = ["-I", str(ROOT / "cuda"), "-I", str(ROOT / "csrc")]
    cmd = [str(nvcc), "-std=c++17", "-DDIFFKV_WITH_CUDA=1", *includes, "-arch=sm_90a", "-ptx", str(src)]
    cmd += ["-o", str(tmp_path / "regs.ptx")]
    # not the sanitizers' preload of `make asan`: nvcc's own binaries crash under it
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_the_kernels_splits_compile(tmp_path):
    r = _compile(tmp_path, FITS)
    assert r.returncode == 0, r.stderr
    ptx = (tmp_path / "regs.ptx").read_text()
    for p, c, _ in FITS:
        assert f"setmaxnreg.dec.sync.aligned.u32 {p};" in ptx
        assert f"setmaxnreg.inc.sync.aligned.u32 {c};" in ptx


@pytest.mark.parametrize("split", TOO_MANY, ids=lambda s: f"{s[0]}-{s[1]}-nc{s[2]}")
def test_a_split_past_the_pool_does_not_compile(tmp_path, split):
    r = _compile(tmp_path, (split,))
    assert r.returncode != 0
    assert MESSAGE in r.stderr + r.stdout
