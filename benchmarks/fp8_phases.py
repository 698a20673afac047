"""Where a tile's time goes in the Hopper e4m3 kernel (cuda/attention_sm90_fp8.cuh), per warp.

Makes a stamped copy of the source tree (nothing in the package changes): clock64 stamps around
each phase of a consumer warp's key tile -- the wait for K and V^T (one `mbar_wait2`), Q K^T
issued (after cp.async's proxy fence), P V issued and Q K^T's wait, the softmax, then P V's
wait, the rescale and P's packing -- and around the transposing warps' waits and
transposes, summed over every warp of a launch into a `__device__` array that the copy's
extension exports (`dk_h8s_dump`, `dk_h8s_reset`). Then, with that copy built, it runs the fp8
benchmark's cases once each (bench_fp8.py's inputs) and prints each phase's mean cycles per warp
and 256-key tile (docs/fp8-log.md has what it showed):

    python benchmarks/fp8_phases.py patch /tmp/f8          # stamped copy of this tree
    (cd /tmp/f8 && DIFFKV_CUDA_ARCHS=90a python setup.py -q build_ext --inplace)
    PYTHONPATH=/tmp/f8/python python benchmarks/fp8_phases.py run

The sums are the TMA producer's forms' (attention_sm90_fp8_tma.cu, the forms bench_fp8.py's
cases run): the cp.async forms, compiled apart (attention_sm90_fp8.cu), stamp an array of their
own that nothing reads. Only the first tile of each warpgroup's pass is left out (it has no P V
to wait for). The
stamps cost a few registers: compare the TFLOP/s it prints with the unstamped kernel's. The
patch anchors on the source text and stops with an error if that text moved.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

# benchmarks/ is sys.path[0] when run as a script
from cta_timeline import HEADER_ANCHOR, patch_run_main, stamp_copy_home, stamped_lib, sums_header

ROOT = Path(__file__).resolve().parent.parent
KERNEL_FILE = Path("cuda") / "attention_sm90_fp8.cuh"
HOME_FILE = Path("cuda") / "attention_sm90_fp8_tma.cu"  # the file whose forms' sums are read
WORDS = 16  # the stamps' sums: 0-5 consumer phases and tiles, 8-11 the transposing warps'

# both .cu files include the kernel's header: the sums are defined in HOME_FILE's object only
HEADER = sums_header("h8s", WORDS, home="DK_H8S_HOME")

CONSUMER_LOOP = (
    "    for (int32_t kt = 0; kt < n_tiles; kt++) {\n"
    "        const int32_t j0 = kt * BN;\n"
    "        const uint32_t slot = (uint32_t)(kt % ST);\n"
)
# (anchor, text, where): each anchor must occur exactly once in the kernel's file
EDITS = (
    (HEADER_ANCHOR, HEADER, "after"),
    (CONSUMER_LOOP, "    unsigned long long hs[6] = {0, 0, 0, 0, 0, 0};\n", "before"),
    (
        CONSUMER_LOOP,
        "        unsigned long long q0c = h8s_clk(), q1c = q0c, q2c = q0c, q3c = q0c, q4c = q0c;\n",
        "after",
    ),
    (
        "                       ring.full_vt + 8u * pslot, (uint32_t)(((kt - 1) / H8_SVT) & 1));\n",
        "            q1c = h8s_clk();\n",
        "after",
    ),
    (
        "            }\n            qk(slot);\n            wgmma_commit();\n            h8_pv<D, BN>(",
        "            q2c = h8s_clk();\n",
        "before_last_line",
    ),
    (
        "            wgmma_wait_1(); /* S_kt done; P_{kt-1} V_{kt-1} may still run */\n"
        "            fence_regs(s);\n",
        "            q3c = h8s_clk();\n",
        "after",
    ),
    (
        "            st_shared_u32(ring.sink, s[BN / 4 - 1] ^ s[BN / 4 - 2]);\n",
        "            q4c = h8s_clk();\n",
        "after",
    ),
    (
        "        h8_pack_p16<BN>(pa, s);\n    }\n",
        "        if (kt > 0) {\n"
        "            const unsigned long long q5c = h8s_clk();\n"
        "            hs[0] += q1c - q0c; hs[1] += q2c - q1c; hs[2] += q3c - q2c; hs[3] += q4c - q3c;\n"
        "            hs[4] += q5c - q4c; hs[5] += 1;\n"
        "        }\n",
        "before",
    ),
    (
        "    if (n_tiles > 0) {\n        const uint32_t lslot",
        "    if ((threadIdx.x & 31u) == 0u) {\n"
        "        for (int i = 0; i < 6; i++) atomicAdd(&h8s_sum[i], hs[i]);\n"
        "    }\n",
        "before",
    ),
    (
        "        for (int32_t kt = 0; kt < n_tiles; kt++) {\n"
        "            const uint32_t ss = (uint32_t)(kt % SR);\n",
        "            const unsigned long long p0c = h8s_clk();\n",
        "after",
    ),
    (
        "            mbar_wait(full_s + 8u * ss, (uint32_t)((kt / SR) & 1));\n",
        "            const unsigned long long p1c = h8s_clk();\n",
        "after",
    ),
    (
        "            __syncwarp();\n            if (lane == 0) {\n"
        "                mbar_arrive(empty_s + 8u * ss);\n            }\n",
        "            if (lane == 0) {\n"
        "                const unsigned long long p2c = h8s_clk();\n"
        "                atomicAdd(&h8s_sum[8], p1c - p0c); atomicAdd(&h8s_sum[9], p2c - p1c);\n"
        "                atomicAdd(&h8s_sum[10], 1ull);\n"
        "            }\n",
        "after",
    ),
    (
        "    if (kt >= H8_SVT) { /* the phase the slot's last use ended */\n"
        "        mbar_wait(empty_vt + 8u * slot, (uint32_t)((kt / H8_SVT - 1) & 1));\n    }\n",
        "    const unsigned long long t0c = h8s_clk();\n",
        "before",
    ),
    (
        "    if (kt >= H8_SVT) { /* the phase the slot's last use ended */\n"
        "        mbar_wait(empty_vt + 8u * slot, (uint32_t)((kt / H8_SVT - 1) & 1));\n    }\n",
        "    if ((threadIdx.x & 31u) == 0u) atomicAdd(&h8s_sum[11], h8s_clk() - t0c);\n",
        "after",
    ),
)
PHASES = ("K and V^T waits", "Q K^T issued", "P V issued, Q K^T wait", "softmax", "P V wait, rescale, pack")


def patch(dest: Path) -> None:
    stamp_copy_home(dest, KERNEL_FILE, EDITS, HOME_FILE, "DK_H8S_HOME")


def run() -> None:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_fp8 as bench

    lib = stamped_lib("dk_h8s_dump")
    device = torch.device("cuda")
    for case, call in bench.warm_attention_calls(device):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lib.dk_h8s_reset() != 0:
            sys.exit("dk_h8s_reset failed")
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        sums = (ctypes.c_ulonglong * WORDS)()
        if lib.dk_h8s_dump(sums) != 0:
            sys.exit("dk_h8s_dump failed")
        v = list(sums)
        tiles, transposes = max(1, v[5]), max(1, v[10])
        flops = 4 * case.rows * case.heads * case.query_len * case.seq_len * bench.HEAD
        flops /= 2 if case.causal else 1
        print(
            f"== {case.name}: {ms * 1e3:.0f} us, {flops / ms / 1e9:.0f} TFLOP/s (stamped), {v[5]} warp-tiles"
        )
        cells = ", ".join(f"{name} {v[i] / tiles:.0f}" for i, name in enumerate(PHASES))
        print(f"   consumer warp, cycles a tile: {cells}; total {sum(v[:5]) / tiles:.0f}")
        print(
            f"   transposing warp, cycles a tile: staging wait {v[8] / transposes:.0f}, "
            f"V^T-slot wait {v[11] / transposes:.0f}, transpose with that wait {v[9] / transposes:.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    return patch_run_main(
        __doc__,
        patch,
        run,
        "run the fp8 cases and print the phases (with the stamped build on PYTHONPATH)",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
