/*
 * attention_sm80.cuh -- the mma.sync paged attention kernel for the masks of dk_mask (diffkv.h),
 * for Ampere and later (Hopper runs the sm90 kernels unless the kernel choice says sm80, and
 * this one for the calls they do not take: attention.cu).  Its instantiations live in two files
 * that the build compiles side by side: attention_sm80.cu over caches of the query dtype,
 * attention_sm80_fp8.cu over e4m3 caches.
 *
 * fp16/bf16, every head size of DK_CUDA_HEAD_SIZES (diffkv.h: 32 to 256):
 * FlashAttention-2 style on mma.sync.m16n8k16 (fp32 accumulation).  One CTA of 4 warps per
 * (query tile of one batch row, head); up to head 160 the tile has 128 tokens and each warp
 * owns 32 query rows (two 16-row m-tiles, so every K/V fragment read from shared memory feeds
 * two MMAs), above it 64 tokens, 16 rows per warp (O of two m-tiles would need D fp32
 * registers per thread).  Key tiles of 128 keys up to head 64, 64 up to head 128, 32 above
 * (attn_tile: O's D / 2 or D / 4 fp32 registers per thread and S must fit 255 registers).
 * Head 72 computes 80 dims, the last 8 zeros in every tile.
 *   - Shared memory: the Q tile and two stages of (K tile, V tile), rows of head_size rounded
 *     up to 64 elements whose 16-byte chunks are XOR-swizzled (chunk c of row r sits at
 *     c ^ (r % 8)), so the 8 row addresses of every ldmatrix and every 16-byte cp.async hit
 *     distinct bank groups.
 *   - Paging: before a key tile is loaded, one thread per key resolves its byte offset in
 *     the cache through the block table into a small double-buffered shared array (any
 *     block_size; the block-table entry is read two tiles ahead, at the start of an
 *     iteration, and the offset stored at its end); the K and V loads of the tile then only
 *     add that offset to the thread's chunk.  Loads are 16-byte cp.async when the cache's dim
 *     stride is 1 and every address is 16-byte aligned (rows past the last visible key are
 *     zero-filled by cp.async itself), element loads with any strides otherwise.
 *   - Pipeline per key tile n: wait for K(n), V(n) (one barrier); issue K(n + 1), V(n + 1)
 *     into the other stage (they land during all of tile n's math); S = Q K^T (Q and K
 *     fragments by ldmatrix); online softmax in fp32 (p = 2^(s * scale * log2(e) - max), one
 *     FFMA + one ex2 each; O is rescaled only when a row's max grew); P packed to fp16/bf16
 *     in registers as the A operand of P V; O += P V (V fragments by ldmatrix.trans).  One
 *     barrier per tile; two CTAs per SM (255 registers) overlap each other.
 *   - Masking only on tiles that straddle a limit of the warp's rows; a warp skips the tiles
 *     past all of its rows' limits (the causal diagonal).  CTA order (attn_cta_place): head
 *     within a small group of heads fastest, then query tile from the last (most keys), then
 *     head group, then batch row, so the CTAs in flight share a few kv heads' K/V (L2) and
 *     the tiles with the most keys start first; batches of 2 to ATTN_SORT_ROWS rows are taken
 *     in order of decreasing seq_len (ranked in the kernel from the device seq_lens).
 *   - A negative scale negates the Q tile in shared memory (the kernel works with |scale|).
 *
 * Masks: every mask is a per-token exclusive key limit L (key j visible iff j < L):
 *   NONE   L = seq_len
 *   CAUSAL L = clamp(i + seq_len - query_len + 1, 0, seq_len)  (i: index of the token in its row)
 *   LIMITS L = clamp(key_limits[t], 0, seq_len)
 * Key tiles at or past the largest L of a query tile are neither loaded nor computed; a token
 * with L == 0 gets zeros.
 *
 * LSE (optional, a.lse != NULL): the natural log-sum-exp of every (token, head)'s visible scaled
 * scores, written by the thread that writes the row's first output pair; -inf for a token that
 * sees no key (context parallelism merges ranks' partial outputs with it).
 *
 * Entry point (attention_internal.cuh): attn_mma_launch (attention_sm80.cu), called by
 * dk_cuda_attention (attention.cu).
 */
#pragma once

#include "attention_common.cuh"
#include "attention_internal.cuh"
#include "cuda_common.cuh"
#include "diffkv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

#include <type_traits>

#define ATTN_WARPS 4 /* warps per CTA */
#define ATTN_THREADS (ATTN_WARPS * 32)
#define ATTN_CTAS_PER_SM 2

/* A head size's tiles.  MTILES: 16-row m-tiles per warp, 2 up to head 160 (every K/V fragment read
 * from shared memory feeds two MMAs), 1 above (O of two m-tiles would not fit the registers);
 * BM = W * MTILES * 16 query rows per CTA of W warps (ATTN_WARPS: attn_mma_bm, 128, or 64 above
 * head 160; the WIDE form's ATTN_WIDE_WARPS: 256).
 * Keys per K/V tile BN: 128 up to head 64 (faster than 64 there: docs/hopper-kernels.md), 64
 * up to head 128 (S, P and O of two m-tiles per warp fit the register file), 32 above.  DK:
 * the head dims the MMAs compute, D rounded up to their 16-dim k-step (head 72: 80; dims
 * D .. DK - 1 are zeros in every tile).  DS: elements per row of the shared-memory tiles, D
 * rounded up to 64 (eight 16-byte chunks), so that the XOR swizzle of a chunk's index with its
 * row's (c ^ (r % 8)) stays inside the row.  HALF: BN / 2, for GPUs whose shared memory per SM
 * holds two CTAs of those tiles but not of the full ones (an A100's 164 KB: launch_mma). */
template <int D, bool HALF = false, int W = ATTN_WARPS> struct attn_tile {
    static_assert(D % 8 == 0 && D >= 32 && D <= 256, "a head size the kernel tiles");
    static constexpr int MTILES = D <= 160 ? 2 : 1;
    static constexpr int BM = W * MTILES * 16;
    static constexpr int BN = (D <= 64 ? 128 : D <= 128 ? 64 : 32) / (HALF ? 2 : 1);
    static constexpr int DK = (D + 15) / 16 * 16;
    static constexpr int DS = (D + 63) / 64 * 64;
    /* bytes of dynamic shared memory: the Q tile, 2 stages of K and V tiles, then 2 x BN key
     * offsets (97 KiB for heads 72 to 160 and 256, 73 KiB for head 192, 82 KiB for heads 32 and
     * 64: two CTAs per SM of an H100, one of an A100; HALF: 49 KiB for 32 and 64, 65 KiB for 72
     * to 128, 64 KiB for 256, 72 KiB for 160) */
    static constexpr size_t SMEM = (size_t)(BM + 4 * BN) * DS * 2 + 2 * BN * sizeof(int64_t);
    static_assert(W != ATTN_WARPS || BM == attn_mma_bm(D), "the dispatcher's query tile");
};

/* Element offset of 16-byte chunk c of row r in a swizzled tile of DS-element rows. */
template <int DS>
static __device__ __forceinline__ int
tile_pos(int r, int c)
{
    return r * DS + (c ^ (r & 7)) * 8;
}

/* Calls f(r, c, pos) for the 16-byte chunks c < D / 8 of rows r < ROWS of a tile of DS-element
 * rows that thread tid (of NT) owns, pos = tile_pos<DS>(r, c): chunk column tid % (D / 8) of rows
 * tid / (D / 8) + k * (NT / (D / 8)) where the threads cover whole rows in passes of a multiple
 * of 8 rows (every row of a thread then has the same r % 8, so the swizzle is computed once),
 * else item tid + k * NT of the tile's chunks in row order.  The same
 * thread always owns the same chunks, so a thread may read back what its own cp.async copies
 * wrote once it waited for them. */
