"""Context-parallel KV (issue 7 item 2): ``_C.paged_attention_lse`` and ``diffkv.parallel_cp``.

- the log-sum-exp of the CPU reference against a float64 reference (every mask, GQA, block
  sizes 1 and 16, random block tables with spare blocks, a row shorter than its query);
- ranks that each hold their interleaved share of every row's KV (``BlockTables`` with
  ``cp_size=2``, ``cp_interleave`` 1 and 4) and merge their ``(out, lse)`` to the
  single-process result, for the three mask modes: in one process (a loop over ranks) and in
  two gloo processes (``torch.distributed``, ``all_gather``);
- every new error message, full text.
"""

from __future__ import annotations

import math

import pytest
import torch

import diffkv
from _helpers import free_port
from diffkv import _C, parallel_cp
from reference import (
    dense_kv_from_cache,
    key_limits_for_spans,
    mask_causal,
    mask_none,
    mask_spans,
    ref_attention,
)

H, HKV, D = 4, 2, 8
SCALE = 1.0 / math.sqrt(D)
MODES = ("none", "causal", "spans")
MASK_OF = {"none": _C.MASK_NONE, "causal": _C.MASK_CAUSAL, "spans": _C.MASK_LIMITS}

# ------------------------------------------------------------------------------------------------
# LSE of the CPU reference
# ------------------------------------------------------------------------------------------------


SMALL_ROWS = {"seq_lens": [23, 7], "query_lens": [5, 7], "spans": [[(19, 22)], [(1, 4)]]}
SMALL_ROWS_SHORT = {"seq_lens": [23, 3], "query_lens": [5, 6], "spans": [[(19, 22)], [(1, 4)]]}


