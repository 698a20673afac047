"""Dense (non-paged) diffusion attention through diffkv's kernels: ``DiffKVAttentionImpl.forward``.

Contiguous K/V is a cache of one-token blocks: every attention row (a batch row, or a document
of a packed varlen batch) gets a row of key indices into ``key``/``value`` viewed as
``[num_keys, Hkv, D]``, and ``_C.dense_attention`` runs the paged kernels over it -- no copy of
K or V, and a key-padding mask only reorders indices (the kept keys first, in order).  Rows
without key padding are one block of all their keys, or on Hopper at head size 128 in-order
blocks of up to 16 keys vouched consecutive (``_row_blocks``: one TMA box per 16-key chunk,
flat boxes for smaller blocks; fp8 K/V keep one block per row, which the e4m3 kernel's TMA
producer takes at any length, and packed fp8 documents that start at multiples of 16 or 8 keys
read the key tensor as blocks of that many).  Every
mask becomes what the kernels take: a row length, causal (bottom-right), or an exclusive key
limit per query token.

Supported ``AttentionMetadata`` fields:

- ``attn_mask``: boolean key padding, ``[B, S_k]`` or ``[B, 1, 1, S_k]`` (``True`` = attend,
  SDPA's convention; any pattern, not only a suffix);
- ``extra["valid_kv_length"]``: keys ``[0, valid)`` only (prefix slicing, free);
- ``extra["cu_seqlens_q"]`` / ``["cu_seqlens_k"]`` (+ ``max_seqlen_q``/``max_seqlen_k``):
  packed documents ``[1, total, H, D]``, no attention across document boundaries;
- ``packed_padding``: ``[real, pad]`` rows without a mask: queries ``[0, q_length)`` attend
  keys ``[0, kv_length)``, pad queries get zeros;
- ``full_attn_spans``: piecewise masks of a causal layer (causal outside the spans, full inside),
  per batch row, ``S_q == S_k``; with packed varlen documents, spans in packed positions of the
  one row, each document causal outside them (a span never reaches past its document);
- the impl's ``causal`` flag: bottom-right aligned (FlashAttention's convention; the same as
  top-left when ``S_q == S_k``);
- ``joint_query``/``joint_key``/``joint_value`` (``[B, S_j, H|Hkv, D]``) with
  ``joint_strategy`` ``"front"`` or ``"rear"``: the attention of the concatenated sequences,
  returned as ``[B, S_j + S_q, H, D]`` in that order -- but nothing is concatenated: the joint
  keys are a second source the kernels read through the same key indices, and the joint and
  image queries run as two launches writing their slices of the output.  ``joint_attn_mask``
  (boolean ``[B, S_j]`` or ``[B, 1, 1, S_j]``, ``True`` = attend) pads joint keys as
  ``attn_mask`` pads the others; ``valid_kv_length`` slices the non-joint keys; causal is
  bottom-right over the concatenated sequence.

``extra["kv_cache_dtype"]`` ``"fp8"`` / ``"fp8_e4m3"``: K and V are rounded to float8_e4m3fn
with one scale each computed from them (amax / 448) and the attention runs over e4m3 K/V (on
Hopper the e4m3 kernel, which also rounds Q and P; on other GPUs the mma.sync kernels' fp8
form).  The scales stay on the device: the binding is told they come from K/V themselves
(``_C.CONSECUTIVE_SCALES_FROM_KV``), so nothing synchronises; NaN or inf inputs give NaN
outputs, as they do unquantized.  With the joint tensors one scale covers K and joint K (one V
and joint V), over the keys the rows read (K up to ``valid_kv_length``, and joint K); since
the rounding copies them anyway, each batch row's concatenated keys are written in order into
one buffer (``_joint_fp8_rows``; with key padding gathered kept first after the rounding) and
read as one block a row like the other fp8 rows.  Key-padded rows gather their e4m3 keys kept
first into one block a row, and packed documents at offsets that are not multiples of 8 (or
given on the device, not read back) gather theirs each from a multiple of 16 rows
(``_doc_gather``), so every fp8 dense form takes the e4m3 kernel's TMA producer on Hopper.
Packed varlen documents share their scales.

``query_ranges``, and ``full_attn_spans``, ``packed_padding`` or packed varlen together with the
joint tensors, raise ``NotImplementedError`` naming the field (never a silent dense fallback);
``video_layout`` is geometry a dense backend may ignore; unknown ``extra`` keys are ignored, as
the contract says.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _C

__all__ = ["dense_forward"]

_OP = "DiffKVAttentionImpl.forward()"
_JOINT_FIELDS = ("joint_query", "joint_key", "joint_value")
_UNQUANTIZED = (None, "auto", "float32", "float", "float16", "half", "bfloat16")
# extra["kv_cache_dtype"] values that run the attention over e4m3 K/V (vLLM's names)
_FP8 = ("fp8", "fp8_e4m3")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HOPPER: dict[int, bool] = {}  # CUDA device index -> compute capability 9.x


def _row_blocks(keys_per_row: int, head_size: int, device: torch.device, fp8: bool = False) -> int:
    """Keys per block of an unpadded dense row: on Hopper at head size 128 the largest power
    of two up to 16 dividing the row, so that the row is a flat cache of in-order blocks whose
    keys the binding is told are consecutive: 16-key blocks take one 5-d TMA box per block
    (sm90-tma16, as a paged cache does), smaller ones one flat box per tile over the flat rows
    (1x40x32768x128 on the H200, 618-627 TFLOP/s against 583-584 with the row as one block of a
    4-d map's per-half boxes); elsewhere, and over fp8 K/V everywhere, one block per row (the
    e4m3 kernel's TMA producer takes a row of one block of any length from 16 keys, where
    blocks of fewer than 8 keys would run its cp.async producer at half its speed)."""
    if device.type != "cuda" or head_size != 128 or fp8:
        return keys_per_row
    index = device.index if device.index is not None else torch.cuda.current_device()
    hopper = _HOPPER.get(index)
    if hopper is None:
        hopper = _HOPPER[index] = torch.cuda.get_device_capability(index)[0] == 9
    return min(16, keys_per_row & -keys_per_row) if hopper else keys_per_row


def _check_unsupported(meta: Any) -> None:
    if getattr(meta, "query_ranges", None) is not None:
        raise NotImplementedError(f"{_OP}: query_ranges is not supported by the DIFFKV backend")
    extra = getattr(meta, "extra", None) or {}
    kv_dtype = extra.get("kv_cache_dtype")
    if kv_dtype not in _UNQUANTIZED and kv_dtype not in _FP8:
        raise NotImplementedError(
            f"{_OP}: extra['kv_cache_dtype'] must be unquantized ({[d for d in _UNQUANTIZED if d]}) "
            f"or {list(_FP8)} (float8_e4m3fn K/V), got {kv_dtype!r}"
        )


def _quantize_kv(
    k: torch.Tensor, v: torch.Tensor, k2: torch.Tensor | None = None, v2: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """extra["kv_cache_dtype"] == "fp8": K and V ``[tokens, Hkv, D]`` (and the joint keys and
    values k2, v2: the kernels read both sources with one scale each for K and V) rounded to
    e4m3 with one scale for the keys and one for the values, computed from them (amax / 448
    over both sources; 1 for all zeros), by the cache write's rule -- ``(x.float() /
    scale).clamp(-448, 448).to(float8_e4m3fn)`` -- into new contiguous tensors by one
    ``_C.quantize_kv`` call (no float32 temporaries, no synchronisation: the scales are
    computed on the device); returns ([k8, v8] or [k8, v8, k2_8, v2_8], (k_scale, v_scale)),
    the scales float32 ``[1]`` views of one ``[2]`` tensor on the device."""
    out = [
        torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        for x in (k, v, k2, v2)
        if x is not None
    ]
    scales = torch.empty(2, dtype=torch.float32, device=k.device)
    joint = out[2:] if k2 is not None else [None, None]
    _C.quantize_kv(k, v, out[0], out[1], scales, k2, v2, *joint)
    return out, (scales[0:1], scales[1:2])


def _joint_fp8_rows(
    key: torch.Tensor, value: torch.Tensor, jk: torch.Tensor, jv: torch.Tensor, front: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Joint tokens over fp8 K/V: key/value ``[B, S, Hkv, D]`` and joint_key/joint_value ``[B,
    J, Hkv, D]`` rounded as ``_quantize_kv`` does (one scale for K and one for V over both
    sources) into one buffer in which batch row b's J + S keys (joint_strategy order) are rows
    b (J + S) .. b (J + S) + J + S - 1: one ``_C.quantize_kv`` call writes both sources into
    their rows ([B, S] views of the buffer).  Returns K, V ``[B (J + S), Hkv, D]`` and the
    scales."""
    batch, s, j = key.shape[0], key.shape[1], jk.shape[1]
    buf = torch.empty((2, batch, s + j, *key.shape[2:]), dtype=torch.float8_e4m3fn, device=key.device)
    main, joint = (slice(j, j + s), slice(0, j)) if front else (slice(0, s), slice(s, s + j))
    scales = torch.empty(2, dtype=torch.float32, device=key.device)
    _C.quantize_kv(
        _flat(key), _flat(value), buf[0, :, main], buf[1, :, main], scales,
        _flat(jk), _flat(jv), buf[0, :, joint], buf[1, :, joint],
    )  # fmt: skip
    return _flat(buf[0]), _flat(buf[1]), (scales[0:1], scales[1:2])


