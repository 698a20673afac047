"""torch.compile over diffkv: the torch.ops.diffkv operators (diffkv/ops.py) inside a small
two-layer DiT attention model compiled with fullgraph=True (no graph breaks), its outputs and
KV caches bit-exact against the eager adapter path (prepare_layer_context +
DiffKVAttentionImpl.forward_paged, which calls diffkv._C directly); forward_paged and
do_kv_cache_update traced from a prepared context; the fake implementations under
FakeTensorMode; torch.library.opcheck of every operator; eager calls never touching the
dispatcher.  CUDA variants (default and mode="reduce-overhead") run under the gpu marker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import diffkv as dk
from diffkv import _C, ops

HEADS, KV_HEADS, HEAD, BLOCK = 4, 2, 64, 4
HIDDEN = 96
PREFIXES, IMAGE = (5, 11), 10
LAYERS = ("blocks.0.attn", "blocks.1.attn")
OPS = ("kv_write", "paged_attention", "forward_paged", "rows_gather", "rows_scatter")


# --- the model and its paged environment --------------------------------------------------------


class AttentionBlock(nn.Module):
    """Fused QKV projection -> paged attention -> output projection, on tokens ``[P, HIDDEN]``.
    No biases and no residual add: Inductor may move an add into or out of a matmul (addmm),
    which rounds differently from eager; plain matmuls stay the same aten kernel, so the
    comparison with eager stays bit-exact."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD, bias=False)
        self.proj = nn.Linear(HEADS * HEAD, HIDDEN, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[P, HIDDEN]`` -> q ``[P, H*D]``, k/v ``[P, Hkv*D]`` (token-strided views)."""
        return self.qkv(x).split([HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)

    def forward(self, x: torch.Tensor, inputs: ops.PagedLayerInputs) -> torch.Tensor:
        q, k, v = self.project(x)
        attn = ops.forward_paged_layer(
            q.unflatten(-1, (HEADS, HEAD)),
            k.unflatten(-1, (KV_HEADS, HEAD)),
            v.unflatten(-1, (KV_HEADS, HEAD)),
            inputs,
        )
        return self.proj(attn.flatten(-2))


class DiT(nn.Module):
    """Two attention blocks over latent tokens ``[..., HIDDEN]`` (packed ``[N, HIDDEN]`` or
    right-padded ``[B, T, HIDDEN]``); ``inputs`` holds one ``PagedLayerInputs`` per block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AttentionBlock() for _ in LAYERS)

    def forward(self, x: torch.Tensor, inputs: tuple[ops.PagedLayerInputs, ...]) -> torch.Tensor:
        h = x.reshape(-1, HIDDEN)
        for block, layer_inputs in zip(self.blocks, inputs, strict=True):
            h = block(h, layer_inputs)
        return h.reshape(x.shape)

    def forward_adapter(self, x: torch.Tensor, adapter: dk.DiffusionPagedAttentionAdapter, spans):
        """The eager reference: every layer through prepare_layer_context and
        DiffKVAttentionImpl.forward_paged (diffkv._C directly)."""
        h = x.reshape(-1, HIDDEN)
        token_shape = x.shape[:-1]
        for name, block in zip(LAYERS, self.blocks, strict=True):
            q, k, v = (t.reshape(*token_shape, -1) for t in block.project(h))
            context = adapter.prepare_layer_context(name, q, k, v, omni_attn_metadata=spans)
            attn = adapter.layers[name].impl.forward_paged(context)
            h = block.proj(attn.reshape(h.shape[0], HEADS * HEAD))
        return h.reshape(x.shape)


