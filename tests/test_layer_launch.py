"""forward_paged's one submission on CUDA (cuda/launch.cu): the KV write and the attention go out
as one cached two-kernel CUDA graph per (stream, kernel pair).  Checked against the same two
kernels launched one by one (_C.kv_write, then _C.paged_attention): bit-identical outputs and
caches for every kernel pair the graph cache sees (more pairs than it holds, twice over), on
several streams at once, and an attention that refuses the call leaves the cache untouched."""

import pytest
import torch

from diffkv import _C

pytestmark = pytest.mark.gpu


def _problem(head, dtype, block, mask, seed, heads=4, kv_heads=2):
    """Two rows (prefix in the cache + new tokens to write and attend), random block order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    prefixes, news = (37, 90), (20, 33)
    seq_lens = [p + n for p, n in zip(prefixes, news, strict=True)]
    blocks = [-(-s // block) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((2, max(blocks)), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(blocks):
        table[r, :n] = torch.tensor(perm[at : at + n], dtype=torch.int32)
        at += n
    cache = torch.randn(2, num_blocks, block, kv_heads, head, device="cuda", dtype=dtype, generator=g)
    slots = []
    for r, (p, s) in enumerate(zip(prefixes, seq_lens, strict=True)):
        pos = torch.arange(p, s)
        slots.append(table[r, pos // block].long() * block + pos % block)
    n = sum(news)
    qsl = torch.tensor([0, news[0], n], dtype=torch.int32)
    return {
        "q": torch.randn(n, heads, head, device="cuda", dtype=dtype, generator=g),
        "k": torch.randn(n, kv_heads, head, device="cuda", dtype=dtype, generator=g),
        "v": torch.randn(n, kv_heads, head, device="cuda", dtype=dtype, generator=g),
        "cache": cache,
        "slots": torch.cat(slots).cuda(),
        "table": table,
        "qsl": qsl,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "mask": mask,
        "scale": head**-0.5,
    }


def _host(p):
    return p["table"], p["qsl"], p["seq_lens"]


def _fused(p):
    """forward_paged: one call, one submission; returns (out, cache)."""
    cache = p["cache"].clone()
    out = torch.empty_like(p["q"])
    dev = [t.cuda() for t in _host(p)]
    _C.forward_paged(
        p["q"], p["k"], p["v"], cache, p["slots"], *dev, None, p["mask"], p["scale"], out, *_host(p)
    )
    return out, cache


def _split(p):
    """The same kernels launched one by one: kv_write, then paged_attention."""
    cache = p["cache"].clone()
    out = torch.empty_like(p["q"])
    _C.kv_write(p["k"], p["v"], cache, p["slots"])
    dev = [t.cuda() for t in _host(p)]
    _C.paged_attention(p["q"], cache, *dev, None, p["mask"], p["scale"], out, *_host(p))
    return out, cache


CONFIGS = [
    (head, dtype, block)
    for dtype in (torch.float16, torch.bfloat16, torch.float32)
    for head in (64, 128)
    for block in (16, 32, 8)
]


def test_every_kernel_pair_matches_two_launches():
    """Every (dtype, head, block, mask) here -- more kernel pairs than the per-thread graph cache
    holds, so entries are evicted and rebuilt on the second pass -- gives the outputs and caches
    of the two kernels launched one by one, bit for bit."""
    for rnd in range(2):
        for i, (head, dtype, block) in enumerate(CONFIGS):
            for mask in (_C.MASK_NONE, _C.MASK_CAUSAL):
                p = _problem(head, dtype, block, mask, seed=100 * rnd + 2 * i + mask)
                out, cache = _fused(p)
                ref_out, ref_cache = _split(p)
                torch.cuda.synchronize()
                assert torch.equal(cache, ref_cache), (head, dtype, block, mask)
                assert torch.equal(out, ref_out), (head, dtype, block, mask)


def test_several_streams_at_once():
    """Layers submitted on two side streams and the default stream, interleaved, each with its
    own cache: every stream gets its own graph, and each result is the one-by-one result."""
    problems = [_problem(128, torch.bfloat16, 16, _C.MASK_CAUSAL, seed=s) for s in range(6)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.current_stream()]
    results = []
    for rnd in range(3):
        for i, p in enumerate(problems):
            s = streams[(i + rnd) % 3]
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                results.append((p, *_fused(p)))
    torch.cuda.synchronize()
    for p, out, cache in results:
        ref_out, ref_cache = _split(p)
        assert torch.equal(cache, ref_cache)
        assert torch.equal(out, ref_out)


def test_refused_attention_leaves_the_cache_untouched():
    """float32 at head size 512 has no CUDA attention kernel: forward_paged raises before either
    kernel is submitted, so the KV write did not happen either (it used to)."""
    p = _problem(512, torch.float32, 16, _C.MASK_NONE, seed=3)
    cache = p["cache"].clone()
    out = torch.zeros_like(p["q"])
    dev = [t.cuda() for t in _host(p)]
    with pytest.raises(
        ValueError,
        match=r"^paged_attention\(\): head_size must be between 1 and 256 for float32 on CUDA, got 512$",
    ):
        _C.forward_paged(
            p["q"], p["k"], p["v"], cache, p["slots"], *dev, None, p["mask"], p["scale"], out, *_host(p)
        )
    torch.cuda.synchronize()
    assert torch.equal(cache, p["cache"])
    assert (out == 0).all()
