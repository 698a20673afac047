"""Strict Ulysses over 2 processes (torch.distributed, gloo on 127.0.0.1) against one process.

    python examples/ulysses_gloo.py [--dtype float32|bfloat16|float16] [--steps N]

Each rank holds a sequence shard ``[B, S_pad/2, H, D]`` of Q/K/V for two CFG rows with different
prefixes (batched, right-padded in the prefill step), all-to-alls them to the full sequence with
half the heads (``diffkv.ulysses.scatter_heads``), runs diffkv on a rank-local paged cache
(layers built with ``ulysses_degree=2``: ``H/2`` query and ``H_kv/2`` KV heads), all-to-alls the
output back (``gather_heads``) and compares its shard with a single-process run of the same
inputs (``ulysses_degree=1``, all heads).  Causal layers with a full-attention span over the
image tokens (piecewise plans), a prefill step then denoise steps reusing the prefix pages.  The
image token count is odd, so the denoise steps exercise the SP padding token.  The head split
moves bytes only and diffkv computes one query head at a time, so the shards must match bit for
bit.  The same code runs on NCCL with one CUDA device per rank (``--backend nccl``).

Entry points: ``build``, ``inputs``, ``run_rank`` (one rank's comparison, used by
``tests/test_ulysses.py``) and ``main``.
"""

from __future__ import annotations

import argparse
import socket
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import diffkv as dk
from diffkv import ulysses

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CASE = dict(heads=4, kv_heads=2, head_size=64, block_size=4, prefixes=(6, 11), image_tokens=7, layers=2)


