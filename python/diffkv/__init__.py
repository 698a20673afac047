"""diffkv: paged-KV attention for diffusion transformers, as a C extension over torch tensors.

The public names keep the API of vLLM-Omni's diffusion paged-attention adapter and backend ABC,
plus diffkv's standalone collaborators (configs, BlockTables, BlockPool, KV cache allocation)
and the DIFFKV attention backend.  Every hot operation runs in diffkv._C; ``diffkv.ops`` registers
the same operations as ``torch.ops.diffkv.*`` operators for torch.compile.
"""

import torch as _torch

from . import _C
from ._C import CudaError
from ._version import __version__


def _configure_bridge():
    getter = getattr(_torch._C, "_cuda_getCurrentRawStream", None)
    _C.configure(_torch.utils.dlpack.to_dlpack, getter, _torch.get_num_threads)


_configure_bridge()

from . import ops  # noqa: E402  (defines the torch.ops.diffkv operators)
from .adapter import (  # noqa: E402
    DiffusionKVRowResolver,
    DiffusionPagedAttentionAdapter,
    DiffusionPagedAttentionContext,
    DiffusionPagedAttentionLayerAdapter,
    DiffusionPagedAttentionMetadata,
    DiffusionPagedAttentionRow,
    DiffusionPagedAttentionRowBinding,
    DiffusionPagedAttentionRuntime,
    PreparedDiffusionPagedAttentionBatch,
)
from .backends.abstract import (  # noqa: E402
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    PackedPaddingMetadata,
    QueryRange,
    VideoTokenLayout,
    VideoTokenSpan,
)
from .backends.diffkv import DiffKVAttentionBackend, DiffKVAttentionImpl  # noqa: E402
from .native import (  # noqa: E402
    AttentionGroup,
    AttentionSpec,
    BlockPool,
    BlockTables,
    CacheConfig,
    DiffusionConfig,
    KVCacheConfig,
    KVCacheGroup,
    ModelConfig,
    PagedAttentionMetadata,
    allocate_kv_caches,
)
from .piecewise import (  # noqa: E402
    PagedPiecewisePlan,
    PagedPiecewiseSegment,
    build_paged_piecewise_plan,
)

__all__ = [
    "AttentionBackend",
    "AttentionGroup",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionSpec",
    "BlockPool",
    "BlockTables",
    "CacheConfig",
    "CudaError",
    "DiffKVAttentionBackend",
    "DiffKVAttentionImpl",
    "DiffusionConfig",
    "DiffusionKVRowResolver",
    "DiffusionPagedAttentionAdapter",
    "DiffusionPagedAttentionContext",
    "DiffusionPagedAttentionLayerAdapter",
    "DiffusionPagedAttentionMetadata",
    "DiffusionPagedAttentionRow",
    "DiffusionPagedAttentionRowBinding",
    "DiffusionPagedAttentionRuntime",
    "KVCacheConfig",
    "KVCacheGroup",
    "ModelConfig",
    "PackedPaddingMetadata",
    "PagedAttentionMetadata",
    "PagedPiecewisePlan",
    "PagedPiecewiseSegment",
    "PreparedDiffusionPagedAttentionBatch",
    "QueryRange",
    "VideoTokenLayout",
    "VideoTokenSpan",
    "allocate_kv_caches",
    "build_paged_piecewise_plan",
    "ops",
    "__version__",
]
