"""Benchmark helpers shared by ``python -m diffkv bench`` (``diffkv/_bench_cli.py``) and the
scripts in the repository's ``benchmarks/``.

Timing on CUDA: warm-up calls first, the L2 cache flushed before every timed repetition (a
256 MiB buffer is overwritten, far above the H200's 60 MB L2), CUDA events around the call
only, the median of the repetitions; on the CPU the same loop runs with perf_counter.  The calls
of one comparison are timed interleaved (``time_interleaved``), so a drift of the GPU's clock
falls on all of them alike.  ``device_times_us`` times GPU work from the profiler's kernel
records instead, for calls that synchronise the host inside (events would count the sync).

Entry points: timing (``flush_l2``, ``time_interleaved``, ``time_us``, ``device_times_us``,
``runnable``); the command line (``bench_device``, ``int_list``); the record (``environment``,
``run_command``, ``write_json``); the printout
(``print_table``, ``fmt``, ``median``); a paged cache for timing ``_C.paged_attention``
(``_paged``, ``paged_call``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TextIO

import torch

import diffkv
from diffkv import _C

L2_FLUSH_BYTES = 256 << 20  # far above the H200's 60 MB L2


# --- timing -------------------------------------------------------------------------------------

_flush_buffers: dict[torch.device, torch.Tensor] = {}
_flush_names: dict[torch.device, set[str]] = {}


def flush_l2(device: torch.device | str) -> None:
    """Overwrites a 256 MiB int32 buffer on ``device`` so that the next timed call starts with a
    cold L2 (CUDA only; a no-op on the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    buf = _flush_buffers.get(device)
    if buf is None:
        buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
        _flush_buffers[device] = buf
    buf.fill_(7)


# GPU cycles of torch.cuda._sleep queued after each flush, before a timed call's start event
# (about 100 us on an H200): the host's time to launch the call -- tens of microseconds for a
# torch SDPA call, more at its first calls or a garbage-collector pause -- then passes while
# the GPU still works, instead of between the events.
HOST_SLACK_CYCLES = 200_000


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(values))


def time_interleaved(
    fns: dict[str, Callable[[], Any]], device: torch.device | str, warmup: int = 3, reps: int = 10
) -> dict[str, dict[str, Any]]:
    """Times the calls of one comparison against each other: warmup untimed calls of each,
    then reps rounds in which each runs once (after an L2 flush, between CUDA events or
    perf_counter readings), the order rotated by one every round.  So every contestant is
    measured across the same stretch of time: an H200 held at its power cap moves its clock
    by 5-10 % over seconds, and back-to-back blocks of repetitions would hand that drift to
    the ratio.  Returns {name: {'median_us', 'min_us', 'samples_us': [reps]}}, names in the
    order given.  On CUDA each flush is followed by HOST_SLACK_CYCLES of GPU sleep, so that a
    call's launch on the host is not timed as a gap between its events."""
    names = list(fns)
    if not names:
        raise ValueError("time_interleaved(): fns must name at least one call, got none")
    device = torch.device(device)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    events = []
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if cuda:
                flush_l2(device)
                torch.cuda._sleep(HOST_SLACK_CYCLES)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                events.append((name, start, end))
            else:
                t0 = time.perf_counter_ns()
                fns[name]()
                samples[name].append((time.perf_counter_ns() - t0) / 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        for name, start, end in events:
            samples[name].append(start.elapsed_time(end) * 1e3)
    return {
        name: {"median_us": median(samples[name]), "min_us": min(samples[name]), "samples_us": samples[name]}
        for name in names
    }


def time_us(
    fn: Callable[[], Any], device: torch.device | str, *, warmup: int = 3, reps: int = 10
) -> dict[str, Any]:
    """``time_interleaved`` of one call: {'median_us', 'min_us', 'samples_us': [reps]}."""
    return time_interleaved({"fn": fn}, device, warmup, reps)["fn"]


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


# --- the record ---------------------------------------------------------------------------------


def run_command(cmd: list[str], cwd: str | None = None) -> str | None:
    """The stripped stdout of ``cmd`` (run in ``cwd``, 20 s at most), or None when it cannot
    start, fails or times out."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cudnn_version(device: torch.device) -> int | None:
    """cuDNN's version on a CUDA run; None on the CPU (loading cuDNN there is pointless, and
    fails outright when another cuDNN is first on the library path) or when it cannot load."""
    if device.type != "cuda":
        return None
    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except RuntimeError:
        return None


def _commit(checkout: str | None) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the diffkv sources measured.  DIFFKV_COMMIT wins: the GPU machine
    gets a copy of the tree whose .git, if any, need not match it (dirty is then unknown).
    Else git in ``checkout`` (a file or folder of a git checkout: a benchmark script passes
    ``__file__``), or, without one, in the tree diffkv is imported from when that is a git
    checkout of diffkv (``<top>/python/diffkv``; an installed copy names no commit)."""
    if os.environ.get("DIFFKV_COMMIT"):
        return os.environ["DIFFKV_COMMIT"], None
    if checkout is None:
        package = os.path.dirname(os.path.abspath(diffkv.__file__))
        top = run_command(["git", "rev-parse", "--show-toplevel"], cwd=package)
        sources = os.path.join(top, "python", "diffkv") if top else ""
        if not os.path.isdir(sources) or not os.path.samefile(sources, package):
            return None, None
        checkout = top
    elif not os.path.isdir(checkout):
        checkout = os.path.dirname(os.path.abspath(checkout))
    commit = run_command(["git", "rev-parse", "HEAD"], cwd=checkout)
    status = run_command(["git", "status", "--porcelain", "--untracked-files=no"], cwd=checkout)
    return commit, None if commit is None or status is None else bool(status)


