"""Piecewise plans: the planner (segments, packed indices, ranges, homogeneity, key limits; its
errors are the "build_paged_piecewise_plan" cases of error_cases.py) and the adapter's
per-activation plan and per-segment native metadata."""

from __future__ import annotations

import dataclasses

import torch

import diffkv
from _helpers import make_adapter, row
from diffkv import adapter as adapter_mod
from diffkv import platform as platform_mod
from diffkv.piecewise import PagedPiecewisePlan, PagedPiecewiseSegment, Segment, build_paged_piecewise_plan


def _key_limits(position, spans):
    for start, end in spans:
        if start <= position < end:
            return end
    return position + 1


# --- dataclass shapes ---------------------------------------------------------------------------------


def test_plan_types():
    assert Segment._fields == ("q_start", "q_end", "kv_end", "mode")
    for cls in (PagedPiecewiseSegment, PagedPiecewisePlan):
        assert cls.__dataclass_params__.frozen
        assert hasattr(cls, "__slots__")
    assert [(f.name, f.default) for f in dataclasses.fields(PagedPiecewiseSegment)][-1] == (
        "local_query_range",
        None,
    )
    names = [f.name for f in dataclasses.fields(PagedPiecewisePlan)]
    assert names == [
        "spans",
        "segments",
        "num_query_tokens",
        "segments_cover_query_contiguously",
        "homogeneous_batch_shape",
        "key_limits",
        "all_keys_visible",
    ]
    assert diffkv.PagedPiecewisePlan is PagedPiecewisePlan
    assert diffkv.build_paged_piecewise_plan is build_paged_piecewise_plan


# --- planner --------------------------------------------------------------------------------------------


def test_hunyuan_worked_example(device):
    # A worked example: two rows, kv_start_pos 3, query_len 6, seq_len 9, span (5, 8).
    plan = build_paged_piecewise_plan([[(5, 8)], [(5, 8)]], [3, 3], [6, 6], [9, 9], device=device)
    assert plan.spans == (((5, 8),), ((5, 8),))
    assert plan.num_query_tokens == 12
    assert [segment.row_segments for segment in plan.segments] == [
        (Segment(3, 5, 5, "causal"),) * 2,
        (Segment(5, 8, 8, "full"),) * 2,
        (Segment(8, 9, 9, "causal"),) * 2,
    ]
    assert all(isinstance(s, Segment) for segment in plan.segments for s in segment.row_segments)
    indices = [segment.query_indices for segment in plan.segments]
    assert [t.tolist() for t in indices] == [[0, 1, 6, 7], [2, 3, 4, 8, 9, 10], [5, 11]]
    assert all(t.dtype == torch.int64 and t.device.type == device.type for t in indices)
    assert [segment.query_range for segment in plan.segments] == [None, None, None]
    assert [segment.local_query_range for segment in plan.segments] == [(0, 2), (2, 5), (5, 6)]
    assert plan.segments_cover_query_contiguously is False
    assert plan.homogeneous_batch_shape == (2, 6)
    assert plan.key_limits.dtype == torch.int32 and plan.key_limits.device.type == device.type
    assert plan.key_limits.tolist() == [4, 5, 8, 8, 8, 9] * 2


def test_single_row_covers_query_contiguously():
    plan = build_paged_piecewise_plan([[(5, 8)]], [3], [6], [9])
    assert [segment.query_range for segment in plan.segments] == [(0, 2), (2, 5), (5, 6)]
    assert [segment.local_query_range for segment in plan.segments] == [(0, 2), (2, 5), (5, 6)]
    assert plan.segments_cover_query_contiguously is True
    assert plan.homogeneous_batch_shape is None
    assert plan.key_limits.device.type == "cpu"


def test_empty_spans_give_one_causal_segment():
    plan = build_paged_piecewise_plan([[], []], [0, 2], [4, 3], [4, 5])
    assert len(plan.segments) == 1
    (segment,) = plan.segments
    assert segment.row_segments == (Segment(0, 4, 4, "causal"), Segment(2, 5, 5, "causal"))
    assert segment.query_range == (0, 7)
    assert segment.local_query_range is None
    assert plan.segments_cover_query_contiguously is True
    assert plan.homogeneous_batch_shape is None
    assert plan.key_limits.tolist() == [1, 2, 3, 4, 3, 4, 5]


def test_spans_before_the_query_are_skipped_and_clipped_spans_keep_their_end():
    # Denoise: the query is [5, 9); span (0, 2) lies in the cached prefix; (2, 8) is clipped to [5, 8).
    plan = build_paged_piecewise_plan([[(0, 2), (2, 8)]], [5], [4], [9])
    assert [segment.row_segments for segment in plan.segments] == [
        (Segment(5, 8, 8, "full"),),
        (Segment(8, 9, 9, "causal"),),
    ]
    assert plan.key_limits.tolist() == [8, 8, 8, 9]


