"""diffkv.native: configs, specs, BlockTables (append / clear / gather / slot mapping, kernel
block split, context parallel), KV cache allocation and the metadata builders.  Their refusals
are cases of error_cases.py (checked by test_adapter_errors, repeated by the fuzz and leak
tests); here, what they accept and the state a refusal leaves."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import diffkv
from diffkv import native
from error_cases import check, kv_config, mixed_kv_config, public_case, public_cases

# --- helpers ------------------------------------------------------------------------------------


def expected_slot(table_row, position, kernel_block_size, cp_size=1, cp_rank=0, interleave=1):
    """vLLM's slot rule, written out plainly."""
    span = kernel_block_size * cp_size
    block, offset = divmod(position, span)
    physical = int(table_row[block])
    if cp_size == 1:
        return physical * kernel_block_size + offset
    if (offset // interleave) % cp_size != cp_rank:
        return -1
    return (
        physical * kernel_block_size + (offset // (interleave * cp_size)) * interleave + offset % interleave
    )


def batch_tensors(rows, device):
    """rows: list of (table_row, kv_start_pos, query_len) -> row_indices, query_start_loc,
    positions on device."""
    row_indices = torch.tensor([r for r, _, _ in rows], dtype=torch.int32, device=device)
    qsl = [0]
    positions = []
    for _, start, length in rows:
        qsl.append(qsl[-1] + length)
        positions.extend(range(start, start + length))
    return (
        row_indices,
        torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
    )


# --- configs and specs --------------------------------------------------------------------------


def test_configs():
    model = diffkv.ModelConfig(torch.bfloat16)
    assert model.dtype is torch.bfloat16
    assert diffkv.ModelConfig("float16").dtype is torch.float16
    cache = diffkv.CacheConfig()
    assert (cache.block_size, cache.cache_dtype) == (16, "auto")
    cfg = diffkv.DiffusionConfig(model, diffkv.CacheConfig(block_size=4))
    assert cfg.model_config.dtype is torch.bfloat16
    assert cfg.cache_config.block_size == 4
    assert cfg.cache_config.cache_dtype == "auto"


def test_attention_spec_defaults_and_replace():
    spec = diffkv.AttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert spec.non_causal is False
    assert spec.head_size_v == 128
    assert int(getattr(spec, "head_size_v", spec.head_size)) == 128
    local = dataclasses.replace(spec, num_kv_heads=2)
    assert (local.num_kv_heads, local.head_size, local.head_size_v) == (2, 128, 128)
    assert local.block_size == 16 and local.dtype is torch.bfloat16
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_kv_heads = 4
    other = diffkv.AttentionSpec(4, 1, 64, torch.float32, non_causal=True, head_size_v=32)
    assert other.non_causal is True and other.head_size_v == 32
    assert hash(spec) == hash(diffkv.AttentionSpec(16, 8, 128, torch.bfloat16))


def test_groups_and_kv_cache_config():
    spec = diffkv.AttentionSpec(16, 2, 64, torch.float16)
    group = diffkv.KVCacheGroup(["a", "b"], spec)
    assert group.layer_names == ("a", "b")
    assert group.kv_cache_spec is spec
    cfg = diffkv.KVCacheConfig(num_blocks=8, kv_cache_groups=[group])
    assert cfg.kv_cache_groups == (group,)


def test_attention_group_builder():
    group = diffkv.AttentionGroup(["a"])
    assert group.get_metadata_builder(0).reorder_batch_threshold is None
    assert (
        diffkv.AttentionGroup(["a"], reorder_batch_threshold=1).get_metadata_builder().reorder_batch_threshold
        == 1
    )


# --- BlockTables ---------------------------------------------------------------------------------


def test_block_tables_attributes(device):
    tables = diffkv.BlockTables([16, 4], 3, 64, [4, 8], device, kernel_block_sizes=[8, 4])
    assert tables.block_sizes == [16, 4]
    assert tables.kernel_block_sizes == [8, 4]
    assert tables.blocks_per_kv_block == [2, 1]
    assert (tables.max_num_reqs, tables.max_num_batched_tokens) == (3, 64)
    assert (tables.cp_size, tables.cp_rank, tables.cp_interleave) == (1, 0, 1)
    assert isinstance(tables.num_blocks.np, np.ndarray)
    assert tables.num_blocks.np.dtype == np.int32 and tables.num_blocks.np.shape == (2, 3)
    assert tables.num_blocks.gpu.device.type == device.type
    assert [tuple(t.shape) for t in tables.block_tables] == [(3, 8), (3, 8)]
    default = diffkv.BlockTables([16], 1, 8, [2], device)
    assert default.kernel_block_sizes == [16] and default.blocks_per_kv_block == [1]


def test_worked_example_block_size_16(device):
    # A worked example of vLLM's slot rule: block size 16, row blocks [3, 1].
    tables = diffkv.BlockTables([16], 2, 32, [4], device)
    tables.append_block_ids(1, [[3, 1]])
    assert tables.num_blocks.np[0, 1] == 2
    row_indices, qsl, positions = batch_tensors([(1, 0, 19)], device)
    slots = tables.compute_slot_mappings(row_indices, qsl, positions, num_tokens_padded=19)
    assert slots.shape == (1, 19) and slots.dtype == torch.int64
    assert slots[0].tolist() == list(range(48, 64)) + [16, 17, 18]


def test_worked_example_block_size_4(device):
    # A worked example of vLLM's slot rule: block size 4, blocks [1, 2, 3], positions 0..8 -> slots 4..12.
    tables = diffkv.BlockTables([4], 1, 16, [3], device)
    tables.append_block_ids(0, [[1, 2, 3]])
    row_indices, qsl, positions = batch_tensors([(0, 0, 9)], device)
    slots = tables.compute_slot_mappings(row_indices, qsl, positions, num_tokens_padded=9)
    assert slots[0].tolist() == list(range(4, 13))


def test_append_overwrite_clear(device):
    tables = diffkv.BlockTables([4], 3, 16, [6], device)
    tables.append_block_ids(2, [[7, 5]])
    tables.append_block_ids(2, [[9]])
    assert tables.num_blocks.np[0, 2] == 3
    assert tables.block_tables[0][2, :3].tolist() == [7, 5, 9]
    assert tables.num_blocks.gpu[0, 2].item() == 3
    tables.append_block_ids(2, [[1]], overwrite=True)
    assert tables.num_blocks.np[0, 2] == 1
    assert tables.block_tables[0][2, 0].item() == 1
    assert tables.num_blocks.gpu[0].tolist() == [0, 0, 1]
    tables.append_block_ids(0, [[4, 4, 2]])
    tables.clear_row(2)
    assert tables.num_blocks.np[0].tolist() == [3, 0, 0]
    assert tables.num_blocks.gpu[0].tolist() == [3, 0, 0]
    assert tables.block_tables[0][2].tolist() == [0] * 6
    assert tables.block_tables[0][0, :3].tolist() == [4, 4, 2]
    tables.apply_staged_writes()
    assert tables.block_tables[0][0, :3].tolist() == [4, 4, 2]


def test_failing_methods_change_nothing(device):
    """Every refusal of error_cases.py's "BlockTables methods" (the append ones: group 0 would
    fit where group 1 overflows, a bad id in group 1) leaves its tables' rows and block counts
    as they were."""
    cases = public_cases(device)["BlockTables methods"]
    tables = {id(case.env): case.env for case in cases}.values()
    before = [([t.clone() for t in tables.block_tables], tables.num_blocks.np.copy()) for tables in tables]
    for case in cases:
        check(case)
    for t, (block_tables, num_blocks) in zip(tables, before, strict=True):
        for now, then in zip(t.block_tables, block_tables, strict=True):
            assert torch.equal(now, then)
        assert (t.num_blocks.np == num_blocks).all()
    assert next(case for case in cases if case.name == "append overflows group 1").env.num_blocks.np[
        :, 0
    ].tolist() == [1, 1]


def test_gather_block_tables(device):
    tables = diffkv.BlockTables([4, 2], 4, 32, [3, 3], device)
    tables.append_block_ids(0, [[10, 11], [20]])
    tables.append_block_ids(1, [[12, 13, 14], [21, 22, 23]])
    tables.append_block_ids(3, [[15], [24, 25]])
    gathered = tables.gather_block_tables(
        torch.tensor([3, 0], dtype=torch.int32, device=device), num_reqs_padded=3
    )
    assert len(gathered) == 2
    g0, g1 = gathered
    assert g0.dtype == torch.int32 and g0.shape == (3, 3) and g0.device.type == device.type
    assert g0[0, :1].tolist() == [15] and g0[1, :2].tolist() == [10, 11]
    assert g1[0, :2].tolist() == [24, 25] and g1[1, :1].tolist() == [20]
    assert g0[2].tolist() == [0, 0, 0] and g1[2].tolist() == [0, 0, 0]
    # Views of the persistent input buffer.
    assert g0.data_ptr() == tables.input_block_tables[0].data_ptr()
    again = tables.gather_block_tables([1], num_reqs_padded=1)
    assert again[0].tolist() == [[12, 13, 14]] and again[1].tolist() == [[21, 22, 23]]


def test_compute_slot_mappings_rows_and_padding(device):
    tables = diffkv.BlockTables([4], 3, 40, [5], device)
    tables.append_block_ids(0, [[9, 2, 7]])
    tables.append_block_ids(2, [[4, 0, 1, 8, 3]])
    rows = [(2, 5, 10), (0, 3, 6)]  # (table row, kv_start_pos, query_len); span starts mid-block
    row_indices, qsl, positions = batch_tensors(rows, device)
    slots = tables.compute_slot_mappings(row_indices, qsl, positions, num_tokens_padded=20)
    table = {0: [9, 2, 7], 2: [4, 0, 1, 8, 3]}
    expected = [expected_slot(table[r], p, 4) for r, start, n in rows for p in range(start, start + n)]
    assert slots.shape == (1, 20)
    assert slots[0, :16].tolist() == expected
    assert slots[0, 16:].tolist() == [-1] * 4
    # The whole persistent buffer past the real tokens is -1.
    assert tables.slot_mappings[0, 16:].tolist() == [-1] * 24
    assert slots.data_ptr() == tables.slot_mappings.data_ptr()


def test_kernel_block_split(device):
    # Manager blocks of 16 split into kernel pages of 4: block b -> kernel blocks 4b .. 4b+3.
    tables = diffkv.BlockTables([16], 1, 64, [2], device, kernel_block_sizes=[4])
    assert tables.blocks_per_kv_block == [4]
    tables.append_block_ids(0, [[2, 0]])
    assert tables.num_blocks.np[0, 0] == 8
    assert tables.block_tables[0][0].tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    row_indices, qsl, positions = batch_tensors([(0, 3, 27)], device)
    slots = tables.compute_slot_mappings(row_indices, qsl, positions, num_tokens_padded=27)
    expected = [expected_slot([8, 9, 10, 11, 0, 1, 2, 3], p, 4) for p in range(3, 30)]
    assert slots[0].tolist() == expected
    # Kernel slots equal manager slots: the split is invisible to the slot mapping.
    assert expected == [expected_slot([2, 0], p, 16) for p in range(3, 30)]


@pytest.mark.parametrize("cp_rank", [0, 1])
@pytest.mark.parametrize("interleave", [1, 2])
def test_context_parallel_slots(device, cp_rank, interleave):
    tables = diffkv.BlockTables([4], 2, 32, [4], device, cp_size=2, cp_rank=cp_rank, cp_interleave=interleave)
    tables.append_block_ids(1, [[6, 3, 5]])
    row_indices, qsl, positions = batch_tensors([(1, 0, 20)], device)
    slots = tables.compute_slot_mappings(row_indices, qsl, positions, num_tokens_padded=24)
    expected = [expected_slot([6, 3, 5], p, 4, 2, cp_rank, interleave) for p in range(20)]
    assert slots[0, :20].tolist() == expected
    assert slots[0, 20:].tolist() == [-1] * 4
    assert expected.count(-1) == 10
    local = [s for s in expected if s >= 0]
    assert len(set(local)) == len(local)


def test_two_groups_slots(device):
    tables = diffkv.BlockTables([4, 8], 1, 16, [4, 2], device)
    tables.append_block_ids(0, [[3, 1, 2], [1, 0]])
    row_indices, qsl, positions = batch_tensors([(0, 2, 9)], device)
    slots = tables.compute_slot_mappings(row_indices, qsl, positions, num_tokens_padded=9)
    assert slots.shape == (2, 9)
    assert slots[0].tolist() == [expected_slot([3, 1, 2], p, 4) for p in range(2, 11)]
    assert slots[1].tolist() == [expected_slot([1, 0], p, 8) for p in range(2, 11)]


# --- BlockPool wiring (full tests in test_block_pool.py) ---------------------------------------


def test_block_pool_basic():
    pool = diffkv.BlockPool(4)
    assert pool.num_free == 4
    assert pool.allocate(2) == [0, 1]
    pool.free([0])
    assert pool.num_free == 3


# --- KV cache allocation ------------------------------------------------------------------------


def test_allocate_layer_major(device):
    cfg = kv_config()
    caches = diffkv.allocate_kv_caches(cfg, dtype=torch.float16, device=device)
    assert list(caches) == ["l0", "l1", "l2"]
    for cache in caches.values():
        assert cache.shape == (2, 5, 4, 2, 8)
        assert cache.dtype == torch.float16 and cache.device.type == device.type
        assert cache.is_contiguous()
        assert not cache.any()
    assert caches["l0"].data_ptr() != caches["l1"].data_ptr()


def test_allocate_block_major(device):
    cfg = kv_config()
    caches = diffkv.allocate_kv_caches(cfg, dtype=torch.float16, device=device, layout="block_major")
    page = 4 * 2 * 8  # block_size * Hkv * D
    for index, name in enumerate(["l0", "l1", "l2"]):
        cache = caches[name]
        assert cache.shape == (2, 5, 4, 2, 8)
        # Each block holds all 3 layers' K and V pages.
        assert cache.stride() == (page, 3 * 2 * page, 2 * 8, 8, 1)
        assert cache.data_ptr() == caches["l0"].data_ptr() + index * 2 * page * cache.element_size()
    caches["l1"][1, 2, 3, 1, 5] = 7.0
    for name in ("l0", "l2"):
        assert not caches[name].any()
    assert caches["l1"].sum().item() == 7.0


def test_allocate_binds_layers(device):
    cfg = kv_config()
    layers = {name: SimpleNamespace(kv_cache=None) for name in ["l0", "l1", "l2"]}
    caches = diffkv.allocate_kv_caches(cfg, dtype=torch.float16, device=device, layers=layers)
    for name, layer in layers.items():
        assert layer.kv_cache is caches[name]


def test_allocate_checks_layers_before_binding_any():
    """The "allocate layers lacks l1" case of error_cases.py binds no layer it was given."""
    case = public_case("allocate layers lacks l1")
    check(case)
    assert all(layer.kv_cache is None for layer in case.env.values())


def test_allocate_mixed_shapes_layer_major():
    # Refused block-major ("allocate block_major of mixed shapes"), accepted layer-major.
    assert set(diffkv.allocate_kv_caches(mixed_kv_config(), dtype=torch.float16, device="cpu")) == {"a", "b"}


# --- metadata builders --------------------------------------------------------------------------


def test_build_attn_metadata(device):
    cfg = kv_config()
    tables = diffkv.BlockTables([4, 4], 2, 16, [3, 3], device)
    tables.append_block_ids(0, [[1, 2], [3, 4]])
    tables.append_block_ids(1, [[0], [2]])
    row_indices, qsl, positions = batch_tensors([(1, 1, 3), (0, 2, 5)], device)
    block_tables = tables.gather_block_tables(row_indices, num_reqs_padded=2)
    slots = tables.compute_slot_mappings(row_indices, qsl, positions, num_tokens_padded=8)
    seq_lens_cpu = torch.tensor([4, 7], dtype=torch.int32)
    groups = [[diffkv.AttentionGroup(["l0", "l1"])], [diffkv.AttentionGroup(["l2"])]]
    md = native.build_attn_metadata(
        attn_groups=groups,
        num_reqs=2,
        num_tokens=8,
        query_start_loc_gpu=qsl,
        query_start_loc_cpu=qsl.cpu(),
        max_query_len=5,
        seq_lens=seq_lens_cpu.to(device),
        max_seq_len=7,
        block_tables=block_tables,
        slot_mappings=slots,
        kv_cache_config=cfg,
        seq_lens_cpu=seq_lens_cpu,
        seq_lens_cpu_upper_bound=seq_lens_cpu,
        dcp_local_seq_lens=None,
        positions=positions,
        causal={0: True, 1: False},
    )
    assert set(md) == {"l0", "l1", "l2"}
    assert md["l0"] is md["l1"] and md["l0"] is not md["l2"]
    m0, m2 = md["l0"], md["l2"]
    assert isinstance(m0, diffkv.PagedAttentionMetadata)
    assert (m0.causal, m2.causal) == (True, False)
    assert (m0.num_reqs, m0.num_actual_tokens, m0.max_query_len, m0.max_seq_len, m0.block_size) == (
        2,
        8,
        5,
        7,
        4,
    )
    assert m0.block_table is block_tables[0] and m2.block_table is block_tables[1]
    assert m0.block_table_cpu.device.type == "cpu" and torch.equal(m0.block_table_cpu, block_tables[0].cpu())
    assert torch.equal(m0.slot_mapping, slots[0]) and torch.equal(m2.slot_mapping, slots[1])
    assert m0.positions is positions and m0.dcp_local_seq_lens is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        m0.causal = False
    assert not hasattr(m0, "__dict__")
    md_bool = native.build_attn_metadata(
        attn_groups=groups,
        num_reqs=2,
        num_tokens=8,
        query_start_loc_gpu=qsl,
        query_start_loc_cpu=qsl.cpu(),
        max_query_len=5,
        seq_lens=seq_lens_cpu.to(device),
        max_seq_len=7,
        block_tables=block_tables,
        slot_mappings=slots,
        kv_cache_config=cfg,
        seq_lens_cpu=seq_lens_cpu,
        seq_lens_cpu_upper_bound=seq_lens_cpu,
        dcp_local_seq_lens=None,
        positions=positions,
        causal=False,
    )
    assert not md_bool["l0"].causal and not md_bool["l2"].causal


def test_build_slot_mappings_by_layer():
    cfg = kv_config()
    slots = torch.arange(12, dtype=torch.int64).reshape(2, 6)
    by_layer = native.build_slot_mappings_by_layer(slots, cfg)
    assert by_layer["l0"].tolist() == list(range(6)) and by_layer["l2"].tolist() == list(range(6, 12))
    assert by_layer["l0"].data_ptr() == by_layer["l1"].data_ptr() == slots.data_ptr()


def test_get_dcp_local_seq_lens(device):
    seq_lens = torch.tensor([5, 0, 1, 8, 13], dtype=torch.int32, device=device)
    out = native.get_dcp_local_seq_lens(seq_lens, dcp_size=2, dcp_rank=1, cp_kv_cache_interleave_size=2)
    assert out.device.type == device.type and out.dtype == torch.int32

    def local(s, c, r, i):
        base = (s // (c * i)) * i
        rem = s - base * c
        return base + min(max(rem - r * i, 0), i)

    assert out.tolist() == [local(s, 2, 1, 2) for s in [5, 0, 1, 8, 13]]
    assert out.tolist()[0] == 2  # the unit test's worked value
    total = sum(
        native.get_dcp_local_seq_lens(seq_lens, dcp_size=3, dcp_rank=r, cp_kv_cache_interleave_size=1)
        for r in range(3)
    )
    assert total.tolist() == [5, 0, 1, 8, 13]
