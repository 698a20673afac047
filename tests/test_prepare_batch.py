"""prepare_batch contents over diffkv's native collaborators: row indices, offsets, positions,
gathered block tables, slot mappings (worked examples of vLLM's slot rule, kernel blocks, context
parallel), native metadata, and the generation/ownership protocol."""

from __future__ import annotations

import pytest
import torch

import diffkv
from _helpers import make_adapter, row
from diffkv import adapter as adapter_mod
from diffkv import platform as platform_mod

SEED_METADATA_KEYWORDS = {
    "attn_groups",
    "num_reqs",
    "num_tokens",
    "query_start_loc_gpu",
    "query_start_loc_cpu",
    "max_query_len",
    "seq_lens",
    "max_seq_len",
    "block_tables",
    "slot_mappings",
    "kv_cache_config",
    "seq_lens_cpu",
    "seq_lens_cpu_upper_bound",
    "dcp_local_seq_lens",
    "positions",
    "causal",
}


class RecordingPlatform(platform_mod.DiffKVPlatform):
    """The default platform, recording every metadata build and the config current during it."""

    def __init__(self):
        self.calls = []

    def build_diffusion_kv_attn_metadata(self, **kwargs):
        self.calls.append((kwargs, platform_mod.get_current_vllm_config()))
        return super().build_diffusion_kv_attn_metadata(**kwargs)


@pytest.fixture
def recording_platform(monkeypatch):
    platform = RecordingPlatform()
    monkeypatch.setattr(adapter_mod, "current_omni_platform", platform)
    return platform


