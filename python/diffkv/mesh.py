"""Ulysses x context-parallel KV on a 2-D ``torch.distributed`` device mesh (USP).

A mesh of ``cp_degree x ulysses_degree`` ranks (torch's own ``DeviceMesh``, dims ``("cp",
"ulysses")``: the Ulysses ranks of one CP index are consecutive, so that on a multi-GPU node they
share NVLink while the CP dimension spans nodes).  A layer call composes the two existing pieces:

1. ``diffkv.ulysses.scatter_heads`` over the Ulysses group: this rank's token shard of Q, K, V
   (``[N_pad / u, H, D]`` of the packed tokens of every row, the same shard on every rank of its
   CP group) becomes every token with ``H / u`` query and ``H_kv / u`` KV heads;
2. the new K/V written into this rank's cache at its slots: the CP share of the keys
   (``BlockTables(cp_size, cp_rank, cp_interleave)`` slot mappings, -1 for another CP rank's);
3. ``diffkv.parallel_cp.attention_partial`` over the rank's keys, and with ``cp_degree > 1``
   ``all_gather_combine`` over the CP group (the log-sum-exp merge);
4. ``diffkv.ulysses.gather_heads`` back to this rank's token shard with every head.

So each rank computes ``1 / (u c)`` of the attention and holds ``1 / (u c)`` of the KV cache.  A
Ulysses-only mesh (``cp_degree == 1``) moves bytes only and matches one process bit for bit; a CP
dimension adds the merge's fp32 rounding.  Everything a call can refuse (head counts the Ulysses
degree does not divide, a block size the CP interleave does not divide, shapes) is checked before
the first collective.

Entry points: ``init_mesh``, ``mesh_groups``, ``MeshGroups``, ``mesh_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _C, parallel_cp, ulysses

__all__ = ["MESH_DIMS", "MeshGroups", "init_mesh", "mesh_attention", "mesh_groups"]

MESH_DIMS = ("cp", "ulysses")


@dataclass(frozen=True)
class MeshGroups:
    """A 2-D mesh's two process groups and this rank's place in them."""

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    ulysses_group: Any
    cp_group: Any
    ulysses_degree: int
    cp_degree: int
    ulysses_rank: int
    cp_rank: int


def _check_degree(op: str, name: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    return value


def mesh_groups(mesh: Any) -> MeshGroups:
    """The groups of a ``DeviceMesh`` with dims ``MESH_DIMS`` (``("cp", "ulysses")``)."""
    op = "mesh_groups()"
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or tuple(names) != MESH_DIMS:
        raise ValueError(
            f"{op}: mesh must be a 2-D DeviceMesh with mesh_dim_names {MESH_DIMS}, got {names!r}"
        )
    return MeshGroups(
        mesh=mesh,
        ulysses_group=mesh.get_group("ulysses"),
        cp_group=mesh.get_group("cp"),
        ulysses_degree=mesh.size(1),
        cp_degree=mesh.size(0),
        ulysses_rank=mesh.get_local_rank("ulysses"),
        cp_rank=mesh.get_local_rank("cp"),
    )


def init_mesh(ulysses_degree: int, cp_degree: int, device_type: str = "cuda") -> MeshGroups:
    """A ``cp_degree x ulysses_degree`` mesh over the initialized default process group (every
    rank calls it): ``torch.distributed.device_mesh.init_device_mesh`` with dims ``MESH_DIMS``.
    Raises ValueError unless the degrees multiply to the world size."""
    from torch.distributed.device_mesh import init_device_mesh

    op = "init_mesh()"
    _check_degree(op, "ulysses_degree", ulysses_degree)
    _check_degree(op, "cp_degree", cp_degree)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed must be initialized, got is_initialized() == False")
    world = dist.get_world_size()
    if ulysses_degree * cp_degree != world:
        raise ValueError(
            f"{op}: ulysses_degree * cp_degree must equal the world size {world}, "
            f"got {ulysses_degree} * {cp_degree}"
        )
    mesh = init_device_mesh(device_type, (cp_degree, ulysses_degree), mesh_dim_names=MESH_DIMS)
    return mesh_groups(mesh)


def mesh_attention(
    groups: MeshGroups,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    mask: int,
    scale: float,
    key_limits: torch.Tensor | None = None,
    *,
    cp_interleave: int = 1,
    host_metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One layer call on the mesh: this rank's token shard of the output.

    query ``[N_pad / u, H, D]``, key/value ``[N_pad / u, H_kv, D]``: this rank's shard of the
    packed new tokens of every row (``diffkv.ulysses.shard_sequence`` over the Ulysses dim of a
    ``[1, N, ...]`` view; ``N_pad = N + sp_padding_size(N, u)``), the same on every rank of the CP
    group.  kv_cache ``[2, num_blocks, block_size, H_kv / u, D]``: this rank's cache (its heads,
    its CP share of the keys); slot_mapping int64 ``[N]``: each new token's slot in it (-1 where
    another CP rank holds the key); block_table, query_start_loc int32 ``[R + 1]`` (over the N
    tokens), seq_lens int32 ``[R]`` (global row lengths), mask, scale and key_limits (global key
    positions) as in ``diffkv.parallel_cp.attention_partial``, whose ``host_metadata`` this
    passes on.  Returns ``[N_pad / u, H, D]`` in the query's dtype (zeros on padding tokens).
    """
    op = "mesh_attention()"
    if not isinstance(groups, MeshGroups):
        raise TypeError(
            f"{op}: groups must be a MeshGroups (init_mesh, mesh_groups), got {type(groups).__name__}"
        )
    u, c = groups.ulysses_degree, groups.cp_degree
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{op}: {name} must be a 3-D tensor [N_pad / u, heads, D], got {_shape(x)}")
    if key.shape != value.shape or key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{op}: key and value must be [{query.shape[0]}, H_kv, {query.shape[2]}] like each other, "
            f"got {_shape(key)} and {_shape(value)}"
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % u != 0 or kv_heads % u != 0:
        raise ValueError(
            f"{op}: the query heads ({heads}) and KV heads ({kv_heads}) must be divisible by the Ulysses "
            f"degree {u}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[3] != kv_heads // u:
        raise ValueError(
            f"{op}: kv_cache must be [2, num_blocks, block_size, {kv_heads // u}, D] (this rank's KV heads), "
            f"got {_shape(kv_cache)}"
        )
    if c > 1 and kv_cache.shape[2] % cp_interleave != 0:
        raise ValueError(
            f"{op}: cp_interleave must divide the cache's block_size {kv_cache.shape[2]} when the CP degree "
            f"is {c}, got {cp_interleave}"
        )
    if host_metadata is None:
        host_metadata = tuple(t.to(device="cpu") for t in (block_table, query_start_loc, seq_lens))
    num_tokens = int(host_metadata[1][-1]) if host_metadata[1].numel() else 0
    padding = ulysses.sp_padding_size(num_tokens, u)
    if query.shape[0] * u != num_tokens + padding:
        raise ValueError(
            f"{op}: query must hold (N + padding) / u = ({num_tokens} + {padding}) / {u} tokens of the "
            f"query_start_loc's N, got {query.shape[0]}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"{op}: slot_mapping must be [{num_tokens}] (one slot per new token), got {_shape(slot_mapping)}"
        )

    q, k, v = (
        ulysses.scatter_heads(x[None], group=groups.ulysses_group, padding=padding)[0]
        for x in (query, key, value)
    )
    _C.kv_write(k, v, kv_cache, slot_mapping)
    out, lse = parallel_cp.attention_partial(
        q,
        kv_cache,
        block_table,
        query_start_loc,
        seq_lens,
        mask,
        scale,
        key_limits,
        cp_size=c,
        cp_rank=groups.cp_rank,
        cp_interleave=cp_interleave,
        host_metadata=host_metadata,
    )
    if c > 1:
        out = parallel_cp.all_gather_combine(out, lse, group=groups.cp_group)[0]
    return ulysses.gather_heads(out[None], group=groups.ulysses_group, padding=padding)[0]


def _shape(x: Any) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
