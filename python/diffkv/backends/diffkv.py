"""The DIFFKV attention backend: paged-KV diffusion attention in one call into diffkv._C.

Entry points: ``DiffKVAttentionBackend`` (the backend class the adapter selects) and
``DiffKVAttentionImpl`` with ``forward_paged(context)`` (KV write + attention in the layer's
mask mode + output in the caller's layout) and ``do_kv_cache_update`` (the write alone, vLLM's
``reshape_and_cache_flash`` contract), and ``forward`` (dense attention, ``diffkv.dense``,
the same kernels over contiguous K/V).  Eager calls go straight to diffkv._C; under
torch.compile (``is_compiling()``, a constant to Dynamo) the paged path goes through the
``torch.ops.diffkv`` operators of ``diffkv.ops``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _C, ops
from ..dense import dense_forward
from ..native import PagedAttentionMetadata, PagedMetadataBuilder
from ..platform import selection_device_type
from .abstract import AttentionBackend, AttentionImpl

__all__ = ["DiffKVAttentionBackend", "DiffKVAttentionImpl", "DiffKVMetadataBuilder", "supported_head_sizes"]

_PLATFORM_MESSAGE = "DiffKVAttentionImpl: diffkv runs on CPU and CUDA tensors only, not on {}"

# kv_cache_dtype values meaning "the cache holds the model dtype".
_UNQUANTIZED_CACHE_DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")
# kv_cache_dtype values of a float8_e4m3fn cache (vLLM's names; e5m2 is refused).
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")

# The activation dtypes the kernels run (C reference and CUDA alike), by their names.
ACTIVATION_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def supported_head_sizes(device_type: str, dtype: torch.dtype, fp8_cache: bool = False) -> list[int]:
    """The head sizes paged and dense attention take on ``device_type`` ('cpu' or 'cuda') for
    the activation ``dtype`` (float32, float16 or bfloat16), over a cache of that dtype or, with
    ``fp8_cache``, a float8_e4m3fn one, as the build serves them: the CPU reference 1 to 1024
    (either cache); CUDA float32 1 to 256 (no fp8 cache), float16/bfloat16 32, 64, 72, 80, 96,
    128, 160, 192 and 256 (over either cache); none on CUDA in a CPU-only build.
    ``_C.supported_head_sizes`` is the one place that says so."""
    name = ACTIVATION_DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(
            f"supported_head_sizes(): dtype must be one of {list(ACTIVATION_DTYPE_NAMES.values())}, "
            f"got {dtype!r}"
        )
    return list(_C.supported_head_sizes(device_type, name, "float8_e4m3fn" if fp8_cache else "auto"))


# vLLM's calculate_kv_scales constants: a layer's first KV write sets k_scale = amax|K| / 200
# and v_scale = amax|V| / 100 (vllm.envs K_SCALE_CONSTANT, V_SCALE_CONSTANT).
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
_MODEL_TORCH_DTYPES = tuple(ACTIVATION_DTYPE_NAMES)


class DiffKVMetadataBuilder(PagedMetadataBuilder):
    """The backend's metadata builder: diffkv's kernels need no decode-first row order, so
    ``reorder_batch_threshold`` is None."""

    reorder_batch_threshold = None


class DiffKVAttentionBackend(AttentionBackend):
    """Paged-KV attention for diffusion layers, run by diffkv's C/CUDA kernels."""

    accept_output_buffer: bool = False
    supports_piecewise_spans: bool = True
    supports_paged_kv: bool = True
    # extra["valid_kv_length"]: the valid prefix becomes the rows' key count (no copy)
    supports_prefix_kv_slicing: bool = True
    # The layer write is explicit (do_kv_cache_update / inside forward_paged), as with vLLM's
    # FLASH_ATTN: the adapter requires do_kv_cache_update when this is False.
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "DIFFKV"

    @staticmethod
    def get_impl_cls() -> type[DiffKVAttentionImpl]:
        return DiffKVAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[PagedAttentionMetadata]:
        return PagedAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[DiffKVMetadataBuilder]:
        return DiffKVMetadataBuilder

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        """Head sizes the kernels take for fp16/bf16 on the device backend selection is for
        (``diffkv.platform.selection_device_type``: the layer's, else the platform's): on CUDA
        the tensor-core kernels' (32, 64, 72, 80, 96, 128, 160, 192, 256), on the CPU every size the C
        reference takes (1 to 1024).  ``supported_head_sizes(device_type, dtype)`` answers for any dtype."""
        return supported_head_sizes(selection_device_type(), torch.bfloat16)

    @classmethod
    def supports_attention_mask(cls, attention_spec: object | None = None) -> bool:
        """Boolean key-padding masks ([B, S_k] or [B, 1, 1, S_k], any pattern) are honoured by
        the dense forward; per-query or additive masks raise NotImplementedError."""
        del attention_spec
        return True

    @classmethod
    def supports_packed_mask_free(cls) -> bool:
        """``packed_padding`` [real, pad] rows run without a mask on every platform diffkv runs on."""
        return True

    @classmethod
    def supports_multi_doc_packed_varlen(cls) -> bool:
        """cu_seqlens_q/cu_seqlens_k documents are separate rows of the kernels: no attention
        crosses a document boundary."""
        return True

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        """diffkv's kernels read K/V pages through the cache's real block stride."""
        return True


