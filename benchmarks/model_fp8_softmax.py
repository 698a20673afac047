"""A CPU model of the e4m3 attention kernel's numerics, and of a variant with S in f16.

The 'fp32' form is the Hopper e4m3 kernel (cuda/attention_sm90_fp8.cu) before its f16 form: Q
rounded to e4m3 per row (amax / 448), K and V as e4m3 with per-tensor scales, S = Q K^T in fp32,
the online softmax in fp32 over 128-key tiles with P = 2^8 p rounded to e4m3, O = P V in fp32.
The kernel now runs S in f16 over 256-key tiles (docs/fp8.md, *What the Hopper kernel
computes*), close to the variant below (its Q scale and exponent's form differ).  The variant
models what benchmarks/probe_wgmma.cu's ``step+softmax16`` times: S accumulated in f16
by the wgmma (each 32-dim k-step's exact dot product added to an f16 accumulator), the scaled
exponent in f16 (one fused multiply-add, rounded), ``ex2.approx.f16x2`` (modelled as the
correctly rounded f16 of 2^x), P rounded to e4m3 from f16, and each thread's tile sums in f16
pairs (four chains of four pairs, then a tree) added into fp32.  To keep S under f16's 65,504
the variant scales Q's row so that ||q||_1 max|k| stays under half of it (an e4m3 row scaled so
is no less exact: e4m3 is floating point), and, with --pow2, so that the exponent's multiplier
is a power of two (exact in f16).

Both are compared with float64 attention on the original bf16 data (the accuracy tables of
bench_fp8.py use the same data and scales): relative L2 error and max abs error.  Usage:

    python benchmarks/model_fp8_softmax.py [--queries 1024] [--keys 4096] [--data gaussian,outlier]
"""

from __future__ import annotations

import argparse
import math

import torch

E4M3_MAX = 448.0
F16_MAX = 65504.0
HEAD = 128
TILE = 128
P_LOG2 = 8
OUTLIER_CHANNELS = 4  # as bench_fp8.py
OUTLIER_FACTOR = 20.0


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating round to e4m3, back in float64."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double()


def f16(x: torch.Tensor) -> torch.Tensor:
    """Round to f16 (to nearest even), back in float64."""
    return x.to(torch.float16).double()


def make_data(kind: str, n_q: int, n_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, HEAD, generator=gen).to(torch.bfloat16).double() for n in (n_q, n_k, n_k))
    if kind == "outlier":
        pick = torch.randperm(HEAD, generator=torch.Generator().manual_seed(seed + 1))[:OUTLIER_CHANNELS]
        for x in (q, k, v):
            x[:, pick] = (x[:, pick] * OUTLIER_FACTOR).to(torch.bfloat16).double()
    elif kind != "gaussian":
        raise ValueError(kind)
    return q, k, v


def reference(q, k, v, scale):
    s = (q @ k.T) * scale
    p = torch.softmax(s, dim=-1)
    return p @ v


