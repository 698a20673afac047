"""No leaks: every ``diffkv._C`` entry point and the public layer path, called many times.

Each entry point (every function ``_C`` exports: ``_C.pyi`` plus ``check_layer_qkv``) has a
table of cases: valid calls and failing calls, one per kind of error path (argument count,
not a tensor, wrong dtype / rank / shape, each of the seed's rules, each error the C core
returns).  A case's arguments (tensors, tuples, lists, ints, rows, bindings, callables) are
created once; every case is checked once (it succeeds, or raises the expected exception with
the expected message) and warmed up (up to ``WARMUP`` = 1,000 calls); then the cases of one
entry point share ``CALLS`` = 100,000 calls, made in plain Python loops (with
``DIFFKV_LEAK_CALLS_PER_CASE=100000`` every case gets 100,000 calls: the long run).  After each
case's loop, and over the whole entry point, with the cycle collector paused:

- the reference count of every argument object and of everything inside it (tuple/list/dict
  items, dataclass fields) is unchanged (atoms the rest of the process shares -- small ints,
  interned strings, None -- may move by less than 1 % of the calls; a leak moves them by one
  per call): a missing ``Py_DECREF`` on any path fails;
- ``sys.getallocatedblocks()`` (live pymalloc blocks) grew by less than 10 % of the calls
  (at least ``BLOCKS_SLACK`` = 500: one-off caches inside CPython and torch): one leaked
  Python object in every 10 calls fails;
- the C heap in use (glibc ``mallinfo2``: ``uordblks + hblkhd``; under AddressSanitizer the
  allocator's own live-bytes count) grew by less than ``HEAP_SLACK`` = 64 KiB: measured growth
  is 0 bytes for every case; one leaked malloc chunk (>= 32 bytes) per call adds >= 220 KiB
  over the ~7,000 calls the smallest share gets;
- the resident set (``/proc/self/statm`` pages x page size) grew by less than ``RSS_SLACK`` =
  1 MiB.  Measured growth after the warm-up is 0 for every case and entry point; 1 MiB
  leaves the allocator room to map a new region once, and is a third of what the smallest
  per-call leak (one 32-byte chunk) adds over 100,000 calls.  RSS is the coarse check (a leak
  can first refill pages the heap already holds), the two exact counters above are the
  sharp ones.  Under AddressSanitizer freed memory sits in the quarantine, so RSS grows by
  design; there the allocator's exact count replaces the RSS bound.

``test_the_checks_catch_leaks`` shows each check failing on a deliberately leaking function.
Cases whose failure is raised inside torch (a ``meta`` tensor DLPack cannot export: torch
builds a C++ backtrace, ~0.6-0.9 ms per call) run ``SLOW_CALLS`` = 500 times; the refcount
check is exact at that count too.  The tensor entry points run again through the bridge's
``to_dlpack`` capsule fallback (``set_bridge_path('capsule')``), which makes and releases a
capsule per tensor argument per call.

The public layer path (``prepare_layer_context`` + ``forward_paged`` in every mask mode and
Q/K/V layout, plus failing layer calls: 80,000 iterations) and the batch path
(``prepare_batch`` / ``activate`` / ``DiffusionPagedAttentionRuntime`` with a layer call, plus
failing preparations: 20,000 iterations) make 100,000 iterations between them, with the same
checks (the cycle collector running; one collection before each measurement).

Under AddressSanitizer (``make asan``) every count is divided by 10 to keep CI short.  The
whole file takes ~9 s on the 2-core dev machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import os
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import diffkv
from _helpers import fake_forward_context, make_adapter, row
from diffkv import _C


def _asan_live_bytes() -> Callable[[], int] | None:
    """The ASan allocator's live-bytes counter when this process runs under ASan."""
    try:
        fn = ctypes.CDLL(None).__sanitizer_get_current_allocated_bytes
    except (AttributeError, OSError):
        return None
    fn.restype = ctypes.c_size_t
    fn.argtypes = []
    return fn


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc_live_bytes() -> Callable[[], int]:
    fn = ctypes.CDLL(None).mallinfo2
    fn.restype = _MallInfo2
    fn.argtypes = []

    def live() -> int:
        info = fn()
        return info.uordblks + info.hblkhd

    return live


_ASAN = _asan_live_bytes()
_heap_live_bytes = _ASAN if _ASAN is not None else _glibc_live_bytes()

SCALE = 10 if _ASAN is not None else 1
# Calls per entry point, shared evenly by its cases; DIFFKV_LEAK_CALLS_PER_CASE=100000 (the long
# run of `make fuzz`) gives every case that many calls instead.
CALLS = 100_000 // SCALE
CALLS_PER_CASE = int(os.environ.get("DIFFKV_LEAK_CALLS_PER_CASE", "0")) // SCALE
SLOW_CALLS = 500 // SCALE
WARMUP = 1_000 // SCALE
LAYER_ITERS = 80_000 // SCALE
BATCH_ITERS = 20_000 // SCALE
RSS_SLACK = 1 << 20
HEAP_SLACK = 64 << 10
SHARED_REFS = 1_000
BLOCKS_SLACK = 500
_ATOMS = (str, int, float, bool, type(None))
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


@dataclasses.dataclass
class Case:
    """One call of an entry point: ``fn(*args)`` succeeds (raises is None) or raises
    ``raises`` with a message matching ``match``."""

    name: str
    fn: Callable[..., Any]
    args: tuple
    raises: type[BaseException] | None = None
    match: str | None = None
    calls: int | None = None  # None: a share of the entry point's CALLS


def ok(name: str, fn: Callable[..., Any], *args: Any) -> Case:
    return Case(name, fn, args)


def bad(
    name: str,
    exc: type[BaseException],
    match: str,
    fn: Callable[..., Any],
    *args: Any,
    calls: int | None = None,
) -> Case:
    return Case(name, fn, args, exc, match, calls)


