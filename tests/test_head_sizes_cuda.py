"""Every fp16/bf16 head size the CUDA kernels take (``_C.supported_head_sizes('cuda', ...)``)
against the float64 reference: every mask mode, block sizes 1, 16 and 48, GQA and MHA, strided
query/output and cache layouts (the cp.async and the element-load paths), the LSE output that
context parallelism merges, the dense forward (over fp8 K/V too), and float8_e4m3fn caches
whose rows are off the e4m3 forms' chunk size refused.  Every cache slot a row must not read --
the spare blocks and the slots past each row's end in its last block -- holds NaN, so a kernel
that reads one poisons its output."""

from __future__ import annotations

import math
import re

import pytest
import torch

import diffkv
from _helpers import mma_kernel_name
from diffkv import _C
from reference import assert_flash_close, e4m3_tensor, mask_key_limits, ref_attention

pytestmark = pytest.mark.gpu

HEADS = list(_C.supported_head_sizes("cuda", "bfloat16", "auto")) if _C.cuda_compiled() else []
WGMMA_HEADS = (64, 128)  # the Hopper kernels' own sizes
# On Hopper the warp-specialized kernel with its cp.async producers (caches of 16-byte chunks):
# heads 192 and 256, and the others on tiles of 64, 128 or 192 dims with zeros past the head
# size; other calls at these sizes run the mma.sync kernel there.
CP_ASYNC_HEADS = (32, 72, 80, 96, 160, 192, 256)
# Of those, the sizes whose caches of 16-key chunks (NHD or HND, no padding past the head) take
# one TMA box per chunk instead ('sm90-tma16').
CHUNK_TMA_HEADS = (192, 256)


def _hopper():
    return torch.cuda.get_device_capability()[0] == 9


