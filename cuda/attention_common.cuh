/*
 * attention_common.cuh -- device helpers shared by the attention kernels (attention_f32.cu,
 * attention_sm80.cu, attention_sm90.cu, attention_sm90_ws.cu and the sm90_*.cuh headers): the key
 * limits of the masks, fp16/bf16 packing and mma.sync, exp2, ldmatrix, cp.async, the clamped
 * row spans and block ids, the per-key cache offsets, the CTA schedule, the row-wise output
 * store, and the launchers' shared-memory attribute.  Everything is static (each translation
 * unit gets its own copy).
 */
#ifndef DIFFKV_ATTENTION_COMMON_CUH
#define DIFFKV_ATTENTION_COMMON_CUH

#include "attention_internal.cuh"
#include "diffkv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

/* ------------------------------------------------------------------------------------------ */
/* Masks                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* Exclusive key limit of query token i of a row (packed token t): key j is visible iff j is
 * below it (the masks of dk_mask, attention.cu's file comment).  Cannot fail. */
static __device__ int32_t
key_limit(const dk_attention_args &a, int64_t t, int64_t i, int64_t query_len, int64_t seq_len)
{
    int64_t lim;
    if (a.mask == DK_MASK_CAUSAL) {
        lim = i + seq_len - query_len + 1;
    }
    else if (a.mask == DK_MASK_LIMITS) {
        lim = a.key_limits[t];
    }
    else {
        lim = seq_len;
    }
    lim = lim < seq_len ? lim : seq_len;
    lim = lim > 0 ? lim : 0;
    return (int32_t)lim;
}

/* ------------------------------------------------------------------------------------------ */
/* fp16 / bf16 helpers                                                                         */
/* ------------------------------------------------------------------------------------------ */

template <typename T> struct half_ops;