def _tracked(args: tuple) -> list:
    """Every object reachable from the arguments through tuples, lists, dicts and dataclass
    fields (deduplicated by identity), the arguments themselves included."""
    seen: dict[int, Any] = {}
    stack = list(args)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj
        if isinstance(obj, (tuple, list)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
    return list(seen.values())


def _loop_ok(fn: Callable[..., Any], args: tuple, n: int) -> None:
    for _ in range(n):
        fn(*args)


def _loop_raises(fn: Callable[..., Any], args: tuple, exc: type[BaseException], n: int) -> None:
    for _ in range(n):
        try:
            fn(*args)
        except exc:
            pass


@contextlib.contextmanager
def _gc_paused():
    """One full collection, then no automatic ones: the measured loops must leave nothing for
    the cycle collector either (a full collection costs ~0.1 s with torch loaded)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclasses.dataclass
class Measure:
    refs: list[int]
    blocks: int
    heap: int
    rss: int


def _measure(objs: list) -> Measure:
    return Measure([sys.getrefcount(o) for o in objs], sys.getallocatedblocks(), _heap_live_bytes(), _rss())


def _compare(label: str, objs: list, before: Measure, after: Measure, n: int) -> list[str]:
    problems = []
    for obj, r0, r1 in zip(objs, before.refs, after.refs, strict=True):
        # Atoms (str, int, float, None, bools) may be shared with the rest of the process (cached
        # small ints, interned strings), which moves them by a few references as the
        # interpreter and pytest run; a leak moves them by about one per call.  Everything
        # else the case created (tensors, tuples, lists, rows, bindings, callables) must not
        # move at all.
        shared = r0 >= SHARED_REFS or type(obj) in _ATOMS
        if (shared and abs(r1 - r0) >= max(n // 100, 10)) or (not shared and r0 != r1):
            text = repr(obj)
            text = text if len(text) <= 80 else text[:77] + "..."
            problems.append(f"{label}: refcount of {type(obj).__name__} {text} went {r0} -> {r1}")
    blocks = after.blocks - before.blocks
    if blocks >= max(n // 10, BLOCKS_SLACK):
        problems.append(f"{label}: {blocks} more live Python objects after {n} calls")
    heap = after.heap - before.heap
    if heap >= HEAP_SLACK:
        problems.append(f"{label}: C heap grew by {heap} bytes over {n} calls")
    rss = after.rss - before.rss
    if _ASAN is None and rss >= RSS_SLACK:
        problems.append(f"{label}: RSS grew by {rss} bytes over {n} calls")
    return problems


def _loop(case: Case, n: int) -> None:
    if case.raises is None:
        _loop_ok(case.fn, case.args, n)
    else:
        _loop_raises(case.fn, case.args, case.raises, n)


def _check_and_warm_up(case: Case) -> None:
    """One checked call (the expected result or exception), then the warm-up calls."""
    if case.raises is None:
        case.fn(*case.args)
    else:
        with pytest.raises(case.raises, match=case.match):
            case.fn(*case.args)
    _loop(case, min(WARMUP, case.calls // 5))


def _run_case(case: Case) -> tuple[list[str], dict]:
    """The measured loop of one (checked, warmed-up) case.  Returns (problems, figures)."""
    objs = _tracked(case.args) + [case.fn]
    before = _measure(objs)
    start = time.perf_counter()
    _loop(case, case.calls)
    seconds = time.perf_counter() - start
    after = _measure(objs)
    problems = _compare(case.name, objs, before, after, case.calls)
    figures = {
        "calls": min(WARMUP, case.calls // 5) + case.calls + 1,
        "objects_refcounted": len(objs),
        "blocks_delta": after.blocks - before.blocks,
        "heap_delta": after.heap - before.heap,
        "rss_delta": after.rss - before.rss,
        "seconds": round(seconds, 3),
    }
    return problems, figures


# ------------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------------

F32 = torch.float32
I32 = torch.int32
I64 = torch.int64
H, HKV, D, BS, NB = 2, 1, 2, 2, 3  # heads, kv heads, head size, block size, blocks: tiny
HUGE = 2**70


class _RaisingNe:
    """An object whose comparison raises (the comparison-error path of check_head_sizes)."""

    def __ne__(self, other):
        raise RuntimeError("comparison refused")

    __hash__ = object.__hash__


def _rows_and_bindings():
    Binding = diffkv.DiffusionPagedAttentionRowBinding
    ra = row("a", 2, 2, sequence_id=0)
    rb = row("b", 2, 2, sequence_id=1)
    return SimpleNamespace(
        ra=ra,
        rb=rb,
        rows=(ra, rb),
        bindings=(Binding(row_index=0, max_seq_len=4), Binding(row_index=1, max_seq_len=4)),
        Binding=Binding,
    )


def _cases_module() -> dict[str, list[Case]]:
    x = torch.zeros(4)
    meta = torch.empty(2, device="meta")
    to_dlpack = torch.utils.dlpack.to_dlpack
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return {
        "configure": [
            ok("configure ok", _C.configure, to_dlpack, getter),
            bad("configure nargs", TypeError, "takes 2 arguments", _C.configure, to_dlpack),
        ],
        "set_bridge_path": [
            ok("set_bridge_path auto", _C.set_bridge_path, "auto"),
            bad("set_bridge_path bogus", ValueError, "must be 'auto' or 'capsule'", _C.set_bridge_path, "x"),
            bad("set_bridge_path int", ValueError, "must be 'auto' or 'capsule'", _C.set_bridge_path, 5),
            bad("set_bridge_path nargs", TypeError, "takes 1 arguments", _C.set_bridge_path),
        ],
        "set_attention_kernel": [
            ok("set_attention_kernel auto", _C.set_attention_kernel, "auto"),
            bad(
                "set_attention_kernel bogus",
                ValueError,
                "must be 'auto', 'sm90' or 'sm80'",
                _C.set_attention_kernel,
                "x",
            ),
            bad(
                "set_attention_kernel int",
                ValueError,
                "must be 'auto', 'sm90' or 'sm80'",
                _C.set_attention_kernel,
                5,
            ),
            bad("set_attention_kernel nargs", TypeError, "takes 1 arguments", _C.set_attention_kernel),
        ],
        "bridge_path": [
            ok("bridge_path ok", _C.bridge_path, x),
            bad("bridge_path not tensor", TypeError, "must be a torch.Tensor", _C.bridge_path, 5),
        ],
        "tensor_info": [
            ok("tensor_info ok", _C.tensor_info, x),
            bad("tensor_info str", TypeError, "must be a torch.Tensor", _C.tensor_info, "s"),
            bad("tensor_info meta", RuntimeError, "meta", _C.tensor_info, meta, calls=SLOW_CALLS),
            bad("tensor_info nargs", TypeError, "takes 1 arguments", _C.tensor_info, x, x),
        ],
        "bridge_noop4": [
            ok("bridge_noop4 ok", _C.bridge_noop4, x, x, x, x),
            bad(
                "bridge_noop4 not tensor", TypeError, "d must be a torch.Tensor", _C.bridge_noop4, x, x, x, 1
            ),
            bad("bridge_noop4 nargs", TypeError, "takes 4 arguments", _C.bridge_noop4, x),
        ],
        "cuda_compiled": [
            ok("cuda_compiled ok", _C.cuda_compiled),
            bad("cuda_compiled nargs", TypeError, "takes 0 arguments", _C.cuda_compiled, 1),
        ],
        "build_info": [
            ok("build_info ok", _C.build_info),
            bad("build_info nargs", TypeError, "takes 0 arguments", _C.build_info, 1),
        ],
        "last_attention_kernel": [
            ok("last_attention_kernel ok", _C.last_attention_kernel),
            bad("last_attention_kernel nargs", TypeError, "takes 0 arguments", _C.last_attention_kernel, 1),
        ],
    }


def _cases_rules() -> dict[str, list[Case]]:
    rb = _rows_and_bindings()
    pre = rb.rows
    den = (row("a", 1, 2, 1, sequence_id=0), row("b", 1, 2, 1, sequence_id=1))
    other = (row("a", 1, 2, 1, sequence_id=0), row("c", 1, 2, 1, sequence_id=1))
    q = torch.zeros(2, H, D)
    k = torch.zeros(2, HKV, D)
    qb = torch.zeros(1, 3, H * D)
    kb = torch.zeros(1, 3, HKV * D)
    cpu = torch.device("cpu")
    code = _C.DTYPE_FLOAT32

    def qkv(query, key, value, *, n=2, lens=(2,), dev_type=1, want_code=code, want=F32, heads=H):
        return (query, key, value, heads, HKV, D, D, dev_type, 0, cpu, want_code, want, n, lens)

    return {
        "check_row": [
            ok("check_row sequence_id", _C.check_row, "r", 4, 8, 4, 0, None),
            ok("check_row context_id", _C.check_row, "r", 4, 8, 0, None, "ctx"),
            ok("check_row huge ints", _C.check_row, "r", HUGE, HUGE * 2, HUGE, HUGE, None),
            bad("check_row R1", ValueError, "request_id", _C.check_row, "", 4, 4, 0, 0, None),
            bad("check_row R2", ValueError, "exactly one of", _C.check_row, "r", 4, 4, 0, 0, "c"),
            bad("check_row R3", ValueError, "sequence_id", _C.check_row, "r", 4, 4, 0, -1, None),
            bad("check_row R4", ValueError, "context_id", _C.check_row, "r", 4, 4, 0, None, ""),
            bad("check_row R5", ValueError, "query_len", _C.check_row, "r", 0, 4, 0, 0, None),
            bad("check_row R6", ValueError, "seq_len", _C.check_row, "r", 4, True, 0, 0, None),
            bad("check_row R7", ValueError, "kv_start_pos", _C.check_row, "r", 4, 4, -HUGE, 0, None),
            bad("check_row R8", ValueError, "write span exceeds", _C.check_row, "r", 4, HUGE, HUGE, 0, None),
            bad("check_row nargs", TypeError, "takes 6 arguments", _C.check_row, "r"),
        ],
        "check_metadata": [
            ok("check_metadata ok", _C.check_metadata, pre, den),
            bad("check_metadata M1", ValueError, "both prefill and denoise", _C.check_metadata, (), den),
            bad("check_metadata M2", ValueError, "same ordered identities", _C.check_metadata, pre, other),
            bad(
                "check_metadata no identity", AttributeError, "identity", _C.check_metadata, pre, (object(),)
            ),
            bad("check_metadata not sequence", TypeError, "must be a sequence", _C.check_metadata, 5, 6),
        ],
        "check_step": [
            ok("check_step ok", _C.check_step, 7),
            bad("check_step negative", ValueError, "non-negative denoise step", _C.check_step, -1),
            bad("check_step None", ValueError, "non-negative denoise step", _C.check_step, None),
            bad("check_step huge negative", ValueError, "non-negative denoise step", _C.check_step, -HUGE),
        ],
        "check_layer_heads": [
            ok("check_layer_heads ok", _C.check_layer_heads, 2, 4, 2),
            ok("check_layer_heads huge", _C.check_layer_heads, 2, HUGE * 4, HUGE * 2),
            bad("check_layer_heads L1", ValueError, "ulysses_degree", _C.check_layer_heads, True, 4, 2),
            bad("check_layer_heads type", TypeError, "must be ints", _C.check_layer_heads, 1, "x", 2),
            bad(
                "check_layer_heads L2", ValueError, "divisible by num_kv_heads", _C.check_layer_heads, 1, 4, 3
            ),
            bad("check_layer_heads L3", ValueError, "divisible by ulysses", _C.check_layer_heads, 4, 4, 2),
        ],
        "check_head_sizes": [
            ok("check_head_sizes ok", _C.check_head_sizes, 64, 64),
            bad("check_head_sizes L5", ValueError, "equal key/value head sizes", _C.check_head_sizes, 64, 32),
            bad("check_head_sizes compare", RuntimeError, "refused", _C.check_head_sizes, 64, _RaisingNe()),
        ],
        "check_layer_qkv": [
            ok("check_layer_qkv packed", _C.check_layer_qkv, *qkv(q, k, k)),
            ok("check_layer_qkv batched padded", _C.check_layer_qkv, *qkv(qb, kb, kb, n=2, lens=(2,))),
            bad("check_layer_qkv C4", ValueError, "must end in", _C.check_layer_qkv, *qkv(q[:, 0], k, k)),
            bad("check_layer_qkv C5", ValueError, "key token count", _C.check_layer_qkv, *qkv(q, k[:1], k)),
            bad(
                "check_layer_qkv C8",
                ValueError,
                "batched value layout",
                _C.check_layer_qkv,
                *qkv(qb, kb, kb[:, :2]),
            ),
            bad(
                "check_layer_qkv C9",
                ValueError,
                "prepared write batch",
                _C.check_layer_qkv,
                *qkv(q, k, k, n=3),
            ),
            bad(
                "check_layer_qkv C10",
                ValueError,
                "batched Q/K/V layout",
                _C.check_layer_qkv,
                *qkv(qb, kb, kb, lens=(4,)),
            ),
            bad(
                "check_layer_qkv C11",
                ValueError,
                "supports packed",
                _C.check_layer_qkv,
                *qkv(q[None, None], k[None, None], k[None, None]),
            ),
            bad(
                "check_layer_qkv C12", ValueError, "must be on", _C.check_layer_qkv, *qkv(q, k, k, dev_type=2)
            ),
            bad(
                "check_layer_qkv C13",
                ValueError,
                "dtypes must match",
                _C.check_layer_qkv,
                *qkv(q, k.double(), k),
            ),
            bad(
                "check_layer_qkv C14",
                ValueError,
                "model activation dtype",
                _C.check_layer_qkv,
                *qkv(q, k, k, want_code=_C.DTYPE_FLOAT16, want=torch.float16),
            ),
            bad("check_layer_qkv not tensor", TypeError, "torch.Tensor", _C.check_layer_qkv, *qkv("q", k, k)),
            bad(
                "check_layer_qkv meta",
                ValueError,
                "must be on",
                _C.check_layer_qkv,
                *qkv(q.to("meta"), k, k),
                calls=SLOW_CALLS,
            ),
            bad(
                "check_layer_qkv int arg",
                TypeError,
                "num_heads must be an int",
                _C.check_layer_qkv,
                *qkv(q, k, k, heads="x"),
            ),
            bad(
                "check_layer_qkv lens",
                TypeError,
                "must be a sequence",
                _C.check_layer_qkv,
                *qkv(qb, kb, kb, lens=5),
            ),
            bad("check_layer_qkv nargs", TypeError, "takes 14 arguments", _C.check_layer_qkv, q),
        ],
    }


def _cases_batch() -> dict[str, list[Case]]:
    rb = _rows_and_bindings()
    B = rb.Binding
    nb = torch.tensor([[2, 2]], dtype=I32)
    nb_short = torch.tensor([[2, 0]], dtype=I32)

    def bind(
        rows=rb.rows, bindings=rb.bindings, threshold=None, max_tokens=8, block_sizes=(2,), cp=1, nbt=nb
    ):
        return (rows, bindings, threshold, True, 2, max_tokens, block_sizes, (1,), cp, nbt)

    decode_last = (row("a", 2, 2, sequence_id=0), row("b", 1, 2, 1, sequence_id=1))
    ri_out = torch.empty(2, dtype=I32)
    qsl_out = torch.empty(3, dtype=I32)
    sl_out = torch.empty(2, dtype=I32)
    pos_out = torch.empty(4, dtype=I64)
    seq_lens = torch.tensor([5, 3], dtype=I32)
    local = torch.empty(2, dtype=I32)
    return {
        "check_batch_rows": [
            ok("check_batch_rows ok", _C.check_batch_rows, rb.rows, False, 4),
            bad("check_batch_rows P1", ValueError, "at least one row", _C.check_batch_rows, (), False, 4),
            bad("check_batch_rows P2", RuntimeError, "active forward", _C.check_batch_rows, rb.rows, True, 4),
            bad(
                "check_batch_rows P3",
                ValueError,
                "Worker capacity is 1",
                _C.check_batch_rows,
                rb.rows,
                False,
                1,
            ),
            bad(
                "check_batch_rows P4", ValueError, "duplicate", _C.check_batch_rows, (rb.ra, rb.ra), False, 4
            ),
            bad(
                "check_batch_rows no identity",
                AttributeError,
                "identity",
                _C.check_batch_rows,
                (object(),),
                0,
                4,
            ),
            bad("check_batch_rows unsized", TypeError, "len", _C.check_batch_rows, 5, False, 4),
        ],
        "check_batch_bindings": [
            ok("check_batch_bindings ok", _C.check_batch_bindings, *bind()),
            bad(
                "check_batch_bindings count",
                ValueError,
                "one entry per row",
                _C.check_batch_bindings,
                *bind(bindings=rb.bindings[:1]),
            ),
            bad(
                "check_batch_bindings P5",
                ValueError,
                "same Worker row",
                _C.check_batch_bindings,
                *bind(bindings=(B(0, 4), B(0, 4))),
            ),
            bad(
                "check_batch_bindings P6",
                ValueError,
                "invalid logical capacity",
                _C.check_batch_bindings,
                *bind(bindings=(B(0, 4), B(1, "x"))),
            ),
            bad(
                "check_batch_bindings P7",
                ValueError,
                "logical length 1",
                _C.check_batch_bindings,
                *bind(bindings=(B(0, 4), B(1, 1))),
            ),
            bad(
                "check_batch_bindings P8",
                ValueError,
                "decode threshold=1",
                _C.check_batch_bindings,
                *bind(rows=decode_last, threshold=1),
            ),
            bad(
                "check_batch_bindings P9",
                ValueError,
                "invalid Worker row 7",
                _C.check_batch_bindings,
                *bind(bindings=(B(0, 4), B(7, 4))),
            ),
            bad(
                "check_batch_bindings P10",
                ValueError,
                "contains only 0 blocks",
                _C.check_batch_bindings,
                *bind(nbt=nb_short),
            ),
            bad(
                "check_batch_bindings P11",
                ValueError,
                "Worker capacity is 3",
                _C.check_batch_bindings,
                *bind(max_tokens=3),
            ),
            bad(
                "check_batch_bindings block_sizes",
                TypeError,
                "sequence of ints",
                _C.check_batch_bindings,
                *bind(block_sizes=("x",)),
            ),
            bad(
                "check_batch_bindings cp",
                ValueError,
                "cp_size must be positive",
                _C.check_batch_bindings,
                *bind(cp=0),
            ),
            bad(
                "check_batch_bindings num_blocks dtype",
                TypeError,
                "int32 or int64",
                _C.check_batch_bindings,
                *bind(nbt=nb.float()),
            ),
            bad(
                "check_batch_bindings num_blocks shape",
                ValueError,
                "must have shape",
                _C.check_batch_bindings,
                *bind(nbt=nb[:, :1]),
            ),
            bad(
                "check_batch_bindings no row_index",
                AttributeError,
                "row_index",
                _C.check_batch_bindings,
                *bind(bindings=(B(0, 4), object())),
            ),
        ],
        "build_batch": [
            ok("build_batch ok", _C.build_batch, rb.rows, [0, 1], ri_out, qsl_out, sl_out, pos_out),
            bad(
                "build_batch row_indices count",
                ValueError,
                "must have 2 entries",
                _C.build_batch,
                rb.rows,
                [0],
                ri_out,
                qsl_out,
                sl_out,
                pos_out,
            ),
            bad(
                "build_batch dtype",
                TypeError,
                "row_indices_out must be int32",
                _C.build_batch,
                rb.rows,
                [0, 1],
                pos_out[:2],
                qsl_out,
                sl_out,
                pos_out,
            ),
            bad(
                "build_batch positions short",
                ValueError,
                "at least 4 entries",
                _C.build_batch,
                rb.rows,
                [0, 1],
                ri_out,
                qsl_out,
                sl_out,
                pos_out[:3],
            ),
            bad(
                "build_batch int32",
                ValueError,
                "must fit int32",
                _C.build_batch,
                rb.rows,
                [0, 2**40],
                ri_out,
                qsl_out,
                sl_out,
                pos_out,
            ),
            bad(
                "build_batch rows",
                TypeError,
                "must be a sequence",
                _C.build_batch,
                5,
                [0],
                ri_out,
                qsl_out,
                sl_out,
                pos_out,
            ),
        ],
        "dcp_local_seq_lens": [
            ok("dcp_local_seq_lens ok", _C.dcp_local_seq_lens, seq_lens, local, 2, 1, 1),
            bad(
                "dcp_local_seq_lens rank",
                ValueError,
                "cp_rank in",
                _C.dcp_local_seq_lens,
                seq_lens,
                local,
                2,
                2,
                1,
            ),
            bad(
                "dcp_local_seq_lens out",
                ValueError,
                "at least 2",
                _C.dcp_local_seq_lens,
                seq_lens,
                local[:1],
                2,
                1,
                1,
            ),
            bad(
                "dcp_local_seq_lens dtype",
                TypeError,
                "seq_lens must be int32",
                _C.dcp_local_seq_lens,
                seq_lens.long(),
                local,
                2,
                1,
                1,
            ),
            bad(
                "dcp_local_seq_lens int",
                TypeError,
                "cp_size must be an int",
                _C.dcp_local_seq_lens,
                seq_lens,
                local,
                "2",
                1,
                1,
            ),
        ],
    }


def _cases_tables() -> dict[str, list[Case]]:
    table = torch.zeros(2, 4, dtype=I32)
    counts = torch.zeros(2, dtype=I32)
    _C.table_append(table, counts, 0, [1, 2], 1, 8, True)
    ids = [1, 2]
    ri = torch.tensor([0], dtype=I32)
    out = torch.zeros(2, 4, dtype=I32)
    qsl = torch.tensor([0, 2], dtype=I32)
    pos = torch.tensor([0, 1], dtype=I64)
    slots = torch.empty(4, dtype=I64)

    def slot_args(t=table, r=ri, q=qsl, p=pos, o=slots, n=2, padded=4, bs=2, cp=1, rank=0):
        return (t, r, q, p, o, n, padded, bs, cp, rank, 1)

    state = torch.zeros(1, dtype=I64)
    free_stack = torch.zeros(4, dtype=I32)
    in_use = torch.zeros(4, dtype=torch.uint8)
    _C.pool_init(state, free_stack, in_use)
    pool = (state, free_stack, in_use)

    def allocate_then_free(s, f, u, n):
        _C.pool_free(s, f, u, _C.pool_allocate(s, f, u, n))

    return {
        "table_append": [
            ok("table_append ok", _C.table_append, table, counts, 0, ids, 1, 8, True),
            bad(
                "table_append row",
                ValueError,
                "row must be in",
                _C.table_append,
                table,
                counts,
                5,
                ids,
                1,
                8,
                True,
            ),
            bad(
                "table_append id range",
                ValueError,
                "block ids must be <",
                _C.table_append,
                table,
                counts,
                0,
                [9],
                1,
                8,
                True,
            ),
            bad(
                "table_append too many",
                ValueError,
                "must fit in the 4 free",
                _C.table_append,
                table,
                counts,
                0,
                [0, 1, 2, 3, 4],
                1,
                8,
                True,
            ),
            bad(
                "table_append ids type",
                TypeError,
                "sequence",
                _C.table_append,
                table,
                counts,
                0,
                5,
                1,
                8,
                True,
            ),
            bad(
                "table_append id type",
                TypeError,
                "sequence of ints",
                _C.table_append,
                table,
                counts,
                0,
                ["a"],
                1,
                8,
                True,
            ),
            bad(
                "table_append huge id",
                ValueError,
                "fit in int64",
                _C.table_append,
                table,
                counts,
                0,
                [HUGE],
                1,
                8,
                True,
            ),
            bad(
                "table_append counts dtype",
                TypeError,
                "counts must be int32",
                _C.table_append,
                table,
                counts.long(),
                0,
                ids,
                1,
                8,
                True,
            ),
            bad("table_append nargs", TypeError, "takes 7 arguments", _C.table_append, table),
        ],
        "gather_block_tables": [
            ok("gather_block_tables ok", _C.gather_block_tables, table, counts, ri, out, 2),
            bad(
                "gather_block_tables cols",
                ValueError,
                "4 columns",
                _C.gather_block_tables,
                table,
                counts,
                ri,
                out[:, :3],
                2,
            ),
            bad(
                "gather_block_tables row",
                ValueError,
                "row_indices",
                _C.gather_block_tables,
                table,
                counts,
                torch.tensor([5], dtype=I32),
                out,
                2,
            ),
            bad(
                "gather_block_tables padded",
                ValueError,
                "num_reqs_padded",
                _C.gather_block_tables,
                table,
                counts,
                ri,
                out,
                9,
            ),
            bad(
                "gather_block_tables dtype",
                TypeError,
                "int32",
                _C.gather_block_tables,
                table,
                counts,
                ri.long(),
                out,
                2,
            ),
        ],
        "compute_slot_mappings": [
            ok("compute_slot_mappings ok", _C.compute_slot_mappings, *slot_args()),
            bad(
                "compute_slot_mappings bs",
                ValueError,
                "block_size >= 1",
                _C.compute_slot_mappings,
                *slot_args(bs=0),
            ),
            bad(
                "compute_slot_mappings out",
                ValueError,
                "num_tokens_padded",
                _C.compute_slot_mappings,
                *slot_args(padded=9),
            ),
            bad(
                "compute_slot_mappings block index",
                ValueError,
                "block index",
                _C.compute_slot_mappings,
                *slot_args(p=torch.tensor([0, 100], dtype=I64)),
            ),
            bad(
                "compute_slot_mappings end",
                ValueError,
                "must end at num_tokens",
                _C.compute_slot_mappings,
                *slot_args(q=torch.tensor([0, 1], dtype=I32)),
            ),
            bad(
                "compute_slot_mappings rank",
                ValueError,
                "cp_rank",
                _C.compute_slot_mappings,
                *slot_args(rank=1),
            ),
            bad(
                "compute_slot_mappings dtype",
                TypeError,
                "table must be int32",
                _C.compute_slot_mappings,
                *slot_args(t=table.long()),
            ),
        ],
        "pool_init": [
            ok("pool_init ok", _C.pool_init, *pool),
            bad(
                "pool_init dtype",
                TypeError,
                "state must be int64",
                _C.pool_init,
                free_stack,
                free_stack,
                in_use,
            ),
            bad(
                "pool_init size",
                ValueError,
                "in_use must have 4",
                _C.pool_init,
                state,
                free_stack,
                in_use[:2],
            ),
        ],
        "pool_allocate": [
            ok("pool_allocate zero", _C.pool_allocate, *pool, 0),
            ok("pool_allocate then free", allocate_then_free, *pool, 3),
            bad(
                "pool_allocate exhausted",
                RuntimeError,
                "at most the number of free",
                _C.pool_allocate,
                *pool,
                5,
            ),
            bad(
                "pool_allocate huge",
                RuntimeError,
                "at most the number of free",
                _C.pool_allocate,
                *pool,
                HUGE,
            ),
            bad("pool_allocate negative", ValueError, "non-negative", _C.pool_allocate, *pool, -1),
            bad("pool_allocate bool", TypeError, "n must be an int", _C.pool_allocate, *pool, True),
        ],
        "pool_free": [
            bad("pool_free range", ValueError, "must be in", _C.pool_free, *pool, [9]),
            bad("pool_free double", ValueError, "not allocated", _C.pool_free, *pool, [0]),
            bad("pool_free type", TypeError, "sequence of ints", _C.pool_free, *pool, ["x"]),
            bad("pool_free not sequence", TypeError, "sequence", _C.pool_free, *pool, 5),
            bad(
                "pool_free state",
                ValueError,
                "in_use must have",
                _C.pool_free,
                state,
                free_stack,
                in_use[:1],
                [0],
            ),
        ],
    }


def _cases_plan() -> dict[str, list[Case]]:
    spans = ([(2, 4)],)
    limits = torch.empty(4, dtype=I32)
    indices = torch.empty(4, dtype=I64)

    def plan(sp=spans, offsets=(0,), lens=(4,), seqs=(4,), kl=limits, qi=indices):
        return (sp, offsets, lens, seqs, kl, qi)

    return {
        "build_plan": [
            ok("build_plan ok", _C.build_plan, *plan()),
            ok(
                "build_plan two rows",
                _C.build_plan,
                *plan(([(1, 3)], [(1, 3)]), (0, 0), (3, 3), (3, 3), None, None),
            ),
            bad("build_plan rows", ValueError, "one entry per row", _C.build_plan, *plan(offsets=())),
            bad(
                "build_plan spans",
                ValueError,
                "Paged piecewise",
                _C.build_plan,
                *plan(sp=([(3, 4), (1, 2)],)),
            ),
            bad(
                "build_plan pair", ValueError, r"\(start, end\) pair", _C.build_plan, *plan(sp=([(1, 2, 3)],))
            ),
            bad("build_plan element", ValueError, "invalid literal", _C.build_plan, *plan(sp=([("x", 2)],))),
            bad("build_plan row type", TypeError, "must be a sequence", _C.build_plan, *plan(sp=(5,))),
            bad(
                "build_plan query range",
                ValueError,
                "query range",
                _C.build_plan,
                *plan(lens=(5,), kl=None, qi=None),
            ),
            bad("build_plan limits short", ValueError, "at least 4", _C.build_plan, *plan(kl=limits[:2])),
            bad(
                "build_plan limits dtype",
                TypeError,
                "key_limits_out must be int32",
                _C.build_plan,
                *plan(kl=indices),
            ),
        ],
    }


def _cases_tensor_ops() -> dict[str, list[Case]]:
    torch.manual_seed(0)
    q = torch.randn(2, H, D)
    key = torch.randn(2, HKV, D)
    value = torch.randn(2, HKV, D)
    cache = torch.zeros(2, NB, BS, HKV, D)
    slots = torch.tensor([4, 5], dtype=I64)
    bt = torch.tensor([[2, 0]], dtype=I32)
    bt_bad = torch.tensor([[5, 0]], dtype=I32)
    qsl = torch.tensor([0, 2], dtype=I32)
    sl = torch.tensor([2], dtype=I32)
    sl_bad = torch.tensor([5], dtype=I32)
    limits = torch.tensor([2, 2], dtype=I32)
    out = torch.empty(2, H, D)

    def attn(query=q, b=bt, s=sl, kl=None, mask=_C.MASK_NONE, scale=0.5, o=out, c=cache):
        return (query, c, b, qsl, s, kl, mask, scale, o, b, qsl, s)

    lse = torch.empty(2, H)

    def attn_lse(b=bt, s=sl, kl=None, mask=_C.MASK_NONE, o=out, lo=lse):
        return (q, cache, b, qsl, s, kl, mask, 0.5, o, lo, b, qsl, s)

    dense_k = torch.randn(3, HKV, D)
    dense_v = torch.randn(3, HKV, D)
    key_index = torch.tensor([[2, 0, 1]], dtype=I32)

    def dense(k=dense_k, v=dense_v, ki=key_index, s=sl, kl=None, mask=_C.MASK_NONE, o=out, jk=None, jv=None):
        return (q, k, v, ki, qsl, s, kl, mask, 0.5, o, None, None, None, 0, jk, jv, 1, 0)

    def fwd(k=key, v=value, sm=slots, b=bt, mask=_C.MASK_CAUSAL, kl=None):
        return (q, k, v, cache, sm, b, qsl, sl, kl, mask, 0.5, out, b, qsl, sl)

    src = torch.randn(3, H, D)
    gather_index = torch.tensor([2, 0], dtype=I64)
    gathered = torch.empty(2, H, D)
    scatter_src = torch.randn(2, H, D)
    scatter_index = torch.tensor([0, 2], dtype=I64)
    scattered = torch.empty(3, H, D)
    bad_index = torch.tensor([5, 0], dtype=I64)
    return {
        "kv_write": [
            ok("kv_write ok", _C.kv_write, key, value, cache, slots),
            ok("kv_write skip", _C.kv_write, key, value, cache, torch.tensor([-1, 4], dtype=I64)),
            bad(
                "kv_write slot",
                ValueError,
                "slot_mapping",
                _C.kv_write,
                key,
                value,
                cache,
                torch.tensor([4, 99], dtype=I64),
            ),
            bad(
                "kv_write value shape", ValueError, "shape of key", _C.kv_write, key, value[:1], cache, slots
            ),
            bad(
                "kv_write cache shape",
                ValueError,
                "kv_cache must have shape",
                _C.kv_write,
                key,
                value,
                cache[:1],
                slots,
            ),
            bad(
                "kv_write slot dtype",
                TypeError,
                "slot_mapping must be int64",
                _C.kv_write,
                key,
                value,
                cache,
                slots.int(),
            ),
            bad("kv_write slot short", ValueError, "at least 2", _C.kv_write, key, value, cache, slots[:1]),
            bad(
                "kv_write key dtype",
                TypeError,
                "key must be float32",
                _C.kv_write,
                slots.view(2, 1, 1),
                value,
                cache,
                slots,
            ),
            bad("kv_write not tensor", TypeError, "torch.Tensor", _C.kv_write, key, value, None, slots),
        ],
        "paged_attention": [
            ok("paged_attention none", _C.paged_attention, *attn()),
            ok("paged_attention causal", _C.paged_attention, *attn(mask=_C.MASK_CAUSAL)),
            ok("paged_attention limits", _C.paged_attention, *attn(kl=limits, mask=_C.MASK_LIMITS)),
            bad("paged_attention mask", ValueError, "mask must be", _C.paged_attention, *attn(mask=7)),
            bad("paged_attention scale", ValueError, "scale must be", _C.paged_attention, *attn(scale=-1.0)),
            bad("paged_attention scale type", TypeError, "str", _C.paged_attention, *attn(scale="x")),
            bad("paged_attention block id", ValueError, "block_table", _C.paged_attention, *attn(b=bt_bad)),
            bad("paged_attention seq_len", ValueError, "seq_lens", _C.paged_attention, *attn(s=sl_bad)),
            bad(
                "paged_attention out", ValueError, "out must have shape", _C.paged_attention, *attn(o=out[:1])
            ),
            bad(
                "paged_attention limits missing",
                ValueError,
                "key_limits",
                _C.paged_attention,
                *attn(mask=_C.MASK_LIMITS),
            ),
            bad(
                "paged_attention dtype",
                TypeError,
                "kv_cache must be float32",
                _C.paged_attention,
                *attn(c=cache.half()),
            ),
            bad(
                "paged_attention not tensor", TypeError, "torch.Tensor", _C.paged_attention, *attn(query=[1])
            ),
            bad("paged_attention nargs", TypeError, "takes 12 arguments", _C.paged_attention, q),
        ],
        "paged_attention_lse": [
            ok("paged_attention_lse none", _C.paged_attention_lse, *attn_lse()),
            ok("paged_attention_lse causal", _C.paged_attention_lse, *attn_lse(mask=_C.MASK_CAUSAL)),
            ok(
                "paged_attention_lse limits",
                _C.paged_attention_lse,
                *attn_lse(kl=limits, mask=_C.MASK_LIMITS),
            ),
            ok(
                "paged_attention_lse short row",
                _C.paged_attention_lse,
                *attn_lse(s=torch.tensor([1], dtype=I32), mask=_C.MASK_CAUSAL),
            ),
            bad(
                "paged_attention_lse mask",
                ValueError,
                "mask must be",
                _C.paged_attention_lse,
                *attn_lse(mask=7),
            ),
            bad(
                "paged_attention_lse limits missing",
                ValueError,
                "key_limits must be a tensor",
                _C.paged_attention_lse,
                *attn_lse(mask=_C.MASK_LIMITS),
            ),
            bad(
                "paged_attention_lse limits dtype",
                TypeError,
                "key_limits must be int32",
                _C.paged_attention_lse,
                *attn_lse(kl=slots, mask=_C.MASK_LIMITS),
            ),
            bad(
                "paged_attention_lse block id",
                ValueError,
                "block_table",
                _C.paged_attention_lse,
                *attn_lse(b=bt_bad),
            ),
            bad(
                "paged_attention_lse lse dtype",
                TypeError,
                "lse_out must be float32",
                _C.paged_attention_lse,
                *attn_lse(lo=lse.double()),
            ),
            bad(
                "paged_attention_lse lse shape",
                ValueError,
                "lse_out must have shape",
                _C.paged_attention_lse,
                *attn_lse(lo=lse[:1]),
            ),
            bad(
                "paged_attention_lse lse overlap",
                ValueError,
                "lse_out must not overlap out",
                _C.paged_attention_lse,
                *attn_lse(lo=out.view(-1)[: 2 * H].view(2, H)),
            ),
            bad(
                "paged_attention_lse not tensor",
                TypeError,
                "torch.Tensor",
                _C.paged_attention_lse,
                *attn_lse(lo=[1.0]),
            ),
            bad("paged_attention_lse nargs", TypeError, "takes 13 arguments", _C.paged_attention_lse, q),
        ],
        "dense_attention": [
            ok("dense_attention none", _C.dense_attention, *dense()),
            ok("dense_attention causal", _C.dense_attention, *dense(mask=_C.MASK_CAUSAL)),
            ok(
                "dense_attention limits, fewer keys than queries",
                _C.dense_attention,
                *dense(s=torch.tensor([1], dtype=I32), kl=limits, mask=_C.MASK_LIMITS),
            ),
            bad(
                "dense_attention key index",
                ValueError,
                "key_index",
                _C.dense_attention,
                *dense(ki=torch.tensor([[7, 0, 1]], dtype=I32)),
            ),
            bad(
                "dense_attention value strides",
                ValueError,
                "value must have the key's shape and strides",
                _C.dense_attention,
                *dense(v=torch.randn(3, HKV, 2 * D)[:, :, :D]),
            ),
            ok(
                "dense_attention joint",
                _C.dense_attention,
                *dense(ki=key_index.clamp(max=1) + 2, jk=dense_k[:2].clone(), jv=dense_v[:2].clone()),
            ),
            bad(
                "dense_attention joint strides",
                ValueError,
                "joint_key must have shape",
                _C.dense_attention,
                *dense(jk=torch.randn(2, HKV, 2 * D)[:, :, :D], jv=dense_v[:2].clone()),
            ),
            bad(
                "dense_attention joint half",
                TypeError,
                "joint_key and joint_value must both be tensors or both be None",
                _C.dense_attention,
                *dense(jk=dense_k[:2].clone()),
            ),
            bad("dense_attention nargs", TypeError, "takes 18 arguments", _C.dense_attention, q),
        ],
        "forward_paged": [
            ok("forward_paged causal", _C.forward_paged, *fwd()),
            ok("forward_paged limits", _C.forward_paged, *fwd(mask=_C.MASK_LIMITS, kl=limits)),
            bad(
                "forward_paged tokens",
                ValueError,
                "one token per query",
                _C.forward_paged,
                *fwd(k=key[:1], v=value[:1]),
            ),
            bad(
                "forward_paged slot",
                ValueError,
                "slot_mapping",
                _C.forward_paged,
                *fwd(sm=torch.tensor([4, 99], dtype=I64)),
            ),
            bad("forward_paged block id", ValueError, "block_table", _C.forward_paged, *fwd(b=bt_bad)),
            bad("forward_paged nargs", TypeError, "takes 15 arguments", _C.forward_paged, q),
        ],
        "forward_context": [
            ok("forward_context causal", _C.forward_context, fake_forward_context(fwd())),
            ok(
                "forward_context limits",
                _C.forward_context,
                fake_forward_context(fwd(mask=_C.MASK_LIMITS, kl=limits)),
            ),
            ok("forward_context no layer", _C.forward_context, fake_forward_context(fwd(), drop=("layer",))),
            bad(
                "forward_context no query",
                AttributeError,
                "query",
                _C.forward_context,
                fake_forward_context(fwd(), drop=("query",)),
            ),
            bad(
                "forward_context slot",
                ValueError,
                "slot_mapping",
                _C.forward_context,
                fake_forward_context(fwd(sm=torch.tensor([4, 99], dtype=I64))),
            ),
            bad("forward_context nargs", TypeError, "takes 1 arguments", _C.forward_context),
        ],
        "rows_gather": [
            ok("rows_gather ok", _C.rows_gather, src, gather_index, gathered),
            bad("rows_gather index", ValueError, "index", _C.rows_gather, src, bad_index, gathered),
            bad(
                "rows_gather count",
                ValueError,
                "index must have 2",
                _C.rows_gather,
                src,
                gather_index[:1],
                gathered,
            ),
            bad(
                "rows_gather dims",
                ValueError,
                "trailing dims",
                _C.rows_gather,
                src,
                gather_index,
                gathered[:, :1],
            ),
            bad(
                "rows_gather dtype",
                TypeError,
                "index must be int64",
                _C.rows_gather,
                src,
                gather_index.int(),
                gathered,
            ),
        ],
        "rows_scatter": [
            ok("rows_scatter ok", _C.rows_scatter, scatter_src, scatter_index, scattered),
            bad(
                "rows_scatter index", ValueError, "index", _C.rows_scatter, scatter_src, bad_index, scattered
            ),
            bad(
                "rows_scatter count",
                ValueError,
                "index must have 2",
                _C.rows_scatter,
                scatter_src,
                scatter_index[:1],
                scattered,
            ),
            bad(
                "rows_scatter dtype",
                TypeError,
                "dst must be float32",
                _C.rows_scatter,
                scatter_src,
                scatter_index,
                scattered.half(),
            ),
        ],
    }


def _cases_objects() -> dict[str, list[Case]]:
    context = diffkv.DiffusionPagedAttentionContext
    fields = tuple(getattr(context, f.name) for f in dataclasses.fields(context))
    t = torch.zeros(2, 1, 4)
    values = (object(), t, t, t, torch.zeros(2, dtype=torch.int64), object(), None, (), (2,), True, None)
    read_only = (property(lambda self: None),)
    return {
        "new_with_slots": [
            ok("new_with_slots context", _C.new_with_slots, context, fields, *values),
            ok("new_with_slots none", _C.new_with_slots, context, ()),
            bad(
                "new_with_slots nargs",
                TypeError,
                "arguments must be a class, a tuple of n descriptors and n values, got 3 arguments",
                _C.new_with_slots,
                context,
                fields,
                t,
            ),
            bad("new_with_slots not a class", TypeError, "__new__ creates, got 3", _C.new_with_slots, 3, ()),
            bad(
                "new_with_slots C class",
                TypeError,
                "object.__new__ creates, got <class 'torch.Tensor'>",
                _C.new_with_slots,
                torch.Tensor,
                (),
            ),
            bad(
                "new_with_slots not a descriptor",
                TypeError,
                "must be a data descriptor, got 3",
                _C.new_with_slots,
                context,
                (fields[0], 3),
                t,
                t,
            ),
            bad(
                "new_with_slots __set__ raises",
                AttributeError,
                "has no setter",
                _C.new_with_slots,
                context,
                (fields[0], *read_only),
                t,
                t,
            ),
        ],
    }


def _all_cases() -> dict[str, list[Case]]:
    cases: dict[str, list[Case]] = {}
    parts = (
        _cases_module,
        _cases_rules,
        _cases_batch,
        _cases_tables,
        _cases_plan,
        _cases_tensor_ops,
        _cases_objects,
    )
    for part in parts:
        cases.update(part())
    return cases


_ENTRY_POINTS = sorted(_all_cases())


def test_every_entry_point_has_cases():
    """The case table covers every function the extension exports."""
    exported = {
        name
        for name in dir(_C)
        if callable(getattr(_C, name)) and not name[0].isupper() and not name.startswith("_")
    }
    assert exported == set(_ENTRY_POINTS)


def _run_cases(cases: list[Case], budget: int, label: str, record_property) -> list[str]:
    """Checks and warms up every case, then runs each one's measured loop (``budget`` calls
    shared by the cases without a fixed count, or CALLS_PER_CASE each), comparing memory
    per case and over all of them."""
    shared = [c for c in cases if c.calls is None]
    for case in shared:
        case.calls = CALLS_PER_CASE or -(-budget // len(shared))
    for case in cases:
        _check_and_warm_up(case)
    problems: list[str] = []
    per_case = []
    with _gc_paused():
        start = _measure([])
        for case in cases:
            case_problems, figures = _run_case(case)
            problems += case_problems
            per_case.append((case.name, figures))
        end = _measure([])
    total = sum(figures["calls"] for _, figures in per_case)
    problems += _compare(label, [], start, end, total)
    for name, figures in per_case:
        record_property(name, figures)
    record_property(
        label,
        {
            "calls": total,
            "blocks_delta": end.blocks - start.blocks,
            "heap_delta": end.heap - start.heap,
            "rss_delta": end.rss - start.rss,
        },
    )
    return problems


def test_the_checks_catch_leaks(record_property):
    """The checks have teeth: a fake entry point that keeps one extra reference to its
    argument, one that keeps a new Python object, one that leaks a 32-byte malloc and one
    that leaks a touched 4 KiB malloc, each per call, are all reported."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    leaked_refs: list = []
    leaked_objects: list = []
    leaked_chunks: list[int] = []
    arg = torch.zeros(1)

    def keeps_reference(tensor):
        leaked_refs.append(tensor)

    def keeps_object(tensor):
        leaked_objects.append(object())

    def leaks_malloc(tensor):
        leaked_chunks.append(libc.malloc(32))

    def leaks_pages(tensor):
        chunk = libc.malloc(4096)
        ctypes.memset(chunk, 1, 4096)
        leaked_chunks.append(chunk)

    n = 4 * RSS_SLACK // 1024  # 4,096 calls: 16 MiB of pages, 192 KiB of 32-byte chunks
    try:
        for fn, expected in (
            (keeps_reference, "refcount of Tensor"),
            (keeps_object, "more live Python objects"),
            (leaks_malloc, "C heap grew"),
            # RSS grows too unless freed pages already resident are reused (after big tests).
            (leaks_pages, "C heap grew"),
        ):
            case = Case(fn.__name__, fn, (arg,), calls=n)
            problems = _run_cases([case], n, fn.__name__, record_property)
            assert any(expected in p for p in problems), (fn.__name__, problems)
            leaked_refs.clear()
            leaked_objects.clear()
    finally:
        for chunk in leaked_chunks:
            libc.free(chunk)


