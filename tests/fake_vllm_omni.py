"""Fakes shaped like the vLLM / vLLM-Omni objects vLLM-Omni's adapter reads, for the
tests of ``diffkv.integrations.vllm_omni`` on a machine without vLLM.

- vLLM side: ``FullAttentionSpec``, ``KVCacheGroupSpec``, ``KVCacheConfig``, ``VllmConfig``
  (model / cache / attention / parallel configs), ``set_current_vllm_config``,
  ``AttentionBackendEnum``, ``AttentionType``, ``get_attn_backend`` selecting the native
  ``FlashAttentionBackend`` (impl with ``forward``, ``do_kv_cache_update``,
  ``vllm_flash_attn_version``), ``FlashAttentionMetadata`` (vLLM's fields), ``BlockTables``
  (kernel_block_sizes, staged writes, persistent input tables and slot mappings, vLLM's gather
  and slot rules, written here with plain Python loops), ``AttentionLayerBase``.
- vLLM-Omni side, as modules for ``sys.modules`` (``fake_vllm_omni_modules()``): the package
  tree, the diffusion backend registry (``DiffusionAttentionBackendEnum``,
  ``register_diffusion_backend``), the selector's cached backend lookup, Omni's dense
  ``FlashAttentionBackend`` (``supports_paged_kv``), the forward context
  (``override_paged_kv_adapter``), the platform (``build_diffusion_kv_attn_metadata`` building
  FlashAttention metadata per cache group), the adapter module (vLLM-Omni's adapter's module attributes and
  class names) and the model-runner module that imports those classes by name.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np
import torch

PAD_SLOT_ID = -1

# ------------------------------------------------------------------------------------------------
# vLLM
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    """vllm.v1.kv_cache_interface.FullAttentionSpec (the fields the adapter reads)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int | None = None
    non_causal: bool = False

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)


@dataclasses.dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: FullAttentionSpec


@dataclasses.dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[Any]
    kv_cache_groups: list[KVCacheGroupSpec]


@dataclasses.dataclass
class ModelConfig:
    dtype: torch.dtype
    max_model_len: int = 64


@dataclasses.dataclass
class CacheConfig:
    block_size: int
    cache_dtype: str = "auto"


@dataclasses.dataclass
class AttentionConfig:
    backend: Any = None
    backend_per_kind: dict = dataclasses.field(default_factory=dict)
    use_non_causal: bool = False


@dataclasses.dataclass
class ParallelConfig:
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1


@dataclasses.dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    attention_config: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)


_current_vllm_config: list[Any] = []


@contextmanager
def set_current_vllm_config(vllm_config: Any) -> Iterator[None]:
    """vllm.config.set_current_vllm_config: a stack of current configs."""
    _current_vllm_config.append(vllm_config)
    try:
        yield
    finally:
        _current_vllm_config.pop()


def get_current_vllm_config() -> Any:
    return _current_vllm_config[-1] if _current_vllm_config else None


class AttentionBackendEnum(enum.Enum):
    """vllm.v1.attention.backends.registry.AttentionBackendEnum (the member the adapter asks for)."""

    FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
    FLEX_ATTENTION = "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend"


class AttentionType:
    DECODER = "decoder"


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class AttentionLayerBase(ABC):
    """vllm.model_executor.layers.attention_layer_base.AttentionLayerBase."""

    @abstractmethod
    def get_attn_backend(self) -> Any: ...

    @abstractmethod
    def get_kv_cache_spec(self, vllm_config: Any) -> Any: ...


class VllmFlashAttentionImpl:
    """vLLM's native FlashAttentionImpl: diffkv's hot path must never call its forward."""

    vllm_flash_attn_version = 3
    forward_calls = 0

    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype,
        logits_soft_cap,
        attn_type,
        kv_sharing_target_layer_name,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        VllmFlashAttentionImpl.forward_calls += 1
        raise AssertionError("vLLM's native FlashAttention forward must not run under diffkv")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        VllmFlashAttentionImpl.forward_calls += 1
        raise AssertionError("vLLM's reshape_and_cache_flash must not run under diffkv")


