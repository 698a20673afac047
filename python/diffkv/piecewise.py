"""Paged piecewise (mixed causal / full-span) attention plans.

Entry point: ``build_paged_piecewise_plan(full_attn_spans, query_offsets, query_lens,
seq_lens, *, device=None)``, vLLM-Omni's planner's contract (its ``piecewise_attn.py``,
newest version), computed in C by ``diffkv._C.build_plan``.  It returns a
``PagedPiecewisePlan`` whose ``segments`` describe vLLM-Omni's per-segment decomposition (used
for per-segment native metadata) and whose ``key_limits`` carry diffkv's single-launch form of
the same mask: packed query token ``t`` at global position ``p`` sees keys ``j < key_limits[t]``
(``p + 1`` in a causal segment, the span end in a full segment).  A plan whose every query token
sees all its row's keys (a denoise step whose image span covers the whole query, as
HunyuanImage-3.0's does) says so (``all_keys_visible``): its layer calls run unmasked.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from . import _C

__all__ = [
    "PagedPiecewisePlan",
    "PagedPiecewiseSegment",
    "Segment",
    "build_paged_piecewise_plan",
]


class Segment(NamedTuple):
    """One row's piece of a segment, global coordinates: queries ``[q_start, q_end)`` attend
    keys ``[0, kv_end)`` with ``mode`` "causal" (bottom-right aligned) or "full"."""

    q_start: int
    q_end: int
    kv_end: int
    mode: Literal["causal", "full"]


@dataclass(frozen=True, slots=True)
class PagedPiecewiseSegment:
    """Segment k of every row.

    row_segments: one ``Segment`` per row; query_indices: int64 ``[n_k]`` packed query
    indices of the segment (rows concatenated); query_range: ``(start, end)`` when those
    indices are one contiguous run, else None; local_query_range: the row-local range when it
    is the same for every row, else None.
    """

    row_segments: tuple[Segment, ...]
    query_indices: torch.Tensor
    query_range: tuple[int, int] | None
    local_query_range: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class PagedPiecewisePlan:
    """A piecewise plan over a packed query of ``num_query_tokens`` tokens.

    spans: the normalised spans (tuple of ``(start, end)`` tuples per row), compared for
    cache equality; segments: ``PagedPiecewiseSegment`` in order;
    segments_cover_query_contiguously: every segment is a contiguous run and together they
    tile ``[0, num_query_tokens)`` in order; homogeneous_batch_shape: ``(rows, query_len)``
    when there are several rows of one query length and every segment has a shared local
    range; key_limits: int32 ``[num_query_tokens]``, the exclusive key bound of every packed
    query token (diffkv's single-launch mask); all_keys_visible: every key limit is its row's
    seq_len, so the mask is no mask (``ops.plan_mask`` then runs the call as ``MASK_NONE``: the
    same attention, on the kernels of unmasked calls).
    """

    spans: tuple[tuple[tuple[int, int], ...], ...]
    segments: tuple[PagedPiecewiseSegment, ...]
    num_query_tokens: int
    segments_cover_query_contiguously: bool
    homogeneous_batch_shape: tuple[int, int] | None = None
    key_limits: torch.Tensor | None = None
    all_keys_visible: bool = False


def _packed_length(query_lens: Sequence[int]) -> int:
    """Size of the packed outputs; malformed lengths give 0 so that _C.build_plan reports
    the planner's own error for them."""
    try:
        total = sum(operator.index(query_len) for query_len in query_lens)
    except TypeError:
        return 0
    return max(total, 0)


def build_paged_piecewise_plan(
    full_attn_spans: Sequence[Sequence[tuple[int, int]]],
    query_offsets: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    device: torch.device | str | None = None,
) -> PagedPiecewisePlan:
    """Plan piecewise attention for packed rows.

    full_attn_spans: per row, sorted non-overlapping global ``[start, end)`` spans with full
    attention (empty: the row is causal); query_offsets / query_lens / seq_lens: per row, the
    global start and length of its queries and its key count.  The query tensors of the plan
    (``query_indices``, ``key_limits``) live on ``device`` (CPU when None).
    Raises vLLM-Omni's planner's ValueErrors.
    """
    num_query_tokens = _packed_length(query_lens)
    key_limits_cpu = torch.empty(num_query_tokens, dtype=torch.int32)
    query_indices_cpu = torch.empty(num_query_tokens, dtype=torch.int64)
    spans, raw_segments = _C.build_plan(
        full_attn_spans, query_offsets, query_lens, seq_lens, key_limits_cpu, query_indices_cpu
    )

    offsets = [int(offset) for offset in query_offsets]
    lens = [int(query_len) for query_len in query_lens]
    num_rows = len(lens)
    packed_starts = [0] * num_rows
    for row in range(1, num_rows):
        packed_starts[row] = packed_starts[row - 1] + lens[row - 1]

    if device is None:
        key_limits = key_limits_cpu
        query_indices_all = query_indices_cpu
    else:
        key_limits = key_limits_cpu.to(device)
        query_indices_all = query_indices_cpu.to(device)

    segments: list[PagedPiecewiseSegment] = []
    cursor = 0
    covers_contiguously = True
    all_local = True
    for raw_segment in raw_segments:
        row_segments = tuple(Segment(*row_segment) for row_segment in raw_segment)
        local_ranges = [
            (row_segment.q_start - offsets[row], row_segment.q_end - offsets[row])
            for row, row_segment in enumerate(row_segments)
        ]
        packed_ranges = [
            (packed_starts[row] + start, packed_starts[row] + end)
            for row, (start, end) in enumerate(local_ranges)
        ]
        contiguous = all(packed_ranges[row][1] == packed_ranges[row + 1][0] for row in range(num_rows - 1))
        query_range = (packed_ranges[0][0], packed_ranges[-1][1]) if contiguous else None
        local_query_range = local_ranges[0] if all(r == local_ranges[0] for r in local_ranges) else None
        length = sum(end - start for start, end in local_ranges)
        segments.append(
            PagedPiecewiseSegment(
                row_segments=row_segments,
                query_indices=query_indices_all[cursor : cursor + length],
                query_range=query_range,
                local_query_range=local_query_range,
            )
        )
        if covers_contiguously and (query_range is None or query_range[0] != cursor):
            covers_contiguously = False
        all_local = all_local and local_query_range is not None
        cursor += length

    if segments and covers_contiguously:
        covers_contiguously = segments[-1].query_range[1] == num_query_tokens
    # every packed token's limit its row's seq_len (checked on the host copy)
    all_keys_visible = num_query_tokens > 0 and torch.equal(
        key_limits_cpu,
        torch.repeat_interleave(
            torch.tensor([int(s) for s in seq_lens], dtype=torch.int32), torch.tensor(lens, dtype=torch.int64)
        ),
    )
    homogeneous_batch_shape = None
    if num_rows > 1 and all_local and all(query_len == lens[0] for query_len in lens):
        homogeneous_batch_shape = (num_rows, lens[0])
    return PagedPiecewisePlan(
        spans=spans,
        segments=tuple(segments),
        num_query_tokens=num_query_tokens,
        segments_cover_query_contiguously=covers_contiguously,
        homogeneous_batch_shape=homogeneous_batch_shape,
        key_limits=key_limits,
        all_keys_visible=all_keys_visible,
    )
