"""``python -m diffkv bench``: paged attention throughput on this GPU against torch's kernels.

The sweep: every head size x sequence length x rows x block size (``--head-sizes all``: every
head size the CUDA kernels take for fp16/bf16).  Each row holds seq_len tokens that all attend
(query_len == seq_len, the prefill / full-image case), non-causal by default (``--mask causal``
for the causal mask).  ``--mask span`` times HunyuanImage-3.0's denoise step instead: each row
holds a prompt of ``--prompt-len`` tokens, then seq_len image tokens under one full-attention
span; the queries are the image tokens, the keys the whole row, and diffkv's mask is what
``diffkv.piecewise``'s plan and ``ops.plan_mask`` give a layer call (the baselines, which cannot
take the plan, run unmasked: the span makes every key visible).  diffkv runs
``diffkv._C.paged_attention`` on a paged cache ``[2, num_blocks, block_size, Hkv, D]`` whose
blocks are a random permutation with spare blocks; the baselines run in the same process on the
same data laid out densely (``[rows, H, seq_len, D]``, one call): torch SDPA with the flash
backend, torch SDPA with the cuDNN backend and ``torch.compile(flex_attention)``.  GQA goes
through ``enable_gqa=True``, or K/V expanded beforehand (outside the timing) when a backend
refuses it.  A baseline that cannot run is skipped with its reason in the notes.  Baselines do
not depend on the block size: they are timed once per (seq_len, rows) and reported on every
block size's point.

Timing (``diffkv._bench``, the helpers the repository's benchmarks use too): CUDA events
around the call only, warm-up calls first, the L2 cache flushed before every repetition, the
median of the repetitions (perf_counter on CPU); a (seq_len, rows) shape's calls -- diffkv at
each block size and every baseline -- are timed interleaved, one of each per repetition round,
so a drift of the GPU's clock falls on all of them alike.  TFLOP/s counts 4 * H * D * visible
(query, key) pairs.  diffkv's output is checked against every baseline's (or a float32
reference when none ran and the case is small).

Writes DIR/bench.json (environment and every point, rewritten after each point so a run cut
short keeps what it measured) and prints the table.  With matplotlib installed (the ``bench``
extra: ``pip install diffkv[bench]``) it also draws DIR/bench.png: TFLOP/s against sequence
length, one panel per rows value, one line per diffkv block size and per baseline.  Without
it, it says how to draw the plot later: ``python -m diffkv bench --plot DIR/bench.json``
draws it from the record and runs nothing.

Entry points: add_arguments(parser), run(args, parser).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, TextIO

import torch
import torch.nn.functional as F

import diffkv
from diffkv import _C
from diffkv._bench import (
    L2_FLUSH_BYTES,
    _paged,
    bench_device,
    environment,
    fmt,
    paged_call,
    print_table,
    time_interleaved,
    write_json,
)
from diffkv.backends.diffkv import supported_head_sizes
from diffkv.ops import plan_mask
from diffkv.piecewise import build_paged_piecewise_plan

BASELINES = ("flash", "cudnn", "flex")
MASK_NAMES = {_C.MASK_NONE: "none", _C.MASK_CAUSAL: "causal", _C.MASK_LIMITS: "limits"}
BASELINE_TITLES = {"flash": "torch SDPA flash", "cudnn": "torch SDPA cuDNN", "flex": "FlexAttention"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PROMPT_LEN = 500  # --mask span's default prompt: the shorter of bench_attention.py's HunyuanImage-3.0 rows
REFERENCE_MAX_SCORES = 1 << 24  # float32 reference only when rows * H * queries * keys is at most this
SCHEMA = 2  # 2: config head_sizes (a list) and a head_size per point; schema 1 records are read too
PLOT_HINT = "pip install 'diffkv[bench]' (matplotlib), then: python -m diffkv bench --plot {json}"
# The plot: one panel of PANEL_INCHES per rows value, saved at PLOT_DPI dots per inch.
PANEL_INCHES = (6.0, 4.8)
PLOT_DPI = 110
DIFFKV_COLORS = ("tab:red", "tab:orange", "tab:brown", "tab:pink", "tab:olive")  # per block size
BASELINE_COLORS = {"flash": "tab:blue", "cudnn": "tab:green", "flex": "tab:purple"}

# HunyuanImage-3.0's DiT attention: 32 query heads, 8 KV heads, head size 128, bf16.
FULL = {
    "seq_lens": [1024, 2048, 4096, 8192, 16384, 32768],
    "rows": [1, 2],
    "block_sizes": [16, 128],
    "heads": 32,
    "kv_heads": 8,
    "head_sizes": [128],
    "warmup": 3,
    "reps": 10,
}
QUICK = {
    "seq_lens": [64, 128, 256],
    "rows": [1, 2],
    "block_sizes": [16, 128],
    "heads": 4,
    "kv_heads": 2,
    "head_sizes": [64],
    "warmup": 1,
    "reps": 3,
}


# --- arguments ----------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    """'1k,2k,4096' -> [1024, 2048, 4096] (k = 1024); every value must be a positive integer."""
    values = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        mult = 1024 if item.endswith("k") else 1
        try:
            value = int(item[:-1] if mult > 1 else item) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be positive integers (1k = 1024), got {item!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be positive integers, got {value}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError("must list at least one value")
    return values


def _head_sizes(text: str) -> list[int] | str:
    """'all' (every head size the CUDA kernels take for fp16/bf16, resolved later) or a list as
    _int_list reads it."""
    return "all" if text.strip().lower() == "all" else _int_list(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


# The options of a sweep (argparse dests); --plot takes none of them.
SWEEP_OPTIONS = (
    "quick",
    "seq_lens",
    "rows",
    "block_sizes",
    "heads",
    "kv_heads",
    "head_sizes",
    "dtype",
    "mask",
    "prompt_len",
    "baselines",
    "warmup",
    "reps",
    "device",
    "no_plot",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the bench options to parser (the `bench` subcommand's parser)."""
    parser.add_argument(
        "--out",
        default=None,
        help="output folder (default: ./diffkv-bench); with --plot: the PNG file (default: the "
        "record's path with .png)",
    )
    parser.add_argument(
        "--plot",
        metavar="JSON",
        default=None,
        help="draw the plot of a bench.json written earlier (needs matplotlib) and run nothing",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sweep (4/2 heads x 64, seq 64..256) that also runs on the CPU; diffkv only",
    )
    parser.add_argument("--seq-lens", type=_int_list, default=None, help="e.g. 1k,2k,4k (default 1k..32k)")
    parser.add_argument("--rows", type=_int_list, default=None, help="rows per call (default 1,2)")
    parser.add_argument("--block-sizes", type=_int_list, default=None, help="default 16,128")
    parser.add_argument("--heads", type=_positive, default=None, help="query heads (default 32)")
    parser.add_argument("--kv-heads", type=_positive, default=None, help="KV heads (default 8)")
    parser.add_argument(
        "--head-sizes",
        "--head-size",
        dest="head_sizes",
        type=_head_sizes,
        default=None,
        help="e.g. 64,96,128, or all: the CUDA kernels' fp16/bf16 sizes (default 128)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--mask",
        choices=("none", "causal", "span"),
        default="none",
        help="default none; span: HunyuanImage-3.0's denoise step (image queries over prompt + image keys)",
    )
    parser.add_argument(
        "--prompt-len",
        type=_positive,
        default=None,
        help="with --mask span: the prompt tokens before each row's image tokens (default 500)",
    )
    parser.add_argument(
        "--baselines", default=",".join(BASELINES), help="subset of flash,cudnn,flex ('' for none)"
    )
    parser.add_argument("--warmup", type=_positive, default=None, help="untimed calls first (default 3)")
    parser.add_argument("--reps", type=_positive, default=None, help="timed calls, median taken (default 10)")
    parser.add_argument("--device", default=None, help="cuda[:i] or cpu (default: cuda when available)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG even with matplotlib installed")