def environment(device: torch.device | str, *, checkout: str | None = None) -> dict[str, Any]:
    """What a result depends on: the UTC time, the device, Python, the platform, the CPU, torch
    and its CUDA, cuDNN, diffkv (version, build info, commit and whether the tree was dirty:
    see ``_commit``; ``checkout``: a file or folder of the git checkout the caller runs from), and
    on CUDA the GPU (name, capability, SMs, memory, driver, max SM clock, power limit)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    commit, dirty = _commit(checkout)
    record: dict[str, Any] = {
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": _cudnn_version(device),
        "diffkv": diffkv.__version__,
        "diffkv_build": _C.build_info(),
        "diffkv_commit": commit,
        "diffkv_dirty": dirty,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record.update(
            gpu=torch.cuda.get_device_name(device),
            gpu_capability=f"sm_{props.major}{props.minor}",
            gpu_sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            driver=None,
        )
        if shutil.which("nvidia-smi"):
            out = run_command(
                [
                    "nvidia-smi",
                    f"--id={device.index}",
                    "--query-gpu=driver_version,clocks.max.sm,power.limit",
                    "--format=csv,noheader",
                ]
            )
            if out:
                fields = [f.strip() for f in out.split(",")] + [None, None]
                record.update(driver=fields[0], gpu_max_sm_clock=fields[1], gpu_power_limit=fields[2])
    return record


def write_json(path: str, record: dict[str, Any]) -> None:
    """Writes ``record`` as indented JSON, folders created as needed; through a temporary file
    and a rename, so a reader (or a run cut short) never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def bench_device(requested: str | None, error: Callable[[str], NoReturn]) -> torch.device:
    """The device a benchmark's --device names: ``cpu`` or ``cuda[:i]``, by default CUDA where torch
    sees a GPU and the CPU otherwise.  ``error`` (argparse's ``parser.error``: it does not return)
    gets the reason when it cannot run there: a device that is neither, CUDA with a CPU-only build
    of diffkv, or CUDA that torch does not see."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        error(f"--device must be cpu or cuda[:i], got {requested!r}")
    if device.type == "cuda":
        if not _C.cuda_compiled():
            error("diffkv was built without CUDA; rebuild with nvcc on PATH or pass --device cpu")
        if not torch.cuda.is_available():
            error(f"--device {device}: torch sees no CUDA device")
    return device


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers from the command line ("4096,16384"; empty items
    skipped)."""
    return [int(x) for x in text.split(",") if x]


# --- the printout -------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table cell; None becomes 'n/a'."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1, stream: TextIO | None = None
) -> None:
    """Prints rows of strings under headers and a dashed rule, columns two spaces apart, the
    first ``left`` columns left-aligned and the others right-aligned (to stdout by default)."""
    stream = sys.stdout if stream is None else stream
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    print(line(headers), file=stream)
    print(line(["-" * w for w in widths]), file=stream)
    for row in rows:
        print(line(row), file=stream)


# --- a paged cache for timing _C.paged_attention ------------------------------------------------


def _paged(
    k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator, query_len: int | None = None
) -> dict[str, Any]:
    """A cache [2, num_blocks, block_size, Hkv, D] holding rows k/v [R, Hkv, S, D] in blocks
    drawn from a random permutation of num_blocks = needed + spare, with the metadata
    _C.paged_attention takes (device tensors and host copies) for query_len queries a row (the
    last ones of its S positions; default S)."""
    rows, kv_heads, seq_len, head_size = k.shape
    device = k.device
    per_row = -(-seq_len // block_size)
    num_blocks = rows * per_row + max(3, rows * per_row // 32)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = order[: rows * per_row].view(rows, per_row).contiguous()
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_size, dtype=k.dtype, device=device)
    flat = cache.view(2, num_blocks * block_size, kv_heads, head_size)
    table_dev = table.to(device)
    pos = torch.arange(seq_len, device=device)
    for r in range(rows):
        slots = table_dev[r].long()[pos // block_size] * block_size + pos % block_size
        flat[0].index_copy_(0, slots, k[r].transpose(0, 1))
        flat[1].index_copy_(0, slots, v[r].transpose(0, 1))
    query_len = seq_len if query_len is None else query_len
    qsl = torch.arange(0, (rows + 1) * query_len, query_len, dtype=torch.int32)
    seq_lens = torch.full((rows,), seq_len, dtype=torch.int32)
    return {
        "cache": cache,
        "num_blocks": num_blocks,
        "block_table": table_dev,
        "query_start_loc": qsl.to(device),
        "seq_lens": seq_lens.to(device),
        "host": (table, qsl, seq_lens),
    }


def paged_call(
    query: torch.Tensor,
    paged: dict[str, Any],
    mask_code: int,
    scale: float,
    out: torch.Tensor,
    key_limits: torch.Tensor | None = None,
) -> Callable[[], None]:
    """A call of ``_C.paged_attention`` over ``_paged``'s cache and metadata (its host copies
    included, as a caller that has them passes them), no arguments, for the timers; key_limits
    with mask_code ``MASK_LIMITS``."""
    host = paged["host"]

    def run() -> None:
        _C.paged_attention(
            query,
            paged["cache"],
            paged["block_table"],
            paged["query_start_loc"],
            paged["seq_lens"],
            key_limits,
            mask_code,
            scale,
            out,
            *host,
        )

    return run
