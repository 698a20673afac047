"""Dense (non-paged) attention: ``DiffKVAttentionImpl.forward`` (diffkv.dense) against a float64
reference with the explicit boolean mask, for every AttentionMetadata field the backend
honours and their combinations, on CPU and (``-m gpu``) CUDA; the capability answers; and the
fields it refuses, by name."""

from __future__ import annotations

import pytest
import torch

import diffkv
from diffkv import _C
from diffkv.backends.abstract import AttentionMetadata, PackedPaddingMetadata, QueryRange
from diffkv.backends.diffkv import DiffKVAttentionBackend
from reference import e4m3_rows, e4m3_tensor, mask_causal, mask_spans, ref_attention

H, HKV = 8, 2
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _impl(head=64, causal=False, scale=None):
    return diffkv.DiffKVAttentionImpl(
        H, head, softmax_scale=scale if scale is not None else head**-0.5, causal=causal, num_kv_heads=HKV
    )


def _qkv(b, sq, sk, head, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, H, head, generator=g).to(dtype)
    k = torch.randn(b, sk, HKV, head, generator=g).to(dtype)
    v = torch.randn(b, sk, HKV, head, generator=g).to(dtype)
    return q.to(device), k.to(device), v.to(device)


def _causal(b, sq, sk):
    """Bottom-right causal: query i sees keys j <= i + sk - sq."""
    return mask_causal(range(sk - sq, sk), sk).expand(b, sq, sk)


def _close(out, ref, dtype):
    err = (out.detach().cpu().double() - ref).abs().max().item()
    assert err <= ATOL[dtype], f"max error {err:.3g} > {ATOL[dtype]}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 37, 37), (1, 130, 300), (3, 200, 77)])
