"""diffkv's standalone collaborators: the objects vLLM supplies to vLLM-Omni's adapter.

Entry points (docs/usage.md, *The API*):

- configs and specs: ``ModelConfig``, ``CacheConfig``, ``DiffusionConfig``, ``AttentionSpec``,
  ``KVCacheGroup``, ``KVCacheConfig``, ``AttentionGroup`` (+ ``PagedMetadataBuilder``);
- ``BlockTables``: persistent per-group block tables, gathered batch tables and slot mappings
  (vLLM's ``vllm/v1/worker/gpu/block_table.py`` semantics, the work done by ``diffkv._C``);
- ``BlockPool``: a free list of KV cache block ids;
- ``allocate_kv_caches``: per-layer ``(2, num_blocks, block_size, num_kv_heads, head_size)`` views
  in a layer-major or block-major buffer;
- ``PagedAttentionMetadata`` and the builders the platform hooks call:
  ``build_attn_metadata``, ``build_slot_mappings_by_layer``, ``get_dcp_local_seq_lens``.

Python holds data and orchestration only; every loop over tokens or blocks runs in ``diffkv._C``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from . import _C

__all__ = [
    "AttentionGroup",
    "AttentionSpec",
    "BlockPool",
    "BlockTables",
    "CacheConfig",
    "DiffusionConfig",
    "KVCacheConfig",
    "KVCacheGroup",
    "ModelConfig",
    "PagedAttentionMetadata",
    "PagedMetadataBuilder",
    "allocate_kv_caches",
    "build_attn_metadata",
    "build_slot_mappings_by_layer",
    "get_dcp_local_seq_lens",
]

# dtypes a KV cache may hold: the activation dtypes, or float8_e4m3fn (quantized: each layer's
# k/v scales: the CPU reference, and on CUDA the Hopper e4m3 kernel).
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)

_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
# A cache's: an activation dtype, or vLLM's cache_dtype names of a float8_e4m3fn cache.
_CACHE_DTYPE_NAMES = {**_DTYPE_NAMES, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(op: str, name: str, value: Any, minimum: int) -> int:
    """Returns ``int(value)``; TypeError for a non-integer, ValueError below ``minimum``."""
    if not _is_int(value):
        raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    value = int(value)
    if value < minimum:
        expectation = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{op}: {name} must be {expectation}, got {value}")
    return value


def _check_int_list(
    op: str, name: str, values: Any, minimum: int, length: int | None = None
) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{op}: {name} must be a sequence of ints, got {values!r}")
    out = tuple(_check_int(op, f"{name}[{i}]", v, minimum) for i, v in enumerate(values))
    if length is not None and len(out) != length:
        raise ValueError(f"{op}: {name} must have {length} entries (one per cache group), got {len(out)}")
    if not out:
        raise ValueError(f"{op}: {name} must not be empty")
    return out


def _to_dtype(op: str, name: str, value: Any, names: Mapping[str, torch.dtype] = _DTYPE_NAMES) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in names:
        return names[value]
    raise TypeError(f"{op}: {name} must be a torch.dtype or one of {sorted(names)}, got {value!r}")


# ------------------------------------------------------------------------------------------------
# Configs and specs
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelConfig:
    """The model side of ``DiffusionConfig``: ``dtype`` is the activation dtype of Q/K/V."""

    dtype: torch.dtype

    def __post_init__(self) -> None:
        self.dtype = _to_dtype("ModelConfig()", "dtype", self.dtype)


@dataclasses.dataclass
class CacheConfig:
    """The cache side of ``DiffusionConfig``: manager block size, cache dtype name ("auto", an
    activation dtype, or "fp8" / "fp8_e4m3" for a float8_e4m3fn cache) and vLLM's
    ``calculate_kv_scales`` (an fp8 layer's first KV write sets its scales)."""

    block_size: int = 16
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        self.block_size = _check_int("CacheConfig()", "block_size", self.block_size, 1)
        if not isinstance(self.cache_dtype, str):
            raise TypeError(f"CacheConfig(): cache_dtype must be a str, got {self.cache_dtype!r}")
        if self.cache_dtype == "fp8_e5m2":
            raise NotImplementedError(
                "CacheConfig(): cache_dtype 'fp8_e5m2' is not supported; diffkv's fp8 KV cache is e4m3 "
                "('fp8' or 'fp8_e4m3')"
            )
        if not isinstance(self.calculate_kv_scales, bool):
            raise TypeError(
                f"CacheConfig(): calculate_kv_scales must be a bool, got {self.calculate_kv_scales!r}"
            )


@dataclasses.dataclass
class DiffusionConfig:
    """Stands in for ``vllm_config``: the adapter reads ``.model_config`` and ``.cache_config``."""

    model_config: ModelConfig
    cache_config: CacheConfig

    def __post_init__(self) -> None:
        if not hasattr(self.model_config, "dtype"):
            raise TypeError(f"DiffusionConfig(): model_config must have a dtype, got {self.model_config!r}")
        if not hasattr(self.cache_config, "block_size") or not hasattr(self.cache_config, "cache_dtype"):
            raise TypeError(
                "DiffusionConfig(): cache_config must have block_size and cache_dtype, "
                f"got {self.cache_config!r}"
            )


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """KV cache spec of one attention layer (vLLM ``AttentionSpec`` fields the adapter reads).

    ``head_size_v=None`` means ``head_size``; the field is filled in at construction so that
    ``dataclasses.replace`` and ``int(spec.head_size_v)`` both work.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    non_causal: bool = False
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        op = "AttentionSpec()"
        for name in ("block_size", "num_kv_heads", "head_size"):
            object.__setattr__(self, name, _check_int(op, name, getattr(self, name), 1))
        object.__setattr__(self, "dtype", _to_dtype(op, "dtype", self.dtype, _CACHE_DTYPE_NAMES))
        if not isinstance(self.non_causal, bool):
            raise TypeError(f"{op}: non_causal must be a bool, got {self.non_causal!r}")
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        else:
            object.__setattr__(self, "head_size_v", _check_int(op, "head_size_v", self.head_size_v, 1))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: K and V pages."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * element


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (vLLM ``KVCacheGroupSpec``)."""

    layer_names: tuple[str, ...]
    spec: AttentionSpec

    def __post_init__(self) -> None:
        names = self.layer_names
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise TypeError(f"KVCacheGroup(): layer_names must be a sequence of str, got {names!r}")
        names = tuple(names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"KVCacheGroup(): layer_names must be non-empty strings, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"KVCacheGroup(): layer_names must be unique, got {names!r}")
        object.__setattr__(self, "layer_names", names)
        if not isinstance(self.spec, AttentionSpec):
            raise TypeError(f"KVCacheGroup(): spec must be an AttentionSpec, got {self.spec!r}")

    @property
    def kv_cache_spec(self) -> AttentionSpec:
        """vLLM's spelling of ``spec``."""
        return self.spec


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """Number of KV blocks and the cache groups (vLLM ``KVCacheConfig``)."""

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroup, ...]

    def __post_init__(self) -> None:
        op = "KVCacheConfig()"
        object.__setattr__(self, "num_blocks", _check_int(op, "num_blocks", self.num_blocks, 1))
        groups = self.kv_cache_groups
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
            raise TypeError(f"{op}: kv_cache_groups must be a sequence of KVCacheGroup, got {groups!r}")
        groups = tuple(groups)
        if not groups:
            raise ValueError(f"{op}: kv_cache_groups must not be empty")
        seen: set[str] = set()
        for i, group in enumerate(groups):
            if not isinstance(group, KVCacheGroup):
                raise TypeError(f"{op}: kv_cache_groups[{i}] must be a KVCacheGroup, got {group!r}")
            for name in group.layer_names:
                if name in seen:
                    raise ValueError(f"{op}: layer {name!r} appears in more than one cache group")
                seen.add(name)
        object.__setattr__(self, "kv_cache_groups", groups)


class PagedMetadataBuilder:
    """The metadata builder an ``AttentionGroup`` exposes; the adapter reads only
    ``reorder_batch_threshold`` (None: no decode-first ordering rule)."""

    reorder_batch_threshold: int | None = None

    def __init__(self, reorder_batch_threshold: int | None = None) -> None:
        if reorder_batch_threshold is not None:
            reorder_batch_threshold = _check_int(
                "PagedMetadataBuilder()", "reorder_batch_threshold", reorder_batch_threshold, 0
            )
        self.reorder_batch_threshold = reorder_batch_threshold

    def __repr__(self) -> str:
        return f"PagedMetadataBuilder(reorder_batch_threshold={self.reorder_batch_threshold!r})"


class AttentionGroup:
    """Layers of one cache group built by one metadata builder (vLLM ``AttentionGroup``)."""

    def __init__(self, layer_names: Sequence[str], reorder_batch_threshold: int | None = None) -> None:
        if isinstance(layer_names, str) or not isinstance(layer_names, Sequence):
            raise TypeError(f"AttentionGroup(): layer_names must be a sequence of str, got {layer_names!r}")
        self.layer_names = tuple(layer_names)
        self.metadata_builders = [PagedMetadataBuilder(reorder_batch_threshold)]

    def get_metadata_builder(self, ubatch_id: int = 0) -> PagedMetadataBuilder:
        """The builder of micro-batch ``ubatch_id`` (diffkv has one: index 0)."""
        if not _is_int(ubatch_id) or not 0 <= int(ubatch_id) < len(self.metadata_builders):
            raise IndexError(
                f"AttentionGroup.get_metadata_builder(): ubatch_id must be in "
                f"[0, {len(self.metadata_builders)}), got {ubatch_id!r}"
            )
        return self.metadata_builders[int(ubatch_id)]

    def __repr__(self) -> str:
        threshold = self.metadata_builders[0].reorder_batch_threshold
        return f"AttentionGroup(layer_names={self.layer_names!r}, reorder_batch_threshold={threshold!r})"


# ------------------------------------------------------------------------------------------------
# Block tables
# ------------------------------------------------------------------------------------------------


class HostDeviceCounts:
    """Installed kernel blocks per (group, row): ``np`` (numpy int32 ``[groups, max_num_reqs]``),
    ``cpu`` (the torch tensor sharing that memory) and ``gpu`` (its device mirror; the same
    tensor when the device is the CPU)."""

    def __init__(self, num_groups: int, max_num_reqs: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros((num_groups, max_num_reqs), dtype=torch.int32, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else self.cpu.to(device)


def _as_cpu_int32(op: str, name: str, value: Any, max_len: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: {name} must be an int32 or int64 tensor, got {value.dtype}")
        if value.ndim != 1:
            raise ValueError(f"{op}: {name} must be 1-D, got shape={tuple(value.shape)}")
        # Before the copy: a zero-stride view may claim any length.
        if value.shape[0] > max_len:
            raise ValueError(f"{op}: {name} must have at most {max_len} entries, got {value.shape[0]}")
        return value.to(device="cpu", dtype=torch.int32).contiguous()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{op}: {name} must be a tensor or a sequence of ints, got {value!r}")
    return torch.tensor(
        [_check_int(op, f"{name}[{i}]", v, 0) for i, v in enumerate(value)], dtype=torch.int32
    )


class BlockTables:
    """Per-group block tables of the Worker rows, as vLLM's GPU ``BlockTables``.

    Each group ``g`` keeps a persistent int32 table ``[max_num_reqs, max_num_blocks_per_group[g]
    * blocks_per_kv_block[g]]`` of **kernel** block ids (manager block ``b`` of size
    ``block_sizes[g]`` becomes kernel blocks ``b*k .. b*k+k-1`` of size
    ``kernel_block_sizes[g]``), a host copy that ``append_block_ids``/``clear_row`` edit and a
    device copy (``block_tables``) kept current by ``apply_staged_writes``.  ``num_blocks``
    counts installed kernel blocks per ``[group, row]``.  ``gather_block_tables`` and
    ``compute_slot_mappings`` return views of persistent buffers that the next call overwrites.
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_num_blocks_per_group: Sequence[int] | int,
        device: torch.device | str,
        kernel_block_sizes: Sequence[int] | None = None,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
    ) -> None:
        op = "BlockTables()"
        self.block_sizes = list(_check_int_list(op, "block_sizes", block_sizes, 1))
        num_groups = len(self.block_sizes)
        self.max_num_reqs = _check_int(op, "max_num_reqs", max_num_reqs, 1)
        self.max_num_batched_tokens = _check_int(op, "max_num_batched_tokens", max_num_batched_tokens, 1)
        if _is_int(max_num_blocks_per_group):
            max_num_blocks_per_group = [max_num_blocks_per_group] * num_groups
        self.max_num_blocks_per_group = list(
            _check_int_list(op, "max_num_blocks_per_group", max_num_blocks_per_group, 1, num_groups)
        )
        if kernel_block_sizes is None:
            kernel_block_sizes = self.block_sizes
        self.kernel_block_sizes = list(
            _check_int_list(op, "kernel_block_sizes", kernel_block_sizes, 1, num_groups)
        )
        for g, (size, kernel) in enumerate(zip(self.block_sizes, self.kernel_block_sizes, strict=True)):
            if size % kernel != 0:
                raise ValueError(
                    f"{op}: kernel_block_sizes[{g}] must divide block_sizes[{g}]={size}, got {kernel}"
                )
        self.blocks_per_kv_block = [
            s // k for s, k in zip(self.block_sizes, self.kernel_block_sizes, strict=True)
        ]
        self.cp_size = _check_int(op, "cp_size", cp_size, 1)
        self.cp_rank = _check_int(op, "cp_rank", cp_rank, 0)
        if self.cp_rank >= self.cp_size:
            raise ValueError(f"{op}: cp_rank must be in [0, {self.cp_size}), got {self.cp_rank}")
        self.cp_interleave = _check_int(op, "cp_interleave", cp_interleave, 1)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_groups = num_groups

        self._on_cpu = self.device.type == "cpu"
        pin = self.device.type == "cuda"
        self.num_blocks = HostDeviceCounts(num_groups, self.max_num_reqs, self.device)
        self._tables_cpu: list[torch.Tensor] = []
        self.block_tables: list[torch.Tensor] = []
        self._input_cpu: list[torch.Tensor] = []
        self.input_block_tables: list[torch.Tensor] = []
        for g in range(num_groups):
            cols = self.max_num_blocks_per_group[g] * self.blocks_per_kv_block[g]
            table = torch.zeros((self.max_num_reqs, cols), dtype=torch.int32, pin_memory=pin)
            gathered = torch.zeros((self.max_num_reqs, cols), dtype=torch.int32, pin_memory=pin)
            self._tables_cpu.append(table)
            self._input_cpu.append(gathered)
            self.block_tables.append(table if self._on_cpu else table.to(self.device))
            self.input_block_tables.append(gathered if self._on_cpu else gathered.to(self.device))
        self.slot_mappings = torch.full(
            (num_groups, self.max_num_batched_tokens), -1, dtype=torch.int64, device=self.device
        )
        self._staged_rows: set[int] = set()

    # --- row edits --------------------------------------------------------------------------

    def _check_row(self, op: str, row: Any) -> int:
        if not _is_int(row):
            raise TypeError(f"{op}: row must be an int, got {row!r}")
        row = int(row)
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"{op}: row must be in [0, {self.max_num_reqs}), got {row}")
        return row

    def append_block_ids(
        self,
        row: int,
        block_ids_per_group: Sequence[Sequence[int]],
        overwrite: bool = False,
    ) -> None:
        """Appends (or, with ``overwrite``, installs) manager block ids into ``row`` of every
        group: ``block_ids_per_group[g]`` is a sequence of manager block ids of group ``g``.
        All groups are validated by ``_C.table_append``; on any error no group changes."""
        op = "BlockTables.append_block_ids()"
        row = self._check_row(op, row)
        if isinstance(block_ids_per_group, (str, bytes)) or not isinstance(block_ids_per_group, Sequence):
            raise TypeError(
                f"{op}: block_ids_per_group must be a sequence (one per cache group), "
                f"got {block_ids_per_group!r}"
            )
        if len(block_ids_per_group) != self.num_groups:
            raise ValueError(
                f"{op}: block_ids_per_group must have {self.num_groups} entries (one per cache group), "
                f"got {len(block_ids_per_group)}"
            )
        ids_per_group = []
        for g, ids in enumerate(block_ids_per_group):
            if isinstance(ids, torch.Tensor):
                # Before tolist(): a zero-stride view may claim any length.
                limit = self.max_num_blocks_per_group[g]
                if ids.ndim != 1 or ids.shape[0] > limit:
                    raise ValueError(
                        f"{op}: block_ids_per_group[{g}] must be 1-D with at most {limit} ids, "
                        f"got shape={tuple(ids.shape)}"
                    )
                ids = ids.tolist()
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise TypeError(f"{op}: block_ids_per_group[{g}] must be a sequence of ints, got {ids!r}")
            for i, block_id in enumerate(ids):
                if not _is_int(block_id):
                    raise TypeError(f"{op}: block_ids_per_group[{g}][{i}] must be an int, got {block_id!r}")
            ids_per_group.append([int(block_id) for block_id in ids])
        saved = [(t[row].clone(), int(self.num_blocks.np[g, row])) for g, t in enumerate(self._tables_cpu)]
        try:
            for g, ids in enumerate(ids_per_group):
                _C.table_append(
                    self._tables_cpu[g],
                    self.num_blocks.cpu[g],
                    row,
                    ids,
                    self.blocks_per_kv_block[g],
                    0,
                    bool(overwrite),
                )
        except BaseException:
            for g, (table_row, count) in enumerate(saved):
                self._tables_cpu[g][row].copy_(table_row)
                self.num_blocks.np[g, row] = count
            raise
        self._staged_rows.add(row)
        self.apply_staged_writes()

    def clear_row(self, row: int) -> None:
        """Removes every block of ``row`` in every group (count 0, ids zeroed)."""
        row = self._check_row("BlockTables.clear_row()", row)
        for g, table in enumerate(self._tables_cpu):
            table[row].zero_()
            self.num_blocks.np[g, row] = 0
        self._staged_rows.add(row)
        self.apply_staged_writes()

    def apply_staged_writes(self) -> None:
        """Copies the host rows edited since the last call to the device tables and counts.
        ``append_block_ids`` and ``clear_row`` call it, so the device copy is always current;
        calling it again is harmless."""
        rows = sorted(self._staged_rows)
        self._staged_rows.clear()
        if self._on_cpu:
            return
        for row in rows:
            for g in range(self.num_groups):
                self.block_tables[g][row].copy_(self._tables_cpu[g][row])
            self.num_blocks.gpu[:, row].copy_(self.num_blocks.cpu[:, row])

    # --- batch views ------------------------------------------------------------------------

    def gather_block_tables(
        self, row_indices: torch.Tensor | Sequence[int], num_reqs_padded: int
    ) -> tuple[torch.Tensor, ...]:
        """Per group, an int32 ``[num_reqs_padded, cols]`` device view of the persistent input
        table: row ``i`` holds the installed blocks of table row ``row_indices[i]``; rows from
        ``len(row_indices)`` on are zeroed.  Reads ``row_indices`` on the host (a device tensor
        is copied back once; this is a per-batch, not a per-layer, call)."""
        op = "BlockTables.gather_block_tables()"
        rows_cpu = _as_cpu_int32(op, "row_indices", row_indices, self.max_num_reqs)
        num_reqs_padded = _check_int(op, "num_reqs_padded", num_reqs_padded, 0)
        if not rows_cpu.shape[0] <= num_reqs_padded <= self.max_num_reqs:
            raise ValueError(
                f"{op}: num_reqs_padded must be in [{rows_cpu.shape[0]}, {self.max_num_reqs}], "
                f"got {num_reqs_padded}"
            )
        for g in range(self.num_groups):
            _C.gather_block_tables(
                self._tables_cpu[g], self.num_blocks.cpu[g], rows_cpu, self._input_cpu[g], num_reqs_padded
            )
        if not self._on_cpu:
            for g in range(self.num_groups):
                self.input_block_tables[g][:num_reqs_padded].copy_(self._input_cpu[g][:num_reqs_padded])
        return tuple(t[:num_reqs_padded] for t in self.input_block_tables)

    def compute_slot_mappings(
        self,
        row_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
    ) -> torch.Tensor:
        """int64 ``[num_groups, num_tokens_padded]`` view of the persistent slot buffer.

        row_indices: int32 ``[R]`` table rows; query_start_loc: int32 ``[R+1]``; positions:
        int64 ``[N]`` with ``N = query_start_loc[R]`` (all on this BlockTables' device).  The
        slot of a token at position ``p`` follows vLLM (context parallel: interleaved, non-local
        tokens -1); every entry from ``N`` to ``max_num_batched_tokens`` is -1."""
        op = "BlockTables.compute_slot_mappings()"
        if not isinstance(positions, torch.Tensor) or positions.ndim != 1:
            raise TypeError(f"{op}: positions must be a 1-D tensor, got {positions!r}")
        num_tokens = int(positions.shape[0])
        num_tokens_padded = _check_int(op, "num_tokens_padded", num_tokens_padded, 0)
        if not num_tokens <= num_tokens_padded <= self.max_num_batched_tokens:
            raise ValueError(
                f"{op}: num_tokens_padded must be in [{num_tokens}, {self.max_num_batched_tokens}], "
                f"got {num_tokens_padded}"
            )
        if isinstance(query_start_loc, torch.Tensor) and query_start_loc.device.type == "cpu":
            total = int(query_start_loc[-1]) if query_start_loc.numel() else 0
            if total != num_tokens:
                raise ValueError(
                    f"{op}: positions must have query_start_loc[-1]={total} entries, got {num_tokens}"
                )
        for g in range(self.num_groups):
            _C.compute_slot_mappings(
                self.block_tables[g],
                row_indices,
                query_start_loc,
                positions,
                self.slot_mappings[g],
                num_tokens,
                self.max_num_batched_tokens,
                self.kernel_block_sizes[g],
                self.cp_size,
                self.cp_rank,
                self.cp_interleave,
            )
        return self.slot_mappings[:, :num_tokens_padded]


# ------------------------------------------------------------------------------------------------
# Block pool
# ------------------------------------------------------------------------------------------------


class BlockPool:
    """Free list of KV cache block ids ``[0, num_blocks)``; state lives in three small CPU
    tensors that ``_C.pool_*`` edit.  Fresh pools hand out 0, 1, 2, ... first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = _check_int("BlockPool()", "num_blocks", num_blocks, 1)
        self._state = torch.zeros(1, dtype=torch.int64)
        self._free_stack = torch.zeros(self.num_blocks, dtype=torch.int32)
        self._in_use = torch.zeros(self.num_blocks, dtype=torch.uint8)
        _C.pool_init(self._state, self._free_stack, self._in_use)

    @property
    def num_free(self) -> int:
        """Blocks currently free."""
        return int(self._state[0])

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` free block ids.  RuntimeError when fewer are free (nothing taken)."""
        return _C.pool_allocate(self._state, self._free_stack, self._in_use, n)

    def free(self, block_ids: Sequence[int]) -> None:
        """Returns allocated ids.  ValueError for an id out of range, not allocated or
        repeated; on any error nothing is freed."""
        op = "BlockPool.free()"
        if isinstance(block_ids, torch.Tensor):
            # Before tolist(): a zero-stride view may claim any length; more ids than blocks
            # must repeat one.
            if block_ids.ndim != 1 or block_ids.shape[0] > self.num_blocks:
                raise ValueError(
                    f"{op}: block_ids must be 1-D with at most {self.num_blocks} ids, "
                    f"got shape={tuple(block_ids.shape)}"
                )
            block_ids = block_ids.tolist()
        elif isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__iter__"):
            raise TypeError(f"{op}: block_ids must be a sequence of ints, got {block_ids!r}")
        block_ids = list(block_ids)
        for i, block_id in enumerate(block_ids):
            if not _is_int(block_id):
                raise TypeError(f"{op}: block_ids[{i}] must be an int, got {block_id!r}")
        _C.pool_free(self._state, self._free_stack, self._in_use, [int(b) for b in block_ids])

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, num_free={self.num_free})"


# ------------------------------------------------------------------------------------------------
# KV cache allocation
# ------------------------------------------------------------------------------------------------

_LAYOUTS = ("layer_major", "block_major")


def allocate_kv_caches(
    kv_cache_config: KVCacheConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    layers: Mapping[str, Any] | None = None,
    layout: str = "layer_major",
) -> dict[str, torch.Tensor]:
    """Allocates zeroed KV caches; returns ``{layer_name: (2, num_blocks, block_size,
    num_kv_heads, head_size) tensor}`` (K at index 0, V at 1).

    layout "layer_major": one contiguous tensor per layer.  "block_major": one buffer
    ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`` (each block holds every
    layer, vLLM's BLNHC), each layer a permuted view, so the block stride spans all layers;
    every layer must then share block_size, num_kv_heads and head_size.  With ``layers``, each
    ``layers[name].kv_cache`` is bound to its tensor (all names are checked first)."""
    op = "allocate_kv_caches()"
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise TypeError(
            f"{op}: kv_cache_config must be a KVCacheConfig, got {type(kv_cache_config).__name__}"
        )
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}: dtype must be a torch.dtype, got {dtype!r}")
    if dtype not in KV_DTYPES:
        raise ValueError(
            f"{op}: dtype must be one of torch.float32, torch.float16, torch.bfloat16, "
            f"torch.float8_e4m3fn, got {dtype}"
        )
    if layout not in _LAYOUTS:
        raise ValueError(f"{op}: layout must be 'layer_major' or 'block_major', got {layout!r}")
    device = torch.device(device)
    entries: list[tuple[str, AttentionSpec]] = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.spec
        if spec.dtype != dtype:
            raise ValueError(
                f"{op}: dtype must match kv_cache_groups[{g}].spec.dtype {spec.dtype}, got {dtype}"
            )
        if spec.head_size_v != spec.head_size:
            raise ValueError(
                f"{op}: kv_cache_groups[{g}].spec must have head_size_v == head_size, "
                f"got head_size={spec.head_size}, head_size_v={spec.head_size_v}"
            )
        entries.extend((name, spec) for name in group.layer_names)
    if layers is not None:
        if not isinstance(layers, Mapping):
            raise TypeError(
                f"{op}: layers must be a mapping of layer name to layer, got {type(layers).__name__}"
            )
        for name, _ in entries:
            if name not in layers:
                raise KeyError(f"{op}: layers has no layer {name!r} named by kv_cache_config")
    num_blocks = kv_cache_config.num_blocks
    caches: dict[str, torch.Tensor] = {}
    if layout == "layer_major":
        for name, spec in entries:
            shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            caches[name] = torch.zeros(shape, dtype=dtype, device=device)
    else:
        geometry = {(s.block_size, s.num_kv_heads, s.head_size) for _, s in entries}
        if len(geometry) != 1:
            raise ValueError(
                f"{op}: layout 'block_major' needs one (block_size, num_kv_heads, head_size) for every "
                f"layer, got {sorted(geometry)}"
            )
        block_size, num_kv_heads, head_size = geometry.pop()
        buffer = torch.zeros(
            (num_blocks, len(entries), 2, block_size, num_kv_heads, head_size), dtype=dtype, device=device
        )
        for index, (name, _) in enumerate(entries):
            caches[name] = buffer[:, index].permute(1, 0, 2, 3, 4)
    if layers is not None:
        for name, tensor in caches.items():
            layers[name].kv_cache = tensor
    return caches


# ------------------------------------------------------------------------------------------------
# Attention metadata
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class PagedAttentionMetadata:
    """One cache group's batch metadata, shared by the group's layers.

    Shapes: query_start_loc / query_start_loc_cpu int32 ``[num_reqs + 1]``; seq_lens /
    seq_lens_cpu int32 ``[num_reqs]``; block_table / block_table_cpu int32 ``[num_reqs, cols]``
    (kernel block ids); slot_mapping int64 ``[num_actual_tokens]``; positions int64
    ``[num_actual_tokens]``; dcp_local_seq_lens int32 ``[num_reqs]`` or None.  ``*_cpu`` are
    host copies (the same tensors on a CPU device)."""

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    block_table_cpu: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    causal: bool
    dcp_local_seq_lens: torch.Tensor | None
    block_size: int


def build_attn_metadata(
    *,
    attn_groups: Sequence[Sequence[Any]],
    num_reqs: int,
    num_tokens: int,
    query_start_loc_gpu: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    max_query_len: int,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    block_tables: Sequence[torch.Tensor],
    slot_mappings: torch.Tensor,
    kv_cache_config: KVCacheConfig,
    seq_lens_cpu: torch.Tensor,
    seq_lens_cpu_upper_bound: torch.Tensor | None = None,
    dcp_local_seq_lens: torch.Tensor | None = None,
    positions: torch.Tensor,
    causal: bool | Mapping[int, bool],
) -> dict[str, PagedAttentionMetadata]:
    """``{layer_name: PagedAttentionMetadata}``: one object per cache group ``g`` (block table
    ``block_tables[g]``, slot mapping ``slot_mappings[g]``, ``causal`` or ``causal[g]``), shared
    by every layer of the group.  ``seq_lens_cpu_upper_bound`` is accepted for vLLM's keyword
    set; diffkv's seq_lens are exact."""
    op = "build_attn_metadata()"
    del seq_lens_cpu_upper_bound
    groups = kv_cache_config.kv_cache_groups
    if len(attn_groups) != len(groups):
        raise ValueError(
            f"{op}: attn_groups must have {len(groups)} entries (one per cache group), got {len(attn_groups)}"
        )
    if len(block_tables) != len(groups):
        raise ValueError(
            f"{op}: block_tables must have {len(groups)} entries (one per cache group), "
            f"got {len(block_tables)}"
        )
    if slot_mappings.ndim != 2 or slot_mappings.shape[0] != len(groups):
        raise ValueError(
            f"{op}: slot_mappings must be [{len(groups)}, num_tokens], got shape={tuple(slot_mappings.shape)}"
        )
    out: dict[str, PagedAttentionMetadata] = {}
    for g, group in enumerate(groups):
        if isinstance(causal, Mapping):
            group_causal = bool(causal[g])
        else:
            group_causal = bool(causal)
        block_table = block_tables[g]
        metadata = PagedAttentionMetadata(
            num_reqs=int(num_reqs),
            num_actual_tokens=int(num_tokens),
            max_query_len=int(max_query_len),
            query_start_loc=query_start_loc_gpu,
            query_start_loc_cpu=query_start_loc_cpu,
            max_seq_len=int(max_seq_len),
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            block_table=block_table,
            block_table_cpu=block_table.cpu(),
            slot_mapping=slot_mappings[g],
            positions=positions,
            causal=group_causal,
            dcp_local_seq_lens=dcp_local_seq_lens,
            block_size=int(group.spec.block_size),
        )
        for name in group.layer_names:
            out[name] = metadata
    return out


def build_slot_mappings_by_layer(
    slot_mappings: torch.Tensor, kv_cache_config: KVCacheConfig
) -> dict[str, torch.Tensor]:
    """Every layer of cache group ``g`` maps to ``slot_mappings[g]`` (a shared view)."""
    groups = kv_cache_config.kv_cache_groups
    if slot_mappings.ndim != 2 or slot_mappings.shape[0] != len(groups):
        raise ValueError(
            f"build_slot_mappings_by_layer(): slot_mappings must be [{len(groups)}, num_tokens], "
            f"got shape={tuple(slot_mappings.shape)}"
        )
    return {name: slot_mappings[g] for g, group in enumerate(groups) for name in group.layer_names}


def get_dcp_local_seq_lens(
    seq_lens: torch.Tensor,
    *,
    dcp_size: int,
    dcp_rank: int,
    cp_kv_cache_interleave_size: int,
) -> torch.Tensor:
    """int32 ``[R]``: tokens of each row stored on context-parallel rank ``dcp_rank``
    (vLLM's interleaved rule), on ``seq_lens``' device.  Computed on the host."""
    op = "get_dcp_local_seq_lens()"
    if not isinstance(seq_lens, torch.Tensor):
        raise TypeError(f"{op}: seq_lens must be a tensor, got {type(seq_lens).__name__}")
    dcp_size = _check_int(op, "dcp_size", dcp_size, 1)
    dcp_rank = _check_int(op, "dcp_rank", dcp_rank, 0)
    interleave = _check_int(op, "cp_kv_cache_interleave_size", cp_kv_cache_interleave_size, 1)
    if dcp_rank >= dcp_size:
        raise ValueError(f"{op}: dcp_rank must be in [0, {dcp_size}), got {dcp_rank}")
    host = seq_lens.to(device="cpu", dtype=torch.int32).contiguous()
    out = torch.empty_like(host)
    _C.dcp_local_seq_lens(host, out, dcp_size, dcp_rank, interleave)
    return out.to(seq_lens.device)
