"""KV-cache write bandwidth: diffkv._C.kv_write against a device copy and torch's scatter.

For N tokens of key/value ``[N, Hkv, D]`` (bf16, contiguous) and a paged cache
``[2, num_blocks, block_size, Hkv, D]`` whose blocks are a random permutation (a few spare
blocks), three ways to move the same bytes, timed in the same run:

* diffkv: ``_C.kv_write(key, value, kv_cache, slot_mapping)`` (the kernel only: the standalone
  binding also copies the slot mapping to the host to range-check it, a synchronisation that
  ``forward_paged`` does not do; that whole call is reported separately as 'call us');
* copy: ``dst.copy_(src)`` of a buffer of 2 * N * Hkv * D elements (K and V: the same bytes);
* index_copy: ``kv_cache[i].view(-1, Hkv, D).index_copy_(0, slots, key / value)`` (torch's own
  scatter, two launches).

Bytes moved = read K + V + write K + V = 4 * N * Hkv * D * elt (the 8-byte slots not counted).

The quantizing write into a float8_e4m3fn cache of the same shape is timed beside them, per
tensor scales: diffkv ``_C.kv_write(..., k_scale, v_scale)`` (one launch) against torch's
``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` then ``index_copy_`` (the
caches compared bit for bit); its bytes are read K + V (bf16) + write K + V (1 byte each) =
6 * N * Hkv * D.
GPU times come from the profiler's kernel records (median of reps, L2 flushed before each), so
host work and synchronisation inside a call are not counted.  The caches written by diffkv and
by index_copy are compared bit for bit.

    python benchmarks/bench_kv_write.py [--quick] [--tokens 1024,...] [--kv-heads 8,32]
                                        [--device cuda|cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from diffkv import _C
from diffkv._bench import (
    bench_device,
    device_times_us,
    environment,
    fmt,
    int_list,
    print_table,
    time_us,
    write_json,
)


def _case(
    num_tokens: int, kv_heads: int, head_size: int, block_size: int, device: torch.device, args
) -> dict:
    dtype = torch.bfloat16
    gen = torch.Generator(device=device)
    gen.manual_seed(num_tokens * 131 + kv_heads)
    key = torch.randn(num_tokens, kv_heads, head_size, generator=gen, device=device, dtype=dtype)
    value = torch.randn(num_tokens, kv_heads, head_size, generator=gen, device=device, dtype=dtype)
    needed = -(-num_tokens // block_size)
    num_blocks = needed + max(3, needed // 32)
    cpu_gen = torch.Generator()
    cpu_gen.manual_seed(num_tokens)
    order = torch.randperm(num_blocks, generator=cpu_gen)[:needed].to(device)
    pos = torch.arange(num_tokens, device=device)
    slots = order[pos // block_size] * block_size + pos % block_size
    cache_shape = (2, num_blocks, block_size, kv_heads, head_size)
    cache = torch.zeros(cache_shape, device=device, dtype=dtype)
    torch_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
    flat = torch_cache.view(2, num_blocks * block_size, kv_heads, head_size)
    src = torch.randn(2 * num_tokens * kv_heads * head_size, generator=gen, device=device, dtype=dtype)
    dst = torch.empty_like(src)

    def diffkv_write():
        _C.kv_write(key, value, cache, slots)

    cache8 = torch.zeros(cache_shape, device=device, dtype=torch.float8_e4m3fn)
    torch_cache8 = torch.zeros(cache_shape, device=device, dtype=torch.float8_e4m3fn)
    flat8 = torch_cache8.view(torch.uint8).view(2, num_blocks * block_size, kv_heads, head_size)
    k_scale = torch.tensor([0.03], device=device)
    v_scale = torch.tensor([0.02], device=device)

    def diffkv_fp8():
        _C.kv_write(key, value, cache8, slots, k_scale, v_scale)

    def torch_fp8():
        for i, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
            quantized = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            flat8[i].index_copy_(0, slots, quantized.view(torch.uint8))

    def copy():
        dst.copy_(src)

    def index_copy():
        flat[0].index_copy_(0, slots, key)
        flat[1].index_copy_(0, slots, value)

    timing = {"warmup": args.warmup, "reps": args.reps}
    method = "profiler kernel records" if device.type == "cuda" else "wall clock"
    times: dict[str, dict[str, Any]] = {}
    if device.type == "cuda":
        try:
            times = {
                "diffkv": device_times_us(diffkv_write, device, match="kv_write", **timing),
                "copy": device_times_us(copy, device, **timing),
                "index_copy": device_times_us(index_copy, device, **timing),
                "fp8": device_times_us(diffkv_fp8, device, match="kv_write", **timing),
                "torch_fp8": device_times_us(torch_fp8, device, **timing),
            }
        except RuntimeError as exc:
            # Reported in the output and the JSON: diffkv's figure then includes its host check.
            method = f"CUDA events (profiler unusable: {exc}); diffkv includes its host slot check"
            times = {}
    if not times:
        times = {
            "diffkv": time_us(diffkv_write, device, **timing),
            "copy": time_us(copy, device, **timing),
            "index_copy": time_us(index_copy, device, **timing),
            "fp8": time_us(diffkv_fp8, device, **timing),
            "torch_fp8": time_us(torch_fp8, device, **timing),
        }
    call = time_us(diffkv_write, device, **timing) if device.type == "cuda" else times["diffkv"]
    nbytes = 4 * num_tokens * kv_heads * head_size * key.element_size()
    result: dict[str, Any] = {
        "num_tokens": num_tokens,
        "num_kv_heads": kv_heads,
        "head_size": head_size,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "dtype": "bfloat16",
        "bytes": nbytes,
        "timing_method": method,
        "bit_exact_vs_index_copy": bool(torch.equal(cache, torch_cache)),
        "diffkv_call_us": call["median_us"],
    }
    nbytes8 = 2 * num_tokens * kv_heads * head_size * (key.element_size() + 1)
    result["fp8_bytes"] = nbytes8
    result["fp8_bit_exact_vs_torch"] = bool(
        torch.equal(cache8.view(torch.uint8), torch_cache8.view(torch.uint8))
    )
    for name, t in times.items():
        result[f"{name}_us"] = t["median_us"]
        result[f"{name}_samples_us"] = t["samples_us"]
        moved = nbytes8 if name in ("fp8", "torch_fp8") else nbytes
        result[f"{name}_gbps"] = moved / (t["median_us"] * 1e-6) / 1e9
        if "kernels" in t:
            result[f"{name}_kernels"] = t["kernels"]
    result["diffkv_vs_copy"] = result["diffkv_gbps"] / result["copy_gbps"]
    result["diffkv_vs_index_copy"] = result["diffkv_gbps"] / result["index_copy_gbps"]
    result["fp8_vs_torch"] = result["fp8_gbps"] / result["torch_fp8_gbps"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU-friendly)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    parser.add_argument("--kv-heads", default=None, help="comma-separated KV head counts")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--json", default=None, help="write a JSON record here")
    args = parser.parse_args(argv)

    device = bench_device(args.device, parser.error)
    default_tokens = "256,1024" if args.quick else "1024,2048,4096,8192,16384,32768,65536"
    tokens = int_list(args.tokens or default_tokens)
    kv_heads = int_list(args.kv_heads or ("2,8" if args.quick else "8,32"))
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 20)

    env = environment(device, checkout=__file__)
    print(
        f"diffkv KV write on {env.get('gpu', device)} (torch {env['torch']}, diffkv {env['diffkv']}); "
        f"bf16, head_size {args.head_size}, block {args.block_size}, random block order; "
        f"median of {args.reps}"
        + (", L2 flushed, kernel time from the profiler" if device.type == "cuda" else "")
    )
    results = []
    for h in kv_heads:
        for n in tokens:
            res = _case(n, h, args.head_size, args.block_size, device, args)
            results.append(res)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the case's tensors died with it
            print(f"  {n} tokens x {h} heads: {res['diffkv_gbps']:.0f} GB/s", file=sys.stderr, flush=True)

    headers = [
        "tokens",
        "kv heads",
        "MB moved",
        "diffkv us",
        "diffkv GB/s",
        "copy GB/s",
        "index_copy GB/s",
        "vs copy",
        "vs index_copy",
        "call us",
        "exact",
        "fp8 us",
        "fp8 GB/s",
        "fp8 vs torch",
        "fp8 exact",
    ]
    rows = [
        [
            str(r["num_tokens"]),
            str(r["num_kv_heads"]),
            fmt(r["bytes"] / 1e6),
            fmt(r["diffkv_us"]),
            fmt(r["diffkv_gbps"], 0),
            fmt(r["copy_gbps"], 0),
            fmt(r["index_copy_gbps"], 0),
            fmt(r["diffkv_vs_copy"], 2),
            fmt(r["diffkv_vs_index_copy"], 2),
            fmt(r["diffkv_call_us"]),
            "yes" if r["bit_exact_vs_index_copy"] else "NO",
            fmt(r["fp8_us"]),
            fmt(r["fp8_gbps"], 0),
            fmt(r["fp8_vs_torch"], 2),
            "yes" if r["fp8_bit_exact_vs_torch"] else "NO",
        ]
        for r in results
    ]
    print()
    print_table(headers, rows, left=0)
    print()
    print("GB/s = (read K+V + write K+V) / time; vs copy / vs index_copy = diffkv GB/s / theirs")
    print(
        "fp8: the quantizing write into a float8_e4m3fn cache, GB/s = (read bf16 K+V + write 1-byte K+V) / "
        "time; vs torch = against (x.float() / scale).clamp(-448, 448).to(float8_e4m3fn) + index_copy_"
    )
    if device.type == "cuda":
        print(
            "call us = the whole _C.kv_write call on the stream (includes its host range check of the slots: "
            "a device-to-host copy + sync that forward_paged does not do)"
        )
    for method in sorted({r["timing_method"] for r in results}):
        print(f"timing: {method}")
    ok = all(r["bit_exact_vs_index_copy"] and r["fp8_bit_exact_vs_torch"] for r in results)
    if args.json:
        big = [r for r in results if r["num_tokens"] >= 8192]
        write_json(
            args.json,
            {
                "benchmark": "kv_write",
                "quick": args.quick,
                "timing": {"warmup": args.warmup, "reps": args.reps, "l2_flush_bytes": 256 << 20},
                "env": env,
                "results": results,
                "summary": {
                    "all_bit_exact": ok,
                    "min_diffkv_gbps_8k_plus": min(r["diffkv_gbps"] for r in big) if big else None,
                    "min_copy_gbps_8k_plus": min(r["copy_gbps"] for r in big) if big else None,
                    "min_fp8_gbps_8k_plus": min(r["fp8_gbps"] for r in big) if big else None,
                },
            },
        )
    if not ok:
        print("MISMATCH: a diffkv cache differs from torch's", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
