"""The mma.sync kernel's form with half the keys per tile ("sm80-smallsmem", "sm80-fp8-smallsmem"),
which a GPU of 164 KB of shared memory per SM runs -- an A100, where the full tiles of every head
size but 192 leave one CTA (four warps) an SM and the half ones fit two.  DIFFKV_MMA_SMEM_KB=164
plans the kernels that way on a Hopper GPU too (their carveout set to 164 KB), so the head-size
suite and the fp8 cases of the kernel choice sm80 run again under it, in a subprocess: every head
size x dtype x mask x block size against the float64 reference with NaN in every cache slot a
row must not read, the fp8 form against its own reference, each asserting the form's name
(``_helpers.mma_kernel_name``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from _helpers import ROOT, mma_kernel_name

pytestmark = pytest.mark.gpu


def test_164_kb_takes_the_half_tiles_at_every_head_size_but_192(monkeypatch):
    monkeypatch.setenv("DIFFKV_MMA_SMEM_KB", "164")
    if torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor <= 164 * 1024:
        pytest.skip("this GPU has no more than 164 KB of shared memory per SM")
    assert [h for h in (32, 64, 72, 80, 96, 128, 160, 192, 256) if mma_kernel_name(h) == "sm80"] == [192]
    monkeypatch.setenv("DIFFKV_MMA_SMEM_KB", "100")  # an L40S: two CTAs of neither
    assert {mma_kernel_name(h) for h in (32, 64, 128, 160, 256)} == {"sm80"}


@pytest.mark.parametrize(
    ("suite", "select", "least"),
    [("test_head_sizes_cuda.py", "", 250), ("test_attention_fp8_cuda.py", "sm80", 90)],
)
def test_the_mma_suites_pass_on_164_kb_of_shared_memory(suite, select, least):
    env = dict(os.environ, DIFFKV_MMA_SMEM_KB="164")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    cmd += ["-k", select] if select else []
    proc = subprocess.run(
        [*cmd, os.path.join(ROOT, "tests", suite)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed is not None and int(passed.group(1)) >= least, tail
