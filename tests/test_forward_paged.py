"""DiffKVAttentionImpl.forward_paged end to end through a real adapter built from diffkv's
public API: prefill rows then denoise rows over the same pages, for non-causal layers (with a
non-suffix denoise span), causal layers and piecewise spans, in packed [T, H, D] / [T, H*D]
and right-padded [B, T, ...] layouts.  Outputs are checked against the float64 reference and
the KV caches bit-exact against the expected scatter."""

from __future__ import annotations

import dataclasses
import math
import re
from types import SimpleNamespace

import pytest
import torch

import diffkv
from diffkv import _C
from reference import assert_attention_close, mask_causal, mask_none, mask_spans

HEAD_SIZE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
SCALE = HEAD_SIZE**-0.5
LAYERS = ("blocks.0.attn", "blocks.1.attn")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class PagedSequence:
    """One paged sequence: its request id, Worker row, seq_len and manager block ids."""

    def __init__(self, request_id, row_index, seq_len, block_ids):
        self.request_id = request_id
        self.row_index = row_index
        self.seq_len = seq_len
        self.block_ids = block_ids

    def slot(self, position, block_size):
        return self.block_ids[position // block_size] * block_size + position % block_size


class Harness:
    """An adapter over two layers of one cache group, with the expected state kept in torch."""

    def __init__(
        self,
        device,
        dtype,
        block_size,
        *,
        non_causal,
        seq_lens=(40, 33),
        layout="layer_major",
        head_size=HEAD_SIZE,
    ):
        self.device = device
        self.head_size = head_size
        self.scale = head_size**-0.5
        self.dtype = dtype
        self.block_size = block_size
        config = diffkv.DiffusionConfig(diffkv.ModelConfig(dtype), diffkv.CacheConfig(block_size=block_size))
        spec = diffkv.AttentionSpec(block_size, NUM_KV_HEADS, self.head_size, dtype, non_causal=non_causal)
        self.layers = {
            name: diffkv.DiffusionPagedAttentionLayerAdapter(
                layer_name=name,
                layer=SimpleNamespace(num_heads=NUM_HEADS, softmax_scale=self.scale),
                spec=spec,
                vllm_config=config,
                device=device,
            )
            for name in LAYERS
        }
        needed = [math.ceil(s / block_size) for s in seq_lens]
        num_blocks = sum(needed) + 4
        kv_config = diffkv.KVCacheConfig(
            num_blocks, [diffkv.KVCacheGroup(LAYERS, self.layers[LAYERS[0]].spec)]
        )
        self.caches = diffkv.allocate_kv_caches(
            kv_config, dtype=dtype, device=device, layers=self.layers, layout=layout
        )
        self.expected_caches = {name: cache.clone() for name, cache in self.caches.items()}

        # Scatter the blocks: allocate everything, give back a shuffled subset, take from it.
        pool = diffkv.BlockPool(num_blocks)
        everything = pool.allocate(num_blocks)
        shuffled = [everything[i] for i in torch.randperm(num_blocks).tolist()]
        pool.free(shuffled[: sum(needed) + 2])
        tables = diffkv.BlockTables([block_size], 4, 256, [max(needed) + 1], device)
        self.sequences = []
        for i, (seq_len, n) in enumerate(zip(seq_lens, needed, strict=True)):
            sequence = PagedSequence(f"req-{i}", 2 - i, seq_len, pool.allocate(n))
            tables.append_block_ids(sequence.row_index, [sequence.block_ids])
            self.sequences.append(sequence)
        bindings = {
            (s.request_id, 0, None): diffkv.DiffusionPagedAttentionRowBinding(
                row_index=s.row_index, max_seq_len=s.seq_len
            )
            for s in self.sequences
        }
        self.adapter = diffkv.DiffusionPagedAttentionAdapter(
            vllm_config=config,
            device=device,
            kv_cache_config=kv_config,
            block_tables=tables,
            attn_groups=[[diffkv.AttentionGroup(LAYERS)]],
            layers=self.layers,
            resolve_row=lambda request_id, sequence_id, context_id: bindings[
                (request_id, sequence_id, context_id)
            ],
        )
        # Logical K/V of every sequence per layer, in the cache dtype.
        self.logical = {
            name: [
                (
                    torch.zeros(s.seq_len, NUM_KV_HEADS, self.head_size, dtype=dtype),
                    torch.zeros(s.seq_len, NUM_KV_HEADS, self.head_size, dtype=dtype),
                )
                for s in self.sequences
            ]
            for name in LAYERS
        }

    def rows(self, spans):
        """Row objects: spans is a list of (kv_start_pos, query_len) per sequence."""
        return tuple(
            diffkv.DiffusionPagedAttentionRow(
                request_id=s.request_id, query_len=q, seq_len=s.seq_len, kv_start_pos=start, sequence_id=0
            )
            for s, (start, q) in zip(self.sequences, spans, strict=True)
        )

    def make_inputs(self, rows, layout):
        """Random Q/K/V in the caller's layout (K/V strided views of one QKV projection) and the
        packed per-row tensors the reference uses."""
        query_lens = [row.query_len for row in rows]
        width = (NUM_HEADS + 2 * NUM_KV_HEADS) * self.head_size
        k0, v0 = NUM_HEADS * self.head_size, (NUM_HEADS + NUM_KV_HEADS) * self.head_size
        if layout.startswith("packed"):
            qkv = torch.randn(sum(query_lens), width).to(self.dtype)
            starts = [sum(query_lens[:r]) for r in range(len(rows))]
            per_row = [qkv[a : a + n] for a, n in zip(starts, query_lens, strict=True)]
        else:
            tokens = max(query_lens) + (1 if layout.endswith("extra") else 0)
            qkv = torch.randn(len(rows), tokens, width).to(self.dtype)
            per_row = [qkv[r, :n] for r, n in enumerate(query_lens)]
        qkv_dev = qkv.to(self.device)
        q, k, v = qkv_dev[..., :k0], qkv_dev[..., k0:v0], qkv_dev[..., v0:]
        if "heads" in layout:
            lead = q.shape[:-1]
            q = q.reshape(*lead, NUM_HEADS, self.head_size)
            k = k.unflatten(-1, (NUM_KV_HEADS, self.head_size))
            v = v.unflatten(-1, (NUM_KV_HEADS, self.head_size))
        packed = [
            (
                t[:, :k0].reshape(-1, NUM_HEADS, self.head_size),
                t[:, k0:v0].reshape(-1, NUM_KV_HEADS, self.head_size),
                t[:, v0:].reshape(-1, NUM_KV_HEADS, self.head_size),
            )
            for t in per_row
        ]
        return q, k, v, packed

    def run_layer(self, name, rows, layout, mask_kind, spans=None):
        q, k, v, packed = self.make_inputs(rows, layout)
        metadata = None if spans is None else diffkv.AttentionMetadata(full_attn_spans=spans)
        context = self.adapter.prepare_layer_context(name, q, k, v, omni_attn_metadata=metadata)
        out = self.layers[name].impl.forward_paged(context)

        # The caller's layout comes back, with zeros at padding positions.
        assert out.shape == q.shape and out.dtype == self.dtype
        assert out.device.type == self.device.type
        padded = not layout.startswith("packed")
        out_rows = []
        cursor = 0
        flat = out.reshape(*out.shape[: 2 if padded else 1], NUM_HEADS, self.head_size)
        for r, row in enumerate(rows):
            if padded:
                out_rows.append(flat[r, : row.query_len])
                assert not flat[r, row.query_len :].any()
            else:
                out_rows.append(flat[cursor : cursor + row.query_len])
                cursor += row.query_len

        # Expected state: the write, then attention over the row's [0, seq_len).
        for r, (row, sequence, (qr, kr, vr)) in enumerate(zip(rows, self.sequences, packed, strict=True)):
            start, end = row.kv_start_pos, row.kv_start_pos + row.query_len
            keys, values = self.logical[name][r]
            keys[start:end] = kr
            values[start:end] = vr
            slots = torch.tensor([sequence.slot(p, self.block_size) for p in range(start, end)])
            blocks, offsets = slots // self.block_size, slots % self.block_size
            expected = self.expected_caches[name]
            expected[0, blocks, offsets] = kr.to(self.device)
            expected[1, blocks, offsets] = vr.to(self.device)
            positions = list(range(start, end))
            if mask_kind == "none":
                visible = mask_none(positions, row.seq_len)
            elif mask_kind == "causal":
                visible = mask_causal(positions, row.seq_len)
            else:
                visible = mask_spans(positions, row.seq_len, spans[r])
            assert_attention_close(out_rows[r], qr, keys, values, visible, self.scale)
        assert torch.equal(self.caches[name], self.expected_caches[name])

    def run_steps(self, prefill, denoise, layout, mask_kind, spans=None, steps=3):
        metadata = diffkv.DiffusionPagedAttentionMetadata(
            prefill_rows=self.rows(prefill), denoise_rows=self.rows(denoise)
        )
        runtime = diffkv.DiffusionPagedAttentionRuntime(self.adapter, metadata)
        with runtime.activate():
            for step in range(steps):
                runtime.ensure_active(step)
                rows = metadata.rows_for_step(step)
                for name in LAYERS:
                    self.run_layer(name, rows, layout, mask_kind, spans)


LAYOUTS = ["packed_heads", "packed_flat", "padded_heads", "padded_flat_extra"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_causal_non_suffix_denoise(device, dtype, block_size, layout):
    # Denoise rows rewrite a span in the middle ([10, 26) of 40, [5, 21) of 33) and attend over
    # the whole row: the tail keeps its prefill K/V.
    h = Harness(device, dtype, block_size, non_causal=True)
    h.run_steps(prefill=[(0, 40), (0, 33)], denoise=[(10, 16), (5, 16)], layout=layout, mask_kind="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [8, 72, 88, 200])
def test_cpu_layers_take_every_head_size_the_reference_does(dtype, head_size):
    """A CPU layer's backend selection takes what the C reference serves (1 to 1024), so the
    whole layer path runs at head sizes the CUDA kernels do not have (8, 88, 200) as well as
    those they have."""
    h = Harness(torch.device("cpu"), dtype, 4, non_causal=True, head_size=head_size)
    steps = dict(prefill=[(0, 40), (0, 33)], denoise=[(10, 16), (5, 16)])
    h.run_steps(**steps, layout="packed_heads", mask_kind="none")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_layers_take_the_cuda_kernels_head_sizes(dtype):
    """A CUDA layer's selection takes the head sizes the CUDA kernels are built for (fp16/bf16:
    32, 64, 72, 80, 96, 128, 160, 192, 256) and names them; it fails before the layer touches the
    device."""
    config = diffkv.DiffusionConfig(diffkv.ModelConfig(dtype), diffkv.CacheConfig(block_size=16))
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    if _C.cuda_compiled():
        message = (
            "get_attn_backend(): head_size must be one of [32, 64, 72, 80, 96, 128, 160, 192, 256] "
            f"for {name} on cuda, got 88"
        )
    else:
        message = (
            f"get_attn_backend(): head_size 88 cannot run for {name} on cuda: this diffkv was built "
            "without CUDA kernels"
        )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        diffkv.DiffusionPagedAttentionLayerAdapter(
            layer_name="blocks.0.attn",
            layer=SimpleNamespace(num_heads=4, softmax_scale=0.1),
            spec=diffkv.AttentionSpec(16, 2, 88, dtype),
            vllm_config=config,
            device=torch.device("cuda"),
        )
    sizes = diffkv.backends.diffkv.supported_head_sizes
    assert sizes("cuda", dtype) == ([32, 64, 72, 80, 96, 128, 160, 192, 256] if _C.cuda_compiled() else [])
    assert sizes("cuda", torch.float32) == (list(range(1, 257)) if _C.cuda_compiled() else [])
    assert sizes("cpu", dtype) == list(range(1, 1025))
    assert sizes("cuda", dtype, fp8_cache=True) == sizes("cuda", dtype)
    assert sizes("cuda", torch.float32, fp8_cache=True) == []
    assert sizes("cpu", dtype, fp8_cache=True) == list(range(1, 1025))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_fp8_layers_take_the_e4m3_forms_head_sizes(dtype):
    """Over a float8_e4m3fn cache a CUDA layer's selection takes the unquantized kernels' head
    sizes (each has an e4m3 form), refusing another (88) by name; a CPU layer takes it (the C
    reference reads fp8 caches at every size)."""
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    config = diffkv.DiffusionConfig(
        diffkv.ModelConfig(dtype), diffkv.CacheConfig(block_size=16, cache_dtype="fp8")
    )

    def adapter(device: str) -> diffkv.DiffusionPagedAttentionLayerAdapter:
        return diffkv.DiffusionPagedAttentionLayerAdapter(
            layer_name="blocks.0.attn",
            layer=SimpleNamespace(num_heads=4, softmax_scale=0.1),
            spec=diffkv.AttentionSpec(16, 2, 88, "fp8"),
            vllm_config=config,
            device=torch.device(device),
        )

    if _C.cuda_compiled():
        message = (
            f"get_attn_backend(): head_size must be one of [32, 64, 72, 80, 96, 128, 160, 192, 256] for "
            f"{name} with a float8_e4m3fn cache on cuda, got 88"
        )
    else:
        message = (
            f"get_attn_backend(): head_size 88 cannot run for {name} with a float8_e4m3fn cache on cuda: "
            "this diffkv was built without CUDA kernels"
        )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        adapter("cuda")
    assert adapter("cpu").layer_name == "blocks.0.attn"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_causal(device, dtype, block_size, layout):
    h = Harness(device, dtype, block_size, non_causal=False)
    h.run_steps(prefill=[(0, 40), (0, 33)], denoise=[(16, 24), (9, 24)], layout=layout, mask_kind="causal")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_piecewise_spans(device, dtype, block_size, layout):
    # Prefill: causal / full / causal per row; denoise (suffix of 24): full / causal.
    h = Harness(device, dtype, block_size, non_causal=False)
    spans = [[(10, 30)], [(5, 25)]]
    h.run_steps(
        prefill=[(0, 40), (0, 33)],
        denoise=[(16, 24), (9, 24)],
        layout=layout,
        mask_kind="spans",
        spans=spans,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_denoise_span_over_the_whole_query_runs_unmasked(device, dtype, monkeypatch):
    # HunyuanImage-3.0's denoise step: the image span covers the step's whole query, so every
    # query token sees all its row's keys -- the plan says so and the layer call runs
    # MASK_NONE; the prefill steps (causal prompt, then the span) keep MASK_LIMITS.  Outputs
    # against the float64 reference of the span mask either way.
    from diffkv import ops

    masks = []
    inputs = ops.paged_layer_inputs

    def recording(*args, **kwargs):
        result = inputs(*args, **kwargs)
        masks.append((result.mask, result.key_limits is None))
        return result

    monkeypatch.setattr(ops, "paged_layer_inputs", recording)
    h = Harness(device, dtype, 16, non_causal=False)
    spans = [[(16, 40)], [(9, 33)]]
    h.run_steps(
        prefill=[(0, 40), (0, 33)],
        denoise=[(16, 24), (9, 24)],
        layout="packed_heads",
        mask_kind="spans",
        spans=spans,
    )
    # the prefill step's two layers, then the denoise steps' (the second denoise step reruns
    # the first one's described calls: same plan, same metadata)
    assert masks == [(_C.MASK_LIMITS, False)] * 2 + [(_C.MASK_NONE, True)] * 2


def test_plan_mask():
    from diffkv import ops

    denoise = diffkv.build_paged_piecewise_plan([[(5, 9)], [(3, 12)]], [5, 3], [4, 9], [9, 12])
    assert denoise.all_keys_visible is True
    assert ops.plan_mask(denoise) == (_C.MASK_NONE, None)
    # a span one key short of the row's end: its queries see keys < 11 of 12
    short = diffkv.build_paged_piecewise_plan([[(3, 11)]], [3], [9], [12])
    assert short.all_keys_visible is False
    assert short.key_limits.tolist() == [11] * 8 + [12]
    mask, limits = ops.plan_mask(short)
    assert mask == _C.MASK_LIMITS and limits is short.key_limits
    # a causal row: only its last token sees every key
    assert diffkv.build_paged_piecewise_plan([[]], [0], [3], [3]).all_keys_visible is False
    # a plan object without the field (vLLM-Omni's own class) keeps its limits
    foreign = SimpleNamespace(key_limits=denoise.key_limits)
    assert ops.plan_mask(foreign) == (_C.MASK_LIMITS, denoise.key_limits)


@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_cache_layouts(device, layout):
    h = Harness(device, torch.bfloat16, 4, non_causal=False, seq_lens=(21, 30), layout=layout)
    spans = [[(3, 9), (12, 18)], [(13, 16), (18, 27)]]
    h.run_steps(
        prefill=[(0, 21), (0, 30)],
        denoise=[(2, 19), (11, 19)],
        layout="packed_heads",
        mask_kind="spans",
        spans=spans,
    )


def test_two_rows_share_pages_not_across_rows(device):
    # A single row attends only to its own pages: changing the other row's cache pages must
    # not change this row's output.
    h = Harness(device, torch.float32, 4, non_causal=True, seq_lens=(12, 12))
    h.run_steps(
        prefill=[(0, 12), (0, 12)], denoise=[(4, 8), (4, 8)], layout="packed_heads", mask_kind="none", steps=2
    )
    rows = h.rows([(4, 8), (4, 8)])
    batch = h.adapter.prepare_batch(rows)
    with h.adapter.activate(batch):
        q, k, v, _ = h.make_inputs(rows, "packed_heads")
        name = LAYERS[0]
        first = h.layers[name].impl.forward_paged(h.adapter.prepare_layer_context(name, q, k, v)).clone()
        other = h.sequences[1]
        for block in other.block_ids:
            h.caches[name][:, block, :] = 0
        second = h.layers[name].impl.forward_paged(h.adapter.prepare_layer_context(name, q, k, v))
        assert torch.equal(first[:8], second[:8])
        assert not torch.equal(first[8:], second[8:])


# --- backend and impl surface -------------------------------------------------------------------


def test_backend_class():
    backend = diffkv.DiffKVAttentionBackend
    assert backend.get_name() == "DIFFKV"
    assert backend.supports_paged_kv is True
    assert backend.supports_piecewise_spans is True
    assert backend.accept_output_buffer is False
    assert backend.forward_includes_kv_cache_update is False
    assert backend.get_impl_cls() is diffkv.DiffKVAttentionImpl
    assert backend.get_metadata_cls() is diffkv.PagedAttentionMetadata
    assert backend.get_builder_cls().reorder_batch_threshold is None
    # the sizes of the device selection is for: the platform's here (no layer is being selected)
    if diffkv.platform.current_omni_platform.is_cuda():
        assert backend.get_supported_head_sizes() == [32, 64, 72, 80, 96, 128, 160, 192, 256]
        assert backend.supports_head_size(96) and not backend.supports_head_size(88)
    else:
        assert backend.get_supported_head_sizes() == list(range(1, 1025))
        assert backend.supports_head_size(96) and not backend.supports_head_size(1025)
    with diffkv.platform.selecting_for("cpu"):
        assert backend.get_supported_head_sizes() == list(range(1, 1025))
    assert backend.indexes_kv_by_block_stride() is True
    assert issubclass(backend, diffkv.AttentionBackend)
    assert issubclass(diffkv.DiffKVAttentionImpl, diffkv.AttentionImpl)


def test_impl_constructor():
    impl = diffkv.DiffKVAttentionImpl(
        num_heads=8,
        head_size=64,
        scale=0.125,
        num_kv_heads=2,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
    )
    assert (impl.num_heads, impl.head_size, impl.num_kv_heads) == (8, 64, 2)
    assert impl.softmax_scale == impl.scale == 0.125
    impl = diffkv.DiffKVAttentionImpl(4, 128, 0.5, causal=True, prefix="x")
    assert impl.num_kv_heads == 4 and impl.causal and impl.softmax_scale == 0.5
    assert diffkv.DiffKVAttentionImpl(4, 64, softmax_scale=0.5, scale=0.5).scale == 0.5
    assert diffkv.DiffKVAttentionImpl(4, 64, 0.5, kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"


def test_dense_forward_on_other_platforms_is_explicitly_unsupported():
    """forward/forward_cuda run the dense path (tests/test_dense.py); the other platforms'
    entry points say that diffkv does not run there."""
    impl = diffkv.DiffKVAttentionImpl(4, 64, 0.125)
    x = torch.zeros(1, 4, 64)
    for method, name in (
        (impl.forward_npu, "NPU"),
        (impl.forward_xpu, "XPU"),
        (impl.forward_hip, "ROCm"),
        (impl.forward_musa, "MUSA"),
    ):
        message = f"^DiffKVAttentionImpl: diffkv runs on CPU and CUDA tensors only, not on {name}$"
        with pytest.raises(NotImplementedError, match=message):
            method(x, x, x, None)


def test_forward_paged_binding_errors(device):
    h = Harness(device, torch.float32, 4, non_causal=True, seq_lens=(8,))
    rows = h.rows([(0, 8)])
    batch = h.adapter.prepare_batch(rows)
    name = LAYERS[0]
    layer = h.layers[name]
    impl = layer.impl
    with h.adapter.activate(batch):
        q, k, v, _ = h.make_inputs(rows, "packed_heads")
        context = h.adapter.prepare_layer_context(name, q, k, v)
        with pytest.raises(
            TypeError, match=r"^paged_kv_context must expose a native diffusion attention layer$"
        ):
            impl.forward_paged(SimpleNamespace(query=q))
        before = h.caches[name].clone()
        layer.kv_cache = None
        with pytest.raises(
            RuntimeError, match=r"^Native KV cache is not bound for diffusion layer 'blocks.0.attn'$"
        ):
            impl.forward_paged(context)
        layer.kv_cache = h.caches[name]
        layer.impl = None
        with pytest.raises(
            RuntimeError,
            match=r"^Native attention implementation is not bound for diffusion layer 'blocks.0.attn'$",
        ):
            impl.forward_paged(context)
        layer.impl = impl
        assert torch.equal(h.caches[name], before)
        out = impl.forward_paged(context)
        assert out.shape == (8, NUM_HEADS, HEAD_SIZE)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_paged_one_c_call(device, layout, monkeypatch):
    # The whole layer (write + attention) is one C call, _C.forward_paged, whose arguments
    # prepare_layer_context described (forward_paged reads nothing back from the context and
    # never reaches run_forward_paged).  The fallback that describes a context from its
    # attributes (run_forward_paged: a context diffkv did not just prepare, or while compiling)
    # makes the same call, and both give bit-identical outputs and caches in every Q/K/V layout
    # (an [N, H*D] query's output is allocated [N, H*D] on the prepared path, the kernels writing
    # its [N, H, D] view, where the fallback restores a view of its [N, H, D] output -- same
    # shape, strides and values; the padded layouts go through restore_output on both).
    backend = diffkv.backends.diffkv
    h = Harness(device, torch.float32, 4, non_causal=False, seq_lens=(8,))
    rows = h.rows([(0, 8)])
    spans = diffkv.AttentionMetadata(full_attn_spans=[[(2, 6)]])
    batch = h.adapter.prepare_batch(rows)
    with h.adapter.activate(batch):
        q, k, v, _ = h.make_inputs(rows, layout)

    def run_layers(prepared):
        outs = []
        with h.adapter.activate(batch):
            for name, metadata in ((LAYERS[0], None), (LAYERS[1], spans)):
                context = h.adapter.prepare_layer_context(name, q, k, v, omni_attn_metadata=metadata)
                if not prepared:
                    context = dataclasses.replace(context)  # not the object prepare described
                outs.append(h.layers[name].impl.forward_paged(context))
        return outs

    calls = []
    real = _C.forward_paged

    def spy(*args):
        calls.append(args)
        return real(*args)

    def no_fallback(*args, **kwargs):
        raise AssertionError("run_forward_paged reached on the prepared path")

    with monkeypatch.context() as m:
        m.setattr(_C, "forward_paged", spy)
        m.setattr(backend, "run_forward_paged", no_fallback)
        for name in ("kv_write", "paged_attention"):
            m.setattr(_C, name, None)
        out_prepared = run_layers(prepared=True)
    prepared_calls, calls[:] = list(calls), []
    caches_prepared = [h.caches[name].clone() for name in LAYERS]
    for name in LAYERS:
        h.caches[name].zero_()

    fallbacks = []
    real_fallback = backend.run_forward_paged

    def fallback_spy(context, **kwargs):
        fallbacks.append(context)
        return real_fallback(context, **kwargs)

    monkeypatch.setattr(_C, "forward_paged", spy)
    monkeypatch.setattr(backend, "run_forward_paged", fallback_spy)
    monkeypatch.setattr(_C, "kv_write", None)
    monkeypatch.setattr(_C, "paged_attention", None)
    out_fallback = run_layers(prepared=False)
    assert len(fallbacks) == 2 and len(calls) == 2 and len(prepared_calls) == 2
    for described, fallback in zip(prepared_calls, calls, strict=True):
        # the same arguments but out (allocated by each path)
        for i, (a, b) in enumerate(zip(described, fallback, strict=True)):
            if i not in (10, 11):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, i
        assert described[10] == fallback[10] == SCALE
    assert prepared_calls[0][9] == _C.MASK_CAUSAL and prepared_calls[0][8] is None
    assert prepared_calls[1][9] == _C.MASK_LIMITS
    if layout.startswith("packed"):
        assert prepared_calls[1][8].tolist() == [1, 2, 6, 6, 6, 6, 7, 8]
    flat_query = layout == "packed_flat"
    assert prepared_calls[0][11].dim() == (2 if flat_query else 3)
    for a, b in zip(out_prepared, out_fallback, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    for name, cache in zip(LAYERS, caches_prepared, strict=True):
        assert torch.equal(h.caches[name], cache)
    assert not torch.equal(caches_prepared[0], torch.zeros_like(caches_prepared[0]))


def test_prepared_call_belongs_to_its_context(device, monkeypatch):
    # prepare_layer_context describes the call of the context it returns, once: another
    # context (prepared later, or the same one a second time), a layer whose cache was rebound,
    # all go through run_forward_paged, with the same results.
    backend = diffkv.backends.diffkv
    fallbacks = []
    real_fallback = backend.run_forward_paged

    def fallback_spy(context, **kwargs):
        fallbacks.append(context)
        return real_fallback(context, **kwargs)

    monkeypatch.setattr(backend, "run_forward_paged", fallback_spy)
    h = Harness(device, torch.float32, 4, non_causal=True, seq_lens=(8,))
    rows = h.rows([(0, 8)])
    first, second = LAYERS
    with h.adapter.activate(h.adapter.prepare_batch(rows)):
        q, k, v, _ = h.make_inputs(rows, "packed_heads")
        context_a = h.adapter.prepare_layer_context(first, q, k, v)
        context_b = h.adapter.prepare_layer_context(second, q, k, v)
        out_a = h.layers[first].impl.forward_paged(context_a)  # B's call is the prepared one
        assert fallbacks == [context_a]
        out_b = h.layers[second].impl.forward_paged(context_b)
        assert fallbacks == [context_a]
        again = h.layers[second].impl.forward_paged(context_b)  # taken once
        assert fallbacks == [context_a, context_b]
        assert torch.equal(out_a, out_b) and torch.equal(out_b, again)
        cache = h.layers[first].kv_cache
        context_a = h.adapter.prepare_layer_context(first, q, k, v)
        h.layers[first].kv_cache = cache.clone()  # rebound: the described cache is stale
        assert torch.equal(h.layers[first].impl.forward_paged(context_a), out_a)
        assert fallbacks[-1] is context_a


def test_forward_paged_fallback_reads_the_context(device):
    # run_forward_paged describes a context from its attributes: a missing one raises what
    # Python raises for it, a bad tensor the binding's error, and nothing is written either way.
    h = Harness(device, torch.float32, 4, non_causal=False, seq_lens=(8,))
    rows = h.rows([(0, 8)])
    name = LAYERS[0]
    layer = h.layers[name]
    with h.adapter.activate(h.adapter.prepare_batch(rows)):
        q, k, v, _ = h.make_inputs(rows, "packed_heads")
        context = h.adapter.prepare_layer_context(name, q, k, v)
        before = h.caches[name].clone()
        names = ("native_metadata", "piecewise_plan", "query", "key_write", "value_write", "slot_mapping")
        fields = {f: getattr(context, f) for f in (*names, "query_token_shape", "output_scatter_indices")}
        for missing in names:
            partial = SimpleNamespace(layer=layer, **{f: val for f, val in fields.items() if f != missing})
            with pytest.raises(AttributeError, match=missing):
                layer.impl.forward_paged(partial)
        assert torch.equal(h.caches[name], before)
        bad = SimpleNamespace(**fields, layer=layer, restore_output=context.restore_output)
        bad.query = q[:, :1]
        message = (
            "forward_paged(): kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, 64] "
            "with num_heads (1) divisible by num_kv_heads, got [2, 6, 4, 2, 64]"
        )
        with pytest.raises(ValueError) as raised:
            layer.impl.forward_paged(bad)
        assert str(raised.value) == message
        assert torch.equal(h.caches[name], before)
        out = layer.impl.forward_paged(context)
        assert out.shape == (8, NUM_HEADS, HEAD_SIZE)
        assert not torch.equal(h.caches[name], before)

        # a context class of its own keeps its restore_output
        class Restoring(diffkv.DiffusionPagedAttentionContext):
            def restore_output(self, output):
                return ("restored", output)

        sub = Restoring(**{f.name: getattr(context, f.name) for f in dataclasses.fields(context)})
        tag, out_sub = layer.impl.forward_paged(sub)
        assert tag == "restored" and torch.equal(out_sub, out)
