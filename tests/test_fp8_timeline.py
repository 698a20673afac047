"""benchmarks/fp8_timeline.py's stamped copy still finds every anchor in the e4m3 kernel: a change
to the kernel's source that moves one makes this fail here rather than on the GPU."""

import re
import sys
from pathlib import Path

from test_cta_timeline import stamped_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fp8_timeline  # noqa: E402


def test_patch_places_every_stamp(tmp_path):
    src, original = stamped_kernel("fp8_timeline.py", "attention_sm90_fp8.cuh", tmp_path / "t8")
    assert "TL(" not in original
    # every CTA event once: entry, limits, Q in, first S, loop end, both warpgroups' stores,
    # the producer's end, K's first tile, the producer's start and first K box, the consumers at
    # their loop, V's first tile staged
    assert sorted(int(e) for e in re.findall(r"\bTL\((\d+)\);", src)) == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        11,
        12,
        13,
        14,
        15,
    ]
    # the buffer and its exported readers are defined in the TMA forms' object only (both .cu
    # files include the header)
    home = (tmp_path / "t8" / "cuda" / "attention_sm90_fp8_tma.cu").read_text()
    assert home.index("#define DK_TL_HOME 1") < home.index('#include "attention_sm90_fp8.cuh"')
    assert "DK_TL_HOME" not in (tmp_path / "t8" / "cuda" / "attention_sm90_fp8.cu").read_text()
    assert src.index("#ifdef DK_TL_HOME") < src.index("dk_tl_dump") < src.index("#else")
    # only lines were added: the stamped kernel is the original one plus the stamps
    kept = set(original.splitlines())
    added = [line for line in src.splitlines() if line not in kept]
    assert all(
        "TL" in line
        or "tl_" in line
        or line.startswith(("#define", "#ifdef", "#else", "#endif", "extern", "{", "static"))
        for line in added
    ), added


def test_occupancy_counts_gaps_and_tail():
    # two SMs over 10 us at 1 cycle a ns (1,000 a us): SM 0 runs CTAs [0, 4) and [5, 10) us, SM 1
    # one CTA [0, 6) us and then idles: 1 us of gap and 4 us of tail in 20 SM-us
    def cta(sm, start_us, end_us):
        row = [0] * 16
        row[0], row[5], row[6], row[8] = start_us * 1000, end_us * 1000, end_us * 1000, sm
        row[9], row[10] = start_us * 1000, end_us * 1000
        return tuple(row)

    occ = fp8_timeline._occupancy([cta(0, 0, 4), cta(0, 5, 10), cta(1, 0, 6)], 1000.0)
    assert occ["span"] == 10.0 and occ["sms"] == 2
    assert abs(occ["gaps"] - 0.05) < 1e-12 and abs(occ["tail"] - 0.2) < 1e-12
    assert abs(occ["busy"] - 0.75) < 1e-12
