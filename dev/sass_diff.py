"""How much of each kernel's sm_90a SASS two builds schedule differently.

ptxas schedules a kernel's key loop anew when code elsewhere in the kernel changes: a change to
the persistent kernel's tail (the source of its key loop untouched) moved 300-380 of the loop's
~1,430 instructions, and those builds ran 1-3 % slower on every shape, as did main's own source
built with another ptxas register-usage level (docs/hopper-kernels.md, *The key loop's schedule
moves with the rest of the kernel*).  So before an A/B says what a change did, this says whether
the loop it did not touch kept its schedule:

    python3 dev/sass_diff.py python/diffkv/_C.abi3.so devrun/NAME/python/diffkv/_C.abi3.so \
        [--match persist_kernelI13__nv_bfloat16] [--loop]

Per function that differs (name filtered by --match): the instructions in the longest common
subsequence's complement over the two, registers, predicates and immediates masked (a renamed
register is not a change; a moved or added instruction is), and the function's length.  --loop
compares only the key loop's body (loop_window: the first loop closing over wgmma instructions;
about 3,000 instructions in the e4m3 kernel's forms, both softmax forms included; a function
without one -- the mma.sync and fp32 kernels -- is listed as not compared).  Until
2026-12-06 it compared 1,420 instructions from the first two back-to-back barrier tests, which
some forms do not have (the docs' "N of 1,420" figures are that window's).  Builds are .so or .o
files; cuobjdump as tests/test_sass.py finds it (`make deps` installs it here).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from toolchain import sass_functions, sass_sm90a  # noqa: E402

MASK = re.compile(r"\bU?R\d+\b|\bU?P\d\b|\bPT\b|0x[0-9a-f]+|\.reuse")


def functions(build: Path) -> dict[str, list[str]]:
    run = sass_sm90a(build)
    if run is None:
        sys.exit("no cuobjdump + nvdisasm (make deps installs them)")
    if run.returncode != 0:
        sys.exit(f"cuobjdump -sass -arch sm_90a {build}: {run.stderr.strip()}")
    return sass_functions(run.stdout)


BRANCH = re.compile(r"\bBRA\b[^;]*?\b0x([0-9a-f]+)")


def loop_bounds(code: list[str]) -> tuple[int, int] | None:
    """The key loop's body as instruction indices [top, end]: from the target of the first
    backward branch that closes over tensor instructions (wgmma: HGMMA / QGMMA) to that branch.
    Instruction i sits at byte 16 i of the function, which is what branch targets count in; the
    retry paths of the barrier tests, placed after the function's last EXIT, branch back too, but
    from further on."""
    for i, line in enumerate(code):
        m = BRANCH.search(line)
        if m is None:
            continue
        top = int(m.group(1), 16) // 16
        if top < i and any("GMMA" in x for x in code[top:i]):
            return top, i
    return None


def loop_window(code: list[str]) -> list[str]:
    """The key loop's body (loop_bounds), or nothing."""
    b = loop_bounds(code)
    return [] if b is None else code[b[0] : b[1] + 1]


def changed(a: list[str], b: list[str]) -> int:
    na, nb = [MASK.sub("X", x) for x in a], [MASK.sub("X", x) for x in b]
    sm = difflib.SequenceMatcher(a=na, b=nb, autojunk=False)
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--match", default="", help="a regular expression the function names must match")
    parser.add_argument("--loop", action="store_true", help="the key loop's window only")
    args = parser.parse_args(argv)
    fa, fb = functions(args.a), functions(args.b)
    pick = re.compile(args.match)
    rows, loopless = [], []
    for name in sorted(set(fa) | set(fb)):
        if not pick.search(name):
            continue
        if name not in fa or name not in fb:
            rows.append((-1, 0, name))
            continue
        if args.loop and (loop_bounds(fa[name]) is None or loop_bounds(fb[name]) is None):
            loopless.append(name)  # no wgmma key loop (the mma.sync and fp32 kernels): not compared
            continue
        a, b = (loop_window(fa[name]), loop_window(fb[name])) if args.loop else (fa[name], fb[name])
        if a != b:
            rows.append((changed(a, b), max(len(a), len(b)), name))
    for n, total, name in sorted(rows, reverse=True):
        print(f"{'only in one' if n < 0 else f'{n:6d} of {total:6d}'}  {name}")
    for name in loopless:
        print(f"no wgmma key loop, not compared (run without --loop)  {name}")
    if not rows and len(loopless) < sum(1 for n in set(fa) | set(fb) if pick.search(n)):
        print("the same SASS" + (" in the key loop" if args.loop else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
