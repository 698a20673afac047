"""No leaks: every ``diffkv._C`` entry point and the public layer path, called many times.

Each entry point (every function ``_C`` exports) has its cases in the shared table of
``error_cases.py``: valid calls and failing calls, one per kind of error path (argument count,
not a tensor, wrong dtype / rank / shape, each of vLLM-Omni's adapter rules, each error the C
core returns).  A case's arguments are created once; every case is checked once (it succeeds,
or raises the expected exception with the expected full message) and warmed up (up to
``WARMUP`` = 1,000 calls); then the cases of one
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

The failing cases of every public entry point (``error_cases.public_cases``: the adapter's
methods and the standalone collaborators -- rows, request metadata, the piecewise planner,
the runtime, configs, BlockTables, BlockPool, KV cache allocation, DiffKVAttentionImpl) share
``PUBLIC_CALLS`` = 10,000 calls per entry point, with the same checks.

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
from _helpers import make_adapter, row
from diffkv import _C
from error_cases import Case, all_cases, check, public_cases


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


def _shared_singleton(obj: Any) -> bool:
    return obj is None or type(obj) is bool or (type(obj) is int and -5 <= obj <= 256)


def _tracked(args: tuple) -> list:
    """Every object reachable from the arguments through tuples, lists, dicts and dataclass
    fields (deduplicated by identity), the arguments themselves included -- except the
    interpreter's shared singletons (None, the bools, the cached small ints -5..256), whose
    reference counts belong to the whole interpreter: Python code on a public path (a cache
    filling as it warms up, a traceback's frames) moves them by a bounded amount unrelated to
    the call, and a reference kept to one of them leaks no memory."""
    seen: dict[int, Any] = {}
    stack = list(args)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or _shared_singleton(obj):
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
    check(case)
    _loop(case, min(WARMUP, case.calls // 5))


def _run_case(case: Case, collect: bool = False) -> tuple[list[str], dict]:
    """The measured loop of one (checked, warmed-up) case.  Returns (problems, figures).
    ``collect``: a garbage collection before each measurement (Python code that makes cyclic
    garbage legitimately: an exception raised through a context manager)."""
    objs = _tracked(case.args) + [case.fn]
    if collect:
        gc.collect()
    before = _measure(objs)
    start = time.perf_counter()
    _loop(case, case.calls)
    seconds = time.perf_counter() - start
    if collect:
        gc.collect()
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


_ENTRY_POINTS = sorted(all_cases())


def test_every_entry_point_has_cases():
    """The case table covers every function the extension exports."""
    exported = {
        name
        for name in dir(_C)
        if callable(getattr(_C, name)) and not name[0].isupper() and not name.startswith("_")
    }
    assert exported == set(_ENTRY_POINTS)


def _run_cases(
    cases: list[Case], budget: int, label: str, record_property, collect: bool = False
) -> list[str]:
    """Checks and warms up every case, then runs each one's measured loop (``budget`` calls
    shared by the cases without a fixed count, or CALLS_PER_CASE each), comparing memory
    per case and over all of them."""
    for case in cases:
        if case.slow and case.calls is None:
            case.calls = SLOW_CALLS
    shared = [c for c in cases if c.calls is None]
    for case in shared:
        case.calls = CALLS_PER_CASE or -(-budget // len(shared))
    for case in cases:
        _check_and_warm_up(case)
    problems: list[str] = []
    per_case = []
    with contextlib.nullcontext() if collect else _gc_paused():
        if collect:
            gc.collect()
        start = _measure([])
        for case in cases:
            case_problems, figures = _run_case(case, collect)
            problems += case_problems
            per_case.append((case.name, figures))
        if collect:
            gc.collect()
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
    problems = _run_cases(all_cases()[name], CALLS, name, record_property)
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
    "rows_gather",
]


def test_capsule_bridge_does_not_leak(record_property):
    """The to_dlpack fallback makes and releases one capsule per tensor argument per call:
    the valid case and the first failing case of each tensor entry point, through it."""
    cases = all_cases()
    chosen = []
    for name in _CAPSULE_ENTRY_POINTS:
        valid = next(c for c in cases[name] if c.raises is None)
        failing = next(c for c in cases[name] if c.raises is not None and not c.slow)
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


_PUBLIC_ENTRY_POINTS = sorted(public_cases())
PUBLIC_CALLS = 10_000 // SCALE  # calls per public entry point, shared by its cases


# Public entry points whose failing calls make no cyclic garbage: measured with the cycle
# collector paused, like the _C entry points (stricter, and two collections per case fewer).
_ACYCLIC_PUBLIC = {
    "AttentionSpec",
    "BlockPool",
    "BlockPool methods",
    "BlockTables methods",
    "DiffKVAttentionImpl",
    "DiffusionPagedAttentionMetadata",
    "DiffusionPagedAttentionMetadata.rows_for_step",
    "DiffusionPagedAttentionRow",
    "allocate_kv_caches",
    "build_paged_piecewise_plan",
    "cache groups",
    "configs",
    "metadata builders",
}


@pytest.mark.parametrize("name", _PUBLIC_ENTRY_POINTS)
def test_public_entry_point_does_not_leak(name, record_property):
    """Every failing case of one public entry point (error_cases.public_cases: each checked
    for its type and full message first), PUBLIC_CALLS calls in all: refcounts and memory flat
    per case and over the entry point (the cycle collector running, one collection before
    each measurement, unless the entry point is in _ACYCLIC_PUBLIC: an exception raised
    through a context manager, or out of a half-built object, makes cyclic garbage)."""
    cases = public_cases()[name]
    collect = name not in _ACYCLIC_PUBLIC
    problems = _run_cases(cases, PUBLIC_CALLS, f"public {name}", record_property, collect=collect)
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
    one layer call each, plus failing preparations (a row over its capacity, a batch prepared during an active
    forward), BATCH_ITERS iterations."""
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
