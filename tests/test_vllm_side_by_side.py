"""vLLM-Omni 0.30's own paged-attention adapter and diffkv's, driven side by side.  Runs only
where vLLM-Omni and vLLM import (``make test-vllm``); skipped elsewhere.

Each test builds two worlds from the same test doubles, in the style of vLLM-Omni's own unit
tests: one runs vLLM-Omni's adapter module (``vllm_omni.diffusion.diffusion_kv.
paged_attention_adapter``), the other diffkv's (``diffkv.adapter``), each with its module-level
collaborators replaced by the same doubles -- a platform whose metadata builder records its
arguments and returns either vLLM FlashAttention-shaped metadata or metadata of another kind, a
native backend whose impl (FlashAttention-2 or -3) records every call, and the fake BlockTables
of ``fake_vllm_omni``.  Then the same calls go to both, and every observable result must be the
same: the native impl's constructor keywords and backend selection, the builder's arguments,
the metadata objects batches store and contexts carry (the builder's own, by identity),
every context field, ``max_num_splits`` on segment metadata, the calls vLLM-Omni's own
FlashAttention ``forward_paged`` makes to the native impl on either world's context, and the
exception type and message of every refused call.  Under ``install()``, a layer whose metadata
diffkv cannot serve must make the native impl exactly the calls vLLM-Omni makes without diffkv.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

import fake_vllm_omni as fake
from diffkv import adapter as ours
from diffkv.integrations import vllm_omni as integration
from reference import mask_causal, ref_attention

ADAPTER = "vllm_omni.diffusion.diffusion_kv.paged_attention_adapter"
OMNI_FLASH_ATTN = "vllm_omni.diffusion.attention.backends.flash_attn"

try:
    theirs = importlib.import_module(ADAPTER)
    omni_flash_attn = importlib.import_module(OMNI_FLASH_ATTN)
except Exception as exc:  # noqa: BLE001 - any import failure means "not installed here"
    pytest.skip(
        f"vLLM + vLLM-Omni are not importable here: {type(exc).__name__}: {exc}", allow_module_level=True
    )

H, HKV, D, BLOCK = 4, 2, 16, 4
NAMES = ("model.layers.0.attn", "model.layers.1.attn")
# Two CFG rows of one request: the prefill writes 12 tokens each, the denoise rewrites the last 4.
PREFIX, TARGET = 8, 4
SEQ = PREFIX + TARGET


class NativeImpl:
    """A native (vLLM) backend impl: records every call; forward returns 2 * query."""

    vllm_flash_attn_version: int | None = 3

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = []

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.calls.append(
            ("do_kv_cache_update", layer.layer_name, key.clone(), value.clone(), slot_mapping.clone())
        )

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        self.calls.append(
            ("forward", layer.layer_name, query.clone(), key, value, attn_metadata, output is None)
        )
        output.copy_(query * 2)
        return output


def _backend(version):
    impl = type(f"FA{version}Impl", (NativeImpl,), {"vllm_flash_attn_version": version})
    return type(
        f"FA{version}Backend",
        (),
        {
            "forward_includes_kv_cache_update": False,
            "get_name": staticmethod(lambda: "FLASH_ATTN"),
            "get_impl_cls": staticmethod(lambda: impl),
        },
    )


class OtherMetadata:
    """Metadata of another backend or platform: none of FlashAttention's tables."""

    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.max_num_splits = 0  # the control vLLM-Omni sets for FA2 impls, whatever the type


class Platform:
    """current_omni_platform: records each metadata build and returns its objects."""

    def __init__(self, kind):
        self.kind = kind
        self.builds = []  # (kwargs, returned dict)

    def get_diffusion_paged_kv_attn_backend(self, attn_backend, *, ulysses_degree):
        return attn_backend

    def requires_diffusion_paged_kv_prewrite(self):
        return False

    def build_diffusion_kv_attn_metadata(self, **kwargs):
        if self.kind == "flash":
            metadata = fake.FlashAttentionMetadata(
                num_actual_tokens=kwargs["num_tokens"],
                max_query_len=kwargs["max_query_len"],
                query_start_loc=kwargs["query_start_loc_gpu"],
                max_seq_len=kwargs["max_seq_len"],
                seq_lens=kwargs["seq_lens"],
                block_table=kwargs["block_tables"][0],
                slot_mapping=kwargs["slot_mappings"][0],
                scheduler_metadata=torch.zeros(4, dtype=torch.int32),
                causal=bool(kwargs["causal"]),
            )
        else:
            metadata = OtherMetadata(kwargs)
        out = dict.fromkeys(NAMES, metadata)
        self.builds.append((kwargs, out))
        return out