template <int D, int DS, int ROWS, int NT = ATTN_THREADS, typename F>
static __device__ __forceinline__ void
for_own_chunks(int tid, F &&f)
{
    constexpr int CHUNKS = D / 8;
    if constexpr (NT % CHUNKS == 0 && (NT / CHUNKS) % 8 == 0) {
        constexpr int ROWS_PER_PASS = NT / CHUNKS;
        const int c = tid % CHUNKS;
        const int r0 = tid / CHUNKS;
        const int pc = c ^ (r0 & 7);
#pragma unroll
        for (int pass = 0; pass < ROWS / ROWS_PER_PASS; pass++) {
            const int r = r0 + pass * ROWS_PER_PASS;
            f(r, c, r * DS + pc * 8);
        }
    }
    else {
#pragma unroll
        for (int pass = 0; pass < (ROWS * CHUNKS + NT - 1) / NT; pass++) {
            const int item = tid + pass * NT;
            if (item < ROWS * CHUNKS) {
                const int r = item / CHUNKS, c = item % CHUNKS;
                f(r, c, tile_pos<DS>(r, c));
            }
        }
    }
}

/*
 * Loads one K or V tile (cache = key_cache or value_cache) of BN keys whose byte offsets are
 * offs[0 .. BN) into the swizzled tile s (rows of DS elements); rows >= valid_rows become
 * zeros, so masked probabilities (0) never meet garbage (0 * inf = nan).  Thread tid copies
 * the chunks for_own_chunks gives it.
 */
template <int D, int BN>
static __device__ __forceinline__ void
load_kv_tile(uint16_t *s, const char *cache, const char *cache2, const int64_t *offs,
             int32_t valid_rows, int64_t stride_dim, bool vec)
{
    constexpr int DS = attn_tile<D>::DS;
    constexpr int CHUNKS = D / 8;
    const int tid = (int)threadIdx.x;
    if constexpr (ATTN_THREADS % CHUNKS == 0 && (ATTN_THREADS / CHUNKS) % 8 == 0) {
        /* for_own_chunks's whole-row mapping, its offsets stepped from one base */
        constexpr int ROWS_PER_PASS = ATTN_THREADS / CHUNKS;
        constexpr int PASSES = BN / ROWS_PER_PASS;
        const int c = tid % CHUNKS;
        const int r0 = tid / CHUNKS;
        const int pc = c ^ (r0 & 7);
        if (vec) {
            const uint32_t dst = smem_addr(s) + (uint32_t)((r0 * DS + pc * 8) * 2);
            if (valid_rows >= BN && cache2 == NULL) { /* the hot path: one source, a full tile */
                const char *src = cache + c * 16;
#pragma unroll
                for (int pass = 0; pass < PASSES; pass++) {
                    cp_async16(dst + pass * ROWS_PER_PASS * DS * 2,
                               src + offs[r0 + pass * ROWS_PER_PASS], 16u);
                }
            }
            else {
#pragma unroll
                for (int pass = 0; pass < PASSES; pass++) {
                    const int r = r0 + pass * ROWS_PER_PASS;
                    cp_async16(dst + pass * ROWS_PER_PASS * DS * 2,
                               kv_row(cache, cache2, offs[r]) + c * 16, r < valid_rows ? 16u : 0u);
                }
            }
        }
        else {
            /* Kept rolled: unrolled, this cold path's registers made the hot loop spill. */
#pragma unroll 1
            for (int pass = 0; pass < PASSES; pass++) {
                const int r = r0 + pass * ROWS_PER_PASS;
                uint16_t *d = s + r * DS + pc * 8;
                if (r < valid_rows) {
                    const uint16_t *src = (const uint16_t *)kv_row(cache, cache2, offs[r]);
                    load_chunk_sync(d, src + (int64_t)c * 8 * stride_dim, stride_dim);
                }
                else {
                    zero_chunk(d);
                }
            }
        }
    }
    else if (vec) {
        const uint32_t base = smem_addr(s);
        for_own_chunks<D, DS, BN>(tid, [&](int r, int c, int pos) {
            cp_async16(base + (uint32_t)(pos * 2), kv_row(cache, cache2, offs[r]) + c * 16,
                       r < valid_rows ? 16u : 0u);
        });
    }
    else {
#pragma unroll 1
        for (int item = tid; item < BN * CHUNKS; item += ATTN_THREADS) {
            const int r = item / CHUNKS, c = item % CHUNKS;
            uint16_t *d = s + tile_pos<DS>(r, c);
            if (r < valid_rows) {
                const uint16_t *src = (const uint16_t *)kv_row(cache, cache2, offs[r]);
                load_chunk_sync(d, src + (int64_t)c * 8 * stride_dim, stride_dim);
            }
            else {
                zero_chunk(d);
            }
        }
    }
}

/* What kv8_to_half's fp16 values are times the e4m3 values: the conversion instruction of
 * sm_89 and later gives the values themselves; sm_80's byte permute, add and shift give 2^-8
 * times them. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KV8_UNIT 1.0f
#else
#define KV8_UNIT 256.0f
#endif

/* Four e4m3 bytes (the lowest first) as two fp16 pairs (.x: bytes 0, 1; .y: bytes 2, 3) of
 * their values / KV8_UNIT, exactly.  sm_80 has no fp8 conversion: an e4m3 byte s.eeee.mmm
 * moved into fp16's s.eeeee.mmmmmmmmmm as s.0eeee.mmm0000000 is 2^-8 times its value (fp16's
 * exponent bias is 15, e4m3's 7), subnormals included -- except the NaN code 0x7F, which reads
 * as 1.875 * 2^-8 there: kv8_nan_words finds it, kv8_nan_fix sets it apart.  sm_89 and later
 * convert with one instruction per pair, NaN included. */
static __device__ __forceinline__ uint2
kv8_to_half(uint32_t w)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint2 r;
    asm("{\n.reg .b16 lo, hi;\n"
        "mov.b32 {lo, hi}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 %0, lo;\n"
        "cvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
        : "=r"(r.x), "=r"(r.y)
        : "r"(w));
    return r;
#else
    /* each byte into the low byte of a 16-bit lane: b + (b & 0x80) moves the sign from bit 7
     * to bit 8, and << 7 places sign, exponent and mantissa (no lane carries into the next) */
    const uint32_t u0 = __byte_perm(w, 0u, 0x4140u), u1 = __byte_perm(w, 0u, 0x4342u);
    return make_uint2((u0 + (u0 & 0x00800080u)) << 7, (u1 + (u1 & 0x00800080u)) << 7);
#endif
}

#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890)
/* Whether any of the sixteen bytes of w is an e4m3 NaN code: the bytes of (w & 0x7F..) ^ 0x7F..
 * are zero exactly there, and (t - 0x01..) & ~t & 0x80.. is nonzero iff some byte of t is. */
static __device__ __forceinline__ bool
kv8_nan_words(const uint4 &w)
{
    uint32_t any = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t t = ((&w.x)[i] & 0x7F7F7F7Fu) ^ 0x7F7F7F7Fu;
        any |= (t - 0x01010101u) & ~t & 0x80808080u;
    }
    return any != 0;
}

/* An fp16 pair from kv8_to_half with its NaN codes' lanes (magnitude 0x3F80) made NaNs: z has
 * those lanes zero, and (z - 1) & ~z sets bit 15 of exactly them (every other lane of z is a
 * nonzero multiple of 0x80 under 0x8000, so no borrow turns another lane's bit 15 on). */
static __device__ __forceinline__ uint32_t
kv8_nan_fix(uint32_t h)
{
    const uint32_t z = (h & 0x7FFF7FFFu) ^ 0x3F803F80u;
    return h | (((z - 0x00010001u) & ~z & 0x80008000u) >> 15) * 0x7E00u;
}
#endif

