"""fp8 (float8_e4m3fn) paged attention: diffkv against cuDNN's fp8 SDPA, its own bf16 path and cuDNN bf16.

Per case (head size 128, bf16 activations, a paged cache of 16-token blocks drawn from a random
permutation as in bench_attention.py) and per data kind (``gaussian``: randn; ``outlier``: randn
with the same 4 of the 128 channels multiplied by 20 in q, k and v, as DiT activations have),
the same bf16 q/k/v run through:

* diffkv fp8: ``_C.paged_attention(..., k_scale, v_scale)`` over a float8_e4m3fn cache
  ``[2, num_blocks, 16, Hkv, 128]`` filled by ``_C.kv_write(key, value, cache, slots, k_scale,
  v_scale)``; per-tensor scales k_scale = amax|k| / 448, v_scale = amax|v| / 448 (float32, one
  element); the query goes in as bf16;
* diffkv bf16: ``_C.paged_attention`` over a bf16 cache of the same K/V (the own baseline);
* cuDNN fp8: the ``sdpa_fp8`` node of the cudnn-frontend graph API (``cudnn.pygraph``) on dense
  BSHD e4m3 tensors -- q, k, v each quantized with its per-tensor scale, ``(x.float() /
  scale).clamp(-448, 448).to(float8_e4m3fn)``, which are exactly the bytes diffkv's cache holds
  (checked), q quantized outside the timing; descale_q/k/v = the scales, scale_s = 448 and
  descale_s = 1/448 (cuDNN's bound for e4m3 P without dropout), GQA native when the graph
  builds (else K/V expanded to the query heads, said so); the output bf16 where cuDNN allows
  it, else e4m3 with scale_o = 448 / amax(O) (amax from the bf16 outputs of the same run: ideal
  delayed scaling), dequantized for the accuracy only;
* cuDNN fp8 paged (when the graph builds): the same node reading diffkv's own fp8 cache through
  its block table (``paged_attention_k_table`` / ``_v_table``);
* cuDNN bf16: ``F.scaled_dot_product_attention`` under ``sdpa_kernel(CUDNN_ATTENTION)`` on
  dense ``[B, H, S, D]`` copies (``enable_gqa=True``, else K/V ``repeat_interleave``-d).

A layer comparison times the step's KV write with the attention: diffkv's quantizing
``_C.kv_write`` of the case's new tokens (every query token: the last 4097 positions of each
HunyuanImage row, all tokens of the long cases) then its fp8 attention, and the same as one
``_C.forward_paged`` call, against torch's quantize ``(x.float() / scale).clamp(-448, 448)
.to(float8_e4m3fn)`` + ``index_copy_`` into the dense e4m3 K/V cuDNN reads, the query's
quantization, then cuDNN's fp8 SDPA.  (The standalone ``_C.kv_write`` binding copies the slot
mapping to the host to range-check it: that synchronisation is inside its time;
``forward_paged`` has none.)

Timing as bench_attention.py: warm-up, then rounds in which every call runs once (the order
rotated per round, the L2 flushed before each, CUDA events around the call), medians.  On
CUDA each call is also timed from the profiler's kernel records (``kernel us``: GPU time only,
no host gaps), with the names of the kernels it ran.  TFLOP/s = 4 * H * D * visible (query,
key) pairs / time (causal: the visible pairs only); a ratio A / B is A's TFLOP/s over B's
(> 1: A faster).  Accuracy of every output: max |out - ref| and ||out - ref|| / ||ref|| against
a float64 reference on the original bf16 q/k/v (on the device, per head, 2048 query rows at a
time); beside them the floors that the output's own rounding sets (the reference rounded to
bf16, and to e4m3 with cuDNN's scale_o).

    python benchmarks/bench_fp8.py [--quick | --smoke] [--cases long,long-causal,hunyuan-4597,hunyuan-7597]
                                   [--data gaussian,outlier]
                                   [--baselines diffkv_bf16,cudnn_fp8,cudnn_fp8_paged,cudnn_bf16]
                                   [--no-layer] [--no-accuracy] [--no-profile] [--json out.json]
                                   [--kernel auto|sm80|sm90] [--head 64|128] [--block N]

cuDNN fp8 needs the ``cudnn`` module of ``nvidia-cudnn-frontend`` (``pip install --no-deps
nvidia-cudnn-frontend``: the backend path needs neither cutlass-dsl nor tvm-ffi); without it, or
when its graph does not build, cuDNN fp8 is reported n/a with the reason and the rest runs.
--quick: smaller shapes (2048 tokens; HunyuanImage rows of 1025 queries after the same 500 /
3500-token prefixes); --smoke: tiny ones for running it end to end on a CPU (512 tokens; 129-query
rows after the same prefixes).  --kernel sm80 runs diffkv's fp8 and bf16 calls on the mma.sync kernels
(what an A100 runs; on Hopper, the sm80 fp8 form against the sm80 bf16 kernel on the same
shapes).  --head 64 runs every case at head 64 (default 128); --block N pages the caches in
blocks of N keys (default 16).  --device cpu runs diffkv only (the CPU reference), for a smoke
test.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from diffkv import _C
from diffkv._bench import (
    bench_device,
    device_times_us,
    environment,
    fmt,
    median,
    time_interleaved,
    write_json,
)
from diffkv._bench_cli import _sdpa_setup

F8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
HEAD = 128
BLOCK = 16
DATA_KINDS = ("gaussian", "outlier")
OUTLIER_CHANNELS = 4
OUTLIER_FACTOR = 20.0
REF_CHUNK = 2048  # query rows per float64 reference block: 2048 x 16384 doubles = 256 MiB
BASELINES = ("diffkv_bf16", "cudnn_fp8", "cudnn_fp8_paged", "cudnn_bf16")
ATTENTION = ("diffkv_fp8", *BASELINES)
LAYERS = ("layer_diffkv", "layer_diffkv_fused", "layer_torch_cudnn")
LABELS = {
    "diffkv_fp8": "diffkv fp8",
    "diffkv_bf16": "diffkv bf16",
    "cudnn_fp8": "cuDNN fp8",
    "cudnn_fp8_paged": "cuDNN fp8 paged",
    "cudnn_bf16": "cuDNN bf16",
    "layer_diffkv": "diffkv kv_write + fp8 attention",
    "layer_diffkv_fused": "diffkv forward_paged (fp8)",
    "layer_torch_cudnn": "torch quantize + index_copy_ + cuDNN fp8",
}
RATIOS = (("vs_cudnn_fp8", "cudnn_fp8"), ("vs_diffkv_bf16", "diffkv_bf16"), ("vs_cudnn_bf16", "cudnn_bf16"))
_CPU_ONLY = "cuDNN baselines run on CUDA only"


@dataclass(frozen=True)
class Case:
    """rows rows of query_len queries, the last query_len positions of seq_len keys each."""

    name: str
    rows: int
    heads: int
    kv_heads: int
    query_len: int
    seq_len: int
    causal: bool
    what: str

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs over all rows (causal: bottom-right aligned)."""
        q, s = self.query_len, self.seq_len
        per_row = q * (s - q) + q * (q + 1) // 2 if self.causal else q * s
        return self.rows * per_row

    @property
    def shape(self) -> str:
        heads = f"{self.heads}" if self.heads == self.kv_heads else f"{self.heads}/{self.kv_heads}"
        tokens = f"{self.seq_len}" if self.query_len == self.seq_len else f"{self.query_len}:{self.seq_len}"
        return f"{self.rows}x{heads}x{tokens}x{HEAD}"


