"""Shared helpers of the diffkv benchmarks: timing, the environment record, JSON and tables.

Timing on CUDA follows STYLE.md: warm-up calls, the L2 cache flushed before every timed
repetition (a 256 MiB buffer is overwritten, far above the H200's 60 MB L2), CUDA events
around the call only, the median of the repetitions.  On CPU the same loop runs with
time.perf_counter_ns.  ``device_times_us`` times GPU work from the profiler's kernel records
instead, for calls that synchronise the host inside (events would count the sync).

Entry points: time_us, time_many_us, runnable, device_times_us, environment, write_json,
print_table, median, fmt.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import torch

import diffkv
from diffkv import _C, _bench
from diffkv._bench import flush_l2

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_flush_names: dict[torch.device, set[str]] = {}


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(values))


def time_us(
    fn: Callable[[], Any],
    device: torch.device | str,
    *,
    warmup: int = 3,
    reps: int = 10,
) -> dict[str, Any]:
    """Times ``fn()`` on ``device`` with the package's timer (``diffkv._bench.time_us``:
    ``warmup`` untimed calls, then ``reps`` timed ones, each after an L2 flush (CUDA) and
    bracketed by CUDA events (CUDA) or perf_counter (CPU)).  Returns {'median_us', 'min_us',
    'samples_us': [reps]}."""
    return time_many_us({"fn": fn}, device, warmup=warmup, reps=reps)["fn"]


def time_many_us(
    fns: dict[str, Callable[[], Any]],
    device: torch.device | str,
    *,
    warmup: int = 3,
    reps: int = 10,
) -> dict[str, dict[str, Any]]:
    """``time_us`` for the calls of one comparison, interleaved (``diffkv._bench.time_interleaved``:
    every round runs each call once, order rotated, so drift in the GPU's clock falls on all of
    them alike).  Returns {name: {'median_us', 'min_us', 'samples_us'}}."""
    timed = _bench.time_interleaved(fns, torch.device(device), warmup, reps)
    return {
        name: {"median_us": t["us"], "min_us": t["min_us"], "samples_us": t["samples_us"]}
        for name, t in timed.items()
    }


def runnable(fns: dict[str, Callable[[], Any]]) -> dict[str, Callable[[], Any]]:
    """The calls of ``fns`` whose first run succeeds (each run once, then the GPU synchronised
    when one is present); a call that raises RuntimeError -- a torch backend that cannot run the
    case -- is reported unavailable and left out."""
    ok = {}
    for name, fn in fns.items():
        try:
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except RuntimeError as exc:
            print(f"  {name}: unavailable ({str(exc).splitlines()[0][:100]})")
            continue
        ok[name] = fn
    return ok


def _flush_kernel_names(device: torch.device) -> set[str]:
    """Names of the device records one flush_l2 leaves in a profile (profiled once per device)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if device in _flush_names:
        return _flush_names[device]
    flush_l2(device)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        flush_l2(device)
        torch.cuda.synchronize(device)
    names = {e.name for e in prof.events() if e.device_type == DeviceType.CUDA}
    if not names:
        raise RuntimeError("device_times_us(): the profiler recorded no CUDA activity (is CUPTI available?)")
    _flush_names[device] = names
    return names


def device_times_us(
    fn: Callable[[], Any],
    device: torch.device | str,
    *,
    match: str | None = None,
    warmup: int = 3,
    reps: int = 10,
) -> dict[str, Any]:
    """GPU time of ``fn()`` from the profiler's device records (kernels, memcpys, memsets):
    per repetition the sum of the durations of the records ``fn`` issued (only those whose
    name contains ``match`` when given), each repetition after an L2 flush.  Host time and
    host synchronisation inside ``fn`` are not counted.  Returns the dict of ``time_us`` plus
    'kernels': the record names counted.  RuntimeError when the records do not split evenly
    into repetitions (the call issued a different amount of work each time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device_times_us(): device must be a CUDA device, got {device}")
    flush_names = _flush_kernel_names(device)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush_l2(device)
            fn()
        torch.cuda.synchronize(device)
    records = [
        e
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
        and e.name not in flush_names
        and (match is None or match in e.name)
    ]
    records.sort(key=lambda e: e.time_range.start)
    if not records or len(records) % reps != 0:
        raise RuntimeError(
            f"device_times_us(): expected a multiple of {reps} device records"
            f"{'' if match is None else f' matching {match!r}'}, got {len(records)}: "
            f"{sorted({e.name for e in records})}"
        )
    per_rep = len(records) // reps
    samples = [
        sum(e.time_range.elapsed_us() for e in records[i * per_rep : (i + 1) * per_rep]) for i in range(reps)
    ]
    return {
        "median_us": median(samples),
        "min_us": min(samples),
        "samples_us": samples,
        "kernels": sorted({e.name for e in records}),
    }


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(device: torch.device | str) -> dict[str, Any]:
    """What a result depends on: GPU, driver, CUDA, cuDNN, torch, diffkv (version, build),
    Python, the git commit (and whether the tree was dirty), the UTC time."""
    device = torch.device(device)
    record: dict[str, Any] = {
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "diffkv": diffkv.__version__,
        "diffkv_build": _C.build_info(),
        # The GPU machine gets a copy of the tree whose .git (if any) need not match it: the
        # caller passes DIFFKV_COMMIT, which wins over what git says there.
        "git_commit": os.environ.get("DIFFKV_COMMIT") or _run(["git", "rev-parse", "HEAD"]),
        "git_dirty": None,
        "cpu": platform.processor() or platform.machine(),
    }
    status = (
        None
        if os.environ.get("DIFFKV_COMMIT")
        else _run(["git", "status", "--porcelain", "--untracked-files=no"])
    )
    if status is not None:
        record["git_dirty"] = bool(status)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record["gpu"] = torch.cuda.get_device_name(device)
        record["gpu_capability"] = f"sm_{props.major}{props.minor}"
        record["gpu_sms"] = props.multi_processor_count
        record["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        record["cudnn"] = torch.backends.cudnn.version()
        record["driver"] = None
        if shutil.which("nvidia-smi"):
            index = device.index if device.index is not None else torch.cuda.current_device()
            out = _run(
                [
                    "nvidia-smi",
                    f"--id={index}",
                    "--query-gpu=driver_version,clocks.max.sm,power.limit",
                    "--format=csv,noheader",
                ]
            )
            if out:
                fields = [f.strip() for f in out.split(",")]
                record["driver"] = fields[0]
                record["gpu_max_sm_clock"] = fields[1] if len(fields) > 1 else None
                record["gpu_power_limit"] = fields[2] if len(fields) > 2 else None
    return record


def write_json(path: str, record: dict[str, Any]) -> None:
    """Writes ``record`` as indented JSON (directories created as needed)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table cell; None becomes 'n/a'."""
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> None:
    """Prints rows of strings under headers, the first ``left`` columns left-aligned and the
    others right-aligned, one space-separated line per row."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    print(line(headers))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))
