"""benchmarks/persist_phases.py's stamped copy still finds every anchor in the persistent kernel: a
change to the kernel's source that moves one makes this fail here rather than on the GPU."""

from test_cta_timeline import stamped_kernel


def test_patch_places_every_stamp(tmp_path):
    src, original = stamped_kernel("persist_phases.py", "attention_sm90_persist.cu", tmp_path / "ps")
    assert "hps_" not in original
    assert "dk_hps_dump" in src and "dk_hps_reset" in src
    # the pass's, the item's three stamps, the split tail's six and the sums
    for name in (
        "const unsigned long long hps_pass = hps_clk();",
        "const unsigned long long hps_c0 = hps_clk();",
        "hps_c1 = hps_clk();\n",
        "const unsigned long long hps_c2 = hps_clk();",
        "hps_t1 = hps_clk();\n",
        "hps_t2 = hps_clk();\n",
        "hps_t3 = hps_clk();\n",
        "hps_tv = hps_clk();\n",
        "hps_tq = hps_clk();\n",
        "hps_tk = hps_clk();\n",
        "atomicAdd(&hps_sum[0], hps_c1 - hps_c0);",
        "atomicAdd(&hps_sum[1], hps_c2 - hps_c1);",
        "atomicAdd(&hps_sum[3], (unsigned long long)n_tiles);",
        "atomicAdd(&hps_sum[4], hps_clk() - hps_pass);",
        "atomicAdd(&hps_sum[6], hps_t1 - hps_c1);",
        "atomicAdd(&hps_sum[9], hps_c2 - hps_t3);",
        "atomicAdd(&hps_sum[10], 1ull);",
        "atomicAdd(&hps_sum[13], hps_tk - hps_tq);",
    ):
        assert src.count(name) == 1, name
    # the split tail's stamps in order: the waits (V, the next Q and K, Q's negation, the turn), then
    # the last P V, then the store of O
    stamps = [
        src.index(x)
        for x in (
            "hps_tv = hps_clk();",
            "hps_tq = hps_clk();",
            "hps_tk = hps_clk();",
            "hps_t1 = hps_clk();",
            "h90_pv<T, D, BN, true, D / 64>(o, pa, sv);",
            "hps_t2 = hps_clk();",
            "/* the epilogue under the next item's first Q K^T */",
            "hps_t3 = hps_clk();",
        )
    ]
    assert stamps == sorted(stamps)
    # only lines were added: the stamped kernel is the original one plus the stamps
    kept = set(original.splitlines())
    added = [line for line in src.splitlines() if line not in kept]
    assert all(
        "hps" in line
        or line.strip() in ("}", "{")
        or "if (wt == 0)" in line
        or line.startswith(("extern", "{ unsigned long long c;"))
        for line in added
    ), added
