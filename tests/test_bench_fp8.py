"""benchmarks/bench_fp8.py on the CPU (the C reference): --head sets every case's head size and
--block its cache's block size, and the record's accuracy says the fp8 cache cost e4m3's rounding
and no more."""

import json

import pytest

from _helpers import run_benchmark


def _run(tmp_path, *extra):
    out = tmp_path / "fp8.json"
    proc = run_benchmark(
        "bench_fp8.py", "--smoke", "--device", "cpu", "--cases", "hunyuan-4597", "--data", "gaussian",
        "--no-layer", "--reps", "1", "--warmup", "0", "--json", str(out), *extra,
        timeout=300,
    )  # fmt: skip
    return proc, out


@pytest.mark.parametrize("head", [64, 96])
def test_head_sets_every_cases_head_size(tmp_path, head):
    proc, out = _run(tmp_path, "--head", str(head))
    assert proc.returncode == 0, proc.stderr
    assert f"head {head}," in proc.stdout
    (r,) = json.loads(out.read_text())["results"]
    assert r["head_size"] == head and r["shape"].endswith(f"x{head}")
    assert r["flops"] == 4 * r["heads"] * head * r["pairs"]
    acc = r["accuracy"]
    # e4m3 keeps 3 mantissa bits: the fp8 cache's error is a few percent, the bf16 cache's a
    # tenth of a percent (its output rounding); a wrong scale or head stride would be far above
    assert 0.01 < acc["diffkv_fp8"]["rel_l2"] < 0.08
    assert acc["diffkv_bf16"]["rel_l2"] < 0.003
    assert r["checks"]["kv_write_bytes_equal_torch"] is True


@pytest.mark.parametrize("head", ["48", "88"])
def test_head_the_cuda_kernels_lack_is_refused(tmp_path, head):
    proc, out = _run(tmp_path, "--head", head)
    assert proc.returncode == 2
    assert "--head" in proc.stderr and "invalid choice" in proc.stderr
    assert not out.exists()


def test_block_24_pages_the_cache_in_24_key_blocks(tmp_path):
    proc, out = _run(tmp_path, "--block", "24")
    assert proc.returncode == 0, proc.stderr
    assert "block 24," in proc.stdout
    (r,) = json.loads(out.read_text())["results"]
    assert r["block_size"] == 24 and r["head_size"] == 128
    assert 0.01 < r["accuracy"]["diffkv_fp8"]["rel_l2"] < 0.08
    assert r["checks"]["kv_write_bytes_equal_torch"] is True


def test_block_of_no_keys_is_refused(tmp_path):
    proc, out = _run(tmp_path, "--block", "0")
    assert proc.returncode == 2
    assert "argument --block: must be a positive number of keys, got 0" in proc.stderr
    assert not out.exists()


def test_quick_and_smoke_are_one_or_the_other(tmp_path):
    proc, out = _run(tmp_path, "--quick")
    assert proc.returncode == 2
    assert "argument --quick: not allowed with argument --smoke" in proc.stderr
    assert not out.exists()
