"""Type stub and contract of diffkv._C, the C extension (csrc/py/; module.c there lists the files).

Every function validates its arguments before it writes anything.  Tensors are torch tensors
read through DLPack (borrowed for the call).  Errors: TypeError for wrong types/dtypes/devices,
ValueError for wrong shapes/values (and vLLM-Omni's adapter's ValueErrors, letter for letter),
RuntimeError for state errors and CPU-only builds, CudaError for CUDA failures.

A "CPU or CUDA" function runs the C reference on CPU tensors and the CUDA launcher on CUDA
tensors (on torch's current stream); all tensor arguments must share one device.
"""

from collections.abc import Sequence
from typing import Any, TypeVar

import torch

_T = TypeVar("_T")

class CudaError(RuntimeError): ...

# --- module / bridge ------------------------------------------------------------------------

def configure(to_dlpack: Any, raw_stream_getter: Any, num_threads: Any) -> None:
    """Register torch.utils.dlpack.to_dlpack and torch._C._cuda_getCurrentRawStream (or None)
    for the capsule fallback path, and torch.get_num_threads (or None: one thread), asked at
    each CPU attention call for the threads the C reference may use.  Called once by
    diffkv/__init__.py."""

def set_bridge_path(path: str) -> None:
    """'auto' (exchange API when the tensor type has it, else capsule) or 'capsule' (force the
    fallback).  Tests use it to run both paths."""

def bridge_path(tensor: torch.Tensor) -> str:
    """'exchange' or 'capsule': the path a call would take for this tensor's type now."""

def tensor_info(tensor: torch.Tensor) -> dict[str, Any]:
    """What C sees: {'data_ptr': int, 'dtype': str, 'device_type': 'cpu'|'cuda',
    'device_id': int, 'shape': tuple, 'strides': tuple (elements), 'path': str}."""