def _problem(seq_lens, query_lens, heads, kv_heads, head, block, dtype, seed, layout="nhd"):
    """K/V of every position of every row written into a paged cache (a random permutation of
    blocks, 3 spare), NaN in every slot no row reads; q random.  layout: 'nhd' (contiguous
    [2, blocks, block, kv heads, head]), 'hnd' (kv heads outside the block's tokens) or 'padded'
    (NHD with each head's row 8 elements wider, NaN there: 16-byte chunks no TMA map folds).
    Returns the call's tensors and the dense K/V per row."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [math.ceil(s / block) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(seq_lens), max(blocks) + 1), perm[-1], dtype=torch.int32)
    nan = float("nan")
    if layout == "hnd":
        backing = torch.full((2, num_blocks, kv_heads, block, head), nan, device="cuda", dtype=dtype)
        cache = backing.permute(0, 1, 3, 2, 4)
    elif layout == "padded":
        backing = torch.full((2, num_blocks, block, kv_heads, head + 8), nan, device="cuda", dtype=dtype)
        cache = backing[..., :head]
    else:
        cache = torch.full((2, num_blocks, block, kv_heads, head), nan, device="cuda", dtype=dtype)
    dense = []
    at = 0
    for r, (s, n) in enumerate(zip(seq_lens, blocks, strict=True)):
        table[r, :n] = torch.tensor(perm[at : at + n], dtype=torch.int32)
        at += n
        k = torch.randn(s, kv_heads, head, device="cuda", generator=g).to(dtype)
        v = torch.randn(s, kv_heads, head, device="cuda", generator=g).to(dtype)
        pos = torch.arange(s)
        slots = (table[r, pos // block].long() * block + pos % block).cuda()
        if layout == "nhd":
            _C.kv_write(k, v, cache, slots)
        else:  # the views' own strides, written through by indexing
            cache[0, slots // block, slots % block] = k
            cache[1, slots // block, slots % block] = v
        dense.append((k, v))
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, head, device="cuda", generator=g).to(dtype)
    return q, cache, table, qsl, torch.tensor(seq_lens, dtype=torch.int32), dense


def _limits(seq_lens, query_lens, mask):
    """Each row's per-query key limits for the mask (limits: spans of 40 keys a query sees
    past its causal limit, as piecewise plans give)."""
    out = []
    for s, n in zip(seq_lens, query_lens, strict=True):
        pos = torch.arange(s - n, s, dtype=torch.int32)
        if mask == "none":
            out.append(torch.full((n,), s, dtype=torch.int32))
        elif mask == "causal":
            out.append(pos + 1)
        else:
            out.append(torch.where(pos % 97 < 50, pos + 1, torch.clamp(pos + 40, max=s)))
    return out


def _close(out, q, k, v, visible, scale, lse=None):
    """out within the flash bound of the float64 reference; lse (if given) within 1e-3 of its
    log-sum-exp."""
    want = assert_flash_close(out, q, k, v, visible, scale)
    if lse is not None:
        assert (lse.double() - want).abs().max().item() <= 1e-3


def _check(out, q, qsl, dense, limits, scale, lse=None):
    for r, (k, v) in enumerate(dense):
        sl = slice(int(qsl[r]), int(qsl[r + 1]))
        visible = mask_key_limits(limits[r].cuda(), k.shape[0])
        _close(out[sl], q[sl], k, v, visible, scale, None if lse is None else lse[sl])


def _masked_case(head, dtype, mask, block, layout="nhd"):
    """Two rows (300 keys / 120 queries, 771 / 771), GQA 8/2, the mask's key limits, the cache in
    _problem's layout: a function that runs the paged call (the current kernel choice) and checks
    it against the reference."""
    seq_lens, query_lens = [300, 771], [120, 771]
    q, cache, table, qsl, seq, dense = _problem(
        seq_lens, query_lens, 8, 2, head, block, dtype, head + block, layout
    )
    limits = _limits(seq_lens, query_lens, mask)
    code = {"none": _C.MASK_NONE, "causal": _C.MASK_CAUSAL, "limits": _C.MASK_LIMITS}[mask]
    key_limits = torch.cat(limits).cuda() if mask == "limits" else None
    scale = head**-0.5

    def run():
        out = torch.full_like(q, float("nan"))
        _C.paged_attention(
            q, cache, table.cuda(), qsl.cuda(), seq.cuda(), key_limits, code, scale, out, table, qsl, seq
        )
        _check(out, q, qsl, dense, limits, scale)

    return run


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "causal", "limits"])
@pytest.mark.parametrize("block", [1, 16, 48])
def test_every_head_size_matches_the_reference(head, dtype, mask, block, attention_kernel):
    run = _masked_case(head, dtype, mask, block)
    for kernel in ("auto", "sm80"):
        attention_kernel(kernel)
        run()
        if kernel == "sm80" or head not in WGMMA_HEADS + CP_ASYNC_HEADS or not _hopper():
            assert _C.last_attention_kernel() == mma_kernel_name(head)
        elif head in CHUNK_TMA_HEADS and block % 16 == 0:
            assert _C.last_attention_kernel() == "sm90-tma16"
        elif head in CP_ASYNC_HEADS:
            assert _C.last_attention_kernel() == "sm90-ws"


@pytest.mark.parametrize("head", [h for h in HEADS if h >= 160])
@pytest.mark.parametrize("mask", ["none", "causal", "limits"])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_192_and_256_forms_group_producer(head, mask, block):
    """The 192- and 256-dim forms' group producer over blocks of 16 to 128 keys, in a cache whose
    head rows are padded (no per-chunk TMA map): 80-key tiles (256) start inside a block and span
    two, 112-key ones (160, 192) likewise, each 16-key group at its own offset in its block."""
    _masked_case(head, torch.bfloat16, mask, block, "padded")()
    assert _C.last_attention_kernel() == ("sm90-ws" if _hopper() else "sm80")


@pytest.mark.parametrize("head", [h for h in HEADS if h in CHUNK_TMA_HEADS])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("mask", ["none", "limits"])
@pytest.mark.parametrize("block", [16, 48, 128])
def test_192_and_256_per_chunk_tma(head, layout, mask, block):
    """Heads 192 and 256 over caches of 16-key chunks, NHD and HND, in random block order: one
    TMA box of the chunk's 16 rows x 3 or 4 panels per chunk for K and V ('sm90-tma16'; a 112- or
    80-key tile's chunks from different blocks), NaN in every slot no row reads."""
    _masked_case(head, torch.float16, mask, block, layout)()
    assert _C.last_attention_kernel() == ("sm90-tma16" if _hopper() else "sm80")


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mha_strided_layouts_and_lse(head, dtype):
    """MHA; the query a view of a fused QKV projection, the output a view of a wider buffer (its
    other half untouched), the LSE beside it; then the same over a cache whose head dims are
    strided (the element-load path) and a query with a dim stride of 2."""
    seq_lens, query_lens = [200, 333], [200, 101]
    q, cache, table, qsl, seq, dense = _problem(seq_lens, query_lens, 4, 4, head, 16, dtype, head)
    fused = torch.randn(q.shape[0], 3, 4, head, device="cuda").to(dtype)
    fused[:, 0] = q
    query = fused[:, 0]
    wide = torch.zeros(q.shape[0], 4, 2 * head, device="cuda", dtype=dtype)
    out = wide[:, :, :head]
    lse = torch.empty(q.shape[0], 4, device="cuda", dtype=torch.float32)
    limits = _limits(seq_lens, query_lens, "causal")
    args = (table.cuda(), qsl.cuda(), seq.cuda(), None, _C.MASK_CAUSAL, head**-0.5)
    _C.paged_attention_lse(query, cache, *args, out, lse, table, qsl, seq)
    assert not wide[:, :, head:].any()
    _check(out, q, qsl, dense, limits, head**-0.5, lse)

    spread = torch.full((*cache.shape[:-1], 2 * head), float("nan"), device="cuda", dtype=dtype)
    spread[..., ::2] = cache
    q2 = torch.zeros(q.shape[0], 4, 2 * head, device="cuda", dtype=dtype)
    q2[..., ::2] = q
    out2 = torch.full_like(q, float("nan"))
    _C.paged_attention(q2[..., ::2], spread[..., ::2], *args, out2, table, qsl, seq)
    _check(out2, q, qsl, dense, limits, head**-0.5)

    # output rows 8 bytes off 16-byte alignment: the kernels' per-thread (not staged) stores
    odd = torch.full((q.shape[0], 4, head + 4), float("nan"), device="cuda", dtype=dtype)
    _C.paged_attention(q, cache, *args, odd[..., :head], table, qsl, seq)
    assert odd[..., head:].isnan().all()
    _check(odd[..., :head], q, qsl, dense, limits, head**-0.5)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("strategy", ["front", "rear"])