/* 8-byte cp.async to shared address dst; src_bytes 0 fills the 8 bytes with zeros. */
static __device__ __forceinline__ void
cp_async8(uint32_t dst, const void *src, uint32_t src_bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

/* Bytes per row of an e4m3 staging tile: D where the rows are 16-byte chunks; head 72's
 * 72-byte rows (every other one 8 bytes off 16-byte alignment in a cache of consecutive heads)
 * take 80, room for the row at its address's offset from 16-byte alignment (stage_kv8_rows). */
template <int D> static constexpr int kv8_row = D % 16 == 0 ? D : D + 8;

/* Byte offset of 16-byte chunk c of row r in an e4m3 staging tile of D-byte rows: the chunks
 * numbered row by row, eight to a 128-byte line, XOR-swizzled by the line's index, so that the
 * eight rows of one chunk column that 8 threads read together lie in distinct bank groups. */
template <int D>
static __device__ __forceinline__ uint32_t
kv8_pos(int r, int c)
{
    const uint32_t n = (uint32_t)(r * (D / 16) + c);
    const uint32_t line = n >> 3;
    return line * 128u + (((n & 7u) ^ (line & 7u)) << 4);
}

/* Calls f(r, c) for each 16-byte chunk (row r < BN, chunk c < D / 16) of an e4m3 tile that thread
 * tid (of NT) copies and converts.  Where eight threads a chunk column tile NT (D / 16 = 2, 4,
 * 8, 16): chunk column (tid / 8) % (D / 16) of rows r0 + k * (NT / (D / 16)), r0 =
 * (tid / (8 * (D / 16))) * 8 + tid % 8, so the eight threads of a chunk column hold eight rows of
 * distinct r % 8 and their fp16 stores meet distinct bank groups; else (D / 16 = 5, 6, 10, 12)
 * item tid + k * NT of the tile's chunks in row order, whose staging reads are
 * conflict-free (kv8_pos) and some of whose fp16 stores share a bank group.  The same thread
 * always owns the same chunks, so it reads back what its own cp.async copies wrote once it
 * waited for them. */
template <int D, int BN, int NT = ATTN_THREADS, typename F>
static __device__ __forceinline__ void
for_kv8_chunks(int tid, F &&f)
{
    constexpr int CH = D / 16;
    if constexpr (NT % (8 * CH) == 0) {
        constexpr int ROWS = NT / CH; /* rows per pass */
        static_assert(BN % ROWS == 0, "whole passes");
        const int c = (tid >> 3) % CH;
        const int r0 = (tid / (8 * CH)) * 8 + (tid & 7);
#pragma unroll
        for (int pass = 0; pass < BN / ROWS; pass++) {
            f(r0 + pass * ROWS, c);
        }
    }
    else {
        constexpr int ITEMS = BN * CH;
#pragma unroll
        for (int k = 0; k < (ITEMS + NT - 1) / NT; k++) {
            const int i = tid + k * NT;
            if (ITEMS % NT == 0 || i < ITEMS) {
                f(i / CH, i % CH);
            }
        }
    }
}

/*
 * Copies one e4m3 K or V tile of BN keys (byte offsets offs[0 .. BN), rows of D bytes in
 * 16-byte chunks) into the staging tile at slot with cp.async; rows >= valid_rows become zeros
 * (e4m3 zero: masked probabilities never meet a NaN code).
 */
template <int D, int BN, int NT>
static __device__ __forceinline__ void
stage_kv8_tile(uint32_t slot, const char *cache, const char *cache2, const int64_t *offs,
               int32_t valid_rows)
{
    for_kv8_chunks<D, BN, NT>((int)threadIdx.x, [&](int r, int c) {
        cp_async16(slot + kv8_pos<D>(r, c), kv_row(cache, cache2, offs[r]) + c * 16,
                   r < valid_rows ? 16u : 0u);
    });
}

/*
 * Converts the staged e4m3 K and V tiles at slot (K then V, BN * D bytes each) into the fp16
 * tiles at tile (K [BN][DS], then V), swizzled as load_kv_tile lays them out: each thread the
 * chunks it staged (its own cp.async copies, waited for by the caller), 16 bytes into two
 * 16-byte fp16 chunks.  Columns D .. DS - 1 are not written (no k-step reads them).
 */
template <int D, int DS, int BN, int NT>
static __device__ __forceinline__ void
convert_kv8_tiles(const uint8_t *slot, uint16_t *tile)
{
    const uint32_t dst = smem_addr(tile);
#pragma unroll
    for (int kv = 0; kv < 2; kv++) {
        for_kv8_chunks<D, BN, NT>((int)threadIdx.x, [&](int r, int c) {
            const uint4 w = *reinterpret_cast<const uint4 *>(slot + kv * BN * D + kv8_pos<D>(r, c));
            const uint2 h0 = kv8_to_half(w.x), h1 = kv8_to_half(w.y);
            const uint2 h2 = kv8_to_half(w.z), h3 = kv8_to_half(w.w);
            uint4 lo = make_uint4(h0.x, h0.y, h1.x, h1.y), hi = make_uint4(h2.x, h2.y, h3.x, h3.y);
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890)
            if (kv8_nan_words(w)) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    (&lo.x)[i] = kv8_nan_fix((&lo.x)[i]);
                    (&hi.x)[i] = kv8_nan_fix((&hi.x)[i]);
                }
            }
#endif
            const uint32_t row = dst + (uint32_t)((kv * BN + r) * DS * 2);
            st_shared16(row + (uint32_t)(((2 * c) ^ (r & 7)) * 16), lo);
            st_shared16(row + (uint32_t)(((2 * c + 1) ^ (r & 7)) * 16), hi);
        });
    }
}

/* Head 72: the row of staging row i (K rows 0 .. BN - 1, then V's), of kv8_row<D> bytes from
 * slot, sits at byte kv8_shift of it: the cache row's address % 16 (0 or 8). */
static __device__ __forceinline__ uint32_t
kv8_shift(const char *src)
{
    return (uint32_t)(uintptr_t)src & 8u;
}

/* The cache row of staging row i (i < BN: K's key i, else V's key i - BN). */
template <int BN>
static __device__ __forceinline__ const char *
kv8_src(int i, const char *kc, const char *kc2, const char *vc, const char *vc2,
        const int64_t *offs)
{
    return i < BN ? kv_row(kc, kc2, offs[i]) : kv_row(vc, vc2, offs[i - BN]);
}

/*
 * Head 72: copies the e4m3 K and V tiles of BN keys (byte offsets offs[0 .. BN), 72-byte rows
 * on 8-byte boundaries) into the staging slot at slot, whole rows: NT / (2 BN) threads a
 * row (1; 2 in the half-key-tile and WIDE forms), the row at kv8_shift of its 80 bytes, so
 * that four of its five 16-byte units come by 16-byte copies and one by an 8-byte copy (the
 * first at shift 8, the last at 0) -- five copies a row, not nine of 8 bytes.  Rows >=
 * valid_rows become zeros.
 */
template <int D, int BN, int NT>
static __device__ __forceinline__ void
stage_kv8_rows(uint32_t slot, const char *kc, const char *kc2, const char *vc, const char *vc2,
               const int64_t *offs, int32_t valid_rows)
{
    constexpr int T = NT / (2 * BN);   /* threads a row */
    constexpr int U = kv8_row<D> / 16; /* 16-byte units a staging row: 5 */
    static_assert(D % 16 == 8 && T * 2 * BN == NT, "rows of 16 u + 8 bytes");
    const int tid = (int)threadIdx.x;
    const int i = tid / T;
    const char *src = kv8_src<BN>(i, kc, kc2, vc, vc2, offs);
    const uint32_t sh = kv8_shift(src);
    const bool valid = (i < BN ? i : i - BN) < valid_rows;
    const uint32_t row = slot + (uint32_t)(i * kv8_row<D>);
#pragma unroll
    for (int k = 0; k < (U + T - 1) / T; k++) {
        const int j = tid % T + k * T; /* 16-byte unit of the staging row */
        if (U % T == 0 || j < U) {
            /* unit j holds the row's bytes 16 j - sh .. 16 j - sh + 15 that exist */
            if (sh ? j == 0 : j == U - 1) {
                const uint32_t lead = j == 0 ? sh : 0u;
                cp_async8(row + (uint32_t)(16 * j) + lead, src + 16 * j, valid ? 8u : 0u);
            }
            else {
                cp_async16(row + (uint32_t)(16 * j), src + 16 * j - (int)sh, valid ? 16u : 0u);
            }
        }
    }
}