@pytest.mark.parametrize("name", _ENTRY_POINTS)
def test_entry_point_does_not_leak(name, record_property):
    """Every case of one entry point, CALLS calls in all: refcounts and memory flat per case
    and over the whole entry point."""
    problems = _run_cases(_all_cases()[name], CALLS, name, record_property)
    assert not problems, "\n".join(problems)


_CAPSULE_ENTRY_POINTS = [
    "tensor_info",
    "bridge_noop4",
    "build_batch",
    "gather_block_tables",
    "compute_slot_mappings",
    "build_plan",
    "kv_write",
    "paged_attention",
    "paged_attention_lse",
    "forward_paged",
    "forward_context",
    "rows_gather",
]


def test_capsule_bridge_does_not_leak(record_property):
    """The to_dlpack fallback makes and releases one capsule per tensor argument per call:
    the valid case and the first failing case of each tensor entry point, through it."""
    cases = _all_cases()
    chosen = []
    for name in _CAPSULE_ENTRY_POINTS:
        valid = next(c for c in cases[name] if c.raises is None)
        failing = next(c for c in cases[name] if c.raises is not None and c.calls is None)
        for case in (valid, failing):
            case.name = f"capsule: {case.name}"
            chosen.append(case)
    _C.set_bridge_path("capsule")
    try:
        assert _C.bridge_path(torch.zeros(1)) == "capsule"
        problems = _run_cases(chosen, CALLS * 2, "capsule path", record_property)
    finally:
        _C.set_bridge_path("auto")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# The public layer and batch paths