# Tokens of the long rows and image queries of the HunyuanImage rows per size: the shapes,
# --quick's and --smoke's.
SIZES = {"full": (16384, 4097), "quick": (2048, 1025), "smoke": (512, 129)}


def _cases(size: str) -> list[Case]:
    """The four cases at one of SIZES."""
    long_len, image = SIZES[size]
    long_what = "one row, every query over every key (a video DiT layer)"
    hunyuan = "HunyuanImage-3.0 denoise: 2 CFG rows, {} image queries after a {}-token prefix"
    return [
        Case("long", 1, 24, 24, long_len, long_len, False, long_what),
        Case("long-causal", 1, 24, 24, long_len, long_len, True, long_what + ", causal"),
        Case("hunyuan-4597", 2, 32, 8, image, image + 500, False, hunyuan.format(image, 500)),
        Case("hunyuan-7597", 2, 32, 8, image, image + 3500, False, hunyuan.format(image, 3500)),
    ]


# --- inputs -------------------------------------------------------------------------------------


@dataclass
class Inputs:
    """One case's bf16 tensors (query/out [N, H, D], rows concatenated; key/value [rows * seq_len,
    Hkv, D], each row's positions 0..seq_len-1), its per-tensor scales and the paged metadata."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    channels: list[int]
    table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    slots: torch.Tensor
    num_blocks: int
    new_index: torch.Tensor  # the new tokens' indices into key/value (rows * query_len)


def _amax_scale(x: torch.Tensor) -> torch.Tensor:
    """amax|x| / 448 as a one-element float32 tensor on x's device."""
    return (x.abs().amax().float() / E4M3_MAX).reshape(1)


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's e4m3 bytes of x with a per-tensor scale: the formula diffkv's write matches bit for bit."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(F8)


