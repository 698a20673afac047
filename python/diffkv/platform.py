"""Standalone stand-ins for the vLLM / vLLM-Omni module-level collaborators of the adapter.

vLLM-Omni's adapter looks these names up at call time in its own module namespace, and so does
``diffkv.adapter`` (tests monkeypatch them there).  Here they are small, self-contained
objects that need neither vLLM nor vLLM-Omni:

- ``current_omni_platform``: the platform object (``is_cuda()`` ... ``is_musa()`` answered
  from torch; ``build_diffusion_kv_attn_metadata(**kw)`` delegates to
  ``diffkv.native.build_attn_metadata``; no KV prewrite; the paged backend is the selected one);
- ``set_current_vllm_config(cfg)`` / ``get_current_vllm_config()``: the current config;
- ``override_paged_kv_adapter(adapter)`` / ``current_paged_kv_adapter()``: the forward
  context's paged-KV adapter;
- ``AttentionBackendEnum``, ``AttentionType``, ``cdiv``, ``AttentionLayerBase``.

Backend selection (``get_attn_backend``) is in ``diffkv.selector``: it needs the backend
classes, which need this module.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar, Token
from typing import Any

import torch

__all__ = [
    "AttentionBackendEnum",
    "AttentionLayerBase",
    "AttentionType",
    "DiffKVPlatform",
    "cdiv",
    "current_omni_platform",
    "current_paged_kv_adapter",
    "get_current_vllm_config",
    "override_paged_kv_adapter",
    "set_current_vllm_config",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers (vLLM's ``vllm.utils.math_utils.cdiv``)."""
    return -(a // -b)


class AttentionType:
    """Attention kinds (vLLM's ``AttentionType``); diffusion paged KV uses only ``DECODER``."""

    DECODER = "decoder"


class AttentionBackendEnum(enum.Enum):
    """Backend names a config may request.  ``FLASH_ATTN`` is vLLM-Omni's adapter's portable request,
    which diffkv's platform resolves to its own ``DIFFKV`` backend."""

    FLASH_ATTN = "FLASH_ATTN"
    DIFFKV = "DIFFKV"


class AttentionLayerBase(ABC):
    """The small contract vLLM's ``init_attn_backend`` reads from an attention layer."""

    @abstractmethod
    def get_attn_backend(self) -> Any:
        """The backend class that serves this layer."""

    @abstractmethod
    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        """The layer's KV cache spec (an ``AttentionSpec``)."""


class DiffKVPlatform:
    """diffkv's ``current_omni_platform``: the host platform as torch sees it."""

    def _device_type(self) -> str:
        if torch.cuda.is_available() and torch.version.hip is None:
            return "cuda"
        return "none"

    def is_cuda(self) -> bool:
        return self._device_type() == "cuda"

    def is_rocm(self) -> bool:
        return False

    def is_npu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_musa(self) -> bool:
        return False

    def build_diffusion_kv_attn_metadata(self, **kwargs: Any) -> dict[str, Any]:
        """Native metadata per layer for one batch: ``diffkv.native.build_attn_metadata``
        with vLLM-Omni's adapter's keyword set (attn_groups, num_reqs, num_tokens, query_start_loc_gpu,
        ...)."""
        from . import native

        return native.build_attn_metadata(**kwargs)

    def requires_diffusion_paged_kv_prewrite(self) -> bool:
        """diffkv's forward_paged writes K/V itself; no platform prewrite is needed."""
        return False

    def get_diffusion_paged_kv_attn_backend(self, backend: Any, *, ulysses_degree: int) -> Any:
        """The paged backend for a selected backend: the same class (strict Ulysses needs no
        specialisation on CUDA)."""
        del ulysses_degree
        return backend

    def __repr__(self) -> str:
        return f"DiffKVPlatform(device_type={self._device_type()!r})"


current_omni_platform = DiffKVPlatform()

# Context variables, not module globals: two threads driving two adapters each see their own
# current config and adapter (a thread starts with a fresh context).
_current_vllm_config: ContextVar[Any | None] = ContextVar("diffkv_current_vllm_config", default=None)
_current_paged_kv_adapter: ContextVar[Any | None] = ContextVar(
    "diffkv_current_paged_kv_adapter", default=None
)
_selection_device: ContextVar[str | None] = ContextVar("diffkv_selection_device", default=None)


def _restore(var: ContextVar, token: Token, previous: Any) -> None:
    try:
        var.reset(token)
    except ValueError:  # exited from another context than the one that entered (a runtime
        var.set(previous)  # activation closed on another thread): restore the value itself


@contextmanager
def _scoped(var: ContextVar, value: Any) -> Iterator[None]:
    """``var`` holds ``value`` inside the block; the previous value is restored on exit (also on
    error)."""
    previous = var.get()
    token = var.set(value)
    try:
        yield
    finally:
        _restore(var, token, previous)


def set_current_vllm_config(vllm_config: Any) -> AbstractContextManager[None]:
    """Make ``vllm_config`` the current config inside the block; the previous one is restored
    on exit (also on error)."""
    return _scoped(_current_vllm_config, vllm_config)


def get_current_vllm_config() -> Any | None:
    """The config installed by the innermost active ``set_current_vllm_config`` (or None)."""
    return _current_vllm_config.get()


def override_paged_kv_adapter(adapter: Any) -> AbstractContextManager[None]:
    """Install ``adapter`` as the forward context's paged-KV adapter inside the block; the
    previous one is restored on exit (also on error)."""
    return _scoped(_current_paged_kv_adapter, adapter)


def current_paged_kv_adapter() -> Any | None:
    """The adapter installed by the innermost active ``override_paged_kv_adapter`` (or None)."""
    return _current_paged_kv_adapter.get()


def selecting_for(device: torch.device | str) -> AbstractContextManager[None]:
    """Backend selection inside the block is for a layer on ``device`` (its type, 'cpu' or
    'cuda', decides the head sizes the backend takes); the layer adapter sets it around
    ``get_attn_backend``.  The previous one is restored on exit (also on error)."""
    return _scoped(_selection_device, torch.device(device).type)


def selection_device_type() -> str:
    """The device type backend selection is for: the innermost ``selecting_for``'s, else the
    platform's ('cuda' where torch sees a CUDA device, else 'cpu')."""
    chosen = _selection_device.get()
    if chosen is not None:
        return chosen
    return "cuda" if current_omni_platform.is_cuda() else "cpu"
