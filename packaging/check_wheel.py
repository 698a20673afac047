"""Checks a release wheel (`make wheel`) before it leaves the machine; exits non-zero naming
every rule it breaks.

    python packaging/check_wheel.py dist/diffkv-0.1.0+cu13-cp310-abi3-manylinux_2_28_x86_64.whl

The rules (docs/architecture.md, *Release wheels*):
- the name is diffkv-<version>+<cu12|cu13|cpu>-cp310-abi3-manylinux_2_28_x86_64.whl;
- `auditwheel show` finds the wheel consistent with manylinux_2_28_x86_64 (or an older policy);
- the extension needs nothing but glibc's libraries: libc, libm, libpthread, libdl, librt and the
  dynamic loader (libcuda is opened at run time by the static CUDA runtime, never linked);
- every symbol it imports is versioned at GLIBC_2.28 or older, or is Python's C API (the
  interpreter provides it), or is weak: a reference that glibc 2.28 would not resolve (an
  unversioned one to a newer symbol) is refused here, as auditwheel does not see it;
- it exports PyInit__C alone and carries no RPATH or RUNPATH;
- a CUDA wheel holds device code (the .nv_fatbin section), a cpu wheel none.

Needs pyelftools and auditwheel (the wheel tools environment of `make wheel` has both).
"""

import argparse
import io
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerSymSection

GLIBC_MAX = (2, 28)
PLATFORM = "manylinux_2_28_x86_64"
GLIBC_LIBRARIES = {
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "ld-linux-x86-64.so.2",
}
NAME = re.compile(
    r"^diffkv-(?P<version>[0-9][0-9.]*)\+(?P<variant>cu[0-9]+|cpu)-cp310-abi3-(?P<platform>[a-z0-9_]+)\.whl$"
)


def imported_symbols(elf):
    """(name, version or None, binding) of every undefined dynamic symbol."""
    dynsym = elf.get_section_by_name(".dynsym")
    versym = next((s for s in elf.iter_sections() if isinstance(s, GNUVerSymSection)), None)
    names = {}  # version index -> version name, from .gnu.version_r
    verneed = elf.get_section_by_name(".gnu.version_r")
    if verneed is not None:
        for _, auxiliaries in verneed.iter_versions():
            for aux in auxiliaries:
                names[aux.entry["vna_other"]] = aux.name
    for index, sym in enumerate(dynsym.iter_symbols()):
        if index == 0 or sym["st_shndx"] != "SHN_UNDEF":
            continue
        version = None
        if versym is not None:
            version = names.get(versym.get_symbol(index)["ndx"])
        yield sym.name, version, sym["st_info"]["bind"]


def exported_symbols(elf):
    """Every defined global or weak dynamic symbol."""
    dynsym = elf.get_section_by_name(".dynsym")
    return sorted(
        sym.name
        for sym in dynsym.iter_symbols()
        if sym.name
        and sym["st_shndx"] != "SHN_UNDEF"
        and sym["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK")
    )


def dynamic_tags(elf, tag):
    section = next(s for s in elf.iter_sections() if isinstance(s, DynamicSection))
    return [t for t in section.iter_tags() if t.entry.d_tag == tag]


def check_extension(data, variant, problems):
    """The ELF rules on the extension's bytes; appends what is wrong to problems."""
    elf = ELFFile(io.BytesIO(data))
    needed = sorted(t.needed for t in dynamic_tags(elf, "DT_NEEDED"))
    if not set(needed) <= GLIBC_LIBRARIES:
        problems.append(f"needs libraries besides glibc's: {sorted(set(needed) - GLIBC_LIBRARIES)}")
    if dynamic_tags(elf, "DT_RPATH") or dynamic_tags(elf, "DT_RUNPATH"):
        problems.append("carries an RPATH or RUNPATH")
    newest = (0, 0)
    for name, version, bind in imported_symbols(elf):
        if version is not None and version.startswith("GLIBC_"):
            number = tuple(int(x) for x in version[len("GLIBC_") :].split(".")[:2])
            newest = max(newest, number)
            if number > GLIBC_MAX:
                problems.append(f"imports {name}@{version}, newer than glibc 2.28")
        elif version is not None:
            problems.append(f"imports {name}@{version}, not from glibc")
        elif not name.startswith(("Py", "_Py")) and bind != "STB_WEAK":
            problems.append(f"imports {name} without a symbol version (glibc 2.28 may not have it)")
    exported = exported_symbols(elf)
    if exported != ["PyInit__C"]:
        problems.append(f"exports {exported[:8]}{'...' if len(exported) > 8 else ''}, not PyInit__C alone")
    has_device_code = elf.get_section_by_name(".nv_fatbin") is not None
    if has_device_code != (variant != "cpu"):
        problems.append(f"a {variant} wheel {'with' if has_device_code else 'without'} device code")
    return needed, newest


def auditwheel_show(wheel, problems):
    """auditwheel's verdict; appends a problem unless it finds the wheel manylinux_2_28 or older."""
    proc = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)], capture_output=True, text=True
    )
    text = " ".join((proc.stdout + proc.stderr).split())
    found = re.search(r'consistent with the following platform tag: "manylinux_(\d+)_(\d+)_x86_64"', text)
    if proc.returncode != 0 or found is None:
        problems.append(f"auditwheel show: {text}")
    elif (int(found.group(1)), int(found.group(2))) > GLIBC_MAX:
        problems.append(f"auditwheel show: only manylinux_{found.group(1)}_{found.group(2)}: {text}")
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    args = parser.parse_args(argv)
    problems = []
    match = NAME.match(args.wheel.name)
    if match is None:
        print(f"{args.wheel.name}: not diffkv-<version>+<cu12|cu13|cpu>-cp310-abi3-<platform>.whl")
        return 1
    if match["platform"] != PLATFORM:
        problems.append(f"tagged {match['platform']}, not {PLATFORM}")
    with zipfile.ZipFile(args.wheel) as archive:
        (member,) = [n for n in archive.namelist() if re.fullmatch(r"diffkv/_C\.abi3\.so", n)]
        data = archive.read(member)
    needed, newest = check_extension(data, match["variant"], problems)
    verdict = auditwheel_show(args.wheel, problems)
    size = args.wheel.stat().st_size
    print(f"{args.wheel.name}: {size / 2**20:.1f} MiB (extension {len(data) / 2**20:.1f} MiB)")
    print(f"  needs {', '.join(needed)}; newest glibc symbol version {newest[0]}.{newest[1]}")
    print(f"  auditwheel show: {verdict}")
    for problem in problems:
        print(f"  FAIL: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
