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
- ``VllmPagedMetadata`` / ``vllm_paged_metadata(native)`` / ``unservable_reason(native)``:
  what diffkv reads from vLLM's native (FlashAttention) metadata, derived beside it once per
  activation and metadata object, or why it cannot be.

What ``install()`` leaves alone: the platform and what its metadata builders return (the
objects ``prepare_batch`` stores and contexts carry are the builder's own), vLLM-Omni's own
classes and functions (its ``FlashAttentionImpl.forward_paged`` still runs a context diffkv's
adapter made), and every layer diffkv cannot serve: a layer whose native metadata is not vLLM
FlashAttention's, or whose query diffkv's kernels do not take (``unservable_query``: a head size
the device's kernels lack, e.g. 96 on CUDA), runs vLLM-Omni's own ``forward_paged``
(``Installation.layer_choices`` and a log line say so), and a layer of another backend never
reaches diffkv.

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
   ``override_paged_kv_adapter``, ``cdiv``, ``current_omni_platform``).  diffkv keeps its own
   ``build_paged_piecewise_plan`` (the same plans; its key limits run every mask mode in one
   launch).
3. The adapter classes (``DiffusionPagedAttentionAdapter``, ``...LayerAdapter``, ``...Row``,
   ...) in ``vllm_omni.diffusion.diffusion_kv.paged_attention_adapter`` and in every loaded
   ``vllm_omni`` module that imported them by name are replaced by diffkv's; the layer adapter
   becomes a subclass that is also vLLM's ``AttentionLayerBase`` (vLLM's KV cache
   initialisation finds layers by that type).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import adapter as _adapter
from ..backends.diffkv import (
    FP8_CACHE_DTYPES,
    DiffKVAttentionBackend,
    run_forward_paged,
    run_prepared_call,
    supported_head_sizes,
)

_log = logging.getLogger(__name__)

__all__ = [
    "KV_CACHE_LAYOUTS",
    "SERVED",
    "Installation",
    "Patch",
    "VllmPagedMetadata",
    "install",
    "installed",
    "kv_cache_view",
    "unservable_query",
    "unservable_reason",
    "vllm_paged_metadata",
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
    "current_omni_platform",
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
    ``block_size == num_kv_heads``).  A uint8 cache -- vLLM's storage of a
    ``cache_dtype="fp8"`` cache -- comes back as its float8_e4m3fn view (the same bytes).
    Raises TypeError for a non-tensor, ValueError for a shape that no layout (or not the named
    one) matches, or an ambiguous shape without ``layout``.
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
    if kv_cache.dtype == torch.uint8:
        kv_cache = kv_cache.view(torch.float8_e4m3fn)
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
    """What diffkv's paged attention reads from vLLM's native metadata of one cache group
    (``native``, e.g. FlashAttentionMetadata), derived beside it: the native object itself is
    left as the platform's builder made it.

    block_table int32 ``[num_reqs, cols]`` (kernel block ids, vLLM's persistent input table);
    query_start_loc int32 ``[num_reqs + 1]``; seq_lens int32 ``[num_reqs]``; causal bool;
    ``*_cpu``: host copies of the same values, taken in one device-to-host copy, for the
    kernels' bounds checks.
    """

    native: Any
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    causal: bool
    block_table_cpu: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor


def unservable_reason(native: Any) -> str | None:
    """Why diffkv cannot serve a layer whose native metadata is ``native`` (it is not vLLM
    FlashAttention's: a field is missing or not the int32 tables diffkv reads), or None when
    it can.  Cannot fail."""
    missing = [name for name in _NATIVE_FIELDS if not hasattr(native, name)]
    if missing:
        return (
            f"native metadata {type(native).__name__} is not vLLM FlashAttention's (no {', '.join(missing)})"
        )
    tables = (("block_table", 2), ("query_start_loc", 1), ("seq_lens", 1))
    for name, ndim in tables:
        value = getattr(native, name)
        if not isinstance(value, torch.Tensor) or value.dim() != ndim or value.dtype != torch.int32:
            return f"native metadata {type(native).__name__}.{name} is not a {ndim}-D int32 tensor"
    block_table, query_start_loc, seq_lens = native.block_table, native.query_start_loc, native.seq_lens
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1 or block_table.shape[0] < seq_lens.shape[0]:
        return (
            f"native metadata {type(native).__name__} has {seq_lens.shape[0]} seq_lens, "
            f"{query_start_loc.shape[0]} query_start_loc and {block_table.shape[0]} block_table rows"
        )
    if not (block_table.device == query_start_loc.device == seq_lens.device):
        return f"native metadata {type(native).__name__}'s tables are on different devices"
    if type(native.causal) is not bool:
        return f"native metadata {type(native).__name__}.causal is not a bool"
    return None