def _check_qkv(impl: Any, query: Any, key: Any, value: Any, prefix: str = "") -> None:
    for name, t in ((prefix + "query", query), (prefix + "key", key), (prefix + "value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{_OP}: {name} must be 4-D [B, S, heads, head_size], got shape {tuple(t.shape)}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(f"{_OP}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    q_, k_, v_ = prefix + "query", prefix + "key", prefix + "value"
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"{_OP}: {k_} and {v_} must have the {q_}'s dtype {query.dtype}, got {key.dtype}, {value.dtype}"
        )
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"{_OP}: {k_} and {v_} must be on the {q_}'s device {query.device}")
    heads, kv_heads, head = impl.num_heads, impl.num_kv_heads, impl.head_size
    if query.shape[2] != heads or query.shape[3] != head:
        raise ValueError(
            f"{_OP}: {q_} must have [{heads}, {head}] heads x head_size, got {list(query.shape[2:])}"
        )
    if key.shape[2:] != (kv_heads, head) or value.shape != key.shape:
        raise ValueError(
            f"{_OP}: {k_} and {v_} must have shape [B, S_k, {kv_heads}, {head}] (equal), got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"{_OP}: {k_} must have the {q_}'s batch size {query.shape[0]}, got {key.shape[0]}")


def _int_extra(extra: dict, name: str) -> int | None:
    value = extra.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_OP}: extra[{name!r}] must be an int, got {value!r}")
    return value


