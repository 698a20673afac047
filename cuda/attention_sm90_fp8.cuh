/*
 * attention_sm90_fp8.cuh -- the Hopper (sm_90a) paged attention kernel over a float8_e4m3fn
 * cache, head 64 or 128, fp16/bf16 queries and output: both products on the e4m3 tensor cores,
 * in the warp-specialized form of attention_sm90_ws.cu.  Its forms are instantiated in two files
 * (h8_launch): attention_sm90_fp8_tma.cu the TMA producer's, attention_sm90_fp8.cu the cp.async
 * producer's and the entry point.  They are compiled apart because ptxas schedules them best at
 * different register-usage levels (setup.py's NVCC_FILE_FLAGS: level 0 for the TMA forms, ~1 %
 * faster there and 0-2 % slower for the cp.async forms; docs/fp8-log.md, 2026-12-06).
 *
 * Three warpgroups, one CTA per SM: warpgroup 0 the producer, warpgroups 1 and 2 the consumers,
 * 64 query rows each (128 per CTA; a tile of at most 64 rows, warpgroup 1 alone), key tiles of
 * 256 keys (cuDNN's fp8 SDPA's width on Hopper: the fixed costs of a tile -- barrier waits, the
 * maxima's shuffles, O's rescale -- spread over twice the keys of a 128-key tile; docs/fp8.md,
 * *What is left*).
 *
 *   - Q: each consumer warpgroup loads its 64 rows once and rounds them to e4m3 with one scale
 *     per row, qs = max(L1 norm / 128, largest magnitude / 448), into a 128-byte swizzled tile
 *     (one 128-byte row per query row; head 64 leaves the second half of each row unused).  The
 *     rounded row's L1 norm is then under 136.2, so |S| = |q8 . k8| < 136.2 * 448 < 61,020
 *     whatever the keys hold (e4m3 is floating point: the scale's size costs no relative
 *     precision above e4m3's subnormals).  A negative softmax scale negates Q here.
 *   - K: S = Q K^T is wgmma m64n256k32 e4m3 with f16 accumulators (64 registers a thread) over
 *     D / 32 k-steps of the K slot; the scores' multiplier sl2 is softmax_scale * log2(e) *
 *     k_scale * qs(row).
 *   - V: wgmma reads 8-bit B operands K-major only, so P V needs V with the key index
 *     contiguous: a tile's V rows land in a staging slot as they lie, and the producer's
 *     threads, otherwise idle, transpose them into the V^T slot (two panels of one 128-key row
 *     per head dim; h8_transpose: ldmatrix.trans, two byte permutes, stmatrix) -- shared-memory
 *     traffic, not HBM.  The key order within each 32-key step is permuted so that P's
 *     registers are already the A operand's bytes: a thread's S holds keys 8n + 2t, 8n + 2t + 1
 *     of its rows, and the e4m3 A fragment wants columns 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3,
 *     so column 16 hh + 4t + i of a step holds key 16 hh + 8 (i / 2) + 2t + i % 2 (h8_pack_p16).
 *   - P: 2^((S - m) sc + 8) on S's f16 pairs (h8_softmax16: two HFMA2 and ex2.approx.f16x2 a
 *     pair, every 4th n-tile a polynomial on the FMA pipe instead, h8_exp2_poly, so that the MUFU
 *     and the FMA pipe share the exponentials; sc = sl2 in f16), i.e. 2^8 p in [0, 256], where
 *     e4m3 keeps 3 mantissa bits down to 2^-6 / 2^8 of the row max.  The row sums come from the
 *     tensor cores: V^T has 8 rows past D, the first all e4m3 ones, so P V (m64n136 / m64n72)
 *     puts the sum of P as rounded to e4m3 -- the weights O gets -- in O's column D, which is
 *     read into an fp32 l and zeroed after every tile (summed into a large accumulator, wgmma's
 *     fp8 products lose low bits: left there the sums measured 60 % more error on 4,525-key
 *     rows).  The 2^8 cancels in O / l and is taken out of the LSE.  A warpgroup with a
 *     multiplier past 32,752 (where 2 sc leaves f16) takes a four-step form of the exponent,
 *     still in f16 (h8_softmax16).
 *   - O (fp32) is scaled by v_scale once at the end.
 * Scales: k_scale and v_scale of the kv head (scale_stride_head 0: one per tensor), read once.
 *
 * Producers ("sm90-fp8-tma" / "sm90-fp8", attention.cu): TMA boxes of 16-key chunks where the
 * cache's per-chunk maps exist (h8_produce_tma: blocks of a multiple of 16 keys, or one block
 * per row; 8-key chunks, CK = 8, at blocks of an odd multiple of 8), else
 * cp.async rows (h8_produce); both fill the same 256-key tiles, so they compute the same bits.
 * Two K, two staging and two V^T slots (208 KB at head 128); every slot has a "full" and an
 * "empty" mbarrier.  Each consumer warpgroup issues tile kt's Q K^T with tile kt - 1's P V and
 * waits for the P V only after kt's softmax (the store to s_sink keeps ptxas from hoisting that
 * wait).  The consumers do not take turns (attention_sm90_ws.cu's ping-pong): measured without
 * it, the e4m3 kernel ran 3 % faster.  Keys past the row's last visible key are zeros in V^T
 * (cp.async's zero fill, or h8_transpose's mask); the mask drops their scores.
 *
 * Epilogue: 16-byte aligned output rows go out through the staging slots (free once the last
 * V^T landed: the producer's last read of them came before) with h90_store_o_staged, others
 * row by row (attn_store_row).
 *
 * Entry point (attention_internal.cuh): attn_sm90_fp8_launch, in attention_sm90_fp8.cu.
 */
#ifndef DIFFKV_ATTENTION_SM90_FP8_CUH
#define DIFFKV_ATTENTION_SM90_FP8_CUH

#include "attention_common.cuh"
#include "attention_internal.cuh"
#include "cuda_common.cuh"
#include "sm90_async.cuh"
#include "sm90_tiles.cuh"
#include "sm90_wgmma.cuh"

#include <cuda.h> /* CUtensorMap */
#include <string.h>

#include <type_traits>

#define H8_NC 2        /* consumer warpgroups */
#define H8_BM 128      /* query rows per CTA: 64 per consumer warpgroup */
#define H8_SVT 2       /* V^T slots */
#define H8_P_LOG2 8    /* P is rounded to e4m3 as 2^8 p */
#define H8_ROW 128u    /* bytes per row of the Q, K and staging tiles */
#define H8_Q_L1 128.0f /* Q rows are scaled to at most this L1 norm before rounding to e4m3 */
#define H8_VX 8u       /* V^T rows past D a panel: row D all ones (O's column D: P's row sums) */
#define H8_PRODUCER_REGS 72
#define H8_CONSUMER_REGS 216
#define H8_POLY_EVERY 4 /* every 4th n-tile's exponentials by h8_exp2_poly (8 of 32 a tile) */

/* Keys per tile and K and staging slots per producer: 256-key tiles, two of each slot beside Q and
 * two V^T slots (208 KB at head 128). */
template <bool TMA> struct h8_stages {
    static constexpr int BN = 256; /* keys per tile */
    static constexpr int ST = 2;   /* K slots */
    static constexpr int SR = 2;   /* staging slots (V rows as they lie) */
    /* producer threads that transpose V: warps 1..3 with TMA (warp 0 issues), else all four */
    static constexpr int TRANSPOSERS = TMA ? 96 : 128;
};

static_assert(H8_BM == ATTN_BM, "dk_cuda_attention sizes the grid with ATTN_BM");

#ifdef H90_DEVICE_CODE
/* Four floats as e4m3 bytes (saturating, round to nearest even): a in the lowest byte. */
static __device__ __forceinline__ uint32_t
h8_pack4(float a, float b, float c, float d)
{
    uint32_t r;
    asm("{\n.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};\n}\n"
        : "=r"(r)
        : "f"(a), "f"(b), "f"(c), "f"(d));
    return r;
}

/* Element e (0 .. 7) of a 16-byte chunk of fp16/bf16 T as fp32. */
template <typename T>
static __device__ __forceinline__ float
h8_elem(const uint4 &v, int e)
{
    const uint32_t w = e < 2 ? v.x : e < 4 ? v.y : e < 6 ? v.z : v.w;
    const uint16_t b = (uint16_t)((e & 1) ? w >> 16 : w & 0xFFFFu);
    if constexpr (std::is_same_v<T, __half>) {
        return __half2float(__ushort_as_half(b));
    }
    else {
        return __uint_as_float((uint32_t)b << 16);
    }
}

