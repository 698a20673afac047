"""Rows of different prompts in one paged attention call: diffkv against cuDNN SDPA run per row.

A diffusion step over a batch of images whose text prompts differ (a CFG pair of a prompt and the
empty one, a batch of prompts): every row holds its prompt's K/V and then the image tokens' K/V,
and the step's queries are the image tokens, each seeing its whole row (HunyuanImage-3.0's
denoise step: the plan's span covers the queries, so the call is unmasked -- ops.plan_mask).
The rows share one query length and differ in seq_len; on Hopper that call runs the persistent
kernel for up to 8 rows ('sm90-persist', docs/hopper-kernels.md), more on 'sm90-tma16'.

Per case (``--prompts`` lists, one per case, each entry a row; ``--image`` token counts): q
[R x image, H, D] and a paged cache of 16-token blocks in a random permutation (bf16, 32 query /
8 KV heads x 128 unless told), diffkv's ``_C.paged_attention`` against cuDNN's
``F.scaled_dot_product_attention`` (``sdpa_kernel(CUDNN_ATTENTION)``, ``enable_gqa``) called once
per row on dense ``[1, H, S, D]`` copies -- the way a dense attention serves rows of different
lengths without padding.  Timing as ``diffkv._bench.time_interleaved`` (warm-up, L2 flushed
before each call, the order rotated per round, medians).  TFLOP/s = 4 H D sum(image x seq_len)
/ time.  Each diffkv output is checked against the baseline's (max |diff|; on the CPU against
torch's math SDPA, no timing claims there).

    python benchmarks/bench_prompts.py                       # the table in docs/performance.md
    python benchmarks/bench_prompts.py --prompts 500,3500 --image 1k,2k,4k --json out/prompts.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from diffkv import _C, _bench

DEFAULT_PROMPTS = ("500,3500", "500,1500,2500,3500", "100,300,500,700,900,1100,1300,1500")


def _tokens(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        n = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        if n <= 0:
            raise SystemExit(f"bench_prompts: token counts must be positive, got {part!r}")
        out.append(n)
    return out


def _case(prompts, image, heads, kv_heads, head_size, dtype, device, reps, gen):
    rows = len(prompts)
    seqs = [p + image for p in prompts]
    qs = [torch.randn(1, heads, image, head_size, generator=gen).to(device, dtype) for _ in seqs]
    ks = [torch.randn(1, kv_heads, s, head_size, generator=gen).to(device, dtype) for s in seqs]
    vs = [torch.randn(1, kv_heads, s, head_size, generator=gen).to(device, dtype) for s in seqs]
    longest = max(seqs)
    kp = torch.zeros(rows, kv_heads, longest, head_size, device=device, dtype=dtype)
    vp = torch.zeros_like(kp)
    for r in range(rows):
        kp[r, :, : seqs[r]] = ks[r][0]
        vp[r, :, : seqs[r]] = vs[r][0]
    paged = _bench._paged(kp, vp, 16, torch.Generator().manual_seed(1), query_len=image)
    seq_lens = torch.tensor(seqs, dtype=torch.int32)  # the rows' own lengths (the tail of each
    paged["seq_lens"] = seq_lens.to(device)  # padded row is never read)
    paged["host"] = (paged["host"][0], paged["host"][1], seq_lens)
    q = torch.cat([x[0].transpose(0, 1) for x in qs]).contiguous()
    out = torch.empty_like(q)
    scale = head_size**-0.5
    diffkv_call = _bench.paged_call(q, paged, _C.MASK_NONE, scale, out)
    diffkv_call()
    kernel = _C.last_attention_kernel()

    def per_row():
        return [
            F.scaled_dot_product_attention(qs[r], ks[r], vs[r], scale=scale, enable_gqa=True)
            for r in range(rows)
        ]

    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def baseline():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return per_row()
    else:
        baseline = per_row
    ref = torch.cat([o[0].transpose(0, 1) for o in baseline()])
    max_diff = (out.float() - ref.float()).abs().max().item()
    times = _bench.time_interleaved({"diffkv": diffkv_call, "baseline": baseline}, device, 3, reps)
    flops = 4 * heads * head_size * sum(image * s for s in seqs)
    d_us, b_us = times["diffkv"]["median_us"], times["baseline"]["median_us"]
    return {
        "prompts": list(prompts),
        "image": image,
        "seq_lens": seqs,
        "kernel": kernel,
        "diffkv_us": d_us,
        "baseline_us": b_us,
        "diffkv_tflops": flops / d_us / 1e6,
        "baseline_tflops": flops / b_us / 1e6,
        "ratio": b_us / d_us,
        "max_abs_diff": max_diff,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", action="append", help="a case's prompt tokens per row, e.g. 500,3500")
    ap.add_argument("--image", default="1k,2k", help="image tokens per row (the queries), e.g. 1k,2k,4k")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    cases = [_tokens(p) for p in (args.prompts or DEFAULT_PROMPTS)]
    images = _tokens(args.image)
    baseline = "cuDNN SDPA per row" if device.type == "cuda" else "torch SDPA per row (CPU: no timing claims)"
    gen = torch.Generator().manual_seed(0)
    results, table = [], []
    for prompts in cases:
        for image in images:
            r = _case(
                prompts, image, args.heads, args.kv_heads, args.head_size, dtype, device, args.reps, gen
            )
            results.append(r)
            table.append(
                [
                    "/".join(str(p) for p in prompts),
                    str(image),
                    r["kernel"],
                    _bench.fmt(r["diffkv_us"]),
                    _bench.fmt(r["diffkv_tflops"], 0),
                    _bench.fmt(r["baseline_us"]),
                    _bench.fmt(r["ratio"], 3),
                    f"{r['max_abs_diff']:.1e}",
                ]
            )
    heads = f"{args.heads}/{args.kv_heads} heads x {args.head_size} {args.dtype}"
    print(f"rows of different prompts, {heads}, vs {baseline}")
    _bench.print_table(
        ["prompts", "image", "kernel", "diffkv us", "TFLOP/s", "baseline us", "ratio", "max |diff|"],
        table,
        left=3,
    )
    if args.json:
        record = {
            "benchmark": "prompts",
            "baseline": baseline,
            "config": vars(args),
            "environment": _bench.environment(device, checkout=__file__),
            "results": results,
        }
        _bench.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
