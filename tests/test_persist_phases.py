"""benchmarks/persist_phases.py's stamped copy still finds every anchor in the persistent kernel: a
change to the kernel's source that moves one makes this fail here rather than on the GPU."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_patch_places_every_stamp(tmp_path):
    dest = tmp_path / "ps"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "persist_phases.py"), "patch", str(dest)],
        check=True,
        capture_output=True,
    )
    src = (dest / "cuda" / "attention_sm90_persist.cu").read_text()
    original = (ROOT / "cuda" / "attention_sm90_persist.cu").read_text()
    assert "hps_" not in original
    assert "dk_hps_dump" in src and "dk_hps_reset" in src
    # the pass's, the item's three stamps and the six sums
    for name in (
        "const unsigned long long hps_pass = hps_clk();",
        "const unsigned long long hps_c0 = hps_clk();",
        "hps_c1 = hps_clk();\n",
        "const unsigned long long hps_c2 = hps_clk();",
        "atomicAdd(&hps_sum[0], hps_c1 - hps_c0);",
        "atomicAdd(&hps_sum[1], hps_c2 - hps_c1);",
        "atomicAdd(&hps_sum[3], (unsigned long long)n_tiles);",
        "atomicAdd(&hps_sum[4], hps_clk() - hps_pass);",
    ):
        assert src.count(name) == 1, name
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
    assert (dest / "setup.py").exists() and (dest / "csrc" / "diffkv.h").exists()
