"""Dense diffusion attention: DiffKVAttentionImpl.forward against torch SDPA on video-DiT shapes.

Every case runs diffkv's dense forward (diffkv.dense: the paged kernels over contiguous K/V)
and torch SDPA's flash and cuDNN backends on the same bf16 data, each given the mask the way it
needs it, in one process; CUDA events, L2 flushed before each repetition, medians.  TFLOP/s =
4 * H * D * visible (query, key) pairs / time.

Cases (B x H x S x D):
* ``wan_nc``: 1 x 40 x 32760 x 128, no mask (Wan-14B 480p self-attention);
* ``wan_keypad``: the same with the last 512 keys padded out: diffkv gets a boolean
  ``attn_mask``; flash (no masks) runs on the valid key prefix (the same result); cuDNN gets
  the boolean mask (or reports that it cannot);
* ``varlen_4docs``: 4 documents of 8190 tokens packed in one row (``cu_seqlens``), 40 heads:
  diffkv runs one call with no attention across documents; flash and cuDNN run one call per
  document (the fastest way SDPA has to express it);
* ``wan_causal``: 1 x 40 x 32760 x 128 causal (the impl's flag);
* ``wan_joint512``: 1 x 40 x 32760 x 128 with a 512-token text prefix: diffkv gets
  ``joint_query``/``joint_key``/``joint_value`` (``joint_strategy="front"``, read in place);
  flash and cuDNN get the concatenated tensors, concatenated before timing (the cost a user
  of SDPA pays on top is not counted).

    python benchmarks/bench_dense.py [--cases wan_nc,...] [--reps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import diffkv
from diffkv._bench import environment, print_table, runnable, time_interleaved, write_json
from diffkv.backends.abstract import AttentionMetadata

CASES = ("wan_nc", "wan_keypad", "varlen_4docs", "wan_causal", "wan_joint512")


def _sdpa(backend: SDPBackend, q, k, v, mask=None, causal=False):
    """q/k/v [B, S, H, D] -> SDPA in [B, H, S, D] with enable_gqa."""
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal
        ).transpose(1, 2)


def _time(fns: dict[str, Any], device, args) -> dict[str, float | None]:
    """Median us of each call, timed interleaved (``time_interleaved``: every round runs each once,
    so the GPU's clock drift falls on all alike); a call whose first run raises is reported
    unavailable (None)."""
    timed = time_interleaved(runnable(fns), device, warmup=args.warmup, reps=args.reps)
    return {name: timed[name]["median_us"] if name in timed else None for name in fns}


def _case(name: str, device: torch.device, args) -> dict[str, Any]:
    dtype = torch.bfloat16
    heads, head = 40, 128
    gen = torch.Generator(device=device).manual_seed(7)
    impl = diffkv.DiffKVAttentionImpl(heads, head, softmax_scale=head**-0.5, causal=name == "wan_causal")
    s = 32760
    if name == "varlen_4docs":
        s = 4 * 8190
    q, k, v = (torch.randn(1, s, heads, head, generator=gen, device=device, dtype=dtype) for _ in range(3))
    res: dict[str, Any] = {"case": name}
    if name in ("wan_nc", "wan_causal"):
        causal = name == "wan_causal"
        pairs = s * (s + 1) // 2 if causal else s * s
        fns = {
            "diffkv": lambda: impl.forward(q, k, v),
            "flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal=causal),
            "cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal=causal),
        }
        res.update(_time(fns, device, args))
        ref = _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal=causal)
        res["max_diff"] = (impl.forward(q, k, v).float() - ref.float()).abs().max().item()
    elif name == "wan_joint512":
        text = (1, 512, heads, head)
        jq, jk, jv = (torch.randn(*text, generator=gen, device=device, dtype=dtype) for _ in range(3))
        meta = AttentionMetadata(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy="front")
        cq, ck, cv = (torch.cat(p, dim=1) for p in ((jq, q), (jk, k), (jv, v)))
        pairs = (s + 512) ** 2
        fns = {
            "diffkv": lambda: impl.forward(q, k, v, meta),
            "flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, cq, ck, cv),
            "cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, cq, ck, cv),
        }
        res.update(_time(fns, device, args))
        ref = _sdpa(SDPBackend.FLASH_ATTENTION, cq, ck, cv)
        res["max_diff"] = (impl.forward(q, k, v, meta).float() - ref.float()).abs().max().item()
    elif name == "wan_keypad":
        valid = s - 512
        keep = torch.zeros(1, s, dtype=torch.bool, device=device)
        keep[:, :valid] = True
        meta = AttentionMetadata(attn_mask=keep)
        pairs = s * valid
        bool_mask = keep[:, None, None, :]
        fns = {
            "diffkv": lambda: impl.forward(q, k, v, meta),
            "flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, q, k[:, :valid], v[:, :valid]),
            "cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, mask=bool_mask),
        }
        res.update(_time(fns, device, args))
        ref = _sdpa(SDPBackend.FLASH_ATTENTION, q, k[:, :valid], v[:, :valid])
        res["max_diff"] = (impl.forward(q, k, v, meta).float() - ref.float()).abs().max().item()
    else:
        doc = 8190
        cu = torch.arange(0, s + 1, doc, dtype=torch.int32)
        meta = AttentionMetadata(
            extra={"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": doc, "max_seqlen_k": doc}
        )
        pairs = 4 * doc * doc
        docs = [(i * doc, (i + 1) * doc) for i in range(4)]

        def per_doc(backend):
            return [_sdpa(backend, q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in docs]

        fns = {
            "diffkv": lambda: impl.forward(q, k, v, meta),
            "flash": lambda: per_doc(SDPBackend.FLASH_ATTENTION),
            "cudnn": lambda: per_doc(SDPBackend.CUDNN_ATTENTION),
        }
        res.update(_time(fns, device, args))
        ref = torch.cat(per_doc(SDPBackend.FLASH_ATTENTION), dim=1)
        res["max_diff"] = (impl.forward(q, k, v, meta).float() - ref.float()).abs().max().item()
    res["kernel"] = diffkv._C.last_attention_kernel()
    flops = 4.0 * heads * head * pairs
    for key in ("diffkv", "flash", "cudnn"):
        us = res.get(key)
        res[f"{key}_tflops"] = None if us is None else flops / us / 1e6
    for key in ("flash", "cudnn"):
        base = res.get(f"{key}_tflops")
        res[f"vs_{key}"] = None if base is None else res["diffkv_tflops"] / base
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_dense needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    env = environment(device, checkout=__file__)
    print(
        f"diffkv dense attention vs torch SDPA on {env.get('gpu')} (diffkv kernel: "
        f"{env['diffkv_build']['attention_kernel']}); bf16; median of {args.reps}, L2 flushed"
    )
    results = []
    for name in [c for c in args.cases.split(",") if c]:
        if name not in CASES:
            parser.error(f"--cases: unknown {name!r}; choose from {', '.join(CASES)}")
        results.append(_case(name, device, args))
        torch.cuda.empty_cache()

    def f(x, digits=1):
        return "n/a" if x is None else f"{x:.{digits}f}"

    rows = [
        [
            r["case"],
            r["kernel"],
            f(r["diffkv_tflops"]),
            f(r["flash_tflops"]),
            f(r["cudnn_tflops"]),
            f(r["vs_flash"], 2),
            f(r["vs_cudnn"], 2),
            f"{r['max_diff']:.1e}",
        ]
        for r in results
    ]
    print_table(
        ["case", "kernel", "diffkv TFLOP/s", "flash TFLOP/s", "cudnn TFLOP/s", "vs flash", "vs cudnn"]
        + ["max diff"],
        rows,
    )
    if args.json:
        write_json(args.json, {"benchmark": "dense", "env": env, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
