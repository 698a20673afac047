"""vLLM-Omni's diffusion paged-attention adapter API, backed by diffkv._C.

Entry points (vLLM-Omni's adapter's classes, same names, fields, flags, validation order and messages):
``DiffusionPagedAttentionLayerAdapter`` (registers one diffusion layer with a native paged
backend), ``DiffusionPagedAttentionRow`` / ``DiffusionPagedAttentionMetadata`` (row layouts of
one request), ``DiffusionPagedAttentionAdapter`` (``prepare_batch`` once per phase,
``activate(batch)``, ``prepare_layer_context`` per layer call) returning a
``DiffusionPagedAttentionContext``, and ``DiffusionPagedAttentionRuntime`` (lazy per-phase
activation through a denoise loop).

Validation and batch construction run in C (``_C.check_*``, ``_C.build_batch``,
``_C.rows_gather`` / ``_C.rows_scatter``); Python keeps the data and the orchestration.  The
collaborators below are module attributes looked up at call time, so a test or a vLLM-Omni
install can replace them on this module: ``set_current_vllm_config``,
``build_slot_mappings_by_layer``, ``current_omni_platform``, ``get_attn_backend``,
``AttentionBackendEnum``, ``override_paged_kv_adapter``, ``build_paged_piecewise_plan``,
``get_dcp_local_seq_lens``, ``cdiv``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from . import _C, ops
from .backends.diffkv import FP8_CACHE_DTYPES, prepared_call
from .native import build_slot_mappings_by_layer, get_dcp_local_seq_lens
from .piecewise import PagedPiecewisePlan, build_paged_piecewise_plan
from .platform import (
    AttentionBackendEnum,
    AttentionLayerBase,
    AttentionType,
    cdiv,
    current_omni_platform,
    override_paged_kv_adapter,
    selecting_for,
    set_current_vllm_config,
)
from .selector import get_attn_backend

__all__ = [
    "AttentionBackendEnum",
    "DiffusionKVRowResolver",
    "DiffusionPagedAttentionAdapter",
    "DiffusionPagedAttentionContext",
    "DiffusionPagedAttentionLayerAdapter",
    "DiffusionPagedAttentionMetadata",
    "DiffusionPagedAttentionRow",
    "DiffusionPagedAttentionRowBinding",
    "DiffusionPagedAttentionRuntime",
    "PreparedDiffusionPagedAttentionBatch",
    "build_paged_piecewise_plan",
    "build_slot_mappings_by_layer",
    "cdiv",
    "current_omni_platform",
    "get_attn_backend",
    "get_dcp_local_seq_lens",
    "override_paged_kv_adapter",
    "set_current_vllm_config",
]


def _normalized_device(device: torch.device) -> torch.device:
    """``cuda`` without an index means the current CUDA device (docs/usage.md, *The API*)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# check_layer_qkv's layout bits (module globals: read on every layer call)
_PACK_ROWS = _C.LAYOUT_PACK_ROWS
_QUERY_HEADS = _C.LAYOUT_QUERY_HEADS
_KEY_HEADS = _C.LAYOUT_KEY_HEADS
_VALUE_HEADS = _C.LAYOUT_VALUE_HEADS
_KEY_CONTIGUOUS = _C.LAYOUT_KEY_CONTIGUOUS
_VALUE_CONTIGUOUS = _C.LAYOUT_VALUE_CONTIGUOUS

# How prepare_layer_context describes a layer call ahead for a diffkv impl that is not the
# layer's own impl: None, or an object with _diffkv_cache_view(layer, kv_cache) and
# _diffkv_paged_metadata(native_metadata) (DiffKVAttentionImpl's contract).  The vLLM-Omni
# install sets it: there the layer's impl is vLLM's FlashAttention and diffkv runs as the
# diffusion backend's impl.
paged_call_hooks: Any = None

_DTYPE_CODES = {
    torch.float32: _C.DTYPE_FLOAT32,
    torch.float16: _C.DTYPE_FLOAT16,
    torch.bfloat16: _C.DTYPE_BFLOAT16,
    torch.float64: _C.DTYPE_FLOAT64,
}


def _same_device(actual: torch.device, expected: torch.device) -> bool:
    if actual == expected:
        return True
    if actual.type != "cuda" or expected.type != "cuda":
        return False
    return _normalized_device(actual) == _normalized_device(expected)


_FP8_SPEC_DTYPES = ops._FP8_SPEC_DTYPES  # an fp8 cache's spec dtypes (vLLM's uint8 included)


def _check_cache_dtype(spec: Any, cache_config: Any) -> None:
    """diffkv's own rule, after vLLM-Omni's adapter's: the spec's dtype is an fp8 cache's
    exactly when cache_config.cache_dtype asks for one (else the layer would silently run
    unquantized, or quantized with identity scales).  Specs without a torch dtype are not
    checked."""
    spec_dtype = getattr(spec, "dtype", None)
    if not isinstance(spec_dtype, torch.dtype):
        return
    cache_dtype = getattr(cache_config, "cache_dtype", "auto")
    if (spec_dtype in _FP8_SPEC_DTYPES) != (cache_dtype in FP8_CACHE_DTYPES):
        raise ValueError(
            f"Paged attention spec dtype {spec_dtype} does not match cache_config.cache_dtype "
            f"{cache_dtype!r}: an fp8 cache ('fp8', 'fp8_e4m3') needs an fp8 spec (torch.float8_e4m3fn) "
            "and an fp8 spec an fp8 cache_dtype"
        )


@dataclass(frozen=True)
class DiffusionPagedAttentionRowBinding:
    """The Worker BlockTables row (``row_index``) and logical length (``max_seq_len``)
    installed for one allocation identity; ``block_ids``: per KV group, the manager block ids
    (read by platform code, not by the adapter)."""

    row_index: int
    max_seq_len: int
    block_ids: tuple[tuple[int, ...], ...] = ()


DiffusionKVRowResolver = Callable[
    [str, int | None, str | None],
    DiffusionPagedAttentionRowBinding,
]


