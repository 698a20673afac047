"""Paged attention throughput: diffkv against torch SDPA (flash, cuDNN) and FlexAttention.

For each case, diffkv runs through the lowest-level op a layer uses,
``diffkv._C.paged_attention``, on a paged cache ``[2, num_blocks, block_size, Hkv, D]`` filled
with the case's K/V through a random permutation of blocks (a few spare blocks left unused).
The baselines run in the same process on the same data laid out densely (``[1, H, S, D]``
per row, contiguous): ``F.scaled_dot_product_attention`` under
``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` and ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``,
and ``torch.compile(flex_attention)`` with a block mask.  GQA goes through ``enable_gqa=True``
when the backend takes it, else through K/V expanded with ``repeat_interleave`` beforehand
(outside the timing); the JSON and the notes say which.  Rows of different lengths run as one
call per row for the baselines (one timed region for all rows), one launch for diffkv.

Throughput counts useful FLOPs only: 4 * H * D * (visible (query, key) pairs), the mask
counted exactly.  A baseline that cannot express a case's mask runs the causal mask over the
same rows instead (marked ``*``; its TFLOP/s counts its own causal pairs).  Every ratio is
diffkv TFLOP/s / baseline TFLOP/s (> 1: diffkv faster); for an exact baseline this equals
baseline time / diffkv time.  diffkv's output is checked against every exact baseline (or a
float32 reference when the case is small).  A case's calls (diffkv, its contiguous or causal
comparison, the baselines) are timed interleaved: every repetition round runs each once, in
an order rotated per round, so a drift of the GPU's clock falls on all of them alike.

    python benchmarks/bench_attention.py [--quick] [--cases a,b] [--baselines flash,cudnn,flex]
                                         [--device cuda|cpu] [--json out.json]

--quick: small sizes (runs on CPU with diffkv only; on CUDA the baselines run too).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from diffkv import _C
from diffkv._bench import bench_device, environment, fmt, median, print_table, time_interleaved, write_json

BASELINES = ("flash", "cudnn", "flex")
CHECK_TOL = 3e-2  # bf16 outputs of softmax-weighted N(0, 1) values
_CPU_ONLY = "baselines run on CUDA only"


@dataclass(frozen=True)
class Case:
    """One benchmark case.  rows: (query_len, seq_len) per row, the queries being the last
    query_len positions of the row.  mask: 'none', 'causal' (bottom-right), 'span' (causal
    before span_starts[r], full attention over [0, seq_len) from there on: HunyuanImage's
    causal prompt + full image span) or 'chunks' (token p sees keys < min((p // chunk + 1) *
    chunk, seq_len): block-causal video chunks).  compare: also time diffkv on contiguous K/V
    ('contiguous') or with the causal mask on the same shape ('causal').  order: the cache's
    blocks as a random permutation ('random', the worst case) or in allocation order
    ('allocation': each row's blocks are consecutive ids, as a fresh pool hands them out)."""

    name: str
    heads: int
    kv_heads: int
    head_size: int
    rows: tuple[tuple[int, int], ...]
    mask: str
    span_starts: tuple[int, ...] = ()
    chunk: int = 0
    block_size: int = 16
    compare: str | None = None
    what: str = ""
    order: str = "random"


def _cases(quick: bool) -> list[Case]:
    """The named cases at full size, or scaled down (same structure) with quick=True."""
    if quick:
        prefixes, image, hn, hkv, d = (5, 35), 41, 4, 2, 64
        s16, s_wan, h24, h40, h16, chunk = 256, 250, 2, 2, 2, 40
        s_pow2 = 256
    else:
        prefixes, image, hn, hkv, d = (500, 3500), 4097, 32, 8, 128
        s16, s_wan, h24, h40, h16, chunk = 16384, 32760, 24, 40, 16, 1560
        s_pow2 = 32768
    hunyuan_seq = tuple(p + image for p in prefixes)
    denoise = Case(
        "hunyuan_denoise",
        hn,
        hkv,
        d,
        tuple((image, s) for s in hunyuan_seq),
        "span",
        span_starts=prefixes,
        what="HunyuanImage-3.0 denoise: 2 rows, prefixes 500/3500 + 4097 image tokens, full span",
    )
    h24_pair = [Case(f"h24_s16k_{m}", h24, h24, 128, ((s16, s16),), mask) for m, mask in _NC_CAUSAL]
    d64_pair = [Case(f"h16_s16k_d64_{m}", h16, h16, 64, ((s16, s16),), mask) for m, mask in _NC_CAUSAL]
    piecewise = Case(
        "piecewise_s16k_c1560",
        h24,
        h24,
        128,
        ((s16, s16),),
        "chunks",
        chunk=chunk,
        compare="causal",
        what="block-causal chunks of 1560 tokens (one video frame)",
    )
    paged16 = Case(
        "paged_b16_s16k", h24, h24, 128, ((s16, s16),), "none", block_size=16, compare="contiguous"
    )
    return [
        denoise,
        _in_allocation_order(denoise),
        Case(
            "hunyuan_prefill",
            hn,
            hkv,
            d,
            tuple((s, s) for s in hunyuan_seq),
            "span",
            span_starts=prefixes,
            what="HunyuanImage-3.0 prefill: causal prompt + full image span",
        ),
        *h24_pair,
        *map(_in_allocation_order, h24_pair),
        Case("wan_s32760_nc", h40, h40, 128, ((s_wan, s_wan),), "none", what="Wan-14B 480p"),
        Case("wan_s32760_causal", h40, h40, 128, ((s_wan, s_wan),), "causal", what="Wan-14B 480p"),
        Case(
            "wan_s32768_nc",
            h40,
            h40,
            128,
            ((s_pow2, s_pow2),),
            "none",
            what="the 32760 case's power-of-two neighbour (a 32760 length should cost nothing extra)",
        ),
        *d64_pair,
        *map(_in_allocation_order, d64_pair),
        piecewise,
        _in_allocation_order(piecewise),
        paged16,
        _in_allocation_order(paged16),
        Case("paged_b128_s16k", h24, h24, 128, ((s16, s16),), "none", block_size=128, compare="contiguous"),
    ]


_NC_CAUSAL = (("nc", "none"), ("causal", "causal"))


def _in_allocation_order(case: Case) -> Case:
    """The case's twin reading a cache whose blocks are in allocation order ('<name>_alloc')."""
    return replace(
        case,
        name=f"{case.name}_alloc",
        order="allocation",
        what="the same, blocks in allocation order" if case.what else "",
    )


# --- masks -------------------------------------------------------------------------------------


def _row_limits(case: Case, r: int, device: torch.device) -> torch.Tensor:
    """Exclusive key bound of each query of row r (int64 [query_len]), from the case's mask."""
    query_len, seq_len = case.rows[r]
    pos = torch.arange(seq_len - query_len, seq_len, device=device, dtype=torch.int64)
    full = torch.full_like(pos, seq_len)
    if case.mask == "none":
        return full
    if case.mask == "causal":
        return pos + 1
    if case.mask == "span":
        return torch.where(pos >= case.span_starts[r], full, pos + 1)
    if case.mask == "chunks":
        return torch.clamp((pos // case.chunk + 1) * case.chunk, max=seq_len)
    raise ValueError(f"unknown mask {case.mask!r}")


def _row_kind(limits: torch.Tensor, query_len: int, seq_len: int) -> str:
    """'full' when every query sees all seq_len keys, 'causal' when the limits are exactly the
    bottom-right causal ones, else 'custom'."""
    if bool((limits >= seq_len).all()):
        return "full"
    causal = torch.arange(seq_len - query_len + 1, seq_len + 1, device=limits.device)
    if torch.equal(limits, causal):
        return "causal"
    return "custom"


def _pairs(limits: torch.Tensor, seq_len: int) -> int:
    return int(torch.clamp(limits, min=0, max=seq_len).sum().item())


def _causal_pairs(query_len: int, seq_len: int) -> int:
    """Visible pairs of the bottom-right causal mask (query_len <= seq_len)."""
    return query_len * (seq_len - query_len) + query_len * (query_len + 1) // 2


def _flex_mask_mod(case: Case, r: int) -> Callable[..., Any]:
    """The case's mask as a FlexAttention mask_mod for row r (query index -> position by the
    row's offset), written analytically so Flex evaluates it cheaply in partial blocks."""
    query_len, seq_len = case.rows[r]
    offset = seq_len - query_len
    if case.mask == "causal":

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        return causal
    if case.mask == "span":
        start = case.span_starts[r]

        def span(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + offset) | (q_idx + offset >= start)

        return span
    if case.mask == "chunks":
        chunk = case.chunk

        def chunks(b, h, q_idx, kv_idx):
            return kv_idx // chunk <= (q_idx + offset) // chunk

        return chunks
    raise ValueError(f"no Flex mask_mod for mask {case.mask!r}")


# --- data ---------------------------------------------------------------------------------------


@dataclass
class Data:
    """One case's tensors.  Dense per row: q [1, H, q_len, D], k/v [1, Hkv, seq_len, D]
    (contiguous).  Packed for diffkv: query/out [N, H, D]."""

    q_rows: list[torch.Tensor]
    k_rows: list[torch.Tensor]
    v_rows: list[torch.Tensor]
    limits: list[torch.Tensor]
    kinds: list[str]
    query: torch.Tensor
    query_start_loc: list[int]
    key_limits: torch.Tensor | None
    mask_code: int
    pairs: int


def _make_data(case: Case, device: torch.device, dtype: torch.dtype, seed: int) -> Data:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q_rows, k_rows, v_rows, limits, kinds = [], [], [], [], []
    for r, (query_len, seq_len) in enumerate(case.rows):

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

        q_rows.append(randn(1, case.heads, query_len, case.head_size))
        k_rows.append(randn(1, case.kv_heads, seq_len, case.head_size))
        v_rows.append(randn(1, case.kv_heads, seq_len, case.head_size))
        lim = _row_limits(case, r, device)
        limits.append(lim)
        kinds.append(_row_kind(lim, query_len, seq_len))
    query = torch.cat([q[0].transpose(0, 1) for q in q_rows]).contiguous()
    qsl = [0]
    for query_len, _ in case.rows:
        qsl.append(qsl[-1] + query_len)
    mask_code = {"none": _C.MASK_NONE, "causal": _C.MASK_CAUSAL}.get(case.mask, _C.MASK_LIMITS)
    key_limits = torch.cat(limits).to(torch.int32) if mask_code == _C.MASK_LIMITS else None
    pairs = sum(_pairs(lim, s) for lim, (_, s) in zip(limits, case.rows, strict=True))
    return Data(q_rows, k_rows, v_rows, limits, kinds, query, qsl, key_limits, mask_code, pairs)


@dataclass
class Paged:
    """A KV cache and the metadata _C.paged_attention takes (device tensors + host copies)."""

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    host_block_table: torch.Tensor
    host_query_start_loc: torch.Tensor
    host_seq_lens: torch.Tensor
    layout: str


def _make_paged(
    case: Case,
    data: Data,
    block_size: int,
    contiguous: bool,
    device: torch.device,
    seed: int,
    kv_layout: str = "nhd",
) -> Paged:
    """Fills a cache with the rows' K/V.  Paged: blocks of block_size drawn from a random
    permutation of num_blocks = needed + spare (case.order 'allocation': in order).
    Contiguous: one block per row holding the whole row (block_size = longest row rounded up
    to 16, block table [[0], [1], ...]).  kv_layout 'hnd': the same [2, blocks, block, heads,
    D] view over memory ordered [2, blocks, heads, block, D] (vLLM's HND stride order)."""
    seq_lens = [s for _, s in case.rows]
    if contiguous:
        block_size = -(-max(seq_lens) // 16) * 16
        per_row = [1] * len(seq_lens)
        num_blocks = len(seq_lens)
        order = torch.arange(num_blocks)
        layout = f"contiguous (one block of {block_size} tokens per row)"
    else:
        per_row = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(per_row) + max(3, sum(per_row) // 32)
        gen = torch.Generator()
        gen.manual_seed(seed)
        if case.order == "allocation":
            order = torch.arange(num_blocks)
            layout = f"paged (block {block_size}, {num_blocks} blocks in allocation order)"
        else:
            order = torch.randperm(num_blocks, generator=gen)
            layout = f"paged (block {block_size}, random permutation of {num_blocks} blocks)"
    cols = max(per_row)
    table = torch.zeros(len(seq_lens), cols, dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_row):
        table[r, :n] = order[used : used + n].to(torch.int32)
        used += n
    cache = torch.zeros(
        2, num_blocks, block_size, case.kv_heads, case.head_size, dtype=data.query.dtype, device=device
    )
    flat = cache.view(2, num_blocks * block_size, case.kv_heads, case.head_size)
    table_dev = table.to(device)
    for r, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len, device=device)
        slots = table_dev[r].long()[pos // block_size] * block_size + pos % block_size
        flat[0].index_copy_(0, slots, data.k_rows[r][0].transpose(0, 1))
        flat[1].index_copy_(0, slots, data.v_rows[r][0].transpose(0, 1))
    if kv_layout == "hnd":
        cache = cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
        layout += ", HND in memory"
    qsl = torch.tensor(data.query_start_loc, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return Paged(cache, table_dev, qsl.to(device), sl.to(device), table, qsl, sl, layout)


def _diffkv_fn(case: Case, data: Data, paged: Paged, mask_code: int, key_limits, out) -> Callable[[], None]:
    scale = case.head_size**-0.5

    def run():
        _C.paged_attention(
            data.query,
            paged.kv_cache,
            paged.block_table,
            paged.query_start_loc,
            paged.seq_lens,
            key_limits,
            mask_code,
            scale,
            out,
            paged.host_block_table,
            paged.host_query_start_loc,
            paged.host_seq_lens,
        )

    return run


# --- baselines ----------------------------------------------------------------------------------


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return SDPBackend.FLASH_ATTENTION if name == "flash" else SDPBackend.CUDNN_ATTENTION


def _sdpa_setup(name: str, case: Case, data: Data) -> dict[str, Any]:
    """Per-row SDPA closures for backend name, or {'reason': ...} when it cannot run the case.
    Chooses GQA handling by trying enable_gqa=True first."""
    from torch.nn.attention import sdpa_kernel

    causal_flags, exact = [], True
    for r, kind in enumerate(data.kinds):
        query_len, seq_len = case.rows[r]
        if kind == "full":
            causal_flags.append(False)
        elif query_len == seq_len:
            # SDPA's is_causal is top-left aligned: it equals diffkv's mask only when q == kv.
            causal_flags.append(True)
            exact = exact and kind == "causal"
        else:
            return {"reason": "mask is neither full nor square causal"}
    backend = _sdpa_backend(name)
    scale = case.head_size**-0.5
    gqa = case.heads != case.kv_heads
    modes = ["enable_gqa", "repeat_interleave"] if gqa else ["mha"]
    reasons = []
    for mode in modes:
        if mode == "repeat_interleave":
            rep = case.heads // case.kv_heads
            ks = [k.repeat_interleave(rep, dim=1) for k in data.k_rows]
            vs = [v.repeat_interleave(rep, dim=1) for v in data.v_rows]
        else:
            ks, vs = data.k_rows, data.v_rows
        kwargs = {"enable_gqa": True} if mode == "enable_gqa" else {}
        outs: list[torch.Tensor | None] = [None] * len(case.rows)

        def run(ks=ks, vs=vs, kwargs=kwargs, outs=outs):
            with sdpa_kernel(backend):
                for r in range(len(case.rows)):
                    outs[r] = F.scaled_dot_product_attention(
                        data.q_rows[r], ks[r], vs[r], is_causal=causal_flags[r], scale=scale, **kwargs
                    )

        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run()
                torch.cuda.synchronize()
        except RuntimeError as exc:
            why = "; ".join(str(w.message).splitlines()[0] for w in caught) or str(exc).splitlines()[0]
            reasons.append(f"{mode}: {why}")
            continue
        pairs = data.pairs if exact else sum(_causal_pairs(q, s) for q, s in case.rows)
        return {"run": run, "outs": outs, "exact": exact, "gqa": mode, "pairs": pairs}
    return {"reason": " | ".join(reasons)}


_flex_compiled: Callable[..., Any] | None = None


def _flex_setup(case: Case, data: Data) -> dict[str, Any]:
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        import torch._dynamo.config as dynamo_config

        # One compiled graph per (shape, mask_mod): more than dynamo's default of 8.
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, limit):
                setattr(dynamo_config, limit, 256)
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    device = data.query.device
    masks = []
    for r, kind in enumerate(data.kinds):
        query_len, seq_len = case.rows[r]
        if kind == "full":
            masks.append(None)
        else:
            mod = _flex_mask_mod(case, r)
            masks.append(create_block_mask(mod, None, None, query_len, seq_len, device=device))
    scale = case.head_size**-0.5
    gqa = case.heads != case.kv_heads
    outs: list[torch.Tensor | None] = [None] * len(case.rows)
    flex = _flex_compiled

    def run():
        for r in range(len(case.rows)):
            outs[r] = flex(
                data.q_rows[r],
                data.k_rows[r],
                data.v_rows[r],
                block_mask=masks[r],
                scale=scale,
                enable_gqa=gqa,
            )

    run()  # compiles
    torch.cuda.synchronize()
    return {
        "run": run,
        "outs": outs,
        "exact": True,
        "gqa": "enable_gqa" if gqa else "mha",
        "pairs": data.pairs,
    }


def _max_diff(case: Case, data: Data, out: torch.Tensor, outs: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for r in range(len(case.rows)):
        ref = outs[r]
        assert ref is not None
        mine = out[data.query_start_loc[r] : data.query_start_loc[r + 1]].transpose(0, 1)
        worst = max(worst, (mine.float() - ref[0].float()).abs().max().item())
    return worst


def _reference_diff(case: Case, data: Data, out: torch.Tensor) -> float:
    """Max |diffkv - float32 dense attention with the explicit mask| over all rows."""
    worst = 0.0
    rep = case.heads // case.kv_heads
    scale = case.head_size**-0.5
    for r, (_, seq_len) in enumerate(case.rows):
        q = data.q_rows[r][0].float()
        k = data.k_rows[r][0].float().repeat_interleave(rep, dim=0)
        v = data.v_rows[r][0].float().repeat_interleave(rep, dim=0)
        visible = torch.arange(seq_len, device=q.device)[None, :] < data.limits[r][:, None]
        scores = (q @ k.transpose(1, 2)) * scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        ref = torch.nan_to_num(scores.softmax(-1)) @ v
        mine = out[data.query_start_loc[r] : data.query_start_loc[r + 1]].transpose(0, 1).float()
        worst = max(worst, (mine - ref).abs().max().item())
    return worst


# --- one case -----------------------------------------------------------------------------------


def _tflops(pairs: int, case: Case, us: float) -> float:
    return 4.0 * case.heads * case.head_size * pairs / (us * 1e-6) / 1e12


def _shape(case: Case) -> str:
    heads = f"{case.heads}" if case.heads == case.kv_heads else f"{case.heads}/{case.kv_heads}"
    if len({r for r in case.rows}) == 1 and case.rows[0][0] == case.rows[0][1]:
        tokens = f"{case.rows[0][0]}"
    else:
        tokens = "(" + ",".join(f"{q}:{s}" if q != s else f"{s}" for q, s in case.rows) + ")"
    return f"{len(case.rows)}x{heads}x{tokens}x{case.head_size}"


def run_case(case: Case, args, device: torch.device) -> dict[str, Any]:
    """One case: diffkv, its comparison (contiguous K/V or causal) and every baseline set up
    first, then timed together (``time_interleaved``: round-robin, so the GPU's clock drift under
    its power cap is shared by all of them rather than handed to a ratio)."""
    dtype = torch.bfloat16
    seed = 1234
    data = _make_data(case, device, dtype, seed)
    paged = _make_paged(case, data, case.block_size, False, device, seed, args.kv_layout)
    out = torch.empty_like(data.query)
    diffkv_run = _diffkv_fn(case, data, paged, data.mask_code, data.key_limits, out)
    diffkv_run()
    kernel = _C.last_attention_kernel()  # the kernel this case's calls launch
    diffkv_out = out.clone()
    timers: dict[str, Callable[[], Any]] = {"diffkv": diffkv_run}
    result: dict[str, Any] = {
        "case": case.name,
        "what": case.what,
        "shape": _shape(case),
        "heads": case.heads,
        "kv_heads": case.kv_heads,
        "head_size": case.head_size,
        "rows": [list(r) for r in case.rows],
        "mask": case.mask,
        "row_kinds": data.kinds,
        "block_size": case.block_size,
        "layout": paged.layout,
        "kernel": kernel,
        "dtype": "bfloat16",
        "pairs": data.pairs,
        "flops": 4 * case.heads * case.head_size * data.pairs,
        "baselines": {},
        "checks": {},
        "extra": {},
    }

    # A float32 reference with the explicit mask when its score matrix is small (<= 64 MiB).
    small = sum(q * s for q, s in case.rows) * case.heads <= (1 << 24)
    if small:
        result["checks"]["fp32_reference"] = _reference_diff(case, data, diffkv_out)

    if case.compare == "contiguous":
        contig = _make_paged(case, data, case.block_size, True, device, seed, args.kv_layout)
        out2 = torch.empty_like(data.query)
        try:
            contig_run = _diffkv_fn(case, data, contig, data.mask_code, data.key_limits, out2)
            contig_run()
        except ValueError as exc:
            # diffkv refused a block this large: use an identity table of 256-token blocks
            # instead (the same memory order; the kernel still translates every block).
            contig = _make_paged_identity(case, data, 256, device)
            contig.layout += f" [one block per row refused: {exc}]"
            contig_run = _diffkv_fn(case, data, contig, data.mask_code, data.key_limits, out2)
            contig_run()
        result["extra"]["contiguous_layout"] = contig.layout
        result["checks"]["contiguous_vs_paged"] = (out2.float() - diffkv_out.float()).abs().max().item()
        timers["contiguous"] = contig_run
    elif case.compare == "causal":
        causal_out = torch.empty_like(data.query)
        timers["causal"] = _diffkv_fn(case, data, paged, _C.MASK_CAUSAL, None, causal_out)

    setups: dict[str, dict[str, Any]] = {}
    for name in BASELINES:
        if name not in args.baselines:
            result["baselines"][name] = {"status": "skipped", "reason": "not requested"}
        elif device.type != "cuda":
            result["baselines"][name] = {"status": "n/a", "reason": _CPU_ONLY}
        else:
            try:
                setup = _flex_setup(case, data) if name == "flex" else _sdpa_setup(name, case, data)
            except Exception as exc:  # a baseline that cannot run is reported, not fatal
                setup = {"reason": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            if "run" not in setup:
                result["baselines"][name] = {"status": "n/a", "reason": setup["reason"]}
            else:
                setups[name] = setup
                timers[name] = setup["run"]

    timed = time_interleaved(timers, device, warmup=args.warmup, reps=args.reps)
    us = timed["diffkv"]["median_us"]
    result["diffkv_us"] = us
    result["diffkv_samples_us"] = timed["diffkv"]["samples_us"]
    result["diffkv_tflops"] = _tflops(data.pairs, case, us)
    if "contiguous" in timed:
        result["extra"]["contiguous_us"] = timed["contiguous"]["median_us"]
        result["extra"]["paged_vs_contiguous"] = timed["contiguous"]["median_us"] / us
    if "causal" in timed:
        causal_pairs = sum(_causal_pairs(q, s) for q, s in case.rows)
        causal_tflops = _tflops(causal_pairs, case, timed["causal"]["median_us"])
        result["extra"]["causal_us"] = timed["causal"]["median_us"]
        result["extra"]["causal_tflops"] = causal_tflops
        result["extra"]["vs_causal"] = result["diffkv_tflops"] / causal_tflops
    for name, setup in setups.items():
        tb = timed[name]
        b_tflops = _tflops(setup["pairs"], case, tb["median_us"])
        result["baselines"][name] = {
            "status": "ok",
            "exact_mask": setup["exact"],
            "mask_run": "same" if setup["exact"] else "causal (flash/cuDNN cannot express the mask)",
            "gqa": setup["gqa"],
            "us": tb["median_us"],
            "samples_us": tb["samples_us"],
            "pairs": setup["pairs"],
            "tflops": b_tflops,
            "ratio": result["diffkv_tflops"] / b_tflops,
        }
        if setup["exact"]:
            result["checks"][name] = _max_diff(case, data, diffkv_out, setup["outs"])
    # the report keeps the baselines in BASELINES order
    result["baselines"] = {name: result["baselines"][name] for name in BASELINES}
    result["check_ok"] = all(v <= CHECK_TOL for v in result["checks"].values())
    del data, paged, out, diffkv_out, setups, timers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _make_paged_identity(case: Case, data: Data, block_size: int, device: torch.device) -> Paged:
    """Blocks of block_size in memory order: row r's blocks are consecutive ids."""
    seq_lens = [s for _, s in case.rows]
    per_row = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_row)
    table = torch.zeros(len(seq_lens), max(per_row), dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_row):
        table[r, :n] = torch.arange(used, used + n, dtype=torch.int32)
        used += n
    cache = torch.zeros(
        2, num_blocks, block_size, case.kv_heads, case.head_size, dtype=data.query.dtype, device=device
    )
    flat = cache.view(2, num_blocks * block_size, case.kv_heads, case.head_size)
    for r, seq_len in enumerate(seq_lens):
        start = int(table[r, 0]) * block_size
        flat[0, start : start + seq_len] = data.k_rows[r][0].transpose(0, 1)
        flat[1, start : start + seq_len] = data.v_rows[r][0].transpose(0, 1)
    qsl = torch.tensor(data.query_start_loc, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    layout = f"contiguous (identity block table, block {block_size})"
    return Paged(cache, table.to(device), qsl.to(device), sl.to(device), table, qsl, sl, layout)


# --- output -------------------------------------------------------------------------------------


def _ratio_cell(entry: dict[str, Any]) -> str:
    if entry.get("status") != "ok":
        return "n/a"
    return f"{entry['ratio']:.2f}" + ("" if entry["exact_mask"] else "*")


def _extra_cell(result: dict[str, Any]) -> str:
    extra = result["extra"]
    if "paged_vs_contiguous" in extra:
        return f"contig {extra['paged_vs_contiguous']:.2f}"
    if "vs_causal" in extra:
        return f"causal {extra['vs_causal']:.2f}"
    return ""


def _check_cell(result: dict[str, Any]) -> str:
    checks = result["checks"]
    if not checks:
        return "none"
    worst = max(checks.values())
    return f"{worst:.1e}" + ("" if result["check_ok"] else " MISMATCH")


def _notes(results: list[dict[str, Any]]) -> list[str]:
    notes = []
    by_name = {r["case"]: r for r in results}
    if "wan_s32760_nc" in by_name and "wan_s32768_nc" in by_name:
        ratio = by_name["wan_s32760_nc"]["diffkv_tflops"] / by_name["wan_s32768_nc"]["diffkv_tflops"]
        line = f"32760 vs 32768 tokens (no mask): diffkv TFLOP/s ratio {ratio:.3f}"
        for b in ("cudnn", "flash"):
            e60, e68 = by_name["wan_s32760_nc"]["baselines"][b], by_name["wan_s32768_nc"]["baselines"][b]
            if e60.get("status") == "ok" and e68.get("status") == "ok":
                line += f", {b} {e60['tflops'] / e68['tflops']:.3f}"
        notes.append(line)
    for res in results:
        name = res["case"]
        if res["mask"] == "span" and all(k == "full" for k in res["row_kinds"]):
            notes.append(
                f"{name}: diffkv runs mask LIMITS with every key limit = its row's seq_len (the full "
                "span covers all query tokens; checked on the limits); that is exactly non-causal attention "
                "over all seq_len keys, so flash/cuDNN run each row non-causal (no boolean mask: flash "
                "takes none) and Flex runs without a block mask."
            )
        inexact = [b for b, e in res["baselines"].items() if e.get("status") == "ok" and not e["exact_mask"]]
        if inexact:
            notes.append(
                f"{name}: {'/'.join(inexact)} cannot express the '{res['mask']}' mask; marked * = they run "
                "the causal mask over the same rows, ratio = diffkv TFLOP/s / their TFLOP/s, each counting "
                "its own visible pairs.  Flex runs the exact mask."
            )
        gqa = {
            b: e["gqa"] for b, e in res["baselines"].items() if e.get("status") == "ok" and e["gqa"] != "mha"
        }
        if gqa:
            notes.append(f"{name}: GQA via " + ", ".join(f"{b}={m}" for b, m in gqa.items()))
        for b, e in res["baselines"].items():
            if e.get("status") == "n/a" and e["reason"] != _CPU_ONLY:
                notes.append(f"{name}: {b} n/a: {e['reason']}")
        if "contiguous_layout" in res["extra"]:
            notes.append(
                f"{name}: 'contig' = contiguous time / paged time (1.00 = paging is free); contiguous K/V = "
                f"{res['extra']['contiguous_layout']}, same kernel"
            )
    return notes


def _write(args, env: dict[str, Any], results: list[dict[str, Any]]) -> None:
    done = [r for r in results if "error" not in r]
    summary: dict[str, Any] = {
        "all_checks_ok": all(r["check_ok"] for r in done) and len(done) == len(results),
        "errors": [r["case"] for r in results if "error" in r],
    }
    for b in BASELINES:
        ratios = [r["baselines"][b]["ratio"] for r in done if r["baselines"][b].get("status") == "ok"]
        summary[f"min_ratio_vs_{b}"] = min(ratios) if ratios else None
        summary[f"median_ratio_vs_{b}"] = median(ratios) if ratios else None
    record = {
        "benchmark": "attention",
        "quick": args.quick,
        "timing": {"warmup": args.warmup, "reps": args.reps, "l2_flush_bytes": 256 << 20},
        "env": env,
        "results": results,
        "summary": summary,
    }
    write_json(args.json, record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU-friendly)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--baselines", default=",".join(BASELINES), help="subset of flash,cudnn,flex")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--json", default=None, help="write a JSON record here")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument(
        "--kv-layout",
        choices=("nhd", "hnd"),
        default="nhd",
        help="memory order of each cache block: [block, heads, D] (nhd, default) or [heads, block, D]",
    )
    args = parser.parse_args(argv)

    device = bench_device(args.device, parser.error)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 10)
    args.baselines = [b for b in args.baselines.split(",") if b]
    unknown = sorted(set(args.baselines) - set(BASELINES))
    if unknown:
        parser.error(f"--baselines: unknown {unknown}; choose from {list(BASELINES)}")

    cases = _cases(args.quick)
    if args.list:
        for c in cases:
            print(f"{c.name:24s} {_shape(c):28s} {c.mask:7s} {c.what}")
        return 0
    if args.cases:
        wanted = [n for n in args.cases.split(",") if n]
        names = {c.name for c in cases}
        missing = [n for n in wanted if n not in names]
        if missing:
            parser.error(f"--cases: unknown {missing}; --list shows the cases")
        cases = [c for c in cases if c.name in wanted]

    env = environment(device, checkout=__file__)
    print(
        f"diffkv paged attention vs torch on {env.get('gpu', device)} (torch {env['torch']}, "
        f"diffkv {env['diffkv']}); bf16; median of {args.reps} after {args.warmup} warm-up"
        + (", L2 flushed before each" if device.type == "cuda" else "")
        + (f"; diffkv kernel: {env['diffkv_build']['attention_kernel']}" if device.type == "cuda" else "")
    )
    results: list[dict[str, Any]] = []
    for case in cases:
        try:
            res = run_case(case, args, device)
        except Exception as exc:  # recorded and reported; the other cases still run
            res = {
                "case": case.name,
                "shape": _shape(case),
                "mask": case.mask,
                "error": f"{type(exc).__name__}: {exc}",
            }
            print(f"  {case.name}: ERROR {res['error']}", file=sys.stderr, flush=True)
        else:
            print(
                f"  {case.name}: {res['diffkv_us']:.1f} us, {res['diffkv_tflops']:.3g} TFLOP/s",
                file=sys.stderr,
                flush=True,
            )
        results.append(res)
        if args.json:  # after every case, so a run cut short keeps what it measured
            _write(args, env, results)
    failed = [r for r in results if "error" in r]
    results = [r for r in results if "error" not in r]

    headers = [
        "case",
        "shape",
        "mask",
        "kernel",
        "diffkv us",
        "TFLOP/s",
        "vs flash",
        "vs cudnn",
        "vs flex",
        "extra",
        "check",
    ]
    rows = [
        [
            r["case"],
            r["shape"],
            r["mask"],
            r["kernel"],
            fmt(r["diffkv_us"]),
            fmt(r["diffkv_tflops"], 1 if r["diffkv_tflops"] >= 10 else 3),
            *(_ratio_cell(r["baselines"][b]) for b in BASELINES),
            _extra_cell(r),
            _check_cell(r),
        ]
        for r in results
    ]
    print()
    print_table(headers, rows, left=3)
    print()
    print(
        "ratio = diffkv TFLOP/s / baseline TFLOP/s (>1: diffkv faster); useful FLOPs = 4*H*D*visible pairs;"
    )
    print(
        "extra: contig = contiguous time / paged time; causal = TFLOP/s / diffkv causal TFLOP/s (same shape)"
    )
    if any(e.get("status") == "ok" for r in results for e in r["baselines"].values()):
        print()
        print_table(
            ["case", "diffkv TFLOP/s", *(f"{b} TFLOP/s" for b in BASELINES)],
            [
                [
                    r["case"],
                    fmt(r["diffkv_tflops"]),
                    *(fmt(r["baselines"][b].get("tflops")) for b in BASELINES),
                ]
                for r in results
            ],
        )
    print()
    if device.type != "cuda":
        print(f"note: {_CPU_ONLY} (this run: {device})")
    for note in _notes(results):
        print("note: " + note)
    for r in failed:
        print(f"ERROR {r['case']}: {r['error']}")
    ok = all(r["check_ok"] for r in results) and not failed
    if args.json:
        _write(args, env, results + failed)
    if not ok:
        print(
            f"FAILED: a case raised or diffkv differs from a reference by more than {CHECK_TOL}",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
