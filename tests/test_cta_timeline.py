"""benchmarks/cta_timeline.py's stamped copy still finds every anchor in the Hopper kernel: a
change to the kernel's source that moves one makes this fail here rather than on the GPU."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stamped_kernel(script: str, kernel: str, dest: Path) -> tuple[str, str]:
    """Runs benchmarks/<script> patch into dest; returns its copy of cuda/<kernel> and the
    tree's own (test_fp8_phases.py and test_persist_phases.py too)."""
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "patch", str(dest)],
        check=True,
        capture_output=True,
    )
    assert (dest / "setup.py").exists() and (dest / "csrc" / "diffkv.h").exists()
    return (dest / "cuda" / kernel).read_text(), (ROOT / "cuda" / kernel).read_text()


def test_patch_places_every_stamp(tmp_path):
    dest = tmp_path / "tl"
    src, original = stamped_kernel("cta_timeline.py", "attention_sm90_ws.cu", dest)
    assert sorted(int(e) for e in re.findall(r"\bTL\((\d)\);", src)) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert "dk_tl_dump" in src and "dk_tl_clear" in src
    assert "TL(" not in original
    # only lines were added: the stamped kernel is the original one plus the stamps
    added = [line for line in src.splitlines() if line not in set(original.splitlines())]
    assert all(
        "TL" in line or "tl_" in line or line.startswith(("#define", "extern", "{", "static"))
        for line in added
    )
    # the persistent kernel (no stamps) is never chosen in the copy: one line added to its choice
    choice = (dest / "cuda" / "attention.cu").read_text().splitlines()
    kept = (ROOT / "cuda" / "attention.cu").read_text().splitlines()
    assert [line for line in choice if line not in set(kept)] == [
        "    return false; /* cta_timeline.py: the stamped kernel is the one-CTA-per-tile one */"
    ]
    at = choice.index(
        "attn_persist_ok(const dk_attention_args *a, const h90_maps &m, int64_t sms, cudaStream_t s)"
    )
    assert choice[at + 2].startswith("    return false;")
