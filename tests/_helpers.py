"""Test helpers: build a DiffusionPagedAttentionAdapter over diffkv's native collaborators.

``make_adapter(device, ...)`` returns a ``SimpleNamespace`` with the adapter and everything it
was built from (config, BlockTables, layers, caches, resolver), so a test can inspect or alter
any collaborator.  ``Resolver`` is a recording ``resolve_row`` callback.  ``free_port`` gives
the TCP port of a local torch.distributed rendezvous.  ``run_benchmark`` runs a script of
benchmarks/ as a user would.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

import diffkv

HEAD_SIZE = 64  # the smallest head size DiffKVAttentionBackend supports
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """benchmarks/<script> with args in a fresh interpreter, its output captured as text; the
    exit status is the caller's to check."""
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def mma_kernel_name(head: int, fp8: bool = False, max_query_len: int | None = None) -> str:
    """What ``_C.last_attention_kernel()`` names a call of the mma.sync kernel at this head size
    on the current GPU: "sm80" ("sm80-fp8"), or with "-smallsmem" where its full tiles leave one
    CTA an SM and the form with half the keys per tile fits two (an A100's 164 KB; also under
    DIFFKV_MMA_SMEM_KB, which plans the kernels for that much shared memory per SM).  Over an fp8
    cache, "sm80-fp8-wide" where the form of eight warps and 256 query rows exists (heads up to
    160), fits one CTA an SM and pays: on such a GPU always, else (but at head 32) where the
    call's last 256-row tile (of ``max_query_len``, which fp8 names need) is empty or more than
    half full -- DIFFKV_MMA_WIDE=0 / 1 forcing it off / on (attention_sm80.cuh's mma_wide_pays).  The sizes
    are attention_sm80.cuh's attn_tile, each CTA counted with 1 KB of static (the wide one 1.5 KB)
    and 1 KB of reserved shared memory."""
    per_sm = torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_multiprocessor
    kb = int(os.environ.get("DIFFKV_MMA_SMEM_KB", "0") or 0)
    if 0 < kb * 1024 < per_sm:
        per_sm = kb * 1024
    bm = 128 if head <= 160 else 64
    bn = 128 if head <= 64 else 64 if head <= 128 else 32
    ds = (head + 63) // 64 * 64

    def fit(ctas: int, bm: int, bn: int, static: int = 1024) -> bool:
        return ctas * ((bm + 4 * bn) * ds * 2 + 16 * bn + static + 1024) <= per_sm

    half = head != 192 and not fit(2, bm, bn) and fit(2, bm, bn // 2)
    if fp8 and head <= 160 and fit(1, 2 * bm, bn, static=1536):
        if max_query_len is None:
            raise ValueError("mma_kernel_name(fp8=True) needs the call's max_query_len")
        tail = max_query_len % 256
        env = os.environ.get("DIFFKV_MMA_WIDE")
        pays = half or (head != 32 and (tail == 0 or tail > 128))
        if (env == "1") if env in ("0", "1") else pays:
            return "sm80-fp8-wide"
    return ("sm80-fp8" if fp8 else "sm80") + ("-smallsmem" if half else "")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a torch.distributed init_method's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Resolver:
    """``resolve_row`` over a dict ``{identity: DiffusionPagedAttentionRowBinding}``;
    records every call as ``(request_id, sequence_id, context_id)``."""

    def __init__(self, bindings: Mapping[tuple, diffkv.DiffusionPagedAttentionRowBinding]) -> None:
        self.bindings = dict(bindings)
        self.calls: list[tuple] = []

    def __call__(self, request_id, sequence_id, context_id):
        identity = (request_id, sequence_id, context_id)
        self.calls.append(identity)
        return self.bindings[identity]


def make_vllm_config(dtype: torch.dtype = torch.float32, block_size: int = 4) -> diffkv.DiffusionConfig:
    return diffkv.DiffusionConfig(diffkv.ModelConfig(dtype), diffkv.CacheConfig(block_size=block_size))


def make_layer(
    name: str,
    *,
    device: torch.device | str,
    vllm_config: Any,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_size: int = HEAD_SIZE,
    block_size: int = 4,
    non_causal: bool = False,
    dtype: torch.dtype = torch.float32,
    ulysses_degree: int = 1,
    softmax_scale: float | None = None,
) -> diffkv.DiffusionPagedAttentionLayerAdapter:
    spec = diffkv.AttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        non_causal=non_causal,
    )
    layer = SimpleNamespace(
        num_heads=num_heads,
        softmax_scale=head_size**-0.5 if softmax_scale is None else softmax_scale,
    )
    return diffkv.DiffusionPagedAttentionLayerAdapter(
        layer_name=name,
        layer=layer,
        spec=spec,
        vllm_config=vllm_config,
        device=device,
        ulysses_degree=ulysses_degree,
    )


