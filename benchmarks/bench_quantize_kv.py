"""The fp8 dense forward's rounding of K and V: ``_C.quantize_kv`` against torch's ops.

For N tokens of key/value ``[N, Hkv, D]`` (bf16, contiguous), both compute the scales
``amax / 448`` (one for K, one for V) and the e4m3 bytes
``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` into new tensors:

* diffkv: one ``_C.quantize_kv`` call (a memset, an amax kernel, a two-thread scales kernel and
  the quantizing KV write);
* torch: what the dense forward ran before it -- per tensor ``abs().amax()``, the scale by
  ``torch.where``, then ``float()``, the division, ``clamp_`` and ``to(float8_e4m3fn)``.

Both are timed interleaved with CUDA events (median of reps, L2 flushed before each call: the
whole call on the stream, gaps between its kernels included), their outputs and scales compared
bit for bit, and the memory each allocates beyond its outputs measured on one call
(``torch.cuda.max_memory_allocated``).  GB/s counts read K + V (bf16) + write K + V (1 byte):
the amax pass reads K and V a second time, which is not counted.

    python benchmarks/bench_quantize_kv.py [--quick] [--tokens 4096,...] [--kv-heads 8,24]
                                           [--device cuda|cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from diffkv import _C
from diffkv._bench import bench_device, environment, fmt, int_list, print_table, time_interleaved, write_json

F8 = torch.float8_e4m3fn


def torch_round(k: torch.Tensor, v: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The dense forward's rounding as torch ops (what ``_C.quantize_kv`` replaced)."""
    out, scales = [], []
    for x in (k, v):
        amax = x.abs().amax().float()
        # a tensor divisor: torch's CUDA division by a Python number multiplies by its rounded
        # reciprocal (one ulp off the quotient for about half of all amax values)
        scale = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
        scale = scale.reshape(1)
        scales.append(scale)
        out.append((x.float() / scale).clamp_(-448.0, 448.0).to(F8))
    return out, torch.cat(scales)


def diffkv_round(
    k: torch.Tensor, v: torch.Tensor, outs: list[torch.Tensor], scales: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    _C.quantize_kv(k, v, outs[0], outs[1], scales, None, None, None, None)
    return outs, scales


def _extra_bytes(fn, device: torch.device) -> int | None:
    """Bytes ``fn()`` allocates at its peak beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del result
    return peak


def _case(n: int, heads: int, head_size: int, device: torch.device, args) -> dict[str, Any]:
    gen = torch.Generator(device=device)
    gen.manual_seed(n * 7 + heads)
    k = (torch.randn(n, heads, head_size, generator=gen, device=device) * 3).to(torch.bfloat16)
    v = torch.randn(n, heads, head_size, generator=gen, device=device).to(torch.bfloat16)
    outs = [torch.empty(k.shape, dtype=F8, device=device) for _ in range(2)]
    scales = torch.empty(2, device=device)
    timed = time_interleaved(
        {"diffkv": lambda: diffkv_round(k, v, outs, scales), "torch": lambda: torch_round(k, v)},
        device,
        args.warmup,
        args.reps,
    )
    (tk, tv), tscales = torch_round(k, v)
    diffkv_round(k, v, outs, scales)
    exact = (
        torch.equal(outs[0].view(torch.uint8), tk.view(torch.uint8))
        and torch.equal(outs[1].view(torch.uint8), tv.view(torch.uint8))
        and torch.equal(scales, tscales)
    )
    del tk, tv
    # diffkv's outputs are allocated inside the measured call too, as the dense forward does
    mem_diffkv = _extra_bytes(
        lambda: diffkv_round(
            k,
            v,
            [torch.empty(k.shape, dtype=F8, device=device) for _ in range(2)],
            torch.empty(2, device=device),
        ),
        device,
    )
    mem_torch = _extra_bytes(lambda: torch_round(k, v), device)
    moved = 2 * k.numel() * (2 + 1)
    res: dict[str, Any] = {
        "num_tokens": n,
        "num_kv_heads": heads,
        "head_size": head_size,
        "bytes": moved,
        "bit_exact": bool(exact),
        "output_bytes": 2 * k.numel(),
        "diffkv_peak_bytes": mem_diffkv,
        "torch_peak_bytes": mem_torch,
    }
    for name, t in timed.items():
        res[f"{name}_us"] = t["median_us"]
        res[f"{name}_samples_us"] = t["samples_us"]
        res[f"{name}_gbps"] = moved / (t["median_us"] * 1e-6) / 1e9
    res["speedup"] = res["torch_us"] / res["diffkv_us"]
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU-friendly)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    parser.add_argument("--kv-heads", default=None, help="comma-separated KV head counts")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--json", default=None, help="write a JSON record here")
    args = parser.parse_args(argv)

    device = bench_device(args.device, parser.error)
    tokens = int_list(args.tokens or ("256,1024" if args.quick else "4096,16384,65536"))
    heads = int_list(args.kv_heads or ("2" if args.quick else "8,24"))
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 15)

    env = environment(device, checkout=__file__)
    print(
        f"fp8 rounding of dense K/V on {env.get('gpu', device)} (torch {env['torch']}, diffkv "
        f"{env['diffkv']}); bf16, head_size {args.head_size}; median of {args.reps} interleaved calls"
        + (", L2 flushed" if device.type == "cuda" else "")
    )
    results = [_case(n, h, args.head_size, device, args) for h in heads for n in tokens]
    mb = lambda b: fmt(b / 1e6) if b is not None else "-"  # noqa: E731
    headers = ["tokens", "kv heads", "diffkv us", "GB/s", "torch us", "GB/s", "speedup"]
    headers += ["outputs MB", "diffkv peak MB", "torch peak MB", "exact"]
    rows = [
        [
            str(r["num_tokens"]),
            str(r["num_kv_heads"]),
            fmt(r["diffkv_us"]),
            fmt(r["diffkv_gbps"], 0),
            fmt(r["torch_us"]),
            fmt(r["torch_gbps"], 0),
            fmt(r["speedup"], 2),
            mb(r["output_bytes"]),
            mb(r["diffkv_peak_bytes"]),
            mb(r["torch_peak_bytes"]),
            "yes" if r["bit_exact"] else "NO",
        ]
        for r in results
    ]
    print()
    print_table(headers, rows, left=0)
    print()
    print(
        "GB/s = (read bf16 K+V + write 1-byte K+V) / time; "
        "peak MB: allocated at the call's peak, outputs included"
    )
    ok = all(r["bit_exact"] for r in results)
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "quantize_kv",
                "quick": args.quick,
                "timing": {"warmup": args.warmup, "reps": args.reps},
                "env": env,
                "results": results,
                "summary": {"all_bit_exact": ok},
            },
        )
    if not ok:
        print("MISMATCH: diffkv's bytes or scales differ from torch's", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
