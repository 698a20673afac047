/*
 * sm90_tiles.cuh -- what both Hopper kernels do with a warpgroup's tiles: the 128-byte swizzled
 * layout wgmma reads (sw128), S = Q K^T and O += P V issued as wgmma (h90_qk, h90_pv), the
 * online softmax of an S tile (h90_softmax) and O's rescale, P packed as the A operand of P V,
 * the Q tile's load and sign flip, and the staged output epilogue (h90_store_o_staged).
 * Everything is static and compiled only where H90_DEVICE_CODE is defined (sm90_wgmma.cuh).
 */
#ifndef DIFFKV_SM90_TILES_CUH
#define DIFFKV_SM90_TILES_CUH

#include "attention_common.cuh"
#include "sm90_wgmma.cuh"

#ifdef H90_DEVICE_CODE
/* Byte offset of 16-byte chunk c of row r in a swizzled tile of `rows` rows. */
static __device__ __forceinline__ uint32_t
sw128(uint32_t rows, uint32_t r, uint32_t c)
{
    return (c >> 3) * rows * 128u + r * 128u + (((c & 7u) ^ (r & 7u)) << 4);
}

/* Issues O += P V for one key tile (no commit): keys 16 kk .. 16 kk + 15 of P (registers) times
 * V rows 16 kk .. (the transposed B operand at shared address sv: 8-key groups 1024 bytes
 * apart, the stride; 64-dim panels BN * 128 bytes apart, the leading offset; with VG the
 * K_GROUPS layout of a tile of PN panels: panels 1024 apart, 8-key groups 1024 PN). */
template <typename T, int D, int BN, bool VG = false, int PN = 2>
static __device__ __forceinline__ void
h90_pv(float (&o)[D / 2], const uint32_t (&pa)[BN / 16][4], uint32_t sv)
{
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
        if constexpr (VG) { /* K_GROUPS layout: a 16-key block 2 KB PN */
            h90_mma<T>::pv(o, pa[kk],
                           wgmma_desc(sv + (uint32_t)kk * 2048u * PN, 1024u, 1024u * PN));
        }
        else {
            h90_mma<T>::pv(o, pa[kk], wgmma_desc(sv + (uint32_t)kk * 2048u, BN * 128u, 1024u));
        }
    }
}

/*
 * The first half of a consumer warpgroup's staged epilogue (rows 64 cw .. 64 cw + 63 of the
 * CTA's BM): its accumulators, scaled by 1 / row sum and converted, go to its own rows of the Q
 * tile at sq (free once its last Q K^T is done; the other warpgroups' rows are not touched) in
 * the same 128-byte swizzle -- the 8 rows of a warp's 4-byte stores land in 8 different 16-byte
 * chunks, no bank conflicts -- and the LSE of its rows under tile_rows goes out as
 * attn_store_row writes it, with scale_log2 per row (hf); t0: the packed token of the CTA's
 * first row.  DR, ON as h90_store_o_staged.  The rows are then for the caller to copy out
 * (h90_store_o_staged; the persistent kernel's TMA store), after a barrier.
 */
template <typename T, int D, int BM, int DR = D, int ON = D / 2>
static __device__ __forceinline__ void
h90_stage_o(const dk_attention_args &a, uint32_t sq, int cw, int wt, int64_t h, int64_t t0,
            int64_t tile_rows, const float (&l)[2], const float (&m)[2],
            const float (&scale_log2)[2], const float (&o)[ON])
{
    const int lane = wt & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float sum = l[hf];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        const int r = cw * 64 + (wt >> 5) * 16 + hf * 8 + g; /* row of the CTA's tile */
        if (a.lse != NULL && tq == 0 && r < tile_rows) {
            a.lse[(t0 + r) * a.lse_stride_token + h * a.lse_stride_head] =
                sum > 0.0f ? (__fmul_rn(m[hf], scale_log2[hf]) + log2f(sum)) / LOG2E : -INFINITY;
        }
#pragma unroll
        for (int dt = 0; dt < DR / 8; dt++) {
            st_shared_u32(
                sq + sw128(BM, (uint32_t)r, (uint32_t)dt) + 4u * (uint32_t)tq,
                half_ops<T>::pack(o[4 * dt + 2 * hf] * inv, o[4 * dt + 2 * hf + 1] * inv));
        }
    }
}