def _lse_problem(block_size, mode, dtype, seed, short_row=False, dims=(H, HKV, D), rows=None):
    """Two rows in a paged cache with a permuted block table and spare blocks; queries are the
    rows' suffixes (bottom-right).  With short_row, row 1 has seq_len < query_len (allowed by
    paged_attention_lse: a rank's local share), queries at positions seq_len - query_len + i.
    dims = (heads, kv heads, head_size); rows overrides the lengths and spans."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_size = dims
    rows = rows or (SMALL_ROWS_SHORT if short_row else SMALL_ROWS)
    seq_lens, query_lens, spans = rows["seq_lens"], rows["query_lens"], rows["spans"]
    cols = max(-(-s // block_size) for s in seq_lens) + 1
    num_blocks = 2 * cols + 3
    perm = torch.randperm(num_blocks, generator=g)[: 2 * cols].to(torch.int32)
    block_table = perm.view(2, cols).contiguous()
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), heads, head_size, generator=g).to(dtype)
    qsl = torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    limits, visibles = [], []
    for r in range(2):
        positions = [seq_lens[r] - query_lens[r] + i for i in range(query_lens[r])]
        if mode == "none":
            visible = mask_none(positions, seq_lens[r])
            limits += [seq_lens[r]] * query_lens[r]
        elif mode == "causal":
            visible = mask_causal(positions, seq_lens[r])
            limits += [p + 1 for p in positions]
        else:
            visible = mask_spans(positions, seq_lens[r], spans[r])
            limits += key_limits_for_spans(positions, spans[r])
        visibles.append(visible)
    key_limits = torch.tensor(limits, dtype=torch.int32)
    return cache, block_table, q, qsl, sl, key_limits, visibles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("short_row", [False, True])
def test_lse_matches_float64_reference(block_size, mode, dtype, short_row):
    cache, bt, q, qsl, sl, kl, visibles = _lse_problem(block_size, mode, dtype, 7 + block_size, short_row)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], H), float("nan"))
    mask = MASK_OF[mode]
    _C.paged_attention_lse(
        q, cache, bt, qsl, sl, kl if mask == 2 else None, mask, SCALE, out, lse, bt, qsl, sl
    )
    for r in range(2):
        t0, t1 = int(qsl[r]), int(qsl[r + 1])
        k, v = dense_kv_from_cache(cache, bt[r], int(sl[r]))
        ref_out, ref_lse = ref_attention(q[t0:t1], k, v, visibles[r], SCALE, lse=True)
        nothing = ~visibles[r].any(dim=1)
        assert torch.equal(torch.isinf(lse[t0:t1]), nothing[:, None].expand(-1, H))
        assert (lse[t0:t1][nothing] == float("-inf")).all()
        assert (out[t0:t1][nothing] == 0).all()
        seen = ~nothing
        assert torch.allclose(lse[t0:t1][seen].double(), ref_lse[seen], atol=1e-5, rtol=1e-5)
        atol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out[t0:t1].double(), ref_out, atol=atol, rtol=atol)
    if not short_row:
        # The output is the very paged_attention output.
        plain = torch.empty_like(q)
        _C.paged_attention(q, cache, bt, qsl, sl, kl if mask == 2 else None, mask, SCALE, plain, bt, qsl, sl)
        assert torch.equal(plain, out)


def test_lse_strided_output():
    cache, bt, q, qsl, sl, kl, _ = _lse_problem(16, "spans", torch.float32, 3)
    lse_t = torch.zeros(H, q.shape[0])
    lse = torch.zeros(q.shape[0], H)
    out = torch.empty_like(q)
    _C.paged_attention_lse(q, cache, bt, qsl, sl, kl, 2, SCALE, out, lse, None, None, None)
    _C.paged_attention_lse(q, cache, bt, qsl, sl, kl, 2, SCALE, out, lse_t.T, None, None, None)
    assert torch.equal(lse_t.T, lse)


# ------------------------------------------------------------------------------------------------
# Context-parallel ranks built through BlockTables
# ------------------------------------------------------------------------------------------------

BLOCK_SIZE = 4
SEQ_LENS = [37, 14, 21]
QUERY_LENS = [9, 14, 5]
SPANS = [[(28, 33), (35, 37)], [(0, 6), (8, 12)], [(16, 21)]]


def _scenario(seed, dtype=torch.float32):
    """Global K/V of every row, the queries (each row's suffix) and the mask inputs."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(s, HKV, D, generator=g).to(dtype) for s in SEQ_LENS]
    values = [torch.randn(s, HKV, D, generator=g).to(dtype) for s in SEQ_LENS]
    q = torch.randn(sum(QUERY_LENS), H, D, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(QUERY_LENS).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor(SEQ_LENS, dtype=torch.int32)
    limits = []
    for r, (s, n) in enumerate(zip(SEQ_LENS, QUERY_LENS, strict=True)):
        limits += key_limits_for_spans(range(s - n, s), SPANS[r])
    return keys, values, q, qsl, sl, torch.tensor(limits, dtype=torch.int32)


def _rank_cache(keys, values, cp_size, cp_rank, cp_interleave, seed):
    """This rank's paged cache and gathered block table: BlockTables with the rank's cp
    settings gives every global position its slot (-1 where another rank holds it), rows get
    randomly permuted block ids with spare blocks, and one kv_write stores the local share."""
    rows = len(keys)
    blocks_per_row = [-(-len(k) // (BLOCK_SIZE * cp_size)) for k in keys]
    num_blocks = sum(blocks_per_row) + 3
    tables = diffkv.BlockTables(
        [BLOCK_SIZE],
        max_num_reqs=rows,
        max_num_batched_tokens=256,
        max_num_blocks_per_group=max(blocks_per_row) + 1,
        device="cpu",
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
    )
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + cp_rank)).tolist()
    for r, n in enumerate(blocks_per_row):
        tables.append_block_ids(r, [ids[:n]])
        ids = ids[n:]
    row_indices = torch.arange(rows, dtype=torch.int32)
    lens = [len(k) for k in keys]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens]).to(torch.int64)
    slots = tables.compute_slot_mappings(row_indices, qsl, positions, positions.shape[0])[0].clone()
    local = int((slots >= 0).sum())
    assert local == sum(
        int(
            parallel_cp.local_key_limits(
                torch.tensor([n], dtype=torch.int32), cp_size, cp_rank, cp_interleave
            )
        )
        for n in lens
    )
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, HKV, D, dtype=keys[0].dtype)
    _C.kv_write(torch.cat(keys), torch.cat(values), cache, slots)
    block_table = tables.gather_block_tables(row_indices, rows)[0].clone()
    return cache, block_table


def _single_process(keys, values, q, qsl, sl, key_limits, mode):
    """The cp_size=1 result: the whole KV in one cache, plain paged_attention."""
    cache, bt = _rank_cache(keys, values, 1, 0, 1, seed=99)
    out = torch.empty_like(q)
    mask = MASK_OF[mode]
    _C.paged_attention(
        q, cache, bt, qsl, sl, key_limits if mask == 2 else None, mask, SCALE, out, bt, qsl, sl
    )
    return out


