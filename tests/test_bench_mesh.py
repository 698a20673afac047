"""benchmarks/bench_mesh.py on the CPU (4 gloo ranks): every mesh shape of the world runs, the
table lists each with its speed-up, the JSON record holds every rank's figures, and the
Ulysses-only mesh's output equals the 1-rank run's while the CP meshes' differ by rounding
only."""

import json
import os
import sys

from _helpers import ROOT, run_benchmark

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_mesh  # noqa: E402


def test_mesh_shapes_are_the_worlds_factorizations_the_heads_take():
    assert bench_mesh.mesh_shapes(8, 24) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert bench_mesh.mesh_shapes(8, 12) == [(4, 2), (2, 4), (1, 8)]
    assert bench_mesh.mesh_shapes(4, 8) == [(4, 1), (2, 2), (1, 4)]


def test_bench_mesh_gloo_four_ranks(tmp_path):
    out = tmp_path / "mesh.json"
    proc = run_benchmark(
        "bench_mesh.py", "--backend", "gloo",
        "--world", "4", "--tokens", "96", "--heads", "8", "--kv-heads", "4", "--head-size", "64",
        "--reps", "2", "--warmup", "1", "--json", str(out),
        timeout=300,
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


def test_mesh_model_fit_recovers_bandwidths_and_reads_records(tmp_path, capsys):
    """Points made by the model itself (all-to-all 150 GB/s, CP all-gather 60 GB/s) are fitted
    back to those bandwidths with no error, from a bench_mesh.py-shaped record too; an 8-GPU
    mesh that spans no node keeps NVLink, 16 GPUs put the CP all-gather on the inter-node link."""
    import mesh_model

    p = mesh_model.Problem(tokens=8192, heads=8, kv_heads=8, head_size=128)
    t1 = 40.0
    shapes = [(4, 1), (2, 2), (1, 4)]
    points = [(u, c, mesh_model.predict(p, u, c, t1, 150.0, 60.0)) for u, c in shapes]
    bw_a2a, bw_cp = mesh_model.fit([(u, c, ms, t1) for u, c, ms in points], p)
    assert abs(bw_a2a - 150.0) < 1e-6 and abs(bw_cp - 60.0) < 1e-6
    assert mesh_model.shapes(16, 24) == [(8, 2), (4, 4), (2, 8), (1, 16)]
    near = mesh_model.predict(p, 4, 2, t1, 150.0, 60.0, gpus_per_node=8, inter_node_gbs=10.0)
    far = mesh_model.predict(p, 4, 2, t1, 150.0, 60.0, gpus_per_node=4, inter_node_gbs=10.0)
    assert far > near  # the CP all-gather at 10 GB/s once the mesh spans nodes
    meshes = [{"ulysses": u, "cp": c, "ms": ms} for u, c, ms in points]
    record = {
        "benchmark": "mesh",
        "shape": {"tokens": 8192, "heads": 8, "kv_heads": 8, "head_size": 128},
        "ranks": [{"cases": [{"mask": "none", "single": {"ms": t1}, "meshes": meshes}]}],
    }
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps(record))
    assert mesh_model.main(["--json", str(path), "--predict", "8"]) == 0
    out = capsys.readouterr().out
    assert "fitted all-to-all 150 GB/s, CP all-gather 60 GB/s" in out
    assert out.count("(+0.0%)") + out.count("(-0.0%)") == 3
    assert "predicted   8 GPUs 8x1" in out
