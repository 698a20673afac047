"""diffkv's hot operations as torch operators, for torch.compile and CUDA-graph trees.

Entry points: the operators ``torch.ops.diffkv.kv_write``, ``paged_attention``,
``forward_paged``, ``rows_gather`` and ``rows_scatter`` (defined here with
``torch.library.Library`` + ``register_fake``; each forwards to the ``diffkv._C`` function of
the same name), ``layer_inputs(context)`` (everything a compiled layer needs from a prepared
``DiffusionPagedAttentionContext``), ``forward_paged_layer(query, key, value, inputs)`` (one
layer through the operators, traceable by Dynamo without graph breaks) and
``restore_output(context, out)`` (``context.restore_output`` through the operators).  Also the
one description of a layer call every path shares: ``paged_layer_inputs`` (what is assembled)
and ``forward_paged_arguments`` (in which order the binding and the operator take it).

Eager calls take no operator: ``DiffKVAttentionImpl`` calls ``diffkv._C`` directly and takes
these operators only while ``torch.compiler.is_compiling()``.

What a compiled model must prepare outside the compiled region (Dynamo cannot trace into the
adapter's C validation, ``_C.check_*`` / ``_C.build_batch``): the batch (``prepare_batch`` /
``activate`` or ``DiffusionPagedAttentionRuntime.ensure_active``) and, per layer, a context from
``adapter.prepare_layer_context`` called with tensors of the step's query/key/value shapes
(``torch.empty`` suffices: only shapes, dtypes and devices are read).  ``layer_inputs`` turns
that context into a ``PagedLayerInputs``: the layer's kv_cache, the slot mapping, the device
metadata (block_table, query_start_loc, seq_lens, key_limits), their host copies, the mask
mode, the softmax scale and, for right-padded ``[B, T]`` inputs, the packing indices.  The
tensors are graph inputs; ``mask``, ``scale`` and ``num_positions`` are Python numbers that the
compiled graph specialises on (a change recompiles).

On CUDA the operators receive no host copies of the block tables (the host-copy arguments are
None): CUDA-graph trees cannot capture CPU tensor inputs, so torch.compile(mode="reduce-overhead")
captures the whole step.  The batch's tables were validated when it was prepared, and the kernels
clamp every block id, offset and length they read, so device metadata stays memory-safe.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _C

__all__ = ["PagedLayerInputs", "forward_paged_layer", "layer_inputs", "restore_output"]

_lib = torch.library.Library("diffkv", "DEF")

# k_scale / v_scale: a float8_e4m3fn cache's (None for an unquantized one)
_SCALES = "Tensor? k_scale=None, Tensor? v_scale=None"
_ATTENTION_METADATA = (
    "Tensor block_table, Tensor query_start_loc, Tensor seq_lens, Tensor? key_limits, int mask, "
    "float scale, Tensor? host_block_table, Tensor? host_query_start_loc, Tensor? host_seq_lens, "
    f"{_SCALES}"
)
_lib.define(f"kv_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, {_SCALES}) -> ()")
_lib.define(f"paged_attention(Tensor query, Tensor kv_cache, {_ATTENTION_METADATA}) -> Tensor")
_lib.define(
    "forward_paged(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
    f"{_ATTENTION_METADATA}) -> Tensor"
)
_lib.define("rows_gather(Tensor src, Tensor index) -> Tensor")
_lib.define("rows_scatter(Tensor src, Tensor index, SymInt num_rows) -> Tensor")


def _attention_out(query: torch.Tensor) -> torch.Tensor:
    # Contiguous whatever the query's strides, so the real and fake outputs agree.
    return query.new_empty(query.shape)


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The binding's trailing scale arguments: both for a float8_e4m3fn cache, none otherwise
    (one given without the other reaches the binding, which names what is wrong)."""
    if k_scale is None and v_scale is None:
        return ()
    return (k_scale, v_scale)


def _kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    _C.kv_write(key, value, kv_cache, slot_mapping, *_scales(k_scale, v_scale))


