"""The Hopper kernels' tensor-core operands stay in uniform registers: read from the built
extension's sm_90a SASS (cuobjdump), no wgmma (HGMMA / QGMMA) of the warp-specialized, persistent
or e4m3 kernels follows a register move into a uniform register (R2UR) within six instructions.

A wgmma takes its shared-memory descriptors in uniform registers; when ptxas computes them in
vector registers (a tile count or ring position it cannot prove warp-uniform, e.g. one loaded
from memory), every wgmma waits on an R2UR first.  That made the persistent kernel 11 % slower on
every call in one commit, with every correctness test passing (docs/hopper-kernels.md, *The
persistent form*).  This is the static check for it; no GPU needed, the CUDA build's objects."""

from __future__ import annotations

import pytest

from diffkv import _C
from toolchain import sass_functions, sass_sm90a

KERNELS = ("attention_sm90_ws_kernel", "attention_sm90_persist_kernel", "attention_sm90_fp8_kernel")
WINDOW = 6  # instructions before a wgmma in which an R2UR means it waits on one


def _waiting_wgmmas(instructions: list[str]) -> int:
    return sum(
        1
        for i, ins in enumerate(instructions)
        if "GMMA" in ins and any(p.startswith("R2UR") for p in instructions[max(0, i - WINDOW) : i])
    )


def test_the_checker_sees_a_wait():
    """The parser and the count on a hand-written listing: one wgmma right after an R2UR, one
    after uniform arithmetic only."""
    listing = """
        Function : k
        /*0010*/                   R2UR UR8, R24 ;
        /*0020*/                   IMAD.MOV.U32 R9, RZ, RZ, 0x40000040 ;
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0040*/                   UIADD3 UR8, UR49, 0x10020, URZ ;
        /*0050*/                   NOP ;
        /*0060*/                   NOP ;
        /*0070*/                   NOP ;
        /*0080*/                   NOP ;
        /*0090*/                   NOP ;
        /*00a0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
    """
    functions = sass_functions(listing)
    assert list(functions) == ["k"] and len(functions["k"]) == 10
    assert _waiting_wgmmas(functions["k"]) == 1


def test_no_wgmma_waits_on_a_register_move():
    if not _C.build_info()["cuda_compiled"] or "90a" not in _C.build_info()["archs"].split(";"):
        pytest.skip("needs a CUDA build with sm_90a code")
    run = sass_sm90a(_C.__file__)
    if run is None:
        pytest.skip("no cuobjdump + nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    assert run.returncode == 0, run.stderr
    sass = run.stdout
    functions = sass_functions(sass)
    checked = {name: ins for name, ins in functions.items() if any(k in name for k in KERNELS)}
    for k in KERNELS:  # every kernel family found: the check cannot pass on an empty listing
        assert any(k in name for name in checked), f"{k} not in the extension's sm_90a SASS"
    waiting = {name: _waiting_wgmmas(ins) for name, ins in checked.items()}
    assert sum("GMMA" in i for ins in checked.values() for i in ins) > 0
    assert not {name: n for name, n in waiting.items() if n}, "wgmma waiting on R2UR"
