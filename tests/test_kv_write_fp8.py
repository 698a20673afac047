"""The quantizing KV write: bf16/fp16/fp32 keys and values into a float8_e4m3fn cache with
per-tensor or per-KV-head float32 scales (``_C.kv_write(key, value, kv_cache, slot_mapping,
k_scale, v_scale)``).  The stored byte must be torch's, bit for bit:
``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` -- checked on every bf16 and
fp16 bit pattern, on the CPU reference and on the CUDA kernels (both of their paths), and the
CUDA bytes against the CPU's.  Refusals (error_cases.py holds their messages) leave the cache
untouched."""

from __future__ import annotations

import re

import pytest
import torch

from diffkv import _C

F8 = torch.float8_e4m3fn


def _torch_quantized(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's bytes for x [N, H, D] and scale [1] or [H]."""
    scale = scale.view(-1, 1) if scale.numel() > 1 else scale
    return (x.float() / scale.to(x.device)).clamp(-448, 448).to(F8).view(torch.uint8)


def _written(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V bytes at ``slots`` of a (2, nb, bs, H, D) cache, [len(slots), H, D] each."""
    flat = cache.view(torch.uint8).reshape(2, -1, cache.shape[3], cache.shape[4])
    return flat[0][slots], flat[1][slots]


def _every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """All 65,536 bit patterns of a 16-bit dtype (NaNs, infinities, subnormals, +-0), [256, 1, 256]."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 1, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0e-5, 200.0, 1e-37])
def test_every_16_bit_value_quantizes_as_torch_does(device, dtype, scale):
    x = _every_pattern(dtype).to(device)
    cache = torch.zeros(2, 16, 16, 1, 256, dtype=F8, device=device)
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(3)).to(device)
    k_scale = torch.tensor([scale], device=device)
    v_scale = torch.tensor([scale * 1.5], device=device)
    _C.kv_write(x, -x, cache, slots, k_scale, v_scale)
    k, v = _written(cache, slots)
    assert torch.equal(k, _torch_quantized(x, k_scale))
    assert torch.equal(v, _torch_quantized(-x, v_scale))


def _layout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """A (2, nb, bs, H, D) view of the same values in another physical order."""
    if layout == "contiguous":
        return cache
    if layout == "hnd":  # heads before tokens in memory
        return cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    if layout == "block_major":  # K and V of a block side by side
        return cache.permute(1, 0, 2, 3, 4).contiguous().permute(1, 0, 2, 3, 4)
    raise AssertionError(layout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("layout", ["contiguous", "hnd", "block_major"])
@pytest.mark.parametrize("inputs", ["dense", "fused_projection", "dim_strided"])
def test_quantized_write_lands_at_its_slots(device, dtype, per_head, layout, inputs):
    gen = torch.Generator().manual_seed(11)
    n, heads, size, block, blocks = 45, 3, 64, 16, 6
    kv = torch.randn(n, 2, heads, size, generator=gen) * torch.logspace(-3, 2.5, size)
    kv[:, :, 0, :3] = torch.tensor([1e6, -1e-9, float("nan")])  # saturates, flushes, NaN
    kv = kv.to(dtype).to(device)
    if inputs == "dense":
        key, value = kv[:, 0].contiguous(), kv[:, 1].contiguous()
    elif inputs == "fused_projection":  # token-strided views of one [N, 2, H, D] projection
        key, value = kv[:, 0], kv[:, 1]
    else:  # dim stride 2: the element-wise kernel
        wide = torch.stack((kv, kv), dim=-1).reshape(n, 2, heads, 2 * size)
        key, value = wide[:, 0, :, ::2], wide[:, 1, :, ::2]
    cache = _layout(torch.zeros(2, blocks, block, heads, size, dtype=F8, device=device), layout)
    slots = torch.randperm(blocks * block, generator=gen)[:n]
    slots[[4, 17]] = -1  # skipped
    slots = slots.to(device)
    scales = (torch.rand(heads if per_head else 1, generator=gen) * 4 + 0.05).to(device)
    k_scale, v_scale = scales, scales.flip(0) * 0.5
    _C.kv_write(key, value, cache, slots, k_scale, v_scale)
    keep = slots >= 0
    k, v = _written(cache.contiguous(), slots[keep])
    assert torch.equal(k, _torch_quantized(key[keep], k_scale))
    assert torch.equal(v, _torch_quantized(value[keep], v_scale))
    untouched = torch.ones(blocks * block, dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    flat = cache.contiguous().view(torch.uint8).reshape(2, -1, heads, size)
    assert not flat[:, untouched].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_cuda_bytes_are_the_cpu_references(dtype, per_head):
    gen = torch.Generator().manual_seed(5)
    n, heads, size = 300, 8, 128
    key = (torch.randn(n, heads, size, generator=gen) * 30).to(dtype)
    value = (torch.randn(n, heads, size, generator=gen) / 30).to(dtype)
    slots = torch.randperm(64 * 16, generator=gen)[:n]
    scales = torch.rand(heads if per_head else 1, generator=gen) + 0.01
    caches = []
    for device in ("cpu", "cuda"):
        cache = torch.zeros(2, 64, 16, heads, size, dtype=F8, device=device)
        _C.kv_write(
            key.to(device),
            value.to(device),
            cache,
            slots.to(device),
            scales.to(device),
            (scales * 2).to(device),
        )
        caches.append(cache.cpu().view(torch.uint8))
    assert torch.equal(caches[0], caches[1])


def test_refusals_leave_the_cache_untouched(device):
    key = torch.randn(2, 2, 16, device=device)
    cache = torch.zeros(2, 3, 4, 2, 16, dtype=F8, device=device)
    slots = torch.tensor([1, 6], device=device)
    one = torch.ones(1, device=device)
    two = torch.ones(2, device=device)
    scales = [
        (),  # none for an fp8 cache
        (one * 0, one),
        (one, one * float("nan")),
        (one, -one),
        (torch.tensor([1.0, float("inf")], device=device), two),  # per head, one bad
        (torch.ones(3, device=device), torch.ones(3, device=device)),
        (two, one),
        (one.double(), one),
    ]
    if torch.device(device).type != "cpu":
        scales.append((one.cpu(), one.cpu()))  # another device
    for args in [(key, key, cache, slots, *sc) for sc in scales] + [
        (key, key, cache, torch.tensor([1, 12], device=device), one, one)  # a slot past the cache
    ]:
        with pytest.raises((TypeError, ValueError)):
            _C.kv_write(*args)
        assert not cache.view(torch.uint8).any(), args


def test_forward_paged_refuses_an_fp8_cache_without_scales_before_writing(device):
    q = torch.randn(2, 2, 16, device=device)
    key = torch.randn(2, 1, 16, device=device)
    cache = torch.zeros(2, 3, 4, 1, 16, dtype=F8, device=device)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    starts = torch.tensor([0, 2], dtype=torch.int32)
    lens = torch.tensor([2], dtype=torch.int32)
    message = (
        "forward_paged(): a float8_e4m3fn kv_cache needs k_scale and v_scale (float32 tensors of 1 or "
        "num_kv_heads = 1 entries), got neither"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        _C.forward_paged(
            q, key, key, cache, torch.tensor([1, 6], device=device), table.to(device), starts.to(device),
            lens.to(device), None, _C.MASK_CAUSAL, 0.25, torch.empty_like(q), table, starts, lens,
        )  # fmt: skip
    assert not cache.view(torch.uint8).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case",
    [(16, 0, 4), (128, 0, 8), (256, 0, 40), (72, 0, 8), (128, 8, 8), (40, 8, 3)],
    ids=["wide_16", "wide_128", "wide_256_x40", "narrow_72", "narrow_cache_at_8", "narrow_40_at_8"],
)
def test_cuda_vec_unit_widths(dtype, case):
    """The fast path's two unit widths on 16-bit inputs, each bit for bit torch's:
    kv_write_wide_kernel's 16-element units and 16-byte stores (heads of whole 16-element
    units, a 16-byte aligned cache side) and kv_write_vec_kernel's 8-element units with 8-byte
    stores (a 72- or 40-dim head, or a cache that starts 8 bytes past a 16-byte boundary).
    Token counts that end a tile part-way and rows of one to several passes."""
    size, cache_offset, heads = case
    gen = torch.Generator().manual_seed(size + cache_offset + heads)
    n, block, blocks = 77, 16, 8
    key = (torch.randn(n, heads, size, generator=gen) * 40).to(dtype).cuda()
    value = (torch.randn(n, heads, size, generator=gen) / 40).to(dtype).cuda()
    slots = torch.randperm(blocks * block, generator=gen)[:n]
    slots[[0, 30, 76]] = -1
    slots = slots.cuda()
    numel = 2 * blocks * block * heads * size
    storage = torch.full((numel + cache_offset,), 0x55, dtype=torch.uint8, device="cuda")
    cache = storage[cache_offset:].view(F8).view(2, blocks, block, heads, size)
    assert cache.data_ptr() % 16 == cache_offset
    k_scale = (torch.rand(heads, generator=gen) + 0.02).cuda()
    v_scale = k_scale.flip(0) * 0.02
    _C.kv_write(key, value, cache, slots, k_scale, v_scale)
    keep = slots >= 0
    k, v = _written(cache, slots[keep])
    assert torch.equal(k, _torch_quantized(key[keep], k_scale))
    assert torch.equal(v, _torch_quantized(value[keep], v_scale))
    untouched = torch.ones(blocks * block, dtype=torch.bool, device="cuda")
    untouched[slots[keep]] = False
    flat = cache.view(torch.uint8).reshape(2, -1, heads, size)
    assert (flat[:, untouched] == 0x55).all()
    assert (storage[:cache_offset] == 0x55).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_fast_quantizer_on_many_scales(dtype):
    """The CUDA division and rounding against torch's on every 16-bit pattern (fp32: 2^16
    random bit patterns) under 512 per-head scales -- random, powers of two, all-ones
    mantissas, tiny (subnormal inputs over them land in e4m3's range) and huge."""
    gen = torch.Generator().manual_seed(17)
    heads = 64
    if dtype == torch.float32:
        x = torch.randint(-(2**31), 2**31, (256, 1, 256), generator=gen, dtype=torch.int64)
        x = x.to(torch.int32).view(torch.float32)
    else:
        x = _every_pattern(dtype)
    x = x.expand(256, heads, 256).contiguous().cuda()
    # 1e-37, 2e-38: subnormal inputs over them land in e4m3's range
    special = torch.tensor(
        [1.0, 0.5, 2.0**-20, 2.0**20, 1.9999999, 1.0 - 2.0**-24, 3.0e-30, 7.0e30, 1e-37, 2e-38]
    )
    for round_ in range(8):
        scales = torch.exp(torch.randn(heads, generator=gen) * 6)
        if round_ == 0:
            scales[: len(special)] = special
        scales = scales.cuda()
        cache = torch.zeros(2, 16, 16, heads, 256, dtype=F8, device="cuda")
        slots = torch.arange(256, device="cuda")
        _C.kv_write(x, x, cache, slots, scales, scales.flip(0).contiguous())
        k, v = _written(cache, slots)
        assert torch.equal(k, _torch_quantized(x, scales)), (dtype, round_)
        assert torch.equal(v, _torch_quantized(x, scales.flip(0))), (dtype, round_)
