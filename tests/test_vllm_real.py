"""diffkv against a real vLLM + vLLM-Omni install.  Skipped where they do not import (the CI
machine and the H200 have neither); `make test-vllm` installs vllm-omni 0.30.0 with its vLLM in
a virtual environment of its own and runs this file there.

What the fakes of test_vllm_omni.py cannot show: that diffkv's adapter classes still have
vLLM-Omni's API (names, fields, parameters), that vLLM-Omni's own model runner builds them with
arguments diffkv accepts, that install() reaches the runner modules vLLM-Omni loaded, and that
diffkv reads and writes the KV cache tensors vLLM itself allocates, for every physical layout,
at the places vLLM's FlashAttention reads them.  vLLM's BlockTables needs a CUDA driver, so it
is not exercised here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys

import pytest
import torch

from diffkv import _C
from diffkv import adapter as diffkv_adapter
from diffkv import native as diffkv_native
from diffkv.integrations import vllm_omni as integration
from reference import assert_attention_close, dense_kv_from_cache, mask_causal

ADAPTER = "vllm_omni.diffusion.diffusion_kv.paged_attention_adapter"
RUNNER_MODULES = (
    "vllm_omni.diffusion.diffusion_kv.model_runner_backend",
    "vllm_omni.diffusion.worker.diffusion_model_runner",
)

try:
    upstream = importlib.import_module(ADAPTER)
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens as vllm_dcp_local_seq_lens
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache
except Exception as exc:  # noqa: BLE001 - any import failure means "not installed here"
    pytest.skip(
        f"vLLM + vLLM-Omni are not importable here: {type(exc).__name__}: {exc}", allow_module_level=True
    )

CLASSES = integration._ADAPTER_CLASSES


@pytest.fixture(autouse=True)
def _not_installed():
    assert integration.installed() is None
    yield
    active = integration.installed()
    if active is not None:
        active.uninstall()


def _public_members(cls):
    return {name: v for name, v in vars(cls).items() if not name.startswith("_") or name == "__init__"}


def _parameters(obj):
    return [(p.name, p.kind) for p in inspect.signature(obj).parameters.values()]


@pytest.mark.parametrize("name", CLASSES)
def test_adapter_class_has_vllm_omnis_api(name):
    theirs, ours = getattr(upstream, name), getattr(diffkv_adapter, name)
    if dataclasses.is_dataclass(theirs):
        assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]
    members = _public_members(theirs)
    assert members, name
    for member, value in members.items():
        assert hasattr(ours, member), f"{name}.{member}"
        if isinstance(value, property):
            assert isinstance(inspect.getattr_static(ours, member), property), f"{name}.{member}"
        elif callable(value) or isinstance(value, (staticmethod, classmethod)):
            ours_params, theirs_params = (
                _parameters(getattr(ours, member)),
                _parameters(getattr(theirs, member)),
            )
            assert ours_params == theirs_params, f"{name}.{member}"


def _runner_modules():
    modules = []
    for module_name in RUNNER_MODULES:
        try:
            modules.append(importlib.import_module(module_name))
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"vLLM-Omni's {module_name} does not import: {type(exc).__name__}: {exc}")
    return modules


def test_runner_builds_adapter_objects_with_arguments_diffkv_accepts():
    """Every call in vLLM-Omni's model runner that constructs an adapter class binds to
    diffkv's signature of that class (positional count and keyword names)."""
    seen = set()
    for module in _runner_modules():
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CLASSES:
                keywords = {k.arg: None for k in node.keywords if k.arg is not None}
                signature = inspect.signature(getattr(diffkv_adapter, node.func.id))
                signature.bind(*([None] * len(node.args)), **keywords)  # TypeError names the mismatch
                seen.add(node.func.id)
    assert {
        "DiffusionPagedAttentionAdapter",
        "DiffusionPagedAttentionLayerAdapter",
        "DiffusionPagedAttentionRow",
        "DiffusionPagedAttentionRowBinding",
        "DiffusionPagedAttentionRuntime",
        "DiffusionPagedAttentionMetadata",
    } <= seen