class World:
    """One adapter module (vLLM-Omni's or diffkv's) wired to its own copies of the doubles."""

    def __init__(self, module, monkeypatch, *, kind="flash", version=3, non_causal=False):
        self.module = module
        self.platform = Platform(kind)
        self.backend = _backend(version)
        self.selections = []

        def get_attn_backend(**kwargs):
            config = fake.get_current_vllm_config()
            self.selections.append(
                (
                    kwargs,
                    config.attention_config.backend,
                    config.parallel_config.prefill_context_parallel_size,
                )
            )
            return self.backend

        monkeypatch.setattr(module, "current_omni_platform", self.platform)
        monkeypatch.setattr(module, "get_attn_backend", get_attn_backend)
        monkeypatch.setattr(module, "set_current_vllm_config", fake.set_current_vllm_config)
        for name in (
            "AttentionBackendEnum",
            "build_slot_mappings_by_layer",
            "get_dcp_local_seq_lens",
            "cdiv",
        ):
            monkeypatch.setattr(module, name, getattr(theirs, name))
        monkeypatch.setattr(module, "override_paged_kv_adapter", theirs.override_paged_kv_adapter)
        self.config = fake.fake_vllm_config(torch.float32, BLOCK)
        self.config.parallel_config.prefill_context_parallel_size = 2
        spec = fake.FullAttentionSpec(BLOCK, HKV, D, torch.float32, non_causal=non_causal)
        self.layers = {
            name: module.DiffusionPagedAttentionLayerAdapter(
                layer_name=name,
                layer=SimpleNamespace(num_heads=H, softmax_scale=0.25),
                spec=spec,
                vllm_config=self.config,
                device=torch.device("cpu"),
            )
            for name in NAMES
        }
        for layer in self.layers.values():
            layer.kv_cache = torch.zeros(2, 12, BLOCK, HKV, D)
        self.tables = fake.BlockTables(
            block_sizes=[BLOCK],
            max_num_reqs=4,
            max_num_batched_tokens=64,
            max_num_blocks_per_group=[4],
            device=torch.device("cpu"),
            kernel_block_sizes=[BLOCK],
        )
        for row, ids in {2: [5, 1, 7], 0: [6, 2, 3]}.items():
            self.tables.append_block_ids(row, (ids,), overwrite=True)
        self.tables.apply_staged_writes()
        bindings = {
            0: module.DiffusionPagedAttentionRowBinding(2, SEQ),
            1: module.DiffusionPagedAttentionRowBinding(0, SEQ),
        }
        self.adapter = module.DiffusionPagedAttentionAdapter(
            vllm_config=self.config,
            device=torch.device("cpu"),
            kv_cache_config=fake.KVCacheConfig(12, [], [fake.KVCacheGroupSpec(list(NAMES), spec)]),
            block_tables=self.tables,
            attn_groups=[[fake.AttentionGroup(list(NAMES))]],
            layers=self.layers,
            resolve_row=lambda request_id, sequence_id, context_id: bindings[sequence_id],
        )

    def rows(self, phase):
        row = self.module.DiffusionPagedAttentionRow
        if phase == "prefill":
            return [row("req", SEQ, SEQ, sequence_id=i) for i in range(2)]
        return [row("req", TARGET, SEQ, kv_start_pos=PREFIX, sequence_id=i) for i in range(2)]

    # This world's builds are platform.builds[offset:stop] (one platform may serve two worlds).
    offset, stop = 0, None

    def builds(self):
        return self.platform.builds[self.offset : self.stop]

    def where(self, obj):
        """Which build made ``obj`` (index, "dict" or "object"), or None: provenance by identity."""
        for index, (_, out) in enumerate(self.builds()):
            if obj is out:
                return (index, "dict")
            if any(obj is value for value in out.values()):
                return (index, "object")
        return None


