"""Paged attention over a float8_e4m3fn cache: ``_C.paged_attention(..., k_scale, v_scale)``
reads each key element as ``e4m3 * k_scale[kv head]`` (values likewise) in fp32.  So far the
CPU reference runs it (every mask mode, GQA, block sizes, cache layouts, per-tensor and
per-KV-head scales); CUDA's e4m3 kernel is tested in test_attention_fp8_cuda.py, its refusals
here.  Checked against the
float64 reference over the dequantized cache: the only rounding left is the output's to the
query dtype (and fp32 accumulation), so a wrong scale, a scale of the wrong head or a wrong
dequantization fails."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

import diffkv as dk
from _helpers import make_adapter, row
from diffkv import _C
from reference import dense_kv_from_cache, mask_causal, mask_key_limits, mask_none, mask_spans, ref_attention

F8 = torch.float8_e4m3fn
# |out - exact| <= REL * max|exact| + ABS: the output's rounding to its dtype, fp32 sums
TOLERANCE = {torch.bfloat16: (2.0**-8, 1e-6), torch.float16: (2.0**-11, 1e-6), torch.float32: (1e-5, 1e-6)}


FP32_QUERIES_MESSAGE = (
    "paged_attention(): a float8_e4m3fn kv_cache takes float16/bfloat16 queries on CUDA, got float32"
)


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
def test_cuda_refuses_float32_queries_over_an_fp8_cache_before_running():
    cache = torch.zeros(2, 3, 16, 2, 64, dtype=F8, device="cuda")
    query = torch.randn(3, 4, 64, device="cuda")
    out = torch.zeros_like(query)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    starts, lens = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    one = torch.ones(1, device="cuda")
    message = FP32_QUERIES_MESSAGE
    with pytest.raises(NotImplementedError, match=f"^{re.escape(message)}$"):
        _C.paged_attention(
            query, cache, table.cuda(), starts.cuda(), lens.cuda(), None, _C.MASK_CAUSAL, 0.125, out,
            table, starts, lens, one, one,
        )  # fmt: skip
    assert not out.any()


@pytest.mark.gpu
@pytest.mark.parametrize("choice", ["auto", "sm80"])
def test_cuda_refuses_an_fp8_cache_without_16_byte_rows(attention_kernel, choice):
    """On CUDA both fp8 kernels (the Hopper e4m3 one and the mma.sync kernels' fp8 form) read
    K/V rows in 16-byte chunks: a cache whose rows are not is refused before anything runs."""
    attention_kernel(choice)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    starts, lens = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    query = torch.randn(3, 4, 64, device="cuda", dtype=torch.bfloat16)
    one = torch.ones(1, device="cuda")
    padded = torch.zeros(2, 3, 16, 2, 68, dtype=F8, device="cuda")[..., :64]  # 136-byte tokens
    message = (
        "paged_attention(): a float8_e4m3fn kv_cache must have contiguous head dims, 16-byte "
        "aligned storage and block, token and head strides that are multiples of 16 on CUDA"
    )
    out = torch.zeros_like(query)
    with pytest.raises(NotImplementedError, match=f"^{re.escape(message)}$"):
        _C.paged_attention(
            query, padded, table.cuda(), starts.cuda(), lens.cuda(), None, _C.MASK_CAUSAL, 0.125,
            out, table, starts, lens, one, one,
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
    """A refused attention (float32 queries over an fp8 cache) leaves the cache unwritten: the
    write is launched only with the attention."""
    query, key, value, cache, slots, table, starts, lens, scales = _layer_call_inputs("cuda")
    before = cache.clone()
    out = torch.zeros_like(query)
    message = FP32_QUERIES_MESSAGE
    with pytest.raises(NotImplementedError, match=f"^{re.escape(message)}$"):
        _C.forward_paged(
            query, key, value, cache, slots, table.cuda(), starts.cuda(), lens.cuda(), None, _C.MASK_CAUSAL,
            0.125, out, table, starts, lens, *scales,
        )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8)) and not out.any()


def test_an_fp8_cache_through_the_adapter_api():
    """vLLM's way, on the CPU reference: CacheConfig(cache_dtype="fp8", calculate_kv_scales=True),
    an fp8 AttentionSpec, allocate_kv_caches in float8_e4m3fn, a piecewise denoise loop.  The
    first KV write sets the layer's scales (amax / 200, amax / 100); the cache holds torch's
    bytes for each write; each output matches float64 over the dequantized cache."""
    dt, prefix, image, heads, kv_heads, size = torch.bfloat16, 20, 37, 4, 2, 64
    spec = dk.AttentionSpec(block_size=16, num_kv_heads=kv_heads, head_size=size, dtype="fp8")
    assert spec.dtype == F8 and spec.page_size_bytes == 16 * kv_heads * 2 * size
    kv = dk.KVCacheConfig(num_blocks=16, kv_cache_groups=[dk.KVCacheGroup(["attn"], spec)])
    cfg = dk.DiffusionConfig(
        dk.ModelConfig(dt), dk.CacheConfig(16, cache_dtype="fp8", calculate_kv_scales=True)
    )
    tables = dk.BlockTables([16], 1, 512, [8], "cpu")
    layer = dk.DiffusionPagedAttentionLayerAdapter(
        layer_name="attn", layer=SimpleNamespace(num_heads=heads, softmax_scale=0.125), spec=spec,
        vllm_config=cfg, device="cpu",
    )  # fmt: skip
    assert layer.impl.kv_cache_dtype == "fp8" and layer.calculate_kv_scales
    assert dk.DiffKVAttentionImpl.supports_kv_cache_dtype("fp8", "cpu")
    assert dk.DiffKVAttentionImpl.supports_kv_cache_dtype("fp8", "cuda")
    assert not dk.DiffKVAttentionImpl.supports_kv_cache_dtype("fp8", "rocm")
    caches = dk.allocate_kv_caches(kv, dtype=F8, device="cpu", layers={"attn": layer})
    assert caches["attn"].dtype == F8 and layer.kv_cache is caches["attn"]
    tables.append_block_ids(0, [dk.BlockPool(16).allocate(4)])
    adapter = dk.DiffusionPagedAttentionAdapter(
        vllm_config=cfg, device="cpu", kv_cache_config=kv, block_tables=tables,
        attn_groups=[[dk.AttentionGroup(["attn"])]], layers={"attn": layer},
        resolve_row=lambda *identity: dk.DiffusionPagedAttentionRowBinding(0, prefix + image),
    )  # fmt: skip
    rows = dk.DiffusionPagedAttentionMetadata(
        prefill_rows=(dk.DiffusionPagedAttentionRow("img", prefix + image, prefix + image, sequence_id=0),),
        denoise_rows=(dk.DiffusionPagedAttentionRow("img", image, prefix + image, prefix, sequence_id=0),),
    )
    spans = [(prefix, prefix + image)]
    gen = torch.Generator().manual_seed(8)
    written = torch.zeros(prefix + image, 2, kv_heads, size, dtype=dt)
    with dk.DiffusionPagedAttentionRuntime(adapter, rows).activate() as runtime:
        for step in range(3):
            n = prefix + image if step == 0 else image
            q = torch.randn(n, heads * size, generator=gen).to(dt)
            k = (torch.randn(n, kv_heads * size, generator=gen) * 5).to(dt)
            v = torch.randn(n, kv_heads * size, generator=gen).to(dt)
            ctx = runtime.ensure_active(step).prepare_layer_context(
                "attn", q, k, v, omni_attn_metadata=dk.AttentionMetadata(full_attn_spans=[spans])
            )
            out = layer.impl.forward_paged(ctx)
            if step == 0:  # the first write set the scales
                assert not layer.calculate_kv_scales
                assert layer._k_scale_float == pytest.approx(k.float().abs().max().item() / 200)
                assert layer._v_scale_float == pytest.approx(v.float().abs().max().item() / 100)
            start = prefix + image - n
            written[start:, 0] = k.view(n, kv_heads, size)
            written[start:, 1] = v.view(n, kv_heads, size)
            # the cache's e4m3 values (dequantized below)
            row_table = ctx.native_metadata.block_table_cpu[0]
            k_cache, v_cache = dense_kv_from_cache(caches["attn"].float(), row_table, prefix + image)
            expected_k = (written[:, 0].float() / layer._k_scale).clamp(-448, 448).to(F8).float()
            expected_v = (written[:, 1].float() / layer._v_scale).clamp(-448, 448).to(F8).float()
            assert torch.equal(k_cache.float(), expected_k) and torch.equal(v_cache.float(), expected_v)
            positions = list(range(start, prefix + image))
            k_deq, v_deq = k_cache * layer._k_scale_float, v_cache * layer._v_scale_float
            visible = mask_spans(positions, prefix + image, spans)
            exact = ref_attention(q.view(n, heads, size).double(), k_deq, v_deq, visible, 0.125)
            err = (out.view(n, heads, size).double() - exact).abs().max().item()
            assert err <= 2.0**-8 * exact.abs().max().item() + 1e-6, (step, err)


def _update_inputs(kv_cache_dtype, seed):
    """An fp8 impl, a layer with fixed scales (0.03, 0.01), 5 tokens of bf16 K/V for 2 KV heads
    x 64, their slots and an empty float8_e4m3fn cache of 2 blocks of 16."""
    impl = dk.DiffKVAttentionImpl(
        num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, kv_cache_dtype=kv_cache_dtype
    )
    layer = SimpleNamespace(_k_scale=torch.tensor([0.03]), _v_scale=torch.tensor([0.01]))
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(5, 2, 64, generator=gen).to(torch.bfloat16)
    value = torch.randn(5, 2, 64, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([3, 17, 0, 31, 8])
    return impl, layer, key, value, slots, torch.zeros(2, 2, 16, 2, 64, dtype=F8)


def test_do_kv_cache_update_quantizes_with_the_layers_scales():
    impl, layer, key, value, slots, cache = _update_inputs("fp8_e4m3", 2)
    impl.do_kv_cache_update(layer, key, value, cache, slots)
    flat = cache.view(torch.uint8).view(2, 32, 2, 64)
    assert torch.equal(flat[0][slots], (key.float() / 0.03).clamp(-448, 448).to(F8).view(torch.uint8))
    assert torch.equal(flat[1][slots], (value.float() / 0.01).clamp(-448, 448).to(F8).view(torch.uint8))
    message = (
        "a float8_e4m3fn KV cache needs its layer's _k_scale and _v_scale (float32 tensors), got NoneType "
        "and NoneType on NoneType"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        impl.do_kv_cache_update(None, key, value, torch.zeros_like(cache), slots)


def test_do_kv_cache_update_names_a_kv_cache_that_is_not_a_tensor():
    """(Found by the long fuzz profile: it raised AttributeError reading None's dtype.)"""
    impl, layer, key, value, slots, _ = _update_inputs("fp8_e4m3", 2)
    for bad in (None, [[0.0]], "cache"):
        message = f"kv_write(): kv_cache must be a torch.Tensor, got {type(bad).__name__}"
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            impl.do_kv_cache_update(layer, key, value, bad, slots)


@pytest.mark.parametrize("spec_dtype", [F8, torch.float32], ids=["fp8_spec", "fp32_spec"])
def test_a_cache_that_contradicts_the_spec_is_refused_before_writing(spec_dtype):
    """A layer whose bound kv_cache is not what its spec says (an fp8 spec with an fp32 cache, or
    the reverse) is refused by the layer call, the cache untouched."""
    h = make_adapter("cpu", num_heads=2, num_kv_heads=1, bindings={("req", 0, None): (0, 8)})
    layer = h.layers["layer0"]
    layer.spec = dataclasses.replace(layer.spec, dtype=spec_dtype)
    wrong = torch.zeros_like(layer.kv_cache, dtype=torch.float32 if spec_dtype == F8 else F8)
    layer.kv_cache = wrong
    batch = h.adapter.prepare_batch([row(query_len=4, seq_len=4)])
    q, kv = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    with h.adapter.activate(batch):
        context = h.adapter.prepare_layer_context("layer0", q, kv, kv)
        message = (
            f"the layer's kv_cache holds {wrong.dtype} but its spec says {spec_dtype}: an fp8 spec needs a "
            "float8_e4m3fn cache (allocate_kv_caches with the spec's dtype), and only it"
        )
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            layer.impl.forward_paged(context)
    assert not wrong.view(torch.uint8).any()


# --- torch.compile ---------------------------------------------------------------------------


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_fp8_layer_call_compiles(device):
    """torch.ops.diffkv.forward_paged with the scales, compiled without graph breaks: the same
    cache bytes and output, bit for bit, as the eager binding."""
    query, key, value, cache, slots, table, starts, lens, (k_scale, v_scale) = _layer_call_inputs(device)
    if device == "cuda":
        query = query.to(torch.bfloat16)
        key, value = key.to(torch.bfloat16), value.to(torch.bfloat16)
    dev_meta = tuple(t.to(device) for t in (table, starts, lens))
    host = (None, None, None) if device == "cuda" else (table, starts, lens)
    eager_cache = cache.clone()
    eager = torch.empty_like(query)
    _C.forward_paged(
        query, key, value, eager_cache, slots, table.to(device), starts.to(device), lens.to(device), None,
        _C.MASK_CAUSAL, 0.125, eager, table, starts, lens, k_scale, v_scale,
    )  # fmt: skip

    def layer(q, k, v, kv_cache, slot_mapping, ks, vs):
        return torch.ops.diffkv.forward_paged(
            q, k, v, kv_cache, slot_mapping, *dev_meta, None, _C.MASK_CAUSAL, 0.125, *host, ks, vs
        )

    out = _compiled(layer)(query, key, value, cache, slots, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), eager_cache.view(torch.uint8))
    assert torch.equal(out, eager)


def test_do_kv_cache_update_compiles_over_an_fp8_cache():
    """The quantizing write traces (the layer's fixed scales are graph inputs); while the
    layer's calculate_kv_scales is pending it refuses, since that first write reads the data
    on the host."""
    impl, layer, key, value, slots, cache = _update_inputs("fp8", 5)
    expected = torch.zeros_like(cache)
    _C.kv_write(key, value, expected, slots, layer._k_scale, layer._v_scale)

    def update(k, v, kv_cache, slot_mapping):
        impl.do_kv_cache_update(layer, k, v, kv_cache, slot_mapping)

    _compiled(update)(key, value, cache, slots)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    layer.calculate_kv_scales = True
    message = (
        "calculate_kv_scales cannot run under torch.compile: the first KV write sets the layer's scales "
        "from the data written (a host synchronisation); run that step eagerly, or set the layer's "
        "_k_scale and _v_scale"
    )
    with pytest.raises(Exception, match=re.escape(message)):
        _compiled(update)(key, value, torch.zeros_like(cache), slots)


def test_the_operators_take_scales():
    """opcheck's fake-tensor and autograd-registration checks over the fp8 forms of the three
    operators.  (Its schema check compares tensors by arithmetic, which torch does not implement
    for float8_e4m3fn; what the operators write is checked byte for byte above.)"""
    query, key, value, cache, slots, table, starts, lens, scales = _layer_call_inputs("cpu")
    meta = (table, starts, lens, None, _C.MASK_CAUSAL, 0.125, table, starts, lens)
    checks = ("test_faketensor", "test_autograd_registration")
    for op, args in (
        (torch.ops.diffkv.kv_write.default, (key, value, cache.clone(), slots, *scales)),
        (torch.ops.diffkv.paged_attention.default, (query, cache, *meta, *scales)),
        (torch.ops.diffkv.forward_paged.default, (query, key, value, cache.clone(), slots, *meta, *scales)),
    ):
        torch.library.opcheck(op, args, test_utils=checks)
