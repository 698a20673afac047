"""The adapter driven entirely by hand-written collaborators (SimpleNamespace configs, a fake
BlockTables whose slot equals the position, a recording platform): it must read only the
attributes vLLM-Omni's adapter reads and call its collaborators through the module attributes."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import diffkv
from diffkv import adapter as adapter_mod

H, HKV, D = 2, 1, 8


class FakeBlockTables:
    """Two cache groups; slot == position; records every call."""

    def __init__(self, device, *, max_num_reqs=4, max_num_batched_tokens=32, cp_size=1):
        self.device = torch.device(device)
        self.block_sizes = [4, 4]
        self.blocks_per_kv_block = [1, 1]
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cp_size = cp_size
        self.cp_rank = 0
        self.cp_interleave = 1
        self.num_blocks = SimpleNamespace(np=np.full((2, max_num_reqs), 8, dtype=np.int64))
        self.calls = []

    def gather_block_tables(self, row_indices, num_reqs_padded):
        self.calls.append(("gather_block_tables", row_indices.tolist(), num_reqs_padded))
        base = torch.arange(8, dtype=torch.int32, device=self.device)
        return [base.repeat(num_reqs_padded, 1), (base + 100).repeat(num_reqs_padded, 1)]

    def compute_slot_mappings(self, row_indices, query_start_loc, positions, num_tokens_padded):
        self.calls.append(
            ("compute_slot_mappings", row_indices.tolist(), query_start_loc.tolist(), num_tokens_padded)
        )
        return torch.stack([positions, positions])[:, :num_tokens_padded]


class FakePlatform:
    def __init__(self):
        self.builds = []

    def build_diffusion_kv_attn_metadata(self, **kwargs):
        self.builds.append(kwargs)
        groups = kwargs["kv_cache_config"].kv_cache_groups
        return {
            name: SimpleNamespace(group=g, causal=kwargs["causal"], build=len(self.builds))
            for g, group in enumerate(groups)
            for name in group.layer_names
        }

    def requires_diffusion_paged_kv_prewrite(self):
        return False

    def get_diffusion_paged_kv_attn_backend(self, backend, *, ulysses_degree):
        return backend


def _layer(non_causal):
    # impl: a layer adapter always has one; vLLM-Omni 0.30's piecewise path reads its FA version
    return SimpleNamespace(
        spec=SimpleNamespace(non_causal=non_causal),
        num_heads=H,
        num_kv_heads=HKV,
        head_size=D,
        head_size_v=D,
        impl=None,
    )


@pytest.fixture
def foreign(device, monkeypatch):
    platform = FakePlatform()
    events = []

    @contextmanager
    def fake_set_current_vllm_config(config):
        events.append(("config", config))
        yield
        events.append(("config exit", config))

    @contextmanager
    def fake_override(adapter):
        events.append(("adapter", adapter))
        yield
        events.append(("adapter exit", adapter))

    monkeypatch.setattr(adapter_mod, "current_omni_platform", platform)
    monkeypatch.setattr(adapter_mod, "set_current_vllm_config", fake_set_current_vllm_config)
    monkeypatch.setattr(adapter_mod, "override_paged_kv_adapter", fake_override)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=4),
    )
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=["a", "b"]), SimpleNamespace(layer_names=["c"])]
    )
    builder = SimpleNamespace(reorder_batch_threshold=None)
    attn_groups = [[SimpleNamespace(get_metadata_builder=lambda i: builder)] for _ in range(2)]
    bindings = {
        ("r", 0, None): diffkv.DiffusionPagedAttentionRowBinding(row_index=3, max_seq_len=20),
        ("r", 1, None): diffkv.DiffusionPagedAttentionRowBinding(row_index=1, max_seq_len=20),
    }
    block_tables = FakeBlockTables(device)
    adapter = diffkv.DiffusionPagedAttentionAdapter(
        vllm_config=vllm_config,
        device=device,
        kv_cache_config=kv_cache_config,
        block_tables=block_tables,
        attn_groups=attn_groups,
        layers={"a": _layer(False), "b": _layer(False), "c": _layer(True)},
        resolve_row=lambda request_id, sequence_id, context_id: bindings[
            (request_id, sequence_id, context_id)
        ],
    )
    return SimpleNamespace(
        adapter=adapter,
        platform=platform,
        events=events,
        block_tables=block_tables,
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        attn_groups=attn_groups,
        device=device,
    )


def _rows():
    return [
        diffkv.DiffusionPagedAttentionRow("r", 3, 7, kv_start_pos=4, sequence_id=0),
        diffkv.DiffusionPagedAttentionRow("r", 5, 5, sequence_id=1),
    ]


def test_prepared_batch_with_fakes(foreign):
    batch = foreign.adapter.prepare_batch(_rows())
    positions = [4, 5, 6, 0, 1, 2, 3, 4]
    assert batch.row_indices.tolist() == [3, 1]
    assert batch.query_start_loc.tolist() == [0, 3, 8]
    assert batch.seq_lens.tolist() == [7, 5]
    assert batch.positions.tolist() == positions
    assert batch.num_tokens == 8
    for tensor in (batch.row_indices, batch.query_start_loc, batch.seq_lens, batch.positions):
        assert tensor.device.type == foreign.device.type
    assert batch.slot_mappings.tolist() == [positions, positions]
    assert foreign.block_tables.calls == [
        ("gather_block_tables", [3, 1], 2),
        ("compute_slot_mappings", [3, 1], [0, 3, 8], 8),
    ]
    assert isinstance(batch.block_tables, tuple) and len(batch.block_tables) == 2
    assert batch.block_tables[1][0, 0].item() == 100
    assert {name: m.tolist() for name, m in batch.slot_mappings_by_layer.items()} == {
        "a": positions,
        "b": positions,
        "c": positions,
    }
    (build,) = foreign.platform.builds
    assert build["causal"] == {0: True, 1: False}
    assert build["dcp_local_seq_lens"] is None
    assert build["attn_groups"] is foreign.attn_groups
    assert (build["num_reqs"], build["num_tokens"], build["max_query_len"], build["max_seq_len"]) == (
        2,
        8,
        5,
        7,
    )
    assert batch.attn_metadata["a"].group == batch.attn_metadata["b"].group == 0
    assert batch.attn_metadata["c"].group == 1
    assert foreign.events == [("config", foreign.vllm_config), ("config exit", foreign.vllm_config)]


def test_layer_context_with_fakes(foreign):
    batch = foreign.adapter.prepare_batch(_rows())
    foreign.events.clear()
    q = torch.randn(8, H * D, device=foreign.device)
    kv = torch.randn(8, HKV * D, device=foreign.device)
    with foreign.adapter.activate(batch):
        assert foreign.events == [("adapter", foreign.adapter), ("config", foreign.vllm_config)]
        context = foreign.adapter.prepare_layer_context("c", q, kv, kv)
        causal_context = foreign.adapter.prepare_layer_context("a", q, kv, kv)
    assert foreign.events[-2:] == [("config exit", foreign.vllm_config), ("adapter exit", foreign.adapter)]
    assert context.slot_mapping.tolist() == batch.positions.tolist()
    assert context.native_metadata is batch.attn_metadata["c"]
    assert causal_context.native_metadata is batch.attn_metadata[
        "a"
    ] and causal_context.native_metadata.causal == {
        0: True,
        1: False,
    }
    assert context.query.shape == (8, H, D)
    assert context.restore_output(torch.ones(8, H, D, device=foreign.device)).shape == (8, H * D)


def test_piecewise_with_fakes(foreign, monkeypatch):
    calls = []
    planner = adapter_mod.build_paged_piecewise_plan

    def recording_planner(spans, **kwargs):
        calls.append(kwargs)
        return planner(spans, **kwargs)

    monkeypatch.setattr(adapter_mod, "build_paged_piecewise_plan", recording_planner)
    rows = [diffkv.DiffusionPagedAttentionRow("r", 3, 7, kv_start_pos=4, sequence_id=0)]
    batch = foreign.adapter.prepare_batch(rows)
    q = torch.randn(3, H, D, device=foreign.device)
    kv = torch.randn(3, HKV, D, device=foreign.device)
    spans = SimpleNamespace(full_attn_spans=[[(5, 7)]])
    with foreign.adapter.activate(batch):
        context = foreign.adapter.prepare_layer_context("a", q, kv, kv, omni_attn_metadata=spans)
        again = foreign.adapter.prepare_layer_context("c", q, kv, kv, omni_attn_metadata=spans)
    assert calls == [
        {"query_offsets": [4], "query_lens": [3], "seq_lens": [7], "device": foreign.adapter.device}
    ]
    assert again.piecewise_plan is context.piecewise_plan
    builds = foreign.platform.builds[1:]
    assert [b["causal"] for b in builds] == [True, False]
    assert [b["positions"].tolist() for b in builds] == [[4], [5, 6]]
    assert [b["slot_mappings"].tolist() for b in builds] == [[[4], [4]], [[5, 6], [5, 6]]]
    assert [m.build for m in context.piecewise_native_metadata] == [2, 3]
    assert context.piecewise_plan.key_limits.tolist() == [5, 7, 7]


def test_context_parallel_with_fakes(device, monkeypatch, foreign):
    seen = []

    def fake_dcp(seq_lens, **kwargs):
        seen.append((seq_lens.tolist(), kwargs))
        return seq_lens // 2

    monkeypatch.setattr(adapter_mod, "get_dcp_local_seq_lens", fake_dcp)
    foreign.block_tables.cp_size = 2
    foreign.block_tables.cp_rank = 1
    foreign.block_tables.cp_interleave = 4
    foreign.adapter.prepare_batch(_rows())
    assert seen == [([7, 5], {"dcp_size": 2, "dcp_rank": 1, "cp_kv_cache_interleave_size": 4})]
    assert foreign.platform.builds[-1]["dcp_local_seq_lens"].tolist() == [3, 2]


def test_validation_reads_the_fake_block_counts(foreign):
    foreign.block_tables.num_blocks.np[1, 1] = 1
    with pytest.raises(ValueError) as excinfo:
        foreign.adapter.prepare_batch(_rows())
    assert str(excinfo.value) == (
        "Paged attention row ('r', 1, None) requires 2 blocks in cache group 1 for seq_len=5, "
        "but its installed Worker row contains only 1 blocks"
    )
    assert foreign.block_tables.calls == []


@dataclasses.dataclass(frozen=True)
class ForeignSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    non_causal: bool = False


class ForeignImpl:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def forward(self, *args):
        return None

    def do_kv_cache_update(self, *args):
        return None


class ForeignBackend:
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name():
        return "FOREIGN"

    @staticmethod
    def get_impl_cls():
        return ForeignImpl


def test_layer_adapter_with_foreign_config_and_backend(monkeypatch):
    attention_config = SimpleNamespace(backend="user-choice", backend_per_kind={"decoder": "x"})
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        attention_config=attention_config,
    )
    selections = []

    def fake_get_attn_backend(**kwargs):
        selections.append((kwargs, attention_config.backend, dict(attention_config.backend_per_kind)))
        return ForeignBackend

    monkeypatch.setattr(adapter_mod, "get_attn_backend", fake_get_attn_backend)
    spec = ForeignSpec(block_size=16, num_kv_heads=4, head_size=96)
    layer = diffkv.DiffusionPagedAttentionLayerAdapter(
        layer_name="blocks.0.attn",
        layer=SimpleNamespace(num_heads=8, softmax_scale=0.5),
        spec=spec,
        vllm_config=vllm_config,
        device="cpu",
        ulysses_degree=2,
    )
    ((kwargs, backend_during, per_kind_during),) = selections
    assert kwargs == {
        "head_size": 96,
        "dtype": torch.bfloat16,
        "kv_cache_dtype": "auto",
        "attn_type": "decoder",
        "num_heads": 4,
    }
    assert backend_during is adapter_mod.AttentionBackendEnum.FLASH_ATTN and per_kind_during == {}
    assert attention_config.backend == "user-choice" and attention_config.backend_per_kind == {"decoder": "x"}
    assert layer.spec == ForeignSpec(block_size=16, num_kv_heads=2, head_size=96)
    assert layer.head_size == layer.head_size_v == 96
    assert layer.impl.kwargs["num_kv_heads"] == 2 and layer.impl.kwargs["scale"] == 0.5
    assert layer.attn_backend is ForeignBackend


def test_layer_adapter_without_attention_config():
    # diffkv.DiffusionConfig has no attention_config: selection goes straight to get_attn_backend.
    config = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.float16),
        cache_config=SimpleNamespace(cache_dtype="float16", block_size=16),
    )
    layer = diffkv.DiffusionPagedAttentionLayerAdapter(
        layer_name="l",
        layer=SimpleNamespace(num_heads=4, softmax_scale=0.1),
        spec=diffkv.AttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=torch.float16),
        vllm_config=config,
        device="cpu",
    )
    assert layer.attn_backend is diffkv.DiffKVAttentionBackend
    assert isinstance(layer.impl, diffkv.DiffKVAttentionImpl)
