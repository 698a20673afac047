"""diffkv inside a vLLM-Omni process: the paged diffusion attention path runs on diffkv's C/CUDA
hot path, with vLLM's own BlockTables, attention metadata and KV cache tensors.

Entry points:

- ``install(*, kv_cache_layout=None) -> Installation``: patches a running vLLM-Omni (see the
  list below) and returns an ``Installation`` whose ``patches`` name every change and whose
  ``uninstall()`` restores them.  ImportError (naming what is missing) when ``vllm_omni`` cannot
  be imported or lacks a module or attribute diffkv needs.
- ``kv_cache_view(kv_cache, num_kv_heads, head_size, *, layout=None)``: a strided view, never a
  copy, of one layer's vLLM KV cache in diffkv's canonical shape
  ``(2, num_blocks, block_size, num_kv_heads, head_size)``.
- ``VllmPagedMetadata``: vLLM's native (FlashAttention) metadata plus the host copies diffkv's
  bounds checks read, built once per batch, never per layer.

What ``install()`` changes (each one recorded in ``Installation.patches``):

1. Omni's diffusion backend registry: the ``FLASH_ATTN`` entry of
   ``DiffusionAttentionBackendEnum`` is overridden (``register_diffusion_backend``) with
   ``DiffKVOmniAttentionBackend``.  That entry is the one Omni's ``Attention`` layer loads for a
   Scheduler-paged layer whose platform default has no paged support, and the CUDA default.
   The class is built at install time: a ``DiffKVAttentionBackend`` whose ``forward_paged``
   runs diffkv, and whose dense path (layers that are not paged) stays the backend it replaces.
   The selector's backend cache is cleared so layers built afterwards see the override.
2. ``diffkv.adapter``'s module-level collaborators are pointed at the ones vLLM-Omni's own
   adapter module uses (``set_current_vllm_config``, ``get_attn_backend``,
   ``AttentionBackendEnum``, ``build_slot_mappings_by_layer``, ``get_dcp_local_seq_lens``,
   ``override_paged_kv_adapter``, ``cdiv``) and ``current_omni_platform`` at a proxy of Omni's
   platform whose ``build_diffusion_kv_attn_metadata`` wraps each native metadata object in a
   ``VllmPagedMetadata``.  diffkv keeps its own ``build_paged_piecewise_plan`` (its key limits
   run every mask mode in one launch).
3. The adapter classes (``DiffusionPagedAttentionAdapter``, ``...LayerAdapter``, ``...Row``,
   ...) in ``vllm_omni.diffusion.diffusion_kv.paged_attention_adapter`` and in every loaded
   ``vllm_omni`` module that imported them by name are replaced by diffkv's; the layer adapter
   becomes a subclass that is also vLLM's ``AttentionLayerBase`` (vLLM's KV cache
   initialisation finds layers by that type).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import adapter as _adapter
from ..backends.diffkv import DiffKVAttentionBackend, run_forward_paged

__all__ = [
    "KV_CACHE_LAYOUTS",
    "DiffKVOmniPlatform",
    "Installation",
    "Patch",
    "VllmPagedMetadata",
    "install",
    "installed",
    "kv_cache_view",
]

# Modules of vLLM-Omni that install() needs.
_REGISTRY_MODULE = "vllm_omni.diffusion.attention.backends.registry"
_SELECTOR_MODULE = "vllm_omni.diffusion.attention.selector"
_ADAPTER_MODULE = "vllm_omni.diffusion.diffusion_kv.paged_attention_adapter"

# Collaborators of diffkv.adapter taken from Omni's adapter module (vLLM-Omni's adapter imports
# each of them from vLLM or vLLM-Omni into that module).
_COLLABORATORS = (
    "set_current_vllm_config",
    "get_attn_backend",
    "AttentionBackendEnum",
    "build_slot_mappings_by_layer",
    "get_dcp_local_seq_lens",
    "override_paged_kv_adapter",
    "cdiv",
)

# Adapter classes replaced by diffkv's wherever Omni bound them.
_ADAPTER_CLASSES = (
    "DiffusionPagedAttentionAdapter",
    "DiffusionPagedAttentionContext",
    "DiffusionPagedAttentionLayerAdapter",
    "DiffusionPagedAttentionMetadata",
    "DiffusionPagedAttentionRow",
    "DiffusionPagedAttentionRowBinding",
    "DiffusionPagedAttentionRuntime",
    "PreparedDiffusionPagedAttentionBatch",
)

# ------------------------------------------------------------------------------------------------
# KV cache layouts
# ------------------------------------------------------------------------------------------------

# Logical per-layer layouts of a vLLM KV cache (any physical stride order, any storage offset):
KV_CACHE_LAYOUTS = {
    "kv_first": "(2, num_blocks, block_size, num_kv_heads, head_size): vLLM <= 0.25 FlashAttention",
    "blocks_first": "(num_blocks, 2, block_size, num_kv_heads, head_size): blocks-first FlashAttention",
    "packed_nhd": "(num_blocks, block_size, num_kv_heads, 2 * head_size): vLLM 0.29, K in [..., :D]",
    "packed_hnd": "(num_blocks, num_kv_heads, block_size, 2 * head_size): vLLM 0.29, K in [..., :D]",
}


def _infer_layout(shape: tuple[int, ...], num_kv_heads: int, head_size: int) -> list[str]:
    """Every layout whose logical shape matches ``shape``."""
    matches = []
    if len(shape) == 5 and shape[3:] == (num_kv_heads, head_size):
        if shape[0] == 2:
            matches.append("kv_first")
        if shape[1] == 2:
            matches.append("blocks_first")
    if len(shape) == 4 and shape[3] == 2 * head_size:
        if shape[2] == num_kv_heads:
            matches.append("packed_nhd")
        if shape[1] == num_kv_heads:
            matches.append("packed_hnd")
    return matches


def kv_cache_view(
    kv_cache: torch.Tensor,
    num_kv_heads: int,
    head_size: int,
    *,
    layout: str | None = None,
) -> torch.Tensor:
    """One layer's vLLM KV cache as a ``(2, num_blocks, block_size, num_kv_heads, head_size)``
    strided view of the same storage (index 0: keys, 1: values); never a copy.

    kv_cache: ``(2, nb, bs, H, D)`` ("kv_first"), ``(nb, 2, bs, H, D)`` ("blocks_first"),
    ``(nb, bs, H, 2D)`` ("packed_nhd") or ``(nb, H, bs, 2D)`` ("packed_hnd"), the last two with
    K in ``[..., :D]`` and V in ``[..., D:]``; the physical stride order is free (vLLM 0.29's
    ``KVCacheLayout`` permutations, block-major buffers shared by several layers).  ``layout``
    names the logical layout when the shape alone is ambiguous (e.g. ``num_blocks == 2`` or
    ``block_size == num_kv_heads``).  Raises TypeError for a non-tensor, ValueError for a shape
    that no layout (or not the named one) matches, or an ambiguous shape without ``layout``.
    """
    op = "kv_cache_view()"
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{op}: kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    for name, value in (("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        if type(value) is not int or value <= 0:
            raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    shape = tuple(kv_cache.shape)
    if layout is not None and layout not in KV_CACHE_LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {sorted(KV_CACHE_LAYOUTS)} or None, got {layout!r}")
    matches = _infer_layout(shape, num_kv_heads, head_size)
    if layout is None:
        if not matches:
            raise ValueError(
                f"{op}: kv_cache must have one of the layouts {list(KV_CACHE_LAYOUTS.values())} with "
                f"num_kv_heads={num_kv_heads}, head_size={head_size}, got shape={shape}"
            )
        if len(matches) > 1:
            raise ValueError(
                f"{op}: kv_cache shape={shape} matches the layouts {matches}; pass layout= to choose one"
            )
        layout = matches[0]
    elif layout not in matches:
        raise ValueError(
            f"{op}: kv_cache must be {KV_CACHE_LAYOUTS[layout]} with num_kv_heads={num_kv_heads}, "
            f"head_size={head_size} for layout {layout!r}, got shape={shape}"
        )
    if layout == "kv_first":
        return kv_cache
    if layout == "blocks_first":
        return kv_cache.transpose(0, 1)
    # Split the content dim into (K|V, D): strides (D * s, s), so the K/V index becomes dim 0.
    split = kv_cache.unflatten(-1, (2, head_size))
    if layout == "packed_nhd":
        return split.permute(3, 0, 1, 2, 4)
    return split.permute(3, 0, 2, 1, 4)


# ------------------------------------------------------------------------------------------------
# Native metadata
# ------------------------------------------------------------------------------------------------

# Fields of vLLM's FlashAttentionMetadata diffkv reads.
_NATIVE_FIELDS = ("block_table", "query_start_loc", "seq_lens", "causal")


@dataclasses.dataclass(frozen=True, slots=True)
class VllmPagedMetadata:
    """vLLM's native metadata of one cache group (``native``, e.g. FlashAttentionMetadata) and
    what diffkv's paged attention reads from it.

    block_table int32 ``[num_reqs, cols]`` (kernel block ids, vLLM's persistent input table);
    query_start_loc int32 ``[num_reqs + 1]``; seq_lens int32 ``[num_reqs]``; causal bool;
    ``*_cpu``: host copies of the same values (the same tensors on a CPU device), taken once per
    batch for the kernels' bounds checks.
    """

    native: Any
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    causal: bool
    block_table_cpu: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor


def _wrap_native_metadata(
    native: Any, query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor
) -> VllmPagedMetadata:
    op = "build_diffusion_kv_attn_metadata()"
    missing = [name for name in _NATIVE_FIELDS if not hasattr(native, name)]
    if missing:
        raise TypeError(
            f"{op}: native attention metadata must have {list(_NATIVE_FIELDS)} (vLLM FlashAttention "
            f"metadata) for diffkv, got {type(native).__name__} without {missing}"
        )
    query_start_loc = native.query_start_loc
    seq_lens = native.seq_lens
    if tuple(query_start_loc.shape) != tuple(query_start_loc_cpu.shape) or tuple(seq_lens.shape) != tuple(
        seq_lens_cpu.shape
    ):
        raise ValueError(
            f"{op}: native metadata query_start_loc/seq_lens must have the batch's shapes "
            f"{tuple(query_start_loc_cpu.shape)}/{tuple(seq_lens_cpu.shape)}, got "
            f"{tuple(query_start_loc.shape)}/{tuple(seq_lens.shape)}"
        )
    block_table = native.block_table
    return VllmPagedMetadata(
        native=native,
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        causal=bool(native.causal),
        block_table_cpu=block_table.cpu(),
        query_start_loc_cpu=query_start_loc_cpu.to(device="cpu", dtype=torch.int32).contiguous(),
        seq_lens_cpu=seq_lens_cpu.to(device="cpu", dtype=torch.int32).contiguous(),
    )


class DiffKVOmniPlatform:
    """Omni's ``current_omni_platform`` as diffkv's adapter sees it: every attribute is the
    platform's, except that ``build_diffusion_kv_attn_metadata`` returns, per layer, a
    ``VllmPagedMetadata`` around the platform's native metadata (layers sharing one native
    object share one wrapper)."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def build_diffusion_kv_attn_metadata(self, **kwargs: Any) -> dict[str, VllmPagedMetadata]:
        native_by_layer = self._platform.build_diffusion_kv_attn_metadata(**kwargs)
        wrapped: dict[int, VllmPagedMetadata] = {}
        out: dict[str, VllmPagedMetadata] = {}
        for name, native in native_by_layer.items():
            wrapper = wrapped.get(id(native))
            if wrapper is None:
                wrapper = _wrap_native_metadata(native, kwargs["query_start_loc_cpu"], kwargs["seq_lens_cpu"])
                wrapped[id(native)] = wrapper
            out[name] = wrapper
        return out

    def __repr__(self) -> str:
        return f"DiffKVOmniPlatform({self._platform!r})"


