"""benchmarks/bench_quantize_kv.py on the CPU: it runs both roundings, finds them equal bit for
bit and writes its JSON record."""

import json

from _helpers import run_benchmark


def test_quick_run_is_bit_exact_and_writes_its_record(tmp_path):
    out = tmp_path / "q.json"
    proc = run_benchmark(
        "bench_quantize_kv.py", "--quick", "--device", "cpu", "--tokens", "64,200", "--json", str(out),
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["benchmark"] == "quantize_kv" and record["summary"]["all_bit_exact"] is True
    assert [r["num_tokens"] for r in record["results"]] == [64, 200]
    for r in record["results"]:
        assert r["bit_exact"] is True
        assert r["diffkv_us"] > 0 and r["torch_us"] > 0
        assert r["bytes"] == 2 * r["num_tokens"] * r["num_kv_heads"] * 128 * 3
