"""A KV cache of more than 2^31 elements: every kernel indexes with int64 (the value half and the
last blocks lie beyond 2^31 elements from the base pointer).  Needs ~4.3 GB of GPU memory."""

import pytest
import torch

from diffkv import _C
from reference import mask_causal, max_error, ref_attention

pytestmark = pytest.mark.gpu


def test_cache_beyond_int32_elements():
    kv_heads, head, block, heads = 8, 128, 16, 16
    per_block = block * kv_heads * head
    num_blocks = 2**31 // (2 * per_block) + 64
    cache = torch.zeros(2, num_blocks, block, kv_heads, head, dtype=torch.bfloat16, device="cuda")
    assert cache.numel() > 2**31 and cache[1].storage_offset() * 2 > 2**31

    g = torch.Generator(device="cuda").manual_seed(0)
    seq_len = 100
    blocks = list(range(num_blocks - 1, num_blocks - 1 - (-(-seq_len // block)), -1))
    table = torch.tensor([blocks], dtype=torch.int32)
    pos = torch.arange(seq_len)
    slots = (table[0, pos // block].long() * block + pos % block).cuda()
    key = torch.randn(seq_len, kv_heads, head, device="cuda", dtype=torch.bfloat16, generator=g)
    value = torch.randn(seq_len, kv_heads, head, device="cuda", dtype=torch.bfloat16, generator=g)
    _C.kv_write(key, value, cache, slots)
    b, o = slots // block, slots % block
    assert torch.equal(cache[0, b, o], key) and torch.equal(cache[1, b, o], value)

    q = torch.randn(seq_len, heads, head, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, seq_len], dtype=torch.int32)
    sl = torch.tensor([seq_len], dtype=torch.int32)
    scale = head**-0.5
    _C.paged_attention(
        q, cache, table.cuda(), qsl.cuda(), sl.cuda(), None, _C.MASK_CAUSAL, scale, out, table, qsl, sl
    )

    ref = ref_attention(q, key, value, mask_causal(range(seq_len), seq_len), scale, device="cuda")
    assert max_error(out, ref) < 2e-2
