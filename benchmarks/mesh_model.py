"""A per-layer cost model of the 2-D mesh (Ulysses x context-parallel KV), fitted to measured points.

Per rank and layer call, for ``N`` tokens, ``H``/``H_kv`` heads of ``D``, ``s`` bytes per element:

    T(u, c) = T1 / (u c)                                   attention + KV write, split u c ways
            + A(u) / bw_a2a                                the Ulysses all-to-alls (Q, K, V, out)
            + G(u, c) / bw_cp(u c)                         the CP all-gather of out and lse
            + M(u, c) / BW_HBM                             the fp32 merge's memory traffic

    A(u)    = (N / u) (2 H + 2 H_kv) D s (u - 1) / u       bytes a rank sends (and receives)
    G(u, c) = (c - 1) N (H / u) (D s + 4)                  bytes a rank receives
    M(u, c) = c N (H / u) D (s + 8)  (c > 1)               each partial read, the fp32 sum read
                                                           and written

``T1`` is the 1-GPU layer time measured in the same run; ``bw_a2a`` and ``bw_cp`` are fitted
(least squares on 1 / bandwidth, non-negative) to the measured mesh points; ``BW_HBM`` is fixed.
Within one node every collective runs on NVLink; past ``--gpus-per-node`` ranks the CP group
spans nodes and its all-gather runs at ``--inter-node-gbs`` per GPU (InfiniBand-class: 50 GB/s
is one 400 Gb/s NIC per GPU), while the Ulysses group stays inside a node.

    python benchmarks/mesh_model.py --points none:2x1=58.2,1x2=66.3 --t1 none=109.9
    python benchmarks/mesh_model.py --json mesh.json [--json multigpu.json] --predict 16,32,64

Prints the fitted bandwidths, each measured point beside the model (the fit's error), and the
predicted time, speed-up and efficiency of every mesh shape for the requested GPU counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import numpy as np

BW_HBM_GBS = 3300.0  # H200 HBM3e, what the KV write and copies reach (docs/performance.md)


@dataclass(frozen=True)
class Problem:
    tokens: int = 75600
    heads: int = 24
    kv_heads: int = 24
    head_size: int = 128
    elem_bytes: int = 2


def a2a_bytes(p: Problem, u: int) -> float:
    return (p.tokens / u) * (2 * p.heads + 2 * p.kv_heads) * p.head_size * p.elem_bytes * (u - 1) / u


def gather_bytes(p: Problem, u: int, c: int) -> float:
    return (c - 1) * p.tokens * (p.heads / u) * (p.head_size * p.elem_bytes + 4)


def merge_bytes(p: Problem, u: int, c: int) -> float:
    return 0.0 if c == 1 else c * p.tokens * (p.heads / u) * p.head_size * (p.elem_bytes + 8)


def fit(points: list[tuple[int, int, float, float]], p: Problem) -> tuple[float, float]:
    """points: (u, c, measured ms, 1-GPU ms).  Returns (bw_a2a, bw_cp) in GB/s fitted by
    non-negative least squares on the time left after T1 / (u c) and the merge."""
    rows, rhs = [], []
    for u, c, ms, t1 in points:
        rest = ms - t1 / (u * c) - merge_bytes(p, u, c) / (BW_HBM_GBS * 1e6)
        rows.append([a2a_bytes(p, u) / 1e6, gather_bytes(p, u, c) / 1e6])  # bytes / 1e6: ms at 1 GB/s
        rhs.append(rest)
    a, b = np.array(rows), np.array(rhs)
    inv = np.zeros(2)
    active = [j for j in range(2) if a[:, j].any()]
    if active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        for j, x in zip(active, sol, strict=True):
            inv[j] = max(x, 1e-9)
    return tuple(float(1.0 / x) if x > 1e-9 else float("inf") for x in inv)  # type: ignore[return-value]


def predict(p: Problem, u: int, c: int, t1: float, bw_a2a: float, bw_cp: float, gpus_per_node: int = 8,
            inter_node_gbs: float = 50.0) -> float:  # fmt: skip
    """Modelled ms of a u x c mesh (the CP all-gather at inter_node_gbs once u c spans nodes)."""
    cp_bw = bw_cp if u * c <= gpus_per_node else inter_node_gbs
    return (
        t1 / (u * c)
        + (a2a_bytes(p, u) / (bw_a2a * 1e6) if u > 1 else 0.0)
        + (gather_bytes(p, u, c) / (cp_bw * 1e6) if c > 1 else 0.0)
        + merge_bytes(p, u, c) / (BW_HBM_GBS * 1e6)
    )


def shapes(gpus: int, kv_heads: int, gpus_per_node: int = 8) -> list[tuple[int, int]]:
    """(u, c) with u c = gpus, u dividing kv_heads, the Ulysses group inside a node."""
    return [
        (u, gpus // u) for u in range(min(gpus, gpus_per_node), 0, -1) if gpus % u == 0 and kv_heads % u == 0
    ]


def _points_from_json(path: str) -> tuple[dict[str, float], dict[str, list[tuple[int, int, float]]], Problem]:
    """bench_mesh.py's or bench_multigpu.py's record: (1-GPU ms per mask, mesh points per mask, shape)."""
    with open(path) as f:
        record = json.load(f)
    shape = record["shape"]
    p = Problem(shape["tokens"], shape["heads"], shape.get("kv_heads") or shape["heads"], shape["head_size"])
    t1, pts = {}, {}
    for case in record["ranks"][0]["cases"]:
        mask = case["mask"]
        t1[mask] = case["single"]["ms"]
        if record["benchmark"] == "mesh":
            pts[mask] = [(e["ulysses"], e["cp"], e["ms"]) for e in case["meshes"]]
        else:  # bench_multigpu: Ulysses x2 and CP x2
            pts[mask] = [(2, 1, case["ulysses"]["ms"]), (1, 2, case["cp"]["ms"])]
    return t1, pts, p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="append", default=[], help="a bench_mesh.py or bench_multigpu.py record")
    ap.add_argument("--points", action="append", default=[], help="MASK:UxC=MS,... measured by hand")
    ap.add_argument("--t1", action="append", default=[], help="MASK=MS: the 1-GPU time")
    ap.add_argument("--predict", default="4,8,16,32,64", help="GPU counts to predict")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--inter-node-gbs", type=float, default=50.0, help="per-GPU inter-node bandwidth (GB/s)")
    args = ap.parse_args(argv)
    problem = Problem()
    t1: dict[str, float] = {}
    pts: dict[str, list[tuple[int, int, float]]] = {}
    for path in args.json:
        t, m, problem = _points_from_json(path)
        t1.update(t)
        for mask, v in m.items():
            pts.setdefault(mask, []).extend(v)
    for item in args.t1:
        mask, _, ms = item.partition("=")
        t1[mask] = float(ms)
    for item in args.points:
        mask, _, rest = item.partition(":")
        for one in rest.split(","):
            shape, _, ms = one.partition("=")
            u, _, c = shape.partition("x")
            pts.setdefault(mask, []).append((int(u), int(c), float(ms)))
    if not pts:
        ap.error("give measured points: --json or --points (with --t1)")
    for mask, mpts in pts.items():
        if mask not in t1:
            ap.error(f"no 1-GPU time for mask {mask!r} (--t1 {mask}=MS)")
        bw_a2a, bw_cp = fit([(u, c, ms, t1[mask]) for u, c, ms in mpts], problem)
        fitted = f"fitted all-to-all {bw_a2a:.0f} GB/s, CP all-gather {bw_cp:.0f} GB/s"
        print(f"mask {mask}: 1 GPU {t1[mask]:.1f} ms; {fitted}")
        for u, c, ms in mpts:
            model = predict(problem, u, c, t1[mask], bw_a2a, bw_cp, args.gpus_per_node, args.inter_node_gbs)
            print(f"  measured {u}x{c}: {ms:.2f} ms, model {model:.2f} ms ({(model - ms) / ms:+.1%})")
        for gpus in (int(g) for g in args.predict.split(",") if g):
            for u, c in shapes(gpus, problem.kv_heads, args.gpus_per_node):
                model = predict(
                    problem, u, c, t1[mask], bw_a2a, bw_cp, args.gpus_per_node, args.inter_node_gbs
                )
                speedup = t1[mask] / model
                eff = f"efficiency {speedup / gpus:.0%}"
                print(f"  predicted {gpus:3d} GPUs {u}x{c}: {model:7.2f} ms, {speedup:5.2f}x, {eff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