def test_install_reaches_the_runner_modules():
    modules = _runner_modules()
    before = {(m.__name__, n): getattr(m, n) for m in modules for n in CLASSES if hasattr(m, n)}
    assert (
        "vllm_omni.diffusion.diffusion_kv.model_runner_backend",
        "DiffusionPagedAttentionAdapter",
    ) in before
    inst = integration.install()
    for (module_name, name), original in before.items():
        now = getattr(sys.modules[module_name], name)
        assert now is not original and issubclass(now, getattr(diffkv_adapter, name)), (module_name, name)
    layer_adapter = sys.modules[RUNNER_MODULES[0]].DiffusionPagedAttentionLayerAdapter
    assert issubclass(layer_adapter, upstream.AttentionLayerBase)
    backend = importlib.import_module("vllm_omni.diffusion.attention.backends.registry")
    assert backend.DiffusionAttentionBackendEnum.FLASH_ATTN.get_class() is inst.backend
    inst.uninstall()
    for (module_name, name), original in before.items():
        assert getattr(sys.modules[module_name], name) is original, (module_name, name)


def test_dcp_local_seq_lens_match_vllm():
    seq_lens = torch.tensor([0, 1, 5, 16, 17, 31, 32, 75_600], dtype=torch.int32)
    for size in (1, 2, 3, 4):
        for rank in range(size):
            for interleave in (1, 2, 16):
                theirs = vllm_dcp_local_seq_lens(seq_lens, size, rank, interleave)
                ours = diffkv_native.get_dcp_local_seq_lens(
                    seq_lens, dcp_size=size, dcp_rank=rank, cp_kv_cache_interleave_size=interleave
                )
                assert torch.equal(ours, theirs), (size, rank, interleave)


# --- vLLM's own KV cache allocations ------------------------------------------------------------

NUM_LAYERS, NUM_BLOCKS, BLOCK, HKV, H, D = 3, 6, 8, 2, 4, 16


def _vllm_caches(layout, kernel_block_size=None, dtype=torch.float32):
    """vLLM's per-layer ``[B, H, N, 2D]`` cache views of one backing buffer (allocate_kv_cache);
    dtype torch.uint8 is how vLLM 0.30 stores a cache_dtype="fp8" cache."""
    spec = FullAttentionSpec(BLOCK, num_kv_heads=HKV, head_size=D, dtype=dtype)
    names = [f"model.layers.{i}.attn" for i in range(NUM_LAYERS)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, NUM_LAYERS, layout)
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=spec.page_size_bytes * NUM_BLOCKS * NUM_LAYERS,
                layers=names,
                layer_stride=layer_stride,
                block_stride=block_stride,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    kernel_sizes = None if kernel_block_size is None else [kernel_block_size]
    caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_sizes)
    return [caches[name] for name in names]


