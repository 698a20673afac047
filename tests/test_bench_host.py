"""benchmarks/bench_host.py on the CPU: one command runs every row (the [N, H*D] and [N, H, D]
layer calls among them) through the public API, prints the table and writes a JSON record
whose figures are positive microseconds."""

import json

from _helpers import run_benchmark

ROWS = (
    "prepare_batch + activate (per phase)",
    "layer call: prepare_layer_context + forward_paged",
    "layer call with full_attn_spans",
    "layer call, q/k/v given as [N, H, D]",
    "prepare_layer_context",
    "forward_paged of a reused context (run_forward_paged)",
    "the same with spans",
    "_C.forward_paged (binding + launches)",
)


def test_bench_host_runs_every_row_and_writes_json(tmp_path):
    out = tmp_path / "host.json"
    proc = run_benchmark(
        "bench_host.py", "--device", "cpu", "--quick",
        "--calls", "20", "--samples", "3", "--json", str(out),
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for row in ROWS:
        assert row in proc.stdout
    record = json.loads(out.read_text())
    assert record["benchmark"] == "host_overhead"
    assert set(record["results"]) == set(ROWS)
    for name, result in record["results"].items():
        assert result["median_us"] > 0, name
        assert len(result["samples_us"]) == 3, name
