"""_C.paged_attention / _C.forward_paged with the three host copies None: CPU tensors are
checked themselves; on CUDA the caller vouches for the device metadata (diffkv.ops, inside
compiled graphs) and the kernels clamp every index, so the results equal the checked call and
hostile device metadata stays memory-safe."""

import re

import pytest
import torch

from diffkv import _C


def _problem(device, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    seq_lens, block, heads, kv_heads, head = [40, 75], 16, 4, 2, 64  # query lens 17 and 75
    blocks = [-(-s // block) for s in seq_lens]
    nb = sum(blocks) + 2
    perm = torch.randperm(nb, generator=g)
    table = torch.zeros(2, max(blocks), dtype=torch.int32)
    table[0, : blocks[0]] = perm[: blocks[0]].int()
    table[1, : blocks[1]] = perm[blocks[0] : blocks[0] + blocks[1]].int()
    cache = torch.randn(2, nb, block, kv_heads, head, generator=g).to(dtype).to(device)
    qsl = torch.tensor([0, 17, 92], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(92, heads, head, generator=g).to(dtype).to(device)
    limits = torch.cat([torch.arange(24, 41), torch.arange(1, 76)]).int()
    return q, cache, table, qsl, sl, limits


@pytest.mark.parametrize("mask", [0, 1, 2])
def test_none_host_copies_match_the_checked_call(device, mask):
    q, cache, table, qsl, sl, limits = _problem(device)
    kl = limits.to(device) if mask == 2 else None
    outs = []
    for host in ((table, qsl, sl), (None, None, None)):
        out = torch.empty_like(q)
        _C.paged_attention(
            q, cache, table.to(device), qsl.to(device), sl.to(device), kl, mask, 0.125, out, *host
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_none_host_copies_still_checked_on_cpu():
    q, cache, table, qsl, sl, _ = _problem("cpu")
    bad = table.clone()
    bad[1, 0] = 10**6
    with pytest.raises(ValueError, match=re.escape("paged_attention(): block_table[1][0] must be in [0, ")):
        _C.paged_attention(q, cache, bad, qsl, sl, None, 0, 0.125, torch.empty_like(q), None, None, None)


def test_host_copies_all_or_none():
    q, cache, table, qsl, sl, _ = _problem("cpu")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "paged_attention(): host_block_table, host_query_start_loc and host_seq_lens must all "
            "be tensors or all be None, got 1 None"
        ),
    ):
        _C.paged_attention(q, cache, table, qsl, sl, None, 0, 0.125, torch.empty_like(q), table, None, sl)


@pytest.mark.gpu
def test_hostile_device_metadata_without_host_copies_is_memory_safe():
    q, cache, table, qsl, sl, limits = _problem("cuda")
    bad_table = torch.full_like(table, 2**30).cuda()
    bad_qsl = torch.tensor([0, 10**6, -5], dtype=torch.int32, device="cuda")
    bad_sl = torch.tensor([10**7, -1], dtype=torch.int32, device="cuda")
    bad_limits = torch.full((92,), 2**30, dtype=torch.int32, device="cuda")
    for mask, kl in ((0, None), (1, None), (2, bad_limits)):
        out = torch.empty_like(q)
        _C.paged_attention(q, cache, bad_table, bad_qsl, bad_sl, kl, mask, 0.125, out, None, None, None)
        torch.cuda.synchronize()