@pytest.mark.parametrize("head", [64, 128])
def test_plain_and_causal(device, dtype, causal, shape, head):
    b, sq, sk = shape
    q, k, v = _qkv(b, sq, sk, head, dtype, device, seed=sq + sk)
    impl = _impl(head, causal)
    out = impl.forward(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    visible = _causal(b, sq, sk) if causal else torch.ones(b, sq, sk, dtype=torch.bool)
    _close(out, ref_attention(q, k, v, visible, impl.softmax_scale), dtype)
    # metadata with nothing set is the same call
    assert torch.equal(impl.forward(q, k, v, AttentionMetadata()), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("four_d", [False, True])
def test_key_padding_mask_any_pattern(device, dtype, causal, four_d):
    """Scattered kept keys (not only a suffix of padding), one row keeping no key at all."""
    b, sq, sk = 3, 90, 150
    q, k, v = _qkv(b, sq, sk, 64, dtype, device, seed=3)
    g = torch.Generator().manual_seed(11)
    keep = torch.rand(b, sk, generator=g) < 0.6
    keep[1, 100:] = False  # suffix padding too
    keep[2] = False  # nothing to attend to: zeros
    mask = keep[:, None, None, :] if four_d else keep
    impl = _impl(64, causal)
    out = impl.forward(q, k, v, AttentionMetadata(attn_mask=mask.to(device)))
    visible = keep[:, None, :].expand(b, sq, sk)
    if causal:
        visible = visible & _causal(b, sq, sk)
    _close(out, ref_attention(q, k, v, visible, impl.softmax_scale), dtype)
    assert (out[2] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_valid_kv_length_with_and_without_mask(device, causal):
    b, sq, sk, valid = 2, 64, 160, 97
    q, k, v = _qkv(b, sq, sk, 64, torch.float32, device, seed=5)
    impl = _impl(64, causal)
    out = impl.forward(q, k, v, AttentionMetadata(extra={"valid_kv_length": valid}))
    visible = torch.zeros(b, sq, sk, dtype=torch.bool)
    visible[:, :, :valid] = _causal(b, sq, valid) if causal else True
    _close(out, ref_attention(q, k, v, visible, impl.softmax_scale), torch.float32)
    # the same as slicing K/V by hand
    sliced = impl.forward(q, k[:, :valid], v[:, :valid])
    assert torch.allclose(out, sliced, atol=1e-6)
    keep = torch.ones(b, sk, dtype=torch.bool)
    keep[0, 10:20] = False
    masked = impl.forward(
        q, k, v, AttentionMetadata(attn_mask=keep.to(device), extra={"valid_kv_length": valid})
    )
    visible2 = visible & keep[:, None, :]
    if causal:
        # positions are original ones; the mask removes keys inside the causal window
        visible2 = keep[:, None, :valid].expand(b, sq, valid) & _causal(b, sq, valid)
        visible2 = torch.cat([visible2, torch.zeros(b, sq, sk - valid, dtype=torch.bool)], dim=2)
    _close(masked, ref_attention(q, k, v, visible2, impl.softmax_scale), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cu_on_cpu", [True, False])
def test_packed_varlen_documents_stay_apart(device, dtype, causal, cu_on_cpu):
    lens_q, lens_k = [50, 130, 7, 64], [50, 130, 7, 64]
    if not causal:
        lens_k = [80, 10, 33, 64]  # cross-length documents
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = _qkv(1, tq, tk, 64, dtype, device, seed=8)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    cu_dev = "cpu" if cu_on_cpu else device
    extra = {
        "cu_seqlens_q": cu_q.to(cu_dev),
        "cu_seqlens_k": cu_k.to(cu_dev),
        "max_seqlen_q": max(lens_q),
        "max_seqlen_k": max(lens_k),
    }
    impl = _impl(64, causal)
    out = impl.forward(q, k, v, AttentionMetadata(extra=extra))
    if device.type == "cuda" and dtype != torch.float32 and _C.build_info()["attention_kernel"] == "sm90-tma":
        # each document's keys are one run of rows: TMA boxes of the key tensor's flat map
        assert _C.last_attention_kernel() == "sm90-tma"
    visible = torch.zeros(1, tq, tk, dtype=torch.bool)
    for r in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
        block = _causal(1, q1 - q0, k1 - k0)[0] if causal else True
        visible[0, q0:q1, k0:k1] = block
    _close(out, ref_attention(q, k, v, visible, impl.softmax_scale), dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_varlen_with_spans(device, causal):
    """full_attn_spans over a packed varlen row: within each document causal outside the spans and
    full inside (a span crossing a document boundary stops at it); a non-causal layer ignores
    them; documents never see each other."""
    lens = [50, 130, 7, 64]
    total = sum(lens)
    q, k, v = _qkv(1, total, total, 64, torch.float32, device, seed=31)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    spans = [(10, 30), (40, 90), (181, 187), (200, 251)]  # (40, 90) crosses documents 0 and 1
    extra = {"cu_seqlens_q": cu.to(device), "cu_seqlens_k": cu.to(device)}
    impl = _impl(64, causal)
    out = impl.forward(q, k, v, AttentionMetadata(extra=extra, full_attn_spans=[spans]))
    visible = torch.zeros(1, total, total, dtype=torch.bool)
    limit = torch.arange(1, total + 1)
    for s, e in spans:
        limit[s:e] = e
    for r in range(len(lens)):
        a, b = int(cu[r]), int(cu[r + 1])
        for t in range(a, b):
            visible[0, t, a : (min(int(limit[t]), b) if causal else b)] = True
    _close(out, ref_attention(q, k, v, visible, impl.softmax_scale), torch.float32)
    if causal:
        other = torch.tensor([0, 50, 180, 187, 250], dtype=torch.int32)
        _raises(
            ValueError,
            "DiffKVAttentionImpl.forward(): full_attn_spans with cu_seqlens need cu_seqlens_q == "
            "cu_seqlens_k (self-attention documents)",
            lambda: impl.forward(
                q,
                k,
                v,
                AttentionMetadata(extra={"cu_seqlens_q": cu, "cu_seqlens_k": other}, full_attn_spans=[spans]),
            ),
        )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spans", [False, True])
@pytest.mark.parametrize(
    ("lens", "tail"),
    [
        ([264, 136, 16, 520], 8),  # keys from multiples of 8: a TMA box per 16-key chunk on Hopper
        ([200, 61, 83], 0),  # documents from any row: the flat boxes
    ],
)
def test_packed_varlen_head128_chunks(device, causal, spans, lens, tail):
    """Packed documents at head 128 (bf16, host cu_seqlens): documents whose keys start at
    multiples of 8 rows in a key tensor of a multiple of 8 rows take one TMA box per 16-key
    chunk on an H200 ('sm90-tma16'), others the flat boxes ('sm90-tma'); causal, spans and the
    NaN-filled keys past the last document (a document's last chunk reads into them) change
    nothing but the visible keys."""
    dtype = torch.bfloat16
    total = sum(lens)
    q, k, v = _qkv(1, total, total + tail, 128, dtype, device, seed=47)
    k[:, total:] = float("nan")
    v[:, total:] = float("nan")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    span_list = [(10, 40), (190, 270), (300, 330)] if spans else None  # (190, 270) crosses documents
    impl = _impl(128, causal)
    meta = AttentionMetadata(
        extra={"cu_seqlens_q": cu, "cu_seqlens_k": cu},
        full_attn_spans=None if span_list is None else [span_list],
    )
    out = impl.forward(q, k, v, meta)
    if device.type == "cuda" and _C.build_info()["attention_kernel"] == "sm90-tma":
        assert _C.last_attention_kernel() == ("sm90-tma16" if tail else "sm90-tma")
    limit = torch.arange(1, total + 1)
    for s, e in span_list or []:
        limit[s:e] = e
    visible = torch.zeros(1, total, total, dtype=torch.bool)
    for r in range(len(lens)):
        a, b = int(cu[r]), int(cu[r + 1])
        for t in range(a, b):
            visible[0, t, a : (min(int(limit[t]), b) if causal else b)] = True
    _close(out, ref_attention(q, k[:, :total], v[:, :total], visible, impl.softmax_scale), dtype)


@pytest.mark.parametrize(
    ("cu_q", "cu_k", "message"),
    [
        ([0, 12, 8, 20], [0, 6, 12, 20], "extra['cu_seqlens_q'] must be non-decreasing, got [0, 12, 8, 20]"),
        ([0, 10, 20], [0, 10, 24], None),
        ([0, 10, 20], [0, 12, 8], None),
        ([0, 10, 20], [-1, 10, 20], None),
    ],
)
def test_packed_varlen_host_offsets_checked(device, cu_q, cu_k, message):
    """Host cu_seqlens are checked before anything runs: query offsets non-decreasing, key
    offsets non-decreasing inside the packed key tokens (a document past them would read other
    keys in its place on the GPU, whose device metadata is trusted)."""
    q, k, v = _qkv(1, 20, 20, 64, torch.float32, device, seed=48)
    if message is None:
        message = (
            "extra['cu_seqlens_k'] must be non-decreasing offsets into the 20 packed key tokens "
            f"(0 <= cu_seqlens_k[0], cu_seqlens_k[-1] <= 20), got {cu_k}"
        )
    extra = {
        "cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32),
        "cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int64),
    }
    _raises(
        ValueError,
        f"DiffKVAttentionImpl.forward(): {message}",
        lambda: _impl(64).forward(q, k, v, AttentionMetadata(extra=extra)),
    )


def test_packed_padding_mask_free(device):
    b, s = 2, 96
    q, k, v = _qkv(b, s, s, 64, torch.float32, device, seed=9)
    pp = PackedPaddingMetadata(
        q_length=70,
        kv_length=70,
        cu_seqlens_q=torch.tensor([0, 70], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 70], dtype=torch.int32),
    )
    for causal in (False, True):
        impl = _impl(64, causal)
        out = impl.forward(q, k, v, AttentionMetadata(packed_padding=pp))
        visible = torch.zeros(b, s, s, dtype=torch.bool)
        visible[:, :70, :70] = _causal(b, 70, 70) if causal else True
        _close(out, ref_attention(q, k, v, visible, impl.softmax_scale), torch.float32)
        assert (out[:, 70:] == 0).all()


def _span_visible(b, s, spans):
    pos = torch.arange(s)
    visible = torch.zeros(b, s, s, dtype=torch.bool)
    for r in range(b):
        limit = pos + 1
        for a, e in spans[r]:
            limit = torch.where((pos >= a) & (pos < e), torch.tensor(e), limit)
        visible[r] = pos[None, :] < limit[:, None]
    return visible


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_mask", [False, True])
def test_full_attn_spans_piecewise(device, dtype, with_mask):
    b, s = 2, 300
    spans = [[(20, 140), (200, 260)], [(0, 50)]]
    q, k, v = _qkv(b, s, s, 128, dtype, device, seed=12)
    impl = _impl(128, causal=True)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, 30:45] = False
    meta = AttentionMetadata(full_attn_spans=spans, attn_mask=keep.to(device) if with_mask else None)
    out = impl.forward(q, k, v, meta)
    visible = _span_visible(b, s, spans)
    if with_mask:
        visible = visible & keep[:, None, :]
    _close(out, ref_attention(q, k, v, visible, impl.softmax_scale), dtype)
    # a non-causal layer attends to everything: the spans change nothing
    full = _impl(128, causal=False)
    assert torch.equal(full.forward(q, k, v, AttentionMetadata(full_attn_spans=spans)), full.forward(q, k, v))


def test_strided_inputs_from_a_fused_projection(device):
    """q/k/v as views of one [B, S, H + 2 Hkv, D] projection, and V with other strides than K."""
    b, s, head = 2, 70, 64
    g = torch.Generator().manual_seed(4)
    fused = torch.randn(b, s, H + 2 * HKV, head, generator=g).to(device)
    q, k, v = fused[:, :, :H], fused[:, :, H : H + HKV], fused[:, :, H + HKV :]
    impl = _impl(head, causal=True)
    out = impl.forward(q, k, v)
    ref = ref_attention(q, k, v, _causal(b, s, s), impl.softmax_scale)
    _close(out, ref, torch.float32)
    out2 = impl.forward(q, k, v.contiguous())
    _close(out2, ref, torch.float32)


def test_capabilities_are_true_and_honoured():
    backend = DiffKVAttentionBackend
    assert backend.supports_attention_mask() is True
    assert backend.supports_attention_mask(object()) is True
    assert backend.supports_packed_mask_free() is True
    assert backend.supports_multi_doc_packed_varlen() is True
    assert backend.supports_prefix_kv_slicing is True
    assert backend.supports_piecewise_spans is True
    assert backend.accept_output_buffer is False  # forward allocates its output
    # head sizes per device: test_forward_paged.py, test_backend_class


def _raises(exc, text, fn):
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value) == text


def test_refused_fields_are_named():
    impl = _impl(64)
    q, k, v = _qkv(1, 4, 4, 64, torch.float32, "cpu")
    op = "DiffKVAttentionImpl.forward()"
    jq, jk, jv = _qkv(1, 2, 2, 64, torch.float32, "cpu", seed=5)
    joint = {"joint_query": jq, "joint_key": jk, "joint_value": jv}
    for name in ("full_attn_spans", "packed_padding"):
        cu = torch.tensor([0, 4], dtype=torch.int32)
        value = [[(0, 2)]] if name == "full_attn_spans" else PackedPaddingMetadata(4, 4, cu, cu)
        _raises(
            NotImplementedError,
            f"{op}: {name} together with joint_query/joint_key/joint_value is not supported",
            lambda name=name, value=value: impl.forward(q, k, v, AttentionMetadata(**joint, **{name: value})),
        )
    _raises(
        ValueError,
        f"{op}: joint_query, joint_key and joint_value must be given together, got only ['joint_query']",
        lambda: impl.forward(q, k, v, AttentionMetadata(joint_query=jq)),
    )
    _raises(
        ValueError,
        f"{op}: joint_strategy must be 'front' or 'rear', got 'middle'",
        lambda: impl.forward(q, k, v, AttentionMetadata(**joint, joint_strategy="middle")),
    )
    cu4 = torch.tensor([0, 4], dtype=torch.int32)
    _raises(
        NotImplementedError,
        f"{op}: cu_seqlens_q/cu_seqlens_k together with joint_query/joint_key/joint_value is not supported",
        lambda: impl.forward(
            q, k, v, AttentionMetadata(**joint, extra={"cu_seqlens_q": cu4, "cu_seqlens_k": cu4})
        ),
    )
    jq2 = jq.expand(2, *jq.shape[1:])
    _raises(
        ValueError,
        f"{op}: joint_query must have the query's dtype, device and batch size (torch.float32, cpu, 1), "
        "got torch.float32, cpu, 2",
        lambda: impl.forward(
            q,
            k,
            v,
            AttentionMetadata(
                joint_query=jq2,
                joint_key=jk.expand(2, *jk.shape[1:]),
                joint_value=jv.expand(2, *jv.shape[1:]),
            ),
        ),
    )
    _raises(
        ValueError,
        f"{op}: joint_attn_mask needs joint_query, joint_key and joint_value",
        lambda: impl.forward(q, k, v, AttentionMetadata(joint_attn_mask=torch.ones(1, 2, dtype=torch.bool))),
    )
    _raises(
        ValueError,
        f"{op}: joint_key and joint_value must have shape [B, S_k, {HKV}, 64] (equal), got (1, 2, 2, 64) "
        "and (1, 3, 2, 64)",
        lambda: impl.forward(
            q,
            k,
            v,
            AttentionMetadata(joint_query=jq, joint_key=jk, joint_value=jv[:, :1].expand(1, 3, HKV, 64)),
        ),
    )
    _raises(
        NotImplementedError,
        f"{op}: query_ranges is not supported by the DIFFKV backend",
        lambda: impl.forward(q, k, v, AttentionMetadata(query_ranges=(QueryRange(0, 4, 0),))),
    )
    _raises(
        NotImplementedError,
        f"{op}: attn_mask must be boolean (True = attend); additive float masks are not supported, got "
        "torch.float32",
        lambda: impl.forward(q, k, v, AttentionMetadata(attn_mask=torch.zeros(1, 4))),
    )
    _raises(
        NotImplementedError,
        f"{op}: attn_mask must be a key-padding mask [B, S_k] or [B, 1, 1, S_k]; per-head or per-query "
        "masks are not supported, got shape (1, 1, 4, 4)",
        lambda: impl.forward(q, k, v, AttentionMetadata(attn_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))),
    )
    _raises(
        NotImplementedError,
        f"{op}: extra['kv_cache_dtype'] must be unquantized (['auto', 'float32', 'float', 'float16', "
        "'half', 'bfloat16']) or ['fp8', 'fp8_e4m3'] (float8_e4m3fn K/V), got 'fp8_e5m2'",
        lambda: impl.forward(q, k, v, AttentionMetadata(extra={"kv_cache_dtype": "fp8_e5m2"})),
    )
    cu = torch.tensor([0, 4], dtype=torch.int32)
    _raises(
        NotImplementedError,
        f"{op}: attn_mask together with cu_seqlens_q/cu_seqlens_k is not supported",
        lambda: impl.forward(
            q,
            k,
            v,
            AttentionMetadata(
                attn_mask=torch.ones(1, 4, dtype=torch.bool), extra={"cu_seqlens_q": cu, "cu_seqlens_k": cu}
            ),
        ),
    )


def test_bad_inputs_raise_before_anything_runs():
    impl = _impl(64, causal=True)
    q, k, v = _qkv(2, 4, 4, 64, torch.float32, "cpu")
    op = "DiffKVAttentionImpl.forward()"
    _raises(
        ValueError,
        f"{op}: query must be 4-D [B, S, heads, head_size], got shape (4, 8, 64)",
        lambda: impl.forward(q[0], k, v),
    )
    _raises(
        ValueError,
        f"{op}: query must have [{H}, 64] heads x head_size, got [4, 64]",
        lambda: impl.forward(q[:, :, :4], k, v),
    )
    _raises(
        TypeError,
        f"{op}: key and value must have the query's dtype torch.float32, got torch.bfloat16, torch.float32",
        lambda: impl.forward(q, k.bfloat16(), v),
    )
    _raises(
        ValueError,
        f"{op}: key and value must have shape [B, S_k, {HKV}, 64] (equal), got (2, 4, 2, 64) and "
        "(2, 3, 2, 64)",
        lambda: impl.forward(q, k, v[:, :3]),
    )
    _raises(
        ValueError,
        f"{op}: extra['valid_kv_length'] must be in [0, 4], got 5",
        lambda: impl.forward(q, k, v, AttentionMetadata(extra={"valid_kv_length": 5})),
    )
    _raises(
        ValueError,
        f"{op}: full_attn_spans[0] must hold (start, end) int pairs with 0 <= start < end <= 4, got (3, 9)",
        lambda: impl.forward(q, k, v, AttentionMetadata(full_attn_spans=[[(3, 9)], []])),
    )
    _raises(
        ValueError,
        f"{op}: full_attn_spans need S_q == S_k (self-attention), got 4 and 3",
        lambda: impl.forward(q, k[:, :3], v[:, :3], AttentionMetadata(full_attn_spans=[[], []])),
    )
    _raises(
        ValueError,
        f"{op}: attn_mask must have shape [B=2, S_k>=4] or [B, 1, 1, S_k], got (2, 3)",
        lambda: impl.forward(q, k, v, AttentionMetadata(attn_mask=torch.ones(2, 3, dtype=torch.bool))),
    )


def _one_row_binding(key_index):
    """dense_attention's inputs for one row of 3 queries (2 heads x 4) over 4 keys (1 KV head):
    q, k, key_index (int32), query_start_loc, seq_lens, a zeroed output."""
    q = torch.randn(3, 2, 4)
    k = torch.randn(4, 1, 4)
    index = torch.tensor(key_index, dtype=torch.int32)
    return (
        q,
        k,
        index,
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        torch.zeros(3, 2, 4),
    )


def test_dense_attention_binding_checks_key_index():
    q, k, index, qsl, sl, out = _one_row_binding([[0, 9, 1]])
    _raises(
        ValueError,
        "dense_attention(): key_index[0][1] must be in [0, num_keys=4), got 9",
        lambda: _C.dense_attention(
            q, k, k.clone(), index, qsl, sl, None, 0, 0.5, out, None, None, None, 0, None, None, 1, 0
        ),
    )
    assert (out == 0).all()
    _raises(
        ValueError,
        "dense_attention(): seq_lens[0] must be in [0, 3] (key_index columns), got 4",
        lambda: _C.dense_attention(
            q,
            k,
            k.clone(),
            index,
            qsl,
            torch.tensor([4], dtype=torch.int32),
            None,
            0,
            0.5,
            out,
            None,
            None,
            None,
            0,
            None,
            None,
            1,
            0,
        ),
    )
    _raises(
        ValueError,
        "dense_attention(): key_block must be >= 1 and divide the 4 key tokens (1 with joint_key), got 3",
        lambda: _C.dense_attention(
            q, k, k.clone(), index, qsl, sl, None, 0, 0.5, out, None, None, None, 0, None, None, 3, 0
        ),
    )
    _raises(
        ValueError,
        "dense_attention(): consecutive must be 0 to 7 (bits 1, 2 and 4), got 8",
        lambda: _C.dense_attention(
            q, k, k.clone(), index, qsl, sl, None, 0, 0.5, out, None, None, None, 0, None, None, 1, 8
        ),
    )
    _raises(
        TypeError,
        "dense_attention(): consecutive must be an int, got True",
        lambda: _C.dense_attention(
            q, k, k.clone(), index, qsl, sl, None, 0, 0.5, out, None, None, None, 0, None, None, 1, True
        ),
    )
    assert (out == 0).all()
    # blocks of 2 keys: key_index [[1, 0]] reads keys 2, 3, 0, 1 (3 of them visible)
    k4 = torch.randn(4, 1, 4)
    v4 = torch.randn(4, 1, 4)
    blocks = torch.tensor([[1, 0]], dtype=torch.int32)
    got = torch.zeros(3, 2, 4)
    _C.dense_attention(q, k4, v4, blocks, qsl, sl, None, 0, 0.5, got, None, None, None, 0, None, None, 2, 0)
    want = torch.zeros(3, 2, 4)
    _C.dense_attention(
        q, k4, v4, torch.tensor([[2, 3, 0]], dtype=torch.int32), qsl, sl, None, 0, 0.5, want, None, None,
        None, 0, None, None, 1, 0,
    )  # fmt: skip
    torch.testing.assert_close(got, want)


def test_dense_attention_binding_checks_joint_keys():
    q, k, index, qsl, sl, out = _one_row_binding([[0, 4, 1]])
    jk = torch.randn(2, 1, 4)

    def call(joint_key, joint_value):
        _C.dense_attention(
            q,
            k,
            k.clone(),
            index,
            qsl,
            sl,
            None,
            0,
            0.5,
            out,
            None,
            None,
            None,
            0,
            joint_key,
            joint_value,
            1,
            0,
        )

    _raises(
        TypeError,
        "dense_attention(): joint_key and joint_value must both be tensors or both be None",
        lambda: call(jk, None),
    )
    _raises(
        ValueError,
        "dense_attention(): joint_value must have shape [num_joint, 1, 4] (joint_value: joint_key's) and "
        "the key's strides [4, 4, 1], got shape [2, 1, 4] strides [8, 8, 1]",
        lambda: call(jk, torch.randn(2, 1, 8)[:, :, :4]),
    )
    assert (out == 0).all()
    call(jk, jk.clone())  # key index 4 is joint token 0
    assert torch.isfinite(out).all() and (out != 0).any()


def test_varlen_max_seqlen_k_below_a_document_is_an_error():
    impl = _impl(64)
    q, k, v = _qkv(1, 10, 10, 64, torch.float32, "cpu")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    extra = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 6, "max_seqlen_k": 3}
    _raises(
        ValueError,
        "DiffKVAttentionImpl.forward(): extra['max_seqlen_k']=3 is below the longest key document",
        lambda: impl.forward(q, k, v, AttentionMetadata(extra=extra)),
    )


