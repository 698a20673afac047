"""Per-CTA timeline of the Hopper e4m3 kernel (cuda/attention_sm90_fp8.cuh): a CTA's fixed costs.

cta_timeline.py's stamps, placed in the e4m3 kernel: clock64 per CTA at entry, after the
barrier that publishes the key limits, the producer's last issue, the consumers' Q rounded and
in shared memory, K's first tile landed, the first S = Q K^T done, the key loop's end and the
output stores issued (with `%smid` and `%globaltimer`), kept in a `__device__` array that the
copy's extension exports (`dk_tl_dump`, `dk_tl_clear`). Then, with that copy built, it runs
bench_fp8.py's cases once each and prints each phase's median per CTA, the gap between one
CTA's end and the next one's start on an SM, and how much of the launch the SMs spent outside
any CTA (the gaps, and the tail: an SM idle after its last CTA while others still run):

    python benchmarks/fp8_timeline.py patch /tmp/tl8      # stamped copy of this tree
    (cd /tmp/tl8 && DIFFKV_CUDA_ARCHS=90a python setup.py -q build_ext --inplace)
    PYTHONPATH=/tmp/tl8/python python benchmarks/fp8_timeline.py run

The stamps are the TMA producer's forms' (attention_sm90_fp8_tma.cu, the forms bench_fp8.py's
cases run); the cp.async forms, compiled apart, stamp an array of their own that nothing reads.
The patch anchors on the source text and stops with an error if that text moved.
"""

from __future__ import annotations

import collections
import ctypes
import statistics
import sys
from pathlib import Path

# benchmarks/ is sys.path[0] when run as a script
from cta_timeline import (
    HEADER_ANCHOR,
    TL_MAX,
    _phases,
    patch_run_main,
    stamp_copy_home,
    stamped_lib,
    timeline_header,
)

ROOT = Path(__file__).resolve().parent.parent
KERNEL_FILE = Path("cuda") / "attention_sm90_fp8.cuh"
HOME_FILE = Path("cuda") / "attention_sm90_fp8_tma.cu"  # the file whose stamps are read

TL_E = 16  # words of a CTA's row: cta_timeline.py's 0-10 (entry, limits, Q in, first S, loop
# end, stores of warpgroups 0 and 1, producer done, smid, %globaltimer at entry and at the
# stores), then K's first tile landed for the consumers (11), the producer warp's start (12) and
# its first K box issued (13), the consumers at their key loop (14), V's first tile in the
# staging slot for the transposers (15)
HEADER = timeline_header(TL_E, home="DK_TL_HOME")

# (anchor, text, where): each anchor must occur exactly once in the kernel's file
EDITS = (
    (HEADER_ANCHOR, HEADER, "after"),
    (
        "    attn_cta cta;\n    if (!attn_cta_begin_at(a, halves ? split_from",
        "    if (threadIdx.x == 0) { TL(0); if (blockIdx.x < TL_MAX) {"
        " tl_buf[blockIdx.x][8] = tl_smid(); tl_buf[blockIdx.x][9] = tl_gt(); } }\n",
        "before",
    ),
    (
        "    __syncthreads();\n    const int32_t kv_end = attn_kv_end<BM>(s_wmax);\n",
        "    if (threadIdx.x == 0) TL(1);\n",
        "after",
    ),
    (
        "    if (wg == 0) {\n        regs::producer();\n",
        "        if (threadIdx.x == 0) TL(12);\n",
        "after",
    ),
    (
        "        issue(ST, sk0, full_k, empty_k, tmk);\n",
        "        if (kt == 0 && threadIdx.x == 0) TL(13);\n",
        "after",
    ),
    (
        "            mbar_wait(full_s + 8u * ss, (uint32_t)((kt / SR) & 1));\n            h8_transpose<",
        "            if (kt == 0 && threadIdx.x == 32) TL(15);\n",
        "before_last_line",
    ),
    (
        "        return;\n    }\n\n    /* ---------------- consumers",
        "        if (threadIdx.x == 0) TL(7);\n",
        "before",
    ),
    (
        "    float o[D / 2 + H8_VX / 2]; /* the head dims",
        "    if (cw == 0 && wt == 0) TL(2);\n",
        "before",
    ),
    (
        "            mbar_wait(ring.full_k + 8u * slot, (uint32_t)((kt / ST) & 1)); /* K_kt landed */\n",
        "            if (threadIdx.x == 128) TL(11);\n",
        "after",
    ),
    (
        "            h8_softmax16<BN>(s, m, alpha, j0, lim0, lim1, g_min, tq, sc, big);\n        }\n"
        "        else {",
        "            if (threadIdx.x == 128) TL(3);\n",
        "before",
    ),
    (
        "    h8_consume<D, TMA>(o, l, lm, qa, ring, n_tiles, lim0, lim1, g_min, tq, lane, sl2, big);\n",
        "    if (cw == 0 && wt == 0) TL(14);\n",
        "before",
    ),
    (
        "    h8_consume<D, TMA>(o, l, lm, qa, ring, n_tiles, lim0, lim1, g_min, tq, lane, sl2, big);\n",
        "    if (cw == 0 && wt == 0) TL(4);\n",
        "after",
    ),
    (
        "                                  o_vec);\n        }\n    }\n#else",
        "    if (wt == 0) { if (cw == 0) { TL(5); if (blockIdx.x < TL_MAX)"
        " tl_buf[blockIdx.x][10] = tl_gt(); } else TL(6); }\n",
        "before_last_line",
    ),
)