def _resolve(args: argparse.Namespace, parser_error: Callable[[str], Any]) -> dict[str, Any]:
    """The run's configuration: defaults (full or quick) overridden by the options."""
    base = QUICK if args.quick else FULL
    cfg: dict[str, Any] = {}
    for key in base:
        value = getattr(args, key)
        cfg[key] = value if value is not None else base[key]
    if args.prompt_len is not None and args.mask != "span":
        parser_error("--prompt-len goes with --mask span")
    if cfg["heads"] % cfg["kv_heads"] != 0:
        parser_error(f"--heads must be a multiple of --kv-heads, got {cfg['heads']} and {cfg['kv_heads']}")
    baselines = [b for b in args.baselines.split(",") if b]
    unknown = sorted(set(baselines) - set(BASELINES))
    if unknown:
        parser_error(f"--baselines: unknown {unknown}; choose from {list(BASELINES)}")
    requested = args.device
    if requested is None and not (torch.cuda.is_available() and _C.cuda_compiled()):
        if not args.quick:
            why = (
                "diffkv was built without CUDA"
                if not _C.cuda_compiled()
                else "torch sees no CUDA device (torch.cuda.is_available() is False)"
            )
            parser_error(f"no GPU to benchmark: {why}; --quick runs a tiny sweep on the CPU")
        requested = "cpu"
    device = bench_device(requested, parser_error)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if cfg["head_sizes"] == "all":
        cfg["head_sizes"] = list(_C.supported_head_sizes("cuda", "bfloat16", "auto"))
        if not cfg["head_sizes"]:
            parser_error(
                "--head-sizes all lists the CUDA kernels' head sizes: this diffkv was built without CUDA"
            )
    served = supported_head_sizes(device.type, DTYPES[args.dtype])
    unserved = [d for d in cfg["head_sizes"] if d not in served]
    if unserved:
        sizes = f"{served[0]} to {served[-1]}" if served == list(range(served[0], served[-1] + 1)) else served
        where = f"the {args.dtype} kernels' head sizes on {device.type}"
        parser_error(f"--head-sizes: {unserved} not among {where} ({sizes})")
    cfg.update(
        device=device,
        dtype=args.dtype,
        mask=args.mask,
        prompt_len=(PROMPT_LEN if args.prompt_len is None else args.prompt_len) if args.mask == "span" else 0,
        quick=args.quick,
        baselines=[] if args.quick else baselines,
        out="diffkv-bench" if args.out is None else args.out,
    )
    return cfg