def _joint_reference(impl, q, k, v, jq, jk, jv, front, keep=None, jkeep=None, valid=None):
    """float64 attention of the concatenated sequences (SDPA's view of joint attention)."""
    if valid is not None:
        k, v = k[:, :valid], v[:, :valid]
        keep = None if keep is None else keep[:, :valid]
    cat = lambda a, b: torch.cat((b, a) if front else (a, b), dim=1)  # noqa: E731
    qq, kk, vv = cat(q.cpu(), jq.cpu()), cat(k.cpu(), jk.cpu()), cat(v.cpu(), jv.cpu())
    b, n_q, n_k = qq.shape[0], qq.shape[1], kk.shape[1]
    ones = lambda n: torch.ones(b, n, dtype=torch.bool)  # noqa: E731
    kv_keep = cat(
        ones(k.shape[1]) if keep is None else keep.cpu(), ones(jk.shape[1]) if jkeep is None else jkeep.cpu()
    )
    visible = kv_keep[:, None, :].expand(b, n_q, n_k)
    if impl.causal:
        visible = visible & _causal(b, n_q, n_k)
    return ref_attention(qq, kk, vv, visible, impl.softmax_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", ["front", "rear"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masks", ["none", "key", "joint", "both"])
@pytest.mark.parametrize("head", [64, 128])
def test_joint_attention(device, dtype, strategy, causal, masks, head):
    """joint_query/key/value (front or rear) equal the attention of the concatenated sequences,
    with key padding on either part, two CFG rows, GQA; nothing concatenated is passed in.  On
    an H200, bf16 head 128 runs the warp-specialized kernel, head 64 the cp.async one."""
    b, sq, sk, sj = 2, 70, 90, 23
    q, k, v = _qkv(b, sq, sk, head, dtype, device, seed=11)
    jq, jk, jv = _qkv(b, sj, sj, head, dtype, device, seed=12)
    g = torch.Generator().manual_seed(13)
    keep = jkeep = None
    if masks in ("key", "both"):
        keep = torch.rand(b, sk, generator=g) < 0.7
        keep[1, :5] = False
    if masks in ("joint", "both"):
        jkeep = torch.rand(b, sj, generator=g) < 0.6
        jkeep[0, -3:] = False
    impl = _impl(head, causal)
    meta = AttentionMetadata(
        joint_query=jq,
        joint_key=jk,
        joint_value=jv,
        joint_strategy=strategy,
        attn_mask=None if keep is None else keep.to(device),
        joint_attn_mask=None if jkeep is None else jkeep.to(device),
    )
    out = impl.forward(q, k, v, meta)
    assert out.shape == (b, sj + sq, H, head) and out.dtype == dtype and out.device == q.device
    ref = _joint_reference(impl, q, k, v, jq, jk, jv, strategy == "front", keep, jkeep)
    _close(out, ref, dtype)


