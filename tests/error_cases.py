"""The error cases of every ``diffkv._C`` entry point, in one table shared by the tests.

``all_cases()`` maps each function ``_C`` exports (``_C.pyi`` plus ``check_layer_qkv``) to its
cases: valid calls (``ok``) and failing calls (``bad``), one per kind of error path (argument
count, not a tensor, wrong dtype / rank / shape, each of vLLM-Omni's adapter rules, each error
the C core returns).  A failing case carries the exception type and the full message: the
error test (``test_adapter_errors.py``) checks both on every case, the leak test
(``test_leaks.py``) repeats every case many times and checks the memory around it, and the
fuzz test (``test_fuzz.py``) runs every case as an explicit example next to its random ones.

A case's arguments (tensors, tuples, lists, ints, rows, bindings, callables) are created once
by ``all_cases()``, so a caller may call ``case.fn(*case.args)`` as often as it likes; call
``all_cases()`` again for fresh objects.  Messages raised inside torch itself (a ``meta``
tensor DLPack cannot export) are torch's text followed by a C++ backtrace: those cases are
marked ``torch_message`` and their message is the first line.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

import diffkv
from _helpers import HEAD_SIZE, make_adapter, make_layer, make_vllm_config, row
from diffkv import _C, selector
from diffkv import adapter as adapter_mod
from diffkv import platform as platform_mod


@dataclasses.dataclass
class Case:
    """One call of an entry point: ``fn(*args)`` succeeds (``raises`` is None) or raises
    ``raises`` with the text ``message``."""

    name: str
    fn: Callable[..., Any]
    args: tuple
    raises: type[BaseException] | None = None
    message: str | None = None
    slow: bool = False  # the failure is raised inside torch and costs ~1 ms per call
    torch_message: bool = False  # torch's text plus a backtrace: compare the first line
    calls: int | None = None  # the leak test's call count for this case
    env: Any = None  # what a public case was built over (an adapter and its collaborators)


def ok(name: str, fn: Callable[..., Any], *args: Any) -> Case:
    return Case(name, fn, args)


def bad(
    name: str,
    exc: type[BaseException],
    message: str,
    fn: Callable[..., Any],
    *args: Any,
    slow: bool = False,
    torch_message: bool = False,
) -> Case:
    return Case(name, fn, args, exc, message, slow, torch_message)


def message_of(case: Case, exc: BaseException) -> str:
    """The part of ``str(exc)`` that ``case.message`` spells."""
    if type(exc) is KeyError and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]  # str() of a KeyError is the repr of its key
    text = str(exc)
    return text.splitlines()[0] if case.torch_message else text


def check(case: Case) -> None:
    """One call of ``case``: it returns, or raises exactly ``case.raises`` with exactly
    ``case.message``."""
    if case.raises is None:
        case.fn(*case.args)
        return
    try:
        case.fn(*case.args)
    except BaseException as exc:  # noqa: BLE001 - the type is compared below
        assert type(exc) is case.raises, f"{case.name}: raised {type(exc).__name__}: {exc}"
        assert message_of(case, exc) == case.message, f"{case.name}: message {str(exc)!r}"
        return
    raise AssertionError(f"{case.name}: did not raise {case.raises.__name__}")


def error_cases() -> list[tuple[str, Case]]:
    """Every failing case as ``(entry point, case)``."""
    return [(entry, case) for entry, cases in all_cases().items() for case in cases if case.raises]


F32 = torch.float32
I32 = torch.int32
_NEEDS_SCALES = (
    "a float8_e4m3fn kv_cache needs k_scale and v_scale (float32 tensors of 1 or num_kv_heads = 1 "
    "entries), got "
)
I64 = torch.int64
F8 = torch.float8_e4m3fn
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
            ok("configure ok", _C.configure, to_dlpack, getter, torch.get_num_threads),
            bad(
                "configure nargs", TypeError, "configure() takes 3 arguments, got 1", _C.configure, to_dlpack
            ),
        ],
        "set_bridge_path": [
            ok("set_bridge_path auto", _C.set_bridge_path, "auto"),
            bad(
                "set_bridge_path bogus",
                ValueError,
                ("set_bridge_path(): path must be 'auto' or 'capsule', got 'x'"),
                _C.set_bridge_path,
                "x",
            ),
            bad(
                "set_bridge_path int",
                ValueError,
                ("set_bridge_path(): path must be 'auto' or 'capsule', got 5"),
                _C.set_bridge_path,
                5,
            ),
            bad(
                "set_bridge_path nargs",
                TypeError,
                "set_bridge_path() takes 1 arguments, got 0",
                _C.set_bridge_path,
            ),
        ],
        "supported_head_sizes": [
            ok("supported_head_sizes cpu", _C.supported_head_sizes, "cpu", "float16", "auto"),
            ok("supported_head_sizes cpu fp8", _C.supported_head_sizes, "cpu", "float16", "float8_e4m3fn"),
            bad(
                "supported_head_sizes device",
                ValueError,
                "supported_head_sizes(): device_type must be 'cpu' or 'cuda', got 'tpu'",
                _C.supported_head_sizes,
                "tpu",
                "float16",
                "auto",
            ),
            bad(
                "supported_head_sizes dtype",
                ValueError,
                "supported_head_sizes(): dtype must be 'float32', 'float16' or 'bfloat16', got torch.int8",
                _C.supported_head_sizes,
                "cpu",
                torch.int8,
                "auto",
            ),
            bad(
                "supported_head_sizes cache dtype",
                ValueError,
                "supported_head_sizes(): cache_dtype must be 'auto' or 'float8_e4m3fn', got 'fp8_e5m2'",
                _C.supported_head_sizes,
                "cpu",
                "float16",
                "fp8_e5m2",
            ),
            bad(
                "supported_head_sizes nargs",
                TypeError,
                "supported_head_sizes() takes 3 arguments, got 2",
                _C.supported_head_sizes,
                "cpu",
                "float16",
            ),
        ],
        "set_attention_kernel": [
            ok("set_attention_kernel auto", _C.set_attention_kernel, "auto"),
            bad(
                "set_attention_kernel bogus",
                ValueError,
                "set_attention_kernel(): kernel must be 'auto', 'sm90' or 'sm80', got 'x'",
                _C.set_attention_kernel,
                "x",
            ),
            bad(
                "set_attention_kernel int",
                ValueError,
                "set_attention_kernel(): kernel must be 'auto', 'sm90' or 'sm80', got 5",
                _C.set_attention_kernel,
                5,
            ),
            bad(
                "set_attention_kernel nargs",
                TypeError,
                ("set_attention_kernel() takes 1 arguments, got 0"),
                _C.set_attention_kernel,
            ),
        ],
        "bridge_path": [
            ok("bridge_path ok", _C.bridge_path, x),
            bad(
                "bridge_path not tensor",
                TypeError,
                ("bridge_path(): tensor must be a torch.Tensor"),
                _C.bridge_path,
                5,
            ),
        ],
        "tensor_info": [
            ok("tensor_info ok", _C.tensor_info, x),
            bad(
                "tensor_info str",
                TypeError,
                ("tensor_info(): tensor must be a torch.Tensor, got str"),
                _C.tensor_info,
                "s",
            ),
            bad(
                "tensor_info meta",
                RuntimeError,
                "Cannot pack tensors on meta",
                _C.tensor_info,
                meta,
                slow=True,
                torch_message=True,
            ),
            bad(
                "tensor_info nargs", TypeError, "tensor_info() takes 1 arguments, got 2", _C.tensor_info, x, x
            ),
        ],
        "bridge_noop4": [
            ok("bridge_noop4 ok", _C.bridge_noop4, x, x, x, x),
            bad(
                "bridge_noop4 not tensor",
                TypeError,
                ("bridge_noop4(): d must be a torch.Tensor, got int"),
                _C.bridge_noop4,
                x,
                x,
                x,
                1,
            ),
            bad(
                "bridge_noop4 nargs", TypeError, "bridge_noop4() takes 4 arguments, got 1", _C.bridge_noop4, x
            ),
        ],
        "cuda_compiled": [
            ok("cuda_compiled ok", _C.cuda_compiled),
            bad(
                "cuda_compiled nargs",
                TypeError,
                "cuda_compiled() takes 0 arguments, got 1",
                _C.cuda_compiled,
                1,
            ),
        ],
        "build_info": [
            ok("build_info ok", _C.build_info),
            bad("build_info nargs", TypeError, "build_info() takes 0 arguments, got 1", _C.build_info, 1),
        ],
        "driver_check": [
            ok("driver_check too old", _C.driver_check, 12080, 13000),
            ok("driver_check compatible", _C.driver_check, 13000, 13000),
            bad(
                "driver_check nargs", TypeError, "driver_check() takes 2 arguments, got 1", _C.driver_check, 1
            ),
            bad(
                "driver_check negative",
                ValueError,
                "driver_check(): versions must be in [0, 2147483647], got -1 and 13000",
                _C.driver_check,
                -1,
                13000,
            ),
        ],
        "last_attention_kernel": [
            ok("last_attention_kernel ok", _C.last_attention_kernel),
            bad(
                "last_attention_kernel nargs",
                TypeError,
                ("last_attention_kernel() takes 0 arguments, got 1"),
                _C.last_attention_kernel,
                1,
            ),
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
            bad(
                "check_row request_id",
                ValueError,
                ("Paged attention request_id must be a non-empty string"),
                _C.check_row,
                "",
                4,
                4,
                0,
                0,
                None,
            ),
            bad(
                "check_row exactly one id",
                ValueError,
                ("Paged attention row requires exactly one of sequence_id or context_id"),
                _C.check_row,
                "r",
                4,
                4,
                0,
                0,
                "c",
            ),
            bad(
                "check_row sequence_id",
                ValueError,
                ("Paged attention sequence_id must be a non-negative integer"),
                _C.check_row,
                "r",
                4,
                4,
                0,
                -1,
                None,
            ),
            bad(
                "check_row context_id",
                ValueError,
                ("Paged attention context_id must be a non-empty string"),
                _C.check_row,
                "r",
                4,
                4,
                0,
                None,
                "",
            ),
            bad(
                "check_row query_len",
                ValueError,
                "Paged attention query_len must be a positive integer",
                _C.check_row,
                "r",
                0,
                4,
                0,
                0,
                None,
            ),
            bad(
                "check_row seq_len",
                ValueError,
                "Paged attention seq_len must be a positive integer",
                _C.check_row,
                "r",
                4,
                True,
                0,
                0,
                None,
            ),
            bad(
                "check_row kv_start_pos",
                ValueError,
                ("Paged attention kv_start_pos must be a non-negative integer"),
                _C.check_row,
                "r",
                4,
                4,
                -HUGE,
                0,
                None,
            ),
            bad(
                "check_row write span past seq_len",
                ValueError,
                (
                    "Paged attention write span exceeds seq_len: start=1180591620717411303424, "
                    "query_len=4, seq_len=1180591620717411303424"
                ),
                _C.check_row,
                "r",
                4,
                HUGE,
                HUGE,
                0,
                None,
            ),
            bad("check_row nargs", TypeError, "check_row() takes 6 arguments, got 1", _C.check_row, "r"),
        ],
        "check_metadata": [
            ok("check_metadata ok", _C.check_metadata, pre, den),
            bad(
                "check_metadata both row sets",
                ValueError,
                ("Paged attention metadata requires both prefill and denoise rows"),
                _C.check_metadata,
                (),
                den,
            ),
            bad(
                "check_metadata same identities",
                ValueError,
                (
                    "Paged attention prefill and denoise rows must use the same ordered identities: "
                    "prefill=(('a', 0, None), ('b', 1, None)), denoise=(('a', 0, None), ('c', 1, None))"
                ),
                _C.check_metadata,
                pre,
                other,
            ),
            bad(
                "check_metadata no identity",
                AttributeError,
                ("'object' object has no attribute 'identity'"),
                _C.check_metadata,
                pre,
                (object(),),
            ),
            bad(
                "check_metadata not sequence",
                TypeError,
                ("diffkv(): rows must be a sequence, got 5"),
                _C.check_metadata,
                5,
                6,
            ),
        ],
        "check_step": [
            ok("check_step ok", _C.check_step, 7),
            bad(
                "check_step negative",
                ValueError,
                ("Paged attention requires a non-negative denoise step index, got -1"),
                _C.check_step,
                -1,
            ),
            bad(
                "check_step None",
                ValueError,
                ("Paged attention requires a non-negative denoise step index, got None"),
                _C.check_step,
                None,
            ),
            bad(
                "check_step huge negative",
                ValueError,
                ("Paged attention requires a non-negative denoise step index, got -1180591620717411303424"),
                _C.check_step,
                -HUGE,
            ),
        ],
        "check_layer_heads": [
            ok("check_layer_heads ok", _C.check_layer_heads, 2, 4, 2),
            ok("check_layer_heads huge", _C.check_layer_heads, 2, HUGE * 4, HUGE * 2),
            bad(
                "check_layer_heads ulysses degree",
                ValueError,
                ("ulysses_degree must be a positive integer, got True"),
                _C.check_layer_heads,
                True,
                4,
                2,
            ),
            bad(
                "check_layer_heads type",
                TypeError,
                ("check_layer_heads(): num_heads and num_kv_heads must be ints"),
                _C.check_layer_heads,
                1,
                "x",
                2,
            ),
            bad(
                "check_layer_heads head counts",
                ValueError,
                (
                    "Paged attention requires positive Q/KV heads with num_heads divisible by "
                    "num_kv_heads: num_heads=4, num_kv_heads=3"
                ),
                _C.check_layer_heads,
                1,
                4,
                3,
            ),
            bad(
                "check_layer_heads heads divisible by ulysses",
                ValueError,
                (
                    "Paged attention requires Q/KV heads divisible by ulysses_degree: num_heads=4, "
                    "num_kv_heads=2, ulysses_degree=4"
                ),
                _C.check_layer_heads,
                4,
                4,
                2,
            ),
        ],
        "check_head_sizes": [
            ok("check_head_sizes ok", _C.check_head_sizes, 64, 64),
            bad(
                "check_head_sizes key and value head sizes",
                ValueError,
                (
                    "Diffusion native paged attention requires equal key/value head sizes; got "
                    "head_size=64, head_size_v=32"
                ),
                _C.check_head_sizes,
                64,
                32,
            ),
            bad(
                "check_head_sizes compare",
                RuntimeError,
                "comparison refused",
                _C.check_head_sizes,
                64,
                _RaisingNe(),
            ),
        ],
        "check_layer_qkv": [
            ok("check_layer_qkv packed", _C.check_layer_qkv, *qkv(q, k, k)),
            ok("check_layer_qkv batched padded", _C.check_layer_qkv, *qkv(qb, kb, kb, n=2, lens=(2,))),
            bad(
                "check_layer_qkv trailing shape",
                ValueError,
                ("Paged attention query must end in (2, 2) or (4,); got shape=(2, 2)"),
                _C.check_layer_qkv,
                *qkv(q[:, 0], k, k),
            ),
            bad(
                "check_layer_qkv key layout",
                ValueError,
                ("Paged attention key token count must match the query layout: query=(2,), key=(1,)"),
                _C.check_layer_qkv,
                *qkv(q, k[:1], k),
            ),
            bad(
                "check_layer_qkv value layout",
                ValueError,
                (
                    "Paged attention batched value layout must match prepared rows and the query "
                    "layout: query=(1, 3), value=(1, 2)"
                ),
                _C.check_layer_qkv,
                *qkv(qb, kb, kb[:, :2]),
            ),
            bad(
                "check_layer_qkv token counts",
                ValueError,
                (
                    "Paged attention Q/K/V token count must match the prepared write batch: tokens=2, "
                    "prepared=3"
                ),
                _C.check_layer_qkv,
                *qkv(q, k, k, n=3),
            ),
            bad(
                "check_layer_qkv batched layout",
                ValueError,
                (
                    "Paged attention batched Q/K/V layout must match prepared rows for the current "
                    "write: shape=(1, 3), row_query_lens=(4,)"
                ),
                _C.check_layer_qkv,
                *qkv(qb, kb, kb, lens=(4,)),
            ),
            bad(
                "check_layer_qkv token rank",
                ValueError,
                (
                    "Paged attention Q/K/V supports packed [T, ...] or uniform batched [B, T, ...] "
                    "token layouts; got token shape=(1, 1, 2)"
                ),
                _C.check_layer_qkv,
                *qkv(q[None, None], k[None, None], k[None, None]),
            ),
            bad(
                "check_layer_qkv device",
                ValueError,
                ("Paged attention Q/K/V must be on cpu; got query=cpu, key=cpu, value=cpu"),
                _C.check_layer_qkv,
                *qkv(q, k, k, dev_type=2),
            ),
            bad(
                "check_layer_qkv dtypes match",
                ValueError,
                ("Paged attention Q/K/V dtypes must match; got torch.float32, torch.float64, torch.float32"),
                _C.check_layer_qkv,
                *qkv(q, k.double(), k),
            ),
            bad(
                "check_layer_qkv model dtype",
                ValueError,
                (
                    "Paged attention Q/K/V dtype must match model activation dtype torch.float16; got "
                    "torch.float32"
                ),
                _C.check_layer_qkv,
                *qkv(q, k, k, want_code=_C.DTYPE_FLOAT16, want=torch.float16),
            ),
            bad(
                "check_layer_qkv not tensor",
                TypeError,
                ("prepare_layer_context(): query must be a torch.Tensor, got str"),
                _C.check_layer_qkv,
                *qkv("q", k, k),
            ),
            bad(
                "check_layer_qkv meta",
                ValueError,
                "Paged attention Q/K/V must be on cpu; got query=meta, key=cpu, value=cpu",
                _C.check_layer_qkv,
                *qkv(q.to("meta"), k, k),
                slow=True,
            ),
            bad(
                "check_layer_qkv int arg",
                TypeError,
                "prepare_layer_context(): num_heads must be an int, got 'x'",
                _C.check_layer_qkv,
                *qkv(q, k, k, heads="x"),
            ),
            bad(
                "check_layer_qkv lens",
                TypeError,
                "prepare_layer_context(): query_lens must be a sequence, got 5",
                _C.check_layer_qkv,
                *qkv(qb, kb, kb, lens=5),
            ),
            bad(
                "check_layer_qkv nargs",
                TypeError,
                "check_layer_qkv() takes 14 arguments, got 1",
                _C.check_layer_qkv,
                q,
            ),
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
            bad(
                "check_batch_rows no rows",
                ValueError,
                ("Paged attention batch must contain at least one row"),
                _C.check_batch_rows,
                (),
                False,
                4,
            ),
            bad(
                "check_batch_rows active forward",
                RuntimeError,
                ("Cannot prepare paged attention metadata during an active forward"),
                _C.check_batch_rows,
                rb.rows,
                True,
                4,
            ),
            bad(
                "check_batch_rows too many rows",
                ValueError,
                "Paged attention batch has 2 rows; Worker capacity is 1",
                _C.check_batch_rows,
                rb.rows,
                False,
                1,
            ),
            bad(
                "check_batch_rows duplicate identities",
                ValueError,
                ("Paged attention batch contains duplicate row identities"),
                _C.check_batch_rows,
                (rb.ra, rb.ra),
                False,
                4,
            ),
            bad(
                "check_batch_rows no identity",
                AttributeError,
                "'object' object has no attribute 'identity'",
                _C.check_batch_rows,
                (object(),),
                0,
                4,
            ),
            bad(
                "check_batch_rows unsized",
                TypeError,
                "object of type 'int' has no len()",
                _C.check_batch_rows,
                5,
                False,
                4,
            ),
        ],
        "check_batch_bindings": [
            ok("check_batch_bindings ok", _C.check_batch_bindings, *bind()),
            bad(
                "check_batch_bindings count",
                ValueError,
                "check_batch_bindings(): bindings must have one entry per row (2), got 1",
                _C.check_batch_bindings,
                *bind(bindings=rb.bindings[:1]),
            ),
            bad(
                "check_batch_bindings same worker row",
                ValueError,
                "Paged attention batch resolves multiple inputs to the same Worker row",
                _C.check_batch_bindings,
                *bind(bindings=(B(0, 4), B(0, 4))),
            ),
            bad(
                "check_batch_bindings invalid capacity",
                ValueError,
                "Paged attention row ('b', 1, None) resolved to invalid logical capacity 'x'",
                _C.check_batch_bindings,
                *bind(bindings=(B(0, 4), B(1, "x"))),
            ),
            bad(
                "check_batch_bindings over capacity",
                ValueError,
                (
                    "Paged attention row ('b', 1, None) uses seq_len=2, but its installed allocation "
                    "has logical length 1"
                ),
                _C.check_batch_bindings,
                *bind(bindings=(B(0, 4), B(1, 1))),
            ),
            bad(
                "check_batch_bindings decode rows first",
                ValueError,
                (
                    "Causal paged attention rows must place native decode/short-query rows before "
                    "prefill/long-query rows (decode threshold=1)"
                ),
                _C.check_batch_bindings,
                *bind(rows=decode_last, threshold=1),
            ),
            bad(
                "check_batch_bindings invalid worker row",
                ValueError,
                "Paged attention row ('b', 1, None) resolved to invalid Worker row 7",
                _C.check_batch_bindings,
                *bind(bindings=(B(0, 4), B(7, 4))),
            ),
            bad(
                "check_batch_bindings too few blocks",
                ValueError,
                (
                    "Paged attention row ('b', 1, None) requires 1 blocks in cache group 0 for "
                    "seq_len=2, but its installed Worker row contains only 0 blocks"
                ),
                _C.check_batch_bindings,
                *bind(nbt=nb_short),
            ),
            bad(
                "check_batch_bindings too many tokens",
                ValueError,
                "Paged attention batch has 4 tokens; Worker capacity is 3",
                _C.check_batch_bindings,
                *bind(max_tokens=3),
            ),
            bad(
                "check_batch_bindings block_sizes",
                TypeError,
                "check_batch_bindings(): block_sizes must be a sequence of ints, got 'x'",
                _C.check_batch_bindings,
                *bind(block_sizes=("x",)),
            ),
            bad(
                "check_batch_bindings cp",
                ValueError,
                "check_batch_bindings(): cp_size must be positive, got 0",
                _C.check_batch_bindings,
                *bind(cp=0),
            ),
            bad(
                "check_batch_bindings num_blocks dtype",
                TypeError,
                "check_batch_bindings(): num_blocks must be int32 or int64, got float32",
                _C.check_batch_bindings,
                *bind(nbt=nb.float()),
            ),
            bad(
                "check_batch_bindings num_blocks shape",
                ValueError,
                ("check_batch_bindings(): num_blocks must have shape [>= 1 groups, >= 2 rows], got [1, 1]"),
                _C.check_batch_bindings,
                *bind(nbt=nb[:, :1]),
            ),
            bad(
                "check_batch_bindings no row_index",
                AttributeError,
                "'object' object has no attribute 'row_index'",
                _C.check_batch_bindings,
                *bind(bindings=(B(0, 4), object())),
            ),
        ],
        "build_batch": [
            ok("build_batch ok", _C.build_batch, rb.rows, [0, 1], ri_out, qsl_out, sl_out, pos_out),
            bad(
                "build_batch row_indices count",
                ValueError,
                "build_batch(): row_indices must have 2 entries, got 1",
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
                "build_batch(): row_indices_out must be int32, got int64",
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
                "build_batch(): positions_out must have at least 4 entries, got 3",
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
                (
                    "build_batch(): row 1 must fit int32 metadata (query_len 2, seq_len 2, tokens so "
                    "far 2, row index 1099511627776)"
                ),
                _C.build_batch,
                rb.rows,
                [0, 2**40],
                ri_out,
                qsl_out,
                sl_out,
                pos_out,
            ),
            bad(
                # 1 + (2^63 - 1) tokens wrapped int64 and passed as a negative total
                "build_batch tokens past int64",
                ValueError,
                (
                    "build_batch(): row 1 must fit int32 metadata (query_len 9223372036854775807, "
                    "seq_len 0, tokens so far 1, row index 1)"
                ),
                _C.build_batch,
                (
                    SimpleNamespace(query_len=1, seq_len=0, kv_start_pos=0),
                    SimpleNamespace(query_len=2**63 - 1, seq_len=0, kv_start_pos=0),
                ),
                [0, 1],
                ri_out,
                qsl_out,
                sl_out,
                pos_out,
            ),
            bad(
                "build_batch rows",
                TypeError,
                "build_batch(): rows must be a sequence, got 5",
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
                (
                    "dcp_local_seq_lens(): cp_size must be >= 1, cp_rank in [0, cp_size) and "
                    "cp_interleave >= 1, got 2, 2, 1"
                ),
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
                "dcp_local_seq_lens(): out must have at least 2 entries, got 1",
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
                "dcp_local_seq_lens(): seq_lens must be int32, got int64",
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
                "dcp_local_seq_lens(): cp_size must be an int, got '2'",
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
                "BlockTables.append_block_ids(): row must be in [0, 2), got 5",
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
                (
                    "BlockTables.append_block_ids(): block ids must be < 8 (8 kernel blocks, 1 per "
                    "block), got 9"
                ),
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
                (
                    "BlockTables.append_block_ids(): block ids must fit in the 4 free kernel-block "
                    "columns of row 0 (1 per block), got 5 ids"
                ),
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
                "BlockTables.append_block_ids(): block_ids must be a sequence, got 5",
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
                "BlockTables.append_block_ids(): block_ids must be a sequence of ints, got 'a'",
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
                ("BlockTables.append_block_ids(): block_ids must fit in int64, got 1180591620717411303424"),
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
                "BlockTables.append_block_ids(): counts must be int32, got int64",
                _C.table_append,
                table,
                counts.long(),
                0,
                ids,
                1,
                8,
                True,
            ),
            bad(
                "table_append nargs",
                TypeError,
                ("BlockTables.append_block_ids() takes 7 arguments, got 1"),
                _C.table_append,
                table,
            ),
        ],
        "gather_block_tables": [
            ok("gather_block_tables ok", _C.gather_block_tables, table, counts, ri, out, 2),
            bad(
                "gather_block_tables cols",
                ValueError,
                "BlockTables.gather_block_tables(): out must have 4 columns, got 3",
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
                "gather_block_tables(): row_indices[0] must be in [0, 2), got 5",
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
                (
                    "gather_block_tables(): num_reqs_padded must be in [1, 2] (batch rows to output "
                    "rows), got 9"
                ),
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
                "BlockTables.gather_block_tables(): row_indices must be int32, got int64",
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
                (
                    "BlockTables.compute_slot_mappings(): block_size >= 1, cp_size >= 1, cp_rank in "
                    "[0, cp_size) and cp_interleave >= 1 required, got 0, 1, 0, 1"
                ),
                _C.compute_slot_mappings,
                *slot_args(bs=0),
            ),
            bad(
                "compute_slot_mappings out",
                ValueError,
                (
                    "BlockTables.compute_slot_mappings(): need 0 <= num_tokens (2) <= "
                    "num_tokens_padded (9), positions with >= num_tokens entries (2) and out with >= "
                    "num_tokens_padded entries (4)"
                ),
                _C.compute_slot_mappings,
                *slot_args(padded=9),
            ),
            bad(
                "compute_slot_mappings block index",
                ValueError,
                (
                    "compute_slot_mappings(): block index 50 of batch row 0 (table row 0) must be < 4 "
                    "table columns, got position 100"
                ),
                _C.compute_slot_mappings,
                *slot_args(p=torch.tensor([0, 100], dtype=I64)),
            ),
            bad(
                "compute_slot_mappings end",
                ValueError,
                ("BlockTables.compute_slot_mappings(): query_start_loc must end at num_tokens (2), got 1"),
                _C.compute_slot_mappings,
                *slot_args(q=torch.tensor([0, 1], dtype=I32)),
            ),
            bad(
                "compute_slot_mappings rank",
                ValueError,
                (
                    "BlockTables.compute_slot_mappings(): block_size >= 1, cp_size >= 1, cp_rank in "
                    "[0, cp_size) and cp_interleave >= 1 required, got 2, 1, 1, 1"
                ),
                _C.compute_slot_mappings,
                *slot_args(rank=1),
            ),
            bad(
                "compute_slot_mappings dtype",
                TypeError,
                "BlockTables.compute_slot_mappings(): table must be int32, got int64",
                _C.compute_slot_mappings,
                *slot_args(t=table.long()),
            ),
        ],
        "pool_init": [
            ok("pool_init ok", _C.pool_init, *pool),
            bad(
                "pool_init dtype",
                TypeError,
                "BlockPool(): state must be int64, got int32",
                _C.pool_init,
                free_stack,
                free_stack,
                in_use,
            ),
            bad(
                "pool_init size",
                ValueError,
                "BlockPool(): in_use must have 4 entries, got 2",
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
                "BlockPool.allocate(): n must be at most the number of free blocks (4), got 5",
                _C.pool_allocate,
                *pool,
                5,
            ),
            bad(
                "pool_allocate huge",
                RuntimeError,
                (
                    "BlockPool.allocate(): n must be at most the number of free blocks (4), got "
                    "9223372036854775807"
                ),
                _C.pool_allocate,
                *pool,
                HUGE,
            ),
            bad(
                "pool_allocate negative",
                ValueError,
                ("BlockPool.allocate(): n must be non-negative, got -1"),
                _C.pool_allocate,
                *pool,
                -1,
            ),
            bad(
                "pool_allocate bool",
                TypeError,
                ("BlockPool.allocate(): n must be an int, got True"),
                _C.pool_allocate,
                *pool,
                True,
            ),
        ],
        "pool_free": [
            bad(
                "pool_free range",
                ValueError,
                ("BlockPool.free(): block id must be in [0, 4), got 9"),
                _C.pool_free,
                *pool,
                [9],
            ),
            bad(
                "pool_free double",
                ValueError,
                ("BlockPool.free(): block id 0 is not allocated (double free?)"),
                _C.pool_free,
                *pool,
                [0],
            ),
            bad(
                "pool_free type",
                TypeError,
                ("BlockPool.free(): block_ids must be a sequence of ints, got 'x'"),
                _C.pool_free,
                *pool,
                ["x"],
            ),
            bad(
                "pool_free not sequence",
                TypeError,
                ("BlockPool.free(): block_ids must be a sequence, got 5"),
                _C.pool_free,
                *pool,
                5,
            ),
            bad(
                # a zero-stride view of 2^40 elements: measured, never iterated (the long fuzz
                # profile's find: iterating it exhausted the memory)
                "pool_free huge tensor",
                ValueError,
                "BlockPool.free(): block_ids must have at most 16777216 entries, got 1099511627776",
                _C.pool_free,
                *pool,
                torch.zeros(1, dtype=I64).expand(2**40),
            ),
            bad(
                "pool_free range past ssize_t",
                ValueError,
                "BlockPool.free(): block_ids must have at most 16777216 entries, got more",
                _C.pool_free,
                *pool,
                range(2**70),
            ),
            bad(
                "pool_free state",
                ValueError,
                "BlockPool.free(): in_use must have 4 entries, got 1",
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
            bad(
                "build_plan rows",
                ValueError,
                ("Paged piecewise inputs must have one entry per row"),
                _C.build_plan,
                *plan(offsets=()),
            ),
            bad(
                "build_plan spans",
                ValueError,
                "Paged piecewise spans must be sorted, non-overlapping, and within the sequence",
                _C.build_plan,
                *plan(sp=([(3, 4), (1, 2)],)),
            ),
            bad(
                "build_plan pair",
                ValueError,
                ("build_paged_piecewise_plan(): each span must be a (start, end) pair, got (1, 2, 3)"),
                _C.build_plan,
                *plan(sp=([(1, 2, 3)],)),
            ),
            bad(
                "build_plan element",
                ValueError,
                "invalid literal for int() with base 10: 'x'",
                _C.build_plan,
                *plan(sp=([("x", 2)],)),
            ),
            bad(
                "build_plan row type",
                TypeError,
                ("build_paged_piecewise_plan(): full_attn_spans row must be a sequence, got 5"),
                _C.build_plan,
                *plan(sp=(5,)),
            ),
            bad(
                "build_plan query range",
                ValueError,
                "Paged piecewise query range must be within the sequence",
                _C.build_plan,
                *plan(lens=(5,), kl=None, qi=None),
            ),
            bad(
                "build_plan limits short",
                ValueError,
                ("build_paged_piecewise_plan(): key_limits_out must have at least 4 entries, got 2"),
                _C.build_plan,
                *plan(kl=limits[:2]),
            ),
            bad(
                "build_plan limits dtype",
                TypeError,
                "build_paged_piecewise_plan(): key_limits_out must be int32, got int64",
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
    cache8 = torch.zeros(2, NB, BS, HKV, D, dtype=torch.float8_e4m3fn)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([2.0])
    shared = torch.zeros(cache8.numel() + 4, dtype=torch.uint8)  # a scale inside the cache's bytes
    cache8_shared = shared[: cache8.numel()].view(torch.float8_e4m3fn).view(cache8.shape)
    scale_in_cache = shared[cache8.numel() - 4 :].view(torch.float32)[:1]
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

    quant_out = torch.empty(3, HKV, D, dtype=F8)

    def quant(k=dense_k, v=dense_v, ko=None, vo=None, sc=None, joint=False, jk=None, jo=None):
        ko = torch.empty(3, HKV, D, dtype=F8) if ko is None else ko
        vo = torch.empty(3, HKV, D, dtype=F8) if vo is None else vo
        sc = torch.empty(2) if sc is None else sc
        if not joint:
            return (k, v, ko, vo, sc, None, None, None, None)
        jk = dense_k[:2].clone() if jk is None else jk
        jv = dense_v[: jk.shape[0]].clone()
        out2 = [torch.empty(jk.shape[0], HKV, D, dtype=F8) for _ in range(2)] if jo is None else jo
        return (k, v, ko, vo, sc, jk, jv, *out2)

    # the dense fp8 forward's joint layout: 3 batch rows of one joint key then one key in one
    # buffer, K's and V's; rows of a [B, S] view 2 rows apart, the main rows at odd positions
    rows_buf = torch.empty(2, 3, 2, HKV, D, dtype=F8)
    rows_main = (rows_buf[0, :, 1:], rows_buf[1, :, 1:])
    rows_joint = [rows_buf[0, :, :1], rows_buf[1, :, :1]]

    rows_flat = torch.empty(2, 10, HKV, D, dtype=F8)

    def rows_at(i: int, first: int) -> torch.Tensor:
        """A [3, 1] view of rows first, first + 2, first + 4 of rows_flat[i] (K's or V's)."""
        return rows_flat[i].as_strided(
            (3, 1, HKV, D), (2 * HKV * D, HKV * D, D, 1), rows_flat[i].storage_offset() + first * HKV * D
        )

    def fwd(k=key, v=value, sm=slots, b=bt, mask=_C.MASK_CAUSAL, kl=None, o=out, c=cache):
        return (q, k, v, c, sm, b, qsl, sl, kl, mask, 0.5, o, b, qsl, sl)

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
                (
                    "kv_write(): slot_mapping[1] must be < num_blocks * block_size = 6 (or < 0 to "
                    "skip), got 99"
                ),
                _C.kv_write,
                key,
                value,
                cache,
                torch.tensor([4, 99], dtype=I64),
            ),
            bad(
                "kv_write value shape",
                ValueError,
                ("kv_write(): value must have the shape of key [2, 1, 2], got [1, 1, 2]"),
                _C.kv_write,
                key,
                value[:1],
                cache,
                slots,
            ),
            bad(
                "kv_write cache shape",
                ValueError,
                (
                    "kv_write(): kv_cache must have shape [2, num_blocks, block_size, 1, 2], got [1, "
                    "3, 2, 1, 2]"
                ),
                _C.kv_write,
                key,
                value,
                cache[:1],
                slots,
            ),
            bad(
                "kv_write slot dtype",
                TypeError,
                "kv_write(): slot_mapping must be int64, got int32",
                _C.kv_write,
                key,
                value,
                cache,
                slots.int(),
            ),
            bad(
                "kv_write slot short",
                ValueError,
                ("kv_write(): slot_mapping must have at least 2 entries, got 1"),
                _C.kv_write,
                key,
                value,
                cache,
                slots[:1],
            ),
            bad(
                "kv_write key dtype",
                TypeError,
                "kv_write(): key must be float32, float16 or bfloat16, got int64",
                _C.kv_write,
                slots.view(2, 1, 1),
                value,
                cache,
                slots,
            ),
            bad(
                "kv_write not tensor",
                TypeError,
                ("kv_write(): kv_cache must be a torch.Tensor, got NoneType"),
                _C.kv_write,
                key,
                value,
                None,
                slots,
            ),
            # the quantizing write into a float8_e4m3fn cache
            ok("kv_write fp8", _C.kv_write, key, value, cache8, slots, k_scale, v_scale),
            ok("kv_write scales none", _C.kv_write, key, value, cache, slots, None, None),
            *[
                bad(
                    "kv_write fp8 " + name,
                    exc,
                    "kv_write(): " + message,
                    _C.kv_write,
                    key,
                    value,
                    c,
                    slots,
                    *sc,
                )
                for name, exc, message, c, sc in (
                    ("no scales", TypeError, f"{_NEEDS_SCALES}neither", cache8, ()),
                    ("no k_scale", TypeError, f"{_NEEDS_SCALES}no k_scale", cache8, (None, v_scale)),
                    ("no v_scale", TypeError, f"{_NEEDS_SCALES}no v_scale", cache8, (k_scale, None)),
                    (
                        "scales unquantized",
                        ValueError,
                        "k_scale and v_scale apply to a float8_e4m3fn kv_cache only; kv_cache is float32",
                        cache,
                        (k_scale, v_scale),
                    ),
                    (
                        "k_scale 0",
                        ValueError,
                        "k_scale must be finite and positive, got k_scale[0] = 0.0",
                        cache8,
                        (torch.zeros(1), v_scale),
                    ),
                    (
                        "k_scale negative",
                        ValueError,
                        "k_scale must be finite and positive, got k_scale[0] = -1.0",
                        cache8,
                        (-torch.ones(1), v_scale),
                    ),
                    (
                        "v_scale nan",
                        ValueError,
                        "v_scale must be finite and positive, got v_scale[0] = nan",
                        cache8,
                        (k_scale, torch.full((1,), float("nan"))),
                    ),
                    (
                        "k_scale inf",
                        ValueError,
                        "k_scale must be finite and positive, got k_scale[0] = inf",
                        cache8,
                        (torch.full((1,), float("inf")), v_scale),
                    ),
                    (
                        "k_scale float64",
                        TypeError,
                        "k_scale must be float32, got float64",
                        cache8,
                        (k_scale.double(), v_scale),
                    ),
                    (
                        "k_scale entries",
                        ValueError,
                        "k_scale must have 1 (per tensor) or num_kv_heads = 1 (per KV head) entries, got 2",
                        cache8,
                        (torch.ones(2), v_scale),
                    ),
                    (
                        "k_scale 2-D",
                        ValueError,
                        "k_scale must be 1-D, got 2 dimensions",
                        cache8,
                        (k_scale.view(1, 1), v_scale),
                    ),
                    (
                        "k_scale float",
                        TypeError,
                        "k_scale must be a torch.Tensor, got float",
                        cache8,
                        (0.5, v_scale),
                    ),
                    (
                        "e5m2 cache",
                        TypeError,
                        "kv_cache must be float32 (the key's dtype) or float8_e4m3fn, got unsupported dtype",
                        cache8.to(torch.float8_e5m2),
                        (k_scale, v_scale),
                    ),
                )
            ],  # fmt: skip
            bad(
                "kv_write fp8 key",
                TypeError,
                "kv_write(): key must be float32, float16 or bfloat16, got float8_e4m3fn",
                _C.kv_write,
                key.to(torch.float8_e4m3fn),
                value.to(torch.float8_e4m3fn),
                cache8,
                slots,
                k_scale,
                v_scale,
            ),
            bad(
                "kv_write fp8 scale overlaps cache",
                ValueError,
                "kv_write(): kv_cache must not overlap v_scale in memory, got views sharing bytes",
                _C.kv_write,
                key,
                value,
                cache8_shared,
                slots,
                k_scale,
                scale_in_cache,
            ),
            bad(
                "kv_write 5 arguments",
                TypeError,
                "kv_write() takes 4 or 6 arguments, got 5",
                _C.kv_write,
                key,
                value,
                cache8,
                slots,
                k_scale,
            ),
        ],
        "paged_attention": [
            ok("paged_attention none", _C.paged_attention, *attn()),
            ok("paged_attention fp8", _C.paged_attention, *attn(c=cache8), k_scale, v_scale),
            ok("paged_attention scales none", _C.paged_attention, *attn(), None, None),
            bad(
                "paged_attention fp8 no scales",
                TypeError,
                "paged_attention(): " + _NEEDS_SCALES + "neither",
                _C.paged_attention,
                *attn(c=cache8),
            ),
            bad(
                "paged_attention scales unquantized",
                ValueError,
                "paged_attention(): k_scale and v_scale apply to a float8_e4m3fn kv_cache only; kv_cache is "
                "float32",
                _C.paged_attention,
                *attn(),
                k_scale,
                v_scale,
            ),
            bad(
                "paged_attention fp8 v_scale 0",
                ValueError,
                "paged_attention(): v_scale must be finite and positive, got v_scale[0] = 0.0",
                _C.paged_attention,
                *attn(c=cache8),
                k_scale,
                torch.zeros(1),
            ),
            bad(
                "paged_attention 13 arguments",
                TypeError,
                "paged_attention() takes 12 or 14 arguments, got 13",
                _C.paged_attention,
                *attn(c=cache8),
                k_scale,
            ),
            ok("paged_attention causal", _C.paged_attention, *attn(mask=_C.MASK_CAUSAL)),
            ok("paged_attention limits", _C.paged_attention, *attn(kl=limits, mask=_C.MASK_LIMITS)),
            bad(
                "paged_attention mask",
                ValueError,
                ("paged_attention(): mask must be 0 (none), 1 (causal) or 2 (limits), got 7"),
                _C.paged_attention,
                *attn(mask=7),
            ),
            bad(
                "paged_attention scale",
                ValueError,
                ("paged_attention(): scale must be a positive finite float, got -1.0"),
                _C.paged_attention,
                *attn(scale=-1.0),
            ),
            bad(
                "paged_attention scale type",
                TypeError,
                "must be real number, not str",
                _C.paged_attention,
                *attn(scale="x"),
            ),
            bad(
                "paged_attention block id",
                ValueError,
                ("paged_attention(): block_table[0][0] must be in [0, num_blocks=3), got 5"),
                _C.paged_attention,
                *attn(b=bt_bad),
            ),
            bad(
                "paged_attention seq_len",
                ValueError,
                (
                    "paged_attention(): seq_lens[0] must be in [0, 4] (block_table columns * "
                    "block_size), got 5"
                ),
                _C.paged_attention,
                *attn(s=sl_bad),
            ),
            bad(
                "paged_attention out",
                ValueError,
                ("paged_attention(): out must have shape [2, 2, 2], got [1, 2, 2]"),
                _C.paged_attention,
                *attn(o=out[:1]),
            ),
            bad(
                "paged_attention limits missing",
                ValueError,
                "paged_attention(): key_limits must be a tensor when mask is 2 (limits)",
                _C.paged_attention,
                *attn(mask=_C.MASK_LIMITS),
            ),
            bad(
                "paged_attention dtype",
                TypeError,
                "paged_attention(): kv_cache must be float32, got float16",
                _C.paged_attention,
                *attn(c=cache.half()),
            ),
            bad(
                "paged_attention not tensor",
                TypeError,
                ("paged_attention(): query must be a torch.Tensor, got list"),
                _C.paged_attention,
                *attn(query=[1]),
            ),
            bad(
                "paged_attention nargs",
                TypeError,
                "paged_attention() takes 12 or 14 arguments, got 1",
                _C.paged_attention,
                q,
            ),
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
                "paged_attention_lse(): mask must be 0 (none), 1 (causal) or 2 (limits), got 7",
                _C.paged_attention_lse,
                *attn_lse(mask=7),
            ),
            bad(
                "paged_attention_lse limits missing",
                ValueError,
                ("paged_attention_lse(): key_limits must be a tensor when mask is 2 (limits), got None"),
                _C.paged_attention_lse,
                *attn_lse(mask=_C.MASK_LIMITS),
            ),
            bad(
                "paged_attention_lse limits dtype",
                TypeError,
                "paged_attention_lse(): key_limits must be int32, got int64",
                _C.paged_attention_lse,
                *attn_lse(kl=slots, mask=_C.MASK_LIMITS),
            ),
            bad(
                "paged_attention_lse block id",
                ValueError,
                "paged_attention(): block_table[0][0] must be in [0, num_blocks=3), got 5",
                _C.paged_attention_lse,
                *attn_lse(b=bt_bad),
            ),
            bad(
                "paged_attention_lse lse dtype",
                TypeError,
                "paged_attention_lse(): lse_out must be float32, got float64",
                _C.paged_attention_lse,
                *attn_lse(lo=lse.double()),
            ),
            bad(
                "paged_attention_lse lse shape",
                ValueError,
                "paged_attention_lse(): lse_out must have shape [2, 2], got [1, 2]",
                _C.paged_attention_lse,
                *attn_lse(lo=lse[:1]),
            ),
            bad(
                "paged_attention_lse lse overlap",
                ValueError,
                ("paged_attention_lse(): lse_out must not overlap out in memory, got views sharing bytes"),
                _C.paged_attention_lse,
                *attn_lse(lo=out.view(-1)[: 2 * H].view(2, H)),
            ),
            bad(
                "paged_attention_lse not tensor",
                TypeError,
                "paged_attention_lse(): lse_out must be a torch.Tensor, got list",
                _C.paged_attention_lse,
                *attn_lse(lo=[1.0]),
            ),
            bad(
                "paged_attention_lse nargs",
                TypeError,
                ("paged_attention_lse() takes 13 arguments, got 1"),
                _C.paged_attention_lse,
                q,
            ),
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
                "dense_attention(): key_index[0][0] must be in [0, num_keys=3), got 7",
                _C.dense_attention,
                *dense(ki=torch.tensor([[7, 0, 1]], dtype=I32)),
            ),
            bad(
                "dense_attention value strides",
                ValueError,
                (
                    "dense_attention(): value must have the key's shape and strides, got shape [3, 1, "
                    "2] strides [4, 4, 1] for key shape [3, 1, 2] strides [2, 2, 1]"
                ),
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
                (
                    "dense_attention(): joint_key must have shape [num_joint, 1, 2] (joint_value: "
                    "joint_key's) and the key's strides [2, 2, 1], got shape [2, 1, 2] strides [4, 4, "
                    "1]"
                ),
                _C.dense_attention,
                *dense(jk=torch.randn(2, HKV, 2 * D)[:, :, :D], jv=dense_v[:2].clone()),
            ),
            bad(
                "dense_attention joint half",
                TypeError,
                ("dense_attention(): joint_key and joint_value must both be tensors or both be None"),
                _C.dense_attention,
                *dense(jk=dense_k[:2].clone()),
            ),
            bad(
                "dense_attention nargs",
                TypeError,
                "dense_attention() takes 18 or 20 arguments, got 1",
                _C.dense_attention,
                q,
            ),
            ok(
                "dense_attention fp8",
                _C.dense_attention,
                *dense(k=dense_k.to(torch.float8_e4m3fn), v=dense_v.to(torch.float8_e4m3fn)),
                k_scale,
                v_scale,
            ),
            bad(
                "dense_attention fp8 key without scales",
                TypeError,
                "dense_attention(): key must be float32, float16 or bfloat16, got float8_e4m3fn",
                _C.dense_attention,
                *dense(k=dense_k.to(torch.float8_e4m3fn), v=dense_v.to(torch.float8_e4m3fn)),
            ),
            bad(
                "dense_attention scales with an unquantized key",
                TypeError,
                "dense_attention(): key must be float8_e4m3fn, got float32",
                _C.dense_attention,
                *dense(),
                k_scale,
                v_scale,
            ),
            bad(
                "dense_attention fp8 bad scale",
                ValueError,
                "dense_attention(): v_scale must be finite and positive, got v_scale[0] = -1.0",
                _C.dense_attention,
                *dense(k=dense_k.to(torch.float8_e4m3fn), v=dense_v.to(torch.float8_e4m3fn)),
                k_scale,
                torch.tensor([-1.0]),
            ),
        ],
        "quantize_kv": [
            ok("quantize_kv", _C.quantize_kv, *quant()),
            ok("quantize_kv joint", _C.quantize_kv, *quant(joint=True)),
            bad(
                "quantize_kv nargs",
                TypeError,
                "quantize_kv() takes 9 arguments, got 1",
                _C.quantize_kv,
                dense_k,
            ),
            bad(
                "quantize_kv key dtype",
                TypeError,
                "quantize_kv(): key must be float32, float16 or bfloat16, got float8_e4m3fn",
                _C.quantize_kv,
                *quant(k=dense_k.to(F8)),
            ),
            bad(
                "quantize_kv value dtype",
                TypeError,
                "quantize_kv(): value must be float32, got float16",
                _C.quantize_kv,
                *quant(v=dense_v.half()),
            ),
            bad(
                "quantize_kv value shape",
                ValueError,
                "quantize_kv(): value must have shape [3, 1, 2], got [2, 1, 2]",
                _C.quantize_kv,
                *quant(v=dense_v[:2]),
            ),
            bad(
                "quantize_kv key_out dtype",
                TypeError,
                "quantize_kv(): key_out must be float8_e4m3fn, got float32",
                _C.quantize_kv,
                *quant(ko=torch.empty(3, HKV, D)),
            ),
            bad(
                "quantize_kv key_out shape",
                ValueError,
                "quantize_kv(): key_out must have shape [3, 1, 2], got [3, 1, 4]",
                _C.quantize_kv,
                *quant(ko=torch.empty(3, HKV, 2 * D, dtype=F8)),
            ),
            bad(
                "quantize_kv value_out strides",
                ValueError,
                "quantize_kv(): value_out must have key_out's strides [2, 2, 1], got [4, 4, 1]",
                _C.quantize_kv,
                *quant(vo=torch.empty(3, HKV, 2 * D, dtype=F8)[:, :, :D]),
            ),
            bad(
                "quantize_kv joint half",
                TypeError,
                (
                    "quantize_kv(): joint_key, joint_value, joint_key_out and joint_value_out must all be "
                    "tensors or all be None"
                ),
                _C.quantize_kv,
                *quant()[:5],
                dense_k[:2].clone(),
                None,
                None,
                None,
            ),
            bad(
                "quantize_kv joint heads",
                ValueError,
                "quantize_kv(): joint_key must have shape [num_joint, 1, 2], got [2, 1, 4]",
                _C.quantize_kv,
                *quant(joint=True, jk=torch.randn(2, HKV, 2 * D)),
            ),
            ok(
                "quantize_kv 4-d outputs",
                _C.quantize_kv,
                *quant(ko=torch.empty(1, 3, HKV, D, dtype=F8), vo=torch.empty(1, 3, HKV, D, dtype=F8)),
            ),
            ok(
                "quantize_kv joint rows of one buffer",
                _C.quantize_kv,
                *quant(
                    *rows_main[:0],
                    ko=rows_main[0],
                    vo=rows_main[1],
                    joint=True,
                    jk=dense_k.clone(),
                    jo=rows_joint,
                ),
            ),
            ok(
                "quantize_kv interleaved rows",
                _C.quantize_kv,
                *quant(
                    ko=rows_at(0, 1),
                    vo=rows_at(1, 1),
                    joint=True,
                    jk=dense_k.clone(),
                    jo=[rows_at(0, 2), rows_at(1, 2)],
                ),
            ),
            bad(
                "quantize_kv key_out 4-d shape",
                ValueError,
                (
                    "quantize_kv(): key_out must have shape [B, S, 1, 2] with B * S = 3 (key's tokens), "
                    "got [2, 2, 1, 2]"
                ),
                _C.quantize_kv,
                *quant(ko=torch.empty(2, 2, HKV, D, dtype=F8)),
            ),
            bad(
                "quantize_kv key_out rank",
                ValueError,
                "quantize_kv(): key_out must have 3 dimensions [tokens, Hkv, D] or 4 [B, S, Hkv, D], got 5",
                _C.quantize_kv,
                *quant(ko=torch.empty(1, 1, 3, HKV, D, dtype=F8)),
            ),
            bad(
                "quantize_kv value_out 4-d shape",
                ValueError,
                "quantize_kv(): value_out must have key_out's shape [1, 3, 1, 2], got [3, 1, 1, 2]",
                _C.quantize_kv,
                *quant(ko=torch.empty(1, 3, HKV, D, dtype=F8), vo=torch.empty(3, 1, HKV, D, dtype=F8)),
            ),
            bad(
                "quantize_kv value_out 4-d beside a 3-d key_out",
                ValueError,
                "quantize_kv(): value_out must have key_out's shape [3, 1, 2], got [1, 3, 1, 2]",
                _C.quantize_kv,
                *quant(vo=torch.empty(1, 3, HKV, D, dtype=F8)),
            ),
            bad(
                "quantize_kv value_out 3-d beside a 4-d key_out",
                ValueError,
                "quantize_kv(): value_out must have key_out's shape [1, 3, 1, 2], got [3, 1, 2]",
                _C.quantize_kv,
                *quant(ko=torch.empty(1, 3, HKV, D, dtype=F8)),
            ),
            bad(
                "quantize_kv joint rows on the main rows",
                ValueError,
                "quantize_kv(): key_out must not overlap joint_key_out in memory, got views sharing bytes",
                _C.quantize_kv,
                *quant(
                    ko=rows_main[0],
                    vo=rows_main[1],
                    joint=True,
                    jk=dense_k.clone(),
                    jo=[rows_buf[0, :, 1:], rows_buf[1, :, :1]],
                ),
            ),
            bad(
                "quantize_kv joint rows reaching the next batch row's",
                ValueError,
                "quantize_kv(): key_out must not overlap joint_key_out in memory, got views sharing bytes",
                _C.quantize_kv,
                *quant(
                    ko=rows_at(0, 1),
                    vo=rows_at(1, 1),
                    joint=True,
                    jk=dense_k.clone(),
                    jo=[rows_at(0, 3), rows_at(1, 3)],
                ),
            ),
            bad(
                "quantize_kv joint value rows on the main value rows",
                ValueError,
                (
                    "quantize_kv(): value_out must not overlap joint_value_out in memory, got views "
                    "sharing bytes"
                ),
                _C.quantize_kv,
                *quant(
                    ko=rows_main[0],
                    vo=rows_main[1],
                    joint=True,
                    jk=dense_k.clone(),
                    jo=[rows_joint[0], rows_buf[1, :, 1:]],
                ),
            ),
            bad(
                "quantize_kv scales dtype",
                TypeError,
                "quantize_kv(): scales must be float32, got float64",
                _C.quantize_kv,
                *quant(sc=torch.empty(2, dtype=torch.float64)),
            ),
            bad(
                "quantize_kv scales length",
                ValueError,
                "quantize_kv(): scales must have 2 entries, got 1",
                _C.quantize_kv,
                *quant(sc=torch.empty(1)),
            ),
            bad(
                "quantize_kv outputs overlap",
                ValueError,
                "quantize_kv(): key_out must not overlap value_out in memory, got views sharing bytes",
                _C.quantize_kv,
                *quant(ko=quant_out, vo=quant_out),
            ),
            bad(
                "quantize_kv scales inside the key",
                ValueError,
                "quantize_kv(): scales must not overlap key in memory, got views sharing bytes",
                _C.quantize_kv,
                *quant(sc=dense_k.view(-1)[:2]),
            ),
        ],
        "forward_paged": [
            ok("forward_paged causal", _C.forward_paged, *fwd()),
            ok("forward_paged fp8", _C.forward_paged, *fwd(c=cache8), k_scale, v_scale),
            ok("forward_paged scales none", _C.forward_paged, *fwd(), None, None),
            bad(
                "forward_paged fp8 no scales",
                TypeError,
                "forward_paged(): " + _NEEDS_SCALES + "neither",
                _C.forward_paged,
                *fwd(c=cache8),
            ),
            bad(
                "forward_paged fp8 k_scale nan",
                ValueError,
                "forward_paged(): k_scale must be finite and positive, got k_scale[0] = nan",
                _C.forward_paged,
                *fwd(c=cache8),
                torch.full((1,), float("nan")),
                v_scale,
            ),
            ok("forward_paged limits", _C.forward_paged, *fwd(mask=_C.MASK_LIMITS, kl=limits)),
            ok("forward_paged flat out", _C.forward_paged, *fwd(o=out.reshape(out.shape[0], -1))),
            bad(
                "forward_paged flat out width",
                ValueError,
                "forward_paged(): out must have 3 dimensions, got 2",
                _C.forward_paged,
                *fwd(o=torch.empty(out.shape[0], out.shape[1] * out.shape[2] + 1)),
            ),
            bad(
                "forward_paged tokens",
                ValueError,
                "forward_paged(): key must have one token per query token (2), got 1",
                _C.forward_paged,
                *fwd(k=key[:1], v=value[:1]),
            ),
            bad(
                "forward_paged slot",
                ValueError,
                (
                    "kv_write(): slot_mapping[1] must be < num_blocks * block_size = 6 (or < 0 to "
                    "skip), got 99"
                ),
                _C.forward_paged,
                *fwd(sm=torch.tensor([4, 99], dtype=I64)),
            ),
            bad(
                "forward_paged block id",
                ValueError,
                ("paged_attention(): block_table[0][0] must be in [0, num_blocks=3), got 5"),
                _C.forward_paged,
                *fwd(b=bt_bad),
            ),
            bad(
                "forward_paged nargs",
                TypeError,
                "forward_paged() takes 15 or 17 arguments, got 1",
                _C.forward_paged,
                q,
            ),
        ],
        "rows_gather": [
            ok("rows_gather ok", _C.rows_gather, src, gather_index, gathered),
            bad(
                "rows_gather index",
                ValueError,
                ("rows_gather(): index[0] must be in [0, src tokens=3), got 5"),
                _C.rows_gather,
                src,
                bad_index,
                gathered,
            ),
            bad(
                "rows_gather count",
                ValueError,
                "rows_gather(): index must have 2 entries, got 1",
                _C.rows_gather,
                src,
                gather_index[:1],
                gathered,
            ),
            bad(
                "rows_gather dims",
                ValueError,
                "rows_gather(): dst must have [2, 2] trailing dims, got [1, 2]",
                _C.rows_gather,
                src,
                gather_index,
                gathered[:, :1],
            ),
            bad(
                "rows_gather dtype",
                TypeError,
                "rows_gather(): index must be int64, got int32",
                _C.rows_gather,
                src,
                gather_index.int(),
                gathered,
            ),
        ],
        "rows_scatter": [
            ok("rows_scatter ok", _C.rows_scatter, scatter_src, scatter_index, scattered),
            bad(
                "rows_scatter index",
                ValueError,
                ("rows_scatter(): index[0] must be in [0, dst tokens=3), got 5"),
                _C.rows_scatter,
                scatter_src,
                bad_index,
                scattered,
            ),
            bad(
                "rows_scatter count",
                ValueError,
                "rows_scatter(): index must have 2 entries, got 1",
                _C.rows_scatter,
                scatter_src,
                scatter_index[:1],
                scattered,
            ),
            bad(
                "rows_scatter dtype",
                TypeError,
                "rows_scatter(): dst must be float32, got float16",
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
                (
                    "new_with_slots(): arguments must be a class, a tuple of n descriptors and n "
                    "values, got 3 arguments"
                ),
                _C.new_with_slots,
                context,
                fields,
                t,
            ),
            bad(
                "new_with_slots not a class",
                TypeError,
                ("new_with_slots(): cls must be a Python class that object.__new__ creates, got 3"),
                _C.new_with_slots,
                3,
                (),
            ),
            bad(
                "new_with_slots C class",
                TypeError,
                (
                    "new_with_slots(): cls must be a Python class that object.__new__ creates, got "
                    "<class 'torch.Tensor'>"
                ),
                _C.new_with_slots,
                torch.Tensor,
                (),
            ),
            bad(
                "new_with_slots int class",
                TypeError,
                "new_with_slots(): cls must be a Python class that object.__new__ creates, got <class 'int'>",
                _C.new_with_slots,
                int,
                (),
            ),
            bad(
                "new_with_slots name for a descriptor",
                TypeError,
                "new_with_slots(): descriptors[0] must be a data descriptor, got 'layer'",
                _C.new_with_slots,
                context,
                ("layer",),
                t,
            ),
            bad(
                "new_with_slots another class's descriptor",
                TypeError,
                (
                    "descriptor 'layer' for 'DiffusionPagedAttentionContext' objects doesn't apply to a "
                    "'DiffusionPagedAttentionRow' object"
                ),
                _C.new_with_slots,
                diffkv.DiffusionPagedAttentionRow,
                (fields[0],),
                t,
            ),
            bad(
                "new_with_slots not a descriptor",
                TypeError,
                "new_with_slots(): descriptors[1] must be a data descriptor, got 3",
                _C.new_with_slots,
                context,
                (fields[0], 3),
                t,
                t,
            ),
            bad(
                "new_with_slots __set__ raises",
                AttributeError,
                "property of 'DiffusionPagedAttentionContext' object has no setter",
                _C.new_with_slots,
                context,
                (fields[0], *read_only),
                t,
                t,
            ),
        ],
    }


def all_cases() -> dict[str, list[Case]]:
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


# ------------------------------------------------------------------------------------------------
# The public methods: the same Case shape, over an adapter (and an activation) a builder sets up
# ------------------------------------------------------------------------------------------------
#
# ``public_cases(device)`` maps each public entry point (the layer adapter's and the adapter's
# constructors, prepare_batch, invalidate_prepared_batches, activate, prepare_layer_context,
# get_attn_backend, forward_paged, and the standalone collaborators of the section at the end:
# rows, request metadata, the piecewise planner, the runtime, configs and specs, BlockTables,
# BlockPool, KV cache allocation, the metadata builders, DiffKVAttentionImpl(...)) to its
# failing cases, one per rule of vLLM-Omni's adapter and one per "checked before" ordering.
# A case's ``fn`` calls the entry point with ``args`` (so the leak test tracks the arguments);
# a case that needs an active batch gets an ``fn`` that enters ``adapter.activate(batch)``
# around the call and leaves it again, so every case can be repeated.  ``case.env`` is the
# ``make_adapter`` namespace a case was built over (None for constructor cases that need none;
# for a collaborator, the object whose state a refusal must leave), for the side-effect checks
# of test_adapter_errors.py and the collaborators' test files.  The adapter's
# ``resolve_row`` does not record its calls (the leak test repeats the cases); a test that wants
# the record sets ``env.adapter.resolve_row = env.resolver``.
#
# Messages a test spells elsewhere (test_fuzz's random calls) are the constants below.

ACTIVE_FORWARD_PREPARE = "Cannot prepare paged attention metadata during an active forward"
ACTIVE_FORWARD_INVALIDATE = "Cannot change paged attention BlockTables during an active forward"
STALE_BATCH = "Prepared paged attention batch is stale after a newer batch preparation"


def negative_bit_view_message(entry: str, name: str) -> str:
    """The bridge's refusal of a negative-bit view (torch._neg_view) passed as ``name``."""
    return (
        f"{entry}(): {name} must not be a negative-bit view (DLPack cannot express it), got one; "
        f"pass {name}.resolve_neg()"
    )


