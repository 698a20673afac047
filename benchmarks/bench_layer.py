"""One HunyuanImage-3.0 denoise layer call end to end -- KV write + attention -- against torch.

diffkv: ``_C.forward_paged``, the one C call a layer's ``forward_paged`` makes: the step's new
K/V written into the paged cache (block 16, randomly permuted blocks, or with ``--order
allocation`` each row's blocks consecutive ids as a fresh pool hands them out) and the attention of the
step's queries over each row's prefix + new keys.  Geometry (issue 4): 2 CFG rows, 32/8 heads x
128, prefixes 500 and 3500 + 4097 image tokens, bf16, a full-attention span over the image
tokens (key limit = the row's length for every query).

torch, what a user of SDPA does per layer: each row's K/V kept in a contiguous buffer whose
prefix is already there, the step's K/V copied into its tail (``copy_``), then SDPA per row
(rows differ in length) with ``enable_gqa``, on the flash and the cuDNN backend.

Reported: median time of the whole call, TFLOP/s of its attention (4 * H * D * visible pairs /
time) and diffkv's speed-up.  The Python around the binding (``prepare_layer_context`` and the
``forward_paged`` wrapper, ~25 us per layer on the H200 host) is ``benchmarks/bench_host.py``'s.

    python benchmarks/bench_layer.py [--reps 10] [--order random|allocation] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffkv import _C
from diffkv._bench import environment, print_table, runnable, time_interleaved, write_json

BLOCK = 16


def _problem(quick: bool, device: torch.device, order: str = "random") -> dict[str, Any]:
    heads, kv_heads, head = (4, 2, 64) if quick else (32, 8, 128)
    prefixes, image = ((5, 35), 41) if quick else ((500, 3500), 4097)
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(3)
    seq = [p + image for p in prefixes]
    blocks = [-(-s // BLOCK) for s in seq]
    num_blocks = sum(blocks) + 8
    if order == "allocation":
        ids = torch.arange(num_blocks)
    else:
        ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    table = torch.zeros(len(seq), max(blocks), dtype=torch.int32)
    at = 0
    for r, n in enumerate(blocks):
        table[r, :n] = ids[at : at + n].to(torch.int32)
        at += n
    cache = torch.zeros(2, num_blocks, BLOCK, kv_heads, head, dtype=dtype, device=device)
    # each row's whole K/V (prefix + this step's image tokens) and the torch buffers
    k_rows = [torch.randn(s, kv_heads, head, generator=g, device=device, dtype=dtype) for s in seq]
    v_rows = [torch.randn(s, kv_heads, head, generator=g, device=device, dtype=dtype) for s in seq]
    slots = []
    for r, (p, s) in enumerate(zip(prefixes, seq, strict=True)):
        pos = torch.arange(s)
        row_slots = (table[r, pos // BLOCK].long() * BLOCK + pos % BLOCK).to(device)
        _C.kv_write(k_rows[r][:p], v_rows[r][:p], cache, row_slots[:p])  # the cached prefix
        slots.append(row_slots[p:])
    q = torch.randn(len(seq) * image, heads, head, generator=g, device=device, dtype=dtype)
    k_new = torch.cat([k[p:] for k, p in zip(k_rows, prefixes, strict=True)])
    v_new = torch.cat([v[p:] for v, p in zip(v_rows, prefixes, strict=True)])
    qsl = torch.tensor([0, image, 2 * image], dtype=torch.int32)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    limits = torch.cat([torch.full((image,), s, dtype=torch.int32) for s in seq])
    return {
        "heads": heads,
        "kv_heads": kv_heads,
        "head": head,
        "prefixes": prefixes,
        "image": image,
        "seq": seq,
        "cache": cache,
        "table": table,
        "q": q,
        "k_new": k_new,
        "v_new": v_new,
        "slots": torch.cat(slots),
        "qsl": qsl,
        "seq_lens": seq_lens,
        "limits": limits.to(device),
        "k_rows": k_rows,
        "v_rows": v_rows,
    }


def _diffkv(p: dict[str, Any], device: torch.device):
    out = torch.empty_like(p["q"])
    dev = {n: p[n].to(device) for n in ("table", "qsl", "seq_lens")}
    scale = p["head"] ** -0.5

    def run():
        _C.forward_paged(
            p["q"], p["k_new"], p["v_new"], p["cache"], p["slots"], dev["table"], dev["qsl"],
            dev["seq_lens"], p["limits"], _C.MASK_LIMITS, scale, out, p["table"], p["qsl"],
            p["seq_lens"],
        )  # fmt: skip

    return run, out


def _torch_layer(p: dict[str, Any], backend: SDPBackend):
    """Per row: the step's K/V copied into the row's contiguous buffer, then SDPA."""
    kbuf = [k.clone() for k in p["k_rows"]]
    vbuf = [v.clone() for v in p["v_rows"]]
    image = p["image"]
    outs = [torch.empty(image, p["heads"], p["head"], dtype=p["q"].dtype, device=p["q"].device) for _ in kbuf]

    def run():
        for r, pre in enumerate(p["prefixes"]):
            kbuf[r][pre:].copy_(p["k_new"][r * image : (r + 1) * image])
            vbuf[r][pre:].copy_(p["v_new"][r * image : (r + 1) * image])
            q = p["q"][r * image : (r + 1) * image]
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None],
                    kbuf[r].transpose(0, 1)[None],
                    vbuf[r].transpose(0, 1)[None],
                    enable_gqa=True,
                )
            outs[r].copy_(o[0].transpose(0, 1))

    return run, outs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU-friendly)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--order", choices=("random", "allocation"), default="random", help="cache block order"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = environment(device, checkout=__file__)
    p = _problem(args.quick or device.type != "cuda", device, args.order)
    pairs = sum(p["image"] * s for s in p["seq"])
    flops = 4.0 * p["heads"] * p["head"] * pairs
    run, out = _diffkv(p, device)
    run()
    kernel = _C.last_attention_kernel()
    # diffkv and the torch layers timed interleaved (one of each per repetition round), so the
    # GPU's clock drift falls on all alike
    layers: dict[str, Any] = {}
    if device.type == "cuda":
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            layers[name] = _torch_layer(p, backend)
    timers = runnable({name: trun for name, (trun, _) in layers.items()})
    torch_outs = {name: layers[name][1] for name in timers}
    timed = time_interleaved({"diffkv": run, **timers}, device, warmup=args.warmup, reps=args.reps)
    t = timed["diffkv"]["median_us"]
    res: dict[str, Any] = {
        "case": "hunyuan_denoise_layer",
        "order": args.order,
        "diffkv_us": t,
        "kernel": kernel,
    }
    res["diffkv_tflops"] = flops / t / 1e6
    rows = [["diffkv _C.forward_paged", f"{t:.1f}", f"{res['diffkv_tflops']:.1f}", "1.00"]]
    if device.type == "cuda":
        for name, touts in torch_outs.items():
            tb = timed[name]["median_us"]
            diff = max(
                (out[r * p["image"] : (r + 1) * p["image"]].float() - touts[r].float()).abs().max().item()
                for r in range(len(p["seq"]))
            )
            res[f"{name}_us"] = tb
            res[f"speedup_vs_{name}"] = tb / t
            res[f"max_diff_vs_{name}"] = diff
            tflops = flops / tb / 1e6
            rows.append([f"torch copy_ + SDPA {name}", f"{tb:.1f}", f"{tflops:.1f}", f"{tb / t:.2f}"])
    heads = f"{p['heads']}/{p['kv_heads']}x{p['head']}"
    print(
        f"one denoise layer call (KV write + attention) on {env.get('gpu') or device.type}: 2 rows, "
        f"{heads}, prefixes {p['prefixes']} + {p['image']} image tokens, bf16, block {BLOCK} "
        f"({args.order} order); "
        f"diffkv kernel {kernel}; median of {args.reps}"
    )
    print_table(["what", "us", "attention TFLOP/s", "its time / diffkv's"], rows)
    for name in ("flash", "cudnn"):
        if f"speedup_vs_{name}" in res:
            speed, diff = res[f"speedup_vs_{name}"], res[f"max_diff_vs_{name}"]
            print(f"diffkv vs {name}: {speed:.2f}x faster (max |diff| {diff:.1e})")
    if args.json:
        write_json(args.json, {"benchmark": "layer", "env": env, "results": [res]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
