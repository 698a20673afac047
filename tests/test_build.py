"""setup.py rebuilds the right thing: the CPU/CUDA mode and the arch list are part of the build's
identity, headers and .cu files are dependencies, each .cu object is recompiled only when its
source or a header it includes changed, and the extension is relinked whenever an object, a C
source or header, or the identity changed -- also under `pip wheel`.

Every case works on one fresh copy of the tree (module fixtures: one CPU build, then one CUDA
build for sm_90a only), with a small probe added to the copy: cuda/build_probe.cu returns a
number from cuda/build_probe.cuh through an exported function, so an edit to either is seen in
the linked .so.  After the first CUDA build the cases only relink or recompile the probe.  A
.so is judged by loading it in a subprocess (`build_info()`; the CUDA one loads on a machine
without a GPU: static cudart) and by its bytes (.nv_fatbin, the section of device code)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from toolchain import find_nvcc

ROOT = Path(__file__).resolve().parent.parent
ARCHS = "90a"  # one target keeps the CUDA build short
PROBE_CU = "cuda/build_probe.cu"
PROBE_CUH = "cuda/build_probe.cuh"


NVCC = find_nvcc()

# Loads a built .so as diffkv._C without importing the package (no torch import: fast) and says
# what it holds; "probe" is dk_build_probe()'s value, None when the symbol is absent.
PROBE_SCRIPT = """
import ctypes, importlib.util, json, sys
path = sys.argv[1]
spec = importlib.util.spec_from_file_location("diffkv._C", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
lib = ctypes.PyDLL(path)
info = module.build_info()
info["cuda_compiled_call"] = module.cuda_compiled()
info["probe"] = lib.dk_build_probe() if hasattr(lib, "dk_build_probe") else None
print(json.dumps(info))
"""


def so_info(path):
    """(cuda_compiled, archs, probe) of a built .so, loaded in a subprocess."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE_SCRIPT, str(path)], check=True, capture_output=True, text=True
    ).stdout
    info = json.loads(out)
    fatbin = b".nv_fatbin" in Path(path).read_bytes()  # the section that holds device code
    assert info["cuda_compiled"] == info["cuda_compiled_call"] == fatbin, info
    return info["cuda_compiled"], info["archs"], info["probe"]


CPU_ONLY = (False, "", None)