@pytest.mark.parametrize("strategy", ["front", "rear"])
def test_joint_attention_valid_kv_length_and_strided_joint(device, strategy):
    """valid_kv_length slices the image keys only; a joint K/V with other strides than the
    image K/V (views of a fused projection) still reads right; joint text shorter than the
    image queries; query and joint query of different lengths."""
    b, sq, sk, sj, head = 1, 40, 60, 9, 128
    q, k, v = _qkv(b, sq, sk, head, torch.float32, device, seed=21)
    g = torch.Generator().manual_seed(22)
    qkv = torch.randn(b, sj, H + 2 * HKV, head, generator=g).to(device)
    jq, jk, jv = qkv[:, :, :H], qkv[:, :, H : H + HKV], qkv[:, :, H + HKV :]
    impl = _impl(head, causal=False)
    meta = AttentionMetadata(
        joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy=strategy, extra={"valid_kv_length": 33}
    )
    out = impl.forward(q, k, v, meta)
    ref = _joint_reference(impl, q, k, v, jq, jk, jv, strategy == "front", valid=33)
    _close(out, ref, torch.float32)


@pytest.mark.parametrize("strategy", ["front", "rear"])
@pytest.mark.parametrize(("sj", "sk"), [(128, 300), (23, 256), (128, 256)])
@pytest.mark.parametrize("head", [64, 128])
def test_joint_attention_whole_tile_sources(device, strategy, sj, sk, head):
    """Non-causal joint attention without masks whose joint or image keys fill whole 128-key
    tiles: that source's keys go first (the result does not depend on the keys' order), every
    tile reads one source's consecutive keys, and on an H200 the bf16 call takes TMA boxes from
    both sources' flat maps.  Two CFG rows, GQA, joint shorter or longer than the image."""
    b, sq = 2, 70
    dtype = torch.bfloat16
    q, k, v = _qkv(b, sq, sk, head, dtype, device, seed=41)
    jq, jk, jv = _qkv(b, sj, sj, head, dtype, device, seed=42)
    impl = _impl(head, causal=False)
    meta = AttentionMetadata(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy=strategy)
    out = impl.forward(q, k, v, meta)
    if device.type == "cuda" and _C.build_info()["attention_kernel"] == "sm90-tma":
        # head 128 with both sources' rows multiples of 8: a TMA box per 16-key chunk
        chunks = head == 128 and sj % 8 == 0 and sk % 8 == 0
        assert _C.last_attention_kernel() == ("sm90-tma16" if chunks else "sm90-tma")
    _close(out, _joint_reference(impl, q, k, v, jq, jk, jv, strategy == "front"), dtype)


