"""Rows, row bindings and request metadata: fields, flags and what they accept (their refusals,
with vLLM-Omni's adapter's messages, each rule in its order, are cases of error_cases.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import diffkv
from diffkv import (
    _C,
    DiffusionPagedAttentionContext,
    DiffusionPagedAttentionMetadata,
    DiffusionPagedAttentionRow,
    DiffusionPagedAttentionRowBinding,
    PreparedDiffusionPagedAttentionBatch,
)
from error_cases import request_rows

Row = DiffusionPagedAttentionRow


def _raises(exc_type, message):
    return pytest.raises(exc_type, match=f"^{re.escape(message)}$")


def _fields(cls):
    return [
        (f.name, f.default if f.default is not dataclasses.MISSING else "<required>")
        for f in dataclasses.fields(cls)
    ]


# --- dataclass shapes ---------------------------------------------------------------------------


def test_binding_fields_and_flags():
    assert _fields(DiffusionPagedAttentionRowBinding) == [
        ("row_index", "<required>"),
        ("max_seq_len", "<required>"),
        ("block_ids", ()),
    ]
    params = DiffusionPagedAttentionRowBinding.__dataclass_params__
    assert params.frozen
    assert not hasattr(DiffusionPagedAttentionRowBinding, "__slots__")
    binding = DiffusionPagedAttentionRowBinding(3, 40)
    assert binding.block_ids == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        binding.row_index = 1


def test_row_fields_flags_and_identity():
    assert _fields(Row) == [
        ("request_id", "<required>"),
        ("query_len", "<required>"),
        ("seq_len", "<required>"),
        ("kv_start_pos", 0),
        ("sequence_id", None),
        ("context_id", None),
    ]
    assert Row.__dataclass_params__.frozen
    row = Row("r", 3, 5, kv_start_pos=2, sequence_id=7)
    assert row.identity == ("r", 7, None)
    assert Row("r", 3, 5, context_id="ctx").identity == ("r", None, "ctx")
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.query_len = 2
    assert row == Row("r", 3, 5, kv_start_pos=2, sequence_id=7)


def test_metadata_batch_and_context_flags():
    assert _fields(DiffusionPagedAttentionMetadata) == [
        ("prefill_rows", "<required>"),
        ("denoise_rows", "<required>"),
    ]
    assert DiffusionPagedAttentionMetadata.__dataclass_params__.frozen
    batch_fields = {f.name: f for f in dataclasses.fields(PreparedDiffusionPagedAttentionBatch)}
    assert list(batch_fields) == [
        "rows",
        "row_indices",
        "query_start_loc",
        "seq_lens",
        "positions",
        "block_tables",
        "slot_mappings",
        "attn_metadata",
        "slot_mappings_by_layer",
        "num_tokens",
        "_owner",
        "_generation",
    ]
    assert PreparedDiffusionPagedAttentionBatch.__dataclass_params__.frozen
    for name in ("_owner", "_generation"):
        assert batch_fields[name].repr is False and batch_fields[name].compare is False
    assert _fields(DiffusionPagedAttentionContext) == [
        ("layer", "<required>"),
        ("query", "<required>"),
        ("key_write", "<required>"),
        ("value_write", "<required>"),
        ("slot_mapping", "<required>"),
        ("native_metadata", "<required>"),
        ("piecewise_plan", "<required>"),
        ("piecewise_native_metadata", "<required>"),
        ("query_token_shape", "<required>"),
        ("query_has_head_dims", "<required>"),
        ("output_scatter_indices", None),
    ]
    assert DiffusionPagedAttentionContext.__dataclass_params__.frozen
    assert hasattr(DiffusionPagedAttentionContext, "__slots__")


def test_new_with_slots_builds_the_context_its_init_would():
    """prepare_layer_context builds its context with _C.new_with_slots: the same frozen object
    as the dataclass __init__ (no __post_init__), each field the value given."""
    context_fields = dataclasses.fields(DiffusionPagedAttentionContext)
    descriptors = tuple(getattr(DiffusionPagedAttentionContext, f.name) for f in context_fields)
    t = torch.zeros(2, 1, 4)
    values = (object(), t, t, t, torch.zeros(2, dtype=torch.int64), object(), None, (), (2,), True, None)
    made = _C.new_with_slots(DiffusionPagedAttentionContext, descriptors, *values)
    assert type(made) is DiffusionPagedAttentionContext
    assert made == DiffusionPagedAttentionContext(*values)
    assert all(getattr(made, f.name) is value for f, value in zip(context_fields, values, strict=True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.query = t


def test_resolver_alias_is_exported():
    assert diffkv.DiffusionKVRowResolver is diffkv.adapter.DiffusionKVRowResolver


# --- row fields: ids, lengths, write span ---------------------------------------------------------
# Each refused row and request metadata (vLLM-Omni's adapter's rules, in its order) is a case of
# error_cases.public_cases ("DiffusionPagedAttentionRow", "DiffusionPagedAttentionMetadata",
# "DiffusionPagedAttentionMetadata.rows_for_step"); here, the rows and metadata they accept.


def test_valid_edge_rows():
    assert Row("r", 1, 1, sequence_id=0).kv_start_pos == 0
    assert Row("r", 2, 5, kv_start_pos=3, context_id="c").seq_len == 5
    # A non-suffix span is a valid row (non-causal layers accept it).
    assert Row("r", 2, 9, kv_start_pos=3, sequence_id=0).query_len == 2


# --- metadata: both row sets, the same identities, the step index ---------------------------------


_rows = request_rows


def test_rows_for_step_selects_phase():
    prefill = _rows()
    denoise = _rows(query_len=2, kv_start_pos=2)
    metadata = DiffusionPagedAttentionMetadata(prefill, denoise)
    assert metadata.rows_for_step(0) is prefill
    assert metadata.rows_for_step(1) is denoise
    assert metadata.rows_for_step(49) is denoise


def test_metadata_accepts_lists():
    prefill = list(_rows())
    denoise = list(_rows(query_len=2, kv_start_pos=2))
    metadata = DiffusionPagedAttentionMetadata(prefill, denoise)
    assert metadata.rows_for_step(0) is prefill
