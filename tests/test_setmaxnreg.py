"""The warp-specialized Hopper kernels' register split is checked when they compile.

setmaxnreg moves registers between warpgroups out of the pool the CTA was launched with: the
launch's registers per thread (65,536 over the CTA's threads, down to a multiple of 8) times its
warpgroups -- 504 at 384 threads, not 512.  A split that asks for more hangs the consumers in
setmaxnreg.inc; an e4m3 form asking 32 / 240 did on the H200 (docs/fp8.md).  ``h90_ws_regs``
(cuda/sm90_wgmma.cuh) refuses such a split with a static_assert; this compiles it to PTX for
sm_90a with both kinds of split.  No GPU needed, nvcc is (skipped without it)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESSAGE = "setmaxnreg: the warpgroups ask for more registers than the CTA was launched with"

# (producer, consumer, consumer warpgroups): what the kernels use, and what must not compile
FITS = ((56, 224, 2), (24, 240, 2), (72, 216, 2), (32, 160, 3))
TOO_MANY = ((32, 240, 2), (48, 232, 2), (40, 160, 3))


def _nvcc() -> str | None:
    """nvcc where setup.py looks for it: $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin."""
    candidates = [
        pathlib.Path(os.environ[v]) / "bin" / "nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)
    ]
    if shutil.which("nvcc"):
        candidates.append(pathlib.Path(shutil.which("nvcc")))
    candidates.append(pathlib.Path("/usr/local/cuda/bin/nvcc"))
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def _compile(tmp_path: pathlib.Path, splits) -> subprocess.CompletedProcess:
    nvcc = _nvcc()
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
    cmd = [nvcc, "-std=c++17", "-DDIFFKV_WITH_CUDA=1", "-I", str(ROOT / "cuda"), "-I", str(ROOT / "csrc")]
    cmd += ["-arch=sm_90a", "-ptx", str(src), "-o", str(tmp_path / "regs.ptx")]
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
