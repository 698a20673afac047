"""Per-CTA timeline of the warp-specialized Hopper kernel: where a CTA's time goes.

Makes a stamped copy of the source tree (nothing in the package changes): clock64 stamps per
CTA at entry, after the key-limits barrier, Q landed, the first S = QK^T, the last P V, the
output stores issued (and `%smid`, `%globaltimer`), kept in a `__device__` array that the
copy's extension exports (`dk_tl_dump`, `dk_tl_clear`). Then, with that copy built, it times
unmasked one-row calls and prints each phase's median per CTA and the gap between one CTA's
end and the next CTA's start on the same SM (docs/hopper-kernels.md, *CTA prologue and
epilogue*, has what it showed):

    python benchmarks/cta_timeline.py patch /tmp/tl          # stamped copy of this tree
    (cd /tmp/tl && DIFFKV_CUDA_ARCHS=90a python setup.py -q build_ext --inplace)
    PYTHONPATH=/tmp/tl/python python benchmarks/cta_timeline.py run [--seq-lens 2048,4096,8192]

The copy also keeps every call off the persistent kernel (cuda/attention_sm90_persist.cu, which
takes short unmasked calls of uniform rows -- these among them -- and has no stamps), so that the
one-CTA-per-tile kernel is what runs and is stamped. The patch anchors on the source text and
stops with an error if that text moved.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TL_MAX, TL_E = 16384, 12  # CTAs stamped, words per CTA
EVENTS = ("entry", "limits", "q_ready", "first_s", "loop_end", "stores_wg0", "stores_wg1", "producer")

KERNEL_FILE = Path("cuda") / "attention_sm90_ws.cu"
# the stamps' buffer and its exporters go in after this line of the kernel's file
HEADER_ANCHOR = "#include <cuda.h> /* CUtensorMap */\n"


def timeline_header(words: int, home: str | None = None) -> str:
    """The device code a timeline-stamped kernel's file starts with (after HEADER_ANCHOR):
    `tl_buf`, TL_MAX CTAs' rows of `words` 64-bit stamps, its exported dk_tl_dump / dk_tl_clear,
    the reads of %clock64, %globaltimer and %smid, and TL(e), which stamps word e of the CTA's
    row.  home: as sums_header's, for a header that several .cu files include
    (fp8_timeline.py)."""
    buf = "__device__ unsigned long long tl_buf[TL_MAX][TL_E];\n"
    exports = (
        'extern "C" __attribute__((visibility("default"))) int dk_tl_dump(void *dst)\n'
        "{ return (int)cudaMemcpyFromSymbol(dst, tl_buf, sizeof(tl_buf)); }\n"
        'extern "C" __attribute__((visibility("default"))) int dk_tl_clear(void)\n'
        "{ static unsigned long long z[TL_MAX][TL_E]; "
        "return (int)cudaMemcpyToSymbol(tl_buf, z, sizeof(z)); }\n"
    )
    sums = buf + exports
    if home is not None:
        sums = f"#ifdef {home}\n{sums}#else\nstatic {buf}#endif\n"
    return (
        f"#define TL_MAX {TL_MAX}\n#define TL_E {words}\n"
        + sums
        + "static __device__ __forceinline__ __attribute__((unused)) unsigned long long tl_clk(void)\n"
        '{ unsigned long long c; asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory"); return c; }\n'
        "static __device__ __forceinline__ __attribute__((unused)) unsigned long long tl_gt(void)\n"
        '{ unsigned long long c; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(c) :: "memory");'
        " return c; }\n"
        "static __device__ __forceinline__ __attribute__((unused)) unsigned tl_smid(void)\n"
        '{ unsigned r; asm volatile("mov.u32 %0, %%smid;" : "=r"(r)); return r; }\n'
        "#define TL(e) do { if (blockIdx.x < TL_MAX) tl_buf[blockIdx.x][e] = tl_clk(); } while (0)\n"
    )


HEADER = timeline_header(TL_E)

# (anchor in attention_sm90_ws_kernel, text inserted before it or after it)
STAMPS = (
    (
        "    attn_cta cta;\n    if (!attn_cta_begin(",
        "before",
        "    if (threadIdx.x == 0) { TL(0); if (blockIdx.x < TL_MAX) {"
        " tl_buf[blockIdx.x][8] = tl_smid(); tl_buf[blockIdx.x][9] = tl_gt(); } }\n",
    ),
    (
        "    __syncthreads();\n    const int32_t kv_end = attn_kv_end<BM>(s_wmax);",
        "after_first_line",
        "    if (threadIdx.x == 0) TL(1);\n",
    ),
    (
        "                    &tmv, &tfk2, &tfv2, dims.k_groups == 2, first_ok, first_blk);\n            }\n",
        "after",
        "            if (threadIdx.x == 0) TL(7);\n",
    ),
    (
        "    named_barrier(1u + (uint32_t)cw, 128u);\n\n    float o[NP / 2];",
        "after_first_line",
        "    if (cw == 0 && wt == 0) TL(2);\n",
    ),
    (
        "                h90_softmax<NT, true>(s, m, l, alpha, j0, rows);\n            }\n            else {",
        "before",
        "                if (cw == 0 && wt == 0) TL(3);\n",
    ),
    (
        "        wgmma_wait_all();\n        fence_regs(o);\n    }\n\n    /* Epilogue",
        "after_second_line",
        "        if (cw == 0 && wt == 0) TL(4);\n",
    ),
    (
        "&o[2 * hf], tq, o_vec);\n        }\n    }\n",
        "after",
        "    if (wt == 0) { if (cw == 0) { TL(5); if (blockIdx.x < TL_MAX)"
        " tl_buf[blockIdx.x][10] = tl_gt(); } else TL(6); }\n",
    ),
)


# the persistent kernel's choice (cuda/attention.cu): refused in the stamped copy
CHOICE_FILE = Path("cuda") / "attention.cu"
CHOICE_ANCHOR = (
    "attn_persist_ok(const dk_attention_args *a, const h90_maps &m, int64_t sms, cudaStream_t s)\n{\n"
)
CHOICE_OFF = "    return false; /* cta_timeline.py: the stamped kernel is the one-CTA-per-tile one */\n"


def copy_tree(dest: Path) -> None:
    """A buildable copy of this tree's sources at dest (a new directory), for a stamped build
    (here and in stamp_copy)."""
    if dest.exists():
        sys.exit(f"{dest} exists: give a new directory")
    for name in ("csrc", "cuda", "python"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)


def sums_header(prefix: str, words: int, home: str | None = None) -> str:
    """The device code a stamped kernel's file starts with (after HEADER_ANCHOR): `words` 64-bit
    sums `{prefix}_sum`, the exported dk_{prefix}_dump / dk_{prefix}_reset that read and clear
    them, and the clock read {prefix}_clk (fp8_phases.py, persist_phases.py).  home: for a
    header that several .cu files include, the macro that the one whose sums are read defines:
    the sums and their readers are defined there only (one definition each would clash at the
    link), the other files' stamps add into a static array of their own."""
    sums = (
        f"__device__ unsigned long long {prefix}_sum[{words}];\n"
        f'extern "C" __attribute__((visibility("default"))) int dk_{prefix}_dump(void *a)\n'
        f"{{ return (int)cudaMemcpyFromSymbol(a, {prefix}_sum, sizeof({prefix}_sum)); }}\n"
        f'extern "C" __attribute__((visibility("default"))) int dk_{prefix}_reset(void)\n'
        f"{{ unsigned long long z[{words}] = {{0}}; "
        f"return (int)cudaMemcpyToSymbol({prefix}_sum, z, sizeof(z)); }}\n"
    )
    if home is not None:
        other = f"static __device__ unsigned long long {prefix}_sum[{words}];\n"
        sums = f"#ifdef {home}\n{sums}#else\n{other}#endif\n"
    clk = (
        f"static __device__ __forceinline__ __attribute__((unused)) unsigned long long {prefix}_clk(void)\n"
        '{ unsigned long long c; asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory"); return c; }\n'
    )
    return sums + clk