/*
 * Quantizes this consumer warpgroup's 64 Q rows (zeros past the row's end) into the e4m3 tile
 * at sq (128-byte swizzled rows) and their scales into s_qs: thread wt (0 .. 127) takes half
 * wt % 2 of row 64 cw + wt / 2.  The row's scale qs is the larger of its L1 norm / 128 and its
 * largest magnitude / 448 (no element past e4m3's 448), so that the rounded row's L1 norm is at
 * most 128 (1 + 2^-4) + D 2^-10 < 136.2 and every score |S| = |q8 . k8| of it stays under
 * 136.2 * 448 < 61,020 whatever the keys hold: S accumulates in f16 without overflow (a row whose
 * L1 norm is under 1e-30 becomes zeros, scale 1); neg_q negates the row.  The caller fences and
 * syncs the warpgroup after.
 */
template <typename T, int D>
static __device__ __forceinline__ void
h8_load_q(const dk_attention_args &a, uint32_t sq, float *s_qs, int cw, int wt, int64_t q0,
          int64_t q_start, int64_t query_len, int64_t h, bool q_vec, bool neg_q)
{
    constexpr int CH = D / 16; /* 8-element source chunks per half row */
    const uint32_t r = (uint32_t)(cw * 64 + wt / 2);
    const int half = wt & 1;
    uint4 x[CH];
    if (q0 + r < query_len) {
        const uint16_t *src = (const uint16_t *)a.query + (q_start + q0 + r) * a.q_stride_token +
                              h * a.q_stride_head + (int64_t)half * (D / 2) * a.q_stride_dim;
#pragma unroll
        for (int i = 0; i < CH; i++) {
            x[i] = q_vec ? *reinterpret_cast<const uint4 *>(src + 8 * i)
                         : gather_chunk(src + 8 * i * a.q_stride_dim, a.q_stride_dim);
        }
    }
    else {
#pragma unroll
        for (int i = 0; i < CH; i++) {
            x[i] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    float l1 = 0.0f, amax = 0.0f;
#pragma unroll
    for (int i = 0; i < CH; i++) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float v = fabsf(h8_elem<T>(x[i], e));
            l1 += v;
            amax = fmaxf(amax, v);
        }
    }
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    /* A row under 1e-30 is a row of zeros (its scores are below fp32's resolution of the
     * others'): 128 / l1 would overflow there, and 0 * inf is nan. */
    const bool live = l1 > 1e-30f;
    const float qs = live ? fmaxf(__fmul_rn(l1, 1.0f / H8_Q_L1), __fdiv_rn(amax, 448.0f)) : 1.0f;
    const float inv = live ? (neg_q ? -__frcp_rn(qs) : __frcp_rn(qs)) : 0.0f;
    if (half == 0) {
        s_qs[r] = qs;
    }
#pragma unroll
    for (int i = 0; i < CH; i += 2) { /* two source chunks: one 16-byte e4m3 chunk */
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint4 &v = x[i + j / 2];
            const int e = 4 * (j % 2);
            w[j] = h8_pack4(h8_elem<T>(v, e) * inv, h8_elem<T>(v, e + 1) * inv,
                            h8_elem<T>(v, e + 2) * inv, h8_elem<T>(v, e + 3) * inv);
        }
        const uint32_t c = (uint32_t)(half * (CH / 2) + i / 2);
        st_shared16(sq + sw128(H8_BM, r, c), make_uint4(w[0], w[1], w[2], w[3]));
    }
}

/* stmatrix x4 (no transpose): lanes 8m .. 8m + 7 give the row addresses of 8x8 b16 matrix m,
 * whose row l / 4 takes r[m]'s two b16 elements at columns 2 (l % 4), 2 (l % 4) + 1 from lane l. */
