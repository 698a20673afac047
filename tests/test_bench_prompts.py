"""benchmarks/bench_prompts.py on the CPU: rows of different prompts in one call against torch's
SDPA per row -- every case runs, the outputs agree, and the JSON record holds each case."""

import json

from _helpers import run_benchmark


def test_bench_prompts_runs_every_case_and_writes_json(tmp_path):
    out = tmp_path / "prompts.json"
    proc = run_benchmark(
        "bench_prompts.py", "--device", "cpu",
        "--prompts", "16,48", "--prompts", "8,24,40", "--image", "32,40", "--heads", "4", "--kv-heads", "2",
        "--head-size", "64", "--reps", "2", "--json", str(out),
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "16/48" in proc.stdout and "8/24/40" in proc.stdout
    record = json.loads(out.read_text())
    assert record["benchmark"] == "prompts"
    cases = [(r["prompts"], r["image"]) for r in record["results"]]
    assert cases == [([16, 48], 32), ([16, 48], 40), ([8, 24, 40], 32), ([8, 24, 40], 40)]
    for r in record["results"]:
        assert r["seq_lens"] == [p + r["image"] for p in r["prompts"]]
        assert r["max_abs_diff"] < 3e-2, r
        assert r["diffkv_us"] > 0 and r["baseline_us"] > 0


def test_bench_prompts_refuses_a_bad_count():
    proc = run_benchmark(
        "bench_prompts.py", "--device", "cpu",
        "--prompts", "16,0",
        timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.strip() == "bench_prompts: token counts must be positive, got '0'"
