"""The diffusion attention backend ABC and its metadata dataclasses (vLLM-Omni's
``vllm_omni/diffusion/attention/backends/abstract.py`` contract, written for diffkv).

Entry points: ``AttentionBackend`` (capability flags and class-level factory methods),
``AttentionImpl`` (per-platform ``forward`` dispatch and the opt-in ``forward_paged``), and the
per-forward metadata ``AttentionMetadata`` with ``QueryRange``, ``VideoTokenSpan``,
``VideoTokenLayout`` and ``PackedPaddingMetadata``.  Names, fields, defaults, flags and
messages follow vLLM-Omni's backend; the platform is diffkv's (``diffkv.platform.current_omni_platform``),
looked up in this module at call time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import torch

from ..platform import current_omni_platform

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "PackedPaddingMetadata",
    "QueryRange",
    "VideoTokenLayout",
    "VideoTokenSpan",
]


class AttentionBackend(ABC):
    """A diffusion attention backend: capability flags plus the classes that implement it."""

    accept_output_buffer: bool = False
    supports_piecewise_spans: bool = False
    # Opt-in for the Worker-prepared paged-KV context (forward_paged); kept on the class so a
    # paged request never falls back to dense attention on a backend that cannot page.
    supports_paged_kv: bool = False
    # The backend can express a valid contiguous K/V prefix by slicing instead of masking.
    supports_prefix_kv_slicing: bool = False

    @classmethod
    def supports_packed_mask_free(cls) -> bool:
        """Whether a packed ``[real, pad]`` layout may run without an ``attn_mask`` (given
        ``AttentionMetadata.packed_padding`` and packed cu_seqlens)."""
        return False

    @classmethod
    def supports_multi_doc_packed_varlen(cls) -> bool:
        """Whether packed cu_seqlens in ``AttentionMetadata.extra`` are honoured as a true
        block-diagonal plan, so several real documents may share one forward."""
        return False

    # Platform names this backend runs on; None means any platform.
    supported_platforms: tuple[str, ...] | None = None

    @classmethod
    def validate_available(cls) -> None:
        """Raise when an optional dependency of the backend is missing (checked at platform
        resolution, before the model is built)."""
        return None

    @classmethod
    def supports_attention_mask(cls, attention_spec: object | None = None) -> bool:
        """Whether a nontrivial ``attn_mask`` can be consumed (``attention_spec``: the resolved
        per-role config when the backend was picked explicitly)."""
        del attention_spec
        return False

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_builder_cls():
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_supported_head_sizes() -> list[int]:
        """The head sizes this backend has kernels for (empty: any)."""
        raise NotImplementedError

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        supported = cls.get_supported_head_sizes()
        return (not supported) or head_size in supported

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        """Whether the backend reads K/V pages through the runtime block stride (so a
        block-outermost physical cache layout is safe).  Conservatively False."""
        return False


@dataclass(frozen=True, slots=True)
class QueryRange:
    """A local query slice ``[local_start, local_end)`` that starts at global position
    ``global_start``."""

    local_start: int
    local_end: int
    global_start: int


@dataclass(frozen=True, slots=True)
class VideoTokenSpan:
    """One physical video-grid slice (``latent_grid`` = (t, h, w)) in packed document 0."""

    start: int
    latent_grid: tuple[int, int, int]
    role: Literal["reference", "target"]

    @property
    def length(self) -> int:
        t, h, w = self.latent_grid
        return t * h * w


@dataclass(frozen=True, slots=True)
class VideoTokenLayout:
    """Video-grid slices of a packed sequence ``[prefix | t*h*w video rows | padding]``.

    Either the one-tail form (``prefix_len``, ``latent_grid``) or the multi-span form
    (``used_len``, ``video_spans``).  Publishing it asserts that any ``attn_mask`` masks only
    the trailing padding.  Plain ints: reading it never syncs the device.
    """

    prefix_len: int | None = None
    latent_grid: tuple[int, int, int] | None = None
    used_len: int | None = None
    video_spans: tuple[VideoTokenSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class PackedPaddingMetadata:
    """Mask-free description of a ``[real, pad]`` packing; ``cu_seqlens_q`` / ``cu_seqlens_k``
    are two-element ``[0, length]`` int32 tensors owned by the producer."""

    q_length: int
    kv_length: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor


@dataclass
class AttentionMetadata:
    """Per-forward attention metadata of a diffusion layer.

    ``attn_mask`` / ``joint_attn_mask``: optional masks; ``joint_query/key/value``: tensors
    joined to the front or rear (``joint_strategy``) of Q/K/V; ``extra``: opaque
    backend-specific keys (unknown keys are ignored by backends); ``full_attn_spans``: per
    sample, the global ``[start, end)`` spans with full attention (everything else causal);
    ``query_ranges``, ``video_layout``, ``packed_padding``: optional geometry.
    """

    attn_mask: torch.Tensor | None = None
    joint_attn_mask: torch.Tensor | None = None
    joint_query: torch.Tensor | None = None
    joint_key: torch.Tensor | None = None
    joint_value: torch.Tensor | None = None
    joint_strategy: str = "front"
    extra: dict[str, Any] = field(default_factory=dict)
    full_attn_spans: list[list[tuple[int, int]]] | None = None
    query_ranges: tuple[QueryRange, ...] | None = None
    video_layout: VideoTokenLayout | None = None
    packed_padding: PackedPaddingMetadata | None = None


T = TypeVar("T", bound=AttentionMetadata)


class AttentionImpl(ABC, Generic[T]):
    """One layer's attention implementation; ``forward`` dispatches on the platform."""

    # Quantized KV cache dtypes each platform ("cuda", "npu", ...) handles.
    _supported_kv_cache_dtypes: dict[str, set[str]] = {}

    @abstractmethod
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        softmax_scale: float,
        causal: bool = False,
        num_kv_heads: int | None = None,
        prefix: str = "",
        qkv_layout: str | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        **extra_impl_args,
    ) -> None:
        raise NotImplementedError

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str | None, platform_key: str) -> bool:
        if kv_cache_dtype is None:
            return True
        return kv_cache_dtype in cls._supported_kv_cache_dtypes.get(platform_key, set())

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: T | None = None,
    ) -> torch.Tensor:
        """Run the platform's forward; query/key/value in the layer's dense layout."""
        platform = current_omni_platform
        if platform.is_rocm():
            return self.forward_hip(query, key, value, attn_metadata)
        if platform.is_cuda():
            return self.forward_cuda(query, key, value, attn_metadata)
        if platform.is_npu():
            return self.forward_npu(query, key, value, attn_metadata)
        if platform.is_xpu():
            return self.forward_xpu(query, key, value, attn_metadata)
        if platform.is_musa():
            return self.forward_musa(query, key, value, attn_metadata)
        raise NotImplementedError(f"No forward implementation for platform: {platform}")

    def forward_paged(self, paged_kv_context: Any) -> torch.Tensor:
        """Run one Worker-prepared paged-KV attention call (a
        ``DiffusionPagedAttentionContext``).  Backends that set ``supports_paged_kv`` override
        this; the default refuses."""
        del paged_kv_context
        raise NotImplementedError(f"{type(self).__name__} does not support paged KV attention")

    def forward_cuda(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: T | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward_npu(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: T | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward_xpu(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: T | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward_hip(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: T | None = None,
    ) -> torch.Tensor:
        # HIP runs the CUDA path unless a backend overrides it.
        return self.forward_cuda(query, key, value, attn_metadata)

    def forward_musa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: T | None = None,
    ) -> torch.Tensor:
        # MUSA runs the CUDA path unless a backend overrides it.
        return self.forward_cuda(query, key, value, attn_metadata)