/*
 * The epilogue of a consumer warpgroup (rows 64 cw .. 64 cw + 63 of the CTA's BM) whose output
 * rows are 16-byte aligned: its rows staged in the Q tile at sq (h90_stage_o), then copied out
 * with 16-byte loads and stores, whole rows per warp instruction (two 256-byte rows at head
 * 128), where the accumulator layout gives 4 bytes per thread and row (8 scattered 16-byte
 * pieces per instruction, 32 instructions per thread at head 128).  Row sums, zero rows and the
 * LSE as attn_store_row, with scale_log2 per row (hf); t0: the packed token of the CTA's first
 * row, tile_rows: its rows inside the batch row.  sq: BM * D * 2 bytes, 1024-byte aligned.  DR:
 * the output's head dims (D: the tile's, DR rounded up to a wgmma panel; dims DR .. D - 1 are
 * not written), ON >= DR / 2 the accumulators O has (of the first ON * 2 dims).
 */
template <typename T, int D, int BM, int DR = D, int ON = D / 2>
static __device__ __forceinline__ void
h90_store_o_staged(const dk_attention_args &a, uint32_t sq, int cw, int wt, int64_t h, int64_t t0,
                   int64_t tile_rows, const float (&l)[2], const float (&m)[2],
                   const float (&scale_log2)[2], const float (&o)[ON])
{
    h90_stage_o<T, D, BM, DR, ON>(a, sq, cw, wt, h, t0, tile_rows, l, m, scale_log2, o);
    named_barrier(1u + (uint32_t)cw, 128u);
    constexpr int CH = D / 8; /* 16-byte chunks per row: 128 % CH == 0 but at 192 dims */
#pragma unroll
    for (int p = 0; p < 64 * CH / 128; p++) {
        /* chunk i of the warpgroup's rows: whole rows per pass where CH divides 128 */
        const int i = 128 * p + wt;
        const int r = cw * 64 + i / CH, c = i % CH;
        if (r < tile_rows && (DR == D || c < DR / 8)) {
            uint16_t *dst =
                (uint16_t *)a.out + h * a.o_stride_head + (t0 + r) * a.o_stride_token + 8 * c;
            *reinterpret_cast<uint4 *>(dst) = ld_shared16(sq + sw128(BM, (uint32_t)r, (uint32_t)c));
        }
    }
}

/*
 * Q rows row0 .. row0 + ROWS - 1 of the CTA's tile (zeros past the row's end) into the swizzled
 * Q tile at sq (BM rows) by THREADS threads, t being this one's index among them: 16-byte
 * cp.async chunks, element gathers for an odd-strided query; then a cp.async commit.  DR: the
 * query's head dims, D those of the tile (dims DR .. D - 1 become zeros).
 */
template <int D, int BM, int THREADS, int ROWS, int DR = D>
static __device__ __forceinline__ void
h90_load_q(const dk_attention_args &a, uint32_t sq, int t, int row0, int64_t q0, int64_t q_start,
           int64_t query_len, int64_t h, bool q_vec)
{
    constexpr int CHUNKS = D / 8; /* THREADS % CHUNKS == 0 but at 192 dims */
    static_assert(ROWS * CHUNKS % THREADS == 0, "whole passes");
#pragma unroll
    for (int pass = 0; pass < ROWS * CHUNKS / THREADS; pass++) {
        const int i = THREADS * pass + t; /* chunk i of the rows */
        const uint32_t r = (uint32_t)(row0 + i / CHUNKS), c = (uint32_t)(i % CHUNKS);
        const uint32_t dst = sq + sw128(BM, r, c);
        if (q0 + r < query_len && (DR == D || c < DR / 8)) {
            const uint16_t *src = (const uint16_t *)a.query +
                                  (q_start + q0 + r) * a.q_stride_token + h * a.q_stride_head +
                                  (int64_t)c * 8 * a.q_stride_dim;
            if (q_vec) {
                cp_async16(dst, src, 16u);
            }
            else {
                st_shared16(dst, gather_chunk(src, a.q_stride_dim));
            }
        }
        else {
            st_shared16(dst, make_uint4(0u, 0u, 0u, 0u));
        }
    }
    cp_async_commit();
}

/* Flips the sign of the Q rows h90_load_q (same arguments) brought in, once they landed. */
template <int D, int BM, int THREADS, int ROWS>
static __device__ __forceinline__ void
h90_negate_q(uint32_t sq, int t, int row0)
{
    constexpr int CHUNKS = D / 8;
#pragma unroll
    for (int pass = 0; pass < ROWS * CHUNKS / THREADS; pass++) {
        const int i = THREADS * pass + t; /* chunk i of the rows, as h90_load_q */
        const uint32_t dst = sq + sw128(BM, (uint32_t)(row0 + i / CHUNKS), (uint32_t)(i % CHUNKS));
        uint32_t v0, v1, v2, v3;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                     : "r"(dst)
                     : "memory");
        const uint32_t f = 0x80008000u;
        st_shared16(dst, make_uint4(v0 ^ f, v1 ^ f, v2 ^ f, v3 ^ f));
    }
}

