"""DiffKVAttentionImpl.forward (dense) under CUDA-graph capture: joint attention and packed
documents with device cu_seqlens capture and replay to the eager result; host cu_seqlens are
refused while capturing (their copy would replay stale host memory) with a RuntimeError."""

import pytest
import torch

import diffkv
from diffkv.backends.abstract import AttentionMetadata

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD = 8, 2, 128


def _tensors(b, s, heads, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(b, s, heads, HEAD, generator=g, device="cuda", dtype=torch.bfloat16)


def _capture(fn):
    """fn captured once (after a warm-up on a side stream), returned with its graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("case", ["joint", "varlen"])
def test_dense_forward_graph_replay(case):
    impl = diffkv.DiffKVAttentionImpl(HEADS, HEAD, softmax_scale=HEAD**-0.5, num_kv_heads=KV_HEADS)
    s = 264
    q, k, v = _tensors(1, s, HEADS, 1), _tensors(1, s, KV_HEADS, 2), _tensors(1, s, KV_HEADS, 3)
    if case == "joint":
        jq, jk, jv = _tensors(1, 48, HEADS, 4), _tensors(1, 48, KV_HEADS, 5), _tensors(1, 48, KV_HEADS, 6)
        meta = AttentionMetadata(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy="front")
    else:
        cu = torch.tensor([0, 64, 200, s], dtype=torch.int32, device="cuda")
        meta = AttentionMetadata(extra={"cu_seqlens_q": cu, "cu_seqlens_k": cu})
    graph, out = _capture(lambda: impl.forward(q, k, v, meta))
    for seed in (10, 20):
        for t, heads, extra_seed in ((q, HEADS, 0), (k, KV_HEADS, 1), (v, KV_HEADS, 2)):
            t.copy_(_tensors(1, s, heads, seed + extra_seed))
        graph.replay()
        torch.cuda.synchronize()
        eager = impl.forward(q, k, v, meta)
        assert torch.equal(out, eager)


# The refusal comes before anything is queued, so torch warns that the capture is empty.
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_host_cu_seqlens_refused_while_capturing():
    impl = diffkv.DiffKVAttentionImpl(HEADS, HEAD, softmax_scale=HEAD**-0.5, num_kv_heads=KV_HEADS)
    q, k, v = _tensors(1, 64, HEADS, 1), _tensors(1, 64, KV_HEADS, 2), _tensors(1, 64, KV_HEADS, 3)
    cu = torch.tensor([0, 24, 64], dtype=torch.int32)
    meta = AttentionMetadata(extra={"cu_seqlens_q": cu, "cu_seqlens_k": cu})
    impl.forward(q, k, v, meta)  # eager: fine
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError) as info:
        with torch.cuda.graph(graph):
            impl.forward(q, k, v, meta)
    assert str(info.value) == (
        "DiffKVAttentionImpl.forward(): host cu_seqlens cannot be captured in a CUDA graph; pass "
        "them as device tensors"
    )
