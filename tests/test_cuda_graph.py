"""forward_paged under CUDA-graph capture: one layer (prepare + KV write + attention + output
restore) captured once, its query/key/value storage overwritten in place, replayed; the replay
matches an eager call on the same data."""

from types import SimpleNamespace

import pytest
import torch

import diffkv as dk

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD, BLOCK = 8, 2, 64, 16
PREFIXES, IMAGE = (37, 90), 129


def _build(dtype=torch.bfloat16):
    device = torch.device("cuda")
    seq_lens = [p + IMAGE for p in PREFIXES]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    spec = dk.AttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=dtype)
    kv = dk.KVCacheConfig(num_blocks=sum(blocks) + 4, kv_cache_groups=[dk.KVCacheGroup(["attn"], spec)])
    cfg = dk.DiffusionConfig(dk.ModelConfig(dtype), dk.CacheConfig(block_size=BLOCK))
    tables = dk.BlockTables([BLOCK], 2, sum(seq_lens), [max(blocks)], device)
    layer = dk.DiffusionPagedAttentionLayerAdapter(
        layer_name="attn",
        layer=SimpleNamespace(num_heads=HEADS, softmax_scale=HEAD**-0.5),
        spec=spec,
        vllm_config=cfg,
        device="cuda",
    )
    dk.allocate_kv_caches(kv, dtype=dtype, device=device, layers={"attn": layer})
    pool = dk.BlockPool(sum(blocks) + 4)
    bindings = {}
    for r, (s, n) in enumerate(zip(seq_lens, blocks, strict=True)):
        ids = pool.allocate(n)[::-1]
        tables.append_block_ids(r, [ids])
        bindings[("img", r, None)] = dk.DiffusionPagedAttentionRowBinding(row_index=r, max_seq_len=s)
    adapter = dk.DiffusionPagedAttentionAdapter(
        vllm_config=cfg,
        device="cuda",
        kv_cache_config=kv,
        block_tables=tables,
        attn_groups=[[dk.AttentionGroup(["attn"])]],
        layers={"attn": layer},
        resolve_row=lambda *identity: bindings[identity],
    )
    metadata = dk.DiffusionPagedAttentionMetadata(
        prefill_rows=tuple(
            dk.DiffusionPagedAttentionRow("img", s, s, sequence_id=r) for r, s in enumerate(seq_lens)
        ),
        denoise_rows=tuple(
            dk.DiffusionPagedAttentionRow("img", IMAGE, p + IMAGE, p, sequence_id=r)
            for r, p in enumerate(PREFIXES)
        ),
    )
    spans = dk.AttentionMetadata(full_attn_spans=[[(p, p + IMAGE)] for p in PREFIXES])
    return SimpleNamespace(adapter=adapter, layer=layer, metadata=metadata, spans=spans, seq_lens=seq_lens)


@pytest.mark.parametrize("layout", ["packed", "batched_padded"])
def test_forward_paged_graph_replay(layout):
    env = _build()
    runtime = dk.DiffusionPagedAttentionRuntime(env.adapter, env.metadata)
    with runtime.activate():
        # Step 0 (eager): the prefill writes every token, prefix pages included.
        n0 = sum(env.seq_lens)
        active = runtime.ensure_active(0)
        q0, k0, v0 = (
            torch.randn(n0, h * HEAD, device="cuda", dtype=torch.bfloat16)
            for h in (HEADS, KV_HEADS, KV_HEADS)
        )
        env.layer.impl.forward_paged(
            active.prepare_layer_context("attn", q0, k0, v0, omni_attn_metadata=env.spans)
        )

        active = runtime.ensure_active(1)
        # Packed [T, H*D], or batched [B, T, H*D] right-padded by 7 tokens per row: exercises
        # the row gather and the zeroing scatter inside the graph.
        shape = (2 * IMAGE,) if layout == "packed" else (2, IMAGE + 7)
        q, k, v = (
            torch.randn(*shape, h * HEAD, device="cuda", dtype=torch.bfloat16)
            for h in (HEADS, KV_HEADS, KV_HEADS)
        )

        def layer_call():
            context = active.prepare_layer_context("attn", q, k, v, omni_attn_metadata=env.spans)
            return env.layer.impl.forward_paged(context)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                layer_call()
        torch.cuda.current_stream().wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = layer_call()

        previous = None
        for trial in range(3):
            torch.manual_seed(100 + trial)
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            graph.replay()
            replayed = graph_out.clone()
            eager = layer_call()
            torch.cuda.synchronize()
            assert replayed.shape == eager.shape == (*shape, HEADS * HEAD)
            assert torch.equal(replayed, eager), f"trial {trial}: replay differs from eager"
            if layout != "packed":
                assert not replayed[:, IMAGE:].any(), "padded rows must come back as zeros"
            if previous is not None:
                assert not torch.equal(replayed, previous), "the replay must see the new inputs"
            previous = replayed
