/*
 * diffkv.h -- the one internal header of diffkv's C core.
 *
 * Holds the borrowed tensor view (dk_tensor), status codes, one argument struct per op and
 * the prototypes of every host routine (dk_*), CPU reference (dk_ref_*) and CUDA launcher
 * (dk_cuda_*).  No Python.h and no CUDA headers here: a stream is a void pointer.  Only
 * the Python boundary (csrc/py/) turns a dk_status into a Python exception.
 *
 * Conventions: sizes, strides and indices are int64 and strides are counted in elements; a
 * slot < 0 means "skip this token"; every routine that can fail returns a dk_status and writes
 * a message into the dk_error it is given; nothing here allocates torch memory or keeps a
 * pointer past the call.
 */
#ifndef DIFFKV_H
#define DIFFKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------ */
/* Status and errors                                                                           */
/* ------------------------------------------------------------------------------------------ */

typedef enum dk_status {
    DK_OK = 0,
    DK_ERR_VALUE = 1,          /* bad shape, size or value: ValueError */
    DK_ERR_TYPE = 2,           /* wrong dtype or device: TypeError */
    DK_ERR_UNSUPPORTED = 3,    /* a size or dtype no kernel is built for: ValueError */
    DK_ERR_CUDA = 4,           /* a CUDA runtime failure: diffkv.CudaError */
    DK_ERR_NO_CUDA = 5,        /* a CUDA path called in a CPU-only build: RuntimeError */
    DK_ERR_NOMEM = 6,          /* host allocation failed: MemoryError */
    DK_ERR_RUNTIME = 7,        /* a state error (exhausted pool, ...): RuntimeError */
    DK_ERR_NOT_IMPLEMENTED = 8 /* a configuration no kernel serves yet: NotImplementedError */
} dk_status;

#define DK_MSG_CAP 512

/* The message a failing routine leaves behind; the Python boundary (csrc/py/) raises it. */
typedef struct dk_error {
    char msg[DK_MSG_CAP];
} dk_error;