/* O rescaled by the softmax's alpha: rows g (alpha[0]) and g + 8 (alpha[1]) of this thread. */
template <int DT>
static __device__ __forceinline__ void
h90_rescale_o(float (&o)[DT * 4], const float (&alpha)[2])
{
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        o[4 * dt + 0] *= alpha[0];
        o[4 * dt + 1] *= alpha[0];
        o[4 * dt + 2] *= alpha[1];
        o[4 * dt + 3] *= alpha[1];
    }
}

/* P (fp32, the S accumulator layout) as the A fragments of P V: keys 16 kk .. 16 kk + 15 in
 * pa[kk] (the mma.sync A layout per warp). */
template <typename T, int BN>
static __device__ __forceinline__ void
h90_pack_p(uint32_t (&pa)[BN / 16][4], const float (&s)[BN / 2])
{
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
        pa[kk][0] = half_ops<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = half_ops<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = half_ops<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = half_ops<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

/* What the softmax of a warpgroup's S tile needs about this thread's two rows. */
struct h90_rows {
    uint32_t q_slab; /* shared address of the warpgroup's 64 rows of Q */
    int32_t lim0;    /* key limit of row g */
    int32_t lim1;    /* key limit of row g + 8 */
    int32_t g_min;   /* smallest key limit of the warpgroup's rows */
    int tq;          /* lane % 4 */
    float scale_log2;
};

/* Issues S = Q K^T for one key tile (no commit) after a wgmma fence: D / 16 k-steps of 16 head
 * dims, 32 bytes apart within a 128-byte row; Q's 64-dim panels BM * 128 bytes apart and its
 * 8-row groups 1024.  K: panels khalf bytes apart and 8-row groups ksbo -- BN * 128 and 1024
 * (each panel a block of rows), or 1024 and 1024 P for a tile of P panels (K_GROUPS: the
 * panels of each 8-row group side by side, as one TMA box per 16-key block lands them). */
template <typename T, int D, int BN, int BM>
static __device__ __forceinline__ void
h90_qk(float (&s)[BN / 2], uint32_t q_slab, uint32_t sk, uint32_t khalf = BN * 128u,
       uint32_t ksbo = 1024u)
{
    fence_regs(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const uint32_t koff = (uint32_t)(kk & 3) * 32u;
        const uint64_t da =
            wgmma_desc(q_slab + (uint32_t)(kk >> 2) * (BM * 128u) + koff, 16u, 1024u);
        const uint64_t db = wgmma_desc(sk + (uint32_t)(kk >> 2) * khalf + koff, 16u, ksbo);
        h90_mma<T>::qk(s, da, db, kk > 0);
    }
}

/* This thread's A fragments of its warpgroup's Q rows for S = Q K^T from registers (the e4m3
 * kernel's), KS k-steps of 32 bytes (32 e4m3 dims): k-step kk's register i holds the 4 bytes at
 * byte 32 kk + 16 (i >> 1) + 4 tq of row r0 + 8 (i & 1) (the layout h90_pack_p gives P), read
 * once from the Q tile at sq (128-byte swizzled rows, 128-byte panels BM * 128 bytes apart). */
template <int KS, int BM>
static __device__ __forceinline__ void
h90_q_frags(uint32_t (&qa)[KS][4], uint32_t sq, int r0, int tq)
{
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t r = (uint32_t)(r0 + 8 * (i & 1));
            const uint32_t chunk = 2u * (uint32_t)kk + (uint32_t)(i >> 1); /* of the row */
            const uint32_t addr = sq + (chunk / 8u) * (BM * 128u) + r * 128u +
                                  (((chunk % 8u) ^ (r & 7u)) << 4) + 4u * (uint32_t)tq;
            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(qa[kk][i]) : "r"(addr) : "memory");
        }
    }
}