def bridge_noop4(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> None:
    """Reads the four tensors' views (and the current stream when on CUDA), does nothing else.
    Used by benchmarks/bench_bridge.py."""

def cuda_compiled() -> bool: ...
def supported_head_sizes(device_type: str, dtype: str, cache_dtype: str) -> tuple[int, ...]:
    """The head sizes paged attention takes on 'cpu' or 'cuda' for 'float32', 'float16' or
    'bfloat16' queries over a cache of that dtype (cache_dtype 'auto') or a 'float8_e4m3fn' one
    (a CPU-only build: none on 'cuda')."""

def build_info() -> dict[str, Any]:
    """{'cuda_compiled': bool, 'cuda_runtime_version': int, 'device_count': int,
    'archs': str, 'limited_api': str, 'attention_kernel': 'sm90-tma' | 'sm90' | 'sm80' |
    'none'} (the fp16/bf16 attention kernels on the current device: sm90-tma = head 128 on a
    cache of power-of-two blocks of 16+ keys takes the TMA kernel, other calls the cp.async
    wgmma one; DIFFKV_ATTENTION_KERNEL=sm90 or set_attention_kernel('sm90') keeps calls off the
    TMA kernel, 'sm80' forces mma.sync)"""

def set_attention_kernel(kernel: str) -> str:
    """The tensor-core attention kernels CUDA calls of this process may take: 'auto' (the
    fastest the device and the build allow), 'sm90' (Hopper without the TMA kernel) or 'sm80'
    (mma.sync); returns the choice it replaces.  Overrides DIFFKV_ATTENTION_KERNEL, which is
    read once, at the first call that asks (a CUDA attention call, build_info, or this one).
    ValueError for any other value."""

def last_attention_kernel() -> str:
    """The kernel the last CUDA attention call of this process launched: 'sm90-tma', 'sm90',
    'sm80', 'f32', or 'none' before the first."""

# --- rows / metadata / layer (vLLM-Omni's adapter's messages) -------------------------------------------

def check_row(
    request_id: object,
    query_len: object,
    seq_len: object,
    kv_start_pos: object,
    sequence_id: object,
    context_id: object,
) -> None:
    """DiffusionPagedAttentionRow.__post_init__: its rules in vLLM-Omni's adapter's order."""

def check_metadata(prefill_rows: tuple, denoise_rows: tuple) -> None:
    """DiffusionPagedAttentionMetadata.__post_init__: both row lists non-empty, the same ordered
    identities (reads row.identity)."""

def check_step(step_idx: object) -> None:
    """rows_for_step: the step is a non-negative int."""

def check_layer_heads(ulysses_degree: object, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """ulysses_degree a positive int; heads positive, num_heads divisible by num_kv_heads, both by
    ulysses_degree; returns the rank-local (num_heads, num_kv_heads)."""

def check_head_sizes(head_size: int, head_size_v: int) -> None:
    """head_size_v == head_size."""

# --- prepare_batch ------------------------------------------------------------------------------

def check_batch_rows(rows: tuple, active: bool, max_num_reqs: int) -> None:
    """No rows, an active forward (RuntimeError), more rows than max_num_reqs, duplicate identities."""

def check_batch_bindings(
    rows: tuple,
    bindings: Sequence[Any],
    reorder_threshold: int | None,
    any_causal: bool,
    max_num_reqs: int,
    max_num_batched_tokens: int,
    block_sizes: Sequence[int],
    blocks_per_kv_block: Sequence[int],
    cp_size: int,
    num_blocks: torch.Tensor,
) -> int:
    """The rows against the Worker's tables and token budget, in vLLM-Omni's adapter's order;
    reads binding.row_index and binding.max_seq_len.
    num_blocks: CPU int32/int64 tensor [num_groups, max_num_reqs] (BlockTables.num_blocks.np
    through torch.as_tensor).  Returns num_tokens = sum(query_len)."""

def build_batch(
    rows: tuple,
    row_indices: Sequence[int],
    row_indices_out: torch.Tensor,
    query_start_loc_out: torch.Tensor,
    seq_lens_out: torch.Tensor,
    positions_out: torch.Tensor,
) -> None:
    """Fills CPU tensors: row_indices_out int32 [R], query_start_loc_out int32 [R+1],
    seq_lens_out int32 [R], positions_out int64 [N]."""

def dcp_local_seq_lens(
    seq_lens: torch.Tensor, out: torch.Tensor, cp_size: int, cp_rank: int, cp_interleave: int
) -> None:
    """CPU int32 [R] -> CPU int32 [R]."""

# --- block tables and pool ------------------------------------------------------------------

def table_append(
    table: torch.Tensor,
    counts: torch.Tensor,
    row: int,
    block_ids: Sequence[int],
    blocks_per_kv_block: int,
    num_kernel_blocks: int,
    overwrite: bool,
) -> None:
    """CPU int32 table [rows, cols] and CPU int32 counts [rows] of one group.  Manager block b
    becomes kernel blocks b*k .. b*k+k-1.  num_kernel_blocks <= 0 disables the id range check."""

def gather_block_tables(
    table: torch.Tensor,
    counts: torch.Tensor,
    row_indices: torch.Tensor,
    out: torch.Tensor,
    num_reqs_padded: int,
) -> None:
    """CPU int32: out[i, :counts[row]] = table[row, :counts[row]]; rows >= len(row_indices)
    up to num_reqs_padded zeroed."""

def compute_slot_mappings(
    table: torch.Tensor,
    row_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    num_tokens: int,
    num_tokens_padded: int,
    block_size: int,
    cp_size: int,
    cp_rank: int,
    cp_interleave: int,
) -> None:
    """CPU or CUDA.  table int32 [rows, cols], row_indices int32 [R], query_start_loc int32
    [R+1], positions int64 [>= num_tokens], out int64 1-D [>= num_tokens_padded]; entries
    [num_tokens, num_tokens_padded) get -1."""

def pool_init(state: torch.Tensor, free_stack: torch.Tensor, in_use: torch.Tensor) -> None:
    """state int64 [1] (number free), free_stack int32 [num_blocks], in_use uint8 [num_blocks]."""

def pool_allocate(state: torch.Tensor, free_stack: torch.Tensor, in_use: torch.Tensor, n: int) -> list[int]:
    """RuntimeError 'BlockPool.allocate(): n must be at most the number of free blocks (3), got 5'
    when exhausted; ValueError for n < 0."""

def pool_free(
    state: torch.Tensor, free_stack: torch.Tensor, in_use: torch.Tensor, block_ids: Sequence[int]
) -> None:
    """ValueError on an id out of range, not allocated (double free) or repeated."""

# --- piecewise plan ---------------------------------------------------------------------------

def build_plan(
    full_attn_spans: Sequence[Sequence[tuple[int, int]]],
    query_offsets: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    key_limits_out: torch.Tensor | None,
    query_indices_out: torch.Tensor | None,
) -> tuple[tuple, tuple]:
    """vLLM-Omni's adapter's build_paged_piecewise_plan, in C.  Raises the planner's ValueErrors
    ('Paged piecewise inputs must have one entry per row', ...).
    Returns (spans, segments): spans = normalised tuple(tuple((start, end), ...) per row);
    segments = tuple over segments k of tuple over rows r of (q_start, q_end, kv_end, mode)
    with mode 'causal' or 'full'.
    key_limits_out: CPU int32 [sum(query_lens)] or None: exclusive key bound per packed token.
    query_indices_out: CPU int64 [sum(query_lens)] or None: segment k's packed query indices,
    segments concatenated in order (segment k's slice starts at the sum of earlier segment
    lengths)."""

# --- tensor work -----------------------------------------------------------------------------

def kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = ...,
    v_scale: torch.Tensor | None = ...,
) -> None:
    """CPU or CUDA.  key/value [N, Hkv, D] (any strides), kv_cache [2, num_blocks, block_size,
    Hkv, D] (any strides), slot_mapping int64 [>= N] (first N used, < 0 skipped).  kv_cache
    holds the key's dtype (a bit copy) or float8_e4m3fn: then k_scale / v_scale (float32, 1 or
    Hkv entries, on the key's device, finite and > 0; required) and the stored byte is
    (x.float() / scale).clamp(-448, 448).to(float8_e4m3fn), bit for bit."""

MASK_NONE: int  # 0
MASK_CAUSAL: int  # 1
MASK_LIMITS: int  # 2
# check_layer_qkv's layout bits
LAYOUT_PACK_ROWS: int  # 1: right-padded [B, T] rows, gather the valid tokens
LAYOUT_QUERY_HEADS: int  # 2: the query is already [N, heads, size]
LAYOUT_KEY_HEADS: int  # 4: the key likewise
LAYOUT_VALUE_HEADS: int  # 8: the value likewise
LAYOUT_KEY_CONTIGUOUS: int  # 16: the key needs .contiguous()
LAYOUT_VALUE_CONTIGUOUS: int  # 32: the value needs .contiguous()
# dense_attention's consecutive bits: what its caller vouches for
CONSECUTIVE_TILES: int  # 1: every 128-key tile of a row is one run of one source's keys
CONSECUTIVE_CHUNKS: int  # 2: every 16 keys of a row are one source's rows from a multiple of 8
CONSECUTIVE_SCALES_FROM_KV: int  # 4: k_scale / v_scale were computed from key / value

def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    key_limits: torch.Tensor | None,
    mask: int,
    scale: float,
    out: torch.Tensor,
    host_block_table: torch.Tensor,
    host_query_start_loc: torch.Tensor,
    host_seq_lens: torch.Tensor,
    k_scale: torch.Tensor | None = ...,
    v_scale: torch.Tensor | None = ...,
) -> None:
    """CPU or CUDA.  query/out [N, H, D], block_table int32 [R, cols], query_start_loc int32
    [R+1], seq_lens int32 [R], key_limits int32 [N] (mask == MASK_LIMITS).  host_* are CPU
    copies used for the bounds check (the same tensors when on CPU).  A float8_e4m3fn kv_cache
    needs k_scale / v_scale (float32, 1 or Hkv entries) and is read as e4m3 * scale (the CPU
    reference only, so far: NotImplementedError on CUDA)."""

