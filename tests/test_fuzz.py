"""Property-based fuzzing of every diffkv._C entry point and the public methods built on them.

Every call with hostile arguments (wrong types, None, bools for ints, ints beyond int64,
NaN/inf, wrong dtype/device/rank/shape, empty and zero-stride "huge" tensors, non-contiguous
and overlapping views, outputs aliasing inputs, block ids beyond the cache, slots beyond it,
malformed spans, rows longer than their blocks) must end in an exception of an expected type
or in a correct result, never in a crash (the test process would die), a hang (faulthandler
ends the run) or a silent wrong answer; after a failed call every tensor it was given (KV
caches, block tables, pool state) is bit-identical to before.

Profiles (``DIFFKV_FUZZ_PROFILE``): ``ci`` (default; derandomized, bounded example counts, the
whole file in well under a minute on two cores) and ``long`` (20x the examples, random seeds)
for ``make fuzz``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import re
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import diffkv
from _helpers import HEAD_SIZE, make_adapter
from diffkv import _C
from error_cases import ACTIVE_FORWARD_INVALIDATE, STALE_BATCH, check, error_cases, public_error_cases
from fuzz_strategies import (
    AttentionProblem,
    attention_problems,
    hostile_ints,
    hostile_objects,
    hostile_tensors,
    table_problems,
)
from reference import (
    dense_kv_from_cache,
    key_limits_for_spans,
    mask_causal,
    mask_key_limits,
    mask_none,
    ref_attention,
)

_CI_EXAMPLES = 40
settings.register_profile(
    "ci",
    max_examples=_CI_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile(
    "long",
    max_examples=20 * _CI_EXAMPLES,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
_PROFILE = os.environ.get("DIFFKV_FUZZ_PROFILE", "ci")
settings.load_profile(_PROFILE)
FUZZ = settings(settings.get_profile(_PROFILE))

# Exception types a hostile call may end in.  AttributeError only where the argument is a
# foreign object that lacks an attribute vLLM-Omni's adapter's duck typing reads.
ALLOWED = (TypeError, ValueError, KeyError, RuntimeError, NotImplementedError, IndexError)
HANG_SECONDS = 120

# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_hang() -> Iterator[None]:
    """A call that does not return in HANG_SECONDS ends the test process with a traceback."""
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _tensors_in(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors_in(item, out)
    elif isinstance(value, dict):  # the keywords of a public case
        for item in value.values():
            _tensors_in(item, out)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().contiguous().reshape(-1).view(torch.uint8)


def _snapshottable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and 0 < t.numel() <= 1 << 16


class Snapshot:
    """Bit copies of every (small, CPU, strided) tensor among `values`."""

    def __init__(self, values: Sequence[Any], skip: Sequence[int] = ()) -> None:
        found: list[torch.Tensor] = []
        for i, value in enumerate(values):
            if i not in skip:
                _tensors_in(value, found)
        self.items = [(t, _bits(t)) for t in found if _snapshottable(t)]

    def assert_unchanged(self) -> None:
        for t, bits in self.items:
            assert torch.equal(_bits(t), bits), "a failed call changed a tensor it was given"


def call(fn: Callable[..., Any], *args: Any, allowed: tuple = ALLOWED) -> tuple[bool, Any]:
    """(True, result) or (False, exception); any other exception type fails the test."""
    with no_hang():
        try:
            return True, fn(*args)
        except allowed as exc:
            return False, exc


def expect_error(fn: Callable[..., Any], args: Sequence[Any], exc_type: type, pattern: str | None) -> None:
    """fn(*args) must raise exc_type (message matching `pattern`) and change no tensor."""
    snap = Snapshot(args)
    with no_hang(), pytest.raises(exc_type) as info:
        fn(*args)
    if pattern is not None:
        assert re.search(pattern, str(info.value)), str(info.value)
    snap.assert_unchanged()


def overlapping(a: torch.Tensor, b: torch.Tensor, shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one byte buffer shaped like `a` and `b` whose byte ranges overlap (b starts
    `shift` bytes into a), holding a's values (b's region then partly a's)."""
    na = a.numel() * a.element_size()
    nb = b.numel() * b.element_size()
    shift %= max(na, 1)
    shift -= shift % 8
    buf = torch.zeros(max(na, shift + nb) + 8, dtype=torch.uint8)
    b2 = buf[shift : shift + nb].view(b.dtype).view(b.shape)
    b2.copy_(b)
    a2 = buf[:na].view(a.dtype).view(a.shape)
    a2.copy_(a)
    return a2, b2


# ------------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------------


