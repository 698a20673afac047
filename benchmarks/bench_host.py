"""Host overhead of one diffkv layer call, in microseconds.

A decode-like batch (one row, one new token over a short cached prefix, 2/1 heads x 64, bf16,
block 16) built from the public API only, as ``python -m diffkv demo`` builds its adapter, so
the GPU work per call is a few microseconds and the host path is what is measured:

* layer call: ``adapter.prepare_layer_context(...)`` + ``layer.impl.forward_paged(ctx)``,
  without spans (causal mask) and with ``full_attn_spans`` (piecewise plan, LIMITS mask), with
  q/k/v as ``[N, H*D]`` and as ``[N, H, D]`` (no reshapes in or out: ~0.6 us each on CPU);
* prepare_layer_context alone (it also describes the call that forward_paged then runs);
  forward_paged of a context prepared earlier and reused (the call is described again from
  the context: ``run_forward_paged``, also taken while compiling and for foreign contexts);
* _C.forward_paged alone (the binding: validation + KV-write and attention launches);
* prepare_batch (+ activate/deactivate): once per phase, not per layer.

Each figure is the median over samples of ``--calls`` back-to-back calls (wall clock, per
call); the parts are timed interleaved, each sample round timing every part once in a rotated
order.  On CUDA the device is synchronised only between samples, outside the timed loop, so
launches are asynchronous as in a model.

    python benchmarks/bench_host.py [--device cpu|cuda] [--calls 2000] [--samples 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

import diffkv as dk
from diffkv import _C
from diffkv._bench import bench_device, environment, fmt, median, print_table, write_json

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, PREFIX = 2, 1, 64, 16, 63


def _per_call_us(
    fns: dict[str, Callable[[], Any]], device: torch.device, calls: int, samples: int
) -> dict[str, dict[str, Any]]:
    """For each named call: the median over samples of the mean wall time per call of `calls`
    back-to-back calls.  The calls are timed interleaved -- each sample round times every one
    of them once, in an order rotated by one per round -- so that a host whose clock or load
    drifts over the run hands the drift to all of them alike (timed one after another, the
    first part measured on an H200 host ran up to 1.5x slower than later ones)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names = list(fns)
    for name in names:
        for _ in range(max(10, calls // 10)):
            fns[name]()
    sync()
    values: dict[str, list[float]] = {name: [] for name in names}
    for r in range(samples):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = fns[name]
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            values[name].append((time.perf_counter_ns() - start) / calls / 1e3)
            sync()
    return {name: {"median_us": median(v), "min_us": min(v), "samples_us": v} for name, v in values.items()}


def _build(device: torch.device):
    """One causal layer, one Worker row with PREFIX cached tokens + 1 new one, on device."""
    dtype = torch.bfloat16
    seq_len = PREFIX + 1
    num_blocks = 16
    spec = dk.AttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=dtype)
    kv_config = dk.KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[dk.KVCacheGroup(["attn"], spec)])
    config = dk.DiffusionConfig(dk.ModelConfig(dtype), dk.CacheConfig(block_size=BLOCK_SIZE))
    tables = dk.BlockTables([BLOCK_SIZE], 1, 64, [num_blocks], device)
    layer = dk.DiffusionPagedAttentionLayerAdapter(
        layer_name="attn",
        layer=SimpleNamespace(num_heads=HEADS, softmax_scale=HEAD_SIZE**-0.5),
        spec=spec,
        vllm_config=config,
        device=device,
    )
    dk.allocate_kv_caches(kv_config, dtype=dtype, device=device, layers={"attn": layer})
    pool = dk.BlockPool(num_blocks)
    pool.allocate(2)  # blocks someone else holds
    tables.append_block_ids(0, [pool.allocate(-(-seq_len // BLOCK_SIZE))])
    binding = dk.DiffusionPagedAttentionRowBinding(row_index=0, max_seq_len=seq_len)
    adapter = dk.DiffusionPagedAttentionAdapter(
        vllm_config=config,
        device=device,
        kv_cache_config=kv_config,
        block_tables=tables,
        attn_groups=[[dk.AttentionGroup(["attn"])]],
        layers={"attn": layer},
        resolve_row=lambda request_id, sequence_id, context_id: binding,
    )
    rows = (dk.DiffusionPagedAttentionRow("req", 1, seq_len, PREFIX, sequence_id=0),)
    return adapter, layer, rows


def run(device: torch.device, calls: int, samples: int) -> dict[str, Any]:
    adapter, layer, rows = _build(device)
    dtype = torch.bfloat16
    q = torch.randn(1, HEADS * HEAD_SIZE, device=device, dtype=dtype)
    k = torch.randn(1, KV_HEADS * HEAD_SIZE, device=device, dtype=dtype)
    v = torch.randn(1, KV_HEADS * HEAD_SIZE, device=device, dtype=dtype)
    spans = dk.AttentionMetadata(full_attn_spans=[[(PREFIX, PREFIX + 1)]])
    impl = layer.impl
    timings: dict[str, dict[str, Any]] = {}

    def prepare_and_activate():
        batch = adapter.prepare_batch(rows)
        with adapter.activate(batch):
            pass

    timings.update(
        _per_call_us(
            {"prepare_batch + activate (per phase)": prepare_and_activate},
            device,
            max(1, calls // 10),
            samples,
        )
    )

    batch = adapter.prepare_batch(rows)
    with adapter.activate(batch):
        ctx = adapter.prepare_layer_context("attn", q, k, v)
        ctx_spans = adapter.prepare_layer_context("attn", q, k, v, omni_attn_metadata=spans)
        meta = ctx.native_metadata
        out = torch.empty(ctx.query.shape, dtype=dtype, device=device)

        def layer_call():
            impl.forward_paged(adapter.prepare_layer_context("attn", q, k, v))

        def layer_call_spans():
            impl.forward_paged(adapter.prepare_layer_context("attn", q, k, v, omni_attn_metadata=spans))

        # the same tokens as [N, heads, head_size] (the layout after a per-head RoPE): no views
        # to make on the way in, none on the way out
        q3, k3, v3 = (t.view(1, -1, HEAD_SIZE) for t in (q, k, v))

        def layer_call_3d():
            impl.forward_paged(adapter.prepare_layer_context("attn", q3, k3, v3))

        def prepare_only():
            adapter.prepare_layer_context("attn", q, k, v)

        def forward_reused():
            impl.forward_paged(ctx)

        def forward_reused_spans():
            impl.forward_paged(ctx_spans)

        def binding_only():
            _C.forward_paged(
                ctx.query,
                ctx.key_write,
                ctx.value_write,
                layer.kv_cache,
                ctx.slot_mapping,
                meta.block_table,
                meta.query_start_loc,
                meta.seq_lens,
                None,
                _C.MASK_CAUSAL,
                float(layer.softmax_scale),
                out,
                meta.block_table_cpu,
                meta.query_start_loc_cpu,
                meta.seq_lens_cpu,
            )

        parts = (
            ("layer call: prepare_layer_context + forward_paged", layer_call),
            ("layer call with full_attn_spans", layer_call_spans),
            ("layer call, q/k/v given as [N, H, D]", layer_call_3d),
            ("  prepare_layer_context", prepare_only),
            ("  forward_paged of a reused context (run_forward_paged)", forward_reused),
            ("  the same with spans", forward_reused_spans),
            ("  _C.forward_paged (binding + launches)", binding_only),
        )
        timings.update(_per_call_us(dict(parts), device, calls, samples))
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed sample")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--json", default=None, help="write a JSON record here")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.samples = min(args.calls, 200), min(args.samples, 5)

    device = bench_device(args.device, parser.error)
    env = environment(device, checkout=__file__)
    timings = run(device, args.calls, args.samples)
    print(
        f"diffkv host overhead per call on {env.get('gpu', device)} (torch {env['torch']}, "
        f"diffkv {env['diffkv']}): 1 row x 1 token over {PREFIX} cached, {HEADS}/{KV_HEADS} heads x "
        f"{HEAD_SIZE}, bf16, block {BLOCK_SIZE}; median of {args.samples} samples x {args.calls} calls"
    )
    print()
    print_table(
        ["what", "us per call", "min us"],
        [[name, fmt(t["median_us"], 2), fmt(t["min_us"], 2)] for name, t in timings.items()],
    )
    if device.type == "cpu":
        print()
        print("(on CPU the C reference computes the write and the attention inside the call)")
    else:
        print()
        print("(launches are asynchronous: if the GPU work per call exceeded the host time, the launch")
        print(" queue would fill and these figures would show GPU time; one call here is ~2 tiny kernels)")
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "host_overhead",
                "config": {
                    "calls": args.calls,
                    "samples": args.samples,
                    "heads": HEADS,
                    "kv_heads": KV_HEADS,
                    "head_size": HEAD_SIZE,
                    "block_size": BLOCK_SIZE,
                    "cached_tokens": PREFIX,
                    "query_tokens": 1,
                    "dtype": "bfloat16",
                },
                "env": env,
                "results": {
                    name.strip(): {k: v for k, v in t.items() if k != "samples_us"}
                    | {"samples_us": t["samples_us"]}
                    for name, t in timings.items()
                },
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
