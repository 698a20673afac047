"""dev/ncu_samples.py reads Nsight Compute's source-page CSV export and sums its per-instruction
warp samples over the function's ranges: the key loop found from its backward branch over wgmma
(the export prints branch targets as virtual addresses), cuts at given offsets, stall reasons."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dev"))
import ncu_samples  # noqa: E402

BASE = 0x7F1F73000000
HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"Instructions Executed","stall_barrier","stall_long_sb","stall_no_inst","stall_wait",'
    '"stall_barrier (Not Issued)","stall_long_sb (Not Issued)","stall_no_inst (Not Issued)",'
    '"stall_wait (Not Issued)"'
)
# (text, samples, barrier, long_sb, no_inst, wait): instruction i at byte 16 i
CODE = [
    ("LDC R1, c[0x0][0x28]", 4, 0, 0, 4, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 10, 9, 0, 0, 1),
    ("LDG.E R2, desc[UR4][R4.64]", 2, 0, 0, 0, 2),
    ("QGMMA.64x256x32.F16.E4M3.E4M3 R24, gdesc[UR8], RZ, !UP0", 30, 0, 0, 0, 30),  # loop top: 0x30
    ("IMAD.U32 R3, RZ, RZ, UR9", 20, 0, 20, 0, 0),
    (f"@P0 BRA {BASE + 0x30:#x}", 6, 0, 0, 1, 5),
    ("EXIT", 0, 0, 0, 0, 0),
    (f"BRA {BASE + 0x70:#x}", 0, 0, 0, 0, 0),
]


def _export() -> str:
    kernel = '"Kernel Name","void attention_sm90_fp8_kernel<__nv_bfloat16, (int)128, (bool)1>(...)",'
    lines = [kernel, HEADER]
    for i, (text, n, bar, lsb, ni, wait) in enumerate(CODE):
        cells = [f"{BASE + 16 * i:#x}", f"      {text}", n, n, 2112, bar, lsb, ni, wait, 0, 0, 0, 0]
        lines.append(",".join(f'"{c}"' for c in cells))
    return "\n".join(lines) + "\n"


def test_read_source_takes_offsets_and_stall_reasons():
    base, instrs = ncu_samples.read_source(_export())
    assert base == BASE
    assert [i.offset for i in instrs] == [16 * i for i in range(len(CODE))]
    assert instrs[4].text.startswith("IMAD.U32") and instrs[4].samples == 20
    assert instrs[4].stalls == {"long_sb": 20}  # the Not-Issued columns are left out
    assert instrs[1].stalls == {"barrier": 9, "wait": 1}


def test_ranges_cut_at_the_key_loop_and_the_splits():
    base, instrs = ncu_samples.read_source(_export())
    # the loop: from the backward branch's target (0x30) to the branch itself (0x50)
    assert ncu_samples.relative_code(instrs, base)[5] == "@P0 BRA 0x30"
    got = ncu_samples.ranges(instrs, base, [0x20])
    assert got == [("", 0x0, 0x20), ("", 0x20, 0x30), ("key loop", 0x30, 0x60), ("", 0x60, 0x80)]
    n, samples, top = ncu_samples.summarise(instrs, 0x30, 0x60)
    assert (n, samples) == (3, 56)
    assert top == [("wait", 35), ("long_sb", 20), ("no_inst", 1)]


def test_regions_prints_each_range_and_the_listed_instructions(tmp_path, capsys):
    import gzip

    path = tmp_path / "src.csv.gz"
    path.write_bytes(gzip.compress(_export().encode()))
    assert (
        ncu_samples.main(["regions", str(path), "--split", "0x20", "--list", "0x30:0x60", "--min", "10"]) == 0
    )
    out = capsys.readouterr().out
    assert "8 instructions, 72 samples" in out
    assert "key loop" in out and "77.78 %" in out  # 56 of 72
    listed = out.split("instructions with at least 10 samples:")[1].strip().splitlines()
    assert [line.split()[0] for line in listed] == ["0x30", "0x40"]  # 30 and 20 samples; the branch has 6


def test_an_export_without_samples_is_refused():
    text = '"Kernel Name","k",\n"Address","Source","Instructions Executed"\n"0x10","EXIT","1"\n'
    try:
        ncu_samples.read_source(text)
    except ValueError as e:
        assert "SourceCounters" in str(e)
    else:
        raise AssertionError("read_source accepted an export without warp samples")
