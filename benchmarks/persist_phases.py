"""Where a work item's time goes in the persistent Hopper kernel (cuda/attention_sm90_persist.cu).

Makes a stamped copy of the source tree (nothing in the package changes): clock64 stamps by
the first thread of each consumer warpgroup at an item's start, at the end of its key loop and
at the end of its epilogue, and around the warpgroup's whole pass, summed over every warpgroup
of a launch into a `__device__` array that the copy's extension exports (`dk_hps_dump`,
`dk_hps_reset`).  Then, with that copy built, it times unmasked uniform short rows (32/8 heads x
128, bf16, block 16 in random order, the CLI bench's shapes) and prints per item: the key loop's
cycles per 128-key tile, the tail's (the last P V, the next item's first Q K^T issued, the
epilogue), and the share of a warpgroup's pass outside its items (docs/hopper-kernels.md, *The
persistent form*, has what it showed).  The tails of items followed by another (the next item's
first Q K^T issued with the last P V) are split further: the waits before the last P V (its V
slot and its zeroing; the next item's Q and first K, tested together; the next Q's negation
for a negative scale; the turn), the last P V (until
`wgmma_wait_1`, the next item's Q K^T issued beside it), the epilogue's store of O
(`hp_store_o`) and the rest (the next item's Q K^T done, the slots released):

    python benchmarks/persist_phases.py patch /tmp/ps          # stamped copy of this tree
    (cd /tmp/ps && DIFFKV_CUDA_ARCHS=90a python setup.py -q build_ext --inplace)
    PYTHONPATH=/tmp/ps/python python benchmarks/persist_phases.py run [--shapes 2x2048,1x4096]

The patch anchors on the source text and stops with an error if that text moved.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

# benchmarks/ is sys.path[0] when run as a script
from cta_timeline import HEADER_ANCHOR, stamp_copy, sums_header

KERNEL_FILE = Path("cuda") / "attention_sm90_persist.cu"
WORDS = 14  # 0 loop cycles, 1 tail cycles, 2 items, 3 tiles, 4 pass cycles, 5 passes,
# 6..9 the split tails' waits, last P V, store of O and rest, 10 split tails, 11..13 the waits'
# parts: the last V (and its zeroing), the next item's Q and first K (one mbar_wait2), the
# next Q's negation for a negative scale (the turn: the rest)

HEADER = sums_header("hps", WORDS)

# (anchor, text, where): each anchor must occur exactly once in the kernel's file
EDITS = (
    (HEADER_ANCHOR, HEADER, "after"),
    ("    regs::consumer();\n", "    const unsigned long long hps_pass = hps_clk();\n", "after"),
    (
        "        const bool was_ahead = ahead;\n        ahead = false;\n",
        "        const unsigned long long hps_c0 = hps_clk();\n        unsigned long long hps_c1 = hps_c0;\n"
        "        unsigned long long hps_t1 = 0, hps_t2 = 0, hps_t3 = 0;\n"
        "        unsigned long long hps_tv = 0, hps_tq = 0, hps_tk = 0;\n",
        "after",
    ),
    (
        "            /* The next item's first Q K^T goes with this last P V (one turn), so that it runs",
        "            hps_tv = hps_clk();\n",
        "before",
    ),
    (
        "                           full_k + 8u * nslot, (uint32_t)((npos / ST) & 1));\n",
        "                hps_tq = hps_clk();\n",
        "after",
    ),
    (
        "                    h90_negate_q<D, BM, 128, 64>(nsq, wt, cw * 64);\n"
        "                    fence_proxy_async();\n"
        "                    named_barrier(1u + (uint32_t)cw, 128u);\n"
        "                }\n",
        "                hps_tk = hps_clk();\n",
        "after",
    ),
    (
        "                named_barrier(8u + (uint32_t)cw, 256u);\n"
        "            }\n"
        "            fence_regs(o);\n",
        "            hps_t1 = hps_clk();\n",
        "before_last_line",
    ),
    (
        "wgmma_wait_1(); /* this item's P V done; the next item's S may still run */\n",
        "                hps_t2 = hps_clk();\n",
        "after",
    ),
    (
        "                /* the epilogue under the next item's first Q K^T */\n"
        "                hp_store_o<T>(a, &tmo, sq, cw, wt, cur, query_len, l, m, scale_log2, o);\n",
        "                hps_t3 = hps_clk();\n",
        "after",
    ),
    (
        "            /* The last tile's V: rows past kv_end become zeros",
        "            hps_c1 = hps_clk();\n",
        "before",
    ),
    (
        "        base += n_tiles;\n    }\n    if (wt == 0) {\n        tma_store_wait();",
        "        if (wt == 0) {\n"
        "            const unsigned long long hps_c2 = hps_clk();\n"
        "            atomicAdd(&hps_sum[0], hps_c1 - hps_c0);\n"
        "            atomicAdd(&hps_sum[1], hps_c2 - hps_c1);\n"
        "            atomicAdd(&hps_sum[2], 1ull);\n"
        "            atomicAdd(&hps_sum[3], (unsigned long long)n_tiles);\n"
        "            if (hps_t3 != 0) {\n"
        "                atomicAdd(&hps_sum[6], hps_t1 - hps_c1);\n"
        "                atomicAdd(&hps_sum[7], hps_t2 - hps_t1);\n"
        "                atomicAdd(&hps_sum[8], hps_t3 - hps_t2);\n"
        "                atomicAdd(&hps_sum[9], hps_c2 - hps_t3);\n"
        "                atomicAdd(&hps_sum[10], 1ull);\n"
        "                atomicAdd(&hps_sum[11], hps_tv - hps_c1);\n"
        "                atomicAdd(&hps_sum[12], hps_tq - hps_tv);\n"
        "                atomicAdd(&hps_sum[13], hps_tk - hps_tq);\n"
        "            }\n"
        "        }\n",
        "before",
    ),
    (
        "    if (cw == 0) {\n        named_barrier(8u, 256u); /* the last turn's hand-over",
        "    if (wt == 0) {\n"
        "        atomicAdd(&hps_sum[4], hps_clk() - hps_pass);\n"
        "        atomicAdd(&hps_sum[5], 1ull);\n"
        "    }\n",
        "before",
    ),
)


def patch(dest: Path) -> None:
    stamp_copy(dest, KERNEL_FILE, EDITS)
    print(f"stamped copy at {dest}; build it there and put its python/ on PYTHONPATH")


def run(shapes: list[tuple[int, int]]) -> None:
    import torch

    from diffkv import _C

    lib = ctypes.CDLL(_C.__file__)
    if not hasattr(lib, "dk_hps_dump"):
        sys.exit("this diffkv build has no stamps: build the copy `patch` made and put it on PYTHONPATH")
    heads, kv_heads, head, block = 32, 8, 128, 16
    print(
        "rows x tokens | kernel | items / warpgroup | cycles / tile | tail cycles / item | outside items"
        " | split tails: waits (V, next Q and K, negate Q, turn) / last P V / store O / rest"
    )
    for rows, n in shapes:
        gen = torch.Generator().manual_seed(rows * n)
        blocks = rows * (n // block)
        cache = torch.randn(2, blocks, block, kv_heads, head, generator=gen).to(torch.bfloat16).cuda()
        table = torch.randperm(blocks, generator=gen).int().view(rows, n // block).cuda()
        q = torch.randn(rows * n, heads, head, generator=gen).to(torch.bfloat16).cuda()
        qsl = torch.arange(0, rows * n + 1, n, dtype=torch.int32)
        seq = torch.full((rows,), n, dtype=torch.int32)
        out = torch.empty_like(q)
        host = (table.cpu(), qsl, seq)  # the metadata's host copies
        args = (q, cache, table, qsl.cuda(), seq.cuda(), None, _C.MASK_NONE, head**-0.5, out, *host)
        for _ in range(3):
            _C.paged_attention(*args)
        torch.cuda.synchronize()
        if lib.dk_hps_reset() != 0:
            sys.exit("dk_hps_reset failed")
        _C.paged_attention(*args)
        torch.cuda.synchronize()
        sums = (ctypes.c_ulonglong * WORDS)()
        if lib.dk_hps_dump(sums) != 0:
            sys.exit("dk_hps_dump failed")
        loop, tail, items, tiles, pas, passes = (sums[i] for i in range(6))
        waits, last_pv, store, rest, split, w_v, w_q, w_k = (sums[i] for i in range(6, 14))
        if not items:
            print(f"{rows} x {n} | {_C.last_attention_kernel()} | no items stamped")
            continue
        outside = 1.0 - (loop + tail) / pas
        pieces = "none"
        if split:
            parts = ", ".join(f"{x / split:.0f}" for x in (w_v, w_q, w_k, waits - w_v - w_q - w_k))
            after = " / ".join(f"{x / split:.0f}" for x in (last_pv, store, rest))
            pieces = f"{waits / split:.0f} ({parts}) / {after}"
        print(
            f"{rows} x {n} | {_C.last_attention_kernel()} | {items / passes:.2f} | {loop / tiles:.0f} | "
            f"{tail / items:.0f} | {100 * outside:.1f} % | {pieces} ({split} items)"
        )


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("patch", help="make a stamped copy of this tree")
    p.add_argument("dest", type=Path)
    r = sub.add_parser("run", help="time the short rows on the stamped build")
    r.add_argument("--shapes", default="1x1024,1x2048,1x4096,2x1024,2x2048,2x4096")
    args = parser.parse_args(argv)
    if args.cmd == "patch":
        patch(args.dest)
    else:
        run([tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
