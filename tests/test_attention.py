"""_C.paged_attention against the float64 reference: random permuted block tables with spare
blocks, block sizes 1/4/16, lengths that are not block multiples, several rows, GQA and MHA,
every mask mode, fp32/fp16/bf16 (error within 2x the same-dtype reference's error + atol)."""

from __future__ import annotations

import math

import pytest
import torch

from diffkv import _C
from reference import (
    assert_attention_close,
    dense_kv_from_cache,
    key_limits_for_spans,
    mask_causal,
    mask_none,
    mask_spans,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_SIZE = 64

# (seq_len, query_len, spans) per row: different prefixes, lengths not block multiples.
ROWS = [
    (37, 13, [(20, 30), (33, 37)]),
    (50, 50, [(5, 19)]),
    (9, 4, [(6, 9)]),
]


class PagedCase:
    """A random paged cache with a permuted block table, spare blocks full of NaN, and rows."""

    def __init__(self, device, dtype, block_size, rows, num_heads, num_kv_heads, spare_blocks=5):
        self.block_size = block_size
        self.rows = rows
        needed = [math.ceil(s / block_size) for s, _, _ in rows]
        num_blocks = sum(needed) + spare_blocks
        cols = max(needed) + 2
        perm = torch.randperm(num_blocks).tolist()
        spare = perm[sum(needed) :]
        table = torch.empty((len(rows), cols), dtype=torch.int32)
        cursor = 0
        for r, n in enumerate(needed):
            table[r, :n] = torch.tensor(perm[cursor : cursor + n], dtype=torch.int32)
            table[r, n:] = spare[r % len(spare)]
            cursor += n
        cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD_SIZE)
        cache[:, spare] = float("nan")  # a kernel reading an unreferenced block poisons its output
        self.kv_cache = cache.to(dtype).to(device)
        self.block_table = table.to(device)
        self.host_block_table = table
        qsl = [0]
        for _, q, _ in rows:
            qsl.append(qsl[-1] + q)
        self.host_query_start_loc = torch.tensor(qsl, dtype=torch.int32)
        self.host_seq_lens = torch.tensor([s for s, _, _ in rows], dtype=torch.int32)
        self.query_start_loc = self.host_query_start_loc.to(device)
        self.seq_lens = self.host_seq_lens.to(device)
        self.num_tokens = qsl[-1]
        self.query = torch.randn(self.num_tokens, num_heads, HEAD_SIZE).to(dtype).to(device)
        # Global position of every query token (queries are each row's suffix).
        self.positions = [[s - q + i for i in range(q)] for s, q, _ in rows]

    def run(self, mask, key_limits=None, scale=None, out=None):
        scale = HEAD_SIZE**-0.5 if scale is None else scale
        if out is None:
            out = torch.full_like(self.query, float("nan"))
        _C.paged_attention(
            self.query,
            self.kv_cache,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
            key_limits,
            mask,
            scale,
            out,
            self.host_block_table,
            self.host_query_start_loc,
            self.host_seq_lens,
        )
        return out

    def row_slices(self):
        qsl = self.host_query_start_loc.tolist()
        return [slice(qsl[r], qsl[r + 1]) for r in range(len(self.rows))]

    def check(self, out, masks, scale=HEAD_SIZE**-0.5):
        for r, ((seq_len, _, _), rows) in enumerate(zip(self.rows, self.row_slices(), strict=True)):
            k, v = dense_kv_from_cache(self.kv_cache, self.host_block_table[r], seq_len)
            k = k.to(self.query.dtype)
            v = v.to(self.query.dtype)
            assert_attention_close(out[rows], self.query[rows], k, v, masks[r], scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mask", ["none", "causal", "limits"])
@pytest.mark.parametrize("heads", [(4, 1), (2, 2)], ids=["gqa4", "mha"])
def test_paged_attention(device, dtype, block_size, mask, heads):
    case = PagedCase(device, dtype, block_size, ROWS, *heads)
    if mask == "none":
        out = case.run(_C.MASK_NONE)
        masks = [mask_none(p, s) for p, (s, _, _) in zip(case.positions, ROWS, strict=True)]
    elif mask == "causal":
        out = case.run(_C.MASK_CAUSAL)
        masks = [mask_causal(p, s) for p, (s, _, _) in zip(case.positions, ROWS, strict=True)]
    else:
        limits = [
            lim
            for p, (_, _, spans) in zip(case.positions, ROWS, strict=True)
            for lim in key_limits_for_spans(p, spans)
        ]
        key_limits = torch.tensor(limits, dtype=torch.int32, device=device)
        out = case.run(_C.MASK_LIMITS, key_limits)
        masks = [mask_spans(p, s, spans) for p, (s, _, spans) in zip(case.positions, ROWS, strict=True)]
    assert out.dtype == dtype
    case.check(out, masks)


def test_key_limits_clamped_and_empty(device):
    # Limits above seq_len are clamped to it; a limit of 0 sees nothing and gives zeros.
    rows = [(10, 4, []), (7, 3, [])]
    case = PagedCase(device, torch.float32, 4, rows, 2, 1)
    limits = torch.tensor([0, 3, 10, 50, 1, 7, 100], dtype=torch.int32, device=device)
    out = case.run(_C.MASK_LIMITS, limits)
    assert not out[0].any()
    seq = torch.arange(10)
    masks = [
        torch.stack([seq < lim for lim in [0, 3, 10, 10]]),
        torch.stack([torch.arange(7) < lim for lim in [1, 7, 7]]),
    ]
    case.check(out, masks)


def test_empty_row_gives_zeros(device):
    # A row with seq_len 0 sees no key: its queries get zeros; other rows are unaffected.
    rows = [(0, 3, []), (6, 2, [])]
    case = PagedCase(device, torch.float16, 4, [(r[0] or 1, r[1], r[2]) for r in rows], 2, 2)
    case.host_seq_lens[0] = 0
    case.seq_lens = case.host_seq_lens.to(device)
    out = case.run(_C.MASK_NONE)
    assert not out[:3].any()
    k, v = dense_kv_from_cache(case.kv_cache, case.host_block_table[1], 6)
    assert_attention_close(out[3:], case.query[3:], k.half(), v.half(), mask_none([4, 5], 6), HEAD_SIZE**-0.5)


def test_scale_and_strided_query_out(device):
    rows = [(21, 9, [])]
    case = PagedCase(device, torch.float32, 4, rows, 4, 2)
    wide = torch.randn(case.num_tokens, 4, 2 * HEAD_SIZE, device=device)
    case.query = wide[:, :, HEAD_SIZE:]  # head stride 2 * HEAD_SIZE
    out_buffer = torch.zeros(case.num_tokens, 4, 2 * HEAD_SIZE, device=device)
    out = out_buffer[:, :, :HEAD_SIZE]
    case.run(_C.MASK_CAUSAL, scale=0.3, out=out)
    assert not out_buffer[:, :, HEAD_SIZE:].any()
    case.check(out, [mask_causal(case.positions[0], 21)], scale=0.3)


def test_block_major_cache_view(device):
    # The cache is one layer's view of a block-major buffer: block stride spans 3 layers.
    rows = [(30, 11, [(22, 30)]), (13, 13, [(0, 5)])]
    case = PagedCase(device, torch.bfloat16, 4, rows, 4, 1)
    num_blocks = case.kv_cache.shape[1]
    buffer = torch.randn(num_blocks, 3, 2, 4, 1, HEAD_SIZE, device=device).to(torch.bfloat16)
    buffer[:, 2] = case.kv_cache.permute(1, 0, 2, 3, 4)
    case.kv_cache = buffer[:, 2].permute(1, 0, 2, 3, 4)
    limits = [
        lim
        for p, (_, _, spans) in zip(case.positions, rows, strict=True)
        for lim in key_limits_for_spans(p, spans)
    ]
    out = case.run(_C.MASK_LIMITS, torch.tensor(limits, dtype=torch.int32, device=device))
    case.check(out, [mask_spans(p, s, spans) for p, (s, _, spans) in zip(case.positions, rows, strict=True)])


def test_paged_attention_rejects_bad_tables(device):
    case = PagedCase(device, torch.float32, 4, [(9, 3, [])], 2, 1)
    # A seq_len past the table's capacity.
    case.host_seq_lens[0] = case.host_block_table.shape[1] * 4 + 1
    case.seq_lens = case.host_seq_lens.to(device)
    with pytest.raises(
        ValueError,
        match=r"^paged_attention\(\): seq_lens\[0\] must be in \[0, 20\] "
        r"\(block_table columns \* block_size\), "
        r"got 21$",
    ):
        case.run(_C.MASK_NONE)
    # A reachable block id outside the cache.
    case = PagedCase(device, torch.float32, 4, [(9, 3, [])], 2, 1)
    case.host_block_table[0, 1] = case.kv_cache.shape[1]
    case.block_table = case.host_block_table.to(device)
    with pytest.raises(
        ValueError,
        match=r"^paged_attention\(\): block_table\[0\]\[1\] must be in \[0, num_blocks=8\), got 8$",
    ):
        case.run(_C.MASK_NONE)
    # MASK_LIMITS without key limits; an unknown mask.
    case = PagedCase(device, torch.float32, 4, [(9, 3, [])], 2, 1)
    with pytest.raises(
        ValueError, match=r"^paged_attention\(\): key_limits must be a tensor when mask is 2 \(limits\)$"
    ):
        case.run(_C.MASK_LIMITS, None)
    with pytest.raises(
        ValueError,
        match=r"^paged_attention\(\): mask must be 0 \(none\), 1 \(causal\) or 2 \(limits\), got 7$",
    ):
        case.run(7)