def _flash_attention_split(cache):
    """K and V ``[B, N, Hkv, D]`` as vLLM 0.30's FlashAttentionImpl splits its per-layer cache."""
    return cache.transpose(1, 2).split(D, dim=-1)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_kv_write_lands_where_vllm_flash_attention_reads(layout):
    caches = _vllm_caches(layout)
    views = [integration.kv_cache_view(cache, HKV, D) for cache in caches]
    num_slots = NUM_BLOCKS * BLOCK
    gen = torch.Generator().manual_seed(7)
    written = []
    for view in views:
        slots = torch.randperm(num_slots, generator=gen)[: num_slots - 5].to(torch.int64)
        key = torch.randn(len(slots), HKV, D, generator=gen)
        value = torch.randn(len(slots), HKV, D, generator=gen)
        _C.kv_write(key, value, view, slots)
        written.append((slots, key, value))
    for cache, (slots, key, value) in zip(caches, written, strict=True):
        k_fa, v_fa = _flash_attention_split(cache)
        k_flat, v_flat = k_fa.reshape(-1, HKV, D), v_fa.reshape(-1, HKV, D)
        assert torch.equal(k_flat[slots], key) and torch.equal(v_flat[slots], value)
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[slots] = False
        assert not k_flat[untouched].any() and not v_flat[untouched].any()


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_fp8_kv_write_lands_where_vllm_reads_its_fp8_cache(layout):
    """vLLM stores a cache_dtype="fp8" cache as uint8; kv_cache_view gives its float8_e4m3fn
    view, and the quantizing write puts torch's e4m3 bytes where vLLM's FlashAttention reads
    them (its uint8 cache viewed as float8_e4m3fn)."""
    caches = _vllm_caches(layout, dtype=torch.uint8)
    views = [integration.kv_cache_view(cache, HKV, D) for cache in caches]
    assert all(view.dtype == torch.float8_e4m3fn for view in views)
    num_slots = NUM_BLOCKS * BLOCK
    gen = torch.Generator().manual_seed(9)
    k_scale, v_scale = torch.tensor([0.02, 0.05]), torch.tensor([0.01, 0.03])
    for cache, view in zip(caches, views, strict=True):
        slots = torch.randperm(num_slots, generator=gen)[: num_slots - 5].to(torch.int64)
        key = torch.randn(len(slots), HKV, D, generator=gen).to(torch.bfloat16)
        value = torch.randn(len(slots), HKV, D, generator=gen).to(torch.bfloat16)
        _C.kv_write(key, value, view, slots, k_scale, v_scale)
        k_fa, v_fa = _flash_attention_split(cache.view(torch.float8_e4m3fn))
        k_bytes = k_fa.reshape(-1, HKV, D).view(torch.uint8)[slots]
        v_bytes = v_fa.reshape(-1, HKV, D).view(torch.uint8)[slots]
        quantize = lambda x, s: (x.float() / s.view(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)  # noqa: E731
        assert torch.equal(k_bytes, quantize(key, k_scale).view(torch.uint8))
        assert torch.equal(v_bytes, quantize(value, v_scale).view(torch.uint8))


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.BLNHC, KVCacheLayout.LHBNC])
def test_attention_over_a_vllm_cache(layout):
    """Paged attention read through kv_cache_view of vLLM's cache equals the float64 reference
    over the keys vLLM's FlashAttention split sees."""
    caches = _vllm_caches(layout)
    gen = torch.Generator().manual_seed(11)
    for cache in caches:
        cache.view(torch.float32).copy_(torch.randn(cache.shape, generator=gen))
    cache = caches[1]
    view = integration.kv_cache_view(cache, HKV, D)
    block_table = torch.tensor([[4, 1, 5, 0], [2, 3, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([29, 11], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 7, 10], dtype=torch.int32)
    query = torch.randn(10, H, D, generator=gen)
    out = torch.full_like(query, float("nan"))
    scale = D**-0.5
    _C.paged_attention(
        query, view, block_table, query_start_loc, seq_lens, None, _C.MASK_CAUSAL, scale, out,
        block_table, query_start_loc, seq_lens,
    )  # fmt: skip
    k_fa, v_fa = _flash_attention_split(cache)
    fa_cache = torch.stack((k_fa, v_fa))  # diffkv's canonical (2, B, N, Hkv, D), built by vLLM's split
    for r, (lo, hi) in enumerate(((0, 7), (7, 10))):
        seq_len = int(seq_lens[r])
        k, v = dense_kv_from_cache(fa_cache, block_table[r], seq_len)
        positions = list(range(seq_len - (hi - lo), seq_len))
        assert_attention_close(out[lo:hi], query[lo:hi], k, v, mask_causal(positions, seq_len), scale)


def test_kernel_blocks_split_a_vllm_manager_block():
    """vLLM splits a manager block of 8 tokens into kernel blocks of 4 (layer-compact layout);
    kv_cache_view sees the kernel blocks and diffkv's writes land where FlashAttention reads."""
    (cache, *_) = _vllm_caches(KVCacheLayout.LBNHC, kernel_block_size=4)
    assert cache.shape == (NUM_BLOCKS * 2, HKV, 4, 2 * D)
    view = integration.kv_cache_view(cache, HKV, D)
    slots = torch.arange(0, NUM_BLOCKS * BLOCK, 3, dtype=torch.int64)
    key = torch.randn(len(slots), HKV, D)
    value = torch.randn(len(slots), HKV, D)
    _C.kv_write(key, value, view, slots)
    k_fa, v_fa = _flash_attention_split(cache)
    assert torch.equal(k_fa.reshape(-1, HKV, D)[slots], key)
    assert torch.equal(v_fa.reshape(-1, HKV, D)[slots], value)