# ------------------------------------------------------------------------------------------------
# The registered backend
# ------------------------------------------------------------------------------------------------


class _DiffKVPagedMixin:
    """``forward_paged`` on diffkv's hot path, mixed in front of the dense impl it stands in for.

    Reads the layer's vLLM cache through ``kv_cache_view`` (cached per bound tensor) and the
    batch's ``VllmPagedMetadata``; one call into C writes K/V and attends."""

    _diffkv_kv_cache_layout: str | None = None
    _diffkv_view_source: torch.Tensor | None = None
    _diffkv_view: torch.Tensor | None = None

    def forward_paged(self, paged_kv_context: Any) -> torch.Tensor:
        """Runs one layer from a ``DiffusionPagedAttentionContext``: writes ``key_write`` /
        ``value_write`` ``[N, Hkv, D]`` into the layer's vLLM cache at ``slot_mapping``, attends
        from ``query`` ``[N, H, D]`` over each row's ``[0, seq_len)`` keys in the layer's mask mode
        and returns the output in the caller's layout (padded rows are zeros)."""
        return run_forward_paged(
            paged_kv_context, cache_view=self._diffkv_cache_view, check_metadata=_require_vllm_metadata
        )

    def _diffkv_cache_view(self, layer: Any, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's per-layer cache as diffkv's (2, nb, bs, Hkv, D) view, cached per cache tensor."""
        if kv_cache is not self._diffkv_view_source:
            self._diffkv_view = kv_cache_view(
                kv_cache, int(layer.num_kv_heads), int(layer.head_size), layout=self._diffkv_kv_cache_layout
            )
            self._diffkv_view_source = kv_cache
        return self._diffkv_view


def _require_vllm_metadata(metadata: Any) -> None:
    if not isinstance(metadata, VllmPagedMetadata):
        raise TypeError(
            f"DiffKVOmniAttentionImpl.forward_paged(): native_metadata must be a VllmPagedMetadata "
            f"(built by diffkv's adapter after diffkv.integrations.vllm_omni.install()), got "
            f"{type(metadata).__name__}"
        )


def _build_backend(dense_backend: type, kv_cache_layout: str | None) -> type:
    """``DiffKVOmniAttentionBackend``: a ``DiffKVAttentionBackend`` that keeps ``dense_backend``'s
    name, capabilities and dense impl and serves ``forward_paged`` with diffkv."""
    dense_impl = dense_backend.get_impl_cls()
    impl_cls = type(
        "DiffKVOmniAttentionImpl",
        (_DiffKVPagedMixin, dense_impl),
        {
            "__module__": __name__,
            "__doc__": f"{dense_impl.__qualname__} with diffkv's forward_paged.",
            "_diffkv_kv_cache_layout": kv_cache_layout,
        },
    )

    def get_impl_cls() -> type:
        return impl_cls

    return type(
        "DiffKVOmniAttentionBackend",
        (dense_backend, DiffKVAttentionBackend),
        {
            "__module__": __name__,
            "__doc__": f"diffkv's paged path over {dense_backend.__qualname__}'s dense path.",
            "supports_paged_kv": True,
            "supports_piecewise_spans": True,
            "forward_includes_kv_cache_update": False,
            "dense_backend": dense_backend,
            "get_impl_cls": staticmethod(get_impl_cls),
            "indexes_kv_by_block_stride": classmethod(lambda cls: True),
        },
    )


# ------------------------------------------------------------------------------------------------
# install / uninstall
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change made by ``install()``: ``target`` (a module, or a registry entry) ``name``
    went from ``old`` to ``new``; ``undo`` restores it."""

    target: str
    name: str
    old: Any
    new: Any
    undo: Callable[[], None] = dataclasses.field(repr=False, compare=False)


_MISSING = object()
_lock = threading.Lock()
_active: Installation | None = None


class Installation:
    """What ``install()`` changed (``patches``, in order) and the registered backend class."""

    def __init__(self, patches: tuple[Patch, ...], backend: type, on_undo: Callable[[], None]) -> None:
        self.patches = patches
        self.backend = backend
        self._on_undo = on_undo
        self._uninstalled = False

    @property
    def active(self) -> bool:
        return not self._uninstalled

    def uninstall(self) -> None:
        """Restores every patch in reverse order.  Calling it again is harmless."""
        global _active
        with _lock:
            if self._uninstalled:
                return
            for patch in reversed(self.patches):
                patch.undo()
            self._on_undo()
            self._uninstalled = True
            if _active is self:
                _active = None

    def summary(self) -> dict[str, list[str]]:
        """``{target: [patched names]}``, in patch order."""
        out: dict[str, list[str]] = {}
        for patch in self.patches:
            out.setdefault(patch.target, []).append(patch.name)
        return out

    def __repr__(self) -> str:
        state = "active" if self.active else "uninstalled"
        return f"Installation({state}, {len(self.patches)} patches, backend={self.backend.__qualname__})"


def installed() -> Installation | None:
    """The active installation, or None."""
    return _active


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"diffkv.integrations.vllm_omni.install() needs vLLM-Omni: cannot import {name!r} ({exc}). "
            "Install vllm-omni (with its vLLM) in this environment, or use diffkv standalone "
            "(diffkv.DiffusionPagedAttentionAdapter with diffkv.BlockTables, diffkv.allocate_kv_caches)."
        ) from exc


