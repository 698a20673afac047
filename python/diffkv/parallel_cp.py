"""Context-parallel paged attention: every rank holds an interleaved share of each row's KV.

With ``cp_size = N`` a rank's ``BlockTables(..., cp_size=N, cp_rank=r, cp_interleave=I)`` gives
the slot of global key position ``p`` only when ``(p % (block_size * N)) // I % N == r``
(vLLM's interleaved rule; every other token gets slot -1 and is not stored there).  Because
``block_size`` is a multiple of ``I``, the stored keys of a row are dense in the rank's blocks
and in global order: the rank's local key ``j`` is the ``j``-th of its global positions, and the
number of its keys with global position ``< L`` is ``dcp_local_seq_lens(L)``
(``base = L // (I * N) * I``, plus ``clip(L - base * N - r * I, 0, I)``).

Entry points:

- ``global_key_limits``: per query token, the exclusive global key bound of a mask mode;
- ``local_key_limits``: global bounds -> this rank's local key counts;
- ``attention_partial``: this rank's attention over its local keys -> ``(out, lse)``;
- ``combine``: exact merge of the ranks' ``(out, lse)`` (no communication);
- ``all_gather_combine``: the same merge across a ``torch.distributed`` group (gloo or NCCL);
- ``cp_attention``: ``attention_partial`` then ``all_gather_combine``.

The partial attention is ``_C.paged_attention_lse``: the CPU reference for CPU tensors, the
tensor-core kernel (which then also writes the log-sum-exp) for CUDA tensors.  The per-token
local key bounds are computed with a few tensor ops on the query's device (no host round trip:
on a 75,600-token row the host version cost 18-60 ms); host copies of the block table,
``query_start_loc`` and ``seq_lens`` (the caller's, or copied) bounds-check the launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _C

__all__ = [
    "all_gather_combine",
    "attention_partial",
    "combine",
    "cp_attention",
    "global_key_limits",
    "local_key_limits",
]

MASKS = (_C.MASK_NONE, _C.MASK_CAUSAL, _C.MASK_LIMITS)


def _check_cp(op: str, cp_size: int, cp_rank: int, cp_interleave: int) -> None:
    checks = (("cp_size", cp_size, 1), ("cp_rank", cp_rank, 0), ("cp_interleave", cp_interleave, 1))
    for name, value, minimum in checks:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be an int, got {value!r}")
        if value < minimum:
            raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
    if cp_rank >= cp_size:
        raise ValueError(f"{op}: cp_rank must be in [0, {cp_size}), got {cp_rank}")


def global_key_limits(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    mask: int,
    key_limits: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> torch.Tensor:
    """Exclusive global key bound of every query token: token ``t`` sees global keys
    ``[0, limit[t])``.

    query_start_loc int32 ``[R + 1]``, seq_lens int32 ``[R]`` (global lengths), key_limits int32
    ``[N]`` (``mask == MASK_LIMITS``), all on one device.  Returns int32 ``[N]`` on that device,
    clamped to ``[0, seq_len]``: MASK_NONE -> ``seq_len``; MASK_CAUSAL (bottom-right) ->
    ``i + seq_len - query_len + 1`` for the row's ``i``-th query; MASK_LIMITS ->
    ``key_limits[t]``.  ``num_tokens`` (``= query_start_loc[-1]``) saves reading it from the
    device; the computation itself never waits for the device.
    """
    op = "global_key_limits()"
    if mask not in MASKS:
        raise ValueError(f"{op}: mask must be 0 (none), 1 (causal) or 2 (limits), got {mask!r}")
    if query_start_loc.ndim != 1 or seq_lens.ndim != 1 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"{op}: query_start_loc must have len(seq_lens) + 1 = {seq_lens.shape[0] + 1} entries, "
            f"got shape={tuple(query_start_loc.shape)}"
        )
    qsl = query_start_loc.to(torch.int64)
    seq = seq_lens.to(device=qsl.device, dtype=torch.int64)
    if num_tokens is None:
        num_tokens = int(qsl[-1])
    query_lens = qsl[1:] - qsl[:-1]
    row_seq = torch.repeat_interleave(seq, query_lens, output_size=num_tokens)
    if mask == _C.MASK_NONE:
        limits = row_seq
    elif mask == _C.MASK_CAUSAL:
        index_in_row = torch.arange(num_tokens, device=qsl.device) - torch.repeat_interleave(
            qsl[:-1], query_lens, output_size=num_tokens
        )
        row_qlen = torch.repeat_interleave(query_lens, query_lens, output_size=num_tokens)
        limits = index_in_row + row_seq - row_qlen + 1
    else:
        if key_limits is None:
            raise ValueError(f"{op}: key_limits must be a tensor when mask is 2 (limits), got None")
        if key_limits.ndim != 1 or key_limits.shape[0] < num_tokens:
            raise ValueError(
                f"{op}: key_limits must be 1-D with at least {num_tokens} entries, "
                f"got shape={tuple(key_limits.shape)}"
            )
        limits = key_limits[:num_tokens].to(device=qsl.device, dtype=torch.int64)
    return torch.minimum(limits.clamp(min=0), row_seq).to(torch.int32)


def local_key_limits(limits: torch.Tensor, cp_size: int, cp_rank: int, cp_interleave: int) -> torch.Tensor:
    """Global exclusive key bounds -> this rank's local key counts.

    limits integer ``[N]`` -> int32 ``[N]`` on the same device: the number of this rank's keys
    whose global position is below ``limits[t]``.  Every mask diffkv runs (none, causal,
    piecewise spans) shows a token a prefix ``[0, L)`` of global keys, and the rank's local keys
    are its global positions in increasing order, so the visible local keys are the prefix of
    local length ``count(p < L, p local)`` -- the count ``dcp_local_seq_lens`` gives for a row of
    length ``L`` (``base = L // (I * N) * I``, plus ``clip(L - base * N - r * I, 0, I)``),
    computed here with tensor ops so that device tensors stay on the device.  A per-rank
    ``MASK_LIMITS`` with these counts is thus the global mask.
    """
    _check_cp("local_key_limits()", cp_size, cp_rank, cp_interleave)
    lim = limits.to(torch.int64)
    base = torch.div(lim, cp_interleave * cp_size, rounding_mode="floor") * cp_interleave
    return (base + (lim - base * cp_size - cp_rank * cp_interleave).clamp(0, cp_interleave)).to(torch.int32)


def attention_partial(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    mask: int,
    scale: float,
    key_limits: torch.Tensor | None = None,
    *,
    cp_size: int,
    cp_rank: int,
    cp_interleave: int = 1,
    host_metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention over its share of every row's keys.

    query ``[N, H, D]``; kv_cache ``[2, num_blocks, block_size, Hkv, D]`` holding this rank's
    keys (written through ``BlockTables(cp_size, cp_rank, cp_interleave)`` slot mappings);
    block_table int32 ``[R, cols]`` (this rank's gathered tables); query_start_loc int32
    ``[R + 1]``; seq_lens int32 ``[R]`` **global** row lengths; mask and key_limits (int32
    ``[N]``, global positions) as in ``paged_attention``.  ``host_metadata``: CPU copies of
    ``(block_table, query_start_loc, seq_lens)`` when the caller has them (vLLM's block tables
    keep them); otherwise they are copied from the device, which waits for it.  They are
    checked (block ids, lengths) before the launch; the per-token bounds are computed on the
    query's device.  Returns ``(out [N, H, D]`` in the query's dtype, ``lse`` float32
    ``[N, H])``: the softmax over the visible local keys and its log-sum-exp (``-inf`` and
    zeros where a token sees none of this rank's keys).
    """
    op = "attention_partial()"
    _check_cp(op, cp_size, cp_rank, cp_interleave)
    block_size = kv_cache.shape[2] if kv_cache.ndim == 5 else None
    if cp_size > 1 and block_size is not None and block_size % cp_interleave != 0:
        raise ValueError(
            f"{op}: cp_interleave must divide the cache's block_size {block_size} when cp_size > 1, "
            f"got {cp_interleave}"
        )
    if host_metadata is None:
        host_metadata = tuple(t.to(device="cpu") for t in (block_table, query_start_loc, seq_lens))
    elif len(host_metadata) != 3 or not all(
        isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in host_metadata
    ):
        raise TypeError(
            f"{op}: host_metadata must be 3 CPU tensors (block_table, query_start_loc, seq_lens), "
            f"got {host_metadata!r}"
        )
    host_bt, host_qsl, host_seq = host_metadata
    num_tokens = query.shape[0] if query.ndim == 3 else -1
    if host_qsl.ndim != 1 or host_qsl.shape[0] < 1 or int(host_qsl[-1]) != num_tokens:
        raise ValueError(
            f"{op}: query_start_loc must end at the query's token count {num_tokens}, got {host_qsl.tolist()}"
        )
    limits = global_key_limits(query_start_loc, seq_lens, mask, key_limits, num_tokens=num_tokens)
    local_limits = local_key_limits(limits, cp_size, cp_rank, cp_interleave)
    local_seq = local_key_limits(seq_lens, cp_size, cp_rank, cp_interleave)
    host_local_seq = local_key_limits(host_seq, cp_size, cp_rank, cp_interleave)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    lse = torch.empty(query.shape[0], query.shape[1], dtype=torch.float32, device=query.device)
    _C.paged_attention_lse(
        query,
        kv_cache,
        block_table,
        query_start_loc,
        local_seq,
        local_limits,
        _C.MASK_LIMITS,
        scale,
        out,
        lse,
        host_bt,
        host_qsl,
        host_local_seq,
    )
    return out, lse


def combine(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attentions over disjoint key sets.

    outs: ranks' ``[N, H, D]``; lses: ranks' float32 ``[N, H]``.  Returns ``(out, lse)`` with
    ``lse = logsumexp_r lse_r`` and ``out = sum_r exp(lse_r - lse) * out_r`` (fp32 arithmetic,
    out in the dtype of ``outs[0]``); a rank whose ``lse`` is ``-inf`` contributes nothing and a
    token no rank can see gets zeros and ``-inf``.
    """
    op = "combine()"
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(
            f"{op}: outs and lses must be non-empty and of equal length, got {len(outs)} and {len(lses)}"
        )
    shape = tuple(outs[0].shape)
    for r, (o, lse) in enumerate(zip(outs, lses, strict=True)):
        if o.ndim != 3 or tuple(o.shape) != shape:
            raise ValueError(f"{op}: outs[{r}] must have shape {list(shape)}, got {list(o.shape)}")
        if tuple(lse.shape) != shape[:2]:
            raise ValueError(f"{op}: lses[{r}] must have shape {list(shape[:2])}, got {list(lse.shape)}")
    lse_all = torch.stack([lse.float() for lse in lses])  # [P, N, H]
    lse = torch.logsumexp(lse_all, dim=0)
    # exp(-inf - (-inf)) is NaN: such ranks (and tokens nobody sees) get weight 0 instead.
    seen = lse_all != float("-inf")
    weights = torch.where(seen, torch.exp(lse_all - torch.where(seen, lse, 0.0)), 0.0)
    out = torch.zeros(shape, dtype=torch.float32, device=outs[0].device)
    for w, o in zip(weights, outs, strict=True):
        out.addcmul_(w.unsqueeze(-1), o)  # o is read in its own dtype: no fp32 copy of it
    return out.to(outs[0].dtype), lse


def all_gather_combine(
    out: torch.Tensor, lse: torch.Tensor, group: torch.distributed.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``combine`` over the ranks of ``group`` (torch.distributed, gloo or NCCL): all-gathers
    every rank's ``out [N, H, D]`` and ``lse`` float32 ``[N, H]`` and returns the merged
    ``(out, lse)``, the same on every rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "all_gather_combine(): torch.distributed must be initialized, got is_initialized() == False"
        )
    world = dist.get_world_size(group)
    out = out.contiguous()
    lse = lse.float().contiguous()
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out, group=group)
    dist.all_gather(lses, lse, group=group)
    return combine(outs, lses)


def cp_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    mask: int,
    scale: float,
    key_limits: torch.Tensor | None = None,
    *,
    cp_interleave: int = 1,
    group: torch.distributed.ProcessGroup | None = None,
    host_metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Context-parallel attention: this rank's ``attention_partial`` (``cp_size`` and
    ``cp_rank`` are the group's size and rank) merged across ``group``.  Arguments as in
    ``attention_partial``; every rank passes the same queries.  Returns ``out [N, H, D]``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "cp_attention(): torch.distributed must be initialized, got is_initialized() == False"
        )
    out, lse = attention_partial(
        query,
        kv_cache,
        block_table,
        query_start_loc,
        seq_lens,
        mask,
        scale,
        key_limits,
        cp_size=dist.get_world_size(group),
        cp_rank=dist.get_rank(group),
        cp_interleave=cp_interleave,
        host_metadata=host_metadata,
    )
    return all_gather_combine(out, lse, group)[0]
