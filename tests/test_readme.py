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