def kernel_model(q, k, v, scale, variant: str):
    """The online softmax over 128-key tiles; variant 'fp32' (the kernel) or 'f16' / 'f16-pow2'."""
    k_scale = k.abs().amax() / E4M3_MAX
    v_scale = v.abs().amax() / E4M3_MAX
    k8, v8 = e4m3(k / k_scale), e4m3(v / v_scale)
    amax = q.abs().amax(dim=1, keepdim=True)
    qs = amax / E4M3_MAX
    if variant != "fp32":
        # ||q / qs||_1 * max|k8| <= F16_MAX / 2, i.e. qs >= ||q||_1 max|k8| / (F16_MAX / 2)
        qs = torch.maximum(qs, q.abs().sum(dim=1, keepdim=True) * k8.abs().amax() / (F16_MAX / 2))
    scale_log2 = scale / math.log(2.0)
    sl2 = scale_log2 * float(k_scale) * qs  # per row
    if variant == "f16-pow2":  # qs up to 2x larger: sl2 a power of two, the bound still kept
        sl2 = torch.exp2(torch.ceil(torch.log2(sl2)))
        qs = sl2 / (scale_log2 * float(k_scale))
    q8 = e4m3(q / qs)
    n_q = q.shape[0]
    o = torch.zeros(n_q, HEAD, dtype=torch.float64)
    m = torch.full((n_q, 1), -math.inf, dtype=torch.float64)
    shift_prev = None
    row_sum = torch.zeros(n_q, 1, dtype=torch.float64)
    for j0 in range(0, k.shape[0], TILE):
        kt, vt = k8[j0 : j0 + TILE], v8[j0 : j0 + TILE]
        if variant == "fp32":
            s = (q8 @ kt.T).float().double()  # exact products and sums, one fp32 rounding
            mn = torch.maximum(m, s.amax(dim=1, keepdim=True))
            base = mn * sl2
            alpha = torch.exp2(m * sl2 - base) if j0 else torch.zeros_like(m)
            p = torch.exp2((s * sl2 - (base - P_LOG2)).float().double())
            tile_sum = p.sum(dim=1, keepdim=True)
            m = mn
        else:
            s = torch.zeros(n_q, kt.shape[0], dtype=torch.float64)
            for c in range(0, HEAD, 32):  # each k-step's exact dot product into the f16 accumulator
                s = f16(s + q8[:, c : c + 32] @ kt[:, c : c + 32].T)
            assert s.abs().max() <= F16_MAX, "S overflowed f16"
            mn = torch.maximum(m, s.amax(dim=1, keepdim=True))
            shift = f16(P_LOG2 - mn * sl2)  # the f16 shift the HFMA2 adds
            sl2h = f16(sl2)
            alpha = torch.exp2(shift - shift_prev) if j0 else torch.zeros_like(m)
            t = f16(s * sl2h + shift)  # fused multiply-add, one rounding
            p = f16(torch.exp2(t))
            tile_sum = f16_tile_sums(p)
            m, shift_prev = mn, shift
        row_sum = row_sum * alpha + tile_sum
        o = o * alpha + e4m3(p) @ vt  # the products exact, the sum in fp32 (float64 here)
    return o * float(v_scale) / row_sum


def f16_tile_sums(p: torch.Tensor) -> torch.Tensor:
    """Each row's tile sum as the variant computes it: thread tq holds keys 8 nt + 2 tq + e (nt <
    16, e < 2) as 16 f16 pairs, summed in four chains (pairs nt = c, c + 4, ..) and a tree, in f16;
    its low and high halves and then the four threads in fp32."""
    n_q, n = p.shape
    x = torch.zeros(n_q, TILE, dtype=torch.float64)
    x[:, :n] = p
    x = x.view(n_q, 4, 4, 4, 2)  # [row, j, c, tq, e]: nt = 4 j + c, key 8 nt + 2 tq + e
    chains = x[:, 0]
    for j in range(1, 4):
        chains = f16(chains + x[:, j])
    pair = f16(f16(chains[:, 0] + chains[:, 1]) + f16(chains[:, 2] + chains[:, 3]))  # [row, tq, e]
    per_thread = (pair[..., 0].float() + pair[..., 1].float()).double()
    return per_thread.sum(dim=1, keepdim=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--data", default="gaussian,outlier")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    scale = HEAD**-0.5
    print(f"{args.queries} queries x {args.keys} keys x {HEAD}, float64 reference on the bf16 data")
    print("| data | form | rel. L2 | max abs |")
    print("|---|---|---:|---:|")
    for kind in args.data.split(","):
        q, k, v = make_data(kind, args.queries, args.keys, args.seed)
        ref = reference(q, k, v, scale)
        for variant in ("fp32", "f16", "f16-pow2"):
            out = kernel_model(q, k, v, scale, variant)
            rel = float((out - ref).norm() / ref.norm())
            print(f"| {kind} | {variant} | {rel:.4f} | {float((out - ref).abs().max()):.3e} |")


if __name__ == "__main__":
    main()