class Tree:
    """A copy of the source tree with the probe added; builds it in place."""

    def __init__(self, path):
        self.path = path
        junk = shutil.ignore_patterns("*.egg-info", "__pycache__", "*.so", "*.o", "build")
        for name in ("csrc", "cuda", "python"):
            shutil.copytree(ROOT / name, path / name, ignore=junk)
        for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
            shutil.copy2(ROOT / name, path / name)
        self.header, self.offset = 1, 0
        self.set_probe()

    @property
    def probe(self):
        return self.header + self.offset

    def write(self, name, text):
        """Writes only a change, so an unchanged file keeps its mtime."""
        file = self.path / name
        if not file.exists() or file.read_text() != text:
            file.write_text(text)

    def set_probe(self, header=None, offset=None):
        """Writes the probe: dk_build_probe() returns header + offset."""
        self.header = self.header if header is None else header
        self.offset = self.offset if offset is None else offset
        self.write(PROBE_CUH, f"#define DK_BUILD_PROBE {self.header}\n")
        self.write(
            PROBE_CU,
            '#include "build_probe.cuh"\n\nextern "C" int\ndk_build_probe(void)\n{\n'
            f"    return DK_BUILD_PROBE + {self.offset};\n}}\n",
        )

    def env(self, cuda):
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.path), "PYTHONPATH": "", "DIFFKV_CUDA_ARCHS": ARCHS}
        if NVCC is not None:
            env["CUDA_HOME"] = str(NVCC.parent.parent)
        if not cuda:
            env["DIFFKV_CUDA"] = "0"
        return env

    @property
    def so(self):
        (so,) = (self.path / "python" / "diffkv").glob("_C*.so")
        return so

    def build(self, cuda):
        """setup.py build_ext --inplace; returns (the cuda/*.cu files nvcc compiled, whether the
        extension was linked: its file changed, and setup.py says so)."""
        so_files = list((self.path / "python" / "diffkv").glob("_C*.so"))
        before = so_files[0].stat().st_mtime_ns if so_files else None
        proc = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"],
            cwd=self.path,
            capture_output=True,
            text=True,
            env=self.env(cuda),
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        lines = proc.stderr.splitlines()
        mode = [line for line in lines if line.startswith(("diffkv: CUDA build", "diffkv: CPU-only build"))]
        want = (
            f"diffkv: CUDA build with {NVCC} for {ARCHS}"
            if cuda
            else "diffkv: CPU-only build (DIFFKV_CUDA=0)"
        )
        assert mode == [want]
        self.nvcc_lines = [line for line in lines if line.startswith(str(NVCC))]
        compiled = sorted(
            str(Path(word).relative_to(self.path))
            for line in lines
            if line.startswith(str(NVCC))
            for word in line.split()
            if word.endswith(".cu")
        )
        linked = self.so.stat().st_mtime_ns != before
        assert linked == any(line.startswith("diffkv: linking _C") for line in lines)
        assert linked != any(line.startswith("diffkv: _C") and "up to date" in line for line in lines)
        return compiled, linked

    def wheel(self, cuda, dest):
        """pip wheel of the tree; returns the one extension file in it, extracted."""
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-build-isolation",
                "--no-deps",
                "--no-cache-dir",
            ]
            + ["-w", str(dest), "."],
            cwd=self.path,
            check=True,
            capture_output=True,
            env=self.env(cuda),
        )
        (wheel,) = dest.glob("diffkv-*-cp310-abi3-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            (so,) = [name for name in archive.namelist() if name.endswith(".so")]
            archive.extract(so, dest / "site")
        return dest / "site" / so


@pytest.fixture(scope="module")
def cpu_tree(tmp_path_factory):
    tree = Tree(tmp_path_factory.mktemp("build") / "tree")
    tree.first_cpu_build = tree.build(cuda=False)
    tree.first_cpu_info = so_info(tree.so)
    tree.second_cpu_build = tree.build(cuda=False)
    return tree


@pytest.fixture(scope="module")
def tree(cpu_tree):
    """The CPU-built tree built again with CUDA (the one full nvcc run of this file)."""
    if NVCC is None:
        pytest.skip("nvcc not found (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda/bin): CUDA cases need it")
    cpu_tree.first_cuda_build = cpu_tree.build(cuda=True)
    cpu_tree.first_cuda_nvcc_lines = cpu_tree.nvcc_lines
    cpu_tree.first_cuda_info = so_info(cpu_tree.so)
    cpu_tree.second_cuda_build = cpu_tree.build(cuda=True)
    return cpu_tree


def test_cpu_build_is_cpu_only_and_a_repeat_does_nothing(cpu_tree):
    assert cpu_tree.first_cpu_build == ([], True)
    assert cpu_tree.first_cpu_info == CPU_ONLY
    assert cpu_tree.second_cpu_build == ([], False)


def test_cpu_build_then_cuda_build_gives_cuda(tree):
    every_cu = sorted(str(p.relative_to(tree.path)) for p in (tree.path / "cuda").glob("*.cu"))
    assert PROBE_CU in every_cu
    assert tree.first_cuda_build == (every_cu, True)
    assert tree.first_cuda_info == (True, ARCHS, 1)
    assert tree.second_cuda_build == ([], False)


def test_cuda_build_then_cpu_build_gives_cpu_only(tree):
    tree.build(cuda=True)  # whatever state an earlier case left
    assert tree.build(cuda=False) == ([], True)
    assert so_info(tree.so) == CPU_ONLY
    # Back to CUDA: the objects of that identity are still there and up to date, only a relink.
    assert tree.build(cuda=True) == ([], True)
    assert so_info(tree.so) == (True, ARCHS, tree.probe)


def test_file_flags_reach_their_file_only(tree):
    """setup.py's NVCC_FILE_FLAGS -- attention_sm90_fp8_tma.cu's ptxas --register-usage-level=0,
    where ptxas lists the option -- are on that file's nvcc line and on no other's."""
    assert len(tree.first_cuda_nvcc_lines) == len(list((tree.path / "cuda").glob("*.cu")))
    ptxas = subprocess.run([str(NVCC.parent / "ptxas"), "--help"], capture_output=True, text=True).stdout
    flagged = {
        Path(word).name
        for line in tree.first_cuda_nvcc_lines
        if "--register-usage-level=0" in line.split()
        for word in line.split()
        if word.endswith(".cu")
    }
    assert flagged == ({"attention_sm90_fp8_tma.cu"} if "--register-usage-level" in ptxas else set())


def test_cu_edit_recompiles_that_file_only_and_reaches_the_so(tree):
    tree.build(cuda=True)
    before = tree.so.stat().st_mtime_ns
    tree.set_probe(offset=tree.offset + 40)
    assert tree.build(cuda=True) == ([PROBE_CU], True)
    assert tree.so.stat().st_mtime_ns > before
    assert so_info(tree.so) == (True, ARCHS, tree.probe)


def test_cuda_header_edit_recompiles_its_includers_only(tree):
    tree.build(cuda=True)
    before = tree.so.stat().st_mtime_ns
    tree.set_probe(header=tree.header + 7)
    assert tree.build(cuda=True) == ([PROBE_CU], True)
    assert tree.so.stat().st_mtime_ns > before
    assert so_info(tree.so) == (True, ARCHS, tree.probe)


def test_touched_c_header_relinks_without_nvcc(tree):
    """A csrc/ header no .cu includes (as nvcc's dependency files say): the C side is rebuilt
    and relinked, no CUDA object is."""
    tree.build(cuda=True)
    cuda_deps = set()
    for depfile in (tree.path / "build").glob(f"temp*/cuda-{ARCHS}-*/cuda/*.d"):
        cuda_deps.update(Path(word).resolve() for word in depfile.read_text().split() if word.endswith(".h"))
    assert tree.path.joinpath("csrc", "diffkv.h").resolve() in cuda_deps
    headers = [h for h in sorted((tree.path / "csrc").rglob("*.h")) if h.resolve() not in cuda_deps]
    assert headers, "every csrc/ header is included by a .cu; pick another C-only dependency"
    before = tree.so.stat().st_mtime_ns
    os.utime(headers[0])
    assert headers[0].stat().st_mtime_ns > before
    assert tree.build(cuda=True) == ([], True)
    assert tree.so.stat().st_mtime_ns > before
    assert so_info(tree.so) == (True, ARCHS, tree.probe)


def test_wheel_after_a_build_of_the_other_mode(tree, tmp_path):
    """DIFFKV_CUDA=0 pip wheel after a CUDA build packages no CUDA code, and the reverse."""
    tree.build(cuda=True)
    assert so_info(tree.wheel(cuda=False, dest=tmp_path / "cpu")) == CPU_ONLY
    assert so_info(tree.so) == (True, ARCHS, tree.probe)  # the in-place CUDA .so was left out
    assert so_info(tree.wheel(cuda=True, dest=tmp_path / "cuda")) == (True, ARCHS, tree.probe)
