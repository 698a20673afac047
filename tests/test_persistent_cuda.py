"""The persistent form of the Hopper kernel ('sm90-persist', cuda/attention_sm90_persist.cu):
head 128, unmasked calls whose rows share one query length and one seq_len (or up to 8 rows of
different seq_lens: CFG pairs, a batch of prompts), over caches the
per-chunk TMA producer reads, with at most HP_MAX_WAVES (16) query tiles per multiprocessor and
a last query tile at least half full.
Each CTA walks several query tiles with two Q buffers and one K/V ring, so these tests check
what crosses from one tile to the next -- the ring's slots and phases, the Q buffers, the
zeroed tail of a last V tile -- against the float64 reference, with NaN in every cache slot a
row must not read, and that every other call keeps the one-CTA-per-tile kernel."""

from __future__ import annotations

import pytest
import torch

from diffkv import _C
from test_head_sizes_cuda import _check, _limits, _problem

pytestmark = pytest.mark.gpu

HP_MAX_WAVES = 16  # attention.cu


def _persist_built():
    return torch.cuda.get_device_capability()[0] == 9 and _C.build_info()["attention_kernel"] == "sm90-tma"


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def _call(q, cache, table, qsl, seq, mask, lse=None, key_limits=None):
    out = torch.full_like(q, float("nan"))
    args = (q, cache, table.cuda(), qsl.cuda(), seq.cuda(), key_limits, mask, 128**-0.5, out)
    if lse is None:
        _C.paged_attention(*args, table, qsl, seq)
    else:
        _C.paged_attention_lse(*args, lse, table, qsl, seq)
    return out