def _slot(table, p, block_size):
    return table[p // block_size] * block_size + p % block_size


def test_two_rows_contents(device, recording_platform):
    bindings = {("req", 0, None): (2, 12), ("req", 1, None): (0, 12)}
    block_ids = {2: [[7, 3, 9]], 0: [[4, 0, 11]]}
    h = make_adapter(device, groups=(("a", "b"),), bindings=bindings, block_ids=block_ids, block_size=4)
    rows = [
        row(query_len=3, seq_len=10, kv_start_pos=7, sequence_id=0),
        row(query_len=5, seq_len=5, kv_start_pos=0, sequence_id=1),
    ]
    batch = h.adapter.prepare_batch(rows)

    assert batch.rows == tuple(rows)
    assert batch.num_tokens == 8
    expected = {
        "row_indices": ([2, 0], torch.int32),
        "query_start_loc": ([0, 3, 8], torch.int32),
        "seq_lens": ([10, 5], torch.int32),
        "positions": ([7, 8, 9, 0, 1, 2, 3, 4], torch.int64),
    }
    for name, (values, dtype) in expected.items():
        tensor = getattr(batch, name)
        assert tensor.dtype == dtype, name
        assert tensor.device.type == device.type, name
        assert tensor.tolist() == values, name

    assert isinstance(batch.block_tables, tuple) and len(batch.block_tables) == 1
    table = batch.block_tables[0]
    assert table.dtype == torch.int32 and table.shape[0] == 2
    assert table[0, :3].tolist() == [7, 3, 9] and table[1, :3].tolist() == [4, 0, 11]

    slots = [_slot([7, 3, 9], p, 4) for p in (7, 8, 9)] + [_slot([4, 0, 11], p, 4) for p in range(5)]
    assert batch.slot_mappings.dtype == torch.int64
    assert batch.slot_mappings.shape == (1, 8)
    assert batch.slot_mappings[0].tolist() == slots == [15, 36, 37, 16, 17, 18, 19, 0]

    assert set(batch.slot_mappings_by_layer) == {"a", "b"}
    for name in ("a", "b"):
        mapping = batch.slot_mappings_by_layer[name]
        assert mapping.tolist() == slots
        assert mapping.data_ptr() == batch.slot_mappings.data_ptr()  # a view, not a copy

    metadata_a, metadata_b = batch.attn_metadata["a"], batch.attn_metadata["b"]
    assert metadata_a is metadata_b
    assert isinstance(metadata_a, diffkv.PagedAttentionMetadata)
    assert metadata_a.causal is True
    assert (metadata_a.num_reqs, metadata_a.num_actual_tokens, metadata_a.max_query_len) == (2, 8, 5)
    assert metadata_a.max_seq_len == 10
    assert metadata_a.dcp_local_seq_lens is None

    ((kwargs, current),) = recording_platform.calls
    assert set(kwargs) == SEED_METADATA_KEYWORDS
    assert current is h.vllm_config
    assert kwargs["attn_groups"] is h.attn_groups
    assert kwargs["kv_cache_config"] is h.kv_cache_config
    assert (kwargs["num_reqs"], kwargs["num_tokens"], kwargs["max_query_len"], kwargs["max_seq_len"]) == (
        2,
        8,
        5,
        10,
    )
    assert kwargs["query_start_loc_gpu"] is batch.query_start_loc
    assert kwargs["query_start_loc_cpu"].device.type == "cpu"
    assert kwargs["query_start_loc_cpu"].tolist() == [0, 3, 8]
    assert kwargs["seq_lens"] is batch.seq_lens
    assert kwargs["seq_lens_cpu"].device.type == "cpu" and kwargs["seq_lens_cpu"].tolist() == [10, 5]
    assert kwargs["seq_lens_cpu_upper_bound"] is kwargs["seq_lens_cpu"]
    assert kwargs["positions"] is batch.positions
    assert kwargs["slot_mappings"] is batch.slot_mappings
    assert kwargs["dcp_local_seq_lens"] is None
    assert kwargs["causal"] is True
    assert platform_mod.get_current_vllm_config() is None


def test_worked_example_block_16(device):
    # vLLM's slot rule: block size 16, row blocks [3, 1]: 0..15 -> 48..63, 16 -> 16, 17, 18 -> 17, 18.
    h = make_adapter(device, block_size=16, bindings={("req", 0, None): (0, 19)}, block_ids={0: [[3, 1]]})
    batch = h.adapter.prepare_batch([row(query_len=19, seq_len=19)])
    assert batch.slot_mappings[0].tolist() == list(range(48, 64)) + [16, 17, 18]


def test_worked_example_block_4(device):
    # Native smoke test: block size 4, blocks [1, 2, 3], positions 0..8 -> slots 4..12.
    h = make_adapter(device, block_size=4, bindings={("req", 0, None): (0, 12)}, block_ids={0: [[1, 2, 3]]})
    batch = h.adapter.prepare_batch([row(query_len=9, seq_len=9)])
    assert batch.slot_mappings[0].tolist() == list(range(4, 13))


def test_write_span_starting_inside_a_block(device):
    h = make_adapter(device, block_size=4, bindings={("req", 0, None): (0, 8)}, block_ids={0: [[0, 1]]})
    batch = h.adapter.prepare_batch([row(query_len=2, seq_len=5, kv_start_pos=3)])
    assert batch.positions.tolist() == [3, 4]
    assert batch.slot_mappings[0].tolist() == [3, 4]


def test_block_size_one(device):
    h = make_adapter(device, block_size=1, bindings={("req", 0, None): (0, 4)}, block_ids={0: [[9, 2, 5, 7]]})
    batch = h.adapter.prepare_batch([row(query_len=3, seq_len=4, kv_start_pos=1)])
    assert batch.slot_mappings[0].tolist() == [2, 5, 7]


def test_kernel_blocks_split_manager_blocks(device):
    # Manager block 4 = 2 kernel blocks of 2: manager ids [3, 1] -> kernel ids [6, 7, 2, 3].
    h = make_adapter(
        device,
        block_size=4,
        kernel_block_size=2,
        bindings={("req", 0, None): (0, 8)},
        block_ids={0: [[3, 1]]},
    )
    batch = h.adapter.prepare_batch([row(query_len=8, seq_len=8)])
    assert batch.block_tables[0][0, :4].tolist() == [6, 7, 2, 3]
    assert batch.slot_mappings[0].tolist() == [12, 13, 14, 15, 4, 5, 6, 7]


def test_context_parallel_slots_and_dcp_lens(device, recording_platform):
    # cp 2, interleave 2, rank 1, block 4: a token is local iff (p % 8) // 2 is odd.
    bindings = {("req", 0, None): (0, 8), ("req", 1, None): (1, 8)}
    h = make_adapter(
        device,
        block_size=4,
        cp_size=2,
        cp_rank=1,
        cp_interleave=2,
        bindings=bindings,
        block_ids={0: [[5]], 1: [[6]]},
    )
    batch = h.adapter.prepare_batch(
        [row(query_len=8, seq_len=8, sequence_id=0), row(query_len=5, seq_len=5, sequence_id=1)]
    )
    assert batch.slot_mappings[0].tolist() == [-1, -1, 20, 21, -1, -1, 22, 23] + [-1, -1, 24, 25, -1]
    ((kwargs, _),) = recording_platform.calls
    assert kwargs["dcp_local_seq_lens"].tolist() == [4, 2]
    assert kwargs["dcp_local_seq_lens"].device.type == device.type
    assert batch.attn_metadata["layer0"].dcp_local_seq_lens.tolist() == [4, 2]


def test_context_parallel_uses_module_dcp_helper(monkeypatch):
    calls = []

    def fake_dcp(seq_lens, **kwargs):
        calls.append((seq_lens.tolist(), kwargs))
        return torch.zeros_like(seq_lens)

    monkeypatch.setattr(adapter_mod, "get_dcp_local_seq_lens", fake_dcp)
    h = make_adapter("cpu", cp_size=2, cp_rank=0, cp_interleave=1, bindings={("req", 0, None): (0, 8)})
    h.adapter.prepare_batch([row(query_len=8, seq_len=8)])
    assert calls == [([8], {"dcp_size": 2, "dcp_rank": 0, "cp_kv_cache_interleave_size": 1})]


def test_mixed_causality_groups(device, recording_platform):
    h = make_adapter(device, groups=(("c",), ("f",)), non_causal={"c": False, "f": True})
    batch = h.adapter.prepare_batch([row(query_len=4, seq_len=4)])
    ((kwargs, _),) = recording_platform.calls
    assert kwargs["causal"] == {0: True, 1: False}
    assert batch.attn_metadata["c"].causal is True
    assert batch.attn_metadata["f"].causal is False
    assert batch.slot_mappings.shape == (2, 4)
    assert len(batch.block_tables) == 2
    assert batch.slot_mappings_by_layer["f"].tolist() == batch.slot_mappings[1].tolist()


def test_all_non_causal_groups(recording_platform):
    h = make_adapter("cpu", non_causal=True)
    h.adapter.prepare_batch([row()])
    assert recording_platform.calls[0][0]["causal"] is False


def test_generation_and_owner():
    h = make_adapter("cpu")
    first = h.adapter.prepare_batch([row()])
    second = h.adapter.prepare_batch([row()])
    assert (first._generation, second._generation) == (1, 2)
    assert first._owner is second._owner is h.adapter._owner
    assert "_owner" not in repr(first) and "_generation" not in repr(first)
    # Activating ``first`` now is refused: the "activate an older batch" case of error_cases.py.
    with h.adapter.activate(second) as active:
        assert active is h.adapter and h.adapter._active_batch is second
    assert h.adapter._active_batch is None


def test_batches_alias_the_persistent_buffers():
    # Why an older batch is stale: the next preparation rewrites the same BlockTables buffers.
    h = make_adapter("cpu", bindings={("req", 0, None): (0, 8)}, block_ids={0: [[1, 2]]})
    first = h.adapter.prepare_batch([row(query_len=4, seq_len=4)])
    assert first.slot_mappings[0].tolist() == [4, 5, 6, 7]
    h.adapter.prepare_batch([row(query_len=4, seq_len=8, kv_start_pos=4)])
    assert first.slot_mappings[0].tolist() == [8, 9, 10, 11]


def test_rows_may_be_any_sequence():
    h = make_adapter("cpu")
    batch = h.adapter.prepare_batch(r for r in [row()])
    assert batch.rows == (row(),)


def test_activation_installs_adapter_and_config():
    h = make_adapter("cpu")
    batch = h.adapter.prepare_batch([row()])
    assert platform_mod.current_paged_kv_adapter() is None
    with h.adapter.activate(batch):
        assert platform_mod.current_paged_kv_adapter() is h.adapter
        assert platform_mod.get_current_vllm_config() is h.vllm_config
    assert platform_mod.current_paged_kv_adapter() is None
    assert platform_mod.get_current_vllm_config() is None


def test_activation_cleans_up_after_errors():
    h = make_adapter("cpu")
    batch = h.adapter.prepare_batch([row()])
    with pytest.raises(ZeroDivisionError):
        with h.adapter.activate(batch):
            h.adapter._active_piecewise_plan = "plan"
            raise ZeroDivisionError("inside the forward")
    assert h.adapter._active_batch is None
    assert h.adapter._active_piecewise_plan is None
    assert h.adapter._active_piecewise_native_metadata is None
    assert platform_mod.current_paged_kv_adapter() is None
