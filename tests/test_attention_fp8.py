"""Paged attention over a float8_e4m3fn cache: ``_C.paged_attention(..., k_scale, v_scale)``
reads each key element as ``e4m3 * k_scale[kv head]`` (values likewise) in fp32.  So far the
CPU reference runs it (every mask mode, GQA, block sizes, cache layouts, per-tensor and
per-KV-head scales); on CUDA the call is refused before anything runs.  Checked against the
float64 reference over the dequantized cache: the only rounding left is the output's to the
query dtype (and fp32 accumulation), so a wrong scale, a scale of the wrong head or a wrong
dequantization fails."""

from __future__ import annotations

import pytest
import torch

from diffkv import _C
from reference import dense_kv_from_cache, mask_causal, mask_key_limits, mask_none, ref_attention

F8 = torch.float8_e4m3fn
# |out - exact| <= REL * max|exact| + ABS: the output's rounding to its dtype, fp32 sums
TOLERANCE = {torch.bfloat16: (2.0**-8, 1e-6), torch.float16: (2.0**-11, 1e-6), torch.float32: (1e-5, 1e-6)}


def _cache(blocks, block, kv_heads, size, layout, gen):
    """A float8_e4m3fn cache of e4m3 values spread over the format's range, in a layout."""
    values = (torch.randn(2, blocks, block, kv_heads, size, generator=gen) * 40).clamp(-448, 448).to(F8)
    if layout == "hnd":
        return values.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    if layout == "block_major":
        return values.permute(1, 0, 2, 3, 4).contiguous().permute(1, 0, 2, 3, 4)
    return values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mask", ["none", "causal", "limits"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize(
    ("block", "layout"), [(16, "contiguous"), (1, "contiguous"), (16, "hnd"), (8, "block_major")]
)
def test_fp8_cache_attention_on_the_cpu_reference(dtype, mask, per_head, block, layout):
    gen = torch.Generator().manual_seed(block * 7 + len(mask))
    heads, kv_heads, size = 6, 2, 64
    rows = [(5, 37), (9, 9), (1, 70)]  # (query_len, seq_len): the queries are each row's suffix
    cols = max(-(-s // block) for _, s in rows)
    blocks = len(rows) * cols + 2
    cache = _cache(blocks, block, kv_heads, size, layout, gen)
    table = torch.randperm(blocks, generator=gen)[: len(rows) * cols].view(len(rows), cols).int()
    starts = torch.tensor([0, 5, 14, 15], dtype=torch.int32)
    lens = torch.tensor([s for _, s in rows], dtype=torch.int32)
    query = torch.randn(15, heads, size, generator=gen).to(dtype)
    k_scale = torch.rand(kv_heads if per_head else 1, generator=gen) * 0.05 + 0.01
    v_scale = torch.rand(kv_heads if per_head else 1, generator=gen) * 0.05 + 0.01
    limits, mode = None, {"none": _C.MASK_NONE, "causal": _C.MASK_CAUSAL, "limits": _C.MASK_LIMITS}[mask]
    if mask == "limits":
        limits = torch.cat([torch.randint(s - q + 1, s + 1, (q,), generator=gen) for q, s in rows]).int()
    out = torch.full_like(query, float("nan"))
    scale = size**-0.5
    _C.paged_attention(
        query, cache, table, starts, lens, limits, mode, scale, out, table, starts, lens, k_scale, v_scale
    )
    dequantized = cache.double()
    dequantized[0] *= k_scale.double().view(-1, 1)
    dequantized[1] *= v_scale.double().view(-1, 1)
    rel, abs_ = TOLERANCE[dtype]
    for r, (q_len, seq_len) in enumerate(rows):
        lo, hi = int(starts[r]), int(starts[r + 1])
        k, v = dense_kv_from_cache(dequantized, table[r], seq_len)
        positions = list(range(seq_len - q_len, seq_len))
        if mask == "none":
            visible = mask_none(positions, seq_len)
        elif mask == "causal":
            visible = mask_causal(positions, seq_len)
        else:
            visible = mask_key_limits(limits[lo:hi], seq_len)
        exact = ref_attention(query[lo:hi].double(), k, v, visible, scale)
        err = (out[lo:hi].double() - exact).abs().max().item()
        assert err <= rel * exact.abs().max().item() + abs_, (r, err)


def test_each_scale_is_its_heads():
    """Per-KV-head scales apply to their own head: swapping them changes exactly those heads."""
    gen = torch.Generator().manual_seed(3)
    cache = _cache(4, 16, 2, 64, "contiguous", gen)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    starts, lens = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    query = torch.randn(4, 4, 64, generator=gen)
    outs = []
    for k_scale in (torch.tensor([0.01, 0.03]), torch.tensor([0.03, 0.01])):
        out = torch.empty_like(query)
        _C.paged_attention(
            query, cache, table, starts, lens, None, _C.MASK_CAUSAL, 0.125, out, table, starts, lens,
            k_scale, torch.tensor([0.02, 0.02]),
        )  # fmt: skip
        outs.append(out)
    assert not torch.allclose(outs[0][:, :2], outs[1][:, :2]) and not torch.allclose(
        outs[0][:, 2:], outs[1][:, 2:]
    )


@pytest.mark.gpu
def test_cuda_refuses_an_fp8_cache_before_running():
    cache = torch.zeros(2, 3, 16, 2, 64, dtype=F8, device="cuda")
    query = torch.randn(3, 4, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(query)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    starts, lens = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    one = torch.ones(1, device="cuda")
    with pytest.raises(NotImplementedError, match="runs on the CPU reference only so far, got a CUDA query"):
        _C.paged_attention(
            query, cache, table.cuda(), starts.cuda(), lens.cuda(), None, _C.MASK_CAUSAL, 0.125, out,
            table, starts, lens, one, one,
        )  # fmt: skip
    assert not out.any()


def _layer_call_inputs(device):
    gen = torch.Generator().manual_seed(21)
    cache = _cache(6, 16, 2, 64, "contiguous", gen).to(device)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    starts, lens = torch.tensor([0, 6, 10], dtype=torch.int32), torch.tensor([38, 41], dtype=torch.int32)
    query = torch.randn(10, 4, 64, generator=gen).to(device)
    key = (torch.randn(10, 2, 64, generator=gen) * 3).to(device)
    value = torch.randn(10, 2, 64, generator=gen).to(device)
    # the queries are each row's last tokens: row 0 positions 32..37 (its block 0), row 1 37..40
    slots = torch.tensor([0 * 16 + p % 16 for p in range(32, 38)] + [3 * 16 + p % 16 for p in range(37, 41)])
    slots = slots.to(device)
    scales = (torch.tensor([0.02, 0.05]).to(device), torch.tensor([0.01, 0.03]).to(device))
    return query, key, value, cache, slots, table, starts, lens, scales


def test_the_fp8_layer_call_is_its_write_then_its_attention():
    """forward_paged over a float8_e4m3fn cache (CPU): the quantizing write with the layer's
    scales, then the attention dequantizing with the same ones -- bit for bit kv_write then
    paged_attention."""
    query, key, value, cache, slots, table, starts, lens, (k_scale, v_scale) = _layer_call_inputs("cpu")
    separate = cache.clone()
    _C.kv_write(key, value, separate, slots, k_scale, v_scale)
    expected = torch.empty_like(query)
    _C.paged_attention(
        query, separate, table, starts, lens, None, _C.MASK_CAUSAL, 0.125, expected, table, starts, lens,
        k_scale, v_scale,
    )  # fmt: skip
    out = torch.empty_like(query)
    _C.forward_paged(
        query, key, value, cache, slots, table, starts, lens, None, _C.MASK_CAUSAL, 0.125, out, table, starts,
        lens, k_scale, v_scale,
    )  # fmt: skip
    assert torch.equal(cache.view(torch.uint8), separate.view(torch.uint8))
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_cuda_refuses_the_fp8_layer_call_before_writing():
    query, key, value, cache, slots, table, starts, lens, scales = _layer_call_inputs("cuda")
    before = cache.clone()
    out = torch.zeros_like(query)
    with pytest.raises(NotImplementedError, match="runs on the CPU reference only so far, got a CUDA query"):
        _C.forward_paged(
            query, key, value, cache, slots, table.cuda(), starts.cuda(), lens.cuda(), None, _C.MASK_CAUSAL,
            0.125, out, table, starts, lens, *scales,
        )  # fmt: skip
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8)) and not out.any()