def _float64_reference(keys, values, q, qsl, mode):
    outs = []
    for r, (s, n) in enumerate(zip(SEQ_LENS, QUERY_LENS, strict=True)):
        positions = list(range(s - n, s))
        visible = {"none": mask_none, "causal": mask_causal}.get(mode)
        visible = visible(positions, s) if visible else mask_spans(positions, s, SPANS[r])
        outs.append(ref_attention(q[int(qsl[r]) : int(qsl[r + 1])], keys[r], values[r], visible, SCALE))
    return torch.cat(outs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp_interleave", [1, 4])
@pytest.mark.parametrize("cp_size", [2, 3])
def test_cp_simulated_ranks_match_single_process(mode, cp_interleave, cp_size):
    """In one process: each rank's partial attention over its share, merged by combine()."""
    keys, values, q, qsl, sl, key_limits = _scenario(5)
    partials = []
    for rank in range(cp_size):
        cache, bt = _rank_cache(keys, values, cp_size, rank, cp_interleave, seed=11)
        partials.append(
            parallel_cp.attention_partial(
                q,
                cache,
                bt,
                qsl,
                sl,
                MASK_OF[mode],
                SCALE,
                key_limits,
                cp_size=cp_size,
                cp_rank=rank,
                cp_interleave=cp_interleave,
            )
        )
    out, lse = parallel_cp.combine([p[0] for p in partials], [p[1] for p in partials])
    expected = _single_process(keys, values, q, qsl, sl, key_limits, mode)
    assert torch.allclose(out, expected, atol=2e-6, rtol=1e-5)
    assert torch.allclose(out.double(), _float64_reference(keys, values, q, qsl, mode), atol=1e-5)
    # The merged lse is the lse of the whole row.
    whole = torch.empty_like(q)
    lse_whole = torch.empty(q.shape[0], H)
    cache, bt = _rank_cache(keys, values, 1, 0, 1, seed=99)
    limits = parallel_cp.global_key_limits(qsl, sl, MASK_OF[mode], key_limits)
    _C.paged_attention_lse(q, cache, bt, qsl, sl, limits, 2, SCALE, whole, lse_whole, None, None, None)
    assert torch.allclose(lse, lse_whole, atol=1e-5, rtol=1e-5)


def test_cp_partial_of_a_rank_that_sees_nothing():
    """Rank 1 of cp_size 2 (interleave 4) holds positions 4..7, 12..15, ...: the causal queries
    at positions 0..3 see none of its keys, so its lse is -inf there and combine ignores it."""
    g = torch.Generator().manual_seed(1)
    keys = [torch.randn(4, HKV, D, generator=g)]
    values = [torch.randn(4, HKV, D, generator=g)]
    q = torch.randn(4, H, D, generator=g)
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    sl = torch.tensor([4], dtype=torch.int32)
    partials = []
    for rank in range(2):
        cache, bt = _rank_cache(keys, values, 2, rank, 4, seed=3)
        partials.append(
            parallel_cp.attention_partial(
                q, cache, bt, qsl, sl, _C.MASK_CAUSAL, SCALE, cp_size=2, cp_rank=rank, cp_interleave=4
            )
        )
    assert (partials[1][1] == float("-inf")).all() and (partials[1][0] == 0).all()
    out, _ = parallel_cp.combine([p[0] for p in partials], [p[1] for p in partials])
    assert torch.allclose(out, partials[0][0])


def test_combine_all_ranks_blind_gives_zeros():
    outs = [torch.randn(2, 1, 3), torch.randn(2, 1, 3)]
    lses = [torch.full((2, 1), float("-inf")), torch.tensor([[0.5], [float("-inf")]])]
    out, lse = parallel_cp.combine(outs, lses)
    assert torch.equal(out[1], torch.zeros(1, 3)) and lse[1, 0] == float("-inf")
    assert torch.allclose(out[0], outs[1][0]) and lse[0, 0] == 0.5


def test_local_key_limits_is_the_interleaved_count():
    limits = torch.arange(0, 40, dtype=torch.int32)
    for cp_size, interleave in ((2, 1), (2, 4), (3, 2)):
        for rank in range(cp_size):
            local = parallel_cp.local_key_limits(limits, cp_size, rank, interleave)
            expected = [
                sum(1 for p in range(L) if (p // interleave) % cp_size == rank) for L in limits.tolist()
            ]
            assert local.tolist() == expected
            # the tensor formula is the C one (BlockTables' dcp_local_seq_lens)
            c_local = torch.empty_like(limits)
            _C.dcp_local_seq_lens(limits, c_local, cp_size, rank, interleave)
            assert torch.equal(local, c_local)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_key_limits_stay_on_their_device(device):
    _, _, q, qsl, sl, key_limits = _scenario(2)
    for mode in MODES:
        host = parallel_cp.global_key_limits(qsl, sl, MASK_OF[mode], key_limits)
        dev = parallel_cp.global_key_limits(
            qsl.to(device), sl.to(device), MASK_OF[mode], key_limits.to(device), num_tokens=q.shape[0]
        )
        assert dev.device.type == device and dev.dtype == torch.int32
        assert torch.equal(dev.cpu(), host)
        local = parallel_cp.local_key_limits(dev, 2, 1, 4)
        assert local.device.type == device and torch.equal(
            local.cpu(), parallel_cp.local_key_limits(host, 2, 1, 4)
        )


# ------------------------------------------------------------------------------------------------
# Two gloo processes
# ------------------------------------------------------------------------------------------------


def _gloo_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        keys, values, q, qsl, sl, key_limits = _scenario(21)
        for cp_interleave in (1, 4):
            cache, bt = _rank_cache(keys, values, world, rank, cp_interleave, seed=31)
            for mode in MODES:
                out = parallel_cp.cp_attention(
                    q, cache, bt, qsl, sl, MASK_OF[mode], SCALE, key_limits, cp_interleave=cp_interleave
                )
                expected = _single_process(keys, values, q, qsl, sl, key_limits, mode)
                err = (out - expected).abs().max().item()
                assert torch.allclose(out, expected, atol=2e-6, rtol=1e-5), (mode, cp_interleave, err)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_cp_two_gloo_processes_match_single_process():
    """2 ranks (torch.multiprocessing spawn, gloo on 127.0.0.1) each hold their interleaved
    share (cp_interleave 1 and 4) and merge with all_gather: every mask mode matches."""
    import torch.multiprocessing as mp

    mp.spawn(_gloo_worker, args=(2, free_port()), nprocs=2, join=True)


# ------------------------------------------------------------------------------------------------
# Errors (full text)
# ------------------------------------------------------------------------------------------------


def _lse_args(**kw):
    q = torch.randn(3, 2, 4)
    cache = torch.randn(2, 3, 2, 1, 4)
    bt = torch.tensor([[2, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    sl = torch.tensor([3], dtype=torch.int32)
    args = {
        "query": q,
        "kv_cache": cache,
        "block_table": bt,
        "query_start_loc": qsl,
        "seq_lens": sl,
        "key_limits": None,
        "mask": 0,
        "scale": 0.5,
        "out": torch.empty(3, 2, 4),
        "lse_out": torch.empty(3, 2),
        "host_block_table": bt,
        "host_query_start_loc": qsl,
        "host_seq_lens": sl,
    }
    args.update(kw)
    return list(args.values())


def _raises(exc, text, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value) == text


def test_paged_attention_lse_errors():
    op = "paged_attention_lse()"
    f = _C.paged_attention_lse
    _raises(TypeError, "paged_attention_lse() takes 13 arguments, got 12", f, *_lse_args()[:12])
    _raises(
        ValueError, f"{op}: mask must be 0 (none), 1 (causal) or 2 (limits), got 7", f, *_lse_args(mask=7)
    )
    _raises(TypeError, f"{op}: mask must be an int, got 1.0", f, *_lse_args(mask=1.0))
    _raises(
        ValueError,
        f"{op}: key_limits must be a tensor when mask is 2 (limits), got None",
        f,
        *_lse_args(mask=2),
    )
    _raises(
        TypeError,
        f"{op}: key_limits must be int32, got int64",
        f,
        *_lse_args(mask=2, key_limits=torch.zeros(3, dtype=torch.int64)),
    )
    _raises(
        ValueError,
        f"{op}: key_limits must have at least 3 entries, got 2",
        f,
        *_lse_args(mask=2, key_limits=torch.zeros(2, dtype=torch.int32)),
    )
    _raises(
        TypeError,
        f"{op}: lse_out must be float32, got float64",
        f,
        *_lse_args(lse_out=torch.empty(3, 2).double()),
    )
    _raises(
        ValueError,
        f"{op}: lse_out must have 2 dimensions, got 3",
        f,
        *_lse_args(lse_out=torch.empty(3, 2, 1)),
    )
    _raises(
        ValueError,
        f"{op}: lse_out must have shape [3, 2], got [3, 3]",
        f,
        *_lse_args(lse_out=torch.empty(3, 3)),
    )
    buf = torch.zeros(3 * 2 * 4)
    _raises(
        ValueError,
        f"{op}: lse_out must not overlap out in memory, got views sharing bytes",
        f,
        *_lse_args(out=buf.view(3, 2, 4), lse_out=buf[:6].view(3, 2)),
    )
    q = torch.randn(3, 2, 4)
    _raises(
        ValueError,
        f"{op}: lse_out must not overlap query in memory, got views sharing bytes",
        f,
        *_lse_args(query=q, lse_out=q.view(-1)[:6].view(3, 2)),
    )
    sl = torch.tensor([3], dtype=torch.int32)
    # The CPU reference reads the tensors themselves, host copies are still inputs of the call.
    host_qsl = torch.tensor([0, 3], dtype=torch.int32)
    lse = torch.zeros(3, 2)
    _raises(
        ValueError,
        f"{op}: lse_out must not overlap host_query_start_loc in memory, got views sharing bytes",
        f,
        *_lse_args(lse_out=lse, host_query_start_loc=lse.view(-1)[:2].view(torch.int32)[:2]),
    )
    del sl, host_qsl
    # A failed call writes nothing.
    out = torch.full((3, 2, 4), 7.0)
    lse = torch.full((3, 2), 7.0)
    with pytest.raises(ValueError):
        f(*_lse_args(out=out, lse_out=lse, block_table=torch.tensor([[5, 0]], dtype=torch.int32)))
    assert (out == 7).all() and (lse == 7).all()


def test_paged_attention_lse_allows_rows_shorter_than_their_queries():
    """paged_attention refuses seq_len < query_len with a causal mask; the lse variant runs it
    (a rank's local share): bottom-right causal query i sees i + seq_len - query_len + 1 keys."""
    args = _lse_args(mask=1, seq_lens=torch.tensor([1], dtype=torch.int32))
    args[10:13] = [None, None, None]
    with pytest.raises(ValueError, match="must be >= the row's query length"):
        _C.paged_attention(*args[:9], *args[10:])
    _C.paged_attention_lse(*args)
    lse = args[9]
    assert (lse[:2] == float("-inf")).all() and torch.isfinite(lse[2]).all()
    assert (args[8][:2] == 0).all()


def test_parallel_cp_errors():
    q = torch.randn(3, 2, 4)
    cache = torch.randn(2, 3, 4, 1, 4)
    bt = torch.tensor([[0]], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    sl = torch.tensor([3], dtype=torch.int32)

    def partial(**kw):
        cp = {"cp_size": 2, "cp_rank": 0, "cp_interleave": 1, **kw}
        return parallel_cp.attention_partial(q, cache, bt, qsl, sl, 0, 0.5, **cp)

    _raises(ValueError, "attention_partial(): cp_rank must be in [0, 2), got 2", partial, cp_rank=2)
    _raises(
        ValueError,
        "attention_partial(): query_start_loc must end at the query's token count 3, got [0, 2]",
        lambda: parallel_cp.attention_partial(
            q, cache, bt, torch.tensor([0, 2], dtype=torch.int32), sl, 0, 0.5, cp_size=2, cp_rank=0
        ),
    )
    bad = (bt, qsl)
    _raises(
        TypeError,
        f"attention_partial(): host_metadata must be 3 CPU tensors (block_table, query_start_loc, "
        f"seq_lens), got {bad!r}",
        partial,
        host_metadata=bad,
    )
    # A row longer than its table's reach (9 global keys -> 5 on rank 0 > 1 block of 4).
    _raises(
        ValueError,
        "paged_attention(): seq_lens[0] must be in [0, 4] (block_table columns * block_size), got 5",
        lambda: parallel_cp.attention_partial(
            q, cache, bt, qsl, torch.tensor([9], dtype=torch.int32), 0, 0.5, cp_size=2, cp_rank=0
        ),
    )
    _raises(TypeError, "attention_partial(): cp_size must be an int, got 2.0", partial, cp_size=2.0)
    _raises(ValueError, "attention_partial(): cp_interleave must be >= 1, got 0", partial, cp_interleave=0)
    _raises(
        ValueError,
        "attention_partial(): cp_interleave must divide the cache's block_size 4 when cp_size > 1, got 3",
        partial,
        cp_interleave=3,
    )
    _raises(
        ValueError,
        "global_key_limits(): mask must be 0 (none), 1 (causal) or 2 (limits), got 5",
        parallel_cp.global_key_limits,
        qsl,
        sl,
        5,
    )
    _raises(
        ValueError,
        "global_key_limits(): key_limits must be a tensor when mask is 2 (limits), got None",
        parallel_cp.global_key_limits,
        qsl,
        sl,
        2,
    )
    _raises(
        ValueError,
        "global_key_limits(): key_limits must be 1-D with at least 3 entries, got shape=(2,)",
        parallel_cp.global_key_limits,
        qsl,
        sl,
        2,
        torch.zeros(2, dtype=torch.int32),
    )
    _raises(
        ValueError,
        "global_key_limits(): query_start_loc must have len(seq_lens) + 1 = 2 entries, got shape=(3,)",
        parallel_cp.global_key_limits,
        torch.tensor([0, 1, 3], dtype=torch.int32),
        sl,
        0,
    )
    _raises(
        ValueError,
        "local_key_limits(): cp_size must be >= 1, got 0",
        parallel_cp.local_key_limits,
        sl,
        0,
        0,
        1,
    )
    _raises(
        ValueError,
        "combine(): outs and lses must be non-empty and of equal length, got 1 and 0",
        parallel_cp.combine,
        [q],
        [],
    )
    _raises(
        ValueError,
        "combine(): outs[1] must have shape [3, 2, 4], got [2, 2, 4]",
        parallel_cp.combine,
        [q, q[:2]],
        [torch.zeros(3, 2), torch.zeros(2, 2)],
    )
    _raises(
        ValueError,
        "combine(): lses[0] must have shape [3, 2], got [3]",
        parallel_cp.combine,
        [q],
        [torch.zeros(3)],
    )
    _raises(
        RuntimeError,
        "all_gather_combine(): torch.distributed must be initialized, got is_initialized() == False",
        parallel_cp.all_gather_combine,
        q,
        torch.zeros(3, 2),
    )
    _raises(
        RuntimeError,
        "cp_attention(): torch.distributed must be initialized, got is_initialized() == False",
        parallel_cp.cp_attention,
        q,
        cache,
        bt,
        qsl,
        sl,
        0,
        0.5,
    )


# ------------------------------------------------------------------------------------------------
# CUDA: the kernels' log-sum-exp, context parallelism on one GPU and over NCCL
# ------------------------------------------------------------------------------------------------

# Rows long enough for several query tiles (128) and key tiles (64/128) of the tensor-core
# kernel; the short variant gives row 1 fewer keys than queries, as a CP rank's share does.
GPU_ROWS = {
    "seq_lens": [700, 190],
    "query_lens": [300, 150],
    "spans": [[(450, 520), (600, 700)], [(40, 100)]],
}
GPU_ROWS_SHORT = {"seq_lens": [700, 90], "query_lens": [300, 150], "spans": [[(450, 520)], [(-20, 60)]]}


def _check_lse_case(dev, block_size, mode, dtype, dims, rows, seed, lse_atol):
    """CUDA paged_attention_lse on _lse_problem(...) against float64; returns (out, lse) on the
    CPU and the problem (cache, bt, q, qsl, sl, kl)."""
    heads = dims[0]
    problem = _lse_problem(block_size, mode, dtype, seed, dims=dims, rows=rows)
    cache, bt, q, qsl, sl, kl, visibles = problem
    mask = MASK_OF[mode]
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=dev)
    lse = torch.full((q.shape[0], heads), float("nan"), device=dev)
    _C.paged_attention_lse(
        q.to(dev),
        cache.to(dev),
        bt.to(dev),
        qsl.to(dev),
        sl.to(dev),
        kl.to(dev) if mask == 2 else None,
        mask,
        0.125,
        out,
        lse,
        bt,
        qsl,
        sl,
    )
    out, lse = out.cpu(), lse.cpu()
    for r in range(2):
        t0, t1 = int(qsl[r]), int(qsl[r + 1])
        k, v = dense_kv_from_cache(cache, bt[r], int(sl[r]))
        ref_out, ref_lse = ref_attention(q[t0:t1], k, v, visibles[r], 0.125, lse=True)
        nothing = ~visibles[r].any(dim=1)
        assert torch.equal(torch.isneginf(lse[t0:t1]), nothing[:, None].expand(-1, heads)), (r, mode)
        assert (out[t0:t1][nothing] == 0).all()
        seen = ~nothing
        lse_err = (lse[t0:t1][seen].double() - ref_lse[seen]).abs().max().item() if seen.any() else 0.0
        assert lse_err <= lse_atol, (r, mode, lse_err)
        out_atol = 1e-5 if dtype == torch.float32 else ATOL_BY_DTYPE[dtype]
        err = (out[t0:t1].double() - ref_out).abs().max().item()
        assert err <= out_atol, (r, mode, err)
    return out, lse, problem[:6]


ATOL_BY_DTYPE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("short_row", [False, True])
def test_cuda_lse_tensor_cores_match_float64_reference(dtype, head_size, mode, block_size, short_row):
    """The mma kernel's lse (8 heads over 2 kv heads) against float64: the scores are exact
    products of fp16/bf16 inputs accumulated in fp32, so the lse is good to ~1e-4."""
    dev = torch.device("cuda")
    rows = GPU_ROWS_SHORT if short_row else GPU_ROWS
    out, _, (cache, bt, q, qsl, sl, kl) = _check_lse_case(
        dev, block_size, mode, dtype, (8, 2, head_size), rows, 3 + block_size, 2e-4
    )
    if not short_row:
        # The output is the very paged_attention output (same kernel, same launch shapes).
        mask = MASK_OF[mode]
        plain = torch.empty(q.shape, dtype=dtype, device=dev)
        _C.paged_attention(
            q.to(dev),
            cache.to(dev),
            bt.to(dev),
            qsl.to(dev),
            sl.to(dev),
            kl.to(dev) if mask == 2 else None,
            mask,
            0.125,
            plain,
            bt,
            qsl,
            sl,
        )
        assert torch.equal(plain.cpu(), out)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("short_row", [False, True])
def test_cuda_lse_fp32_kernel_matches_cpu(mode, short_row):
    dev = torch.device("cuda")
    out, lse, (cache, bt, q, qsl, sl, kl) = _check_lse_case(
        dev, 16, mode, torch.float32, (H, HKV, D), None if not short_row else SMALL_ROWS_SHORT, 9, 1e-5
    )
    cpu_out, cpu_lse = torch.empty_like(q), torch.empty(q.shape[0], H)
    mask = MASK_OF[mode]
    _C.paged_attention_lse(
        q, cache, bt, qsl, sl, kl if mask == 2 else None, mask, 0.125, cpu_out, cpu_lse, bt, qsl, sl
    )
    assert torch.allclose(lse, cpu_lse, atol=1e-5, rtol=1e-6)
    assert torch.allclose(out, cpu_out, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_lse_strided_output():
    dev = torch.device("cuda")
    cache, bt, q, qsl, sl, kl, visibles = _lse_problem(
        16, "spans", torch.bfloat16, 4, dims=(8, 2, 128), rows=GPU_ROWS
    )
    args = (q.to(dev), cache.to(dev), bt.to(dev), qsl.to(dev), sl.to(dev), kl.to(dev), 2)
    out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    lse = torch.empty(q.shape[0], 8, device=dev)
    lse_t = torch.empty(8, q.shape[0], device=dev)
    _C.paged_attention_lse(*args, 0.125, out, lse, bt, qsl, sl)
    _C.paged_attention_lse(*args, 0.125, out, lse_t.T, None, None, None)
    assert torch.equal(lse_t.T, lse)
    k, v = dense_kv_from_cache(cache, bt[0], int(sl[0]))
    _, ref_lse = ref_attention(q[: int(qsl[1])], k, v, visibles[0], 0.125, lse=True)
    assert (lse[: int(qsl[1])].cpu().double() - ref_lse).abs().max().item() < 2e-4


@pytest.mark.gpu
def test_cuda_partial_checks_the_host_metadata_before_the_launch():
    dev = torch.device("cuda")
    q = torch.randn(3, 2, 4, device=dev)
    cache = torch.randn(2, 3, 4, 1, 4, device=dev)
    bt = torch.tensor([[0]], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    sl = torch.tensor([3], dtype=torch.int32)
    _raises(
        ValueError,
        "paged_attention(): seq_lens[0] must be in [0, 4] (block_table columns * block_size), got 5",
        lambda: parallel_cp.attention_partial(
            q, cache, bt.to(dev), qsl.to(dev), sl.to(dev), 0, 0.5, cp_size=2, cp_rank=0,
            host_metadata=(bt, qsl, torch.tensor([9], dtype=torch.int32)),
        ),
    )  # fmt: skip
    out, lse = parallel_cp.attention_partial(
        q,
        cache,
        bt.to(dev),
        qsl.to(dev),
        sl.to(dev),
        0,
        0.5,
        cp_size=2,
        cp_rank=0,
        host_metadata=(bt, qsl, sl),
    )
    same = parallel_cp.attention_partial(
        q, cache, bt.to(dev), qsl.to(dev), sl.to(dev), 0, 0.5, cp_size=2, cp_rank=0
    )
    assert torch.equal(out, same[0]) and torch.equal(lse, same[1])


def _cuda_rank_partials(keys, values, q, qsl, sl, key_limits, mode, cp_size, cp_interleave, dev):
    partials = []
    for rank in range(cp_size):
        cache, bt = _rank_cache(keys, values, cp_size, rank, cp_interleave, seed=11)
        partials.append(
            parallel_cp.attention_partial(
                q.to(dev),
                cache.to(dev),
                bt.to(dev),
                qsl.to(dev),
                sl.to(dev),
                MASK_OF[mode],
                SCALE,
                key_limits.to(dev),
                cp_size=cp_size,
                cp_rank=rank,
                cp_interleave=cp_interleave,
            )
        )
    return partials


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp_interleave", [1, 4])
@pytest.mark.parametrize("cp_size", [2, 3])
def test_cuda_cp_simulated_ranks_match_single_process(mode, cp_interleave, cp_size):
    """Every rank's CUDA partial (fp32 kernel at this head size) merged by combine() matches the
    CPU single-process result and the CPU partials."""
    dev = torch.device("cuda")
    keys, values, q, qsl, sl, key_limits = _scenario(5)
    partials = _cuda_rank_partials(keys, values, q, qsl, sl, key_limits, mode, cp_size, cp_interleave, dev)
    assert all(o.device.type == "cuda" and lse.device.type == "cuda" for o, lse in partials)
    out, lse = parallel_cp.combine([p[0] for p in partials], [p[1] for p in partials])
    expected = _single_process(keys, values, q, qsl, sl, key_limits, mode)
    assert torch.allclose(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert torch.allclose(out.cpu().double(), _float64_reference(keys, values, q, qsl, mode), atol=1e-5)


def _nccl_scenario(seed, dtype):
    """Two long rows with GQA 8/2 at head_size 128 for the tensor-core kernel."""
    g = torch.Generator().manual_seed(seed)
    seq_lens, query_lens = [1500, 620], [700, 620]
    spans = [[(900, 1100), (1300, 1500)], [(0, 300), (300, 620)]]
    keys = [torch.randn(s, 2, 128, generator=g).to(dtype) for s in seq_lens]
    values = [torch.randn(s, 2, 128, generator=g).to(dtype) for s in seq_lens]
    q = torch.randn(sum(query_lens), 8, 128, generator=g).to(dtype)
    qsl = torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    limits = []
    for r, (s, n) in enumerate(zip(seq_lens, query_lens, strict=True)):
        limits += key_limits_for_spans(range(s - n, s), spans[r])
    visibles = [
        mask_spans(range(s - n, s), s, spans[r])
        for r, (s, n) in enumerate(zip(seq_lens, query_lens, strict=True))
    ]
    return keys, values, q, qsl, sl, torch.tensor(limits, dtype=torch.int32), visibles


def _nccl_cache(keys, values, cp_size, cp_rank, cp_interleave, block_size, dev):
    """This rank's share through BlockTables (slots -1 elsewhere), written by one kv_write."""
    blocks_per_row = [-(-len(k) // (block_size * cp_size)) for k in keys]
    tables = diffkv.BlockTables(
        [block_size],
        max_num_reqs=len(keys),
        max_num_batched_tokens=4096,
        max_num_blocks_per_group=max(blocks_per_row),
        device="cpu",
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
    )
    start = 0
    for r, n in enumerate(blocks_per_row):
        tables.append_block_ids(r, [list(range(start, start + n))[::-1]])
        start += n
    rows = torch.arange(len(keys), dtype=torch.int32)
    lens = [len(k) for k in keys]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens]).to(torch.int64)
    slots = tables.compute_slot_mappings(rows, qsl, positions, positions.shape[0])[0].clone()
    cache = torch.zeros(2, start, block_size, 2, 128, dtype=keys[0].dtype, device=dev)
    _C.kv_write(torch.cat(keys).to(dev), torch.cat(values).to(dev), cache, slots.to(dev))
    return cache, tables.gather_block_tables(rows, len(keys))[0].clone().to(dev)


def _nccl_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import json
    import pathlib

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    report = {}
    try:
        for dtype in (torch.bfloat16, torch.float16):
            keys, values, q, qsl, sl, kl, visibles = _nccl_scenario(17, dtype)
            whole, whole_bt = _nccl_cache(keys, values, 1, 0, 1, 16, dev)
            for cp_interleave in (1, 16):
                cache, bt = _nccl_cache(keys, values, world, rank, cp_interleave, 16, dev)
                for mode in MODES:
                    out = parallel_cp.cp_attention(
                        q.to(dev),
                        cache,
                        bt,
                        qsl.to(dev),
                        sl.to(dev),
                        MASK_OF[mode],
                        0.09,
                        kl.to(dev),
                        cp_interleave=cp_interleave,
                    )
                    single = torch.empty_like(out)
                    mask = MASK_OF[mode]
                    _C.paged_attention(
                        q.to(dev),
                        whole,
                        whole_bt,
                        qsl.to(dev),
                        sl.to(dev),
                        kl.to(dev) if mask == 2 else None,
                        mask,
                        0.09,
                        single,
                        whole_bt.cpu(),
                        qsl,
                        sl,
                    )
                    ref = []
                    for r in range(2):
                        s, t0, t1 = int(sl[r]), int(qsl[r]), int(qsl[r + 1])
                        visible = {
                            "none": mask_none(range(s - (t1 - t0), s), s),
                            "causal": mask_causal(range(s - (t1 - t0), s), s),
                            "spans": visibles[r],
                        }[mode]
                        ref.append(ref_attention(q[t0:t1], keys[r], values[r], visible, 0.09))
                    ref = torch.cat(ref)
                    report[f"{dtype}/{cp_interleave}/{mode}"] = {
                        "vs_single": (out.float() - single.float()).abs().max().item(),
                        "cp_vs_f64": (out.cpu().double() - ref).abs().max().item(),
                        "single_vs_f64": (single.cpu().double() - ref).abs().max().item(),
                        "device": str(out.device),
                    }
        dist.barrier()
        (pathlib.Path(out_dir) / f"cp_rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_cp_two_nccl_processes_match_single_process(tmp_path):
    """2 ranks on 2 GPUs (NCCL): bf16/fp16, GQA 8/2, head 128, block 16, interleave 1 and 16,
    every mask; the merged output is as close to float64 as one GPU's own output is."""
    import json

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs 2 CUDA devices and NCCL")
    mp.spawn(_nccl_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        report = json.loads((tmp_path / f"cp_rank{rank}.json").read_text())
        assert len(report) == 2 * 2 * 3
        for key, r in report.items():
            assert r["device"] == f"cuda:{rank}", key
            atol = 2e-3 if "float16" in key and "bfloat16" not in key else 1.6e-2
            assert r["vs_single"] <= atol, (key, r)
            assert r["cp_vs_f64"] <= max(2 * r["single_vs_f64"], atol / 2), (key, r)
