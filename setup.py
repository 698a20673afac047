"""Builds diffkv._C: the C11 sources in csrc/ (csrc/**/*.c) and, when nvcc is found, the CUDA
sources in cuda/ (cuda/*.cu).

The extension uses CPython's limited API (abi3, Python >= 3.10) and never includes torch
headers or links libtorch, so one build serves every Python and torch version.  The CUDA part
links the static CUDA runtime, so the same .so imports on a machine without a GPU.

Environment:
  DIFFKV_CUDA=0          force a CPU-only build (default: CUDA when nvcc is found)
  DIFFKV_CUDA_ARCHS      ';'-separated targets, default "80;90a" (PTX is added for the highest
                         plain-number target, compute_80 by default, which newer GPUs JIT)
  DIFFKV_WERROR=1        warnings are errors (CI and development builds)
  DIFFKV_SANITIZE=1      -fsanitize=address,undefined on the C sources (CPU-only builds)
  DIFFKV_MANYLINUX=1     a release wheel (`make wheel`): the extension is linked for glibc 2.28
                         by `python -m ziglang c++` (the ziglang package), with the C++ runtime
                         static and only PyInit__C exported; the wheel is tagged
                         manylinux_2_28_x86_64 and its version gets the local label +cu<major>
                         (the CUDA major nvcc compiled for) or +cpu.  The objects are the same as
                         without it: only the link differs
  CUDA_HOME              where to look for nvcc first

What gets rebuilt.  decide_build() makes every choice the environment drives (CPU or CUDA,
the arch list, sanitizers, -Werror, the compilers) in one place, and the build's identity is a
hash of the resulting compiler paths, versions (nvcc's and ptxas's) and flags.  Objects live in
a directory per identity under build_temp (e.g. build/temp.*/cuda-90a-<hash>/), so a CPU build
and a CUDA build never mix objects and switching back to an earlier configuration reuses its
objects.  Each .cu object is recompiled only when its source or a header it includes (nvcc -MD
writes the list next to the object) is newer, and the extension is relinked when any object
changed, a C source or csrc/**/*.h header changed, the list of sources changed, or the
extension file on disk is not the one this build directory last linked for this identity and
link (the stamp build_temp/diffkv-link.json records it), so `DIFFKV_CUDA=0 pip wheel .` after a
CUDA build (or the reverse) relinks instead of packaging the other mode's .so.
"""

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 ships bdist_wheel; older ones use the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:
        _bdist_wheel = None

ROOT = Path(__file__).resolve().parent
LIMITED_API = "0x030A0000"
C_WARNINGS = ["-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes"]
SANITIZE_FLAGS = [
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=undefined",
    "-fno-omit-frame-pointer",
    "-g",
]
CUDA_LINK_LIBS = ["-lcudart_static", "-lrt", "-lpthread", "-ldl", "-lstdc++"]
# The release wheel's link (DIFFKV_MANYLINUX=1): zig's clang and lld against the symbol versions
# of glibc 2.28 (manylinux_2_28).  `zig c++` links its own libc++abi and libunwind statically,
# built for that glibc: gcc's static libsupc++/libgcc_eh would bring references to glibc 2.32
# and 2.35 symbols (__libc_single_threaded, _dl_find_object).
MANYLINUX_GLIBC = "2.28"
MANYLINUX_PLATFORM = "manylinux_2_28_x86_64"
ZIG_TARGET = f"x86_64-linux-gnu.{MANYLINUX_GLIBC}"
# The compiler environment that changes C objects without appearing in our own flags.
C_COMPILER_ENV = ("CC", "CFLAGS", "CPPFLAGS", "LDSHARED", "LDFLAGS")

# ptxas options for single CUDA files, each measured against the default on the GPU (only the
# file's kernels change).  attention_sm90_fp8_tma.cu: the e4m3 kernel's TMA forms scheduled at
# --register-usage-level 0 (default 5) ran ~1 % faster on every case of bench_fp8.py, where its
# cp.async forms (attention_sm90_fp8.cu) ran 0-2 % slower (docs/fp8-log.md, 2026-12-06).  A
# ptxas that does not list an option builds the file with its default.
NVCC_FILE_FLAGS = {"attention_sm90_fp8_tma.cu": ("-Xptxas", "--register-usage-level=0")}
LINK_STAMP = "diffkv-link.json"


