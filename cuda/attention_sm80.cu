/*
 * attention_sm80.cu -- paged attention on the GPU for the masks of dk_mask (diffkv.h), for
 * Ampere and later.
 *
 * fp16/bf16, head_size 64 or 128: FlashAttention-2 style.  One CTA of 8 warps per (query tile
 * of 128 tokens of one batch row, head); each warp owns 16 query rows.  K/V tiles of 64 keys
 * are read through the block table into shared memory (cp.async when every address is 16-byte
 * aligned, element loads with any strides otherwise), S = Q K^T and O += P V run on
 * mma.sync.m16n8k16 with fp32 accumulation, the softmax is online in fp32 with exp2f and
 * scale * log2(e) folded into the scores.
 *
 * fp32: one warp per (token, head), plain fp32 math over the visible keys, any head_size up to
 * 256 -- so every dtype the CPU reference takes also runs on CUDA.
 *
 * Masks: every mask is a per-token exclusive key limit L (key j visible iff j < L):
 *   NONE   L = seq_len
 *   CAUSAL L = clamp(i + seq_len - query_len + 1, 0, seq_len)  (i: index of the token in its row)
 *   LIMITS L = clamp(key_limits[t], 0, seq_len)
 * Key tiles at or past the largest L of a query tile are neither loaded nor computed; a token
 * with L == 0 gets zeros.
 *
 * Entry point: dk_cuda_attention.
 */
#include "diffkv.h"

#include "cuda_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

#define ATTN_BM 128  /* query rows per CTA (measured on H200: 25 % faster than 64) */
#define ATTN_BN 64   /* keys per K/V tile */
#define ATTN_WARPS 8 /* warps per CTA, 16 query rows each */
#define ATTN_THREADS (ATTN_WARPS * 32)
/* smem row padding in elements: rows 16 bytes apart mod 128, so ldmatrix's 8 row addresses
 * hit 8 distinct bank groups */
#define ATTN_PAD 8

#define F32_WARPS 4 /* warps per CTA of the fp32 kernel */
#define F32_MAX_HEAD 256

#define LOG2E 1.4426950408889634f

/* ------------------------------------------------------------------------------------------ */
/* Masks                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* Exclusive key limit of query token i of a row (packed token t), see the file comment. */
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

static __device__ uint32_t
smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/*
 * ldmatrix x4: lanes 8m..8m+7 give the 8 row addresses (16 contiguous bytes each) of 8x8
 * matrix m; r[m] receives, in lane l, elements (row l/4, cols 2(l%4), 2(l%4)+1) of matrix m
 * (lower column in the low half).  With .trans it receives (rows 2(l%4), 2(l%4)+1, col l/4).
 */
static __device__ void
ldsm_x4(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}

static __device__ void
ldsm_x4_trans(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}

static __device__ void
cp_async16(void *smem, const void *gmem)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem)
                 : "memory");
}

static __device__ void
cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Waits until at most `n` of this thread's most recent cp.async groups are pending. */
template <int n>
static __device__ void
cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
}

/*
 * One 16-byte chunk (8 elements) of a smem tile row from global memory: `src` is the chunk's
 * first element, `stride` the element stride along the dim (1 whenever vec is true).
 * vec: asynchronous cp.async (completes at the next cp_async_wait); otherwise loaded now.
 */