@pytest.mark.parametrize(
    ("rows", "query_len", "seq_len", "block", "layout", "heads"),
    [
        (1, 1024, 1024, 16, "nhd", 32),  # 256 tiles: two per CTA on 132 SMs
        (2, 1000, 1000, 16, "hnd", 32),  # partial last query tile and key tile
        (3, 333, 2000, 32, "nhd", 8),  # fewer queries than keys, 72 tiles: one per CTA
        (2, 200, 4000, 4096, "nhd", 8),  # one block per row, its last chunk partly past the row
        (1, 64, 100, 48, "hnd", 8),  # one tile: fewer items than CTAs
        (2, 4096, 4597, 16, "nhd", 32),  # 15-16 tiles per CTA on 132 SMs, a partial last key tile
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_persistent_kernel_matches_the_reference(rows, query_len, seq_len, block, layout, heads, dtype):
    """Unmasked uniform rows run persistent, with and without the LSE; NaN in the slots no row
    reads stays out of the outputs."""
    if not _persist_built():
        pytest.skip("needs the TMA kernels (Hopper, sm_90a build)")
    seq_lens, query_lens = [seq_len] * rows, [query_len] * rows
    q, cache, table, qsl, seq, dense = _problem(
        seq_lens, query_lens, heads, 8, 128, block, dtype, seed=rows + query_len, layout=layout
    )
    limits = _limits(seq_lens, query_lens, "none")
    out = _call(q, cache, table, qsl, seq, _C.MASK_NONE)
    assert _C.last_attention_kernel() == "sm90-persist"
    _check(out, q, qsl, dense, limits, 128**-0.5)
    lse = torch.full((q.shape[0], heads), float("nan"), device="cuda")
    out2 = _call(q, cache, table, qsl, seq, _C.MASK_NONE, lse=lse)
    assert _C.last_attention_kernel() == "sm90-persist"
    assert torch.equal(out, out2)
    _check(out2, q, qsl, dense, limits, 128**-0.5, lse)


def test_a_strided_query_and_output():
    """A query and an output whose token stride is wider than their heads ([T, H * D + 64]
    buffers, NaN in the gap): the TMA maps take the strides, the outputs meet the reference and
    nothing is written in the output's gap."""
    if not _persist_built():
        pytest.skip("needs the TMA kernels (Hopper, sm_90a build)")
    seq_lens, query_lens = [1000] * 2, [1000] * 2
    q, cache, table, qsl, seq, dense = _problem(seq_lens, query_lens, 32, 8, 128, 16, torch.float16, 23)

    def wide():
        return torch.full((q.shape[0], 32 * 128 + 64), float("nan"), device="cuda", dtype=q.dtype)

    q_backing, out_backing = wide(), wide()
    strided_q = q_backing[:, : 32 * 128].view(q.shape[0], 32, 128)
    strided_q.copy_(q)
    out = out_backing[:, : 32 * 128].view(q.shape[0], 32, 128)
    args = (strided_q, cache, table.cuda(), qsl.cuda(), seq.cuda(), None, _C.MASK_NONE, 128**-0.5)
    _C.paged_attention(*args, out, table, qsl, seq)
    assert _C.last_attention_kernel() == "sm90-persist"
    _check(out, q, qsl, dense, _limits(seq_lens, query_lens, "none"), 128**-0.5)
    assert out_backing[:, 32 * 128 :].isnan().all()


@pytest.mark.parametrize("query_len", [1024, 1000])
def test_a_cfg_pair_runs_persistent(query_len):
    """Two rows of one query length over different seq_lens (a CFG pair: a 500- and a
    3,500-token prompt before the same image tokens): each item takes its own row's keys; the
    outputs and the LSE meet the reference, NaN in every slot no row reads staying out."""
    if not _persist_built():
        pytest.skip("needs the TMA kernels (Hopper, sm_90a build)")
    seq_lens, query_lens = [500 + query_len, 3500 + query_len], [query_len] * 2
    q, cache, table, qsl, seq, dense = _problem(seq_lens, query_lens, 32, 8, 128, 16, torch.bfloat16, 29)
    limits = _limits(seq_lens, query_lens, "none")
    lse = torch.full((q.shape[0], 32), float("nan"), device="cuda")
    out = _call(q, cache, table, qsl, seq, _C.MASK_NONE, lse=lse)
    assert _C.last_attention_kernel() == "sm90-persist"
    _check(out, q, qsl, dense, limits, 128**-0.5, lse)
    # the longer row first: the items' order, not the rows', decides which CTA takes what
    swapped = _problem(seq_lens[::-1], query_lens, 32, 8, 128, 16, torch.bfloat16, 31)
    out2 = _call(*swapped[:5], _C.MASK_NONE)
    assert _C.last_attention_kernel() == "sm90-persist"
    _check(out2, swapped[0], swapped[3], swapped[5], _limits(seq_lens[::-1], query_lens, "none"), 128**-0.5)


@pytest.mark.parametrize(
    ("seq_lens", "query_len", "heads"),
    [
        ([1524, 2524, 3524, 4524], 1024, 32),  # two CFG pairs of different prompts
        ([2100, 700, 1500, 1300, 2900, 900, 1700, 2500], 640, 8),  # 8 rows: every row's seq_len
        ([1000, 200, 3000], 1000, 32),  # a row with fewer keys than queries; half-full tiles
        ([100, 100, 100, 100], 1024, 32),  # 1,024 items of one partial key tile, ~8 a CTA
        ([100, 1000, 128, 300], 1024, 32),  # one-tile items between longer ones, both orders
        ([300, 64, 1200, 128], 1024, 32),
    ],
)
def test_rows_of_one_query_length_over_different_keys(seq_lens, query_len, heads):
    """Up to 8 rows of one query length over different seq_lens run persistent, each item taking
    its own row's keys (the rows' seq_lens passed by value, the row found from the item's
    index): outputs and LSE meet the reference, NaN in every slot no row reads staying out.
    With one-key-tile rows a one-tile item's only Q K^T comes in the tail of the item before and
    its only P V in its own tail, so the Q buffers and the ring's slots turn over once a tile."""
    if not _persist_built():
        pytest.skip("needs the TMA kernels (Hopper, sm_90a build)")
    rows = len(seq_lens)
    query_lens = [query_len] * rows
    q, cache, table, qsl, seq, dense = _problem(seq_lens, query_lens, heads, 8, 128, 16, torch.bfloat16, rows)
    lse = torch.full((q.shape[0], heads), float("nan"), device="cuda")
    out = _call(q, cache, table, qsl, seq, _C.MASK_NONE, lse=lse)
    assert _C.last_attention_kernel() == "sm90-persist"
    _check(out, q, qsl, dense, _limits(seq_lens, query_lens, "none"), 128**-0.5, lse)


def test_the_one_cta_per_tile_kernel_gives_the_same_bits():
    """The persistent kernel computes each tile as the kernel it stands in for: two uniform
    rows run persistent, the same two rows with a shorter third one 'sm90-tma16', and the two
    rows' outputs are bit-identical."""
    if not _persist_built():
        pytest.skip("needs the TMA kernels (Hopper, sm_90a build)")
    q, cache, table, qsl, seq, dense = _problem(
        [1500, 1500, 700], [1000, 1000, 300], 32, 8, 128, 16, torch.bfloat16, 5
    )
    out3 = _call(q, cache, table, qsl, seq, _C.MASK_NONE)
    assert _C.last_attention_kernel() == "sm90-tma16"
    out2 = _call(q[:2000], cache, table[:2], qsl[:3], seq[:2], _C.MASK_NONE)
    assert _C.last_attention_kernel() == "sm90-persist"
    assert torch.equal(out2, out3[:2000])
    _check(out2, q[:2000], qsl[:3], dense[:2], _limits([1500] * 2, [1000] * 2, "none"), 128**-0.5)


def test_a_denoise_span_over_the_whole_query_runs_persistent():
    """HunyuanImage-3.0's denoise step over short rows: two rows of a 512-token prompt and 1,024
    image tokens, the image span covering the step's queries.  The plan says every query sees
    all keys, ops.plan_mask gives MASK_NONE and the call runs persistent, bit-identical to the
    same call under the plan's key limits (the one-CTA-per-tile kernel's LIMITS form)."""
    if not _persist_built():
        pytest.skip("needs the TMA kernels (Hopper, sm_90a build)")
    from diffkv import build_paged_piecewise_plan, ops

    prompt, image = 512, 1024
    seq_lens, query_lens = [prompt + image] * 2, [image] * 2
    q, cache, table, qsl, seq, dense = _problem(seq_lens, query_lens, 32, 8, 128, 16, torch.bfloat16, 17)
    plan = build_paged_piecewise_plan(
        [[(prompt, prompt + image)]] * 2, [prompt] * 2, query_lens, seq_lens, device="cuda"
    )
    mask, key_limits = ops.plan_mask(plan)
    assert plan.all_keys_visible and mask == _C.MASK_NONE and key_limits is None
    out = _call(q, cache, table, qsl, seq, mask)
    assert _C.last_attention_kernel() == "sm90-persist"
    limited = _call(q, cache, table, qsl, seq, _C.MASK_LIMITS, key_limits=plan.key_limits)
    assert _C.last_attention_kernel() == "sm90-tma16"
    assert torch.equal(out, limited)
    _check(out, q, qsl, dense, _limits(seq_lens, query_lens, "none"), 128**-0.5)


def test_other_calls_keep_the_one_cta_per_tile_kernel():
    """Masked calls, more tiles than HP_MAX_WAVES per SM, a last query tile under half full and calls
    captured into a CUDA graph (which replays the launch's parameters while the device metadata
    may change) take 'sm90-tma16'; a captured call still meets the reference on replay."""
    if not _persist_built():
        pytest.skip("needs the TMA kernels (Hopper, sm_90a build)")
    seq_lens, query_lens = [1024, 1024], [1024, 1024]
    q, cache, table, qsl, seq, dense = _problem(seq_lens, query_lens, 32, 8, 128, 16, torch.bfloat16, 9)
    for mask, name in ((_C.MASK_CAUSAL, "causal"), (_C.MASK_LIMITS, "limits")):
        limits = _limits(seq_lens, query_lens, name)
        kl = torch.cat(limits).cuda() if mask == _C.MASK_LIMITS else None
        out = _call(q, cache, table, qsl, seq, mask, key_limits=kl)
        assert _C.last_attention_kernel() == "sm90-tma16"
        _check(out, q, qsl, dense, limits, 128**-0.5)

    # the tile count, 32 heads x 2 rows x ceil(query_len / 128), against HP_MAX_WAVES x SMs (the
    # persistent kernel's reference check at 16 tiles per SM is the HunyuanImage case above)
    per_row = HP_MAX_WAVES * _sms() // 64
    for n, want in ((128 * per_row, "sm90-persist"), (128 * (per_row + 1), "sm90-tma16")):
        q1, cache1, table1, qsl1, seq1, _ = _problem([n, n], [n, n], 32, 8, 128, 16, torch.bfloat16, 11)
        out = _call(q1, cache1, table1, qsl1, seq1, _C.MASK_NONE)
        assert _C.last_attention_kernel() == want
        assert not out.isnan().any()

    # more rows than the host passes seq_lens for (DK_ROW_SEQ_LENS, 8), of different seq_lens
    seqs9 = [300 + 50 * r for r in range(9)]
    q9, cache9, table9, qsl9, seq9, dense9 = _problem(seqs9, [256] * 9, 8, 2, 128, 16, torch.bfloat16, 12)
    out = _call(q9, cache9, table9, qsl9, seq9, _C.MASK_NONE)
    assert _C.last_attention_kernel() == "sm90-tma16"
    _check(out, q9, qsl9, dense9, _limits(seqs9, [256] * 9, "none"), 128**-0.5)

    # a last query tile under half full (4097 queries: one row) stays on sm90-tma16
    q2, cache2, table2, qsl2, seq2, dense2 = _problem(
        [4097] * 2, [4097] * 2, 32, 8, 128, 16, torch.bfloat16, 13
    )
    out = _call(q2, cache2, table2, qsl2, seq2, _C.MASK_NONE)
    assert _C.last_attention_kernel() == "sm90-tma16"
    assert not out.isnan().any()

    limits = _limits(seq_lens, query_lens, "none")
    args = (q, cache, table.cuda(), qsl.cuda(), seq.cuda(), None, _C.MASK_NONE, 128**-0.5)
    out = torch.full_like(q, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _C.paged_attention(*args, out, table, qsl, seq)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _C.paged_attention(*args, out, table, qsl, seq)
    assert _C.last_attention_kernel() == "sm90-tma16"
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, q, qsl, dense, limits, 128**-0.5)
