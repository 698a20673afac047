"""The runtime (prefill -> denoise switching, reuse of one batch per phase, close, what its
refusals -- cases of error_cases.py -- leave behind) and the per-layer context: packing of
[N, ...] and right-padded [B, T, ...] inputs, K/V stride rules, restore_output, device
normalisation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import diffkv
from _helpers import HEAD_SIZE, make_adapter, row
from diffkv import platform as platform_mod
from error_cases import check, public_case, runtime_request

D = HEAD_SIZE


# --- runtime ------------------------------------------------------------------------------------------


def _counting(h):
    """The batches ``h.adapter.prepare_batch`` makes from now on."""
    prepared = []
    original = h.adapter.prepare_batch

    def counting_prepare_batch(rows):
        batch = original(rows)
        prepared.append(batch)
        return batch

    h.adapter.prepare_batch = counting_prepare_batch
    return prepared


def _request(device):
    """error_cases.runtime_request (two CFG rows: prefill 9 tokens, denoise 6), counting batches."""
    h, metadata = runtime_request(device)
    return h, metadata, _counting(h)


def test_runtime_switches_phase_once_and_reuses_batches(device):
    h, metadata, prepared = _request(device)
    runtime = diffkv.DiffusionPagedAttentionRuntime(h.adapter, metadata)
    assert h.adapter._active_batch is None  # nothing happens before the first step

    assert runtime.ensure_active(0) is h.adapter
    assert len(prepared) == 1 and prepared[0].rows == metadata.prefill_rows
    assert h.adapter._active_batch is prepared[0]
    assert platform_mod.current_paged_kv_adapter() is h.adapter
    assert runtime.ensure_active(0) is h.adapter
    assert len(prepared) == 1

    runtime.ensure_active(1)
    assert len(prepared) == 2 and prepared[1].rows == metadata.denoise_rows
    denoise_batch = h.adapter._active_batch
    assert denoise_batch is prepared[1]
    assert denoise_batch.positions.tolist() == [3, 4, 5, 6, 7, 8] * 2
    for step in range(2, 8):
        assert runtime.ensure_active(step) is h.adapter
        assert h.adapter._active_batch is denoise_batch
        q = torch.randn(12, 2, D, device=device)
        k = torch.randn(12, 1, D, device=device)
        context = h.adapter.prepare_layer_context("layer0", q, k, k)
        assert context.native_metadata is denoise_batch.attn_metadata["layer0"]
    assert len(prepared) == 2

    runtime.close()
    assert h.adapter._active_batch is None
    assert platform_mod.current_paged_kv_adapter() is None
    assert platform_mod.get_current_vllm_config() is None
    runtime.close()  # idempotent
    assert runtime._closed  # ensure_active refuses it: the "runtime closed" case of error_cases.py


def test_runtime_can_return_to_prefill(device):
    h, metadata, prepared = _request(device)
    runtime = diffkv.DiffusionPagedAttentionRuntime(h.adapter, metadata)
    runtime.ensure_active(0)
    runtime.ensure_active(1)
    runtime.ensure_active(0)
    assert [b.rows for b in prepared] == [metadata.prefill_rows, metadata.denoise_rows, metadata.prefill_rows]
    assert h.adapter._active_batch is prepared[2]
    runtime.close()


@pytest.mark.parametrize("step", [None, -1, True])
def test_runtime_step_index_errors_leave_the_phase(device, step):
    """The table's case refuses ``step`` in a runtime's prefill phase: the prefill batch stays
    active and nothing new is prepared."""
    case = public_case(f"runtime step index {step!r}", device)
    h = case.env
    prepared = _counting(h)
    h.kept_phase = None
    check(case)
    assert h.kept_phase is True and len(prepared) == 1
    assert h.adapter._active_batch is None  # the case closes its runtime


def test_runtime_activate_context_closes(device):
    h, metadata, _ = _request(device)
    runtime = diffkv.DiffusionPagedAttentionRuntime(h.adapter, metadata)
    with pytest.raises(KeyError):
        with runtime.activate() as active:
            assert active is runtime
            runtime.ensure_active(0)
            raise KeyError("model failed")
    assert runtime._closed and h.adapter._active_batch is None  # refused after: "runtime closed"


def test_runtime_prepare_failure_leaves_nothing_active(device):
    """The resolver's KeyError for a denoise row (the table's case) propagates and leaves no
    batch, phase or activation behind."""
    case = public_case("runtime denoise rows unresolvable", device)
    case.env.left_nothing_active = None
    check(case)
    assert case.env.left_nothing_active is True


# --- layer context --------------------------------------------------------------------------------------


@pytest.fixture
def gqa(device):
    """4 query heads, 2 KV heads; one row of 5 tokens at positions [3, 8) of 8."""
    h = make_adapter(device, num_heads=4, num_kv_heads=2, bindings={("req", 0, None): (0, 8)})
    batch = h.adapter.prepare_batch([row(query_len=5, seq_len=8, kv_start_pos=3)])
    with h.adapter.activate(batch):
        h.batch = batch
        yield h


def test_packed_hidden_layout(gqa):
    device = gqa.device
    q = torch.randn(5, 4 * D, device=device)
    k = torch.randn(5, 2 * D, device=device)
    v = torch.randn(5, 2 * D, device=device)
    context = gqa.adapter.prepare_layer_context("layer0", q, k, v)
    assert isinstance(context, diffkv.DiffusionPagedAttentionContext)
    assert context.layer is gqa.layers["layer0"]
    assert context.query.shape == (5, 4, D) and context.query.is_contiguous()
    assert torch.equal(context.query, q.reshape(5, 4, D))
    assert context.key_write.shape == (5, 2, D) and context.value_write.shape == (5, 2, D)
    assert context.query_token_shape == (5,) and context.query_has_head_dims is False
    assert context.output_scatter_indices is None
    assert context.piecewise_plan is None and context.piecewise_native_metadata == ()
    assert context.native_metadata is gqa.batch.attn_metadata["layer0"]
    assert context.slot_mapping.tolist() == gqa.batch.slot_mappings[0].tolist()
    out = torch.randn(5, 4, D, device=device)
    restored = context.restore_output(out)
    assert restored.shape == (5, 4 * D) and torch.equal(restored, out.reshape(5, 4 * D))


def test_strided_projection_views_are_kept(gqa):
    device = gqa.device
    qkv = torch.randn(5, (4 + 2 + 2) * D, device=device)
    q = qkv[:, : 4 * D].view(5, 4, D)
    k = qkv[:, 4 * D : 6 * D].view(5, 2, D)
    v = qkv[:, 6 * D :].view(5, 2, D)
    context = gqa.adapter.prepare_layer_context("layer0", q, k, v)
    assert context.key_write.data_ptr() == k.data_ptr() and context.key_write.stride() == (8 * D, D, 1)
    assert context.value_write.data_ptr() == v.data_ptr()
    # diffkv's kernel reads the caller's view, strides and all: the context keeps it, and
    # diffkv's forward_paged makes no copy of it (a read of context.query would have stored one).
    assert context._caller_query.data_ptr() == q.data_ptr() and context._caller_query.stride() == (
        8 * D,
        D,
        1,
    )
    out = gqa.layers["layer0"].impl.forward_paged(context)
    assert context._caller_query.data_ptr() == q.data_ptr()
    # context.query is vLLM-Omni 0.30's: a contiguous copy, made on the first read, then kept
    query = context.query
    assert query.is_contiguous() and query.data_ptr() != q.data_ptr() and torch.equal(query, q)
    assert context.query is query and context._caller_query is query
    reference = gqa.layers["layer0"].impl.forward_paged(
        gqa.adapter.prepare_layer_context("layer0", q.contiguous(), k.contiguous(), v.contiguous())
    )
    assert torch.equal(out, reference)
    assert context.query_has_head_dims is True
    assert context.restore_output(context.query).shape == (5, 4, D)


def test_homogeneous_piecewise_plan_keeps_the_callers_query(device):
    """vLLM-Omni 0.30 hands a homogeneous piecewise plan's runner the caller's query view
    (it packs each segment itself); any other plan gets a contiguous query."""
    bindings = {("req", 0, None): (0, 8), ("req", 1, None): (1, 8)}
    h = make_adapter(device, num_heads=4, num_kv_heads=2, bindings=bindings)
    rows = [row(query_len=4, seq_len=8, kv_start_pos=4, sequence_id=i) for i in range(2)]
    batch = h.adapter.prepare_batch(rows)
    qkv = torch.randn(8, 8 * D, device=device)
    q = qkv[:, : 4 * D].view(8, 4, D)
    k = qkv[:, 4 * D : 6 * D].view(8, 2, D)
    v = qkv[:, 6 * D :].view(8, 2, D)
    with h.adapter.activate(batch):
        spans = SimpleNamespace(full_attn_spans=[[(6, 8)], [(6, 8)]])
        context = h.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=spans)
        assert context.piecewise_plan.homogeneous_batch_shape == (2, 4)
        assert context.query.data_ptr() == q.data_ptr() and context.query.stride() == (8 * D, D, 1)
    with h.adapter.activate(batch):  # one plan per activation
        uneven = SimpleNamespace(full_attn_spans=[[(6, 8)], [(5, 8)]])
        context = h.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=uneven)
    assert context.piecewise_plan.homogeneous_batch_shape is None
    assert context.query.is_contiguous() and torch.equal(context.query, q)


def test_unusual_inner_layouts_are_materialised(gqa):
    device = gqa.device
    q = torch.randn(5, 4, D, device=device)
    k = torch.randn(5, D, 2, device=device).transpose(1, 2)  # dim stride 2
    v = torch.randn(5, 2, 2 * D, device=device)[..., :D]  # head stride 2 * D
    context = gqa.adapter.prepare_layer_context("layer0", q, k, v)
    for src, written in ((k, context.key_write), (v, context.value_write)):
        assert written.is_contiguous() and written.data_ptr() != src.data_ptr()
        assert torch.equal(written, src)


def test_single_kv_head_skips_the_head_stride_rule(device):
    h = make_adapter(device, num_heads=2, num_kv_heads=1, bindings={("req", 0, None): (0, 8)})
    batch = h.adapter.prepare_batch([row(query_len=4, seq_len=4)])
    k = torch.randn(4, 1, 3 * D, device=device)[..., D : 2 * D]
    with h.adapter.activate(batch):
        context = h.adapter.prepare_layer_context("layer0", torch.randn(4, 2, D, device=device), k, k)
    assert context.key_write.data_ptr() == k.data_ptr()


def _two_rows(device, query_lens, seq_lens=None):
    seq_lens = seq_lens or query_lens
    bindings = {("req", s, None): (s, 16) for s in range(len(query_lens))}
    h = make_adapter(device, groups=(("layer0", "layer1"),), bindings=bindings)
    rows = [
        row(query_len=q, seq_len=s, kv_start_pos=s - q, sequence_id=i)
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
    ]
    return h, h.adapter.prepare_batch(rows)


def test_uniform_batched_layout(device):
    h, batch = _two_rows(device, [4, 4])
    q = torch.randn(2, 4, 2, D, device=device)
    k = torch.randn(2, 4, 1, D, device=device)
    with h.adapter.activate(batch):
        context = h.adapter.prepare_layer_context("layer0", q, k, k)
    assert context.output_scatter_indices is None
    assert context.query_token_shape == (2, 4) and context.query_has_head_dims
    assert torch.equal(context.query, q.reshape(8, 2, D))
    assert context.restore_output(context.query).shape == (2, 4, 2, D)


@pytest.mark.parametrize("head_dims", [True, False])
def test_right_padded_batched_layout(device, head_dims):
    h, batch = _two_rows(device, [3, 2], [5, 2])
    shape_q = (2, 4, 2, D) if head_dims else (2, 4, 2 * D)
    shape_kv = (2, 4, 1, D) if head_dims else (2, 4, D)
    q = torch.randn(*shape_q, device=device)
    k = torch.randn(*shape_kv, device=device)
    v = torch.randn(*shape_kv, device=device)
    with h.adapter.activate(batch):
        context = h.adapter.prepare_layer_context("layer0", q, k, v)
        other = h.adapter.prepare_layer_context("layer1", q, k, v)
    index = [0, 1, 2, 4, 5]
    assert context.output_scatter_indices.dtype == torch.int64
    assert context.output_scatter_indices.tolist() == index
    assert other.output_scatter_indices is context.output_scatter_indices  # built once per activation
    assert torch.equal(context.query, q.reshape(8, 2, D)[index])
    assert torch.equal(context.key_write, k.reshape(8, 1, D)[index])
    assert torch.equal(context.value_write, v.reshape(8, 1, D)[index])
    assert context.query_token_shape == (2, 4) and context.query_has_head_dims is head_dims

    out = torch.randn(5, 2, D, device=device)
    restored = context.restore_output(out)
    assert restored.shape == shape_q
    flat = restored.reshape(8, 2, D)
    assert torch.equal(flat[index], out)
    assert torch.count_nonzero(flat[[3, 6, 7]]) == 0


def test_restore_output_accepts_flat_outputs(device):
    h, batch = _two_rows(device, [1, 2], [1, 2])
    q = torch.randn(2, 2, 2 * D, device=device)
    k = torch.randn(2, 2, D, device=device)
    with h.adapter.activate(batch):
        context = h.adapter.prepare_layer_context("layer0", q, k, k)
    out = torch.arange(3 * 2 * D, dtype=torch.float32, device=device).reshape(3, 2 * D)
    restored = context.restore_output(out)
    assert restored.shape == (2, 2, 2 * D)
    assert torch.equal(restored[0, 0], out[0]) and torch.count_nonzero(restored[0, 1]) == 0
    assert torch.equal(restored[1], out[1:])


def test_context_is_frozen_with_slots(gqa):
    q = torch.randn(5, 4, D, device=gqa.device)
    k = torch.randn(5, 2, D, device=gqa.device)
    context = gqa.adapter.prepare_layer_context("layer0", q, k, k)
    with pytest.raises(AttributeError):
        context.query = q
    assert not hasattr(context, "__dict__")


@pytest.mark.gpu
def test_cuda_devices_are_normalised():
    index = torch.cuda.current_device()
    for adapter_device, tensor_device in (("cuda", f"cuda:{index}"), (f"cuda:{index}", "cuda")):
        h = make_adapter(adapter_device)
        batch = h.adapter.prepare_batch([row()])
        q = torch.randn(4, 2, D, device=tensor_device)
        k = torch.randn(4, 1, D, device=tensor_device)
        with h.adapter.activate(batch):
            context = h.adapter.prepare_layer_context("layer0", q, k, k)
        assert context.query.device.type == "cuda"
        assert str(h.adapter.device) == adapter_device
