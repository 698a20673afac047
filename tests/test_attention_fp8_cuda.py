"""Paged attention over a float8_e4m3fn cache on CUDA: the Hopper e4m3 kernel ("sm90-fp8") and
the mma.sync kernels' fp8 form ("sm80-fp8", the kernel choice sm80: what an A100 runs).

Both products run on e4m3 tensor cores: Q is rounded to e4m3 with one scale per (token, head)
(the larger of its L1 norm / 128 and its largest magnitude / 448: S = Q K^T accumulates in f16,
under 61,020 whatever the keys), P as 2^8 p.  The reference is float64 over the dequantized cache
(``e4m3 * scale``) and over Q rounded as the kernel documents it (``reference.e4m3_rows``), so what is
left between them is P's rounding to e4m3: a relative error of at most 2^-4 per probability
(RMS about 2^-4 / sqrt(3) / 1.5 over uniformly spread mantissas) that averages incoherently over
the keys -- the output's relative L2 error stays near 0.02.  The tolerance is 2^-4 relative L2
and 2^-2 of the largest output for any element; the test data's scores spread with a standard
deviation of about 3, so a k_scale 10 % off (a different temperature) or a v_scale 10 % off
fails both (``test_a_wrong_scale_fails_the_tolerance``).

The sm80 form widens the e4m3 K/V to fp16 exactly and keeps Q in fp16 (bf16 queries times one
power of two per CTA: exact for every value within 2^39 of the tile's largest), P in fp16: its
reference is float64 over the dequantized cache and the query as it is, and what is left is P's
rounding to fp16 (2^-11 relative) and the output's to bf16 (2^-9): tolerances 2^-8 relative L2
and 2^-6 of the largest output, which a scale 10 % off fails as well."""

from __future__ import annotations

import math
import os

import pytest
import torch

from _helpers import mma_kernel_name
from diffkv import _C
from reference import dense_kv_from_cache, e4m3_rows, mask_causal, mask_key_limits, mask_none, ref_attention

pytestmark = pytest.mark.gpu

F8 = torch.float8_e4m3fn
REL_L2 = 2.0**-4
REL_MAX = 2.0**-2
SM80_REL_L2 = 2.0**-8
SM80_REL_MAX = 2.0**-6


def _layout(values: torch.Tensor, layout: str) -> torch.Tensor:
    """values ``[2, blocks, block, Hkv, D]`` in a cache layout (same logical shape)."""
    if layout == "hnd":
        return values.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    if layout == "block_major":
        return values.permute(1, 0, 2, 3, 4).contiguous().permute(1, 0, 2, 3, 4)
    return values.contiguous()


