"""One long video-DiT row split over 2 GPUs against one GPU: Ulysses heads and context-parallel KV.

Shape (defaults): one row of 75,600 tokens, 24 query and KV heads of 128, bf16, block 16, no
mask and causal.  A "layer call" is what a rank runs per attention layer, inputs already on the
GPU:

- ``1 GPU``: ``_C.forward_paged`` (KV write of all tokens + attention, one C call);
- ``ulysses x2``: each rank holds half the tokens with all heads; ``scatter_heads`` of q, k, v
  (all-to-all), ``forward_paged`` over half the heads and the whole sequence with a
  rank-local cache of half the heads, ``gather_heads`` of the output (all-to-all);
- ``cp x2``: each rank holds every token (as vLLM's decode context parallelism does), writes
  its interleaved share of the KV (slot -1 elsewhere, ``cp_interleave`` 1), runs
  ``parallel_cp.attention_partial`` (attention over its keys + log-sum-exp) and
  ``all_gather_combine`` (one NCCL all-gather of out and lse, exact merge).

Timing: every repetition starts after a barrier and a device sync on both ranks, is bracketed
by CUDA events on each rank, and counts as the slower rank's time; medians of ``--reps``.
Memory: peak ``torch.cuda.max_memory_allocated`` of each rank over the timed calls (inputs,
cache and outputs included) and the rank's KV-cache bytes.  Every 2-GPU output is compared with
the 1-GPU output of the same inputs (max abs difference).

Usage: python benchmarks/bench_multigpu.py [--tokens 75600] [--heads 24] [--json out.json]
Needs 2 CUDA devices and NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import diffkv
from diffkv import _C, parallel_cp, ulysses
from diffkv._bench import environment, print_table, write_json

WORLD = 2
MASKS = {"none": _C.MASK_NONE, "causal": _C.MASK_CAUSAL}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, reps: int, warmup: int, cuda: bool = True) -> float:
    """Median ms of fn() over the ranks: every repetition starts after a barrier (and a device
    sync), is timed on each rank (CUDA events, or ``time.perf_counter`` on CPU ranks) and counts
    as the slowest rank's time."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        t = torch.tensor([ms], device="cuda" if cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        samples.append(float(t.item()))
    return statistics.median(samples)


