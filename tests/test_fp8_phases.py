"""benchmarks/fp8_phases.py's stamped copy still finds every anchor in the e4m3 kernel: a change to
the kernel's source that moves one makes this fail here rather than on the GPU."""

from test_cta_timeline import stamped_kernel


def test_patch_places_every_stamp(tmp_path):
    src, original = stamped_kernel("fp8_phases.py", "attention_sm90_fp8.cuh", tmp_path / "f8")
    assert "h8s_" not in original
    assert "dk_h8s_dump" in src and "dk_h8s_reset" in src
    # the sums and their exported readers are defined in the TMA forms' object only (both .cu
    # files include the header); the cp.async forms' file is copied as it is
    home = (tmp_path / "f8" / "cuda" / "attention_sm90_fp8_tma.cu").read_text()
    assert home.index("#define DK_H8S_HOME 1") < home.index('#include "attention_sm90_fp8.cuh"')
    assert "DK_H8S_HOME" not in (tmp_path / "f8" / "cuda" / "attention_sm90_fp8.cu").read_text()
    assert src.index("#ifdef DK_H8S_HOME") < src.index("dk_h8s_dump") < src.index("#else")
    # every consumer phase stamp and sum, and the transposing warps' three sums
    for name in (
        "q0c = h8s_clk()",
        "q1c = h8s_clk();",
        "q2c = h8s_clk();",
        "q3c = h8s_clk();",
        "q4c = h8s_clk();",
        "const unsigned long long q5c = h8s_clk();",
        "atomicAdd(&h8s_sum[i], hs[i]);",
        "atomicAdd(&h8s_sum[8], p1c - p0c);",
        "atomicAdd(&h8s_sum[10], 1ull);",
        "atomicAdd(&h8s_sum[11], h8s_clk() - t0c);",
    ):
        assert src.count(name) == 1, name
    # only lines were added: the stamped kernel is the original one plus the stamps
    kept = set(original.splitlines())
    added = [line for line in src.splitlines() if line not in kept]
    assert all(
        "h8s" in line
        or "hs[" in line
        or "p2c" in line
        or line.strip() in ("}", "{")
        or line.startswith(("extern", "static", "__device__", "#ifdef DK_H8S_HOME", "#else", "#endif"))
        or "if (kt > 0)" in line
        or "if (lane == 0)" in line
        or "threadIdx.x & 31u" in line
        or "unsigned long long" in line
        for line in added
    ), added
