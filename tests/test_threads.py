"""Threads: the long C loops release the GIL, and adapters in different threads do not interfere.

GIL: a counter thread increments a Python int in a loop (yielding the GIL every 1,000
increments) while the main thread makes one long CPU call into ``diffkv._C``.  The switch
interval is raised to 10 s for the measurement, so a call that holds the GIL lets the counter
advance by exactly 0 (checked on a GIL-holding builtin, ``sum(range(n))``, of similar length);
a call that releases it lets the counter run on the other core for the whole call.  Checked
for ``paged_attention`` and ``forward_paged`` (a large attention: the counter must reach at
least 20 % of its solo rate over the call) and for ``kv_write``, ``rows_gather`` and
``rows_scatter`` (large copies: the counter must advance).

CPU reference threads: one attention call runs its (row, kv head) items on up to
``torch.get_num_threads()`` threads (the caller's included, one per ~4M multiply-adds); outputs
and log-sum-exps are bit-identical on any number of threads (fp32, bf16 with GQA and the key
limits mask, an fp8 cache, several rows), the extra threads exist while a large call runs and
match the count asked for, and a small call starts none.

Two adapters: each of two threads builds and drives its own adapter (its own BlockTables,
block pool, caches, rows, layers) through a HunyuanImage-shaped loop of several causal layers,
a prefill step and denoise steps with piecewise full-attention spans; every layer output and
the final caches are bit-identical to the same work done by one thread alone, in fp32 and bf16.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import diffkv as dk
from diffkv import _C

# --- GIL release ---------------------------------------------------------------------------------


class _Counter:
    """A thread that counts as fast as it can and yields the GIL every 1,000 increments."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop:
            self.count += 1
            if self.count % 1000 == 0:
                time.sleep(0)

    def __enter__(self) -> _Counter:
        self._thread.start()
        while self.count < 10_000:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()

    def rate(self, seconds: float = 0.1) -> float:
        """Increments per second while the main thread sleeps."""
        c0, t0 = self.count, time.perf_counter()
        time.sleep(seconds)
        return (self.count - c0) / (time.perf_counter() - t0)

    def during(self, fn) -> tuple[int, float]:
        """(increments, seconds) while fn() runs in the main thread."""
        time.sleep(0.005)  # take the GIL afresh: the counter waits from here on
        c0, t0 = self.count, time.perf_counter()
        fn()
        t1, c1 = time.perf_counter(), self.count
        return c1 - c0, t1 - t0


@contextlib.contextmanager
def _switch_interval(seconds: float):
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _attention_args(num_tokens=512, seq_len=1024, heads=8, head_size=64, block_size=16):
    """One row: num_tokens queries over seq_len keys, heads x head_size, fp32 (~0.1-0.3 s)."""
    g = torch.Generator().manual_seed(0)
    num_blocks = seq_len // block_size
    cache = torch.randn(2, num_blocks, block_size, heads, head_size, generator=g)
    table = torch.randperm(num_blocks, generator=g).to(torch.int32)[None]
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    q = torch.randn(num_tokens, heads, head_size, generator=g)
    k = torch.randn(num_tokens, heads, head_size, generator=g)
    slots = torch.arange(seq_len - num_tokens, seq_len, dtype=torch.int64)
    return SimpleNamespace(q=q, k=k, cache=cache, table=table, qsl=qsl, seq_lens=seq_lens, slots=slots)