_head_sizes_cache: dict[tuple[str, torch.dtype, bool], frozenset[int]] = {}


def unservable_query(query: Any, fp8_cache: bool = False) -> str | None:
    """Why diffkv's kernels cannot take a layer whose query is ``query`` ``[N, H, D]`` over its
    cache (``fp8_cache``: a float8_e4m3fn one) -- the query's device, dtype or head size D
    (``supported_head_sizes``) --, or None when they can (also for anything that is not a
    tensor: the layer call says what is wrong with it).  Cannot fail."""
    if not isinstance(query, torch.Tensor) or query.dim() < 1:
        return None
    device_type = query.device.type
    if device_type not in ("cpu", "cuda"):
        return f"diffkv runs on CPU and CUDA tensors, not {device_type}"
    key = (device_type, query.dtype, fp8_cache)
    sizes = _head_sizes_cache.get(key)
    if sizes is None:
        try:
            sizes = frozenset(supported_head_sizes(device_type, query.dtype, fp8_cache=fp8_cache))
        except ValueError:
            return f"diffkv's kernels do not take {query.dtype} queries"
        _head_sizes_cache[key] = sizes
    head_size = int(query.shape[-1])
    if head_size not in sizes:
        over = " over a float8_e4m3fn cache" if fp8_cache else ""
        return (
            f"head size {head_size} is not among diffkv's {str(query.dtype).removeprefix('torch.')} "
            f"kernels{over} on {device_type} "
            f"({sorted(sizes) if len(sizes) <= 16 else 'up to ' + str(max(sizes))})"
        )
    return None


def vllm_paged_metadata(native: Any) -> VllmPagedMetadata | None:
    """diffkv's view of vLLM's native metadata (``VllmPagedMetadata``), or None when
    ``unservable_reason(native)`` names a reason.  Copies the three tables to the host in one
    transfer (a device synchronisation): diffkv's adapter makes it once per activation and
    native object, and the layers of a cache group share it."""
    if unservable_reason(native) is not None:
        return None
    block_table, query_start_loc, seq_lens = native.block_table, native.query_start_loc, native.seq_lens
    host = torch.cat((block_table.reshape(-1), query_start_loc, seq_lens)).cpu()
    n_table, n_starts = block_table.numel(), query_start_loc.shape[0]
    return VllmPagedMetadata(
        native=native,
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        causal=native.causal,
        block_table_cpu=host[:n_table].view(block_table.shape),
        query_start_loc_cpu=host[n_table : n_table + n_starts],
        seq_lens_cpu=host[n_table + n_starts :],
    )


# ------------------------------------------------------------------------------------------------
# The registered backend
# ------------------------------------------------------------------------------------------------