static __device__ __forceinline__ void
stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3)
{
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

/*
 * Transposes tile kt's V rows (landed in staging slot kt % SR, 128-byte swizzled rows) into
 * V^T slot kt % H8_SVT (BN / 128 panels of D + 8 rows: row n < D of panel p holds head dim n of
 * keys 128 p .. 128 p + 127 in the h8_pack_p16 order, 128-byte swizzle; rows D .. D + 7, the
 * ones row and zeros, are the kernel's, written once at its start),
 * after waiting for that slot's release, and arrives on its full barrier (every thread of the NW
 * transposing warps; w: this warp's index among them).  A warp step takes 16 keys (half hh of
 * a 32-key step kk: 16 (2 kk + hh) = 16 `half`) x 32 dims: ldmatrix.trans reads them as four
 * 8x8 b16 matrices, so lane (p, q) = (lane / 4, lane % 4) holds dims 2p, 2p + 1 of keys 2q,
 * 2q + 1 and of keys 8 + 2q, 9 + 2q (and 16 dims later); two byte permutes give dim 2p's word
 * and dim 2p + 1's, each the keys 2q, 2q + 1, 8 + 2q, 9 + 2q -- the order P's registers have --
 * and stmatrix writes them as rows of V^T.  Its matrices take dims 2p for p < 4 and 2p + 1 for
 * p >= 4 (or the reverse), so that a matrix's 8 rows fall in 8 different 16-byte bank groups
 * of the swizzle.  Keys at or past `valid` become zeros: the TMA producer's boxes bring whole
 * 16-key chunks, whose rows past the row's last key are stale (0 * nan is nan in P V); cp.async
 * zero-filled them already.  The caller made the staging slot's contents visible.
 */
template <int D, int NW, int SR, int BN>
static __device__ __forceinline__ void
h8_transpose(int32_t kt, int w, int32_t valid, uint32_t sr0, uint32_t svt0, uint32_t full_vt,
             uint32_t empty_vt)
{
    constexpr uint32_t VTB = (D + H8_VX) * BN;  /* a V^T slot: BN / 128 panels of D + 8 rows */
    constexpr int STEPS = (BN / 16) * (D / 32); /* (16 keys, 32 dims) steps per tile */
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t m = lane >> 3, r = lane & 7u; /* the matrix and row this lane addresses */
    const uint32_t p = lane >> 2, q = lane & 3u; /* the row and column pair it holds */
    const uint32_t slot = (uint32_t)(kt % H8_SVT);
    if (kt >= H8_SVT) { /* the phase the slot's last use ended */
        mbar_wait(empty_vt + 8u * slot, (uint32_t)((kt / H8_SVT - 1) & 1));
    }
    /* ldmatrix: key 8 (m & 1) + r of the step's 16, 16-byte chunk 2 dgp + m / 2 */
    const uint32_t src = sr0 + (uint32_t)(kt % SR) * (BN * H8_ROW) + (8u * (m & 1u) + r) * H8_ROW;
    /* stmatrix: dim 2r or 2r + 1 (+ 16 for matrices 2, 3) of the step's 32 */
    const uint32_t dim = ((m & 2u) << 3) + 2u * r + ((r >= 4u ? 1u : 0u) ^ (m & 1u));
    const uint32_t dst = svt0 + slot * VTB + dim * H8_ROW;
    const uint32_t sel0 = p < 4u ? 0x6420u : 0x7531u; /* dim 2p's bytes, or 2p + 1's */
    const uint32_t sel1 = p < 4u ? 0x7531u : 0x6420u;
    constexpr uint32_t PANEL = (D + H8_VX) * H8_ROW; /* a V^T panel: 128 keys */
    /* one step: 16 keys at source address sa (this lane's row and chunk), to V^T address da */
    const auto move = [&](uint32_t sa, uint32_t da) {
        uint32_t x[4];
        ldsm_x4_trans(x, sa);
        stsm_x4(da, __byte_perm(x[0], x[1], sel0), __byte_perm(x[0], x[1], sel1),
                __byte_perm(x[2], x[3], sel0), __byte_perm(x[2], x[3], sel1));
    };
    static_assert(BN == 256, "two V^T panels of 128 keys a tile (h8_stages)");
    /* the fixed split below: four warps at either head size, three (the TMA form's) over four
     * dim groups (head 128); three warps at head 64 take the general loop */
    constexpr bool FIXED = NW == 4 || D / 32 == 4;
    if (FIXED && valid >= BN) {
        /* A whole tile (every tile but a row's last): each warp a fixed set of steps whose
         * addresses are its lane's two bases plus constants -- ldmatrix, two byte permutes a
         * pair and stmatrix a step (the general loop below spends ~20 instructions a step on
         * its indices and masks, and its three warps were busy the whole tile: docs/fp8.md).
         * Warp w takes dim group w % G and PER halves from (w / G) PER; with three warps the
         * fourth dim group's 16 halves go 6 / 6 / 4. */
        constexpr int G = D / 32, HALVES = BN / 16;
        constexpr int PER = NW == 3 ? HALVES : HALVES * G / NW;
        static_assert(!FIXED || NW == 4 || (NW == 3 && G == 4), "the step split");
        const auto group = [&](uint32_t dgp, uint32_t h0) {
            const uint32_t sa = src + h0 * (16u * H8_ROW) + (((2u * dgp + (m >> 1)) ^ r) << 4);
            /* dst's low 7 bits are 0: adding (dim & 7) 16 then XOR-ing chunk 16 is the swizzle */
            const uint32_t db = dst + dgp * (32u * H8_ROW) + (h0 / 8u) * PANEL + ((dim & 7u) << 4);
#pragma unroll
            for (int i = 0; i < PER; i++) {
                move(sa + (uint32_t)i * (16u * H8_ROW),
                     (db ^ ((uint32_t)(i % 8) << 4)) + (uint32_t)(i / 8) * PANEL);
            }
        };
        group((uint32_t)w % G, ((uint32_t)w / G) * PER);
        if constexpr (NW == 3 && G == 4) {
            const uint32_t sa = src + (((2u * 3u + (m >> 1)) ^ r) << 4);
            const uint32_t db = dst + 3u * (32u * H8_ROW) + ((dim & 7u) << 4);
#pragma unroll
            for (int i = 0; i < 6; i++) {
                const uint32_t half = 6u * (uint32_t)w + (uint32_t)i;
                if (half < (uint32_t)HALVES) { /* warp-uniform */
                    move(sa + half * (16u * H8_ROW),
                         (db ^ ((half & 7u) << 4)) + (half >> 3) * PANEL);
                }
            }
        }
        fence_proxy_async(); /* the generic-proxy stores, for wgmma */
        mbar_arrive(full_vt + 8u * slot);
        return;
    }
#pragma unroll 2
    for (int i = 0; i < (STEPS + NW - 1) / NW; i++) {
        const uint32_t step = (uint32_t)(w + NW * i);
        if (step < (uint32_t)STEPS) { /* warp-uniform */
            const uint32_t half = step % (BN / 16u), dgp = step / (BN / 16u);
            const uint32_t panel = half / 8u, chunk = half % 8u;
            uint32_t x[4];
            ldsm_x4_trans(x, src + half * (16u * H8_ROW) + (((2u * dgp + (m >> 1)) ^ r) << 4));
            uint32_t y0 = __byte_perm(x[0], x[1], sel0), y1 = __byte_perm(x[0], x[1], sel1);
            uint32_t y2 = __byte_perm(x[2], x[3], sel0), y3 = __byte_perm(x[2], x[3], sel1);
            if (valid < BN) { /* the row's last tile: keys past valid become zeros */
                const int32_t k0 = (int32_t)(16u * half + 2u * q);
                const uint32_t keep = (k0 < valid ? 0xFFu : 0u) | (k0 + 1 < valid ? 0xFF00u : 0u) |
                                      (k0 + 8 < valid ? 0xFF0000u : 0u) |
                                      (k0 + 9 < valid ? 0xFF000000u : 0u);
                y0 &= keep;
                y1 &= keep;
                y2 &= keep;
                y3 &= keep;
            }
            /* panel half / 8 (keys 128 (half / 8) ..), 16-byte chunk half % 8 of its rows */
            stsm_x4(dst + panel * PANEL + dgp * (32u * H8_ROW) + ((chunk ^ (dim & 7u)) << 4), y0,
                    y1, y2, y3);
        }
    }
    fence_proxy_async(); /* the generic-proxy stores, for wgmma */
    mbar_arrive(full_vt + 8u * slot);
}

/*
 * The cp.async producer warpgroup (128 threads): per key tile, thread t resolves keys t and
 * t + 128's row offsets into a shared ring of two tiles; then K's rows go by cp.async into K slot
 * kt % ST (arriving on its full barrier as they land) and V's into staging slot kt % SR, 16-byte
 * chunk tid % CH of rows tid / CH + (128 / CH) i, zero-filled past kv_end; then tile kt - 1's V,
 * landed by now, is transposed.  Barrier 15 (once per tile, after the ring is written) also orders
 * every thread's transpose of tile kt - 2 before the copies into its staging slot; barrier 14 makes
 * tile kt - 1's staging copies visible to the transpose.
 */
template <int D>
static __device__ __forceinline__ void
h8_produce(const dk_attention_args &a, int64_t h, int64_t row, int32_t kv_end, int32_t n_tiles,
           uint32_t sk0, uint32_t sr0, uint32_t svt0, uint32_t full_k, uint32_t full_vt,
           uint32_t empty_k, uint32_t empty_vt)
{
    constexpr int CH = D / 16;   /* 16-byte chunks per key row */
    constexpr int RP = 128 / CH; /* rows per pass of the 128 threads */
    constexpr int BN = h8_stages<false>::BN;
    constexpr int KPT = BN / 128; /* keys per thread: tid, tid + 128, .. */
    __shared__ int64_t s_off[2][BN];
    const int tid = (int)threadIdx.x;
    const int64_t kvh = h / (a.num_heads / a.num_kv_heads);
    const int32_t *const bt = a.block_table + row * a.bt_stride_row;
    const char *const kc = (const char *)a.key_cache, *const vc = (const char *)a.value_cache;
    const char *const kc2 = (const char *)a.key_cache2, *const vc2 = (const char *)a.value_cache2;
    const uint32_t bs = (uint32_t)a.block_size;
    const uint32_t c = (uint32_t)(tid % CH), rr = (uint32_t)(tid / CH);
    int32_t blk[KPT]; /* loaded a tile ahead */
#pragma unroll
    for (int e = 0; e < KPT; e++) {
        const int32_t j = tid + 128 * e;
        blk[e] = j < kv_end ? bt[(uint32_t)j / bs] : 0;
    }
    constexpr int ST = h8_stages<false>::ST, SR = h8_stages<false>::SR;
    for (int32_t kt = 0; kt < n_tiles; kt++) {
        const int32_t j0 = kt * BN;
#pragma unroll
        for (int e = 0; e < KPT; e++) {
            const int32_t j = j0 + tid + 128 * e;
            s_off[kt & 1][tid + 128 * e] =
                j < kv_end ? kv_block_offset<1>(a, dk_safe_block(a, blk[e]), (uint32_t)j % bs, kvh)
                           : 0;
            const int32_t jn = j + BN;
            blk[e] = jn < kv_end ? bt[(uint32_t)jn / bs] : 0;
        }
        named_barrier(15u, 128u);
        const int64_t *const offs = s_off[kt & 1];
        const uint32_t slot_k = (uint32_t)(kt % ST);
        if (kt >= ST) {
            mbar_wait(empty_k + 8u * slot_k, (uint32_t)((kt / ST - 1) & 1));
        }
        const uint32_t dk = sk0 + slot_k * (BN * H8_ROW);
        const uint32_t dv = sr0 + (uint32_t)(kt % SR) * (BN * H8_ROW);
#pragma unroll
        for (int i = 0; i < BN / RP; i++) {
            const uint32_t r = rr + (uint32_t)(RP * i);
            cp_async16(dk + sw128(BN, r, c), kv_row(kc, kc2, offs[r]) + c * 16u,
                       j0 + (int32_t)r < kv_end ? 16u : 0u);
        }
        cp_async_arrive_noinc(full_k + 8u * slot_k);
#pragma unroll
        for (int i = 0; i < BN / RP; i++) {
            const uint32_t r = rr + (uint32_t)(RP * i);
            cp_async16(dv + sw128(BN, r, c), kv_row(vc, vc2, offs[r]) + c * 16u,
                       j0 + (int32_t)r < kv_end ? 16u : 0u);
        }
        cp_async_commit();
        if (kt > 0) {
            asm volatile("cp.async.wait_group 1;\n" ::: "memory"); /* tile kt - 1's copies */
            named_barrier(14u, 128u);
            h8_transpose<D, 4, SR, BN>(kt - 1, tid / 32, BN, sr0, svt0, full_vt, empty_vt);
        }
    }
    cp_async_wait_all();
    if (n_tiles > 0) {
        named_barrier(14u, 128u);
        h8_transpose<D, 4, SR, BN>(n_tiles - 1, tid / 32, BN, sr0, svt0, full_vt, empty_vt);
    }
}

/*
 * The TMA warp's lane state before its first tile (h8_produce_tma's t0), computed before the
 * CTA's key limits are known: the lane's chunk positions of tiles 0 and 2 (key CK lane of the
 * tile, at block-table column col and token tok of its block) and the block-table entries of
 * its chunks of tiles 0 and 1 -- those within the row's seq_len keys, a bound of the key limits'
 * kv_end (h8_produce_tma clamps with kv_end).  After the limits the warp goes straight to its
 * first boxes: done after them, this setup put the first K box 2.2 us after the warp's start
 * (docs/fp8-log.md, *The TMA warp's setup before the key limits*).
 */
struct h8_tma_lane {
    const int32_t *bt;
    uint32_t nblocks, bs, step_q, step_r;
    uint32_t col0, tok0, col2, tok2;
    int32_t kvh, raw0, raw1;
};

template <int CK>
static __device__ __forceinline__ h8_tma_lane
h8_tma_begin(const dk_attention_args &a, int64_t h, int64_t row, int64_t seq_len)
{
    constexpr uint32_t BN = (uint32_t)h8_stages<true>::BN;
    const uint32_t lane = threadIdx.x & 31u;
    h8_tma_lane t;
    t.kvh = (int32_t)(h / (a.num_heads / a.num_kv_heads));
    t.bt = a.block_table + row * a.bt_stride_row;
    t.nblocks = (uint32_t)min(a.num_blocks, (int64_t)INT32_MAX);
    t.bs = (uint32_t)a.block_size;
    t.step_q = BN / t.bs;
    t.step_r = BN % t.bs;
    t.col0 = CK * lane / t.bs;
    t.tok0 = CK * lane % t.bs;
    uint32_t c1 = t.col0 + t.step_q, k1 = t.tok0 + t.step_r;
    if (k1 >= t.bs) {
        c1++;
        k1 -= t.bs;
    }
    t.col2 = c1 + t.step_q;
    t.tok2 = k1 + t.step_r;
    if (t.tok2 >= t.bs) {
        t.col2++;
        t.tok2 -= t.bs;
    }
    const bool in0 = lane < BN / CK && CK * (int64_t)lane < seq_len;
    const bool in1 = lane < BN / CK && (int64_t)(BN + CK * lane) < seq_len;
    t.raw0 = in0 ? t.bt[t.col0] : 0;
    t.raw1 = in1 ? t.bt[c1] : 0;
    return t;
}

/*
 * The TMA producer warpgroup (blocks of a multiple of CK keys, or one block per row, every
 * block's rows in one map: h8_tma_chunk_maps): warp 0's lanes 0 .. BN / CK - 1 each bring one
 * CK-key chunk of a tile as a TMA box of CK rows x 128 bytes -- CK = 16, or 8 at blocks of an
 * odd multiple of 8 keys (its boxes land at 1,024-byte steps, the 128-byte swizzle's period, so
 * the slot holds the same bytes); at head 64 the rows' second halves are zeros, which nothing
 * reads, as are a one-block row's keys past its block -- K into K slot kt % ST, V into
 * staging slot kt % SR -- lane 0 expecting the tile's bytes on the slot's full barrier; chunks
 * at or past kv_end are not fetched.  The block ids come two tiles ahead (below); tiles 0 and
 * 1's, with the lane's positions, come from h8_tma_begin (t0), which the kernel runs before its
 * key limits.  Warps 1 .. 3 transpose: per tile they wait for its staging, transpose it
 * (h8_transpose, 96 threads) and release the staging slot (one arrive per warp).  No thread of
 * this warpgroup waits for a copy it issued, so the issuing warp runs ahead by the slots it has.
 */
template <int D, int CK>
static __device__ __forceinline__ void
h8_produce_tma(int32_t kv_end, int32_t n_tiles, const h8_tma_lane &t0, uint32_t sk0, uint32_t sr0,
               uint32_t svt0, uint32_t full_k, uint32_t full_s, uint32_t full_vt, uint32_t empty_k,
               uint32_t empty_s, uint32_t empty_vt, const CUtensorMap *tmk, const CUtensorMap *tmv)
{
    constexpr int ST = h8_stages<true>::ST, SR = h8_stages<true>::SR, BN = h8_stages<true>::BN;
    constexpr uint32_t CHUNK = CK * H8_ROW; /* bytes of a CK-key box */
    static_assert(D == 128 || D == 64, "a 128-byte box row per key (head 64: half zeros)");
    static_assert((CK == 16 || CK == 8) && BN / CK <= 32, "a lane per chunk of a tile");
    const int warp = (int)(threadIdx.x >> 5);
    const int lane = (int)(threadIdx.x & 31u);
    if (warp != 0) {
        for (int32_t kt = 0; kt < n_tiles; kt++) {
            const uint32_t ss = (uint32_t)(kt % SR);
            mbar_wait(full_s + 8u * ss, (uint32_t)((kt / SR) & 1));
            h8_transpose<D, 3, SR, BN>(kt, warp - 1, kv_end - kt * BN, sr0, svt0, full_vt,
                                       empty_vt);
            __syncwarp();
            if (lane == 0) {
                mbar_arrive(empty_s + 8u * ss);
            }
        }
        return;
    }
    const int32_t kvh = t0.kvh;
    const int32_t *const bt = t0.bt;
    const uint32_t nblocks = t0.nblocks;
    const uint32_t bs = t0.bs;
    /* This lane's chunk of a tile: key kt BN + CK lane, at block-table column col and token tok
     * of its block, stepped a tile at a time (no division in the loop).  Its block id is loaded
     * two tiles ahead and clamped (dk_safe_block's) an iteration later, so that the warp never
     * waits for a load between a slot's release and the copies into it. */
    struct pos {
        uint32_t col, tok;
    };
    const uint32_t step_q = t0.step_q, step_r = t0.step_r;
    const auto advance = [&](pos p) -> pos {
        const uint32_t t = p.tok + step_r;
        return t >= bs ? pos{p.col + step_q + 1u, t - bs} : pos{p.col + step_q, t};
    };
    /* whether the lane has a chunk of tile kt (one before kv_end) */
    const auto has = [&](int32_t kt) { return lane < BN / CK && kt * BN + CK * lane < kv_end; };
    const auto load = [&](int32_t kt, pos p) -> int32_t { return has(kt) ? bt[p.col] : 0; };
    /* the block to fetch from tile kt's loaded entry; -1: none */
    const auto clamp = [&](int32_t kt, int32_t b) -> int32_t {
        return !has(kt) ? -1 : (uint32_t)b < nblocks ? b : 0;
    };
    pos p0 = {t0.col0, t0.tok0}; /* tile kt's */
    pos p2 = {t0.col2, t0.tok2}; /* tile kt + 2's */
    int32_t blk = clamp(0, t0.raw0);
    int32_t raw1 = t0.raw1; /* tile kt + 1's entry, not yet clamped */
    for (int32_t kt = 0; kt < n_tiles; kt++) {
        const int32_t raw2 = load(kt + 2, p2);
        const uint32_t bytes = (uint32_t)min(BN / CK, (kv_end - kt * BN + CK - 1) / CK) * CHUNK;
        /* K into slot kt % ST, then V into staging slot kt % SR, each once its slot is free */
        const auto issue = [&](int stages, uint32_t dst0, uint32_t full, uint32_t empty,
                               const CUtensorMap *map) {
            const uint32_t slot = (uint32_t)(kt % stages);
            if (kt >= stages) {
                mbar_wait(empty + 8u * slot, (uint32_t)((kt / stages - 1) & 1));
            }
            if (lane == 0) {
                mbar_arrive_expect_tx(full + 8u * slot, bytes);
            }
            __syncwarp();
            if (blk >= 0) {
                tma_load_4d(dst0 + slot * (BN * H8_ROW) + (uint32_t)lane * CHUNK, map,
                            full + 8u * slot, 0, (int32_t)p0.tok, kvh, blk);
            }
        };
        issue(ST, sk0, full_k, empty_k, tmk);
        issue(SR, sr0, full_s, empty_s, tmv);
        blk = clamp(kt + 1, raw1);
        raw1 = raw2;
        p0 = advance(p0);
        p2 = advance(p2);
    }
}

/* O += P V in e4m3 for one key tile of BN keys (no commit): BN / 32 steps of P (registers) times
 * the V^T slot of descriptor dv -- panel kk / 4 (keys 128 (kk / 4) .., D + 8 rows of 128 bytes
 * each: O's columns D .. D + 7 take the ones row and the zeros after it), 32 bytes a step within
 * its rows. */
template <int D, int BN>
static __device__ __forceinline__ void
h8_pv(float (&o)[D / 2 + H8_VX / 2], const uint32_t (&pa)[BN / 32][4], uint64_t dv)
{
#pragma unroll
    for (int kk = 0; kk < BN / 32; kk++) {
        h90_pv_e4m3(o, pa[kk],
                    dv + (uint32_t)(kk / 4) * ((D + H8_VX) * H8_ROW >> 4) +
                        2u * (uint32_t)(kk % 4));
    }
}

static __device__ __forceinline__ __half2
h8_h2(uint32_t x)
{
    return *reinterpret_cast<__half2 *>(&x);
}
static __device__ __forceinline__ uint32_t
h8_u32(__half2 x)
{
    return *reinterpret_cast<uint32_t *>(&x);
}

/*
 * 2^t for a pair of f16 exponents t <= 8 on the FMA pipe instead of the MUFU (XU): the softmax
 * takes every 4th n-tile's exponentials here (h8_softmax16).  The XU runs one warp's MUFU.EX2.F16
 * in 8 cycles and does the two consumer warps' 256 a tile in 2,048 of the ~3,750 cycles a tile
 * step takes; this form's 7 f16 instructions at 2 cycles each cost as much on the FMA pipe, so
 * the two pipes share the work: 1-2.5 % faster with 8 of 32 n-tiles here (5 of 32 about as
 * much, 10 less, 16 of 32 was 1-2 % slower; docs/fp8.md, *What is left* 1).
 *   x = S / 2 - m / 2 and sc2 = 2 sc, from which h8_softmax16 forms t = x sc2 + 8.  Then
 *   t' = max(t + 14, 0) in [0, 22] (one HFMA2.RELU); y = t' + 1025 is 1025 + j with j the integer
 *   nearest t' (f16's spacing is 1 in [1024, 2048)), f = t' - j in [-1/2, 1/2] (both exact);
 *   2^f by a degree-2 minimax polynomial (relative error 1.7e-3); 2^(j - 14) is the f16 whose
 *   biased exponent is j + 1, the low 5 bits of y's (j + 1 <= 23) shifted into place (one shift
 *   of the word: no mask, which would be one more ALU instruction; below).  Relative
 *   error under 1 % (t' is rounded at 2^-6 against t's 2^-7 in the MUFU form) before P's rounding
 *   to e4m3 (up to 6.25 %).  t < -14 gives 2^-14 instead of 2^t: both pack to e4m3 0, as all
 *   under 2^-10 do; S = -inf (a masked key) gives t' = 0, the same; nan stays nan (fma.relu).
 */
static __device__ __forceinline__ uint32_t
h8_exp2_poly(__half2 x, __half2 sc2)
{
    const __half2 tp = __hfma2_relu(x, sc2, __float2half2_rn((float)H8_P_LOG2 + 14.0f));
    const __half2 magic = __float2half2_rn(1025.0f);
    const __half2 y = __hadd2(tp, magic);
    const __half2 f = __hsub2(tp, __hsub2(y, magic));
    /* y << 10 on the whole word: the low half is 2^(j - 14) exactly; the high half gets its
     * exponent field too, and as mantissa the low half's bits 6 .. 15, 0x190 (y's low half is
     * 0x6400 + j + 1 < 0x6440): 2^(j - 14) x 1.390625, which its coefficients divide out (a
     * nan low half -- a nan score -- shifts other bits there, in a row whose output is nan) */
    constexpr float R = 1.0f / 1.390625f;
    const __half2 c2 = __floats2half2_rn(0.23842184f, 0.23842184f * R);
    const __half2 c1 = __floats2half2_rn(0.7034351f, 0.7034351f * R);
    const __half2 c0 = __floats2half2_rn(1.0004426f, 1.0004426f * R);
    const __half2 q = __hfma2(__hfma2(c2, f, c1), f, c0);
    return h8_u32(__hmul2(q, h8_h2(h8_u32(y) << 10)));
}

/*
 * The online softmax of one key tile on S's f16 pairs in place (s[2 nt + hf]: row g + 8 hf, keys
 * j0 + 8 nt + 2 tq in the low half and + 1 in the high): keys at or past the row's limit become
 * -inf; the row maxima m (f16 values, -inf before any visible key) by HMNMX2, both rows' in one
 * shuffled pair; then p = 2^((S / 2 - m / 2) 2 sc + 8) by two HFMA2 and ex2.approx.f16x2 per pair
 * (sc: the row's multiplier in f16, h8_consume): S / 2 - m / 2 stays within f16 (|S| < 61,020,
 * Q's scaling; S - m itself could pass 65,504 where a small sc still leaves p well above 0), one
 * rounding, exact near the max, where p matters; p <= 2^8 = 2^P_LOG2 at the max.  alpha =
 * 2^((m - m') sc) in fp32 for O, whose column D holds the row sums (P V against V^T's row of
 * ones: no sums here).  Returns whether some row's max rose (warp-uniform): O needs the rescale
 * by alpha.
 */
template <int BN>
static __device__ __forceinline__ bool
h8_softmax16(uint32_t (&s)[BN / 4], float (&m)[2], float (&alpha)[2], int32_t j0, int32_t lim0,
             int32_t lim1, int32_t g_min, int tq, const float (&sc)[2], bool big)
{
    constexpr int NT = BN / 8;
    if (j0 + BN > g_min) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int32_t k = j0 + nt * 8 + 2 * tq, lim = hf ? lim1 : lim0;
                const uint32_t x = s[2 * nt + hf];
                s[2 * nt + hf] = k >= lim       ? 0xFC00FC00u
                                 : k + 1 >= lim ? (x & 0xFFFFu) | 0xFC000000u
                                                : x;
            }
        }
    }
    __half2 part[2][4];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            part[hf][c] = h8_h2(s[2 * c + hf]);
        }
