"""A small, launch-light run of every diffkv CUDA kernel for compute-sanitizer.

    compute-sanitizer --tool memcheck  --kernel-name regex='attention_|kv_write|kv_amax|rows_|slots_' \\
        python3 tests/gpu_sanitize.py
    (also --tool racecheck, initcheck, synccheck; see benchmarks/gpu_session.sh --sanitize)

Each op runs on tiny shapes covering its code paths (aligned and strided K/V, block sizes 1/16,
all three masks, fp16/bf16/fp32, every head size the CUDA kernels take, padded rows,
float8_e4m3fn caches); results are checked against the CPU path so a kernel that misbehaves
under the tool also fails here.
Exits 0 on success.
"""

import sys

import torch

import diffkv
from diffkv import _C


def _attention_case(
    dtype, head, block, mask, strided, sequential=False, seq_lens=(37, 70), query_lens=(20, 70)
):
    g = torch.Generator().manual_seed(head + block + mask)
    rows, seq_lens, query_lens, heads, kv_heads = 2, list(seq_lens), list(query_lens), 4, 2
    blocks = [-(-s // block) for s in seq_lens]
    nb = sum(blocks) + 3
    # sequential: blocks in allocation order (a flat cache's tiles of consecutive blocks)
    perm = torch.arange(nb) if sequential else torch.randperm(nb, generator=g)
    table = torch.zeros(rows, max(blocks), dtype=torch.int32)
    at = 0
    for r, n in enumerate(blocks):
        table[r, :n] = perm[at : at + n].int()
        at += n
    # Strided: a cache view with a padded head stride (the element-load path on CUDA).
    width = head + 8 if strided else head
    backing = torch.randn(2, nb, block, kv_heads, width, generator=g).to(dtype)
    qsl = torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(sum(query_lens), heads, head, generator=g).to(dtype)
    limits = []
    for s, n in zip(seq_lens, query_lens, strict=True):
        pos = torch.arange(s - n, s, dtype=torch.int32)
        limits.append(torch.where(pos % 11 < 5, pos + 1, torch.clamp(pos + 9, max=s)))
    kl = torch.cat(limits) if mask == _C.MASK_LIMITS else None
    outs = []
    for device in ("cpu", "cuda"):
        out = torch.empty_like(q, device=device)
        _C.paged_attention(
            q.to(device),
            backing.to(device)[..., :head],
            table.to(device),
            qsl.to(device),
            sl.to(device),
            None if kl is None else kl.to(device),
            mask,
            head**-0.5,
            out,
            table,
            qsl,
            sl,
        )
        outs.append(out.cpu().float())
    err = (outs[0] - outs[1]).abs().max().item()
    assert err < 3e-2, f"attention {dtype} d{head} b{block} mask{mask}: {err}"


def _fp8_attention_case(dtype, head, block, mask, seq_lens=(37, 150)):
    """Attention over a float8_e4m3fn cache (per-head scales): on Hopper the e4m3 kernel, its TMA
    producer with blocks of a multiple of 8 keys or one block a row (boxes of 16 keys, or 8 at
    blocks of an odd multiple of 8; head 64 and 128), cp.async otherwise; rows ending mid-chunk
    (and, with longer seq_lens, blocks that straddle the 256-key tiles).  The CPU
    reference reads the same cache but keeps Q and P unrounded: a relative L2 of 0.1 bounds
    their e4m3 rounding with room."""
    g = torch.Generator().manual_seed(head + block + mask + 7)
    seq_lens, query_lens, heads, kv_heads = list(seq_lens), [20, 70], 4, 2
    cols = -(-max(seq_lens) // block)
    nb = 2 * cols + 3
    table = torch.randperm(nb, generator=g)[: 2 * cols].view(2, cols).int()
    cache = (torch.randn(2, nb, block, kv_heads, head, generator=g) * 50).clamp(-448, 448)
    cache = cache.to(torch.float8_e4m3fn)
    k_scale, v_scale = torch.tensor([0.01, 0.02]), torch.tensor([0.02, 0.03])
    qsl = torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(sum(query_lens), heads, head, generator=g).to(dtype)
    kl = None
    if mask == _C.MASK_LIMITS:
        pairs = zip(seq_lens, query_lens, strict=True)
        kl = torch.cat([torch.randint(0, s + 1, (n,), generator=g) for s, n in pairs]).int()
    outs = []
    for device in ("cpu", "cuda"):
        out = torch.empty_like(q, device=device)
        _C.paged_attention(
            q.to(device), cache.to(device), table.to(device), qsl.to(device), sl.to(device),
            None if kl is None else kl.to(device), mask, head**-0.5, out, table, qsl, sl,
            k_scale.to(device), v_scale.to(device),
        )  # fmt: skip
        outs.append(out.cpu().double())
    rel = ((outs[0] - outs[1]).norm() / outs[0].norm()).item()
    assert rel < 0.1, f"fp8 attention {dtype} d{head} b{block} mask{mask}: relative L2 {rel}"


def _kv_write_case(dtype, strided, fp8=False, head=64):
    """The write (fp8: quantizing into a float8_e4m3fn cache, per-head scales; strided: K/V
    views of a fused projection, and with fp8 a dim stride of 2 -- the element-wise kernel; a
    head of whole 16-element units takes 16-byte e4m3 stores from 16-bit inputs, head 40 the
    8-byte ones)."""
    g = torch.Generator().manual_seed(7)
    tokens, kv_heads, block, nb = 45, 2, 16, 6
    src = torch.randn(tokens, 3, kv_heads, 2 * head if fp8 else head, generator=g).to(dtype)
    if fp8:
        src = src[..., ::2] if strided else src[..., :head]
    key, value = (src[:, 1], src[:, 2]) if strided else (src[:, 1].contiguous(), src[:, 2].contiguous())
    slots = torch.randperm(nb * block, generator=g)[:tokens]
    slots[::7] = -1
    scales = (torch.tensor([0.5, 3.0]), torch.tensor([0.25, 1.0])) if fp8 else ()
    caches = []
    for device in ("cpu", "cuda"):
        cache = torch.zeros(
            2, nb, block, kv_heads, head, dtype=torch.float8_e4m3fn if fp8 else dtype, device=device
        )
        _C.kv_write(
            key.to(device), value.to(device), cache, slots.to(device), *(s.to(device) for s in scales)
        )
        caches.append(cache.cpu().view(torch.uint8) if fp8 else cache.cpu())
    assert torch.equal(caches[0], caches[1]), f"kv_write {dtype} strided={strided} fp8={fp8} d{head}"


def _quantize_kv_case(dtype, strided):
    """The fp8 dense forward's rounding (the amax kernel's 16-byte units, or single elements over
    a dim stride of 2; the scales kernel; the quantizing write with no slot mapping), a joint
    pair of another length beside the main one."""
    g = torch.Generator().manual_seed(11)
    srcs = []
    for n in (45, 13):
        x = torch.randn(n, 2, 2, 128, generator=g).to(dtype)
        srcs += [x[:, i, :, ::2] if strided else x[:, i, :, :64].contiguous() for i in (0, 1)]
    got = []
    for device in ("cpu", "cuda"):
        xs = [x.to(device) for x in srcs]
        outs = [torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device) for x in xs]
        scales = torch.empty(2, device=device)
        _C.quantize_kv(xs[0], xs[1], outs[0], outs[1], scales, xs[2], xs[3], outs[2], outs[3])
        got.append([scales.cpu().view(torch.uint8)] + [o.cpu().view(torch.uint8) for o in outs])
    for a, b in zip(got[0], got[1], strict=True):
        assert torch.equal(a, b), f"quantize_kv {dtype} strided={strided}"


def _slots_and_rows_case():
    table = torch.tensor([[3, 1, 0], [2, 4, 5]], dtype=torch.int32)
    ri = torch.tensor([1, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 12], dtype=torch.int32)
    pos = torch.cat([torch.arange(3, 8), torch.arange(0, 7)])
    outs = []
    for device in ("cpu", "cuda"):
        out = torch.full((16,), 99, dtype=torch.int64, device=device)
        _C.compute_slot_mappings(
            table.to(device), ri.to(device), qsl.to(device), pos.to(device), out, 12, 16, 4, 1, 0, 1
        )
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1]), "slots"
    src = torch.randn(10, 2, 64).to(torch.bfloat16)
    index = torch.tensor([7, 2, 9, 0], dtype=torch.int64)
    for op in (_C.rows_gather, _C.rows_scatter):
        results = []
        for device in ("cpu", "cuda"):
            if op is _C.rows_gather:
                dst = torch.empty(4, 2, 64, dtype=torch.bfloat16, device=device)
                op(src.to(device), index.to(device), dst)
            else:
                # rows the scatter leaves alone hold the same value on both devices
                dst = torch.full((12, 2, 64), 7.0, dtype=torch.bfloat16, device=device)
                op(src[:4].to(device), index.to(device), dst)
            results.append(dst.cpu())
        assert torch.equal(results[0], results[1]), op.__name__


