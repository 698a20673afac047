"""One long row on a 2-D mesh (Ulysses x context-parallel KV) against one GPU: every mesh shape.

For a world of W ranks (default: every visible GPU, one per rank, NCCL) the shapes are the
factorizations ``ulysses x cp = W`` whose Ulysses degree divides the KV heads (8 GPUs: 8x1, 4x2,
2x4, 1x8).  A "layer call" is what a rank runs per attention layer, inputs on its device:

- ``1 GPU``: ``_C.forward_paged`` (KV write of every token + attention) on the whole problem,
  every rank on its own device at once;
- ``u x c``: ``diffkv.mesh.mesh_attention`` -- the rank's token shard (``N / u``, every head) in,
  Ulysses all-to-alls over its ``u`` ranks, its CP share of the KV written and attended over,
  the log-sum-exp merge over its ``c`` ranks, its shard with every head out.

Timing: each repetition starts after a barrier and a device sync on every rank and counts as the
slowest rank's time (CUDA events; ``time.perf_counter`` on the CPU); medians of ``--reps``.
Memory (CUDA): each rank's peak ``torch.cuda.max_memory_allocated`` over the timed calls, less the
full Q/K/V and the 1-GPU output kept for the comparison; the rank's KV-cache bytes.  Every mesh
output shard is compared with the 1-GPU output's (max abs difference).  Speed-up = 1-GPU time /
mesh time; efficiency = speed-up / W.

    python benchmarks/bench_mesh.py [--world 8] [--tokens 75600] [--heads 24] [--kv-heads 24]
        [--meshes 4x2,2x4] [--masks none,causal] [--json out.json]
    python benchmarks/bench_mesh.py --backend gloo --world 4 --tokens 256 --heads 8   # CPU check
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from bench_multigpu import _cache_and_tables, free_port, run_ranks, timed
from diffkv import _C, mesh, ulysses
from diffkv._bench import environment, print_table, write_json

MASKS = {"none": _C.MASK_NONE, "causal": _C.MASK_CAUSAL}


def mesh_shapes(world: int, kv_heads: int) -> list[tuple[int, int]]:
    """(ulysses, cp) with ulysses * cp == world and ulysses dividing kv_heads, most Ulysses first."""
    return [(u, world // u) for u in range(world, 0, -1) if world % u == 0 and kv_heads % u == 0]


def _parse_meshes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        u, _, c = item.strip().partition("x")
        if not (u.isdigit() and c.isdigit()) or int(u) < 1 or int(c) < 1:
            raise argparse.ArgumentTypeError(f"must be ULYSSESxCP shapes such as 4x2, got {item!r}")
        shapes.append((int(u), int(c)))
    return shapes


def _mesh_layer(groups, shard, call_args, host):
    """The mesh's layer call on this rank's shard and a dict that receives its output."""
    result = {}

    def layer():
        result["out"] = mesh.mesh_attention(groups, *shard, *call_args, host_metadata=host)

    return layer, result


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    cuda = args.backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    n, h, hkv, d, bs = args.tokens, args.heads, args.kv_heads, args.head_size, args.block_size
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=dev).manual_seed(1234)  # the same numbers on every rank
    q = torch.randn(n, h, d, generator=gen, device=dev, dtype=dtype)
    k, v = (torch.randn(n, hkv, d, generator=gen, device=dev, dtype=dtype) for _ in range(2))
    host_qsl, host_sl = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    qsl, sl = host_qsl.to(dev), host_sl.to(dev)
    scale = d**-0.5
    full_bytes = 3 * q.numel() * q.element_size()
    record = {"rank": rank, "cases": []}
    for mode in args.masks:
        mask = MASKS[mode]
        cache, slots, bt, host_bt = _cache_and_tables(n, hkv, d, bs, 1, 0, dtype, dev)
        single = torch.empty_like(q)

        def one_gpu(cache=cache, slots=slots, bt=bt, host_bt=host_bt, single=single, mask=mask):
            _C.forward_paged(
                q, k, v, cache, slots, bt, qsl, sl, None, mask, scale, single, host_bt, host_qsl, host_sl
            )  # fmt: skip

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ms = timed(one_gpu, args.reps, args.warmup, cuda)
        flops = 4.0 * h * d * (n * n if mode == "none" else n * (n + 1) / 2)
        case = {"mask": mode, "single": {"ms": ms, "tflops": flops / ms / 1e9}, "meshes": []}
        del cache
        for u, c in args.meshes:
            groups = mesh.init_mesh(u, c, "cuda" if cuda else "cpu")
            cache, slots, bt, host_bt = _cache_and_tables(n, hkv // u, d, bs, c, groups.cp_rank, dtype, dev)
            shard = [
                ulysses.shard_sequence(x[None], rank=groups.ulysses_rank, degree=u)[0] for x in (q, k, v)
            ]
            host = (host_bt, host_qsl, host_sl)
            layer, result = _mesh_layer(groups, shard, (cache, slots, bt, qsl, sl, mask, scale), host)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            mesh_ms = timed(layer, args.reps, args.warmup, cuda)
            want = ulysses.shard_sequence(single[None], rank=groups.ulysses_rank, degree=u)[0]
            entry = {
                "ulysses": u,
                "cp": c,
                "ms": mesh_ms,
                "speedup": ms / mesh_ms,
                "efficiency": ms / mesh_ms / world,
                "kv_cache_gib": cache.numel() * cache.element_size() / 2**30,
                "max_abs_diff_vs_single": float((result["out"].float() - want.float()).abs().max()),
            }
            if cuda:
                # the full q, k, v and the 1-GPU output stay resident for the comparison only
                entry["peak_gib"] = (
                    torch.cuda.max_memory_allocated() - full_bytes - single.numel() * 2
                ) / 2**30
            case["meshes"].append(entry)
            del cache, shard, result
            if cuda:
                torch.cuda.empty_cache()
        record["cases"].append(case)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl", help="gloo: CPU ranks")
    p.add_argument("--world", type=int, default=None, help="ranks (default: the visible GPUs; gloo: 4)")
    p.add_argument("--tokens", type=int, default=75600)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="default bf16 (gloo: fp32)"
    )
    p.add_argument("--meshes", type=_parse_meshes, default=None, help="e.g. 4x2,2x4 (default: every shape)")
    p.add_argument("--masks", default="none,causal", help="subset of none,causal")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    cuda = args.backend == "nccl"
    world = args.world or (torch.cuda.device_count() if cuda else 4)
    args.kv_heads = args.kv_heads or args.heads
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.masks = [m for m in args.masks.split(",") if m]
    if any(m not in MASKS for m in args.masks):
        p.error(f"--masks must be a subset of {list(MASKS)}, got {args.masks}")
    if cuda and (torch.cuda.device_count() < world or world < 2 or not dist.is_nccl_available()):
        print(
            f"needs {max(world, 2)} CUDA devices and NCCL, found {torch.cuda.device_count()} devices",
            file=sys.stderr,
        )
        return 2
    args.meshes = args.meshes or mesh_shapes(world, args.kv_heads)
    for u, c in args.meshes:
        if u * c != world or args.heads % u or args.kv_heads % u:
            p.error(f"--meshes: {u}x{c} needs ulysses x cp = {world} and ulysses dividing the heads")
    ranks = run_ranks(_worker, world, world, free_port(), args)
    shape = (
        f"1 row x {args.tokens} tokens, {args.heads}/{args.kv_heads} heads x {args.head_size}, {args.dtype}, "
        f"block {args.block_size}, {world} ranks ({args.backend})"
    )
    print(
        f"{shape}; medians of {args.reps}, slowest rank"
        + ("; memory: peak allocated per GPU (GiB)" if cuda else "")
    )
    rows = []
    for i, case in enumerate(ranks[0]["cases"]):
        rows.append(
            [
                case["mask"],
                "1 GPU" if cuda else "1 rank",
                f"{case['single']['ms']:.2f}",
                f"{case['single']['tflops']:.1f} TF/s",
                "",
                "",
                "",
                "",
            ]
        )
        for j, entry in enumerate(case["meshes"]):
            per_rank = [r["cases"][i]["meshes"][j] for r in ranks]
            peak = f"{max(e['peak_gib'] for e in per_rank):.2f}" if cuda else "-"
            diff = max(e["max_abs_diff_vs_single"] for e in per_rank)
            label = f"{entry['ulysses']}x{entry['cp']}"
            speed, eff = f"{entry['speedup']:.2f}x", f"{entry['efficiency']:.0%}"
            kv = f"{entry['kv_cache_gib']:.3f}"
            rows.append([case["mask"], label, f"{entry['ms']:.2f}", speed, eff, peak, kv, f"{diff:.2e}"])
    print_table(
        ["mask", "mesh u x cp", "ms", "speedup", "efficiency", "peak GiB", "KV GiB/rank", "max |diff|"],
        rows,
        left=2,
    )
    if args.json:
        record = {
            "benchmark": "mesh",
            "shape": {k: v for k, v in vars(args).items() if k != "meshes"} | {"meshes": args.meshes},
            "environment": environment(
                torch.device("cuda", 0) if cuda else torch.device("cpu"), checkout=__file__
            ),
            "ranks": ranks,
        }
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