@pytest.mark.parametrize("strategy", ["front", "rear"])
@pytest.mark.parametrize(
    ("b", "sj", "sk", "valid"),
    [
        (2, 48, 264, None),  # joint first (16 n keys), the image's last chunk half past the row
        (2, 40, 272, None),  # the image first: the joint's last chunk ends the row
        (1, 32, 16392, None),  # rows of 16384+ keys: 176-key tiles
        (2, 32, 520, 296),  # valid_kv_length: the image's run ends mid-chunk, before its rows do
        (3, 16, 8, None),  # rows of 24 keys: one tile, the image half a chunk
    ],
)
def test_joint_attention_chunks(device, strategy, b, sj, sk, valid):
    """Non-causal joint attention without masks at head 128 whose sources' token rows are
    multiples of 8 and one of whose key counts is a multiple of 16: that source goes first and
    every 16 keys of a row are consecutive rows of one source from a multiple of 8, so on an
    H200 the bf16 call takes one TMA box per 16-key chunk from each source's own map
    ('sm90-tma16'); a row's last chunk may reach past its keys (masked in K, zeroed in V)."""
    dtype = torch.bfloat16
    q, k, v = _qkv(b, 37, sk, 128, dtype, device, seed=43)
    jq, jk, jv = _qkv(b, sj, sj, 128, dtype, device, seed=44)
    impl = _impl(128, causal=False)
    extra = {} if valid is None else {"valid_kv_length": valid}
    meta = AttentionMetadata(
        joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy=strategy, extra=extra
    )
    out = impl.forward(q, k, v, meta)
    if device.type == "cuda" and _C.build_info()["attention_kernel"] == "sm90-tma":
        assert _C.last_attention_kernel() == "sm90-tma16"
    ref = _joint_reference(impl, q, k, v, jq, jk, jv, strategy == "front", valid=valid)
    _close(out, ref, dtype)


