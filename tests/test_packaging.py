"""The source distribution is complete: it holds every source and header setup.py compiles,
subfolders of csrc/ included (an sdist without csrc/*.h and cuda/ once built nothing, or, with
nvcc found, a broken CUDA build), and a CPU-only wheel built from it alone imports."""

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SOURCES = (
    "csrc/**/*.c",
    "csrc/**/*.h",
    "cuda/**/*.cu",
    "cuda/**/*.cuh",
    "python/diffkv/**/*.py",
    "python/diffkv/_C.pyi",
    "python/diffkv/py.typed",
    "docs/*.md",
    "examples/*.py",
    "setup.py",
    "pyproject.toml",
    "README.md",
)


def _sdist(work: Path) -> Path:
    """The sdist of a fresh copy of the tree: in the checkout itself, a python/diffkv.egg-info
    left by an earlier build would list the files for setuptools and hide a gap in MANIFEST.in."""
    tree = work / "tree"
    tree.mkdir(parents=True)
    junk = shutil.ignore_patterns("*.egg-info", "__pycache__", "*.so", "*.o", "build")
    for name in ("csrc", "cuda", "python", "docs", "tests", "benchmarks", "examples"):
        shutil.copytree(ROOT / name, tree / name, ignore=junk)
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, tree / name)
    subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(work / "dist")],
        cwd=tree,
        check=True,
        capture_output=True,
    )
    (archive,) = (work / "dist").glob("diffkv-*.tar.gz")
    return archive


def test_sdist_holds_every_source(tmp_path):
    archive = _sdist(tmp_path)
    with tarfile.open(archive) as tar:
        members = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    expected = {p.relative_to(ROOT).as_posix() for pattern in SOURCES for p in ROOT.glob(pattern)}
    assert {"csrc/diffkv.h", "cuda/attention_sm90.cu", "python/diffkv/adapter.py"} <= expected
    assert sorted(expected - members) == []
    assert not [m for m in members if m.endswith((".so", ".o", ".pyc"))]


def test_cpu_wheel_from_sdist_imports(tmp_path):
    archive = _sdist(tmp_path)
    env = {"DIFFKV_CUDA": "0", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            "-w",
            str(tmp_path / "wheel"),
            str(archive),
        ],
        check=True,
        capture_output=True,
        env={**env, "PYTHONPATH": ""},
    )
    (wheel,) = (tmp_path / "wheel").glob("diffkv-*-cp310-abi3-*.whl")
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import diffkv, diffkv._C as c; print(diffkv.__file__, c.build_info()['limited_api'])",
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(tmp_path / "site")},
    )
    path, api = probe.stdout.split()
    assert Path(path).is_relative_to(tmp_path / "site")
    assert api == "cp310-abi3"


def test_nvcc_without_cuda_sources_is_refused(tmp_path):
    """A tree without cuda/*.cu (what the sdist was before MANIFEST.in) while nvcc is found: the
    build stops with a message naming both, before compiling anything."""
    tree = tmp_path / "tree"
    for name in ("csrc", "python"):
        shutil.copytree(
            ROOT / name, tree / name, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "*.so")
        )
    (tree / "cuda").mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    nvcc = tmp_path / "cuda_home" / "bin" / "nvcc"  # found through CUDA_HOME; never run
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\nexit 1\n")
    nvcc.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CUDA_HOME": str(nvcc.parent.parent)}
    proc = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tree,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode != 0
    message = (
        f"RuntimeError: diffkv: nvcc found ({nvcc.resolve()}) but no CUDA sources in {tree / 'cuda'}: the "
        "source tree is incomplete (an sdist from before MANIFEST.in?); set DIFFKV_CUDA=0 for a CPU-only "
        "build"
    )
    assert message in proc.stderr.splitlines()
    assert not list(tree.rglob("*.o"))