def _gil_calls():
    a = _attention_args()
    out = torch.empty_like(a.q)
    scale = a.q.shape[-1] ** -0.5
    n_copy = 1 << 22
    key = torch.randn(1, 1, 64).expand(n_copy, 1, 64)  # one token read n_copy times: no memory
    cache = torch.zeros(2, 1024, 16, 1, 64)
    slots = torch.arange(n_copy, dtype=torch.int64) % (1024 * 16)
    src = torch.randn(16, 1, 8)
    index = torch.randint(0, 16, (n_copy // 2,))
    gathered = torch.empty(n_copy // 2, 1, 8)
    scatter_index = torch.arange(n_copy // 4)
    scattered = torch.empty(n_copy // 4, 1, 8)
    return {
        "paged_attention": lambda: _C.paged_attention(
            a.q,
            a.cache,
            a.table,
            a.qsl,
            a.seq_lens,
            None,
            _C.MASK_CAUSAL,
            scale,
            out,
            a.table,
            a.qsl,
            a.seq_lens,
        ),
        "forward_paged": lambda: _C.forward_paged(
            a.q,
            a.k,
            a.k,
            a.cache,
            a.slots,
            a.table,
            a.qsl,
            a.seq_lens,
            None,
            _C.MASK_NONE,
            scale,
            out,
            a.table,
            a.qsl,
            a.seq_lens,
        ),
        "kv_write": lambda: _C.kv_write(key, key, cache, slots),
        "rows_gather": lambda: _C.rows_gather(src, index, gathered),
        "rows_scatter": lambda: _C.rows_scatter(gathered[: n_copy // 4], scatter_index, scattered),
    }


def test_long_c_calls_release_the_gil(record_property):
    calls = _gil_calls()
    for fn in calls.values():
        fn()  # first touch of every buffer outside the measurement
    with _Counter() as counter, _switch_interval(10.0):
        rate = counter.rate()
        results = {name: counter.during(fn) for name, fn in calls.items()}
        # The control: a builtin that holds the GIL for about as long as the attention.
        seconds = results["paged_attention"][1]
        n = 1_000_000
        _, t = counter.during(lambda: sum(range(n)))
        n = max(n, int(n * seconds / max(t, 1e-6)))
        results["control sum(range)"] = counter.during(lambda: sum(range(n)))
    figures = {
        name: {
            "increments": inc,
            "seconds": round(sec, 4),
            "fraction_of_solo_rate": round(inc / (rate * sec), 3),
        }
        for name, (inc, sec) in results.items()
    }
    record_property("counter_rate_per_s", int(rate))
    record_property("gil", figures)
    assert results["control sum(range)"][0] == 0, figures
    for name in ("paged_attention", "forward_paged"):
        assert figures[name]["fraction_of_solo_rate"] >= 0.2, (name, figures)
    for name in ("kv_write", "rows_gather", "rows_scatter"):
        assert results[name][0] > 0, (name, figures)


# --- the CPU reference's threads -----------------------------------------------------------------


@contextlib.contextmanager
def _torch_threads(n: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _reference_call(kind: str):
    """(call, outputs): a CPU attention call above the threading threshold and the tensors it
    writes.  fp32: _attention_args' causal row (8 heads); bf16: three rows of different lengths,
    8 / 2 heads (GQA), the key limits mask, with the log-sum-exps; fp8: a float8_e4m3fn cache with
    per-kv-head scales, 2 rows, 8 / 4 heads."""
    g = torch.Generator().manual_seed(1)
    if kind == "fp32":
        a = _attention_args()
        out = torch.empty_like(a.q)
        args = (a.q, a.cache, a.table, a.qsl, a.seq_lens, None, _C.MASK_CAUSAL, 0.125, out)
        return (lambda: _C.paged_attention(*args, a.table, a.qsl, a.seq_lens)), (out,)
    heads, kv_heads, d, block = 8, (2 if kind == "bf16" else 4), 64, 16
    query_lens, seq_lens = ([300, 77, 512], [700, 77, 1100]) if kind == "bf16" else ([400, 256], [900, 640])
    cols = max(-(-s // block) for s in seq_lens)
    num_blocks = cols * len(seq_lens) + 3
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:cols] for _ in seq_lens]).to(torch.int32)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    n = int(qsl[-1])
    q = torch.randn(n, heads, d, generator=g).bfloat16()
    out = torch.empty_like(q)
    if kind == "bf16":
        cache = torch.randn(2, num_blocks, block, kv_heads, d, generator=g).bfloat16()
        limits = torch.randint(0, 1100, (n,), generator=g, dtype=torch.int32)
        lse = torch.empty(n, heads)
        args = (q, cache, table, qsl, sl, limits, _C.MASK_LIMITS, 0.125, out, lse, table, qsl, sl)
        return (lambda: _C.paged_attention_lse(*args)), (out, lse)
    cache = (torch.randn(2, num_blocks, block, kv_heads, d, generator=g) * 4).to(torch.float8_e4m3fn)
    k_scale = torch.rand(kv_heads, generator=g) + 0.5
    v_scale = torch.rand(kv_heads, generator=g) + 0.5
    args = (q, cache, table, qsl, sl, None, _C.MASK_NONE, 0.125, out, table, qsl, sl, k_scale, v_scale)
    return (lambda: _C.paged_attention(*args)), (out,)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_cpu_attention_is_bit_identical_on_any_number_of_threads(kind):
    call, outs = _reference_call(kind)
    with _torch_threads(1):
        call()
    alone = [o.clone() for o in outs]
    for n in (2, 3, 8):
        for o in outs:
            o.fill_(float("nan"))
        with _torch_threads(n):
            call()
        for o, ref in zip(outs, alone, strict=True):
            assert torch.equal(o.view(torch.uint8), ref.view(torch.uint8)), (kind, n)  # the bits


def _reference_threads() -> int:
    """Threads of this process that the CPU reference started (named "diffkv-cpu")."""
    n = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                n += f.read().strip() == "diffkv-cpu"
        except OSError:  # the thread ended meanwhile
            pass
    return n


def _peak_reference_threads_during(fn) -> int:
    """The most reference threads seen while fn() runs in the main thread (it releases the GIL,
    so a watcher thread samples /proc/self/task meanwhile)."""
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _reference_threads())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        fn()
    finally:
        stop.set()
        watcher.join()
    return peak[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.parametrize("n", [1, 3])
def test_cpu_attention_runs_on_torch_num_threads(n):
    """A large call (~0.1-0.3 s on one thread) runs on n threads: the caller's and n - 1 of its
    own; a small one on the caller's alone."""
    call, _ = _reference_call("fp32")
    call()  # first touch outside the measurement
    assert _reference_threads() == 0
    with _torch_threads(n):
        assert _peak_reference_threads_during(call) == n - 1
        small = _attention_args(num_tokens=16, seq_len=64, heads=2)
        out = torch.empty_like(small.q)
        small_call = lambda: _C.paged_attention(  # noqa: E731
            small.q, small.cache, small.table, small.qsl, small.seq_lens, None, _C.MASK_NONE, 0.125,
            out, small.table, small.qsl, small.seq_lens,
        )  # fmt: skip
        assert _peak_reference_threads_during(lambda: [small_call() for _ in range(20)]) == 0


# --- two adapters, two threads ---------------------------------------------------------------------


def _build(seed: int, dtype: torch.dtype, prefixes: tuple[int, ...], image_tokens: int):
    """A full adapter from the public API (as ``python -m diffkv demo`` builds it), small: 3
    causal layers, 4 query / 2 KV heads x 64, block size 16, one row per prefix (CFG), a
    full-attention span over the image tokens, shuffled block ids, and pre-drawn inputs for a
    prefill step and 3 denoise steps."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_size, block_size, steps = 4, 2, 64, 16, 3
    layer_names = [f"model.layers.{i}.self_attn" for i in range(3)]
    seq_lens = [p + image_tokens for p in prefixes]
    blocks_per_row = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row) + 5
    spec = dk.AttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype)
    kv_cache_config = dk.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_groups=[dk.KVCacheGroup(layer_names, spec)]
    )
    config = dk.DiffusionConfig(dk.ModelConfig(dtype), dk.CacheConfig(block_size=block_size))
    block_tables = dk.BlockTables(
        block_sizes=[block_size],
        max_num_reqs=len(prefixes),
        max_num_batched_tokens=sum(seq_lens),
        max_num_blocks_per_group=[max(blocks_per_row)],
        device="cpu",
    )
    attention = SimpleNamespace(num_heads=heads, softmax_scale=head_size**-0.5)
    layers = {
        name: dk.DiffusionPagedAttentionLayerAdapter(
            layer_name=name, layer=attention, spec=spec, vllm_config=config, device="cpu"
        )
        for name in layer_names
    }
    caches = dk.allocate_kv_caches(kv_cache_config, dtype=dtype, device="cpu", layers=layers)
    pool = dk.BlockPool(num_blocks)
    pool.allocate(2)
    bindings = {}
    prefill_rows, denoise_rows = [], []
    for r, (prefix, seq_len, nblk) in enumerate(zip(prefixes, seq_lens, blocks_per_row, strict=True)):
        ids = pool.allocate(nblk)
        ids = [ids[i] for i in torch.randperm(nblk, generator=g).tolist()]
        block_tables.append_block_ids(r, [ids], overwrite=True)
        bindings[("img", r, None)] = dk.DiffusionPagedAttentionRowBinding(row_index=r, max_seq_len=seq_len)
        prefill_rows.append(dk.DiffusionPagedAttentionRow("img", seq_len, seq_len, 0, sequence_id=r))
        denoise_rows.append(
            dk.DiffusionPagedAttentionRow("img", image_tokens, seq_len, prefix, sequence_id=r)
        )
    adapter = dk.DiffusionPagedAttentionAdapter(
        vllm_config=config,
        device="cpu",
        kv_cache_config=kv_cache_config,
        block_tables=block_tables,
        attn_groups=[[dk.AttentionGroup(layer_names)]],
        layers=layers,
        resolve_row=lambda request_id, sequence_id, context_id: bindings[
            (request_id, sequence_id, context_id)
        ],
    )
    metadata = dk.DiffusionPagedAttentionMetadata(
        prefill_rows=tuple(prefill_rows), denoise_rows=tuple(denoise_rows)
    )
    omni = dk.AttentionMetadata(full_attn_spans=[[(p, p + image_tokens)] for p in prefixes])

    def draw(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    inputs = []
    for step in range(steps + 1):
        per_layer = []
        for _ in layer_names:
            if step == 0:  # packed [T, H, D], rows of different lengths
                t = sum(seq_lens)
                per_layer.append(
                    (draw(t, heads, head_size), draw(t, kv_heads, head_size), draw(t, kv_heads, head_size))
                )
            else:  # batched [B, T, H*D]
                b = len(prefixes)
                per_layer.append(
                    (
                        draw(b, image_tokens, heads * head_size),
                        draw(b, image_tokens, kv_heads * head_size),
                        draw(b, image_tokens, kv_heads * head_size),
                    )
                )
        inputs.append(per_layer)
    return SimpleNamespace(
        adapter=adapter,
        layers=layers,
        caches=caches,
        metadata=metadata,
        omni=omni,
        inputs=inputs,
        names=layer_names,
    )


def _drive(setup) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The denoise loop: every layer output, then a copy of every cache."""
    outputs = []
    runtime = dk.DiffusionPagedAttentionRuntime(setup.adapter, setup.metadata)
    with runtime.activate():
        for step, per_layer in enumerate(setup.inputs):
            active = runtime.ensure_active(step)
            for name, (q, k, v) in zip(setup.names, per_layer, strict=True):
                context = active.prepare_layer_context(name, q, k, v, omni_attn_metadata=setup.omni)
                outputs.append(setup.layers[name].impl.forward_paged(context).clone())
    return outputs, {name: cache.clone() for name, cache in setup.caches.items()}


_SHAPES = {
    "a": dict(seed=1, prefixes=(40, 72), image_tokens=96),
    "b": dict(seed=2, prefixes=(24,), image_tokens=130),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: bit-identical, not merely equal (-0.0 differs from 0.0)."""
    return t.contiguous().view(torch.uint8)


def _assert_identical(label, got, want) -> None:
    outputs, caches = got
    want_outputs, want_caches = want
    assert len(outputs) == len(want_outputs)
    for i, (o, w) in enumerate(zip(outputs, want_outputs, strict=True)):
        assert o.dtype == w.dtype and o.shape == w.shape, (label, i)
        assert torch.equal(_bits(o), _bits(w)), f"{label}: output {i} differs"
    for name in want_caches:
        assert torch.equal(_bits(caches[name]), _bits(want_caches[name])), f"{label}: cache {name} differs"


def _drive_concurrently(setups: dict) -> tuple[dict, dict]:
    """Each setup driven by its own thread, all released at once.  Returns ({key: result or
    the exception the thread raised}, {key: (start, end)})."""
    results: dict[str, object] = {}
    spans: dict[str, tuple[float, float]] = {}
    barrier = threading.Barrier(len(setups))

    def work(key):
        barrier.wait()
        start = time.perf_counter()
        try:
            results[key] = _drive(setups[key])
        except BaseException as exc:  # surfaced by the caller, with the thread's name
            results[key] = exc
        spans[key] = (start, time.perf_counter())

    threads = [threading.Thread(target=work, args=(key,), name=f"adapter-{key}") for key in setups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, spans


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_adapters_in_two_threads_match_one_thread(dtype):
    """Adapters a (two CFG rows) and b (one row), each alone in the main thread, then both at
    once in two threads, three times: outputs and caches bit-identical."""
    alone = {key: _drive(_build(dtype=dtype, **shape)) for key, shape in _SHAPES.items()}
    for round_ in range(3):
        setups = {key: _build(dtype=dtype, **shape) for key, shape in _SHAPES.items()}
        results, spans = _drive_concurrently(setups)
        for key in setups:
            if isinstance(results[key], BaseException):
                raise AssertionError(f"thread {key} (round {round_}) raised") from results[key]
            _assert_identical(f"adapter {key}, round {round_}", results[key], alone[key])
        # The two loops really ran at the same time.
        assert max(start for start, _ in spans.values()) < min(end for _, end in spans.values()), spans