#pragma unroll
        for (int nt = 4; nt < NT; nt++) {
            part[hf][nt % 4] = __hmax2(part[hf][nt % 4], h8_h2(s[2 * nt + hf]));
        }
    }
    const __half2 m0 = __hmax2(__hmax2(part[0][0], part[0][1]), __hmax2(part[0][2], part[0][3]));
    const __half2 m1 = __hmax2(__hmax2(part[1][0], part[1][1]), __hmax2(part[1][2], part[1][3]));
    __half2 mm = __hmax2(__lows2half2(m0, m1), __highs2half2(m0, m1));
    mm = __hmax2(mm, h8_h2(__shfl_xor_sync(0xffffffffu, h8_u32(mm), 1)));
    mm = __hmax2(mm, h8_h2(__shfl_xor_sync(0xffffffffu, h8_u32(mm), 2)));
    const float mx[2] = {__low2float(mm), __high2float(mm)};
    bool raised = false;
    __half2 sc2[2], mu2[2]; /* 2 sc; -m / 2 */
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const float mn = fmaxf(m[hf], mx[hf]);
        raised = raised || mn > m[hf];
        /* m - mn of two f16 values is exact in fp32 */
        alpha[hf] = m[hf] == -INFINITY ? 0.0f : fast_exp2(__fmul_rn(m[hf] - mn, sc[hf]));
        m[hf] = mn;
        sc2[hf] = __float2half2_rn(2.0f * sc[hf]);
        mu2[hf] = __float2half2_rn(mn == -INFINITY ? 0.0f : -0.5f * mn); /* -inf + inf is nan */
    }
    if (big) {
        /* BIG: a warpgroup with a multiplier past 32,752 (rare; a warp-uniform branch, so that
         * one loop serves both -- two instantiations of h8_consume made ptxas serialize the
         * wgmmas).  Its rows past 32,752 take t = (S - m) 2^15 c2 (sc / 2^15 / c2) + 8 in f16:
         * S - m may become -inf, which is right (the exponent is then below -65,504 x 32,752);
         * c2 = 2^15 past sc = 2^31 (any nonzero S - m then gives p = 0, as the exact p underflows
         * too) and the last factor at most 65,504.  Its other rows take the form below in the
         * same four steps (S / 2 - m / 2, then 1, 1 and 2 sc). */
        const __half2 shift = __float2half2_rn((float)H8_P_LOG2);
        __half2 h[2], nm[2], c1[2], c2[2], sb[2];
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const bool past = sc[hf] > 32752.0f, huge = sc[hf] > 0x1p31f;
            h[hf] = __float2half2_rn(past ? 1.0f : 0.5f);
            nm[hf] = past ? __float2half2_rn(m[hf] == -INFINITY ? 0.0f : -m[hf]) : mu2[hf];
            c1[hf] = __float2half2_rn(past ? 0x1p15f : 1.0f);
            c2[hf] = __float2half2_rn(huge ? 0x1p15f : 1.0f);
            sb[hf] = past ? __float2half2_rn(fminf(sc[hf] * (huge ? 0x1p-30f : 0x1p-15f), 65504.0f))
                          : sc2[hf];
        }
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const __half2 t = __hfma2(
                    __hmul2(__hmul2(__hfma2(h8_h2(s[2 * nt + hf]), h[hf], nm[hf]), c1[hf]), c2[hf]),
                    sb[hf], shift);
                uint32_t p;
                asm("ex2.approx.f16x2 %0, %1;" : "=r"(p) : "r"(h8_u32(t)));
                s[2 * nt + hf] = p;
            }
        }
        return __any_sync(0xffffffffu, raised) != 0;
    }
    const __half2 shift = __float2half2_rn((float)H8_P_LOG2), half = __float2half2_rn(0.5f);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const __half2 x = __hfma2(h8_h2(s[2 * nt + hf]), half, mu2[hf]);
            if (nt % H8_POLY_EVERY == H8_POLY_EVERY - 1) {
                s[2 * nt + hf] = h8_exp2_poly(x, sc2[hf]);
            }
            else {
                const __half2 t = __hfma2(x, sc2[hf], shift);
                uint32_t p; /* cuda_fp16's h2exp2 goes through fp32; this is two MUFU.EX2.F16 */
                asm("ex2.approx.f16x2 %0, %1;" : "=r"(p) : "r"(h8_u32(t)));
                s[2 * nt + hf] = p;
            }
        }
    }
    return __any_sync(0xffffffffu, raised) != 0;
}

