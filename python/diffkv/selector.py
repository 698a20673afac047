"""Attention backend selection: which backend class serves a layer (vLLM's
``vllm.v1.attention.selector.get_attn_backend``, written for diffkv).

Selection lives in its own module, apart from the platform (``diffkv.platform``) and the
backend classes (``diffkv.backends``): it needs both, and neither needs it, so the import
graph stays one-way (platform <- backends.abstract <- backends.diffkv <- selector <- adapter).

Entry point: ``get_attn_backend(...)``, which ``diffkv.adapter`` calls (and re-exports as a
module attribute that tests and a vLLM-Omni install replace).
"""

from __future__ import annotations

import torch

from .backends.diffkv import (
    ACTIVATION_DTYPE_NAMES,
    FP8_CACHE_DTYPES,
    DiffKVAttentionBackend,
    supported_head_sizes,
)
from .platform import AttentionType, selection_device_type

__all__ = ["get_attn_backend"]

# Activation dtypes the DIFFKV kernels are built for, in the order the refusal names them.
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_NAMES = ACTIVATION_DTYPE_NAMES


def get_attn_backend(
    *,
    head_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str | None,
    attn_type: str,
    num_heads: int,
) -> type:
    """Select the attention backend for a layer: ``DiffKVAttentionBackend``.

    The head sizes it takes are the kernels' on the device the selection is for
    (``diffkv.platform.selection_device_type``: the layer adapter's device, else the
    platform's) and for ``dtype``.  Raises ValueError naming the argument when the backend
    cannot serve the layer.
    """
    # the head size first (then the dtype), for the dtype's kernels -- bfloat16's when the
    # dtype is not one diffkv runs
    device_type = selection_device_type()
    size_dtype = dtype if dtype in _SUPPORTED_DTYPES else torch.bfloat16
    # an fp8 cache's sizes for fp16/bf16 queries; float32 ones keep float32's (the CPU reference
    # runs them over an fp8 cache, a CUDA call refuses them with its own reason)
    fp8 = (
        isinstance(kv_cache_dtype, str) and kv_cache_dtype in FP8_CACHE_DTYPES and size_dtype != torch.float32
    )
    sizes = supported_head_sizes(device_type, size_dtype, fp8_cache=fp8)
    if type(head_size) is not int or head_size not in sizes:
        cache = " with a float8_e4m3fn cache" if fp8 else ""
        where = f"for {_DTYPE_NAMES[size_dtype]}{cache} on {device_type}"
        if not sizes:
            raise ValueError(
                f"get_attn_backend(): head_size {head_size!r} cannot run {where}: this diffkv was built "
                "without CUDA kernels"
            )
        if sizes == list(range(sizes[0], sizes[-1] + 1)) and len(sizes) > 2:
            raise ValueError(
                f"get_attn_backend(): head_size must be between {sizes[0]} and {sizes[-1]} {where}, "
                f"got {head_size!r}"
            )
        raise ValueError(f"get_attn_backend(): head_size must be one of {sizes} {where}, got {head_size!r}")
    supported_dtypes = [_DTYPE_NAMES[d] for d in _SUPPORTED_DTYPES]
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"get_attn_backend(): dtype must be one of {supported_dtypes}, got {dtype!r}")
    if kv_cache_dtype == "fp8_e5m2":
        raise NotImplementedError(
            "get_attn_backend(): kv_cache_dtype 'fp8_e5m2' is not supported; diffkv's fp8 KV cache is "
            "e4m3 ('fp8' or 'fp8_e4m3')"
        )
    allowed_cache_dtypes = (None, "auto", _DTYPE_NAMES[dtype], dtype, *FP8_CACHE_DTYPES)
    if kv_cache_dtype not in allowed_cache_dtypes:
        raise ValueError(
            "get_attn_backend(): kv_cache_dtype must be 'auto', the activation dtype "
            f"{_DTYPE_NAMES[dtype]!r} (unquantized cache) or 'fp8' / 'fp8_e4m3', got {kv_cache_dtype!r}"
        )
    if attn_type != AttentionType.DECODER:
        raise ValueError(
            f"get_attn_backend(): attn_type must be {AttentionType.DECODER!r}, got {attn_type!r}"
        )
    if type(num_heads) is not int or num_heads <= 0:
        raise ValueError(f"get_attn_backend(): num_heads must be a positive integer, got {num_heads!r}")
    return DiffKVAttentionBackend
