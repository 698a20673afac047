"""Builds diffkv._C: the C11 sources in csrc/ and, when nvcc is found, the CUDA sources in cuda/.

The extension uses CPython's limited API (abi3, Python >= 3.10) and never includes torch
headers or links libtorch, so one build serves every Python and torch version.  The CUDA part
links the static CUDA runtime, so the same .so imports on a machine without a GPU.

Environment:
  DIFFKV_CUDA=0          force a CPU-only build (default: CUDA when nvcc is found)
  DIFFKV_CUDA_ARCHS      ';'-separated targets, default "80;90a" (PTX is added for the highest
                         plain-number target, compute_80 by default, which newer GPUs JIT)
  DIFFKV_WERROR=1        warnings are errors (CI and development builds)
  DIFFKV_SANITIZE=1      -fsanitize=address,undefined on the C sources (CPU-only builds)
  CUDA_HOME              where to look for nvcc first
"""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:  # setuptools >= 70.1 ships bdist_wheel; older ones use the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:
        _bdist_wheel = None

ROOT = Path(__file__).resolve().parent
LIMITED_API = "0x030A0000"


def env_flag(name, default="0"):
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


def find_nvcc():
    if os.environ.get("DIFFKV_CUDA", "").strip() == "0":
        return None
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    which = shutil.which("nvcc")
    if which:
        candidates.append(Path(which))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path.resolve()
    return None


def cuda_archs():
    spec = os.environ.get("DIFFKV_CUDA_ARCHS", "80;90a")
    archs = [a.strip() for a in spec.replace(",", ";").split(";") if a.strip()]
    if not archs:
        raise RuntimeError("DIFFKV_CUDA_ARCHS must name at least one target, e.g. '80;90a'")
    flags = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    plain = [a for a in archs if a.isdigit()] or [archs[-1].rstrip("af")]
    ptx = max(plain, key=int)
    flags += ["-gencode", f"arch=compute_{ptx},code=compute_{ptx}"]
    return archs, flags


C_WARNINGS = ["-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes"]


class BuildExt(build_ext):
    """Compiles cuda/*.cu with nvcc next to the C sources, when nvcc exists."""

    def build_extension(self, ext):
        nvcc = find_nvcc()
        werror = env_flag("DIFFKV_WERROR")
        sanitize = env_flag("DIFFKV_SANITIZE")
        ext.extra_compile_args = ["-std=c11", "-O2", *C_WARNINGS] + (["-Werror"] if werror else [])
        if sanitize:
            ext.extra_compile_args += [
                "-fsanitize=address,undefined",
                "-fno-sanitize-recover=undefined",
                "-fno-omit-frame-pointer",
                "-g",
            ]
            ext.extra_link_args = [*ext.extra_link_args, "-fsanitize=address,undefined"]
        cu_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cuda").glob("*.cu"))
        if nvcc is None or sanitize:
            why = "DIFFKV_SANITIZE=1" if sanitize else "DIFFKV_CUDA=0 or no nvcc found"
            print(f"diffkv: CPU-only build ({why})", file=sys.stderr)
            ext.define_macros = [m for m in ext.define_macros if m[0] != "DIFFKV_WITH_CUDA"]
            ext.define_macros.append(("DIFFKV_CUDA_ARCHS", '""'))
            return super().build_extension(ext)

        if not cu_sources:
            raise RuntimeError(
                f"diffkv: nvcc found ({nvcc}) but no CUDA sources in {ROOT / 'cuda'}: the source tree is "
                "incomplete (an sdist from before MANIFEST.in?); set DIFFKV_CUDA=0 for a CPU-only build"
            )
        archs, gencode = cuda_archs()
        cuda_home = nvcc.parent.parent
        build_temp = Path(self.build_temp) / "cuda"
        build_temp.mkdir(parents=True, exist_ok=True)
        nvcc_flags = [
            "-std=c++17",
            "-O3",
            "--use_fast_math",
            "-Xcompiler",
            "-fPIC,-Wall,-Wextra",
            "-DDIFFKV_WITH_CUDA=1",
            "-I",
            str(ROOT / "csrc"),
            *gencode,
        ]
        if werror:
            nvcc_flags += ["-Werror", "all-warnings"]

        def compile_one(src):
            obj = build_temp / (Path(src).stem + ".o")
            cmd = [str(nvcc), *nvcc_flags, "-c", str(ROOT / src), "-o", str(obj)]
            print(" ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True)
            return str(obj)

        jobs = max(1, min(len(cu_sources), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            objects = list(pool.map(compile_one, cu_sources))

        lib_dirs = [
            d
            for d in (cuda_home / "lib64", cuda_home / "lib", cuda_home / "targets" / "x86_64-linux" / "lib")
            if d.is_dir()
        ]
        ext.extra_objects = [*ext.extra_objects, *objects]
        ext.library_dirs = [*ext.library_dirs, *map(str, lib_dirs)]
        ext.extra_link_args = [
            *ext.extra_link_args,
            "-lcudart_static",
            "-lrt",
            "-lpthread",
            "-ldl",
            "-lstdc++",
        ]
        ext.define_macros = [*ext.define_macros, ("DIFFKV_CUDA_ARCHS", '"' + ";".join(archs) + '"')]
        print(f"diffkv: CUDA build with {nvcc} for {';'.join(archs)}", file=sys.stderr)
        return super().build_extension(ext)


cmdclass = {"build_ext": BuildExt}

if _bdist_wheel is not None:

    class BdistWheelAbi3(_bdist_wheel):
        """Tags the wheel cp310-abi3: the extension uses only the limited API."""

        def get_tag(self):
            python, abi, plat = super().get_tag()
            if python.startswith("cp"):
                return "cp310", "abi3", plat
            return python, abi, plat

    cmdclass["bdist_wheel"] = BdistWheelAbi3

c_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.c"))
with_cuda = find_nvcc() is not None and not env_flag("DIFFKV_SANITIZE")

setup(
    ext_modules=[
        Extension(
            "diffkv._C",
            sources=c_sources,
            include_dirs=["csrc", "csrc/py"],
            define_macros=[("Py_LIMITED_API", LIMITED_API)]
            + ([("DIFFKV_WITH_CUDA", "1")] if with_cuda else []),
            py_limited_api=True,
        )
    ],
    cmdclass=cmdclass,
)