# --- progress ------------------------------------------------------------------------------------


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """A progress bar on a text stream.  Work is counted in units the caller chooses (here
    FLOPs, so the bar and the estimate of the time left follow the cost of the steps).  On a
    terminal one line is redrawn; elsewhere (logs, pipes) each step prints its own line."""

    def __init__(self, total_steps: int, total_work: float, stream: TextIO, width: int = 28):
        self.total_steps = total_steps
        self.total_work = max(total_work, 1e-30)
        self.stream = stream
        self.width = width
        self.steps = 0
        self.work = 0.0
        self.start_time = time.monotonic()
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._last_len = 0

    def _line(self, label: str) -> str:
        frac = min(1.0, self.work / self.total_work)
        filled = int(frac * self.width)
        elapsed = time.monotonic() - self.start_time
        eta = f", ~{_fmt_duration(elapsed * (1 - frac) / frac)} left" if 0 < frac < 1 else ""
        return (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {self.steps}/{self.total_steps} "
            f"{frac * 100:3.0f}% {_fmt_duration(elapsed)}{eta}  {label}"
        )

    def show(self, label: str) -> None:
        """Shows the bar with label naming the step now running."""
        line = self._line(label)
        if self.tty:
            self.stream.write("\r" + line.ljust(self._last_len))
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def advance(self, work: float) -> None:
        """Marks one step done that cost work units."""
        self.steps += 1
        self.work += work

    def close(self) -> None:
        """Draws the full bar and ends its line."""
        line = self._line("done")
        self.stream.write(("\r" + line.ljust(self._last_len) if self.tty else line) + "\n")
        self.stream.flush()


def _seq_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# --- one (seq_len, rows) group: data, baselines, diffkv per block size -------------------------


