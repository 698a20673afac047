"""bench_fp8.py over small e4m3-kernel grids, the ones whose last wave runs as halves
(h8_split_from: at most half the SMs left over), with one that has none as a control.

    python3 dev/fp8_small.py --data gaussian --no-accuracy --no-layer --no-profile --reps 15

Takes bench_fp8.py's arguments (its cases replaced by these); tile counts for 132 SMs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_fp8  # noqa: E402


def _cases(quick: bool) -> list[bench_fp8.Case]:
    del quick
    case = bench_fp8.Case
    return [
        case("h8-1k", 1, 8, 8, 1024, 1024, False, "64 tiles: every one as halves"),
        case("h24-1k", 1, 24, 24, 1024, 1024, False, "192 tiles: the last 60 as halves"),
        case("h24-1k-causal", 1, 24, 24, 1024, 1024, True, "192 tiles, causal: the last 60 as halves"),
        case("denoise-1k", 2, 32, 8, 1025, 1525, False, "576 tiles: the last 48 as halves"),
        case("h24-8k", 1, 24, 24, 8192, 8192, False, "1,536 tiles, 84 left over: no halves"),
    ]


bench_fp8._cases = _cases
if __name__ == "__main__":
    sys.exit(bench_fp8.main())