def paged_attention_lse(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    key_limits: torch.Tensor | None,
    mask: int,
    scale: float,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    host_block_table: torch.Tensor | None,
    host_query_start_loc: torch.Tensor | None,
    host_seq_lens: torch.Tensor | None,
) -> None:
    """paged_attention plus lse_out float32 [N, H] (CPU reference and CUDA kernels):
    lse_out[t, h] = log(sum over t's visible keys
    j of exp(scale * q[t, h] . k[j])), -inf when t sees no key.  Unlike paged_attention, a row's
    seq_len may be below its query length in every mask mode (a context-parallel rank's local
    share of the keys): tokens then see fewer keys, possibly none (zeros in out)."""

def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_index: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    key_limits: torch.Tensor | None,
    mask: int,
    scale: float,
    out: torch.Tensor,
    host_key_index: torch.Tensor | None,
    host_query_start_loc: torch.Tensor | None,
    host_seq_lens: torch.Tensor | None,
    max_query_len: int,
    joint_key: torch.Tensor | None,
    joint_value: torch.Tensor | None,
    key_block: int,
    consecutive: int,
) -> None:
    """Attention over plain key/value tensors [num_keys, Hkv, D] (one stride set): key j of row
    r is key token key_index[r, j] (int32 [R, cols]; a block table over one-token blocks).
    joint_key/joint_value [num_joint, Hkv, D] (the key's strides; both or neither) are a second
    source read by the same kernels: key indices num_keys .. num_keys + num_joint - 1.
    key_block > 1 (dividing num_keys; no joint keys): key_index holds blocks of key_block
    consecutive key tokens instead (the dense path's whole rows: TMA boxes on Hopper).
    consecutive & CONSECUTIVE_TILES (1): the caller vouches that every 128-key tile of every
    row is one run of consecutive key indices from one source (key_index[r, j] = key_index[r,
    j0] + j - j0 for the keys j0 <= j < seq_lens[r] of a tile starting at j0, a multiple of
    128: packed varlen documents, joint tokens in whole tiles), which lets Hopper bring
    one-token blocks in as TMA boxes (a row that breaks the promise reads the wrong keys, never
    outside the key tensors); consecutive & CONSECUTIVE_CHUNKS (2): every 16 keys of a row are
    16 consecutive rows of one source starting at a multiple of 8; consecutive &
    CONSECUTIVE_SCALES_FROM_KV (4, with k_scale, v_scale): the scales were computed from
    key/value (amax / 448), so their values are not checked on the host (no synchronisation);
    0 = no promise.
    Serves DiffKVAttentionImpl.forward (diffkv.dense).  As in paged_attention_lse, a row may
    have fewer keys than queries in every mask mode.  max_query_len > 0 sizes the CUDA launch
    when the host copies are None (the caller vouches no row has more queries); 0 = every
    query token."""

