"""_C.kv_write (and DiffKVAttentionImpl.do_kv_cache_update): a pure scatter, compared bit-exact
with a torch index_put reference over strided inputs and every cache layout."""

from __future__ import annotations

import pytest
import torch

import diffkv
from diffkv import _C

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference_write(key, value, kv_cache, slot_mapping):
    """Expected cache after the write: tokens with slot >= 0 land at (slot // bs, slot % bs)."""
    expected = kv_cache.clone()
    block_size = kv_cache.shape[2]
    slots = slot_mapping[: key.shape[0]]
    keep = slots >= 0
    blocks = torch.div(slots[keep], block_size, rounding_mode="floor")
    offsets = slots[keep] % block_size
    expected[0].index_put_((blocks, offsets), key[keep])
    expected[1].index_put_((blocks, offsets), value[keep])
    return expected


def make_cache(layout, num_blocks, block_size, num_kv_heads, head_size, dtype, device):
    """A (2, num_blocks, block_size, Hkv, D) cache view in one of three physical layouts,
    filled with random data (so untouched slots are checked too)."""
    if layout == "layer_major":
        cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, device=device).to(dtype)
    elif layout == "block_major":
        # Three layers interleaved per block; this is layer 1's view.
        buffer = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_size, device=device).to(dtype)
        cache = buffer[:, 1].permute(1, 0, 2, 3, 4)
    elif layout == "head_major":
        # HND pages ([Hkv, bs, D] inside a block), seen through a transposed view.
        buffer = torch.randn(2, num_blocks, num_kv_heads, block_size, head_size, device=device).to(dtype)
        cache = buffer.transpose(2, 3)
    else:
        raise AssertionError(layout)
    assert cache.shape == (2, num_blocks, block_size, num_kv_heads, head_size)
    return cache


def qkv_views(num_tokens, num_heads, num_kv_heads, head_size, dtype, device):
    """Key and value as strided slices of one packed QKV projection [N, (H + 2 Hkv) * D]."""
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(num_tokens, width, device=device).to(dtype)
    k0 = num_heads * head_size
    v0 = k0 + num_kv_heads * head_size
    key = qkv[:, k0:v0].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, v0:].view(num_tokens, num_kv_heads, head_size)
    assert not key.is_contiguous() and key.stride(0) == width
    return key, value


def random_slots(num_tokens, num_blocks, block_size, device, num_skipped=0):
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    if num_skipped:
        slots[torch.randperm(num_tokens)[:num_skipped]] = -1
    return slots.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("layout", ["layer_major", "block_major", "head_major"])
def test_kv_write_bit_exact(device, dtype, block_size, layout):
    num_blocks, num_kv_heads, head_size, num_tokens = 11, 2, 64, 23
    num_tokens = min(num_tokens, num_blocks * block_size)
    cache = make_cache(layout, num_blocks, block_size, num_kv_heads, head_size, dtype, device)
    key, value = qkv_views(num_tokens, 8, num_kv_heads, head_size, dtype, device)
    slots = random_slots(num_tokens, num_blocks, block_size, device, num_skipped=3)
    expected = reference_write(key, value, cache, slots)
    _C.kv_write(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_kv_write_contiguous_and_longer_slot_mapping(device):
    cache = torch.zeros(2, 4, 4, 1, 64, device=device)
    key = torch.randn(5, 1, 64, device=device)
    value = torch.randn(5, 1, 64, device=device)
    # Only the first N entries are used: the padding tail (would be out of range) is ignored.
    slots = torch.tensor([3, 0, -1, 15, 8, 99, 99], dtype=torch.int64, device=device)
    expected = reference_write(key, value, cache, slots)
    _C.kv_write(key, value, cache, slots)
    assert torch.equal(cache, expected)
    assert not cache[:, 0, 2].any()  # token 2 (slot -1) wrote nothing


def test_kv_write_all_skipped(device):
    cache = torch.randn(2, 3, 4, 2, 64, device=device)
    before = cache.clone()
    key = torch.randn(4, 2, 64, device=device)
    _C.kv_write(key, key, cache, torch.full((4,), -1, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)


def test_kv_write_suffix_span_mid_block(device):
    # A write span starting inside a block (start 3, block size 4) touches exactly slots [3, 4].
    cache = torch.zeros(2, 3, 4, 1, 64, device=device)
    key = torch.ones(2, 1, 64, device=device)
    _C.kv_write(key, 2 * key, cache, torch.tensor([3, 4], dtype=torch.int64, device=device))
    flat = cache.reshape(2, 12, 64)
    assert flat[0, :, 0].tolist() == [0, 0, 0, 1, 1] + [0] * 7
    assert flat[1, :, 0].tolist() == [0, 0, 0, 2, 2] + [0] * 7


def test_out_of_range_slot_rejected_cache_unchanged(device):
    cache = torch.randn(2, 4, 4, 2, 64, device=device)
    before = cache.clone()
    key = torch.randn(3, 2, 64, device=device)
    slots = torch.tensor([1, 16, 2], dtype=torch.int64, device=device)
    with pytest.raises(
        ValueError,
        match=r"^kv_write\(\): slot_mapping\[1\] must be < num_blocks \* block_size = 16 "
        r"\(or < 0 to skip\), got 16$",
    ):
        _C.kv_write(key, key, cache, slots)
    assert torch.equal(cache, before)


def test_kv_write_argument_errors(device):
    cache = torch.zeros(2, 4, 4, 2, 64, device=device, dtype=torch.float16)
    key = torch.randn(3, 2, 64, device=device, dtype=torch.float16)
    slots = torch.tensor([0, 1, 2], dtype=torch.int64, device=device)
    with pytest.raises(
        TypeError,
        match=r"^kv_write\(\): kv_cache must be float32 \(the key's dtype\) or float8_e4m3fn, got float16$",
    ):
        _C.kv_write(key.float(), key.float(), cache, slots)
    with pytest.raises(TypeError, match=r"^kv_write\(\): slot_mapping must be int64, got int32$"):
        _C.kv_write(key, key, cache, slots.to(torch.int32))
    with pytest.raises(
        ValueError,
        match=r"^kv_write\(\): kv_cache must have shape \[2, num_blocks, block_size, 1, 64\], "
        r"got \[2, 4, 4, 2, 64\]$",
    ):
        _C.kv_write(key[:, :1], key[:, :1], cache, slots)
    with pytest.raises(ValueError, match=r"^kv_write\(\): slot_mapping must have at least 3 entries, got 2$"):
        _C.kv_write(key, key, cache, slots[:2])
    with pytest.raises(ValueError, match=r"^kv_write\(\): kv_cache must have 5 dimensions, got 4$"):
        _C.kv_write(key, key, cache[0], slots)
    assert not cache.any()


def test_do_kv_cache_update_matches(device):
    impl = diffkv.DiffKVAttentionImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2)
    cache = make_cache("block_major", 6, 4, 2, 64, torch.bfloat16, device)
    key, value = qkv_views(10, 4, 2, 64, torch.bfloat16, device)
    slots = random_slots(10, 6, 4, device, num_skipped=2)
    expected = reference_write(key, value, cache, slots)
    impl.do_kv_cache_update(None, key, value, cache, slots)
    assert torch.equal(cache, expected)
