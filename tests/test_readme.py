"""The README's quick start runs as written and produces the documented output shape."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_runs():
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 30
    namespace: dict = {}
    exec(compile(code, "README.md quick start", "exec"), namespace)
    out, n = namespace["out"], namespace["N"]
    assert tuple(out.shape) == (n, 8 * 64)
    assert out.isfinite().all()


# A commit hash as git abbreviates it: 7 to 40 lowercase hex digits standing alone as a word.
_HASH_LIKE = re.compile(r"(?<![0-9A-Za-z_])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
# Hex-looking words that are not hashes and may appear in the README; none does today.
_NOT_HASHES: frozenset[str] = frozenset()


def _hash_like_tokens(text: str) -> list[str]:
    """Words that read as commit hashes: all-digit words (numbers) and all-letter words
    (``deadbeef``, ``facade``) are not counted, and neither are the listed exceptions."""
    return [
        word
        for word in _HASH_LIKE.findall(text)
        if re.search(r"[0-9]", word) and re.search(r"[a-f]", word) and word not in _NOT_HASHES
    ]


def test_hash_like_tokens_found_precisely():
    text = "commit 2f42c41, at 9731fb0..3952a74 (`31bf51b`); not 2026-11-30, 1000000, deadbeef, "
    text += "float8_e4m3fn, sm90a, abi3, cp310, 5.3e-04, 0x1f, 1e10, manylinux_2_28_x86_64"
    assert _hash_like_tokens(text) == ["2f42c41", "9731fb0", "3952a74", "31bf51b"]


def test_readme_is_short_and_names_no_commits():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines (at most ~250): move detail to docs/"
    assert _hash_like_tokens(text) == [], "commit hashes belong in docs/, not in the README"
    assert "make demo" in text and "make test" in text
