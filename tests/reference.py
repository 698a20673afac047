"""Plain PyTorch references for the tests: paged K/V read-back, attention with an explicit mask,
and the three mask builders (none, causal bottom-right, piecewise spans).

Everything is computed in float64 unless a lower ``dtype`` is asked for (the "same-precision
reference" whose error bounds the kernels' error, STYLE.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slot_of(block_table_row: Sequence[int], position: int, block_size: int) -> int:
    """Slot of a token at ``position`` in a row (no context parallelism)."""
    return int(block_table_row[position // block_size]) * block_size + position % block_size


def dense_kv_from_cache(
    kv_cache: torch.Tensor, block_table_row: Sequence[int] | torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[seq_len, Hkv, D]`` (float64, CPU) of one row read back from a paged
    cache ``(2, num_blocks, block_size, Hkv, D)`` through its block table row."""
    block_size = kv_cache.shape[2]
    table = [
        int(b) for b in (block_table_row.tolist() if torch.is_tensor(block_table_row) else block_table_row)
    ]
    positions = torch.arange(seq_len)
    blocks = torch.tensor([table[p // block_size] for p in range(seq_len)], dtype=torch.long)
    offsets = positions % block_size
    cache = kv_cache.detach().cpu().double()
    return cache[0, blocks, offsets], cache[1, blocks, offsets]


def mask_none(positions: Sequence[int], seq_len: int) -> torch.Tensor:
    """Every query sees every key: bool ``[n, seq_len]``."""
    return torch.ones((len(positions), seq_len), dtype=torch.bool)


def mask_causal(positions: Sequence[int], seq_len: int) -> torch.Tensor:
    """Query at global position ``p`` sees keys ``j <= p`` (bottom-right alignment when the
    queries are the row's suffix): bool ``[n, seq_len]``."""
    p = torch.as_tensor(list(positions), dtype=torch.long)[:, None]
    j = torch.arange(seq_len)[None, :]
    return j <= p


def mask_spans(positions: Sequence[int], seq_len: int, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Piecewise: ``visible(p, j) = j <= p or (p in [a, b) for a span and j < b)``."""
    visible = mask_causal(positions, seq_len)
    p = torch.as_tensor(list(positions), dtype=torch.long)
    j = torch.arange(seq_len)
    for a, b in spans:
        inside = (p >= a) & (p < b)
        visible |= inside[:, None] & (j[None, :] < b)
    return visible


def key_limits_for_spans(positions: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """Exclusive key bound per query token for ``mask_spans``: the span end inside a span,
    ``p + 1`` elsewhere."""
    limits = []
    for p in positions:
        limit = p + 1
        for a, b in spans:
            if a <= p < b:
                limit = b
        limits.append(limit)
    return limits


def ref_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Attention of ``q [n, H, D]`` over ``k, v [S, Hkv, D]`` (GQA: query head ``h`` uses KV
    head ``h // (H / Hkv)``) with a bool ``visible [n, S]`` mask; rows that see nothing give
    zeros.  Computed in ``dtype`` (scores and P@V in ``dtype``, softmax in fp32 when ``dtype``
    is lower than fp32) and returned as float64 ``[n, H, D]`` on the CPU."""
    q = q.detach().cpu().to(dtype)
    k = k.detach().cpu().to(dtype)
    v = v.detach().cpu().to(dtype)
    visible = visible.cpu()
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,shd->hns", q, k) * scale
    softmax_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    scores = scores.to(softmax_dtype).masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0).to(dtype)
    out = torch.einsum("hns,shd->nhd", probs, v)
    return out.double()


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference (float64, CPU)."""
    return (actual.detach().cpu().double() - expected.detach().cpu().double()).abs().max().item()


# Small absolute slack on top of "2x the same-precision reference's error".
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def assert_attention_close(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> None:
    """Kernel output vs the float64 reference: error within 2x the error of the same
    computation done in the input dtype, plus ``ATOL[dtype]``."""
    dtype = q.dtype
    exact = ref_attention(q, k, v, visible, scale)
    low = ref_attention(q, k, v, visible, scale, dtype=dtype)
    bound = 2 * max_error(low, exact) + ATOL[dtype]
    err = max_error(out, exact)
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g} ({dtype})"
