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
from error_cases import all_cases, check, error_cases


def _raises(exc_type, message):
    return pytest.raises(exc_type, match=f"^{re.escape(message)}$")


def _key_error(excinfo, message):
    assert excinfo.value.args == (message,)


# --- layer adapter: ulysses degree, head counts, backend selection, head sizes, impl --------------


def _layer_kwargs(device="cpu", *, num_heads=4, num_kv_heads=2, head_size=HEAD_SIZE, head_size_v=None, **kw):
    spec = diffkv.AttentionSpec(
        block_size=4,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=torch.float32,
        head_size_v=head_size_v,
    )
    return dict(
        layer_name="layer0",
        layer=SimpleNamespace(num_heads=num_heads, softmax_scale=0.125),
        spec=spec,
        vllm_config=make_vllm_config(),
        device=device,
        **kw,
    )


@pytest.mark.parametrize("ulysses_degree", [0, -2, True, 2.0, "2", None])
def test_ulysses_degree_must_be_a_positive_integer(ulysses_degree):
    with _raises(ValueError, f"ulysses_degree must be a positive integer, got {ulysses_degree!r}"):
        diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs(ulysses_degree=ulysses_degree))


def test_ulysses_degree_checked_before_head_counts_are_read():
    kwargs = _layer_kwargs(ulysses_degree=0)
    kwargs["layer"] = SimpleNamespace(softmax_scale=1.0)  # no num_heads
    with _raises(ValueError, "ulysses_degree must be a positive integer, got 0"):
        diffkv.DiffusionPagedAttentionLayerAdapter(**kwargs)
    kwargs = _layer_kwargs(ulysses_degree=1)
    kwargs["layer"] = SimpleNamespace(softmax_scale=1.0)
    with pytest.raises(AttributeError):
        diffkv.DiffusionPagedAttentionLayerAdapter(**kwargs)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(0, 2), (-4, 2), (3, 2), (2, 4)])
def test_head_counts_positive_and_divisible(num_heads, num_kv_heads):
    message = (
        "Paged attention requires positive Q/KV heads with num_heads divisible by num_kv_heads: "
        f"num_heads={num_heads}, num_kv_heads={num_kv_heads}"
    )
    with _raises(ValueError, message):
        diffkv.DiffusionPagedAttentionLayerAdapter(
            **_layer_kwargs(num_heads=num_heads, num_kv_heads=num_kv_heads)
        )


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "ulysses_degree"), [(4, 2, 4), (6, 3, 2), (4, 2, 3)])
def test_heads_divisible_by_ulysses_degree(num_heads, num_kv_heads, ulysses_degree):
    message = (
        "Paged attention requires Q/KV heads divisible by ulysses_degree: "
        f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, ulysses_degree={ulysses_degree}"
    )
    kwargs = _layer_kwargs(num_heads=num_heads, num_kv_heads=num_kv_heads, ulysses_degree=ulysses_degree)
    with _raises(ValueError, message):
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


def test_standalone_backend_selection_rejects_head_size():
    with _raises(ValueError, "get_attn_backend(): head_size must be one of [64, 128], got 48"):
        diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs(head_size=48))


def test_get_attn_backend_argument_errors():
    ok = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", attn_type="decoder", num_heads=4)
    assert selector.get_attn_backend(**ok) is diffkv.DiffKVAttentionBackend
    cases = [
        (
            dict(dtype=torch.int8),
            "get_attn_backend(): dtype must be one of ['float16', 'bfloat16', 'float32'], got torch.int8",
        ),
        (
            dict(kv_cache_dtype="fp8"),
            "get_attn_backend(): kv_cache_dtype must be 'auto' or the activation dtype "
            "'bfloat16' (unquantized cache), got 'fp8'",
        ),
        (dict(attn_type="encoder"), "get_attn_backend(): attn_type must be 'decoder', got 'encoder'"),
        (dict(num_heads=0), "get_attn_backend(): num_heads must be a positive integer, got 0"),
    ]
    for change, message in cases:
        with _raises(ValueError, message):
            selector.get_attn_backend(**{**ok, **change})