def env_flag(name, default="0"):
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


def rel(paths):
    return sorted(str(p.relative_to(ROOT)) for p in paths)


def c_sources():
    return rel((ROOT / "csrc").rglob("*.c"))


def c_headers():
    return rel((ROOT / "csrc").rglob("*.h"))


def cuda_sources():
    return rel((ROOT / "cuda").glob("*.cu"))


def find_nvcc():
    """The nvcc to use: $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin; None if none."""
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


@dataclass(frozen=True)
class BuildConfig:
    """Everything that decides what the objects and the extension contain."""

    nvcc: Path | None  # None: a CPU-only build
    why_cpu: str  # why the build is CPU-only ("" for a CUDA build)
    archs: tuple  # CUDA targets, () for a CPU-only build
    macros: tuple  # (name, value) pairs for the C sources
    cflags: tuple  # C compiler flags
    ldflags: tuple  # linker flags
    nvcc_flags: tuple  # nvcc flags ((): no CUDA)
    library_dirs: tuple  # where the static CUDA runtime is
    toolchain: str = ""  # what nvcc and its ptxas say of their version (a toolkit changed in place)
    manylinux: bool = False  # DIFFKV_MANYLINUX=1: the release wheel's link (objects unchanged)
    cuda_major: int = 0  # the CUDA major version nvcc compiles for (0: CPU-only)
    nvcc_file_flags: tuple = ()  # (file name, flags) pairs: NVCC_FILE_FLAGS that ptxas takes

    @property
    def cuda(self):
        return self.nvcc is not None

    @functools.cached_property
    def identity(self):
        """A directory name: the mode, the archs and a hash of every path and flag above plus
        the C compiler and its environment (a different build must not reuse these objects).
        The release wheel's link (manylinux) changes no object, so it is not part of it: a
        release wheel reuses the objects of the development build with the same flags."""
        compiler = {name: os.environ.get(name, "") for name in C_COMPILER_ENV}
        compiler["sysconfig_cc"] = sysconfig.get_config_var("CC") or ""
        described = {f.name: str(getattr(self, f.name)) for f in fields(self) if f.name not in LINK_ONLY}
        described.update(compiler)
        digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:12]
        mode = "cuda-" + "-".join(self.archs) if self.cuda else "cpu"
        return f"{mode}-{digest}"

    @property
    def link(self):
        """How the extension is linked: "manylinux_2_28_x86_64" or "default" (in the stamp)."""
        return MANYLINUX_PLATFORM if self.manylinux else "default"

    @property
    def local_version(self):
        """The local version label of a release wheel: cu12, cu13, ... or cpu."""
        return f"cu{self.cuda_major}" if self.cuda else "cpu"


# BuildConfig fields that change only the link, not an object.
LINK_ONLY = ("manylinux", "cuda_major")


def toolchain_versions(nvcc):
    """The build lines of `nvcc --version` and of the ptxas beside it (the one nvcc runs), e.g.
    "Build cuda_12.4.r12.4/compiler.34097967_0; Build cuda_12.9.r12.9/compiler.36037853_0"."""
    lines = []
    for tool in (nvcc, nvcc.parent / "ptxas"):
        if tool.is_file():
            out = subprocess.run([str(tool), "--version"], check=True, capture_output=True, text=True).stdout
            lines += [
                line.strip() for line in out.splitlines() if line.startswith(("Build ", "Cuda compilation"))
            ]
    return "; ".join(lines)


def ptxas_options(nvcc):
    """The options the ptxas beside nvcc lists in its --help ("--register-usage-level", ...)."""
    ptxas = nvcc.parent / "ptxas"
    if not ptxas.is_file():
        return frozenset()
    out = subprocess.run([str(ptxas), "--help"], check=True, capture_output=True, text=True).stdout
    return frozenset(re.findall(r"^\s*(--[a-z0-9-]+)", out, flags=re.MULTILINE))


