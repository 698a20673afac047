"""benchmarks/bench_mesh.py on the CPU (4 gloo ranks): every mesh shape of the world runs, the
table lists each with its speed-up, the JSON record holds every rank's figures, and the
Ulysses-only mesh's output equals the 1-rank run's while the CP meshes' differ by rounding
only."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_mesh  # noqa: E402


def test_mesh_shapes_are_the_worlds_factorizations_the_heads_take():
    assert bench_mesh.mesh_shapes(8, 24) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert bench_mesh.mesh_shapes(8, 12) == [(4, 2), (2, 4), (1, 8)]
    assert bench_mesh.mesh_shapes(4, 8) == [(4, 1), (2, 2), (1, 4)]


def test_bench_mesh_gloo_four_ranks(tmp_path):
    out = tmp_path / "mesh.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_mesh.py"), "--backend", "gloo",
         "--world", "4", "--tokens", "96", "--heads", "8", "--kv-heads", "4", "--head-size", "64",
         "--reps", "2", "--warmup", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for mask in ("none", "causal"):
        for shape in ("1 rank", "4x1", "2x2", "1x4"):
            assert any(line.split()[:1] == [mask] and shape in line for line in lines), (mask, shape)
    record = json.loads(out.read_text())
    assert record["benchmark"] == "mesh" and record["shape"]["meshes"] == [[4, 1], [2, 2], [1, 4]]
    assert len(record["ranks"]) == 4
    for rank in record["ranks"]:
        for case in rank["cases"]:
            assert case["single"]["ms"] > 0
            for entry in case["meshes"]:
                assert entry["ms"] > 0 and entry["speedup"] > 0
                if entry["cp"] == 1:
                    assert entry["max_abs_diff_vs_single"] == 0.0
                else:
                    assert entry["max_abs_diff_vs_single"] < 1e-5