class _VllmCallHooks:
    """How diffkv reads a layer's vLLM inputs (``diffkv.adapter.paged_call_hooks`` while
    installed; the impl's own calls use it too): the cache through ``kv_cache_view`` (cached
    per bound tensor), the native metadata through ``vllm_paged_metadata``."""

    def __init__(self, kv_cache_layout: str | None) -> None:
        self.kv_cache_layout = kv_cache_layout
        # per layer: (layer, the cache it had bound, the view) -- the cache the layer holds anyway
        self._views: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}

    def _diffkv_cache_view(self, layer: Any, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's per-layer cache as diffkv's (2, nb, bs, Hkv, D) view."""
        cached = self._views.get(id(layer))
        if cached is None or cached[0] is not layer or cached[1] is not kv_cache:
            view = kv_cache_view(
                kv_cache, int(layer.num_kv_heads), int(layer.head_size), layout=self.kv_cache_layout
            )
            cached = (layer, kv_cache, view)
            self._views[id(layer)] = cached
        return cached[2]

    @staticmethod
    def _diffkv_paged_metadata(native_metadata: Any) -> VllmPagedMetadata | None:
        return vllm_paged_metadata(native_metadata)


class _DiffKVPagedMixin:
    """``forward_paged`` on diffkv's hot path, mixed in front of the impl it stands in for
    (``_diffkv_native_impl``, vLLM-Omni's FlashAttention impl), which keeps the dense path and
    gets back every layer diffkv cannot serve."""

    _diffkv_hooks: _VllmCallHooks = _VllmCallHooks(None)
    _diffkv_native_impl: type = object

    def forward_paged(self, paged_kv_context: Any) -> torch.Tensor:
        """Runs one layer from a ``DiffusionPagedAttentionContext``: writes ``key_write`` /
        ``value_write`` ``[N, Hkv, D]`` into the layer's vLLM cache at ``slot_mapping``, attends
        from the caller's query ``[N, H, D]`` over each row's ``[0, seq_len)`` keys in the
        layer's mask mode and returns the output in the caller's layout (padded rows are
        zeros).  The call diffkv's adapter described when it made the context runs as is; any
        other context is read here (its metadata's tables copied to the host once per call).
        A layer diffkv cannot serve -- its query's device, dtype or head size
        (``unservable_query``: e.g. head size 88 on CUDA, or 96 over an fp8 cache there) or its
        native metadata
        (``unservable_reason``) -- is handed to the native impl's own ``forward_paged``, as
        vLLM-Omni runs it without diffkv; ``Installation.layer_choices`` and a log line say
        which way each layer went."""
        fp8 = getattr(self, "kv_cache_dtype", "auto") in FP8_CACHE_DTYPES
        reason = unservable_query(getattr(paged_kv_context, "query", None), fp8)
        if reason is None:
            out = run_prepared_call(paged_kv_context)
            if out is not None:
                _record_choice(paged_kv_context, None)
                return out
        native = getattr(paged_kv_context, "native_metadata", None)
        paged = None if reason is not None else vllm_paged_metadata(native)
        if paged is None:
            reason = reason or unservable_reason(native)
            _record_choice(paged_kv_context, f"{self._diffkv_native_impl.__qualname__}: {reason}")
            native_forward = getattr(super(), "forward_paged", None)
            if native_forward is None:
                raise NotImplementedError(
                    f"DiffKVOmniAttentionImpl.forward_paged(): diffkv cannot serve this layer "
                    f"({reason}) and {self._diffkv_native_impl.__qualname__} has no forward_paged"
                )
            return native_forward(paged_kv_context)
        _record_choice(paged_kv_context, None)
        hooks = self._diffkv_hooks
        return run_forward_paged(paged_kv_context, cache_view=hooks._diffkv_cache_view, metadata=paged)


SERVED = "diffkv"


def _record_choice(paged_kv_context: Any, handed_back: str | None) -> None:
    """Notes in the active installation's ``layer_choices`` who ran a layer's forward_paged
    (``SERVED``, or the native impl and why), logging each layer's first choice and changes."""
    installation = _active
    if installation is None:
        return
    name = getattr(getattr(paged_kv_context, "layer", None), "layer_name", None)
    choice = SERVED if handed_back is None else f"handed back to {handed_back}"
    if installation.layer_choices.get(name) != choice:
        installation.layer_choices[name] = choice
        if handed_back is None:
            _log.info("diffkv serves paged attention layer %r", name)
        else:
            _log.info("diffkv hands paged attention layer %r back to %s", name, handed_back)


def _build_backend(dense_backend: type, hooks: _VllmCallHooks) -> type:
    """``DiffKVOmniAttentionBackend``: a ``DiffKVAttentionBackend`` that keeps ``dense_backend``'s
    name, capabilities and dense impl and serves ``forward_paged`` with diffkv."""
    dense_impl = dense_backend.get_impl_cls()
    impl_cls = type(
        "DiffKVOmniAttentionImpl",
        (_DiffKVPagedMixin, dense_impl),
        {
            "__module__": __name__,
            "__doc__": f"{dense_impl.__qualname__} with diffkv's forward_paged.",
            "_diffkv_hooks": hooks,
            "_diffkv_native_impl": dense_impl,
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
    """What ``install()`` changed (``patches``, in order), the registered backend class, and
    ``layer_choices``: for each layer whose ``forward_paged`` ran through the registered
    backend, who ran its latest call -- ``SERVED`` ("diffkv") or "handed back to <native impl>:
    <why>" (its native metadata is not vLLM FlashAttention's); each first choice and each
    change is also logged (logger ``diffkv.integrations.vllm_omni``, INFO)."""

    def __init__(self, patches: tuple[Patch, ...], backend: type, on_undo: Callable[[], None]) -> None:
        self.patches = patches
        self.backend = backend
        self.layer_choices: dict[str | None, str] = {}
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
        originals = {name: getattr(omni_adapter, name, _MISSING) for name in _ADAPTER_CLASSES}

        # Everything that can fail is resolved before the first patch.
        dense_backend = flash_attn.get_class()
        hooks = _VllmCallHooks(kv_cache_layout)
        backend = _build_backend(dense_backend, hooks)
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
            patches.append(_set_attr(_adapter, "paged_call_hooks", hooks))
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