def stamp_copy(dest: Path, kernel_file: Path, edits) -> None:
    """copy_tree, then each (anchor, text, where) of edits in the copy's kernel_file: text put
    "before" or "after" its anchor, or before its last line ("before_last_line": an anchor of
    several lines that makes one line unique); the anchor must occur there exactly once
    (fp8_phases.py, persist_phases.py)."""
    copy_tree(dest)
    path = dest / kernel_file
    src = path.read_text()
    for anchor, text, where in edits:
        if src.count(anchor) != 1:
            sys.exit(f"{kernel_file}: anchor found {src.count(anchor)} times (the kernel changed):\n{anchor}")
        at = src.index(anchor)
        if where == "after":
            pos = at + len(anchor)
        elif where == "before_last_line":
            pos = at + anchor.rstrip("\n").rfind("\n") + 1
        else:
            pos = at
        src = src[:pos] + text + src[pos:]
    path.write_text(src)


def stamp_copy_home(dest: Path, kernel_file: Path, edits, home_file: Path, macro: str) -> None:
    """stamp_copy, then `#define <macro> 1` ahead of home_file's include of the kernel's header:
    the one .cu file of those including it whose stamps are read (sums_header's home;
    fp8_phases.py, fp8_timeline.py)."""
    stamp_copy(dest, kernel_file, edits)
    home = dest / home_file
    include = f'#include "{kernel_file.name}"\n'
    text = home.read_text()
    if text.count(include) != 1:
        sys.exit(f"{home_file}: {include.strip()!r} not found once (the file changed)")
    home.write_text(text.replace(include, f"#define {macro} 1\n" + include))
    print(f"stamped copy in {dest}: build it there, then `run` with {dest / 'python'} on PYTHONPATH")


