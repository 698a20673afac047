/*
 * attention_sm90.cu -- the Hopper (sm_90a) paged attention kernel whose warpgroups load their
 * own K/V ("sm90"): the tensor-core kernel of attention_sm80.cu rebuilt on warpgroup MMAs
 * (wgmma).  dk_cuda_attention (attention.cu) takes it on compute capability 9.x for the caches
 * the warp-specialized kernel (attention_sm90_ws.cu) does not read -- K/V rows not in 16-byte
 * chunks -- and for every call under the kernel choice sm90.
 *
 * fp16/bf16, head_size 64 or 128, every mask, GQA, any block size and cache strides.  One CTA
 * of two warpgroups (256 threads) per (query tile of 128 tokens of one batch row, head);
 * warpgroup w owns query rows 64w .. 64w + 63.  Key tiles of 128 keys (head 128) or 64 keys
 * (head 64, two CTAs per SM).
 *   - Shared memory holds Q, and two stages of (K tile, V tile), in the layout wgmma reads
 *     with 128-byte swizzling: a tile of R rows is cut into panels of 64 columns (128 bytes
 *     per row), panel p at p * R * 128 bytes; 16-byte chunk c of row r of a panel sits at
 *     chunk c ^ (r % 8) (sw128).  Q and K are "K-major" operands (contraction over head dims,
 *     the contiguous ones), V the "MN-major" B operand of P V (transposed by wgmma itself).
 *   - Loads: as in the sm80 kernel, one thread per key resolves the key's cache offset
 *     through the block table (any block_size) into a shared ring of three tiles' offsets; K
 *     and V chunks are 16-byte cp.async (element loads for odd strides); rows past the last
 *     visible key are zero-filled.
 *   - Per key tile kt: wait for the loads, fence the generic-proxy writes for wgmma's async
 *     proxy, one barrier, issue the loads of K_{kt+1} and V_kt, then each warpgroup issues
 *     S_kt = Q K_kt^T (D/16 wgmma.m64nBNk16 from shared memory) and O += P_{kt-1} V_{kt-1}
 *     (BN/16 wgmma.m64nDk16, P from registers, V the transposed B operand), waits for S_kt
 *     only and runs its online softmax (fp32, exp2 with the scale folded in) while the P V
 *     product is still on the tensor cores; then waits for that, rescales O and packs P_kt
 *     to fp16/bf16 registers.  The accumulator layouts are those of mma.sync m16n8 per
 *     16-row slice, so masking, softmax and the epilogue are the sm80 kernel's.  A
 *     warpgroup skips the tiles past all of its rows' limits; masks are applied only on
 *     tiles that reach past the smallest limit of the warpgroup's rows.
 * Register use and shared memory: `nvcc -Xptxas -v` (docs/hopper-kernels.md).
 *
 * Entry points (attention_internal.cuh): attn_sm90_launch, attn_sm90_ready.
 */
#include "attention_common.cuh"
#include "attention_internal.cuh"
#include "cuda_common.cuh"
#include "sm90_tiles.cuh"
#include "sm90_wgmma.cuh"

#include <string.h>

#define H90_BM 128      /* query rows per CTA */
#define H90_THREADS 256 /* two warpgroups */

static_assert(H90_BM == ATTN_BM, "dk_cuda_attention sizes this kernel's grid with ATTN_BM");

/* Keys per K/V tile and CTAs per SM: head 128 takes 128-key tiles (S, P and O of one CTA
 * fill the register file), head 64 takes 64-key tiles so that two CTAs fit on an SM (the
 * softmax, not the MMAs, bounds head 64; more warps hide its latency). */
template <int D> struct h90_cfg;
template <> struct h90_cfg<128> {
    static constexpr int BN = 128;
    static constexpr int CTAS_PER_SM = 1;
};
template <> struct h90_cfg<64> {
    static constexpr int BN = 64;
    static constexpr int CTAS_PER_SM = 2;
};