def _problem(rows, heads, kv_heads, size, block, layout, per_head, dtype, seed):
    """A paged fp8 problem on CUDA: (query, cache, table, starts, lens, k_scale, v_scale) with
    e4m3 K/V spread over the format's range, scores of standard deviation about 3."""
    gen = torch.Generator().manual_seed(seed)
    cols = max(-(-s // block) for _, s in rows)
    blocks = len(rows) * cols + 3
    codes = (torch.randn(2, blocks, block, kv_heads, size, generator=gen) * 60).clamp(-448, 448).to(F8)
    cache = _layout(codes, layout).cuda()
    table = torch.randperm(blocks, generator=gen)[: len(rows) * cols].view(len(rows), cols).int()
    starts = torch.tensor([0] + list(torch.tensor([q for q, _ in rows]).cumsum(0)), dtype=torch.int32)
    lens = torch.tensor([s for _, s in rows], dtype=torch.int32)
    n = int(starts[-1])
    k_scale = torch.rand(kv_heads if per_head else 1, generator=gen) * 0.01 + 0.005
    v_scale = torch.rand(kv_heads if per_head else 1, generator=gen) * 0.05 + 0.01
    # keys dequantize to about 60 * k_scale; scores of std ~3 under scale = size ** -0.5
    q_std = 3.0 / (60 * float(k_scale.mean()))
    query = (torch.randn(n, heads, size, generator=gen) * q_std).to(dtype).cuda()
    return query, cache, table, starts, lens, k_scale.cuda(), v_scale.cuda()


def _run(query, cache, table, starts, lens, k_scale, v_scale, mode, scale, limits=None, out=None):
    out = torch.full_like(query, float("nan")) if out is None else out
    _C.paged_attention(
        query, cache, table.cuda(), starts.cuda(), lens.cuda(), limits, mode, scale, out, table, starts, lens,
        k_scale, v_scale,
    )  # fmt: skip
    torch.cuda.synchronize()
    return out


def _expected(query, cache, table, starts, lens, k_scale, v_scale, visible_of, scale, round_q=True):
    """float64 attention over the dequantized cache; the query rounded as the Hopper kernel
    rounds it (round_q), else as it is (the sm80 form)."""
    deq = cache.double().cpu()
    deq[0] *= k_scale.double().cpu().view(-1, 1)  # one per tensor or one per KV head
    deq[1] *= v_scale.double().cpu().view(-1, 1)
    q = e4m3_rows(query.cpu()) if round_q else query.double().cpu()
    parts = []
    for r in range(len(lens)):
        lo, hi, seq_len = int(starts[r]), int(starts[r + 1]), int(lens[r])
        k, v = dense_kv_from_cache(deq, table[r], seq_len)
        parts.append(ref_attention(q[lo:hi], k, v, visible_of(r, lo, hi, seq_len), scale))
    return torch.cat(parts)


def _check(out, exact, sm80=False):
    out = out.double().cpu()
    assert torch.isfinite(out).all()
    diff = out - exact
    rel_l2 = (diff.norm() / exact.norm()).item()
    rel_max = (diff.abs().max() / exact.abs().max()).item()
    limits = (SM80_REL_L2, SM80_REL_MAX) if sm80 else (REL_L2, REL_MAX)
    assert rel_l2 <= limits[0] and rel_max <= limits[1], (rel_l2, rel_max)
    return rel_l2


def _visible(mask, limits):
    def of(r, lo, hi, seq_len):
        positions = list(range(seq_len - (hi - lo), seq_len))
        if mask == "none":
            return mask_none(positions, seq_len)
        if mask == "causal":
            return mask_causal(positions, seq_len)
        return mask_key_limits(limits[lo:hi].cpu(), seq_len)

    return of


def _limits(rows, seed):
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randint(max(s - q - 40, 0), s + 1, (q,), generator=gen) for q, s in rows]
    limits = torch.cat(parts).int()
    limits[::17] = 0  # tokens that see no key: zeros
    return limits.cuda()


MODES = {"none": _C.MASK_NONE, "causal": _C.MASK_CAUSAL, "limits": _C.MASK_LIMITS}


@pytest.mark.parametrize("choice", ["auto", "sm80"])
@pytest.mark.parametrize("size", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["none", "causal", "limits"])
@pytest.mark.parametrize(
    ("block", "layout", "per_head"),
    [
        (16, "contiguous", False),
        (1, "contiguous", True),
        (16, "hnd", True),
        (64, "block_major", False),
        (8, "contiguous", False),
        (24, "hnd", True),
    ],
)
def test_fp8_attention_matches_the_reference(
    attention_kernel, choice, size, dtype, mask, block, layout, per_head
):
    """Both kernels: the Hopper e4m3 kernel (auto on the H200) and the mma.sync kernels' fp8 form
    (the kernel choice sm80), each against its own reference and tolerance."""
    attention_kernel(choice)
    sm80 = choice == "sm80"
    rows = [(300, 700), (129, 129), (1, 333), (64, 900)]
    heads, kv_heads = 8, 2
    prob = _problem(rows, heads, kv_heads, size, block, layout, per_head, dtype, seed=size + block)
    limits = _limits(rows, 5) if mask == "limits" else None
    scale = size**-0.5
    out = _run(*prob, MODES[mask], scale, limits)
    # Hopper: TMA boxes of 16-key chunks with blocks of a multiple of 16 keys, of 8-key chunks
    # with blocks of an odd multiple of 8, else cp.async
    hopper = "sm90-fp8-tma" if block % 8 == 0 else "sm90-fp8"
    assert _C.last_attention_kernel() == (
        mma_kernel_name(size, fp8=True, max_query_len=300) if sm80 else hopper
    )
    _check(out, _expected(*prob, _visible(mask, limits), scale, round_q=not sm80), sm80)


# Every CUDA head size has an e4m3 form; 64 and 128 also the Hopper e4m3 kernel (above).
FP8_HEADS = list(_C.supported_head_sizes("cuda", "bfloat16", "float8_e4m3fn")) if _C.cuda_compiled() else []


@pytest.mark.parametrize("size", [d for d in FP8_HEADS if d not in (64, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["none", "causal", "limits"])
@pytest.mark.parametrize(
    ("block", "layout", "per_head"), [(16, "contiguous", False), (1, "hnd", True), (48, "block_major", True)]
)
def test_sm80_fp8_every_head_size_matches_the_reference(
    attention_kernel, size, dtype, mask, block, layout, per_head
):
    """Head sizes other than 64 and 128 over an fp8 cache run the mma.sync kernel's e4m3 form on
    every GPU, Hopper included (no e4m3 wgmma kernel there): against the float64 reference over
    the dequantized cache, within the sm80 form's tolerances."""
    attention_kernel("auto")
    rows = [(300, 700), (129, 129), (1, 333), (64, 900)]
    prob = _problem(rows, 8, 2, size, block, layout, per_head, dtype, seed=size + block)
    limits = _limits(rows, 5) if mask == "limits" else None
    scale = size**-0.5
    out = _run(*prob, MODES[mask], scale, limits)
    assert _C.last_attention_kernel() == mma_kernel_name(size, fp8=True, max_query_len=300)
    _check(out, _expected(*prob, _visible(mask, limits), scale, round_q=False), sm80=True)


# Rows whose longest query row leaves its last 256-row tile empty (512), more than half full
# (400) and half full (384): the first two run the wide e4m3 form at an H100's full tiles.
WIDE_ROWS = {
    "512": [(512, 900), (200, 333)],
    "400": [(400, 700), (1, 50)],
    "384": [(384, 1000), (37, 37)],
}


@pytest.mark.parametrize("size", [64, 72, 128, 160])
@pytest.mark.parametrize("rows", list(WIDE_ROWS))
@pytest.mark.parametrize("mask", ["none", "causal", "limits"])
def test_sm80_fp8_wide_form_matches_the_reference(attention_kernel, size, rows, mask):
    """The mma.sync kernel's e4m3 form of eight warps and 256 query rows a CTA ("sm80-fp8-wide",
    one CTA an SM, each K/V tile widened once for all of them) where the call's last query tile
    says so (``mma_kernel_name``), and the four-warp form where not: against the float64
    reference over the dequantized cache, per-head scales, an HND cache, GQA."""
    attention_kernel("sm80")
    r = WIDE_ROWS[rows]
    prob = _problem(r, 8, 2, size, 16, "hnd", True, torch.bfloat16, seed=size + int(rows))
    limits = _limits(r, 5) if mask == "limits" else None
    scale = size**-0.5
    out = _run(*prob, MODES[mask], scale, limits)
    assert _C.last_attention_kernel() == mma_kernel_name(size, fp8=True, max_query_len=r[0][0])
    _check(out, _expected(*prob, _visible(mask, limits), scale, round_q=False), sm80=True)


def test_the_wide_form_follows_the_last_query_tile_at_the_full_tiles(attention_kernel):
    """At an H100's or H200's shared memory (two four-warp CTAs of the full tiles an SM) and no
    DIFFKV_MMA_WIDE: the e4m3 form runs wide where the call's last 256-row tile is empty or more
    than half full (HunyuanImage's 4,097 queries: not), but never at head 32."""
    per_sm = torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor
    if os.environ.get("DIFFKV_MMA_WIDE") or os.environ.get("DIFFKV_MMA_SMEM_KB") or per_sm < 200 * 1024:
        pytest.skip("needs a GPU of at least 200 KB of shared memory per SM, planned as it is")
    attention_kernel("sm80")
    for size, queries, wide in [
        (128, 512, True),
        (128, 400, True),
        (128, 384, False),
        (64, 4097, False),
        (72, 700, True),
        (32, 512, False),
    ]:
        prob = _problem(
            [(queries, queries + 10)], 2, 1, size, 16, "contiguous", False, torch.bfloat16, seed=queries
        )
        _run(*prob, _C.MASK_NONE, size**-0.5)
        assert _C.last_attention_kernel() == ("sm80-fp8-wide" if wide else "sm80-fp8"), (size, queries)


@pytest.mark.parametrize("block", [16, 8])
def test_a_query_tile_without_keys_lets_its_first_copies_land(attention_kernel, block):
    """The TMA form may bring a CTA's first K and V tile in for the row's keys before the key
    limits say which the CTA's rows see.  A CTA whose 128 rows see no key has no tile to wait
    for: it must still let such copies land before it ends, and keep them out of its output rows
    (zeros, through the staging slots).  Rows 0-127 see nothing, the others their limits; the
    call twice (copies landing after a CTA's end would corrupt a later CTA's shared memory); boxes
    of 16 and of 8 keys."""
    attention_kernel("auto")
    rows = [(300, 700)]
    prob = _problem(rows, 8, 2, 128, block, "contiguous", False, torch.bfloat16, seed=31)
    limits = _limits(rows, 6)
    limits[:128] = 0
    exact = _expected(*prob, _visible("limits", limits), 128**-0.5)
    for _ in range(2):
        out = _run(*prob, _C.MASK_LIMITS, 128**-0.5, limits)
        assert _C.last_attention_kernel() == "sm90-fp8-tma"
        assert (out[:128] == 0).all()
        _check(out, exact)


@pytest.mark.parametrize("block", [16, 8, 4])
def test_a_query_tile_of_at_most_64_rows_runs_one_consumer_warpgroup(attention_kernel, block):
    """A CTA's 128 query rows go to two consumer warpgroups of 64; where the tile's rows end
    within the first 64 (a row's last tile: 4,097 queries leave one row) the second warpgroup
    has nothing to compute and leaves at once, and the producer's slots are released by the
    first alone.  Rows ending at 64 and 65 into a tile, in a row's only tile and its third, both
    producers (blocks of 16 and 8: TMA boxes of 16 and 8 keys; of 4: cp.async), called twice."""
    attention_kernel("auto")
    rows = [(64, 500), (65, 500), (192, 700), (193, 300), (1, 260)]
    prob = _problem(rows, 8, 2, 128, block, "contiguous", False, torch.bfloat16, seed=41 + block)
    exact = _expected(*prob, _visible("causal", None), 128**-0.5)
    for _ in range(2):
        out = _run(*prob, _C.MASK_CAUSAL, 128**-0.5)
        assert _C.last_attention_kernel() == ("sm90-fp8-tma" if block % 8 == 0 else "sm90-fp8")
        _check(out, exact)


@pytest.mark.parametrize("factor", [1e5, 1e-25])
def test_sm80_fp8_takes_bf16_queries_outside_fp16s_range(attention_kernel, factor):
    """bf16 queries 1e5 times larger (fp16 overflows at 65504) or 1e-25 times smaller (fp16
    flushes under 2^-24) than usual, the key scale divided by the same factor: the same scores,
    the same outputs -- the sm80 form's power of two per Q tile keeps them in fp16's range."""
    attention_kernel("sm80")
    rows = [(200, 500), (60, 60)]
    query, cache, table, starts, lens, k_scale, v_scale = _problem(
        rows, 4, 2, 128, 16, "contiguous", True, torch.bfloat16, seed=21
    )
    query = (query.float() * factor).to(torch.bfloat16)
    k_scale = k_scale / factor
    prob = (query, cache, table, starts, lens, k_scale, v_scale)
    out = _run(*prob, _C.MASK_CAUSAL, 128**-0.5)
    _check(out, _expected(*prob, _visible("causal", None), 128**-0.5, round_q=False), sm80=True)


def test_sm80_fp8_nan_codes_reach_the_rows_that_read_them(attention_kernel):
    """An e4m3 NaN code (0x7F / 0xFF) in K or V makes the output of every row that sees that key
    NaN, as the reference's dequantized NaN does (sm_80's shift-and-mask widening sets the code
    apart); rows of other batch entries stay exact."""
    attention_kernel("sm80")
    rows = [(50, 100), (50, 100), (50, 100)]
    prob = _problem(rows, 4, 2, 128, 16, "contiguous", False, torch.bfloat16, seed=13)
    query, cache, table, starts, lens, k_scale, v_scale = prob
    codes = cache.view(torch.uint8)
    codes[0, int(table[0, 2]), 5, 1] = 0x7F  # a key of row 0, kv head 1
    codes[1, int(table[1, 4]), 9, 0] = 0xFF  # a value of row 1, kv head 0
    out = _run(*prob, _C.MASK_NONE, 128**-0.5).double().cpu()
    assert torch.isnan(out[0:50, 2:4]).all() and torch.isnan(out[50:100, 0:2]).all()
    assert torch.isfinite(out[0:50, 0:2]).all() and torch.isfinite(out[50:100, 2:4]).all()
    exact = _expected(*prob, _visible("none", None), 128**-0.5, round_q=False)
    _check(out[100:], exact[100:], sm80=True)


@pytest.mark.parametrize("choice", ["auto", "sm80"])
@pytest.mark.parametrize("mask", ["none", "causal", "limits"])
@pytest.mark.parametrize(
    ("size", "block", "layout"),
    [
        (128, 16, "contiguous"),
        (128, 16, "hnd"),
        (128, 8, "contiguous"),
        (128, 24, "hnd"),
        (128, 4, "contiguous"),
        (64, 16, "contiguous"),
        (64, 8, "contiguous"),
        (32, 16, "contiguous"),
        (72, 16, "contiguous"),
        (72, 8, "hnd"),
        (80, 1, "contiguous"),
        (96, 48, "hnd"),
        (160, 16, "contiguous"),
        (192, 8, "hnd"),
        (256, 16, "contiguous"),
    ],
)
def test_nan_codes_in_unread_slots_stay_out(attention_kernel, choice, mask, size, block, layout):
    """e4m3 NaN codes in every cache slot that no query of the call reads -- the unused blocks, a
    row's last block past its seq_len and, under key limits, the keys at and past the row's
    largest limit (inside seq_len: a tile a CTA reads only in part) -- leave every output finite
    and equal to the reference over the clean cache (0 * nan is nan: a kernel must zero, not
    weigh, the keys past what its rows see)."""
    attention_kernel(choice)
    sm80 = choice == "sm80" or size not in (64, 128)  # the other sizes' only e4m3 form
    rows = [(150, 700), (300, 1000), (64, 333)]
    prob = _problem(rows, 8, 2, size, block, layout, True, torch.bfloat16, seed=31)
    query, cache, table, starts, lens, k_scale, v_scale = prob
    limits = None
    if mask == "limits":  # every row's largest limit well inside its seq_len
        gen = torch.Generator().manual_seed(31)
        limits = torch.cat([torch.randint(s // 2, s - 90, (q,), generator=gen) for q, s in rows]).int().cuda()
    scale = size**-0.5
    exact = _expected(*prob, _visible(mask, limits), scale, round_q=not sm80)
    read = torch.zeros(cache.shape[1], block, dtype=torch.bool)
    for r, (q, seq_len) in enumerate(rows):
        lo = int(starts[r])
        end = seq_len if limits is None else int(limits[lo : lo + q].clamp(max=seq_len).max())
        keys = torch.arange(end)
        read[table[r].long()[keys // block], keys % block] = True
    blk, tok = (~read).nonzero(as_tuple=True)
    assert len(blk) > 0
    codes = cache.view(torch.uint8)
    codes[:, blk.cuda(), tok.cuda()] = 0x7F
    out = _run(query, cache, table, starts, lens, k_scale, v_scale, MODES[mask], scale, limits)
    _check(out, exact, sm80)


def _rows_for_halves(sms, per_row):
    """(n, m): n rows of `per_row` tiles make a grid whose last wave holds at most half the SMs
    and that has full waves before it; n + m rows make one whose last wave has no halves."""
    n = next(n for n in range(1, 4 * sms) if n * per_row > sms and 0 < n * per_row % sms <= sms // 2)
    m = next(m for m in range(1, 4 * sms) if not 0 < (n + m) * per_row % sms <= sms // 2)
    return n, m


@pytest.mark.parametrize("mask", ["none", "causal", "limits"])
@pytest.mark.parametrize("block", [16, 4])
def test_the_last_waves_tiles_run_as_halves_with_the_same_bits(attention_kernel, mask, block):
    """A grid whose last wave of 128-row tiles holds at most half the SMs runs that wave's tiles
    as two CTAs of 64 rows each (h8_split_from).  Rows of 300 queries (tiles of 128, 128 and 44
    rows: the halves include a tile's empty second half), as many as make such a grid: their
    outputs against the reference, and bit for bit against the same rows in a call with rows
    appended, whose grid has no halves (a row's keys, masks and arithmetic do not depend on the
    CTA that takes it).  Both producers (blocks of 16: TMA; 4: cp.async)."""
    attention_kernel("auto")
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    heads = 8
    n, m = _rows_for_halves(sms, heads * 3)
    rows = [(300, 300 + 53 * (i % 7)) for i in range(n + m)]
    big = _problem(rows, heads, 2, 128, block, "contiguous", True, torch.bfloat16, seed=77 + block)
    query, cache, table, starts, lens, k_scale, v_scale = big
    limits = _limits(rows, seed=5) if mask == "limits" else None
    cut = int(starts[n])
    small = (query[:cut].contiguous(), cache, table[:n].contiguous(), starts[: n + 1].contiguous())
    small += (lens[:n].contiguous(), k_scale, v_scale)
    out_small = _run(*small, MODES[mask], 0.1, None if limits is None else limits[:cut].contiguous())
    assert _C.last_attention_kernel() == ("sm90-fp8-tma" if block == 16 else "sm90-fp8")
    _check(out_small, _expected(*small, _visible(mask, limits), 0.1))
    out_big = _run(*big, MODES[mask], 0.1, limits)
    assert torch.equal(out_small, out_big[:cut])


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("block", [16, 48, 80, 272, 512])
def test_both_producers_compute_the_same_bits(mask, block):
    """The TMA producer's boxes of 16 keys (blocks of a multiple of 16 keys), its boxes of 8 keys
    (the same cache seen as 8-key blocks) and the cp.async producer (seen as 4-key blocks) feed
    the same tiles: the outputs are equal bit for bit.  Blocks of 48, 80 and 272 keys do not
    divide the 256-key tiles and 512 spans two, so the TMA producer's block-table column and
    token, stepped a tile at a time, cross blocks at every offset."""
    rows = [(300, 1000), (77, 333), (5, 1300)]
    prob = _problem(rows, 8, 2, 128, block, "contiguous", True, torch.bfloat16, seed=12)
    query, cache, table, starts, lens, k_scale, v_scale = prob
    out16 = _run(*prob, MODES[mask], 0.1)
    assert _C.last_attention_kernel() == "sm90-fp8-tma"

    def split(keys):  # the cache as blocks of `keys` keys, the table to match
        n = block // keys
        parts = cache.view(2, cache.shape[1] * n, keys, *cache.shape[3:])
        table_n = (n * table.unsqueeze(-1) + torch.arange(n, dtype=table.dtype)).flatten(1).int()
        return _run(query, parts, table_n, starts, lens, k_scale, v_scale, MODES[mask], 0.1)

    out8 = split(8)
    assert _C.last_attention_kernel() == "sm90-fp8-tma"
    out4 = split(4)
    assert _C.last_attention_kernel() == "sm90-fp8"
    assert torch.equal(out16, out8)
    assert torch.equal(out16, out4)


@pytest.mark.parametrize("mask", ["none", "causal", "limits"])
@pytest.mark.parametrize(("head", "block"), [(128, 1003), (64, 150), (128, 20)])
def test_rows_of_one_block_take_the_tma_producer_at_any_block_size(mask, head, block):
    """A table of one column (every row one block: the dense forward's rows) takes the TMA
    producer's 16-key boxes at any block size from 16 -- a chunk never crosses into another block,
    and the last chunk's keys past the block arrive as zeros -- and computes the bits the cp.async
    producer computes over the same cache seen as one-key blocks."""
    rows = [(min(300, block), block), (min(77, block // 2 + 1), block // 2 + 1), (5, 17)]
    prob = _problem(rows, 8, 2, head, block, "contiguous", True, torch.bfloat16, seed=block + head)
    query, cache, table, starts, lens, k_scale, v_scale = prob
    assert table.shape[1] == 1
    limits = _limits(rows, 7) if mask == "limits" else None
    out = _run(*prob, MODES[mask], head**-0.5, limits)
    assert _C.last_attention_kernel() == "sm90-fp8-tma"
    _check(out, _expected(*prob, _visible(mask, limits), head**-0.5))
    ones = cache.view(2, cache.shape[1] * block, 1, *cache.shape[3:])
    table1 = (block * table.long() + torch.arange(block)).int()
    out1 = _run(query, ones, table1, starts, lens, k_scale, v_scale, MODES[mask], head**-0.5, limits)
    assert _C.last_attention_kernel() == "sm90-fp8"
    assert torch.equal(out, out1)


@pytest.mark.parametrize("choice", ["auto", "sm80"])
def test_a_wrong_scale_fails_the_tolerance(attention_kernel, choice):
    """The tolerance is tight enough to see a scale 10 % off."""
    attention_kernel(choice)
    sm80 = choice == "sm80"
    rows = [(256, 1024)]
    prob = _problem(rows, 4, 4, 128, 16, "contiguous", False, torch.bfloat16, seed=1)
    query, cache, table, starts, lens, k_scale, v_scale = prob
    out = _run(*prob, _C.MASK_NONE, 128**-0.5)
    visible = _visible("none", None)
    _check(out, _expected(*prob, visible, 128**-0.5, round_q=not sm80), sm80)
    for k_f, v_f in ((1.1, 1.0), (1.0, 1.1)):
        scales = (k_scale * k_f, v_scale * v_f)
        wrong = _expected(query, cache, table, starts, lens, *scales, visible, 128**-0.5, round_q=not sm80)
        with pytest.raises(AssertionError):
            _check(out, wrong, sm80)


def test_strided_query_and_output_and_one_tile_rows():
    """A query view of a fused QKV projection, an output with padded rows."""
    rows = [(5, 5), (200, 450)]
    prob = _problem(rows, 4, 1, 128, 16, "contiguous", False, torch.bfloat16, seed=9)
    query, cache, table, starts, lens, k_scale, v_scale = prob
    fused = torch.randn(query.shape[0], 3, 4, 128, dtype=torch.bfloat16, device="cuda")
    fused[:, 0] = query
    strided_q = fused[:, 0]
    out_store = torch.full((query.shape[0], 4, 130), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = out_store[:, :, :128]
    _run(strided_q, cache, table, starts, lens, k_scale, v_scale, _C.MASK_CAUSAL, 128**-0.5, out=out)
    _check(out, _expected(*prob, _visible("causal", None), 128**-0.5))
    assert torch.isnan(out_store[:, :, 128:]).all()


def test_query_rows_of_almost_zeros_attend_uniformly():
    """A (token, head) row whose L1 norm is under 1e-30 is rounded as zeros (128 / l1 would
    overflow, and 0 * inf is nan): its output is the mean of the visible values."""
    rows = [(40, 300)]
    prob = _problem(rows, 4, 2, 128, 16, "contiguous", False, torch.bfloat16, seed=8)
    query, cache, table, starts, lens, k_scale, v_scale = prob
    query[:7] *= 1e-33
    out = _run(*prob, _C.MASK_NONE, 128**-0.5)
    _check(out, _expected(*prob, _visible("none", None), 128**-0.5))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k_scale", [4096.0, 2.0**28])
def test_multipliers_past_f16s_range_take_the_big_softmax_form(ties, k_scale):
    """A row's exponent multiplier (softmax scale x log2 e x k_scale x Q's row scale) past 32,752
    does not fit the f16 softmax's 2 sc: that warpgroup takes the kernel's BIG form.  Here it is
    ~4.6 x 10^4, and with k_scale 2^28 ~3 x 10^9, past the form's 2^31 step (Q's rows one-hot at
    1000, so Q's row scale is 1000 / 128; scale 1): scores one code step apart differ by
    thousands in log2 units, so each row's output is the mean of the V rows of its largest keys
    (one or a few where codes round alike; two set apart with `ties`).  Through the f16 form,
    2 sc would be infinite there and the outputs nan."""
    prob = _problem([(8, 100), (3, 37)], 4, 2, 128, 16, "contiguous", False, torch.bfloat16, seed=21)
    query, cache, table, starts, lens, _, v_scale = prob
    query.zero_()
    query[..., 0] = 1000.0  # q8 = 128 on dim 0: S = 128 k8[dim 0], exact in f16
    keys = cache[0].float().cpu()
    # dim 0 of the keys: 1 / 64 .. 100 / 64, rounded to e4m3
    for r in range(len(lens)):
        for j in range(int(lens[r])):
            b, t = int(table[r, j // 16]), j % 16
            keys[b, t, :, 0] = (((j * 37) % 100) + 1) / 64.0
        if ties:  # the row's last two keys share the largest code
            for j in (int(lens[r]) - 2, int(lens[r]) - 1):
                keys[int(table[r, j // 16]), j % 16, :, 0] = 2.0
    cache[0] = keys.to(F8).cuda()
    k_scale = torch.full((1,), k_scale, device="cuda")
    out = _run(query, cache, table, starts, lens, k_scale, v_scale, _C.MASK_NONE, 1.0)
    exact = _expected(query, cache, table, starts, lens, k_scale, v_scale, _visible("none", None), 1.0)
    out = out.double().cpu()
    assert torch.isfinite(out).all()
    assert ((out - exact).abs() <= 2.0**-8 * exact.abs() + 1e-6).all()


def test_one_row_past_f16s_range_takes_its_warpgroup_to_the_big_form():
    """The BIG form is a warpgroup's choice (wgmma wants every thread of it in the same code), made
    by a vote of each warp over the warpgroup's 64 rows, two a lane.  Here one row of each
    warpgroup has a multiplier past 32,752 -- rows 40 and 100, the second rows that lanes 8 and
    4 read -- and the other rows' are ~300: a vote that missed them would leave those rows to the
    f16 form, whose 2 sc is infinite there (nan outputs).  Keys and tolerance as in the test
    above (one-hot Q at 1000 on dim 0, keys' dim 0 at 1 / 64 .. 100 / 64)."""
    prob = _problem([(128, 200)], 4, 2, 128, 16, "contiguous", False, torch.bfloat16, seed=22)
    query, cache, table, starts, lens, _, v_scale = prob
    big = [40, 100]
    query.mul_(0.01)
    query[big] = 0.0
    query[big, :, 0] = 1000.0
    keys = cache[0].float().cpu()
    for j in range(int(lens[0])):
        keys[int(table[0, j // 16]), j % 16, :, 0] = (((j * 37) % 100) + 1) / 64.0
    cache[0] = keys.to(F8).cuda()
    k_scale = torch.full((1,), 4096.0, device="cuda")
    out = _run(query, cache, table, starts, lens, k_scale, v_scale, _C.MASK_NONE, 1.0)
    exact = _expected(query, cache, table, starts, lens, k_scale, v_scale, _visible("none", None), 1.0)
    out = out.double().cpu()
    assert torch.isfinite(out).all()
    assert ((out[big] - exact[big]).abs() <= 2.0**-8 * exact[big].abs() + 1e-6).all()


@pytest.mark.parametrize("size", [64, 128])
def test_every_key_weighs_its_probability_rounded_to_e4m3(size):
    """Each key's weight in the output is its probability 2^8 p rounded to e4m3, within one e4m3
    step, over exponents from 0 down to -22 (log2 units): the MUFU's and the polynomial's
    columns (h8_exp2_poly: every 4th n-tile of a 256-key tile, keys 24-31, 56-63, ...; its high
    halves' own coefficients included).
    One 256-key tile: Q one-hot (1.0 on dim 0, so Q's row scale is 1 / 128 and q8 = 128), key j's
    dim 0 an e4m3 code k8_j, the multiplier softmax scale x log2 e x k_scale x qs = 31 / 65536
    (exact in f16), so key j's exponent is (k8_j - 352) 31 / 512; V one-hot, kv head h giving key
    h D + d to output dim d.  So output d of head h is P8_j / l (j = h D + d), and its ratio to
    the largest key's (exponent 0, P8 = 2^8 exactly) gives P8_j / 2^8 whatever l is.  A wrong
    exponent (a factor 2) or a polynomial off by more than an e4m3 step fails it."""
    heads = 256 // size
    alpha = 31.0 / 512.0
    top = 77  # the largest key: n-tile 9, an ex2.approx column
    gen = torch.Generator().manual_seed(5)
    golden = 0.6180339887498949
    t_target = torch.tensor([-22.28 * ((j * golden) % 1.0) for j in range(256)], dtype=torch.float64)
    # the codes' spacing: exponent steps of 1.94 at the top, 0.97 below 256, 0.48 below 128, ..
    k8 = (352.0 + t_target / alpha).clamp(-16.0, 352.0).to(F8)
    k8[top] = 352.0
    t = (k8.double() - 352.0) * alpha  # the exponents the codes give
    assert t.min() < -20 and t[top] == 0 and t.max() == 0  # the keys near the top tie with it
    nb = 256 // 16 + 3
    table = torch.randperm(nb, generator=gen)[:16].view(1, 16).int()
    keys = torch.zeros(256, heads, size, dtype=torch.float32)
    keys[:, :, 0] = k8.float()[:, None]
    values = torch.zeros(256, heads, size, dtype=torch.float32)
    for h in range(heads):
        values[torch.arange(h * size, (h + 1) * size), h, torch.arange(size)] = 1.0
    cache = torch.zeros(2, nb, 16, heads, size, dtype=F8)
    for j in range(256):
        b = int(table[0, j // 16])
        cache[0, b, j % 16] = keys[j].to(F8)
        cache[1, b, j % 16] = values[j].to(F8)
    query = torch.zeros(16, heads, size, dtype=torch.bfloat16)
    query[..., 0] = 1.0
    starts = torch.tensor([0, 16], dtype=torch.int32)
    lens = torch.tensor([256], dtype=torch.int32)
    one = torch.ones(1, device="cuda")
    scale = alpha * math.log(2.0)  # scale x log2 e = alpha
    out = _run(query.cuda(), cache.cuda(), table, starts, lens, one, one, _C.MASK_NONE, scale)
    assert _C.last_attention_kernel().startswith("sm90-fp8")
    weights = out.double().cpu().reshape(16, 256)  # [query, key]: key h D + d is head h's dim d
    p8 = 256.0 * weights / weights[:, top : top + 1]
    exact = (2.0 ** (8.0 + t)).to(F8).double()  # 2^8 p rounded to e4m3
    step = torch.where(
        exact >= 2.0**-6, 2.0 ** (torch.floor(torch.log2(exact.clamp(min=2.0**-6))) - 3), 2.0**-9
    )
    assert ((p8 - exact).abs() <= step + 2.0**-7 * exact).all()
    # most weights are the rounded value itself: the exponents' own error moves few across an
    # e4m3 rounding boundary, the polynomial's columns included
    poly = torch.tensor([(j // 8) % 4 == 3 for j in range(256)])  # H8_POLY_EVERY 4
    normal = exact >= 2.0**-6  # e4m3's normal range: 3 mantissa bits
    assert int((poly & normal).sum()) >= 20
    same = (p8 - exact).abs() <= 2.0**-7 * exact
    assert same[:, poly & normal].double().mean() >= 0.8
    assert same[:, ~poly & normal].double().mean() >= 0.8


def test_long_rows_and_gqa_groups():
    rows = [(1024, 5000), (2048, 2048)]
    prob = _problem(rows, 16, 2, 128, 16, "contiguous", True, torch.bfloat16, seed=4)
    out = _run(*prob, _C.MASK_CAUSAL, 128**-0.5)
    _check(out, _expected(*prob, _visible("causal", None), 128**-0.5))


@pytest.mark.parametrize("choice", ["auto", "sm80"])
def test_the_fp8_layer_call_on_cuda_is_write_then_attention(attention_kernel, choice):
    """forward_paged over an fp8 cache on CUDA: the quantizing write then the e4m3 attention, in
    one submission -- the same cache bytes and the same output as the two calls."""
    attention_kernel(choice)
    gen = torch.Generator().manual_seed(3)
    rows = [(40, 300), (7, 77)]
    prob = _problem(rows, 8, 2, 128, 16, "contiguous", True, torch.bfloat16, seed=3)
    query, cache, table, starts, lens, k_scale, v_scale = prob
    n = query.shape[0]
    key = (torch.randn(n, 2, 128, generator=gen) * 0.3).to(torch.bfloat16).cuda()
    value = torch.randn(n, 2, 128, generator=gen).to(torch.bfloat16).cuda()
    slots = []
    for r, (q_len, seq_len) in enumerate(rows):
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(table[r, p // 16]) * 16 + p % 16)
    slots = torch.tensor(slots).cuda()
    separate = cache.clone()
    _C.kv_write(key, value, separate, slots, k_scale, v_scale)
    expected = _run(query, separate, table, starts, lens, k_scale, v_scale, _C.MASK_CAUSAL, 0.1)
    out = torch.full_like(query, float("nan"))
    _C.forward_paged(
        query, key, value, cache, slots, table.cuda(), starts.cuda(), lens.cuda(), None, _C.MASK_CAUSAL, 0.1,
        out, table, starts, lens, k_scale, v_scale,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), separate.view(torch.uint8))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("choice", ["auto", "sm80"])
def test_fp8_attention_replays_in_a_cuda_graph(attention_kernel, choice):
    attention_kernel(choice)
    rows = [(100, 400)]
    prob = _problem(rows, 4, 2, 128, 16, "contiguous", False, torch.bfloat16, seed=6)
    query, cache, table, starts, lens, k_scale, v_scale = prob
    eager = _run(*prob, _C.MASK_NONE, 0.09)
    out = torch.zeros_like(query)
    bt, sl, ln = table.cuda(), starts.cuda(), lens.cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            _C.paged_attention(
                query, cache, bt, sl, ln, None, _C.MASK_NONE, 0.09, out, table, starts, lens, k_scale, v_scale
            )
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    k_scale.mul_(1.5)  # the scales are read on the device at each replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _run(*prob, _C.MASK_NONE, 0.09))