# ------------------------------------------------------------------------------------------------


def _public_setup():
    """Two cache groups (a causal and a non-causal layer), heads 2/1 x 64, block size 4, one
    row with a prefill (4 tokens) and a denoise (last 2 tokens) layout."""
    h = make_adapter(
        "cpu",
        groups=(("causal",), ("full",)),
        non_causal={"causal": False, "full": True},
        bindings={("req", 0, None): (0, 8)},
        max_num_reqs=2,
    )
    bindings = h.resolver.bindings

    def resolve_row(request_id, sequence_id, context_id):
        # Not the recording Resolver of _helpers: its call log grows by design.
        return bindings[(request_id, sequence_id, context_id)]

    h.adapter.resolve_row = resolve_row
    prefill = (row("req", 4, 4),)
    denoise = (row("req", 2, 4, 2),)
    metadata = diffkv.DiffusionPagedAttentionMetadata(prefill_rows=prefill, denoise_rows=denoise)
    torch.manual_seed(0)
    hd = 2 * 64
    t = SimpleNamespace(
        q=torch.randn(4, 2, 64),
        k=torch.randn(4, 1, 64),
        v=torch.randn(4, 1, 64),
        q_hidden=torch.randn(4, hd),
        k_hidden=torch.randn(4, 64),
        v_hidden=torch.randn(4, 64),
        q_padded=torch.randn(1, 5, hd),
        k_padded=torch.randn(1, 5, 64),
        v_padded=torch.randn(1, 5, 64),
        q_wrong=torch.randn(4, 3),
        q_half=torch.randn(4, 2, 64, dtype=torch.float16),
        spans=diffkv.AttentionMetadata(full_attn_spans=[[(1, 3)]]),
    )
    return h, prefill, denoise, metadata, t


