"""Per-call host overhead of one diffkv._C binding call with 4 tensor arguments.

Measures _C.bridge_noop4(a, b, c, d) (reads all four tensors' views through DLPack and, on
CUDA, torch's current stream) through the exchange API and through the capsule fallback,
against a Python function call that does nothing (the floor).  Medians of repeated timings.

    python benchmarks/bench_bridge.py [--device cpu|cuda] [--json out.json]
"""

import argparse
import statistics
import time

import torch

from diffkv import _C
from diffkv._bench import environment, write_json


def _per_call_ns(fn, args, calls=20000, repeats=15):
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn(*args)
        samples.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(samples)


def _noop(a, b, c, d):
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write a JSON record here")
    args = parser.parse_args()

    device = torch.device(args.device)
    tensors = [torch.zeros(1024, device=device) for _ in range(4)]
    results = {"python_noop_ns": _per_call_ns(_noop, tensors)}
    for path in ("auto", "capsule"):
        _C.set_bridge_path(path)
        key = "exchange_ns" if path == "auto" else "capsule_ns"
        try:
            results[key] = _per_call_ns(_C.bridge_noop4, tensors)
        finally:
            _C.set_bridge_path("auto")
    record = {
        "benchmark": "bridge_noop4",
        "env": environment(device, checkout=__file__),
        "path_used": _C.bridge_path(tensors[0]),
        **{k: round(v, 1) for k, v in results.items()},
    }
    what = "4 tensors + stream" if device.type == "cuda" else "4 tensors"
    print(f"bridge_noop4 on {device} ({what}), median ns per call")
    print(f"  python no-op floor : {results['python_noop_ns']:8.1f}")
    print(f"  DLPack exchange API: {results['exchange_ns']:8.1f}")
    print(f"  to_dlpack capsules : {results['capsule_ns']:8.1f}")
    if args.json:
        write_json(args.json, record)


if __name__ == "__main__":
    main()