static __device__ void
load_chunk(uint16_t *dst, const uint16_t *src, int64_t stride, bool vec)
{
    if (vec) {
        cp_async16(dst, src);
    }
    else {
        uint32_t w[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            /* element 2e in the low half, as in memory (little endian) */
            w[e] = (uint32_t)src[2 * e * stride] | ((uint32_t)src[(2 * e + 1) * stride] << 16);
        }
        *reinterpret_cast<uint4 *>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

static __device__ void
zero_chunk(uint16_t *dst)
{
    *reinterpret_cast<uint4 *>(dst) = make_uint4(0u, 0u, 0u, 0u);
}

/* ------------------------------------------------------------------------------------------ */
/* fp16 / bf16 tensor-core kernel                                                              */
/* ------------------------------------------------------------------------------------------ */

/*
 * Loads keys [j0, j0 + 64) of one K or V tile (base = key_cache or value_cache) into s (row
 * stride D + ATTN_PAD); keys at or past kv_end become zeros, so masked probabilities (0)
 * never meet garbage (0 * inf = nan).  Thread tid owns chunk tid % (D / 8) of rows
 * tid / (D / 8) + k * (ATTN_THREADS / (D / 8)).
 */
template <int D>
static __device__ void
load_kv_tile(uint16_t *s, const uint16_t *base, const dk_attention_args &a, const int32_t *bt,
             int32_t block_size, int64_t kv_head, int32_t j0, int32_t kv_end, bool vec)
{
    constexpr int CHUNKS = D / 8;
    constexpr int ROWS_PER_PASS = ATTN_THREADS / CHUNKS;
    constexpr int LD = D + ATTN_PAD;
    const int c = (int)threadIdx.x % CHUNKS;
#pragma unroll
    for (int r = (int)threadIdx.x / CHUNKS; r < ATTN_BN; r += ROWS_PER_PASS) {
        int32_t j = j0 + r;
        uint16_t *dst = s + r * LD + c * 8;
        if (j < kv_end) {
            int64_t blk = bt[j / block_size];
            int64_t off = j % block_size;
            const uint16_t *src = base + blk * a.cache_stride_block + off * a.cache_stride_token +
                                  kv_head * a.cache_stride_head +
                                  (int64_t)c * 8 * a.cache_stride_dim;
            load_chunk(dst, src, a.cache_stride_dim, vec);
        }
        else {
            zero_chunk(dst);
        }
    }
}

/*
 * grid.x = num_rows * tiles_per_row (tile qt of row r is r * tiles_per_row + qt; tiles past
 * the row's end exit at once), grid.y = num_heads, ATTN_THREADS threads.
 */
template <typename T, int D>
/* clang-format does not know __launch_bounds__ is an attribute. */
/* clang-format off */
static __global__ void __launch_bounds__(ATTN_THREADS)
attention_mma_kernel(const dk_attention_args a, int64_t tiles_per_row, float scale_log2,
                     bool q_vec, bool kv_vec)
/* clang-format on */
{
    constexpr int LD = D + ATTN_PAD;
    constexpr int CHUNKS = D / 8;
    constexpr int ROWS_PER_PASS = ATTN_THREADS / CHUNKS;
    constexpr int KSTEPS = D / 16; /* k-steps of S = Q K^T */
    constexpr int DTILES = D / 8;  /* n-tiles of O */

    static_assert(ATTN_BM == ATTN_WARPS * 16, "one warp per 16 query rows");
    static_assert(ATTN_BM <= 2 * ATTN_BN, "the Q tile must fit where the K and V tiles go");
    /* K tile then V tile; before the loop the Q tile spans both. */
    __shared__ __align__(16) uint16_t s_kv[2 * ATTN_BN * LD];
    uint16_t *const s_k = s_kv;
    uint16_t *const s_v = s_kv + ATTN_BN * LD;
    __shared__ int32_t s_lim[ATTN_BM];

    const int64_t row = blockIdx.x / tiles_per_row;
    const int64_t q0 = (blockIdx.x % tiles_per_row) * ATTN_BM;
    const int64_t h = blockIdx.y;
    const int64_t q_start = a.query_start_loc[row];
    const int64_t query_len = a.query_start_loc[row + 1] - q_start;
    if (q0 >= query_len) {
        return; /* uniform over the CTA, before any barrier */
    }
    const int64_t seq_len = a.seq_lens[row];
    const int64_t kv_head = h / (a.num_heads / a.num_kv_heads);
    const int32_t *bt = a.block_table + row * a.bt_stride_row;
    const int32_t block_size = (int32_t)a.block_size;
    const int tid = (int)threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;

    /* Per-row key limits (0 for rows past the row's end), and the tile's largest. */
    if (tid < ATTN_BM) {
        int64_t i = q0 + tid;
        s_lim[tid] = i < query_len ? key_limit(a, q_start + i, i, query_len, seq_len) : 0;
    }
    /* Q tile -> s_kv (rows past the row's end are zeros). */
    {
        const int c = tid % CHUNKS;
        for (int r = tid / CHUNKS; r < ATTN_BM; r += ROWS_PER_PASS) {
            uint16_t *dst = s_kv + r * LD + c * 8;
            if (q0 + r < query_len) {
                const uint16_t *src = (const uint16_t *)a.query +
                                      (q_start + q0 + r) * a.q_stride_token + h * a.q_stride_head +
                                      (int64_t)c * 8 * a.q_stride_dim;
                load_chunk(dst, src, a.q_stride_dim, q_vec);
            }
            else {
                zero_chunk(dst);
            }
        }
        cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();

    int32_t kv_end = 0;
    for (int r = 0; r < ATTN_BM; r++) {
        kv_end = s_lim[r] > kv_end ? s_lim[r] : kv_end;
    }
    const int32_t n_tiles = (int32_t)(((int64_t)kv_end + ATTN_BN - 1) / ATTN_BN);

    /* A fragments of this warp's 16 query rows: matrices (rows +0/+8) x (cols +0/+8), in the
     * order a0 (r0-7, c0-7), a1 (r8-15, c0-7), a2 (r0-7, c8-15), a3 (r8-15, c8-15). */
    uint32_t qf[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
        int r = warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
        int col = kk * 16 + (lane >> 4) * 8;
        ldsm_x4(qf[kk], s_kv + r * LD + col);
    }
    __syncthreads(); /* every warp has its Q before s_kv is overwritten by K and V */

    const uint16_t *kc = (const uint16_t *)a.key_cache;
    const uint16_t *vc = (const uint16_t *)a.value_cache;
    if (n_tiles > 0) {
        load_kv_tile<D>(s_k, kc, a, bt, block_size, kv_head, 0, kv_end, kv_vec);
        cp_async_commit();
        load_kv_tile<D>(s_v, vc, a, bt, block_size, kv_head, 0, kv_end, kv_vec);
        cp_async_commit();
    }

    /* This thread's two query rows (accumulator rows g and g + 8 of the warp's 16). */
    const int g = lane >> 2;
    const int tq = lane & 3;
    const int r0 = warp * 16 + g;
    const int r1 = r0 + 8;
    const int32_t lim0 = s_lim[r0];
    const int32_t lim1 = s_lim[r1];
    const int32_t lim_min = lim0 < lim1 ? lim0 : lim1;

    float o[DTILES][4];
#pragma unroll
    for (int dt = 0; dt < DTILES; dt++) {
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    }
    float m0 = -INFINITY, m1 = -INFINITY; /* running max, log2 domain */
    float l0 = 0.0f, l1 = 0.0f;           /* running sum, this thread's columns only */

    for (int32_t kt = 0; kt < n_tiles; kt++) {
        const int32_t j0 = kt * ATTN_BN;
        cp_async_wait<1>(); /* K tile kt has landed (V tile kt may be pending) */
        __syncthreads();

        /* S = Q K^T: s[nt] is the 16x8 block of keys j0 + nt*8 .. +7; c0,c1 row g, c2,c3 row
         * g + 8, columns 2*tq, 2*tq + 1. */
        float s[ATTN_BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < ATTN_BN / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
#pragma unroll
            for (int np = 0; np < ATTN_BN / 16; np++) {
                /* matrices: (keys +0-7, dims +0-7) b0 of n-tile 2np, (keys +0-7, dims +8-15)
                 * b1 of 2np, (keys +8-15, dims +0-7) b0 of 2np+1, (keys +8-15, +8-15) b1. */
                uint32_t b[4];
                int key = np * 16 + (lane >> 4) * 8 + (lane & 7);
                int col = kk * 16 + ((lane >> 3) & 1) * 8;
                ldsm_x4(b, s_k + key * LD + col);
                half_ops<T>::mma(s[2 * np], qf[kk], b[0], b[1]);
                half_ops<T>::mma(s[2 * np + 1], qf[kk], b[2], b[3]);
            }
        }

        /* Scale into the log2 domain and mask keys at or past each row's limit. */
        const bool need_mask = j0 + ATTN_BN > lim_min;
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < ATTN_BN / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = s[nt][e] * scale_log2;
                if (need_mask) {
                    int32_t j = j0 + nt * 8 + 2 * tq + (e & 1);
                    if (j >= (e < 2 ? lim0 : lim1)) {
                        x = -INFINITY;
                    }
                }
                s[nt][e] = x;
                if (e < 2) {
                    mx0 = fmaxf(mx0, x);
                }
                else {
                    mx1 = fmaxf(mx1, x);
                }
            }
        }
        /* The 4 threads of a quad (same g) hold one row's 64 columns between them. */
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0);
        const float mn1 = fmaxf(m1, mx1);
        /* A row with no visible key so far keeps max -inf; subtract 0 then, so that
         * exp2(-inf - base) = 0 instead of nan. */
        const float base0 = mn0 == -INFINITY ? 0.0f : mn0;
        const float base1 = mn1 == -INFINITY ? 0.0f : mn1;
        const float alpha0 = exp2f(m0 - base0);
        const float alpha1 = exp2f(m1 - base1);
        m0 = mn0;
        m1 = mn1;
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < ATTN_BN / 8; nt++) {
            s[nt][0] = exp2f(s[nt][0] - base0);
            s[nt][1] = exp2f(s[nt][1] - base0);
            s[nt][2] = exp2f(s[nt][2] - base1);
            s[nt][3] = exp2f(s[nt][3] - base1);
            sum0 += s[nt][0] + s[nt][1];
            sum1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * alpha0 + sum0;
        l1 = l1 * alpha1 + sum1;
#pragma unroll
        for (int dt = 0; dt < DTILES; dt++) {
            o[dt][0] *= alpha0;
            o[dt][1] *= alpha0;
            o[dt][2] *= alpha1;
            o[dt][3] *= alpha1;
        }

        __syncthreads(); /* every warp is done with K tile kt */
        if (kt + 1 < n_tiles) {
            load_kv_tile<D>(s_k, kc, a, bt, block_size, kv_head, j0 + ATTN_BN, kv_end, kv_vec);
        }
        cp_async_commit();  /* possibly empty: keeps the group count of the waits fixed */
        cp_async_wait<1>(); /* V tile kt has landed (K tile kt + 1 may be pending) */
        __syncthreads();

        /* O += P V.  P's accumulator layout is the A fragment layout of k-step kk (keys
         * 16kk .. 16kk + 15): a0 = s[2kk] row g, a1 = s[2kk] row g+8, a2 = s[2kk+1] row g,
         * a3 = s[2kk+1] row g+8. */
#pragma unroll
        for (int kk = 0; kk < ATTN_BN / 16; kk++) {
            uint32_t pa[4];
            pa[0] = half_ops<T>::pack(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = half_ops<T>::pack(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = half_ops<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = half_ops<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; dp++) {
                /* transposed matrices: (keys +0-7, dims +0-7) b0 of d-tile 2dp, (keys +8-15,
                 * dims +0-7) b1 of 2dp, (keys +0-7, dims +8-15) b0 of 2dp+1, (+8-15, +8-15) b1. */
                uint32_t b[4];
                int key = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
                int col = dp * 16 + (lane >> 4) * 8;
                ldsm_x4_trans(b, s_v + key * LD + col);
                half_ops<T>::mma(o[2 * dp], pa, b[0], b[1]);
                half_ops<T>::mma(o[2 * dp + 1], pa, b[2], b[3]);
            }
        }

        __syncthreads(); /* every warp is done with V tile kt */
        if (kt + 1 < n_tiles) {
            load_kv_tile<D>(s_v, vc, a, bt, block_size, kv_head, j0 + ATTN_BN, kv_end, kv_vec);
        }
        cp_async_commit();
    }

    /* Row sums over the quad; a row that saw no key (l == 0) writes zeros. */
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f;
    const float inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    uint16_t *out = (uint16_t *)a.out;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = half == 0 ? r0 : r1;
        const float inv = half == 0 ? inv0 : inv1;
        if (q0 + r >= query_len) {
            continue;
        }
        uint16_t *orow = out + (q_start + q0 + r) * a.o_stride_token + h * a.o_stride_head;
#pragma unroll
        for (int dt = 0; dt < DTILES; dt++) {
            const int64_t d = dt * 8 + 2 * tq;
            orow[d * a.o_stride_dim] = half_ops<T>::bits(o[dt][2 * half] * inv);
            orow[(d + 1) * a.o_stride_dim] = half_ops<T>::bits(o[dt][2 * half + 1] * inv);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* fp32 kernel                                                                                 */
/* ------------------------------------------------------------------------------------------ */

/*
 * One warp per (token, head): w = t * num_heads + h.  Lane l owns dims l + 32k (k < 8).  For
 * each visible key in order: the dot product is reduced over the warp, then the online
 * softmax update runs on every lane with the same numbers.
 */
/* clang-format off */
static __global__ void __launch_bounds__(F32_WARPS * 32)
attention_f32_kernel(const dk_attention_args a, float scale_log2)
/* clang-format on */
{
    constexpr int PER_LANE = F32_MAX_HEAD / 32;
    const int64_t w = (int64_t)blockIdx.x * F32_WARPS + threadIdx.x / 32;
    const int lane = (int)threadIdx.x % 32;
    if (w >= a.num_tokens * a.num_heads) {
        return;
    }
    const int64_t t = w / a.num_heads;
    const int64_t h = w % a.num_heads;
    const int64_t row = dk_row_of_token(a.query_start_loc, a.num_rows, t);
    const int64_t q_start = a.query_start_loc[row];
    const int64_t query_len = a.query_start_loc[row + 1] - q_start;
    const int64_t seq_len = a.seq_lens[row];
    const int32_t lim = key_limit(a, t, t - q_start, query_len, seq_len);
    const int64_t kv_head = h / (a.num_heads / a.num_kv_heads);
    const int32_t *bt = a.block_table + row * a.bt_stride_row;
    const float *q = (const float *)a.query + t * a.q_stride_token + h * a.q_stride_head;
    const float *kc = (const float *)a.key_cache;
    const float *vc = (const float *)a.value_cache;

    float qv[PER_LANE];
    float o[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        int64_t d = lane + 32 * k;
        qv[k] = d < a.head_size ? q[d * a.q_stride_dim] * scale_log2 : 0.0f;
        o[k] = 0.0f;
    }
    float m = -INFINITY;
    float l = 0.0f;
    for (int32_t j = 0; j < lim; j++) {
        const int64_t kv_off = (int64_t)bt[j / a.block_size] * a.cache_stride_block +
                               (j % a.block_size) * a.cache_stride_token +
                               kv_head * a.cache_stride_head;
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < PER_LANE; k++) {
            int64_t d = lane + 32 * k;
            if (d < a.head_size) {
                dot += qv[k] * kc[kv_off + d * a.cache_stride_dim];
            }
        }
#pragma unroll
        for (int sh = 16; sh > 0; sh >>= 1) {
            dot += __shfl_xor_sync(0xffffffffu, dot, sh);
        }
        const float mn = fmaxf(m, dot);
        const float alpha = exp2f(m - mn); /* m = -inf on the first key: alpha = 0 */
        const float p = exp2f(dot - mn);
        l = l * alpha + p;
#pragma unroll
        for (int k = 0; k < PER_LANE; k++) {
            int64_t d = lane + 32 * k;
            if (d < a.head_size) {
                o[k] = o[k] * alpha + p * vc[kv_off + d * a.cache_stride_dim];
            }
        }
        m = mn;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float *orow = (float *)a.out + t * a.o_stride_token + h * a.o_stride_head;
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        int64_t d = lane + 32 * k;
        if (d < a.head_size) {
            orow[d * a.o_stride_dim] = o[k] * inv;
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Launcher                                                                                    */
/* ------------------------------------------------------------------------------------------ */

static bool
aligned16(int64_t bytes)
{
    return bytes % 16 == 0;
}

static bool
ptr_aligned16(const void *p)
{
    return (uintptr_t)p % 16 == 0;
}

template <typename T, int D>
static void
launch_mma(const dk_attention_args *a, int64_t tiles_per_row, float scale_log2, bool q_vec,
           bool kv_vec, cudaStream_t s)
{
    dim3 grid((unsigned)(tiles_per_row * a->num_rows), (unsigned)a->num_heads);
    attention_mma_kernel<T, D>
        <<<grid, ATTN_THREADS, 0, s>>>(*a, tiles_per_row, scale_log2, q_vec, kv_vec);
}

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
        if (a->head_size < 1 || a->head_size > F32_MAX_HEAD) {
            return dk_fail(err, DK_ERR_UNSUPPORTED,
                           "paged_attention(): head_size must be between 1 and %d for float32 "
                           "on CUDA, got %lld",
                           F32_MAX_HEAD, (long long)a->head_size);
        }
    }
    else if (a->head_size != 64 && a->head_size != 128) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "paged_attention(): head_size must be one of 64, 128 for "
                       "float16/bfloat16 on CUDA, got %lld",
                       (long long)a->head_size);
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
    cudaStream_t s = (cudaStream_t)stream;

    if (a->dtype == DK_F32) {
        int64_t blocks = dk_cdiv(a->num_tokens * a->num_heads, F32_WARPS);
        if (blocks > DK_MAX_GRID_X) {
            return dk_fail(err, DK_ERR_UNSUPPORTED,
                           "paged_attention(): num_tokens * num_heads must be at most %lld, got "
                           "%lld",
                           (long long)(DK_MAX_GRID_X * F32_WARPS),
                           (long long)(a->num_tokens * a->num_heads));
        }
        attention_f32_kernel<<<(unsigned)blocks, F32_WARPS * 32, 0, s>>>(*a, scale_log2);
        return dk_cuda_after_launch(op, stream, err);
    }

    const int64_t tiles_per_row = dk_cdiv(a->max_query_len, ATTN_BM);
    if (tiles_per_row * a->num_rows > DK_MAX_GRID_X || a->num_heads > DK_MAX_GRID_YZ) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "paged_attention(): num_rows * cdiv(max_query_len, %d) must be at most "
                       "%lld and num_heads at most %lld, got %lld and %lld",
                       ATTN_BM, (long long)DK_MAX_GRID_X, (long long)DK_MAX_GRID_YZ,
                       (long long)(tiles_per_row * a->num_rows), (long long)a->num_heads);
    }
    const int64_t es = 2;
    const bool q_vec = a->q_stride_dim == 1 && ptr_aligned16(a->query) &&
                       aligned16(a->q_stride_token * es) && aligned16(a->q_stride_head * es);
    const bool kv_vec = a->cache_stride_dim == 1 && ptr_aligned16(a->key_cache) &&
                        ptr_aligned16(a->value_cache) && aligned16(a->cache_stride_block * es) &&
                        aligned16(a->cache_stride_token * es) &&
                        aligned16(a->cache_stride_head * es);
    const bool bf16 = a->dtype == DK_BF16;
    if (a->head_size == 64) {
        if (bf16) {
            launch_mma<__nv_bfloat16, 64>(a, tiles_per_row, scale_log2, q_vec, kv_vec, s);
        }
        else {
            launch_mma<__half, 64>(a, tiles_per_row, scale_log2, q_vec, kv_vec, s);
        }
    }
    else {
        if (bf16) {
            launch_mma<__nv_bfloat16, 128>(a, tiles_per_row, scale_log2, q_vec, kv_vec, s);
        }
        else {
            launch_mma<__half, 128>(a, tiles_per_row, scale_log2, q_vec, kv_vec, s);
        }
    }
    return dk_cuda_after_launch(op, stream, err);
}