def _loop_with_memory_checks(label: str, body: Callable[[], None], iterations: int, objs: list) -> dict:
    for _ in range(WARMUP):
        body()
    # Python code may make cyclic garbage legitimately: collect it before each measurement.
    gc.collect()
    before = _measure(objs)
    start = time.perf_counter()
    for _ in range(iterations):
        body()
    seconds = time.perf_counter() - start
    gc.collect()
    after = _measure(objs)
    problems = _compare(label, objs, before, after, iterations)
    assert not problems, "\n".join(problems)
    return {
        "iterations": WARMUP + iterations,
        "blocks_delta": after.blocks - before.blocks,
        "heap_delta": after.heap - before.heap,
        "rss_delta": after.rss - before.rss,
        "seconds": round(seconds, 3),
    }


def test_public_layer_path_does_not_leak(record_property):
    """prepare_layer_context + forward_paged in every mask mode and Q/K/V layout (packed
    [N, H, D], hidden [N, H*D], right-padded batched [B, T, H*D] through rows_gather /
    rows_scatter, piecewise spans), plus failing layer calls, LAYER_ITERS iterations."""
    h, prefill, _denoise, _metadata, t = _public_setup()
    adapter = h.adapter
    causal = h.layers["causal"]
    full = h.layers["full"]
    batch = adapter.prepare_batch(prefill)
    state = [0]

    def body() -> None:
        i = state[0] = (state[0] + 1) % 6
        if i == 0:
            ctx = adapter.prepare_layer_context("causal", t.q, t.k, t.v)
            causal.impl.forward_paged(ctx)
        elif i == 1:
            ctx = adapter.prepare_layer_context("full", t.q_hidden, t.k_hidden, t.v_hidden)
            full.impl.forward_paged(ctx)
        elif i == 2:
            ctx = adapter.prepare_layer_context("causal", t.q, t.k, t.v, omni_attn_metadata=t.spans)
            causal.impl.forward_paged(ctx)
        elif i == 3:
            ctx = adapter.prepare_layer_context("full", t.q_padded, t.k_padded, t.v_padded)
            full.impl.forward_paged(ctx)
        elif i == 4:
            try:
                adapter.prepare_layer_context("causal", t.q_wrong, t.k, t.v)
            except ValueError:
                pass
        else:
            try:
                adapter.prepare_layer_context("full", t.q_half, t.k, t.v)
            except ValueError:
                pass

    objs = _tracked((adapter, causal, full, batch, prefill, h.block_tables, h.adapter.resolve_row, t.spans))
    objs += list(vars(t).values()) + list(h.caches.values())
    with adapter.activate(batch):
        figures = _loop_with_memory_checks("layer path", body, LAYER_ITERS, objs)
    record_property("layer path", figures)