/* The kernel's tile geometry and dynamic shared memory for head size D. */
template <int D> struct h90_tile {
    static constexpr int BN = h90_cfg<D>::BN;
    /* bytes: Q, 2 stages of K and V, 3 x BN key offsets, and slack to align the tiles to
     * 1024 bytes (the swizzle repeats every 8 rows of 128 bytes) */
    static constexpr uint32_t Q_BYTES = H90_BM * D * 2;
    static constexpr uint32_t KV_BYTES = BN * D * 2; /* one K or one V tile */
    static constexpr size_t SMEM = (size_t)Q_BYTES + 4 * KV_BYTES + 3 * BN * 8 + 1024;
};

#ifdef H90_DEVICE_CODE
/*
 * Loads a tile of `rows` rows x D (row r at byte offset offs[r] of src, element stride
 * `stride_dim`) into the swizzled tile at shared address dst; rows >= valid_rows become zeros
 * (masked probabilities, 0, must never meet garbage: 0 * inf = nan).  Thread tid owns chunk
 * tid % (D/8) of rows tid / (D/8) + k * (H90_THREADS / (D/8)).
 */
template <int D, int ROWS>
static __device__ __forceinline__ void
h90_load_tile(uint32_t dst, const char *src, const char *src2, const int64_t *offs,
              int32_t valid_rows, int64_t stride_dim, bool vec)
{
    constexpr uint32_t rows = ROWS;
    constexpr int passes = ROWS / (H90_THREADS / (D / 8));
    constexpr int CHUNKS = D / 8;
    constexpr int ROWS_PER_PASS = H90_THREADS / CHUNKS;
    static_assert(ROWS_PER_PASS % 8 == 0, "a thread's rows share one swizzle");
    const int tid = (int)threadIdx.x;
    const uint32_t c = (uint32_t)(tid % CHUNKS);
    const uint32_t r0 = (uint32_t)(tid / CHUNKS);
    const uint32_t d0 = dst + sw128(rows, r0, c);
    if (vec && src2 == NULL) { /* the hot path: one source */
        const char *s = src + c * 16;
#pragma unroll
        for (int pass = 0; pass < passes; pass++) {
            const uint32_t r = r0 + (uint32_t)(pass * ROWS_PER_PASS);
            cp_async16(d0 + (uint32_t)(pass * ROWS_PER_PASS) * 128u, s + offs[r],
                       (int32_t)r < valid_rows ? 16u : 0u);
        }
    }
    else if (vec) {
#pragma unroll
        for (int pass = 0; pass < passes; pass++) {
            const uint32_t r = r0 + (uint32_t)(pass * ROWS_PER_PASS);
            cp_async16(d0 + (uint32_t)(pass * ROWS_PER_PASS) * 128u,
                       kv_row(src, src2, offs[r]) + c * 16, (int32_t)r < valid_rows ? 16u : 0u);
        }
    }
    else {
#pragma unroll 1
        for (int pass = 0; pass < passes; pass++) {
            const uint32_t r = r0 + (uint32_t)(pass * ROWS_PER_PASS);
            const uint32_t a = d0 + (uint32_t)(pass * ROWS_PER_PASS) * 128u;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if ((int32_t)r < valid_rows) {
                v = gather_chunk((const uint16_t *)kv_row(src, src2, offs[r]) +
                                     (int64_t)c * 8 * stride_dim,
                                 stride_dim);
            }
            st_shared16(a, v);
        }
    }
}
#endif /* H90_DEVICE_CODE */

/*
 * grid.x = num_heads * num_rows * tiles_per_row (order: attn_cta_place); tiles past a row's
 * end exit at once.  H90_THREADS threads, h90_tile<D>::SMEM bytes of dynamic shared memory.
 * scale_log2 = |scale| * log2(e) > 0; neg_q: the scale is negative, so q is negated instead.
 */
template <typename T, int D>
/* clang-format off */
static __global__ void __launch_bounds__(H90_THREADS, h90_cfg<D>::CTAS_PER_SM)
attention_sm90_kernel(const dk_attention_args a, int64_t tiles_per_row, int64_t head_group,
                      float scale_log2, bool neg_q, bool q_vec, bool kv_vec, bool o_vec,
                      bool sort_rows)