def _paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    key_limits: torch.Tensor | None,
    mask: int,
    scale: float,
    host_block_table: torch.Tensor | None,
    host_query_start_loc: torch.Tensor | None,
    host_seq_lens: torch.Tensor | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    out = _attention_out(query)
    _C.paged_attention(
        query,
        kv_cache,
        block_table,
        query_start_loc,
        seq_lens,
        key_limits,
        mask,
        scale,
        out,
        host_block_table,
        host_query_start_loc,
        host_seq_lens,
        *_scales(k_scale, v_scale),
    )
    return out


def _forward_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    key_limits: torch.Tensor | None,
    mask: int,
    scale: float,
    host_block_table: torch.Tensor | None,
    host_query_start_loc: torch.Tensor | None,
    host_seq_lens: torch.Tensor | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    out = _attention_out(query)
    _C.forward_paged(
        query,
        key,
        value,
        kv_cache,
        slot_mapping,
        block_table,
        query_start_loc,
        seq_lens,
        key_limits,
        mask,
        scale,
        out,
        host_block_table,
        host_query_start_loc,
        host_seq_lens,
        *_scales(k_scale, v_scale),
    )
    return out


def _rows_gather(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    dst = src.new_empty((index.shape[0], *src.shape[1:]))
    _C.rows_gather(src, index, dst)
    return dst


def _rows_scatter(src: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    dst = src.new_empty((num_rows, *src.shape[1:]))
    _C.rows_scatter(src, index, dst)
    return dst


# diffkv._C picks the CPU reference or the CUDA launcher from the tensors' device, so one
# kernel serves every backend key.
for _name, _impl in (
    ("kv_write", _kv_write),
    ("paged_attention", _paged_attention),
    ("forward_paged", _forward_paged),
    ("rows_gather", _rows_gather),
    ("rows_scatter", _rows_scatter),
):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")


@torch.library.register_fake("diffkv::kv_write")
def _kv_write_fake(key, value, kv_cache, slot_mapping, k_scale=None, v_scale=None):
    return None


@torch.library.register_fake("diffkv::paged_attention")
def _paged_attention_fake(query, kv_cache, *metadata):
    return _attention_out(query)


@torch.library.register_fake("diffkv::forward_paged")
def _forward_paged_fake(query, key, value, kv_cache, slot_mapping, *metadata):
    return _attention_out(query)


@torch.library.register_fake("diffkv::rows_gather")
def _rows_gather_fake(src, index):
    return src.new_empty((index.shape[0], *src.shape[1:]))


@torch.library.register_fake("diffkv::rows_scatter")
def _rows_scatter_fake(src, index, num_rows):
    return src.new_empty((num_rows, *src.shape[1:]))


class PagedLayerInputs(NamedTuple):
    """One layer's paged inputs for a compiled call, taken from a prepared context.

    kv_cache ``(2, num_blocks, block_size, Hkv, D)``; slot_mapping int64 ``[N]``; block_table
    int32 ``[R, cols]``, query_start_loc int32 ``[R+1]``, seq_lens int32 ``[R]`` on the layer's
    device, host_* their CPU copies; key_limits int32 ``[N]`` (mask == MASK_LIMITS) or None;
    mask: ``_C.MASK_NONE`` / ``MASK_CAUSAL`` / ``MASK_LIMITS``; scale: the softmax scale;
    output_scatter_indices int64 ``[N]`` (positions of the packed tokens among the caller's
    ``num_positions = B*T`` right-padded positions) or None for packed inputs.
    """

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    key_limits: torch.Tensor | None
    mask: int
    scale: float
    host_block_table: torch.Tensor | None
    host_query_start_loc: torch.Tensor | None
    host_seq_lens: torch.Tensor | None
    output_scatter_indices: torch.Tensor | None
    num_positions: int
    # a float8_e4m3fn kv_cache's scales (the layer's _k_scale / _v_scale), else None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


FP8_SCALES_COMPILE_MESSAGE = (
    "calculate_kv_scales cannot run under torch.compile: the first KV write sets the layer's "
    "scales from the data written (a host synchronisation); run that step eagerly, or set the "
    "layer's _k_scale and _v_scale"
)

# Spec dtypes of an fp8 cache: diffkv's, and vLLM 0.30's uint8 storage of one.
_FP8_SPEC_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def layer_scales(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's ``_k_scale`` and ``_v_scale`` (vLLM's contract: float32 tensors on its device,
    1 entry, or one per KV head), which a float8_e4m3fn cache is written and read with."""
    k_scale = getattr(layer, "_k_scale", None)
    v_scale = getattr(layer, "_v_scale", None)
    if not isinstance(k_scale, torch.Tensor) or not isinstance(v_scale, torch.Tensor):
        raise TypeError(
            "a float8_e4m3fn KV cache needs its layer's _k_scale and _v_scale (float32 tensors), got "
            f"{type(k_scale).__name__} and {type(v_scale).__name__} on {type(layer).__name__}"
        )
    return k_scale, v_scale


def graph_host_copies(metadata: Any) -> tuple[torch.Tensor | None, ...]:
    """The host copies of the block tables a traced call passes: none on CUDA (CUDA-graph trees
    cannot hold CPU tensors; the batch's tables were checked when prepared, and the kernels
    clamp every index), the CPU tensors themselves on the CPU."""
    if metadata.block_table.is_cuda:
        return None, None, None
    return metadata.block_table_cpu, metadata.query_start_loc_cpu, metadata.seq_lens_cpu


def plan_mask(piecewise_plan: Any) -> tuple[int, torch.Tensor | None]:
    """The mask a piecewise plan's layer call runs: ``(MASK_LIMITS, its key limits)``, or
    ``(MASK_NONE, None)`` when every query token sees all its row's keys (the plan's
    ``all_keys_visible``; a denoise step under HunyuanImage-3.0's image span): the same
    attention, served by the kernels of unmasked calls (on Hopper the persistent one for short
    uniform rows).  A plan object without the field (vLLM-Omni's own class) keeps its limits."""
    if getattr(piecewise_plan, "all_keys_visible", False):
        return _C.MASK_NONE, None
    return _C.MASK_LIMITS, piecewise_plan.key_limits


def paged_layer_inputs(
    layer: Any,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    metadata: Any,
    piecewise_plan: Any | None,
    query_token_shape: tuple[int, ...],
    output_scatter_indices: torch.Tensor | None,
    host_copies: tuple[torch.Tensor | None, ...],
) -> PagedLayerInputs:
    """One layer call's description, the one place it is assembled: the layer's cache and
    softmax scale, the batch's device metadata, the mask (the plan's per-token key limits when
    piecewise, else causal or not per the native metadata) and ``host_copies`` (the block
    tables' CPU copies for an eager call, ``graph_host_copies`` for a traced one).  The eager
    layer call (``DiffKVAttentionImpl.forward_paged``), its fallback for foreign contexts
    (``run_forward_paged``) and the compiled one (``forward_paged_layer``) all run from it."""
    if piecewise_plan is not None:
        mask, key_limits = plan_mask(piecewise_plan)
    else:
        mask, key_limits = (_C.MASK_CAUSAL if metadata.causal else _C.MASK_NONE), None
    num_positions = 1
    for size in query_token_shape:
        num_positions *= size
    host_block_table, host_query_start_loc, host_seq_lens = host_copies
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    spec_dtype = getattr(getattr(layer, "spec", None), "dtype", None)
    if isinstance(spec_dtype, torch.dtype) and (spec_dtype in _FP8_SPEC_DTYPES) != fp8:
        raise TypeError(
            f"the layer's kv_cache holds {kv_cache.dtype} but its spec says {spec_dtype}: an fp8 spec "
            "needs a float8_e4m3fn cache (allocate_kv_caches with the spec's dtype), and only it"
        )
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = layer_scales(layer)
    return PagedLayerInputs(
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
        block_table=metadata.block_table,
        query_start_loc=metadata.query_start_loc,
        seq_lens=metadata.seq_lens,
        key_limits=key_limits,
        mask=mask,
        scale=float(layer.softmax_scale),
        host_block_table=host_block_table,
        host_query_start_loc=host_query_start_loc,
        host_seq_lens=host_seq_lens,
        output_scatter_indices=output_scatter_indices,
        num_positions=num_positions,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def eager_host_copies(metadata: Any) -> tuple[torch.Tensor | None, ...]:
    """The host copies an eager call passes: the batch's CPU tables, whichever the device."""
    return metadata.block_table_cpu, metadata.query_start_loc_cpu, metadata.seq_lens_cpu


def forward_paged_arguments(
    inputs: PagedLayerInputs,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The layer call's arguments from a description, in the one order both entry points take:
    ``(kv_cache, ..., scale)`` after query, key and value, then the host copies --
    ``_C.forward_paged(q, k, v, *head, out, *tail)`` and
    ``torch.ops.diffkv.forward_paged(q, k, v, *head, *tail)``."""
    head = (
        inputs.kv_cache,
        inputs.slot_mapping,
        inputs.block_table,
        inputs.query_start_loc,
        inputs.seq_lens,
        inputs.key_limits,
        inputs.mask,
        inputs.scale,
    )
    tail = (inputs.host_block_table, inputs.host_query_start_loc, inputs.host_seq_lens)
    if inputs.k_scale is not None:
        tail = (*tail, inputs.k_scale, inputs.v_scale)  # a float8_e4m3fn cache's
    return head, tail


def layer_inputs(context: Any) -> PagedLayerInputs:
    """The tensors and numbers of a ``DiffusionPagedAttentionContext`` (from
    ``adapter.prepare_layer_context``) that ``forward_paged_layer`` needs; run it outside the
    compiled region, once per step and layer (layers of one cache group share all but kv_cache)."""
    layer = context.layer
    metadata = context.native_metadata
    return paged_layer_inputs(
        layer,
        layer.kv_cache,
        context.slot_mapping,
        metadata,
        context.piecewise_plan,
        context.query_token_shape,
        context.output_scatter_indices,
        graph_host_copies(metadata),
    )


def forward_paged_layer(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inputs: PagedLayerInputs
) -> torch.Tensor:
    """One layer of paged attention through the operators: query ``[P, H, D]``, key/value
    ``[P, Hkv, D]`` in the caller's flattened token layout (``P = N`` packed, or ``B*T``
    right-padded when ``inputs.output_scatter_indices`` is set); writes K/V into
    ``inputs.kv_cache`` and returns ``[P, H, D]`` (padded positions are zeros).  The same
    result, bit for bit, as ``DiffKVAttentionImpl.forward_paged`` on the matching context."""
    indices = inputs.output_scatter_indices
    if indices is not None:
        query = torch.ops.diffkv.rows_gather(query, indices)
        key = torch.ops.diffkv.rows_gather(key, indices)
        value = torch.ops.diffkv.rows_gather(value, indices)
    out = forward_paged_packed(query, key, value, inputs)
    if indices is not None:
        out = torch.ops.diffkv.rows_scatter(out, indices, inputs.num_positions)
    return out


def forward_paged_packed(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inputs: PagedLayerInputs
) -> torch.Tensor:
    """``torch.ops.diffkv.forward_paged`` over packed ``[N, H, D]`` query and ``[N, Hkv, D]``
    key/value: KV write + attention, returns ``[N, H, Dv]`` (a float8_e4m3fn cache: written and
    read with ``inputs.k_scale`` / ``v_scale``)."""
    head, tail = forward_paged_arguments(inputs)
    return torch.ops.diffkv.forward_paged(query, key, value, *head, *tail)


def restore_output(context: Any, output: torch.Tensor) -> torch.Tensor:
    """``context.restore_output(output)`` with the padded-row scatter through
    ``torch.ops.diffkv.rows_scatter`` (so Dynamo can trace it): packed output ``[N, H, Dv]``
    back to ``query_token_shape + (H, Dv)`` or ``query_token_shape + (H*Dv,)``."""
    num_heads = context.layer.num_heads
    head_size_v = context.layer.head_size_v
    token_shape = context.query_token_shape
    if context.output_scatter_indices is not None:
        num_positions = 1
        for size in token_shape:
            num_positions *= size
        flat_output = output.reshape(-1, num_heads, head_size_v)
        output = torch.ops.diffkv.rows_scatter(flat_output, context.output_scatter_indices, num_positions)
    if context.query_has_head_dims:
        return output.reshape(*token_shape, num_heads, head_size_v)
    return output.reshape(*token_shape, num_heads * head_size_v)