class DiffusionPagedAttentionLayerAdapter(AttentionLayerBase):
    """One diffusion attention layer registered with the native paged-KV machinery.

    Holds the rank-local head counts (after strict Ulysses), the rank-local KV spec, the
    selected backend and its native impl, identity scales, and ``kv_cache`` (bound later, a
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` view).
    """

    def __init__(
        self,
        *,
        layer_name: str,
        layer: Any,
        spec: Any,
        vllm_config: Any,
        device: torch.device,
        ulysses_degree: int = 1,
    ) -> None:
        try:
            total_heads = int(layer.num_heads)
            total_kv_heads = int(spec.num_kv_heads)
        except Exception:
            # vLLM-Omni's adapter checks ulysses_degree before it reads the head counts.
            _C.check_layer_heads(ulysses_degree, 1, 1)
            raise
        num_heads, num_kv_heads = _C.check_layer_heads(ulysses_degree, total_heads, total_kv_heads)

        attention_config = getattr(vllm_config, "attention_config", None)
        if attention_config is not None:
            previous_backend = attention_config.backend
            previous_backend_per_kind = attention_config.backend_per_kind
        # vLLM-Omni (0.30) maps sequence parallelism to vLLM's prefill context parallelism for
        # MoE layers; its Ulysses hooks have already sharded heads before this attention, so the
        # backend is selected as for one rank (vLLM would otherwise look for a PCP backend).
        parallel_config = getattr(vllm_config, "parallel_config", None)
        previous_pcp_size = getattr(parallel_config, "prefill_context_parallel_size", None)
        try:
            if attention_config is not None:
                # A portable backend request; the platform resolves it to its native backend.
                attention_config.backend = AttentionBackendEnum.FLASH_ATTN
                attention_config.backend_per_kind = {}
            if previous_pcp_size is not None:
                parallel_config.prefill_context_parallel_size = 1
            with set_current_vllm_config(vllm_config), selecting_for(device):
                attn_backend = get_attn_backend(
                    head_size=spec.head_size,
                    dtype=vllm_config.model_config.dtype,
                    kv_cache_dtype=vllm_config.cache_config.cache_dtype,
                    attn_type=AttentionType.DECODER,
                    num_heads=num_heads,
                )
        finally:
            if attention_config is not None:
                attention_config.backend = previous_backend
                attention_config.backend_per_kind = previous_backend_per_kind
            if previous_pcp_size is not None:
                parallel_config.prefill_context_parallel_size = previous_pcp_size
        attn_backend = current_omni_platform.get_diffusion_paged_kv_attn_backend(
            attn_backend,
            ulysses_degree=ulysses_degree,
        )
        canonical_spec = replace(spec, num_kv_heads=num_kv_heads)
        self.layer_name = layer_name
        self.spec = canonical_spec
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = int(canonical_spec.head_size)
        head_size_v = getattr(canonical_spec, "head_size_v", canonical_spec.head_size)
        # diffkv.AttentionSpec spells "same as head_size" as head_size_v=None.
        self.head_size_v = self.head_size if head_size_v is None else int(head_size_v)
        _C.check_head_sizes(self.head_size, self.head_size_v)
        self.softmax_scale = float(layer.softmax_scale)
        self.attn_backend = attn_backend
        self.kv_cache: torch.Tensor | None = None
        # Identity scales, as device tensors and host floats: an unquantized cache ignores them; a
        # float8_e4m3fn cache is written and read with _k_scale / _v_scale (set them, or let the
        # first write set them: calculate_kv_scales below).
        self._q_scale = torch.ones(1, device=device, dtype=torch.float32)
        self._k_scale = torch.ones(1, device=device, dtype=torch.float32)
        self._v_scale = torch.ones(1, device=device, dtype=torch.float32)
        self._q_scale_float = 1.0
        # vLLM's calculate_kv_scales: a float8_e4m3fn layer's first KV write sets the scales
        # (backends.diffkv.calculate_kv_scales); otherwise they stay what the caller sets.
        self.calculate_kv_scales = bool(getattr(vllm_config.cache_config, "calculate_kv_scales", False))
        self._k_scale_float = 1.0
        self._v_scale_float = 1.0
        _check_cache_dtype(canonical_spec, vllm_config.cache_config)
        with set_current_vllm_config(vllm_config):
            self.impl = self._create_native_impl(vllm_config)

    def get_attn_backend(self):
        return self.attn_backend

    def _create_native_impl(self, vllm_config: Any):
        impl_cls = self.attn_backend.get_impl_cls()
        impl = impl_cls(
            num_heads=self.num_heads,
            head_size=self.head_size,
            scale=self.softmax_scale,
            num_kv_heads=self.num_kv_heads,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype=vllm_config.cache_config.cache_dtype,
            logits_soft_cap=None,
            attn_type=AttentionType.DECODER,
            kv_sharing_target_layer_name=None,
        )
        backend_name = self.attn_backend.get_name()
        if not callable(getattr(impl, "forward", None)):
            raise RuntimeError(
                f"Native paged-attention backend {backend_name!r} has no forward implementation"
            )
        needs_explicit_cache_update = (
            not self.attn_backend.forward_includes_kv_cache_update
            or current_omni_platform.requires_diffusion_paged_kv_prewrite()
        )
        if needs_explicit_cache_update and not callable(getattr(impl, "do_kv_cache_update", None)):
            raise RuntimeError(f"Native paged-attention backend {backend_name!r} cannot update the KV cache")
        if hasattr(impl, "vllm_flash_attn_version") and impl.vllm_flash_attn_version is None:
            raise RuntimeError(
                f"Native paged-attention kernel is unavailable for diffusion layer {self.layer_name!r}"
            )
        return impl

    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        del vllm_config
        return self.spec


