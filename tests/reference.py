"""The tests' one reference attention (``ref_attention``: float64, an explicit mask, GQA, any
value head size, optional log-sum-exp, dense or batched), the mask builders it takes (none,
bottom-right causal, piecewise spans, per-token key limits) and the paged K/V read-back.

Everything is computed in float64 unless a lower ``precision`` is asked for (the
"same-precision reference", whose own error against float64 bounds the kernels' error: see
``assert_attention_close``).  Every test that checks an attention output compares against
``ref_attention``; no test spells out its own.
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


def mask_key_limits(limits: Sequence[int] | torch.Tensor, seq_len: int) -> torch.Tensor:
    """Query token ``i`` sees keys ``j < limits[i]`` (the kernels' per-token key limit; a limit
    at or below 0 sees nothing): bool ``[n, seq_len]``."""
    limits = torch.as_tensor(limits, dtype=torch.long).cpu()
    return torch.arange(seq_len)[None, :] < limits[:, None]


def ref_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    *,
    precision: str = "float64",
    lse: bool = False,
    device: torch.device | str = "cpu",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The one reference attention of the tests.

    ``q [..., n, H, D]`` attends over ``k [..., S, Hkv, D]`` and ``v [..., S, Hkv, Dv]`` (any
    leading batch dims, the same on all four; GQA: query head ``h`` uses KV head
    ``h // (H / Hkv)``; ``Dv`` may differ from ``D``) under the explicit bool mask
    ``visible [..., n, S]`` (``mask_none``, ``mask_causal``, ``mask_spans``,
    ``mask_key_limits``); a query that sees no key gives zeros.  Computed on ``device`` and
    returned there as float64 ``[..., n, H, Dv]``; with ``lse=True`` also the float64
    log-sum-exp of the scaled visible scores ``[..., n, H]`` (``-inf`` where nothing is visible).

    ``precision`` says which roundings to the inputs' dtype it models:

    - ``"float64"``: none, everything in float64 (the exact result);
    - ``"inputs"``: the "same-precision reference" -- scores and P@V in the inputs' dtype,
      the softmax in fp32 when that dtype is lower;
    - ``"flash"``: what a flash kernel computes -- fp32 scores, softmax and P@V, with P rounded
      to the inputs' dtype before P@V.
    """
    if precision not in ("float64", "inputs", "flash"):
        raise ValueError(f"precision must be 'float64', 'inputs' or 'flash', got {precision!r}")
    dtype = q.dtype
    work = {"float64": torch.float64, "inputs": dtype, "flash": torch.float32}[precision]
    q, k, v = (t.detach().to(device=device, dtype=work) for t in (q, k, v))
    visible = visible.to(device)
    group = q.shape[-2] // k.shape[-2]
    k = k.repeat_interleave(group, dim=-2)
    v = v.repeat_interleave(group, dim=-2)
    scores = torch.einsum("...nhd,...shd->...hns", q, k) * scale
    if precision == "inputs" and work in (torch.float16, torch.bfloat16):
        scores = scores.float()
    scores = scores.masked_fill(~visible.unsqueeze(-3), float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    if precision == "inputs":
        probs = probs.to(work)
    elif precision == "flash":
        probs = probs.to(dtype).to(work)
    out = torch.einsum("...hns,...shd->...nhd", probs, v).double()
    if not lse:
        return out
    return out, torch.logsumexp(scores.double(), dim=-1).transpose(-1, -2)


def e4m3_rows(q: torch.Tensor) -> torch.Tensor:
    """Q ``[..., D]`` as the Hopper e4m3 kernel rounds it, float64: per row of D (a token's
    head), the scale ``qs = max(l1 / 128, amax / 448)`` (the row's L1 norm and largest magnitude,
    fp32), ``x * (1 / qs)`` in fp32 rounded to float8_e4m3fn, times ``qs``; a row whose L1 norm
    is under 1e-30 becomes zeros."""
    x = q.float()
    ax = x.abs()
    l1 = ax.sum(dim=-1, keepdim=True)
    live = l1 > 1e-30  # smaller rows become zeros
    amax = ax.amax(dim=-1, keepdim=True)
    # amax / 448 as the kernel's correctly rounded quotient: torch's CUDA division of a tensor by
    # a Python number multiplies by the rounded reciprocal instead (by a tensor it divides)
    qs = torch.maximum(l1 / 128.0, amax / torch.full_like(amax, 448.0))
    qs = torch.where(live, qs, torch.ones_like(l1))
    codes = (x * torch.where(live, 1.0 / qs, torch.zeros_like(qs))).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.double() * qs.double()


def e4m3_tensor(x: torch.Tensor) -> torch.Tensor:
    """x as the fp8 dense forward rounds K and V, float64: one scale for the whole tensor,
    amax / 448 (1 for an all-zero tensor), ``(x / scale)`` rounded to float8_e4m3fn, times it."""
    amax = x.float().abs().amax()
    scale = amax / 448 if amax > 0 else torch.ones(())
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale.double()


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
    low = ref_attention(q, k, v, visible, scale, precision="inputs")
    bound = 2 * max_error(low, exact) + ATOL[dtype]
    err = max_error(out, exact)
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g} ({dtype})"


def assert_flash_close(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    what: str = "",
) -> torch.Tensor:
    """A GPU kernel's output vs the float64 reference computed on q's device: error within 2x
    that of a flash-rounded reference (fp32 scores, P rounded to the inputs' dtype) plus
    ``ATOL[dtype]``; ``what`` prefixes the failure message.  Returns the reference's float64
    log-sum-exp ``[n, H]``."""
    exact, lse = ref_attention(q, k, v, visible, scale, lse=True, device=q.device)
    low = ref_attention(q, k, v, visible, scale, precision="flash", device=q.device)
    bound = 2 * (low - exact).abs().max().item() + ATOL[q.dtype]
    err = (out.double() - exact).abs().max().item()
    assert err <= bound, f"{what}max error {err:.3g} > bound {bound:.3g}"
    return lse