/*
 * Head 72: converts the K and V rows stage_kv8_rows staged at slot into the fp16 tiles at tile
 * (K [BN][DS], then V), swizzled as load_kv_tile lays them out: each of NT / (2 BN) threads
 * of a row every T-th of its nine 8-byte chunks into one 16-byte fp16 chunk (the
 * thread's staging row and its fp16 row are the same row of K then V).  Columns 72 .. 79 are
 * the zeros the kernel wrote at its start.  The caller's barrier after the copies landed makes
 * every thread's copies visible.
 */
template <int D, int DS, int BN, int NT>
static __device__ __forceinline__ void
convert_kv8_rows(const uint8_t *slot, uint16_t *tile, const char *kc, const char *kc2,
                 const char *vc, const char *vc2, const int64_t *offs)
{
    constexpr int T = NT / (2 * BN);
    const int tid = (int)threadIdx.x;
    const int i = tid / T;
    const uint8_t *src = slot + i * kv8_row<D> + kv8_shift(kv8_src<BN>(i, kc, kc2, vc, vc2, offs));
    const uint32_t row = smem_addr(tile) + (uint32_t)(i * DS * 2);
    /* A thread a row: the 16 rows of a half-warp's 8-byte loads are 80 bytes apart, so rows i
     * and i + 8 meet the same two banks; the rows with bit 3 set take their first chunks in
     * swapped pairs (c ^ 1), which moves them to the other two banks of each four.  (Two
     * threads a row read even and odd chunks, which does the same.) */
    const int swap = T == 1 ? (i >> 3) & 1 : 0;
#pragma unroll
    for (int k = 0; k < (D / 8 + T - 1) / T; k++) {
        const int c = T == 1 ? (k < ((D / 8) & ~1) ? k ^ swap : k) : tid % T + k * T;
        if ((D / 8) % T == 0 || c < D / 8) {
            const uint2 w = *reinterpret_cast<const uint2 *>(src + 8 * c);
            const uint2 h0 = kv8_to_half(w.x), h1 = kv8_to_half(w.y);
            uint4 h = make_uint4(h0.x, h0.y, h1.x, h1.y);
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890)
            if (kv8_nan_words(make_uint4(w.x, w.y, 0u, 0u))) { /* zero bytes are no NaN */
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    (&h.x)[x] = kv8_nan_fix((&h.x)[x]);
                }
            }
#endif
            st_shared16(row + (uint32_t)((c ^ (i & 7)) * 16), h);
        }
    }
}

/* Stages the e4m3 K and V tiles of BN keys at slot: kv8_row<D> bytes a row, K's BN rows then
 * V's (stage_kv8_rows at head 72, else stage_kv8_tile for each). */
template <int D, int BN, int NT>
static __device__ __forceinline__ void
stage_kv8(const uint8_t *slot, const char *kc, const char *kc2, const char *vc, const char *vc2,
          const int64_t *offs, int32_t valid_rows)
{
    if constexpr (D % 16 != 0) {
        stage_kv8_rows<D, BN, NT>(smem_addr(slot), kc, kc2, vc, vc2, offs, valid_rows);
    }
    else {
        stage_kv8_tile<D, BN, NT>(smem_addr(slot), kc, kc2, offs, valid_rows);
        stage_kv8_tile<D, BN, NT>(smem_addr(slot + BN * D), vc, vc2, offs, valid_rows);
    }
}

/* Converts what stage_kv8 staged at slot (with the same offsets and caches) into the fp16 K and
 * V tiles at tile. */
template <int D, int DS, int BN, int NT>
static __device__ __forceinline__ void
convert_kv8(const uint8_t *slot, uint16_t *tile, const char *kc, const char *kc2, const char *vc,
            const char *vc2, const int64_t *offs)
{
    if constexpr (D % 16 != 0) {
        convert_kv8_rows<D, DS, BN, NT>(slot, tile, kc, kc2, vc, vc2, offs);
    }
    else {
        convert_kv8_tiles<D, DS, BN, NT>(slot, tile);
    }
}

/*
 * grid.x = num_heads * num_rows * tiles_per_row (order: attn_cta_place); tiles past a row's
 * end exit at once.  W * 32 threads, attn_tile<D, HALF, W>::SMEM bytes of dynamic shared memory.
 * W: ATTN_WARPS, two CTAs an SM where they fit; ATTN_WIDE_WARPS (the WIDE form, KV8 only), one
 * CTA an SM of twice the query rows, each K/V tile widened once for all of them.
 * scale_log2 = |scale| * log2(e) > 0; neg_q: the scale is negative, so q is negated instead.
 *
 * KV8: the cache holds e4m3 (kv_fp8; K/V rows in 16-byte chunks, 8-byte at head 72), T the query
 * and output dtype; the products run in fp16 on the same tiles:
 *   - K/V tiles land by cp.async as bytes in a staging slot (stage_kv8: 16-byte chunks, head
 *     72 whole rows) and the threads widen them into the fp16 K and V tiles (convert_kv8,
 *     values / KV8_UNIT).  The shared memory of the second fp16 stage holds two staging slots
 *     instead, so there is one fp16 stage: per tile, a barrier (tile kt - 1 done), tile kt + 1's
 *     copies issued, tile kt converted, a barrier, then the math.
 *   - bf16 queries become fp16 in place, times one power of two 2^e for the CTA's Q tile
 *     (its largest magnitude just under 2^15): fp16's 11-bit significand holds bf16's 8, and
 *     values under 2^-39 of the tile's largest lose bits -- each such score's error is under
 *     2^-39 of the largest score's magnitude.  fp16 queries are used as they are (e = 0).
 *   - the scores' multiplier is scale_log2 * k_scale * KV8_UNIT * 2^-e; O is multiplied by
 *     v_scale * KV8_UNIT before the division by the row sum; P is fp16.
 */
template <typename T, int D, bool KV8, bool HALF, int W = ATTN_WARPS>
/* clang-format does not know __launch_bounds__ is an attribute. */
/* clang-format off */
static __global__ void __launch_bounds__(W * 32, W == ATTN_WARPS ? ATTN_CTAS_PER_SM : 1)
attention_mma_kernel(const dk_attention_args a, int64_t tiles_per_row, int64_t head_group,
                     float scale_log2, bool neg_q, bool q_vec, bool kv_vec, bool o_vec,
                     bool sort_rows)
