/*
 * attention.cu -- paged attention on the GPU: checks a call's arguments and chooses the kernel
 * that serves it, the one place that does.
 *
 *   - fp32: the fp32 kernel (attention_f32.cu), any head_size up to ATTN_F32_MAX_HEAD.
 *   - fp16/bf16, head_size 64 or 128, on compute capability 9.x with the sm_90a code in the
 *     binary (unless the kernel choice is sm80):
 *       - K/V rows in 16-byte chunks (and the kernel choice not sm90): the warp-specialized
 *         kernel (attention_sm90_ws.cu), its producer chosen from the cache's tensor maps
 *         (sm90_tma_map.cu): one TMA box per 16-key chunk ("sm90-tma16") for every head-128
 *         cache those maps fold, per-block or flat TMA boxes ("sm90-tma") for large blocks and
 *         for tables of consecutive blocks, cp.async rows ("sm90-ws") for the rest; key tiles
 *         of 176 keys instead of 128 over long rows where TMA can cut them; short unmasked
 *         calls of uniform rows that the per-chunk boxes serve run its persistent form
 *         (attention_sm90_persist.cu, "sm90-persist": attn_persist_ok);
 *       - otherwise the wgmma kernel whose warpgroups load their own tiles (attention_sm90.cu,
 *         "sm90").
 *   - fp16/bf16, head_size 32, 72, 80, 96, 160, 192 or 256 on the same Hopper GPUs, K/V rows in
 *     16-byte chunks, kernel choice auto: the warp-specialized kernel with tiles of 64 (32),
 *     128 (72 to 96), 192 (160, 192) or 256 dims, the dims past head_size zeros, fed by its
 *     cp.async producers ("sm90-ws"; h90_cp_async_head) or, at 192 and 256 over caches of
 *     16-key chunks, by one TMA box per chunk ("sm90-tma16").
 *   - other fp16/bf16 calls, every head size of DK_CUDA_HEAD_SIZES (diffkv.h): the mma.sync
 *     kernel (attention_sm80.cu, "sm80"; "sm80-smallsmem": its form with half the keys per tile,
 *     on GPUs whose shared memory per SM takes two CTAs only of those, an A100); on Hopper too
 *     for the padded sizes' other calls.
 *   - a float8_e4m3fn cache (kv_fp8), fp16/bf16 queries, every head size of DK_CUDA_HEAD_SIZES,
 *     K/V rows in 16-byte chunks (8-byte at head 72): at 64 and 128 on the Hopper kernels the
 *     e4m3 wgmma kernel (attention_sm90_fp8.cuh; h8_head), fed by TMA boxes of 16-key
 *     chunks ("sm90-fp8-tma": blocks of a multiple of 16 keys or one block a row; 8-key chunks
 *     at blocks of an odd multiple of 8) or cp.async rows ("sm90-fp8"); elsewhere (the other
 *     sizes on Hopper too, and with the kernel choice sm80) the mma.sync kernel with the cache
 *     widened to fp16 in shared memory ("sm80-fp8", "sm80-fp8-smallsmem", or "sm80-fp8-wide":
 *     a CTA of eight warps and twice the query rows, where attention_sm80.cuh's mma_wide_pays);
 *     anything else over an fp8 cache is refused (NotImplementedError) before it runs.
 * docs/hopper-kernels.md has the measurements behind each rule.
 *
 * Masks: every mask is a per-token exclusive key limit L (key j visible iff j < L):
 *   NONE   L = seq_len
 *   CAUSAL L = clamp(i + seq_len - query_len + 1, 0, seq_len)  (i: index of the token in its row)
 *   LIMITS L = clamp(key_limits[t], 0, seq_len)
 * Key tiles at or past the largest L of a query tile are neither loaded nor computed; a token
 * with L == 0 gets zeros.
 *
 * LSE (optional, a.lse != NULL): the natural log-sum-exp of every (token, head)'s visible scaled
 * scores; -inf for a token that sees no key (context parallelism merges ranks' partial outputs
 * with it).
 *
 * Entry points: dk_cuda_attention, dk_cuda_attention_kernel, dk_cuda_last_attention_kernel
 * (diffkv.h).
 */