def test_heterogeneous_rows():
    # Same segment count and modes, but different local ranges: packed, not homogeneous.
    plan = build_paged_piecewise_plan([[(5, 8)], [(7, 9)]], [3, 4], [6, 6], [9, 10])
    assert [segment.local_query_range for segment in plan.segments] == [None, None, (5, 6)]
    assert plan.homogeneous_batch_shape is None
    assert [segment.query_indices.tolist() for segment in plan.segments] == [
        [0, 1, 6, 7, 8],
        [2, 3, 4, 9, 10],
        [5, 11],
    ]
    assert plan.key_limits.tolist() == [_key_limits(p, [(5, 8)]) for p in range(3, 9)] + [
        _key_limits(p, [(7, 9)]) for p in range(4, 10)
    ]


def test_unequal_query_lens_are_not_homogeneous():
    plan = build_paged_piecewise_plan([[], []], [0, 0], [4, 3], [4, 3])
    assert plan.homogeneous_batch_shape is None


def test_spans_may_be_lists_and_any_sequences():
    plan = build_paged_piecewise_plan([[[1, 3]], ([4, 6],)], (0, 0), (8, 8), (8, 8))
    assert plan.spans == (((1, 3),), ((4, 6),))


def test_planner_accepts_touching_spans():
    plan = build_paged_piecewise_plan([[(1, 3), (3, 5)]], [0], [9], [9])
    assert [s.row_segments[0].mode for s in plan.segments] == ["causal", "full", "full", "causal"]


# --- adapter: per-activation plan and per-segment native metadata ----------------------------------


class CountingPlatform(platform_mod.DiffKVPlatform):
    def __init__(self):
        self.calls = []

    def build_diffusion_kv_attn_metadata(self, **kwargs):
        self.calls.append(kwargs)
        return super().build_diffusion_kv_attn_metadata(**kwargs)


def _hunyuan(device, monkeypatch, *, groups=(("layer0", "layer1"),)):
    platform = CountingPlatform()
    monkeypatch.setattr(adapter_mod, "current_omni_platform", platform)
    bindings = {("req", 0, None): (0, 12), ("req", 1, None): (1, 12)}
    h = make_adapter(device, groups=groups, bindings=bindings, block_ids={0: [[2, 0, 5]], 1: [[1, 4, 3]]})
    rows = [row(query_len=6, seq_len=9, kv_start_pos=3, sequence_id=s) for s in (0, 1)]
    return h, h.adapter.prepare_batch(rows), platform


def _qkv(n, device):
    return (
        torch.randn(n, 2, 64, device=device),
        torch.randn(n, 1, 64, device=device),
        torch.randn(n, 1, 64, device=device),
    )


def test_adapter_hunyuan_segments(device, monkeypatch):
    h, batch, platform = _hunyuan(device, monkeypatch)
    spans = diffkv.AttentionMetadata(full_attn_spans=[[(5, 8)], [(5, 8)]])
    q, k, v = _qkv(12, device)
    with h.adapter.activate(batch):
        context0 = h.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=spans)
        builds_after_first = len(platform.calls)
        context1 = h.adapter.prepare_layer_context("layer1", q, k, v, omni_attn_metadata=spans)
        assert len(platform.calls) == builds_after_first == 1 + 3  # batch + one per segment, once
        plan = context0.piecewise_plan
        assert context1.piecewise_plan is plan
        assert plan.homogeneous_batch_shape == (2, 6)
        assert len(context0.piecewise_native_metadata) == 3
        for m0, m1 in zip(
            context0.piecewise_native_metadata, context1.piecewise_native_metadata, strict=True
        ):
            assert m0 is m1  # one group: layers share each segment's metadata

    segment_calls = platform.calls[1:]
    assert [c["query_start_loc_cpu"].tolist() for c in segment_calls] == [[0, 2, 4], [0, 3, 6], [0, 1, 2]]
    assert [c["seq_lens_cpu"].tolist() for c in segment_calls] == [[5, 5], [8, 8], [9, 9]]
    assert [c["seq_lens"].tolist() for c in segment_calls] == [[5, 5], [8, 8], [9, 9]]
    assert [c["positions"].tolist() for c in segment_calls] == [[3, 4, 3, 4], [5, 6, 7, 5, 6, 7], [8, 8]]
    assert [c["causal"] for c in segment_calls] == [True, False, True]
    assert [
        (c["num_reqs"], c["num_tokens"], c["max_query_len"], c["max_seq_len"]) for c in segment_calls
    ] == [
        (2, 4, 2, 5),
        (2, 6, 3, 8),
        (2, 2, 1, 9),
    ]
    batch_slots = batch.slot_mappings
    for call, segment in zip(segment_calls, plan.segments, strict=True):
        assert call["block_tables"] is batch.block_tables
        assert call["slot_mappings"].tolist() == batch_slots[:, segment.query_indices].tolist()
        assert call["query_start_loc_gpu"].device.type == device.type
    metadata = context0.piecewise_native_metadata
    assert [m.causal for m in metadata] == [True, False, True]
    assert [m.seq_lens_cpu.tolist() for m in metadata] == [[5, 5], [8, 8], [9, 9]]
    # The layer's batch metadata stays the whole-batch one.
    assert context0.native_metadata is batch.attn_metadata["layer0"]