@pytest.mark.parametrize("first", [0, 5])
def test_packed_varlen_tokens_outside_documents(device, first):
    """Host cu_seqlens_q must cover every packed query token (a ValueError naming it, before
    anything runs); device ones are not read back, and tokens before cu_seqlens_q[0] or past
    cu_seqlens_q[-1] come back as zeros, also when the output's memory last held NaN (the
    allocator hands the freed block of the same size back)."""
    lens = [40, 9, 70]
    total = first + sum(lens) + 11
    q, k, v = _qkv(1, total, total, 64, torch.float32, device, seed=12)
    cu = torch.tensor([first, *(first + torch.tensor(lens).cumsum(0)).tolist()], dtype=torch.int32)
    impl = _impl(64, False)
    _raises(
        ValueError,
        f"DiffKVAttentionImpl.forward(): extra['cu_seqlens_q'] must run from 0 to the {total} packed "
        f"query tokens, got {first} .. {int(cu[-1])}",
        lambda: impl.forward(q, k, v, AttentionMetadata(extra={"cu_seqlens_q": cu, "cu_seqlens_k": cu})),
    )
    if device.type == "cpu":
        return
    poison = torch.full_like(q[0], float("nan"))
    del poison
    cu_dev = cu.to(device)
    out = impl.forward(q, k, v, AttentionMetadata(extra={"cu_seqlens_q": cu_dev, "cu_seqlens_k": cu_dev}))
    assert not out.isnan().any()
    assert (out[0, :first] == 0).all() and (out[0, int(cu[-1]) :] == 0).all()
    visible = torch.zeros(1, total, total, dtype=torch.bool)
    for r in range(len(lens)):
        a, b = int(cu[r]), int(cu[r + 1])
        visible[0, a:b, a:b] = True
    _close(out, ref_attention(q, k, v, visible, impl.softmax_scale), torch.float32)


# --- extra["kv_cache_dtype"] == "fp8" ------------------------------------------------------------


def _fp8_close(out, q, kd, vd, visible, scale, device):
    """CPU: the reference over the e4m3-rounded K/V, within the output's rounding.  CUDA (the
    Hopper e4m3 kernel): Q rounded per row as documented, P's e4m3 rounding left -- 2^-4
    relative L2 (tests/test_attention_fp8_cuda.py's bound)."""
    if device.type == "cpu":
        _close(out, ref_attention(q.double(), kd, vd, visible, scale), q.dtype)
        return
    exact = ref_attention(e4m3_rows(q.cpu()), kd, vd, visible, scale)
    rel = ((out.cpu().double() - exact).norm() / exact.norm()).item()
    assert rel <= 2.0**-4, rel


@pytest.mark.parametrize(
    ("causal", "fields"),
    [(c, f) for c in (False, True) for f in ("plain", "attn_mask", "valid_kv_length")] + [(True, "spans")],
)
@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_dense_forward(device, causal, fields, name):
    """extra["kv_cache_dtype"] == "fp8": K and V rounded to e4m3 with a scale each from their
    amax, the attention over them (on Hopper the e4m3 kernel); spans are a causal layer's."""
    b, sq, sk, head = 2, 80, 80 if fields == "spans" else 150, 128
    dtype = torch.bfloat16
    q, k, v = _qkv(b, sq, sk, head, dtype, device, seed=sk + causal)
    impl = _impl(head, causal)
    extra = {"kv_cache_dtype": name}
    meta = AttentionMetadata(extra=extra)
    visible = _causal(b, sq, sk) if causal else torch.ones(b, sq, sk, dtype=torch.bool)
    if fields == "attn_mask":
        keep = torch.rand(b, sk, generator=torch.Generator().manual_seed(2)) < 0.7
        meta = AttentionMetadata(attn_mask=keep.to(device), extra=extra)
        visible = visible & keep[:, None, :]
    elif fields == "valid_kv_length":
        meta = AttentionMetadata(extra={**extra, "valid_kv_length": 97})
        visible = torch.zeros(b, sq, sk, dtype=torch.bool)
        visible[:, :, :97] = _causal(b, sq, 97) if causal else True
    elif fields == "spans":
        spans = [[(10, 50)], [(0, 80)]]
        meta = AttentionMetadata(full_attn_spans=spans, extra=extra)
        visible = torch.stack([mask_spans(range(sq), sk, s) for s in spans])
    out = impl.forward(q, k, v, meta)
    assert out.shape == q.shape and out.dtype == dtype
    if device.type == "cuda" and _C.build_info()["attention_kernel"] == "sm90-tma":
        # a row is one block of its 150 (or 80) keys, which the e4m3 kernel's TMA producer
        # takes; with key padding the rounding copies them kept first
        assert _C.last_attention_kernel() == "sm90-fp8-tma"
    _fp8_close(out, q, e4m3_tensor(k.cpu()), e4m3_tensor(v.cpu()), visible, impl.softmax_scale, device)


