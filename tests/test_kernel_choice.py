"""The attention kernel choice: DIFFKV_ATTENTION_KERNEL read once per process, and
_C.set_attention_kernel, which overrides it and returns the choice it replaces."""

import os
import re
import subprocess
import sys

import pytest
import torch

from _helpers import mma_kernel_name
from diffkv import _C


def test_set_returns_the_choice_it_replaces(attention_kernel):
    assert _C.set_attention_kernel("sm90") == "auto"
    assert _C.set_attention_kernel("sm80") == "sm90"
    assert _C.set_attention_kernel("sm80") == "sm80"
    assert _C.set_attention_kernel("auto") == "sm80"


@pytest.mark.parametrize("value", ["fast", "SM80", "", 80, None, b"sm80"])
def test_bad_choices_are_refused_and_change_nothing(value, attention_kernel):
    _C.set_attention_kernel("sm90")
    message = f"set_attention_kernel(): kernel must be 'auto', 'sm90' or 'sm80', got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _C.set_attention_kernel(value)
    assert _C.set_attention_kernel("auto") == "sm90"


def test_wrong_argument_count():
    with pytest.raises(TypeError, match=r"^set_attention_kernel\(\) takes 1 arguments, got 0$"):
        _C.set_attention_kernel()


def _fresh_process(env_value, code):
    env = dict(os.environ)
    env.pop("DIFFKV_ATTENTION_KERNEL", None)
    if env_value is not None:
        env["DIFFKV_ATTENTION_KERNEL"] = env_value
    proc = subprocess.run(
        [sys.executable, "-c", f"from diffkv import _C\n{code}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize(
    ("env_value", "read"), [(None, "auto"), ("sm90", "sm90"), ("sm80", "sm80"), ("bogus", "auto")]
)
def test_environment_is_the_initial_choice(env_value, read):
    assert _fresh_process(env_value, "print(_C.set_attention_kernel('auto'))") == read


@pytest.mark.gpu
def test_choice_steers_cuda_calls_and_the_environment_does_not(attention_kernel, monkeypatch):
    """After the first read, a changed DIFFKV_ATTENTION_KERNEL no longer moves calls; the
    setter does."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(200, 4, 128, generator=g).to(torch.bfloat16).cuda()
    cache = torch.randn(2, 16, 16, 2, 128, generator=g).to(torch.bfloat16).cuda()
    table = torch.arange(16, dtype=torch.int32).view(1, 16)
    qsl = torch.tensor([0, 200], dtype=torch.int32)
    sl = torch.tensor([256], dtype=torch.int32)
    args = (table.cuda(), qsl.cuda(), sl.cuda(), None, _C.MASK_CAUSAL, 128**-0.5)

    def run():
        out = torch.empty_like(q)
        _C.paged_attention(q, cache, *args, out, table, qsl, sl)
        return out, _C.last_attention_kernel()

    auto_out, auto_kernel = run()
    monkeypatch.setenv("DIFFKV_ATTENTION_KERNEL", "sm80")
    assert run()[1] == auto_kernel
    _C.set_attention_kernel("sm80")
    sm80_out, sm80_kernel = run()
    assert sm80_kernel == mma_kernel_name(128)
    assert (sm80_out.float() - auto_out.float()).abs().max().item() < 2e-2