def _key_padding(
    mask: Any, batch: int, keys: int, device: torch.device, name: str = "attn_mask"
) -> torch.Tensor:
    """attn_mask (or joint_attn_mask) -> bool [B, S_k] (True = attend)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{_OP}: {name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise NotImplementedError(
            f"{_OP}: {name} must be boolean (True = attend); additive float masks are not "
            f"supported, got {mask.dtype}"
        )
    if mask.dim() == 4:
        if mask.shape[1] != 1 or mask.shape[2] != 1:
            raise NotImplementedError(
                f"{_OP}: {name} must be a key-padding mask [B, S_k] or [B, 1, 1, S_k]; per-head or "
                f"per-query masks are not supported, got shape {tuple(mask.shape)}"
            )
        mask = mask[:, 0, 0]
    if mask.dim() != 2 or mask.shape[0] not in (1, batch) or mask.shape[1] < keys:
        raise ValueError(
            f"{_OP}: {name} must have shape [B={batch}, S_k>={keys}] or [B, 1, 1, S_k], got "
            f"{tuple(mask.shape)}"
        )
    if mask.device != device:
        raise ValueError(f"{_OP}: {name} must be on the query's device {device}, got {mask.device}")
    return mask[:, :keys].expand(batch, keys)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[B, S, heads, D] -> [B*S, heads, D] (a view whenever the batch and token strides allow)."""
    return t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])


def _key_value(key: torch.Tensor, value: torch.Tensor, *joint: torch.Tensor) -> list[torch.Tensor]:
    """key, value (and joint_key, joint_value) as [tokens, Hkv, D] with one set of strides."""
    flat = [_flat(t) for t in (key, value, *joint)]
    if any(t.stride() != flat[0].stride() for t in flat[1:]):
        # the kernels address every K/V source with the key's strides
        flat = [t.contiguous() for t in flat]
    return flat


def _spans_limits(spans: Any, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """full_attn_spans -> exclusive key limit per (row, position): the span end inside a span,
    position + 1 elsewhere (int64 [B, S])."""
    if not isinstance(spans, (list, tuple)) or len(spans) != batch:
        raise ValueError(
            f"{_OP}: full_attn_spans must hold one list of spans per batch row ({batch}), got {spans!r}"
        )
    pos = torch.arange(length, device=device, dtype=torch.int64)
    limits = (pos + 1).expand(batch, length).clone()
    for b, row_spans in enumerate(spans):
        for span in row_spans:
            if (
                not isinstance(span, (list, tuple))
                or len(span) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in span)
                or not 0 <= span[0] < span[1] <= length
            ):
                raise ValueError(
                    f"{_OP}: full_attn_spans[{b}] must hold (start, end) int pairs with "
                    f"0 <= start < end <= {length}, got {span!r}"
                )
            start, end = span
            limits[b, start:end] = end
    return limits


def _valid_keys(extra: dict, s_k: int) -> int:
    """The key count: extra["valid_kv_length"] (prefix slicing, in [0, S_k]) or S_k."""
    valid = _int_extra(extra, "valid_kv_length")
    if valid is None:
        return s_k
    if not 0 <= valid <= s_k:
        raise ValueError(f"{_OP}: extra['valid_kv_length'] must be in [0, {s_k}], got {valid}")
    return valid


