"""diffkv.integrations.vllm_omni: install() into a (fake) vLLM-Omni, the KV cache layout views,
and a full runtime -> prepare_batch -> activate -> prepare_layer_context -> forward_paged run
through Omni's Attention layer with vLLM-shaped BlockTables, FlashAttention metadata and KV
caches in every supported layout, checked against the float64 reference."""

from __future__ import annotations

import importlib
import logging
import sys
from types import SimpleNamespace

import pytest
import torch

import diffkv
import fake_vllm_omni as fake
from diffkv import adapter as diffkv_adapter
from diffkv.backends.diffkv import DiffKVAttentionBackend
from diffkv.integrations import vllm_omni as integration
from reference import assert_attention_close, mask_causal, mask_none, mask_spans, ref_attention

ADAPTER = "vllm_omni.diffusion.diffusion_kv.paged_attention_adapter"
RUNNER = "vllm_omni.diffusion.diffusion_kv.model_runner_backend"
REGISTRY = "vllm_omni.diffusion.attention.backends.registry"
H, HKV, D = 4, 2, 16
BLOCK, KERNEL_BLOCK = 8, 4


@pytest.fixture
def omni(monkeypatch):
    """A fake vllm_omni in sys.modules; diffkv is uninstalled again afterwards."""
    modules = fake.fake_vllm_omni_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    fake.VllmFlashAttentionImpl.forward_calls = 0
    fake.OmniFlashAttentionImpl.dense_calls = 0
    fake.OmniFlashAttentionImpl.paged_contexts = []
    yield modules
    active = integration.installed()
    if active is not None:
        active.uninstall()


# ------------------------------------------------------------------------------------------------
# KV cache layouts: (logical layout, allocation of one layer's cache in a 2-layer buffer)
# ------------------------------------------------------------------------------------------------


def _alloc(case, nb, bs, dtype, device, layer=0, num_layers=2):
    if case == "kv_first":
        return torch.zeros(2, nb, bs, HKV, D, dtype=dtype, device=device)
    if case == "kv_first_hnd":  # HND stride order behind the classic logical shape
        return torch.zeros(2, nb, HKV, bs, D, dtype=dtype, device=device).transpose(2, 3)
    if case == "blocks_first":
        return torch.zeros(nb, 2, bs, HKV, D, dtype=dtype, device=device)
    if case == "packed_nhd_lbnhc":  # 0.29 default: layer-outermost, token-major
        return torch.zeros(num_layers, nb, bs, HKV, 2 * D, dtype=dtype, device=device)[layer]
    if case == "packed_nhd_blnhc":  # block-outermost: the block stride spans every layer
        return torch.zeros(nb, num_layers, bs, HKV, 2 * D, dtype=dtype, device=device)[:, layer]
    if case == "packed_hnd_view":  # logical [B, H, N, C] view of LBNHC storage
        return torch.zeros(num_layers, nb, bs, HKV, 2 * D, dtype=dtype, device=device)[layer].transpose(1, 2)
    if case == "packed_hnd_lbhnc":  # head-major storage
        return torch.zeros(num_layers, nb, HKV, bs, 2 * D, dtype=dtype, device=device)[layer]
    raise AssertionError(case)


CASES = {
    "kv_first": "kv_first",
    "kv_first_hnd": "kv_first",
    "blocks_first": "blocks_first",
    "packed_nhd_lbnhc": "packed_nhd",
    "packed_nhd_blnhc": "packed_nhd",
    "packed_hnd_view": "packed_hnd",
    "packed_hnd_lbhnc": "packed_hnd",
}


def _read_slot(layout, cache, slot, bs):
    """K and V ``[Hkv, D]`` stored at ``slot``, read with the layout's own indexing."""
    b, o = divmod(slot, bs)
    if layout == "kv_first":
        return cache[0, b, o], cache[1, b, o]
    if layout == "blocks_first":
        return cache[b, 0, o], cache[b, 1, o]
    if layout == "packed_nhd":
        return cache[b, o, :, :D], cache[b, o, :, D:]
    return cache[b, :, o, :D], cache[b, :, o, D:]