def test_dense_joint_every_head_size(head, strategy):
    """The dense forward with joint tokens: two key sources in one launch (the kernels' second
    cache, whose blocks follow the first's), GQA, two CFG rows, against the attention of the
    concatenated sequences."""
    g = torch.Generator(device="cuda").manual_seed(head + 7)
    b, sq, sk, sj, h, hkv = 2, 70, 90, 23, 4, 2

    def rand(n, heads):
        return torch.randn(b, n, heads, head, device="cuda", generator=g).to(torch.bfloat16)

    q, k, v = rand(sq, h), rand(sk, hkv), rand(sk, hkv)
    jq, jk, jv = rand(sj, h), rand(sj, hkv), rand(sj, hkv)
    impl = diffkv.DiffKVAttentionImpl(
        num_heads=h, head_size=head, softmax_scale=head**-0.5, causal=False, num_kv_heads=hkv
    )
    meta = diffkv.AttentionMetadata(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy=strategy)
    out = impl.forward(q, k, v, meta)
    front = strategy == "front"  # the joint tokens first

    def cat(x, jx):
        return torch.cat([jx, x] if front else [x, jx], 1)

    visible = torch.ones(b, sq + sj, sk + sj, dtype=torch.bool)
    _close(out, cat(q, jq), cat(k, jk), cat(v, jv), visible, head**-0.5)