/* clang-format on */
{
    using tile = attn_tile<D, HALF, W>;
    constexpr int NT = W * 32;           /* threads */
    constexpr int MTILES = tile::MTILES; /* 16-row m-tiles per warp */
    constexpr int BM = tile::BM;         /* query rows per CTA */
    constexpr int BN = tile::BN;
    constexpr int DK = tile::DK;                       /* head dims computed (D, zeros past) */
    constexpr int DS = tile::DS;                       /* elements per shared-memory row */
    constexpr int KSTEPS = DK / 16;                    /* k-steps of S = Q K^T */
    constexpr int NTILES = BN / 8;                     /* n-tiles of S */
    constexpr int DTILES = DK / 8;                     /* n-tiles of O */
    constexpr uint32_t STAGE_BYTES = 2u * BN * DS * 2; /* one K and one V tile */
    constexpr int ES = KV8 ? 1 : 2;                    /* bytes per cache element */
    using MT = std::conditional_t<KV8, __half, T>;     /* the MMAs' operand type */
    static_assert(BM <= NT, "a thread per query row for the limits");
    static_assert(BN <= NT, "one thread per key for the offsets");
    static_assert(KV8 || W == ATTN_WARPS, "the wide form is an e4m3 one");
    static_assert(!KV8 || D % 8 == 0, "e4m3 rows of whole 8-byte chunks");
    static_assert(!KV8 || 2 * 2 * BN * kv8_row<D> <= STAGE_BYTES, "2 staging slots a stage");

    extern __shared__ uint4 attn_smem[];
    uint16_t *const s_q = reinterpret_cast<uint16_t *>(attn_smem); /* [BM][DS] */
    uint16_t *const s_kv = s_q + BM * DS; /* [2 stages][K [BN][DS], V [BN][DS]] */
    int64_t *const s_off = reinterpret_cast<int64_t *>(s_kv + 4 * BN * DS); /* [2][BN] */
    /* KV8: the second stage's bytes hold 2 staging slots of e4m3 K, V rows (kv8_row<D> bytes) */
    const uint8_t *const s_kv8 = reinterpret_cast<const uint8_t *>(s_kv + 2 * BN * DS);
    __shared__ int32_t s_wmax[W];
    __shared__ int32_t s_lim[NT]; /* key limit of each query row (of BM) */
    __shared__ int32_t s_row;
    __shared__ uint32_t s_qmax[W]; /* KV8, bf16 queries: each warp's largest |q| */

    attn_cta cta;
    if (!attn_cta_begin(a, tiles_per_row, head_group, sort_rows, BM, &s_row, &cta)) {
        return;
    }
    const int64_t h = cta.h, row = cta.row, q0 = cta.q0;
    const int64_t q_start = cta.q_start, query_len = cta.query_len, seq_len = cta.seq_len;
    const int64_t kv_head = h / (a.num_heads / a.num_kv_heads);
    const int32_t *bt = a.block_table + row * a.bt_stride_row;
    const int tid = (int)threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane >> 2; /* accumulator row within an 8-row half */
    const int tq = lane & 3; /* accumulator column pair */

    /* Head dims D .. DK - 1 (head 72's last 8 of 80) are zeros in the Q tile and in both
     * stages' K and V tiles: no load writes them. */
    if constexpr (DK > D) {
        for (int item = tid; item < (BM + 4 * BN) * (DK - D) / 8; item += NT) {
            const int r = item / ((DK - D) / 8), c = D / 8 + item % ((DK - D) / 8);
            zero_chunk(s_q + tile_pos<DS>(r, c)); /* s_kv's rows follow s_q's */
        }
    }

    /* Q tile -> s_q, swizzled (rows past the row's end are zeros); negated for a negative
     * scale once this thread's chunks have landed. */
    {
        for_own_chunks<D, DS, BM, NT>(tid, [&](int r, int c, int pos) {
            uint16_t *dst = s_q + pos;
            if (q0 + r < query_len) {
                const uint16_t *src = (const uint16_t *)a.query +
                                      (q_start + q0 + r) * a.q_stride_token + h * a.q_stride_head +
                                      (int64_t)c * 8 * a.q_stride_dim;
                if (q_vec) {
                    cp_async16(smem_addr(dst), src, 16u);
                }
                else {
                    load_chunk_sync(dst, src, a.q_stride_dim);
                }
            }
            else {
                zero_chunk(dst);
            }
        });
        cp_async_commit();
        if (neg_q) {
            cp_async_wait_all();
            for_own_chunks<D, DS, BM, NT>(tid, [&](int, int, int pos) {
                uint4 *p = reinterpret_cast<uint4 *>(s_q + pos);
                uint4 v = *p;
                v.x ^= 0x80008000u;
                v.y ^= 0x80008000u;
                v.z ^= 0x80008000u;
                v.w ^= 0x80008000u;
                *p = v;
            });
        }
        if constexpr (KV8 && !std::is_same_v<T, __half>) {
            /* this thread's largest bf16 magnitude (bit patterns order as magnitudes) */
            cp_async_wait_all();
            uint32_t mx = 0;
            for_own_chunks<D, DS, BM, NT>(tid, [&](int, int, int pos) {
                const uint4 v = *reinterpret_cast<const uint4 *>(s_q + pos);
                mx = max(mx, max(max(v.x & 0x7FFFu, v.x >> 16 & 0x7FFFu),
                                 max(v.y & 0x7FFFu, v.y >> 16 & 0x7FFFu)));
                mx = max(mx, max(max(v.z & 0x7FFFu, v.z >> 16 & 0x7FFFu),
                                 max(v.w & 0x7FFFu, v.w >> 16 & 0x7FFFu)));
            });
#pragma unroll
            for (int sh = 16; sh > 0; sh >>= 1) {
                mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, sh));
            }
            if (lane == 0) {
                s_qmax[warp] = mx;
            }
        }
    }

    /* Key limit of query row tid (0 past the row's end; threads past BM compute a row of the
     * next tile, which no warp reads).  With two m-tiles per warp, warp w's threads hold
     * exactly the rows warp w computes, so the warp's extremes need only shuffles; with one,
     * warp w computes rows 16w .. 16w + 15 and takes their extremes from s_lim. */
    int32_t wmax, wmin;
    attn_row_limit(a, tid, q0, q_start, query_len, seq_len, s_lim, &wmax, &wmin);
    if (lane == 0) {
        s_wmax[warp] = wmax;
    }
    __syncthreads();
    int32_t kv_end = 0;