def build(device: torch.device, dtype: torch.dtype, *, ulysses_degree: int, case: dict = CASE):
    """An adapter for two CFG rows (prefixes ``case["prefixes"]`` + ``image_tokens``) whose
    layers keep ``heads / ulysses_degree`` query and ``kv_heads / ulysses_degree`` KV heads;
    returns the adapter, its layers and the prefill/denoise metadata."""
    bs = case["block_size"]
    seq_lens = [p + case["image_tokens"] for p in case["prefixes"]]
    blocks = [-(-n // bs) for n in seq_lens]
    names = [f"layers.{i}.attn" for i in range(case["layers"])]
    config = dk.DiffusionConfig(dk.ModelConfig(dtype), dk.CacheConfig(block_size=bs))
    spec = dk.AttentionSpec(
        block_size=bs, num_kv_heads=case["kv_heads"], head_size=case["head_size"], dtype=dtype
    )
    attention = SimpleNamespace(num_heads=case["heads"], softmax_scale=case["head_size"] ** -0.5)
    layers = {
        name: dk.DiffusionPagedAttentionLayerAdapter(
            layer_name=name,
            layer=attention,
            spec=spec,
            vllm_config=config,
            device=device,
            ulysses_degree=ulysses_degree,
        )
        for name in names
    }
    # The cache keeps the rank-local KV heads: the layers' spec, not the model's.
    kv_cache_config = dk.KVCacheConfig(
        num_blocks=sum(blocks) + 4, kv_cache_groups=[dk.KVCacheGroup(names, layers[names[0]].spec)]
    )
    dk.allocate_kv_caches(kv_cache_config, dtype=dtype, device=device, layers=layers)
    tables = dk.BlockTables([bs], 2, 2 * max(seq_lens), [max(blocks)], device)
    pool = dk.BlockPool(sum(blocks) + 4)
    pool.allocate(2)  # blocks someone else holds
    bindings, prefill, denoise = {}, [], []
    for row, (prefix, seq_len, nblk) in enumerate(zip(case["prefixes"], seq_lens, blocks, strict=True)):
        tables.append_block_ids(row, [pool.allocate(nblk)[::-1]], overwrite=True)
        bindings[("img", row, None)] = dk.DiffusionPagedAttentionRowBinding(
            row_index=row, max_seq_len=seq_len
        )
        prefill.append(dk.DiffusionPagedAttentionRow("img", seq_len, seq_len, 0, sequence_id=row))
        denoise.append(
            dk.DiffusionPagedAttentionRow("img", case["image_tokens"], seq_len, prefix, sequence_id=row)
        )
    adapter = dk.DiffusionPagedAttentionAdapter(
        vllm_config=config,
        device=device,
        kv_cache_config=kv_cache_config,
        block_tables=tables,
        attn_groups=[[dk.AttentionGroup(names)]],
        layers=layers,
        resolve_row=lambda *identity: bindings[identity],
    )
    metadata = dk.DiffusionPagedAttentionMetadata(prefill_rows=tuple(prefill), denoise_rows=tuple(denoise))
    spans = [[(p, p + case["image_tokens"])] for p in case["prefixes"]]
    return SimpleNamespace(
        adapter=adapter,
        layers=layers,
        names=names,
        metadata=metadata,
        omni_metadata=dk.AttentionMetadata(full_attn_spans=spans),
    )


def inputs(step: int, layer: int, rows, dtype: torch.dtype, device: torch.device, case: dict = CASE):
    """Full-sequence Q, K, V ``[B, T, H(_kv), D]`` (T = the longest row; shorter rows are
    right-padded), the same on every rank: drawn from a generator seeded by (step, layer)."""
    gen = torch.Generator().manual_seed(1000 * step + layer)
    tokens = max(r.query_len for r in rows)
    shape = (len(rows), tokens)
    q, k, v = (
        torch.randn(*shape, h, case["head_size"], generator=gen).to(dtype=dtype, device=device)
        for h in (case["heads"], case["kv_heads"], case["kv_heads"])
    )
    return q, k, v


def run_rank(rank: int, world: int, device: torch.device, dtype: torch.dtype, steps: int, group=None) -> dict:
    """This rank's Ulysses run against a single-process run of the same inputs; returns
    ``{"max_abs_diff": float, "bit_exact": bool, "checked": int}`` over every step and layer."""
    single = build(device, dtype, ulysses_degree=1)
    split = build(device, dtype, ulysses_degree=world)
    worst, exact, checked = 0.0, True, 0
    with (
        dk.DiffusionPagedAttentionRuntime(single.adapter, single.metadata).activate() as ref_rt,
        dk.DiffusionPagedAttentionRuntime(split.adapter, split.metadata).activate() as sp_rt,
    ):
        for step in range(steps + 1):
            rows = single.metadata.rows_for_step(step)
            ref_active, sp_active = ref_rt.ensure_active(step), sp_rt.ensure_active(step)
            for index, name in enumerate(single.names):
                q, k, v = inputs(step, index, rows, dtype, device)
                ctx = ref_active.prepare_layer_context(name, q, k, v, omni_attn_metadata=single.omni_metadata)
                reference = single.layers[name].impl.forward_paged(ctx)  # [B, T, H, D]

                tokens = q.shape[1]
                pad = ulysses.sp_padding_size(tokens, world)
                # What this rank holds in a sequence-parallel model: its shard of the sequence.
                q_l, k_l, v_l = (
                    ulysses.scatter_heads(
                        ulysses.shard_sequence(t, rank=rank, degree=world), group=group, padding=pad
                    )
                    for t in (q, k, v)
                )
                ctx = sp_active.prepare_layer_context(
                    name, q_l, k_l, v_l, omni_attn_metadata=split.omni_metadata
                )
                out_l = split.layers[name].impl.forward_paged(ctx)  # [B, T, H/u, D]
                out = ulysses.gather_heads(out_l, group=group, padding=pad)  # [B, T_pad/u, H, D]

                expected = ulysses.shard_sequence(reference, rank=rank, degree=world)
                exact = exact and torch.equal(out, expected)
                worst = max(worst, (out.float() - expected.float()).abs().max().item())
                checked += 1
    return {"max_abs_diff": worst, "bit_exact": exact, "checked": checked}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, dtype_name: str, steps: int) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank, bound before NCCL starts
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = run_rank(rank, world, device, DTYPES[dtype_name], steps)
        print(
            f"rank {rank}: {result['checked']} layer calls, max |diff| {result['max_abs_diff']:.3g}, "
            f"bit-exact {result['bit_exact']}",
            flush=True,
        )
        if not result["bit_exact"]:
            raise SystemExit(1)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--steps", type=int, default=3, help="denoise steps after the prefill step")
    args = parser.parse_args(argv)
    world = 2
    c = CASE
    print(
        f"Ulysses degree {world} over {args.backend}: {c['heads']}/{c['kv_heads']} heads x {c['head_size']}, "
        f"{args.dtype}, 2 CFG rows with prefixes {list(c['prefixes'])} + {c['image_tokens']} image tokens, "
        f"{c['layers']} layers, 1 prefill + {args.steps} denoise steps"
    )
    mp.spawn(_worker, args=(world, free_port(), args.backend, args.dtype, args.steps), nprocs=world)
    print("ok: every rank's shard matches the single-process result bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