def run_ranks(worker, world: int, *args) -> list[dict]:
    """Spawns ``world`` processes of ``worker(rank, *args, out_path)``, each of which writes its
    JSON record to ``f"{out_path}.rank{rank}"``; returns the records in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench")
        mp.spawn(worker, args=(*args, path), nprocs=world, join=True)
        ranks = []
        for r in range(world):
            with open(f"{path}.rank{r}") as f:
                ranks.append(json.load(f))
    return ranks


def _cache_and_tables(
    tokens: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    cp_size: int,
    cp_rank: int,
    dtype: torch.dtype,
    dev: torch.device,
):
    """A rank's cache for one row of `tokens` keys (its cp share) and the row's slots/table."""
    blocks = -(-tokens // (block_size * cp_size))
    tables = diffkv.BlockTables(
        [block_size],
        max_num_reqs=1,
        max_num_batched_tokens=tokens,
        max_num_blocks_per_group=blocks,
        device="cpu",
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=1,
    )
    tables.append_block_ids(0, [list(range(blocks))])
    rows = torch.zeros(1, dtype=torch.int32)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    positions = torch.arange(tokens, dtype=torch.int64)
    slots = tables.compute_slot_mappings(rows, qsl, positions, tokens)[0].clone()
    bt = tables.gather_block_tables(rows, 1)[0].clone()
    cache = torch.zeros(2, blocks, block_size, kv_heads, head_size, dtype=dtype, device=dev)
    return cache, slots.to(dev), bt.to(dev), bt


def _forward(q, k, v, cache, slots, bt, mask, out, host_bt, ctx):
    """KV write of every token + attention: one C call (no key_limits for none/causal)."""
    _C.forward_paged(
        q, k, v, cache, slots, bt, ctx["qsl"], ctx["sl"], None, mask, ctx["scale"], out,
        host_bt, ctx["host_qsl"], ctx["host_sl"],
    )  # fmt: skip


def _single(case, ctx, mode, mask):
    """One GPU: every rank runs the whole layer on its own GPU (timed together)."""
    q, k, v, n, h, d, bs = (ctx[x] for x in ("q", "k", "v", "n", "h", "d", "bs"))
    cache, slots, bt, host_bt = _cache_and_tables(n, h, d, bs, 1, 0, q.dtype, q.device)
    single = torch.empty_like(q)

    def layer():
        _forward(q, k, v, cache, slots, bt, mask, single, host_bt, ctx)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = timed(layer, ctx["reps"], ctx["warmup"])
    flops = 4.0 * h * d * (n * n if mode == "none" else n * (n + 1) / 2)
    case["single"] = {
        "ms": ms,
        "tflops": flops / ms / 1e9,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "kv_cache_gib": cache.numel() * cache.element_size() / 2**30,
    }
    return single


def _ulysses(case, ctx, mask, single):
    """Ulysses: half the tokens in, all-to-all to half the heads over the whole row and back."""
    q, k, v, n, h, d, bs, rank = (ctx[x] for x in ("q", "k", "v", "n", "h", "d", "bs", "rank"))
    shard = n // WORLD
    q_s, k_s, v_s = (t[rank * shard : (rank + 1) * shard].unsqueeze(0).clone() for t in (q, k, v))
    cache, slots, bt, host_bt = _cache_and_tables(n, h // WORLD, d, bs, 1, 0, q.dtype, q.device)
    local_out = torch.empty(n, h // WORLD, d, dtype=q.dtype, device=q.device)
    result = {}

    def layer():
        qh, kh, vh = (ulysses.scatter_heads(t) for t in (q_s, k_s, v_s))  # [1, n, h/2, d]
        _forward(qh[0], kh[0], vh[0], cache, slots, bt, mask, local_out, host_bt, ctx)
        result["out"] = ulysses.gather_heads(local_out.unsqueeze(0))  # [1, n/2, h, d]

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = timed(layer, ctx["reps"], ctx["warmup"])
    diff = (result["out"][0].float() - single[rank * shard : (rank + 1) * shard].float()).abs().max()
    case["ulysses"] = {
        "ms": ms,
        "speedup": case["single"]["ms"] / ms,
        # the full q, k, v and the 1-GPU output stay resident for the comparison only
        "peak_gib": (torch.cuda.max_memory_allocated() - 4 * ctx["full_bytes"]) / 2**30,
        "kv_cache_gib": cache.numel() * cache.element_size() / 2**30,
        "max_abs_diff_vs_single": float(diff),
    }


def _cp(case, ctx, mask, single):
    """Context parallel: all tokens in, each rank keeps its interleaved half of the KV."""
    q, k, v, n, h, d, bs, rank = (ctx[x] for x in ("q", "k", "v", "n", "h", "d", "bs", "rank"))
    cache, slots, bt, host_bt = _cache_and_tables(n, h, d, bs, WORLD, rank, q.dtype, q.device)
    host = (host_bt, ctx["host_qsl"], ctx["host_sl"])  # vLLM's block tables keep host copies
    result = {}

    def layer():
        _C.kv_write(k, v, cache, slots)
        out, lse = parallel_cp.attention_partial(
            q,
            cache,
            bt,
            ctx["qsl"],
            ctx["sl"],
            mask,
            ctx["scale"],
            cp_size=WORLD,
            cp_rank=rank,
            cp_interleave=1,
            host_metadata=host,
        )
        result["out"] = parallel_cp.all_gather_combine(out, lse)[0]

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = timed(layer, ctx["reps"], ctx["warmup"])
    diff = (result["out"].float() - single.float()).abs().max()
    case["cp"] = {
        "ms": ms,
        "speedup": case["single"]["ms"] / ms,
        # the 1-GPU output stays resident for the comparison only
        "peak_gib": (torch.cuda.max_memory_allocated() - ctx["full_bytes"]) / 2**30,
        "kv_cache_gib": cache.numel() * cache.element_size() / 2**30,
        "max_abs_diff_vs_single": float(diff),
    }


def _worker(rank: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    n, h, d = args.tokens, args.heads, args.head_size
    if n % WORLD or h % WORLD:
        raise ValueError(f"--tokens and --heads must be multiples of {WORLD}, got {n} and {h}")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=dev).manual_seed(1234)  # same numbers on both GPUs
    q, k, v = (torch.randn(n, h, d, generator=gen, device=dev, dtype=dtype) for _ in range(3))
    host_qsl = torch.tensor([0, n], dtype=torch.int32)
    host_sl = torch.tensor([n], dtype=torch.int32)
    ctx = {
        "q": q, "k": k, "v": v, "n": n, "h": h, "d": d, "bs": args.block_size, "rank": rank,
        "scale": d**-0.5, "reps": args.reps, "warmup": args.warmup,
        "qsl": host_qsl.to(dev), "sl": host_sl.to(dev), "host_qsl": host_qsl, "host_sl": host_sl,
        "full_bytes": q.numel() * q.element_size(),
    }  # fmt: skip
    record = {"rank": rank, "cases": []}
    for mode, mask in MASKS.items():
        case = {"mask": mode}
        single = _single(case, ctx, mode, mask)
        torch.cuda.empty_cache()
        _ulysses(case, ctx, mask, single)
        torch.cuda.empty_cache()
        _cp(case, ctx, mask, single)
        del single
        torch.cuda.empty_cache()
        record["cases"].append(case)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=75600)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    if torch.cuda.device_count() < WORLD or not dist.is_nccl_available():
        print(
            f"needs {WORLD} CUDA devices and NCCL, found {torch.cuda.device_count()} devices", file=sys.stderr
        )
        return 2
    ranks = run_ranks(_worker, WORLD, free_port(), args)
    shape = (
        f"1 row x {args.tokens} tokens, {args.heads}/{args.heads} heads x {args.head_size}, "
        f"{args.dtype}, block {args.block_size}"
    )
    print(f"{shape}; medians of {args.reps}, slower rank; memory: peak allocated per GPU (GiB)")
    rows = []
    for i, case in enumerate(ranks[0]["cases"]):
        for run in ("single", "ulysses", "cp"):
            r0, r1 = case[run], ranks[1]["cases"][i][run]
            label = "1 GPU" if run == "single" else f"{run} x{WORLD}"
            speed = f"{r0['speedup']:.2f}x" if "speedup" in r0 else f"{r0['tflops']:.0f} TF/s"
            diff = (
                f"{max(r0['max_abs_diff_vs_single'], r1['max_abs_diff_vs_single']):.2e}"
                if run != "single"
                else "-"
            )
            peak = f"{r0['peak_gib']:.2f}/{r1['peak_gib']:.2f}"
            rows.append(
                [case["mask"], label, f"{r0['ms']:.2f}", speed, peak, f"{r0['kv_cache_gib']:.2f}", diff]
            )
    print_table(["mask", "run", "ms", "speedup", "peak GiB r0/r1", "KV GiB", "max |diff|"], rows, left=2)
    if args.json:
        record = {
            "benchmark": "multigpu",
            "shape": vars(args),
            "environment": environment(torch.device("cuda", 0), checkout=__file__),
            "ranks": ranks,
        }
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
