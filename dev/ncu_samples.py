"""Where a kernel's warps wait, instruction by instruction: Nsight Compute's warp-state samples
per SASS instruction (its SourceCounters section), summed over address ranges of the function.

On the GPU machine, one launch (the fourth) of one bench_fp8.py case's fp8 attention:

    ncu --section SourceCounters --section WarpStateStats -k regex:attention_sm90_fp8 \\
        --launch-skip 3 --launch-count 1 -o /tmp/r python3 dev/ncu_samples.py drive hunyuan-4597
    ncu -i /tmp/r.ncu-rep --page source --csv --print-source sass | gzip > $OUT/src.csv.gz

Here, with the export:

    python3 dev/ncu_samples.py regions src.csv.gz [--split 0x17c0,0x3100] [--list 0x1a140:0x1ae30]

`regions` cuts the function at the key loop's ends (dev/sass_diff.py's loop_bounds: the first
backward branch closing over wgmma) and at the --split offsets (bytes from the function's first
instruction, as `cuobjdump -sass` numbers them), and prints per range its instructions, samples,
share of all samples and five most frequent stall reasons.  --list prints each instruction of a
range with at least --min samples and its three main reasons.  A warp is sampled at a fixed
interval, so a range's samples over a warp's lifetime's samples is its share of that warp's time
(docs/fp8-log.md, *Where the TMA warp's 2.2 us went*).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_diff import loop_bounds  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = "Warp Stall Sampling (All Samples)"
ABS_TARGET = re.compile(r"\b0x([0-9a-f]{9,})\b")  # an absolute branch target in ncu's listing


@dataclass
class Instr:
    offset: int  # bytes from the function's first instruction
    text: str
    samples: int
    stalls: dict[str, int] = field(default_factory=dict)  # reason -> samples


def read_source(text: str) -> tuple[int, list[Instr]]:
    """The first instruction's address and the instructions of ncu's `--page source --csv
    --print-source sass` export (one kernel): a kernel-name line, the header, then one row per
    instruction."""
    rows = list(csv.reader(io.StringIO(text)))
    head = next((i for i, r in enumerate(rows) if "Address" in r and "Source" in r), None)
    if head is None:
        raise ValueError("no 'Address' / 'Source' header: not an ncu source-page CSV export")
    cols = rows[head]
    at = {c: i for i, c in enumerate(cols)}
    if SAMPLES not in at:
        raise ValueError(f"no {SAMPLES!r} column: profile with --section SourceCounters")
    reasons = [c for c in cols if c.startswith("stall_") and "(Not Issued)" not in c]
    out: list[Instr] = []
    base = None
    for r in rows[head + 1 :]:
        if len(r) < len(cols) or not r[at["Address"]].startswith("0x"):
            continue
        addr = int(r[at["Address"]], 16)
        base = addr if base is None else base

        def num(c: str, r=r) -> int:
            v = r[at[c]].strip()
            return int(v) if v.isdigit() else 0

        stalls = {c[len("stall_") :]: n for c in reasons if (n := num(c))}
        out.append(Instr(addr - base, r[at["Source"]].strip(), num(SAMPLES), stalls))
    if base is None:
        raise ValueError("no instruction rows in the export")
    return base, out


def relative_code(instrs: list[Instr], base: int) -> list[str]:
    """The listing with its branch targets (virtual addresses in ncu's export) made offsets from
    the function's first instruction at `base`, for sass_diff.loop_bounds."""

    def rel(m: re.Match) -> str:
        return hex(int(m.group(1), 16) - base)

    return [ABS_TARGET.sub(rel, i.text) if "BRA" in i.text else i.text for i in instrs]


def ranges(instrs: list[Instr], base: int, splits: list[int]) -> list[tuple[str, int, int]]:
    """[name, lo, hi) byte ranges: the function cut at the key loop's ends and at `splits`."""
    end = 16 * len(instrs)
    cuts = {0, end}
    names = {}
    bounds = loop_bounds(relative_code(instrs, base))
    if bounds is not None:
        top, last = 16 * bounds[0], 16 * (bounds[1] + 1)
        cuts |= {top, last}
        names[top] = "key loop"
    cuts |= {s for s in splits if 0 < s < end}
    edges = sorted(cuts)
    return [(names.get(lo, ""), lo, hi) for lo, hi in zip(edges, edges[1:], strict=False)]


def summarise(instrs: list[Instr], lo: int, hi: int) -> tuple[int, int, list[tuple[str, int]]]:
    """(instructions, samples, the five main stall reasons with their samples) of [lo, hi)."""
    sel = [i for i in instrs if lo <= i.offset < hi]
    reasons: collections.Counter = collections.Counter()
    for i in sel:
        reasons.update(i.stalls)
    return len(sel), sum(i.samples for i in sel), reasons.most_common(5)


def _read(path: Path) -> str:
    raw = path.read_bytes()
    return gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()


def _span(text: str) -> tuple[int, int]:
    lo, hi = text.split(":")
    return int(lo, 0), int(hi, 0)


def cmd_regions(args) -> int:
    base, instrs = read_source(_read(args.csv))
    total = sum(i.samples for i in instrs) or 1
    print(f"{len(instrs)} instructions, {total} samples")
    splits = [int(s, 0) for s in args.split.split(",") if s] if args.split else []
    for name, lo, hi in ranges(instrs, base, splits):
        n, samples, top = summarise(instrs, lo, hi)
        reasons = ", ".join(f"{r} {c}" for r, c in top)
        share = 100 * samples / total
        print(f"{lo:#7x}-{hi:#7x} {name:9s} {n:5d} instr {samples:8d} samples {share:6.2f} %  {reasons}")
    for spec in args.list or []:
        lo, hi = _span(spec)
        print(f"\n{lo:#x}-{hi:#x}, instructions with at least {args.min} samples:")
        for i in instrs:
            if lo <= i.offset < hi and i.samples >= args.min:
                main = sorted(i.stalls.items(), key=lambda kv: -kv[1])[:3]
                print(
                    f"{i.offset:#7x} {i.text[:60]:60s} {i.samples:6d}  "
                    + " ".join(f"{r}:{c}" for r, c in main)
                )
    return 0


def cmd_drive(args) -> int:
    """The case's fp8 attention, four launches (ncu's --launch-skip 3 takes the last, warm)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_fp8

    cases = {c.name: c for c in bench_fp8._cases(False)}
    if args.case not in cases:
        sys.exit(f"unknown case {args.case!r}; one of {', '.join(cases)}")
    case, device = cases[args.case], torch.device("cuda")
    inp = bench_fp8._make_inputs(case, "gaussian", device, 0)
    out = torch.empty_like(inp.query)
    call = bench_fp8._attention_call(case, inp, bench_fp8._cache(inp, bench_fp8.F8), out, True)
    for _ in range(4):
        call()
    torch.cuda.synchronize()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drive", help="run one bench_fp8.py case's fp8 attention four times (for ncu)")
    d.add_argument("case")
    r = sub.add_parser("regions", help="sum an ncu source-page export's samples over ranges")
    r.add_argument("csv", type=Path)
    r.add_argument("--split", default="", help="comma-separated byte offsets to cut at")
    r.add_argument("--list", action="append", help="LO:HI byte range whose instructions to print")
    r.add_argument("--min", type=int, default=3, help="--list: the fewest samples printed")
    args = parser.parse_args(argv)
    return cmd_drive(args) if args.cmd == "drive" else cmd_regions(args)


if __name__ == "__main__":
    sys.exit(main())