@dataclass(frozen=True)
class DiffusionPagedAttentionRow:
    """One logical BlockTables row of a paged attention call: writes K/V for global positions
    ``[kv_start_pos, kv_start_pos + query_len)`` and attends over ``[0, seq_len)``.  Exactly
    one of ``sequence_id`` / ``context_id`` names the allocation."""

    request_id: str
    query_len: int
    seq_len: int
    kv_start_pos: int = 0
    sequence_id: int | None = None
    context_id: str | None = None

    def __post_init__(self) -> None:
        _C.check_row(
            self.request_id,
            self.query_len,
            self.seq_len,
            self.kv_start_pos,
            self.sequence_id,
            self.context_id,
        )

    @property
    def identity(self) -> tuple[str, int | None, str | None]:
        return (self.request_id, self.sequence_id, self.context_id)


def _as_row_tuple(rows: Any) -> tuple:
    """Rows as a tuple for _C; falsy input (None, empty) becomes () so the emptiness rule
    reports it."""
    if type(rows) is tuple:
        return rows
    return tuple(rows) if rows else ()


@dataclass(frozen=True)
class DiffusionPagedAttentionMetadata:
    """Runner-owned row layouts of one request-level denoise loop: the step-0 rows and the
    rows of every later step, with the same ordered identities."""

    prefill_rows: tuple[DiffusionPagedAttentionRow, ...]
    denoise_rows: tuple[DiffusionPagedAttentionRow, ...]

    def __post_init__(self) -> None:
        _C.check_metadata(_as_row_tuple(self.prefill_rows), _as_row_tuple(self.denoise_rows))

    def rows_for_step(self, step_idx: int | None) -> tuple[DiffusionPagedAttentionRow, ...]:
        _C.check_step(step_idx)
        return self.prefill_rows if step_idx == 0 else self.denoise_rows


@dataclass(frozen=True)
class PreparedDiffusionPagedAttentionBatch:
    """Native metadata shared by every paged layer of one forward.

    row_indices int32 ``[R]``; query_start_loc int32 ``[R+1]``; seq_lens int32 ``[R]``;
    positions int64 ``[N]``; block_tables: per KV group int32 ``[R, cols]``; slot_mappings
    int64 ``[num_groups, N]``; attn_metadata / slot_mappings_by_layer: per layer.  Tensors on
    the adapter's device; BlockTables' persistent buffers, so a newer preparation makes it
    stale.
    """

    rows: tuple[DiffusionPagedAttentionRow, ...]
    row_indices: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    block_tables: tuple[torch.Tensor, ...]
    slot_mappings: torch.Tensor
    attn_metadata: dict[str, Any]
    slot_mappings_by_layer: dict[str, torch.Tensor]
    num_tokens: int
    _owner: object = field(repr=False, compare=False)
    _generation: int = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class DiffusionPagedAttentionContext:
    """One layer's native inputs for a paged backend call.

    query ``[N, H, D]``, as vLLM-Omni 0.30's adapter hands it over: contiguous, except under a
    piecewise plan with a ``homogeneous_batch_shape``, where the caller's view is kept (its
    homogeneous runner packs each segment itself).  A strided caller query (a view of a fused
    QKV projection) is copied when ``query`` is first read, not before: diffkv's own
    ``forward_paged`` reads the caller's view, strides and all, and never makes that copy.
    key_write / value_write ``[N, Hkv, D]`` (possibly token-strided views); slot_mapping int64
    ``[N]``; native_metadata: the object the platform's metadata builder returned for this
    layer; query_token_shape: the caller's leading shape (``(N,)`` or ``(B, T)``);
    output_scatter_indices: int64 ``[N]`` positions of the packed tokens in the caller's
    flattened ``(B*T)`` layout, or None.
    """

    layer: DiffusionPagedAttentionLayerAdapter
    query: torch.Tensor
    key_write: torch.Tensor
    value_write: torch.Tensor
    slot_mapping: torch.Tensor
    native_metadata: Any
    piecewise_plan: PagedPiecewisePlan | None
    piecewise_native_metadata: tuple[Any, ...]
    query_token_shape: tuple[int, ...]
    query_has_head_dims: bool
    output_scatter_indices: torch.Tensor | None = None

    def restore_output(self, output: torch.Tensor) -> torch.Tensor:
        """Packed output ``[N, H, Dv]`` (or any shape with N*H*Dv elements) back to the
        caller's layout: ``query_token_shape + (H, Dv)`` or ``query_token_shape + (H*Dv,)``;
        right-padding positions come back as zeros."""
        num_heads = self.layer.num_heads
        head_size_v = self.layer.head_size_v
        if self.output_scatter_indices is not None:
            flat_output = output.reshape(-1, num_heads, head_size_v)
            num_positions = 1
            for size in self.query_token_shape:
                num_positions *= size
            restored = output.new_empty((num_positions, num_heads, head_size_v))
            _C.rows_scatter(flat_output, self.output_scatter_indices, restored)
            output = restored
        if self.query_has_head_dims:
            token_shape = self.query_token_shape
            if (
                len(token_shape) == 1
                and output.dim() == 3
                and output.shape[0] == token_shape[0]
                and output.shape[1] == num_heads
                and output.shape[2] == head_size_v
            ):
                return output  # already [N, H, Dv]: the reshape would be the identity
            return output.reshape(*token_shape, num_heads, head_size_v)
        return output.reshape(*self.query_token_shape, num_heads * head_size_v)


# The context's field descriptors in field order: prepare_layer_context fills a new context
# through them in one C call (_C.new_with_slots, ~0.1 us on the dev CPU) instead of the frozen
# dataclass __init__, which assigns each field through object.__setattr__ (~0.8 us for 11).
# The dataclass has no __post_init__, so the object is the same.
_CONTEXT_FIELDS = tuple(
    getattr(DiffusionPagedAttentionContext, f.name) for f in fields(DiffusionPagedAttentionContext)
)