def nvcc_file_flags(nvcc):
    """NVCC_FILE_FLAGS as (file name, flags) pairs, those whose ptxas options ptxas takes."""
    known = ptxas_options(nvcc)
    return tuple(
        (name, flags)
        for name, flags in sorted(NVCC_FILE_FLAGS.items())
        if all(f.split("=")[0] in known for f in flags if f.startswith("--"))
    )


def nvcc_major(toolchain, nvcc):
    """The CUDA major version nvcc compiles for ("release 12.4," in `nvcc --version`)."""
    found = re.search(r"release (\d+)\.\d+", toolchain)
    if found is None:
        raise RuntimeError(f"diffkv: cannot read the CUDA release from `{nvcc} --version`: {toolchain}")
    return int(found.group(1))


def manylinux_linker():
    """The release wheel's link command: zig's c++ driver for glibc 2.28, from the ziglang
    package of the Python that builds."""
    if importlib.util.find_spec("ziglang") is None:
        raise RuntimeError(
            "diffkv: DIFFKV_MANYLINUX=1 links with zig: install the ziglang package into the Python that "
            "builds (`make wheel` does)"
        )
    return [sys.executable, "-m", "ziglang", "c++", "-target", ZIG_TARGET, "-shared"]


@functools.cache
def decide_build():
    """The one place that decides CPU or CUDA and every flag (the environment is read once)."""
    werror = env_flag("DIFFKV_WERROR")
    sanitize = env_flag("DIFFKV_SANITIZE")
    manylinux = env_flag("DIFFKV_MANYLINUX")
    if manylinux and sanitize:
        raise RuntimeError("diffkv: DIFFKV_MANYLINUX=1 (a release wheel) excludes DIFFKV_SANITIZE=1")
    cflags = ["-std=c11", "-O2", *C_WARNINGS] + (["-Werror"] if werror else [])
    ldflags = ["-lpthread"]  # the CPU reference's threads (libpthread.so.0 before glibc 2.34)
    if sanitize:
        cflags += SANITIZE_FLAGS
        ldflags += ["-fsanitize=address,undefined"]

    nvcc = find_nvcc()
    why_cpu = ""
    if sanitize:
        why_cpu = "DIFFKV_SANITIZE=1"
    elif os.environ.get("DIFFKV_CUDA", "").strip() == "0":
        why_cpu = "DIFFKV_CUDA=0"
    elif nvcc is None:
        why_cpu = "no nvcc found"
    if why_cpu:
        return BuildConfig(
            nvcc=None,
            why_cpu=why_cpu,
            archs=(),
            macros=(("DIFFKV_CUDA_ARCHS", '""'),),
            cflags=tuple(cflags),
            ldflags=tuple(ldflags),
            nvcc_flags=(),
            library_dirs=(),
            manylinux=manylinux,
        )

    if not cuda_sources():
        raise RuntimeError(
            f"diffkv: nvcc found ({nvcc}) but no CUDA sources in {ROOT / 'cuda'}: the source tree is "
            "incomplete (an sdist from before MANIFEST.in?); set DIFFKV_CUDA=0 for a CPU-only build"
        )
    archs, gencode = cuda_archs()
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
    cuda_home = nvcc.parent.parent
    toolchain = toolchain_versions(nvcc)
    lib_dirs = [
        d
        for d in (cuda_home / "lib64", cuda_home / "lib", cuda_home / "targets" / "x86_64-linux" / "lib")
        if d.is_dir()
    ]
    return BuildConfig(
        nvcc=nvcc,
        why_cpu="",
        archs=tuple(archs),
        macros=(("DIFFKV_WITH_CUDA", "1"), ("DIFFKV_CUDA_ARCHS", '"' + ";".join(archs) + '"')),
        cflags=tuple(cflags),
        ldflags=(*ldflags, *CUDA_LINK_LIBS),
        nvcc_flags=tuple(nvcc_flags),
        library_dirs=tuple(map(str, lib_dirs)),
        toolchain=toolchain,
        manylinux=manylinux,
        cuda_major=nvcc_major(toolchain, nvcc),
        nvcc_file_flags=nvcc_file_flags(nvcc),
    )