def _pairs(seq_len: int, mask: str, prompt_len: int = 0) -> int:
    """Visible (query, key) pairs of one row: seq_len queries over seq_len keys (none, causal) or
    over prompt_len + seq_len keys (span)."""
    if mask == "causal":
        return seq_len * (seq_len + 1) // 2
    return seq_len * (prompt_len + seq_len) if mask == "span" else seq_len * seq_len


def _tflops(flops: float, us: float) -> float:
    return flops / (us * 1e-6) / 1e12


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _sdpa_setup(name: str, q, k, v, causal: bool, scale: float) -> dict[str, Any]:
    """{'run', 'out', 'gqa'} for SDPA under backend name, or {'reason'} when it cannot run.
    q [R, H, S, D], k/v [R, Hkv, S, D] contiguous."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if name == "flash" else SDPBackend.CUDNN_ATTENTION
    gqa = q.shape[1] != k.shape[1]
    reasons = []
    for mode in ("enable_gqa", "repeat_interleave") if gqa else ("mha",):
        if mode == "repeat_interleave":
            rep = q.shape[1] // k.shape[1]
            kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        else:
            kk, vv = k, v
        kwargs = {"enable_gqa": True} if mode == "enable_gqa" else {}

        def run(kk=kk, vv=vv, kwargs=kwargs):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, scale=scale, **kwargs)

        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = run()
                torch.cuda.synchronize(q.device)
        except RuntimeError as exc:
            why = "; ".join(str(w.message).splitlines()[0] for w in caught) or _first_line(exc)
            reasons.append(f"{mode}: {why}")
            continue
        return {"run": run, "out": out, "gqa": mode}
    return {"reason": " | ".join(reasons)}


_flex_compiled: Callable[..., Any] | None = None


def _flex_setup(q, k, v, causal: bool, scale: float) -> dict[str, Any]:
    """{'run', 'out', 'gqa'} for torch.compile(flex_attention) (compiled here, outside the
    timing; one graph per shape)."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        import torch._dynamo.config as dynamo_config

        for limit in ("recompile_limit", "cache_size_limit"):  # one graph per shape: raise the cap
            if hasattr(dynamo_config, limit):
                setattr(dynamo_config, limit, 256)
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    flex = _flex_compiled
    seq_len = q.shape[2]
    block_mask = None
    if causal:

        def causal_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        block_mask = create_block_mask(causal_mod, None, None, seq_len, seq_len, device=q.device)
    gqa = q.shape[1] != k.shape[1]

    def run():
        return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)

    out = run()
    torch.cuda.synchronize(q.device)
    return {"run": run, "out": out, "gqa": "enable_gqa" if gqa else "mha"}