class VllmFlashAttentionBackend:
    """vLLM's native FlashAttentionBackend (v1)."""

    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type:
        return VllmFlashAttentionImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


backend_selections: list[dict] = []


def get_attn_backend(*, head_size, dtype, kv_cache_dtype, attn_type, num_heads) -> type:
    """vllm.v1.attention.selector.get_attn_backend: needs the config the adapter installed."""
    config = get_current_vllm_config()
    if config is None:
        raise RuntimeError("get_attn_backend() outside set_current_vllm_config")
    backend_selections.append(
        {
            "head_size": head_size,
            "dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype,
            "attn_type": attn_type,
            "num_heads": num_heads,
            "backend": config.attention_config.backend,
            "prefill_context_parallel_size": config.parallel_config.prefill_context_parallel_size,
        }
    )
    if config.attention_config.backend is not AttentionBackendEnum.FLASH_ATTN:
        raise ValueError(f"unexpected backend request {config.attention_config.backend!r}")
    return VllmFlashAttentionBackend


@dataclasses.dataclass
class FlashAttentionMetadata:
    """vllm.v1.attention.backends.flash_attn.FlashAttentionMetadata."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    use_cascade: bool = False
    common_prefix_len: int = 0
    cu_prefix_query_lens: torch.Tensor | None = None
    prefix_kv_lens: torch.Tensor | None = None
    suffix_kv_lens: torch.Tensor | None = None
    max_dcp_context_kv_len: int | None = None
    dcp_context_kv_lens: torch.Tensor | None = None
    scheduler_metadata: torch.Tensor | None = None
    prefix_scheduler_metadata: torch.Tensor | None = None
    max_num_splits: int = 0
    causal: bool = True


class _UvaCounts:
    """num_blocks of vLLM's BlockTables: a host numpy mirror (``np``) and a device tensor."""

    def __init__(self, num_groups: int, max_num_reqs: int, device: torch.device) -> None:
        self.np = np.zeros((num_groups, max_num_reqs), dtype=np.int32)
        self.gpu = torch.zeros((num_groups, max_num_reqs), dtype=torch.int32, device=device)