template <> struct half_ops<__half> {
    static __device__ uint32_t pack(float lo, float hi)
    {
        __half2 v = __floats2half2_rn(lo, hi); /* .x (low 16 bits) = lo */
        return *reinterpret_cast<uint32_t *>(&v);
    }
    static __device__ uint16_t bits(float f)
    {
        return __half_as_ushort(__float2half_rn(f));
    }
    static __device__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

template <> struct half_ops<__nv_bfloat16> {
    static __device__ uint32_t pack(float lo, float hi)
    {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x (low 16 bits) = lo */
        return *reinterpret_cast<uint32_t *>(&v);
    }
    static __device__ uint16_t bits(float f)
    {
        return __bfloat16_as_ushort(__float2bfloat16_rn(f));
    }
    static __device__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

/* 2^x on the special-function unit (2^-inf = 0). */
static __device__ __forceinline__ float
fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* The shared-memory address of generic pointer p into shared memory. */
static __device__ uint32_t
smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/*
 * ldmatrix x4 at shared address `addr` (this lane's row address): lanes 8m..8m+7 give the 8
 * row addresses (16 contiguous bytes each) of 8x8 matrix m; r[m] receives, in lane l, elements
 * (row l/4, cols 2(l%4), 2(l%4)+1) of matrix m (lower column in the low half).  With .trans
 * it receives (rows 2(l%4), 2(l%4)+1, col l/4).
 */
static __device__ __forceinline__ void
ldsm_x4(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

/* ldsm_x4 with .trans (see there). */
static __device__ __forceinline__ void
ldsm_x4_trans(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

/* 16-byte cp.async to shared address dst; src_bytes 0 fills the 16 bytes with zeros. */
static __device__ __forceinline__ void
cp_async16(uint32_t dst, const void *src, uint32_t src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

/* Closes the group of cp.async issued by this thread since the last commit. */
static __device__ __forceinline__ void
cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Waits until every cp.async group of this thread has landed. */
static __device__ __forceinline__ void
cp_async_wait_all(void)
{
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

/* One 16-byte chunk of 8 fp16/bf16 elements `stride` elements apart, read now with plain loads
 * (element 2e in the low half of word e, as in memory: little endian). */
static __device__ __forceinline__ uint4
gather_chunk(const uint16_t *src, int64_t stride)
{
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        w[e] = (uint32_t)src[2 * e * stride] | ((uint32_t)src[(2 * e + 1) * stride] << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* gather_chunk into shared memory at generic address dst. */
static __device__ void
load_chunk_sync(uint16_t *dst, const uint16_t *src, int64_t stride)
{
    *reinterpret_cast<uint4 *>(dst) = gather_chunk(src, stride);
}

/* 16 bytes to shared address `addr`. */
static __device__ __forceinline__ void
st_shared16(uint32_t addr, uint4 v)
{
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

/* 16 zero bytes to shared memory at generic address dst. */
static __device__ void
zero_chunk(uint16_t *dst)
{
    *reinterpret_cast<uint4 *>(dst) = make_uint4(0u, 0u, 0u, 0u);
}

/* ------------------------------------------------------------------------------------------ */
/* fp16 / bf16 tensor-core kernel                                                              */
/* ------------------------------------------------------------------------------------------ */

/* Start and length of row `row`'s queries with both ends clamped to [0, num_tokens]: device
 * offsets that disagree with the checked host copy cannot move Q/O accesses out of the
 * tensors.  Cannot fail. */
static __device__ __forceinline__ void
row_span(const dk_attention_args &a, int64_t row, int64_t *start, int64_t *len)
{
    const int64_t n = a.num_tokens;
    const int64_t s0 = min(max((int64_t)a.query_start_loc[row], (int64_t)0), n);
    const int64_t s1 = min(max((int64_t)a.query_start_loc[row + 1], s0), n);
    *start = s0;
    *len = s1 - s0;
}

/* A block id the host check passed; clamped to a real block in case the device table differs
 * from the host copy that was checked (memory stays in bounds, never out of the cache). */
static __device__ __forceinline__ int32_t
dk_safe_block(const dk_attention_args &a, int32_t block)
{
    return (uint32_t)block < (uint64_t)a.num_blocks ? block : 0;
}

/*
 * Key limit of query row r of the CTA's tile (0 past the row's end, q0 + r >= query_len, and
 * with TE past the tile's, q0 + r >= tile_end: a half tile's), stored to s_lim[r]; *wmax and *wmin
 * receive the largest and smallest limits over the calling warp's rows (every lane of the warp
 * must call, for rows 32w .. 32w + 31).
 */
template <bool TE = false>
static __device__ __forceinline__ void
attn_row_limit(const dk_attention_args &a, int r, int64_t q0, int64_t q_start, int64_t query_len,
               int64_t seq_len, int32_t *s_lim, int32_t *wmax, int32_t *wmin, int64_t tile_end = 0)
{
    const int64_t my_i = q0 + r;
    const int32_t my_lim = my_i < query_len && (!TE || my_i < tile_end)
                               ? key_limit(a, q_start + my_i, my_i, query_len, seq_len)
                               : 0;
    int32_t hi = my_lim, lo = my_lim;
#pragma unroll
    for (int sh = 16; sh > 0; sh >>= 1) {
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, sh));
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, sh));
    }
    s_lim[r] = my_lim;
    *wmax = hi;
    *wmin = lo;
}

/* attn_row_limit of row r (every lane of the warp calls; lane: r % 32) with the warp's largest
 * and smallest limits stored to s_wmax[r / 32] and s_wmin[r / 32] by its lane 0. */
template <bool TE = false>
static __device__ __forceinline__ void
attn_warp_limits(const dk_attention_args &a, int r, int lane, int64_t q0, int64_t q_start,
                 int64_t query_len, int64_t seq_len, int32_t *s_lim, int32_t *s_wmax,
                 int32_t *s_wmin, int64_t tile_end = 0)
{
    int32_t wmax, wmin;
    attn_row_limit<TE>(a, r, q0, q_start, query_len, seq_len, s_lim, &wmax, &wmin, tile_end);
    if (lane == 0) {
        s_wmax[r / 32] = wmax;
        s_wmin[r / 32] = wmin;
    }
}

/* The largest key limit over the CTA's BM rows: the furthest key any of them sees (after the
 * barrier that published attn_warp_limits's s_wmax). */
template <int BM>
static __device__ __forceinline__ int32_t
attn_kv_end(const int32_t *s_wmax)
{
    int32_t kv_end = s_wmax[0];
#pragma unroll
    for (int w = 1; w < BM / 32; w++) {
        kv_end = max(kv_end, s_wmax[w]);
    }
    return kv_end;
}

/* Byte offset of token `tok` of (safe) block `block`, head kv_head, in a cache of ES-byte
 * elements (2, or 1 for e4m3 with 16-byte aligned rows: the offset stays even); odd (+1) when
 * the block is the second source's (dense joint tokens): kv_row reads it back. */
template <int ES = 2>
static __device__ __forceinline__ int64_t
kv_block_offset(const dk_attention_args &a, int32_t block, uint32_t tok, int64_t kv_head)
{
    const bool second = a.key_cache2 != NULL && block >= a.blocks2;
    const int64_t b = second ? block - a.blocks2 : block;
    return (b * a.cache_stride_block + (int64_t)tok * a.cache_stride_token +
            kv_head * a.cache_stride_head) *
               ES +
           (second ? 1 : 0);
}

/* The address of a K (or V) row from its kv_block_offset: base is key_cache (value_cache),
 * base2 the second source's. */
static __device__ __forceinline__ const char *
kv_row(const char *base, const char *base2, int64_t off)
{
    return (off & 1) ? base2 + (off - 1) : base + off;
}

/* kv_block_offset<ES> of key j of the row (head kv_head), or 0 (a harmless address, never
 * read) when j >= kv_end. */
template <int ES = 2>
static __device__ int64_t
kv_key_offset(const dk_attention_args &a, const int32_t *bt, int64_t kv_head, int32_t j,
              int32_t kv_end)
{
    if (j >= kv_end) {
        return 0;
    }
    const uint32_t bs = (uint32_t)a.block_size;
    const uint32_t uj = (uint32_t)j;
    return kv_block_offset<ES>(a, dk_safe_block(a, bt[uj / bs]), uj % bs, kv_head);
}

/*
 * Head, batch row and reversed query tile of CTA `bid`.  grid.x is numbered, fastest first:
 * head within a group of head_group heads (a multiple of the GQA group, dividing num_heads),
 * query tile from the last (most keys) to the first, head group, batch row.  So the CTAs that
 * run together share the K/V of a few kv heads (they stay in L2), and within a group the
 * tiles with the most keys start first.  With sort_rows (2 to ATTN_SORT_ROWS rows) the rows
 * are taken in order of decreasing seq_len (ties by index), so the rows with the most keys
 * are scheduled first and the grid ends on the short rows' tiles.  Called by every thread
 * (it has a barrier when sorting).
 */
static __device__ void
attn_cta_place(const dk_attention_args &a, int64_t bid, int64_t tiles_per_row, int64_t head_group,
               bool sort_rows, int32_t *s_row, int64_t *h, int64_t *row, int64_t *tile_rev)
{
    const uint32_t hg = (uint32_t)head_group;
    const uint32_t tpr = (uint32_t)tiles_per_row;
    const uint32_t groups = (uint32_t)a.num_heads / hg;
    const uint32_t ub = (uint32_t)bid;
    const uint32_t h_in = ub % hg;
    uint32_t rest = ub / hg;
    *tile_rev = rest % tpr;
    rest /= tpr;
    *h = (rest % groups) * hg + h_in;
    const int64_t rank = rest / groups;
    if (!sort_rows) {
        *row = rank;
        return;
    }
    const int tid = (int)threadIdx.x;
    if (tid < a.num_rows) {
        const int32_t mine = a.seq_lens[tid];
        int64_t before = 0;
        for (int r = 0; r < (int)a.num_rows; r++) {
            const int32_t other = a.seq_lens[r];
            before += other > mine || (other == mine && r < tid);
        }
        if (before == rank) {
            *s_row = tid;
        }
    }
    __syncthreads();
    *row = *s_row;
}

/*
 * The start every tensor-core kernel makes (every thread calls it: attn_cta_place may hold a
 * barrier): the CTA's head h and batch row, its tile's first query row q0 (bm rows per tile),
 * the row's queries [q_start, q_start + query_len) and its seq_len, bounded by the block table's
 * reach whatever the device seq_lens says, for the CTA placed at grid index bid.  Returns false,
 * uniformly over the CTA, when the tile lies past the row's end (the CTA then exits).
 */
struct attn_cta {
    int64_t h, row, q0, q_start, query_len, seq_len;
};

static __device__ __forceinline__ bool
attn_cta_begin_at(const dk_attention_args &a, int64_t bid, int64_t tiles_per_row,
                  int64_t head_group, bool sort_rows, int64_t bm, int32_t *s_row, attn_cta *c)
{
    int64_t tile_rev;
    attn_cta_place(a, bid, tiles_per_row, head_group, sort_rows, s_row, &c->h, &c->row, &tile_rev);
    c->q0 = (tiles_per_row - 1 - tile_rev) * bm;
    row_span(a, c->row, &c->q_start, &c->query_len);
    if (c->q0 >= c->query_len) {
        return false;
    }
    c->seq_len = min((int64_t)a.seq_lens[c->row], a.bt_cols * a.block_size);
    return true;
}

/* attn_cta_begin_at for the CTA's own place in the grid */
static __device__ __forceinline__ bool
attn_cta_begin(const dk_attention_args &a, int64_t tiles_per_row, int64_t head_group,
               bool sort_rows, int64_t bm, int32_t *s_row, attn_cta *c)
{
    return attn_cta_begin_at(a, blockIdx.x, tiles_per_row, head_group, sort_rows, bm, s_row, c);
}

/* Where a CTA's output tile lands, recomputed after the key loop (arithmetic and loads rather
 * than registers held across it): the head, the packed token of the tile's first query row and
 * the number of the tile's rows inside its batch row (bm: query rows per CTA). */
static __device__ __forceinline__ void
attn_out_tile(const dk_attention_args &a, int64_t tiles_per_row, int64_t head_group, bool sort_rows,
              int32_t *s_row, int64_t bm, int64_t *h, int64_t *t0, int64_t *tile_rows)
{
    int64_t row, tile_rev;
    attn_cta_place(a, blockIdx.x, tiles_per_row, head_group, false, s_row, h, &row, &tile_rev);
    if (sort_rows) {
        row = *s_row;
    }
    const int64_t q0 = (tiles_per_row - 1 - tile_rev) * bm;
    int64_t start, len;
    row_span(a, row, &start, &len);
    *t0 = start + q0;
    *tile_rows = len - q0;
}

/*
 * Writes output row t of head h from the accumulator layout both tensor-core kernels share:
 * l is this thread's partial row sum (summed over the quad here, so every lane must call),
 * m the row's running max of the raw scores, o[4 dt] and o[4 dt + 1] this thread's columns
 * 8 dt + 2 tq and + 1.  A row that saw no key (sum 0) writes zeros and lse -inf; nothing is
 * written when !in_tile.  sum = sum_j 2^(s_j * scale_log2 - m * scale_log2), so the natural
 * log-sum-exp of the scaled scores is (m * scale_log2 + log2(sum)) * ln 2.
 */
template <typename T, int DT>
static __device__ __forceinline__ void
attn_store_row(const dk_attention_args &a, int64_t h, int64_t t, bool in_tile, float l, float m,
               float scale_log2, const float *o, int tq, bool o_vec)
{
    float sum = l;
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    if (!in_tile) {
        return;
    }
    if (a.lse != NULL && tq == 0) {
        a.lse[t * a.lse_stride_token + h * a.lse_stride_head] =
            sum > 0.0f ? (__fmul_rn(m, scale_log2) + log2f(sum)) / LOG2E : -INFINITY;
    }
    uint16_t *orow = (uint16_t *)a.out + h * a.o_stride_head + t * a.o_stride_token;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        const int64_t d = dt * 8 + 2 * tq;
        const float v0 = o[4 * dt] * inv;
        const float v1 = o[4 * dt + 1] * inv;
        if (o_vec) {
            *reinterpret_cast<uint32_t *>(orow + d) = half_ops<T>::pack(v0, v1);
        }
        else {
            orow[d * a.o_stride_dim] = half_ops<T>::bits(v0);
            orow[(d + 1) * a.o_stride_dim] = half_ops<T>::bits(v1);
        }
    }
}

/* Sets `kernel`'s dynamic shared-memory limit to `smem` once per device (done: the kernel's
 * flags, one per device; a race sets the same value twice, which is harmless).  Returns the
 * cudaGetDevice / cudaFuncSetAttribute error. */
static inline cudaError_t
attn_allow_smem(const void *kernel, size_t smem, volatile bool *done)
{
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) {
        return e;
    }
    const bool cached = dev >= 0 && dev < ATTN_MAX_DEVICES;
    if (!cached || !done[dev]) {
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) {
            return e;
        }
        if (cached) {
            done[dev] = true;
        }
    }
    return cudaSuccess;
}

#endif /* DIFFKV_ATTENTION_COMMON_CUH */
