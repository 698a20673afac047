"""diffkv.mesh: Ulysses x context-parallel on a 2-D DeviceMesh, 4 gloo processes (CPU).

One spawn of 4 ranks runs every mesh shape (ulysses x cp = 2x2, 4x1, 1x4; CP interleave 1 and 2)
through a prefill step
and two denoise steps of two CFG rows with different prefixes (the denoise steps write the image
tokens' K/V again and reuse the prefix pages), in the three mask modes (non-causal, causal,
piecewise spans over the image tokens), and compares each rank's output shard with one process
running the same pieces unsplit: a Ulysses-only mesh bit for bit, meshes with a CP dimension
within the log-sum-exp merge's fp32 rounding.  Then the refusals, before any collective."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import diffkv
from _helpers import free_port
from diffkv import _C, mesh, parallel_cp, ulysses
from reference import key_limits_for_spans

H, HKV, D, BLOCK = 8, 4, 32, 4
PREFIXES, IMAGE = (6, 11), 7
SHAPES = ((2, 2), (4, 1), (1, 4))  # (ulysses_degree, cp_degree)
MASKS = {"none": _C.MASK_NONE, "causal": _C.MASK_CAUSAL, "spans": _C.MASK_LIMITS}
SCALE = D**-0.5


class RankCache:
    """One rank's paged cache (its KV heads, its CP share of the keys) and block tables for the
    two rows, blocks in a shuffled order."""

    def __init__(self, kv_heads: int, cp_size: int, cp_rank: int, seed: int, cp_interleave: int = 1):
        seq_lens = [p + IMAGE for p in PREFIXES]
        blocks = [-(-s // (BLOCK * cp_size)) for s in seq_lens]
        self.tables = diffkv.BlockTables(
            [BLOCK],
            2,
            64,
            max(blocks) + 1,
            "cpu",
            cp_size=cp_size,
            cp_rank=cp_rank,
            cp_interleave=cp_interleave,
        )
        ids = torch.randperm(sum(blocks) + 2, generator=torch.Generator().manual_seed(seed)).tolist()
        for row, n in enumerate(blocks):
            self.tables.append_block_ids(row, [ids[:n]])
            ids = ids[n:]
        self.cache = torch.zeros(2, sum(blocks) + 2, BLOCK, kv_heads, D)
        self.rows = torch.arange(2, dtype=torch.int32)
        self.block_table = self.tables.gather_block_tables(self.rows, 2)[0].clone()

    def slots(self, qsl: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.tables.compute_slot_mappings(self.rows, qsl, positions, positions.shape[0])[0].clone()


def _step(step: int):
    """Step 0 (prefill: every token of both rows) or a denoise step (the image tokens):
    query_start_loc, seq_lens, each token's position, the spans' key limits, and full-head
    Q, K, V of the step's tokens (the same on every rank)."""
    seq_lens = [p + IMAGE for p in PREFIXES]
    query_lens = seq_lens if step == 0 else [IMAGE, IMAGE]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, query_lens, strict=True)])
    limits = []
    for p, s, n in zip(PREFIXES, seq_lens, query_lens, strict=True):
        limits += key_limits_for_spans(range(s - n, s), [(p, p + IMAGE)])
    g = torch.Generator().manual_seed(100 + step)
    n = int(qsl[-1])
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (H, HKV, HKV))
    return (
        qsl,
        torch.tensor(seq_lens, dtype=torch.int32),
        positions,
        torch.tensor(limits, dtype=torch.int32),
        q,
        k,
        v,
    )


def _single_process(mask: str) -> list[torch.Tensor]:
    """Every step's output from one process: the same kv_write and partial attention, unsplit."""
    rank = RankCache(HKV, 1, 0, seed=5)
    outs = []
    for step in range(3):
        qsl, seq, positions, limits, q, k, v = _step(step)
        _C.kv_write(k, v, rank.cache, rank.slots(qsl, positions))
        out, _ = parallel_cp.attention_partial(
            q, rank.cache, rank.block_table, qsl, seq, MASKS[mask], SCALE, limits, cp_size=1, cp_rank=0
        )
        outs.append(out)
    return outs