/* P (2^8 p, S's f16 pairs) as the e4m3 A fragments of P V in the kernel's key order (register
 * 0 of step kk: row g, the pairs of n-tiles 4 kk and 4 kk + 1 -- keys 2t, 2t + 1, 8 + 2t, 9 + 2t
 * of the step; 1: the same of row g + 8; 2, 3: n-tiles 4 kk + 2 and 4 kk + 3). */
template <int BN>
static __device__ __forceinline__ void
h8_pack_p16(uint32_t (&pa)[BN / 32][4], const uint32_t (&s)[BN / 4])
{
#pragma unroll
    for (int kk = 0; kk < BN / 32; kk++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = 8 * kk + 4 * (j / 2) + j % 2;
            uint16_t lo, hi;
            asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(lo) : "r"(s[i]));
            asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(hi) : "r"(s[i + 2]));
            pa[kk][j] = (uint32_t)hi << 16 | lo;
        }
    }
}

/* The consumer's key-tile barriers and slots (h8_consume). */
struct h8_ring {
    uint32_t full_k, full_vt, empty_k, empty_vt; /* mbarrier arrays */
    uint64_t dk0, dv0;                           /* wgmma descriptors of K and V^T slot 0 */
    uint32_t sink;                               /* this thread's s_sink word */
};