def test_adapter_plan_and_metadata_rebuilt_per_activation(device, monkeypatch):
    h, batch, platform = _hunyuan(device, monkeypatch)
    spans = diffkv.AttentionMetadata(full_attn_spans=[[(5, 8)], [(5, 8)]])
    q, k, v = _qkv(12, device)
    with h.adapter.activate(batch):
        first = h.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=spans)
    with h.adapter.activate(batch):
        second = h.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=spans)
    assert second.piecewise_plan is not first.piecewise_plan
    assert second.piecewise_native_metadata[0] is not first.piecewise_native_metadata[0]
    assert len(platform.calls) == 1 + 3 + 3


def test_adapter_calls_module_planner_with_seed_arguments(device, monkeypatch):
    calls = []

    def recording_planner(spans, **kwargs):
        calls.append((spans, kwargs))
        return build_paged_piecewise_plan(spans, **kwargs)

    monkeypatch.setattr(adapter_mod, "build_paged_piecewise_plan", recording_planner)
    h, batch, _ = _hunyuan(device, monkeypatch)
    spans = [[(5, 8)], [(5, 8)]]
    q, k, v = _qkv(12, device)
    with h.adapter.activate(batch):
        h.adapter.prepare_layer_context(
            "layer0", q, k, v, omni_attn_metadata=diffkv.AttentionMetadata(full_attn_spans=spans)
        )
        h.adapter.prepare_layer_context(
            "layer1", q, k, v, omni_attn_metadata=diffkv.AttentionMetadata(full_attn_spans=spans)
        )
    assert calls == [
        (
            spans,
            {"query_offsets": [3, 3], "query_lens": [6, 6], "seq_lens": [9, 9], "device": h.adapter.device},
        )
    ]


def test_adapter_single_row_segments_are_views(device, monkeypatch):
    platform = CountingPlatform()
    monkeypatch.setattr(adapter_mod, "current_omni_platform", platform)
    h = make_adapter(device, bindings={("req", 0, None): (0, 12)})
    batch = h.adapter.prepare_batch([row(query_len=6, seq_len=9, kv_start_pos=3)])
    q, k, v = _qkv(6, device)
    spans = diffkv.AttentionMetadata(full_attn_spans=[[(5, 8)]])
    with h.adapter.activate(batch):
        context = h.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=spans)
    assert context.piecewise_plan.segments_cover_query_contiguously is True
    element = batch.positions.element_size()
    for call, start in zip(platform.calls[1:], (0, 2, 5), strict=True):
        assert call["positions"].data_ptr() == batch.positions.data_ptr() + start * element
        assert call["slot_mappings"].data_ptr() == batch.slot_mappings.data_ptr() + start * element


def test_adapter_snapshots_scheduler_metadata(monkeypatch):
    shared = torch.zeros(3)

    class SchedulerPlatform(platform_mod.DiffKVPlatform):
        def build_diffusion_kv_attn_metadata(self, **kwargs):
            kv_cache_config = kwargs["kv_cache_config"]
            metadata = type("M", (), {})()
            metadata.scheduler_metadata = shared
            metadata.prefix_scheduler_metadata = None
            return {name: metadata for g in kv_cache_config.kv_cache_groups for name in g.layer_names}

    monkeypatch.setattr(adapter_mod, "current_omni_platform", SchedulerPlatform())
    h = make_adapter("cpu", groups=(("layer0", "layer1"),), bindings={("req", 0, None): (0, 12)})
    batch = h.adapter.prepare_batch([row(query_len=6, seq_len=9, kv_start_pos=3)])
    q, k, v = _qkv(6, "cpu")
    with h.adapter.activate(batch):
        context = h.adapter.prepare_layer_context(
            "layer0", q, k, v, omni_attn_metadata=diffkv.AttentionMetadata(full_attn_spans=[[(5, 8)]])
        )
    snapshots = [m.scheduler_metadata for m in context.piecewise_native_metadata]
    assert all(s is not shared for s in snapshots)
    assert len({id(s) for s in snapshots}) == 3
    assert batch.attn_metadata["layer0"].scheduler_metadata is shared