/* clang-format on */
{
#ifdef H90_DEVICE_CODE
    constexpr int BN = h90_cfg<D>::BN;
    constexpr int NT = BN / 8; /* n8 blocks of S */
    constexpr int DT = D / 8;  /* n8 blocks of O */
    constexpr uint32_t QB = h90_tile<D>::Q_BYTES;
    constexpr uint32_t KVB = h90_tile<D>::KV_BYTES;

    extern __shared__ uint4 h90_smem[];
    __shared__ int32_t s_lim[H90_BM];
    __shared__ int32_t s_wmax[4], s_wmin[4];
    __shared__ int32_t s_row;
    const uint32_t raw = smem_addr(h90_smem);
    const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
    const uint32_t sq = raw + pad; /* Q tile */
    const uint32_t skv = sq + QB;  /* stage s: K at skv + 2s KVB, V at skv + (2s+1) KVB */
    int64_t *const s_off =
        reinterpret_cast<int64_t *>(reinterpret_cast<char *>(h90_smem) + pad + QB +
                                    4 * KVB); /* [3][BN]: tile t's in slot t % 3 */

    attn_cta cta;
    if (!attn_cta_begin(a, tiles_per_row, head_group, sort_rows, H90_BM, &s_row, &cta)) {
        return;
    }
    const int64_t h = cta.h, row = cta.row, q0 = cta.q0;
    const int64_t q_start = cta.q_start, query_len = cta.query_len, seq_len = cta.seq_len;
    const int64_t kv_head = h / (a.num_heads / a.num_kv_heads);
    const int32_t *bt = a.block_table + row * a.bt_stride_row;
    const int tid = (int)threadIdx.x;
    const int wg = tid / 128;        /* warpgroup: query rows 64 wg .. 64 wg + 63 */
    const int w4 = (tid % 128) / 32; /* warp within the warpgroup: rows 16 w4 .. */
    const int lane = tid % 32;
    const int g = lane >> 2;
    const int tq = lane & 3;

    /* Q tile (rows past the row's end are zeros), negated for a negative scale. */
    h90_load_q<D, H90_BM, H90_THREADS, H90_BM>(a, sq, tid, 0, q0, q_start, query_len, h, q_vec);
    if (neg_q) {
        cp_async_wait_all();
        h90_negate_q<D, H90_BM, H90_THREADS, H90_BM>(sq, tid, 0);
    }

    /* Key limits of the 128 query rows (threads 0..127; 0 past the row's end); warp k of
     * them covers rows 32k .. 32k + 31, so warpgroup w's extremes are warps 2w and 2w + 1's. */
    if (tid < H90_BM) {
        attn_warp_limits(a, tid, lane, q0, q_start, query_len, seq_len, s_lim, s_wmax, s_wmin);
    }
    __syncthreads();
    const int32_t kv_end = max(max(s_wmax[0], s_wmax[1]), max(s_wmax[2], s_wmax[3]));
    const int32_t g_min = min(s_wmin[2 * wg], s_wmin[2 * wg + 1]);
    const int32_t n_tiles = (kv_end + BN - 1) / BN;
    if (tid < BN) {
        s_off[tid] = kv_key_offset(a, bt, kv_head, tid, kv_end);
        s_off[BN + tid] = kv_key_offset(a, bt, kv_head, BN + tid, kv_end);
    }
    __syncthreads();

    const char *kc = (const char *)a.key_cache;
    const char *vc = (const char *)a.value_cache;
    const char *kc2 = (const char *)a.key_cache2;
    const char *vc2 = (const char *)a.value_cache2;
    /* K_0 now; then iteration kt loads K_{kt+1} and V_kt (see the loop). */
    if (n_tiles > 0) {
        h90_load_tile<D, BN>(skv, kc, kc2, s_off, kv_end, a.cache_stride_dim, kv_vec);
    }
    cp_async_commit();

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) {
        o[i] = 0.0f;
    }
    float m[2] = {-INFINITY, -INFINITY}; /* running max of the raw scores, rows g, g + 8 */
    float l[2] = {0.0f, 0.0f};           /* running sums, this thread's columns only */
    uint32_t pa[BN / 16][4];             /* P of the previous tile, the A operand of P V */
    float s[NT * 4];                     /* S of the current tile, then its P (fp32) */
    h90_rows rows;
    rows.q_slab = sq + (uint32_t)wg * 64u * 128u; /* this warpgroup's 64 rows of Q */
    rows.lim0 = s_lim[wg * 64 + w4 * 16 + g];     /* key limits of this thread's rows */
    rows.lim1 = s_lim[wg * 64 + w4 * 16 + 8 + g];
    rows.g_min = g_min;
    rows.tq = tq;
    rows.scale_log2 = scale_log2;

    /*
     * Software pipeline over key tiles, the same in every warpgroup (a warpgroup whose rows
     * end earlier computes the CTA's last tiles fully masked, so that no wgmma sits in a
     * branch ptxas cannot prove uniform -- it would serialize every wgmma).  Iteration kt
     * issues S_kt = Q K_kt^T and then O += P_{kt-1} V_{kt-1}, waits for S_kt only, runs the
     * softmax of S_kt while the P V product is still on the tensor cores, then waits for it,
     * rescales O and packs P_kt.  Tile 0 (no P V yet) and the last P V are peeled off.
     * Shared memory: K tile kt in K slot kt & 1 and V tile kt in V slot kt & 1; iteration kt
     * loads K_{kt+1} (its slot held K_{kt-1}, used in iteration kt - 1) and V_kt (its slot held
     * V_{kt-2}, used in iteration kt - 1), so every load has a whole iteration to land.
     */
    if (n_tiles > 0) {
        for (int32_t kt = 0; kt < n_tiles; kt++) {
            const int32_t j0 = kt * BN;
            cp_async_wait_all(); /* K_kt and V_{kt-1} (and Q) landed for this thread */
            fence_proxy_async(); /* ... and are visible to wgmma */
            __syncthreads();     /* ... for every thread; every warpgroup is done with kt - 1 */
            if (kt + 1 < n_tiles) {
                h90_load_tile<D, BN>(skv + (uint32_t)((kt + 1) & 1) * 2u * KVB, kc, kc2,
                                     s_off + ((kt + 1) % 3) * BN, kv_end - j0 - BN,
                                     a.cache_stride_dim, kv_vec);
            }
            h90_load_tile<D, BN>(skv + (uint32_t)(kt & 1) * 2u * KVB + KVB, vc, vc2,
                                 s_off + (kt % 3) * BN, kv_end - j0, a.cache_stride_dim, kv_vec);
            cp_async_commit();
            const int32_t j2 = j0 + 2 * BN + tid;
            const bool want_off = tid < BN && kt + 2 < n_tiles;
            const int32_t blk2 = want_off && j2 < kv_end
                                     ? dk_safe_block(a, bt[(uint32_t)j2 / (uint32_t)a.block_size])
                                     : 0;

            const uint32_t sk = skv + (uint32_t)(kt & 1) * 2u * KVB;
            float alpha[2];
            if (kt == 0) {
                h90_qk<T, D, BN, H90_BM>(s, rows.q_slab, sk);
                wgmma_commit();
                wgmma_wait_all();
                fence_regs(s);
                h90_softmax<NT>(s, m, l, alpha, j0, rows);
            }
            else {
                h90_qk<T, D, BN, H90_BM>(s, rows.q_slab, sk);
                wgmma_commit();
                h90_pv<T, D, BN>(o, pa, skv + (uint32_t)((kt - 1) & 1) * 2u * KVB + KVB);
                wgmma_commit();
                wgmma_wait_1(); /* S_kt done; P_{kt-1} V_{kt-1} may still run */
                fence_regs(s);
                h90_softmax<NT>(s, m, l, alpha, j0, rows);
                wgmma_wait_all(); /* P_{kt-1} V_{kt-1} is in O (relative to the old max) */
                fence_regs(o);
                h90_rescale_o<DT>(o, alpha);
            }
            h90_pack_p<T, BN>(pa, s);
            if (want_off) {
                s_off[((kt + 2) % 3) * BN + tid] =
                    j2 < kv_end
                        ? kv_block_offset(a, blk2, (uint32_t)j2 % (uint32_t)a.block_size, kv_head)
                        : 0;
            }
        }
        cp_async_wait_all(); /* V of the last tile (every thread loaded part of it) */
        fence_proxy_async();
        __syncthreads();
        fence_regs(o);
        wgmma_fence();
        h90_pv<T, D, BN>(o, pa, skv + (uint32_t)((n_tiles - 1) & 1) * 2u * KVB + KVB);
        wgmma_commit();
        wgmma_wait_all();
        fence_regs(o);
    }
    cp_async_wait_all();

    /* Epilogue: row sums over the quad; a row that saw no key writes zeros (and lse -inf). */
    int64_t eh, t0, tile_rows;
    attn_out_tile(a, tiles_per_row, head_group, sort_rows, &s_row, H90_BM, &eh, &t0, &tile_rows);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int r = wg * 64 + w4 * 16 + hf * 8 + g;
        attn_store_row<T, DT>(a, eh, t0 + r, r < tile_rows, l[hf], m[hf], scale_log2, &o[2 * hf],
                              tq, o_vec);
    }