/*
 * One consumer warpgroup's pass over the key tiles (BN keys each): O (fp32), the rows' sums l
 * of P as rounded to e4m3 (O's column D, from V^T's row of ones, taken into l after each tile;
 * thread tq = 0 of a quad holds them, the others 0) and the LSE base lm (log2 units: the
 * log-sum-exp of the scaled scores is lm + log2(l / 2^8)).
 * S = Q K^T is accumulated in f16 by the e4m3 wgmma (BN / 4 registers), the softmax runs on its
 * pairs (h8_softmax16) with sc = sl2 in f16, at least 2^-24 (so that -inf * sc stays -inf: a
 * smaller multiplier moves no exponent by more than 61,020 * 2^-25 < 2^-9); a warpgroup with a
 * row's multiplier past 32,752 (big: the caller's vote) takes the softmax's BIG form.  Each
 * warpgroup issues tile kt's Q K^T with tile kt - 1's P V and waits for the P V only after kt's
 * softmax (the store to the sink word keeps ptxas from hoisting that wait).
 */
template <int D, bool TMA>
static __device__ __forceinline__ void
h8_consume(float (&o)[D / 2 + H8_VX / 2], float (&l)[2], float (&lm)[2],
           const uint32_t (&qa)[D / 32][4], const h8_ring &ring, int32_t n_tiles, int32_t lim0,
           int32_t lim1, int32_t g_min, int tq, int lane, const float (&sl2)[2], bool big)
{
    constexpr int ST = h8_stages<TMA>::ST, BN = h8_stages<TMA>::BN;
    constexpr uint32_t TILE = BN * H8_ROW;
    constexpr uint32_t VTB = (D + H8_VX) * BN;
    uint32_t s[BN / 4];
    uint32_t pa[BN / 32][4];
    float m[2] = {-INFINITY, -INFINITY};
    float sc[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        /* a nan or infinite multiplier (a nan or infinite scale) stays nan: the outputs are nan;
         * one past 32,752 (2 sc past f16's range) is kept in fp32 for h8_softmax16's BIG form */
        sc[hf] = !isfinite(sl2[hf])   ? __int_as_float(0x7fffffff)
                 : sl2[hf] > 32752.0f ? sl2[hf]
                                      : fmaxf(__half2float(__float2half_rn(sl2[hf])), 0x1p-24f);
    }
    /* S = Q K^T for the tile in K slot `slot` (no commit): D / 32 k-steps of 32 bytes */
    const auto qk = [&](uint32_t slot) {
        const uint64_t dk = ring.dk0 + slot * (TILE >> 4);
        fence_regs(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 32; kk++) {
            wgmma_rs_e4m3_f16(s, qa[kk], dk + 2u * (uint32_t)kk, kk > 0);
        }
    };
    for (int32_t kt = 0; kt < n_tiles; kt++) {
        const int32_t j0 = kt * BN;
        const uint32_t slot = (uint32_t)(kt % ST);
        float alpha[2];
        if (kt == 0) {
            mbar_wait(ring.full_k + 8u * slot, (uint32_t)((kt / ST) & 1)); /* K_kt landed */
            if (!TMA) {
                fence_proxy_async(); /* cp.async (generic proxy) writes, for wgmma */
            }
            qk(slot);
            wgmma_commit();
            wgmma_wait_all();
            fence_regs(s);
            if (lane == 0) {
                mbar_arrive(ring.empty_k + 8u * slot);
            }
            h8_softmax16<BN>(s, m, alpha, j0, lim0, lim1, g_min, tq, sc, big);
        }
        else {
            const uint32_t pslot = (uint32_t)((kt - 1) % H8_SVT);
            /* K_kt landed, V^T_{kt-1}: both tests issued before either is waited on */
            mbar_wait2(ring.full_k + 8u * slot, (uint32_t)((kt / ST) & 1),
                       ring.full_vt + 8u * pslot, (uint32_t)(((kt - 1) / H8_SVT) & 1));
            if (!TMA) {
                fence_proxy_async(); /* cp.async (generic proxy) writes, for wgmma */
            }
            qk(slot);
            wgmma_commit();
            h8_pv<D, BN>(o, pa, ring.dv0 + pslot * (VTB >> 4)); /* O += P V of the tile before */
            wgmma_commit();
            wgmma_wait_1(); /* S_kt done; P_{kt-1} V_{kt-1} may still run */
            fence_regs(s);
            if (lane == 0) {
                mbar_arrive(ring.empty_k + 8u * slot);
            }
            const bool rescale = h8_softmax16<BN>(s, m, alpha, j0, lim0, lim1, g_min, tq, sc, big);
            /* P V of the tile before runs under this softmax: ptxas would hoist the wait above
             * it (attention_sm90_ws.cu, LATE_PV_WAIT) but for a store that needs the softmax's
             * results, to a word nothing reads. */
            st_shared_u32(ring.sink, s[BN / 4 - 1] ^ s[BN / 4 - 2]);
            wgmma_wait_all();
            fence_regs(o);
            if (lane == 0) {
                mbar_arrive(ring.empty_vt + 8u * pslot);
            }
            /* O's column D: the sums of P_{kt-1} (at m_{kt-1}, as l), afresh each tile: the
             * wgmma's accumulation loses low bits against a large accumulator */
            l[0] = (l[0] + o[D / 2]) * alpha[0];
            l[1] = (l[1] + o[D / 2 + 2]) * alpha[1];
            o[D / 2] = 0.0f;
            o[D / 2 + 2] = 0.0f;
            if (rescale) {
                h90_rescale_o<(D + H8_VX) / 8>(o, alpha);
            }
        }
        h8_pack_p16<BN>(pa, s);
    }
    if (n_tiles > 0) {
        const uint32_t lslot = (uint32_t)((n_tiles - 1) % H8_SVT);
        mbar_wait(ring.full_vt + 8u * lslot, (uint32_t)(((n_tiles - 1) / H8_SVT) & 1));
        fence_regs(o);
        wgmma_fence();
        h8_pv<D, BN>(o, pa, ring.dv0 + lslot * (VTB >> 4));
        wgmma_commit();
        wgmma_wait_all();
        fence_regs(o);
        l[0] += o[D / 2];
        l[1] += o[D / 2 + 2];
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        lm[hf] = m[hf] == -INFINITY ? -INFINITY : __fmul_rn(m[hf], sc[hf]);
    }
}

#endif /* H90_DEVICE_CODE */

template <typename T, int D, bool TMA, int CK>
/* clang-format off */
static __global__ void __launch_bounds__(128 * (H8_NC + 1), 1)
attention_sm90_fp8_kernel(const __grid_constant__ CUtensorMap tmk,
                          const __grid_constant__ CUtensorMap tmv, const dk_attention_args a,
                          int64_t tiles_per_row, int64_t head_group, int64_t split_from,
                          float scale_log2, bool neg_q, bool q_vec, bool o_vec, bool o16,
                          bool sort_rows)