def _make_inputs(case: Case, kind: str, device: torch.device, seed: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    n_q, n_kv = case.rows * case.query_len, case.rows * case.seq_len

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    query, key, value = (
        randn(n_q, case.heads, HEAD),
        randn(n_kv, case.kv_heads, HEAD),
        randn(n_kv, case.kv_heads, HEAD),
    )
    channels: list[int] = []
    if kind == "outlier":
        pick = torch.randperm(HEAD, generator=torch.Generator().manual_seed(seed + 1))[:OUTLIER_CHANNELS]
        channels = sorted(int(c) for c in pick)
        for x in (query, key, value):
            x[..., channels] *= OUTLIER_FACTOR
    elif kind != "gaussian":
        raise ValueError(f"unknown data kind {kind!r}")

    per_row = -(-case.seq_len // BLOCK)
    num_blocks = case.rows * per_row + max(3, case.rows * per_row // 32)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = order[: case.rows * per_row].view(case.rows, per_row).to(torch.int32).contiguous()
    pos = torch.arange(case.seq_len)
    slots = torch.cat([table[r].long()[pos // BLOCK] * BLOCK + pos % BLOCK for r in range(case.rows)])
    qsl = torch.arange(0, (case.rows + 1) * case.query_len, case.query_len, dtype=torch.int32)
    seq_lens = torch.full((case.rows,), case.seq_len, dtype=torch.int32)
    first_new = case.seq_len - case.query_len
    new_index = torch.cat(
        [torch.arange(r * case.seq_len + first_new, (r + 1) * case.seq_len) for r in range(case.rows)]
    )
    return Inputs(
        query,
        key,
        value,
        _amax_scale(query),
        _amax_scale(key),
        _amax_scale(value),
        channels,
        table.to(device),
        qsl.to(device),
        seq_lens.to(device),
        (table, qsl, seq_lens),
        slots.to(device),
        num_blocks,
        new_index.to(device),
    )


def _cache(inp: Inputs, dtype: torch.dtype) -> torch.Tensor:
    """The paged cache [2, num_blocks, 16, Hkv, D] holding every row's K/V, written by diffkv's
    kv_write (quantizing with the case's scales for float8_e4m3fn)."""
    kv_heads = inp.key.shape[1]
    cache = torch.zeros(2, inp.num_blocks, BLOCK, kv_heads, HEAD, dtype=dtype, device=inp.key.device)
    scales = (inp.k_scale, inp.v_scale) if dtype == F8 else ()
    _C.kv_write(inp.key, inp.value, cache, inp.slots, *scales)
    return cache


def _attention_call(
    case: Case, inp: Inputs, cache: torch.Tensor, out: torch.Tensor, fp8: bool
) -> Callable[[], None]:
    """``_C.paged_attention`` over the cache: 12 arguments as bench_attention passes them, plus
    k_scale / v_scale for the fp8 cache (14)."""
    mask = _C.MASK_CAUSAL if case.causal else _C.MASK_NONE
    scales = (inp.k_scale, inp.v_scale) if fp8 else ()
    args = (
        inp.query,
        cache,
        inp.table,
        inp.query_start_loc,
        inp.seq_lens,
        None,
        mask,
        HEAD**-0.5,
        out,
        *inp.host,
        *scales,
    )

    def run() -> None:
        _C.paged_attention(*args)

    return run


def warm_attention_calls(device: torch.device) -> Iterator[tuple[Case, Callable[[], None]]]:
    """Each case's fp8 attention call on Gaussian data, called three times first: what the
    stamping scripts time (fp8_phases.py, fp8_timeline.py)."""
    for case in _cases("full"):
        inp = _make_inputs(case, "gaussian", device, 0)
        out = torch.empty_like(inp.query)
        call = _attention_call(case, inp, _cache(inp, F8), out, True)
        for _ in range(3):
            call()
        yield case, call


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# --- cuDNN fp8 (cudnn-frontend graph API) -------------------------------------------------------

_cudnn_state: dict[str, Any] = {}


def _cudnn() -> tuple[Any, str | None]:
    """(the cudnn module, None), or (None, why not).  Imported on first use only, so that this
    script imports and --help works without it."""
    if "module" not in _cudnn_state:
        try:
            import cudnn  # nvidia-cudnn-frontend

            if not hasattr(cudnn, "pygraph"):
                raise ImportError(f"cudnn {getattr(cudnn, '__version__', '?')} has no pygraph")
            _cudnn_state.update(module=cudnn, reason=None)
        except Exception as exc:  # ImportError, or a broken install: reported, never fatal
            _cudnn_state.update(module=None, reason=f"import cudnn failed: {_reason(exc)}")
    return _cudnn_state["module"], _cudnn_state["reason"]


def _cudnn_handle(cudnn: Any) -> Any:
    """One cuDNN handle for the run, on torch's current stream."""
    if "handle" not in _cudnn_state:
        _cudnn_state["handle"] = cudnn.create_handle()
    handle = _cudnn_state["handle"]
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    return handle


@dataclass
class CudnnGraph:
    """A built sdpa_fp8 graph: its IR tensors by role, the variant that built, and the attempts
    that did not."""

    graph: Any
    tensors: dict[str, Any]
    variant: dict[str, Any]
    workspace: torch.Tensor
    failed: list[str] = field(default_factory=list)


def _build_sdpa_fp8(
    cudnn: Any,
    handle: Any,
    case: Case,
    kv_heads: int,
    out_fp8: bool,
    amax_s_output: bool,
    causal_spelling: str,
    paged: tuple[int, int] | None,
) -> tuple[Any, dict[str, Any]]:
    """An sdpa_fp8 graph over BSHD tensors (q [B, Sq, H, D] in memory, declared (B, H, Sq, D)),
    dense K/V [B, Skv, Hkv, D] or (paged = (num_blocks, table columns)) K/V pools of diffkv's
    cache layout [num_blocks, 16, Hkv, D] read through per-row block tables, then validated,
    planned and built.  Raises whatever cudnn raises when the graph cannot be served."""
    dt = cudnn.data_type
    b, h, sq, skv, d = case.rows, case.heads, case.query_len, case.seq_len, HEAD
    graph = cudnn.pygraph(
        io_data_type=dt.FP8_E4M3,
        intermediate_data_type=dt.FLOAT,
        compute_data_type=dt.FLOAT,
        handle=handle,
    )
    t: dict[str, Any] = {}
    t["q"] = graph.tensor(
        name="q", dim=[b, h, sq, d], stride=[sq * h * d, d, h * d, 1], data_type=dt.FP8_E4M3
    )
    kwargs: dict[str, Any] = {"generate_stats": False, "attn_scale": d**-0.5}
    # K/V [outer, Hkv, rows, D] in BSHD memory: dense [b, Hkv, skv, D], or the paged cache's
    # [num_blocks, Hkv, BLOCK, D]
    outer, rows = (b, skv) if paged is None else (paged[0], BLOCK)
    for n in ("k", "v"):
        t[n] = graph.tensor(
            name=n,
            dim=[outer, kv_heads, rows, d],
            stride=[rows * kv_heads * d, d, kv_heads * d, 1],
            data_type=dt.FP8_E4M3,
        )
    if paged is not None:
        cols = paged[1]
        for n in ("k_table", "v_table"):
            t[n] = graph.tensor(name=n, dim=[b, 1, cols, 1], stride=[cols, cols, 1, 1], data_type=dt.INT32)
        for n in ("seq_len_q", "seq_len_kv"):
            t[n] = graph.tensor(name=n, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
        kwargs.update(
            use_padding_mask=True,
            seq_len_q=t["seq_len_q"],
            seq_len_kv=t["seq_len_kv"],
            paged_attention_k_table=t["k_table"],
            paged_attention_v_table=t["v_table"],
            paged_attention_max_seq_len_kv=skv,
        )
    for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
        t[n] = graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT)
    if case.causal:  # square: top-left and bottom-right alignment coincide
        if causal_spelling == "right_bound":
            kwargs.update(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, right_bound=0)
        else:
            kwargs["use_causal_mask"] = True
    o, _stats, amax_s, amax_o = graph.sdpa_fp8(
        t["q"],
        t["k"],
        t["v"],
        t["descale_q"],
        t["descale_k"],
        t["descale_v"],
        t["descale_s"],
        t["scale_s"],
        t["scale_o"],
        name="sdpa_fp8",
        **kwargs,
    )
    o.set_output(True).set_dim([b, h, sq, d]).set_stride([sq * h * d, d, h * d, 1])
    o.set_data_type(dt.FP8_E4M3 if out_fp8 else dt.BFLOAT16)
    amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT)
    t["o"], t["amax_o"] = o, amax_o
    if amax_s_output:
        amax_s.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT)
        t["amax_s"] = amax_s
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, t


def _cudnn_fp8_graph(case: Case, device: torch.device, paged: tuple[int, int] | None) -> CudnnGraph | str:
    """The first sdpa_fp8 variant that builds, or why none did.  Tried in order: output bf16
    then e4m3 (cuDNN documents bf16/fp16 output for Blackwell only), Amax_S left virtual (its
    deprecated output declared only if that fails), causal as TOP_LEFT + right_bound=0 then the
    deprecated use_causal_mask; all with native GQA first, then (dense only) with K/V expanded
    to the query heads."""
    cudnn, why = _cudnn()
    if cudnn is None:
        return str(why)
    handle = _cudnn_handle(cudnn)
    failed: list[str] = []
    gqa_modes = ["native"] if case.heads == case.kv_heads else ["native", "expanded"]
    if paged is not None:
        gqa_modes = gqa_modes[:1]
    spellings = ("right_bound", "use_causal_mask") if case.causal else ("none",)
    for gqa in gqa_modes:
        kv_heads = case.kv_heads if gqa == "native" else case.heads
        for out_fp8 in (False, True):
            for amax_s_output in (False, True):
                for spelling in spellings:
                    variant = {
                        "output": "float8_e4m3fn" if out_fp8 else "bfloat16",
                        "amax_s_output": amax_s_output,
                        "causal_spelling": spelling,
                        "gqa": "mha" if case.heads == case.kv_heads else gqa,
                    }
                    try:
                        graph, tensors = _build_sdpa_fp8(
                            cudnn, handle, case, kv_heads, out_fp8, amax_s_output, spelling, paged
                        )
                        size = graph.get_workspace_size()
                    except Exception as exc:  # cudnnGraphNotSupportedError and friends
                        failed.append(f"{variant}: {_reason(exc)}")
                        continue
                    workspace = torch.empty(max(int(size), 1), dtype=torch.uint8, device=device)
                    return CudnnGraph(graph, tensors, variant, workspace, failed)
    return "no sdpa_fp8 variant built: " + " | ".join(failed)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """A [B, S, H, D] tensor as its (B, H, S, D) view: the dims and strides the graph declares."""
    return x.permute(0, 2, 1, 3)


def _cudnn_fp8_call(
    built: CudnnGraph,
    q8: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: dict[str, torch.Tensor],
    out: torch.Tensor,
    extra: dict[str, torch.Tensor],
) -> Callable[[], None]:
    """One execute of a built graph.  q8 / out: (B, H, Sq, D) views of BSHD memory; k / v: the
    same of dense [B, Skv, Hkv', D] tensors, or the paged pools (num_blocks, Hkv, 16, D) (views
    of diffkv's cache)."""
    cudnn, _ = _cudnn()
    t = built.tensors
    pack: dict[Any, torch.Tensor] = {t["q"]: q8, t["k"]: k, t["v"]: v, t["o"]: out}
    for name, value in scales.items():
        pack[t[name]] = value.reshape(1, 1, 1, 1)
    for name, value in extra.items():
        if name in t:
            pack[t[name]] = value
    handle = _cudnn_handle(cudnn)
    graph, workspace = built.graph, built.workspace

    def run() -> None:
        graph.execute(pack, workspace, handle=handle)

    return run


# --- cuDNN bf16 through torch SDPA --------------------------------------------------------------


def _sdpa_cudnn(case: Case, inp: Inputs) -> dict[str, Any]:
    """cuDNN bf16 via torch SDPA on dense [B, H, S, D] copies, as ``python -m diffkv bench`` runs
    it (``_bench_cli._sdpa_setup``: enable_gqa first, else K/V expanded beforehand).
    {'run', 'out', 'gqa'} or {'reason'}."""
    b, sq, skv = case.rows, case.query_len, case.seq_len
    q = inp.query.view(b, sq, case.heads, HEAD).transpose(1, 2).contiguous()
    k = inp.key.view(b, skv, case.kv_heads, HEAD).transpose(1, 2).contiguous()
    v = inp.value.view(b, skv, case.kv_heads, HEAD).transpose(1, 2).contiguous()
    return _sdpa_setup("cudnn", q, k, v, case.causal, HEAD**-0.5)


# --- accuracy -----------------------------------------------------------------------------------


def _accuracy(
    case: Case, inp: Inputs, outs: dict[str, torch.Tensor], o_descale: float | None
) -> dict[str, dict[str, float]]:
    """max |out - ref| and ||out - ref|| / ||ref|| of every output [N, H, D] (any float dtype)
    against float64 attention over the bf16 q/k/v, per (row, head) in blocks of REF_CHUNK
    query rows; also for the reference itself rounded to bf16 ('bf16_output_floor') and, with
    o_descale, to e4m3 with scale 1 / o_descale ('e4m3_output_floor')."""
    device = inp.query.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    names = [*outs, "bf16_output_floor"] + (["e4m3_output_floor"] if o_descale else [])
    worst = dict.fromkeys(names, zero)
    err_sq = dict.fromkeys(names, zero)
    ref_sq = zero
    scale = HEAD**-0.5
    sq, skv = case.query_len, case.seq_len
    keys = torch.arange(skv, device=device)
    for r in range(case.rows):
        for kvh in range(case.kv_heads):
            k = inp.key[r * skv : (r + 1) * skv, kvh].double()
            v = inp.value[r * skv : (r + 1) * skv, kvh].double()
            for h in range(kvh * case.group, (kvh + 1) * case.group):
                for c0 in range(0, sq, REF_CHUNK):
                    c1 = min(c0 + REF_CHUNK, sq)
                    rows = slice(r * sq + c0, r * sq + c1)
                    scores = (inp.query[rows, h].double() @ k.T) * scale
                    if case.causal:
                        pos = torch.arange(skv - sq + c0, skv - sq + c1, device=device)
                        scores.masked_fill_(keys[None, :] > pos[:, None], float("-inf"))
                    ref = torch.softmax(scores, dim=-1) @ v
                    del scores
                    ref_sq = ref_sq + ref.square().sum()
                    mine = {name: out[rows, h].double() for name, out in outs.items()}
                    mine["bf16_output_floor"] = ref.to(torch.bfloat16).double()
                    if o_descale:
                        rounded = (ref / o_descale).clamp(-E4M3_MAX, E4M3_MAX).to(F8).double()
                        mine["e4m3_output_floor"] = rounded * o_descale
                    for name, value in mine.items():
                        diff = value - ref
                        worst[name] = torch.maximum(worst[name], diff.abs().max())
                        err_sq[name] = err_sq[name] + diff.square().sum()
    ref_norm = float(ref_sq.sqrt())
    return {
        name: {
            "max_abs": float(worst[name]),
            "rel_l2": float(err_sq[name].sqrt()) / ref_norm if ref_norm > 0 else float("nan"),
        }
        for name in names
    }


# --- one case -----------------------------------------------------------------------------------


def _tflops(case: Case, us: float | None) -> float | None:
    return None if not us else 4.0 * case.heads * HEAD * case.pairs / (us * 1e-6) / 1e12


def run_case(
    case: Case, kind: str, args, device: torch.device, graphs: dict[str, CudnnGraph | str]
) -> dict[str, Any]:
    """One (case, data kind): every contestant set up and run once (a failure is recorded as
    n/a with its reason), then all timed interleaved, then the accuracy."""
    cuda = device.type == "cuda"
    seed = 1234 + 7 * DATA_KINDS.index(kind) + 1000 * args.seed
    inp = _make_inputs(case, kind, device, seed)
    n_q = case.rows * case.query_len
    b, sq, skv = case.rows, case.query_len, case.seq_len
    result: dict[str, Any] = {
        "case": case.name,
        "data": kind,
        "what": case.what,
        "shape": case.shape,
        "rows": case.rows,
        "heads": case.heads,
        "kv_heads": case.kv_heads,
        "head_size": HEAD,
        "query_len": sq,
        "seq_len": skv,
        "mask": "causal" if case.causal else "none",
        "block_size": BLOCK,
        "num_blocks": inp.num_blocks,
        "layout": f"paged (block {BLOCK}, random permutation of {inp.num_blocks} blocks)",
        "pairs": case.pairs,
        "flops": 4 * case.heads * HEAD * case.pairs,
        "outlier_channels": inp.channels,
        "outlier_factor": OUTLIER_FACTOR if inp.channels else None,
        "scales": {
            "q": float(inp.q_scale),
            "k": float(inp.k_scale),
            "v": float(inp.v_scale),
            "rule": "amax / 448, per tensor",
        },
        "attention": {},
        "layer": {},
        "checks": {},
    }
    att: dict[str, dict[str, Any]] = result["attention"]
    timers: dict[str, Callable[[], Any]] = {}
    outs: dict[str, torch.Tensor] = {}  # [N, H, D] views for the accuracy

    def try_setup(name: str, setup: Callable[[], Callable[[], Any]], table: dict[str, Any]) -> bool:
        try:
            run = setup()
            run()
            if cuda:
                torch.cuda.synchronize()
        except Exception as exc:  # recorded as n/a: the other contestants still run
            table[name] = {"status": "n/a", "reason": _reason(exc)}
            return False
        timers[name] = run
        table[name] = {"status": "ok"}
        return True

    # diffkv fp8 and bf16 over their paged caches
    cache8 = _cache(inp, F8)
    out8 = torch.empty_like(inp.query)
    if try_setup("diffkv_fp8", lambda: _attention_call(case, inp, cache8, out8, True), att):
        att["diffkv_fp8"]["kernel"] = _C.last_attention_kernel()
        outs["diffkv_fp8"] = out8
    if "diffkv_bf16" in args.baselines:
        cache16 = _cache(inp, torch.bfloat16)
        out16 = torch.empty_like(inp.query)
        if try_setup("diffkv_bf16", lambda: _attention_call(case, inp, cache16, out16, False), att):
            att["diffkv_bf16"]["kernel"] = _C.last_attention_kernel()
            outs["diffkv_bf16"] = out16
    else:
        att["diffkv_bf16"] = {"status": "skipped", "reason": "not requested"}

    # cuDNN bf16 (torch SDPA) first: its output's amax calibrates cuDNN fp8's scale_o
    sdpa: dict[str, Any] = {}
    if "cudnn_bf16" not in args.baselines:
        att["cudnn_bf16"] = {"status": "skipped", "reason": "not requested"}
    elif not cuda:
        att["cudnn_bf16"] = {"status": "n/a", "reason": _CPU_ONLY}
    else:
        try:
            sdpa = _sdpa_cudnn(case, inp)
        except Exception as exc:  # a baseline that cannot run is reported, not fatal
            sdpa = {"reason": _reason(exc)}
        if "run" in sdpa:
            timers["cudnn_bf16"] = sdpa["run"]
            att["cudnn_bf16"] = {"status": "ok", "gqa": sdpa["gqa"]}
        else:
            att["cudnn_bf16"] = {"status": "n/a", "reason": sdpa["reason"]}

    # the e4m3 K/V bytes are torch's quantization of the same bf16 K/V, equal to diffkv's cache
    k8 = _quantize(inp.key, inp.k_scale)
    v8 = _quantize(inp.value, inp.v_scale)
    q8 = _quantize(inp.query, inp.q_scale)
    flat8 = cache8.view(torch.uint8).view(2, -1, case.kv_heads, HEAD)
    result["checks"]["kv_write_bytes_equal_torch"] = bool(
        torch.equal(flat8[0][inp.slots], k8.view(torch.uint8))
        and torch.equal(flat8[1][inp.slots], v8.view(torch.uint8))
    )

    # scale_o for an e4m3 output: amax of a bf16 output of the same inputs (ideal delayed scaling)
    if "cudnn_bf16" in timers:
        o_amax, o_source = float(sdpa["out"].abs().amax()), "cuDNN bf16 output amax"
    elif "diffkv_bf16" in outs:
        o_amax, o_source = float(outs["diffkv_bf16"].abs().amax()), "diffkv bf16 output amax"
    else:
        o_amax, o_source = float(inp.v_scale) * E4M3_MAX, "amax|v| (a bound on |O|)"
    o_amax = o_amax if o_amax > 0 else 1.0

    cudnn_fp8: dict[str, Any] = {}
    for name in ("cudnn_fp8", "cudnn_fp8_paged"):
        if name not in args.baselines:
            att[name] = {"status": "skipped", "reason": "not requested"}
            continue
        if not cuda:
            att[name] = {"status": "n/a", "reason": _CPU_ONLY}
            continue
        built = graphs.get(name)
        if built is None:
            paged = (inp.num_blocks, inp.table.shape[1]) if name == "cudnn_fp8_paged" else None
            built = graphs[name] = _cudnn_fp8_graph(case, device, paged)
        if isinstance(built, str):
            att[name] = {"status": "n/a", "reason": built}
            continue
        fp8_out = built.variant["output"] == "float8_e4m3fn"
        scale_o = E4M3_MAX / o_amax if fp8_out else 1.0
        scales = {
            "descale_q": inp.q_scale,
            "descale_k": inp.k_scale,
            "descale_v": inp.v_scale,
            "descale_s": torch.tensor([1.0 / E4M3_MAX], device=device),
            "scale_s": torch.tensor([E4M3_MAX], device=device),
            "scale_o": torch.tensor([scale_o], device=device),
        }
        out = torch.empty(b, sq, case.heads, HEAD, dtype=F8 if fp8_out else torch.bfloat16, device=device)
        extra = {
            "amax_o": torch.full((1, 1, 1, 1), float("nan"), device=device),
            "amax_s": torch.full((1, 1, 1, 1), float("nan"), device=device),
        }
        if name == "cudnn_fp8":
            kv_heads = case.kv_heads if built.variant["gqa"] != "expanded" else case.heads

            def dense(x8: torch.Tensor, kv_heads: int = kv_heads) -> torch.Tensor:
                x = x8.view(b, skv, case.kv_heads, HEAD)
                if kv_heads != case.kv_heads:  # repeat_interleave of fp8 through its bytes
                    x = x.view(torch.uint8).repeat_interleave(case.group, dim=2).view(F8)
                return x.contiguous()

            k_bshd, v_bshd = dense(k8), dense(v8)
            k_in, v_in = _bhsd(k_bshd), _bhsd(v_bshd)
        else:
            # diffkv's cache, [2, num_blocks, 16, Hkv, D]: each pool as (num_blocks, Hkv, 16, D)
            k_bshd = v_bshd = None
            k_in, v_in = _bhsd(cache8[0]), _bhsd(cache8[1])
            extra.update(
                k_table=inp.table.view(b, 1, -1, 1),
                v_table=inp.table.view(b, 1, -1, 1),
                seq_len_q=torch.full((b, 1, 1, 1), sq, dtype=torch.int32, device=device),
                seq_len_kv=inp.seq_lens.view(b, 1, 1, 1),
            )
        q8_in = _bhsd(q8.view(b, sq, case.heads, HEAD))
        call = _cudnn_fp8_call(built, q8_in, k_in, v_in, scales, _bhsd(out), extra)
        if not try_setup(name, lambda call=call: call, att):
            continue
        att[name].update(built.variant, failed_variants=built.failed)
        att[name]["scale_o"] = scale_o
        att[name]["scale_o_source"] = o_source if fp8_out else "1 (bf16 output)"
        att[name]["amax_o_reported"] = float(extra["amax_o"])
        cudnn_fp8[name] = {
            "out": out,
            "scale_o": scale_o,
            "fp8_out": fp8_out,
            "q_in": q8_in,
            "k_in": k_in,
            "v_in": v_in,
            "k_bshd": k_bshd,
            "v_bshd": v_bshd,
        }

    # layer: the step's new tokens written, then the attention
    layer = result["layer"]
    new_tokens = n_q
    result["new_tokens"] = new_tokens
    if not args.no_layer:
        new_k = inp.key[inp.new_index].contiguous()
        new_v = inp.value[inp.new_index].contiguous()
        new_slots = inp.slots[inp.new_index].contiguous()
        mask = _C.MASK_CAUSAL if case.causal else _C.MASK_NONE
        layer_out = torch.empty_like(inp.query)
        fused_out = torch.empty_like(inp.query)
        attend = _attention_call(case, inp, cache8, layer_out, True)

        def diffkv_layer() -> None:
            _C.kv_write(new_k, new_v, cache8, new_slots, inp.k_scale, inp.v_scale)
            attend()

        def diffkv_fused() -> None:
            _C.forward_paged(
                inp.query, new_k, new_v, cache8, new_slots, inp.table, inp.query_start_loc, inp.seq_lens,
                None, mask, HEAD**-0.5, fused_out, *inp.host, inp.k_scale, inp.v_scale,
            )  # fmt: skip

        try_setup("layer_diffkv", lambda: diffkv_layer, layer)
        try_setup("layer_diffkv_fused", lambda: diffkv_fused, layer)
        if "diffkv_fp8" in outs:
            for name, o in (("layer_diffkv", layer_out), ("layer_diffkv_fused", fused_out)):
                if name in timers:
                    result["checks"][f"{name}_equals_attention"] = bool(torch.equal(o, out8))
        if "cudnn_fp8" not in cudnn_fp8:
            layer["layer_torch_cudnn"] = {"status": "n/a", "reason": "cuDNN fp8 did not run"}
        else:
            c = cudnn_fp8["cudnn_fp8"]
            built = graphs["cudnn_fp8"]
            assert not isinstance(built, str)
            expanded = built.variant["gqa"] == "expanded"
            # cuDNN's own buffers, written in place: [B * Skv, Hkv', D] bytes of K/V, q8 [N, H, D]
            k_bytes = c["k_bshd"].view(torch.uint8).view(b * skv, -1, HEAD)
            v_bytes = c["v_bshd"].view(torch.uint8).view(b * skv, -1, HEAD)
            q_dst = q8
            layer_out_c = torch.empty_like(c["out"])
            run_c = _cudnn_fp8_call(
                built,
                c["q_in"],
                c["k_in"],
                c["v_in"],
                {
                    "descale_q": inp.q_scale,
                    "descale_k": inp.k_scale,
                    "descale_v": inp.v_scale,
                    "descale_s": torch.tensor([1.0 / E4M3_MAX], device=device),
                    "scale_s": torch.tensor([E4M3_MAX], device=device),
                    "scale_o": torch.tensor([c["scale_o"]], device=device),
                },
                _bhsd(layer_out_c),
                {
                    "amax_o": torch.empty(1, 1, 1, 1, device=device),
                    "amax_s": torch.empty(1, 1, 1, 1, device=device),
                },
            )

            def torch_layer() -> None:
                for x, scale, dst in ((new_k, inp.k_scale, k_bytes), (new_v, inp.v_scale, v_bytes)):
                    quantized = _quantize(x, scale).view(torch.uint8)
                    if expanded:
                        quantized = quantized.repeat_interleave(case.group, dim=1)
                    dst.index_copy_(0, inp.new_index, quantized)
                q_dst.copy_(_quantize(inp.query, inp.q_scale))
                run_c()

            if try_setup("layer_torch_cudnn", lambda: torch_layer, layer):
                layer["layer_torch_cudnn"]["includes"] = "K/V quantize + index_copy_, Q quantize, sdpa_fp8"
                result["checks"]["layer_torch_cudnn_equals_attention"] = bool(
                    torch.equal(layer_out_c.view(torch.uint8), c["out"].view(torch.uint8))
                )
        if "layer_diffkv" in layer and layer["layer_diffkv"]["status"] == "ok":
            layer["layer_diffkv"]["includes"] = "kv_write (with its host slot check + sync), paged_attention"
        if "layer_diffkv_fused" in layer and layer["layer_diffkv_fused"]["status"] == "ok":
            layer["layer_diffkv_fused"]["includes"] = "forward_paged: quantizing write + attention, one call"
    else:
        for name in LAYERS:
            layer[name] = {"status": "skipped", "reason": "--no-layer"}

    # timing: every call that ran, interleaved
    if timers:
        timed = time_interleaved(timers, device, warmup=args.warmup, reps=args.reps)
        for name, t in timed.items():
            entry = att.get(name) or layer[name]
            entry.update(us=t["median_us"], min_us=t["min_us"], samples_us=t["samples_us"])
            entry["tflops"] = _tflops(case, t["median_us"])
        if cuda and not args.no_profile:
            for name, fn in timers.items():
                entry = att.get(name) or layer[name]
                try:
                    prof = device_times_us(fn, device, warmup=1, reps=args.reps)
                except Exception as exc:  # the profiler is a cross-check: its failure is reported
                    entry["kernel_us_error"] = _reason(exc)
                    continue
                entry.update(kernel_us=prof["median_us"], kernels=prof["kernels"])
                entry["kernel_tflops"] = _tflops(case, prof["median_us"])
    ratios: dict[str, float | None] = {}
    mine = att["diffkv_fp8"].get("tflops")
    for key, name in RATIOS:
        theirs = att.get(name, {}).get("tflops")
        ratios[key] = mine / theirs if mine and theirs else None
    paged_tf = att.get("cudnn_fp8_paged", {}).get("tflops")
    ratios["vs_cudnn_fp8_paged"] = mine / paged_tf if mine and paged_tf else None
    result["ratios"] = ratios
    lt = {name: layer.get(name, {}).get("us") for name in LAYERS}
    result["layer_ratios"] = {
        "torch_cudnn_over_diffkv": lt["layer_torch_cudnn"] / lt["layer_diffkv"]
        if lt["layer_torch_cudnn"] and lt["layer_diffkv"]
        else None,
        "torch_cudnn_over_diffkv_fused": lt["layer_torch_cudnn"] / lt["layer_diffkv_fused"]
        if lt["layer_torch_cudnn"] and lt["layer_diffkv_fused"]
        else None,
    }

    # outputs (cuDNN bf16's from its first call: the timed calls compute the same values)
    if "cudnn_bf16" in timers:
        outs["cudnn_bf16"] = sdpa["out"].transpose(1, 2).reshape(n_q, case.heads, HEAD)
    for name, c in cudnn_fp8.items():
        flat_out = c["out"].view(n_q, case.heads, HEAD)
        outs[name] = flat_out.float() / c["scale_o"] if c["fp8_out"] else flat_out
    for name, out in outs.items():
        (att.get(name) or {})["finite"] = bool(torch.isfinite(out).all())
    if "diffkv_fp8" in outs and "cudnn_fp8" in outs:
        result["checks"]["diffkv_fp8_vs_cudnn_fp8_max_abs"] = float(
            (outs["diffkv_fp8"].float() - outs["cudnn_fp8"].float()).abs().max()
        )
    if args.no_accuracy:
        result["accuracy"] = {}
    else:
        e4m3 = [c for c in cudnn_fp8.values() if c["fp8_out"]]
        o_descale = 1.0 / e4m3[0]["scale_o"] if e4m3 else None
        result["accuracy"] = _accuracy(case, inp, outs, o_descale)
        result["accuracy_reference"] = "float64 attention over the bf16 q/k/v (before any quantization)"
    return result


# --- output -------------------------------------------------------------------------------------


def _markdown(headers: list[str], rows: list[list[str]], left: int = 2) -> None:
    """A markdown table: the first ``left`` columns left-aligned, the others right-aligned."""
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join(":---" if i < left else "---:" for i in range(len(headers))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _tf(entry: dict[str, Any]) -> str:
    if entry.get("status") != "ok":
        return "n/a"
    return fmt(entry.get("tflops"))


def _err(acc: dict[str, Any], name: str, key: str) -> str:
    value = acc.get(name, {}).get(key)
    return "n/a" if value is None else f"{value:.2e}"


def _print_report(results: list[dict[str, Any]], failed: list[dict[str, Any]], device: torch.device) -> None:
    print()
    print("### Attention (TFLOP/s = useful FLOPs / median time; ratio = diffkv fp8 TFLOP/s / theirs)")
    print()
    _markdown(
        [
            "case",
            "data",
            "shape",
            "diffkv fp8 us",
            "diffkv fp8",
            "diffkv bf16",
            "cuDNN fp8",
            "cuDNN fp8 paged",
            "cuDNN bf16",
            "fp8 / cuDNN fp8",
            "fp8 / own bf16",
            "fp8 / cuDNN bf16",
        ],
        [
            [
                r["case"],
                r["data"],
                r["shape"],
                fmt(r["attention"]["diffkv_fp8"].get("us")),
                *(_tf(r["attention"].get(n, {})) for n in ATTENTION),
                *(fmt(r["ratios"][key], 2) for key, _ in RATIOS),
            ]
            for r in results
        ],
        left=3,
    )
    if any(r["attention"][n].get("kernel_us") for r in results for n in ATTENTION if n in r["attention"]):
        print()
        print("Kernel time from the profiler's records (GPU only, no host gaps), TFLOP/s:")
        print()
        _markdown(
            ["case", "data", *(LABELS[n] for n in ATTENTION)],
            [
                [
                    r["case"],
                    r["data"],
                    *(fmt(r["attention"].get(n, {}).get("kernel_tflops")) for n in ATTENTION),
                ]
                for r in results
            ],
        )
    if any(r["accuracy"] for r in results):
        print()
        print("### Accuracy against float64 attention on the bf16 q/k/v (max |err|, ||err|| / ||ref||)")
        print()
        names = ("diffkv_fp8", "cudnn_fp8", "cudnn_fp8_paged", "diffkv_bf16", "cudnn_bf16")
        floors = ("bf16_output_floor", "e4m3_output_floor")
        _markdown(
            [
                "case",
                "data",
                *(f"{LABELS[n]} {k}" for n in names for k in ("max", "rel")),
                "bf16 floor rel",
                "e4m3 out floor rel",
            ],
            [
                [
                    r["case"],
                    r["data"],
                    *(_err(r["accuracy"], n, k) for n in names for k in ("max_abs", "rel_l2")),
                    *(_err(r["accuracy"], n, "rel_l2") for n in floors),
                ]
                for r in results
                if r["accuracy"]
            ],
        )
    if any(r["layer"].get(n, {}).get("status") == "ok" for r in results for n in LAYERS):
        print()
        print(
            "### Layer: the step's new K/V written + the attention (median us; ratio = torch+cuDNN / diffkv)"
        )
        print()
        _markdown(
            ["case", "data", "new tokens", *(LABELS[n] for n in LAYERS), "ratio", "ratio (fused)"],
            [
                [
                    r["case"],
                    r["data"],
                    str(r["new_tokens"]),
                    *(fmt(r["layer"].get(n, {}).get("us")) for n in LAYERS),
                    fmt(r["layer_ratios"]["torch_cudnn_over_diffkv"], 2),
                    fmt(r["layer_ratios"]["torch_cudnn_over_diffkv_fused"], 2),
                ]
                for r in results
            ],
        )
    print()
    if device.type != "cuda":
        print(f"note: {_CPU_ONLY} (this run: {device})")
    seen: set[str] = set()
    for r in results:
        for name, entry in list(r["attention"].items()) + list(r["layer"].items()):
            if entry.get("status") == "n/a" and entry["reason"] != _CPU_ONLY:
                line = f"{LABELS[name]} n/a: {entry['reason']}"
                if line not in seen:
                    seen.add(line)
                    print(f"note: {r['case']}/{r['data']}: {line}")
        for name in ("cudnn_fp8", "cudnn_fp8_paged"):
            e = r["attention"].get(name, {})
            if e.get("status") == "ok":
                line = (
                    f"{LABELS[name]}: output {e['output']}, GQA {e['gqa']}, scale_o {e['scale_o']:.4g} "
                    f"({e['scale_o_source']}), Amax_S output declared: {e['amax_s_output']}"
                )
                if line not in seen:
                    seen.add(line)
                    print(f"note: {r['case']}/{r['data']}: {line}")
        bad = [k for k, v in r["checks"].items() if v is False]
        if bad:
            print(f"note: {r['case']}/{r['data']}: check failed: {', '.join(bad)}")
    for r in failed:
        print(f"ERROR {r['case']}/{r['data']}: {r['error']}")


def _summary(results: list[dict[str, Any]], failed: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"errors": [f"{r['case']}/{r['data']}" for r in failed]}
    for key in (*(k for k, _ in RATIOS), "vs_cudnn_fp8_paged"):
        values = [r["ratios"][key] for r in results if r["ratios"].get(key)]
        summary[f"min_ratio_{key}"] = min(values) if values else None
        summary[f"median_ratio_{key}"] = median(values) if values else None
    summary["diffkv_fp8_ran"] = any(r["attention"]["diffkv_fp8"]["status"] == "ok" for r in results)
    summary["all_outputs_finite"] = all(
        e.get("finite", True) for r in results for e in r["attention"].values() if e.get("status") == "ok"
    )
    summary["all_checks_true"] = all(v is not False for r in results for v in r["checks"].values())
    summary["kv_bytes_equal_torch"] = all(r["checks"]["kv_write_bytes_equal_torch"] for r in results)
    return summary


def _write(args, env: dict[str, Any], results: list[dict[str, Any]], failed: list[dict[str, Any]]) -> None:
    record = {
        "benchmark": "fp8_attention",
        "quick": args.quick,
        "smoke": args.smoke,
        "seed": args.seed,
        "data_kinds": args.data,
        "timing": {
            "warmup": args.warmup,
            "reps": args.reps,
            "l2_flush_bytes": 256 << 20,
            "method": "CUDA events around each call, interleaved rounds (time_interleaved); kernel_us: "
            "profiler device records (device_times_us)",
        },
        "env": env,
        "results": results + failed,
        "summary": _summary(results, failed),
    }
    write_json(args.json, record)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of keys, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    global HEAD, BLOCK  # --head and --block set the module's sizes, which every case and reference reads
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller shapes (2048 tokens; 1025-query rows)")
    size.add_argument(
        "--smoke", action="store_true", help="tiny shapes, to run it on a CPU (512 tokens; 129-query rows)"
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all; --list)")
    parser.add_argument("--data", default=",".join(DATA_KINDS), help="comma-separated: gaussian,outlier")
    parser.add_argument("--baselines", default=",".join(BASELINES), help=f"subset of {','.join(BASELINES)}")
    parser.add_argument("--no-layer", action="store_true", help="skip the KV write + attention comparison")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the float64 reference")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler's kernel times")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--json", default=None, help="write a JSON record here")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="another draw of the data (0: the documented one), e.g. to spread the accuracy over draws",
    )
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument(
        "--head",
        type=int,
        default=128,
        choices=(32, 64, 72, 80, 96, 128, 160, 192, 256),
        help="head size of every case (on Hopper 64 and 128 run the e4m3 wgmma kernel, the others the "
        "mma.sync kernel's e4m3 form; default %(default)s)",
    )
    parser.add_argument(
        "--block",
        type=_positive,
        default=16,
        help="keys per cache block (default %(default)s: the issue's; 8: the e4m3 kernel's 8-key TMA boxes)",
    )
    parser.add_argument(
        "--kernel",
        default="auto",
        choices=("auto", "sm80", "sm90"),
        help="diffkv's attention kernel choice for its fp8 and bf16 calls (sm80: the mma.sync kernels)",
    )
    args = parser.parse_args(argv)
    HEAD = args.head
    BLOCK = args.block

    size = "quick" if args.quick else "smoke" if args.smoke else "full"
    cases = _cases(size)
    if args.list:
        for c in cases:
            print(f"{c.name:14s} {c.shape:22s} {'causal' if c.causal else 'none':7s} {c.what}")
        return 0
    if args.cases:
        wanted = [n for n in args.cases.split(",") if n]
        missing = sorted(set(wanted) - {c.name for c in cases})
        if missing:
            parser.error(f"--cases: unknown {missing}; --list shows the cases")
        cases = [c for c in cases if c.name in wanted]
    args.data = [d for d in args.data.split(",") if d]
    unknown = sorted(set(args.data) - set(DATA_KINDS))
    if unknown or not args.data:
        parser.error(f"--data: unknown {unknown}; choose from {list(DATA_KINDS)}")
    args.baselines = [b for b in args.baselines.split(",") if b]
    unknown = sorted(set(args.baselines) - set(BASELINES))
    if unknown:
        parser.error(f"--baselines: unknown {unknown}; choose from {list(BASELINES)}")
    device = bench_device(args.device, parser.error)
    args.warmup = args.warmup if args.warmup is not None else (3 if size == "full" else 1)
    args.reps = args.reps if args.reps is not None else (10 if size == "full" else 3)

    env = environment(device, checkout=__file__)
    env["attention_kernel_choice"] = args.kernel
    _C.set_attention_kernel(args.kernel)
    if device.type == "cuda" and any(b.startswith("cudnn_fp8") for b in args.baselines):
        cudnn, why = _cudnn()
        env["cudnn_frontend"] = getattr(cudnn, "__version__", None) if cudnn else None
        env["cudnn_frontend_error"] = why
        if cudnn is not None:
            try:
                env["cudnn_frontend_backend"] = cudnn.backend_version_string()
            except Exception as exc:  # reported in the record only
                env["cudnn_frontend_backend"] = _reason(exc)
    print(
        f"diffkv fp8 paged attention vs cuDNN on {env.get('gpu', device)} (torch {env['torch']}, "
        f"cuDNN {env.get('cudnn')}, cudnn-frontend {env.get('cudnn_frontend')}, diffkv {env['diffkv']}); "
        f"head {HEAD}, block {BLOCK}, bf16 activations, diffkv kernel choice {args.kernel}; "
        f"median of {args.reps} after {args.warmup} warm-up"
        + (", L2 flushed before each" if device.type == "cuda" else "")
    )
    if env.get("cudnn_frontend_error"):
        print(f"note: cuDNN fp8 skipped: {env['cudnn_frontend_error']}")

    results: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for case in cases:
        graphs: dict[str, CudnnGraph | str] = {}  # built once per case, shared by the data kinds
        for kind in args.data:
            try:
                res = run_case(case, kind, args, device, graphs)
            except Exception as exc:  # recorded and reported; the other cases still run
                res = {"case": case.name, "data": kind, "shape": case.shape, "error": _reason(exc)}
                failed.append(res)
                print(f"  {case.name}/{kind}: ERROR {res['error']}", file=sys.stderr, flush=True)
            else:
                results.append(res)
                mine = res["attention"]["diffkv_fp8"]
                line = (
                    f"{mine['us']:.1f} us, {mine['tflops']:.1f} TFLOP/s"
                    if mine.get("us")
                    else f"diffkv fp8 n/a ({mine.get('reason', '')[:80]})"
                )
                print(f"  {case.name}/{kind}: {line}", file=sys.stderr, flush=True)
            if args.json:  # after every case, so a run cut short keeps what it measured
                _write(args, env, results, failed)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        graphs.clear()

    _print_report(results, failed, device)
    if args.json:
        _write(args, env, results, failed)
    summary = _summary(results, failed)
    # the equalities of a layer's output and the attention's are reported, not fatal (they also
    # test the kernels' determinism); the cache bytes must be torch's
    ok = not failed and summary["all_outputs_finite"] and summary["kv_bytes_equal_torch"]
    if not ok:
        print(
            "FAILED: a case raised, an output is not finite, or diffkv's fp8 cache bytes differ from torch's",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