class BlockTables:
    """vllm.v1.worker.gpu.block_table.BlockTables: persistent per-group kernel-block tables with
    staged writes, persistent ``input_block_tables`` and ``slot_mappings`` buffers."""

    def __init__(
        self,
        block_sizes,
        max_num_reqs,
        max_num_batched_tokens,
        max_num_blocks_per_group,
        device,
        kernel_block_sizes,
        cp_size=1,
        cp_rank=0,
        cp_interleave=1,
    ) -> None:
        self.block_sizes = list(block_sizes)
        self.kernel_block_sizes = list(kernel_block_sizes)
        self.blocks_per_kv_block = [
            b // k for b, k in zip(self.block_sizes, self.kernel_block_sizes, strict=True)
        ]
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = torch.device(device)
        self.cp_size, self.cp_rank, self.cp_interleave = cp_size, cp_rank, cp_interleave
        self.num_groups = len(self.block_sizes)
        cols = [m * k for m, k in zip(max_num_blocks_per_group, self.blocks_per_kv_block, strict=True)]
        self._staged = [np.zeros((max_num_reqs, c), dtype=np.int32) for c in cols]
        self.block_tables = [
            torch.zeros((max_num_reqs, c), dtype=torch.int32, device=self.device) for c in cols
        ]
        self.input_block_tables = [
            torch.zeros((max_num_reqs, c), dtype=torch.int32, device=self.device) for c in cols
        ]
        self.num_blocks = _UvaCounts(self.num_groups, max_num_reqs, self.device)
        self.slot_mappings = torch.full(
            (self.num_groups, max_num_batched_tokens), PAD_SLOT_ID, dtype=torch.int64, device=self.device
        )
        self.calls: list[str] = []

    def append_block_ids(self, req_index, new_block_ids, overwrite) -> None:
        for g, ids in enumerate(new_block_ids):
            k = self.blocks_per_kv_block[g]
            kernel_ids = [b * k + j for b in ids for j in range(k)]
            start = 0 if overwrite else int(self.num_blocks.np[g, req_index])
            self._staged[g][req_index, start : start + len(kernel_ids)] = kernel_ids
            self.num_blocks.np[g, req_index] = start + len(kernel_ids)

    def apply_staged_writes(self) -> None:
        for g in range(self.num_groups):
            self.block_tables[g].copy_(torch.from_numpy(self._staged[g]))
        self.num_blocks.gpu.copy_(torch.from_numpy(self.num_blocks.np))

    def gather_block_tables(self, idx_mapping, num_reqs_padded):
        self.calls.append("gather_block_tables")
        rows = idx_mapping.tolist()
        for g in range(self.num_groups):
            for i, row in enumerate(rows):
                n = int(self.num_blocks.np[g, row])
                self.input_block_tables[g][i, :n] = self.block_tables[g][row, :n]
            self.input_block_tables[g][len(rows) : num_reqs_padded] = 0
        return tuple(t[:num_reqs_padded] for t in self.input_block_tables)

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded):
        self.calls.append("compute_slot_mappings")
        rows = idx_mapping.tolist()
        qsl = query_start_loc.tolist()
        pos = positions.tolist()
        c, rank, inter = self.cp_size, self.cp_rank, self.cp_interleave
        for g in range(self.num_groups):
            kbs = self.kernel_block_sizes[g]
            table = self.block_tables[g].cpu()
            out = [PAD_SLOT_ID] * self.max_num_batched_tokens
            for i, row in enumerate(rows):
                for t in range(qsl[i], qsl[i + 1]):
                    p = pos[t]
                    blk, off = p // (kbs * c), p % (kbs * c)
                    phys = int(table[row, blk])
                    if c == 1:
                        out[t] = phys * kbs + off
                    elif (off // inter) % c == rank:
                        out[t] = phys * kbs + (off // (inter * c)) * inter + off % inter
            self.slot_mappings[g].copy_(torch.tensor(out, dtype=torch.int64))
        return self.slot_mappings[:, :num_tokens_padded]


class AttentionGroup:
    """vllm.v1.worker.utils.AttentionGroup: layers built by one metadata builder."""

    def __init__(self, layer_names, reorder_batch_threshold=None) -> None:
        self.layer_names = list(layer_names)
        self.metadata_builders = [type("FlashAttentionMetadataBuilder", (), {})()]
        self.metadata_builders[0].reorder_batch_threshold = reorder_batch_threshold

    def get_metadata_builder(self, ubatch_id: int = 0):
        return self.metadata_builders[ubatch_id]


def build_slot_mappings_by_layer(slot_mappings, kv_cache_config):
    """vllm.v1.worker.gpu.attn_utils.build_slot_mappings_by_layer."""
    return {
        name: slot_mappings[g]
        for g, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    }


def get_dcp_local_seq_lens(seq_lens, dcp_size, dcp_rank, cp_kv_cache_interleave_size):
    raise AssertionError("context parallelism is not used by these tests")


# ------------------------------------------------------------------------------------------------
# vLLM-Omni
# ------------------------------------------------------------------------------------------------


class OmniAttentionBackend(ABC):
    """vllm_omni.diffusion.attention.backends.abstract.AttentionBackend (the flags Omni reads)."""

    accept_output_buffer = False
    supports_piecewise_spans = False
    supports_paged_kv = False

    @classmethod
    def supports_attention_mask(cls, attention_spec=None) -> bool:
        return False

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type: ...


class OmniFlashAttentionImpl:
    """Omni's dense FlashAttentionImpl: dense calls are recorded and run with torch SDPA."""

    dense_calls = 0

    def __init__(
        self,
        num_heads,
        head_size,
        softmax_scale,
        causal=False,
        num_kv_heads=None,
        prefix="",
        qkv_layout=None,
        backend_kwargs=None,
        role="self",
        **extra_impl_args,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.num_kv_heads = num_kv_heads
        self.prefix = prefix
        self.role = role
        self.extra_impl_args = extra_impl_args

    def forward(self, query, key, value, attn_metadata=None):
        """query/key/value ``[B, S, H, D]``."""
        OmniFlashAttentionImpl.dense_calls += 1
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            is_causal=self.causal,
            scale=self.softmax_scale,
        )
        return out.transpose(1, 2)

    paged_contexts: list = []

    def forward_paged(self, paged_kv_context):
        """Omni's own paged path (vLLM's FlashAttention in the real one): records the context and
        what it read, returns a value only it makes (the query, doubled, in the caller's layout)."""
        query = paged_kv_context.query
        OmniFlashAttentionImpl.paged_contexts.append((paged_kv_context, query))
        return paged_kv_context.restore_output(query * 2)


class OmniFlashAttentionBackend(OmniAttentionBackend):
    accept_output_buffer = True
    supports_piecewise_spans = True
    supports_paged_kv = True

    @classmethod
    def supports_attention_mask(cls, attention_spec=None) -> bool:
        return True

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type:
        return OmniFlashAttentionImpl


class OmniSDPABackend(OmniAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type:
        return OmniFlashAttentionImpl


def _resolve_obj_by_qualname(path: str) -> Any:
    module_name, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), name)


_FLASH_ATTN_PATH = "vllm_omni.diffusion.attention.backends.flash_attn.FlashAttentionBackend"
_SDPA_PATH = "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"


def _make_registry(module: ModuleType) -> None:
    overrides: dict = {}

    class DiffusionAttentionBackendEnum(enum.Enum):
        FLASH_ATTN = _FLASH_ATTN_PATH
        TORCH_SDPA = _SDPA_PATH

        def get_path(self, include_classname: bool = True) -> str:
            path = overrides.get(self, self.value)
            return path if include_classname else path.rsplit(".", 1)[0]

        def get_class(self) -> type:
            return _resolve_obj_by_qualname(self.get_path())

        def is_overridden(self) -> bool:
            return self in overrides

        def clear_override(self) -> None:
            overrides.pop(self, None)

    def register_diffusion_backend(backend, class_path=None):
        def decorator(cls):
            overrides[backend] = f"{cls.__module__}.{cls.__qualname__}"
            return cls

        if class_path is not None:
            overrides[backend] = class_path
            return lambda x: x
        return decorator

    module.DiffusionAttentionBackendEnum = DiffusionAttentionBackendEnum
    module.register_diffusion_backend = register_diffusion_backend
    module._DIFFUSION_ATTN_OVERRIDES = overrides


class FakeOmniPlatform:
    """vllm_omni.platforms.current_omni_platform (CUDA-like; the device is the test's)."""

    def __init__(self) -> None:
        self.builds: list[dict] = []

    def is_cuda(self) -> bool:
        return True

    def is_npu(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def get_diffusion_attn_backend_cls(self, selected_backend, head_size, allow_trtllm_default=True) -> str:
        registry = importlib.import_module("vllm_omni.diffusion.attention.backends.registry")
        enum_cls = registry.DiffusionAttentionBackendEnum
        if selected_backend is not None:
            return enum_cls[selected_backend.upper()].get_path()
        return enum_cls.FLASH_ATTN.get_path()

    def requires_diffusion_paged_kv_prewrite(self) -> bool:
        return False

    def get_diffusion_paged_kv_attn_backend(self, attn_backend, *, ulysses_degree):
        return attn_backend

    def build_diffusion_kv_attn_metadata(
        self,
        *,
        attn_groups,
        num_reqs,
        num_tokens,
        query_start_loc_gpu,
        query_start_loc_cpu,
        max_query_len,
        seq_lens,
        max_seq_len,
        block_tables,
        slot_mappings,
        kv_cache_config,
        seq_lens_cpu,
        seq_lens_cpu_upper_bound,
        dcp_local_seq_lens,
        positions,
        causal,
    ) -> dict[str, FlashAttentionMetadata]:
        """One FlashAttentionMetadata per cache group, shared by its layers (vLLM's builder)."""
        self.builds.append({"num_reqs": num_reqs, "num_tokens": num_tokens, "causal": causal})
        out = {}
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            metadata = FlashAttentionMetadata(
                num_actual_tokens=num_tokens,
                max_query_len=max_query_len,
                query_start_loc=query_start_loc_gpu,
                max_seq_len=max_seq_len,
                seq_lens=seq_lens,
                block_table=block_tables[g],
                slot_mapping=slot_mappings[g],
                scheduler_metadata=torch.zeros(4, dtype=torch.int32),
                causal=bool(causal[g] if isinstance(causal, dict) else causal),
            )
            for name in group.layer_names:
                out[name] = metadata
        return out


class ForwardContext:
    """vllm_omni.diffusion.forward_context.ForwardContext (the paged fields)."""

    def __init__(self) -> None:
        self.paged_kv_adapter = None
        self.paged_kv_runtime = None


def _make_forward_context(module: ModuleType) -> None:
    context = ForwardContext()

    @contextmanager
    def override_paged_kv_adapter(adapter):
        previous = context.paged_kv_adapter
        context.paged_kv_adapter = adapter
        try:
            yield
        finally:
            context.paged_kv_adapter = previous

    module.ForwardContext = ForwardContext
    module.override_paged_kv_adapter = override_paged_kv_adapter
    module.get_forward_context = lambda: context
    module.is_forward_context_available = lambda: True


class _OriginalClass:
    """Marker base of vLLM-Omni's adapter classes in the fake adapter module."""


def _original(name: str) -> type:
    return type(
        name, (_OriginalClass,), {"__module__": "vllm_omni.diffusion.diffusion_kv.paged_attention_adapter"}
    )


ADAPTER_CLASS_NAMES = (
    "DiffusionPagedAttentionAdapter",
    "DiffusionPagedAttentionContext",
    "DiffusionPagedAttentionLayerAdapter",
    "DiffusionPagedAttentionMetadata",
    "DiffusionPagedAttentionRow",
    "DiffusionPagedAttentionRowBinding",
    "DiffusionPagedAttentionRuntime",
    "PreparedDiffusionPagedAttentionBatch",
)

# Names the model runner backend binds from the adapter module (as the published one does).
RUNNER_IMPORTS = (
    "DiffusionPagedAttentionAdapter",
    "DiffusionPagedAttentionLayerAdapter",
    "DiffusionPagedAttentionMetadata",
    "DiffusionPagedAttentionRowBinding",
    "DiffusionPagedAttentionRuntime",
)


def _make_attention_layer(module: ModuleType) -> None:
    class Attention(torch.nn.Module):
        """The paged branch of Omni's ``Attention`` layer: backend selection for a marked paged
        layer, impl construction with Omni's keywords, and ``forward`` dispatch through the active
        adapter of the forward context."""

        def __init__(
            self,
            num_heads,
            head_size,
            causal,
            softmax_scale,
            num_kv_heads=None,
            prefix="",
            paged_kv_cache_role=None,
        ):
            super().__init__()
            selector = importlib.import_module("vllm_omni.diffusion.attention.selector")
            registry = importlib.import_module("vllm_omni.diffusion.attention.backends.registry")
            backend = selector._cached_get_backend_cls(None, head_size)
            if paged_kv_cache_role is not None and not backend.supports_paged_kv:
                backend = registry.DiffusionAttentionBackendEnum.FLASH_ATTN.get_class()
            self.prefix = prefix
            self.num_heads = num_heads
            self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
            self.head_size = head_size
            self.softmax_scale = softmax_scale
            self.paged_kv_cache_role = paged_kv_cache_role
            self.attn_backend = backend
            self.attention = backend.get_impl_cls()(
                num_heads=num_heads,
                head_size=head_size,
                softmax_scale=softmax_scale,
                causal=causal,
                num_kv_heads=num_kv_heads,
                qkv_layout=None,
                prefix=prefix,
                backend_kwargs=None,
                role="self",
                backend_explicit=False,
            )

        def forward(self, query, key, value, attn_metadata=None):
            forward_context = importlib.import_module("vllm_omni.diffusion.forward_context")
            adapter = forward_context.get_forward_context().paged_kv_adapter
            if adapter is not None and self.paged_kv_cache_role is not None:
                if not self.attn_backend.supports_paged_kv:
                    raise NotImplementedError(
                        "Diffusion paged KV requires an Omni backend with paged support; "
                        f"selected {self.attn_backend.get_name()}"
                    )
                context = adapter.prepare_layer_context(
                    self.prefix, query, key, value, omni_attn_metadata=attn_metadata
                )
                return self.attention.forward_paged(context)
            return self.attention.forward(query, key, value, attn_metadata)

    module.Attention = Attention


def fake_vllm_omni_modules() -> dict[str, ModuleType]:
    """A fresh fake ``vllm_omni`` package: ``{module name: module}`` for ``sys.modules``."""
    names = (
        "vllm_omni",
        "vllm_omni.platforms",
        "vllm_omni.diffusion",
        "vllm_omni.diffusion.forward_context",
        "vllm_omni.diffusion.attention",
        "vllm_omni.diffusion.attention.layer",
        "vllm_omni.diffusion.attention.selector",
        "vllm_omni.diffusion.attention.backends",
        "vllm_omni.diffusion.attention.backends.registry",
        "vllm_omni.diffusion.attention.backends.flash_attn",
        "vllm_omni.diffusion.attention.backends.sdpa",
        "vllm_omni.diffusion.diffusion_kv",
        "vllm_omni.diffusion.diffusion_kv.paged_attention_adapter",
        "vllm_omni.diffusion.diffusion_kv.model_runner_backend",
    )
    modules = {name: ModuleType(name) for name in names}
    for name, module in modules.items():
        module.__path__ = []  # packages and modules alike may hold submodules
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)

    platform = FakeOmniPlatform()
    modules["vllm_omni.platforms"].current_omni_platform = platform
    _make_forward_context(modules["vllm_omni.diffusion.forward_context"])
    _make_registry(modules["vllm_omni.diffusion.attention.backends.registry"])
    modules[
        "vllm_omni.diffusion.attention.backends.flash_attn"
    ].FlashAttentionBackend = OmniFlashAttentionBackend
    modules["vllm_omni.diffusion.attention.backends.flash_attn"].FlashAttentionImpl = OmniFlashAttentionImpl
    modules["vllm_omni.diffusion.attention.backends.sdpa"].SDPABackend = OmniSDPABackend

    @cache
    def _cached_get_backend_cls(backend_name, head_size, allow_trtllm_default=True):
        path = platform.get_diffusion_attn_backend_cls(backend_name, head_size, allow_trtllm_default)
        return _resolve_obj_by_qualname(path)

    modules["vllm_omni.diffusion.attention.selector"]._cached_get_backend_cls = _cached_get_backend_cls
    _make_attention_layer(modules["vllm_omni.diffusion.attention.layer"])

    adapter = modules["vllm_omni.diffusion.diffusion_kv.paged_attention_adapter"]
    collaborators = {
        "set_current_vllm_config": set_current_vllm_config,
        "get_attn_backend": get_attn_backend,
        "AttentionBackendEnum": AttentionBackendEnum,
        "AttentionType": AttentionType,
        "AttentionLayerBase": AttentionLayerBase,
        "build_slot_mappings_by_layer": build_slot_mappings_by_layer,
        "get_dcp_local_seq_lens": get_dcp_local_seq_lens,
        "override_paged_kv_adapter": modules["vllm_omni.diffusion.forward_context"].override_paged_kv_adapter,
        "current_omni_platform": platform,
        "cdiv": cdiv,
        "BlockTables": BlockTables,
    }
    for name, value in collaborators.items():
        setattr(adapter, name, value)
    for name in ADAPTER_CLASS_NAMES:
        setattr(adapter, name, _original(name))
    runner = modules["vllm_omni.diffusion.diffusion_kv.model_runner_backend"]
    for name in RUNNER_IMPORTS:
        setattr(runner, name, getattr(adapter, name))
    runner.current_omni_platform = platform
    return modules


def fake_vllm_config(dtype: torch.dtype, block_size: int) -> VllmConfig:
    return VllmConfig(ModelConfig(dtype), CacheConfig(block_size=block_size))