@pytest.mark.parametrize("case", sorted(CASES))
def test_kv_cache_view_is_a_view_of_each_layout(case):
    cache = _alloc(case, 5, 4, torch.float32, "cpu")
    cache.copy_(torch.randn(cache.shape))
    view = integration.kv_cache_view(cache, HKV, D)
    assert view.shape == (2, 5, 4, HKV, D)
    assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    layout = CASES[case]
    for slot in (0, 7, 19):
        k, v = _read_slot(layout, cache, slot, 4)
        assert torch.equal(view[0, slot // 4, slot % 4], k)
        assert torch.equal(view[1, slot // 4, slot % 4], v)
    view[1, 2, 3].fill_(42.0)  # writes through the view land in the caller's cache
    assert torch.equal(_read_slot(layout, cache, 11, 4)[1], torch.full((HKV, D), 42.0))
    assert integration.kv_cache_view(cache, HKV, D, layout=layout).stride() == view.stride()


def test_kv_cache_view_errors():
    with pytest.raises(TypeError, match=r"^kv_cache_view\(\): kv_cache must be a torch.Tensor, got list$"):
        integration.kv_cache_view([], HKV, D)
    with pytest.raises(ValueError, match=r"num_kv_heads must be a positive int, got 0"):
        integration.kv_cache_view(torch.zeros(2, 3, 4, HKV, D), 0, D)
    with pytest.raises(ValueError, match=r"got shape=\(3, 4, 2, 17\)"):
        integration.kv_cache_view(torch.zeros(3, 4, HKV, 17), HKV, D)
    ambiguous = torch.zeros(2, 2, 4, HKV, D)
    with pytest.raises(ValueError) as excinfo:
        integration.kv_cache_view(ambiguous, HKV, D)
    assert str(excinfo.value) == (
        "kv_cache_view(): kv_cache shape=(2, 2, 4, 2, 16) matches the layouts ['kv_first', 'blocks_first']; "
        "pass layout= to choose one"
    )
    assert integration.kv_cache_view(ambiguous, HKV, D, layout="blocks_first").shape == (2, 2, 4, HKV, D)
    square = torch.zeros(3, HKV, HKV, 2 * D)  # block_size == num_kv_heads
    with pytest.raises(ValueError, match=r"\['packed_nhd', 'packed_hnd'\]; pass layout="):
        integration.kv_cache_view(square, HKV, D)
    with pytest.raises(ValueError, match=r"for layout 'kv_first', got shape=\(3, 2, 2, 32\)"):
        integration.kv_cache_view(square, HKV, D, layout="kv_first")
    with pytest.raises(ValueError, match=r"layout must be one of .* or None, got 'NHD'"):
        integration.kv_cache_view(square, HKV, D, layout="NHD")


# ------------------------------------------------------------------------------------------------
# install / uninstall
# ------------------------------------------------------------------------------------------------


def test_install_patches_and_uninstall_restores(omni):
    adapter_mod, runner_mod, registry = omni[ADAPTER], omni[RUNNER], omni[REGISTRY]
    selector = omni["vllm_omni.diffusion.attention.selector"]
    flash_attn = registry.DiffusionAttentionBackendEnum.FLASH_ATTN
    before_collaborators = {name: getattr(diffkv_adapter, name) for name in integration._COLLABORATORS}
    before_platform = diffkv_adapter.current_omni_platform
    assert diffkv_adapter.paged_call_hooks is None
    before_classes = {name: getattr(adapter_mod, name) for name in fake.ADAPTER_CLASS_NAMES}
    assert selector._cached_get_backend_cls(None, D) is fake.OmniFlashAttentionBackend

    inst = integration.install()
    assert integration.installed() is inst and inst.active
    summary = inst.summary()
    assert summary[f"{REGISTRY}.DiffusionAttentionBackendEnum"] == ["FLASH_ATTN"]
    assert summary["diffkv.adapter"] == [*integration._COLLABORATORS, "paged_call_hooks"]
    assert summary[ADAPTER] == list(integration._ADAPTER_CLASSES)
    assert summary[RUNNER] == [n for n in integration._ADAPTER_CLASSES if n in fake.RUNNER_IMPORTS]

    backend = flash_attn.get_class()
    assert backend is inst.backend is integration.DiffKVOmniAttentionBackend
    assert issubclass(backend, DiffKVAttentionBackend) and issubclass(backend, fake.OmniFlashAttentionBackend)
    assert backend.supports_paged_kv and backend.supports_piecewise_spans
    assert backend.get_name() == "FLASH_ATTN" and backend.supports_attention_mask()
    assert issubclass(backend.get_impl_cls(), fake.OmniFlashAttentionImpl)
    assert selector._cached_get_backend_cls(None, D) is backend  # the cache was cleared
    for name in integration._COLLABORATORS:
        assert getattr(diffkv_adapter, name) is getattr(adapter_mod, name)
    # the platform itself, not a proxy: its builders' metadata objects reach the contexts
    assert diffkv_adapter.current_omni_platform is omni["vllm_omni.platforms"].current_omni_platform
    assert diffkv_adapter.paged_call_hooks is backend.get_impl_cls()._diffkv_hooks
    assert diffkv_adapter.build_paged_piecewise_plan is diffkv.adapter.build_paged_piecewise_plan
    layer_cls = runner_mod.DiffusionPagedAttentionLayerAdapter
    assert layer_cls is adapter_mod.DiffusionPagedAttentionLayerAdapter
    assert issubclass(layer_cls, diffkv.DiffusionPagedAttentionLayerAdapter)
    assert issubclass(layer_cls, fake.AttentionLayerBase)
    assert runner_mod.DiffusionPagedAttentionAdapter is diffkv.DiffusionPagedAttentionAdapter
    assert adapter_mod.DiffusionPagedAttentionRow is diffkv.DiffusionPagedAttentionRow

    with pytest.raises(RuntimeError, match=r"already installed into vLLM-Omni; call uninstall\(\) first"):
        integration.install()

    inst.uninstall()
    inst.uninstall()  # harmless
    assert integration.installed() is None and not inst.active
    assert not flash_attn.is_overridden()
    assert selector._cached_get_backend_cls(None, D) is fake.OmniFlashAttentionBackend
    assert {
        name: getattr(diffkv_adapter, name) for name in integration._COLLABORATORS
    } == before_collaborators
    assert diffkv_adapter.current_omni_platform is before_platform
    assert diffkv_adapter.paged_call_hooks is None
    assert {name: getattr(adapter_mod, name) for name in fake.ADAPTER_CLASS_NAMES} == before_classes
    assert all(getattr(runner_mod, name) is before_classes[name] for name in fake.RUNNER_IMPORTS)
    assert not hasattr(integration, "DiffKVOmniAttentionBackend")


def test_uninstall_restores_an_earlier_override(omni):
    registry = omni[REGISTRY]
    flash_attn = registry.DiffusionAttentionBackendEnum.FLASH_ATTN
    registry.register_diffusion_backend(flash_attn, "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend")
    inst = integration.install()
    assert inst.backend.dense_backend is fake.OmniSDPABackend
    inst.uninstall()
    assert flash_attn.get_path() == "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"


def test_install_without_vllm_omni(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_omni", None)  # import vllm_omni raises ImportError
    before = diffkv_adapter.get_attn_backend
    with pytest.raises(ImportError) as excinfo:
        integration.install()
    message = str(excinfo.value)
    assert message.startswith(
        "diffkv.integrations.vllm_omni.install() needs vLLM-Omni: cannot import 'vllm_omni' ("
    )
    assert message.endswith(
        "Install vllm-omni (with its vLLM) in this environment, or use diffkv standalone "
        "(diffkv.DiffusionPagedAttentionAdapter with diffkv.BlockTables, diffkv.allocate_kv_caches)."
    )
    assert integration.installed() is None and diffkv_adapter.get_attn_backend is before


def test_install_with_an_incompatible_vllm_omni_patches_nothing(omni):
    del omni[ADAPTER].get_dcp_local_seq_lens
    with pytest.raises(ImportError) as excinfo:
        integration.install()
    assert str(excinfo.value) == (
        f"diffkv.integrations.vllm_omni.install(): {ADAPTER} has no 'get_dcp_local_seq_lens'; this "
        "vLLM-Omni version does not match the diffusion paged-KV contract diffkv installs into"
    )
    assert not omni[REGISTRY].DiffusionAttentionBackendEnum.FLASH_ATTN.is_overridden()
    assert omni[RUNNER].DiffusionPagedAttentionAdapter is omni[ADAPTER].DiffusionPagedAttentionAdapter
    assert integration.installed() is None


def test_install_rejects_unknown_layout(omni):
    with pytest.raises(ValueError, match=r"^install\(\): kv_cache_layout must be one of .*, got 'HND'$"):
        integration.install(kv_cache_layout="HND")


def test_dense_layers_keep_the_replaced_backend(omni):
    integration.install()
    layer = omni["vllm_omni.diffusion.attention.layer"].Attention(H, D, causal=False, softmax_scale=D**-0.5)
    q = torch.randn(1, 5, H, D)
    out = layer(q, q, q)
    expected = ref_attention(q, q, q, mask_none(range(5), 5)[None], D**-0.5)
    assert fake.OmniFlashAttentionImpl.dense_calls == 1
    # torch.testing's fp32 tolerance (atol 1e-5, rtol 1.3e-6), against the float64 reference.
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1.3e-6)


# ------------------------------------------------------------------------------------------------
# The full path through Omni's Attention layer
# ------------------------------------------------------------------------------------------------

PREFIX = (7, 3)  # per row: prefix length (denoise kv_start_pos)
TARGET = 6  # denoise query_len per row
SPANS = ([(7, 12)], [(3, 8)])  # the image spans, global positions


class Harness:
    """vLLM-Omni's model-runner wiring, done by hand with the fake collaborators."""

    def __init__(self, omni, device, case, *, non_causal=False, num_layers=2, dtype=torch.float32, fp8=False):
        self.device = torch.device(device)
        self.layout = CASES[case]
        self.dtype = dtype
        self.fp8 = fp8
        adapter_mod, runner_mod = omni[ADAPTER], omni[RUNNER]
        self.platform = omni["vllm_omni.platforms"].current_omni_platform
        attention_cls = omni["vllm_omni.diffusion.attention.layer"].Attention
        vllm_config = fake.fake_vllm_config(dtype, BLOCK)
        self.names = [f"model.layers.{i}.attn" for i in range(num_layers)]
        # fp8: vLLM 0.30's cache_dtype="fp8" -- a uint8 spec and uint8 caches, the layers' scales
        # set as vLLM sets them (per-tensor float32 tensors and their _float copies)
        cache_dtype = torch.uint8 if fp8 else dtype
        if fp8:
            vllm_config.cache_config.cache_dtype = "fp8"
        spec = fake.FullAttentionSpec(BLOCK, HKV, D, cache_dtype, non_causal=non_causal)
        self.omni_layers = {
            name: attention_cls(
                H,
                D,
                causal=not non_causal,
                softmax_scale=0.3,
                num_kv_heads=HKV,
                prefix=name,
                paged_kv_cache_role="dit",
            )
            for name in self.names
        }
        with fake.set_current_vllm_config(vllm_config):
            self.native_layers = {
                name: runner_mod.DiffusionPagedAttentionLayerAdapter(
                    layer_name=name, layer=layer, spec=spec, vllm_config=vllm_config, device=self.device
                )
                for name, layer in self.omni_layers.items()
            }
        num_manager_blocks = 8
        kv_cache_config = fake.KVCacheConfig(
            num_blocks=num_manager_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[fake.KVCacheGroupSpec(list(self.names), spec)],
        )
        self.block_tables = fake.BlockTables(
            block_sizes=[BLOCK],
            max_num_reqs=4,
            max_num_batched_tokens=64,
            max_num_blocks_per_group=[3],
            device=self.device,
            kernel_block_sizes=[KERNEL_BLOCK],
        )
        # Rows 2 and 0, manager blocks out of order with spare blocks left in the pool.
        self.manager_blocks = {2: [5, 1], 0: [6, 2]}
        for row, ids in self.manager_blocks.items():
            self.block_tables.append_block_ids(row, (ids,), overwrite=True)
        self.block_tables.apply_staged_writes()
        k = BLOCK // KERNEL_BLOCK
        num_kernel_blocks = num_manager_blocks * k
        self.caches = {
            name: _alloc(case, num_kernel_blocks, KERNEL_BLOCK, cache_dtype, self.device, index, num_layers)
            for index, name in enumerate(self.names)
        }
        if fp8:
            for index, layer in enumerate(self.native_layers.values()):
                for which, value in (("_k", 0.004 * (index + 1)), ("_v", 0.01 * (index + 1))):
                    getattr(layer, f"{which}_scale").fill_(value)
                    setattr(layer, f"{which}_scale_float", value)
        for name, layer in self.native_layers.items():
            layer.kv_cache = self.caches[name]  # what vLLM's init_kv_cache binds
        self.kernel_tables = {
            row: [b * k + j for b in ids for j in range(k)] for row, ids in self.manager_blocks.items()
        }
        bindings = {
            0: diffkv.DiffusionPagedAttentionRowBinding(row_index=2, max_seq_len=16),
            1: diffkv.DiffusionPagedAttentionRowBinding(row_index=0, max_seq_len=16),
        }
        self.adapter = adapter_mod.DiffusionPagedAttentionAdapter(
            vllm_config=vllm_config,
            device=self.device,
            kv_cache_config=kv_cache_config,
            block_tables=self.block_tables,
            attn_groups=[[fake.AttentionGroup(self.names)]],
            layers=self.native_layers,
            resolve_row=lambda request_id, sequence_id, context_id: bindings[sequence_id],
        )
        row_cls = adapter_mod.DiffusionPagedAttentionRow
        seq_lens = [p + TARGET for p in PREFIX]
        self.seq_lens = seq_lens
        self.metadata = adapter_mod.DiffusionPagedAttentionMetadata(
            prefill_rows=tuple(row_cls("req", s, s, sequence_id=i) for i, s in enumerate(seq_lens)),
            denoise_rows=tuple(
                row_cls("req", TARGET, s, kv_start_pos=p, sequence_id=i)
                for i, (p, s) in enumerate(zip(PREFIX, seq_lens, strict=True))
            ),
        )
        self.runtime = runner_mod.DiffusionPagedAttentionRuntime(self.adapter, self.metadata)
        self.truth = {name: [torch.zeros(s, HKV, D, 2, dtype=dtype) for s in seq_lens] for name in self.names}

    def slot(self, row_index, position):
        table = self.kernel_tables[row_index]
        return table[position // KERNEL_BLOCK] * KERNEL_BLOCK + position % KERNEL_BLOCK

    def step(self, step_idx, mode):
        """One denoise step of every layer through Omni's Attention layer; checks each output."""
        forward_context = sys.modules["vllm_omni.diffusion.forward_context"].get_forward_context()
        self.runtime.ensure_active(step_idx)
        assert forward_context.paged_kv_adapter is self.adapter
        rows = self.metadata.rows_for_step(step_idx)
        attn_metadata = (
            SimpleNamespace(full_attn_spans=[list(s) for s in SPANS]) if mode == "piecewise" else None
        )
        for name, layer in self.omni_layers.items():
            if step_idx == 0:  # packed [N, H, D] (rows of different lengths)
                n = sum(row.query_len for row in rows)
                q = torch.randn(n, H, D, dtype=self.dtype, device=self.device)
                kv = torch.randn(n, 2, HKV, D, dtype=self.dtype, device=self.device)
                k, v = kv[:, 0], kv[:, 1]  # token-strided views, as a fused QKV projection gives
                out = layer(q, k, v, attn_metadata=attn_metadata)
                assert out.shape == (n, H, D)
                per_row = torch.split(torch.arange(n), [row.query_len for row in rows])
                slices = [(q[i], k[i], v[i], out[i]) for i in per_row]
            else:  # batched [B, T, H*D]
                q = torch.randn(len(rows), TARGET, H * D, dtype=self.dtype, device=self.device)
                k = torch.randn(len(rows), TARGET, HKV * D, dtype=self.dtype, device=self.device)
                v = torch.randn(len(rows), TARGET, HKV * D, dtype=self.dtype, device=self.device)
                out = layer(q, k, v, attn_metadata=attn_metadata)
                assert out.shape == (len(rows), TARGET, H * D)
                slices = [
                    (
                        q[r].view(TARGET, H, D),
                        k[r].view(TARGET, HKV, D),
                        v[r].view(TARGET, HKV, D),
                        out[r].view(TARGET, H, D),
                    )
                    for r in range(len(rows))
                ]
            for r, (row, (qr, kr, vr, outr)) in enumerate(zip(rows, slices, strict=True)):
                positions = list(range(row.kv_start_pos, row.kv_start_pos + row.query_len))
                truth = self.truth[name][r]
                truth[positions, :, :, 0] = kr.cpu()
                truth[positions, :, :, 1] = vr.cpu()
                if mode == "piecewise":
                    visible = mask_spans(positions, row.seq_len, SPANS[r])
                elif mode == "causal":
                    visible = mask_causal(positions, row.seq_len)
                else:
                    visible = mask_none(positions, row.seq_len)
                k_ref, v_ref = truth[..., 0], truth[..., 1]
                if self.fp8:  # the cache holds e4m3: the reference reads it dequantized
                    layer_ = self.native_layers[name]
                    k_ref = self.e4m3(k_ref, layer_._k_scale).double() * layer_._k_scale_float
                    v_ref = self.e4m3(v_ref, layer_._v_scale).double() * layer_._v_scale_float
                assert_attention_close(outr, qr, k_ref, v_ref, visible, 0.3)
        self.check_cache()

    @staticmethod
    def e4m3(x, scale):
        """x quantized as an fp8 cache write stores it (torch's rule)."""
        return (x.float() / scale.cpu()).clamp(-448, 448).to(torch.float8_e4m3fn)

    def check_cache(self):
        """Every written position sits at its vLLM slot, read with the layout's own indexing."""
        for name in self.names:
            for r, row_index in enumerate((2, 0)):
                truth = self.truth[name][r]
                for p in range(self.seq_lens[r]):
                    k, v = _read_slot(self.layout, self.caches[name], self.slot(row_index, p), KERNEL_BLOCK)
                    k_want, v_want = truth[p, :, :, 0], truth[p, :, :, 1]
                    if self.fp8:  # the bytes an fp8 write stores, in vLLM's uint8 cache
                        layer = self.native_layers[name]
                        k_want = self.e4m3(k_want, layer._k_scale).view(torch.uint8)
                        v_want = self.e4m3(v_want, layer._v_scale).view(torch.uint8)
                    assert torch.equal(k.cpu(), k_want) and torch.equal(v.cpu(), v_want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_full_path_every_layout(omni, device, case, monkeypatch):
    inst = integration.install()
    harness = Harness(omni, device, case)
    derived = []
    derive = integration.vllm_paged_metadata
    monkeypatch.setattr(
        integration, "vllm_paged_metadata", lambda native: derived.append(native) or derive(native)
    )
    impl = harness.omni_layers[harness.names[0]].attention
    assert isinstance(impl, inst.backend.get_impl_cls())
    with harness.runtime.activate():
        for step in range(3):  # prefill, then two denoise steps reusing the denoise batch
            harness.step(step, "piecewise")
    assert harness.block_tables.calls == ["gather_block_tables", "compute_slot_mappings"] * 2
    # One vLLM metadata build per phase plus one per piecewise segment and phase (prefill:
    # causal, full, causal; denoise: full, causal), none per layer or step.
    assert len(harness.platform.builds) == 2 + 3 + 2
    assert fake.VllmFlashAttentionImpl.forward_calls == 0
    assert fake.OmniFlashAttentionImpl.paged_contexts == []  # diffkv served every layer
    assert inst.layer_choices == dict.fromkeys(harness.names, integration.SERVED)
    # diffkv's view of vLLM's metadata (a host copy of its tables): once per activation (prefill,
    # denoise) and metadata object, shared by the layers and steps; every call was described ahead
    assert len(derived) == 2 and len({id(native) for native in derived}) == 2
    assert fake.backend_selections[-1]["backend"] is fake.AttentionBackendEnum.FLASH_ATTN


@pytest.mark.parametrize("case", sorted(CASES))
def test_full_path_fp8_cache_every_layout(omni, case):
    """cache_dtype="fp8" the vLLM way -- a uint8 spec, uint8 caches in every layout, each layer's
    _k_scale / _v_scale set on it -- through Omni's Attention layer under install(), on the CPU
    reference: the cache holds each write's e4m3 bytes at its vLLM slot, and every output matches
    the float64 reference over the dequantized cache.  (The CUDA kernel's own bound is
    tests/test_attention_fp8_cuda.py's.)"""
    inst = integration.install()
    harness = Harness(omni, "cpu", case, fp8=True)
    with harness.runtime.activate():
        for step in range(3):
            harness.step(step, "piecewise")
    assert inst.layer_choices == dict.fromkeys(harness.names, integration.SERVED)
    assert fake.OmniFlashAttentionImpl.paged_contexts == []


def test_backend_selected_without_prefill_context_parallelism(omni):
    """vLLM-Omni 0.30 maps sequence parallelism to vLLM's prefill context parallelism; its
    adapter selects the attention backend with that size set to 1 and restores it after."""
    integration.install()
    vllm_config = fake.fake_vllm_config(torch.float32, BLOCK)
    vllm_config.parallel_config.prefill_context_parallel_size = 2
    layer = omni["vllm_omni.diffusion.attention.layer"].Attention(
        H, D, causal=True, softmax_scale=0.3, num_kv_heads=HKV, prefix="l0", paged_kv_cache_role="dit"
    )
    fake.backend_selections.clear()
    omni[RUNNER].DiffusionPagedAttentionLayerAdapter(
        layer_name="l0",
        layer=layer,
        spec=fake.FullAttentionSpec(BLOCK, HKV, D, torch.float32),
        vllm_config=vllm_config,
        device="cpu",
    )
    assert [sel["prefill_context_parallel_size"] for sel in fake.backend_selections] == [1]
    assert vllm_config.parallel_config.prefill_context_parallel_size == 2


@pytest.mark.parametrize("mode", ["causal", "non_causal"])
@pytest.mark.parametrize("case", ["packed_nhd_blnhc", "blocks_first"])
def test_full_path_mask_modes(omni, device, case, mode):
    integration.install()
    harness = Harness(omni, device, case, non_causal=(mode == "non_causal"))
    with harness.runtime.activate():
        for step in range(2):
            harness.step(step, mode)
    native = harness.adapter._active_batch
    assert native is None  # the runtime closed its activation


def test_native_metadata_stays_the_builders_and_diffkv_derives_beside_it(omni):
    integration.install()
    harness = Harness(omni, "cpu", "packed_nhd_lbnhc", num_layers=2)
    built = []
    build = harness.platform.build_diffusion_kv_attn_metadata

    def recording_build(**kwargs):
        built.append(build(**kwargs))
        return built[-1]

    harness.platform.build_diffusion_kv_attn_metadata = recording_build
    batch = harness.adapter.prepare_batch(harness.metadata.prefill_rows)
    assert batch.attn_metadata is built[0]  # the builder's dict and objects, untouched
    first, second = (batch.attn_metadata[name] for name in harness.names)
    assert first is second and type(first) is fake.FlashAttentionMetadata
    paged = integration.vllm_paged_metadata(first)
    assert paged.native is first and paged.block_table is first.block_table
    assert paged.block_table.data_ptr() == harness.block_tables.input_block_tables[0].data_ptr()
    assert paged.query_start_loc_cpu.tolist() == [0, 13, 22]
    assert paged.seq_lens_cpu.tolist() == [13, 9]
    assert paged.block_table_cpu[:2, :4].tolist() == [harness.kernel_tables[2], harness.kernel_tables[0]]
    q = torch.randn(22, H, D)
    kv = torch.randn(22, 2, HKV, D)
    with harness.adapter.activate(batch):
        context = harness.adapter.prepare_layer_context(harness.names[0], q, kv[:, 0], kv[:, 1])
    assert context.native_metadata is first


class _OtherMetadata:
    """Native metadata of another backend or platform: no FlashAttention tables."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs


def test_layers_diffkv_cannot_serve_run_omnis_own_forward_paged(omni, caplog):
    inst = integration.install()
    harness = Harness(omni, "cpu", "kv_first")
    others = []

    def build_other(**kwargs):
        others.append(_OtherMetadata(**kwargs))
        return dict.fromkeys(harness.names, others[-1])

    harness.platform.build_diffusion_kv_attn_metadata = build_other
    batch = harness.adapter.prepare_batch(harness.metadata.prefill_rows)  # no TypeError
    assert set(batch.attn_metadata.values()) == {others[0]}
    rows = harness.metadata.prefill_rows
    n = sum(row.query_len for row in rows)
    qkv = torch.randn(n, (H + 2 * HKV) * D)
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)  # strided projection views
    caplog.set_level(logging.INFO, logger="diffkv.integrations.vllm_omni")
    with harness.adapter.activate(batch):
        out = harness.omni_layers[harness.names[0]](q, k, v)
    ((context, query_read),) = fake.OmniFlashAttentionImpl.paged_contexts
    assert context.native_metadata is others[0]
    assert query_read.is_contiguous() and torch.equal(query_read, q.reshape(n, H, D))
    assert torch.equal(out, q * 2)  # what Omni's own forward_paged returned
    assert harness.caches[harness.names[0]].abs().sum() == 0  # diffkv wrote nothing
    choice = inst.layer_choices[harness.names[0]]
    assert choice.startswith("handed back to OmniFlashAttentionImpl: native metadata _OtherMetadata")
    assert "is not vLLM FlashAttention's (no block_table, query_start_loc, seq_lens, causal)" in choice
    assert f"hands paged attention layer {harness.names[0]!r} back to OmniFlashAttentionImpl" in caplog.text


def test_layers_of_a_head_size_the_kernels_lack_run_omnis_own_forward_paged(omni, monkeypatch, caplog):
    """A layer whose query diffkv's kernels do not take on its device (a head size the device's
    kernels lack: on CUDA, 88 for fp16/bf16) runs vLLM-Omni's own forward_paged; here the CPU's
    head sizes are narrowed to the CUDA kernels' so that the layer's D is one of them."""
    monkeypatch.setattr(integration, "_head_sizes_cache", {})
    monkeypatch.setattr(integration, "supported_head_sizes", lambda device_type, dtype, fp8_cache: [64, 128])
    assert D not in (64, 128)
    inst = integration.install()
    harness = Harness(omni, "cpu", "kv_first")
    batch = harness.adapter.prepare_batch(harness.metadata.prefill_rows)
    n = sum(row.query_len for row in harness.metadata.prefill_rows)
    q, k, v = torch.randn(n, (H + 2 * HKV) * D).split([H * D, HKV * D, HKV * D], dim=-1)
    caplog.set_level(logging.INFO, logger="diffkv.integrations.vllm_omni")
    with harness.adapter.activate(batch):
        out = harness.omni_layers[harness.names[0]](q, k, v)
    assert torch.equal(out, q * 2)  # what Omni's own forward_paged returned
    assert harness.caches[harness.names[0]].abs().sum() == 0  # diffkv wrote nothing
    assert inst.layer_choices[harness.names[0]] == (
        f"handed back to OmniFlashAttentionImpl: head size {D} is not among diffkv's float32 kernels "
        "on cpu ([64, 128])"
    )
    assert f"hands paged attention layer {harness.names[0]!r} back to OmniFlashAttentionImpl" in caplog.text
    assert integration.unservable_query(torch.zeros(3, 4, 64)) is None
    assert integration.unservable_query("not a tensor") is None


def test_unservable_query_reads_an_fp8_caches_head_sizes(monkeypatch):
    """Over a float8_e4m3fn cache the head sizes are the e4m3 kernels' (on CUDA 64 and 128, fewer
    than the unquantized kernels'): the reason names the cache."""
    monkeypatch.setattr(integration, "_head_sizes_cache", {})
    monkeypatch.setattr(
        integration,
        "supported_head_sizes",
        lambda device_type, dtype, fp8_cache: [64, 128] if fp8_cache else [64, 96, 128],
    )
    query = torch.zeros(3, 4, 96)
    assert integration.unservable_query(query) is None
    assert integration.unservable_query(query, True) == (
        "head size 96 is not among diffkv's float32 kernels over a float8_e4m3fn cache on cpu ([64, 128])"
    )


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda m: setattr(m, "block_table", m.block_table.long()), "block_table is not a 2-D int32 tensor"),
        (lambda m: setattr(m, "seq_lens", m.seq_lens[:1]), "has 1 seq_lens, 3 query_start_loc"),
        (lambda m: setattr(m, "causal", 1), "causal is not a bool"),
        (lambda m: delattr(m, "seq_lens"), "(no seq_lens)"),
    ],
)
def test_unservable_reason_names_what_is_missing(omni, change, reason):
    integration.install()
    harness = Harness(omni, "cpu", "kv_first")
    batch = harness.adapter.prepare_batch(harness.metadata.prefill_rows)
    native = batch.attn_metadata[harness.names[0]]
    assert integration.unservable_reason(native) is None
    change(native)
    assert reason in integration.unservable_reason(native)
    assert integration.vllm_paged_metadata(native) is None


def test_a_context_not_prepared_just_now_is_read_from_its_attributes(omni):
    """A context diffkv's adapter did not just describe (prepared earlier, another layer's call
    since) runs from its own attributes, with the same result."""
    inst = integration.install()
    harness = Harness(omni, "cpu", "kv_first")
    batch = harness.adapter.prepare_batch(harness.metadata.prefill_rows)
    n = sum(row.query_len for row in harness.metadata.prefill_rows)
    q, k, v = torch.randn(n, H, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    a, b = harness.names
    with harness.adapter.activate(batch):
        first = harness.adapter.prepare_layer_context(a, q, k, v)
        second = harness.adapter.prepare_layer_context(b, q, k, v)
        impl = harness.omni_layers[a].attention
        out_first = impl.forward_paged(first)  # the slot holds second's call
        out_second = impl.forward_paged(second)
    assert torch.equal(out_first, out_second)
    assert inst.layer_choices == {a: integration.SERVED, b: integration.SERVED}


def test_ambiguous_cache_layout_needs_install_hint(omni):
    """block_size == num_kv_heads: packed NHD and HND shapes coincide; install() names it."""
    inst = integration.install(kv_cache_layout="packed_hnd")
    assert inst.backend.get_impl_cls()._diffkv_hooks.kv_cache_layout == "packed_hnd"
    cache = torch.zeros(4, HKV, HKV, 2 * D)
    with pytest.raises(ValueError, match="pass layout= to choose one"):
        integration.kv_cache_view(cache, HKV, D)
    assert integration.kv_cache_view(cache, HKV, D, layout="packed_hnd").stride() == (
        D,
        2 * HKV * 2 * D,
        2 * D,
        2 * HKV * D,
        1,
    )


def test_with_real_vllm_omni():
    """Runs only where a real vLLM-Omni is installed (it is not on the CI machine)."""
    try:
        importlib.import_module("vllm_omni.diffusion.attention.backends.registry")
        importlib.import_module(ADAPTER)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        pytest.skip(f"vllm_omni is not importable here: {type(exc).__name__}: {exc}")
    inst = integration.install()
    try:
        registry = sys.modules[REGISTRY]
        assert registry.DiffusionAttentionBackendEnum.FLASH_ATTN.get_class() is inst.backend
        assert sys.modules[ADAPTER].DiffusionPagedAttentionAdapter is diffkv.DiffusionPagedAttentionAdapter
        assert issubclass(inst.backend, DiffKVAttentionBackend) and inst.backend.supports_paged_kv
    finally:
        inst.uninstall()


def test_kv_cache_view_of_vllms_fp8_storage():
    """vLLM 0.30 stores a cache_dtype="fp8" cache as uint8: its view is float8_e4m3fn, the same
    bytes, in every layout."""
    for case in sorted(CASES):
        cache = _alloc(case, 4, BLOCK, torch.uint8, "cpu")
        view = integration.kv_cache_view(cache, HKV, D)
        assert view.dtype == torch.float8_e4m3fn and view.shape == (2, 4, BLOCK, HKV, D)
        assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()


def test_a_layer_neither_can_serve_raises_naming_both():
    """Metadata diffkv cannot serve, and a native impl without its own forward_paged: a
    NotImplementedError that says why diffkv refused and which impl had nothing to hand back to."""

    class DenseOnlyImpl:
        pass

    class DenseOnlyBackend:
        @staticmethod
        def get_impl_cls():
            return DenseOnlyImpl

    backend = integration._build_backend(DenseOnlyBackend, integration._VllmCallHooks(None))
    context = SimpleNamespace(layer=SimpleNamespace(layer_name="l0"), native_metadata=object())
    message = (
        "DiffKVOmniAttentionImpl.forward_paged(): diffkv cannot serve this layer (native metadata object is "
        "not vLLM FlashAttention's (no block_table, query_start_loc, seq_lens, causal)) and "
        "test_a_layer_neither_can_serve_raises_naming_both.<locals>.DenseOnlyImpl has no forward_paged"
    )
    with pytest.raises(NotImplementedError) as excinfo:
        backend.get_impl_cls()().forward_paged(context)
    assert str(excinfo.value) == message
