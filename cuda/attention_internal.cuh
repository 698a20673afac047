/*
 * attention_internal.cuh -- the private interface between the attention files of cuda/: the
 * dispatcher (attention.cu, which chooses the kernel for a call) and the files of the kernels
 * it launches.  Host-side constants the dispatcher and the kernels must agree on, and one
 * launcher per kernel family.  No device code.
 *
 * Every launcher takes the arguments dk_cuda_attention checked and computed (a call with
 * tokens, heads and rows, fp16/bf16 unless it says fp32, a grid that fits), launches on `s`
 * after the pending KV write a->pending (dk_launch_after) and returns the cudaGetDevice /
 * cudaFuncSetAttribute error of its set-up, or the launch's own; the caller reports it.
 */
#ifndef DIFFKV_ATTENTION_INTERNAL_CUH
#define DIFFKV_ATTENTION_INTERNAL_CUH

#include "cuda_common.cuh"
#include "diffkv.h"
#include "sm90_tma_map.cuh"

#include <cuda_runtime.h>

#include <stdint.h>

#define ATTN_BM 128         /* query rows per CTA of the sm90 kernels and attn_mma_bm's most */
#define ATTN_SORT_ROWS 64   /* batches of 2 .. this many rows are scheduled longest row first */
#define ATTN_MAX_DEVICES 64 /* devices whose kernel attributes are cached */
#define ATTN_HEAD_GROUP 8   /* least heads per scheduling group with a mask */
#define ATTN_F32_WARPS 4    /* warps per CTA of the fp32 kernel: one per (token, head) */
#define ATTN_F32_MAX_HEAD DK_CUDA_F32_MAX_HEAD

#define LOG2E 1.4426950408889634f

/*
 * The arguments every tensor-core kernel takes besides dk_attention_args: tiles_per_row query
 * tiles of ATTN_BM rows per batch row, head_group heads per scheduling group (attn_cta_place),
 * scale_log2 = |scale| * log2(e) > 0 (neg_q: the scale is negative, so q is negated instead),
 * and whether the query, the K/V cache and the output take 16-byte (q_vec, kv_vec) and 4-byte
 * (o_vec) vector accesses.
 */

/* Whether every output row of a fp16/bf16 call starts 16-byte aligned with contiguous dims: the
 * Hopper kernels' staged epilogue (h90_store_o_staged) then writes it.  Cannot fail. */
static inline bool
attn_out_rows16(const dk_attention_args *a)
{
    return a->o_stride_dim == 1 && (uintptr_t)a->out % 16 == 0 &&
           (a->o_stride_token * 2) % 16 == 0 && (a->o_stride_head * 2) % 16 == 0;
}

/* Query rows per CTA of the mma.sync kernel at head size `head`: ATTN_BM, or 64 above head 160
 * (one 16-row m-tile per warp: attention_sm80.cu's attn_tile). */
static constexpr int64_t
attn_mma_bm(int64_t head)
{
    return head > 160 ? 64 : ATTN_BM;
}

/* attention_f32.cu: the fp32 kernel over cdiv(num_tokens * num_heads, ATTN_F32_WARPS) CTAs
 * (`blocks`); scale_log2 = scale * log2(e), any sign. */
cudaError_t attn_f32_launch(const dk_attention_args *a, int64_t blocks, float scale_log2,
                            cudaStream_t s);

/* The mma.sync kernel's forms: the full tiles, half the keys per tile (a GPU whose shared memory
 * per SM takes two CTAs of those tiles but not of the full ones: an A100), and over an e4m3 cache
 * a CTA of twice the warps and query rows (attention_sm80.cuh's mma_wide_pays). */
typedef enum { ATTN_MMA_FULL, ATTN_MMA_HALF, ATTN_MMA_WIDE } attn_mma_form;

/* attention_sm80.cu: the mma.sync kernel, every head size of DK_CUDA_HEAD_SIZES (fp16/bf16
 * queries, over a cache of their dtype or an e4m3 one); tiles_per_row counts tiles of
 * attn_mma_bm(head size) rows.  *form: which form ran. */
cudaError_t attn_mma_launch(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group,
                            float scale_log2, bool neg_q, bool q_vec, bool kv_vec, bool o_vec,
                            cudaStream_t s, attn_mma_form *form);

/* attention_sm90.cu: whether the current device is compute capability 9.x and this binary
 * carries the sm90 kernels' sm_90a code (a build without that target has only trapping stubs),
 * cached per device.  Cannot fail (a CUDA error reads as no). */
bool attn_sm90_ready(void);

/* attention_sm90.cu: the wgmma kernel whose warpgroups load their own K/V ("sm90"), head 64 or
 * 128, any cache strides. */
cudaError_t attn_sm90_launch(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group,
                             float scale_log2, bool neg_q, bool q_vec, bool kv_vec, bool o_vec,
                             cudaStream_t s);