def _shard(x: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
    return ulysses.shard_sequence(x[None], rank=rank, degree=degree)[0]


def _worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        expected = {m: _single_process(m) for m in MASKS}
        for u, c in SHAPES:
            groups = mesh.init_mesh(u, c, "cpu")
            assert (groups.ulysses_degree, groups.cp_degree) == (u, c)
            assert dist.get_rank() == groups.cp_rank * u + groups.ulysses_rank  # Ulysses ranks adjacent
            for m, code, interleave in [
                (m, code, i) for m, code in MASKS.items() for i in ((1, 2) if c > 1 else (1,))
            ]:
                cache = RankCache(
                    HKV // u, c, groups.cp_rank, seed=7 + groups.cp_rank, cp_interleave=interleave
                )
                for step in range(3):
                    qsl, seq, positions, limits, q, k, v = _step(step)
                    out = mesh.mesh_attention(
                        groups,
                        *(_shard(x, groups.ulysses_rank, u) for x in (q, k, v)),
                        cache.cache,
                        cache.slots(qsl, positions),
                        cache.block_table,
                        qsl,
                        seq,
                        code,
                        SCALE,
                        limits,
                        cp_interleave=interleave,
                    )
                    want = _shard(expected[m][step], groups.ulysses_rank, u)
                    where = f"mesh {u}x{c} rank {rank} mask {m} interleave {interleave} step {step}"
                    if c == 1:
                        assert torch.equal(out, want), where
                    else:
                        err = (out - want).abs().max().item()
                        assert torch.allclose(out, want, atol=2e-6, rtol=1e-5), f"{where}: {err}"
                # the rank's cache holds its CP share of the keys (its KV heads), no other slot
                written = int((cache.cache[0].abs().sum(dim=(-1, -2)) != 0).sum())
                share = parallel_cp.local_key_limits(seq, c, groups.cp_rank, interleave)
                assert written == int(share.sum()), (where, written, share.tolist())
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_four_gloo_processes_every_mesh_shape_match_one_process():
    mp.spawn(_worker, args=(4, free_port()), nprocs=4, join=True)


def _one_rank_worker(rank: int, port: int, errors: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(
            ValueError,
            match=r"^init_mesh\(\): ulysses_degree \* cp_degree must equal the world size 1, got 2 \* 1$",
        ):
            mesh.init_mesh(2, 1, "cpu")
        with pytest.raises(ValueError, match=r"^init_mesh\(\): cp_degree must be a positive int, got 0$"):
            mesh.init_mesh(1, 0, "cpu")
        groups = mesh.init_mesh(1, 1, "cpu")
        qsl, seq, positions, limits, q, k, v = _step(0)
        cache = RankCache(HKV, 1, 0, seed=1)
        args = (cache.cache, cache.slots(qsl, positions), cache.block_table, qsl, seq, _C.MASK_NONE, SCALE)
        out = mesh.mesh_attention(groups, q, k, v, *args)
        assert out.shape == q.shape
        with pytest.raises(
            ValueError,
            match=r"^mesh_attention\(\): kv_cache must be \[2, num_blocks, block_size, 4, D\] "
            r"\(this rank's KV heads\), got shape \(2, 11, 4, 2, 32\)$",
        ):
            mesh.mesh_attention(groups, q, k, v, cache.cache[:, :, :, :2], *args[1:])
        with pytest.raises(
            ValueError,
            match=r"^mesh_attention\(\): query must hold \(N \+ padding\) / u = \(31 \+ 0\) / 1 tokens "
            r"of the query_start_loc's N, got 30$",
        ):
            mesh.mesh_attention(groups, q[:-1], k[:-1], v[:-1], *args)
        with pytest.raises(
            ValueError,
            match=r"^mesh_attention\(\): slot_mapping must be \[31\] \(one slot per new token\), "
            r"got shape \(30,\)$",
        ):
            mesh.mesh_attention(groups, q, k, v, args[0], args[1][:-1], *args[2:])
        with pytest.raises(
            TypeError,
            match=r"^mesh_attention\(\): groups must be a MeshGroups \(init_mesh, mesh_groups\), "
            r"got NoneType$",
        ):
            mesh.mesh_attention(None, q, k, v, *args)
        with pytest.raises(
            ValueError,
            match=r"^mesh_groups\(\): mesh must be a 2-D DeviceMesh with mesh_dim_names "
            r"\('cp', 'ulysses'\), got None$",
        ):
            mesh.mesh_groups(object())
    finally:
        dist.destroy_process_group()


def test_refusals_before_any_collective():
    """Degrees that do not multiply to the world size, shapes that do not fit, a mesh without
    the two dims: each a clear error (one gloo process: nothing to hang on)."""
    mp.spawn(_one_rank_worker, args=(free_port(), {}), nprocs=1, join=True)


def test_heads_the_ulysses_degree_does_not_divide_and_the_cp_interleave():
    """Checked before the first collective: a mesh of groups whose degrees the heads or the
    block size cannot take (built by hand: no process group needed to be refused)."""
    groups = mesh.MeshGroups(None, None, None, ulysses_degree=3, cp_degree=1, ulysses_rank=0, cp_rank=0)
    qsl, seq, positions, limits, q, k, v = _step(0)
    cache = RankCache(HKV, 1, 0, seed=1)
    args = (cache.cache, cache.slots(qsl, positions), cache.block_table, qsl, seq, _C.MASK_NONE, SCALE)
    with pytest.raises(
        ValueError,
        match=r"^mesh_attention\(\): the query heads \(8\) and KV heads \(4\) must be divisible by the "
        r"Ulysses degree 3$",
    ):
        mesh.mesh_attention(groups, q, k, v, *args)
    groups = mesh.MeshGroups(None, None, None, ulysses_degree=1, cp_degree=2, ulysses_rank=0, cp_rank=0)
    with pytest.raises(
        ValueError,
        match=r"^mesh_attention\(\): cp_interleave must divide the cache's block_size 4 when the CP degree "
        r"is 2, got 3$",
    ):
        mesh.mesh_attention(groups, q, k, v, *args, cp_interleave=3)
