"""The CUDA toolchain the tests that compile find: nvcc where setup.py looks for it
($CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin), and cuobjdump for the SASS checks
(tests/test_sass.py, dev/sass_diff.py).  No torch import."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
from pathlib import Path


def find_nvcc() -> Path | None:
    """nvcc where setup.py looks for it; None if none."""
    candidates = [Path(os.environ[v]) / "bin" / "nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
    if shutil.which("nvcc"):
        candidates.append(Path(shutil.which("nvcc")))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((p.resolve() for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)


def sass_tools() -> tuple[str, dict[str, str]] | None:
    """cuobjdump and the environment it finds nvdisasm in: the CUDA toolkit's, else the
    nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels' (make deps installs them)."""
    env = dict(os.environ)
    exe = shutil.which("cuobjdump")
    if exe and shutil.which("nvdisasm"):
        return exe, env
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for path in sorted(pathlib.Path(root).glob("cu*/bin/cuobjdump")):
            if (path.parent / "nvdisasm").exists():
                env["PATH"] = f"{path.parent}{os.pathsep}{env.get('PATH', '')}"
                return str(path), env
    return None


def sass_sm90a(build: str | Path) -> subprocess.CompletedProcess | None:
    """cuobjdump's sm_90a SASS listing of a built extension or object (its stdout; the process,
    so that the caller sees a failure); None without cuobjdump + nvdisasm."""
    tools = sass_tools()
    if tools is None:
        return None
    exe, env = tools
    return subprocess.run(
        [exe, "-sass", "-arch", "sm_90a", str(build)], capture_output=True, text=True, env=env
    )


def sass_functions(sass: str) -> dict[str, list[str]]:
    """Function name -> its instructions (opcode and operands), in order."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line)
        if m and current is not None:
            current.append(m.group(1))
    return out