#pragma unroll
    for (int w = 0; w < BM / 32; w++) {
        kv_end = max(kv_end, s_wmax[w]);
    }
    if constexpr (MTILES == 1) {
        wmax = wmin = s_lim[warp * 16 + (lane & 15)];
#pragma unroll
        for (int sh = 8; sh > 0; sh >>= 1) {
            wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, sh));
            wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, sh));
        }
    }
    /* the scores' multiplier (KV8: times k_scale * KV8_UNIT * 2^-e) */
    float sl = scale_log2;
    if constexpr (KV8) {
        sl *= a.k_scale[kv_head * a.scale_stride_head] * KV8_UNIT;
    }
    if constexpr (KV8 && !std::is_same_v<T, __half>) {
        /* e: the Q tile's largest magnitude (exponent field E) times 2^e is under 2^15;
         * this thread's own chunks (landed: waited for above) become fp16 in place */
        uint32_t qmax = 0;
#pragma unroll
        for (int w = 0; w < W; w++) {
            qmax = max(qmax, s_qmax[w]);
        }
        const int e = min(141 - (int)(qmax >> 7), 126); /* -114 (inf, NaN) .. 126 */
        const float up = __int_as_float((e + 127) << 23);
        sl *= __int_as_float((127 - e) << 23);
        for_own_chunks<D, DS, BM, NT>(tid, [&](int, int, int pos) {
            uint4 *p = reinterpret_cast<uint4 *>(s_q + pos);
            uint4 v = *p;
            uint32_t *w = &v.x;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float lo = __uint_as_float(w[i] << 16) * up;
                const float hi = __uint_as_float(w[i] & 0xFFFF0000u) * up;
                w[i] = half_ops<__half>::pack(lo, hi);
            }
            *p = v;
        });
    }
    const int32_t n_tiles = (kv_end + BN - 1) / BN;
    /* offsets of key tiles 0 and 1 (thread tid < BN owns key tid of every tile) */
    if (tid < BN) {
        s_off[tid] = kv_key_offset<ES>(a, bt, kv_head, tid, kv_end);
        s_off[BN + tid] = kv_key_offset<ES>(a, bt, kv_head, BN + tid, kv_end);
    }
    __syncthreads();

    const char *kc = (const char *)a.key_cache;
    const char *vc = (const char *)a.value_cache;
    const char *kc2 = (const char *)a.key_cache2;
    const char *vc2 = (const char *)a.value_cache2;
    if (n_tiles > 0) {
        if constexpr (KV8) {
            stage_kv8<D, BN, NT>(s_kv8, kc, kc2, vc, vc2, s_off, kv_end);
        }
        else {
            load_kv_tile<D, BN>(s_kv, kc, kc2, s_off, kv_end, a.cache_stride_dim, kv_vec);
            load_kv_tile<D, BN>(s_kv + BN * DS, vc, vc2, s_off, kv_end, a.cache_stride_dim, kv_vec);
        }
        cp_async_commit();
    }

    /* Per-lane ldmatrix addresses (bytes) in stage 0.  Rows advance by multiples of 8, so a
     * lane's row % 8 is lane & 7 and its swizzle is fixed: 16-byte chunk 2s + b (b = 0, 1) of
     * its row sits at chunk 2s ^ sw with sw = b ^ (lane & 7) < 8, i.e. at byte
     * (sw * 16 ^ (s % 4) * 32) + (s / 4) * 128: addr[s % 4] below plus an immediate.
     * Q (A operand): matrices (rows +0/+8) x (chunk +0/+1), lane row (lane >> 3 & 1) * 8.
     * K (B operand): matrices (keys +0, chunk +0), (keys +0, chunk +1), (keys +8, +0),
     * (keys +8, +1).  V (B operand, transposed): (keys +0, chunk +0), (keys +8, +0),
     * (keys +0, +1), (keys +8, +1). */
    const int l7 = lane & 7;
    const uint32_t q_row =
        smem_addr(s_q) + (uint32_t)((warp * MTILES * 16 + ((lane >> 3) & 1) * 8 + l7) * DS * 2);
    const uint32_t k_row = smem_addr(s_kv) + (uint32_t)(((lane >> 4) * 8 + l7) * DS * 2);
    const uint32_t v_row =
        smem_addr(s_kv + BN * DS) + (uint32_t)((((lane >> 3) & 1) * 8 + l7) * DS * 2);
    const uint32_t q_sw = (uint32_t)(((lane >> 4) ^ l7) * 16);
    const uint32_t k_sw = (uint32_t)((((lane >> 3) & 1) ^ l7) * 16);
    const uint32_t v_sw = (uint32_t)(((lane >> 4) ^ l7) * 16);
    uint32_t q_addr[4], k_addr[4], v_addr[4];
#pragma unroll
    for (int x = 0; x < 4; x++) {
        q_addr[x] = q_row + (q_sw ^ (uint32_t)(x * 32));
        k_addr[x] = k_row + (k_sw ^ (uint32_t)(x * 32));
        v_addr[x] = v_row + (v_sw ^ (uint32_t)(x * 32));
    }
    float o[MTILES][DTILES][4];
#pragma unroll
    for (int mt = 0; mt < MTILES; mt++) {
#pragma unroll
        for (int dt = 0; dt < DTILES; dt++) {
            o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
        }
    }
    float m[MTILES][2]; /* running max of the raw scores */
    float l[MTILES][2]; /* running sum, this thread's columns only */
#pragma unroll
    for (int mt = 0; mt < MTILES; mt++) {
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    /*
     * Two stages: tile kt sits in stage kt & 1 while tile kt + 1 loads into the other, so the
     * loads have a whole tile of compute to land and one barrier per tile suffices.  Key
     * offsets: s_off[kt & 1] holds tile kt's until tile kt's loads are issued (iteration
     * kt - 1), then receives tile kt + 2's at the end of iteration kt; the block-table entry
     * for it is read at the start of the iteration so its latency hides behind the MMAs.
     */
    for (int32_t kt = 0; kt < n_tiles; kt++) {
        const int32_t j0 = kt * BN;
        const uint32_t stage = KV8 ? 0u : (uint32_t)(kt & 1) * STAGE_BYTES;
        cp_async_wait_all(); /* tile kt (and Q) landed */
        __syncthreads();     /* ... for every thread; every warp is done with tile kt - 1 */
        if constexpr (KV8) {
            if (kt + 1 < n_tiles) {
                const uint8_t *next = s_kv8 + ((kt + 1) & 1) * 2 * BN * kv8_row<D>;
                const int64_t *noff = s_off + ((kt + 1) & 1) * BN;
                stage_kv8<D, BN, NT>(next, kc, kc2, vc, vc2, noff, kv_end - j0 - BN);
                cp_async_commit();
            }
            convert_kv8<D, DS, BN, NT>(s_kv8 + (kt & 1) * 2 * BN * kv8_row<D>, s_kv, kc, kc2, vc,
                                       vc2, s_off + (kt & 1) * BN);
            __syncthreads(); /* tile kt in fp16 for every warp */
        }
        else if (kt + 1 < n_tiles) {
            uint16_t *next = s_kv + ((kt + 1) & 1) * 2 * BN * DS;
            const int64_t *noff = s_off + ((kt + 1) & 1) * BN;
            load_kv_tile<D, BN>(next, kc, kc2, noff, kv_end - j0 - BN, a.cache_stride_dim, kv_vec);
            load_kv_tile<D, BN>(next + BN * DS, vc, vc2, noff, kv_end - j0 - BN, a.cache_stride_dim,
                                kv_vec);
            cp_async_commit();
        }
        /* block of key j0 + 2 BN + tid, for the offsets of tile kt + 2 */
        const int32_t j2 = j0 + 2 * BN + tid;
        const bool want_off = tid < BN && kt + 2 < n_tiles;
        const int32_t blk2 = want_off && j2 < kv_end
                                 ? dk_safe_block(a, bt[(uint32_t)j2 / (uint32_t)a.block_size])
                                 : 0;

        /* A warp whose rows all end before this tile has nothing to add. */
        if (j0 < wmax) {
            /* S = Q K^T: s[mt][nt] is the 16x8 block (rows mt*16.., keys j0 + nt*8 ..);
             * c0,c1 row g, c2,c3 row g + 8, columns 2*tq, 2*tq + 1. */
            float s[MTILES][NTILES][4];
#pragma unroll
            for (int mt = 0; mt < MTILES; mt++) {
#pragma unroll
                for (int nt = 0; nt < NTILES; nt++) {
                    s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
                }
            }
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk++) {
                uint32_t qa[MTILES][4];
#pragma unroll
                for (int mt = 0; mt < MTILES; mt++) {
                    ldsm_x4(qa[mt], q_addr[kk & 3] + (kk >> 2) * 128 + mt * 16 * DS * 2);
                }
#pragma unroll
                for (int np = 0; np < NTILES / 2; np++) {
                    uint32_t b[4];
                    ldsm_x4(b, k_addr[kk & 3] + stage + (kk >> 2) * 128 + np * 16 * DS * 2);
#pragma unroll
                    for (int mt = 0; mt < MTILES; mt++) {
                        half_ops<MT>::mma(s[mt][2 * np], qa[mt], b[0], b[1]);
                        half_ops<MT>::mma(s[mt][2 * np + 1], qa[mt], b[2], b[3]);
                    }
                }
            }

            /* Mask keys at or past each row's limit, only on tiles that reach past the
             * smallest limit of the warp's rows. */
            if (j0 + BN > wmin) {
                /* limits of this thread's rows warp*32 + mt*16 + hf*8 + g (re-read here
                 * rather than held in registers across the loop) */
                int32_t lim[MTILES][2];
#pragma unroll
                for (int mt = 0; mt < MTILES; mt++) {
                    lim[mt][0] = s_lim[warp * MTILES * 16 + mt * 16 + g];
                    lim[mt][1] = s_lim[warp * MTILES * 16 + mt * 16 + 8 + g];
                }
#pragma unroll
                for (int mt = 0; mt < MTILES; mt++) {
#pragma unroll
                    for (int nt = 0; nt < NTILES; nt++) {
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            if (j0 + nt * 8 + 2 * tq + (e & 1) >= lim[mt][e >> 1]) {
                                s[mt][nt][e] = -INFINITY;
                            }
                        }
                    }
                }
            }

            /* Online softmax: p = 2^(s * scale_log2 - m * scale_log2) with m the running max
             * of the raw scores (scale_log2 > 0); O and l are rescaled only when some row's
             * max grew. */
            float alpha[MTILES][2];
            bool grew = false;
#pragma unroll
            for (int mt = 0; mt < MTILES; mt++) {
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float mx = fmaxf(s[mt][0][2 * hf], s[mt][0][2 * hf + 1]);
#pragma unroll
                    for (int nt = 1; nt < NTILES; nt++) {
                        mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
                    }
                    /* The 4 threads of a quad (same g) hold one row's BN columns. */
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float mn = fmaxf(m[mt][hf], mx);
                    grew |= mn != m[mt][hf];
                    /* A row with no visible key so far keeps max -inf; subtract 0 then, so
                     * that 2^(-inf - base) = 0 instead of nan. */
                    const float base = mn == -INFINITY ? 0.0f : __fmul_rn(mn, sl);
                    alpha[mt][hf] = fast_exp2(__fmul_rn(m[mt][hf], sl) - base);
                    m[mt][hf] = mn;
                    float sum = 0.0f;
#pragma unroll
                    for (int nt = 0; nt < NTILES; nt++) {
                        const float p0 = fast_exp2(fmaf(s[mt][nt][2 * hf], sl, -base));
                        const float p1 = fast_exp2(fmaf(s[mt][nt][2 * hf + 1], sl, -base));
                        s[mt][nt][2 * hf] = p0;
                        s[mt][nt][2 * hf + 1] = p1;
                        sum += p0 + p1;
                    }
                    l[mt][hf] = l[mt][hf] * alpha[mt][hf] + sum;
                }
            }
            if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
                for (int mt = 0; mt < MTILES; mt++) {
#pragma unroll
                    for (int dt = 0; dt < DTILES; dt++) {
                        o[mt][dt][0] *= alpha[mt][0];
                        o[mt][dt][1] *= alpha[mt][0];
                        o[mt][dt][2] *= alpha[mt][1];
                        o[mt][dt][3] *= alpha[mt][1];
                    }
                }
            }

            /* O += P V, P of this tile as A fragments: keys 16kk .. 16kk + 15 in the
             * accumulator layout of S (a0 = s[2kk] row g, a1 = s[2kk] row g+8,
             * a2 = s[2kk+1] row g, a3 = s[2kk+1] row g+8). */
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                uint32_t pa[MTILES][4];
#pragma unroll
                for (int mt = 0; mt < MTILES; mt++) {
                    pa[mt][0] = half_ops<MT>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                    pa[mt][1] = half_ops<MT>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                    pa[mt][2] = half_ops<MT>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                    pa[mt][3] = half_ops<MT>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                }