def _reference(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """float32 dense attention [R, H, S, D] with an explicit mask."""
    rep = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(rep, dim=1), v.float().repeat_interleave(rep, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        s = q.shape[2]
        visible = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ vf


def _max_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref|: out packed [R*S, H, D], ref [R, H, S, D]; row by row (bounded memory)."""
    rows, _, seq_len, _ = ref.shape
    worst = 0.0
    for r in range(rows):
        mine = out[r * seq_len : (r + 1) * seq_len].transpose(0, 1)
        worst = max(worst, (mine.float() - ref[r].float()).abs().max().item())
    return worst


def _group(
    cfg: dict[str, Any], seq_len: int, rows: int, head_size: int, progress: Progress, notes: dict[str, str]
) -> list[dict[str, Any]]:
    """Times diffkv at every block size and the baselines on one (seq_len, rows, head_size)
    shape, all in one interleaved run (``time_interleaved``: each repetition round runs every
    call once, so the GPU's clock drift falls on all alike).  Returns one point per block
    size."""
    device, dtype = cfg["device"], DTYPES[cfg["dtype"]]
    heads, kv_heads = cfg["heads"], cfg["kv_heads"]
    causal = cfg["mask"] == "causal"
    prompt = cfg["prompt_len"]  # 0 but under --mask span
    scale = head_size**-0.5
    flops = 4 * heads * head_size * rows * _pairs(seq_len, cfg["mask"], prompt)
    where = f"seq {_seq_label(seq_len)} rows {rows}"
    if len(cfg["head_sizes"]) > 1:
        where += f" head {head_size}"

    gen = torch.Generator(device=device)
    gen.manual_seed((seq_len * 16 + rows) * 1024 + head_size)
    q = torch.randn(rows, heads, seq_len, head_size, generator=gen, device=device, dtype=dtype)
    k = torch.randn(rows, kv_heads, prompt + seq_len, head_size, generator=gen, device=device, dtype=dtype)
    v = torch.randn(rows, kv_heads, prompt + seq_len, head_size, generator=gen, device=device, dtype=dtype)

    timers: dict[str, Callable[[], Any]] = {}
    baselines: dict[str, dict[str, Any]] = {}
    setups: dict[str, dict[str, Any]] = {}
    steps = 0  # progress steps this group owes: one per requested baseline and block size
    for name in BASELINES:
        if name not in cfg["baselines"]:
            why = "--quick runs diffkv only" if cfg["quick"] else "not requested (--baselines)"
            baselines[name] = {"status": "skipped", "reason": why}
            continue
        if device.type != "cuda":
            baselines[name] = {"status": "skipped", "reason": "baselines run on CUDA only"}
            continue
        steps += 1
        progress.show(f"{where}: {name} setup")
        try:
            if name == "flex":
                setup = _flex_setup(q, k, v, causal, scale)
            else:
                setup = _sdpa_setup(name, q, k, v, causal, scale)
        except Exception as exc:  # a baseline that cannot run is reported, not fatal
            setup = {"reason": _first_line(exc)}
        if "run" in setup:
            setups[name] = setup
            timers[name] = setup["run"]
        else:
            baselines[name] = {"status": "skipped", "reason": setup["reason"]}
            notes.setdefault(f"{name}: {setup['reason']}", where)

    query = q.transpose(1, 2).reshape(rows * seq_len, heads, head_size).contiguous()
    mask_code, key_limits = (_C.MASK_CAUSAL if causal else _C.MASK_NONE), None
    if cfg["mask"] == "span":  # the mask a layer call gets from the step's piecewise plan
        plan = build_paged_piecewise_plan(
            [[(prompt, prompt + seq_len)]] * rows,
            [prompt] * rows,
            [seq_len] * rows,
            [prompt + seq_len] * rows,
            device=device,
        )
        mask_code, key_limits = plan_mask(plan)
    tol = 5e-3 if dtype == torch.float32 else 3e-2
    runs: dict[int, dict[str, Any]] = {}
    for block_size in cfg["block_sizes"]:
        steps += 1
        progress.show(f"{where}: diffkv block {block_size} setup")
        paged = _paged(k, v, block_size, torch.Generator().manual_seed(block_size), query_len=seq_len)
        out = torch.empty_like(query)

        run = paged_call(query, paged, mask_code, scale, out, key_limits)

        entry: dict[str, Any] = {"paged": paged, "out": out}
        try:
            run()  # a refusal is recorded on the point; the sweep goes on and the run fails
            entry["kernel"] = _C.last_attention_kernel()  # e.g. TMA boxes or not, per block size
            timers[f"diffkv block {block_size}"] = run
        except Exception as exc:
            entry["error"] = _first_line(exc)
            notes.setdefault(f"diffkv: {entry['error']}", f"{where} block {block_size}")
        runs[block_size] = entry

    progress.show(f"{where}: timing {len(timers)} calls interleaved")
    timed = time_interleaved(timers, device, cfg["warmup"], cfg["reps"]) if timers else {}
    refs: dict[str, torch.Tensor] = {}
    for name, setup in setups.items():
        t = timed[name]
        refs[name] = setup["out"]
        baselines[name] = {
            "status": "ok",
            "us": t["median_us"],
            "tflops": _tflops(flops, t["median_us"]),
            "gqa": setup["gqa"],
            "samples_us": t["samples_us"],
        }
    if not refs and rows * heads * seq_len * (prompt + seq_len) <= REFERENCE_MAX_SCORES:
        refs["fp32_reference"] = _reference(q, k, v, causal, scale)
    baselines = {name: baselines[name] for name in BASELINES}

    points = []
    for block_size, entry in runs.items():
        if "error" in entry:
            result: dict[str, Any] = {"error": entry["error"], "us": None, "tflops": None}
            checks: dict[str, float] = {}
            ok = False
        else:
            t = timed[f"diffkv block {block_size}"]
            result = {
                "us": t["median_us"],
                "tflops": _tflops(flops, t["median_us"]),
                "min_us": t["min_us"],
                "samples_us": t["samples_us"],
                "kernel": entry["kernel"],
                "mask_run": MASK_NAMES[mask_code],
            }
            checks = {name: _max_diff(entry["out"], ref) for name, ref in refs.items()}
            ok = all(d <= tol for d in checks.values())
        point = {
            "seq_len": seq_len,
            "rows": rows,
            "head_size": head_size,
            "block_size": block_size,
            "num_blocks": entry["paged"]["num_blocks"],
            "pairs": rows * _pairs(seq_len, cfg["mask"], prompt),
            "flops": flops,
            "diffkv": result,
            "baselines": {},
            "checks": checks,
            "check_tol": tol,
            "check_ok": ok,
        }
        for name, b in baselines.items():
            b = dict(b)
            if b["status"] == "ok" and result["tflops"] is not None:
                b["ratio"] = result["tflops"] / b["tflops"]
            point["baselines"][name] = b
        points.append(point)
    for _ in range(steps):
        progress.advance(flops)
    del q, k, v, refs, runs, setups, timers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return points


# --- output -------------------------------------------------------------------------------------


def _title(record: dict[str, Any]) -> str:
    cfg, env = record["config"], record["env"]
    where = env.get("gpu") or env["device"]
    heads = f"{cfg['heads']}/{cfg['kv_heads']}" if cfg["heads"] != cfg["kv_heads"] else f"{cfg['heads']}"
    mask = {"causal": "causal", "span": f"denoise span over a {cfg.get('prompt_len')}-token prompt"}.get(
        cfg["mask"], "non-causal"
    )
    kernel = env.get("diffkv_build", {}).get("attention_kernel", "none")
    kernel = f" ({kernel} kernel)" if kernel != "none" else ""
    sizes = "/".join(str(d) for d in cfg["head_sizes"])
    return f"diffkv paged attention vs torch: {where}{kernel}, {heads} heads x {sizes} {cfg['dtype']}, {mask}"


def _panels(
    record: dict[str, Any],
) -> list[tuple[str, list[tuple[str, str, list[tuple[int, float | None]]]]]]:
    """One panel per rows value (per head size and rows value when the record has several head
    sizes): (title, [(series name, colour, [(seq_len, TFLOP/s or None)])]), a series per diffkv
    block size and per baseline that ran."""
    cfg = record["config"]
    panels = []
    several = len(cfg["head_sizes"]) > 1
    for head_size, rows in [(d, r) for d in cfg["head_sizes"] for r in cfg["rows"]]:
        pts = [p for p in record["points"] if p["rows"] == rows and p["head_size"] == head_size]
        series = []
        for i, bs in enumerate(cfg["block_sizes"]):
            values = [(p["seq_len"], p["diffkv"]["tflops"]) for p in pts if p["block_size"] == bs]
            series.append((f"diffkv block {bs}", DIFFKV_COLORS[i % len(DIFFKV_COLORS)], values))
        first = [p for p in pts if p["block_size"] == cfg["block_sizes"][0]]
        for name in BASELINES:
            values = [(p["seq_len"], p["baselines"][name].get("tflops")) for p in first]
            if any(y is not None for _, y in values):
                series.append((BASELINE_TITLES[name], BASELINE_COLORS[name], values))
        title = f"{rows} row" + ("s" if rows != 1 else "")
        panels.append((f"head {head_size}, {title}" if several else title, series))
    return panels


def _pyplot() -> Any | None:
    """matplotlib.pyplot drawing to files only (the Agg backend), or None when matplotlib is not
    installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(record: dict[str, Any], path: str, plt: Any) -> None:
    """Writes the PNG of record to path with matplotlib.pyplot plt: TFLOP/s against sequence
    length (log2 axis), one panel per rows value (and head size), PANEL_INCHES each at
    PLOT_DPI."""
    panels = _panels(record)
    width, height = PANEL_INCHES
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), height), squeeze=False)
    seq_lens = record["config"]["seq_lens"]
    for ax, (title, series) in zip(axes[0], panels, strict=True):
        for name, color, values in series:
            xs = [x for x, _ in values]
            ys = [math.nan if y is None else y for _, y in values]
            lw = 2.2 if name.startswith("diffkv") else 1.6
            ax.plot(xs, ys, marker="o", ms=4, lw=lw, label=name, color=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(seq_lens, [_seq_label(s) for s in seq_lens])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.set_xlabel("sequence length (tokens per row)")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.35)
        ax.legend(fontsize=8)
    fig.suptitle(_title(record), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def print_record_table(record: dict[str, Any], stream: TextIO) -> None:
    """The points as a table: diffkv time and TFLOP/s, each baseline's TFLOP/s and diffkv's
    ratio to it (> 1: diffkv faster), the worst check difference."""
    names = [b for b in BASELINES if any(p["baselines"][b]["status"] == "ok" for p in record["points"])]
    headers = ["seq_len", "rows", "head", "block", "kernel", "diffkv us", "diffkv TFLOP/s"]
    headers += [f"{b} TFLOP/s" for b in names] + [f"vs {b}" for b in names] + ["max diff"]
    rows = []
    for p in record["points"]:
        tf = p["diffkv"]["tflops"]
        cells = [str(p["seq_len"]), str(p["rows"]), str(p["head_size"]), str(p["block_size"])]
        cells += [p["diffkv"].get("kernel", "n/a"), fmt(p["diffkv"]["us"])]
        cells.append("ERROR" if tf is None else fmt(tf, 1 if tf >= 10 else 3))
        cells += [fmt(p["baselines"][b].get("tflops")) for b in names]
        cells += [fmt(p["baselines"][b].get("ratio"), 2) for b in names]
        diff = max(p["checks"].values()) if p["checks"] else None
        if "error" in p["diffkv"]:
            cells.append("n/a")
        else:
            cells.append("none" if diff is None else f"{diff:.1e}" + ("" if p["check_ok"] else " MISMATCH"))
        rows.append(cells)
    print_table(headers, rows, left=0, stream=stream)


# --- the command --------------------------------------------------------------------------------


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs the command of args (from add_arguments on parser): the sweep, or with --plot the
    plot of a record written earlier.  A bad option goes to parser.error (exits 2).  Returns 0,
    or 1 when diffkv raised at a point or its output differed from a baseline or the reference
    by more than the tolerance, or when --plot finds no matplotlib."""
    if args.plot is not None:
        return _plot_record(args, parser)
    return _sweep(args, parser.error)


def _read_record(path: str) -> dict[str, Any]:
    """The record of a `python -m diffkv bench` run at path; ValueError saying what is wrong."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--plot: cannot read {path}: {exc}") from None
    if not isinstance(record, dict) or record.get("benchmark") != "diffkv bench":
        raise ValueError(f"--plot: {path} is not the record of a `python -m diffkv bench` run")
    if record.get("schema") not in (1, SCHEMA):
        raise ValueError(
            f"--plot: {path} has schema {record.get('schema')!r}; this diffkv reads schemas 1 and {SCHEMA}"
        )
    if record["schema"] == 1:  # one head size, in config["head_size"]
        head_size = record["config"].pop("head_size")
        record["config"]["head_sizes"] = [head_size]
        for p in record["points"]:
            p["head_size"] = head_size
    return record