def read_depfile(path):
    """The prerequisites a make-style dependency file (nvcc -MD) lists, relative ones resolved
    against ROOT (nvcc runs there)."""
    text = path.read_text().replace("\\\n", " ")
    _, _, prerequisites = text.partition(":")
    words = prerequisites.replace("\\ ", "\0").split()
    return [ROOT / w.replace("\0", " ") for w in words]


def out_of_date(obj, depfile):
    """True when obj is missing, its dependency file is missing, or a file it was built from
    (source or header) is newer or gone."""
    if not obj.exists() or not depfile.exists():
        return True
    built = obj.stat().st_mtime_ns
    for dep in read_depfile(depfile):
        try:
            if dep.stat().st_mtime_ns > built:
                return True
        except FileNotFoundError:
            return True
    return False


class BuildExt(build_ext):
    """Compiles cuda/*.cu with nvcc next to the C sources (CUDA builds) and relinks the
    extension whenever what it is built from or the build's identity changed."""

    def build_extension(self, ext):
        cfg = decide_build()
        if cfg.cuda:
            print(f"diffkv: CUDA build with {cfg.nvcc} for {';'.join(cfg.archs)}", file=sys.stderr)
        else:
            print(f"diffkv: CPU-only build ({cfg.why_cpu})", file=sys.stderr)
        temp = Path(self.build_temp) / cfg.identity
        ext.define_macros = [("Py_LIMITED_API", LIMITED_API), *cfg.macros]
        ext.extra_compile_args = list(cfg.cflags)
        ext.extra_link_args = list(cfg.ldflags)
        ext.library_dirs = list(cfg.library_dirs)
        ext.depends = c_headers()
        ext.extra_objects = list(map(str, self.compile_cuda(cfg, temp / "cuda"))) if cfg.cuda else []
        linker = self.compiler.linker_so
        if cfg.manylinux:
            linker = manylinux_linker()
            exports = temp / "exports.map"  # the module's init function is all Python needs
            exports.parent.mkdir(parents=True, exist_ok=True)
            exports.write_text("{ global: PyInit__C; local: *; };\n")
            ext.extra_link_args = [a for a in cfg.ldflags if a != "-lstdc++"]  # zig links libc++abi
            ext.extra_link_args.append(f"-Wl,--version-script={exports}")

        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        stamp_path = Path(self.build_temp) / LINK_STAMP
        wanted = {"identity": cfg.identity, "link": cfg.link, "sources": ext.sources + ext.extra_objects}
        reason = self.relink_reason(ext, ext_path, self.read_stamp(stamp_path).get(str(ext_path)), wanted)
        if reason is None:
            print(f"diffkv: {ext_path.name} up to date ({cfg.identity})", file=sys.stderr)
            return
        print(f"diffkv: linking {ext_path.name} ({cfg.identity}): {reason}", file=sys.stderr)
        saved = self.build_temp, self.force, self.compiler.force, self.compiler.linker_so
        # force: setuptools and the compiler would skip the link when no object is newer than
        # the .so, which is wrong after a switch back to an earlier identity's objects.
        self.build_temp, self.force, self.compiler.force = str(temp), True, True
        self.compiler.set_executable("linker_so", linker)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp, self.force, self.compiler.force, linker_so = saved
            self.compiler.set_executable("linker_so", linker_so)
        stat = ext_path.stat()
        stamps = self.read_stamp(stamp_path)
        stamps[str(ext_path)] = {**wanted, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        stamp_path.write_text(json.dumps(stamps, indent=1, sort_keys=True) + "\n")

    @staticmethod
    def read_stamp(path):
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def relink_reason(self, ext, ext_path, linked, wanted):
        """Why the extension must be linked again, or None when the file on disk is what this
        build would produce."""
        if self.force:
            return "--force"
        if not ext_path.exists():
            return "no extension yet"
        if linked is None:
            return "not linked from this build directory"
        if linked["identity"] != wanted["identity"]:
            return f"the build's identity changed (was {linked['identity']})"
        if linked.get("link", "default") != wanted["link"]:
            return f"the link changed (was {linked.get('link', 'default')})"
        if linked["sources"] != wanted["sources"]:
            return "the list of sources changed"
        stat = ext_path.stat()
        if (linked["size"], linked["mtime_ns"]) != (stat.st_size, stat.st_mtime_ns):
            return "the extension file was replaced since the last link"
        for name in [*ext.sources, *ext.depends, *ext.extra_objects]:
            if Path(name).stat().st_mtime_ns > stat.st_mtime_ns:
                return f"{name} changed"
        return None

    def compile_cuda(self, cfg, out_dir):
        """Compiles the out-of-date cuda/*.cu into out_dir; returns every object, in order."""
        out_dir.mkdir(parents=True, exist_ok=True)
        sources = cuda_sources()
        objects = [out_dir / (Path(src).stem + ".o") for src in sources]
        stale = [
            (src, obj)
            for src, obj in zip(sources, objects, strict=True)
            if self.force or out_of_date(obj, obj.with_suffix(".d"))
        ]
        print(f"diffkv: nvcc: {len(stale)} of {len(sources)} CUDA objects out of date", file=sys.stderr)

        def compile_one(job):
            src, obj = job
            depfile = obj.with_suffix(".d")
            depfile.unlink(missing_ok=True)  # no dependency file: rebuilt next time if this fails
            tmp_obj, tmp_dep = obj.with_suffix(".o.tmp"), obj.with_suffix(".d.tmp")
            cmd = [str(cfg.nvcc), *cfg.nvcc_flags, *dict(cfg.nvcc_file_flags).get(Path(src).name, ())]
            cmd += ["-MD", "-MF", str(tmp_dep)]
            cmd += ["-c", str(ROOT / src), "-o", str(tmp_obj)]
            print(" ".join(cmd), file=sys.stderr)
            proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            print(proc.stdout, end="", file=sys.stderr)
            proc.check_returncode()
            # ptxas says so when it serializes wgmma (C7513; CUDA 12.4's ptxas did for every
            # Hopper kernel): not a warning to nvcc, but as costly as one, so -Werror refuses it
            losses = [line for line in proc.stdout.splitlines() if "Potential Performance Loss" in line]
            if losses and "-Werror" in cfg.nvcc_flags:
                raise RuntimeError(f"diffkv: ptxas reports a performance loss in {src}: {losses[0]}")
            os.replace(tmp_obj, obj)
            os.replace(tmp_dep, depfile)

        if stale:
            jobs = max(1, min(len(stale), os.cpu_count() or 1))
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(compile_one, stale))
        return objects


