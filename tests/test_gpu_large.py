"""Large GPU cases: HunyuanImage-3.0 geometry (32/8/128, two CFG rows with prefixes 500 and
3500, 4097 image tokens, block 16), thousands of tokens in every mask mode, and the CUDA path
against the CPU path on the same inputs.  References run on the GPU in float64."""

import pytest
import torch

from _helpers import mma_kernel_name
from diffkv import _C
from reference import assert_flash_close, mask_key_limits

pytestmark = pytest.mark.gpu


def _paged_problem(
    seq_lens, query_lens, heads, kv_heads, head, block, dtype, seed=0, order="random", key_gain=None
):
    """Random K/V for every position of every row, written into a cache whose blocks are a
    permutation with spare blocks -- random, 'sequential' (allocation order: each row's blocks
    are consecutive ids, one spare block between rows) or 'runs' (sequential with blocks 40 i + 3
    and 40 i + 4 swapped: most 128-key tiles are runs of consecutive blocks, some not); returns
    what _C.paged_attention needs plus the dense K/V per row.  key_gain(positions) -> a factor
    per key position multiplying K (scores that grow along the row)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = len(seq_lens)
    blocks = [-(-s // block) for s in seq_lens]
    num_blocks = sum(blocks) + 5
    if order == "random":
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        perm, at = [], 0
        for n in blocks:
            perm += list(range(at, at + n))
            at += n + 1
        if order == "runs":
            for i in range(3, len(perm) - 1, 40):
                perm[i], perm[i + 1] = perm[i + 1], perm[i]
    cols = max(blocks)
    table = torch.full((rows, cols), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(blocks):
        table[r, :n] = torch.tensor(perm[at : at + n], dtype=torch.int32)
        at += n
    cache = torch.randn(2, num_blocks, block, kv_heads, head, device="cuda", dtype=dtype, generator=g)
    dense_k, dense_v = [], []
    for r, s in enumerate(seq_lens):
        k = torch.randn(s, kv_heads, head, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(s, kv_heads, head, device="cuda", dtype=dtype, generator=g)
        pos = torch.arange(s)
        if key_gain is not None:
            k = (k.float() * key_gain(pos).cuda()[:, None, None]).to(dtype)
        slots = (table[r, pos // block].long() * block + pos % block).cuda()
        _C.kv_write(k, v, cache, slots)
        dense_k.append(k)
        dense_v.append(v)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, head, device="cuda", dtype=dtype, generator=g)
    return {
        "q": q,
        "cache": cache,
        "table": table,
        "qsl": qsl,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "dense_k": dense_k,
        "dense_v": dense_v,
    }


def _run(p, mask, key_limits=None, scale=None, device="cuda"):
    q = p["q"].to(device)
    out = torch.empty_like(q)
    scale = scale or q.shape[-1] ** -0.5
    _C.paged_attention(
        q,
        p["cache"].to(device),
        p["table"].to(device),
        p["qsl"].to(device),
        p["seq_lens"].to(device),
        None if key_limits is None else key_limits.to(device),
        mask,
        scale,
        out,
        p["table"],
        p["qsl"],
        p["seq_lens"],
    )
    return out


def _check(out, p, limits_per_row, scale):
    q = p["q"]
    qsl = p["qsl"].tolist()
    for r in range(len(p["dense_k"])):
        sl = slice(qsl[r], qsl[r + 1])
        lim = limits_per_row[r].cuda()
        k, v = p["dense_k"][r], p["dense_v"][r]
        visible = mask_key_limits(lim, k.shape[0])
        assert_flash_close(out[sl], q[sl], k, v, visible, scale, f"row {r}: ")


def test_hunyuan_image3_denoise_geometry():
    prefixes, image = (500, 3500), 4097
    seq_lens = [p + image for p in prefixes]
    p = _paged_problem(seq_lens, [image, image], 32, 8, 128, 16, torch.bfloat16)
    # Every image token is in the full span [prefix, prefix + image): it sees all keys.
    limits = [torch.full((image,), s, dtype=torch.int32) for s in seq_lens]
    scale = 128**-0.5
    out = _run(p, _C.MASK_LIMITS, torch.cat(limits), scale)
    _check(out, p, limits, scale)
    out_none = _run(p, _C.MASK_NONE, None, scale)
    assert torch.equal(out, out_none), "a span covering the whole query equals the unmasked call"


def test_hunyuan_image3_prefill_piecewise():
    prefixes, image, tail = (500, 3500), 4097, 3
    seq_lens = [p + image + tail for p in prefixes]
    p = _paged_problem(seq_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, seed=1)
    limits = []
    for pre, s in zip(prefixes, seq_lens, strict=True):
        pos = torch.arange(s, dtype=torch.int32)
        in_span = (pos >= pre) & (pos < pre + image)
        limits.append(torch.where(in_span, torch.tensor(pre + image, dtype=torch.int32), pos + 1))
    scale = 128**-0.5
    out = _run(p, _C.MASK_LIMITS, torch.cat(limits), scale)
    _check(out, p, limits, scale)


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_thousands_of_tokens(head, dtype, mask):
    seq_lens, query_lens = [2300, 5111], [1800, 5111]
    p = _paged_problem(seq_lens, query_lens, 8, 2, head, 16, dtype, seed=head)
    limits = []
    for s, n in zip(seq_lens, query_lens, strict=True):
        if mask == "none":
            limits.append(torch.full((n,), s, dtype=torch.int32))
        else:
            limits.append(torch.arange(s - n, s, dtype=torch.int32) + 1)
    code = _C.MASK_NONE if mask == "none" else _C.MASK_CAUSAL
    out = _run(p, code, None, head**-0.5)
    _check(out, p, limits, head**-0.5)


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gain", ["steps", "ramp", "peaked"])
@pytest.mark.parametrize("order", ["random", "sequential"])
def test_scores_growing_along_the_row(head, dtype, gain, order):
    """Scores that grow from tile to tile (K scaled up every 384 keys, or steadily) and peaked
    rows (K x 8: a few keys dominate): the running max moves on many tiles and by a lot, and a
    kernel that let a row's largest P drift from exactly 1 (a lazily kept max) loses precision on
    exactly these rows -- 1.6-2.3x the eager error in one measurement (ramp, head 128, fp16:
    3.45e-3 against a bound of 3.37e-3) -- so each must stay within the reference bound."""
    gains = {
        "steps": lambda pos: 1 + 2.5 * (pos // 384).float(),
        "ramp": lambda pos: 1 + pos.float() / 200,
        "peaked": lambda pos: torch.full(pos.shape, 8.0),
    }
    seq_lens, query_lens = [3000, 700], [3000, 300]
    p = _paged_problem(seq_lens, query_lens, 8, 2, head, 16, dtype, seed=3, order=order, key_gain=gains[gain])
    full, limits = [], []
    for s, n in zip(seq_lens, query_lens, strict=True):
        pos = torch.arange(s - n, s, dtype=torch.int32)
        full.append(torch.full((n,), s, dtype=torch.int32))
        limits.append(torch.where(pos % 300 < 150, pos + 1, torch.full_like(pos, s)))
    scale = head**-0.5
    _check(_run(p, _C.MASK_NONE, None, scale), p, full, scale)
    _check(_run(p, _C.MASK_LIMITS, torch.cat(limits), scale), p, limits, scale)


@pytest.mark.parametrize("block", [1, 16, 64])
def test_cuda_matches_cpu(block):
    seq_lens, query_lens = [300, 771], [120, 771]
    p = _paged_problem(seq_lens, query_lens, 8, 2, 64, block, torch.bfloat16, seed=block)
    limits = []
    for s, n in zip(seq_lens, query_lens, strict=True):
        pos = torch.arange(s - n, s, dtype=torch.int32)
        limits.append(torch.where(pos % 97 < 50, pos + 1, torch.clamp(pos + 40, max=s)))
    key_limits = torch.cat(limits)
    for code, kl in ((_C.MASK_NONE, None), (_C.MASK_CAUSAL, None), (_C.MASK_LIMITS, key_limits)):
        gpu = _run(p, code, kl).cpu().double()
        cpu = _run(p, code, kl, device="cpu").double()
        assert (gpu - cpu).abs().max().item() <= 2e-2


def test_kv_write_cuda_matches_cpu():
    g = torch.Generator().manual_seed(3)
    tokens, kv_heads, head, block, nb = 3000, 8, 128, 16, 260
    qkv = torch.randn(tokens, 3, kv_heads * 2, head, generator=g).to(torch.bfloat16)
    key, value = qkv[:, 1, :kv_heads], qkv[:, 2, :kv_heads]  # strided views of a projection
    slots = torch.randperm(nb * block, generator=g)[:tokens]
    slots[::17] = -1
    caches = []
    for device in ("cpu", "cuda"):
        cache = torch.zeros(2, nb, block, kv_heads, head, dtype=torch.bfloat16, device=device)
        _C.kv_write(key.to(device), value.to(device), cache, slots.to(device))
        caches.append(cache.cpu())
    assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("kernel", ["auto", "sm90", "sm80"])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_tensor_core_kernel_matches_the_reference(kernel, head, dtype, attention_kernel):
    """The kernel choice is visible (build_info, last_attention_kernel),
    set_attention_kernel('sm90') keeps a Hopper GPU off the TMA kernel and 'sm80' on mma.sync,
    and every kernel meets the reference on three rows of different lengths (one shorter than a
    tile) with a piecewise span, GQA 8/2, block 16."""
    attention_kernel(kernel)
    hopper = torch.cuda.get_device_capability()[0] == 9 and "90a" in _C.build_info()["archs"]
    built = {"auto": "sm90-tma", "sm90": "sm90", "sm80": "sm80"}[kernel] if hopper else "sm80"
    assert _C.build_info()["attention_kernel"] == built
    # block 16 in random order: at head 128 one 5-d TMA box per block for K and V, at head 64
    # the cp.async producer (per-half TMA boxes take blocks of 32+, or runs of consecutive
    # 16-key blocks)
    launched = {"sm90-tma": "sm90-tma16" if head == 128 else "sm90-ws", "sm80": mma_kernel_name(head)}.get(
        built, built
    )
    seq_lens, query_lens = [1700, 77, 2600], [900, 77, 2600]
    spans = [(1000, 1500), (0, 40), (100, 2400)]
    p = _paged_problem(seq_lens, query_lens, 8, 2, head, 16, dtype, seed=7 + head)
    limits = []
    for s, n, (a, b) in zip(seq_lens, query_lens, spans, strict=True):
        pos = torch.arange(s - n, s, dtype=torch.int32)
        limits.append(torch.where((pos >= a) & (pos < b), torch.tensor(b, dtype=torch.int32), pos + 1))
    scale = head**-0.5
    out = _run(p, _C.MASK_LIMITS, torch.cat(limits), scale)
    assert _C.last_attention_kernel() == launched
    _check(out, p, limits, scale)


@pytest.mark.parametrize(
    ("block", "layout", "order", "kernel", "head"),
    [
        (16, "nhd", "random", "sm90-tma16", 128),  # K and V one 5-d box per 16-key chunk
        (16, "nhd", "sequential", "sm90-tma16", 128),  # runs too: faster than the flat boxes
        (16, "nhd", "runs", "sm90-tma16", 128),
        (16, "hnd", "sequential", "sm90-tma16", 128),  # the kv head folded into the maps' blocks
        (32, "hnd", "random", "sm90-tma16", 128),
        (32, "nhd", "runs", "sm90-tma16", 128),
        (64, "nhd", "random", "sm90-tma16", 128),
        (64, "nhd", "sequential", "sm90-tma16", 128),
        (128, "hnd", "random", "sm90-tma16", 128),
        (256, "nhd", "random", "sm90-tma16", 128),
        (1024, "layers", "random", "sm90-tma16", 128),
        (8, "nhd", "sequential", "sm90-tma", 128),  # chunks would straddle blocks: flat boxes
        (4, "nhd", "sequential", "sm90-tma", 128),  # every tile a run: flat boxes only
        (1, "nhd", "sequential", "sm90-tma", 128),
        (2, "nhd", "runs", "sm90-ws", 128),  # some tiles are not runs: no box per block here
        (16, "layers", "sequential", "sm90-tma16", 128),
        (48, "layers", "random", "sm90-tma16", 128),  # a multiple of 16 keys
        (48, "nhd", "sequential", "sm90-tma16", 128),
        (24, "nhd", "random", "sm90-ws", 128),  # not a power of two nor a multiple of 16
        (16, "strided-dim", "random", "sm90", 128),
        (16, "nhd", "sequential", "sm90-ws", 64),  # head 64: block groups beat the flat boxes
        (4, "nhd", "sequential", "sm90-tma", 64),
        (4, "nhd", "runs", "sm90-ws", 64),  # 21 % of its tiles are runs: under the 25 % bar
        (8, "nhd", "runs", "sm90-tma", 128),
        (16, "nhd", "random", "sm90-ws", 64),
        (16, "hnd", "random", "sm90-ws", 64),
        (32, "nhd", "random", "sm90-tma", 64),  # head 64: per-half boxes of 32+ keys
        (16, "layers", "random", "sm90-tma16", 128),
        (4096, "nhd", "random", "sm90-tma16", 128),  # one block per row
        (4104, "nhd", "random", "sm90-tma16", 128),  # one block per row of 8 n keys: the row's
        (4104, "hnd", "random", "sm90-tma16", 128),  # last chunk half out of the map (zeros)
    ],
)
def test_tma_kernel_layouts_blocks_and_poison(block, layout, order, kernel, head, attention_kernel):
    """Hopper, head 128: caches of 16 n-key blocks (or one block per row of 8 n keys) in NHD,
    HND or layer-strided order take one 5-d TMA box per 16-key chunk for K and V in any block
    order ('sm90-tma16', reading a row's last chunk whole: masked in K, zeroed in V; past a
    one-block row's end the map gives zeros).  Otherwise power-of-two blocks of 32+ keys take
    per-half TMA boxes in any layout (block/token/head dims in any stride order), and smaller
    power-of-two blocks of a flat cache (block stride = block * token stride: NHD) when at
    least a quarter of the tiles are runs of consecutive blocks ('sequential', 'runs'), which
    come in as one box per half -- reading past a row's last block into its spare neighbour --
    and blocks too small for a box per lane when every tile is a run; head 64 likewise, except
    that its 16-key blocks take the cp.async producer; other caches take the same
    warp-specialized kernel with a cp.async producer (per 16-key group addresses for
    power-of-two blocks of 16+ keys, per-key ones otherwise: 24, 2), and a cache whose head dim
    is not contiguous the cp.async wgmma kernel.
    Cache slots past each row's end -- the tail of its last block and the spare blocks -- hold
    NaN, so a kernel that lets them meet a zero probability poisons the row."""
    if _C.build_info()["attention_kernel"] != "sm90-tma":
        pytest.skip("needs the TMA kernel (Hopper, sm_90a build)")
    _poisoned_call(block, layout, order, kernel, head, [1000, 77, 2333], [1000, 77, 300])


@pytest.mark.parametrize(
    ("block", "layout", "order", "kernel"),
    [
        (16, "nhd", "sequential", "sm90-tma16"),
        (16, "nhd", "runs", "sm90-tma16"),
        (32768, "nhd", "random", "sm90-tma16"),  # one block per row
        (32768, "hnd", "random", "sm90-tma16"),
        (32776, "nhd", "random", "sm90-tma16"),  # one block per row of 8 n keys
        (16, "nhd", "random", "sm90-tma16"),  # one 5-d box per 16-key chunk for K and V
        (16, "hnd", "random", "sm90-tma16"),  # not a flat cache: 176-key tiles all the same
        (16, "layers", "random", "sm90-tma16"),
    ],
)
def test_wide_key_tiles_long_rows_and_poison(block, layout, order, kernel, attention_kernel):
    """Head-128 calls whose longest row has 16384+ keys take 176-key tiles when TMA can cut
    them (16-key blocks -- runs of a flat cache, or any order through the per-block 5-d boxes --
    and one block per row), with and without a mask: rows
    shorter than a tile, rows ending mid-tile next to NaN slots, and a long row all meet the
    reference, unmasked, causal and with key limits."""
    if _C.build_info()["attention_kernel"] != "sm90-tma":
        pytest.skip("needs the TMA kernel (Hopper, sm_90a build)")
    _poisoned_call(block, layout, order, kernel, 128, [1000, 77, 16500], [1000, 77, 200], causal=True)


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize(
    ("out_layout", "staged"),
    [
        ("contiguous", True),  # 16-byte rows: staged through shared memory, 16-byte stores
        ("head_pad8", True),  # head stride D + 8: rows still 16-byte aligned
        ("head_pad2", False),  # head stride D + 2: 4-byte stores from the accumulators
        ("offset1", False),  # base one element in: 2-byte stores
        ("strided_dim", False),  # every other element
    ],
)
def test_tma_kernel_output_layouts(head, out_layout, staged, attention_kernel):
    """The warp-specialized kernel writes its output rows through shared memory with 16-byte
    stores when every row is 16-byte aligned, and from the accumulators otherwise; both give the
    reference in any output view, write nothing outside it (NaN around it stays), and honour
    the padded rows of the last query tile (query lengths not multiples of the tile)."""
    if _C.build_info()["attention_kernel"] != "sm90-tma":
        pytest.skip("needs the TMA kernel (Hopper, sm_90a build)")
    seq_lens, query_lens = [700, 333, 1500], [700, 45, 201]
    p = _paged_problem(seq_lens, query_lens, 8, 2, head, 16, torch.bfloat16, seed=head)
    n = p["q"].shape[0]
    pad = {"head_pad8": 8, "head_pad2": 2}.get(out_layout, 0)
    if out_layout == "strided_dim":
        buf = torch.full((n, 8, 2 * head), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = buf[..., ::2]
    elif out_layout == "offset1":
        buf = torch.full((n * 8 * head + 1,), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = buf[1:].view(n, 8, head)
    else:
        buf = torch.full((n, 8, head + pad), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = buf[..., :head]
    assert (
        out.stride(-1) == 1 and out.data_ptr() % 16 == 0 and all(2 * st % 16 == 0 for st in out.stride()[:-1])
    ) == staged
    scale = head**-0.5
    _C.paged_attention(
        p["q"],
        p["cache"],
        p["table"].cuda(),
        p["qsl"].cuda(),
        p["seq_lens"].cuda(),
        None,
        _C.MASK_NONE,
        scale,
        out,
        p["table"],
        p["qsl"],
        p["seq_lens"],
    )
    assert _C.last_attention_kernel().startswith("sm90-")
    _check(
        out,
        p,
        [torch.full((q,), s, dtype=torch.int32) for s, q in zip(seq_lens, query_lens, strict=True)],
        scale,
    )
    written = torch.zeros_like(buf, dtype=torch.bool)
    if out_layout == "strided_dim":
        written[..., ::2] = True
    elif out_layout == "offset1":
        written[1:] = True
    else:
        written[..., :head] = True
    assert not buf[written].isnan().any()
    assert buf[~written].isnan().all()


def _poisoned_call(block, layout, order, kernel, head, seq_lens, query_lens, causal=False):
    """test_tma_kernel_layouts_blocks_and_poison's call: NaN in every slot no row may read,
    unmasked and with key limits (and causal), each against the reference."""
    p = _paged_problem(seq_lens, query_lens, 8, 2, head, block, torch.bfloat16, seed=block, order=order)
    cache = p["cache"]
    used = torch.zeros(cache.shape[1], dtype=torch.bool)
    for r, s in enumerate(seq_lens):
        n = -(-s // block)
        ids = p["table"][r, :n].long()
        used[ids] = True
        cache[:, ids[-1], s - (n - 1) * block :] = float("nan")
    cache[:, ~used.cuda()] = float("nan")
    if layout == "hnd":  # [2, blocks, heads, block, D] in memory
        cache = cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    elif layout == "layers":  # one layer of a [blocks, layers, 2, block, heads, D] buffer
        buf = torch.zeros(cache.shape[1], 3, 2, *cache.shape[2:], dtype=cache.dtype, device="cuda")
        buf[:, 1] = cache.permute(1, 0, 2, 3, 4)
        cache = buf[:, 1].permute(1, 0, 2, 3, 4)
    elif layout == "strided-dim":  # every other element of a twice-as-wide head dim
        wide = torch.zeros(*cache.shape[:-1], 2 * head, dtype=cache.dtype, device="cuda")
        wide[..., ::2] = cache
        cache = wide[..., ::2]
    p["cache"] = cache
    limits = []
    for s, n in zip(seq_lens, query_lens, strict=True):
        pos = torch.arange(s - n, s, dtype=torch.int32)
        limits.append(torch.where(pos % 300 < 150, pos + 1, torch.full_like(pos, s)))
    scale = head**-0.5
    full = [torch.full((n,), s, dtype=torch.int32) for s, n in zip(seq_lens, query_lens, strict=True)]
    masks = [(_C.MASK_NONE, full), (_C.MASK_LIMITS, limits)]
    if causal:  # bottom-right: the row's query i sees keys j < seq_len - query_len + i + 1
        bottom_right = [
            torch.arange(s - n + 1, s + 1, dtype=torch.int32)
            for s, n in zip(seq_lens, query_lens, strict=True)
        ]
        masks.append((_C.MASK_CAUSAL, bottom_right))
    for code, lim in masks:
        out = _run(p, code, torch.cat(lim) if code == _C.MASK_LIMITS else None, scale)
        assert _C.last_attention_kernel() == kernel
        assert not out.isnan().any()
        _check(out, p, lim, scale)