/* clang-format on */
{
#ifdef H90_DEVICE_CODE
    constexpr int NC = H8_NC;
    constexpr int BM = H8_BM;
    constexpr int DT = D / 8;
    constexpr int ST = h8_stages<TMA>::ST, SR = h8_stages<TMA>::SR;
    constexpr int BN = h8_stages<TMA>::BN;
    constexpr uint32_t TILE = BN * H8_ROW; /* a K or staging slot */
    using regs = h90_ws_regs<H8_PRODUCER_REGS, H8_CONSUMER_REGS, NC>;

    extern __shared__ uint4 h8_smem[];
    __shared__ int32_t s_lim[BM];
    __shared__ int32_t s_wmax[BM / 32], s_wmin[BM / 32];
    __shared__ float s_qs[BM];
    __shared__ float s_sink[128 * NC]; /* the consumers' late P V wait (see there) */
    __shared__ int32_t s_row;
    /* full K[ST], full V^T[SVT], empty K[ST], empty V^T[SVT]; with TMA full and empty
     * staging[SR] */
    __shared__ __align__(8) uint64_t s_bar[2 * (ST + H8_SVT + SR)];
    const uint32_t raw = smem_addr(h8_smem);
    const uint32_t sq = raw + ((1024u - (raw & 1023u)) & 1023u); /* Q tile */
    const uint32_t sk0 = sq + BM * H8_ROW;                       /* K slots */
    const uint32_t sr0 = sk0 + ST * TILE;                        /* staging slots */
    const uint32_t svt0 = sr0 + SR * TILE;                       /* V^T slots */
    const uint32_t full_k = smem_addr(s_bar);
    const uint32_t full_vt = full_k + 8u * ST;
    const uint32_t empty_k = full_vt + 8u * H8_SVT;
    const uint32_t empty_vt = empty_k + 8u * ST;
    const uint32_t full_s = empty_vt + 8u * H8_SVT;
    const uint32_t empty_s = full_s + 8u * SR;

    if (TMA && threadIdx.x == 0) { /* the maps' descriptors ahead of the first boxes */
        tma_prefetch_map(&tmk);
        tma_prefetch_map(&tmv);
    }
    /* CTAs from split_from on are the halves of the last wave's tiles (h8_split_from): CTA
     * split_from + 2 i + hv takes rows 64 hv .. 64 hv + 63 of tile split_from + i, as a tile of
     * its own whose rows end at tile_end. */
    const int64_t bid = blockIdx.x;
    const bool halves = bid >= split_from;
    const int64_t hv = halves ? (bid - split_from) & 1 : 0;
    attn_cta cta;
    if (!attn_cta_begin_at(a, halves ? split_from + (bid - split_from) / 2 : bid, tiles_per_row,
                           head_group, sort_rows, BM, &s_row, &cta)) {
        return;
    }
    const int64_t h = cta.h, row = cta.row, q0 = cta.q0 + 64 * hv;
    const int64_t q_start = cta.q_start, query_len = cta.query_len, seq_len = cta.seq_len;
    const int64_t tile_end = halves ? min(query_len, q0 + 64) : query_len;
    if (q0 >= tile_end) { /* the second half of a tile of 64 rows or fewer */
        return;
    }
    const int tid = (int)threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0); /* warp-uniform for ptxas */
    const int lane = tid % 32;
    /* A CTA's first S waits for its Q and its first K tile; both start before the key limits
     * (docs/fp8-log.md, *The CTA's prologue*): each consumer thread's half Q row (h8_load_q's)
     * into L2, and the TMA warp's setup (h8_tma_begin), whose key limits warp 4 takes */
    h8_tma_lane tl{};
    if (tid >= 128) {
        const int64_t r = (tid - 128) / 2;
        if (q0 + r < tile_end) {
            prefetch_l2((const uint16_t *)a.query + (q_start + q0 + r) * a.q_stride_token +
                        h * a.q_stride_head + (int64_t)(tid & 1) * (D / 2) * a.q_stride_dim);
        }
    }
    else if (TMA && tid < 32) {
        tl = h8_tma_begin<CK>(a, h, row, seq_len);
    }

    /* The consumer warpgroups with rows in the tile: the second has none where the tile's rows
     * end within the first's 64 (a row's last tile: 4,097 queries leave one row), and leaves at
     * once instead of running the key loop over masked rows; the empties count the first's
     * warps alone.  The first then has the tensor cores and the MUFU to itself. */
    const uint32_t ncw = tile_end - q0 > 64 ? 2u : 1u;
    /* Key limits of the BM query rows (row r by thread r, but rows 0 .. 31 by warp 4 where warp
     * 0 is the TMA warp), barriers. */
    {
        const int lr = tid < 32           ? (TMA ? -1 : tid)
                       : tid < 128        ? tid
                       : TMA && tid < 160 ? tid - 128
                                          : -1;
        if (lr >= 0) {
            attn_warp_limits<true>(a, lr, lane, q0, q_start, query_len, seq_len, s_lim, s_wmax,
                                   s_wmin, tile_end);
        }
    }
    if (tid < BM) {
        if (tid == 0) {
            /* K's full: the TMA warp's expect_tx, or the cp.async threads' arrivals; V^T's full:
             * the transposing threads' arrivals; empties: the warps of the ncw consumer
             * warpgroups */
#pragma unroll
            for (int i = 0; i < ST; i++) {
                mbar_init(full_k + 8u * (uint32_t)i, TMA ? 1u : 128u);
                mbar_init(empty_k + 8u * (uint32_t)i, 4u * ncw);
            }
#pragma unroll
            for (int i = 0; i < H8_SVT; i++) {
                mbar_init(full_vt + 8u * (uint32_t)i, (uint32_t)h8_stages<TMA>::TRANSPOSERS);
                mbar_init(empty_vt + 8u * (uint32_t)i, 4u * ncw);
            }
#pragma unroll
            for (int i = 0; i < (TMA ? SR : 0); i++) { /* the TMA warp; the 3 transposing warps */
                mbar_init(full_s + 8u * (uint32_t)i, 1u);
                mbar_init(empty_s + 8u * (uint32_t)i, 3u);
            }
            mbar_init_fence();
        }
    }
    {
        /* rows D .. D + 7 of every V^T panel, which no transpose writes: e4m3 ones, then zeros
         * (O's column D is then P's row sums: h8_consume) */
        constexpr int PANELS = H8_SVT * (BN / 128);
        for (int i = tid; i < PANELS * (int)H8_VX * 8; i += 128 * (NC + 1)) {
            const uint32_t pn = (uint32_t)(i / (8 * (int)H8_VX)), r = (uint32_t)(i / 8) % H8_VX;
            const uint32_t v = r == 0u ? 0x38383838u : 0u; /* e4m3 1.0 */
            st_shared16(svt0 + pn * ((D + H8_VX) * H8_ROW) + (D + r) * H8_ROW + 16u * (i % 8),
                        make_uint4(v, v, v, v));
        }
        fence_proxy_async(); /* the generic-proxy stores, for wgmma */
    }
    __syncthreads();
    const int32_t kv_end = attn_kv_end<BM>(s_wmax);
    const int32_t n_tiles = (kv_end + BN - 1) / BN;

    if (wg == 0) {
        regs::producer();
        if constexpr (TMA) {
            h8_produce_tma<D, CK>(kv_end, n_tiles, tl, sk0, sr0, svt0, full_k, full_s, full_vt,
                                  empty_k, empty_s, empty_vt, &tmk, &tmv);
        }
        else {
            h8_produce<D>(a, h, row, kv_end, n_tiles, sk0, sr0, svt0, full_k, full_vt, empty_k,
                          empty_vt);
        }
        return;
    }

    /* ---------------- consumers ---------------- */
    const int cw = wg - 1; /* query rows 64 cw .. 64 cw + 63 */
    if ((uint32_t)cw >= ncw) {
        return;
    }
    regs::consumer();
    const int wt = tid - 128 * wg; /* thread within the warpgroup */
    const int w4 = wt / 32;
    const int g = lane >> 2;
    const int tq = lane & 3;
    const int64_t kvh = h / (a.num_heads / a.num_kv_heads);
    const float k_scale = a.k_scale[kvh * a.scale_stride_head];
    const float v_scale = a.v_scale[kvh * a.scale_stride_head];

    h8_load_q<T, D>(a, sq, s_qs, cw, wt, q0, q_start, query_len, h, q_vec, neg_q);
    fence_proxy_async();
    named_barrier(1u + (uint32_t)cw, 128u);

    float o[D / 2 + H8_VX / 2]; /* the head dims, then the row sums (column D) and 3 zero columns */