#include "attention_internal.cuh"
#include "cuda_common.cuh"
#include "diffkv.h"
#include "sm90_tma_map.cuh"

#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Per mille of a call's 128-key tiles that must be runs of consecutive blocks before 16-key and
 * smaller blocks of a flat cache take TMA boxes (H90_TMA_RUNS); below, boxes this small cost
 * more than cp.async rows. */
#define H90T_MIN_RUNS 250
/* Longest row (keys) from which head-128 calls take 176-key tiles: over shorter rows the
 * larger tile's savings do not cover its coarser masking and tail. */
#define H90_WIDE_MIN_KEYS 16384

/* Most work items (128-row query tiles of one head), in CTAs per SM, that a call may have to run
 * on the persistent kernel (attention_sm90_persist.cu): short calls, whose CTAs' fixed costs
 * weigh most. */
#define HP_MAX_WAVES 16

/* The kernel the last call launched, for dk_cuda_last_attention_kernel (a string literal). */
static const char *volatile attn_last_kernel = "none";

/* "32, 64, ..." of an X-macro list of head sizes, for messages. */
#define ATTN_HEAD_TEXT(d) ", " #d
static const char attn_heads_text[] = DK_CUDA_HEAD_SIZES(ATTN_HEAD_TEXT);
#undef ATTN_HEAD_TEXT

/* Whether the wgmma kernels (attention_sm90*.cu) take head_size.  Cannot fail. */
static bool
h90_head(int64_t head_size)
{
    return head_size == 64 || head_size == 128;
}

/* Whether the e4m3 wgmma kernel (attention_sm90_fp8.cuh) takes head_size over a float8_e4m3fn
 * cache; the other sizes run the mma.sync kernel's e4m3 form on Hopper too.  Cannot fail. */
static bool
h8_head(int64_t head_size)
{
    return head_size == 64 || head_size == 128;
}

/* Whether the warp-specialized wgmma kernel takes head_size with its cp.async producers only:
 * 192 and 256, and padded to tiles of 64 (32), 128 (72, 80, 96) or 192 (160) dims with zeros
 * past head_size -- its products skip most of the zeros (docs/head-sizes.md: 1.2 to 2.5x the
 * mma.sync kernel's speed at these sizes).  K/V rows must be in 16-byte chunks; other calls at
 * these sizes run the mma.sync kernel.  Cannot fail. */
static bool
h90_cp_async_head(int64_t head_size)
{
    return head_size == 32 || head_size == 72 || head_size == 80 || head_size == 96 ||
           head_size == 160 || head_size == 192 || head_size == 256;
}

/* Records the kernel a call launched.  Cannot fail. */
static void
attn_note(const char *kernel)
{
    attn_last_kernel = kernel;
}

/* Whether the Hopper kernels serve fp16/bf16 calls on the current device: compute capability
 * 9.x with their sm_90a code in the binary, unless the kernel choice is sm80
 * (DIFFKV_ATTENTION_KERNEL=sm80 or set_attention_kernel("sm80")).  Cannot fail. */
static bool
h90_ready(void)
{
    return dk_attention_kernel_choice() != DK_KERNEL_SM80 && attn_sm90_ready();
}

/* Whether head-128 calls may take the warp-specialized kernel (the kernel choice sm90 --
 * DIFFKV_ATTENTION_KERNEL=sm90 or set_attention_kernel("sm90") -- keeps them on the cp.async
 * wgmma kernel).  Cannot fail. */
static bool
h90_ws_allowed(void)
{
    return dk_attention_kernel_choice() != DK_KERNEL_SM90;
}