def _kept_first(
    key_index: torch.Tensor, keep: torch.Tensor, limits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Key padding as indices, not data: each row's kept keys first, in order (a stable sort of
    "not kept"), its seq_len the number kept, and every limit in original key positions turned
    into the number of kept keys below it.  key_index, keep [B, L]; limits [B, S_q] or None."""
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    seq_lens = keep.sum(dim=1, dtype=torch.int32)
    if limits is not None:
        prefix = keep.to(torch.int32).cumsum(dim=1)
        limits = torch.where(limits > 0, prefix.gather(1, (limits - 1).clamp(min=0)), 0)
    return key_index.gather(1, order), seq_lens, limits


def _varlen(impl: Any, query, key, value, extra: dict, meta: Any, fp8: bool) -> torch.Tensor:
    cu_q, cu_k = extra.get("cu_seqlens_q"), extra.get("cu_seqlens_k")
    if cu_q is None or cu_k is None:
        raise ValueError(f"{_OP}: extra must hold both cu_seqlens_q and cu_seqlens_k, or neither")
    for name in ("attn_mask", "packed_padding"):
        if getattr(meta, name, None) is not None:
            raise NotImplementedError(
                f"{_OP}: {name} together with cu_seqlens_q/cu_seqlens_k is not supported"
            )
    if extra.get("valid_kv_length") is not None:
        raise NotImplementedError(
            f"{_OP}: valid_kv_length together with cu_seqlens_q/cu_seqlens_k is not supported"
        )
    if query.shape[0] != 1:
        raise ValueError(f"{_OP}: packed varlen query must be [1, total_q, H, D], got {tuple(query.shape)}")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{_OP}: extra[{name!r}] must be a 1-D int32/int64 tensor, got {cu!r}")
        if cu.shape[0] < 2:
            raise ValueError(f"{_OP}: extra[{name!r}] must have at least 2 entries, got {cu.shape[0]}")
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(
            f"{_OP}: cu_seqlens_q and cu_seqlens_k must have the same length, got {cu_q.shape[0]} and "
            f"{cu_k.shape[0]}"
        )
    device = query.device
    total_q, total_k = query.shape[1], key.shape[1]
    host_q = cu_q.device.type == "cpu"
    if host_q:
        # host offsets are checked: the documents cover every query token, in order
        if int(cu_q[0]) != 0 or int(cu_q[-1]) != total_q:
            raise ValueError(
                f"{_OP}: extra['cu_seqlens_q'] must run from 0 to the {total_q} packed query "
                f"tokens, got {int(cu_q[0])} .. {int(cu_q[-1])}"
            )
        if bool((cu_q[1:] < cu_q[:-1]).any()):
            raise ValueError(f"{_OP}: extra['cu_seqlens_q'] must be non-decreasing, got {cu_q.tolist()}")
    max_k = _int_extra(extra, "max_seqlen_k")
    host_k = cu_k.device.type == "cpu"
    cols = total_k
    if host_k:
        # host offsets are checked: every document's keys lie in the packed key tokens
        if int(cu_k[0]) < 0 or int(cu_k[-1]) > total_k or bool((cu_k[1:] < cu_k[:-1]).any()):
            raise ValueError(
                f"{_OP}: extra['cu_seqlens_k'] must be non-decreasing offsets into the {total_k} "
                f"packed key tokens (0 <= cu_seqlens_k[0], cu_seqlens_k[-1] <= {total_k}), got "
                f"{cu_k.tolist()}"
            )
        # the longest key document sizes the rows of key indices (a stated max_seqlen_k below
        # it is an error, not a silent truncation)
        longest = int((cu_k[1:] - cu_k[:-1]).max())
        if max_k is not None and longest > max(1, min(max_k, total_k)):
            raise ValueError(f"{_OP}: extra['max_seqlen_k']={max_k} is below the longest key document")
        cols = max(1, min(longest, total_k))
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if host_q else 0
    qsl, cuk = _device_offsets(cu_q, cu_k, device)
    seq_lens = (cuk[1:] - cuk[:-1]).to(torch.int32)
    key_index = (cuk[:-1, None] + torch.arange(cols, device=device)).clamp_(max=max(total_k - 1, 0))
    # At head 128 on Hopper, documents whose keys start at multiples of 8 rows (host offsets:
    # checked here) in a key tensor of a multiple of 8 rows take one TMA box per 16-key chunk
    # (the binding's CONSECUTIVE_CHUNKS; a document's last chunk may run into the next one's
    # rows, masked): 8192-key documents 584 -> 605 TFLOP/s on the H200 against the flat boxes
    # (elsewhere the bit is ignored)
    chunks = host_k and impl.head_size == 128 and total_k % 8 == 0 and bool((cu_k % 8 == 0).all())
    q = query[0]
    mask = _C.MASK_CAUSAL if impl.causal else _C.MASK_NONE
    key_limits = None
    spans = getattr(meta, "full_attn_spans", None)
    if spans is not None:
        # spans in packed token positions of the one row; validated in any layer, used by a
        # causal one (full attention inside a span, causal outside, within each document)
        span_limits = _spans_limits(spans, 1, q.shape[0], device)[0]
        if impl.causal:
            same = cu_q.shape == cu_k.shape and torch.equal(cu_q.cpu().long(), cu_k.cpu().long())
            if not same:
                raise ValueError(
                    f"{_OP}: full_attn_spans with cu_seqlens need cu_seqlens_q == cu_seqlens_k "
                    "(self-attention documents)"
                )
            # a token's limit in its document's key positions: the span end (clamped to the
            # document's end) or its own position + 1, both counted from the document's start
            cu = qsl.to(torch.int64)
            pos = torch.arange(q.shape[0], device=device, dtype=torch.int64)
            doc = torch.searchsorted(cu[1:], pos, right=True).clamp_(max=cu.shape[0] - 2)
            lim = torch.minimum(span_limits, cu[doc + 1]) - cu[doc]
            key_limits = lim.clamp_(min=0).to(torch.int32)
            mask = _C.MASK_LIMITS
    k, v = _key_value(key, value)
    consecutive = _C.CONSECUTIVE_TILES | (_C.CONSECUTIVE_CHUNKS if chunks else 0)
    scales: tuple[torch.Tensor, ...] = ()
    key_block = 1
    if fp8:
        # the per-chunk boxes (CONSECUTIVE_CHUNKS) are the bf16 kernels' producer: not asked for
        consecutive = _C.CONSECUTIVE_TILES | _C.CONSECUTIVE_SCALES_FROM_KV
        (k, v), scales = _quantize_kv(k, v)
        key_block = _doc_blocks(cu_k, total_k) if host_k else 1
        if key_block == 1 and total_k > 0 and (not host_k or int(cu_k[-1]) > int(cu_k[0])):
            # documents at other offsets, or at offsets not read back (device cu_seqlens_k):
            # their e4m3 keys gathered on the device with each document from a multiple of 16
            # rows (copies of its last key after it), read as 16-key blocks -- the TMA producer
            # instead of cp.async over one-key blocks.  Host offsets size the gathered rows
            # exactly; device ones by their bound, 15 more rows a document
            if host_k:
                lens = (cu_k[1:] - cu_k[:-1]).to(torch.int64)
                rows = int(((lens + 15) // 16 * 16).sum())
            else:
                rows = -(-(total_k + 15 * (cu_k.shape[0] - 1)) // 16) * 16
            gather, first = _doc_gather(cuk, rows, total_k)
            k, v = _rows(k, gather), _rows(v, gather)
            key_block, total_k, cuk = 16, rows, first
        if key_block > 1:
            # the key tensor as blocks of key_block rows, each document's from its first: the
            # e4m3 kernel's TMA producer (16- or 8-key boxes) where one-key blocks would run its
            # cp.async producer at half the speed; a document's last block may run into the
            # next one's rows, which its seq_len masks
            blocks = -(-cols // key_block)
            first = cuk[:-1, None] // key_block
            key_index = (first + torch.arange(blocks, device=device)).clamp_(0, total_k // key_block - 1)
    if host_q:
        # host offsets were checked: the kernels write every document token (no memset: it
        # costs ~4 % of a four-document call on an H200)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        # device offsets are not read back (no sync): tokens outside the documents are zeros
        out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    _C.dense_attention(
        q, k, v, key_index.to(torch.int32), qsl, seq_lens, key_limits, mask, impl.softmax_scale, out,
        None, None, None, max_q, None, None, key_block, consecutive, *scales,
    )  # fmt: skip
    return out.view(query.shape)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without synchronising the stream.  A pageable copy
    waits for the GPU to drain, which then idles while the host prepares the launch (on the H200
    four 8190-key documents took ~1 ms longer per call with two such copies: 508-510 against
    559-563 TFLOP/s); a pinned one is queued, and the caching host allocator keeps its staging
    memory until the copy has run."""
    if device.type != "cuda":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():
        # a captured copy would read this host memory again at every replay, long after it
        # was reused
        raise RuntimeError(
            f"{_OP}: host cu_seqlens cannot be captured in a CUDA graph; pass them as device tensors"
        )
    return t.pin_memory().to(device, non_blocking=True)