/*
 * Online softmax of one S tile in place (s becomes P, fp32): masks keys at or past each row's
 * limit (lim0: row g, lim1: row g + 8; only on a tile reaching past the warpgroup's smallest
 * limit g_min), updates the running max m (raw scores) and this thread's partial sums l, and
 * returns the factor alpha by which O must be rescaled.  s[4 nt + e]: row g (e < 2) or g + 8,
 * key j0 + 8 nt + 2 tq + (e & 1).  p = 2^(s * sl2 - m * sl2 + P_LOG2) with the row's multiplier
 * sl2[hf] (P_LOG2 > 0 scales P by 2^P_LOG2: the e4m3 kernel's, which the row sums carry too); a
 * row with no visible key so far keeps max -inf and subtracts 0 instead, so that 2^-inf = 0
 * rather than nan.  Returns whether O needs the rescale: with SKIP, false when no row of the
 * warp raised its max in this tile (every alpha is then exactly 1, as the eager form computes
 * it: skipping is bit-identical); without, always true.  CHAINS (a power of two dividing NT):
 * the row maxima and sums run as that many independent chains joined by a tree at the end --
 * instruction-level parallelism for a warp that has few others beside it on its scheduler (the
 * e4m3 kernel's: its products take half the time, so the softmax's latency shows); 1 keeps the
 * single chain in key order.
 */
template <int NT, bool SKIP, int P_LOG2, int CHAINS = 1>
static __device__ __forceinline__ bool
h90_softmax_rows(float (&s)[NT * 4], float (&m)[2], float (&l)[2], float (&alpha)[2], int32_t j0,
                 int32_t lim0, int32_t lim1, int32_t g_min, int tq, const float (&sl2)[2])
{
    bool raised = false;
    if (j0 + NT * 8 > g_min) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (j0 + nt * 8 + 2 * tq + (e & 1) >= (e < 2 ? lim0 : lim1)) {
                    s[4 * nt + e] = -INFINITY;
                }
            }
        }
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float mx;
        if constexpr (CHAINS == 1) {
            mx = fmaxf(s[2 * hf], s[2 * hf + 1]);
#pragma unroll
            for (int nt = 1; nt < NT; nt++) {
                mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
            }
        }
        else { /* CHAINS independent maxima, then their tree */
            float part[CHAINS];
#pragma unroll
            for (int c = 0; c < CHAINS; c++) {
                part[c] = fmaxf(s[4 * c + 2 * hf], s[4 * c + 2 * hf + 1]);
            }
#pragma unroll
            for (int nt = CHAINS; nt < NT; nt++) {
                part[nt % CHAINS] =
                    fmaxf(part[nt % CHAINS], fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
            }
#pragma unroll
            for (int w = CHAINS / 2; w > 0; w /= 2) {
#pragma unroll
                for (int c = 0; c < w; c++) {
                    part[c] = fmaxf(part[c], part[c + w]);
                }
            }
            mx = part[0];
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m[hf], mx);
        raised = raised || mn > m[hf];
        const float base = mn == -INFINITY ? 0.0f : __fmul_rn(mn, sl2[hf]);
        alpha[hf] = fast_exp2(__fmul_rn(m[hf], sl2[hf]) - base);
        m[hf] = mn;
        const float shifted = P_LOG2 == 0 ? base : base - (float)P_LOG2;
        float sum[CHAINS];
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
            sum[c] = 0.0f;
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float p0 = fast_exp2(fmaf(s[4 * nt + 2 * hf], sl2[hf], -shifted));
            const float p1 = fast_exp2(fmaf(s[4 * nt + 2 * hf + 1], sl2[hf], -shifted));
            s[4 * nt + 2 * hf] = p0;
            s[4 * nt + 2 * hf + 1] = p1;
            sum[nt % CHAINS] += p0 + p1;
        }
#pragma unroll
        for (int w = CHAINS / 2; w > 0; w /= 2) {
#pragma unroll
            for (int c = 0; c < w; c++) {
                sum[c] += sum[c + w];
            }
        }
        l[hf] = l[hf] * alpha[hf] + sum[0];
    }
    return !SKIP || __any_sync(0xffffffffu, raised) != 0; /* warp-uniform */
}

/* h90_softmax_rows for the fp16/bf16 kernels: r's limits, one multiplier for both rows. */
template <int NT, bool SKIP = false>
static __device__ __forceinline__ bool
h90_softmax(float (&s)[NT * 4], float (&m)[2], float (&l)[2], float (&alpha)[2], int32_t j0,
            const h90_rows &r)
{
    const float sl2[2] = {r.scale_log2, r.scale_log2};
    return h90_softmax_rows<NT, SKIP, 0>(s, m, l, alpha, j0, r.lim0, r.lim1, r.g_min, r.tq, sl2);
}

#endif /* H90_DEVICE_CODE */

#endif /* DIFFKV_SM90_TILES_CUH */