/* Whether a head-128 call on TMA boxes takes 176-key tiles (FlashAttention-3's choice: each
 * tile's fixed costs -- the barrier waits, the row maxima's shuffles, O's rescale -- spread over
 * 37 % more keys; 2 K + 2 V stages of them and Q fill 209 KB): rows of at least
 * H90_WIDE_MIN_KEYS keys, and a cache whose tiles TMA can cut at any multiple of 176 keys --
 * one block per row, 16-key blocks of a flat cache (per-block boxes, 11 per tile, or flat boxes
 * over runs) or smaller ones whose rows dense_attention's caller vouched consecutive (flat
 * boxes only); the per-chunk producer (sm90-tma16) cuts 176-key tiles of any cache it takes,
 * which attn_sm90 decides itself.  Two sources (dense joint tokens) keep 128: their split point
 * is a multiple of 128 keys.  Masked calls take them too, since 176-key tiles wait late for
 * P V (attention_sm90_ws.cu).  Cannot fail. */
static bool
h90_wide_tiles(const dk_attention_args *a)
{
    if (a->head_size != 128 || a->key_cache2 != NULL || a->max_seq_len < H90_WIDE_MIN_KEYS) {
        return false;
    }
    const int64_t bs = a->block_size;
    const bool one_block = a->bt_cols == 1 && bs >= 128;
    const bool flat = a->cache_stride_block == bs * h90_row_stride(a);
    const bool flat16 = bs == 16 && flat;
    /* smaller power-of-two blocks whose rows the caller vouched consecutive (dense K/V): flat
     * boxes of any length */
    const bool vouched = (a->keys_consecutive & DK_CONSECUTIVE_TILES) != 0 && flat && bs < 16 &&
                         (bs & (bs - 1)) == 0;
    return one_block || flat16 || vouched;
}

/* attn_sm_count (attention_internal.cuh) */
int64_t
attn_sm_count(void)
{
    static volatile int counts[ATTN_MAX_DEVICES];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    const bool cached = dev >= 0 && dev < ATTN_MAX_DEVICES;
    if (cached && counts[dev] > 0) {
        return counts[dev];
    }
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (cached) {
        counts[dev] = n;
    }
    return n;
}

/* Whether a head-128 call that the per-chunk TMA producer serves in 128-key tiles (maps m) runs
 * on the persistent kernel, over `sms` multiprocessors: rows that share one query length and one
 * seq_len, or up to DK_ROW_SEQ_LENS rows of one query length (a CFG pair: 1.09-1.11x cuDNN
 * against 1.05-1.08x on one CTA per tile at 1k-4k queries) -- the host copies say so: the
 * kernel takes them as parameters --, mask none (every row
 * sees all its keys: no limits to read; causal rows, whose tiles differ in cost, ran 10-30 %
 * slower on its static round-robin of items), one source, at most HP_MAX_WAVES items per SM, a
 * last query tile at least half full, and the stream not being captured -- a graph replays its
 * parameters, while the device metadata may change between replays.  (The caller then needs the
 * query's and the output's TMA maps: h90_persist_maps.)  Cannot fail. */
static bool
attn_persist_ok(const dk_attention_args *a, const h90_maps &m, int64_t sms, cudaStream_t s)
{
    if (a->head_size != 128 || m.tile != 128 || (m.dims.k_groups != 1 && m.dims.k_groups != 2) ||
        a->key_cache2 != NULL || a->uniform_query_len <= 0 || sms <= 0 || a->mask != DK_MASK_NONE) {
        return false;
    }
    /* rows of different seq_lens: each passed by value (0s past DK_ROW_SEQ_LENS rows) and with
     * keys (a row without any: nothing to pipeline) */
    for (int64_t r = 0; r < a->num_rows && a->uniform_seq_len <= 0; r++) {
        if (a->row_seq_lens[r] <= 0) {
            return false;
        }
    }
    const int64_t items = attn_persist_items(a);
    /* A last query tile under half full (4097 queries: one row) measured 4-5 % slower than one
     * CTA per tile, for a reason not found (hopper-kernels.md, *The persistent form*). */
    const int64_t tail = a->uniform_query_len % ATTN_BM;
    if (items > HP_MAX_WAVES * sms || (tail != 0 && tail < ATTN_BM / 2)) {
        return false;
    }
    return !dk_cuda_stream_capturing(s);
}