#pragma unroll
                for (int dp = 0; dp < DK / 16; dp++) {
                    uint32_t b[4];
                    ldsm_x4_trans(b, v_addr[dp & 3] + stage + (dp >> 2) * 128 + kk * 16 * DS * 2);
#pragma unroll
                    for (int mt = 0; mt < MTILES; mt++) {
                        half_ops<MT>::mma(o[mt][2 * dp], pa[mt], b[0], b[1]);
                        half_ops<MT>::mma(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
                    }
                }
            }
        }

        /* offsets of tile kt + 2 into the slot tile kt's loads (issued last iteration) freed */
        if (want_off) {
            s_off[(kt & 1) * BN + tid] =
                j2 < kv_end
                    ? kv_block_offset<ES>(a, blk2, (uint32_t)j2 % (uint32_t)a.block_size, kv_head)
                    : 0;
        }
    }
    cp_async_wait_all(); /* nothing may land after the CTA exits (Q when there is no tile) */

    /* Row sums over the quad; a row that saw no key (l == 0) writes zeros. */
    int64_t eh, t0, tile_rows;
    attn_out_tile(a, tiles_per_row, head_group, sort_rows, &s_row, BM, &eh, &t0, &tile_rows);
    if constexpr (KV8) {
        const float vs = a.v_scale[kv_head * a.scale_stride_head] * KV8_UNIT;
#pragma unroll
        for (int mt = 0; mt < MTILES; mt++) {
#pragma unroll
            for (int dt = 0; dt < DTILES; dt++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    o[mt][dt][i] *= vs;
                }
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MTILES; mt++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int r = warp * MTILES * 16 + mt * 16 + hf * 8 + g;
            attn_store_row<T, D / 8>(a, eh, t0 + r, r < tile_rows, l[mt][hf], m[mt][hf], sl,
                                     &o[mt][0][2 * hf], tq, o_vec);
        }
    }
}

/* DIFFKV_MMA_SMEM_KB: the mma.sync kernels planned as on a GPU with that many KB of shared memory
 * per SM -- their carveout set to it, so the occupancy is that GPU's too (164 on an H100 runs
 * what an A100 runs: the driver rounds a carveout up to a configuration it has).  Read once;
 * unset, not a positive number, or above the device's: the device's own. */
static int
mma_smem_kb(void)
{
    static volatile int kb = -1; /* a race reads the same variable twice: harmless */
    if (kb < 0) {
        const char *v = getenv("DIFFKV_MMA_SMEM_KB");
        const int n = v != NULL ? atoi(v) : 0;
        kb = n > 0 ? n : 0;
    }
    return kb;
}

/* Sets one form of the kernel up on device dev (its dynamic shared memory; DIFFKV_MMA_SMEM_KB's
 * carveout) and gives its CTAs per SM there; returns the CUDA error. */
template <typename T, int D, bool KV8, bool HALF, int W = ATTN_WARPS>
static cudaError_t
mma_form_setup(int dev, int *ctas)
{
    const void *k = (const void *)attention_mma_kernel<T, D, KV8, HALF, W>;
    const size_t smem = attn_tile<D, HALF, W>::SMEM;
    cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    const int kb = mma_smem_kb();
    if (e == cudaSuccess && kb > 0) {
        int per_sm = 0;
        e = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
        const int64_t pct = e == cudaSuccess && per_sm > 0 ? (int64_t)kb * 102400 / per_sm : 100;
        if (e == cudaSuccess && pct < 100) {
            e = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, (int)pct);
        }
    }
    if (e != cudaSuccess) {
        return e;
    }
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        ctas, attention_mma_kernel<T, D, KV8, HALF, W>, W * 32, smem);
}

/* Launches form (HALF, W) of the kernel; returns the launch submission's error. */
template <typename T, int D, bool KV8, bool HALF, int W = ATTN_WARPS>
static cudaError_t
launch_mma_form(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group,
                float scale_log2, bool neg_q, bool q_vec, bool kv_vec, bool o_vec, cudaStream_t s)
{
    bool sort_rows = a->num_rows >= 2 && a->num_rows <= ATTN_SORT_ROWS;
    const unsigned blocks = (unsigned)(a->num_heads * a->num_rows * tiles_per_row);
    /* the kernel's parameters, in order (with a pending KV write: one submission) */
    void *args[] = {(void *)a, &tiles_per_row, &head_group, &scale_log2, &neg_q,
                    &q_vec,    &kv_vec,        &o_vec,      &sort_rows};
    return dk_launch_after(a->pending, (const void *)attention_mma_kernel<T, D, KV8, HALF, W>,
                           dim3(blocks), dim3(W * 32), attn_tile<D, HALF, W>::SMEM, s, args);
}