class _ContextQuery:
    """``DiffusionPagedAttentionContext.query``: the slot holds the caller's ``[N, H, D]`` view
    (prepare_layer_context's); reading ``query`` gives vLLM-Omni 0.30's contiguous query
    (``.contiguous()`` unless the piecewise plan is homogeneous), copied on the first read and
    kept in the slot.  ``context._caller_query`` reads the slot itself: the caller's view until
    someone reads ``query``, which is what diffkv's forward_paged reads (so when diffkv serves
    the layer, no copy is ever made).  ``_caller_query`` is the slot's own member descriptor
    under a second name, which torch.compile traces like any slot."""

    __slots__ = ()

    def __get__(self, context: Any, owner: type | None = None) -> Any:
        if context is None:
            return self
        query = context._caller_query
        if not query.is_contiguous():
            plan = context.piecewise_plan
            if plan is None or plan.homogeneous_batch_shape is None:
                query = query.contiguous()
                _QUERY_SLOT.__set__(context, query)
        return query

    # Reached only through object.__setattr__ (the dataclass __init__, replace()); the frozen
    # class's own __setattr__ refuses assignments before they get here.
    def __set__(self, context: Any, value: Any) -> None:
        _QUERY_SLOT.__set__(context, value)

    def __delete__(self, context: Any) -> None:
        _QUERY_SLOT.__delete__(context)


_QUERY_SLOT = DiffusionPagedAttentionContext.query
DiffusionPagedAttentionContext._caller_query = _QUERY_SLOT
DiffusionPagedAttentionContext.query = _ContextQuery()


class DiffusionPagedAttentionRuntime:
    """Activates the metadata's rows lazily as the denoise loop advances: the prefill batch
    at step 0, then one denoise batch reused by every later step."""

    def __init__(
        self,
        adapter: DiffusionPagedAttentionAdapter,
        metadata: DiffusionPagedAttentionMetadata,
    ) -> None:
        self.adapter = adapter
        self.metadata = metadata
        self._active_phase: bool | None = None
        self._activation: Any | None = None
        self._closed = False

    def ensure_active(self, step_idx: int | None) -> DiffusionPagedAttentionAdapter:
        if self._closed:
            raise RuntimeError("Paged attention runtime is already closed")
        is_prefill = step_idx == 0
        rows = self.metadata.rows_for_step(step_idx)
        if self._active_phase == is_prefill:
            return self.adapter
        self._deactivate()
        batch = self.adapter.prepare_batch(rows)
        activation = self.adapter.activate(batch)
        activation.__enter__()
        self._activation = activation
        self._active_phase = is_prefill
        return self.adapter

    def _deactivate(self) -> None:
        activation = self._activation
        self._activation = None
        self._active_phase = None
        if activation is not None:
            activation.__exit__(None, None, None)

    def close(self) -> None:
        if self._closed:
            return
        self._deactivate()
        self._closed = True

    @contextmanager
    def activate(self) -> Iterator[DiffusionPagedAttentionRuntime]:
        try:
            yield self
        finally:
            self.close()