/*
 * Launches a checked fp16/bf16 call on the Hopper kernels (arguments as dk_cuda_attention
 * computed them; kv_vec: K/V rows in 16-byte chunks) and records which one ran.  Returns
 * DK_ERR_CUDA with the launch's error in err, else DK_OK.
 */
static dk_status
attn_sm90(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group, float scale_log2,
          bool neg_q, bool q_vec, bool kv_vec, bool o_vec, void *stream, dk_error *err)
{
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t e;
    h90_maps m;
    const char *kernel = "sm90";
    if (h90_cp_async_head(a->head_size)) { /* the caller checked kv_vec and h90_ws_allowed */
        memset(&m, 0, sizeof(m));          /* box 0, no maps: the cp.async producers */
        kernel = "sm90-ws";
        if ((a->head_size == 192 || a->head_size == 256) && a->key_cache2 == NULL) {
            /* A cache of 16-key chunks in a layout the 5-d maps fold (NHD, HND, layer-strided):
             * one box per chunk for K and for V, as head 128's sm90-tma16 -- no copies on the
             * load/store pipe, and the producer's registers go to the consumers (with the late
             * P V wait 1.11-1.22x cuDNN at 16k against 0.90-1.00 with cp.async,
             * docs/head-sizes.md).  Dense sources' vouched chunks (k_groups_ok 3) keep
             * cp.async. */
            h90_maps t;
            (void)h90_tma_maps(a, 128, &t);
            if (t.k_groups_ok == 1 || t.k_groups_ok == 2) {
                m.k = t.k_groups;
                m.v = t.v_groups;
                m.dims.k_groups = t.k_groups_ok;
                kernel = "sm90-tma16";
            }
        }
        e = attn_sm90_ws_launch(a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    }
    else if (kv_vec && h90_ws_allowed()) {
        /* TMA boxes when the cache suits them, else the cp.async producer (box 0) */
        int64_t sms = 0;
        bool persist = false;
        CUtensorMap qm, om; /* the query's and the output's maps, for the persistent kernel */
        const int32_t tile = h90_wide_tiles(a) ? 176 : 128;
        h90_producer pr = h90_tma_maps(a, tile, &m);
        m.tile = tile;
        if (m.k_groups_ok != 0) {
            /* Head 128, 16-key chunks within blocks, a layout the 5-d maps fold (NHD, HND,
             * layer-strided): one box per chunk for K and for V, in any block order, cut into
             * 176-key tiles over long rows.  It beats every other producer on the caches it
             * takes: random 16-key tables, allocation order (against flat boxes) and 128-key
             * blocks (against a 4-d map's per-half boxes). */
            memset(&m.dims, 0, sizeof(m.dims));
            m.k = m.k_groups;
            m.v = m.v_groups;
            m.flat_k2 = m.k_groups2; /* the flat chunks' second source (tfk2 / tfv2) */
            m.flat_v2 = m.v_groups2;
            m.dims.k_groups = m.k_groups_ok;
            m.tile = a->max_seq_len >= H90_WIDE_MIN_KEYS ? 176 : 128;
            kernel = "sm90-tma16";
            sms = attn_sm_count();
            persist = attn_persist_ok(a, m, sms, s) && h90_persist_maps(a, &qm, &om);
            if (persist) {
                kernel = "sm90-persist";
            }
        }
        else {
            /* Head 64 takes 16-key blocks through the block-group cp.async producer even
             * when their tiles are runs: it beats the 128-row flat boxes there. */
            const bool cp_d64 = pr == H90_TMA_RUNS && a->head_size == 64 && a->block_size >= 16;
            if (cp_d64 || (pr == H90_TMA_RUNS && a->table_runs < H90T_MIN_RUNS) ||
                (pr == H90_TMA_ALL_RUNS && a->table_runs < DK_TABLE_RUNS_ALL)) {
                memset(&m.dims, 0, sizeof(m.dims)); /* box 0, 128-key tiles, no flat map */
                m.tile = 0;
                pr = H90_CP_ASYNC;
            }
            kernel = pr == H90_CP_ASYNC ? "sm90-ws" : "sm90-tma";
        }
        e = persist ? attn_sm90_persist_launch(a, m, qm, om, head_group, scale_log2, neg_q, sms, s)
                    : attn_sm90_ws_launch(a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    }
    else {
        e = attn_sm90_launch(a, tiles_per_row, head_group, scale_log2, neg_q, q_vec, kv_vec, o_vec,
                             s);
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* reported here: not the next call's error */
        return dk_fail(err, DK_ERR_CUDA, "paged_attention(): CUDA error %s (%d)",
                       cudaGetErrorString(e), (int)e);
    }
    attn_note(kernel);
    return dk_cuda_after_launch("paged_attention()", stream, err);
}

/* Whether `bytes` is a multiple of 16.  Cannot fail. */
static bool
aligned16(int64_t bytes)
{
    return bytes % 16 == 0;
}

/* Whether p is 16-byte aligned.  Cannot fail. */
static bool
ptr_aligned16(const void *p)
{
    return (uintptr_t)p % 16 == 0;
}

/* Whether the K/V caches' rows are whole chunks of `unit` bytes (elements of es bytes):
 * contiguous head dims, storage and block, token and head strides that are multiples of unit.
 * Cannot fail. */
static bool
kv_rows_in_chunks(const dk_attention_args *a, int64_t es, int64_t unit)
{
    const void *p[4] = {a->key_cache, a->value_cache, a->key_cache2, a->value_cache2};
    for (int i = 0; i < 4; i++) {
        if ((uintptr_t)p[i] % (uint64_t)unit != 0) {
            return false;
        }
    }
    return a->cache_stride_dim == 1 && a->cache_stride_block * es % unit == 0 &&
           a->cache_stride_token * es % unit == 0 && a->cache_stride_head * es % unit == 0;
}

/* Whether `bytes` is a multiple of 4.  Cannot fail. */
static bool
aligned4(int64_t bytes)
{
    return bytes % 4 == 0;
}

/*
 * Launches a checked fp16/bf16 call over a float8_e4m3fn cache, or refuses it with
 * DK_ERR_NOT_IMPLEMENTED before anything runs (K/V rows not in 16-byte chunks -- 8-byte at head
 * 72, whose rows are 72 bytes): on the Hopper kernels (compute
 * capability 9.x, sm_90a code, kernel choice not sm80) at head 64 and 128 the e4m3 wgmma kernel
 * (attention_sm90_fp8.cuh), elsewhere the mma.sync kernel's fp8 form (attention_sm80.cu,
 * "sm80-fp8": e4m3 widened to fp16 in shared memory).  Returns DK_ERR_CUDA with the launch's error
 * in err, else DK_OK.
 */
static dk_status
attn_fp8(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group, float scale_log2,
         bool neg_q, bool q_vec, bool o_vec, void *stream, dk_error *err)
{
    /* e4m3: one byte per element, so 16-byte chunks are 16 elements; head 72's 72-byte rows need
     * only 8-byte alignment (the mma.sync form stages each whole, at its offset from 16) */
    const int64_t unit = a->head_size % 16 == 0 ? 16 : 8;
    if (!kv_rows_in_chunks(a, 1, unit)) {
        return dk_fail(err, DK_ERR_NOT_IMPLEMENTED,
                       "paged_attention(): a float8_e4m3fn kv_cache must have contiguous head "
                       "dims, %d-byte aligned storage and block, token and head strides that "
                       "are multiples of %d on CUDA",
                       (int)unit, (int)unit);
    }
    const char *kernel = "sm80-fp8";
    attn_mma_form form = ATTN_MMA_FULL;
    cudaError_t e;
    if (h90_ready() && h8_head(a->head_size)) {
        bool tma = false;
        e = attn_sm90_fp8_launch(a, head_group, scale_log2, neg_q, q_vec, o_vec,
                                 (cudaStream_t)stream, &tma);
        kernel = tma ? "sm90-fp8-tma" : "sm90-fp8";
    }
    else {
        e = attn_mma_launch(a, tiles_per_row, head_group, scale_log2, neg_q, q_vec, true, o_vec,
                            (cudaStream_t)stream, &form);
        kernel = form == ATTN_MMA_WIDE   ? "sm80-fp8-wide"
                 : form == ATTN_MMA_HALF ? "sm80-fp8-smallsmem"
                                         : "sm80-fp8";
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* reported here: not the next call's error */
        return dk_fail(err, DK_ERR_CUDA, "paged_attention(): CUDA error %s (%d)",
                       cudaGetErrorString(e), (int)e);
    }
    attn_note(kernel);
    return dk_cuda_after_launch("paged_attention()", stream, err);
}

/* diffkv.h's contract: the kernel family fp16/bf16 calls take on the current device. */
extern "C" const char *
dk_cuda_attention_kernel(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        (void)cudaGetLastError();
        return "none";
    }
    if (!h90_ready()) {
        return "sm80";
    }
    return h90_ws_allowed() && h90_tma_encoder_ready() ? "sm90-tma" : "sm90";
}

/* diffkv.h's contract: the kernel the last call launched. */
extern "C" const char *
dk_cuda_last_attention_kernel(void)
{
    return attn_last_kernel;
}

/* diffkv.h's contract: checks the call (dtype, head size, mask, shapes the kernels take),
 * chooses the kernel and launches it on `stream` after the pending KV write. */
extern "C" dk_status
dk_cuda_attention(const dk_attention_args *a, void *stream, dk_error *err)
{
    const char *op = "paged_attention()";
    if (a->dtype != DK_F32 && a->dtype != DK_F16 && a->dtype != DK_BF16) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "paged_attention(): dtype must be one of float32, float16, bfloat16, "
                       "got %s",
                       dk_dtype_name(a->dtype));
    }
    if (a->dtype == DK_F32) {
        if (a->head_size < 1 || a->head_size > ATTN_F32_MAX_HEAD) {
            return dk_fail(err, DK_ERR_UNSUPPORTED,
                           "paged_attention(): head_size must be between 1 and %d for float32 "
                           "on CUDA, got %lld",
                           ATTN_F32_MAX_HEAD, (long long)a->head_size);
        }
    }
    else if (!dk_head_size_supported(DK_CUDA, a->dtype, 0, a->head_size)) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "paged_attention(): head_size must be one of %s for float16/bfloat16 on "
                       "CUDA, got %lld",
                       attn_heads_text + 2, (long long)a->head_size);
    }
    if (a->mask != DK_MASK_NONE && a->mask != DK_MASK_CAUSAL && a->mask != DK_MASK_LIMITS) {
        return dk_fail(err, DK_ERR_VALUE, "paged_attention(): mask must be 0, 1 or 2, got %d",
                       (int)a->mask);
    }
    if (a->mask == DK_MASK_LIMITS && a->key_limits == NULL && a->num_tokens > 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "paged_attention(): key_limits must be given for the limits mask, "
                       "got None");
    }
    if (a->num_tokens <= 0 || a->num_heads <= 0 || a->num_rows <= 0) {
        return DK_OK;
    }
    if (a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads != 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "paged_attention(): num_heads must be a multiple of num_kv_heads, got "
                       "%lld and %lld",
                       (long long)a->num_heads, (long long)a->num_kv_heads);
    }
    if (a->block_size <= 0 || a->block_size > INT32_MAX) {
        return dk_fail(err, DK_ERR_VALUE,
                       "paged_attention(): block_size must be in [1, %d], got %lld", INT32_MAX,
                       (long long)a->block_size);
    }
    if (a->max_query_len <= 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "paged_attention(): max_query_len must be positive when num_tokens > 0, "
                       "got %lld",
                       (long long)a->max_query_len);
    }
    const float scale_log2 = a->scale * LOG2E;
    /* The tensor-core kernel wants a positive scale: a negative one negates q instead, and 0
     * becomes a scale so small that every score rounds to the same probability. */
    const bool neg_q = a->scale < 0.0f;
    float mma_scale_log2 = fabsf(scale_log2);
    if (mma_scale_log2 < 1e-30f) {
        mma_scale_log2 = 1e-30f;
    }
    cudaStream_t s = (cudaStream_t)stream;

    if (a->kv_fp8 && a->dtype == DK_F32) {
        return dk_fail(err, DK_ERR_NOT_IMPLEMENTED,
                       "paged_attention(): a float8_e4m3fn kv_cache takes float16/bfloat16 "
                       "queries on CUDA, got float32");
    }
    if (a->dtype == DK_F32) {
        int64_t blocks = dk_cdiv(a->num_tokens * a->num_heads, ATTN_F32_WARPS);
        if (blocks > DK_MAX_GRID_X) {
            return dk_fail(err, DK_ERR_UNSUPPORTED,
                           "paged_attention(): num_tokens * num_heads must be at most %lld, got "
                           "%lld",
                           (long long)(DK_MAX_GRID_X * ATTN_F32_WARPS),
                           (long long)(a->num_tokens * a->num_heads));
        }
        /* the launch's error, if any, is read by dk_cuda_after_launch */
        (void)attn_f32_launch(a, blocks, scale_log2, s);
        attn_note("f32");
        return dk_cuda_after_launch(op, stream, err);
    }

    /* query rows per CTA: ATTN_BM for every kernel but the mma.sync one above head 160 */
    const int64_t bm = attn_mma_bm(a->head_size);
    const int64_t tiles_per_row = dk_cdiv(a->max_query_len, bm);
    if (tiles_per_row * a->num_rows > DK_MAX_GRID_X / a->num_heads) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "paged_attention(): num_heads * num_rows * cdiv(max_query_len, %lld) must "
                       "be at most %lld, got %lld * %lld * %lld",
                       (long long)bm, (long long)DK_MAX_GRID_X, (long long)a->num_heads,
                       (long long)a->num_rows, (long long)tiles_per_row);
    }
    const int64_t es = 2;
    const bool q_vec = a->q_stride_dim == 1 && ptr_aligned16(a->query) &&
                       aligned16(a->q_stride_token * es) && aligned16(a->q_stride_head * es);
    const bool kv_vec = kv_rows_in_chunks(a, es, 16);
    const bool o_vec = a->o_stride_dim == 1 && (uintptr_t)a->out % 4 == 0 &&
                       aligned4(a->o_stride_token * es) && aligned4(a->o_stride_head * es);
    /* Heads per scheduling group (attn_cta_place): the GQA group without a mask (every tile
     * costs the same, so a group's K/V is all that needs to stay in L2); with a mask the
     * smallest multiple of it dividing num_heads that is >= ATTN_HEAD_GROUP, so that tiles
     * of very different cost are spread over enough CTAs to run longest first. */
    const int64_t group = a->num_heads / a->num_kv_heads;
    int64_t hg = group;
    if (a->mask != DK_MASK_NONE) {
        while (hg < ATTN_HEAD_GROUP || a->num_heads % hg != 0) {
            hg += group; /* ends at num_heads at the latest */
            if (hg >= a->num_heads) {
                hg = a->num_heads;
                break;
            }
        }
    }
    if (a->kv_fp8) {
        return attn_fp8(a, tiles_per_row, hg, mma_scale_log2, neg_q, q_vec, o_vec, stream, err);
    }
    if (h90_ready() && (h90_head(a->head_size) ||
                        (h90_cp_async_head(a->head_size) && kv_vec && h90_ws_allowed()))) {
        return attn_sm90(a, tiles_per_row, hg, mma_scale_log2, neg_q, q_vec, kv_vec, o_vec, stream,
                         err);
    }
    attn_mma_form form = ATTN_MMA_FULL;
    const cudaError_t e = attn_mma_launch(a, tiles_per_row, hg, mma_scale_log2, neg_q, q_vec,
                                          kv_vec, o_vec, s, &form);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* reported here: not the next call's error */
        return dk_fail(err, DK_ERR_CUDA, "%s: CUDA error %s (%d)", op, cudaGetErrorString(e),
                       (int)e);
    }
    attn_note(form == ATTN_MMA_HALF ? "sm80-smallsmem" : "sm80");
    return dk_cuda_after_launch(op, stream, err);
}