def _dense_joint_case(dtype):
    """dense_attention with a second K/V source (joint tokens): CUDA against the CPU path."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, head, n_k, n_j = 4, 2, 128, 50, 7
    q = torch.randn(30, heads, head, generator=g).to(dtype)
    k, v = (torch.randn(n_k, kv_heads, head, generator=g).to(dtype) for _ in range(2))
    jk, jv = (torch.randn(n_j, kv_heads, head, generator=g).to(dtype) for _ in range(2))
    index = torch.cat([torch.arange(n_k, n_k + n_j), torch.randperm(n_k, generator=g)[:40]])
    index = index.to(torch.int32)[None]
    qsl = torch.tensor([0, 30], dtype=torch.int32)
    sl = torch.tensor([47], dtype=torch.int32)
    outs = []
    for dev in ("cpu", "cuda"):
        out = torch.zeros(30, heads, head, dtype=dtype, device=dev)
        t = [x.to(dev) for x in (q, k, v, index, qsl, sl)]
        _C.dense_attention(
            *t, None, _C.MASK_NONE, 0.1, out, None, None, None, 30, jk.to(dev), jv.to(dev), 1, 0
        )
        outs.append(out.cpu().float())
    if (outs[0] - outs[1]).abs().max().item() > 2e-2:
        raise AssertionError("dense_attention joint: CUDA and CPU disagree")


def _dense_long_rows_case():
    """DiffKVAttentionImpl.forward over rows of 16384+ keys (Hopper: in-order 16-key blocks,
    176-key tiles of per-chunk 5-d boxes, and 8-key blocks vouched consecutive, 176-key tiles
    of flat boxes), non-causal and causal: CUDA against the CPU path, a few queries against
    every key."""
    g = torch.Generator().manual_seed(9)
    for keys in (16400, 16392):  # 16 and 8 keys per block
        k, v = (torch.randn(1, keys, 2, 128, generator=g).to(torch.bfloat16) for _ in range(2))
        q = torch.randn(1, 40, 2, 128, generator=g).to(torch.bfloat16)
        for causal in (False, True):
            impl = diffkv.DiffKVAttentionImpl(2, 128, softmax_scale=128**-0.5, causal=causal)
            outs = [impl.forward(*(x.to(dev) for x in (q, k, v))).cpu().float() for dev in ("cpu", "cuda")]
            if (outs[0] - outs[1]).abs().max().item() > 2e-2:
                raise AssertionError(f"dense forward, {keys} keys, causal={causal}: CUDA and CPU disagree")
    # joint tokens first (32: whole 16-key chunks), two rows of 16392 image keys: a TMA box per
    # chunk from each source's map, 176-key tiles, the image's last chunk half past the row
    k, v = (torch.randn(2, 16392, 2, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(2, 24, 2, 128, generator=g).to(torch.bfloat16)
    jq, jk, jv = (torch.randn(2, 32, 2, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    impl = diffkv.DiffKVAttentionImpl(2, 128, softmax_scale=128**-0.5, causal=False)
    outs = []
    for dev in ("cpu", "cuda"):
        meta = diffkv.AttentionMetadata(joint_query=jq.to(dev), joint_key=jk.to(dev), joint_value=jv.to(dev))
        outs.append(impl.forward(q.to(dev), k.to(dev), v.to(dev), meta).cpu().float())
    if (outs[0] - outs[1]).abs().max().item() > 2e-2:
        raise AssertionError("dense joint forward, 32 + 16392 keys: CUDA and CPU disagree")


def _dense_joint_fp8_case():
    """The dense fp8 forward with joint tokens, batch 2: both sources rounded into their rows of
    one buffer (quantize_kv's 4-d outputs, rows interleaving batch row by batch row), each row
    one block of 23 + 90 keys (the e4m3 kernel's TMA producer on Hopper), causal and not: CUDA
    against the CPU path."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 90, 2, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    jq, jk, jv = (torch.randn(2, 23, 2, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        impl = diffkv.DiffKVAttentionImpl(2, 128, softmax_scale=128**-0.5, causal=causal)
        outs = []
        for dev in ("cpu", "cuda"):
            meta = diffkv.AttentionMetadata(
                joint_query=jq.to(dev), joint_key=jk.to(dev), joint_value=jv.to(dev),
                joint_strategy="rear" if causal else "front", extra={"kv_cache_dtype": "fp8"},
            )  # fmt: skip
            outs.append(impl.forward(q.to(dev), k.to(dev), v.to(dev), meta).cpu().double())
        rel = ((outs[0] - outs[1]).norm() / outs[0].norm()).item()
        assert rel < 0.1, f"dense fp8 joint forward, causal={causal}: relative L2 {rel}"


def main():
    if not torch.cuda.is_available() or not _C.cuda_compiled():
        print("gpu_sanitize: needs a CUDA device and a CUDA build", file=sys.stderr)
        return 2
    _slots_and_rows_case()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        _kv_write_case(dtype, strided=False)
        _kv_write_case(dtype, strided=True)
        _kv_write_case(dtype, strided=False, fp8=True)
        _kv_write_case(dtype, strided=True, fp8=True)
        _kv_write_case(dtype, strided=False, fp8=True, head=40)
        _quantize_kv_case(dtype, strided=False)
        _quantize_kv_case(dtype, strided=True)
    for dtype, head in ((torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 64)):
        # on Hopper: 16 and 32 TMA boxes (head 64/128), 16 sequential the flat map's boxes
        for block, sequential in ((1, False), (16, False), (16, True), (32, False)):
            for mask in (_C.MASK_NONE, _C.MASK_CAUSAL, _C.MASK_LIMITS):
                _attention_case(dtype, head, block, mask, strided=(block == 1), sequential=sequential)
    # the other head sizes: on Hopper the warp-specialized kernel's own forms at 192 and 256 (block
    # 16 and 48: per-chunk TMA boxes; block 16 over a padded head stride: the group producer) and
    # the forms padded to 64, 128 or 192 dims (block 16: the group producer; block 48 at 160: the
    # per-row producer's passes of 64-dim panels; block 1, a padded head stride: the per-row
    # producer); elsewhere the mma.sync kernel's row-order chunk mappings, head 72's zero dims,
    # 32-key tiles above head 128
    for head in _C.supported_head_sizes("cuda", "bfloat16", "auto"):
        if head in (64, 128):
            continue
        cases = [(torch.bfloat16, 16, False), (torch.float16, 1, True)]
        if head in (160, 192, 256):
            cases.append((torch.bfloat16, 48, False))
        if head in (192, 256):
            cases.append((torch.float16, 16, True))
        for dtype, block, strided in cases:
            for mask in (_C.MASK_NONE, _C.MASK_CAUSAL, _C.MASK_LIMITS):
                _attention_case(dtype, head, block, mask, strided=strided)
    # the three-warpgroup form of heads 72 to 96 on Hopper: 192-row query tiles over more 112-key
    # tiles than its two K and three V slots
    for head in (72, 80, 96):
        for mask in (_C.MASK_NONE, _C.MASK_CAUSAL, _C.MASK_LIMITS):
            _attention_case(torch.bfloat16, head, 16, mask, False, seq_lens=(37, 900), query_lens=(20, 400))
    # a row of 16384+ keys: 176-key tiles of per-chunk 5-d boxes on Hopper, random and
    # allocation order, with or without a mask
    for sequential in (False, True):
        for mask in (_C.MASK_NONE, _C.MASK_CAUSAL, _C.MASK_LIMITS):
            _attention_case(torch.bfloat16, 128, 16, mask, False, sequential, seq_lens=(37, 16400))
    # two uniform rows of 18 query tiles (the last half full), 4 heads: 144 tiles, on Hopper the
    # persistent kernel ('sm90-persist': a CTA takes a second tile where there are fewer SMs);
    # then 35 tiles a row, 280 in all: some CTAs take a third, whose Q reuses the first's buffer
    for n in (2240, 4480):
        _attention_case(torch.bfloat16, 128, 16, _C.MASK_NONE, False, seq_lens=(n, n), query_lens=(n, n))
    if torch.cuda.get_device_capability()[0] == 9:  # the e4m3 kernel is Hopper's
        fp8_cases = (
            (torch.bfloat16, 128, 16),
            (torch.float16, 128, 1),
            (torch.bfloat16, 64, 16),
            (torch.bfloat16, 128, 8),
            (torch.float16, 64, 24),
        )
        for dtype, head, block in fp8_cases:
            for mask in (_C.MASK_NONE, _C.MASK_CAUSAL, _C.MASK_LIMITS):
                _fp8_attention_case(dtype, head, block, mask)
        for mask in (_C.MASK_NONE, _C.MASK_CAUSAL):  # 48-key blocks across three tiles
            _fp8_attention_case(torch.bfloat16, 128, 48, mask, seq_lens=(37, 700))
        for mask in (_C.MASK_NONE, _C.MASK_LIMITS):  # one block of 150 keys a row (TMA, zeros past it)
            _fp8_attention_case(torch.bfloat16, 128, 150, mask)
    # the mma.sync kernel's e4m3 form at the head sizes without an e4m3 wgmma kernel (every GPU)
    for head in (32, 72, 80, 96, 160, 192, 256):
        for mask in (_C.MASK_NONE, _C.MASK_LIMITS):
            _fp8_attention_case(torch.bfloat16, head, 16, mask)
    _fp8_attention_case(torch.float16, 96, 1, _C.MASK_CAUSAL)
    for dtype in (torch.bfloat16, torch.float32):
        _dense_joint_case(dtype)
    if _C.build_info()["attention_kernel"] == "sm90-tma":
        _dense_joint_fp8_case()
    _dense_long_rows_case()
    torch.cuda.synchronize()
    print("gpu_sanitize: all kernels ran and matched the CPU path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