class DiffusionPagedAttentionAdapter:
    """Translates diffusion rows into native paged-attention metadata for a paged backend."""

    def __init__(
        self,
        *,
        vllm_config: Any,
        device: torch.device,
        kv_cache_config: Any,
        block_tables: Any,
        attn_groups: list[list[Any]],
        layers: Mapping[str, DiffusionPagedAttentionLayerAdapter],
        resolve_row: DiffusionKVRowResolver,
    ) -> None:
        if not layers:
            raise ValueError("Paged attention requires at least one native attention layer")
        if len(attn_groups) != len(kv_cache_config.kv_cache_groups):
            raise ValueError(
                "Paged attention group mismatch: "
                f"builders={len(attn_groups)}, cache_groups={len(kv_cache_config.kv_cache_groups)}"
            )
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.kv_cache_config = kv_cache_config
        self.block_tables = block_tables
        self.attn_groups = attn_groups
        self.layers = dict(layers)
        self.resolve_row = resolve_row
        self._owner = object()
        self._prepare_generation = 0
        self._active_batch: PreparedDiffusionPagedAttentionBatch | None = None
        self._active_piecewise_plan: PagedPiecewisePlan | None = None
        self._active_piecewise_native_metadata: tuple[dict[str, Any], ...] | None = None
        # Per activation: [B, T] packing indices by (token shape, device).
        self._active_packing_indices: dict[tuple, torch.Tensor | None] = {}
        self._active_query_lens: tuple[int, ...] = ()
        self._active_non_suffix_rows: list[tuple] = []
        # Per activation: _device_key(), so "cuda" without an index means the device that was
        # current when the batch was activated (torch.cuda.current_device() costs ~1 us a call).
        self._active_device_key: tuple[int, int] = (0, -1)
        # Per activation and layer: the flattened slot-mapping view (keyed by its source
        # tensor) and the per-segment metadata tuple (keyed by the segment dicts).
        self._active_slot_views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._active_segment_metadata: dict[str, tuple[Any, tuple]] = {}
        # per layer: what its last described call was made from, and _C.forward_paged's
        # arguments (ops.forward_paged_arguments) made from it
        self._active_calls: dict[str, tuple] = {}
        # per activation and native metadata object: (it, its diffkv impl's view of it)
        self._active_paged: dict[int, tuple[Any, Any]] = {}
        self._causal_by_group = self._resolve_group_causality()
        self._reorder_batch_threshold = self._resolve_reorder_batch_threshold()

    def _resolve_group_causality(self) -> dict[int, bool]:
        causal_by_group: dict[int, bool] = {}
        for group_index, cache_group in enumerate(self.kv_cache_config.kv_cache_groups):
            layer_causality = {
                not bool(getattr(self.layers[layer_name].spec, "non_causal", False))
                for layer_name in cache_group.layer_names
            }
            if len(layer_causality) != 1:
                raise ValueError(
                    f"Paged attention cache group {group_index} mixes causal and non-causal layers"
                )
            causal_by_group[group_index] = layer_causality.pop()
        return causal_by_group

    def _resolve_reorder_batch_threshold(self) -> int | None:
        thresholds = [
            group.get_metadata_builder(0).reorder_batch_threshold
            for group_index, groups in enumerate(self.attn_groups)
            if self._causal_by_group[group_index]
            for group in groups
        ]
        concrete = [threshold for threshold in thresholds if threshold is not None]
        return min(concrete, default=None)

    def _build_native_metadata(
        self,
        *,
        query_lens: Sequence[int],
        query_start_loc: torch.Tensor,
        query_start_loc_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        positions: torch.Tensor,
        block_tables: Sequence[torch.Tensor],
        slot_mappings: torch.Tensor,
        causal: bool | Mapping[int, bool],
    ) -> dict[str, Any]:
        block_tables_owner = self.block_tables
        dcp_local_seq_lens = None
        if block_tables_owner.cp_size > 1:
            dcp_local_seq_lens = get_dcp_local_seq_lens(
                seq_lens,
                dcp_size=block_tables_owner.cp_size,
                dcp_rank=block_tables_owner.cp_rank,
                cp_kv_cache_interleave_size=block_tables_owner.cp_interleave,
            )
        with set_current_vllm_config(self.vllm_config):
            return current_omni_platform.build_diffusion_kv_attn_metadata(
                attn_groups=self.attn_groups,
                num_reqs=len(query_lens),
                num_tokens=sum(query_lens),
                query_start_loc_gpu=query_start_loc,
                query_start_loc_cpu=query_start_loc_cpu,
                max_query_len=max(query_lens),
                seq_lens=seq_lens,
                max_seq_len=int(seq_lens_cpu.max()),
                block_tables=block_tables,
                slot_mappings=slot_mappings,
                kv_cache_config=self.kv_cache_config,
                seq_lens_cpu=seq_lens_cpu,
                seq_lens_cpu_upper_bound=seq_lens_cpu,
                dcp_local_seq_lens=dcp_local_seq_lens,
                positions=positions,
                causal=causal,
            )

    def prepare_batch(
        self,
        rows: Sequence[DiffusionPagedAttentionRow],
    ) -> PreparedDiffusionPagedAttentionBatch:
        """Validate rows against the Worker's BlockTables and build the batch's native
        metadata (once per phase)."""
        rows = tuple(rows)
        tables = self.block_tables
        _C.check_batch_rows(rows, self._active_batch is not None, tables.max_num_reqs)
        row_bindings = [self.resolve_row(row.request_id, row.sequence_id, row.context_id) for row in rows]
        num_tokens = _C.check_batch_bindings(
            rows,
            row_bindings,
            self._reorder_batch_threshold,
            any(self._causal_by_group.values()),
            tables.max_num_reqs,
            tables.max_num_batched_tokens,
            tables.block_sizes,
            tables.blocks_per_kv_block,
            tables.cp_size,
            torch.as_tensor(tables.num_blocks.np),
        )

        # BlockTables reuses persistent gather/slot buffers: a new preparation invalidates
        # every earlier batch, even when a later step below raises.
        self._prepare_generation += 1
        generation = self._prepare_generation
        num_rows = len(rows)
        row_indices_list = [binding.row_index for binding in row_bindings]
        # One int32 host buffer [row_indices | query_start_loc | seq_lens], one copy to the device.
        host_ints = torch.empty(3 * num_rows + 1, dtype=torch.int32)
        positions_cpu = torch.empty(num_tokens, dtype=torch.int64)
        row_indices_cpu = host_ints[:num_rows]
        query_start_loc_cpu = host_ints[num_rows : 2 * num_rows + 1]
        seq_lens_cpu = host_ints[2 * num_rows + 1 :]
        _C.build_batch(
            rows, row_indices_list, row_indices_cpu, query_start_loc_cpu, seq_lens_cpu, positions_cpu
        )
        device_ints = host_ints.to(self.device)
        row_indices = device_ints[:num_rows]
        query_start_loc = device_ints[num_rows : 2 * num_rows + 1]
        seq_lens = device_ints[2 * num_rows + 1 :]
        positions = positions_cpu.to(self.device)

        block_tables = tables.gather_block_tables(row_indices, num_reqs_padded=num_rows)
        slot_mappings = tables.compute_slot_mappings(
            row_indices,
            query_start_loc,
            positions,
            num_tokens_padded=num_tokens,
        )
        causal_values = set(self._causal_by_group.values())
        causal: bool | Mapping[int, bool] = (
            next(iter(causal_values)) if len(causal_values) == 1 else self._causal_by_group
        )
        attn_metadata = self._build_native_metadata(
            query_lens=[row.query_len for row in rows],
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            positions=positions,
            block_tables=block_tables,
            slot_mappings=slot_mappings,
            causal=causal,
        )
        slot_mappings_by_layer = build_slot_mappings_by_layer(slot_mappings, self.kv_cache_config)
        return PreparedDiffusionPagedAttentionBatch(
            rows=rows,
            row_indices=row_indices,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            positions=positions,
            block_tables=tuple(block_tables),
            slot_mappings=slot_mappings,
            attn_metadata=attn_metadata,
            slot_mappings_by_layer=slot_mappings_by_layer,
            num_tokens=num_tokens,
            _owner=self._owner,
            _generation=generation,
        )

    def invalidate_prepared_batches(self) -> None:
        """Make every prepared batch stale (call after BlockTables state changes)."""
        if self._active_batch is not None:
            raise RuntimeError("Cannot change paged attention BlockTables during an active forward")
        self._prepare_generation += 1

    def _clear_activation_caches(self) -> None:
        self._active_piecewise_plan = None
        self._active_piecewise_native_metadata = None
        self._active_packing_indices = {}
        self._active_query_lens = ()
        self._active_non_suffix_rows = []
        self._active_device_key = (0, -1)
        self._active_slot_views = {}
        self._active_segment_metadata = {}
        self._active_calls = {}
        self._active_paged = {}

    def _device_key(self) -> tuple[int, int]:
        """(DLPack device type, index) of the adapter's device, "cuda" meaning the current one."""
        device = self.device
        if device.type == "cpu":
            return 1, 0
        if device.type == "cuda":
            return 2, device.index if device.index is not None else torch.cuda.current_device()
        return 0, -1

    @contextmanager
    def activate(
        self,
        batch: PreparedDiffusionPagedAttentionBatch,
    ) -> Iterator[DiffusionPagedAttentionAdapter]:
        if batch._owner is not self._owner:
            raise ValueError("Prepared paged attention batch belongs to a different adapter")
        if batch._generation != self._prepare_generation:
            raise ValueError("Prepared paged attention batch is stale after a newer batch preparation")
        if self._active_batch is not None:
            raise RuntimeError("Paged attention adapter already has an active forward")
        device_key = self._device_key()  # before any state changes: it may raise (bare "cuda")
        self._active_batch = batch
        self._clear_activation_caches()
        self._active_query_lens = tuple(row.query_len for row in batch.rows)
        self._active_non_suffix_rows = [
            row.identity for row in batch.rows if row.kv_start_pos + row.query_len != row.seq_len
        ]
        self._active_device_key = device_key
        try:
            with override_paged_kv_adapter(self), set_current_vllm_config(self.vllm_config):
                yield self
        finally:
            self._clear_activation_caches()
            self._active_batch = None

    @staticmethod
    def _flatten_tensor(
        tensor: torch.Tensor,
        *,
        num_heads: int,
        head_size: int,
        name: str,
    ) -> tuple[torch.Tensor, tuple[int, ...], bool]:
        shape = tuple(tensor.shape)
        if len(shape) >= 3 and shape[-2:] == (num_heads, head_size):
            return tensor.reshape(-1, num_heads, head_size), shape[:-2], True
        hidden_size = num_heads * head_size
        if len(shape) >= 1 and shape[-1] == hidden_size:
            return tensor.reshape(-1, num_heads, head_size), shape[:-1], False
        raise ValueError(
            f"Paged attention {name} must end in ({num_heads}, {head_size}) or ({hidden_size},); "
            f"got shape={shape}"
        )

    @staticmethod
    def _token_packing_indices(
        token_shape: tuple[int, ...],
        batch: PreparedDiffusionPagedAttentionBatch,
        *,
        name: str,
        device: torch.device,
    ) -> torch.Tensor | None:
        if len(token_shape) == 1:
            if token_shape[0] == batch.num_tokens:
                return None
            raise ValueError(
                f"Paged attention {name} token count must match the prepared write batch: "
                f"tokens={token_shape[0]}, prepared={batch.num_tokens}"
            )
        if len(token_shape) == 2:
            batch_size, tokens_per_row = token_shape
            query_lens = tuple(row.query_len for row in batch.rows)
            if batch_size != len(batch.rows) or any(query_len > tokens_per_row for query_len in query_lens):
                raise ValueError(
                    f"Paged attention batched {name} layout must match prepared rows for the current write: "
                    f"shape={token_shape}, row_query_lens={query_lens}"
                )
            if all(query_len == tokens_per_row for query_len in query_lens):
                return None
            return torch.cat(
                [
                    torch.arange(
                        row * tokens_per_row,
                        row * tokens_per_row + query_len,
                        dtype=torch.long,
                        device=device,
                    )
                    for row, query_len in enumerate(query_lens)
                ]
            )
        raise ValueError(
            f"Paged attention {name} supports packed [T, ...] or uniform batched [B, T, ...] token layouts; "
            f"got token shape={token_shape}"
        )

    def _get_piecewise_plan(
        self,
        full_attn_spans: list[list[tuple[int, int]]],
    ) -> PagedPiecewisePlan:
        batch = self._active_batch
        if batch is None:
            raise RuntimeError("Piecewise paged attention requires an active prepared batch")
        # The rows whose span does not end at seq_len, listed when the batch was activated.
        invalid_rows = self._active_non_suffix_rows
        if invalid_rows:
            raise ValueError(
                "Paged piecewise attention requires each query/write span to end at seq_len; "
                f"invalid rows={invalid_rows!r}"
            )
        cached_plan = self._active_piecewise_plan
        if cached_plan is not None:
            frozen_spans = tuple([tuple(map(tuple, row_spans)) for row_spans in full_attn_spans])
            if cached_plan.spans != frozen_spans:
                raise ValueError(
                    "Paged piecewise attention metadata changed between layers in one active batch"
                )
            return cached_plan
        plan = build_paged_piecewise_plan(
            full_attn_spans,
            query_offsets=[row.kv_start_pos for row in batch.rows],
            query_lens=[row.query_len for row in batch.rows],
            seq_lens=[row.seq_len for row in batch.rows],
            device=self.device,
        )
        self._active_piecewise_plan = plan
        return plan

    def _get_piecewise_native_metadata(
        self,
        plan: PagedPiecewisePlan,
    ) -> tuple[dict[str, Any], ...]:
        """One native metadata dict per plan segment, built once per activation."""
        batch = self._active_batch
        if batch is None:
            raise RuntimeError("Piecewise paged attention requires an active prepared batch")
        cached = self._active_piecewise_native_metadata
        if cached is not None:
            return cached
        metadata_by_segment: list[dict[str, Any]] = []
        for packed_segment in plan.segments:
            row_segments = packed_segment.row_segments
            query_lens = [segment.q_end - segment.q_start for segment in row_segments]
            offsets = [0]
            for query_len in query_lens:
                offsets.append(offsets[-1] + query_len)
            query_start_loc_cpu = torch.tensor(offsets, dtype=torch.int32)
            seq_lens_cpu = torch.tensor([segment.kv_end for segment in row_segments], dtype=torch.int32)
            if packed_segment.query_range is None:
                positions = batch.positions.index_select(0, packed_segment.query_indices)
                slot_mappings = batch.slot_mappings.index_select(-1, packed_segment.query_indices)
            else:
                start, end = packed_segment.query_range
                positions = batch.positions[start:end]
                slot_mappings = batch.slot_mappings[..., start:end]
            segment_metadata = self._build_native_metadata(
                query_lens=query_lens,
                query_start_loc=query_start_loc_cpu.to(self.device),
                query_start_loc_cpu=query_start_loc_cpu,
                seq_lens=seq_lens_cpu.to(self.device),
                seq_lens_cpu=seq_lens_cpu,
                positions=positions,
                block_tables=batch.block_tables,
                slot_mappings=slot_mappings,
                causal=(row_segments[0].mode == "causal"),
            )
            # vLLM-Omni 0.30: FlashAttention-2's automatic split policy would pick SplitKV for
            # these short per-segment calls; one split selects its single-pass kernel.  Other
            # native backends, and metadata without the control, are left as built.
            for layer_name, native_metadata in segment_metadata.items():
                layer = self.layers.get(layer_name)
                if (
                    layer is not None
                    and getattr(layer.impl, "vllm_flash_attn_version", None) == 2
                    and hasattr(native_metadata, "max_num_splits")
                ):
                    native_metadata.max_num_splits = 1
            # All segments are prepared before any runs: a builder that reuses one persistent
            # scheduler buffer would otherwise leave every segment a view of the last build.
            snapshotted: set[int] = set()
            for native_metadata in segment_metadata.values():
                if id(native_metadata) in snapshotted:
                    continue
                snapshotted.add(id(native_metadata))
                for field_name in ("scheduler_metadata", "prefix_scheduler_metadata"):
                    scheduler_metadata = getattr(native_metadata, field_name, None)
                    if isinstance(scheduler_metadata, torch.Tensor):
                        setattr(native_metadata, field_name, scheduler_metadata.clone())
            metadata_by_segment.append(segment_metadata)
        self._active_piecewise_native_metadata = tuple(metadata_by_segment)
        return self._active_piecewise_native_metadata

    def _packing_indices(
        self,
        token_shape: tuple[int, ...],
        batch: PreparedDiffusionPagedAttentionBatch,
        device: torch.device,
    ) -> torch.Tensor | None:
        """``_token_packing_indices`` for Q/K/V, cached per activation (all layers share it)."""
        key = (token_shape, device)
        try:
            return self._active_packing_indices[key]
        except KeyError:
            pass
        indices = self._token_packing_indices(token_shape, batch, name="Q/K/V", device=device)
        self._active_packing_indices[key] = indices
        return indices

    @staticmethod
    def _pack_rows(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        packed = torch.empty(
            (indices.shape[0], tensor.shape[1], tensor.shape[2]), dtype=tensor.dtype, device=tensor.device
        )
        _C.rows_gather(tensor, indices, packed)
        return packed

    def prepare_layer_context(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        omni_attn_metadata: Any | None = None,
    ) -> DiffusionPagedAttentionContext:
        """One layer's native inputs.  query ``[N, H*D]`` / ``[N, H, D]`` / ``[B, T, ...]``
        (right-padded rows allowed), key/value likewise with ``Hkv``."""
        batch = self._active_batch
        if batch is None:
            raise RuntimeError("Paged attention forward must run inside adapter.activate(batch)")
        try:
            layer = self.layers[layer_name]
        except KeyError as exc:
            raise KeyError(f"Unknown diffusion paged attention layer {layer_name!r}") from exc
        full_attn_spans = (
            None if omni_attn_metadata is None else self._validate_omni_attn_metadata(omni_attn_metadata)
        )

        # vLLM-Omni's adapter's query/key/value rules in its order, in one C call (the K/V gather
        # of padded rows has no visible effect, so the device/dtype checks may precede it).
        device_type, device_index = self._active_device_key
        expected_dtype = self.vllm_config.model_config.dtype
        query_token_shape, query_has_head_dims, layout = _C.check_layer_qkv(
            query,
            key,
            value,
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_size,
            layer.head_size_v,
            device_type,
            device_index,
            self.device,
            _DTYPE_CODES.get(expected_dtype, -1),
            expected_dtype,
            batch.num_tokens,
            self._active_query_lens,
        )
        # K/V that need .contiguous(): the writer reads heads and dims densely; it honours the
        # token stride, so QKV-projection views stay views.
        query_flat = query if layout & _QUERY_HEADS else query.reshape(-1, layer.num_heads, layer.head_size)
        key_flat = key if layout & _KEY_HEADS else key.reshape(-1, layer.num_kv_heads, layer.head_size)
        value_flat = (
            value if layout & _VALUE_HEADS else value.reshape(-1, layer.num_kv_heads, layer.head_size_v)
        )
        output_scatter_indices = None
        if layout & _PACK_ROWS:
            output_scatter_indices = self._packing_indices(query_token_shape, batch, query.device)
            query_flat = self._pack_rows(query_flat, output_scatter_indices)
            key_flat = self._pack_rows(key_flat, output_scatter_indices)
            value_flat = self._pack_rows(value_flat, output_scatter_indices)
        else:
            if layout & _KEY_CONTIGUOUS:
                key_flat = key_flat.contiguous()
            if layout & _VALUE_CONTIGUOUS:
                value_flat = value_flat.contiguous()
        non_suffix_rows = self._active_non_suffix_rows
        if non_suffix_rows and not bool(getattr(layer.spec, "non_causal", False)):
            raise ValueError(
                "Causal paged attention requires each query/write span to end at seq_len; "
                f"invalid rows={non_suffix_rows!r}"
            )

        source = batch.slot_mappings_by_layer.get(layer_name)
        if source is None:
            raise KeyError(f"No native slot mapping was built for diffusion layer {layer_name!r}")
        cached = self._active_slot_views.get(layer_name)
        if cached is not None and cached[0] is source:
            slot_mapping = cached[1]
        else:
            slot_mapping = source.reshape(-1)[: batch.num_tokens]
            if slot_mapping.numel() != batch.num_tokens:
                raise ValueError(
                    f"Paged attention slot mapping for {layer_name!r} has {slot_mapping.numel()} entries; "
                    f"expected {batch.num_tokens}"
                )
            self._active_slot_views[layer_name] = (source, slot_mapping)

        try:
            native_metadata = batch.attn_metadata[layer_name]
        except KeyError as exc:
            raise KeyError(
                f"No native attention metadata was built for diffusion layer {layer_name!r}"
            ) from exc
        piecewise_plan: PagedPiecewisePlan | None = None
        piecewise_native_metadata: tuple[Any, ...] = ()
        if full_attn_spans is not None:
            piecewise_plan = self._get_piecewise_plan(full_attn_spans)
            native_metadata_by_segment = self._get_piecewise_native_metadata(piecewise_plan)
            cached = self._active_segment_metadata.get(layer_name)
            if cached is not None and cached[0] is native_metadata_by_segment:
                piecewise_native_metadata = cached[1]
            else:
                try:
                    piecewise_native_metadata = tuple(
                        segment_metadata[layer_name] for segment_metadata in native_metadata_by_segment
                    )
                except KeyError as exc:
                    raise KeyError(
                        f"No piecewise native attention metadata was built for diffusion layer {layer_name!r}"
                    ) from exc
                self._active_segment_metadata[layer_name] = (
                    native_metadata_by_segment,
                    piecewise_native_metadata,
                )
        context = _C.new_with_slots(
            DiffusionPagedAttentionContext,
            _CONTEXT_FIELDS,
            layer,
            query_flat,
            key_flat,
            value_flat,
            slot_mapping,
            native_metadata,
            piecewise_plan,
            piecewise_native_metadata,
            query_token_shape,
            query_has_head_dims,
            output_scatter_indices,
        )
        kv_cache = getattr(layer, "kv_cache", None)  # a foreign layer object may have neither
        impl = getattr(layer, "impl", None)
        hooks = impl if getattr(type(impl), "_diffkv_runs_prepared_calls", False) else paged_call_hooks
        if kv_cache is not None and hooks is not None:
            # A diffkv impl will run the call (the layer's DiffKVAttentionImpl, or the vLLM-Omni
            # install's): describe it now, from what is at hand, so that its forward_paged runs
            # it without reading the context back.
            scale = getattr(layer, "softmax_scale", None)
            described = self._active_calls.get(layer_name)
            if (
                described is None
                or described[0] is not piecewise_plan
                or described[1] is not kv_cache
                or described[2] is not native_metadata
                or described[3] is not slot_mapping
                or described[4] != scale
                or described[7] is not hooks
            ):
                described = self._describe_call(
                    layer_name, layer, hooks, kv_cache, scale, slot_mapping, native_metadata, piecewise_plan
                )
                if described is None:
                    return context
            if output_scatter_indices is None and len(query_token_shape) == 1:
                # out is the caller's layout: [N, H, Dv] like the query, or [N, H*Dv] (the
                # kernels write its [N, H, Dv] view)
                out_shape, restored = (None if query_has_head_dims else described[6]), True
            else:
                out_shape, restored = None, False
            prepared_call[0] = (
                context,
                layer,
                kv_cache,
                query_flat,
                [query_flat, key_flat, value_flat, *described[5]],
                out_shape,
                restored,
            )
        return context

    def _describe_call(
        self,
        layer_name: str,
        layer: Any,
        hooks: Any,
        kv_cache: torch.Tensor,
        scale: Any,
        slot_mapping: torch.Tensor,
        native_metadata: Any,
        piecewise_plan: PagedPiecewisePlan | None,
    ) -> tuple | None:
        """What prepare_layer_context keeps per layer and activation to describe its calls:
        (piecewise_plan, kv_cache, native_metadata, slot_mapping, scale -- what it was made
        from --, then _C.forward_paged's arguments after query, key and value with None in out's
        place, the [N, H*Dv] output shape, and the hooks), or None when diffkv cannot serve the
        metadata (``hooks._diffkv_paged_metadata`` gives None) or the metadata or layer cannot
        be read this way (forward_paged then reads the context itself and does or raises what
        it does).  diffkv's view of the metadata is made once per activation and metadata
        object: the layers of one cache group share it."""
        try:
            paged = self._active_paged.get(id(native_metadata))
            if paged is None or paged[0] is not native_metadata:
                paged = (native_metadata, hooks._diffkv_paged_metadata(native_metadata))
                self._active_paged[id(native_metadata)] = paged
            metadata = paged[1]
            if metadata is None:
                return None
            inputs = ops.paged_layer_inputs(
                layer,
                hooks._diffkv_cache_view(layer, kv_cache),
                slot_mapping,
                metadata,
                piecewise_plan,
                (),
                None,
                ops.eager_host_copies(metadata),
            )
            flat_shape = (self._active_batch.num_tokens, layer.num_heads * layer.head_size_v)
        except Exception:
            return None
        head, tail = ops.forward_paged_arguments(inputs)
        arguments = (*head, None, *tail)  # _C.forward_paged's after key and value; None: out
        described = (
            piecewise_plan,
            kv_cache,
            native_metadata,
            slot_mapping,
            scale,
            arguments,
            flat_shape,
            hooks,
        )
        self._active_calls[layer_name] = described
        return described

    @staticmethod
    def _validate_omni_attn_metadata(
        metadata: Any | None,
    ) -> list[list[tuple[int, int]]] | None:
        if metadata is None:
            return None
        full_attn_spans = getattr(metadata, "full_attn_spans", None)
        attn_mask = getattr(metadata, "attn_mask", None)
        # Read in vLLM-Omni's adapter's order, without a comprehension (this runs on every layer call).
        joint_attn_mask = getattr(metadata, "joint_attn_mask", None)
        query_ranges = getattr(metadata, "query_ranges", None)
        video_layout = getattr(metadata, "video_layout", None)
        unsupported_fields = []
        if joint_attn_mask is not None:
            unsupported_fields.append("joint_attn_mask")
        if query_ranges is not None:
            unsupported_fields.append("query_ranges")
        if video_layout is not None:
            unsupported_fields.append("video_layout")
        if attn_mask is not None:
            if full_attn_spans is None:
                unsupported_fields.append("attn_mask")
            elif not isinstance(attn_mask, torch.Tensor) or attn_mask.ndim != 4:
                unsupported_fields.append("attn_mask (piecewise paging requires a 4D tensor)")
        extra = getattr(metadata, "extra", None)
        if extra:
            unsupported_fields.append(f"extra={sorted(extra)}")
        if unsupported_fields:
            raise NotImplementedError(
                "Diffusion paged attention cannot translate Omni attention metadata fields "
                f"{unsupported_fields!r} to native FlashAttention metadata"
            )
        return full_attn_spans