def _attn_type_name(attn_type: Any) -> Any:
    return getattr(attn_type, "value", attn_type)


class DiffKVAttentionImpl(AttentionImpl):
    """One layer's attention implementation.

    Accepts both the diffusion constructor (``softmax_scale``, ``causal``, ...) and the vLLM
    keywords the layer adapter passes (``scale``, ``alibi_slopes``, ``sliding_window``,
    ``kv_cache_dtype``, ``logits_soft_cap``, ``attn_type``, ``kv_sharing_target_layer_name``);
    features diffkv does not implement are rejected with NotImplementedError naming them.
    """

    # vLLM-Omni's backend contract: the quantized cache dtypes each platform handles (an fp8
    # cache: the CPU reference, and on CUDA the Hopper e4m3 kernel -- other GPUs refuse the call).
    _supported_kv_cache_dtypes = {"cpu": set(FP8_CACHE_DTYPES), "cuda": set(FP8_CACHE_DTYPES)}

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        softmax_scale: float | None = None,
        causal: bool = False,
        num_kv_heads: int | None = None,
        prefix: str = "",
        qkv_layout: str | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        **extra_impl_args: Any,
    ) -> None:
        op = "DiffKVAttentionImpl()"
        scale = extra_impl_args.pop("scale", None)
        alibi_slopes = extra_impl_args.pop("alibi_slopes", None)
        sliding_window = extra_impl_args.pop("sliding_window", None)
        kv_cache_dtype = extra_impl_args.pop("kv_cache_dtype", "auto")
        logits_soft_cap = extra_impl_args.pop("logits_soft_cap", None)
        attn_type = extra_impl_args.pop("attn_type", None)
        kv_sharing_target_layer_name = extra_impl_args.pop("kv_sharing_target_layer_name", None)
        if extra_impl_args:
            raise TypeError(f"{op}: unexpected keyword arguments {sorted(extra_impl_args)}")

        for name, value in (("num_heads", num_heads), ("head_size", head_size)):
            if type(value) is not int:
                raise TypeError(f"{op}: {name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"{op}: {name} must be positive, got {value}")
        if num_kv_heads is None:
            num_kv_heads = num_heads
        if type(num_kv_heads) is not int:
            raise TypeError(f"{op}: num_kv_heads must be an int, got {num_kv_heads!r}")
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{op}: num_kv_heads must be positive and divide num_heads={num_heads}, got {num_kv_heads}"
            )

        if scale is None and softmax_scale is None:
            raise TypeError(f"{op}: softmax_scale (or its alias scale) is required")
        if scale is not None and softmax_scale is not None and float(scale) != float(softmax_scale):
            raise ValueError(
                f"{op}: scale and softmax_scale must agree, "
                f"got scale={scale!r}, softmax_scale={softmax_scale!r}"
            )
        resolved_scale = float(softmax_scale if softmax_scale is not None else scale)

        unsupported = (
            ("alibi_slopes", alibi_slopes),
            ("sliding_window", sliding_window),
            ("logits_soft_cap", logits_soft_cap),
            ("kv_sharing_target_layer_name", kv_sharing_target_layer_name),
        )
        for name, value in unsupported:
            if value is not None:
                raise NotImplementedError(f"{op}: {name} is not supported, got {value!r}")
        if not (
            kv_cache_dtype is None
            or kv_cache_dtype in _MODEL_TORCH_DTYPES
            or (
                isinstance(kv_cache_dtype, str)
                and kv_cache_dtype in (*_UNQUANTIZED_CACHE_DTYPES, *FP8_CACHE_DTYPES)
            )
        ):
            raise NotImplementedError(
                f"{op}: kv_cache_dtype must be one of {list(_UNQUANTIZED_CACHE_DTYPES)} (an unquantized "
                f"cache) or {list(FP8_CACHE_DTYPES)} (float8_e4m3fn), "
                f"got {kv_cache_dtype!r}"
            )
        if attn_type is not None and _attn_type_name(attn_type) != "decoder":
            raise NotImplementedError(f"{op}: attn_type must be 'decoder', got {attn_type!r}")
        if backend_kwargs:
            raise NotImplementedError(f"{op}: backend_kwargs are not supported, got {sorted(backend_kwargs)}")

        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.softmax_scale = resolved_scale
        self.scale = resolved_scale
        self.causal = bool(causal)
        self.prefix = prefix
        self.qkv_layout = qkv_layout
        self.kv_cache_dtype = "auto" if kv_cache_dtype is None else kv_cache_dtype
        self.attn_type = attn_type

    # --- paged path ---------------------------------------------------------------------------

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatters key/value ``[N, Hkv, D]`` (any strides) into ``kv_cache`` ``(2, num_blocks,
        block_size, Hkv, D)`` at ``slot_mapping[:N]`` (int64; slots < 0 skipped).  A
        float8_e4m3fn cache is written quantized with ``layer._k_scale`` / ``layer._v_scale``."""
        # anything but a tensor goes to _C.kv_write, which names kv_cache in its TypeError
        if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.float8_e4m3fn:
            # quantized with the layer's scales (vLLM's contract: layer._k_scale, _v_scale)
            if torch.compiler.is_compiling():
                if getattr(layer, "calculate_kv_scales", False):
                    raise NotImplementedError(ops.FP8_SCALES_COMPILE_MESSAGE)
                torch.ops.diffkv.kv_write(key, value, kv_cache, slot_mapping, *ops.layer_scales(layer))
                return
            calculate_kv_scales(layer, key, value)
            k_scale, v_scale = ops.layer_scales(layer)
            _C.kv_write(key, value, kv_cache, slot_mapping, k_scale, v_scale)
            return
        if torch.compiler.is_compiling():
            torch.ops.diffkv.kv_write(key, value, kv_cache, slot_mapping)
            return
        _C.kv_write(key, value, kv_cache, slot_mapping)

    # How diffkv's adapter describes this impl's layer calls ahead (prepare_layer_context): the
    # impl consumes prepared_call, its layer's cache as diffkv reads it, its native metadata as
    # ops.paged_layer_inputs reads it (device tables, causal, host copies) or None where diffkv
    # cannot serve it.  The vLLM-Omni install's impl (diffkv.integrations.vllm_omni) overrides
    # the last two.
    _diffkv_runs_prepared_calls = True

    def _diffkv_cache_view(self, layer: Any, kv_cache: torch.Tensor) -> torch.Tensor:
        del layer
        return kv_cache

    @staticmethod
    def _diffkv_paged_metadata(native_metadata: Any) -> Any | None:
        return native_metadata

    def forward_paged(self, paged_kv_context: Any) -> torch.Tensor:
        """Runs one layer of paged diffusion attention from a ``DiffusionPagedAttentionContext``:
        writes ``key_write``/``value_write`` into the layer's cache, attends from the caller's
        query ``[N, H, D]`` over each row's ``[0, seq_len)`` keys (piecewise spans -> per-token
        key limits; else causal or not per the native metadata) and returns the output in the
        caller's layout (``context.restore_output``; padded rows are zeros).

        A context that diffkv's ``prepare_layer_context`` has just made arrives with its call
        already described (``prepared_call``), which runs while its layer keeps that cache and an
        impl; any other context is described here from its attributes (``run_forward_paged``,
        which also raises the errors of a layer without its cache or impl)."""
        out = run_prepared_call(paged_kv_context)
        if out is not None:
            return out
        return run_forward_paged(paged_kv_context)

    # --- dense path (diffkv.dense: the same kernels over contiguous K/V) ---------------------

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any | None = None,
    ) -> torch.Tensor:
        """Dense attention, ``[B, S_q, H, D]`` x ``[B, S_k, Hkv, D]`` -> ``[B, S_q, H, D]``, on
        the CPU reference or the CUDA kernels (the tensors' device; no platform dispatch is
        needed).  See ``diffkv.dense`` for the metadata fields honoured."""
        return dense_forward(self, query, key, value, attn_metadata)

    def forward_cuda(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any | None = None,
    ) -> torch.Tensor:
        return dense_forward(self, query, key, value, attn_metadata)

    def forward_hip(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(_PLATFORM_MESSAGE.format("ROCm"))

    def forward_npu(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(_PLATFORM_MESSAGE.format("NPU"))

    def forward_xpu(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(_PLATFORM_MESSAGE.format("XPU"))

    def forward_musa(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(_PLATFORM_MESSAGE.format("MUSA"))


def calculate_kv_scales(layer: Any, key: torch.Tensor, value: torch.Tensor) -> None:
    """vLLM's calculate_kv_scales, once: while ``layer.calculate_kv_scales`` is true, sets the
    layer's scales from the KV being written -- ``_k_scale = amax|key| / K_SCALE_CONSTANT`` and
    ``_v_scale = amax|value| / V_SCALE_CONSTANT`` (1.0 for an all-zero tensor), in place, with
    their ``_float`` copies -- and clears the flag.  One device synchronisation, that once."""
    if not getattr(layer, "calculate_kv_scales", False):
        return
    k_scale, v_scale = ops.layer_scales(layer)
    for scale, x, constant, name in (
        (k_scale, key, K_SCALE_CONSTANT, "_k"),
        (v_scale, value, V_SCALE_CONSTANT, "_v"),
    ):
        amax = float(x.abs().amax()) if x.numel() else 0.0
        computed = amax / constant if amax > 0 and amax != float("inf") else 1.0
        scale.fill_(computed)
        setattr(layer, f"{name}_scale_float", float(scale[0]))
    layer.calculate_kv_scales = False


# The layer call diffkv's prepare_layer_context described last, until forward_paged takes it
# (adapter.py fills it): (context, its layer, the cache it was described with, query,
# _C.forward_paged's arguments as a list -- query, key, value, ops.forward_paged_arguments'
# head, None in out's place, the host copies --, out's shape or None for
# torch.empty_like(query), whether out is then already in the caller's layout).  One slot for
# the process: a context that finds another's call here (two threads, or prepare without
# forward) is described again by run_forward_paged, with the same result; and one layer call's
# tensors at most are kept alive by it.
prepared_call: list[tuple | None] = [None]
_empty_like = torch.empty_like
_OUT = 11  # out's place among _C.forward_paged's arguments


def run_prepared_call(paged_kv_context: Any) -> torch.Tensor | None:
    """The layer call diffkv's ``prepare_layer_context`` described for ``paged_kv_context``
    (``prepared_call``), run: the output in the caller's layout; None, running nothing, when
    the slot holds another context's call, the layer has since been given another cache or no
    impl, or torch.compile is tracing."""
    if torch.compiler.is_compiling():
        return None
    prepared = prepared_call[0]
    if prepared is None or prepared[0] is not paged_kv_context:
        return None
    prepared_call[0] = None
    _, layer, kv_cache, query, arguments, out_shape, restored = prepared
    if layer.kv_cache is not kv_cache or layer.impl is None:
        return None
    if len(arguments) > _OUT + 4:  # a float8_e4m3fn cache's scales follow the host copies
        calculate_kv_scales(layer, arguments[1], arguments[2])
    out = _empty_like(query) if out_shape is None else query.new_empty(out_shape)
    arguments[_OUT] = out
    _C.forward_paged(*arguments)
    return out if restored else paged_kv_context.restore_output(out)


def caller_query(paged_kv_context: Any) -> torch.Tensor:
    """The query diffkv's kernels read: a ``DiffusionPagedAttentionContext``'s slot (the
    caller's ``[N, H, D]`` view, strides and all, unless ``query`` was read and copied it);
    other context objects give their ``query``."""
    query = getattr(paged_kv_context, "_caller_query", None)
    return paged_kv_context.query if query is None else query


def run_forward_paged(
    paged_kv_context: Any,
    *,
    cache_view: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    metadata: Any | None = None,
) -> torch.Tensor:
    """The DIFFKV ``forward_paged`` from a context's attributes, shared by
    ``DiffKVAttentionImpl`` and the vLLM-Omni install (``diffkv.integrations.vllm_omni``): the
    Omni backend's binding checks, one ``_C`` call (KV write + attention; the
    ``diffkv::forward_paged`` operator while compiling) and the output back in the caller's
    layout.  ``cache_view(layer, kv_cache)`` maps a foreign cache layout onto
    ``(2, num_blocks, block_size, Hkv, D)``; ``metadata`` stands in for the context's native
    metadata (what the install derives from vLLM's)."""
    layer = getattr(paged_kv_context, "layer", None)
    if layer is None:
        raise TypeError("paged_kv_context must expose a native diffusion attention layer")
    kv_cache = getattr(layer, "kv_cache", None)
    if kv_cache is None:
        raise RuntimeError(
            f"Native KV cache is not bound for diffusion layer {getattr(layer, 'layer_name', None)!r}"
        )
    if getattr(layer, "impl", None) is None:
        raise RuntimeError(
            "Native attention implementation is not bound for diffusion layer "
            f"{getattr(layer, 'layer_name', None)!r}"
        )
    if cache_view is not None:
        kv_cache = cache_view(layer, kv_cache)
    if metadata is None:
        metadata = paged_kv_context.native_metadata
    compiling = torch.compiler.is_compiling()
    inputs = ops.paged_layer_inputs(
        layer,
        kv_cache,
        paged_kv_context.slot_mapping,
        metadata,
        paged_kv_context.piecewise_plan,
        (),  # the token layout is restore_output's business, below
        None,
        ops.graph_host_copies(metadata) if compiling else ops.eager_host_copies(metadata),
    )
    query = caller_query(paged_kv_context)
    key = paged_kv_context.key_write
    value = paged_kv_context.value_write
    if inputs.k_scale is not None:
        if compiling:
            if getattr(layer, "calculate_kv_scales", False):
                raise NotImplementedError(ops.FP8_SCALES_COMPILE_MESSAGE)
        else:
            calculate_kv_scales(layer, key, value)
    if compiling:
        out = ops.forward_paged_packed(query, key, value, inputs)
        return ops.restore_output(paged_kv_context, out)
    head, tail = ops.forward_paged_arguments(inputs)
    out = torch.empty_like(query)
    _C.forward_paged(query, key, value, *head, out, *tail)
    return paged_kv_context.restore_output(out)