/* Whether head size D has the HALF form: every size whose full tiles take more than half of an
 * A100's 164 KB (all but 192). */
template <int D> static constexpr bool mma_has_half = D != 192;

/* Warps of the WIDE form's CTA, and its query rows at head sizes of two m-tiles a warp. */
#define ATTN_WIDE_WARPS (2 * ATTN_WARPS)
#define ATTN_WIDE_BM (ATTN_WIDE_WARPS * 32)

/* Whether head size D's form over an e4m3 cache (KV8) has the WIDE form: one CTA of
 * ATTN_WIDE_WARPS warps and ATTN_WIDE_BM query rows, the full tiles of keys, one CTA an SM -- so
 * that each K/V tile is widened once for twice the queries of a four-warp CTA.  The sizes of two
 * m-tiles a warp (32 to 160). */
template <int D, bool KV8> static constexpr bool mma_has_wide = KV8 && (attn_tile<D>::MTILES == 2);

/* DIFFKV_MMA_WIDE: 0 never runs the WIDE form, 1 always where it exists and fits; unset (or
 * anything else): mma_wide_pays decides.  Read once. */
static int
mma_wide_env(void)
{
    static volatile int w = -2; /* a race reads the same variable twice: harmless */
    if (w == -2) {
        const char *v = getenv("DIFFKV_MMA_WIDE");
        const int n = v != NULL && (v[0] == '0' || v[0] == '1') && v[1] == '\0' ? v[0] - '0' : -1;
        w = n;
    }
    return w;
}

/* Whether a call at head size d over an e4m3 cache runs the WIDE form (it exists and fits one
 * CTA an SM), given the four-warp form the GPU would run: on a GPU whose shared memory takes two
 * CTAs of the full tiles only with half the keys (an A100's 164 KB), always; at the full tiles
 * (an H100's 228 KB), where the call's last query tile of ATTN_WIDE_BM rows is empty or more than
 * half full, but never at head 32 -- on an H100 the WIDE form ran 1.03-1.13x the four-warp one
 * on 16k rows at 64 to 160 but 0.94-0.98x on HunyuanImage's 4,097 queries a row (a last CTA of
 * one query row; 72: 1.01x), and 0.90-0.98x at 32 (docs/fp8.md, *The wide form*). */
static bool
mma_wide_pays(int64_t d, bool half, int64_t max_query_len)
{
    const int env = mma_wide_env();
    if (env >= 0) {
        return env == 1;
    }
    const int64_t tail = max_query_len % ATTN_WIDE_BM;
    return half || (d != 32 && (tail == 0 || tail > ATTN_WIDE_BM / 2));
}

/*
 * Launches the tensor-core kernel; returns the cudaGetDevice / cudaFuncSetAttribute / occupancy
 * error (the launch's own is read by dk_cuda_after_launch).  Its four-warp form, chosen once per
 * (instantiation, device) -- a race chooses the same twice, which is harmless: the full tiles
 * where two CTAs of them fit an SM (an H100's 228 KB), else the HALF tiles where two of those do
 * (an A100's 164 KB: the full tiles of every head size but 192 leave it one CTA, four warps, an
 * SM), else the full tiles; over an e4m3 cache the WIDE form instead where it fits and
 * mma_wide_pays.  tiles_per_row counts tiles of attn_mma_bm(D) rows (the WIDE form recounts).
 * *form: which ran.
 */
template <typename T, int D, bool KV8>
static cudaError_t
launch_mma(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group, float scale_log2,
           bool neg_q, bool q_vec, bool kv_vec, bool o_vec, cudaStream_t s, attn_mma_form *form)
{
    /* 0: not chosen; bit 0: HALF (else the full tiles), bit 1: the WIDE form fits, bit 2: set */
    static volatile int8_t forms[ATTN_MAX_DEVICES];
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) {
        return e;
    }
    const bool cached = dev >= 0 && dev < ATTN_MAX_DEVICES;
    int f = cached ? forms[dev] : 0;
    if (f == 0) {
        int full = 0, halved = 0, wide = 0;
        e = mma_form_setup<T, D, KV8, false>(dev, &full);
        if constexpr (mma_has_half<D>) {
            if (e == cudaSuccess) {
                e = mma_form_setup<T, D, KV8, true>(dev, &halved);
            }
        }
        if constexpr (mma_has_wide<D, KV8>) {
            if (e == cudaSuccess) {
                e = mma_form_setup<T, D, KV8, false, ATTN_WIDE_WARPS>(dev, &wide);
            }
        }
        if (e != cudaSuccess) {
            return e;
        }
        f = 4 | (full < 2 && halved >= 2 ? 1 : 0) | (wide >= 1 ? 2 : 0);
        if (cached) {
            forms[dev] = (int8_t)f;
        }
    }
    const bool half = (f & 1) != 0;
    if constexpr (mma_has_wide<D, KV8>) {
        if ((f & 2) != 0 && mma_wide_pays(D, half, a->max_query_len)) {
            *form = ATTN_MMA_WIDE;
            const int64_t tiles = (a->max_query_len + ATTN_WIDE_BM - 1) / ATTN_WIDE_BM;
            return launch_mma_form<T, D, KV8, false, ATTN_WIDE_WARPS>(
                a, tiles, head_group, scale_log2, neg_q, q_vec, kv_vec, o_vec, s);
        }
    }
    *form = half ? ATTN_MMA_HALF : ATTN_MMA_FULL;
    if constexpr (mma_has_half<D>) {
        if (half) {
            return launch_mma_form<T, D, KV8, true>(a, tiles_per_row, head_group, scale_log2, neg_q,
                                                    q_vec, kv_vec, o_vec, s);
        }
    }
    return launch_mma_form<T, D, KV8, false>(a, tiles_per_row, head_group, scale_log2, neg_q, q_vec,
                                             kv_vec, o_vec, s);
}

/* A head size's launchers, one per query dtype, over a cache of that dtype (KV8 false) or an
 * e4m3 one (KV8 true). */
typedef cudaError_t (*mma_launcher)(const dk_attention_args *, int64_t, int64_t, float, bool, bool,
                                    bool, bool, cudaStream_t, attn_mma_form *);
struct mma_launchers {
    int32_t head;
    mma_launcher f16, bf16;
};
template <int D, bool KV8>
static constexpr mma_launchers
mma_head()
{
    return {D, launch_mma<__half, D, KV8>, launch_mma<__nv_bfloat16, D, KV8>};
}

/* Runs the call on the launcher of heads[0 .. n) for its head size and dtype; cudaErrorInvalidValue
 * where there is none (the caller checked the head size: not reached). */
static cudaError_t
mma_run(const mma_launchers *heads, size_t n, const dk_attention_args *a, int64_t tiles_per_row,
        int64_t head_group, float scale_log2, bool neg_q, bool q_vec, bool kv_vec, bool o_vec,
        cudaStream_t s, attn_mma_form *form)
{
    *form = ATTN_MMA_FULL;
    for (size_t i = 0; i < n; i++) {
        if (heads[i].head == a->head_size) {
            const mma_launcher f = a->dtype == DK_BF16 ? heads[i].bf16 : heads[i].f16;
            return f(a, tiles_per_row, head_group, scale_log2, neg_q, q_vec, kv_vec, o_vec, s,
                     form);
        }
    }
    return cudaErrorInvalidValue;
}

/* attention_sm80_fp8.cu: attn_mma_launch's calls over an e4m3 cache. */
cudaError_t attn_mma_kv8_launch(const dk_attention_args *a, int64_t tiles_per_row,
                                int64_t head_group, float scale_log2, bool neg_q, bool q_vec,
                                bool kv_vec, bool o_vec, cudaStream_t s, attn_mma_form *form);
