"""Bounds the CUDA kernels enforce themselves: the host checks validate the host copies of the
block tables; if the device tensors disagree (a caller passing stale or hostile device
metadata), the kernels stay inside the table and the cache (block ids clamped, slots -1)
instead of reading or writing out of bounds.  Run under compute-sanitizer by make sanitize-gpu."""

import pytest
import torch

from diffkv import _C

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,head", [(torch.bfloat16, 128), (torch.float32, 64)])
def test_attention_device_table_disagrees_with_host_copy(dtype, head):
    block, nb, seq_len = 16, 8, 100
    cache = torch.randn(2, nb, block, 2, head, device="cuda").to(dtype)
    host_table = torch.arange(7, dtype=torch.int32).reshape(1, 7)
    device_table = torch.full((1, 7), 2**30, dtype=torch.int32, device="cuda")  # far outside
    qsl = torch.tensor([0, seq_len], dtype=torch.int32)
    sl = torch.tensor([seq_len], dtype=torch.int32)
    device_sl = torch.tensor([10**6], dtype=torch.int32, device="cuda")  # beyond the table
    q = torch.randn(seq_len, 4, head, device="cuda").to(dtype)
    out = torch.empty_like(q)
    _C.paged_attention(
        q, cache, device_table, qsl.cuda(), device_sl, None, _C.MASK_NONE, 0.1, out, host_table, qsl, sl
    )
    torch.cuda.synchronize()
    assert out.isfinite().all()


@pytest.mark.parametrize("bad", [2**30, -1])
@pytest.mark.parametrize("head", [128, 64])
@pytest.mark.parametrize("block", [16, 48, 8, 24, 4, 100])
def test_fp8_attention_device_table_disagrees_with_host_copy(bad, head, block):
    """The e4m3 kernel's producers (TMA boxes of 16 keys at blocks of 16 and 48 keys and at one
    block of 100 a row, of 8 keys at 8 and 24, cp.async at 4) clamp a device block id outside the
    cache, negative ones included, to block 0 and still fetch the chunk: every slot's expected
    bytes arrive, the call ends and its outputs are finite."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the e4m3 kernel runs on Hopper")
    nb, seq_len = 8, 100
    cols = -(-seq_len // block)
    codes = (torch.randn(2, nb + cols, block, 2, head) * 60).clamp(-448, 448)
    cache = codes.to(torch.float8_e4m3fn).cuda()
    host_table = torch.arange(cols, dtype=torch.int32).reshape(1, cols)
    device_table = torch.full((1, cols), bad, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, seq_len], dtype=torch.int32)
    sl = torch.tensor([seq_len], dtype=torch.int32)
    q = torch.randn(seq_len, 4, head, device="cuda").to(torch.bfloat16)
    scale = torch.tensor([0.01], device="cuda")
    out = torch.empty_like(q)
    _C.paged_attention(
        q, cache, device_table, qsl.cuda(), sl.cuda(), None, _C.MASK_NONE, 0.1, out, host_table, qsl, sl,
        scale, scale,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert _C.last_attention_kernel() == ("sm90-fp8" if block % 8 and cols > 1 else "sm90-fp8-tma")
    assert out.isfinite().all()


def test_slots_device_rows_outside_the_table():
    table = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32, device="cuda")
    row_indices = torch.tensor([5, -3], dtype=torch.int32, device="cuda")  # no such table rows
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")
    positions = torch.tensor([0, 40, 1, 2], dtype=torch.int64, device="cuda")
    out = torch.zeros(4, dtype=torch.int64, device="cuda")
    _C.compute_slot_mappings(table, row_indices, qsl, positions, out, 4, 4, 4, 1, 0, 1)
    assert out.tolist() == [-1, -1, -1, -1]
