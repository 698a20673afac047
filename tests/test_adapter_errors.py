"""Every error of the layer adapter, the adapter and the backend ABC, matched on its full text
(the layer adapter's constructor, the adapter's constructor, prepare_batch, invalidate, activate and
prepare_layer_context, each rule in vLLM-Omni's adapter's order), validation before any side effect,
and every failing case of the _C entry points' table (error_cases.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import diffkv
from _helpers import HEAD_SIZE, RecordingBlockTables, make_adapter, make_layer, make_vllm_config, row
from diffkv import adapter as adapter_mod
from diffkv import platform as platform_mod
from diffkv import selector
from error_cases import (
    STALE_BATCH,
    Case,
    DenseImpl,
    FakeImpl,
    FakeImplNoUpdate,
    active_env,
    all_cases,
    check,
    error_cases,
    fake_backend,
    layer_kwargs,
    public_case,
    public_error_cases,
    qkv,
)


def _raises(exc_type, message):
    return pytest.raises(exc_type, match=f"^{re.escape(message)}$")


def _key_error(excinfo, message):
    assert excinfo.value.args == (message,)


# --- layer adapter: ulysses degree, head counts, backend selection, head sizes, impl --------------


def test_head_counts_are_read_after_a_valid_ulysses_degree():
    # With ulysses_degree 0 the table's case raises before num_heads is read.
    kwargs = _layer_kwargs(ulysses_degree=1)
    kwargs["layer"] = SimpleNamespace(softmax_scale=1.0)
    with pytest.raises(AttributeError):
        diffkv.DiffusionPagedAttentionLayerAdapter(**kwargs)


def test_ulysses_gives_rank_local_heads_and_spec():
    kwargs = _layer_kwargs(num_heads=8, num_kv_heads=4, ulysses_degree=2)
    original_spec = kwargs["spec"]
    layer = diffkv.DiffusionPagedAttentionLayerAdapter(**kwargs)
    assert (layer.num_heads, layer.num_kv_heads) == (4, 2)
    assert layer.spec.num_kv_heads == 2 and original_spec.num_kv_heads == 4
    assert layer.get_kv_cache_spec(None) is layer.spec
    assert layer.get_attn_backend() is diffkv.DiffKVAttentionBackend
    assert layer.impl.num_heads == 4 and layer.impl.num_kv_heads == 2
    assert layer.head_size == layer.head_size_v == HEAD_SIZE
    assert layer.softmax_scale == 0.125
    assert layer.kv_cache is None
    for name in ("_q_scale", "_k_scale", "_v_scale"):
        scale = getattr(layer, name)
        assert scale.dtype == torch.float32 and scale.tolist() == [1.0]
    assert layer._q_scale_float == layer._k_scale_float == layer._v_scale_float == 1.0


def test_backend_selection_errors_propagate_and_config_is_restored(monkeypatch):
    attention_config = SimpleNamespace(backend="mine", backend_per_kind={"decoder": "x"})
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=4),
        attention_config=attention_config,
    )
    seen = {}

    def failing_get_attn_backend(**kwargs):
        seen["backend"] = attention_config.backend
        seen["per_kind"] = attention_config.backend_per_kind
        seen["current"] = platform_mod.get_current_vllm_config()
        raise LookupError("no backend for you")

    monkeypatch.setattr(adapter_mod, "get_attn_backend", failing_get_attn_backend)
    kwargs = _layer_kwargs()
    kwargs["vllm_config"] = vllm_config
    with _raises(LookupError, "no backend for you"):
        diffkv.DiffusionPagedAttentionLayerAdapter(**kwargs)
    assert seen == {
        "backend": adapter_mod.AttentionBackendEnum.FLASH_ATTN,
        "per_kind": {},
        "current": vllm_config,
    }
    assert attention_config.backend == "mine"
    assert attention_config.backend_per_kind == {"decoder": "x"}
    assert platform_mod.get_current_vllm_config() is None


def test_get_attn_backend_accepts_a_supported_layer():
    ok = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", attn_type="decoder", num_heads=4)
    assert selector.get_attn_backend(**ok) is diffkv.DiffKVAttentionBackend


_Impl = FakeImpl
_fake_backend = fake_backend
_layer_kwargs = layer_kwargs


def _with_backend(monkeypatch, backend):
    monkeypatch.setattr(adapter_mod, "get_attn_backend", lambda **kwargs: backend)


def test_native_impl_gets_vllm_omni_adapter_keywords(monkeypatch):
    _with_backend(monkeypatch, _fake_backend(_Impl))
    layer = diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs(num_heads=4, num_kv_heads=2))
    assert layer.impl.kwargs == dict(
        num_heads=4,
        head_size=HEAD_SIZE,
        scale=0.125,
        num_kv_heads=2,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
    )


def test_cache_update_needed_only_when_forward_does_not_write(monkeypatch):
    # The table's "layer impl cannot update the cache the platform prewrites" is the failing half.
    _with_backend(monkeypatch, _fake_backend(FakeImplNoUpdate, forward_includes_kv_cache_update=True))
    layer = diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs())
    assert isinstance(layer.impl, FakeImplNoUpdate)


def test_platform_may_swap_the_paged_backend(monkeypatch):
    swapped = _fake_backend(_Impl)
    calls = []

    class SwapPlatform(platform_mod.DiffKVPlatform):
        def get_diffusion_paged_kv_attn_backend(self, backend, *, ulysses_degree):
            calls.append((backend, ulysses_degree))
            return swapped

    monkeypatch.setattr(adapter_mod, "current_omni_platform", SwapPlatform())
    layer = diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs(ulysses_degree=2))
    assert calls == [(diffkv.DiffKVAttentionBackend, 2)]
    assert layer.attn_backend is swapped and isinstance(layer.impl, _Impl)


# --- adapter constructor: layers and KV cache groups ----------------------------------------------


# --- prepare_batch: rows, bindings, capacities, blocks, tokens ------------------------------------
# Every failing prepare_batch case is in error_cases.public_cases (checked by
# test_public_error_case); the tests here add what a failure must leave untouched.


def _untouched_after(name, *, generation=0, resolver_calls=()):
    """The table's case ``name`` fails without touching BlockTables or the prepare generation,
    having resolved exactly ``resolver_calls``."""
    case = public_case(name)
    h = case.env
    recording = RecordingBlockTables(h.block_tables)
    h.adapter.block_tables = recording
    h.adapter.resolve_row = h.resolver
    h.resolver.calls.clear()
    check(case)
    assert recording.calls == []
    assert h.adapter._prepare_generation == generation
    if resolver_calls is not None:
        assert h.resolver.calls == list(resolver_calls)


@pytest.mark.parametrize(
    ("name", "generation", "resolver_calls"),
    [
        ("prepare_batch no rows", 0, ()),
        ("prepare_batch resolver refuses", 0, [("req", 5, None)]),
        ("prepare_batch during an active forward", 1, ()),
        ("prepare_batch too many rows", 0, ()),
        ("prepare_batch duplicate identities", 0, ()),
        ("prepare_batch same worker row", 0, [("req", 0, None), ("req", 1, None)]),
        ("prepare_batch invalid capacity -1", 0, None),
        ("prepare_batch invalid capacity None", 0, None),
        ("prepare_batch over capacity", 0, None),
        ("prepare_batch decode rows first", 0, None),
        ("prepare_batch invalid worker row 4", 0, None),
        ("prepare_batch invalid worker row True", 0, None),
        ("prepare_batch too few blocks", 0, None),
        ("prepare_batch too many tokens", 0, None),
    ],
)
def test_failing_prepare_batch_changes_nothing(name, generation, resolver_calls):
    _untouched_after(name, generation=generation, resolver_calls=resolver_calls)


def test_decode_rows_first_allows_short_rows_first():
    h = public_case("prepare_batch decode rows first").env
    h.adapter.prepare_batch([row(query_len=1, seq_len=4, kv_start_pos=3, sequence_id=1), row(sequence_id=0)])


def test_decode_rows_first_ignored_without_causal_groups():
    bindings = {("req", 0, None): (0, 16), ("req", 1, None): (1, 16)}
    h = make_adapter("cpu", bindings=bindings, reorder_batch_threshold=1, non_causal=True)
    assert h.adapter._reorder_batch_threshold is None
    h.adapter.prepare_batch(
        [
            row(query_len=4, seq_len=4, sequence_id=0),
            row(query_len=1, seq_len=4, kv_start_pos=3, sequence_id=1),
        ]
    )


def test_installed_blocks_counted_as_manager_blocks_with_kernel_blocks_and_groups():
    h = public_case("prepare_batch too few blocks, kernel blocks and groups").env
    assert h.block_tables.blocks_per_kv_block == [2, 2]
    h.adapter.prepare_batch([row(query_len=4, seq_len=4)])


def test_installed_blocks_counted_with_cp_size():
    # cp_size 2: a row of 8 tokens needs cdiv(8, 4 * 2) = 1 manager block per rank.
    h = make_adapter("cpu", cp_size=2, cp_rank=0, bindings={("req", 0, None): (0, 8)}, block_ids={0: [[3]]})
    h.adapter.prepare_batch([row(query_len=8, seq_len=8)])


def test_generation_bumps_before_metadata_build_fails(monkeypatch):
    h = make_adapter("cpu")
    first = h.adapter.prepare_batch([row()])

    class FailingPlatform(platform_mod.DiffKVPlatform):
        def build_diffusion_kv_attn_metadata(self, **kwargs):
            raise RuntimeError("builder failed")

    monkeypatch.setattr(adapter_mod, "current_omni_platform", FailingPlatform())
    with _raises(RuntimeError, "builder failed"):
        h.adapter.prepare_batch([row()])
    assert h.adapter._prepare_generation == 2
    with _raises(ValueError, STALE_BATCH):
        with h.adapter.activate(first):
            pass


# --- invalidate / activate: the failing cases are the table's; what they leave behind -----------


def test_invalidate_after_an_active_forward():
    case = public_case("invalidate during an active forward")
    check(case)
    case.env.adapter.invalidate_prepared_batches()
    assert case.env.adapter._prepare_generation == 2


@pytest.mark.parametrize(
    "name",
    ["activate a batch of another adapter", "activate an invalidated batch", "activate an older batch"],
)
def test_refused_activation_leaves_no_active_batch(name):
    case = public_case(name)
    case.env.adapter.activate(*case.args)  # the checks run at with-entry
    check(case)
    assert case.env.adapter._active_batch is None


def test_newer_batch_activates():
    h = make_adapter("cpu")
    h.adapter.prepare_batch([row()])
    newer = h.adapter.prepare_batch([row()])
    with h.adapter.activate(newer) as active:
        assert active is h.adapter


def test_activate_while_already_active_keeps_the_batch():
    h = make_adapter("cpu")
    batch = h.adapter.prepare_batch([row()])
    with h.adapter.activate(batch):
        with pytest.raises(RuntimeError):
            with h.adapter.activate(batch):
                pass
        assert h.adapter._active_batch is batch
    assert h.adapter._active_batch is None


# --- prepare_layer_context: the failing cases are the table's; the accepted inputs -----------------


def _qkv(n, *, device="cpu", **kw):
    return qkv(n, device=device, **kw)


@pytest.fixture
def active(device):
    """An adapter over two causal layers with one active 4-token batch (row 0, seq_len 4)."""
    h = active_env(device)
    with h.adapter.activate(h.batch):
        yield h


def test_accepted_omni_metadata_fields(active):
    q, k, v = _qkv(4, device=active.device)
    plain = diffkv.AttentionMetadata(
        joint_query=torch.ones(1), packed_padding=object(), joint_strategy="rear"
    )
    context = active.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=plain)
    assert context.piecewise_plan is None
    masked = diffkv.AttentionMetadata(attn_mask=torch.ones(1, 1, 4, 4), full_attn_spans=[[(1, 3)]])
    context = active.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=masked)
    assert context.piecewise_plan is not None
    context = active.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=SimpleNamespace())
    assert context.piecewise_plan is None and context.query.shape == (4, 2, HEAD_SIZE)


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_negative_bit_view_leaves_the_cache_unwritten(device, name):
    """prepare_layer_context's checks read only layouts, so a negative-bit Q/K/V view (DLPack
    would export it un-negated) is refused by forward_paged, before the cache is written."""
    case = public_case(f"forward_paged negative-bit {name}", device)
    layer = case.env.adapter.layers["layer0"]
    cache = layer.kv_cache.clone()
    check(case)
    assert torch.equal(layer.kv_cache, cache)


def test_full_layers_accept_rows_that_are_not_suffixes(device):
    h = public_case("layer context causal layer needs suffix rows", device).env
    q, k, v = _qkv(2, device=device)
    with h.adapter.activate(h.batch):
        context = h.adapter.prepare_layer_context("full", q, k, v)
    assert context.slot_mapping.shape == (2,)


def test_non_piecewise_accepts_rows_that_are_not_suffixes(device):
    h = public_case("layer context piecewise spans need suffix rows", device).env
    q, k, v = _qkv(2, device=device)
    with h.adapter.activate(h.batch):
        h.adapter.prepare_layer_context("layer0", q, k, v)


def test_same_spans_reuse_the_plan(active):
    q, k, v = _qkv(4, device=active.device)
    first = diffkv.AttentionMetadata(full_attn_spans=[[(1, 3)]])
    active.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=first)
    same = SimpleNamespace(full_attn_spans=[[[1, 3]]])
    context = active.adapter.prepare_layer_context("layer1", q, k, v, omni_attn_metadata=same)
    assert context.piecewise_plan is active.adapter._active_piecewise_plan


# --- backend ABC ----------------------------------------------------------------------------------


_DenseImpl = DenseImpl


def test_abstract_forward_dispatch(monkeypatch):
    from diffkv.backends import abstract

    class Platform:
        def __init__(self, kind):
            self.kind = kind

        def __getattr__(self, name):
            return lambda: name == f"is_{self.kind}"

        def __repr__(self):
            return f"Platform({self.kind})"

    for kind, expected in (("cuda", "cuda"), ("rocm", "cuda"), ("musa", "cuda")):
        monkeypatch.setattr(abstract, "current_omni_platform", Platform(kind))
        assert _DenseImpl().forward(None, None, None) == expected
    for kind in ("npu", "xpu"):
        monkeypatch.setattr(abstract, "current_omni_platform", Platform(kind))
        with pytest.raises(NotImplementedError):
            _DenseImpl().forward(None, None, None)
    monkeypatch.setattr(abstract, "current_omni_platform", Platform("tpu"))
    with _raises(NotImplementedError, "No forward implementation for platform: Platform(tpu)"):
        _DenseImpl().forward(None, None, None)


def test_default_platform_answers_from_torch():
    platform = platform_mod.current_omni_platform
    cuda = torch.cuda.is_available() and torch.version.hip is None
    assert platform.is_cuda() is cuda
    assert not (platform.is_rocm() or platform.is_npu() or platform.is_xpu() or platform.is_musa())
    assert platform.requires_diffusion_paged_kv_prewrite() is False
    assert platform.get_diffusion_paged_kv_attn_backend("B", ulysses_degree=2) == "B"
    if not cuda:
        with _raises(
            NotImplementedError, "No forward implementation for platform: DiffKVPlatform(device_type='none')"
        ):
            _DenseImpl().forward(None, None, None)


def test_make_layer_helper_builds_a_diffkv_layer():
    layer = make_layer("x", device="cpu", vllm_config=make_vllm_config())
    assert isinstance(layer.impl, diffkv.DiffKVAttentionImpl)


# --- the _C entry points: every failing case of the shared table ----------------------------------


@pytest.mark.parametrize(("entry", "name"), [(entry, case.name) for entry, case in error_cases()])
def test_entry_point_error_case(entry, name):
    """Each failing case of error_cases.py raises exactly its exception type with its full
    message (the leak and fuzz tests run the same cases)."""
    case = next(c for c in all_cases()[entry] if c.name == name)
    check(case)


# --- the public entry points: every failing case of the shared public table ----------------------

_PUBLIC: dict[str, dict[str, Case]] = {}


def _public(device) -> dict[str, Case]:
    """The public table on ``device``, built once per device (its cases can be repeated)."""
    key = str(device)
    if key not in _PUBLIC:
        _PUBLIC[key] = {case.name: case for _, case in public_error_cases(device)}
    return _PUBLIC[key]


@pytest.mark.parametrize(("entry", "name"), [(entry, case.name) for entry, case in public_error_cases()])
def test_public_error_case(device, entry, name):
    """Each failing public case raises exactly its exception type with its full message (the
    leak test repeats them; the Q/K/V cases run on every device)."""
    check(_public(device)[name])