class BuildPy(build_py):
    """Writes the built package's _version.py with the version of this build, so that
    diffkv.__version__ names a release wheel's variant (0.1.0+cu13) as its metadata does."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "diffkv" / "_version.py"
        if target.exists():
            target.write_text(f'__version__ = "{version()}"\n')


cmdclass = {"build_ext": BuildExt, "build_py": BuildPy}

if _bdist_wheel is not None:

    class BdistWheelAbi3(_bdist_wheel):
        """Tags the wheel cp310-abi3: the extension uses only the limited API."""

        def get_tag(self):
            python, abi, plat = super().get_tag()
            if decide_build().manylinux:  # linked for glibc 2.28: make wheel checks it (auditwheel)
                plat = MANYLINUX_PLATFORM
            if python.startswith("cp"):
                return "cp310", "abi3", plat
            return python, abi, plat

    cmdclass["bdist_wheel"] = BdistWheelAbi3


def version():
    """python/diffkv/_version.py's version; a release wheel's carries the local label of its
    variant (0.1.0+cu13), the way PyTorch's wheels name theirs."""
    text = (ROOT / "python" / "diffkv" / "_version.py").read_text()
    found = re.search(r'__version__ = "([^"]+)"', text)
    if found is None:
        raise RuntimeError("diffkv: python/diffkv/_version.py holds no __version__")
    if env_flag("DIFFKV_MANYLINUX"):
        return f"{found.group(1)}+{decide_build().local_version}"
    return found.group(1)


setup(
    version=version(),
    ext_modules=[
        Extension(
            "diffkv._C",
            sources=c_sources(),
            include_dirs=["csrc", "csrc/py"],
            depends=c_headers(),
            define_macros=[("Py_LIMITED_API", LIMITED_API)],
            py_limited_api=True,
        )
    ],
    cmdclass=cmdclass,
)