def _doc_gather(cuk: torch.Tensor, rows: int, total_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed fp8 documents at any offsets (cuk: cu_seqlens_k, int64, on the device; not read
    back): the ``rows`` key rows to gather so that each document starts at a multiple of 16 rows
    -- document d's keys, then copies of its last key up to the next multiple of 16; rows past
    the last document (``rows`` a bound) copy its last key.  Every row lies in [0, total_k), also
    for offsets that are not (their documents' lengths then mask nothing sensible, but nothing
    is read out of range).  Returns the rows and each document's first row there followed by
    their end (both int64, on cuk's device)."""
    lens = (cuk[1:] - cuk[:-1]).clamp(min=0)
    first = torch.cat(
        [torch.zeros(1, dtype=torch.int64, device=cuk.device), ((lens + 15) // 16 * 16).cumsum(0)]
    )
    r = torch.arange(rows, dtype=torch.int64, device=cuk.device)
    doc = torch.searchsorted(first[1:], r, right=True).clamp_(max=lens.shape[0] - 1)
    src = torch.minimum(cuk[:-1][doc] + r - first[:-1][doc], cuk[1:][doc] - 1)
    return src.clamp_(0, max(total_k - 1, 0)), first


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x's rows at index (fp8 gathered as bytes: torch's index_select takes no float8)."""
    return x.view(torch.uint8).index_select(0, index).view(x.dtype)


def _doc_blocks(cu_k: torch.Tensor, total_k: int) -> int:
    """Keys per block of packed documents over fp8 K/V (host offsets): 16 or 8 where every
    document starts at a multiple of it (cu_k but its last entry, the last document's end) and
    the packed keys are a whole number of blocks, else 1 (one key a block)."""
    for block in (16, 8):
        if total_k >= block and total_k % block == 0 and bool((cu_k[:-1] % block == 0).all()):
            return block
    return 1


def _device_offsets(
    cu_q: torch.Tensor, cu_k: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens_q (int32) and cu_seqlens_k (int64) on ``device``; host offsets in one copy."""
    if cu_q.device.type == "cpu" and cu_k.device.type == "cpu":
        both = _to_device(torch.cat([cu_q.to(torch.int64), cu_k.to(torch.int64)]), device)
        n = cu_q.shape[0]
        return both[:n].to(torch.int32), both[n:]
    return cu_q.to(device=device, dtype=torch.int32), cu_k.to(device=device, dtype=torch.int64)


def _joint(impl: Any, query, key, value, meta: Any, extra: dict, fp8: bool) -> torch.Tensor:
    """Joint attention: the concatenation (joint_strategy order) of the joint and the other
    tokens, as if concatenated, from the separate tensors (see the module docstring)."""
    jq, jk, jv = (getattr(meta, n, None) for n in _JOINT_FIELDS)
    if jq is None or jk is None or jv is None:
        given = [n for n, t in zip(_JOINT_FIELDS, (jq, jk, jv), strict=True) if t is not None]
        raise ValueError(
            f"{_OP}: joint_query, joint_key and joint_value must be given together, got only {given}"
        )
    strategy = getattr(meta, "joint_strategy", "front")
    if strategy not in ("front", "rear"):
        raise ValueError(f"{_OP}: joint_strategy must be 'front' or 'rear', got {strategy!r}")
    for name in ("full_attn_spans", "packed_padding"):
        if getattr(meta, name, None) is not None:
            raise NotImplementedError(
                f"{_OP}: {name} together with joint_query/joint_key/joint_value is not supported"
            )
    if extra.get("cu_seqlens_q") is not None or extra.get("cu_seqlens_k") is not None:
        raise NotImplementedError(
            f"{_OP}: cu_seqlens_q/cu_seqlens_k together with joint_query/joint_key/joint_value is "
            "not supported"
        )
    _check_qkv(impl, jq, jk, jv, prefix="joint_")
    if jq.dtype != query.dtype or jq.device != query.device or jq.shape[0] != query.shape[0]:
        raise ValueError(
            f"{_OP}: joint_query must have the query's dtype, device and batch size ({query.dtype}, "
            f"{query.device}, {query.shape[0]}), got {jq.dtype}, {jq.device}, {jq.shape[0]}"
        )
    device = query.device
    batch, s_q, heads, head = query.shape
    s_k, sj_q, sj_k = key.shape[1], jq.shape[1], jk.shape[1]
    keys = _valid_keys(extra, s_k)
    mask = getattr(meta, "attn_mask", None)
    keep = None if mask is None else _key_padding(mask, batch, keys, device)
    jmask = getattr(meta, "joint_attn_mask", None)
    jkeep = None if jmask is None else _key_padding(jmask, batch, sj_k, device, "joint_attn_mask")
    front = strategy == "front"
    n_q, n_k = sj_q + s_q, sj_k + keys  # the concatenated sequences
    out = torch.empty(batch, n_q, heads, head, dtype=query.dtype, device=device)
    if batch == 0 or n_q == 0:
        return out
    # Key j of the concatenated row: an index into key (flattened) or, past B * S_k, joint_key.
    rows = torch.arange(batch, device=device, dtype=torch.int64)[:, None]
    main_index = rows * s_k + torch.arange(keys, device=device, dtype=torch.int64)
    joint_index = batch * s_k + rows * sj_k + torch.arange(sj_k, device=device, dtype=torch.int64)
    parts = (joint_index, main_index) if front else (main_index, joint_index)
    # Without a mask the keys are a set (no position matters): the source that fills whole
    # 128-key tiles goes first, so every tile reads one source's consecutive keys (Hopper: flat
    # TMA boxes; the binding's CONSECUTIVE_TILES) -- or, at head 128, the one that fills whole
    # 16-key chunks, each then 16 consecutive rows of one source from a multiple of 8 when both
    # sources' rows are (Hopper: a TMA box per chunk and 176-key tiles; CONSECUTIVE_CHUNKS).
    unmasked = not impl.causal and keep is None and jkeep is None
    runs = unmasked and (sj_k % 128 == 0 or keys % 128 == 0)
    aligned = s_k % 8 == 0 and sj_k % 8 == 0  # every source row of a chunk from a multiple of 8
    chunks = unmasked and head == 128 and (sj_k % 16 == 0 or keys % 16 == 0) and aligned
    if runs:
        parts = (joint_index, main_index) if sj_k % 128 == 0 else (main_index, joint_index)
    elif chunks:
        parts = (joint_index, main_index) if sj_k % 16 == 0 else (main_index, joint_index)
    key_index = torch.cat(parts, dim=1)
    limits = None
    if impl.causal:  # bottom-right over the concatenated sequence
        pos = torch.arange(n_q, device=device, dtype=torch.int64) + (n_k - n_q + 1)
        limits = pos.clamp(0, n_k).expand(batch, n_q)
    if keep is None and jkeep is None:
        seq_lens = torch.full((batch,), n_k, device=device, dtype=torch.int32)
    else:

        def all_kept(n: int) -> torch.Tensor:
            return torch.ones(batch, n, dtype=torch.bool, device=device)

        kj = all_kept(sj_k) if jkeep is None else jkeep
        km = all_kept(keys) if keep is None else keep
        vkeep = torch.cat((kj, km) if front else (km, kj), dim=1)
        key_index, seq_lens, limits = _kept_first(key_index, vkeep, limits)
    key_index = key_index.to(torch.int32)
    tiles = _C.CONSECUTIVE_TILES if runs else 0
    consecutive = tiles | (_C.CONSECUTIVE_CHUNKS if chunks else 0)
    scales: tuple[torch.Tensor, ...] = ()
    key_block = 1
    if fp8 and n_k > 0:
        # each batch row's concatenated keys rounded into one block of n_k rows (the e4m3
        # kernel's TMA producer; two sources would run its cp.async producer at half speed)
        k, v, scales = _joint_fp8_rows(key[:, :keys], value[:, :keys], jk, jv, front)
        if keep is not None or jkeep is not None:
            # key padding: each row's e4m3 keys gathered kept first.  key_index counts the keys
            # in rows of s_k, then the joint keys after all B * s_k; the buffer holds row b's
            # n_k keys from b * n_k in joint_strategy order
            main_at, joint_at = (sj_k, 0) if front else (0, keys)
            idx = key_index.to(torch.int64)
            jdx = idx - batch * s_k
            sk, sj = max(s_k, 1), max(sj_k, 1)  # the branch not taken divides too
            idx = torch.where(
                jdx >= 0, jdx // sj * n_k + joint_at + jdx % sj, idx // sk * n_k + main_at + idx % sk
            ).reshape(-1)
            k, v = _rows(k, idx), _rows(v, idx)
        k2 = v2 = None
        key_block, consecutive = n_k, _C.CONSECUTIVE_TILES | _C.CONSECUTIVE_SCALES_FROM_KV
        key_index = torch.arange(batch, device=device, dtype=torch.int32)[:, None]
    else:
        k, v, k2, v2 = _key_value(key, value, jk, jv)
    if fp8 and k2 is not None:
        # no keys at all: one scale for K and one for V over both (empty) sources
        (k, v, k2, v2), scales = _quantize_kv(k, v, k2, v2)
        consecutive = tiles | _C.CONSECUTIVE_SCALES_FROM_KV
    # one launch per batch row and query source: [B, S] slices of the output need not flatten
    spans = ((jq, 0), (query, sj_q)) if front else ((query, 0), (jq, s_q))
    # [0, n] filled on the device: no host memory, nothing to synchronise, capturable
    qsl = {n: torch.arange(0, n + 1, n, dtype=torch.int32, device=device) for n in (sj_q, s_q) if n > 0}
    for b in range(batch):
        for src, start in spans:
            n = src.shape[1]
            if n == 0:
                continue
            mask, key_limits = _C.MASK_NONE, None
            if limits is not None:
                mask, key_limits = _C.MASK_LIMITS, limits[b, start : start + n].to(torch.int32).contiguous()
            _C.dense_attention(
                src[b], k, v, key_index[b : b + 1], qsl[n], seq_lens[b : b + 1], key_limits, mask,
                impl.softmax_scale, out[b, start : start + n], None, None, None, n, k2, v2, key_block,
                consecutive, *scales,
            )  # fmt: skip
    return out


def dense_forward(impl: Any, query: Any, key: Any, value: Any, attn_metadata: Any = None) -> torch.Tensor:
    """``DiffKVAttentionImpl.forward``: query ``[B, S_q, H, D]``, key/value ``[B, S_k, Hkv, D]``
    -> ``[B, S_q, H, D]`` (see the module docstring for the metadata honoured)."""
    meta = attn_metadata
    if meta is not None:
        _check_unsupported(meta)
    _check_qkv(impl, query, key, value)
    extra = (getattr(meta, "extra", None) or {}) if meta is not None else {}
    if not isinstance(extra, dict):
        raise TypeError(f"{_OP}: attn_metadata.extra must be a dict, got {type(extra).__name__}")
    fp8 = extra.get("kv_cache_dtype") in _FP8
    if meta is not None and any(getattr(meta, n, None) is not None for n in _JOINT_FIELDS):
        return _joint(impl, query, key, value, meta, extra, fp8)
    if meta is not None and getattr(meta, "joint_attn_mask", None) is not None:
        raise ValueError(f"{_OP}: joint_attn_mask needs joint_query, joint_key and joint_value")
    if extra.get("cu_seqlens_q") is not None or extra.get("cu_seqlens_k") is not None:
        return _varlen(impl, query, key, value, extra, meta, fp8)

    device = query.device
    batch, s_q, heads, head = query.shape
    s_k = key.shape[1]
    keys = _valid_keys(extra, s_k)
    q_real = s_q
    packed = getattr(meta, "packed_padding", None) if meta is not None else None
    if packed is not None:
        q_len, kv_len = getattr(packed, "q_length", None), getattr(packed, "kv_length", None)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (q_len, kv_len)):
            raise TypeError(
                f"{_OP}: packed_padding.q_length and kv_length must be ints, got {q_len!r}, {kv_len!r}"
            )
        if not (0 <= q_len <= s_q and 0 <= kv_len <= keys):
            raise ValueError(
                f"{_OP}: packed_padding must have 0 <= q_length <= {s_q} and 0 <= kv_length <= {keys}, "
                f"got {q_len} and {kv_len}"
            )
        q_real, keys = q_len, kv_len
    keep = None
    if meta is not None and getattr(meta, "attn_mask", None) is not None:
        keep = _key_padding(meta.attn_mask, batch, keys, device)
    spans = getattr(meta, "full_attn_spans", None) if meta is not None else None
    if spans is not None:
        if s_q != keys:
            raise ValueError(f"{_OP}: full_attn_spans need S_q == S_k (self-attention), got {s_q} and {keys}")
        span_limits = _spans_limits(spans, batch, s_q, device)  # validates them in any layer
    if keys == 0 or s_q == 0 or batch == 0:
        return query.new_zeros(query.shape)  # no key visible to any query (or no query)

    # Exclusive key limit of every query in original key positions (None: the whole row).
    limits = None
    if impl.causal:
        if spans is not None:
            limits = span_limits
        else:
            # bottom-right over the real queries (all of them without packed_padding)
            pos = torch.arange(s_q, device=device, dtype=torch.int64) + (keys - q_real + 1)
            limits = pos.clamp(0, keys).expand(batch, s_q)
    if q_real < s_q:
        if limits is None:
            limits = torch.full((batch, s_q), keys, device=device, dtype=torch.int64)
        limits = limits.clone()
        limits[:, q_real:] = 0  # pad queries see nothing: zeros

    rows = torch.arange(batch, device=device, dtype=torch.int64)[:, None] * s_k
    key_block, consecutive = 1, 0
    gather = None  # fp8 with key padding: the key rows to copy, in their new order
    if keep is None:
        # each batch row's keys are s_k / key_block in-order blocks (_row_blocks)
        key_block = _row_blocks(s_k, head, device, fp8)
        per_row = s_k // key_block
        key_index = rows // key_block + torch.arange(per_row, device=device, dtype=torch.int64)
        seq_lens = torch.full((batch,), keys, device=device, dtype=torch.int32)
        consecutive = _C.CONSECUTIVE_TILES
    elif fp8:
        # each row's e4m3 keys gathered kept first into one block of `keys` rows, which the
        # e4m3 kernel's TMA producer takes (one-key blocks would run its cp.async producer at
        # half the speed)
        gather = rows + torch.arange(keys, device=device, dtype=torch.int64)
        gather, seq_lens, limits = _kept_first(gather, keep, limits)
        key_block = keys
        key_index = torch.arange(batch, device=device, dtype=torch.int64)[:, None]
    else:
        key_index = rows + torch.arange(keys, device=device, dtype=torch.int64)
        key_index, seq_lens, limits = _kept_first(key_index, keep, limits)

    if limits is None:
        mask, key_limits = _C.MASK_NONE, None
    elif impl.causal and spans is None and keep is None and q_real == s_q:
        mask, key_limits = _C.MASK_CAUSAL, None
    else:
        mask, key_limits = _C.MASK_LIMITS, limits.reshape(-1).to(torch.int32)
    q = _flat(query)
    k, v = _key_value(key, value)
    scales: tuple[torch.Tensor, ...] = ()
    if fp8:
        (k, v), scales = _quantize_kv(k, v)
        if gather is not None:
            gather = gather.reshape(-1)
            k, v = _rows(k, gather), _rows(v, gather)
            consecutive = _C.CONSECUTIVE_TILES
        consecutive |= _C.CONSECUTIVE_SCALES_FROM_KV
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    qsl = torch.arange(batch + 1, device=device, dtype=torch.int32) * s_q
    _C.dense_attention(
        q, k, v, key_index.to(torch.int32), qsl, seq_lens, key_limits, mask, impl.softmax_scale, out,
        None, None, None, s_q, None, None, key_block, consecutive, *scales,
    )  # fmt: skip
    return out.view(batch, s_q, heads, head)