def _dense_case(head, causal, sq, sk, seed):
    """Two CFG rows of bf16 Q [2, sq, 4, head] and K/V [2, sk, 2, head] (GQA) from the seed, the
    layer (scale head^-0.5, causal or not) and the visible mask [2, sq, sk] (bottom-right
    causal)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, sq, 4, head, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(2, sk, 2, head, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(2, sk, 2, head, device="cuda", generator=g).to(torch.bfloat16)
    impl = diffkv.DiffKVAttentionImpl(
        num_heads=4, head_size=head, softmax_scale=head**-0.5, causal=causal, num_kv_heads=2
    )
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    return q, k, v, impl, visible.expand(2, sq, sk)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("causal", [False, True])
def test_dense_forward_every_head_size(head, causal):
    """DiffKVAttentionImpl.forward (the dense path: the same kernels over plain K/V)."""
    q, k, v, impl, visible = _dense_case(head, causal, 150, 290, head)
    _close(impl.forward(q, k, v), q, k, v, visible, head**-0.5)


FP8_HEADS = list(_C.supported_head_sizes("cuda", "bfloat16", "float8_e4m3fn")) if _C.cuda_compiled() else []


def test_every_head_size_takes_an_fp8_cache():
    """Every CUDA head size has an e4m3 form (72 with 8-byte rows)."""
    assert FP8_HEADS == HEADS and 72 in FP8_HEADS


@pytest.mark.parametrize("head", [h for h in FP8_HEADS if h not in WGMMA_HEADS])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_dense_forward_every_head_size(head, causal):
    """extra["kv_cache_dtype"] == "fp8" at the head sizes without an e4m3 wgmma kernel: the dense
    forward's K/V rounded to e4m3 (a scale each from their amax), the mma.sync kernel's e4m3 form
    over them, GQA, two rows: within 2^-8 relative L2 of the float64 reference over the rounded
    K/V and the query as it is (the form's products are fp16: tests/test_attention_fp8_cuda.py)."""
    q, k, v, impl, visible = _dense_case(head, causal, 80, 150, head + causal)
    out = impl.forward(q, k, v, diffkv.AttentionMetadata(extra={"kv_cache_dtype": "fp8"}))
    assert _C.last_attention_kernel() == mma_kernel_name(head, fp8=True, max_query_len=80)
    exact = ref_attention(q.cpu().double(), e4m3_tensor(k.cpu()), e4m3_tensor(v.cpu()), visible, head**-0.5)
    rel = ((out.cpu().double() - exact).norm() / exact.norm()).item()
    assert rel <= 2.0**-8, rel


@pytest.mark.parametrize(("head", "width", "unit"), [(72, 76, 8), (96, 104, 16)])
def test_fp8_cache_rows_off_their_chunk_size_are_refused(head, width, unit):
    """The e4m3 forms copy K/V rows in 16-byte chunks, head 72's in 8-byte ones: a cache whose
    head stride (width bytes) is not a multiple of that is refused before anything runs."""
    q, cache, table, qsl, seq, _ = _problem([40], [40], 2, 2, head, 16, torch.bfloat16, 1)
    backing = torch.zeros((*cache.shape[:-1], width), device="cuda", dtype=torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda")
    out = torch.zeros_like(q)
    message = (
        f"paged_attention(): a float8_e4m3fn kv_cache must have contiguous head dims, {unit}-byte "
        f"aligned storage and block, token and head strides that are multiples of {unit} on CUDA"
    )
    with pytest.raises(NotImplementedError, match=f"^{re.escape(message)}$"):
        _C.paged_attention(
            q,
            backing[..., :head],
            table.cuda(),
            qsl.cuda(),
            seq.cuda(),
            None,
            _C.MASK_NONE,
            0.1,
            out,
            table,
            qsl,
            seq,
            one,
            one,
        )
    assert not out.any()


def test_a_head_size_the_kernels_lack_is_refused_by_name():
    """A head size no CUDA kernel is built for (88) raises ValueError naming the sizes there are,
    before anything runs."""
    q, cache, table, qsl, seq, _ = _problem([40], [40], 2, 2, 88, 16, torch.bfloat16, 1)
    out = torch.zeros_like(q)
    sizes = ", ".join(str(h) for h in HEADS)
    with pytest.raises(
        ValueError,
        match=rf"^paged_attention\(\): head_size must be one of {sizes} for float16/bfloat16 on CUDA, "
        r"got 88$",
    ):
        _C.paged_attention(
            q, cache, table.cuda(), qsl.cuda(), seq.cuda(), None, _C.MASK_NONE, 0.1, out, table, qsl, seq
        )
    assert not out.any()


@pytest.mark.parametrize(("head", "bm", "rows"), [(32, 128, 32768), (192, 64, 16384)])
def test_a_grid_past_the_launch_limit_is_refused_before_anything_runs(head, bm, rows):
    """num_heads * num_rows * cdiv(max_query_len, bm) CTAs past the grid's 2^31 - 1 raise
    ValueError naming the query tile of that head size (128 rows; 64 on the mma.sync kernel above
    head 160), before anything is written: 256 heads, one row of 32,768 queries and the rest of
    one query each over a one-block cache (every table entry block 0)."""
    heads, long_q, block = 256, 32768, 1024
    query_lens = [long_q] + [1] * (rows - 1)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(query_lens, dtype=torch.int32)
    table = torch.zeros(rows, long_q // block, dtype=torch.int32)
    cache = torch.zeros(2, 1, block, 1, head, device="cuda", dtype=torch.bfloat16)
    q = torch.ones(int(qsl[-1]), heads, head, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    tiles = -(-long_q // bm)
    assert heads * rows * tiles > 2**31 - 1
    with pytest.raises(
        ValueError,
        match=rf"^paged_attention\(\): num_heads \* num_rows \* cdiv\(max_query_len, {bm}\) must be at "
        rf"most 2147483647, got {heads} \* {rows} \* {tiles}$",
    ):
        _C.paged_attention(
            q, cache, table.cuda(), qsl.cuda(), seq.cuda(), None, _C.MASK_NONE, 0.1, out, table, qsl, seq
        )
    assert not out.any()