def test_key_and_value_head_sizes_must_be_equal():
    message = (
        "Diffusion native paged attention requires equal key/value head sizes; "
        "got head_size=64, head_size_v=128"
    )
    with _raises(ValueError, message):
        diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs(head_size_v=128))


class _Impl:
    """Records its keywords; has forward and do_kv_cache_update."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def forward(self, *args):
        return None

    def do_kv_cache_update(self, *args):
        return None


class _ImplNoForward:
    def __init__(self, **kwargs):
        self.forward = "not callable"


class _ImplNoUpdate:
    def __init__(self, **kwargs):
        pass

    def forward(self, *args):
        return None


class _ImplNoKernel(_Impl):
    vllm_flash_attn_version = None


def _fake_backend(impl_cls, *, forward_includes_kv_cache_update=False):
    return type(
        "FakeBackend",
        (),
        {
            "get_name": staticmethod(lambda: "FAKE"),
            "get_impl_cls": staticmethod(lambda: impl_cls),
            "forward_includes_kv_cache_update": forward_includes_kv_cache_update,
        },
    )


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


def test_impl_without_forward_paged(monkeypatch):
    _with_backend(monkeypatch, _fake_backend(_ImplNoForward))
    with _raises(RuntimeError, "Native paged-attention backend 'FAKE' has no forward implementation"):
        diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs())


def test_impl_that_cannot_update_the_cache(monkeypatch):
    _with_backend(monkeypatch, _fake_backend(_ImplNoUpdate))
    with _raises(RuntimeError, "Native paged-attention backend 'FAKE' cannot update the KV cache"):
        diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs())


def test_cache_update_needed_only_when_forward_does_not_write(monkeypatch):
    _with_backend(monkeypatch, _fake_backend(_ImplNoUpdate, forward_includes_kv_cache_update=True))
    diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs())

    class PrewritePlatform(platform_mod.DiffKVPlatform):
        def requires_diffusion_paged_kv_prewrite(self):
            return True

    monkeypatch.setattr(adapter_mod, "current_omni_platform", PrewritePlatform())
    with _raises(RuntimeError, "Native paged-attention backend 'FAKE' cannot update the KV cache"):
        diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs())


def test_paged_kernel_unavailable(monkeypatch):
    _with_backend(monkeypatch, _fake_backend(_ImplNoKernel))
    with _raises(RuntimeError, "Native paged-attention kernel is unavailable for diffusion layer 'layer0'"):
        diffkv.DiffusionPagedAttentionLayerAdapter(**_layer_kwargs())


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


def _adapter_kwargs(h, **changes):
    kwargs = dict(
        vllm_config=h.vllm_config,
        device=h.device,
        kv_cache_config=h.kv_cache_config,
        block_tables=h.block_tables,
        attn_groups=h.attn_groups,
        layers=h.layers,
        resolve_row=h.resolver,
    )
    kwargs.update(changes)
    return kwargs


def test_adapter_needs_a_layer():
    h = make_adapter("cpu")
    with _raises(ValueError, "Paged attention requires at least one native attention layer"):
        diffkv.DiffusionPagedAttentionAdapter(**_adapter_kwargs(h, layers={}))


def test_attention_groups_must_match_cache_groups():
    h = make_adapter("cpu")
    with _raises(ValueError, "Paged attention group mismatch: builders=2, cache_groups=1"):
        diffkv.DiffusionPagedAttentionAdapter(**_adapter_kwargs(h, attn_groups=h.attn_groups * 2))


def test_cache_group_must_not_mix_causality():
    with _raises(ValueError, "Paged attention cache group 1 mixes causal and non-causal layers"):
        make_adapter(
            "cpu",
            groups=(("a",), ("b", "c")),
            non_causal={"a": True, "b": False, "c": True},
        )


def test_cache_group_names_an_unknown_layer():
    h = make_adapter("cpu", groups=(("a", "b"),))
    with pytest.raises(KeyError) as excinfo:
        diffkv.DiffusionPagedAttentionAdapter(**_adapter_kwargs(h, layers={"a": h.layers["a"]}))
    assert excinfo.value.args == ("b",)


# --- prepare_batch: rows, bindings, capacities, blocks, tokens ------------------------------------


def _recording(h):
    recording = RecordingBlockTables(h.block_tables)
    h.adapter.block_tables = recording
    return recording


def _assert_untouched(h, recording, generation=0):
    assert recording.calls == []
    assert h.adapter._prepare_generation == generation


def test_prepare_batch_needs_rows():
    h = make_adapter("cpu")
    recording = _recording(h)
    with _raises(ValueError, "Paged attention batch must contain at least one row"):
        h.adapter.prepare_batch([])
    _assert_untouched(h, recording)
    assert h.resolver.calls == []


def test_prepare_batch_during_an_active_forward():
    h = make_adapter("cpu")
    batch = h.adapter.prepare_batch([row(query_len=4, seq_len=4)])
    recording = _recording(h)
    with h.adapter.activate(batch):
        with _raises(RuntimeError, "Cannot prepare paged attention metadata during an active forward"):
            h.adapter.prepare_batch([row(query_len=4, seq_len=4)])
    _assert_untouched(h, recording, generation=1)


def test_no_rows_checked_before_active_forward():
    h = make_adapter("cpu")
    batch = h.adapter.prepare_batch([row()])
    with h.adapter.activate(batch):
        with _raises(ValueError, "Paged attention batch must contain at least one row"):
            h.adapter.prepare_batch(())


def test_more_rows_than_max_num_reqs():
    h = make_adapter("cpu", max_num_reqs=2)
    recording = _recording(h)
    rows = [row(sequence_id=i) for i in range(3)]
    with _raises(ValueError, "Paged attention batch has 3 rows; Worker capacity is 2"):
        h.adapter.prepare_batch(rows)
    _assert_untouched(h, recording)
    assert h.resolver.calls == []


def test_duplicate_row_identities():
    h = make_adapter("cpu")
    recording = _recording(h)
    with _raises(ValueError, "Paged attention batch contains duplicate row identities"):
        h.adapter.prepare_batch([row(query_len=2, seq_len=4, kv_start_pos=2), row(query_len=4, seq_len=4)])
    _assert_untouched(h, recording)
    assert h.resolver.calls == []


def test_resolver_errors_propagate():
    h = make_adapter("cpu")
    recording = _recording(h)
    with pytest.raises(KeyError):
        h.adapter.prepare_batch([row(sequence_id=5)])
    _assert_untouched(h, recording)


def test_two_rows_resolve_to_the_same_worker_row():
    h = make_adapter("cpu", bindings={("req", 0, None): (1, 16), ("req", 1, None): (1, 16)})
    recording = _recording(h)
    with _raises(ValueError, "Paged attention batch resolves multiple inputs to the same Worker row"):
        h.adapter.prepare_batch([row(sequence_id=0), row(sequence_id=1)])
    _assert_untouched(h, recording)
    assert h.resolver.calls == [("req", 0, None), ("req", 1, None)]


@pytest.mark.parametrize("capacity", [-1, 16.0, "16", None, True])
def test_invalid_row_capacity(capacity):
    h = make_adapter("cpu")
    h.resolver.bindings[("req", 0, None)] = diffkv.DiffusionPagedAttentionRowBinding(0, capacity)
    recording = _recording(h)
    message = f"Paged attention row ('req', 0, None) resolved to invalid logical capacity {capacity!r}"
    with _raises(ValueError, message):
        h.adapter.prepare_batch([row()])
    _assert_untouched(h, recording)


def test_seq_len_over_row_capacity():
    h = make_adapter("cpu", bindings={("req", 0, None): (0, 8)})
    recording = _recording(h)
    message = (
        "Paged attention row ('req', 0, None) uses seq_len=9, "
        "but its installed allocation has logical length 8"
    )
    with _raises(ValueError, message):
        h.adapter.prepare_batch([row(query_len=9, seq_len=9)])
    _assert_untouched(h, recording)


def test_causal_groups_need_decode_rows_first():
    bindings = {("req", 0, None): (0, 16), ("req", 1, None): (1, 16)}
    h = make_adapter("cpu", bindings=bindings, reorder_batch_threshold=1)
    recording = _recording(h)
    message = (
        "Causal paged attention rows must place native decode/short-query rows before "
        "prefill/long-query rows (decode threshold=1)"
    )
    with _raises(ValueError, message):
        h.adapter.prepare_batch(
            [
                row(query_len=4, seq_len=4, sequence_id=0),
                row(query_len=1, seq_len=4, kv_start_pos=3, sequence_id=1),
            ]
        )
    _assert_untouched(h, recording)
    # Short rows first is fine.
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


@pytest.mark.parametrize("row_index", [4, -1, "0", 1.0, True])
def test_invalid_worker_row(row_index):
    h = make_adapter("cpu", max_num_reqs=4)
    h.resolver.bindings[("req", 0, None)] = diffkv.DiffusionPagedAttentionRowBinding(row_index, 16)
    recording = _recording(h)
    message = f"Paged attention row ('req', 0, None) resolved to invalid Worker row {row_index!r}"
    with _raises(ValueError, message):
        h.adapter.prepare_batch([row()])
    _assert_untouched(h, recording)


def test_too_few_installed_blocks():
    h = make_adapter("cpu", bindings={("req", 0, None): (0, 16)}, block_ids={0: [[5]]})
    recording = _recording(h)
    message = (
        "Paged attention row ('req', 0, None) requires 2 blocks in cache group 0 for seq_len=8, "
        "but its installed Worker row contains only 1 blocks"
    )
    with _raises(ValueError, message):
        h.adapter.prepare_batch([row(query_len=8, seq_len=8)])
    _assert_untouched(h, recording)


def test_installed_blocks_counted_as_manager_blocks_with_kernel_blocks_and_groups():
    # block 4 = two kernel blocks of 2; group 1 has one manager block only.
    h = make_adapter(
        "cpu",
        groups=(("a",), ("b",)),
        kernel_block_size=2,
        bindings={("req", 0, None): (0, 16)},
        block_ids={0: [[1, 2], [3]]},
    )
    assert h.block_tables.blocks_per_kv_block == [2, 2]
    message = (
        "Paged attention row ('req', 0, None) requires 2 blocks in cache group 1 for seq_len=5, "
        "but its installed Worker row contains only 1 blocks"
    )
    with _raises(ValueError, message):
        h.adapter.prepare_batch([row(query_len=5, seq_len=5)])
    h.adapter.prepare_batch([row(query_len=4, seq_len=4)])


def test_installed_blocks_counted_with_cp_size():
    # cp_size 2: a row of 8 tokens needs cdiv(8, 4 * 2) = 1 manager block per rank.
    h = make_adapter("cpu", cp_size=2, cp_rank=0, bindings={("req", 0, None): (0, 8)}, block_ids={0: [[3]]})
    h.adapter.prepare_batch([row(query_len=8, seq_len=8)])
    message = (
        "Paged attention row ('req', 0, None) requires 2 blocks in cache group 0 for seq_len=9, "
        "but its installed Worker row contains only 1 blocks"
    )
    h.resolver.bindings[("req", 0, None)] = diffkv.DiffusionPagedAttentionRowBinding(0, 16)
    with _raises(ValueError, message):
        h.adapter.prepare_batch([row(query_len=9, seq_len=9)])


def test_more_tokens_than_max_num_batched_tokens():
    bindings = {("req", 0, None): (0, 16), ("req", 1, None): (1, 16)}
    h = make_adapter("cpu", bindings=bindings, max_num_batched_tokens=20)
    recording = _recording(h)
    with _raises(ValueError, "Paged attention batch has 21 tokens; Worker capacity is 20"):
        h.adapter.prepare_batch(
            [row(query_len=16, seq_len=16, sequence_id=0), row(query_len=5, seq_len=5, sequence_id=1)]
        )
    _assert_untouched(h, recording)


def test_prepare_batch_rules_run_in_vllm_omni_adapter_order():
    # The capacity checks run row by row: row 0's seq_len over its capacity comes before row 1's
    # invalid capacity.
    bindings = {("req", 0, None): (0, 4), ("req", 1, None): (1, -1)}
    h = make_adapter("cpu", bindings={("req", 0, None): (0, 16), ("req", 1, None): (1, 16)})
    h.resolver.bindings = {
        identity: diffkv.DiffusionPagedAttentionRowBinding(*value) for identity, value in bindings.items()
    }
    with _raises(
        ValueError,
        "Paged attention row ('req', 0, None) uses seq_len=8, "
        "but its installed allocation has logical length 4",
    ):
        h.adapter.prepare_batch([row(query_len=8, seq_len=8, sequence_id=0), row(sequence_id=1)])
    # The capacity check precedes the Worker row check and the installed-blocks check.
    h.resolver.bindings = {("req", 0, None): diffkv.DiffusionPagedAttentionRowBinding(99, 4)}
    with _raises(
        ValueError,
        "Paged attention row ('req', 0, None) uses seq_len=8, "
        "but its installed allocation has logical length 4",
    ):
        h.adapter.prepare_batch([row(query_len=8, seq_len=8)])
    # The Worker row check precedes the batched-token limit.
    h.resolver.bindings = {("req", 0, None): diffkv.DiffusionPagedAttentionRowBinding(99, 4000)}
    with _raises(ValueError, "Paged attention row ('req', 0, None) resolved to invalid Worker row 99"):
        h.adapter.prepare_batch([row(query_len=1000, seq_len=1000)])


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
    with _raises(ValueError, "Prepared paged attention batch is stale after a newer batch preparation"):
        with h.adapter.activate(first):
            pass


# --- invalidate / activate --------------------------------------------------------------


def test_invalidate_during_an_active_forward():
    h = make_adapter("cpu")
    batch = h.adapter.prepare_batch([row()])
    with h.adapter.activate(batch):
        with _raises(RuntimeError, "Cannot change paged attention BlockTables during an active forward"):
            h.adapter.invalidate_prepared_batches()
    h.adapter.invalidate_prepared_batches()
    assert h.adapter._prepare_generation == 2


def test_activate_a_batch_of_another_adapter():
    h = make_adapter("cpu")
    other = make_adapter("cpu")
    batch = other.adapter.prepare_batch([row()])
    h.adapter.prepare_batch([row()])  # same generation number, different owner
    activation = h.adapter.activate(batch)  # checks run at with-entry
    with _raises(ValueError, "Prepared paged attention batch belongs to a different adapter"):
        with activation:
            pass
    assert h.adapter._active_batch is None


def test_activate_a_stale_batch():
    h = make_adapter("cpu")
    batch = h.adapter.prepare_batch([row()])
    h.adapter.invalidate_prepared_batches()
    with _raises(ValueError, "Prepared paged attention batch is stale after a newer batch preparation"):
        with h.adapter.activate(batch):
            pass
    newer = h.adapter.prepare_batch([row()])
    with _raises(ValueError, "Prepared paged attention batch is stale after a newer batch preparation"):
        with h.adapter.activate(batch):
            pass
    with h.adapter.activate(newer) as active:
        assert active is h.adapter


def test_activate_while_already_active():
    h = make_adapter("cpu")
    batch = h.adapter.prepare_batch([row()])
    with h.adapter.activate(batch):
        with _raises(RuntimeError, "Paged attention adapter already has an active forward"):
            with h.adapter.activate(batch):
                pass
        assert h.adapter._active_batch is batch
    assert h.adapter._active_batch is None


# --- prepare_layer_context: activation, layer, metadata, Q/K/V, slots, piecewise ------------------


def _qkv(n, *, device="cpu", dtype=torch.float32, heads=2, kv_heads=1, d=HEAD_SIZE, lead=None):
    lead = (n,) if lead is None else lead
    q = torch.randn(*lead, heads, d, device=device, dtype=dtype)
    k = torch.randn(*lead, kv_heads, d, device=device, dtype=dtype)
    v = torch.randn(*lead, kv_heads, d, device=device, dtype=dtype)
    return q, k, v


@pytest.fixture
def active(device):
    """An adapter over two causal layers with one active 4-token batch (row 0, seq_len 4)."""
    h = make_adapter(device, groups=(("layer0", "layer1"),))
    batch = h.adapter.prepare_batch([row(query_len=4, seq_len=4)])
    with h.adapter.activate(batch):
        h.batch = batch
        yield h


def test_layer_context_outside_an_activation(device):
    h = make_adapter(device)
    q, k, v = _qkv(4, device=device)
    with _raises(RuntimeError, "Paged attention forward must run inside adapter.activate(batch)"):
        h.adapter.prepare_layer_context("layer0", q, k, v)


def test_layer_context_for_an_unknown_layer(active):
    q, k, v = _qkv(4, device=active.device)
    with pytest.raises(KeyError) as excinfo:
        active.adapter.prepare_layer_context("nope", q, k, v)
    _key_error(excinfo, "Unknown diffusion paged attention layer 'nope'")


def _unsupported_metadata(fields):
    return (
        "Diffusion paged attention cannot translate Omni attention metadata fields "
        f"{fields} to native FlashAttention metadata"
    )


@pytest.mark.parametrize(
    ("metadata", "fields"),
    [
        (diffkv.AttentionMetadata(joint_attn_mask=torch.ones(1)), "['joint_attn_mask']"),
        (diffkv.AttentionMetadata(query_ranges=(diffkv.QueryRange(0, 4, 0),)), "['query_ranges']"),
        (diffkv.AttentionMetadata(video_layout=diffkv.VideoTokenLayout(prefix_len=1)), "['video_layout']"),
        (diffkv.AttentionMetadata(attn_mask=torch.ones(1, 1, 4, 4)), "['attn_mask']"),
        (
            diffkv.AttentionMetadata(attn_mask=torch.ones(4, 4), full_attn_spans=[[(0, 4)]]),
            "['attn_mask (piecewise paging requires a 4D tensor)']",
        ),
        (
            SimpleNamespace(attn_mask="mask", full_attn_spans=[[(0, 4)]]),
            "['attn_mask (piecewise paging requires a 4D tensor)']",
        ),
        (diffkv.AttentionMetadata(extra={"b": 1, "a": 2}), "[\"extra=['a', 'b']\"]"),
        (
            SimpleNamespace(
                extra={"z": 0}, attn_mask=torch.ones(1), video_layout=1, query_ranges=(), joint_attn_mask=0
            ),
            "['joint_attn_mask', 'query_ranges', 'video_layout', 'attn_mask', \"extra=['z']\"]",
        ),
    ],
)
def test_unsupported_omni_metadata_fields(active, metadata, fields):
    q, k, v = _qkv(4, device=active.device)
    with _raises(NotImplementedError, _unsupported_metadata(fields)):
        active.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=metadata)


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


def test_query_trailing_shape(active):
    q, k, v = _qkv(4, device=active.device)
    other = torch.randn(4, 3, 32, device=active.device)
    with _raises(ValueError, "Paged attention query must end in (2, 64) or (128,); got shape=(4, 3)"):
        active.adapter.prepare_layer_context("layer0", other[:, :, 0], k, v)
    with _raises(ValueError, "Paged attention key must end in (1, 64) or (64,); got shape=(4, 3, 32)"):
        active.adapter.prepare_layer_context("layer0", q, other, v)
    with _raises(ValueError, "Paged attention value must end in (1, 64) or (64,); got shape=()"):
        active.adapter.prepare_layer_context("layer0", q, k, torch.tensor(1.0, device=active.device))
    # query is checked before key.
    with _raises(ValueError, "Paged attention query must end in (2, 64) or (128,); got shape=(4, 1, 64)"):
        active.adapter.prepare_layer_context("layer0", k, q, v)


def test_key_layout(active):
    q, k, v = _qkv(4, device=active.device)
    with _raises(
        ValueError, "Paged attention key token count must match the query layout: query=(4,), key=(3,)"
    ):
        active.adapter.prepare_layer_context("layer0", q, k[:3], v)
    with _raises(
        ValueError,
        "Paged attention batched key layout must match prepared rows and the query layout: "
        "query=(4,), key=(2, 2)",
    ):
        active.adapter.prepare_layer_context("layer0", q, k.reshape(2, 2, 1, HEAD_SIZE), v)


def test_value_layout(active):
    q, k, v = _qkv(4, device=active.device)
    with _raises(
        ValueError, "Paged attention value token count must match the query layout: query=(4,), value=(5,)"
    ):
        active.adapter.prepare_layer_context("layer0", q, k, torch.cat([v, v[:1]]))
    with _raises(
        ValueError,
        "Paged attention batched value layout must match prepared rows and the query layout: "
        "query=(4,), value=(1, 4)",
    ):
        active.adapter.prepare_layer_context("layer0", q, k, v.reshape(1, 4, HEAD_SIZE))


def test_query_key_value_token_counts(active):
    q, k, v = _qkv(3, device=active.device)
    with _raises(
        ValueError,
        "Paged attention Q/K/V token count must match the prepared write batch: tokens=3, prepared=4",
    ):
        active.adapter.prepare_layer_context("layer0", q, k, v)


@pytest.mark.parametrize("lead", [(2, 4), (1, 3)])
def test_batched_layout_matches_the_rows(active, lead):
    q, k, v = _qkv(0, device=active.device, lead=lead)
    with _raises(
        ValueError,
        f"Paged attention batched Q/K/V layout must match prepared rows for the current write: "
        f"shape={lead}, row_query_lens=(4,)",
    ):
        active.adapter.prepare_layer_context("layer0", q, k, v)


def test_query_token_rank(active):
    q, k, v = _qkv(0, device=active.device, lead=(1, 2, 2))
    with _raises(
        ValueError,
        "Paged attention Q/K/V supports packed [T, ...] or uniform batched [B, T, ...] token layouts; "
        "got token shape=(1, 2, 2)",
    ):
        active.adapter.prepare_layer_context("layer0", q, k, v)


def test_query_key_value_device(active):
    q, k, v = _qkv(4, device=active.device)
    meta_k = torch.empty(4, 1, HEAD_SIZE, device="meta")
    with _raises(
        ValueError,
        f"Paged attention Q/K/V must be on {active.adapter.device}; "
        f"got query={q.device}, key=meta, value={v.device}",
    ):
        active.adapter.prepare_layer_context("layer0", q, meta_k, v)


def test_query_key_value_dtypes_match(active):
    q, k, v = _qkv(4, device=active.device)
    with _raises(
        ValueError, "Paged attention Q/K/V dtypes must match; got torch.float32, torch.float32, torch.float16"
    ):
        active.adapter.prepare_layer_context("layer0", q, k, v.half())


def test_query_dtype_is_the_model_dtype(active):
    q, k, v = _qkv(4, device=active.device, dtype=torch.float16)
    with _raises(
        ValueError,
        "Paged attention Q/K/V dtype must match model activation dtype torch.float32; got torch.float16",
    ):
        active.adapter.prepare_layer_context("layer0", q, k, v)


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_negative_bit_view_is_refused_by_the_binding_that_reads_it(active, name):
    """prepare_layer_context's checks read only layouts, so a negative-bit Q/K/V view (DLPack
    would export it un-negated) is refused by forward_paged, before the cache is written."""
    q, k, v = _qkv(4, device=active.device)
    tensors = {"query": q, "key": k, "value": v}
    tensors[name] = torch._neg_view(tensors[name])
    context = active.adapter.prepare_layer_context("layer0", *tensors.values())
    layer = active.adapter.layers["layer0"]
    cache = layer.kv_cache.clone()
    with _raises(
        ValueError,
        f"forward_paged(): {name} must not be a negative-bit view (DLPack cannot express it), got one; "
        f"pass {name}.resolve_neg()",
    ):
        layer.impl.forward_paged(context)
    assert torch.equal(layer.kv_cache, cache)


def test_causal_layers_need_suffix_rows(device):
    h = make_adapter(device, groups=(("causal",), ("full",)), non_causal={"causal": False, "full": True})
    batch = h.adapter.prepare_batch([row(query_len=2, seq_len=4, kv_start_pos=1)])
    q, k, v = _qkv(2, device=device)
    with h.adapter.activate(batch):
        with _raises(
            ValueError,
            "Causal paged attention requires each query/write span to end at seq_len; "
            "invalid rows=[('req', 0, None)]",
        ):
            h.adapter.prepare_layer_context("causal", q, k, v)
        context = h.adapter.prepare_layer_context("full", q, k, v)
    assert context.slot_mapping.shape == (2,)


def test_no_slot_mapping(active):
    del active.batch.slot_mappings_by_layer["layer1"]
    q, k, v = _qkv(4, device=active.device)
    with pytest.raises(KeyError) as excinfo:
        active.adapter.prepare_layer_context("layer1", q, k, v)
    _key_error(excinfo, "No native slot mapping was built for diffusion layer 'layer1'")


def test_slot_mapping_shorter_than_the_tokens(active):
    active.batch.slot_mappings_by_layer["layer1"] = torch.zeros(3, dtype=torch.int64, device=active.device)
    q, k, v = _qkv(4, device=active.device)
    with _raises(ValueError, "Paged attention slot mapping for 'layer1' has 3 entries; expected 4"):
        active.adapter.prepare_layer_context("layer1", q, k, v)


def test_no_native_metadata(active):
    del active.batch.attn_metadata["layer1"]
    q, k, v = _qkv(4, device=active.device)
    with pytest.raises(KeyError) as excinfo:
        active.adapter.prepare_layer_context("layer1", q, k, v)
    _key_error(excinfo, "No native attention metadata was built for diffusion layer 'layer1'")


def test_piecewise_spans_need_suffix_rows(device):
    h = make_adapter(device, non_causal=True)
    batch = h.adapter.prepare_batch([row(query_len=2, seq_len=4, kv_start_pos=1)])
    q, k, v = _qkv(2, device=device)
    spans = diffkv.AttentionMetadata(full_attn_spans=[[(1, 3)]])
    with h.adapter.activate(batch):
        h.adapter.prepare_layer_context("layer0", q, k, v)  # non-piecewise is fine
        with _raises(
            ValueError,
            "Paged piecewise attention requires each query/write span to end at seq_len; "
            "invalid rows=[('req', 0, None)]",
        ):
            h.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=spans)


def test_spans_change_between_layers(active):
    q, k, v = _qkv(4, device=active.device)
    first = diffkv.AttentionMetadata(full_attn_spans=[[(1, 3)]])
    second = diffkv.AttentionMetadata(full_attn_spans=[[(1, 4)]])
    active.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=first)
    with _raises(ValueError, "Paged piecewise attention metadata changed between layers in one active batch"):
        active.adapter.prepare_layer_context("layer1", q, k, v, omni_attn_metadata=second)
    same = SimpleNamespace(full_attn_spans=[[[1, 3]]])
    context = active.adapter.prepare_layer_context("layer1", q, k, v, omni_attn_metadata=same)
    assert context.piecewise_plan is active.adapter._active_piecewise_plan


def test_piecewise_helpers_need_an_active_batch():
    h = make_adapter("cpu")
    with _raises(RuntimeError, "Piecewise paged attention requires an active prepared batch"):
        h.adapter._get_piecewise_plan([[(0, 1)]])
    plan = diffkv.build_paged_piecewise_plan([[(0, 1)]], [0], [2], [2])
    with _raises(RuntimeError, "Piecewise paged attention requires an active prepared batch"):
        h.adapter._get_piecewise_native_metadata(plan)


def test_no_piecewise_metadata_for_the_layer(active):
    q, k, v = _qkv(4, device=active.device)
    spans = diffkv.AttentionMetadata(full_attn_spans=[[(1, 3)]])
    active.adapter.prepare_layer_context("layer0", q, k, v, omni_attn_metadata=spans)
    del active.adapter._active_piecewise_native_metadata[1]["layer1"]
    with pytest.raises(KeyError) as excinfo:
        active.adapter.prepare_layer_context("layer1", q, k, v, omni_attn_metadata=spans)
    _key_error(excinfo, "No piecewise native attention metadata was built for diffusion layer 'layer1'")


# --- backend ABC ----------------------------------------------------------------------------------


class _DenseImpl(diffkv.AttentionImpl):
    def __init__(self, *args, **kwargs):
        pass

    def forward_cuda(self, query, key, value, attn_metadata=None):
        return "cuda"


def test_abstract_forward_paged_refuses():
    with _raises(NotImplementedError, "_DenseImpl does not support paged KV attention"):
        _DenseImpl().forward_paged(object())


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