def ref_kv_write(p: AttentionProblem) -> torch.Tensor:
    """The cache after p's KV write (later tokens with the same slot win)."""
    cache = p.kv_cache.clone()
    block_size = cache.shape[2]
    for t, slot in enumerate(p.slot_mapping.tolist()):
        if slot >= 0:
            cache[0, slot // block_size, slot % block_size] = p.key[t]
            cache[1, slot // block_size, slot % block_size] = p.value[t]
    return cache


def _visible_per_row(p: AttentionProblem) -> list[torch.Tensor]:
    """p's mask per row as bool [query_len, seq_len]: every key, bottom-right causal, or the
    per-token key limits."""
    qsl = p.query_start_loc.tolist()
    masks = []
    for r, seq_len in enumerate(p.seq_lens.tolist()):
        query_len = qsl[r + 1] - qsl[r]
        if p.mask == 0:
            masks.append(mask_none(range(query_len), seq_len))
        elif p.mask == 1:
            masks.append(mask_causal(range(seq_len - query_len, seq_len), seq_len))
        else:
            masks.append(mask_key_limits(p.key_limits[qsl[r] : qsl[r + 1]], seq_len))
    return masks


def ref_paged_attention(p: AttentionProblem, cache: torch.Tensor, lse: bool = False) -> Any:
    """float64 [N, H, D] reference of p's attention over `cache` (with lse: also the float64
    [N, H] log-sum-exp, -inf where a token sees no key)."""
    qsl = p.query_start_loc.tolist()
    out = torch.zeros(p.query.shape, dtype=torch.float64)
    out_lse = torch.full(p.query.shape[:2], float("-inf"), dtype=torch.float64)
    for r, (seq_len, visible) in enumerate(zip(p.seq_lens.tolist(), _visible_per_row(p), strict=True)):
        k, v = dense_kv_from_cache(cache, p.block_table[r], seq_len)
        rows = slice(qsl[r], qsl[r + 1])
        out[rows], out_lse[rows] = ref_attention(p.query[rows], k, v, visible, p.scale, lse=True)
    return (out, out_lse) if lse else out


_ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def assert_close_attention(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.allclose(actual.double(), expected, atol=_ATOL[actual.dtype], rtol=_ATOL[actual.dtype])


def ref_slots(p: Any, table: torch.Tensor) -> list[int]:
    """vLLM's slot rule for every token of p's batch."""
    span = p.block_size * p.cp_size
    qsl = p.query_start_loc.tolist()
    out = []
    for i, row in enumerate(p.row_indices.tolist()):
        for t in range(qsl[i], qsl[i + 1]):
            pos = int(p.positions[t])
            phys = int(table[row, pos // span])
            off = pos % span
            if p.cp_size == 1:
                out.append(phys * p.block_size + off)
            elif (off // p.cp_interleave) % p.cp_size == p.cp_rank:
                local = (off // (p.cp_interleave * p.cp_size)) * p.cp_interleave + off % p.cp_interleave
                out.append(phys * p.block_size + local)
            else:
                out.append(-1)
    return out


# ------------------------------------------------------------------------------------------------
# Every entry point, with a valid call to corrupt
# ------------------------------------------------------------------------------------------------


def _row(**kw: Any) -> diffkv.DiffusionPagedAttentionRow:
    fields = {"request_id": "r", "query_len": 4, "seq_len": 4, "kv_start_pos": 0, "sequence_id": 0}
    fields.update(kw)
    return diffkv.DiffusionPagedAttentionRow(**fields)


def _small_problem() -> AttentionProblem:
    block_table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    return AttentionProblem(
        query=torch.randn(5, 2, 4),
        key=torch.randn(5, 1, 4),
        value=torch.randn(5, 1, 4),
        kv_cache=torch.randn(2, 5, 2, 1, 4),
        slot_mapping=torch.tensor([4, 5, 0, 2, 3], dtype=torch.int64),
        block_table=block_table,
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        seq_lens=torch.tensor([3, 4], dtype=torch.int32),
        key_limits=torch.tensor([1, 3, 1, 2, 4], dtype=torch.int32),
        mask=2,
        scale=0.5,
        out=torch.zeros(5, 2, 4),
    )


def _lse_args(p: AttentionProblem) -> list[Any]:
    """The 13 arguments of _C.paged_attention_lse: paged_attention's with lse_out after out."""
    a = p.attention_args()
    return [*a[:9], torch.zeros(p.query.shape[0], p.query.shape[1]), *a[9:]]


def _dense_args() -> list[Any]:
    """The 18 arguments of _C.dense_attention: two rows over 5 key tokens and 2 joint tokens
    (key indices 5 and 6; row 1 with fewer keys than queries), limits mask."""
    return [
        torch.randn(5, 2, 4),
        torch.randn(5, 1, 4),
        torch.randn(5, 1, 4),
        torch.tensor([[4, 6, 2], [1, 5, 0]], dtype=torch.int32),
        torch.tensor([0, 2, 5], dtype=torch.int32),
        torch.tensor([3, 2], dtype=torch.int32),
        torch.tensor([1, 3, 1, 2, 0], dtype=torch.int32),
        2,
        0.5,
        torch.zeros(5, 2, 4),
        None,
        None,
        None,
        0,
        torch.randn(2, 1, 4),
        torch.randn(2, 1, 4),
        1,
        0,
    ]


def _quantize_args() -> list[Any]:
    """The 9 arguments of _C.quantize_kv: 5 key tokens and 2 joint tokens, 1 kv head of 4."""
    f8 = torch.float8_e4m3fn
    return [
        torch.randn(5, 1, 4),
        torch.randn(5, 1, 4),
        torch.zeros(5, 1, 4, dtype=f8),
        torch.zeros(5, 1, 4, dtype=f8),
        torch.zeros(2),
        torch.randn(2, 1, 4),
        torch.randn(2, 1, 4),
        torch.zeros(2, 1, 4, dtype=f8),
        torch.zeros(2, 1, 4, dtype=f8),
    ]


def _pool_state(allocated: int = 2) -> list[torch.Tensor]:
    state = [
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(6, dtype=torch.int32),
        torch.zeros(6, dtype=torch.uint8),
    ]
    _C.pool_init(*state)
    _C.pool_allocate(*state, allocated)
    return state


def _valid_calls() -> dict[str, tuple[list[Any], tuple[int, ...]]]:
    """name -> (valid arguments, indices of scratch outputs that a failed call may change)."""
    t = torch.zeros(2, 3)
    row = _row()
    p = _small_problem()
    table = torch.tensor([[3, 4, 0], [1, 0, 0]], dtype=torch.int32)
    counts = torch.tensor([2, 1], dtype=torch.int32)
    binding = diffkv.DiffusionPagedAttentionRowBinding(row_index=0, max_seq_len=4)
    return {
        "set_bridge_path": (["auto"], ()),
        "set_attention_kernel": (["auto"], ()),
        "supported_head_sizes": (["cpu", "float16", "auto"], ()),
        "bridge_path": ([t], ()),
        "tensor_info": ([t], ()),
        "bridge_noop4": ([t, t, t, t], ()),
        "cuda_compiled": ([], ()),
        "build_info": ([], ()),
        "driver_check": ([12080, 13000], ()),
        "last_attention_kernel": ([], ()),
        "check_row": (["r", 4, 4, 0, 0, None], ()),
        "check_metadata": ([(row,), (row,)], ()),
        "check_step": ([0], ()),
        "check_layer_heads": ([1, 4, 2], ()),
        "check_head_sizes": ([8, 8], ()),
        "check_layer_qkv": (
            [
                torch.zeros(4, 2, 8),
                torch.zeros(4, 1, 8),
                torch.zeros(4, 1, 8),
                2,
                1,
                8,
                8,
                1,
                0,
                torch.device("cpu"),
                _C.DTYPE_FLOAT32,
                torch.float32,
                4,
                (4,),
            ],
            (),
        ),
        "check_batch_rows": ([(row,), False, 4], ()),
        "check_batch_bindings": (
            [
                (row,),
                (binding,),
                None,
                True,
                4,
                64,
                [4],
                [1],
                1,
                torch.tensor([[1, 0, 0, 0]], dtype=torch.int32),
            ],
            (),
        ),
        "build_batch": (
            [
                (row,),
                [0],
                torch.zeros(1, dtype=torch.int32),
                torch.zeros(2, dtype=torch.int32),
                torch.zeros(1, dtype=torch.int32),
                torch.zeros(4, dtype=torch.int64),
            ],
            (2, 3, 4, 5),
        ),
        "dcp_local_seq_lens": (
            [torch.tensor([5, 9], dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 2, 1, 2],
            (),
        ),
        "table_append": ([table, counts, 1, [1, 2], 1, 0, False], ()),
        "gather_block_tables": (
            [table, counts, torch.tensor([1, 0], dtype=torch.int32), torch.zeros(3, 3, dtype=torch.int32), 3],
            (),
        ),
        "compute_slot_mappings": (
            [
                table,
                torch.tensor([1, 0], dtype=torch.int32),
                torch.tensor([0, 1, 3], dtype=torch.int32),
                torch.tensor([0, 5, 7], dtype=torch.int64),
                torch.zeros(4, dtype=torch.int64),
                3,
                4,
                4,
                1,
                0,
                1,
            ],
            (),
        ),
        "pool_init": (_pool_state(0), ()),
        "pool_allocate": ([*_pool_state(), 2], ()),
        "pool_free": ([*_pool_state(), [0]], ()),
        "build_plan": (
            [[[(0, 2)]], [0], [4], [4], torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)],
            (),
        ),
        "kv_write": (p.kv_write_args(), ()),
        "paged_attention": (p.attention_args(), ()),
        "paged_attention_lse": (_lse_args(p), ()),
        "dense_attention": (_dense_args(), ()),
        "quantize_kv": (_quantize_args(), ()),
        "forward_paged": (p.forward_args(), ()),
        "rows_gather": (
            [torch.randn(4, 2, 3), torch.tensor([3, 0], dtype=torch.int64), torch.zeros(2, 2, 3)],
            (),
        ),
        "rows_scatter": (
            [torch.randn(2, 2, 3), torch.tensor([3, 0], dtype=torch.int64), torch.zeros(4, 2, 3)],
            (),
        ),
        "new_with_slots": (
            [
                diffkv.DiffusionPagedAttentionContext,
                tuple(
                    getattr(diffkv.DiffusionPagedAttentionContext, f.name)
                    for f in dataclasses.fields(diffkv.DiffusionPagedAttentionContext)
                ),
                *(t, t, t, t, t, None, None, (), (2,), False, None),
            ],
            (),
        ),
    }


# Entry points that read attributes of row / binding objects (row.identity, row.query_len,
# binding.row_index), as vLLM-Omni's adapter does: a foreign object there raises AttributeError.
_DUCK_TYPED = ("check_metadata", "check_batch_rows", "check_batch_bindings", "build_batch")
# Entry points that keep vLLM-Omni's adapter's Python arithmetic on the objects they are given (comparisons,
# `%`, int()): a foreign object or float there may raise OverflowError (int(inf), a huge int
# compared with a tensor), as in vLLM-Omni's adapter.
_PYTHON_ARITHMETIC = ("check_head_sizes", "check_layer_heads", "check_batch_rows", "build_plan")

# configure() is fuzzed on its own below: it replaces module state.
FUZZED_ENTRY_POINTS = sorted(["configure", *_valid_calls()])


def test_every_entry_point_is_fuzzed():
    """A new _C function must be added to the fuzz table."""
    names = {
        name
        for name in dir(_C)
        if not name.startswith("_") and callable(getattr(_C, name)) and name != "CudaError"
    }
    assert names == set(FUZZED_ENTRY_POINTS)


def test_valid_calls_succeed():
    """The baseline of every corruption below is a call that works."""
    for name, (args, _) in _valid_calls().items():
        with no_hang():
            getattr(_C, name)(*args)


@FUZZ
@given(data=st.data())
def test_hostile_argument_any_entry_point(data):
    """Any entry point, one to three argument slots replaced by hostile values (or the wrong
    number of arguments): an allowed exception or success, and nothing changed on failure."""
    calls = _valid_calls()
    name = data.draw(st.sampled_from(sorted(calls)))
    args, scratch = calls[name]
    args = list(args)
    if not args or data.draw(st.integers(0, 9)) == 0:
        args = args + [None] if data.draw(st.booleans()) or not args else args[:-1]
    else:
        for _ in range(data.draw(st.integers(1, 3))):
            args[data.draw(st.integers(0, len(args) - 1))] = data.draw(hostile_objects())
    snap = Snapshot(args, skip=scratch)
    allowed = (
        ALLOWED + (AttributeError,) * (name in _DUCK_TYPED) + (OverflowError,) * (name in _PYTHON_ARITHMETIC)
    )
    choice = _C.set_attention_kernel("auto")
    try:
        ok, result = call(getattr(_C, name), *args, allowed=allowed)
    finally:
        _C.set_bridge_path("auto")
        _C.set_attention_kernel(choice)
    if not ok:
        snap.assert_unchanged()
        assert str(result), "an exception without a message"


# configure()'s num_threads: anything, or a callable returning a count or a bad one
_THREAD_COUNTS = (torch.get_num_threads, lambda: 1, lambda: 3, lambda: 0, lambda: -2, lambda: 2**70,
                  lambda: -(2**70), lambda: 2.0, lambda: "4", lambda: None)  # fmt: skip


@FUZZ
@given(
    to_dlpack=hostile_objects(),
    getter=hostile_objects(),
    num_threads=st.one_of(hostile_objects(), st.sampled_from(_THREAD_COUNTS)),
    tensor=hostile_tensors(),
)
def test_configure_hostile(to_dlpack, getter, num_threads, tensor):
    """configure() takes any objects; a later call on the capsule path then fails cleanly, and a
    CPU attention call (which asks num_threads) and a CPU layer call (which asks it before its KV
    write) either run or fail having written nothing."""
    try:
        _C.configure(to_dlpack, getter, num_threads)
        for name in ("paged_attention", "forward_paged"):
            args = _valid_calls()[name][0]
            snap = Snapshot(args)
            ok, exc = call(getattr(_C, name), *args)
            if not ok:
                assert str(exc), "an exception without a message"
                snap.assert_unchanged()
        _C.set_bridge_path("capsule")
        ok, exc = call(_C.tensor_info, tensor)
        assert ok or str(exc)
    finally:
        _C.set_bridge_path("auto")
        diffkv._configure_bridge()
    assert _C.tensor_info(torch.zeros(2))["shape"] == (2,)


@FUZZ
@given(path=hostile_objects())
def test_set_bridge_path_hostile(path):
    try:
        ok, exc = call(_C.set_bridge_path, path)
        if not ok and type(exc) is ValueError:
            assert "set_bridge_path(): path must be 'auto' or 'capsule'" in str(exc)
        elif ok:
            assert type(path) is str and path in ("auto", "capsule")
    finally:
        _C.set_bridge_path("auto")


@FUZZ
@given(kernel=hostile_objects())
def test_set_attention_kernel_hostile(kernel):
    choice = _C.set_attention_kernel("auto")
    try:
        ok, result = call(_C.set_attention_kernel, kernel)
        if not ok and type(result) is ValueError:
            assert "set_attention_kernel(): kernel must be 'auto', 'sm90' or 'sm80'" in str(result)
        elif ok:
            assert type(kernel) is str and kernel in ("auto", "sm90", "sm80") and result == "auto"
    finally:
        _C.set_attention_kernel(choice)


# ------------------------------------------------------------------------------------------------
# Paged attention, forward_paged, kv_write
# ------------------------------------------------------------------------------------------------


@FUZZ
@given(p=attention_problems())
def test_attention_and_kv_write_correct(p):
    """Valid problems: kv_write and paged_attention match the references; forward_paged is
    the two in one call."""
    expected_cache = ref_kv_write(p)
    cache_before = p.kv_cache.clone()
    with no_hang():
        _C.paged_attention(*p.attention_args())
    assert torch.equal(p.kv_cache, cache_before), "paged_attention wrote the cache"
    assert_close_attention(p.out, ref_paged_attention(p, cache_before))
    p.out.fill_(3.0)
    with no_hang():
        _C.forward_paged(*p.forward_args())
    assert torch.equal(p.kv_cache, expected_cache)
    assert_close_attention(p.out, ref_paged_attention(p, expected_cache))
    p.kv_cache.copy_(cache_before)
    with no_hang():
        _C.kv_write(*p.kv_write_args())
    assert torch.equal(p.kv_cache, expected_cache)


_FP8_REL = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _fp32_score_bound(p: AttentionProblem, cache: torch.Tensor) -> float:
    """What fp32 scores can move the output by: a score q.k * scale over D dims carries up to
    (D + 2) rounding errors of 2^-24 of scale * sum |q_d k_d| (the dequantized k_d = e4m3 *
    k_scale included), and scores off by at most e move softmax weights by a factor within
    exp(+-2e), so the output by at most 2e max|v|.  Negligible on the unit-scale data of the
    other tests; here the cache holds e4m3 values up to 448 times scales up to 10, where scores
    of ~10^4 make it the larger term (an fp32 example failed the relative bound alone)."""
    d = p.query.shape[-1]
    q = p.query.double().abs().reshape(-1, d)
    k = cache[0].abs().reshape(-1, d)
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    smax = p.scale * (q @ k.T).max().item()
    return 2.0 * (d + 2) * 2.0**-24 * smax * cache[1].abs().max().item()


@FUZZ
@given(p=attention_problems(), per_head=st.booleans(), data=st.data())
def test_fp8_cache_write_and_attention_correct(p, per_head, data):
    """A float8_e4m3fn cache of the problem's shape and strides, random per-tensor or per-head
    scales: kv_write stores torch's bytes; paged_attention matches float64 over the dequantized
    cache (e4m3 * scale) up to the output's rounding; forward_paged is the two in one call."""
    fp8 = torch.float8_e4m3fn
    heads = p.kv_cache.shape[3] if per_head else 1
    draw_scales = st.lists(st.floats(0.0009765625, 10.0, width=32), min_size=heads, max_size=heads)
    k_scale = torch.tensor(data.draw(draw_scales), dtype=torch.float32)
    v_scale = torch.tensor(data.draw(draw_scales), dtype=torch.float32)
    cache = torch.empty_strided(p.kv_cache.shape, p.kv_cache.stride(), dtype=fp8)
    cache.copy_((p.kv_cache.float().nan_to_num(0.0) * 20).clamp(-448, 448).to(fp8))
    before = cache.clone()
    expected = cache.clone()
    block_size = cache.shape[2]
    for t, slot in enumerate(p.slot_mapping.tolist()):
        if slot >= 0:
            for i, (x, scale) in enumerate(((p.key, k_scale), (p.value, v_scale))):
                quantized = (x[t].float() / scale.view(-1, 1)).clamp(-448, 448).to(fp8)
                expected[i, slot // block_size, slot % block_size] = quantized
    with no_hang():
        _C.kv_write(p.key, p.value, cache, p.slot_mapping, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    args = p.attention_args()
    args[1] = cache
    with no_hang():
        _C.paged_attention(*args, k_scale, v_scale)
    dequantized = cache.double()
    dequantized[0] *= k_scale.double().view(-1, 1)
    dequantized[1] *= v_scale.double().view(-1, 1)
    exact = ref_paged_attention(p, dequantized)
    if exact.numel():
        err = (p.out.double() - exact).abs().max().item()
        bound = _FP8_REL[p.query.dtype] * exact.abs().max().item() + _fp32_score_bound(p, dequantized)
        assert err <= bound + 1e-6
    separate = p.out.clone()
    cache.copy_(before)
    p.out.fill_(3.0)
    args = p.forward_args()
    args[3] = cache
    with no_hang():
        _C.forward_paged(*args, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(p.out, separate)


@FUZZ
@given(p=attention_problems())
def test_attention_lse_correct(p):
    """Valid problems: paged_attention_lse gives paged_attention's output bit for bit and the
    float64 log-sum-exp (-inf exactly where a token sees no key)."""
    args = _lse_args(p)
    with no_hang():
        _C.paged_attention(*p.attention_args())
    expected_out = p.out.clone()
    p.out.fill_(3.0)
    with no_hang():
        _C.paged_attention_lse(*args)
    assert torch.equal(p.out, expected_out)
    lse, expected = args[9], ref_paged_attention(p, p.kv_cache, lse=True)[1]
    blind = torch.isinf(expected)
    assert torch.equal(torch.isinf(lse), blind) and (lse[blind] < 0).all()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}[p.query.dtype]
    assert torch.allclose(lse[~blind].double(), expected[~blind], atol=tol, rtol=tol)


def test_table_error_cases_change_nothing():
    """The explicit examples next to the random ones: every failing case of the shared table
    (error_cases.py) raises its exception with its full message, twice in a row, and changes no
    tensor it was given (outputs the entry point may fill before it fails aside)."""
    scratch = {name: slots for name, (_, slots) in _valid_calls().items()}
    for entry, case in error_cases():
        snap = Snapshot(case.args, skip=scratch.get(entry, ()))
        for _ in range(2):
            with no_hang():
                check(case)
        snap.assert_unchanged()


def test_public_table_error_cases_change_nothing():
    """The public entry points' failing cases (error_cases.public_cases), twice in a row: each
    raises its exception with its full message and changes no tensor it was given."""
    for _entry, case in public_error_cases():
        snap = Snapshot(case.args)
        for _ in range(2):
            with no_hang():
                check(case)
        snap.assert_unchanged()


def _reachable(p: AttentionProblem) -> list[tuple[int, int]]:
    bs = p.kv_cache.shape[2]
    return [(r, b) for r, s in enumerate(p.seq_lens.tolist()) for b in range(-(-s // bs))]


# name -> (mutate(problem, data) -> (args of paged_attention or None to skip), error, pattern)
def _attention_mutation(p: AttentionProblem, data: st.DataObject, which: str) -> tuple[list, type, str]:
    args = p.attention_args()
    n, rows = p.query.shape[0], p.seq_lens.shape[0]
    if which == "block_id_beyond_cache":
        reach = _reachable(p)
        assume(reach)
        r, b = data.draw(st.sampled_from(reach))
        bt = p.block_table.clone()
        bt[r, b] = data.draw(st.sampled_from((p.kv_cache.shape[1], 2**31 - 1, -1, -(2**31))))
        args[2] = args[9] = bt
        return args, ValueError, r"block_table\[\d+\]\[\d+\] must be in \[0, num_blocks"
    if which == "host_copy_hides_bad_id":
        reach = _reachable(p)
        assume(reach)
        r, b = data.draw(st.sampled_from(reach))
        bt = p.block_table.clone()
        bt[r, b] = 2**30
        args[2] = bt  # the device table is bad, the "host copy" is fine: CPU must still refuse
        return args, ValueError, r"block_table\[\d+\]\[\d+\] must be in"
    if which == "seq_len_beyond_blocks":
        sl = p.seq_lens.clone()
        r = data.draw(st.integers(0, rows - 1))
        sl[r] = data.draw(st.sampled_from((p.block_table.shape[1] * p.kv_cache.shape[2] + 1, 2**31 - 1, -1)))
        args[4] = args[11] = sl
        return args, ValueError, r"seq_lens"
    if which == "query_start_loc_unsorted":
        assume(rows >= 1 and n >= 1)
        qsl = p.query_start_loc.clone()
        qsl[0] = data.draw(st.sampled_from((1, -1, n + 1)))
        args[3] = args[10] = qsl
        return args, ValueError, r"query_start_loc"
    if which == "key_limits_missing":
        args[5], args[6] = None, 2
        return args, ValueError, r"key_limits"
    if which == "bad_mask":
        args[6] = data.draw(st.sampled_from((3, -1, 2**40)))
        return args, ValueError, r"mask must be"
    if which == "bool_mask":
        args[6] = True
        return args, TypeError, r"mask must be an int"
    if which == "bad_scale":
        args[7] = data.draw(st.sampled_from((float("nan"), float("inf"), 0.0, -1.0, 1e300)))
        return args, ValueError, r"scale must be a positive finite float"
    if which == "out_aliases_query":
        assume(n > 0)
        args[8] = p.query
        return args, ValueError, r"out must not overlap query"
    if which == "out_aliases_cache":
        assume(n > 0)
        o, c = overlapping(p.out, p.kv_cache.contiguous(), data.draw(st.integers(0, 64)))
        args[8], args[1] = o, c
        return args, ValueError, r"out must not overlap kv_cache"
    if which == "out_aliases_block_table":
        assume(n > 0)
        o, bt = overlapping(p.out, p.block_table, data.draw(st.integers(0, 16)))
        args[8], args[2], args[9] = o, bt, bt
        return args, ValueError, r"out must not overlap block_table"
    if which == "wrong_dtype":
        slot = data.draw(st.sampled_from((1, 2, 3, 4, 8)))
        args[slot] = args[slot].to(torch.float64 if slot in (1, 8) else torch.int64)
        return args, TypeError, r"must be"
    if which == "wrong_rank":
        args[0] = p.query.reshape(n, p.query.shape[1] * p.query.shape[2])
        return args, ValueError, r"query must have 3 dimensions"
    if which == "meta":
        slot = data.draw(st.sampled_from((0, 1, 2, 3, 4, 8)))
        args[slot] = torch.empty(args[slot].shape, dtype=args[slot].dtype, device="meta")
        return args, RuntimeError, None
    if which == "huge_query":
        big = p.query.reshape(-1)[:1].reshape(1, 1, 1) if n else torch.zeros(1, 1, 1, dtype=p.query.dtype)
        args[0] = big.expand(2**40, p.query.shape[1], p.query.shape[2])
        return args, ValueError, r"out must have shape"
    if which == "noncontiguous_seq_lens":
        args[4] = torch.stack([p.seq_lens, p.seq_lens], 1)[:, 0] if rows > 1 else p.seq_lens.expand(2)[:1]
        assume(rows > 1)
        return args, ValueError, r"seq_lens must be contiguous"
    raise AssertionError(which)


_ATTENTION_MUTATIONS = (
    "block_id_beyond_cache",
    "host_copy_hides_bad_id",
    "seq_len_beyond_blocks",
    "query_start_loc_unsorted",
    "key_limits_missing",
    "bad_mask",
    "bool_mask",
    "bad_scale",
    "out_aliases_query",
    "out_aliases_cache",
    "out_aliases_block_table",
    "wrong_dtype",
    "wrong_rank",
    "meta",
    "huge_query",
    "noncontiguous_seq_lens",
)


@FUZZ
@given(p=attention_problems(), which=st.sampled_from(_ATTENTION_MUTATIONS), data=st.data())
def test_attention_corrupted(p, which, data):
    """One corrupted argument: the named error, and neither cache nor out changed."""
    args, exc, pattern = _attention_mutation(p, data, which)
    expect_error(_C.paged_attention, args, exc, pattern)
    # forward_paged takes the same attention arguments (after its KV write arguments).
    forward = [args[0], p.key, p.value, args[1], p.slot_mapping, *args[2:]]
    if which in ("out_aliases_cache",):
        forward[4] = p.slot_mapping.clone()
    pattern_fp = pattern
    if which in ("wrong_dtype", "meta"):
        pattern_fp = None  # the KV write half may name its own argument first
    expect_error(
        _C.forward_paged, forward, ValueError if exc is ValueError and pattern_fp else exc, pattern_fp
    )


@pytest.mark.parametrize("seq_len", [-1, 0, 3, 2**31 - 1])
def test_zero_stride_cache_claiming_huge_blocks(seq_len):
    """A cache view claiming 2^61 tokens per block (stride 0): the bounds arithmetic
    (columns * block_size > int64) saturates instead of overflowing."""
    cache = torch.randn(2, 1, 1, 1, 1).expand(2, 1, 2**61, 1, 1)
    query = torch.randn(1, 1, 1)
    table = torch.zeros(1, 4, dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    sl = torch.tensor([seq_len], dtype=torch.int32)
    out = torch.zeros(1, 1, 1)
    args = [query, cache, table, qsl, sl, None, 0, 1.0, out, table, qsl, sl]
    if seq_len < 0:
        return expect_error(_C.paged_attention, args, ValueError, r"seq_lens\[0\] must be in \[0, ")
    if seq_len > 3:
        return  # a correct result would read 2^31 keys: too slow for the suite, valid all the same
    with no_hang():
        _C.paged_attention(*args)
    assert torch.equal(out, cache[1, 0, 0].reshape(1, 1, 1) if seq_len else torch.zeros(1, 1, 1))


_KV_MUTATIONS = (
    "slot_beyond_cache",
    "slot_huge",
    "key_aliases_cache",
    "value_aliases_cache",
    "slots_alias_cache",
    "short_slot_mapping",
    "value_shape",
    "query_aliases_cache",
    "block_table_aliases_cache",
    "out_aliases_key",
    "head_size_beyond_reference",
)


@FUZZ
@given(p=attention_problems(), which=st.sampled_from(_KV_MUTATIONS), data=st.data())
def test_kv_write_and_forward_corrupted(p, which, data):
    """Corrupted KV write inputs (kv_write and forward_paged): the cache stays bit-identical."""
    n = p.key.shape[0]
    args = p.forward_args()  # query, key, value, kv_cache, slot_mapping, block_table, ...
    kv_only = True
    if which in ("slot_beyond_cache", "slot_huge"):
        assume(n > 0)
        sm = p.slot_mapping.clone()
        cap = p.kv_cache.shape[1] * p.kv_cache.shape[2]
        sm[data.draw(st.integers(0, n - 1))] = cap if which == "slot_beyond_cache" else 2**62
        args[4] = sm
        exc, pattern = ValueError, r"slot_mapping\[\d+\] must be < num_blocks \* block_size"
    elif which in ("key_aliases_cache", "value_aliases_cache"):
        assume(n > 0)
        slot = 1 if which == "key_aliases_cache" else 2
        t, c = overlapping(args[slot].contiguous(), p.kv_cache.contiguous(), data.draw(st.integers(0, 32)))
        args[slot], args[3] = t, c
        exc, pattern = ValueError, rf"kv_cache must not overlap {'key' if slot == 1 else 'value'}"
    elif which == "slots_alias_cache":
        assume(n > 0)
        sm, c = overlapping(p.slot_mapping, p.kv_cache.contiguous(), data.draw(st.integers(0, 32)))
        args[4], args[3] = sm, c
        exc, pattern = ValueError, r"kv_cache must not overlap slot_mapping"
    elif which == "short_slot_mapping":
        assume(n > 0)
        args[4] = p.slot_mapping[: n - 1]
        exc, pattern = ValueError, r"slot_mapping must have at least"
    elif which == "value_shape":
        args[2] = torch.zeros(n, p.value.shape[1], p.value.shape[2] + 1, dtype=p.value.dtype)
        exc, pattern = ValueError, r"value must have the shape of key"
    else:
        kv_only = False
        if which == "query_aliases_cache":
            assume(n > 0)
            q, c = overlapping(p.query.contiguous(), p.kv_cache.contiguous(), data.draw(st.integers(0, 32)))
            args[0], args[3] = q, c
            exc, pattern = ValueError, r"kv_cache must not overlap query"
        elif which == "block_table_aliases_cache":
            bt, c = overlapping(p.block_table, p.kv_cache.contiguous(), data.draw(st.integers(0, 16)))
            args[5], args[3], args[12] = bt, c, bt
            exc, pattern = ValueError, r"kv_cache must not overlap (block_table|host_block_table)"
        elif which == "out_aliases_key":
            assume(n > 0 and p.query.shape[1] == p.key.shape[1])
            o, k = overlapping(p.out, p.key.contiguous(), data.draw(st.integers(0, 16)))
            args[11], args[1] = o, k
            exc, pattern = ValueError, r"out must not overlap key"
        else:  # head_size_beyond_reference: the CPU reference refuses it before the write
            assume(n > 0)
            d = 1025
            cache = torch.zeros(
                2, p.kv_cache.shape[1], p.kv_cache.shape[2], p.kv_cache.shape[3], d, dtype=p.query.dtype
            )
            args = [
                torch.zeros(n, p.query.shape[1], d, dtype=p.query.dtype),
                torch.ones(n, p.key.shape[1], d, dtype=p.query.dtype),
                torch.ones(n, p.key.shape[1], d, dtype=p.query.dtype),
                cache,
                p.slot_mapping,
                *args[5:11],
                torch.zeros(n, p.query.shape[1], d, dtype=p.query.dtype),
                *args[12:],
            ]
            exc, pattern = ValueError, r"head_size must be at most 1024"
    expect_error(_C.forward_paged, args, exc, pattern)
    if kv_only:
        expect_error(_C.kv_write, args[1:5], exc, pattern)


# ------------------------------------------------------------------------------------------------
# Row copies
# ------------------------------------------------------------------------------------------------


@FUZZ
@given(
    tokens=st.integers(0, 5),
    picks=st.lists(st.integers(-3, 8), max_size=6),
    scatter=st.booleans(),
    alias=st.sampled_from((None, "src", "index")),
    dtype=st.sampled_from((torch.float32, torch.float16, torch.bfloat16)),
    shift=st.integers(0, 32),
)
def test_rows_fuzz(tokens, picks, scatter, alias, dtype, shift):
    """rows_gather / rows_scatter: a correct copy, or the named error with dst untouched."""
    index = torch.tensor(picks, dtype=torch.int64)
    m = len(picks)
    src = torch.randn(m if scatter else tokens, 2, 3).to(dtype)
    dst = torch.full((tokens if scatter else m, 2, 3), 5.0).to(dtype)
    if alias == "src":
        assume(src.numel() and dst.numel())
        dst, src = overlapping(dst, src, shift)
    elif alias == "index":
        assume(index.numel() and dst.numel())
        dst, index = overlapping(dst, index, shift)
    fn = _C.rows_scatter if scatter else _C.rows_gather
    args = [src, index, dst]
    if alias is not None:
        return expect_error(fn, args, ValueError, rf"dst must not overlap {alias}")
    valid = all(0 <= i < tokens for i in picks)
    if not valid:
        return expect_error(fn, args, ValueError, r"index\[\d+\] must be in \[0, (src|dst) tokens=")
    with no_hang():
        fn(*args)
    if scatter:
        expected = torch.zeros(tokens, 2, 3, dtype=dtype)
        for n, i in enumerate(picks):
            expected[i] = src[n]
    else:
        expected = src[index] if m else dst
    assert torch.equal(dst, expected)


# ------------------------------------------------------------------------------------------------
# Block tables: slot mappings, gather, append; the pool
# ------------------------------------------------------------------------------------------------


_SLOT_MUTATIONS = (
    None,
    "row_beyond_table",
    "negative_row",
    "position_beyond_table",
    "negative_position",
    "negative_block_id",
    "huge_block_size",
    "query_start_loc_unsorted",
    "num_tokens_mismatch",
    "out_aliases_positions",
    "out_aliases_table",
    "bad_cp",
)


@FUZZ
@given(p=table_problems(), which=st.sampled_from(_SLOT_MUTATIONS), data=st.data())
def test_compute_slot_mappings_fuzz(p, which, data):
    n = p.positions.shape[0]
    out = torch.full((n + 2,), 9, dtype=torch.int64)
    table, ri, qsl, pos = p.table, p.row_indices, p.query_start_loc, p.positions
    bs, cs, cr, ci = p.block_size, p.cp_size, p.cp_rank, p.cp_interleave
    num_tokens = n
    pattern = None
    if which == "row_beyond_table":
        ri = ri.clone()
        ri[0] = table.shape[0] + data.draw(st.integers(0, 2**20))
        pattern = r"row_indices\[0\] must be in"
    elif which == "negative_row":
        ri = ri.clone()
        ri[0] = -1
        pattern = r"row_indices\[0\] must be in"
    elif which in ("position_beyond_table", "negative_position", "negative_block_id"):
        assume(n > 0)
        pos = pos.clone()
        t = data.draw(st.integers(0, n - 1))
        if which == "position_beyond_table":
            pos[t] = table.shape[1] * bs * cs + data.draw(st.sampled_from((0, 5, 2**62)))
            pattern = r"must be < \d+ table columns"
        elif which == "negative_position":
            pos[t] = -1
            pattern = r"must be >= 0"
        else:
            table = table.clone()
            row = int(ri[[i for i in range(ri.shape[0]) if qsl[i] <= t < qsl[i + 1]][0]])
            table[row, int(pos[t]) // (bs * cs)] = -3
            pattern = r"block_table\[\d+\]\[\d+\] must be a block id >= 0"
    elif which == "huge_block_size":
        assume(n > 0 and cs == 1 and int(table.max()) > 1)
        table = torch.full_like(table, 7)
        bs = 2**62
        pattern = r"must be a block id >= 0 whose slots fit in int64"
    elif which == "query_start_loc_unsorted":
        assume(ri.shape[0] > 1)
        qsl = qsl.clone()
        qsl[1] = n + 1
        pattern = r"query_start_loc"
    elif which == "num_tokens_mismatch":
        num_tokens = n + 1
        pattern = r"num_tokens"
    elif which == "out_aliases_positions":
        assume(n > 0)
        out, pos = overlapping(out, pos, data.draw(st.integers(0, 8)))
        pattern = r"out must not overlap positions"
    elif which == "out_aliases_table":
        out, table = overlapping(out, table, data.draw(st.integers(0, 8)))
        pattern = r"out must not overlap table"
    elif which == "bad_cp":
        cr = cs
        pattern = r"cp_rank"
    args = [table, ri, qsl, pos, out, num_tokens, n + 2, bs, cs, cr, ci]
    if which is not None:
        return expect_error(_C.compute_slot_mappings, args, ValueError, pattern)
    with no_hang():
        _C.compute_slot_mappings(*args)
    assert out.tolist() == ref_slots(p, table) + [-1, -1]


@FUZZ
@given(
    p=table_problems(),
    padded_extra=st.integers(-1, 2),
    which=st.sampled_from((None, "row", "count", "alias")),
    data=st.data(),
)
def test_gather_block_tables_fuzz(p, padded_extra, which, data):
    rows_out = p.row_indices.shape[0] + 2
    out = torch.full((rows_out, p.table.shape[1]), 8, dtype=torch.int32)
    table, counts, ri = p.table, p.counts, p.row_indices
    padded = p.row_indices.shape[0] + padded_extra
    if which == "row":
        ri = ri.clone()
        ri[0] = data.draw(st.sampled_from((-1, table.shape[0], 2**31 - 1)))
    elif which == "count":
        counts = counts.clone()
        counts[int(ri[0])] = data.draw(st.sampled_from((-1, table.shape[1] + 1)))
    elif which == "alias":
        out, table = overlapping(out, table, data.draw(st.integers(0, 8)))
    args = [table, counts, ri, out, padded]
    if which is not None or padded_extra < 0:
        pattern = {
            "row": r"row_indices\[0\]",
            "count": r"installed block count",
            "alias": r"out must not overlap",
        }
        if padded_extra < 0 and which != "alias":
            pattern = {}
        return expect_error(_C.gather_block_tables, args, ValueError, pattern.get(which, r"num_reqs_padded"))
    expected = out.clone()
    for i, row in enumerate(ri.tolist()):
        c = int(counts[row])
        expected[i, :c] = table[row, :c]
    expected[ri.shape[0] : padded] = 0
    with no_hang():
        _C.gather_block_tables(*args)
    assert torch.equal(out, expected)


@FUZZ
@given(
    rows=st.integers(1, 3),
    cols=st.integers(0, 6),
    row=hostile_ints(),
    ids=st.lists(hostile_ints(), max_size=4),
    k=st.sampled_from((1, 2, 0, -1)),
    limit=st.sampled_from((0, 8, 2**31, 2**40, -5)),
    overwrite=st.booleans(),
    count=st.integers(-1, 7),
)
def test_table_append_fuzz(rows, cols, row, ids, k, limit, overwrite, count):
    """table_append: exactly the Python rule, or a ValueError with table and counts as before."""
    table = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    counts = torch.full((rows,), count, dtype=torch.int32)
    args = [table, counts, row, ids, k, limit, overwrite]
    in_int64 = all(-(2**63) <= v < 2**63 for v in [row, *ids])
    if not in_int64:
        return expect_error(_C.table_append, args, ValueError, r"must fit in int64")
    cap = min(limit, 2**31) if limit > 0 else 2**31
    base = 0 if overwrite else count
    valid = (
        0 <= row < rows
        and k >= 1
        and all(0 <= b and b * k + k - 1 < cap for b in ids)
        and 0 <= base <= cols
        and len(ids) * k <= cols - base
    )
    if not valid:
        return expect_error(_C.table_append, args, ValueError, r"BlockTables.append_block_ids\(\): ")
    expected = table.clone()
    for j, b in enumerate(ids):
        expected[row, base + j * k : base + (j + 1) * k] = torch.arange(b * k, b * k + k)
    with no_hang():
        _C.table_append(*args)
    assert torch.equal(table, expected)
    assert int(counts[row]) == base + len(ids) * k


@FUZZ
@given(
    num_blocks=st.integers(1, 6),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("allocate"), st.one_of(hostile_ints(), hostile_objects())),
            st.tuples(st.just("free"), st.lists(hostile_ints(), max_size=3)),
            st.tuples(st.just("free"), hostile_objects()),
        ),
        max_size=8,
    ),
)
def test_block_pool_fuzz(num_blocks, ops):
    """BlockPool against a set model: every failed call leaves the pool as it was."""
    pool = diffkv.BlockPool(num_blocks)
    allocated: set[int] = set()
    for op, arg in ops:
        before = (pool._state.clone(), pool._free_stack.clone(), pool._in_use.clone())
        ok, result = call(getattr(pool, op), arg)
        if not ok:
            assert torch.equal(pool._state, before[0])
            assert torch.equal(pool._free_stack, before[1])
            assert torch.equal(pool._in_use, before[2])
            continue
        if op == "allocate":
            assert type(arg) is int or hasattr(arg, "__index__")
            assert len(result) == len(set(result)) == int(arg)
            assert not allocated & set(result) and all(0 <= b < num_blocks for b in result)
            allocated |= set(result)
        else:
            ids = [int(b) for b in arg]
            assert set(ids) <= allocated and len(set(ids)) == len(ids)
            allocated -= set(ids)
        assert pool.num_free == num_blocks - len(allocated)


# ------------------------------------------------------------------------------------------------
# Piecewise plans, rows, batch building
# ------------------------------------------------------------------------------------------------

_SPAN_MSG = "Paged piecewise spans must be sorted, non-overlapping, and within the sequence"
_QUERY_MSG = "Paged piecewise query range must be within the sequence"
_ALIGN_MSGS = (
    "Paged piecewise rows must produce aligned segments",
    "Paged piecewise rows must use the same attention mode per segment",
)


def _first_plan_error(spans, offsets, lens, seqs) -> str | None:
    for row_spans, offset, length, seq in zip(spans, offsets, lens, seqs, strict=True):
        previous = 0
        for start, end in row_spans:
            if start < previous or not (0 <= start < end <= seq):
                return _SPAN_MSG
            previous = end
        if offset < 0 or length <= 0 or offset + length > seq:
            return _QUERY_MSG
    return None


_span = st.tuples(st.integers(-2, 14), st.integers(-2, 14))


@FUZZ
@given(
    rows=st.lists(
        st.tuples(st.lists(_span, max_size=3), st.integers(-1, 10), st.integers(-1, 6), st.integers(0, 12)),
        min_size=1,
        max_size=3,
    ),
    huge=st.sampled_from((None, 2**62, 2**63 - 1, 2**64)),
)
def test_build_plan_fuzz(rows, huge):
    """Malformed, unsorted, overlapping and out-of-range spans get vLLM-Omni's adapter's messages; valid
    plans give the reference key limits.  `huge` query lengths never overrun the outputs."""
    spans = [r[0] for r in rows]
    offsets = [r[1] for r in rows]
    lens = [r[2] for r in rows]
    seqs = [r[3] for r in rows]
    if huge is not None:
        lens = [huge] * len(rows)
        seqs = [huge] * len(rows)
        offsets = [0] * len(rows)
        spans = [[] for _ in rows]
        ok, exc = call(_C.build_plan, spans, offsets, lens, seqs, None, torch.zeros(0, dtype=torch.int64))
        assert not ok and type(exc) is ValueError
        return
    total = sum(max(v, 0) for v in lens)
    kl = torch.full((total,), -7, dtype=torch.int32)
    qi = torch.full((total,), -7, dtype=torch.int64)
    ok, result = call(_C.build_plan, spans, offsets, lens, seqs, kl, qi)
    expected_error = _first_plan_error(spans, offsets, lens, seqs)
    if expected_error is not None:
        assert not ok and type(result) is ValueError and str(result) == expected_error
        return
    if not ok:
        assert type(result) is ValueError and str(result) in _ALIGN_MSGS
        return
    expected = []
    for row_spans, offset, length in zip(spans, offsets, lens, strict=True):
        expected += key_limits_for_spans(range(offset, offset + length), row_spans)
    assert kl.tolist() == expected
    assert sorted(qi.tolist()) == list(range(total))


def _check_row_oracle(request_id, query_len, seq_len, kv_start_pos, sequence_id, context_id) -> bool:
    def is_int(v):
        return type(v) is int

    return (
        type(request_id) is str
        and request_id != ""
        and ((sequence_id is None) != (context_id is None))
        and (sequence_id is None or (is_int(sequence_id) and sequence_id >= 0))
        and (context_id is None or (type(context_id) is str and context_id != ""))
        and is_int(query_len)
        and query_len > 0
        and is_int(seq_len)
        and seq_len > 0
        and is_int(kv_start_pos)
        and kv_start_pos >= 0
        and kv_start_pos + query_len <= seq_len
    )


_row_field = st.one_of(hostile_ints(), hostile_objects(), st.sampled_from(("r", "", "ctx")))


@FUZZ
@given(fields=st.tuples(_row_field, _row_field, _row_field, _row_field, _row_field, _row_field))
def test_row_rules_fuzz(fields):
    """DiffusionPagedAttentionRow accepts exactly vLLM-Omni's adapter's rows; everything else is a
    ValueError (vLLM-Omni's adapter's type)."""
    names = ("request_id", "query_len", "seq_len", "kv_start_pos", "sequence_id", "context_id")
    ok, result = call(lambda: diffkv.DiffusionPagedAttentionRow(**dict(zip(names, fields, strict=True))))
    assert ok == _check_row_oracle(*fields)
    if not ok:
        assert type(result) is ValueError and str(result).startswith("Paged attention")


@FUZZ
@given(
    lens=st.lists(st.tuples(hostile_ints(), st.integers(0, 9), hostile_ints()), min_size=1, max_size=3),
)
def test_build_batch_fuzz(lens):
    """build_batch on raw rows (any ints): positions exactly as the rule, or a ValueError;
    negative lengths never reach the positions loop."""
    rows = tuple(SimpleNamespace(query_len=q, seq_len=s, kv_start_pos=k) for q, s, k in lens)
    n = len(rows)
    total = sum(max(q, 0) for q, _, _ in lens)
    pos = torch.zeros(min(total, 64), dtype=torch.int64)
    args = [rows, list(range(n)), torch.zeros(n, dtype=torch.int32), torch.zeros(n + 1, dtype=torch.int32)]
    args += [torch.zeros(n, dtype=torch.int32), pos]
    ok, result = call(_C.build_batch, *args)
    valid = all(0 <= q and 0 <= k < 2**63 - q and q < 2**31 for q, _, k in lens) and total <= 64
    valid = valid and total < 2**31 and all(-(2**63) <= v < 2**63 for q, _, k in lens for v in (q, k))
    if not ok:
        assert type(result) is ValueError
        return
    assert valid
    expected = [k + i for q, _, k in lens for i in range(q)]
    assert pos[:total].tolist() == expected


@FUZZ
@given(
    seq_lens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4),
    cp=st.tuples(hostile_ints(), hostile_ints(), hostile_ints()),
)
def test_dcp_local_seq_lens_fuzz(seq_lens, cp):
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.zeros_like(sl)
    ok, result = call(_C.dcp_local_seq_lens, sl, out, *cp)
    c, r, il = cp
    fits = all(-(2**63) <= v < 2**63 for v in cp)
    valid = fits and c >= 1 and 0 <= r < c and il >= 1 and c * il < 2**63
    assert ok == valid, result
    if ok:
        for s, got in zip(seq_lens, out.tolist(), strict=True):
            quotient = abs(s) // (c * il) * (1 if s >= 0 else -1)  # C division truncates
            base = quotient * il
            local = base + min(max(s - base * c - r * il, 0), il)
            assert got == (local + 2**31) % 2**32 - 2**31


# ------------------------------------------------------------------------------------------------
# The adapter and its collaborators
# ------------------------------------------------------------------------------------------------


def _adapter(non_causal: bool) -> SimpleNamespace:
    return make_adapter(
        "cpu",
        head_size=HEAD_SIZE,
        non_causal=non_causal,
        bindings={("a", 0, None): (0, 16), ("b", 0, None): (1, 16)},
        max_num_blocks=6,
        num_blocks=16,
    )


def _state(env: SimpleNamespace) -> Snapshot:
    bt = env.block_tables
    return Snapshot([list(env.caches.values()), bt._tables_cpu, bt.num_blocks.cpu, bt.block_tables])


@FUZZ
@given(
    non_causal=st.booleans(),
    rows=st.lists(
        st.tuples(st.sampled_from(("a", "b")), st.integers(1, 6), st.integers(0, 24), st.integers(0, 6)),
        min_size=1,
        max_size=2,
    ),
    bad_block=st.sampled_from((None, 15, 16, 400, 2**27)),
    capacity=st.sampled_from((16, 24, 2**40)),
    qkv=st.sampled_from(
        ("valid", "packed_hidden", "dtype", "meta", "shape", "huge", "batched_padded", "none")
    ),
    data=st.data(),
)
def test_adapter_forward_fuzz(non_causal, rows, bad_block, capacity, qkv, data):
    """prepare_batch -> activate -> prepare_layer_context -> forward_paged with random rows,
    bindings longer than their blocks, block ids beyond the cache and hostile Q/K/V: a correct
    output (checked against the reference over the written cache) or an allowed error with
    caches and block tables unchanged."""
    env = _adapter(non_causal)
    if bad_block is not None:
        env.block_tables.append_block_ids(1, [[bad_block]], overwrite=False)
    if capacity != 16:
        env.resolver.bindings[("b", 0, None)] = diffkv.DiffusionPagedAttentionRowBinding(1, capacity)
    diff_rows = []
    for request_id, query_len, seq_len, start in rows:
        ok, row = call(
            diffkv.DiffusionPagedAttentionRow,
            request_id,
            query_len,
            seq_len,
            start,
            0,
            None,
        )
        if not ok:
            assert type(row) is ValueError
            return
        diff_rows.append(row)
    before = _state(env)
    ok, batch = call(env.adapter.prepare_batch, diff_rows)
    if not ok:
        before.assert_unchanged()
        return
    layer = env.layers["layer0"]
    n = batch.num_tokens
    # values from a drawn seed: a failing example replays with its data
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    q = torch.randn(n, 2, HEAD_SIZE, generator=gen)
    k = torch.randn(n, 1, HEAD_SIZE, generator=gen)
    v = torch.randn(n, 1, HEAD_SIZE, generator=gen)
    if qkv == "packed_hidden":
        q, k, v = q.reshape(n, 2 * HEAD_SIZE), k.reshape(n, HEAD_SIZE), v.reshape(n, HEAD_SIZE)
    elif qkv == "dtype":
        k = k.half()
    elif qkv == "meta":
        v = torch.empty(v.shape, device="meta")
    elif qkv == "shape":
        k = torch.randn(n, 2, HEAD_SIZE, generator=gen)
    elif qkv == "huge":
        q = torch.zeros(1, 1, 1).expand(2**40, 2, HEAD_SIZE)
    elif qkv == "batched_padded":
        t = max(r.query_len for r in diff_rows) + data.draw(st.integers(0, 2))
        q, k, v = (
            torch.randn(len(diff_rows), t, 2, HEAD_SIZE, generator=gen),
            torch.randn(len(diff_rows), t, 1, HEAD_SIZE, generator=gen),
            torch.randn(len(diff_rows), t, 1, HEAD_SIZE, generator=gen),
        )
    elif qkv == "none":
        q = None
    before = _state(env)
    with env.adapter.activate(batch):
        ok, ctx = call(env.adapter.prepare_layer_context, "layer0", q, k, v)
        if ok:
            cache_before = env.caches["layer0"].clone()
            ok, out = call(layer.impl.forward_paged, ctx)
    if not ok:
        before.assert_unchanged()
        return
    assert qkv in ("valid", "packed_hidden", "batched_padded")
    # Reference: the write is the rule's scatter, the output attention over the new cache.
    cache = env.caches["layer0"]
    meta = ctx.native_metadata
    problem = AttentionProblem(
        query=ctx.query,
        key=ctx.key_write,
        value=ctx.value_write,
        kv_cache=cache_before,
        slot_mapping=ctx.slot_mapping,
        block_table=meta.block_table,
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        key_limits=None,
        mask=0 if non_causal else 1,
        scale=layer.softmax_scale,
        out=torch.empty(0),
    )
    expected_cache = ref_kv_write(problem)
    assert torch.equal(cache, expected_cache)
    expected = ref_paged_attention(problem, expected_cache)
    expected = ctx.restore_output(expected.float())
    assert torch.allclose(out.double(), expected.double(), atol=1e-4)


@FUZZ
@given(step=hostile_objects(), output=hostile_objects())
def test_runtime_and_restore_output_hostile(step, output):
    """Runtime.ensure_active with any step index, restore_output with any output,
    invalidate_prepared_batches during a forward, a stale batch."""
    env = _adapter(True)
    rows = (diffkv.DiffusionPagedAttentionRow("a", 4, 4, 0, 0),)
    metadata = diffkv.DiffusionPagedAttentionMetadata(rows, rows)
    runtime = diffkv.DiffusionPagedAttentionRuntime(env.adapter, metadata)
    ok, exc = call(runtime.ensure_active, step)
    if not ok:
        # vLLM-Omni's adapter evaluates `step_idx == 0` first: a tensor step may fail in torch's __eq__.
        assert type(exc) is not ValueError or "denoise step index" in str(exc)
    else:
        assert type(step) is int and step >= 0
        with pytest.raises(RuntimeError, match=f"^{re.escape(ACTIVE_FORWARD_INVALIDATE)}$"):
            env.adapter.invalidate_prepared_batches()
        ctx = env.adapter.prepare_layer_context(
            "layer0", torch.randn(4, 2, HEAD_SIZE), torch.randn(4, 1, HEAD_SIZE), torch.randn(4, 1, HEAD_SIZE)
        )
        # vLLM-Omni's adapter's restore_output is a plain reshape: a non-tensor raises AttributeError.
        ok, restored = call(ctx.restore_output, output, allowed=ALLOWED + (AttributeError,))
        if ok:
            assert isinstance(output, torch.Tensor) and restored.shape == (4, 2, HEAD_SIZE)
    runtime.close()
    batch = env.adapter.prepare_batch(rows)
    env.adapter.invalidate_prepared_batches()
    with pytest.raises(ValueError, match=f"^{re.escape(STALE_BATCH)}$"), env.adapter.activate(batch):
        pass


def _collaborator_calls() -> dict[str, tuple[Callable[..., Any], list[Any], tuple]]:
    """name -> (callable, valid args, extra allowed exception types)."""
    tables = diffkv.BlockTables([4], 2, 16, 4, "cpu")
    pool = diffkv.BlockPool(4)
    spec = diffkv.AttentionSpec(block_size=4, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float32)
    config = diffkv.KVCacheConfig(4, (diffkv.KVCacheGroup(("l0",), spec),))
    impl = diffkv.DiffKVAttentionImpl(2, 8, softmax_scale=0.5, num_kv_heads=1)
    cache = torch.zeros(2, 4, 4, 1, 8)
    return {
        "BlockTables.append_block_ids": (tables.append_block_ids, [0, [[1, 2]], False], ()),
        "BlockTables.clear_row": (tables.clear_row, [1], ()),
        "BlockTables.gather_block_tables": (tables.gather_block_tables, [[0, 1], 2], ()),
        "BlockTables.compute_slot_mappings": (
            tables.compute_slot_mappings,
            [
                torch.tensor([0], dtype=torch.int32),
                torch.tensor([0, 2], dtype=torch.int32),
                torch.tensor([0, 1]),
                2,
            ],
            (),
        ),
        "BlockPool.allocate": (pool.allocate, [2], ()),
        "BlockPool.free": (pool.free, [[]], ()),
        "allocate_kv_caches": (
            lambda c, d, dev, layout: diffkv.allocate_kv_caches(c, dtype=d, device=dev, layout=layout),
            [config, torch.float32, "cpu", "layer_major"],
            (),
        ),
        "build_paged_piecewise_plan": (
            diffkv.build_paged_piecewise_plan,
            [[[(0, 2)]], [0], [4], [4]],
            (OverflowError,),
        ),
        "DiffKVAttentionImpl.do_kv_cache_update": (
            impl.do_kv_cache_update,
            [None, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), cache, torch.tensor([3])],
            (),
        ),
        "DiffKVAttentionImpl.forward_paged": (
            impl.forward_paged,
            [SimpleNamespace(layer=None)],
            (AttributeError,),
        ),
        "DiffusionPagedAttentionMetadata": (
            diffkv.DiffusionPagedAttentionMetadata,
            [(_row(),), (_row(),)],
            (AttributeError,),
        ),
        "DiffusionPagedAttentionLayerAdapter": (
            lambda heads, scale, u: diffkv.DiffusionPagedAttentionLayerAdapter(
                layer_name="l0",
                layer=SimpleNamespace(num_heads=heads, softmax_scale=scale),
                spec=spec,
                vllm_config=diffkv.DiffusionConfig(diffkv.ModelConfig(torch.float32), diffkv.CacheConfig(4)),
                device=torch.device("cpu"),
                ulysses_degree=u,
            ),
            [2, 0.5, 1],
            (OverflowError,),  # vLLM-Omni's adapter's int(layer.num_heads) of inf
        ),
    }


@FUZZ
@given(data=st.data())
def test_hostile_argument_public_methods(data):
    """Public methods of vLLM-Omni's adapter classes and collaborators, one or two arguments hostile:
    an allowed exception (or a documented extra type) and no tensor changed on failure."""
    calls = _collaborator_calls()
    name = data.draw(st.sampled_from(sorted(calls)))
    fn, args, extra = calls[name]
    args = list(args)
    for _ in range(data.draw(st.integers(1, 2))):
        args[data.draw(st.integers(0, len(args) - 1))] = data.draw(hostile_objects())
    owner = getattr(fn, "__self__", None)
    state = [v for v in vars(owner).values()] if owner is not None and hasattr(owner, "__dict__") else []
    snap = Snapshot([args, state, getattr(owner, "_tables_cpu", []), getattr(owner, "block_tables", [])])
    ok, exc = call(fn, *args, allowed=ALLOWED + extra)
    if not ok:
        snap.assert_unchanged()
        assert str(exc) or type(exc) in extra


@pytest.mark.parametrize("path", ["auto", "capsule"])
def test_negative_bit_view_is_rejected(path):
    """torch exports a negative-bit view (torch._neg_view, .imag of a conjugate) through DLPack
    without applying the negation: the bridge asks is_neg() and refuses it, on both paths."""
    src = torch._neg_view(torch.ones(2, 1, 4))
    dst = torch.zeros(2, 1, 4)
    _C.set_bridge_path(path)
    try:
        with pytest.raises(ValueError, match=re.escape("rows_gather(): src must not be a negative-bit view")):
            _C.rows_gather(src, torch.tensor([0, 1]), dst)
    finally:
        _C.set_bridge_path("auto")
    assert torch.equal(dst, torch.zeros(2, 1, 4))
    imag = torch.randn(3, 4, dtype=torch.complex64).conj().imag
    with pytest.raises(ValueError, match="must not be a negative-bit view"):
        _C.tensor_info(imag)
    _C.rows_gather(src.resolve_neg(), torch.tensor([0, 1]), dst)
    assert torch.equal(dst, -torch.ones(2, 1, 4))