#else
    (void)a;
    (void)tiles_per_row;
    (void)head_group;
    (void)scale_log2;
    (void)neg_q;
    (void)q_vec;
    (void)kv_vec;
    (void)o_vec;
    (void)sort_rows;
    __trap(); /* launched only where the sm_90a code exists (attn_sm90_ready) */
#endif
}

/* Launches attention_sm90_kernel<T, D> (attn_sm90_launch's contract).  The shared-memory
 * attribute is set once per (instantiation, device). */
template <typename T, int D>
static cudaError_t
h90_launch(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group, float scale_log2,
           bool neg_q, bool q_vec, bool kv_vec, bool o_vec, cudaStream_t s)
{
    static volatile bool attr_set[ATTN_MAX_DEVICES];
    const size_t smem = h90_tile<D>::SMEM;
    const cudaError_t e =
        attn_allow_smem((const void *)attention_sm90_kernel<T, D>, smem, attr_set);
    if (e != cudaSuccess) {
        return e;
    }
    bool sort_rows = a->num_rows >= 2 && a->num_rows <= ATTN_SORT_ROWS;
    const unsigned blocks = (unsigned)(a->num_heads * a->num_rows * tiles_per_row);
    /* the kernel's parameters, in order (with a pending KV write: one submission) */
    void *args[] = {(void *)a, &tiles_per_row, &head_group, &scale_log2, &neg_q,
                    &q_vec,    &kv_vec,        &o_vec,      &sort_rows};
    return dk_launch_after(a->pending, (const void *)attention_sm90_kernel<T, D>, dim3(blocks),
                           dim3(H90_THREADS), smem, s, args);
}