def test_fp8_dense_scales_from_the_inputs_are_not_checked(device):
    """consecutive & 4: the dense forward's scales come from K/V themselves, so the binding does
    not copy them to the host to check them (no synchronisation on CUDA); a NaN scale -- what a
    NaN among the inputs makes -- then gives NaN outputs instead of the check's ValueError."""
    q = torch.randn(6, 2, 64, device=device, dtype=torch.bfloat16)
    k8 = (torch.randn(6, 2, 64) * 50).to(torch.float8_e4m3fn).to(device)
    index = torch.arange(6, dtype=torch.int32, device=device).view(1, 6)
    qsl = torch.tensor([0, 6], dtype=torch.int32, device=device)
    sl = torch.tensor([6], dtype=torch.int32, device=device)
    one = torch.ones(1, device=device)
    nan = torch.full((1,), float("nan"), device=device)

    def run(consecutive, k_scale):
        out = torch.zeros_like(q)
        _C.dense_attention(
            q, k8, k8.clone(), index, qsl, sl, None, 0, 0.125, out, None, None, None, 6, None, None, 1,
            consecutive, k_scale, one,
        )  # fmt: skip
        return out

    assert torch.isfinite(run(4, one)).all() and torch.equal(run(4, one), run(0, one))
    with pytest.raises(ValueError, match="k_scale"):
        run(0, nan)
    assert torch.isnan(run(4, nan)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fp8_dense_forward_of_nan_or_inf_keys_is_nan(device, bad):
    """A NaN or inf key makes its rows' outputs NaN, as unquantized attention does, with no
    exception from the scales computed from it."""
    q, k, v = _qkv(1, 8, 8, 64, torch.bfloat16, device, seed=4)
    k[0, 3, 1, 5] = bad
    out = _impl(64).forward(q, k, v, AttentionMetadata(extra={"kv_cache_dtype": "fp8"}))
    assert torch.isnan(out).any()


def _e4m3_shared(*xs: torch.Tensor) -> list[torch.Tensor]:
    """xs rounded to e4m3 with one scale from their common amax (the cache write's rule), as
    float64 values: what the dense forward reads for K and joint K (and V and joint V)."""
    amax = torch.stack([x.float().abs().amax() for x in xs]).amax()
    scale = amax / 448 if amax > 0 else torch.ones(())
    return [
        (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale.double() for x in xs
    ]


@pytest.mark.parametrize("keys", ["all", "valid", "padded"])
@pytest.mark.parametrize("strategy", ["front", "rear"])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_dense_joint_attention(device, strategy, causal, keys):
    """Joint tensors over an fp8 K/V: K and joint K rounded with one scale from their common
    amax (the joint keys, 3x larger here, set it), V and joint V with another; the attention of
    the concatenated sequences over those values.  Each batch row's keys are one block of one
    buffer (all keys, the first valid_kv_length, or with an attn_mask the kept ones first: on
    Hopper the e4m3 kernel's TMA producer); the scales come from the keys the rows read."""
    b, sq, sk, sj, head = 2, 70, 90, 23, 128
    q, k, v = _qkv(b, sq, sk, head, torch.bfloat16, device, seed=21)
    jq, jk, jv = _qkv(b, sj, sj, head, torch.bfloat16, device, seed=22)
    jk = jk * 3
    impl = _impl(head, causal)
    extra = {"kv_cache_dtype": "fp8"}
    kept, mask = sk, None
    if keys == "valid":
        kept = extra["valid_kv_length"] = 61
    elif keys == "padded":
        mask = torch.ones(b, sk, dtype=torch.bool)
        mask[0, 5:40] = False
        mask[1, ::3] = False
        mask = mask.to(device)
    meta = AttentionMetadata(
        joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy=strategy, attn_mask=mask, extra=extra
    )
    out = impl.forward(q, k, v, meta)
    assert out.shape == (b, sj + sq, H, head) and out.dtype == torch.bfloat16
    if device.type == "cuda" and _C.build_info()["attention_kernel"] == "sm90-tma":
        assert _C.last_attention_kernel() == "sm90-fp8-tma"
    front = strategy == "front"
    cat = lambda a, c: torch.cat((c, a) if front else (a, c), dim=1)  # noqa: E731
    kd, jkd = _e4m3_shared(k[:, :kept].cpu(), jk.cpu())
    vd, jvd = _e4m3_shared(v[:, :kept].cpu(), jv.cpu())
    qq, kk, vv = cat(q.cpu(), jq.cpu()), cat(kd, jkd), cat(vd, jvd)
    n_q, n_k = sq + sj, kept + sj
    visible = _causal(b, n_q, n_k) if causal else torch.ones(b, n_q, n_k, dtype=torch.bool)
    if mask is not None:
        visible = visible & cat(mask.cpu(), torch.ones(b, sj, dtype=torch.bool))[:, None, :]
    _fp8_close(out, qq, kk, vv, visible, impl.softmax_scale, device)


def test_fp8_dense_joint_attention_with_no_other_keys(device):
    """Joint tokens over an fp8 K/V with key padding and no other keys (S_k = 0): the rows'
    keys are the kept joint keys alone, gathered from the one buffer (whose index arithmetic
    must not divide by the empty source's length)."""
    b, sq, sj, head = 2, 30, 12, 128
    q, _, _ = _qkv(b, sq, 1, head, torch.bfloat16, device, seed=23)
    k = v = torch.zeros(b, 0, HKV, head, dtype=torch.bfloat16, device=device)
    jq, jk, jv = _qkv(b, sj, sj, head, torch.bfloat16, device, seed=24)
    jkeep = torch.ones(b, sj, dtype=torch.bool)
    jkeep[0, 3:7] = False
    jkeep[1, ::2] = False
    meta = AttentionMetadata(
        joint_query=jq, joint_key=jk, joint_value=jv, joint_attn_mask=jkeep.to(device),
        attn_mask=torch.ones(b, 0, dtype=torch.bool, device=device), extra={"kv_cache_dtype": "fp8"},
    )  # fmt: skip
    impl = _impl(head)
    out = impl.forward(q, k, v, meta)
    assert out.shape == (b, sj + sq, H, head)
    (jkd,), (jvd,) = _e4m3_shared(jk.cpu()), _e4m3_shared(jv.cpu())
    qq = torch.cat((jq.cpu(), q.cpu()), dim=1)
    visible = jkeep[:, None, :].expand(b, sj + sq, sj)
    _fp8_close(out, qq, jkd, jvd, visible, impl.softmax_scale, device)


@pytest.mark.parametrize(
    ("offsets", "total", "block"),
    [
        ([0, 48, 176, 192, 256], 256, 16),
        ([0, 40, 176, 184, 256], 256, 8),
        ([0, 48, 176, 192, 250], 256, 16),  # the documents need not cover every key
        ([0, 48, 176, 192, 250], 250, 1),  # 250 keys are no whole number of blocks
        ([0, 50, 180, 187, 251], 251, 1),
        ([0, 0], 0, 1),
    ],
)
def test_fp8_packed_documents_block_size(offsets, total, block):
    """The key tensor's blocks under packed fp8 documents: the largest of 16 and 8 that every
    document's first key and the key count are multiples of, else one key a block."""
    from diffkv.dense import _doc_blocks

    assert _doc_blocks(torch.tensor(offsets, dtype=torch.int32), total) == block


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [[50, 130, 7, 64], [48, 128, 16, 64], [40, 136, 8, 72]])
def test_fp8_dense_packed_varlen(device, causal, lens, where):
    """Packed varlen documents over an fp8 K/V (one scale for all the documents' keys, one for
    the values): each document attends to its own keys only.  Documents starting at multiples of
    16 or 8 keys read the key tensor as blocks of 16 or 8 (on Hopper the e4m3 kernel's TMA
    producer; a document's last block runs into the next one's keys, masked); others are
    gathered, each from a multiple of 16 rows, and read as 16-key blocks (the TMA producer
    too), as are documents at offsets given on the device (not read back)."""
    total = sum(lens)
    q, k, v = _qkv(1, total, total, 128, torch.bfloat16, device, seed=9)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    given = cu if where == "host" else cu.to(device)
    extra = {
        "kv_cache_dtype": "fp8",
        "cu_seqlens_q": given,
        "cu_seqlens_k": given,
        "max_seqlen_q": max(lens),
        "max_seqlen_k": max(lens),
    }
    impl = _impl(128, causal)
    out = impl.forward(q, k, v, AttentionMetadata(extra=extra))
    if device.type == "cuda" and _C.build_info()["attention_kernel"] == "sm90-tma":
        assert _C.last_attention_kernel() == "sm90-fp8-tma"
    visible = torch.zeros(1, total, total, dtype=torch.bool)
    for r in range(len(lens)):
        a, c = int(cu[r]), int(cu[r + 1])
        visible[0, a:c, a:c] = _causal(1, c - a, c - a)[0] if causal else True
    _fp8_close(out, q, e4m3_tensor(k.cpu()), e4m3_tensor(v.cpu()), visible, impl.softmax_scale, device)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_dense_packed_keys_inside_a_longer_tensor(device, causal):
    """Key documents at unaligned offsets that leave keys outside every document (3 before the
    first, 10 after the last, the largest key among them): the scales are still the whole
    tensor's (the rounding comes before the documents' keys are gathered; the CPU output within
    its rounding of the reference over K/V rounded with them); each document attends to its own
    keys (causal: bottom-right)."""
    q_lens, k_lens, before, after = [50, 130, 7], [50, 130, 7], 3, 10
    total_q, total_k = sum(q_lens), before + sum(k_lens) + after
    q, k, v = _qkv(1, total_q, total_k, 128, torch.bfloat16, device, seed=13)
    k[0, 1] *= 8  # outside every document: sets K's amax
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([before, *(before + torch.tensor(k_lens).cumsum(0)).tolist()], dtype=torch.int32)
    extra = {"kv_cache_dtype": "fp8", "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    impl = _impl(128, causal)
    out = impl.forward(q, k, v, AttentionMetadata(extra=extra))
    if device.type == "cuda" and _C.build_info()["attention_kernel"] == "sm90-tma":
        assert _C.last_attention_kernel() == "sm90-fp8-tma"
    visible = torch.zeros(1, total_q, total_k, dtype=torch.bool)
    for r in range(len(q_lens)):
        a, c, ka, kc = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
        visible[0, a:c, ka:kc] = _causal(1, c - a, kc - ka)[0] if causal else True
    _fp8_close(out, q, e4m3_tensor(k.cpu()), e4m3_tensor(v.cpu()), visible, impl.softmax_scale, device)


@pytest.mark.parametrize("offsets", [[0, 50, 180, 187, 251], [3, 53, 183, 190], [0, 0, 5], [4, 20, 36]])
@pytest.mark.parametrize("bound", [False, True])
def test_fp8_packed_documents_gathered_from_multiples_of_16(offsets, bound):
    """_doc_gather: document d's keys from row first[d] (a multiple of 16), then copies of its
    last key up to the next multiple of 16; with the device offsets' bound on the rows (15 more
    a document), the rows past the last document copy its last key."""
    from diffkv.dense import _doc_gather

    total = offsets[-1] + 10
    body = sum(-(-(c - a) // 16) * 16 for a, c in zip(offsets, offsets[1:], strict=False))
    n = -(-(total + 15 * (len(offsets) - 1)) // 16) * 16 if bound else body
    rows, first = _doc_gather(torch.tensor(offsets, dtype=torch.int64), n, total)
    assert rows.shape[0] == n and int(first[-1]) == body and bool((first % 16 == 0).all())
    for d in range(len(offsets) - 1):
        a, c = offsets[d], offsets[d + 1]
        f = int(first[d])
        assert rows[f : f + c - a].tolist() == list(range(a, c))
        assert set(rows[f + c - a : int(first[d + 1])].tolist()) <= {c - 1}
        assert int(first[d + 1]) - f == -(-(c - a) // 16) * 16
    last = max(c - 1 for a, c in zip(offsets, offsets[1:], strict=False) if c > a)
    assert set(rows[body:].tolist()) <= {last}
    assert bool(((rows >= 0) & (rows < total)).all())


def test_fp8_packed_documents_gathered_from_offsets_out_of_range():
    """Device offsets are not read back: offsets past the keys, or decreasing, gather rows that
    all lie inside the key tensor (nothing is read out of range)."""
    from diffkv.dense import _doc_gather

    rows, _ = _doc_gather(torch.tensor([0, 90, 40, 500], dtype=torch.int64), 96, 64)
    assert bool(((rows >= 0) & (rows < 64)).all())