/* attention_sm90_ws.cu: the warp-specialized wgmma kernel, head 64 or 128 (and 32, 72, 80, 96,
 * 160, 192, 256 with m.dims.box 0: the cp.async producers), K/V rows in 16-byte chunks, fed as the
 * maps m say (m.dims.k_groups: per-chunk TMA boxes; else m.dims.box: per-block or flat TMA boxes;
 * 0: cp.async rows), in tiles of m.tile keys (176 only with TMA boxes at head 128).  It cuts its
 * own query tiles. */
cudaError_t attn_sm90_ws_launch(const dk_attention_args *a, const h90_maps &m, int64_t head_group,
                                float scale_log2, bool neg_q, bool q_vec, bool o_vec,
                                cudaStream_t s);

/* attention_sm90_persist.cu: the persistent form of the ws kernel over cdiv(items,
 * cdiv(items, sms)) CTAs (at most sms, each with the same number of items or one fewer):
 * head 128, the per-chunk TMA maps of m (m.dims.k_groups 1 or 2, one source), the query's and
 * the output's maps q and o (h90_persist_maps), 128-key tiles, mask none, rows of
 * a->uniform_query_len queries over a->uniform_seq_len keys, or each over its a->row_seq_lens. */
/* The persistent kernel's work items: one per ATTN_BM-row query tile of every row and head --
 * what attn_persist_ok bounds and what the launch spreads over its CTAs. */
static inline int64_t
attn_persist_items(const dk_attention_args *a)
{
    return a->num_heads * a->num_rows * dk_cdiv(a->uniform_query_len, ATTN_BM);
}

cudaError_t attn_sm90_persist_launch(const dk_attention_args *a, const h90_maps &m,
                                     const CUtensorMap &q, const CUtensorMap &o, int64_t head_group,
                                     float scale_log2, bool neg_q, int64_t sms, cudaStream_t s);

/* Multiprocessors of the current device, cached per device (0 on a CUDA error, cleared).
 * Cannot fail.  In attention.cu. */
int64_t attn_sm_count(void);

/* attention_sm90_fp8.cu(h): the e4m3 wgmma kernel over a float8_e4m3fn cache (a->kv_fp8), head 64
 * or 128, fp16/bf16 queries, K/V rows in 16-byte chunks; 128 query rows per CTA.  *tma: whether
 * its TMA producer ran (else cp.async rows). */
cudaError_t attn_sm90_fp8_launch(const dk_attention_args *a, int64_t head_group, float scale_log2,
                                 bool neg_q, bool q_vec, bool o_vec, cudaStream_t s, bool *tma);

/* Keys per box of the e4m3 kernel's TMA producer for the call's cache (head 64 or 128, one
 * source): 16 where the blocks are a multiple of 16 keys or every row has one block of at least
 * 16 (bt_cols 1: a chunk never crosses into another block, and the last one's keys past the
 * block arrive as zeros: the dense forward's one block per row), 8 at blocks of an odd multiple
 * of 8 keys, 0 otherwise (the cp.async producer). */
static inline int
h8_box_keys(const dk_attention_args *a)
{
    if (a->block_size % 16 == 0 || (a->bt_cols == 1 && a->block_size >= 16)) {
        return 16;
    }
    return a->block_size % 8 == 0 ? 8 : 0;
}

/* sm90_tma_map.cu: the per-chunk maps of a float8_e4m3fn cache for the e4m3 kernel's TMA
 * producer (one box of h8_box_keys keys x 128 bytes per chunk: head 64 or 128, one source, byte
 * strides under 2^40) into *k and *v, through a per-thread cache like h90_tma_maps's.  Returns
 * whether they exist (none where h8_box_keys is 0).  Cannot fail otherwise. */
bool h8_tma_chunk_maps(const dk_attention_args *a, CUtensorMap *k, CUtensorMap *v);

/* sm90_tma_map.cu: encodes (or finds in this host thread's cache of the last 64 caches) the
 * tensor maps that suit the cache of `a` for key tiles of `tile` keys (128 or 176) into *m, with
 * m->k_groups_ok saying whether the per-chunk maps exist, and returns the producer the other
 * maps allow (H90_CP_ASYNC with dims.box 0 when none; the caller has checked 16-byte K/V
 * chunks).  Cannot fail: a map the driver refuses only narrows the choice. */
h90_producer h90_tma_maps(const dk_attention_args *a, int32_t tile, h90_maps *m);

/* sm90_tma_map.cu: the tensor maps of the persistent kernel's query (its producer brings each
 * work item's 128 x 128 Q tile as two boxes) and output (each consumer warpgroup stores its 64
 * rows as two boxes) into *q and *o, for a call of uniform rows (a->uniform_query_len): 4 dims,
 * the rows apart, so that a box's rows past a row's end are zeros (Q) or not written (O).
 * Returns false when a layout cannot be mapped (a dim stride other than 1, a base or a token /
 * head stride not a multiple of 16 bytes) or the driver refuses it.  Cannot fail otherwise. */
bool h90_persist_maps(const dk_attention_args *a, CUtensorMap *q, CUtensorMap *o);

/* sm90_tma_map.cu: whether the driver has a tensor-map encoder (fetched once).  Cannot fail. */
bool h90_tma_encoder_ready(void);

#endif /* DIFFKV_ATTENTION_INTERNAL_CUH */