/* attention_internal.cuh's contract: the instantiation for the call's dtype and head size. */
cudaError_t
attn_sm90_launch(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group,
                 float scale_log2, bool neg_q, bool q_vec, bool kv_vec, bool o_vec, cudaStream_t s)
{
    const bool bf16 = a->dtype == DK_BF16;
    if (a->head_size == 64) {
        return bf16 ? h90_launch<__nv_bfloat16, 64>(a, tiles_per_row, head_group, scale_log2, neg_q,
                                                    q_vec, kv_vec, o_vec, s)
                    : h90_launch<__half, 64>(a, tiles_per_row, head_group, scale_log2, neg_q, q_vec,
                                             kv_vec, o_vec, s);
    }
    return bf16 ? h90_launch<__nv_bfloat16, 128>(a, tiles_per_row, head_group, scale_log2, neg_q,
                                                 q_vec, kv_vec, o_vec, s)
                : h90_launch<__half, 128>(a, tiles_per_row, head_group, scale_log2, neg_q, q_vec,
                                          kv_vec, o_vec, s);
}

/* The sm_90a code of this file and of attention_sm90_ws.cu comes from the same -gencode list,
 * so one kernel's binary version speaks for both. */
bool
attn_sm90_ready(void)
{
    static volatile int state[ATTN_MAX_DEVICES]; /* 0 unknown, 1 yes, 2 no */
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        return false;
    }
    const bool cached = dev >= 0 && dev < ATTN_MAX_DEVICES;
    if (cached && state[dev] != 0) {
        return state[dev] == 1;
    }
    int major = 0;
    cudaFuncAttributes attr;
    memset(&attr, 0, sizeof(attr));
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        major == 9 &&
        cudaFuncGetAttributes(&attr, attention_sm90_kernel<__nv_bfloat16, 128>) == cudaSuccess &&
        attr.binaryVersion == 90 && attr.ptxVersion == 90;
    if (cached) {
        state[dev] = ok ? 1 : 2;
    }
    return ok;
}
