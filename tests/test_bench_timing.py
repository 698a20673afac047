"""The benchmarks' interleaved timer (diffkv._bench.time_interleaved) and bench_attention's use
of it, on the CPU: every call of a comparison runs warmup + reps times, one repetition of each
per round in an order rotated every round, and a case's diffkv call, its contiguous or causal
comparison and its baselines all come back from one command."""

import json
import re

import pytest
import torch

from _helpers import run_benchmark
from diffkv import _bench


def test_time_interleaved_rotates_the_order_every_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    timed = _bench.time_interleaved(fns, torch.device("cpu"), 2, 4)
    assert list(timed) == ["a", "b", "c"]
    warm, rounds = calls[:6], calls[6:]
    assert warm == ["a", "a", "b", "b", "c", "c"]
    assert rounds == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    for name, t in timed.items():
        assert len(t["samples_us"]) == 4, name
        assert t["min_us"] <= t["median_us"], name
        assert all(s >= 0 for s in t["samples_us"]), name


def test_time_us_is_the_one_call_case():
    calls = []
    t = _bench.time_us(lambda: calls.append(1), "cpu", warmup=3, reps=5)
    assert len(calls) == 8
    assert len(t["samples_us"]) == 5 and t["min_us"] <= t["median_us"]


def test_time_interleaved_needs_a_call():
    with pytest.raises(ValueError, match="time_interleaved\\(\\): fns must name at least one call, got none"):
        _bench.time_interleaved({}, torch.device("cpu"), 1, 1)


class _Refused(Exception):
    pass


def _refuse(message):
    raise _Refused(message)


@pytest.mark.parametrize(
    ("requested", "message"),
    [
        ("mps", "--device must be cpu or cuda[:i], got 'mps'"),
        ("gpu0", "--device must be cpu or cuda[:i], got 'gpu0'"),
    ],
)
def test_bench_device_refuses_what_is_not_cpu_or_cuda(requested, message):
    with pytest.raises(_Refused, match=re.escape(message)):
        _bench.bench_device(requested, _refuse)


def test_bench_device_cuda_needs_a_cuda_build_and_a_gpu(monkeypatch):
    monkeypatch.setattr(_bench._C, "cuda_compiled", lambda: False)
    with pytest.raises(
        _Refused,
        match=re.escape("diffkv was built without CUDA; rebuild with nvcc on PATH or pass --device cpu"),
    ):
        _bench.bench_device("cuda:0", _refuse)
    monkeypatch.setattr(_bench._C, "cuda_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(_Refused, match=re.escape("--device cuda:1: torch sees no CUDA device")):
        _bench.bench_device("cuda:1", _refuse)
    # the default follows torch: the CPU where it sees no GPU
    assert _bench.bench_device(None, _refuse) == torch.device("cpu")
    assert _bench.bench_device("cpu", _refuse) == torch.device("cpu")


def test_bench_attention_times_a_case_and_its_comparison_together(tmp_path):
    out = tmp_path / "attention.json"
    proc = run_benchmark(
        "bench_attention.py", "--quick", "--device", "cpu",
        "--cases", "piecewise_s16k_c1560,paged_b16_s16k", "--reps", "3", "--warmup", "1",
        "--json", str(out),
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    piecewise, paged = results["piecewise_s16k_c1560"], results["paged_b16_s16k"]
    for r in (piecewise, paged):
        assert r["diffkv_us"] > 0 and len(r["diffkv_samples_us"]) == 3
        assert list(r["baselines"]) == ["flash", "cudnn", "flex"]
        assert all(b["status"] == "n/a" for b in r["baselines"].values())  # CUDA only
        assert r["check_ok"]
    assert piecewise["extra"]["causal_us"] > 0
    assert piecewise["extra"]["vs_causal"] == pytest.approx(
        piecewise["diffkv_tflops"] / piecewise["extra"]["causal_tflops"]
    )
    assert paged["extra"]["paged_vs_contiguous"] == pytest.approx(
        paged["extra"]["contiguous_us"] / paged["diffkv_us"]
    )
    assert paged["checks"]["contiguous_vs_paged"] == 0.0


def test_bench_attention_reads_an_hnd_cache(tmp_path):
    """--kv-layout hnd: the same case through a cache whose blocks are [heads, block, D] in
    memory, checked against the baselines' reference like the default layout."""
    out = tmp_path / "attention.json"
    proc = run_benchmark(
        "bench_attention.py", "--quick", "--device", "cpu",
        "--cases", "paged_b16_s16k", "--reps", "2", "--warmup", "1", "--kv-layout", "hnd",
        "--json", str(out),
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (paged,) = json.loads(out.read_text())["results"]
    assert paged["layout"].endswith(", HND in memory")
    assert paged["check_ok"]
    assert paged["checks"]["contiguous_vs_paged"] == 0.0