def _require(module: Any, name: str) -> Any:
    value = getattr(module, name, _MISSING)
    if value is _MISSING:
        raise ImportError(
            f"diffkv.integrations.vllm_omni.install(): {module.__name__} has no {name!r}; this vLLM-Omni "
            "version does not match the diffusion paged-KV contract diffkv installs into"
        )
    return value


def _set_attr(module: Any, name: str, new: Any) -> Patch:
    old = getattr(module, name, _MISSING)
    setattr(module, name, new)

    def undo() -> None:
        if old is _MISSING:
            delattr(module, name)
        else:
            setattr(module, name, old)

    return Patch(module.__name__, name, None if old is _MISSING else old, new, undo)


def _clear_selector_cache() -> None:
    selector = sys.modules.get(_SELECTOR_MODULE)
    cached = getattr(selector, "_cached_get_backend_cls", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _layer_adapter_class(vllm_layer_base: Any) -> type:
    """diffkv's layer adapter, also a subclass of vLLM's ``AttentionLayerBase`` when given."""
    base = _adapter.DiffusionPagedAttentionLayerAdapter
    if not isinstance(vllm_layer_base, type) or issubclass(base, vllm_layer_base):
        return base
    return type(
        base.__name__,
        (base, vllm_layer_base),
        {"__module__": __name__, "__doc__": base.__doc__},
    )


def install(*, kv_cache_layout: str | None = None) -> Installation:
    """Installs diffkv into the running vLLM-Omni (see the module docstring for each change).

    kv_cache_layout: one of ``KV_CACHE_LAYOUTS`` when every layer's cache shape is ambiguous
    (``kv_cache_view``); None infers it per layer.  Returns the ``Installation``; RuntimeError
    when diffkv is already installed, ImportError when vLLM-Omni (or a module or attribute it must
    have) is missing — nothing is patched then.
    """
    global _active
    if kv_cache_layout is not None and kv_cache_layout not in KV_CACHE_LAYOUTS:
        raise ValueError(
            f"install(): kv_cache_layout must be one of {sorted(KV_CACHE_LAYOUTS)} or None, "
            f"got {kv_cache_layout!r}"
        )
    with _lock:
        if _active is not None:
            raise RuntimeError(
                "install(): diffkv is already installed into vLLM-Omni; call uninstall() first"
            )
        _import("vllm_omni")
        registry = _import(_REGISTRY_MODULE)
        omni_adapter = _import(_ADAPTER_MODULE)
        backend_enum = _require(registry, "DiffusionAttentionBackendEnum")
        register = _require(registry, "register_diffusion_backend")
        flash_attn = _require(backend_enum, "FLASH_ATTN")
        collaborators = {name: _require(omni_adapter, name) for name in _COLLABORATORS}
        platform = _require(omni_adapter, "current_omni_platform")
        originals = {name: getattr(omni_adapter, name, _MISSING) for name in _ADAPTER_CLASSES}

        # Everything that can fail is resolved before the first patch.
        dense_backend = flash_attn.get_class()
        backend = _build_backend(dense_backend, kv_cache_layout)
        replacements = {name: getattr(_adapter, name) for name in _ADAPTER_CLASSES}
        replacements["DiffusionPagedAttentionLayerAdapter"] = _layer_adapter_class(
            getattr(omni_adapter, "AttentionLayerBase", None)
        )
        backend_path = f"{__name__}.DiffKVOmniAttentionBackend"

        patches: list[Patch] = []
        try:
            patches.append(_set_attr(sys.modules[__name__], "DiffKVOmniAttentionBackend", backend))
            was_overridden = flash_attn.is_overridden()
            previous_path = flash_attn.get_path()
            register(flash_attn, backend_path)

            def undo_registry() -> None:
                if was_overridden:
                    register(flash_attn, previous_path)
                else:
                    flash_attn.clear_override()

            patches.append(
                Patch(
                    f"{registry.__name__}.{backend_enum.__name__}",
                    "FLASH_ATTN",
                    previous_path,
                    backend_path,
                    undo_registry,
                )
            )
            for name, value in collaborators.items():
                patches.append(_set_attr(_adapter, name, value))
            patches.append(_set_attr(_adapter, "current_omni_platform", DiffKVOmniPlatform(platform)))
            for module_name, module in list(sys.modules.items()):
                if module is None or not (module_name == "vllm_omni" or module_name.startswith("vllm_omni.")):
                    continue
                for name, original in originals.items():
                    if original is _MISSING:
                        continue
                    if module is omni_adapter or getattr(module, name, _MISSING) is original:
                        patches.append(_set_attr(module, name, replacements[name]))
        except BaseException:
            for patch in reversed(patches):
                patch.undo()
            raise
        _clear_selector_cache()
        _active = Installation(tuple(patches), backend, _clear_selector_cache)
        return _active