def _plot_record(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    given = [
        "--" + dest.replace("_", "-")
        for dest in SWEEP_OPTIONS
        if getattr(args, dest) != parser.get_default(dest)
    ]
    if given:
        parser.error(
            "--plot draws a record written earlier and runs nothing: it takes only --out, "
            f"got {', '.join(given)}"
        )
    try:
        record = _read_record(args.plot)
    except ValueError as exc:
        parser.error(str(exc))
    plt = _pyplot()
    if plt is None:
        print(
            f"--plot needs matplotlib, which is not installed: {PLOT_HINT.format(json=args.plot)}",
            file=sys.stderr,
        )
        return 1
    png_path = args.out if args.out is not None else os.path.splitext(args.plot)[0] + ".png"
    plot(record, png_path, plt)
    print(f"wrote {png_path}")
    return 0


def _sweep(args: argparse.Namespace, parser_error: Callable[[str], Any]) -> int:
    cfg = _resolve(args, parser_error)
    device = cfg["device"]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.makedirs(cfg["out"], exist_ok=True)
    json_path = os.path.join(cfg["out"], "bench.json")
    png_path = os.path.join(cfg["out"], "bench.png")
    env = environment(device)
    config = {k: v for k, v in cfg.items() if k not in ("device", "out")}
    config.update(device=str(device), l2_flush_bytes=L2_FLUSH_BYTES if device.type == "cuda" else 0)
    record: dict[str, Any] = {
        "benchmark": "diffkv bench",
        "schema": SCHEMA,
        "what": (
            "diffkv._C.paged_attention on a permuted paged cache vs torch SDPA flash, SDPA cuDNN and "
            "compiled FlexAttention on the same data laid out densely; TFLOP/s = 4*H*D*visible pairs / "
            "median time; ratio = diffkv TFLOP/s / baseline TFLOP/s"
        ),
        "config": config,
        "env": env,
        "points": [],
        "notes": [],
        "files": {"json": os.path.abspath(json_path), "png": None},
    }
    heads = f"{cfg['heads']}/{cfg['kv_heads']}"
    sizes = ",".join(str(d) for d in cfg["head_sizes"])
    print(
        f"diffkv {diffkv.__version__} bench on {env.get('gpu', device)}: heads {heads} x {sizes} "
        f"{cfg['dtype']}, mask {cfg['mask']}, seq {','.join(_seq_label(s) for s in cfg['seq_lens'])}, "
        f"rows {cfg['rows']}, blocks {cfg['block_sizes']}; median of {cfg['reps']} after "
        f"{cfg['warmup']} warm-up" + (", L2 flushed before each" if device.type == "cuda" else ""),
        flush=True,
    )
    active = cfg["baselines"] if device.type == "cuda" else []
    groups = [(s, r, d) for d in cfg["head_sizes"] for r in cfg["rows"] for s in cfg["seq_lens"]]
    steps_per_group = len(active) + len(cfg["block_sizes"])
    flops = [4 * cfg["heads"] * d * r * _pairs(s, cfg["mask"], cfg["prompt_len"]) for s, r, d in groups]
    progress = Progress(len(groups) * steps_per_group, steps_per_group * sum(flops), sys.stderr)
    notes: dict[str, str] = {}
    for seq_len, rows, head_size in groups:
        record["points"] += _group(cfg, seq_len, rows, head_size, progress, notes)
        record["notes"] = [f"{n} (first at {w})" for n, w in notes.items()]
        write_json(json_path, record)
    progress.close()
    if device.type != "cuda":
        record["notes"].append(f"baselines run on CUDA only (this run: {device})")
    elif cfg["quick"]:
        record["notes"].append("--quick runs diffkv only")
    plt = None if args.no_plot else _pyplot()
    if plt is not None:
        record["files"]["png"] = os.path.abspath(png_path)
        plot(record, png_path, plt)
    write_json(json_path, record)

    print()
    print_record_table(record, sys.stdout)
    print()
    print("TFLOP/s = 4*H*D*visible (query, key) pairs / median time; vs b = diffkv TFLOP/s / b TFLOP/s")
    for note in record["notes"]:
        print(f"note: {note}")
    print(f"wrote {json_path}" + ("" if plt is None else f" and {png_path}"))
    if plt is None and not args.no_plot:
        print(f"no plot: matplotlib is not installed; to draw it: {PLOT_HINT.format(json=json_path)}")
    bad = [p for p in record["points"] if not p["check_ok"]]
    if bad:
        print(
            f"FAILED at {len(bad)} point(s): diffkv raised (see the notes) or differs from a baseline or "
            "the reference by more than the tolerance",
            file=sys.stderr,
        )
        return 1
    return 0