def _same(a, b, what):
    """Values equal: tensors by dtype, shape and value, containers elementwise."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), what
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{what}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            _same(a[key], b[key], f"{what}[{key!r}]")
    elif hasattr(a, "__dataclass_fields__") and not isinstance(a, type):
        assert type(a).__name__ == type(b).__name__, what
        for name in a.__dataclass_fields__:
            _same(getattr(a, name), getattr(b, name), f"{what}.{name}")
    else:
        assert a == b, what


def _same_builds(w1, w2):
    assert len(w1.builds()) == len(w2.builds())
    skip = ("attn_groups", "kv_cache_config")  # each world's own doubles
    for (k1, _), (k2, _) in zip(w1.builds(), w2.builds(), strict=True):
        _same(
            {k: v for k, v in k1.items() if k not in skip},
            {k: v for k, v in k2.items() if k not in skip},
            "build",
        )


def _inputs(kind, n, gen):
    """query, key, value of one layer call in the caller's layout ``kind``."""
    if kind == "packed_heads":
        return (
            torch.randn(n, H, D, generator=gen),
            torch.randn(n, HKV, D, generator=gen),
            torch.randn(n, HKV, D, generator=gen),
        )
    if kind == "fused_qkv":  # [N, (H + 2 Hkv) D] projection, split into strided views
        qkv = torch.randn(n, (H + 2 * HKV) * D, generator=gen)
        return qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    if kind == "batched":  # [B, T, H*D]
        q = torch.randn(2, n // 2, H * D, generator=gen)
        kv = torch.randn(2, n // 2, 2, HKV * D, generator=gen)
        return q, kv[:, :, 0], kv[:, :, 1]
    raise AssertionError(kind)


def _same_context(w1, c1, w2, c2, caller_query):
    assert type(c1).__name__ == type(c2).__name__ == "DiffusionPagedAttentionContext"
    assert c1.layer is w1.layers[c1.layer.layer_name] and c2.layer is w2.layers[c2.layer.layer_name]
    # query as vLLM-Omni hands it over: contiguous unless the plan is homogeneous (then the view)
    _same(c1.query, c2.query, "query")
    assert c1.query.is_contiguous() == c2.query.is_contiguous()
    assert (c1.query.data_ptr() == caller_query.data_ptr()) == (
        c2.query.data_ptr() == caller_query.data_ptr()
    )
    for name in ("key_write", "value_write"):  # token-strided views stay views in both
        a, b = getattr(c1, name), getattr(c2, name)
        _same(a, b, name)
        assert a.stride() == b.stride(), name
    _same(c1.slot_mapping, c2.slot_mapping, "slot_mapping")
    assert w1.where(c1.native_metadata) == w2.where(c2.native_metadata) != None  # noqa: E711
    assert [w1.where(m) for m in c1.piecewise_native_metadata] == [
        w2.where(m) for m in c2.piecewise_native_metadata
    ]
    for m1, m2 in zip(c1.piecewise_native_metadata, c2.piecewise_native_metadata, strict=True):
        assert m1.max_num_splits == m2.max_num_splits
    assert (c1.piecewise_plan is None) == (c2.piecewise_plan is None)
    if c1.piecewise_plan is not None:
        p1, p2 = c1.piecewise_plan, c2.piecewise_plan
        assert p1.spans == p2.spans and p1.num_query_tokens == p2.num_query_tokens
        assert p1.homogeneous_batch_shape == p2.homogeneous_batch_shape
        assert p1.segments_cover_query_contiguously == p2.segments_cover_query_contiguously
        _same([(s.query_range, s.query_indices) for s in p1.segments],
              [(s.query_range, s.query_indices) for s in p2.segments], "segments")  # fmt: skip
    assert c1.query_token_shape == c2.query_token_shape
    assert c1.query_has_head_dims == c2.query_has_head_dims
    _same(c1.output_scatter_indices, c2.output_scatter_indices, "output_scatter_indices")


def _omni_flash_attention():
    """vLLM-Omni's own diffusion FlashAttention impl (its forward_paged calls the native impl)."""
    return omni_flash_attn.FlashAttentionImpl(num_heads=H, head_size=D, softmax_scale=0.25, num_kv_heads=HKV)


def _same_native_calls(w1, w2):
    for name in NAMES:
        calls1, calls2 = w1.layers[name].impl.calls, w2.layers[name].impl.calls
        assert len(calls1) == len(calls2), name
        for x, y in zip(calls1, calls2, strict=True):
            assert x[:2] == y[:2]
            for a, b in zip(x[2:], y[2:], strict=True):
                if a is None or isinstance(a, (torch.Tensor, bool)):
                    _same(a, b, f"{name} {x[0]}")
                else:  # a metadata object: the same build's
                    assert w1.where(a) == w2.where(b) != None, name  # noqa: E711


def _worlds(monkeypatch, **kwargs):
    return World(theirs, monkeypatch, **kwargs), World(ours, monkeypatch, **kwargs)


@pytest.mark.parametrize("version", [2, 3])
def test_layer_adapters_match(monkeypatch, version):
    w1, w2 = _worlds(monkeypatch, version=version)
    assert w1.selections == w2.selections
    assert w1.selections[0][1] is theirs.AttentionBackendEnum.FLASH_ATTN and w1.selections[0][2] == 1
    assert w1.config.parallel_config.prefill_context_parallel_size == 2  # restored
    assert w2.config.parallel_config.prefill_context_parallel_size == 2
    for name in NAMES:
        l1, l2 = w1.layers[name], w2.layers[name]
        assert l1.impl.kwargs == l2.impl.kwargs
        assert l1.spec == l2.spec and l1.get_kv_cache_spec(None) == l2.get_kv_cache_spec(None)
        for field in ("num_heads", "num_kv_heads", "head_size", "head_size_v", "softmax_scale", "kv_cache"):
            _same(getattr(l1, field), getattr(l2, field), field)
        for field in (
            "_q_scale",
            "_k_scale",
            "_v_scale",
            "_q_scale_float",
            "_k_scale_float",
            "_v_scale_float",
        ):
            _same(getattr(l1, field), getattr(l2, field), field)
        assert l1.get_attn_backend() is w1.backend and l2.get_attn_backend() is w2.backend


@pytest.mark.parametrize("kind", ["flash", "other"])
@pytest.mark.parametrize("version", [2, 3])
def test_batches_contexts_and_native_calls_match(monkeypatch, kind, version):
    w1, w2 = _worlds(monkeypatch, kind=kind, version=version)
    spans_cases = {
        "none": None,
        "homogeneous": SimpleNamespace(full_attn_spans=[[(SEQ - 2, SEQ)], [(SEQ - 2, SEQ)]]),
        "uneven": SimpleNamespace(full_attn_spans=[[(SEQ - 2, SEQ)], [(SEQ - 3, SEQ)]]),
    }
    omni_impl = _omni_flash_attention()
    for phase, layouts in (("prefill", ("packed_heads", "fused_qkv")), ("denoise", ("fused_qkv", "batched"))):
        b1, b2 = w1.adapter.prepare_batch(w1.rows(phase)), w2.adapter.prepare_batch(w2.rows(phase))
        _same_builds(w1, w2)
        assert (
            w1.where(b1.attn_metadata) == w2.where(b2.attn_metadata) == (len(w1.platform.builds) - 1, "dict")
        )
        for field in ("rows", "row_indices", "query_start_loc", "seq_lens", "positions", "block_tables",
                      "slot_mappings", "slot_mappings_by_layer", "num_tokens"):  # fmt: skip
            _same(getattr(b1, field), getattr(b2, field), f"batch.{field}")
        n = b1.num_tokens
        for spans_name, spans in spans_cases.items():
            if spans is not None and phase == "prefill":
                continue  # piecewise needs the denoise rows (each write span ends at seq_len)
            for layout in layouts:
                gen = torch.Generator().manual_seed(hash((phase, spans_name, layout)) % 2**31)
                q, k, v = _inputs(layout, n, gen)
                with w1.adapter.activate(b1):
                    contexts1 = [
                        w1.adapter.prepare_layer_context(name, q, k, v, omni_attn_metadata=spans)
                        for name in NAMES
                    ]
                    out1 = [omni_impl.forward_paged(c) for c in contexts1]
                with w2.adapter.activate(b2):
                    contexts2 = [
                        w2.adapter.prepare_layer_context(name, q, k, v, omni_attn_metadata=spans)
                        for name in NAMES
                    ]
                    out2 = [omni_impl.forward_paged(c) for c in contexts2]  # Omni's own, unpatched
                caller = q.reshape(n, H, D) if layout != "batched" else q
                for c1, c2 in zip(contexts1, contexts2, strict=True):
                    _same_context(w1, c1, w2, c2, caller)
                _same(out1, out2, f"{phase} {spans_name} {layout} outputs")
                _same_builds(w1, w2)
                _same_native_calls(w1, w2)
    segment_splits = {m.max_num_splits for _, out in w1.platform.builds[2:] for m in out.values()}
    assert segment_splits == ({1} if version == 2 else {0})  # vLLM-Omni 0.30: FA2 segments run unsplit


def _refusals(world):
    """Each refused call's (type, message), in order."""
    a = world.adapter
    results = []

    def attempt(call):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the exception is the observable result
            results.append((type(exc).__name__, str(exc)))
        else:
            results.append(None)

    batch = a.prepare_batch(world.rows("denoise"))
    n = batch.num_tokens
    q, k, v = torch.randn(n, H, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    attempt(lambda: a.prepare_layer_context(NAMES[0], q, k, v))  # outside activate
    attempt(lambda: a.prepare_batch([]))
    attempt(lambda: a.prepare_batch(world.rows("denoise") * 3))
    row = world.module.DiffusionPagedAttentionRow
    attempt(lambda: a.prepare_batch([row("req", 4, SEQ + 8, kv_start_pos=SEQ + 4, sequence_id=0)]))
    attempt(lambda: row("", 1, 1, sequence_id=0))
    attempt(lambda: row("r", 1, 1))
    attempt(lambda: row("r", 2, 1, sequence_id=0))
    batch = a.prepare_batch(world.rows("denoise"))
    with a.activate(batch):
        attempt(lambda: a.prepare_layer_context("nope", q, k, v))
        attempt(lambda: a.prepare_layer_context(NAMES[0], q[:-1], k, v))
        attempt(lambda: a.prepare_layer_context(NAMES[0], q, k[:-1], v))
        attempt(lambda: a.prepare_layer_context(NAMES[0], q, k, v.reshape(n, HKV * D)[:, :-1]))
        attempt(lambda: a.prepare_layer_context(NAMES[0], q.double(), k, v))
        attempt(lambda: a.prepare_layer_context(NAMES[0], q.double(), k.double(), v.double()))
        attempt(lambda: a.prepare_layer_context(NAMES[0], q[None], k[None], v[None]))
        attempt(
            lambda: a.prepare_layer_context(
                NAMES[0], q, k, v, omni_attn_metadata=SimpleNamespace(attn_mask=q)
            )
        )
        attempt(
            lambda: a.prepare_layer_context(
                NAMES[0], q, k, v, omni_attn_metadata=SimpleNamespace(extra={"x": 1})
            )
        )
        spans = SimpleNamespace(full_attn_spans=[[(SEQ - 2, SEQ)], [(SEQ - 2, SEQ)]])
        attempt(lambda: a.prepare_layer_context(NAMES[0], q, k, v, omni_attn_metadata=spans))
        other = SimpleNamespace(full_attn_spans=[[(SEQ - 3, SEQ)], [(SEQ - 2, SEQ)]])
        attempt(lambda: a.prepare_layer_context(NAMES[0], q, k, v, omni_attn_metadata=other))
        attempt(lambda: a.activate(batch).__enter__())
        attempt(lambda: a.invalidate_prepared_batches())
    stale = batch
    a.prepare_batch(world.rows("prefill"))
    attempt(lambda: a.activate(stale).__enter__())
    return results


def test_refusals_match(monkeypatch):
    w1, w2 = _worlds(monkeypatch)
    r1, r2 = _refusals(w1), _refusals(w2)
    assert r1 == r2
    assert sum(r is not None for r in r1) >= 15


def test_install_hands_unservable_layers_back_as_vllm_omni_runs_them(monkeypatch):
    """Under install(), metadata that is not FlashAttention's: diffkv's registered impl hands
    each layer to vLLM-Omni's own forward_paged, which makes the native impl the same calls as
    in a process without diffkv."""
    w1, w2 = _worlds(monkeypatch, kind="other", version=2)
    gen = torch.Generator().manual_seed(5)
    spans = SimpleNamespace(full_attn_spans=[[(SEQ - 2, SEQ)], [(SEQ - 3, SEQ)]])
    b1 = w1.adapter.prepare_batch(w1.rows("denoise"))
    q, k, v = _inputs("fused_qkv", b1.num_tokens, gen)
    omni_impl = _omni_flash_attention()
    with w1.adapter.activate(b1):
        out1 = [
            omni_impl.forward_paged(w1.adapter.prepare_layer_context(n, q, k, v, omni_attn_metadata=spans))
            for n in NAMES
        ]
    inst = integration.install()
    # diffkv's adapter now builds through vLLM-Omni's platform (w1's double), after Omni's builds
    w1.stop = w2.offset = len(w1.platform.builds)
    w2.platform = w1.platform
    try:
        installed_impl = inst.backend.get_impl_cls()(
            num_heads=H, head_size=D, softmax_scale=0.25, num_kv_heads=HKV
        )
        b2 = w2.adapter.prepare_batch(w2.rows("denoise"))
        with w2.adapter.activate(b2):
            out2 = [
                installed_impl.forward_paged(
                    w2.adapter.prepare_layer_context(n, q, k, v, omni_attn_metadata=spans)
                )
                for n in NAMES
            ]
        choices = dict(inst.layer_choices)
    finally:
        inst.uninstall()
    _same(out1, out2, "outputs")
    _same_builds(w1, w2)
    _same_native_calls(w1, w2)
    assert all(
        c.startswith("handed back to FlashAttentionImpl: native metadata OtherMetadata")
        for c in choices.values()
    )
    assert set(choices) == set(NAMES)


def test_install_serves_flash_attention_metadata_without_touching_it(monkeypatch):
    """Under install(), FlashAttention metadata: diffkv serves the layer (the native impl is
    not called), the batch and contexts keep the builder's objects, and the output is the
    attention vLLM's FlashAttention would compute over the same cache."""
    w1, w2 = _worlds(monkeypatch, kind="flash", version=3)
    inst = integration.install()
    w2.platform = w1.platform  # diffkv's adapter builds through vLLM-Omni's platform now
    try:
        installed_impl = inst.backend.get_impl_cls()(
            num_heads=H, head_size=D, softmax_scale=0.25, num_kv_heads=HKV
        )
        batch = w2.adapter.prepare_batch(w2.rows("prefill"))
        assert w2.where(batch.attn_metadata) == (0, "dict")
        gen = torch.Generator().manual_seed(9)
        q, k, v = _inputs("fused_qkv", batch.num_tokens, gen)
        with w2.adapter.activate(batch):
            context = w2.adapter.prepare_layer_context(NAMES[0], q, k, v)
            out = installed_impl.forward_paged(context)
        assert w2.where(context.native_metadata) == (0, "object")
        assert type(context.native_metadata) is fake.FlashAttentionMetadata
        assert inst.layer_choices == {NAMES[0]: integration.SERVED}
    finally:
        inst.uninstall()
    assert w2.layers[NAMES[0]].impl.calls == []
    # the reference: causal attention of each row over what diffkv wrote into the cache
    cache = w2.layers[NAMES[0]].kv_cache
    qh, rows = q.reshape(-1, H, D), ((0, 0, SEQ), (1, SEQ, 2 * SEQ))  # the batch's table rows
    for table_row, lo, hi in rows:
        blocks = batch.block_tables[0][table_row, :3].long()
        keys = cache[0, blocks].reshape(-1, HKV, D)[:SEQ]
        values = cache[1, blocks].reshape(-1, HKV, D)[:SEQ]
        _same(keys, k.reshape(-1, HKV, D)[lo:hi], "keys written")
        expected = ref_attention(qh[lo:hi], keys, values, mask_causal(range(SEQ), SEQ), 0.25)
        torch.testing.assert_close(out.reshape(-1, H, D)[lo:hi].double(), expected, rtol=1e-5, atol=1e-5)


def _register_with_the_model_runner(runner_mod):
    """vLLM-Omni's DiffusionKVModelRunnerBackend.register_kv_cache_layers on CPU doubles: the
    layer adapters it builds, the specs it returns, what it sets on the config."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    geometry = []
    config = fake.fake_vllm_config(torch.float32, BLOCK)
    config.compilation_config = SimpleNamespace(static_forward_context={})
    config.model_config.set_attention_geometry = lambda **kwargs: geometry.append(kwargs)
    backend = runner_mod.DiffusionKVModelRunnerBackend(
        vllm_config=config,
        od_config=SimpleNamespace(parallel_config=SimpleNamespace(ulysses_degree=1)),
        device=torch.device("cpu"),
    )
    omni_layer = SimpleNamespace(
        attn_backend=SimpleNamespace(supports_paged_kv=True, get_name=lambda: "FLASH_ATTN"),
        num_heads=H,
        softmax_scale=0.25,
    )
    spec = FullAttentionSpec(BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    specs = backend.register_kv_cache_layers({name: (omni_layer, spec) for name in NAMES})
    context = config.compilation_config.static_forward_context
    return specs, context, geometry, config.attention_config.use_non_causal


def test_model_runner_registers_the_same_layers(monkeypatch):
    """vLLM-Omni's model runner builds its layer adapters the same way, vLLM-Omni's or (after
    install()) diffkv's: the same specs, forward-context entries, native impls and geometry."""
    runner_mod = importlib.import_module("vllm_omni.diffusion.diffusion_kv.model_runner_backend")
    w1 = World(theirs, monkeypatch)  # its doubles stand in for vLLM's backend selection
    platform = SimpleNamespace(
        get_diffusion_kv_block_tables_cls=lambda: fake.BlockTables,
        build_diffusion_kv_attn_metadata=w1.platform.build_diffusion_kv_attn_metadata,
    )
    monkeypatch.setattr(runner_mod, "current_omni_platform", platform)
    monkeypatch.setattr(runner_mod, "set_current_vllm_config", fake.set_current_vllm_config)
    start = len(w1.selections)
    specs1, context1, geometry1, non_causal1 = _register_with_the_model_runner(runner_mod)
    middle = len(w1.selections)
    inst = integration.install()
    try:
        specs2, context2, geometry2, non_causal2 = _register_with_the_model_runner(runner_mod)
        layer_cls = runner_mod.DiffusionPagedAttentionLayerAdapter
    finally:
        inst.uninstall()
    assert specs1 == specs2 and geometry1 == geometry2 == [
        {"num_heads": H, "num_kv_heads": HKV, "head_size": D}
    ]
    assert non_causal1 == non_causal2 is False
    assert list(context1) == list(context2) == list(NAMES)
    assert w1.selections[start:middle] == w1.selections[middle:]
    for name in NAMES:
        a, b = context1[name], context2[name]
        assert type(a) is theirs.DiffusionPagedAttentionLayerAdapter and type(b) is layer_cls
        assert issubclass(layer_cls, ours.DiffusionPagedAttentionLayerAdapter)
        assert a.impl.kwargs == b.impl.kwargs and a.spec == b.spec
