"""Hypothesis strategies shared by the fuzz suite (tests/test_fuzz.py).

Two kinds of values:

- hostile objects for any argument slot: ``hostile_objects()`` (None, bools, ints beyond int64,
  NaN/inf, strings, containers, foreign objects and ``hostile_tensors()``), ``hostile_ints()``
  (the int64/int32 edges and small values);
- small valid problems that a test then corrupts one field at a time: ``attention_problems()``
  (paged attention / forward_paged / kv_write arguments with randomly permuted block tables,
  spare blocks, padding slots and non-contiguous views) and ``table_problems()`` (block-table
  and slot-mapping arguments).

Nothing here allocates much: "huge" tensors are zero-stride ``expand()`` views of one element.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

INT_EDGES = (
    -(2**100),
    -(2**64),
    -(2**63) - 1,
    -(2**63),
    -(2**31) - 1,
    -(2**31),
    -1,
    0,
    1,
    2**31 - 1,
    2**31,
    2**32,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    2**100,
)


def hostile_ints() -> st.SearchStrategy[int]:
    """int64/int32 edges, beyond-int64 values and small ints."""
    return st.one_of(st.sampled_from(INT_EDGES), st.integers(-3, 40))


class _Opaque:
    """An object with no useful attributes."""

    def __repr__(self) -> str:
        return "<opaque>"


class _BadIndex:
    """Claims to be an integer but fails when asked."""

    def __index__(self) -> int:
        raise RuntimeError("hostile __index__")

    def __repr__(self) -> str:
        return "<bad index>"


class _FakeTensor:
    """Has ``__dlpack__`` (the bridge's tensor test) but is no tensor."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("not a real tensor")

    def __repr__(self) -> str:
        return "<fake tensor>"


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ALL_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
)


@st.composite
def hostile_tensors(draw: st.DrawFn) -> torch.Tensor:
    """Tensors of every kind the bridge can meet: odd dtypes, 0-d and 9-d, empty, meta, sparse,
    zero-stride "huge" views, transposed and strided views, requires_grad."""
    kind = draw(
        st.sampled_from(
            ("plain", "empty", "scalar", "ndim9", "meta", "sparse", "huge", "strided", "grad", "overlap")
        )
    )
    dtype = draw(st.sampled_from(_ALL_DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=5)))
    if kind == "plain":
        return torch.zeros(shape, dtype=dtype)
    if kind == "empty":
        return torch.zeros((*shape[:-1], 0), dtype=dtype)
    if kind == "scalar":
        return torch.zeros((), dtype=dtype)
    if kind == "ndim9":
        return torch.zeros([1] * 9, dtype=dtype)
    if kind == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if kind == "sparse":
        return torch.zeros(2, 2).to_sparse()
    if kind == "huge":
        big = draw(st.sampled_from((2**31, 2**40, 2**62)))
        dims = draw(st.integers(1, 5))
        base = torch.zeros([1] * dims, dtype=dtype)
        target = [1] * dims
        target[draw(st.integers(0, dims - 1))] = big
        return base.expand(target)
    if kind == "strided":
        t = torch.zeros((*shape, 4), dtype=dtype)
        return t.transpose(0, -1)[::2]
    if kind == "grad":
        return torch.zeros(shape, dtype=torch.float32, requires_grad=True)
    # Overlapping rows: an as_strided view whose rows share elements.
    base = torch.zeros(8, dtype=dtype)
    return base.as_strided((4, 3), (1, 1))


def hostile_objects() -> st.SearchStrategy[Any]:
    """Anything a caller could pass in an argument slot."""
    return st.one_of(
        st.none(),
        st.booleans(),
        hostile_ints(),
        st.sampled_from((float("nan"), float("inf"), -float("inf"), -0.0, 1e308, 5e-324)),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=3),
        st.binary(max_size=2),
        st.lists(st.integers(-2, 5), max_size=3),
        st.tuples(st.integers(-2, 5), st.integers(-2, 5)),
        st.dictionaries(st.text(max_size=1), st.integers(), max_size=1),
        st.sampled_from((np.int64(3), np.int32(-1), np.float64("nan"), np.bool_(True))),
        st.builds(_Opaque),
        st.builds(_BadIndex),
        st.builds(_FakeTensor),
        hostile_tensors(),
    )