def make_adapter(
    device: torch.device | str,
    *,
    groups: Sequence[Sequence[str]] = (("layer0",),),
    non_causal: Mapping[str, bool] | bool = False,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_size: int = HEAD_SIZE,
    block_size: int = 4,
    kernel_block_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    bindings: Mapping[tuple, tuple[int, int]] | None = None,
    block_ids: Mapping[int, Sequence[Sequence[int]]] | None = None,
    max_num_reqs: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_blocks: int = 8,
    num_blocks: int = 64,
    reorder_batch_threshold: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    allocate_caches: bool = True,
) -> SimpleNamespace:
    """An adapter over diffkv's native collaborators.

    groups: layer names per KV cache group (every group has the same spec geometry).
    bindings: ``{identity: (row_index, max_seq_len)}``; default one binding ``("req", 0, None)``
    -> row 0 with capacity 16.  block_ids: ``{row_index: [manager ids per group]}``; rows not
    named get ``cdiv(max_seq_len, block_size * cp_size)`` fresh blocks per group from a
    BlockPool (ids 0, 1, 2, ... in order of installation).
    """
    device = torch.device(device)
    vllm_config = make_vllm_config(dtype, block_size)
    if bindings is None:
        bindings = {("req", 0, None): (0, 16)}
    if isinstance(non_causal, bool):
        non_causal = {name: non_causal for group in groups for name in group}
    layers = {
        name: make_layer(
            name,
            device=device,
            vllm_config=vllm_config,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=block_size,
            non_causal=non_causal[name],
            dtype=dtype,
        )
        for group in groups
        for name in group
    }
    kv_cache_groups = tuple(diffkv.KVCacheGroup(tuple(group), layers[group[0]].spec) for group in groups)
    kv_cache_config = diffkv.KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=kv_cache_groups)
    kernel_sizes = None if kernel_block_size is None else [kernel_block_size] * len(groups)
    block_tables = diffkv.BlockTables(
        [block_size] * len(groups),
        max_num_reqs,
        max_num_batched_tokens,
        max_num_blocks,
        device,
        kernel_block_sizes=kernel_sizes,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
    )
    pool = diffkv.BlockPool(num_blocks // block_tables.blocks_per_kv_block[0])
    installed: dict[int, list[list[int]]] = {}
    for _identity, (row_index, max_seq_len) in bindings.items():
        if block_ids is not None and row_index in block_ids:
            ids = [list(g) for g in block_ids[row_index]]
        else:
            needed = -(-max_seq_len // (block_size * cp_size))
            ids = [pool.allocate(needed) for _ in groups]
        if type(row_index) is int and 0 <= row_index < max_num_reqs and row_index not in installed:
            block_tables.append_block_ids(row_index, ids, overwrite=True)
            installed[row_index] = ids
    attn_groups = [[diffkv.AttentionGroup(tuple(group), reorder_batch_threshold)] for group in groups]
    resolver = Resolver(
        {
            identity: diffkv.DiffusionPagedAttentionRowBinding(row_index=row_index, max_seq_len=max_seq_len)
            for identity, (row_index, max_seq_len) in bindings.items()
        }
    )
    caches = {}
    if allocate_caches:
        caches = diffkv.allocate_kv_caches(kv_cache_config, dtype=dtype, device=device, layers=layers)
    adapter = diffkv.DiffusionPagedAttentionAdapter(
        vllm_config=vllm_config,
        device=device,
        kv_cache_config=kv_cache_config,
        block_tables=block_tables,
        attn_groups=attn_groups,
        layers=layers,
        resolve_row=resolver,
    )
    return SimpleNamespace(
        adapter=adapter,
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_tables=block_tables,
        attn_groups=attn_groups,
        layers=layers,
        resolver=resolver,
        caches=caches,
        installed=installed,
        device=device,
    )


def row(request_id: str = "req", query_len: int = 4, seq_len: int = 4, kv_start_pos: int = 0, **kw):
    """A DiffusionPagedAttentionRow with ``sequence_id=0`` unless an id is given."""
    if "sequence_id" not in kw and "context_id" not in kw:
        kw["sequence_id"] = 0
    return diffkv.DiffusionPagedAttentionRow(
        request_id=request_id, query_len=query_len, seq_len=seq_len, kv_start_pos=kv_start_pos, **kw
    )


class RecordingBlockTables:
    """Wraps a BlockTables and records every call of gather_block_tables /
    compute_slot_mappings (attribute reads pass through)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def gather_block_tables(self, *args, **kwargs):
        self.calls.append("gather_block_tables")
        return self._inner.gather_block_tables(*args, **kwargs)

    def compute_slot_mappings(self, *args, **kwargs):
        self.calls.append("compute_slot_mappings")
        return self._inner.compute_slot_mappings(*args, **kwargs)