def stamped_lib(symbol: str) -> ctypes.CDLL:
    """The imported diffkv extension as a library, or exit where it lacks `symbol` (a build
    without the stamps)."""
    from diffkv import _C

    lib = ctypes.CDLL(_C.__file__)
    if not hasattr(lib, symbol):
        sys.exit("this diffkv build has no stamps: build the copy `patch` made and put it on PYTHONPATH")
    return lib


def patch_run_main(doc: str, patch_fn, run_fn, run_help: str, argv: list[str] | None) -> int:
    """The command line of a stamping script whose `run` takes no options: `patch DEST`, `run`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("patch", help="make a stamped copy of this tree")
    p.add_argument("dest", type=Path)
    sub.add_parser("run", help=run_help)
    args = parser.parse_args(argv)
    if args.cmd == "patch":
        patch_fn(args.dest)
    else:
        run_fn()
    return 0


def patch(dest: Path) -> None:
    copy_tree(dest)
    path = dest / KERNEL_FILE
    src = path.read_text()
    if HEADER_ANCHOR not in src:
        sys.exit(f"{KERNEL_FILE}: {HEADER_ANCHOR.strip()!r} not found")
    src = src.replace(HEADER_ANCHOR, HEADER_ANCHOR + HEADER, 1)
    start = src.index("attention_sm90_ws_kernel(const __grid_constant__")
    for anchor, where, text in STAMPS:
        at = src.find(anchor, start)
        if at < 0:
            sys.exit(f"{KERNEL_FILE}: anchor not found (the kernel changed):\n{anchor}")
        if where == "before":
            pos = at
        elif where == "after":
            pos = at + len(anchor)
        else:  # after the anchor's first or second line
            lines = 1 if where == "after_first_line" else 2
            pos = at
            for _ in range(lines):
                pos = src.index("\n", pos) + 1
        src = src[:pos] + text + src[pos:]
    path.write_text(src)
    choice = dest / CHOICE_FILE
    text = choice.read_text()
    if CHOICE_ANCHOR not in text:
        sys.exit(f"{CHOICE_FILE}: the persistent kernel's choice (attn_persist_ok) not found")
    choice.write_text(text.replace(CHOICE_ANCHOR, CHOICE_ANCHOR + CHOICE_OFF, 1))
    print(
        f"stamped copy in {dest}; build it with DIFFKV_CUDA_ARCHS=90a python setup.py -q build_ext --inplace"
    )


def _phases(stamps, ghz_cycles_per_us: float) -> dict[str, float]:
    rows = [r for r in stamps if r[0] != 0]
    med = statistics.median

    def us(values):
        return med(values) / ghz_cycles_per_us

    end = [max(r[5], r[6]) for r in rows]
    out = {
        "ctas": len(rows),
        "limits": us([r[1] - r[0] for r in rows]),
        "q_ready": us([r[2] - r[0] for r in rows]),
        "first_s": us([r[3] - r[0] for r in rows]),
        "loop": us([r[4] - r[3] for r in rows]),
        "epilogue": us([r[5] - r[4] for r in rows]),
        "cta": us([e - r[0] for e, r in zip(end, rows, strict=True)]),
    }
    per_sm = collections.defaultdict(list)
    for e, r in zip(end, rows, strict=True):
        per_sm[r[8]].append((r[0], e))
    gaps = []
    for spans in per_sm.values():
        spans.sort()
        gaps += [(b[0] - a[1]) / ghz_cycles_per_us for a, b in zip(spans[:-1], spans[1:], strict=True)]
    out["gap_to_next_cta"] = med(gaps) if gaps else float("nan")
    return out


def run(seq_lens: list[int], heads: int, kv_heads: int) -> None:
    import torch

    from diffkv import _C
    from diffkv import _bench as bench

    lib = stamped_lib("dk_tl_dump")
    buf = (ctypes.c_ulonglong * (TL_MAX * TL_E))()
    device = torch.device("cuda")
    print(
        f"per CTA, medians in us (clock64 cycles over the SM clock, calibrated per call against"
        f" %globaltimer); one row, {heads}/{kv_heads} heads x 128, bf16, block 16"
    )
    print(
        f"{'seq':>6} {'kernel':>11} {'CTAs':>5} {'MHz':>5} {'limits':>7} {'Q in':>6} {'1st S':>6} "
        f"{'loop':>7} {'epilog':>7} {'CTA':>7} {'gap':>5}"
    )
    for seq in seq_lens:
        gen = torch.Generator(device=device)
        gen.manual_seed(seq)
        q, k, v = (
            torch.randn(1, h, seq, 128, generator=gen, device=device, dtype=torch.bfloat16)
            for h in (heads, kv_heads, kv_heads)
        )
        paged = bench._paged(k, v, 16, torch.Generator().manual_seed(16))
        query = q.transpose(1, 2).reshape(seq, heads, 128).contiguous()
        out = torch.empty_like(query)

        call = bench.paged_call(query, paged, _C.MASK_NONE, 128**-0.5, out)
        for _ in range(3):
            call()
        if lib.dk_tl_clear() != 0:
            sys.exit("dk_tl_clear failed")
        bench.flush_l2(device)
        call()
        torch.cuda.synchronize()
        if lib.dk_tl_dump(buf) != 0:
            sys.exit("dk_tl_dump failed")
        stamps = [tuple(buf[i * TL_E : (i + 1) * TL_E]) for i in range(TL_MAX)]
        # cycles per us: a CTA's clock64 span over its %globaltimer span (entry to stores)
        clock = statistics.median(
            (r[5] - r[0]) / ((r[10] - r[9]) / 1e3) for r in stamps if r[0] != 0 and r[10] > r[9]
        )
        p = _phases(stamps, clock)
        print(
            f"{seq:>6} {_C.last_attention_kernel():>11} {p['ctas']:>5} {clock:>5.0f} {p['limits']:>7.2f} "
            f"{p['q_ready']:>6.2f} "
            f"{p['first_s']:>6.2f} {p['loop']:>7.2f} {p['epilogue']:>7.2f} {p['cta']:>7.2f} "
            f"{p['gap_to_next_cta']:>5.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("patch", help="make a stamped copy of this tree")
    p.add_argument("dest", type=Path)
    r = sub.add_parser("run", help="time and print the phases (with the stamped build on PYTHONPATH)")
    r.add_argument("--seq-lens", default="2048,4096,8192")
    r.add_argument("--heads", type=int, default=32)
    r.add_argument("--kv-heads", type=int, default=8)
    args = parser.parse_args(argv)
    if args.cmd == "patch":
        patch(args.dest)
    else:
        run([int(s) for s in args.seq_lens.split(",")], args.heads, args.kv_heads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