# ------------------------------------------------------------------------------------------------
# Valid attention problems
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class AttentionProblem:
    """One valid paged-attention call (and its KV write) on CPU.

    query/out [N, H, D]; key/value [N, Hkv, D]; kv_cache (2, num_blocks, block_size, Hkv, D)
    (possibly a block-major view); block_table int32 [R, cols]; query_start_loc int32 [R+1];
    seq_lens int32 [R]; slot_mapping int64 [N] (some -1); key_limits int32 [N] or None.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    key_limits: torch.Tensor | None
    mask: int
    scale: float
    out: torch.Tensor

    def attention_args(self) -> list[Any]:
        """The 12 arguments of _C.paged_attention (host_* are the same CPU tensors)."""
        return [
            self.query,
            self.kv_cache,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
            self.key_limits,
            self.mask,
            self.scale,
            self.out,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
        ]

    def forward_args(self) -> list[Any]:
        """The 15 arguments of _C.forward_paged."""
        a = self.attention_args()
        return [a[0], self.key, self.value, self.kv_cache, self.slot_mapping, *a[2:]]

    def kv_write_args(self) -> list[Any]:
        """The 4 arguments of _C.kv_write."""
        return [self.key, self.value, self.kv_cache, self.slot_mapping]


def _maybe_strided(
    draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """A random tensor of `shape`, either contiguous or a token-strided / transposed view."""
    layout = draw(st.sampled_from(("contiguous", "token_strided", "head_major")))
    if layout == "contiguous":
        return torch.randn(shape, generator=gen).to(dtype)
    if layout == "token_strided":
        wide = torch.randn((shape[0], shape[1] + 1, shape[2]), generator=gen).to(dtype)
        return wide[:, 1:]
    return torch.randn((shape[1], shape[0], shape[2]), generator=gen).to(dtype).transpose(0, 1)


@st.composite
def attention_problems(draw: st.DrawFn) -> AttentionProblem:
    """A small valid problem: 1-3 rows, GQA, block_size 1/2/4, permuted tables with spare
    blocks, lengths that are not block multiples, padding slots, every mask mode."""
    dtype = draw(st.sampled_from(_FLOAT_DTYPES))
    # the values from a drawn seed, so that a failing example replays with its data (torch's
    # global generator is not Hypothesis's to seed: such a failure read as flaky)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    num_kv_heads = draw(st.integers(1, 2))
    num_heads = num_kv_heads * draw(st.integers(1, 2))
    head_size = draw(st.sampled_from((1, 2, 4, 8)))
    block_size = draw(st.sampled_from((1, 2, 4)))
    mask = draw(st.sampled_from((0, 1, 2)))
    num_rows = draw(st.integers(1, 3))
    seq_lens, query_lens = [], []
    for _ in range(num_rows):
        seq_len = draw(st.integers(0, 9))
        query_len = draw(st.integers(0, seq_len if mask else 4))
        seq_lens.append(seq_len)
        query_lens.append(query_len)
    cols = max(1, max(-(-s // block_size) for s in seq_lens))
    spare = draw(st.integers(0, 3))
    num_blocks = num_rows * cols + spare
    perm = torch.tensor(draw(st.permutations(range(num_blocks))), dtype=torch.int32)
    block_table = perm[: num_rows * cols].reshape(num_rows, cols).contiguous()
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    n = qsl[-1]
    shape_c = (2, num_blocks, block_size, num_kv_heads, head_size)
    if draw(st.booleans()):
        kv_cache = torch.randn(shape_c, generator=gen).to(dtype)
    else:  # block-major: one buffer [num_blocks, 2, ...], each layer a permuted view
        kv_cache = torch.randn((num_blocks, 2, block_size, num_kv_heads, head_size), generator=gen)
        kv_cache = kv_cache.to(dtype)
        kv_cache = kv_cache.permute(1, 0, 2, 3, 4)
    slots = []
    for r in range(num_rows):
        for i in range(query_lens[r]):
            p = seq_lens[r] - query_lens[r] + i
            pad = draw(st.integers(0, 7)) == 0 or p < 0  # mask 0 allows query_len > seq_len
            slots.append(-1 if pad else int(block_table[r, p // block_size]) * block_size + p % block_size)
    key_limits = None
    if mask == 2:
        limits = [
            draw(st.integers(-2, seq_lens[r] + 2)) for r in range(num_rows) for _ in range(query_lens[r])
        ]
        key_limits = torch.tensor(limits, dtype=torch.int32)
    return AttentionProblem(
        query=_maybe_strided(draw, (n, num_heads, head_size), dtype, gen),
        key=_maybe_strided(draw, (n, num_kv_heads, head_size), dtype, gen),
        value=_maybe_strided(draw, (n, num_kv_heads, head_size), dtype, gen),
        kv_cache=kv_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=block_table,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        key_limits=key_limits,
        mask=mask,
        scale=draw(st.sampled_from((1.0, 0.5, head_size**-0.5))),
        out=torch.full((n, num_heads, head_size), 7.0).to(dtype),
    )


# ------------------------------------------------------------------------------------------------
# Valid block-table problems
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TableProblem:
    """A persistent table and a batch over it.

    table int32 [rows, cols]; counts int32 [rows] (installed blocks per row); row_indices int32
    [R]; query_start_loc int32 [R+1]; positions int64 [N]; block_size, cp_size, cp_rank,
    cp_interleave as BlockTables holds them.
    """

    table: torch.Tensor
    counts: torch.Tensor
    row_indices: torch.Tensor
    query_start_loc: torch.Tensor
    positions: torch.Tensor
    block_size: int
    cp_size: int
    cp_rank: int
    cp_interleave: int


@st.composite
def table_problems(draw: st.DrawFn) -> TableProblem:
    """Tables with random ids, counts within the columns, distinct batch rows, positions that
    stay inside the table's columns."""
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(1, 4))
    cp_size = draw(st.sampled_from((1, 1, 2)))
    cp_interleave = draw(st.sampled_from((1, 2))) if cp_size > 1 else 1
    block_size = cp_interleave * draw(st.integers(1, 2)) if cp_size > 1 else draw(st.integers(1, 4))
    cp_rank = draw(st.integers(0, cp_size - 1))
    table = torch.tensor(
        draw(
            st.lists(st.lists(st.integers(0, 50), min_size=cols, max_size=cols), min_size=rows, max_size=rows)
        ),
        dtype=torch.int32,
    )
    counts = torch.tensor(
        draw(st.lists(st.integers(0, cols), min_size=rows, max_size=rows)), dtype=torch.int32
    )
    batch_rows = draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows, unique=True))
    qsl = [0]
    positions: list[int] = []
    span = block_size * cp_size
    for _ in batch_rows:
        n = draw(st.integers(0, 3))
        for _ in range(n):
            positions.append(draw(st.integers(0, cols * span - 1)))
        qsl.append(qsl[-1] + n)
    return TableProblem(
        table=table,
        counts=counts,
        row_indices=torch.tensor(batch_rows, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64),
        block_size=block_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
    )