def quantize_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
    scales: torch.Tensor,
    joint_key: torch.Tensor | None,
    joint_value: torch.Tensor | None,
    joint_key_out: torch.Tensor | None,
    joint_value_out: torch.Tensor | None,
) -> None:
    """The fp8 dense forward's rounding of its keys and values (CPU reference and CUDA
    kernels), with no temporaries and no synchronisation: scales (float32 [2]) receives
    amax_k / 448 and amax_v / 448, the largest magnitudes over key and joint_key and over value
    and joint_value (1 where that is not > 0: all zeros, or a NaN among them); then each input
    x goes into its output (float8_e4m3fn, x's shape; value_out with key_out's strides, the
    joint outputs likewise) as ``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``,
    bit for bit. An output may also be ``[B, S, Hkv, D]`` with B * S = its input's tokens (token
    t into entry t // S, row t % S; value_out then of key_out's shape): the dense forward's
    joint layout, the main and joint outputs ``[B, S]`` and ``[B, J]`` row ranges of one ``[B,
    J + S, Hkv, D]`` buffer, interleaving batch row by batch row -- allowed where their rows
    within each entry do not meet. key/value [tokens, Hkv, D] float32, float16 or bfloat16 at
    any strides; joint_key/joint_value [num_joint, Hkv, D] of the key's dtype; the four joint
    arguments all tensors or all None. Every tensor on the key's device; the outputs and scales
    share no byte with another argument."""

def forward_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    key_limits: torch.Tensor | None,
    mask: int,
    scale: float,
    out: torch.Tensor,
    host_block_table: torch.Tensor,
    host_query_start_loc: torch.Tensor,
    host_seq_lens: torch.Tensor,
    k_scale: torch.Tensor | None = ...,
    v_scale: torch.Tensor | None = ...,
) -> None:
    """kv_write then paged_attention in one call; every check runs before the write.  out is
    [N, H, Dv], or [N, H * Dv] written through its [N, H, Dv] view (the layer call of an
    [N, H * D] query needs no reshape afterwards)."""

def rows_gather(src: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> None:
    """CPU or CUDA.  src [S, H, D], index int64 [N], dst [N, H, D]: dst[n] = src[index[n]]."""

def rows_scatter(src: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> None:
    """CPU or CUDA.  src [N, H, D], index int64 [N], dst [S, H, D]: dst[index[n]] = src[n],
    other dst rows zeroed."""

def new_with_slots(cls: type[_T], descriptors: tuple[Any, ...], *values: Any) -> _T:
    """``object.__new__(cls)`` (cls: a Python class that object.__new__ creates) with
    ``descriptors[i].__set__(obj, values[i])`` for each i and no ``__init__``; TypeError for
    wrong arguments, or what a __set__ raised.  Builds the per-call
    DiffusionPagedAttentionContext (a frozen slots dataclass) without its __init__."""
