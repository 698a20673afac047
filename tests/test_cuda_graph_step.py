"""A whole denoise step in one CUDA graph: every layer's projection, prepare_layer_context,
KV write and attention captured once, then replayed across steps with new latents, matching
eager step by step.

What must stay fixed between replays (README, "CUDA graphs"): the active batch (the graph holds
its metadata tensors), the token layout and shapes, the KV cache tensors, the spans (the
piecewise plan is built on the first, eager, call of the activation), and the input buffers the
graph reads (copy new latents into them; never rebind them)."""

from types import SimpleNamespace

import pytest
import torch

import diffkv as dk

pytestmark = pytest.mark.gpu

LAYERS, HEADS, KV_HEADS, HEAD, BLOCK = 3, 8, 2, 64, 16
PREFIXES, IMAGE = (29, 70), 97
HIDDEN = HEADS * HEAD


def _model(dtype):
    device = torch.device("cuda")
    names = [f"layers.{i}.attn" for i in range(LAYERS)]
    seq_lens = [p + IMAGE for p in PREFIXES]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    spec = dk.AttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=dtype)
    kv = dk.KVCacheConfig(num_blocks=sum(blocks) + 3, kv_cache_groups=[dk.KVCacheGroup(names, spec)])
    cfg = dk.DiffusionConfig(dk.ModelConfig(dtype), dk.CacheConfig(block_size=BLOCK))
    tables = dk.BlockTables([BLOCK], 2, sum(seq_lens), [max(blocks)], device)
    attn = SimpleNamespace(num_heads=HEADS, softmax_scale=HEAD**-0.5)
    layers = {
        n: dk.DiffusionPagedAttentionLayerAdapter(
            layer_name=n, layer=attn, spec=spec, vllm_config=cfg, device=device
        )
        for n in names
    }
    dk.allocate_kv_caches(kv, dtype=dtype, device=device, layers=layers)
    pool = dk.BlockPool(sum(blocks) + 3)
    bindings = {}
    for r, (s, n) in enumerate(zip(seq_lens, blocks, strict=True)):
        tables.append_block_ids(r, [pool.allocate(n)[::-1]])
        bindings[("img", r, None)] = dk.DiffusionPagedAttentionRowBinding(row_index=r, max_seq_len=s)
    adapter = dk.DiffusionPagedAttentionAdapter(
        vllm_config=cfg,
        device=device,
        kv_cache_config=kv,
        block_tables=tables,
        attn_groups=[[dk.AttentionGroup(names)]],
        layers=layers,
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
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        n: torch.randn(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD, device=device, generator=g).to(dtype)
        * HIDDEN**-0.5
        for n in names
    }
    spans = dk.AttentionMetadata(full_attn_spans=[[(p, p + IMAGE)] for p in PREFIXES])
    return SimpleNamespace(
        names=names,
        layers=layers,
        adapter=adapter,
        metadata=metadata,
        weights=weights,
        spans=spans,
        seq_lens=seq_lens,
    )


def _step(model, active, hidden):
    """One denoise step through every layer: x -> qkv projection -> paged attention -> x + out."""
    for name in model.names:
        qkv = hidden @ model.weights[name]
        q = qkv[..., :HIDDEN]
        k = qkv[..., HIDDEN : HIDDEN + KV_HEADS * HEAD]
        v = qkv[..., HIDDEN + KV_HEADS * HEAD :]
        context = active.prepare_layer_context(name, q, k, v, omni_attn_metadata=model.spans)
        hidden = hidden + model.layers[name].impl.forward_paged(context)
    return hidden


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_whole_denoise_step_in_one_graph(dtype):
    model = _model(dtype)
    runtime = dk.DiffusionPagedAttentionRuntime(model.adapter, model.metadata)
    with runtime.activate():
        active = runtime.ensure_active(0)
        prefill = torch.randn(sum(model.seq_lens), HIDDEN, device="cuda").to(dtype)
        _step(model, active, prefill)  # step 0 eager: writes the prefix pages of every layer

        active = runtime.ensure_active(1)
        latents = torch.randn(2, IMAGE, HIDDEN, device="cuda").to(dtype)  # the graph's input buffer
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _step(model, active, latents)  # warm-up: builds the piecewise plan for this activation
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = _step(model, active, latents)

        caches_before = None
        for step in range(1, 5):
            new = torch.randn(
                2, IMAGE, HIDDEN, device="cuda", generator=torch.Generator(device="cuda").manual_seed(step)
            )
            latents.copy_(new.to(dtype))
            graph.replay()
            replayed = graph_out.clone()
            caches_graph = [model.layers[n].kv_cache.clone() for n in model.names]
            eager = _step(model, active, latents)  # rewrites the same slots with the same values
            torch.cuda.synchronize()
            assert torch.equal(replayed, eager), f"step {step}: replay differs from eager"
            for n, cache in zip(model.names, caches_graph, strict=True):
                assert torch.equal(cache, model.layers[n].kv_cache)
            if caches_before is not None:
                assert not torch.equal(caches_graph[0], caches_before), "the replay must write new K/V"
            caches_before = caches_graph[0]