def _public_env(device: Any = "cpu", **kw: Any) -> SimpleNamespace:
    """make_adapter(device, **kw) whose adapter resolves rows without recording the calls."""
    h = make_adapter(device, **kw)
    bindings = h.resolver.bindings
    h.adapter.resolve_row = lambda request_id, sequence_id, context_id: bindings[
        (request_id, sequence_id, context_id)
    ]
    return h


def in_activation(adapter: Any, batch: Any, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method(*args)`` inside ``adapter.activate(batch)``."""

    def call(*args: Any) -> Any:
        with adapter.activate(batch):
            return method(*args)

    call.__name__ = getattr(method, "__name__", "call")
    return call


def _enter(activation_of: Callable[..., Any]) -> Callable[..., None]:
    """Entering (and leaving) ``activation_of(*args)``: activate's checks run at with-entry."""

    def enter(*args: Any) -> None:
        with activation_of(*args):
            pass

    return enter


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _patching(obj: Any, name: str, value: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(*args)`` with ``obj.name`` set to ``value`` for the call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with _patched(obj, name, value):
            return fn(*args, **kwargs)

    return call


def _with_metadata(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method(layer, q, k, v, omni_attn_metadata=metadata)`` as a positional call."""

    def call(layer: str, q: Any, k: Any, v: Any, metadata: Any) -> Any:
        return method(layer, q, k, v, omni_attn_metadata=metadata)

    return call


def layer_kwargs(
    device: Any = "cpu",
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = HEAD_SIZE,
    head_size_v: int | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """The keywords of a DiffusionPagedAttentionLayerAdapter (4/2 heads x 64, block size 4)."""
    spec = diffkv.AttentionSpec(
        block_size=4,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=torch.float32,
        head_size_v=head_size_v,
    )
    return dict(
        layer_name="layer0",
        layer=SimpleNamespace(num_heads=num_heads, softmax_scale=0.125),
        spec=spec,
        vllm_config=make_vllm_config(),
        device=device,
        **kw,
    )


def _layer(**kwargs: Any) -> Any:
    return diffkv.DiffusionPagedAttentionLayerAdapter(**kwargs)


def layer_case(
    name: str, exc: type[BaseException], message: str, kwargs: dict, fn: Callable = _layer
) -> Case:
    """A constructor case; ``fn`` takes ``kwargs`` as its one argument."""
    return bad(name, exc, message, lambda k: fn(**k), kwargs)


class FakeImpl:
    """Records its keywords; has forward and do_kv_cache_update."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def forward(self, *args: Any) -> None:
        return None

    def do_kv_cache_update(self, *args: Any) -> None:
        return None


class FakeImplNoForward:
    def __init__(self, **kwargs: Any) -> None:
        self.forward = "not callable"


class FakeImplNoUpdate:
    def __init__(self, **kwargs: Any) -> None:
        pass

    def forward(self, *args: Any) -> None:
        return None


class FakeImplNoKernel(FakeImpl):
    vllm_flash_attn_version = None


def fake_backend(impl_cls: type, *, forward_includes_kv_cache_update: bool = False) -> type:
    return type(
        "FakeBackend",
        (),
        {
            "get_name": staticmethod(lambda: "FAKE"),
            "get_impl_cls": staticmethod(lambda: impl_cls),
            "forward_includes_kv_cache_update": forward_includes_kv_cache_update,
        },
    )


class PrewritePlatform(platform_mod.DiffKVPlatform):
    def requires_diffusion_paged_kv_prewrite(self) -> bool:
        return True


def _with_backend(backend: type, fn: Callable[..., Any] = _layer) -> Callable[..., Any]:
    return _patching(adapter_mod, "get_attn_backend", lambda **kwargs: backend, fn)


def _cases_layer_adapter() -> dict[str, list[Case]]:
    cases = []
    for degree in (0, -2, True, 2.0, "2", None):
        cases.append(
            layer_case(
                f"layer ulysses_degree {degree!r}",
                ValueError,
                f"ulysses_degree must be a positive integer, got {degree!r}",
                layer_kwargs(ulysses_degree=degree),
            )
        )
    no_heads = layer_kwargs(ulysses_degree=0)
    no_heads["layer"] = SimpleNamespace(softmax_scale=1.0)  # no num_heads: never read
    cases.append(
        layer_case(
            "layer ulysses_degree before head counts",
            ValueError,
            "ulysses_degree must be a positive integer, got 0",
            no_heads,
        )
    )
    for heads, kv_heads in ((0, 2), (-4, 2), (3, 2), (2, 4)):
        cases.append(
            layer_case(
                f"layer head counts {heads}/{kv_heads}",
                ValueError,
                "Paged attention requires positive Q/KV heads with num_heads divisible by "
                f"num_kv_heads: num_heads={heads}, num_kv_heads={kv_heads}",
                layer_kwargs(num_heads=heads, num_kv_heads=kv_heads),
            )
        )
    for heads, kv_heads, degree in ((4, 2, 4), (6, 3, 2), (4, 2, 3)):
        cases.append(
            layer_case(
                f"layer heads divisible by ulysses {heads}/{kv_heads}/{degree}",
                ValueError,
                "Paged attention requires Q/KV heads divisible by ulysses_degree: "
                f"num_heads={heads}, num_kv_heads={kv_heads}, ulysses_degree={degree}",
                layer_kwargs(num_heads=heads, num_kv_heads=kv_heads, ulysses_degree=degree),
            )
        )
    fp8_spec = layer_kwargs()
    fp8_spec["spec"] = dataclasses.replace(fp8_spec["spec"], dtype=torch.float8_e4m3fn)
    fp8_config = layer_kwargs()
    fp8_config["vllm_config"] = diffkv.DiffusionConfig(
        diffkv.ModelConfig(torch.float32), diffkv.CacheConfig(block_size=4, cache_dtype="fp8")
    )
    cases += [
        layer_case(
            "layer fp8 spec, unquantized cache_dtype",
            ValueError,
            "Paged attention spec dtype torch.float8_e4m3fn does not match cache_config.cache_dtype 'auto': "
            "an fp8 cache ('fp8', 'fp8_e4m3') needs an fp8 spec (torch.float8_e4m3fn) and an fp8 spec an "
            "fp8 cache_dtype",
            fp8_spec,
        ),
        layer_case(
            "layer fp8 cache_dtype, float32 spec",
            ValueError,
            "Paged attention spec dtype torch.float32 does not match cache_config.cache_dtype 'fp8': "
            "an fp8 cache ('fp8', 'fp8_e4m3') needs an fp8 spec (torch.float8_e4m3fn) and an fp8 spec an "
            "fp8 cache_dtype",
            fp8_config,
        ),
        layer_case(
            "layer standalone selection head size",
            ValueError,
            "get_attn_backend(): head_size must be between 1 and 1024 for float32 on cpu, got 1032",
            layer_kwargs(head_size=1032),
        ),
        layer_case(
            "layer key and value head sizes",
            ValueError,
            "Diffusion native paged attention requires equal key/value head sizes; "
            "got head_size=64, head_size_v=128",
            layer_kwargs(head_size_v=128),
        ),
        layer_case(
            "layer impl without forward",
            RuntimeError,
            "Native paged-attention backend 'FAKE' has no forward implementation",
            layer_kwargs(),
            _with_backend(fake_backend(FakeImplNoForward)),
        ),
        layer_case(
            "layer impl cannot update the cache",
            RuntimeError,
            "Native paged-attention backend 'FAKE' cannot update the KV cache",
            layer_kwargs(),
            _with_backend(fake_backend(FakeImplNoUpdate)),
        ),
        layer_case(
            "layer impl cannot update the cache the platform prewrites",
            RuntimeError,
            "Native paged-attention backend 'FAKE' cannot update the KV cache",
            layer_kwargs(),
            _with_backend(
                fake_backend(FakeImplNoUpdate, forward_includes_kv_cache_update=True),
                _patching(adapter_mod, "current_omni_platform", PrewritePlatform(), _layer),
            ),
        ),
        layer_case(
            "layer paged kernel unavailable",
            RuntimeError,
            "Native paged-attention kernel is unavailable for diffusion layer 'layer0'",
            layer_kwargs(),
            _with_backend(fake_backend(FakeImplNoKernel)),
        ),
    ]
    ok_args = dict(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", attn_type="decoder", num_heads=4
    )

    def select(change: dict) -> Any:
        return selector.get_attn_backend(**{**ok_args, **change})

    selection = [
        ok("get_attn_backend ok", select, {}),
        bad(
            "get_attn_backend dtype",
            ValueError,
            "get_attn_backend(): dtype must be one of ['float16', 'bfloat16', 'float32'], got torch.int8",
            select,
            dict(dtype=torch.int8),
        ),
        bad(
            "get_attn_backend kv_cache_dtype",
            ValueError,
            "get_attn_backend(): kv_cache_dtype must be 'auto', the activation dtype 'bfloat16' "
            "(unquantized cache) or 'fp8' / 'fp8_e4m3', got 'int8'",
            select,
            dict(kv_cache_dtype="int8"),
        ),
        bad(
            "get_attn_backend fp8_e5m2",
            NotImplementedError,
            "get_attn_backend(): kv_cache_dtype 'fp8_e5m2' is not supported; diffkv's fp8 KV cache is "
            "e4m3 ('fp8' or 'fp8_e4m3')",
            select,
            dict(kv_cache_dtype="fp8_e5m2"),
        ),
        bad(
            "get_attn_backend attn_type",
            ValueError,
            "get_attn_backend(): attn_type must be 'decoder', got 'encoder'",
            select,
            dict(attn_type="encoder"),
        ),
        bad(
            "get_attn_backend num_heads",
            ValueError,
            "get_attn_backend(): num_heads must be a positive integer, got 0",
            select,
            dict(num_heads=0),
        ),
    ]
    return {"DiffusionPagedAttentionLayerAdapter": cases, "get_attn_backend": selection}


def adapter_kwargs(h: SimpleNamespace, **changes: Any) -> dict[str, Any]:
    """The keywords ``h.adapter`` was built with, ``changes`` applied."""
    kwargs = dict(
        vllm_config=h.vllm_config,
        device=h.device,
        kv_cache_config=h.kv_cache_config,
        block_tables=h.block_tables,
        attn_groups=h.attn_groups,
        layers=h.layers,
        resolve_row=h.resolver,
    )
    kwargs.update(changes)
    return kwargs


def _adapter(**kwargs: Any) -> Any:
    return diffkv.DiffusionPagedAttentionAdapter(**kwargs)


def _cases_adapter() -> dict[str, list[Case]]:
    h = _public_env()
    mixed = _public_env(groups=(("a",), ("b", "c")), allocate_caches=False)
    # Group 1 gets a non-causal layer next to its causal one.
    mixed_layers = {
        **mixed.layers,
        "c": make_layer("c", device="cpu", vllm_config=mixed.vllm_config, non_causal=True),
    }
    two = _public_env(groups=(("a", "b"),))
    cases = [
        layer_case(
            "adapter needs a layer",
            ValueError,
            "Paged attention requires at least one native attention layer",
            adapter_kwargs(h, layers={}),
            _adapter,
        ),
        layer_case(
            "adapter group mismatch",
            ValueError,
            "Paged attention group mismatch: builders=2, cache_groups=1",
            adapter_kwargs(h, attn_groups=h.attn_groups * 2),
            _adapter,
        ),
        layer_case(
            "adapter group mixes causality",
            ValueError,
            "Paged attention cache group 1 mixes causal and non-causal layers",
            adapter_kwargs(mixed, layers=mixed_layers),
            _adapter,
        ),
        layer_case(
            "adapter group names an unknown layer",
            KeyError,
            "b",
            adapter_kwargs(two, layers={"a": two.layers["a"]}),
            _adapter,
        ),
    ]
    for case, env in zip(cases, (h, h, mixed, two), strict=True):
        case.env = env
    return {"DiffusionPagedAttentionAdapter": cases}


def _batch_case(
    name: str, message: str, rows: Any, exc: type[BaseException] = ValueError, **env_kw: Any
) -> Case:
    h = _public_env(**env_kw)
    case = bad(name, exc, message, h.adapter.prepare_batch, rows)
    case.env = h
    return case


def _rebind(case: Case, bindings: dict) -> Case:
    """The case's resolver answers ``{identity: (row_index, max_seq_len)}`` instead."""
    case.env.resolver.bindings.clear()
    case.env.resolver.bindings.update(
        {identity: diffkv.DiffusionPagedAttentionRowBinding(*value) for identity, value in bindings.items()}
    )
    return case


def _row_message(rest: str) -> str:
    return f"Paged attention row ('req', 0, None) {rest}"


def _cases_prepare_batch() -> dict[str, list[Case]]:
    two = {("req", 0, None): (0, 16), ("req", 1, None): (1, 16)}
    no_rows = "Paged attention batch must contain at least one row"
    over8 = _row_message("uses seq_len=8, but its installed allocation has logical length 4")
    active = _public_env()
    batch = active.adapter.prepare_batch([row()])
    during = bad(
        "prepare_batch during an active forward",
        RuntimeError,
        ACTIVE_FORWARD_PREPARE,
        in_activation(active.adapter, batch, active.adapter.prepare_batch),
        [row()],
    )
    during.env = active
    no_rows_active = bad(
        "prepare_batch no rows before active forward",
        ValueError,
        no_rows,
        in_activation(active.adapter, batch, active.adapter.prepare_batch),
        (),
    )
    no_rows_active.env = active
    cases = [
        _batch_case("prepare_batch no rows", no_rows, []),
        # The resolver's own error propagates (here: a KeyError for an identity it has no
        # binding for).
        _batch_case("prepare_batch resolver refuses", "('req', 5, None)", [row(sequence_id=5)], KeyError),
        during,
        no_rows_active,
        _batch_case(
            "prepare_batch too many rows",
            "Paged attention batch has 3 rows; Worker capacity is 2",
            [row(sequence_id=i) for i in range(3)],
            max_num_reqs=2,
        ),
        _batch_case(
            "prepare_batch duplicate identities",
            "Paged attention batch contains duplicate row identities",
            [row(query_len=2, seq_len=4, kv_start_pos=2), row(query_len=4, seq_len=4)],
        ),
        _batch_case(
            "prepare_batch same worker row",
            "Paged attention batch resolves multiple inputs to the same Worker row",
            [row(sequence_id=0), row(sequence_id=1)],
            bindings={("req", 0, None): (1, 16), ("req", 1, None): (1, 16)},
        ),
    ]
    for capacity in (-1, 16.0, "16", None, True):
        cases.append(
            _rebind(
                _batch_case(
                    f"prepare_batch invalid capacity {capacity!r}",
                    _row_message(f"resolved to invalid logical capacity {capacity!r}"),
                    [row()],
                ),
                {("req", 0, None): (0, capacity)},
            )
        )
    cases += [
        _batch_case(
            "prepare_batch over capacity",
            _row_message("uses seq_len=9, but its installed allocation has logical length 8"),
            [row(query_len=9, seq_len=9)],
            bindings={("req", 0, None): (0, 8)},
        ),
        _batch_case(
            "prepare_batch decode rows first",
            "Causal paged attention rows must place native decode/short-query rows before "
            "prefill/long-query rows (decode threshold=1)",
            [
                row(query_len=4, seq_len=4, sequence_id=0),
                row(query_len=1, seq_len=4, kv_start_pos=3, sequence_id=1),
            ],
            bindings=two,
            reorder_batch_threshold=1,
        ),
    ]
    for row_index in (4, -1, "0", 1.0, True):
        cases.append(
            _rebind(
                _batch_case(
                    f"prepare_batch invalid worker row {row_index!r}",
                    _row_message(f"resolved to invalid Worker row {row_index!r}"),
                    [row()],
                    max_num_reqs=4,
                ),
                {("req", 0, None): (row_index, 16)},
            )
        )
    cases += [
        _batch_case(
            "prepare_batch too few blocks",
            _row_message(
                "requires 2 blocks in cache group 0 for seq_len=8, "
                "but its installed Worker row contains only 1 blocks"
            ),
            [row(query_len=8, seq_len=8)],
            bindings={("req", 0, None): (0, 16)},
            block_ids={0: [[5]]},
        ),
        # block 4 = two kernel blocks of 2; group 1 has one manager block only.
        _batch_case(
            "prepare_batch too few blocks, kernel blocks and groups",
            _row_message(
                "requires 2 blocks in cache group 1 for seq_len=5, "
                "but its installed Worker row contains only 1 blocks"
            ),
            [row(query_len=5, seq_len=5)],
            groups=(("a",), ("b",)),
            kernel_block_size=2,
            bindings={("req", 0, None): (0, 16)},
            block_ids={0: [[1, 2], [3]]},
        ),
        # cp_size 2: 8 tokens need cdiv(8, 4 * 2) = 1 manager block per rank, 9 tokens 2.
        _rebind(
            _batch_case(
                "prepare_batch too few blocks with cp_size",
                _row_message(
                    "requires 2 blocks in cache group 0 for seq_len=9, "
                    "but its installed Worker row contains only 1 blocks"
                ),
                [row(query_len=9, seq_len=9)],
                cp_size=2,
                cp_rank=0,
                bindings={("req", 0, None): (0, 8)},
                block_ids={0: [[3]]},
            ),
            {("req", 0, None): (0, 16)},
        ),
        _batch_case(
            "prepare_batch too many tokens",
            "Paged attention batch has 21 tokens; Worker capacity is 20",
            [row(query_len=16, seq_len=16, sequence_id=0), row(query_len=5, seq_len=5, sequence_id=1)],
            bindings=two,
            max_num_batched_tokens=20,
        ),
        # The capacity checks run row by row: row 0's seq_len over its capacity comes before
        # row 1's invalid capacity.
        _rebind(
            _batch_case(
                "prepare_batch order: row 0 over capacity before row 1 invalid capacity",
                over8,
                [row(query_len=8, seq_len=8, sequence_id=0), row(sequence_id=1)],
                bindings=two,
            ),
            {("req", 0, None): (0, 4), ("req", 1, None): (1, -1)},
        ),
        # The capacity check precedes the Worker row check and the installed-blocks check.
        _rebind(
            _batch_case(
                "prepare_batch order: capacity before worker row", over8, [row(query_len=8, seq_len=8)]
            ),
            {("req", 0, None): (99, 4)},
        ),
        # The Worker row check precedes the batched-token limit.
        _rebind(
            _batch_case(
                "prepare_batch order: worker row before token limit",
                _row_message("resolved to invalid Worker row 99"),
                [row(query_len=1000, seq_len=1000)],
            ),
            {("req", 0, None): (99, 4000)},
        ),
    ]
    return {"prepare_batch": cases}


def _cases_activation() -> dict[str, list[Case]]:
    active = _public_env()
    batch = active.adapter.prepare_batch([row()])
    invalidate = bad(
        "invalidate during an active forward",
        RuntimeError,
        ACTIVE_FORWARD_INVALIDATE,
        in_activation(active.adapter, batch, active.adapter.invalidate_prepared_batches),
    )
    invalidate.env = active
    h = _public_env()
    other = _public_env()
    foreign = other.adapter.prepare_batch([row()])
    h.adapter.prepare_batch([row()])  # the same generation number, another owner
    stale_env = _public_env()
    stale = stale_env.adapter.prepare_batch([row()])
    stale_env.adapter.invalidate_prepared_batches()
    newer_env = _public_env()
    older = newer_env.adapter.prepare_batch([row()])
    newer_env.adapter.prepare_batch([row()])
    again = _public_env()
    again_batch = again.adapter.prepare_batch([row()])
    cases = [
        bad(
            "activate a batch of another adapter",
            ValueError,
            "Prepared paged attention batch belongs to a different adapter",
            _enter(h.adapter.activate),
            foreign,
        ),
        bad(
            "activate an invalidated batch",
            ValueError,
            STALE_BATCH,
            _enter(stale_env.adapter.activate),
            stale,
        ),
        bad("activate an older batch", ValueError, STALE_BATCH, _enter(newer_env.adapter.activate), older),
        bad(
            "activate while already active",
            RuntimeError,
            "Paged attention adapter already has an active forward",
            in_activation(again.adapter, again_batch, _enter(again.adapter.activate)),
            again_batch,
        ),
    ]
    for case, env in zip(cases, (h, stale_env, newer_env, again), strict=True):
        case.env = env
    return {"invalidate_prepared_batches": [invalidate], "activate": cases}


def qkv(n: int, *, device: Any = "cpu", dtype=torch.float32, heads=2, kv_heads=1, d=HEAD_SIZE, lead=None):
    """Random query [*lead, heads, d], key and value [*lead, kv_heads, d] (lead = (n,))."""
    lead = (n,) if lead is None else lead
    q = torch.randn(*lead, heads, d, device=device, dtype=dtype)
    k = torch.randn(*lead, kv_heads, d, device=device, dtype=dtype)
    v = torch.randn(*lead, kv_heads, d, device=device, dtype=dtype)
    return q, k, v


def active_env(device: Any = "cpu") -> SimpleNamespace:
    """An adapter over two causal layers with one prepared 4-token batch (row 0, seq_len 4)
    in ``env.batch``."""
    h = _public_env(device, groups=(("layer0", "layer1"),))
    h.batch = h.adapter.prepare_batch([row(query_len=4, seq_len=4)])
    return h


def unsupported_metadata_message(fields: str) -> str:
    return (
        "Diffusion paged attention cannot translate Omni attention metadata fields "
        f"{fields} to native FlashAttention metadata"
    )


def _cases_layer_context(device: Any) -> dict[str, list[Case]]:
    cases: list[Case] = []

    def context_case(name, exc, message, args, h=None, metadata=None, prepare=None):
        h = active_env(device) if h is None else h
        if prepare is not None:
            prepare(h)
        method = h.adapter.prepare_layer_context
        if metadata is not None:
            method, args = _with_metadata(method), (*args, metadata)
        case = bad(name, exc, message, in_activation(h.adapter, h.batch, method), *args)
        case.env = h
        cases.append(case)
        return case

    q, k, v = qkv(4, device=device)
    outside = _public_env(device)
    case = bad(
        "layer context outside an activation",
        RuntimeError,
        "Paged attention forward must run inside adapter.activate(batch)",
        outside.adapter.prepare_layer_context,
        "layer0",
        q,
        k,
        v,
    )
    case.env = outside
    cases.append(case)
    context_case(
        "layer context unknown layer",
        KeyError,
        "Unknown diffusion paged attention layer 'nope'",
        ("nope", q, k, v),
    )
    unsupported = [
        ("joint_attn_mask", diffkv.AttentionMetadata(joint_attn_mask=torch.ones(1)), "['joint_attn_mask']"),
        (
            "query_ranges",
            diffkv.AttentionMetadata(query_ranges=(diffkv.QueryRange(0, 4, 0),)),
            "['query_ranges']",
        ),
        (
            "video_layout",
            diffkv.AttentionMetadata(video_layout=diffkv.VideoTokenLayout(prefix_len=1)),
            "['video_layout']",
        ),
        ("attn_mask", diffkv.AttentionMetadata(attn_mask=torch.ones(1, 1, 4, 4)), "['attn_mask']"),
        (
            "2D attn_mask with spans",
            diffkv.AttentionMetadata(attn_mask=torch.ones(4, 4), full_attn_spans=[[(0, 4)]]),
            "['attn_mask (piecewise paging requires a 4D tensor)']",
        ),
        (
            "non-tensor attn_mask with spans",
            SimpleNamespace(attn_mask="mask", full_attn_spans=[[(0, 4)]]),
            "['attn_mask (piecewise paging requires a 4D tensor)']",
        ),
        ("extra", diffkv.AttentionMetadata(extra={"b": 1, "a": 2}), "[\"extra=['a', 'b']\"]"),
        (
            "every field",
            SimpleNamespace(
                extra={"z": 0}, attn_mask=torch.ones(1), video_layout=1, query_ranges=(), joint_attn_mask=0
            ),
            "['joint_attn_mask', 'query_ranges', 'video_layout', 'attn_mask', \"extra=['z']\"]",
        ),
    ]
    for label, metadata, fields in unsupported:
        context_case(
            f"layer context unsupported metadata: {label}",
            NotImplementedError,
            unsupported_metadata_message(fields),
            ("layer0", q, k, v),
            metadata=metadata,
        )
    other = torch.randn(4, 3, 32, device=device)
    scalar = torch.tensor(1.0, device=device)
    shapes = [
        (
            "query trailing shape",
            "Paged attention query must end in (2, 64) or (128,); got shape=(4, 3)",
            (other[:, :, 0], k, v),
        ),
        (
            "key trailing shape",
            "Paged attention key must end in (1, 64) or (64,); got shape=(4, 3, 32)",
            (q, other, v),
        ),
        (
            "value trailing shape",
            "Paged attention value must end in (1, 64) or (64,); got shape=()",
            (q, k, scalar),
        ),
        # query is checked before key.
        (
            "query before key",
            "Paged attention query must end in (2, 64) or (128,); got shape=(4, 1, 64)",
            (k, q, v),
        ),
        (
            "key token count",
            "Paged attention key token count must match the query layout: query=(4,), key=(3,)",
            (q, k[:3], v),
        ),
        (
            "batched key layout",
            "Paged attention batched key layout must match prepared rows and the query layout: "
            "query=(4,), key=(2, 2)",
            (q, k.reshape(2, 2, 1, HEAD_SIZE), v),
        ),
        (
            "value token count",
            "Paged attention value token count must match the query layout: query=(4,), value=(5,)",
            (q, k, torch.cat([v, v[:1]])),
        ),
        (
            "batched value layout",
            "Paged attention batched value layout must match prepared rows and the query layout: "
            "query=(4,), value=(1, 4)",
            (q, k, v.reshape(1, 4, HEAD_SIZE)),
        ),
        (
            "token count",
            "Paged attention Q/K/V token count must match the prepared write batch: tokens=3, prepared=4",
            qkv(3, device=device),
        ),
    ]
    for lead in ((2, 4), (1, 3)):
        shapes.append(
            (
                f"batched layout {lead}",
                "Paged attention batched Q/K/V layout must match prepared rows for the current write: "
                f"shape={lead}, row_query_lens=(4,)",
                qkv(0, device=device, lead=lead),
            )
        )
    shapes += [
        (
            "token rank",
            "Paged attention Q/K/V supports packed [T, ...] or uniform batched [B, T, ...] token layouts; "
            "got token shape=(1, 2, 2)",
            qkv(0, device=device, lead=(1, 2, 2)),
        ),
        (
            "device",
            f"Paged attention Q/K/V must be on {torch.device(device)}; "
            f"got query={q.device}, key=meta, value={v.device}",
            (q, torch.empty(4, 1, HEAD_SIZE, device="meta"), v),
        ),
        (
            "dtypes match",
            "Paged attention Q/K/V dtypes must match; got torch.float32, torch.float32, torch.float16",
            (q, k, v.half()),
        ),
        (
            "model dtype",
            "Paged attention Q/K/V dtype must match model activation dtype torch.float32; got torch.float16",
            qkv(4, device=device, dtype=torch.float16),
        ),
    ]
    for label, message, tensors in shapes:
        context_case(f"layer context {label}", ValueError, message, ("layer0", *tensors))

    # Causal layers and piecewise spans need every row's span to end at seq_len.
    suffix = _public_env(device, groups=(("causal",), ("full",)), non_causal={"causal": False, "full": True})
    suffix.batch = suffix.adapter.prepare_batch([row(query_len=2, seq_len=4, kv_start_pos=1)])
    q2, k2, v2 = qkv(2, device=device)
    context_case(
        "layer context causal layer needs suffix rows",
        ValueError,
        "Causal paged attention requires each query/write span to end at seq_len; "
        "invalid rows=[('req', 0, None)]",
        ("causal", q2, k2, v2),
        h=suffix,
    )
    piecewise = _public_env(device, non_causal=True)
    piecewise.batch = piecewise.adapter.prepare_batch([row(query_len=2, seq_len=4, kv_start_pos=1)])
    context_case(
        "layer context piecewise spans need suffix rows",
        ValueError,
        "Paged piecewise attention requires each query/write span to end at seq_len; "
        "invalid rows=[('req', 0, None)]",
        ("layer0", q2, k2, v2),
        h=piecewise,
        metadata=diffkv.AttentionMetadata(full_attn_spans=[[(1, 3)]]),
    )

    def drop(table: str, layer: str) -> Callable[[SimpleNamespace], None]:
        return lambda h: getattr(h.batch, table).pop(layer)

    context_case(
        "layer context no slot mapping",
        KeyError,
        "No native slot mapping was built for diffusion layer 'layer1'",
        ("layer1", q, k, v),
        prepare=drop("slot_mappings_by_layer", "layer1"),
    )
    context_case(
        "layer context short slot mapping",
        ValueError,
        "Paged attention slot mapping for 'layer1' has 3 entries; expected 4",
        ("layer1", q, k, v),
        prepare=lambda h: h.batch.slot_mappings_by_layer.__setitem__(
            "layer1", torch.zeros(3, dtype=torch.int64, device=device)
        ),
    )
    context_case(
        "layer context no native metadata",
        KeyError,
        "No native attention metadata was built for diffusion layer 'layer1'",
        ("layer1", q, k, v),
        prepare=drop("attn_metadata", "layer1"),
    )

    # Spans that change between two layers of one activation: the first layer's call inside.
    first = diffkv.AttentionMetadata(full_attn_spans=[[(1, 3)]])
    second = diffkv.AttentionMetadata(full_attn_spans=[[(1, 4)]])
    changed = active_env(device)

    def changed_spans(q, k, v, metadata):
        changed.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=first)
        return changed.adapter.prepare_layer_context("layer1", q, k, v, omni_attn_metadata=metadata)

    case = bad(
        "layer context spans change between layers",
        ValueError,
        "Paged piecewise attention metadata changed between layers in one active batch",
        in_activation(changed.adapter, changed.batch, changed_spans),
        q,
        k,
        v,
        second,
    )
    case.env = changed
    cases.append(case)
    # Piecewise metadata missing for the second layer.
    missing = active_env(device)

    def missing_layer(q, k, v, spans):
        missing.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=spans)
        missing.adapter._active_piecewise_native_metadata[1].pop("layer1")
        return missing.adapter.prepare_layer_context("layer1", q, k, v, omni_attn_metadata=spans)

    case = bad(
        "layer context no piecewise metadata for the layer",
        KeyError,
        "No piecewise native attention metadata was built for diffusion layer 'layer1'",
        in_activation(missing.adapter, missing.batch, missing_layer),
        q,
        k,
        v,
        first,
    )
    case.env = missing
    cases.append(case)
    helpers = _public_env()
    plan = diffkv.build_paged_piecewise_plan([[(0, 1)]], [0], [2], [2])
    piecewise_helpers = [
        bad(
            "piecewise plan outside an activation",
            RuntimeError,
            "Piecewise paged attention requires an active prepared batch",
            helpers.adapter._get_piecewise_plan,
            [[(0, 1)]],
        ),
        bad(
            "piecewise native metadata outside an activation",
            RuntimeError,
            "Piecewise paged attention requires an active prepared batch",
            helpers.adapter._get_piecewise_native_metadata,
            plan,
        ),
    ]

    # forward_paged refuses a negative-bit Q/K/V view (prepare_layer_context reads layouts only).
    forward = []
    for name in ("query", "key", "value"):
        h = active_env(device)
        tensors = dict(zip(("query", "key", "value"), qkv(4, device=device), strict=True))
        tensors[name] = torch._neg_view(tensors[name])
        layer = h.adapter.layers["layer0"]

        def layer_call(*tensors, h=h, layer=layer):
            return layer.impl.forward_paged(h.adapter.prepare_layer_context("layer0", *tensors))

        case = bad(
            f"forward_paged negative-bit {name}",
            ValueError,
            negative_bit_view_message("forward_paged", name),
            in_activation(h.adapter, h.batch, layer_call),
            *tensors.values(),
        )
        case.env = h
        forward.append(case)
    return {
        "prepare_layer_context": cases,
        "piecewise helpers": piecewise_helpers,
        "DiffKVAttentionImpl.forward_paged": forward,
    }


class _DenseImpl(diffkv.AttentionImpl):
    """An AttentionImpl with a CUDA forward and no paged forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def forward_cuda(self, query, key, value, attn_metadata=None):
        return "cuda"


DenseImpl = _DenseImpl


def _cases_backend() -> dict[str, list[Case]]:
    return {
        "AttentionImpl.forward_paged": [
            bad(
                "AttentionImpl.forward_paged refuses",
                NotImplementedError,
                "_DenseImpl does not support paged KV attention",
                _DenseImpl().forward_paged,
                object(),
            )
        ]
    }


# --- the standalone collaborators: rows and request metadata, the piecewise planner, the runtime,
# configs and specs, BlockTables, BlockPool, KV cache allocation, the metadata builders and the
# attention implementation's constructor.  A case whose entry point needs state (a BlockTables
# with rows, a BlockPool with blocks in use, a closed runtime) calls a method of an object built
# once with that state, kept as ``case.env``: a failing call must leave it untouched, so the case
# can be repeated (the tests of those files check the state around ``check(case)``).

Row = diffkv.DiffusionPagedAttentionRow
ROW_REQUEST_ID = "Paged attention request_id must be a non-empty string"
ROW_ONE_ID = "Paged attention row requires exactly one of sequence_id or context_id"
ROW_SEQUENCE_ID = "Paged attention sequence_id must be a non-negative integer"
ROW_CONTEXT_ID = "Paged attention context_id must be a non-empty string"
ROW_QUERY_LEN = "Paged attention query_len must be a positive integer"
ROW_SEQ_LEN = "Paged attention seq_len must be a positive integer"
ROW_KV_START_POS = "Paged attention kv_start_pos must be a non-negative integer"
BOTH_ROW_SETS = "Paged attention metadata requires both prefill and denoise rows"
RUNTIME_CLOSED = "Paged attention runtime is already closed"


def step_index_message(step: Any) -> str:
    return f"Paged attention requires a non-negative denoise step index, got {step!r}"


def _keywords(fn: Callable[..., Any]) -> Callable[[tuple, dict], Any]:
    """``fn(*args, **kwargs)`` as a call of two arguments (so the leak test tracks both)."""

    def call(args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "call")
    return call


def kw_case(
    name: str, exc: type[BaseException], message: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Case:
    """A failing case of ``fn(*args, **kwargs)``."""
    return bad(name, exc, message, _keywords(fn), args, kwargs)


def request_rows(seq_ids=(0, 1), query_len=4, seq_len=4, kv_start_pos=0) -> tuple:
    """Rows of request "req", one per sequence id."""
    return tuple(Row("req", query_len, seq_len, kv_start_pos=kv_start_pos, sequence_id=s) for s in seq_ids)


def _cases_rows() -> dict[str, list[Case]]:
    rows = []
    for value in ("", 1, None, b"r"):
        rows.append(
            kw_case(f"row request_id {value!r}", ValueError, ROW_REQUEST_ID, Row, value, 1, 1, sequence_id=0)
        )
    for ids in ({}, {"sequence_id": 0, "context_id": "c"}):
        rows.append(kw_case(f"row ids {ids!r}", ValueError, ROW_ONE_ID, Row, "r", 1, 1, **ids))
    for value in (-1, True, 1.0, "0"):
        rows.append(
            kw_case(
                f"row sequence_id {value!r}", ValueError, ROW_SEQUENCE_ID, Row, "r", 1, 1, sequence_id=value
            )
        )
    for value in ("", 3, b"c"):
        rows.append(
            kw_case(f"row context_id {value!r}", ValueError, ROW_CONTEXT_ID, Row, "r", 1, 1, context_id=value)
        )
    for value in (0, -1, 1.0, True, None):
        rows.append(
            kw_case(f"row query_len {value!r}", ValueError, ROW_QUERY_LEN, Row, "r", value, 4, sequence_id=0)
        )
    for value in (0, -3, 4.0, True):
        rows.append(
            kw_case(f"row seq_len {value!r}", ValueError, ROW_SEQ_LEN, Row, "r", 1, value, sequence_id=0)
        )
    for value in (-1, 0.0, False, None):
        rows.append(
            kw_case(
                f"row kv_start_pos {value!r}",
                ValueError,
                ROW_KV_START_POS,
                Row,
                "r",
                1,
                4,
                kv_start_pos=value,
                sequence_id=0,
            )
        )
    rows.append(
        kw_case(
            "row write span beyond seq_len",
            ValueError,
            "Paged attention write span exceeds seq_len: start=3, query_len=2, seq_len=4",
            Row,
            "r",
            2,
            4,
            kv_start_pos=3,
            sequence_id=0,
        )
    )
    # vLLM-Omni's adapter's order: request_id, one id, sequence_id / context_id, query_len,
    # seq_len, kv_start_pos, the write span.
    for name, message, args, kwargs in (
        ("request_id", ROW_REQUEST_ID, ("", 0, 0), {"kv_start_pos": -1}),
        ("one id", ROW_ONE_ID, ("r", 0, 0), {"kv_start_pos": -1}),
        ("sequence_id", ROW_SEQUENCE_ID, ("r", 0, 0), {"kv_start_pos": -1, "sequence_id": -1}),
        ("context_id", ROW_CONTEXT_ID, ("r", 0, 0), {"kv_start_pos": -1, "context_id": ""}),
        ("query_len", ROW_QUERY_LEN, ("r", 0, 0), {"kv_start_pos": -1, "sequence_id": 0}),
        ("seq_len", ROW_SEQ_LEN, ("r", 1, 0), {"kv_start_pos": -1, "sequence_id": 0}),
        ("kv_start_pos", ROW_KV_START_POS, ("r", 9, 1), {"kv_start_pos": -1, "sequence_id": 0}),
    ):
        rows.append(kw_case(f"row order: {name} first", ValueError, message, Row, *args, **kwargs))

    Metadata = diffkv.DiffusionPagedAttentionMetadata
    metadata = [
        bad("metadata no prefill rows", ValueError, BOTH_ROW_SETS, Metadata, (), request_rows()),
        bad("metadata no denoise rows", ValueError, BOTH_ROW_SETS, Metadata, request_rows(), ()),
        bad("metadata no rows", ValueError, BOTH_ROW_SETS, Metadata, (), ()),
        bad(
            "metadata identities in another order",
            ValueError,
            "Paged attention prefill and denoise rows must use the same ordered identities: "
            "prefill=(('req', 0, None), ('req', 1, None)), denoise=(('req', 1, None), ('req', 0, None))",
            Metadata,
            request_rows((0, 1)),
            request_rows((1, 0), query_len=2, kv_start_pos=2),
        ),
        bad(
            "metadata row counts differ",
            ValueError,
            "Paged attention prefill and denoise rows must use the same ordered identities: "
            "prefill=(('req', 0, None),), denoise=(('req', 0, None), ('req', 1, None))",
            Metadata,
            request_rows((0,)),
            request_rows((0, 1)),
        ),
    ]
    request = Metadata(request_rows(), request_rows(query_len=2, kv_start_pos=2))
    steps = [
        bad(f"rows_for_step {step!r}", ValueError, step_index_message(step), request.rows_for_step, step)
        for step in (None, -1, True, 1.0, "1")
    ]
    return {
        "DiffusionPagedAttentionRow": rows,
        "DiffusionPagedAttentionMetadata": metadata,
        "DiffusionPagedAttentionMetadata.rows_for_step": steps,
    }


def _cases_piecewise() -> dict[str, list[Case]]:
    from diffkv.piecewise import build_paged_piecewise_plan as plan

    one_entry = "Paged piecewise inputs must have one entry per row"
    bad_spans = "Paged piecewise spans must be sorted, non-overlapping, and within the sequence"
    bad_range = "Paged piecewise query range must be within the sequence"
    cases = [
        bad(f"piecewise one entry per row {i}", ValueError, one_entry, plan, *args)
        for i, args in enumerate(
            (
                ([[(0, 1)]], [0, 0], [1], [1]),
                ([[(0, 1)]], [0], [1, 1], [1]),
                ([[(0, 1)]], [0], [1], [1, 1]),
                ([[(0, 1)], []], [0], [1], [1]),
                ([], [], [], []),
            )
        )
    ]
    for spans in ([(5, 8), (1, 3)], [(1, 5), (4, 6)], [(5, 10)], [(-1, 2)], [(4, 4)], [(6, 3)]):
        cases.append(bad(f"piecewise spans {spans}", ValueError, bad_spans, plan, [spans], [0], [9], [9]))
    for offset, query_len, seq_len in ((5, 6, 9), (0, 0, 9), (-1, 2, 9), (9, 1, 9)):
        cases.append(
            bad(
                f"piecewise query range {offset}+{query_len} of {seq_len}",
                ValueError,
                bad_range,
                plan,
                [[]],
                [offset],
                [query_len],
                [seq_len],
            )
        )
    cases.append(
        bad(
            "piecewise rows must align",
            ValueError,
            "Paged piecewise rows must produce aligned segments",
            plan,
            [[], [(1, 2)]],
            [0, 0],
            [4, 4],
            [4, 4],
        )
    )
    cases.append(
        bad(
            "piecewise rows must share modes",
            ValueError,
            "Paged piecewise rows must use the same attention mode per segment",
            plan,
            [[(0, 2)], [(2, 4)]],
            [0, 0],
            [4, 4],
            [4, 4],
        )
    )
    return {"build_paged_piecewise_plan": cases}


def runtime_request(device: Any = "cpu") -> tuple[SimpleNamespace, Any]:
    """An adapter of two layers (resolving rows without recording the calls) and the metadata
    of two CFG rows: prefix 3 + target 6 -> prefill rows (9 tokens), denoise rows (6 tokens)."""
    bindings = {("req", 0, None): (0, 12), ("req", 1, None): (1, 12)}
    h = _public_env(device, groups=(("layer0", "layer1"),), bindings=bindings)
    prefill = tuple(row(query_len=9, seq_len=9, sequence_id=s) for s in (0, 1))
    denoise = tuple(row(query_len=6, seq_len=9, kv_start_pos=3, sequence_id=s) for s in (0, 1))
    return h, diffkv.DiffusionPagedAttentionMetadata(prefill, denoise)


def _step_in_runtime(h: SimpleNamespace, metadata: Any) -> Callable[[Any], None]:
    """``ensure_active(step)`` of a fresh runtime in its prefill phase, closed again after;
    ``h.kept_phase`` says whether the failing call left the prefill batch active."""

    def ensure_active(step: Any) -> None:
        runtime = diffkv.DiffusionPagedAttentionRuntime(h.adapter, metadata)
        try:
            runtime.ensure_active(0)
            batch = h.adapter._active_batch
            try:
                runtime.ensure_active(step)
            finally:
                h.kept_phase = h.adapter._active_batch is batch
        finally:
            runtime.close()

    return ensure_active


def _denoise_unresolvable(h: SimpleNamespace, metadata: Any) -> Callable[[Any], None]:
    """``ensure_active(step)`` of a fresh runtime past its prefill phase, with the resolver
    no longer knowing row ('req', 1, None) (restored after); ``h.left_nothing_active`` says
    whether the failing call left no batch, phase or activation behind."""

    def ensure_active(step: Any) -> None:
        runtime = diffkv.DiffusionPagedAttentionRuntime(h.adapter, metadata)
        try:
            runtime.ensure_active(0)
            binding = h.resolver.bindings.pop(("req", 1, None))
            try:
                runtime.ensure_active(step)
            finally:
                h.resolver.bindings[("req", 1, None)] = binding
                h.left_nothing_active = (
                    h.adapter._active_batch is None
                    and runtime._active_phase is None
                    and runtime._activation is None
                )
        finally:
            runtime.close()

    return ensure_active


def _cases_runtime(device: Any) -> dict[str, list[Case]]:
    h, metadata = runtime_request(device)
    cases = []
    for step in (None, -1, True):
        case = bad(
            f"runtime step index {step!r}",
            ValueError,
            step_index_message(step),
            _step_in_runtime(h, metadata),
            step,
        )
        case.env = h
        cases.append(case)
    unresolvable_h, metadata = runtime_request(device)
    case = bad(
        "runtime denoise rows unresolvable",
        KeyError,
        "('req', 1, None)",
        _denoise_unresolvable(unresolvable_h, metadata),
        1,
    )
    case.env = unresolvable_h
    cases.append(case)
    closed_h, metadata = runtime_request(device)
    closed = diffkv.DiffusionPagedAttentionRuntime(closed_h.adapter, metadata)
    closed.ensure_active(0)
    closed.close()
    case = bad("runtime closed", RuntimeError, RUNTIME_CLOSED, closed.ensure_active, 3)
    case.env = closed_h
    cases.append(case)
    return {"DiffusionPagedAttentionRuntime.ensure_active": cases}


def _cases_configs() -> dict[str, list[Case]]:
    spec = diffkv.AttentionSpec(16, 2, 64, torch.float16)
    dtypes = "['bfloat16', 'float', 'float16', 'float32', 'half']"
    cache_dtypes = "['bfloat16', 'float', 'float16', 'float32', 'fp8', 'fp8_e4m3', 'half']"
    bare = object()
    group = diffkv.KVCacheGroup(["a", "b"], spec)
    return {
        "configs": [
            bad(
                "ModelConfig dtype",
                TypeError,
                f"ModelConfig(): dtype must be a torch.dtype or one of {dtypes}, got 'fp8'",
                diffkv.ModelConfig,
                "fp8",
            ),
            kw_case(
                "CacheConfig block_size 0",
                ValueError,
                "CacheConfig(): block_size must be positive, got 0",
                diffkv.CacheConfig,
                block_size=0,
            ),
            kw_case(
                "CacheConfig block_size 1.5",
                TypeError,
                "CacheConfig(): block_size must be an int, got 1.5",
                diffkv.CacheConfig,
                block_size=1.5,
            ),
            kw_case(
                "CacheConfig block_size True",
                TypeError,
                "CacheConfig(): block_size must be an int, got True",
                diffkv.CacheConfig,
                block_size=True,
            ),
            kw_case(
                "CacheConfig cache_dtype None",
                TypeError,
                "CacheConfig(): cache_dtype must be a str, got None",
                diffkv.CacheConfig,
                cache_dtype=None,
            ),
            kw_case(
                "CacheConfig cache_dtype fp8_e5m2",
                NotImplementedError,
                "CacheConfig(): cache_dtype 'fp8_e5m2' is not supported; diffkv's fp8 KV cache is e4m3 "
                "('fp8' or 'fp8_e4m3')",
                diffkv.CacheConfig,
                cache_dtype="fp8_e5m2",
            ),
            kw_case(
                "CacheConfig calculate_kv_scales 1",
                TypeError,
                "CacheConfig(): calculate_kv_scales must be a bool, got 1",
                diffkv.CacheConfig,
                calculate_kv_scales=1,
            ),
            bad(
                "DiffusionConfig model_config",
                TypeError,
                f"DiffusionConfig(): model_config must have a dtype, got {bare!r}",
                diffkv.DiffusionConfig,
                bare,
                diffkv.CacheConfig(),
            ),
            bad(
                "DiffusionConfig cache_config",
                TypeError,
                f"DiffusionConfig(): cache_config must have block_size and cache_dtype, got {bare!r}",
                diffkv.DiffusionConfig,
                diffkv.ModelConfig(torch.float16),
                bare,
            ),
        ],
        "AttentionSpec": [
            bad(
                "AttentionSpec num_kv_heads 0",
                ValueError,
                "AttentionSpec(): num_kv_heads must be positive, got 0",
                diffkv.AttentionSpec,
                16,
                0,
                128,
                torch.float16,
            ),
            bad(
                "AttentionSpec head_size '128'",
                TypeError,
                "AttentionSpec(): head_size must be an int, got '128'",
                diffkv.AttentionSpec,
                16,
                1,
                "128",
                torch.float16,
            ),
            kw_case(
                "AttentionSpec non_causal 1",
                TypeError,
                "AttentionSpec(): non_causal must be a bool, got 1",
                diffkv.AttentionSpec,
                16,
                1,
                128,
                torch.float16,
                non_causal=1,
            ),
            bad(
                "AttentionSpec dtype None",
                TypeError,
                f"AttentionSpec(): dtype must be a torch.dtype or one of {cache_dtypes}, got None",
                diffkv.AttentionSpec,
                16,
                1,
                128,
                None,
            ),
            kw_case(
                "AttentionSpec head_size_v -1",
                ValueError,
                "AttentionSpec(): head_size_v must be positive, got -1",
                diffkv.AttentionSpec,
                16,
                1,
                128,
                torch.float16,
                head_size_v=-1,
            ),
        ],
        "cache groups": [
            bad(
                "KVCacheGroup duplicate names",
                ValueError,
                "KVCacheGroup(): layer_names must be unique, got ('a', 'a')",
                diffkv.KVCacheGroup,
                ["a", "a"],
                spec,
            ),
            bad(
                "KVCacheGroup names a str",
                TypeError,
                "KVCacheGroup(): layer_names must be a sequence of str, got 'ab'",
                diffkv.KVCacheGroup,
                "ab",
                spec,
            ),
            bad(
                "KVCacheGroup spec None",
                TypeError,
                "KVCacheGroup(): spec must be an AttentionSpec, got None",
                diffkv.KVCacheGroup,
                ["a"],
                None,
            ),
            bad(
                "KVCacheConfig layer in two groups",
                ValueError,
                "KVCacheConfig(): layer 'a' appears in more than one cache group",
                diffkv.KVCacheConfig,
                8,
                [group, diffkv.KVCacheGroup(["a"], spec)],
            ),
            bad(
                "KVCacheConfig no groups",
                ValueError,
                "KVCacheConfig(): kv_cache_groups must not be empty",
                diffkv.KVCacheConfig,
                8,
                [],
            ),
            bad(
                "KVCacheConfig num_blocks 0",
                ValueError,
                "KVCacheConfig(): num_blocks must be positive, got 0",
                diffkv.KVCacheConfig,
                0,
                [group],
            ),
            bad(
                "KVCacheConfig group not a KVCacheGroup",
                TypeError,
                "KVCacheConfig(): kv_cache_groups[0] must be a KVCacheGroup, got 1",
                diffkv.KVCacheConfig,
                4,
                [1],
            ),
            kw_case(
                "AttentionGroup reorder_batch_threshold -1",
                ValueError,
                "PagedMetadataBuilder(): reorder_batch_threshold must be >= 0, got -1",
                diffkv.AttentionGroup,
                ["a"],
                reorder_batch_threshold=-1,
            ),
            bad(
                "AttentionGroup names a str",
                TypeError,
                "AttentionGroup(): layer_names must be a sequence of str, got 'a'",
                diffkv.AttentionGroup,
                "a",
            ),
            bad(
                "AttentionGroup ubatch_id 1",
                IndexError,
                "AttentionGroup.get_metadata_builder(): ubatch_id must be in [0, 1), got 1",
                diffkv.AttentionGroup(["a"]).get_metadata_builder,
                1,
            ),
        ],
    }


def append_tables(device: Any = "cpu") -> Any:
    """BlockTables of two groups (block sizes 4 and 8, 2 and 1 columns), row 0 holding one block
    of each."""
    tables = diffkv.BlockTables([4, 8], 2, 16, [2, 1], device)
    tables.append_block_ids(0, [[3], [5]])
    return tables


def _tables_case(
    name: str, exc: type[BaseException], message: str, tables: Any, method: str, *args: Any, **kwargs: Any
) -> Case:
    case = kw_case(name, exc, message, getattr(tables, method), *args, **kwargs)
    case.env = tables
    return case


def _cases_block_tables(device: Any) -> dict[str, list[Case]]:
    T = diffkv.BlockTables
    construct = [
        bad(
            "BlockTables no block sizes",
            ValueError,
            "BlockTables(): block_sizes must not be empty",
            T,
            [],
            1,
            1,
            [],
            "cpu",
        ),
        bad(
            "BlockTables max_num_reqs 0",
            ValueError,
            "BlockTables(): max_num_reqs must be positive, got 0",
            T,
            [16],
            0,
            1,
            [1],
            "cpu",
        ),
        bad(
            "BlockTables one max blocks per group",
            ValueError,
            "BlockTables(): max_num_blocks_per_group must have 1 entries (one per cache group), got 2",
            T,
            [16],
            1,
            1,
            [1, 2],
            "cpu",
        ),
        kw_case(
            "BlockTables kernel block size 6",
            ValueError,
            "BlockTables(): kernel_block_sizes[0] must divide block_sizes[0]=16, got 6",
            T,
            [16],
            1,
            1,
            [1],
            "cpu",
            kernel_block_sizes=[6],
        ),
        kw_case(
            "BlockTables cp_rank 2",
            ValueError,
            "BlockTables(): cp_rank must be in [0, 2), got 2",
            T,
            [16],
            1,
            1,
            [1],
            "cpu",
            cp_size=2,
            cp_rank=2,
        ),
        kw_case(
            "BlockTables cp_interleave 0",
            ValueError,
            "BlockTables(): cp_interleave must be positive, got 0",
            T,
            [16],
            1,
            1,
            [1],
            "cpu",
            cp_interleave=0,
        ),
    ]
    two = append_tables(device)
    append = "BlockTables.append_block_ids(): "
    methods = [
        # Group 0 would fit, group 1 overflows its single column: nothing may change.
        _tables_case(
            "append overflows group 1",
            ValueError,
            append
            + "block ids must fit in the 0 free kernel-block columns of row 0 (1 per block), got 1 ids",
            two,
            "append_block_ids",
            0,
            [[1], [6]],
        ),
        _tables_case(
            "append negative id in group 1",
            ValueError,
            append + "block ids must be non-negative, got -1",
            two,
            "append_block_ids",
            0,
            [[1], [-1]],
        ),
        _tables_case(
            "append float id in group 1",
            TypeError,
            append + "block_ids_per_group[1][0] must be an int, got 1.5",
            two,
            "append_block_ids",
            0,
            [[1], [1.5]],
        ),
        _tables_case(
            "append one group of two",
            ValueError,
            append + "block_ids_per_group must have 2 entries (one per cache group), got 1",
            two,
            "append_block_ids",
            0,
            [[1]],
        ),
        _tables_case(
            "append row 2",
            ValueError,
            append + "row must be in [0, 2), got 2",
            two,
            "append_block_ids",
            2,
            [[1], [1]],
        ),
        _tables_case(
            "append row '0'",
            TypeError,
            append + "row must be an int, got '0'",
            two,
            "append_block_ids",
            "0",
            [[1], [1]],
        ),
        _tables_case(
            "clear_row -1",
            ValueError,
            "BlockTables.clear_row(): row must be in [0, 2), got -1",
            two,
            "clear_row",
            -1,
        ),
    ]
    four = diffkv.BlockTables([4, 2], 4, 32, [3, 3], device)
    methods.append(
        _tables_case(
            "gather num_reqs_padded 1 of 2",
            ValueError,
            "BlockTables.gather_block_tables(): num_reqs_padded must be in [2, 4], got 1",
            four,
            "gather_block_tables",
            [0, 1],
            num_reqs_padded=1,
        )
    )
    slots = diffkv.BlockTables([4], 1, 8, [2], device)
    slots.append_block_ids(0, [[0, 1]])
    row_indices = torch.tensor([0], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 6], dtype=torch.int32, device=device)
    positions = torch.arange(6, device=device)
    for padded in (9, 5):
        methods.append(
            _tables_case(
                f"slot mappings num_tokens_padded {padded}",
                ValueError,
                f"BlockTables.compute_slot_mappings(): num_tokens_padded must be in [6, 8], got {padded}",
                slots,
                "compute_slot_mappings",
                row_indices,
                qsl,
                positions,
                num_tokens_padded=padded,
            )
        )
    one = diffkv.BlockTables([4], 2, 8, 2, device)
    one.append_block_ids(0, [[1]])
    methods += [
        _tables_case(
            "gather float row indices",
            TypeError,
            "BlockTables.gather_block_tables(): row_indices must be an int32 or int64 tensor, "
            "got torch.float32",
            one,
            "gather_block_tables",
            torch.zeros(1),
            1,
        ),
        _tables_case(
            "gather int row indices",
            TypeError,
            "BlockTables.gather_block_tables(): row_indices must be a tensor or a sequence of ints, got 0",
            one,
            "gather_block_tables",
            0,
            1,
        ),
        _tables_case(
            "slot mappings positions a list",
            TypeError,
            "BlockTables.compute_slot_mappings(): positions must be a 1-D tensor, got [0, 1]",
            one,
            "compute_slot_mappings",
            None,
            None,
            [0, 1],
            num_tokens_padded=2,
        ),
        _tables_case(
            "append two groups of one",
            ValueError,
            append + "block_ids_per_group must have 1 entries (one per cache group), got 2",
            one,
            "append_block_ids",
            0,
            [[1], [2]],
        ),
        _tables_case(
            "append group not a sequence",
            TypeError,
            append + "block_ids_per_group[0] must be a sequence of ints, got 3",
            one,
            "append_block_ids",
            0,
            [3],
        ),
    ]
    # CPU tables on every device: the CUDA path does not read the query starts.
    cpu_one = one if torch.device(device).type == "cpu" else diffkv.BlockTables([4], 2, 8, 2, "cpu")
    methods.append(
        _tables_case(
            "slot mappings short positions",
            ValueError,
            "BlockTables.compute_slot_mappings(): positions must have query_start_loc[-1]=3 entries, got 2",
            cpu_one,
            "compute_slot_mappings",
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32),
            torch.arange(2),
            num_tokens_padded=4,
        )
    )
    return {"BlockTables": construct, "BlockTables methods": methods}


def pool_in_use(num_blocks: int, allocated: int, freed: tuple = ()) -> Any:
    pool = diffkv.BlockPool(num_blocks)
    pool.allocate(allocated)
    if freed:
        pool.free(list(freed))
    return pool


def _pool_case(name: str, exc: type[BaseException], message: str, pool: Any, method: str, *args: Any) -> Case:
    case = bad(name, exc, message, getattr(pool, method), *args)
    case.env = pool
    return case


def _cases_block_pool() -> dict[str, list[Case]]:
    three = pool_in_use(3, 2)
    four = pool_in_use(4, 4)
    return {
        "BlockPool": [
            bad(
                "BlockPool num_blocks 0",
                ValueError,
                "BlockPool(): num_blocks must be positive, got 0",
                diffkv.BlockPool,
                0,
            ),
            bad(
                "BlockPool num_blocks 2.0",
                TypeError,
                "BlockPool(): num_blocks must be an int, got 2.0",
                diffkv.BlockPool,
                2.0,
            ),
        ],
        "BlockPool methods": [
            _pool_case(
                "pool exhausted",
                RuntimeError,
                "BlockPool.allocate(): n must be at most the number of free blocks (3), got 5",
                pool_in_use(5, 2),
                "allocate",
                5,
            ),
            _pool_case(
                "pool allocate -1",
                ValueError,
                "BlockPool.allocate(): n must be non-negative, got -1",
                pool_in_use(2, 0),
                "allocate",
                -1,
            ),
            _pool_case(
                "pool double free",
                ValueError,
                "BlockPool.free(): block id 0 is not allocated (double free?)",
                pool_in_use(4, 3, (0,)),
                "free",
                [1, 0],
            ),
            _pool_case(
                "pool repeated id",
                ValueError,
                "BlockPool.free(): block ids must not repeat, got block id 2 twice",
                pool_in_use(4, 3),
                "free",
                [2, 1, 2],
            ),
            _pool_case(
                "pool free id 4",
                ValueError,
                "BlockPool.free(): block id must be in [0, 4), got 4",
                four,
                "free",
                [0, 4],
            ),
            _pool_case(
                "pool free id -1",
                ValueError,
                "BlockPool.free(): block id must be in [0, 4), got -1",
                four,
                "free",
                [-1],
            ),
            _pool_case(
                "pool allocate 2.0",
                TypeError,
                "BlockPool.allocate(): n must be an int, got 2.0",
                three,
                "allocate",
                2.0,
            ),
            _pool_case(
                "pool allocate True",
                TypeError,
                "BlockPool.allocate(): n must be an int, got True",
                three,
                "allocate",
                True,
            ),
            _pool_case(
                "pool free 'a'",
                TypeError,
                "BlockPool.free(): block_ids[1] must be an int, got 'a'",
                three,
                "free",
                [0, "a"],
            ),
            _pool_case(
                "pool free 5",
                TypeError,
                "BlockPool.free(): block_ids must be a sequence of ints, got 5",
                three,
                "free",
                5,
            ),
        ],
    }


def kv_config(num_blocks=5, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16) -> Any:
    """Layers l0, l1 (causal) and l2 (non-causal) of one shape."""
    spec = diffkv.AttentionSpec(block_size, num_kv_heads, head_size, dtype)
    spec2 = diffkv.AttentionSpec(block_size, num_kv_heads, head_size, dtype, non_causal=True)
    return diffkv.KVCacheConfig(
        num_blocks, [diffkv.KVCacheGroup(["l0", "l1"], spec), diffkv.KVCacheGroup(["l2"], spec2)]
    )


def mixed_kv_config() -> Any:
    """Layers a (block size 4) and b (block size 8)."""
    return diffkv.KVCacheConfig(
        3,
        [
            diffkv.KVCacheGroup(["a"], diffkv.AttentionSpec(4, 2, 8, torch.float16)),
            diffkv.KVCacheGroup(["b"], diffkv.AttentionSpec(8, 2, 8, torch.float16)),
        ],
    )


def _cases_allocation() -> dict[str, list[Case]]:
    from diffkv import native

    allocate = diffkv.allocate_kv_caches
    cfg = kv_config()
    layers = {"l0": SimpleNamespace(kv_cache=None), "l2": SimpleNamespace(kv_cache=None)}
    missing = kw_case(
        "allocate layers lacks l1",
        KeyError,
        "allocate_kv_caches(): layers has no layer 'l1' named by kv_cache_config",
        allocate,
        cfg,
        dtype=torch.float16,
        device="cpu",
        layers=layers,
    )
    missing.env = layers
    one = diffkv.KVCacheConfig(4, [diffkv.KVCacheGroup(["a"], diffkv.AttentionSpec(4, 1, 8, torch.float32))])
    return {
        "allocate_kv_caches": [
            missing,
            kw_case(
                "allocate layout 'packed'",
                ValueError,
                "allocate_kv_caches(): layout must be 'layer_major' or 'block_major', got 'packed'",
                allocate,
                cfg,
                dtype=torch.float16,
                device="cpu",
                layout="packed",
            ),
            kw_case(
                "allocate dtype mismatch",
                ValueError,
                "allocate_kv_caches(): dtype must match kv_cache_groups[0].spec.dtype torch.float16, "
                "got torch.bfloat16",
                allocate,
                cfg,
                dtype=torch.bfloat16,
                device="cpu",
            ),
            kw_case(
                "allocate dtype int8",
                ValueError,
                "allocate_kv_caches(): dtype must be one of torch.float32, torch.float16, torch.bfloat16, "
                "torch.float8_e4m3fn, got torch.int8",
                allocate,
                cfg,
                dtype=torch.int8,
                device="cpu",
            ),
            kw_case(
                "allocate dtype a str",
                TypeError,
                "allocate_kv_caches(): dtype must be a torch.dtype, got 'float16'",
                allocate,
                cfg,
                dtype="float16",
                device="cpu",
            ),
            kw_case(
                "allocate config a dict",
                TypeError,
                "allocate_kv_caches(): kv_cache_config must be a KVCacheConfig, got dict",
                allocate,
                {},
                dtype=torch.float16,
                device="cpu",
            ),
            kw_case(
                "allocate block_major of mixed shapes",
                ValueError,
                "allocate_kv_caches(): layout 'block_major' needs one (block_size, num_kv_heads, head_size) "
                "for every layer, got [(4, 2, 8), (8, 2, 8)]",
                allocate,
                mixed_kv_config(),
                dtype=torch.float16,
                device="cpu",
                layout="block_major",
            ),
        ],
        "metadata builders": [
            bad(
                "slot mappings by layer of one row",
                ValueError,
                "build_slot_mappings_by_layer(): slot_mappings must be [2, num_tokens], got shape=(1, 6)",
                native.build_slot_mappings_by_layer,
                torch.arange(12, dtype=torch.int64).reshape(2, 6)[:1],
                cfg,
            ),
            kw_case(
                "dcp local seq lens rank 2 of 2",
                ValueError,
                "get_dcp_local_seq_lens(): dcp_rank must be in [0, 2), got 2",
                native.get_dcp_local_seq_lens,
                torch.tensor([5, 0, 1, 8, 13], dtype=torch.int32),
                dcp_size=2,
                dcp_rank=2,
                cp_kv_cache_interleave_size=1,
            ),
            kw_case(
                "dcp local seq lens of a list",
                TypeError,
                "get_dcp_local_seq_lens(): seq_lens must be a tensor, got list",
                native.get_dcp_local_seq_lens,
                [1],
                dcp_size=1,
                dcp_rank=0,
                cp_kv_cache_interleave_size=1,
            ),
            kw_case(
                "attn metadata without groups",
                ValueError,
                "build_attn_metadata(): attn_groups must have 1 entries (one per cache group), got 0",
                native.build_attn_metadata,
                attn_groups=[],
                num_reqs=1,
                num_tokens=1,
                query_start_loc_gpu=None,
                query_start_loc_cpu=None,
                max_query_len=1,
                seq_lens=None,
                max_seq_len=1,
                block_tables=[],
                slot_mappings=torch.zeros(1, 1),
                kv_cache_config=one,
                seq_lens_cpu=None,
                positions=None,
                causal=True,
            ),
        ],
    }


def _cases_impl() -> dict[str, list[Case]]:
    Impl = diffkv.DiffKVAttentionImpl
    start = "DiffKVAttentionImpl(): "
    cases = [
        kw_case(
            "impl no scale", TypeError, start + "softmax_scale (or its alias scale) is required", Impl, 4, 64
        )
    ]
    for name, exc, message, kwargs in (
        (
            "scales disagree",
            ValueError,
            "scale and softmax_scale must agree, got scale=0.1, softmax_scale=0.2",
            {"softmax_scale": 0.2},
        ),
        (
            "alibi_slopes",
            NotImplementedError,
            "alibi_slopes is not supported, got [1.0]",
            {"alibi_slopes": [1.0]},
        ),
        (
            "sliding_window",
            NotImplementedError,
            "sliding_window is not supported, got 128",
            {"sliding_window": 128},
        ),
        (
            "logits_soft_cap",
            NotImplementedError,
            "logits_soft_cap is not supported, got 30.0",
            {"logits_soft_cap": 30.0},
        ),
        (
            "kv sharing",
            NotImplementedError,
            "kv_sharing_target_layer_name is not supported, got 'l0'",
            {"kv_sharing_target_layer_name": "l0"},
        ),
        (
            "fp8_e5m2 cache",
            NotImplementedError,
            "kv_cache_dtype must be one of ['auto', 'float32', 'float', 'float16', 'half', 'bfloat16'] "
            "(an unquantized cache) or ['fp8', 'fp8_e4m3'] (float8_e4m3fn), got 'fp8_e5m2'",
            {"kv_cache_dtype": "fp8_e5m2"},
        ),
        (
            "encoder",
            NotImplementedError,
            "attn_type must be 'decoder', got 'encoder'",
            {"attn_type": "encoder"},
        ),
        (
            "backend_kwargs",
            NotImplementedError,
            "backend_kwargs are not supported, got ['x']",
            {"backend_kwargs": {"x": 1}},
        ),
        ("unexpected keyword", TypeError, "unexpected keyword arguments ['bogus']", {"bogus": 1}),
        (
            "num_kv_heads 3 of 4",
            ValueError,
            "num_kv_heads must be positive and divide num_heads=4, got 3",
            {"num_kv_heads": 3},
        ),
    ):
        cases.append(kw_case(f"impl {name}", exc, start + message, Impl, 4, 64, scale=0.1, **kwargs))
    return {"DiffKVAttentionImpl": cases}


def _cases_collaborators(device: Any) -> dict[str, list[Case]]:
    cases: dict[str, list[Case]] = {}
    for part in (
        _cases_rows,
        _cases_piecewise,
        _cases_configs,
        _cases_block_pool,
        _cases_allocation,
        _cases_impl,
    ):
        cases.update(part())
    cases.update(_cases_block_tables(device))
    cases.update(_cases_runtime(device))
    return cases


def public_cases(device: Any = "cpu") -> dict[str, list[Case]]:
    """The public entry points' cases (built afresh on each call); the Q/K/V ones on ``device``."""
    cases: dict[str, list[Case]] = {}
    for part in (
        _cases_layer_adapter,
        _cases_adapter,
        _cases_prepare_batch,
        _cases_activation,
        _cases_backend,
    ):
        cases.update(part())
    cases.update(_cases_layer_context(device))
    cases.update(_cases_collaborators(device))
    return cases


def public_error_cases(device: Any = "cpu") -> list[tuple[str, Case]]:
    """Every failing public case as ``(entry point, case)``."""
    return [(entry, case) for entry, cases in public_cases(device).items() for case in cases if case.raises]


def public_case(name: str, device: Any = "cpu") -> Case:
    """The public case called ``name`` (its environment built afresh)."""
    return next(case for _, case in public_error_cases(device) if case.name == name)