def _layer_inputs(adapter, token_shape, spans, device, dtype) -> tuple[ops.PagedLayerInputs, ...]:
    """What a compiled step needs from outside the graph: one context per layer, prepared from
    placeholder Q/K/V of the step's shapes."""
    q, k, v = (
        torch.empty(*token_shape, h * HEAD, device=device, dtype=dtype) for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    return tuple(
        ops.layer_inputs(adapter.prepare_layer_context(name, q, k, v, omni_attn_metadata=spans))
        for name in LAYERS
    )


def _env(device, dtype, mode):
    """Adapter over two layers of one cache group; rows of prefix + IMAGE latent tokens with
    blocks in reverse order; mode: 'piecewise' (causal layers, full-attention image spans),
    'causal' or 'non_causal'."""
    device = torch.device(device)
    seq_lens = [p + IMAGE for p in PREFIXES]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    spec = dk.AttentionSpec(BLOCK, KV_HEADS, HEAD, dtype, non_causal=(mode == "non_causal"))
    num_blocks = sum(blocks) + 3
    kv = dk.KVCacheConfig(num_blocks, [dk.KVCacheGroup(LAYERS, spec)])
    cfg = dk.DiffusionConfig(dk.ModelConfig(dtype), dk.CacheConfig(block_size=BLOCK))
    layers = {
        name: dk.DiffusionPagedAttentionLayerAdapter(
            layer_name=name,
            layer=SimpleNamespace(num_heads=HEADS, softmax_scale=HEAD**-0.5),
            spec=spec,
            vllm_config=cfg,
            device=device,
        )
        for name in LAYERS
    }
    caches = dk.allocate_kv_caches(kv, dtype=dtype, device=device, layers=layers)
    tables = dk.BlockTables([BLOCK], 2, 64, [max(blocks)], device)
    pool = dk.BlockPool(num_blocks)
    bindings = {}
    for r, (s, n) in enumerate(zip(seq_lens, blocks, strict=True)):
        tables.append_block_ids(r, [pool.allocate(n)[::-1]])
        bindings[("img", r, None)] = dk.DiffusionPagedAttentionRowBinding(row_index=r, max_seq_len=s)
    adapter = dk.DiffusionPagedAttentionAdapter(
        vllm_config=cfg,
        device=device,
        kv_cache_config=kv,
        block_tables=tables,
        attn_groups=[[dk.AttentionGroup(LAYERS)]],
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
    spans = None
    if mode == "piecewise":
        spans = dk.AttentionMetadata(full_attn_spans=[[(p, p + IMAGE)] for p in PREFIXES])
    model = DiT().to(device=device, dtype=dtype)
    return SimpleNamespace(
        adapter=adapter, layers=layers, caches=caches, metadata=metadata, spans=spans, model=model,
        seq_lens=seq_lens, device=device, dtype=dtype,
    )  # fmt: skip


def _latents(env, layout, seed):
    """Denoise-step latents: packed ``[2*IMAGE, HIDDEN]`` or right-padded ``[2, IMAGE+3, HIDDEN]``."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2 * IMAGE, HIDDEN) if layout == "packed" else (2, IMAGE + 3, HIDDEN)
    return torch.randn(shape, generator=generator).to(device=env.device, dtype=env.dtype)


def _prefill(env, runtime):
    """Step 0, eager: every token of both rows goes through the adapter path (fills the prefix)."""
    runtime.ensure_active(0)
    x = torch.randn(sum(env.seq_lens), HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        env.model.forward_adapter(x.to(device=env.device, dtype=env.dtype), env.adapter, env.spans)


def _snapshot(env):
    return {name: cache.clone() for name, cache in env.caches.items()}


def _restore(env, snapshot):
    for name, cache in env.caches.items():
        cache.copy_(snapshot[name])


def _assert_caches_equal(env, expected, where):
    for name, cache in env.caches.items():
        assert torch.equal(cache, expected[name]), f"{where}: kv cache of {name} differs"


def _compiled_steps_match_eager(env, layout, compiled, steps=3):
    """Runs denoise steps 1..steps: each step's latents through the eager adapter path and
    through ``compiled`` from the same cache state; outputs and caches must be bit-exact, and
    each step must write something new."""
    runtime = dk.DiffusionPagedAttentionRuntime(env.adapter, env.metadata)
    with runtime.activate(), torch.no_grad():
        _prefill(env, runtime)
        previous = None
        for step in range(1, steps + 1):
            runtime.ensure_active(step)
            x = _latents(env, layout, seed=step)
            before = _snapshot(env)
            eager = env.model.forward_adapter(x, env.adapter, env.spans)
            eager_caches = _snapshot(env)
            _restore(env, before)
            inputs = _layer_inputs(env.adapter, x.shape[:-1], env.spans, env.device, env.dtype)
            out = compiled(x, inputs)
            if env.device.type == "cuda":
                out = out.clone()  # a CUDA-graph tree output is overwritten by the next replay
                torch.cuda.synchronize()
            assert torch.equal(out, eager), f"step {step}: compiled output differs from eager"
            _assert_caches_equal(env, eager_caches, f"step {step}")
            if layout == "padded":
                assert not out[:, IMAGE:].any(), "padded positions must come back as zeros"
            if previous is not None:
                assert not torch.equal(out, previous), "each step must see its own latents"
            previous = out


def _compile(fn, **kwargs):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=True, **kwargs)


def _assert_one_graph():
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


# --- compiled model vs eager ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "layout"),
    [("piecewise", "padded"), ("piecewise", "packed"), ("causal", "packed"), ("non_causal", "padded")],
)
def test_compiled_dit_matches_eager(device, mode, layout):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    env = _env(device, dtype, mode)
    compiled = _compile(env.model)
    _compiled_steps_match_eager(env, layout, compiled)
    _assert_one_graph()


def test_compiled_graph_holds_the_diffkv_ops():
    """torch._dynamo.explain over one compiled step: one graph, no breaks, and the graph calls
    diffkv::forward_paged once per layer (plus the padded layout's gathers and scatter)."""
    env = _env("cpu", torch.float32, "piecewise")
    runtime = dk.DiffusionPagedAttentionRuntime(env.adapter, env.metadata)
    with runtime.activate(), torch.no_grad():
        _prefill(env, runtime)
        runtime.ensure_active(1)
        x = _latents(env, "padded", seed=1)
        inputs = _layer_inputs(env.adapter, x.shape[:-1], env.spans, env.device, env.dtype)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(env.model)(x, inputs)
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0
    targets = [str(node.target) for node in explanation.graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count("diffkv.forward_paged") == len(LAYERS)
    assert targets.count("diffkv.rows_gather") == 3 * len(LAYERS)
    assert targets.count("diffkv.rows_scatter") == len(LAYERS)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_forward_paged_traces_from_a_prepared_context(device, layout):
    """DiffKVAttentionImpl.forward_paged itself compiles without graph breaks when the context
    is prepared outside (is_compiling() routes it to torch.ops.diffkv.forward_paged and the
    output restore to rows_scatter); bit-exact against the eager call."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    env = _env(device, dtype, "piecewise")
    impl = env.layers[LAYERS[0]].impl
    compiled = _compile(impl.forward_paged)
    runtime = dk.DiffusionPagedAttentionRuntime(env.adapter, env.metadata)
    with runtime.activate(), torch.no_grad():
        _prefill(env, runtime)
        runtime.ensure_active(1)
        for seed in (1, 2):
            x = _latents(env, layout, seed)
            q, k, v = (
                t.reshape(*x.shape[:-1], -1) for t in env.model.blocks[0].project(x.reshape(-1, HIDDEN))
            )
            context = env.adapter.prepare_layer_context(LAYERS[0], q, k, v, omni_attn_metadata=env.spans)
            before = _snapshot(env)
            eager = impl.forward_paged(context)
            eager_caches = _snapshot(env)
            _restore(env, before)
            out = compiled(context)
            assert out.shape == eager.shape == (*x.shape[:-1], HEADS * HEAD)
            assert torch.equal(out, eager)
            _assert_caches_equal(env, eager_caches, f"seed {seed}")
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_do_kv_cache_update_compiles():
    env = _env("cpu", torch.float32, "non_causal")
    impl = env.layers[LAYERS[0]].impl
    cache = env.caches[LAYERS[0]]
    key, value = (torch.randn(6, KV_HEADS, HEAD) for _ in range(2))
    slots = torch.tensor([3, -1, 0, 17, 9, 4])

    def update(k, v, kv_cache, slot_mapping):
        impl.do_kv_cache_update(None, k, v, kv_cache, slot_mapping)
        return kv_cache.sum()

    expected = cache.clone()
    _C.kv_write(key, value, expected, slots)
    compiled = _compile(update)
    compiled(key, value, cache, slots)
    assert torch.equal(cache, expected)
    assert not counters["graph_break"], dict(counters["graph_break"])


# --- eager stays on the direct C path ------------------------------------------------------------


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_bypass_the_dispatcher():
    env = _env("cpu", torch.float32, "piecewise")
    runtime = dk.DiffusionPagedAttentionRuntime(env.adapter, env.metadata)
    with runtime.activate(), torch.no_grad():
        _prefill(env, runtime)
        runtime.ensure_active(1)
        x = _latents(env, "packed", seed=1)
        q, k, v = env.model.blocks[0].project(x)
        context = env.adapter.prepare_layer_context(LAYERS[0], q, k, v, omni_attn_metadata=env.spans)
        impl = env.layers[LAYERS[0]].impl
        with _RecordOps() as recorded:
            impl.forward_paged(context)
            impl.do_kv_cache_update(
                None, context.key_write, context.value_write, env.caches[LAYERS[0]], context.slot_mapping
            )
        assert not [name for name in recorded.names if name.startswith("diffkv.")], recorded.names
        with _RecordOps() as recorded:
            ops.forward_paged_layer(
                context.query, context.key_write, context.value_write, ops.layer_inputs(context)
            )
        assert "diffkv.forward_paged.default" in recorded.names


# --- fake implementations and opcheck ------------------------------------------------------------


def _sample_args(name):
    """Small valid CPU arguments for each operator: 2 rows (3 and 2 new tokens over 5 and 4
    keys), block size 4, 5 blocks."""
    g = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(2, 5, 4, 2, 8, generator=g)
    query = torch.randn(5, 4, 8, generator=g)
    key, value = (torch.randn(5, 2, 8, generator=g) for _ in range(2))
    slot_mapping = torch.tensor([6, 7, 8, 14, 15])
    block_table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 3, 5], dtype=torch.int32)
    seq_lens = torch.tensor([5, 4], dtype=torch.int32)
    key_limits = torch.tensor([3, 4, 5, 4, 4], dtype=torch.int32)
    metadata = (block_table, query_start_loc, seq_lens, key_limits, _C.MASK_LIMITS, 0.35)
    host = (block_table, query_start_loc, seq_lens)
    index = torch.tensor([4, 0, 2])
    return {
        "kv_write": (key, value, kv_cache, slot_mapping),
        "paged_attention": (query, kv_cache, *metadata, *host),
        "forward_paged": (query, key, value, kv_cache, slot_mapping, *metadata, *host),
        "rows_gather": (query, index),
        "rows_scatter": (query[:3], index, 6),
    }[name]


_EXPECTED_SHAPES = {
    "kv_write": None,
    "paged_attention": (5, 4, 8),
    "forward_paged": (5, 4, 8),
    "rows_gather": (3, 4, 8),
    "rows_scatter": (6, 4, 8),
}


@pytest.mark.parametrize("name", OPS)
def test_fake_impl_shapes(name):
    args = _sample_args(name)
    mode = FakeTensorMode()
    with mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        out = getattr(torch.ops.diffkv, name)(*fake_args)
    real = getattr(torch.ops.diffkv, name)(*args)
    if _EXPECTED_SHAPES[name] is None:
        assert out is None and real is None
        return
    assert tuple(out.shape) == tuple(real.shape) == _EXPECTED_SHAPES[name]
    assert out.dtype == real.dtype == args[0].dtype
    assert out.stride() == real.stride()
    assert out.device == real.device


def test_fake_impl_keeps_symbolic_sizes():
    """rows_scatter's row count stays symbolic under dynamic shapes (no recompile per size)."""
    torch._dynamo.reset()
    counters.clear()

    def scatter(src, index, dst_rows):
        return torch.ops.diffkv.rows_scatter(src, index, dst_rows.shape[0])

    compiled = torch.compile(scatter, fullgraph=True, dynamic=True)
    for n, s in ((3, 6), (4, 9)):
        src = torch.randn(n, 2, 8)
        index = torch.randperm(s)[:n]
        out = compiled(src, index, torch.empty(s))
        expected = torch.zeros(s, 2, 8)
        expected[index] = src
        assert torch.equal(out, expected)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    args = _sample_args(name)
    torch.library.opcheck(getattr(torch.ops.diffkv, name).default, args)


def test_op_results_match_c():
    """Each operator returns (or writes) exactly what its diffkv._C function gives."""
    args = _sample_args("forward_paged")
    cache = args[3].clone()
    out = torch.empty_like(args[0])
    _C.forward_paged(*args[:3], cache, *args[4:11], out, *args[11:])
    got = torch.ops.diffkv.forward_paged(*args)
    assert torch.equal(got, out) and torch.equal(args[3], cache)
    args = _sample_args("paged_attention")
    out = torch.empty_like(args[0])
    _C.paged_attention(*args[:8], out, *args[8:])
    assert torch.equal(torch.ops.diffkv.paged_attention(*args), out)


def test_op_errors_come_from_c():
    """Bad input to an operator raises diffkv._C's own message (the fake impls check nothing
    the C binding does not)."""
    key, value, kv_cache, slot_mapping = _sample_args("kv_write")
    with pytest.raises(
        ValueError, match=r"^kv_write\(\): slot_mapping\[1\] must be < num_blocks \* block_size"
    ):
        torch.ops.diffkv.kv_write(key, value, kv_cache, torch.tensor([0, 20, 1, 2, 3]))


# --- CUDA: reduce-overhead (CUDA-graph trees) -----------------------------------------------------


# On CUDA the operators take no CPU host copies (diffkv.ops.layer_inputs passes None; the
# kernels clamp every index), so the whole step is captured in a CUDA-graph tree.


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "layout"), [("piecewise", "padded"), ("piecewise", "packed")])
def test_compiled_dit_reduce_overhead(mode, layout):
    """mode="reduce-overhead": the step is captured in a CUDA-graph tree, replayed with new
    latents each step, bit-exact against eager, with no cudagraph skips.  The KV caches are
    graph inputs mutated in place, so they are marked static (their addresses never change
    between replays)."""
    env = _env("cuda", torch.bfloat16, mode)
    for cache in env.caches.values():
        torch._dynamo.mark_static_address(cache)
    compiled = _compile(env.model, mode="reduce-overhead")
    _compiled_steps_match_eager(env, layout, compiled, steps=4)
    _assert_one_graph()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
