"""Strict Ulysses sequence parallelism on torch.distributed: the all-to-alls around paged attention.

vLLM-Omni's strict Ulysses keeps activations batched ``[B, S, H, D]`` with the sequence dim split
over the ``u`` ranks of the sequence-parallel group: rank ``r`` holds tokens
``[r * S_pad / u, (r + 1) * S_pad / u)``, where ``S_pad`` is ``S`` rounded up to a multiple of
``u`` with synthetic zero tokens at the end (``sp_padding_size``).  Around attention:

- ``scatter_heads``: ``[B, S_pad/u, H, D]`` per rank -> ``[B, S, H/u, D]`` (full sequence, the
  rank's contiguous share of heads, synthetic padding cut out).  Run it on Q (``H`` heads), K and
  V (``H_kv`` heads); then call the adapter with a layer built with ``ulysses_degree=u``, which
  keeps ``H/u`` query and ``H_kv/u`` KV heads and a rank-local cache of the full sequence.
- ``gather_heads``: the inverse for the attention output, ``[B, S, H/u, D]`` ->
  ``[B, S_pad/u, H, D]`` (zeros re-inserted where the padding was cut).

Each all-to-all is one ``torch.distributed.all_to_all_single`` over a contiguous buffer with equal
splits, the collective both backends implement: NCCL (CUDA tensors) and gloo (CPU tensors;
``alltoall_base`` since torch 1.x, whereas gloo's list ``all_to_all`` is recent).  The exchange
moves bytes only, so the head-split attention matches the single-rank result exactly wherever the
kernel's per-head arithmetic does not depend on the number of heads (diffkv's kernels: one
query head at a time).  Every rank must pass tensors of the same shape, dtype and padding.

Entry points: ``sp_padding_size``, ``shard_sequence``, ``scatter_heads``, ``gather_heads``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_heads", "scatter_heads", "shard_sequence", "sp_padding_size"]


def _check_int(op: str, name: str, value: Any, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        kind = "a positive int" if minimum == 1 else "a non-negative int"
        raise ValueError(f"{op}(): {name} must be {kind}, got {value!r}")
    return value


def _check_4d(op: str, x: Any, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}(): x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{op}(): x must be 4-D {layout}, got shape {tuple(x.shape)}")
    return x


def sp_padding_size(seq_len: int, degree: int) -> int:
    """Synthetic tokens appended so that ``seq_len`` splits evenly over ``degree`` ranks:
    ``(-seq_len) % degree``."""
    _check_int("sp_padding_size", "seq_len", seq_len, 0)
    _check_int("sp_padding_size", "degree", degree, 1)
    return -seq_len % degree


def shard_sequence(x: torch.Tensor, *, rank: int, degree: int) -> torch.Tensor:
    """Rank ``rank``'s sequence shard of a full batched tensor.

    x: ``[B, S, ...]``.  Returns ``[B, S_pad / degree, ...]`` (a new tensor): tokens
    ``[rank * S_pad / degree, (rank + 1) * S_pad / degree)`` of ``x`` zero-padded at the end of
    the sequence dim to ``S_pad = S + sp_padding_size(S, degree)``.
    """
    op = "shard_sequence"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}(): x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{op}(): x must be at least 2-D [B, S, ...], got shape {tuple(x.shape)}")
    _check_int(op, "degree", degree, 1)
    if type(rank) is not int or not 0 <= rank < degree:
        raise ValueError(f"{op}(): rank must be an int in [0, {degree}), got {rank!r}")
    seq_len = x.shape[1]
    shard = (seq_len + sp_padding_size(seq_len, degree)) // degree
    start = rank * shard
    out = x.new_zeros((x.shape[0], shard, *x.shape[2:]))
    valid = max(0, min(seq_len, start + shard) - start)
    out[:, :valid] = x[:, start : start + valid]
    return out


def _group_size(group: Any) -> int:
    return dist.get_world_size(group)


def scatter_heads(x: torch.Tensor, *, group: Any = None, padding: int = 0) -> torch.Tensor:
    """Pre-attention all-to-all: scatter heads, gather the sequence.

    x: this rank's sequence shard ``[B, S_pad/u, H, D]`` (``u`` = size of ``group``, the default
    group when None).  Returns ``[B, S_pad - padding, H/u, D]`` (contiguous): every rank's shard
    in rank order, heads ``[rank * H/u, (rank + 1) * H/u)``, the last ``padding`` synthetic
    tokens of the sequence cut out.
    """
    op = "scatter_heads"
    _check_4d(op, x, "[B, S/u, H, D]")
    _check_int(op, "padding", padding, 0)
    degree = _group_size(group)
    batch, shard, heads, head_size = x.shape
    if heads % degree != 0:
        raise ValueError(
            f"{op}(): x.shape[2] (heads) must be divisible by the group size {degree}, got {heads}"
        )
    sequence = shard * degree
    if padding > sequence:
        raise ValueError(
            "Paged Ulysses padding exceeds the post-all-to-all sequence: "
            f"padding={padding}, sequence={sequence}"
        )
    local_heads = heads // degree
    # send[j] = heads of rank j for this rank's tokens; recv[i] = rank i's tokens, our heads.
    send = x.reshape(batch, shard, degree, local_heads, head_size).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    out = recv.permute(1, 0, 2, 3, 4).reshape(batch, sequence, local_heads, head_size)
    if padding:
        out = out[:, : sequence - padding].contiguous()
    return out


def gather_heads(x: torch.Tensor, *, group: Any = None, padding: int = 0) -> torch.Tensor:
    """Post-attention all-to-all (inverse of ``scatter_heads``): gather heads, scatter the sequence.

    x: ``[B, S, H/u, D]``, the full logical sequence with this rank's heads.  ``padding``
    zero tokens are appended (``S + padding`` must be a multiple of ``u``), then the sequence
    is split over the ranks.  Returns ``[B, (S + padding)/u, u * H/u, D]`` (contiguous): this
    rank's sequence shard with all heads, in rank order.
    """
    op = "gather_heads"
    _check_4d(op, x, "[B, S, H/u, D]")
    _check_int(op, "padding", padding, 0)
    degree = _group_size(group)
    batch, seq_len, local_heads, head_size = x.shape
    sequence = seq_len + padding
    if sequence % degree != 0:
        raise ValueError(
            f"{op}(): x.shape[1] + padding (sequence) must be divisible by the group size {degree}, "
            f"got {seq_len} + {padding} = {sequence}"
        )
    if padding:
        x = torch.cat([x, x.new_zeros((batch, padding, local_heads, head_size))], dim=1)
    shard = sequence // degree
    # send[j] = rank j's tokens with our heads; recv[i] = rank i's heads for our tokens.
    send = x.reshape(batch, degree, shard, local_heads, head_size).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(batch, shard, degree * local_heads, head_size)