def test_public_batch_path_does_not_leak(record_property):
    """prepare_batch + activate (directly and through DiffusionPagedAttentionRuntime) with
    one layer call each, plus failing preparations (P7, P2), BATCH_ITERS iterations."""
    h, prefill, denoise, metadata, t = _public_setup()
    adapter = h.adapter
    causal = h.layers["causal"]
    too_long = (row("req", 9, 9),)
    state = [0]

    def body() -> None:
        i = state[0] = (state[0] + 1) % 4
        if i == 0:
            batch = adapter.prepare_batch(prefill)
            with adapter.activate(batch):
                causal.impl.forward_paged(adapter.prepare_layer_context("causal", t.q, t.k, t.v))
        elif i == 1:
            runtime = diffkv.DiffusionPagedAttentionRuntime(adapter, metadata)
            with runtime.activate():
                runtime.ensure_active(0)
                runtime.ensure_active(1)
                ctx = adapter.prepare_layer_context("causal", t.q[2:], t.k[2:], t.v[2:])
                causal.impl.forward_paged(ctx)
        elif i == 2:
            try:
                adapter.prepare_batch(too_long)
            except ValueError:
                pass
        else:
            batch = adapter.prepare_batch(denoise)
            with adapter.activate(batch):
                try:
                    adapter.prepare_batch(denoise)
                except RuntimeError:
                    pass

    objs = _tracked(
        (adapter, causal, prefill, denoise, too_long, metadata, h.block_tables, h.adapter.resolve_row)
    )
    objs += list(vars(t).values()) + list(h.caches.values())
    figures = _loop_with_memory_checks("batch path", body, BATCH_ITERS, objs)
    record_property("batch path", figures)