def patch(dest: Path) -> None:
    stamp_copy_home(dest, KERNEL_FILE, EDITS, HOME_FILE, "DK_TL_HOME")


def _occupancy(stamps, per_us: float) -> dict[str, float]:
    """The launch's span (first entry to last store, us) and the share of the SMs' time spent
    outside any CTA: between CTAs (gaps) and after an SM's last CTA while others still ran (tail)."""
    spans = collections.defaultdict(list)
    for r in stamps:
        spans[r[8]].append((r[0], max(r[5], r[6])))
    # clock64 is per SM: line SMs up by %globaltimer at each CTA's entry
    start_gt = min(r[9] for r in stamps)
    end_gt = max(r[9] + (max(r[5], r[6]) - r[0]) / per_us * 1e3 for r in stamps)
    span = (end_gt - start_gt) / 1e3
    busy = gaps = tail = 0.0
    for sm, cta in spans.items():
        cta.sort()
        busy += sum(e - s for s, e in cta) / per_us
        gaps += sum(b[0] - a[1] for a, b in zip(cta[:-1], cta[1:], strict=True)) / per_us
        last = max(r[9] + (max(r[5], r[6]) - r[0]) / per_us * 1e3 for r in stamps if r[8] == sm)
        tail += (end_gt - last) / 1e3
    total = span * len(spans)
    return {"span": span, "sms": len(spans), "gaps": gaps / total, "tail": tail / total, "busy": busy / total}


def run() -> None:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_fp8 as bench
    from diffkv._bench import flush_l2

    lib = stamped_lib("dk_tl_dump")
    buf = (ctypes.c_ulonglong * (TL_MAX * TL_E))()
    device = torch.device("cuda")
    print(
        "per CTA, medians in us from the CTA's entry"
        " (clock64 over the SM clock, calibrated per call by %globaltimer)"
    )
    print(
        f"{'case':>13} {'CTAs':>5} {'MHz':>5} {'limits':>6} {'Q in':>5} {'K0 in':>5} {'1st S':>5} "
        f"{'loop':>7} {'epilog':>6} {'CTA':>7} {'gap':>5} | {'span':>7} {'gaps%':>5} {'tail%':>5}"
    )
    for case, call in bench.warm_attention_calls(device):
        if lib.dk_tl_clear() != 0:
            sys.exit("dk_tl_clear failed")
        flush_l2(device)
        call()
        torch.cuda.synchronize()
        if lib.dk_tl_dump(buf) != 0:
            sys.exit("dk_tl_dump failed")
        stamps = [tuple(buf[i * TL_E : (i + 1) * TL_E]) for i in range(TL_MAX)]
        stamps = [r for r in stamps if r[0] != 0 and r[10] > r[9]]
        per_us = statistics.median((r[5] - r[0]) / ((r[10] - r[9]) / 1e3) for r in stamps)
        p = _phases(stamps, per_us)
        k0 = statistics.median(r[11] - r[0] for r in stamps) / per_us
        extra = {
            name: statistics.median(r[i] - r[0] for r in stamps) / per_us
            for name, i in (
                ("producer start", 12),
                ("K0 issued", 13),
                ("consumers at the loop", 14),
                ("V0 staged", 15),
            )
        }
        occ = _occupancy(stamps, per_us)
        print(
            f"{case.name:>13} {p['ctas']:>5} {per_us:>5.0f} {p['limits']:>6.2f} {p['q_ready']:>5.2f} "
            f"{k0:>5.2f} {p['first_s']:>5.2f} {p['loop']:>7.2f} {p['epilogue']:>6.2f} {p['cta']:>7.2f} "
            f"{p['gap_to_next_cta']:>5.2f} | {occ['span']:>7.1f} {100 * occ['gaps']:>5.1f} "
            f"{100 * occ['tail']:>5.1f}"
        )
        print(f"{'':>13} " + ", ".join(f"{k} {v:.2f}" for k, v in extra.items()))


def main(argv: list[str] | None = None) -> int:
    return patch_run_main(
        __doc__,
        patch,
        run,
        "run the fp8 cases and print the timeline (with the stamped build on PYTHONPATH)",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
