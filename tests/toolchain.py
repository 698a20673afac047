"""The CUDA toolchain the tests that compile find: nvcc where setup.py looks for it
($CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin).  No torch import."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def find_nvcc() -> Path | None:
    """nvcc where setup.py looks for it; None if none."""
    candidates = [Path(os.environ[v]) / "bin" / "nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
    if shutil.which("nvcc"):
        candidates.append(Path(shutil.which("nvcc")))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((p.resolve() for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)