#pragma unroll
    for (int i = 0; i < D / 2 + H8_VX / 2; i++) {
        o[i] = 0.0f;
    }
    float l[2] = {0.0f, 0.0f};            /* the rows' sums (h8_consume; thread tq = 0's) */
    float lm[2];                          /* the LSE's base (h8_consume) */
    const int r0 = cw * 64 + w4 * 16 + g; /* this thread's rows r0 and r0 + 8 */
    const int32_t lim0 = s_lim[r0], lim1 = s_lim[r0 + 8];
    const int32_t g_min = min(s_wmin[2 * cw], s_wmin[2 * cw + 1]);
    const float sl2[2] = {scale_log2 * k_scale * s_qs[r0], scale_log2 * k_scale * s_qs[r0 + 8]};
    /* this warpgroup's Q rows as registers; wgmma descriptors of K slot 0 and V^T slot 0 (slot
     * i: + i times the slot's size in 16-byte units) */
    uint32_t qa[D / 32][4];
    h90_q_frags<D / 32, 128>(qa, sq, r0, tq); /* rows of D <= 128 bytes: one panel */
    const h8_ring ring = {full_k,
                          full_vt,
                          empty_k,
                          empty_vt,
                          wgmma_desc(sk0, 16u, 1024u),
                          wgmma_desc(svt0, 16u, 1024u),
                          smem_addr(&s_sink[tid - 128])};
    /* a multiplier past 32,752 anywhere in the warpgroup (its 64 rows' scales, the same
     * product as sl2's): the softmax's fp32 form for the whole warpgroup (wgmma wants every
     * thread of it in the same code).  Each warp reads the 64 rows, two a lane, and votes: a
     * loop over the rows here was a chain of 64 shared loads, ~1.8 us of every CTA. */
    const bool big =
        __any_sync(0xffffffffu, scale_log2 * k_scale * s_qs[64 * cw + lane] > 32752.0f ||
                                    scale_log2 * k_scale * s_qs[64 * cw + 32 + lane] > 32752.0f);
    h8_consume<D, TMA>(o, l, lm, qa, ring, n_tiles, lim0, lim1, g_min, tq, lane, sl2, big);

    /* Epilogue: O v_scale / l (l: thread tq = 0's, the row stores add the quad's); O and l both
     * carry 2^P_LOG2, taken out of l here so that the LSE (lm + log2 l: the row stores' m sl2
     * with m = lm, sl2 = 1) comes out right. */
    const float out_scale = v_scale * (1.0f / (float)(1 << H8_P_LOG2));
#pragma unroll
    for (int i = 0; i < D / 2; i++) {
        o[i] *= out_scale;
    }
    l[0] *= 1.0f / (float)(1 << H8_P_LOG2);
    l[1] *= 1.0f / (float)(1 << H8_P_LOG2);
    const int64_t t0 = q_start + q0, tile_rows = query_len - q0;
    const float one[2] = {1.0f, 1.0f};
    if (o16) {
        /* the staging slots (BM * D * 2 bytes), free: the producer's last read of them came
         * before the last V^T's arrival, which this warpgroup waited for */
        h90_store_o_staged<T, D, BM, D, D / 2 + H8_VX / 2>(a, sr0, cw, wt, h, t0, tile_rows, l, lm,
                                                           one, o);
    }
    else {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int r = r0 + 8 * hf;
            attn_store_row<T, DT>(a, h, t0 + r, r < tile_rows, l[hf], lm[hf], 1.0f, &o[2 * hf], tq,
                                  o_vec);
        }
    }
#else
    (void)tmk;
    (void)tmv;
    (void)a;
    (void)tiles_per_row;
    (void)head_group;
    (void)split_from;
    (void)scale_log2;
    (void)neg_q;
    (void)q_vec;
    (void)o_vec;
    (void)o16;
    (void)sort_rows;
    __trap(); /* launched only where the sm_90a code exists (attn_sm90_ready) */
#endif
}

/*
 * The grid index from which the e4m3 kernel runs its tiles as halves (the kernel's split_from;
 * blocks: none), for a grid of `blocks` tiles over `sms` multiprocessors, one CTA each (384
 * threads at 168 registers fill an SM's registers).  When the last wave holds at most half the
 * SMs, its tiles run as two CTAs of 64 query rows each, one consumer warpgroup apiece: the wave
 * then spreads over twice the SMs, and its CTAs end sooner (one warpgroup alone over a tile's
 * keys takes less than the two together, though more than half as long).  A 16k-token row of 24
 * heads is 3,072 tiles: 23 waves of 132 and 36 tiles left, which ran with 96 SMs idle.
 */
static inline int64_t
h8_split_from(int64_t blocks, int64_t sms)
{
    const int64_t rem = sms > 0 ? blocks % sms : 0;
    return rem > 0 && 2 * rem <= sms ? blocks - rem : blocks;
}

/* Launches attention_sm90_fp8_kernel<T, D, TMA, CK> (attn_sm90_fp8_launch's contract; maps: the
 * TMA producer's, with boxes of CK keys, zeros otherwise).  The shared-memory attribute is set
 * once per (instantiation, device). */
template <typename T, int D, bool TMA, int CK>
static cudaError_t
h8_launch(const dk_attention_args *a, const CUtensorMap *maps, int64_t head_group, float scale_log2,
          bool neg_q, bool q_vec, bool o_vec, cudaStream_t s)
{
    static volatile bool attr_set[ATTN_MAX_DEVICES];
    constexpr int ST = h8_stages<TMA>::ST, SR = h8_stages<TMA>::SR;
    constexpr int BN = h8_stages<TMA>::BN;
    static_assert((size_t)SR * BN * H8_ROW >= (size_t)H8_BM * D * 2,
                  "the staged epilogue fits in the staging slots");
    /* Q, K, staging and V^T slots, alignment slack */
    const size_t smem = (size_t)H8_BM * H8_ROW + (size_t)(ST + SR) * BN * H8_ROW +
                        (size_t)H8_SVT * (D + H8_VX) * BN + 1024;
    const void *kernel = (const void *)attention_sm90_fp8_kernel<T, D, TMA, CK>;
    const cudaError_t e = attn_allow_smem(kernel, smem, attr_set);
    if (e != cudaSuccess) {
        return e;
    }
    int64_t tiles_per_row = dk_cdiv(a->max_query_len, H8_BM);
    bool sort_rows = a->num_rows >= 2 && a->num_rows <= ATTN_SORT_ROWS;
    const int64_t blocks = a->num_heads * a->num_rows * tiles_per_row;
    int64_t split_from = h8_split_from(blocks, attn_sm_count());
    bool o16 = attn_out_rows16(a);
    void *args[] = {(void *)&maps[0], (void *)&maps[1], (void *)a,   &tiles_per_row,
                    &head_group,      &split_from,      &scale_log2, &neg_q,
                    &q_vec,           &o_vec,           &o16,        &sort_rows};
    return dk_launch_after(a->pending, kernel, dim3((unsigned)(2 * blocks - split_from)),
                           dim3(128 * (H8_NC + 1)), smem, s, args);
}

/* h8_launch of the call's query dtype (fp16/bf16) and head size (64, 128) with boxes of CK keys
 * (the TMA producer's; CK 16 for cp.async, where nothing reads it). */
template <bool TMA, int CK>
static cudaError_t
h8_launch_head(const dk_attention_args *a, const CUtensorMap *maps, int64_t head_group,
               float scale_log2, bool neg_q, bool q_vec, bool o_vec, cudaStream_t s)
{
    const bool bf16 = a->dtype == DK_BF16;
    if (a->head_size == 128) {
        return bf16 ? h8_launch<__nv_bfloat16, 128, TMA, CK>(a, maps, head_group, scale_log2, neg_q,
                                                             q_vec, o_vec, s)
                    : h8_launch<__half, 128, TMA, CK>(a, maps, head_group, scale_log2, neg_q, q_vec,
                                                      o_vec, s);
    }
    return bf16 ? h8_launch<__nv_bfloat16, 64, TMA, CK>(a, maps, head_group, scale_log2, neg_q,
                                                        q_vec, o_vec, s)
                : h8_launch<__half, 64, TMA, CK>(a, maps, head_group, scale_log2, neg_q, q_vec,
                                                 o_vec, s);
}

/* The e4m3 kernel's form for the call, with the TMA producer (maps: h8_tma_chunk_maps's, boxes
 * of h8_box_keys keys) or cp.async; each form is instantiated in the file that calls it (the TMA
 * forms in attention_sm90_fp8_tma.cu). */
template <bool TMA>
static cudaError_t
h8_launch_form(const dk_attention_args *a, const CUtensorMap *maps, int64_t head_group,
               float scale_log2, bool neg_q, bool q_vec, bool o_vec, cudaStream_t s)
{
    if constexpr (TMA) {
        if (h8_box_keys(a) == 8) {
            return h8_launch_head<true, 8>(a, maps, head_group, scale_log2, neg_q, q_vec, o_vec, s);
        }
    }
    return h8_launch_head<TMA, 16>(a, maps, head_group, scale_log2, neg_q, q_vec, o_vec, s);
}

/* The TMA producer's forms (h8_launch_form<true>), in attention_sm90_fp8_tma.cu. */
cudaError_t attn_sm90_fp8_launch_tma(const dk_attention_args *a, const CUtensorMap *maps,
                                     int64_t head_group, float scale_log2, bool neg_q, bool q_vec,
                                     bool o_vec, cudaStream_t s);

#endif /* DIFFKV_ATTENTION_SM90_FP8_CUH */