/* Formats into err->msg and returns status (printf-style).  Cannot fail. */
dk_status dk_fail(dk_error *err, dk_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Whether an NVIDIA driver that supports CUDA `driver` (cudaDriverGetVersion's form: 1000 major
 * + 10 minor) runs code built with the CUDA runtime `runtime` (CUDART_VERSION's form): a driver
 * of the runtime's major version or newer (CUDA's minor-version compatibility).  DK_OK, or
 * DK_ERR_CUDA with a message naming both versions, the driver the build needs and what to do
 * instead (a driver of 0: none found).  Cannot fail otherwise. */
dk_status dk_driver_check(int driver, int runtime, dk_error *err);

/* ------------------------------------------------------------------------------------------ */
/* Tensors                                                                                     */
/* ------------------------------------------------------------------------------------------ */

typedef enum dk_dtype {
    DK_F32 = 0,
    DK_F16 = 1,
    DK_BF16 = 2,
    DK_F64 = 3,
    DK_I32 = 4,
    DK_I64 = 5,
    DK_U8 = 6,
    DK_BOOL = 7,
    DK_I8 = 8,
    DK_I16 = 9,
    DK_OTHER = 10,
    DK_F8E4M3 = 11 /* float8_e4m3fn: a KV cache's quantized element (no inf; 0x7F is NaN) */
} dk_dtype;

typedef enum dk_device_type {
    DK_CPU = 1, /* the DLPack codes: kDLCPU */
    DK_CUDA = 2 /* kDLCUDA */
} dk_device_type;

#define DK_MAX_DIMS 8

/* A borrowed view of a torch tensor, valid for one call. */
typedef struct dk_tensor {
    void *data;          /* first element (DLPack data + byte_offset); may be NULL if numel == 0 */
    dk_dtype dtype;      /* element type */
    int32_t device_type; /* DK_CPU or DK_CUDA (other DLPack codes are rejected) */
    int32_t device_id;   /* CUDA ordinal, 0 on CPU */
    int32_t ndim;        /* 0..DK_MAX_DIMS */
    int64_t shape[DK_MAX_DIMS]; /* sizes */
    int64_t
        strides[DK_MAX_DIMS]; /* element strides (compact row-major when the producer gave none) */
} dk_tensor;

/* Bytes of one element of dtype (0 for DK_OTHER).  Cannot fail. */
size_t dk_dtype_size(dk_dtype dtype);
/* "float32", "bfloat16", ... as torch spells them.  Cannot fail. */
const char *dk_dtype_name(dk_dtype dtype);
/* Number of elements (product of shape).  Cannot fail. */
int64_t dk_tensor_numel(const dk_tensor *t);

/* ------------------------------------------------------------------------------------------ */
/* Half-precision conversions used by the CPU reference (round to nearest even)               */
/* ------------------------------------------------------------------------------------------ */

float dk_f16_to_f32(uint16_t h);
uint16_t dk_f32_to_f16(float f);
float dk_bf16_to_f32(uint16_t h);
uint16_t dk_f32_to_bf16(float f);
/* float8_e4m3fn, as torch converts: round to nearest even; a NaN becomes 0x7F with its sign;
 * |f| >= 448 (infinities included) saturates to +-448 (torch: clamp(-448, 448) first). */
uint8_t dk_f32_to_e4m3(float f);
float dk_e4m3_to_f32(uint8_t b);

/* ------------------------------------------------------------------------------------------ */
/* Slot mapping (csrc/batch.c, cuda/slots.cu)                                                  */
/* ------------------------------------------------------------------------------------------ */

/*
 * Slot of the token at position p of batch row i (vLLM BlockTables.compute_slot_mappings):
 *   row = row_indices[i]; span = block_size * cp_size; blk = p / span; off = p % span;
 *   phys = block_table[row * bt_stride_row + blk]
 *   cp_size == 1: slot = phys * block_size + off
 *   else: local iff (off / cp_interleave) % cp_size == cp_rank, then
 *         slot = phys * block_size + (off / (cp_interleave * cp_size)) * cp_interleave
 *                + off % cp_interleave; a non-local token gets -1.
 * Tokens in [num_tokens, num_tokens_padded) get -1.
 */
typedef struct dk_slots_args {
    const int32_t *block_table;     /* [table_rows, table_cols] persistent table of one group */
    int64_t bt_stride_row;          /* elements between table rows (column stride must be 1) */
    int64_t table_rows;             /* rows in block_table */
    int64_t table_cols;             /* kernel blocks per table row */
    const int32_t *row_indices;     /* [num_rows] table row of each batch row */
    const int32_t *query_start_loc; /* [num_rows + 1] token offsets of each batch row */
    const int64_t *positions;       /* [num_tokens] global position of each token */
    int64_t *slot_mapping;          /* [num_tokens_padded] out; slot_stride apart */
    int64_t slot_stride;            /* element stride of slot_mapping */
    int64_t num_rows;               /* batch rows */
    int64_t num_tokens;             /* query_start_loc[num_rows] */
    int64_t num_tokens_padded;      /* >= num_tokens */
    int64_t block_size;             /* kernel block size (tokens per page) */
    int64_t cp_size;                /* context-parallel world size, >= 1 */
    int64_t cp_rank;                /* this rank, [0, cp_size) */
    int64_t cp_interleave;          /* tokens per interleave step, >= 1 */
} dk_slots_args;

/* CPU slot mapping.  All pointers are host memory.  Returns DK_ERR_VALUE when a row index or a
 * block index falls outside the table (nothing is written then). */
dk_status dk_ref_slots(const dk_slots_args *a, dk_error *err);
/* CUDA slot mapping on `stream`; pointers are device memory.  Ranges are not checked on the
 * device: the caller has validated row indices and capacities on the host. */
dk_status dk_cuda_slots(const dk_slots_args *a, void *stream, dk_error *err);

/* ------------------------------------------------------------------------------------------ */
/* Batch preparation (csrc/batch.c)                                                            */
/* ------------------------------------------------------------------------------------------ */

/* positions[t] = kv_start_pos[i] + (t - query_start_loc[i]) for t in row i.  Host memory.
 * Cannot fail. */
void dk_positions_build(const int64_t *kv_start_pos, const int32_t *query_start_loc,
                        int64_t num_rows, int64_t *positions);

/* vLLM get_dcp_local_seq_lens: tokens of each row stored on cp_rank:
 *   base = (s / (cp_size * I)) * I; rem = s - base * cp_size;
 *   out = base + clamp(rem - cp_rank * I, 0, I).  Host memory.  Cannot fail. */
void dk_dcp_local_seq_lens(const int32_t *seq_lens, int64_t num_rows, int64_t cp_size,
                           int64_t cp_rank, int64_t cp_interleave, int32_t *out);

/* gather_block_tables: out row i <- the first counts[row_indices[i]] entries of table row
 * row_indices[i]; rows [num_rows, num_reqs_padded) of out are zeroed; the tail of a valid
 * row past its count is left as it was (vLLM semantics).  Host memory.  DK_ERR_VALUE when a
 * row index or count is out of range (nothing written). */
typedef struct dk_gather_args {
    const int32_t *table;     /* [table_rows, table_cols] */
    int64_t table_stride_row; /* elements between table rows */
    int64_t table_rows;
    int64_t table_cols;
    const int32_t *counts; /* installed kernel blocks per table row, counts_stride apart */
    int64_t counts_stride;
    const int32_t *row_indices; /* [num_rows] */
    int64_t num_rows;
    int32_t *out; /* [out_rows, table_cols] */
    int64_t out_stride_row;
    int64_t out_rows;        /* rows available in out */
    int64_t num_reqs_padded; /* rows to fill, >= num_rows, <= out_rows */
} dk_gather_args;
dk_status dk_ref_gather_block_tables(const dk_gather_args *a, dk_error *err);

/*
 * vLLM-Omni's adapter's prepare_batch checks over plain numbers, in its order:
 *   two rows resolve to the same Worker row (only compared among rows whose index is an int);
 *   for each row: capacity not an int or < 0; seq_len > capacity;
 *   causal ordering (threshold >= 0 and any_causal);
 *   for each row: index not an int or outside [0, max_num_reqs);
 *                 for each group: too few installed kernel blocks;
 *   sum(query_len) > max_num_batched_tokens.
 * Python-level facts (is this an int?) arrive as flags.  On a violation `fault` names the rule
 * and the row/group so csrc/py/batch.c can format the adapter's exact message.
 */
typedef enum dk_batch_rule {
    DK_BATCH_OK = 0,
    DK_BATCH_DUP_WORKER_ROW,
    DK_BATCH_BAD_CAPACITY,
    DK_BATCH_SEQ_LEN_OVER_CAPACITY,
    DK_BATCH_ORDER,
    DK_BATCH_BAD_WORKER_ROW,
    DK_BATCH_TOO_FEW_BLOCKS,
    DK_BATCH_TOO_MANY_TOKENS
} dk_batch_rule;

typedef struct dk_batch_check_args {
    int64_t num_rows;
    const int64_t *query_lens;       /* [num_rows] */
    const int64_t *seq_lens;         /* [num_rows] */
    const int64_t *row_indices;      /* [num_rows] value when row_index_is_int[i] */
    const uint8_t *row_index_is_int; /* [num_rows] 1 when type(row_index) is int and fits int64 */
    const int64_t *capacities;       /* [num_rows] binding.max_seq_len */
    const uint8_t *capacity_is_int;  /* [num_rows] 1 when type(max_seq_len) is int and fits int64 */
    int64_t reorder_threshold;       /* < 0: no threshold */
    int any_causal;                  /* some cache group is causal */
    int64_t max_num_reqs;
    int64_t max_num_batched_tokens;
    int64_t num_groups;
    const int64_t *block_sizes;         /* [num_groups] manager block sizes */
    const int64_t *blocks_per_kv_block; /* [num_groups] kernel blocks per manager block */
    int64_t cp_size;
    const void *num_blocks;          /* [num_groups, max_num_reqs] installed kernel blocks */
    dk_dtype num_blocks_dtype;       /* DK_I32 or DK_I64 */
    int64_t num_blocks_stride_group; /* element strides of num_blocks */
    int64_t num_blocks_stride_row;
} dk_batch_check_args;

typedef struct dk_batch_fault {
    dk_batch_rule rule;
    int64_t row;              /* offending row (capacity, seq_len, row index, blocks) */
    int64_t group;            /* offending cache group (too few blocks) */
    int64_t required_blocks;  /* cdiv(seq_len, block_size * cp_size) */
    int64_t installed_blocks; /* installed kernel blocks // blocks_per_kv_block */
    int64_t num_tokens;       /* sum(query_len): the budget rule, and on success */
} dk_batch_fault;

/* Returns DK_OK with fault->rule == DK_BATCH_OK and fault->num_tokens set, or DK_ERR_VALUE
 * with fault filled (err->msg then holds a generic description).  Never touches memory other
 * than the arguments. */
dk_status dk_batch_check(const dk_batch_check_args *a, dk_batch_fault *fault, dk_error *err);

/* ------------------------------------------------------------------------------------------ */
/* Piecewise plans (csrc/plan.c)                                                               */
/* ------------------------------------------------------------------------------------------ */

typedef enum dk_mode { DK_MODE_CAUSAL = 0, DK_MODE_FULL = 1 } dk_mode;

/* One segment of one row, global coordinates (vLLM-Omni's adapter's Segment NamedTuple). */
typedef struct dk_segment {
    int64_t q_start;
    int64_t q_end;
    int64_t kv_end;
    int32_t mode; /* dk_mode */
} dk_segment;

typedef enum dk_plan_rule {
    DK_PLAN_OK = 0,
    DK_PLAN_BAD_SPANS, /* "Paged piecewise spans must be sorted, non-overlapping, and within the
                          sequence" */
    DK_PLAN_BAD_QUERY_RANGE, /* "Paged piecewise query range must be within the sequence" */
    DK_PLAN_UNALIGNED,       /* "Paged piecewise rows must produce aligned segments" */
    DK_PLAN_MODE_MISMATCH /* "Paged piecewise rows must use the same attention mode per segment" */
} dk_plan_rule;

typedef struct dk_plan_args {
    int64_t num_rows;
    const int64_t
        *span_offsets; /* [num_rows + 1] row r owns spans[span_offsets[r] .. span_offsets[r+1]) */
    const int64_t *spans;         /* [total_spans, 2] (start, end) pairs, global coordinates */
    const int64_t *query_offsets; /* [num_rows] kv_start_pos of each row */
    const int64_t *query_lens;    /* [num_rows] */
    const int64_t *seq_lens;      /* [num_rows] */
} dk_plan_args;

/* Capacity of `segments` that dk_plan_build needs: num_rows * (2 * max spans of a row + 1).
 * Cannot fail. */
int64_t dk_plan_segment_capacity(const dk_plan_args *a);

/*
 * Validates and segments every row (vLLM-Omni's adapter's build_paged_piecewise_plan, rows checked
 * in order: spans first, then the query range, per row), then checks that all rows have the same
 * number of segments (UNALIGNED) and the same mode per segment (MODE_MISMATCH). Output:
 * *num_segments = K; segments[k * num_rows + r] = segment k of row r; key_limits[t] (int32, [sum
 * query_lens], packed row-major) = exclusive key bound of packed query token t: kv_end of its full
 * segment, else position + 1. On failure returns DK_ERR_VALUE, sets *rule and the adapter's message
 * in err; nothing written to key_limits.
 */
dk_status dk_plan_build(const dk_plan_args *a, dk_segment *segments, int64_t segment_capacity,
                        int64_t *num_segments, int32_t *key_limits, dk_plan_rule *rule,
                        dk_error *err);

/* ------------------------------------------------------------------------------------------ */
/* Block pool (csrc/blocks.c)                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* The state lives in caller-owned memory (int32 tensors held by the Python BlockPool):
 * free_stack[0 .. *num_free) are the free block ids, in_use[b] is 1 while b is allocated. */
typedef struct dk_pool {
    int32_t *free_stack; /* [num_blocks] */
    uint8_t *in_use;     /* [num_blocks] */
    int64_t num_blocks;
    int64_t num_free;
} dk_pool;

/* Fills free_stack with num_blocks-1 .. 0 (so allocation hands out 0, 1, 2, ... first) and
 * clears in_use.  Cannot fail. */
void dk_pool_init(dk_pool *pool);
/* Pops n ids into out[0..n).  DK_ERR_RUNTIME when fewer than n are free, DK_ERR_VALUE when
 * n < 0; the pool is unchanged on failure. */
dk_status dk_pool_allocate(dk_pool *pool, int64_t n, int32_t *out, dk_error *err);
/* Returns ids to the pool.  Every id is checked first (range, currently allocated, no id twice
 * in `ids`); on any failure nothing changes.  DK_ERR_VALUE. */
dk_status dk_pool_free(dk_pool *pool, const int64_t *ids, int64_t n, dk_error *err);

/* Block table row writes for diffkv's BlockTables (append_block_ids / clear_row). */
typedef struct dk_table_append_args {
    int32_t *table; /* [table_rows, table_cols] kernel block ids of one group */
    int64_t table_stride_row;
    int64_t table_rows;
    int64_t table_cols;
    int32_t *counts; /* [table_rows] installed kernel blocks per row */
    int64_t counts_stride;
    int64_t row;
    const int64_t *block_ids; /* [n] manager block ids */
    int64_t n;
    int64_t blocks_per_kv_block; /* each manager block b becomes kernel blocks b*k .. b*k+k-1 */
    int64_t num_kernel_blocks;   /* ids must satisfy b*k + k - 1 < num_kernel_blocks (when > 0) */
    int overwrite;               /* 1: replace the row, 0: append */
} dk_table_append_args;
/* Validates (row range, ids >= 0 and in range, capacity) before writing anything.
 * DK_ERR_VALUE on failure. */
dk_status dk_table_append(const dk_table_append_args *a, dk_error *err);

/* ------------------------------------------------------------------------------------------ */
/* KV write (csrc/ref_attention.c, cuda/kv_write.cu)                                           */
/* ------------------------------------------------------------------------------------------ */

/*
 * cache[block][off][h][d] = src[t][h][d] for every token t with slot = slot_mapping[t] >= 0,
 * block = slot / block_size, off = slot % block_size, for the key and the value.
 * Later tokens with the same slot win (a pure scatter).  slot_mapping NULL: slot t for token t
 * (dk_quantize_kv's outputs, caches of one-token blocks).
 */
typedef struct dk_kv_write_args {
    const void *key;   /* [num_tokens, num_kv_heads, head_size] */
    const void *value; /* [num_tokens, num_kv_heads, head_size] */
    int64_t key_stride_token, key_stride_head, key_stride_dim;
    int64_t value_stride_token, value_stride_head, value_stride_dim;
    void *key_cache;   /* [num_blocks, block_size, num_kv_heads, head_size] */
    void *value_cache; /* same shape and strides as key_cache */
    int64_t cache_stride_block, cache_stride_token, cache_stride_head, cache_stride_dim;
    const int64_t *slot_mapping; /* [num_tokens], or NULL: token t into slot t */
    int64_t slot_stride;
    int64_t num_tokens;
    int64_t num_kv_heads;
    int64_t head_size;
    int64_t block_size;
    int64_t num_blocks;
    dk_dtype dtype; /* DK_F32, DK_F16 or DK_BF16: key and value */
    /* The cache's element: dtype (a bit copy), or DK_F8E4M3 (quantized: the stored value is
     * dk_f32_to_e4m3(x / scale), the division in fp32, scale = k_scale / v_scale[h *
     * scale_stride_head], fp32 on the inputs' device, finite and > 0 -- checked by the caller;
     * scale_stride_head 0 for one scale per tensor). */
    dk_dtype cache_dtype;
    const float *k_scale;
    const float *v_scale;
    int64_t scale_stride_head;
} dk_kv_write_args;

/* Checks every slot first (slot < num_blocks * block_size), then writes.  Host memory.
 * DK_ERR_VALUE on an out-of-range slot (nothing written), DK_ERR_UNSUPPORTED on a dtype. */
dk_status dk_ref_kv_write(const dk_kv_write_args *a, dk_error *err);
/* Same on the GPU, on `stream`.  The caller has range-checked the slots. */
dk_status dk_cuda_kv_write(const dk_kv_write_args *a, void *stream, dk_error *err);

/*
 * A KV-write launch held back so that it can go out together with the attention launch that
 * reads what it writes (cuda/launch.cu): the kernel (its host stub), its geometry and copies of
 * its parameter values.  func == NULL: nothing pending.
 */
typedef struct dk_pending_launch {
    const void *func;
    uint32_t grid[3], block[3];
    dk_kv_write_args kv; /* the kv_write kernels' parameters, in order */
    int64_t elem_size;
    int32_t units_per_head, elems_per_unit;
} dk_pending_launch;

/* dk_cuda_kv_write's checks, then its launch described in *p instead of made (p->func NULL when
 * there is nothing to write).  Same errors. */
dk_status dk_cuda_kv_write_prepare(const dk_kv_write_args *a, dk_pending_launch *p, dk_error *err);

/*
 * The dense forward's fp8 rounding of its keys and values (extra["kv_cache_dtype"] == "fp8"):
 * scales[0] = amax_k / 448 and scales[1] = amax_v / 448 (the fp32 division), where amax_k is
 * the largest magnitude over the keys of both pairs (key, then joint key) and amax_v over the
 * values; 1 where that amax is not > 0 (all zeros, or a NaN among them: the outputs are then
 * NaN anyway).  Then each pair's kv_write into its float8_e4m3fn outputs: kv[i] with
 * slot_mapping NULL (token t into row t of the outputs, caches of num_tokens one-token blocks),
 * k_scale = scales, v_scale = scales + 1, scale_stride_head 0 -- the stored byte is
 * dk_f32_to_e4m3(x / scale), as torch's (x.float() / scale).clamp(-448, 448).to(float8_e4m3fn).
 * kv[1].num_tokens 0: no joint pair.  scales: float32 on the inputs' device, written.  Nothing is
 * launched or written when a check fails (the CUDA form prepares both writes first).
 */
typedef struct dk_quantize_kv_args {
    dk_kv_write_args kv[2];
    float *scales;
} dk_quantize_kv_args;
dk_status dk_ref_quantize_kv(const dk_quantize_kv_args *a, dk_error *err);
dk_status dk_cuda_quantize_kv(const dk_quantize_kv_args *a, void *stream, dk_error *err);

/* ------------------------------------------------------------------------------------------ */
/* Paged attention (csrc/ref_attention.c, cuda/attention_*.cu)                                 */
/* ------------------------------------------------------------------------------------------ */

typedef enum dk_mask {
    DK_MASK_NONE = 0,   /* every query of row r sees keys [0, seq_lens[r]) */
    DK_MASK_CAUSAL = 1, /* bottom-right: query i of row r sees keys j <= i + seq_len - query_len */
    DK_MASK_LIMITS = 2  /* query token t sees keys j < min(key_limits[t], seq_len) */
} dk_mask;

/*
 * out[t, h, :] = softmax(scale * q[t, h, :] . K[j, h / (num_heads / num_kv_heads), :]) V[j]
 * over the visible keys j of t's row, where K/V for key position j of row r live at
 * block = block_table[r * bt_stride_row + j / block_size], offset j % block_size.
 * A token whose row sees no key gets zeros.  Accumulation in fp32 (fp64 never needed).
 */
/* dk_attention_args.row_seq_lens: the most rows whose seq_lens the host passes by value */
#define DK_ROW_SEQ_LENS 8

typedef struct dk_attention_args {
    /* CUDA: a KV write to launch with the first attention kernel (it reads what the write
     * writes), consumed by that launch; NULL: none (cuda/launch.cu) */
    struct dk_pending_launch *pending;
    const void *query; /* [num_tokens, num_heads, head_size] */
    int64_t q_stride_token, q_stride_head, q_stride_dim;
    const void *key_cache; /* [num_blocks, block_size, num_kv_heads, head_size] */
    const void *value_cache;
    int64_t cache_stride_block, cache_stride_token, cache_stride_head, cache_stride_dim;
    void *out; /* [num_tokens, num_heads, head_size] */
    int64_t o_stride_token, o_stride_head, o_stride_dim;
    const int32_t *block_table; /* [num_rows, bt_cols] gathered tables, batch row order */
    int64_t bt_stride_row;
    int64_t bt_cols;
    const int32_t *query_start_loc; /* [num_rows + 1] */
    const int32_t *seq_lens;        /* [num_rows] */
    const int32_t *key_limits;      /* [num_tokens] for DK_MASK_LIMITS, else NULL */
    int32_t mask;                   /* dk_mask */
    int64_t num_rows;
    int64_t num_tokens;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_size;
    int64_t block_size;
    int64_t num_blocks;
    int64_t max_query_len; /* max over rows of the query length (launch shapes) */
    int64_t max_seq_len;   /* max over rows of seq_lens */
    float scale;           /* softmax scale */
    dk_dtype dtype;        /* DK_F32, DK_F16 or DK_BF16: query, cache and out */
    /* 1: the cache holds float8_e4m3fn, a key element read as e4m3 * k_scale[h *
     * scale_stride_head] in fp32 (values likewise with v_scale; fp32 on the query's device,
     * finite and > 0 -- checked by the caller; scale_stride_head 0: one scale per tensor);
     * 0: the cache holds dtype.  The CUDA kernels refuse 1 (DK_ERR_UNSUPPORTED) so far. */
    int32_t kv_fp8;
    const float *k_scale;
    const float *v_scale;
    int64_t scale_stride_head;
    /* Optional output, NULL = not requested (every builder memsets the struct), filled by the
     * CPU reference and the CUDA kernels: lse[t, h] = natural log of the sum over t's visible
     * keys j of exp(scale * q[t, h] . K[j]), fp32; -inf when t sees no key. */
    float *lse;                                /* [num_tokens, num_heads] or NULL */
    int64_t lse_stride_token, lse_stride_head; /* element strides of lse */
    /* DK_KEYS_PAGED, or which dense_attention key_index block_table is (only the check's
     * messages differ) */
    int32_t dense;
    /* Optional second K/V source (dense_attention's joint tokens), NULL = none: a block id
     * b >= blocks2 is block b - blocks2 of key_cache2 / value_cache2, which share the cache
     * strides; num_blocks counts the blocks of both sources. */
    const void *key_cache2;
    const void *value_cache2;
    int64_t blocks2;
    /* Per mille of the key tiles (128 keys) whose blocks are consecutive ids, counted on the
     * host copy of the block table for the CUDA kernels' choice of K/V producer (0 when not
     * counted): dk_attention_table_runs. */
    int32_t table_runs;
    /* DK_CONSECUTIVE_TILES, dense_attention's bit over one source: every row's keys are
     * consecutive rows of the cache, so a key tile of any size is one run (the CUDA kernels'
     * flat boxes).  DK_CONSECUTIVE_CHUNKS, its bit as given (one or two sources): every 16 keys
     * of a row are 16 consecutive rows of one source from a multiple of 8 (the per-chunk TMA
     * boxes). */
    int32_t keys_consecutive;
    /* Every row's query length when all rows share it and query_start_loc is
     * r * uniform_query_len, as the host copies of the metadata say (dk_attention_uniform_rows),
     * and their seq_len when they share that too; 0 when they differ or were not counted.
     * row_seq_lens: every row's seq_len when there are 2 to DK_ROW_SEQ_LENS rows of one query
     * length (a CFG pair, a batch of prompts), else 0s.  The persistent sm90 kernel takes
     * its rows' spans from these instead of reading them (cuda/attention_sm90_persist.cu). */
    int32_t uniform_query_len, uniform_seq_len;
    int32_t row_seq_lens[DK_ROW_SEQ_LENS];
    /* Threads the CPU reference may use, the caller's included (0 or 1: the caller's alone);
     * the bindings pass torch.get_num_threads().  The CUDA path ignores it. */
    int32_t cpu_threads;
} dk_attention_args;

/* dk_attention_args.dense */
enum {
    DK_KEYS_PAGED = 0,       /* block_table is a paged cache's */
    DK_KEYS_DENSE = 1,       /* dense_attention's key_index: blocks of one key token */
    DK_KEYS_DENSE_BLOCKS = 2 /* dense_attention's key_index: blocks of key_block tokens */
};

/* dk_attention_args.table_runs when every key tile is one run (its scale: per mille) */
#define DK_TABLE_RUNS_ALL 1000

/* dense_attention's consecutive argument, one bit per promise its caller makes (exported as
 * _C.CONSECUTIVE_*); the first two are also dk_attention_args.keys_consecutive's bits. */
enum {
    /* every 128-key tile of every row is one run of consecutive key indices of one source */
    DK_CONSECUTIVE_TILES = 1,
    /* every 16 keys of a row (0-15, 16-31, ..) are 16 consecutive rows of one source starting
     * at a multiple of 8 */
    DK_CONSECUTIVE_CHUNKS = 2,
    /* k_scale / v_scale were computed from key / value themselves (amax / 448): their values
     * are not checked on the host */
    DK_CONSECUTIVE_SCALES_FROM_KV = 4
};

/* Host-side bounds check the kernels rely on: query_start_loc monotone from 0 to num_tokens,
 * seq_lens[r] in [0, bt_cols * block_size], every block id a row can reach in
 * [0, num_blocks).  All arrays must be host-readable.  DK_ERR_VALUE on violation. */
dk_status dk_attention_check(const dk_attention_args *a, dk_error *err);
/* After dk_attention_check, on the same host arrays: per mille of the tiles of tile_keys keys
 * (a multiple of block_size) over every row's seq_len whose blocks are consecutive ids
 * (block_table[r][b + 1] == block_table[r][b] + 1 within the tile); 0 for no tiles. */
int32_t dk_attention_table_runs(const dk_attention_args *a, int64_t tile_keys);
/* After dk_attention_check, on the same host arrays: sets a->uniform_query_len when every row
 * has the same query length q > 0 (query_start_loc[r] == r q), then a->uniform_seq_len when the
 * rows share one seq_len too and a->row_seq_lens when there are 2 to DK_ROW_SEQ_LENS rows; clears
 * what does not hold. */
void dk_attention_uniform_rows(dk_attention_args *a);
/* Whether the sm90 kernel's per-chunk TMA producer can read the cache as 16-key chunks (head
 * 128, 192 or 256, one source, blocks of 16 n keys or one block per row of 8 n, strides its 5-d
 * maps can take): 1 the kv heads are adjacent head_size-element rows (NHD), 2 a contiguous HND
 * cache, 0 no.
 * Such a cache takes that producer in any block order, so its runs need not be counted. */
int32_t dk_attention_chunk_layout(const dk_attention_args *a);
/* CPU reference.  Assumes dk_attention_check passed.  Cannot fail except DK_ERR_UNSUPPORTED
 * (dtype) and DK_ERR_NOMEM (scratch), both before anything is written.  Fills a->lse too when
 * it is not NULL.  Runs its (row, kv head) items on up to a->cpu_threads threads, the caller's
 * included: one per DK_REF_THREAD_MACS multiply-adds, at most DK_REF_MAX_THREADS and as many as
 * DK_REF_THREADS_SCRATCH bytes of per-thread scratch allow.  The bits are the same on any number
 * of threads (each item is computed whole by one thread). */
dk_status dk_ref_attention(const dk_attention_args *a, dk_error *err);
#define DK_REF_MAX_THREADS 256
#define DK_REF_THREAD_MACS (4.0 * 1024 * 1024)
#define DK_REF_THREADS_SCRATCH ((size_t)512 << 20)
#define DK_REF_THREAD_NAME "diffkv-cpu" /* the name of its threads (the caller's excepted) */
/* CUDA path on `stream` (device pointers).  DK_ERR_UNSUPPORTED for head sizes it is not
 * built for (the message lists the supported ones). */
dk_status dk_cuda_attention(const dk_attention_args *a, void *stream, dk_error *err);
/* One layer call on the GPU: the KV write w, then the attention a that reads what it wrote, on
 * `stream`, as one submission where the driver allows (a cached two-kernel CUDA graph per
 * stream and kernel pair: one launch instead of two, ~5 us less host time per call on the
 * H200 hosts; DIFFKV_LAUNCH_GRAPH=0 launches them one by one).  Both are checked before either
 * is launched: an error leaves the cache untouched.  Same errors as the two calls. */
dk_status dk_cuda_layer(const dk_kv_write_args *w, const dk_attention_args *a, void *stream,
                        dk_error *err);

/* ------------------------------------------------------------------------------------------ */
/* Row copies (csrc/ref_attention.c): right-padded [B, T, ...] <-> packed [N, ...]             */
/* ------------------------------------------------------------------------------------------ */

/*
 * Packs or unpacks token rows of width `width` elements (a token is [num_heads, head_size]
 * flattened, inner strides given):
 *   gather:  dst[n] = src[index[n]]            for n < num_index
 *   scatter: dst[index[n]] = src[n], and every dst row not named by index is zeroed.
 */
typedef struct dk_rows_args {
    const void *src;
    int64_t src_stride_token, src_stride_head, src_stride_dim;
    void *dst;
    int64_t dst_stride_token, dst_stride_head, dst_stride_dim;
    const int64_t *index; /* [num_index] token indices into src (gather) or dst (scatter) */
    int64_t num_index;
    int64_t src_tokens; /* tokens in src */
    int64_t dst_tokens; /* tokens in dst */
    int64_t num_heads;
    int64_t head_size;
    dk_dtype dtype;
} dk_rows_args;
/* DK_ERR_VALUE when an index is out of range (nothing written). */
dk_status dk_ref_rows_gather(const dk_rows_args *a, dk_error *err);
dk_status dk_ref_rows_scatter(const dk_rows_args *a, dk_error *err);
dk_status dk_cuda_rows_gather(const dk_rows_args *a, void *stream, dk_error *err);
dk_status dk_cuda_rows_scatter(const dk_rows_args *a, void *stream, dk_error *err);

/* ------------------------------------------------------------------------------------------ */
/* CUDA runtime helpers (cuda/runtime.cu; stubs in csrc/nocuda.c for CPU-only builds)          */
/* ------------------------------------------------------------------------------------------ */

/* 1 when this build has the CUDA path compiled in.  Cannot fail. */
int dk_cuda_compiled(void);
/* Makes `device` current, remembering the previous device in *prev.  DK_ERR_CUDA. */
dk_status dk_cuda_device_enter(int32_t device, int32_t *prev, dk_error *err);
/* Restores the device saved by dk_cuda_device_enter.  Cannot fail (errors are ignored). */
void dk_cuda_device_exit(int32_t prev);
/* Copies n bytes device->host on `stream` and waits for them (setup paths only, never in a
 * layer call).  DK_ERR_CUDA. */
dk_status dk_cuda_copy_to_host(void *dst, const void *src, size_t n, void *stream, dk_error *err);
/* Whether work submitted to `stream` now would be captured into a CUDA graph (a query error
 * reads as yes); 0 in a CPU-only build.  Cannot fail. */
int dk_cuda_stream_capturing(void *stream);
/* Number of visible devices and the compute capability of one (0 when unknown). */
int dk_cuda_device_count(void);
int dk_cuda_capability(int32_t device);
/* The CUDA runtime version this build links (e.g. 13000), 0 in a CPU-only build. */
int dk_cuda_runtime_version(void);
/* The CUDA version the installed driver supports (e.g. 12080), 0 with no driver or in a CPU-only
 * build.  Cannot fail. */
int dk_cuda_driver_version(void);
/* Which tensor-core attention kernel fp16/bf16 calls run on the current device: "sm90-tma"
 * (compute capability 9.x with the sm_90a code built in and a driver that encodes TMA tensor
 * maps: head 128 on a cache with power-of-two blocks of 16+ keys and 16-byte rows takes the
 * TMA kernel, other calls the cp.async wgmma kernel), "sm90" (the cp.async wgmma kernel only;
 * also DIFFKV_ATTENTION_KERNEL=sm90), "sm80" (mma.sync; also DIFFKV_ATTENTION_KERNEL=sm80) or
 * "none" (no device, or a CPU-only build).  Cannot fail. */
const char *dk_cuda_attention_kernel(void);
/* The kernel the last CUDA attention call of this process launched: "sm90-tma", "sm90",
 * "sm80", "f32" (fp32 inputs), or "none" before the first.  Cannot fail. */
const char *dk_cuda_last_attention_kernel(void);

/* Which tensor-core attention kernels CUDA calls may take: DK_KERNEL_AUTO (the fastest the
 * device and the build allow), DK_KERNEL_SM90 (Hopper without the TMA kernel) or
 * DK_KERNEL_SM80 (mma.sync).  Read from DIFFKV_ATTENTION_KERNEL ("sm90", "sm80"; anything else
 * is auto) once, at the first call that asks, unless dk_set_attention_kernel came first: the
 * launchers ask on every call, and getenv scans the whole environment (~0.2 us in a process
 * with 300 variables).  Thread-safe; cannot fail. */
typedef enum { DK_KERNEL_AUTO = 0, DK_KERNEL_SM90 = 1, DK_KERNEL_SM80 = 2 } dk_kernel_choice;
dk_kernel_choice dk_attention_kernel_choice(void);
/* Sets the choice; returns the one it replaces. */
dk_kernel_choice dk_set_attention_kernel(dk_kernel_choice choice);

/* Head sizes the attention paths serve (the one place that says so; the paths check with it):
 *   - the CPU reference: any head_size in [1, DK_REF_MAX_HEAD_SIZE], every float dtype;
 *   - CUDA float32: any in [1, DK_CUDA_F32_MAX_HEAD] (attention_f32.cu's per-lane registers);
 *   - CUDA float16/bfloat16: DK_CUDA_HEAD_SIZES, the tensor-core kernels' instantiations (the
 *     mma.sync kernel's, attention_sm80.cu; on Hopper the wgmma kernels take 64 and 128);
 *     over a float8_e4m3fn cache the same sizes (the mma.sync kernel's e4m3 form at each, on
 *     Hopper the e4m3 wgmma kernel at 64 and 128).
 * A CPU-only build serves no CUDA head size. */
#define DK_REF_MAX_HEAD_SIZE 1024
#define DK_CUDA_F32_MAX_HEAD 256
/* X-macro lists, ascending: X(size) for each */
#define DK_CUDA_HEAD_SIZES(X) X(32) X(64) X(72) X(80) X(96) X(128) X(160) X(192) X(256)
/* Whether paged attention on device_type (DK_CPU or DK_CUDA) takes head_size for dtype (an
 * activation dtype: DK_F32, DK_F16, DK_BF16; anything else: 0) over a cache of the activation
 * dtype (kv_fp8 0) or a float8_e4m3fn one (kv_fp8 1: on CUDA fp16/bf16 queries only).  Cannot
 * fail. */
int dk_head_size_supported(int32_t device_type, dk_dtype dtype, int kv_fp8, int64_t head_size);

#ifdef __cplusplus
}
#endif

#endif /* DIFFKV_H */
