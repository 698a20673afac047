/*
 * sm90_producers.cuh -- the K/V producers of the warp-specialized Hopper kernel
 * (attention_sm90_ws.cu): the producer warpgroup's ways of filling the K and V slots of shared
 * memory and arriving on their "full" mbarriers, each waiting on a slot's "empty" mbarrier
 * before it refills it:
 *   - h90_produce_cp_async: cp.async rows, any block size (per-key row addresses through a
 *     shared ring);
 *   - h90_produce_cp_async_groups: cp.async rows for power-of-two blocks of 16+ keys (per
 *     16-key group addresses in registers);
 *   - h90_produce_tma_groups: one TMA box per 16-key chunk for K and for V (heads 128, 192,
 *     256).
 * The fourth way, per-block and flat TMA boxes from one warp, lives in the kernel itself.
 * Everything is static and compiled only where H90_DEVICE_CODE is defined (sm90_wgmma.cuh).
 */
#ifndef DIFFKV_SM90_PRODUCERS_CUH
#define DIFFKV_SM90_PRODUCERS_CUH

#include "attention_common.cuh"
#include "sm90_async.cuh"
#include "sm90_tiles.cuh"
#include "sm90_wgmma.cuh"

#include <cuda.h> /* CUtensorMap */

/* Producer warps issuing the per-chunk boxes (h90_produce_tma_groups). */
#define H90_TMA16_WARPS 4

#ifdef H90_DEVICE_CODE
/* What each of a cp.async producer's 128 threads needs about its CTA's row: the kv head, the
 * row's block table, its 16-byte chunk c of a key row and first row rr of a pass, the caches
 * (the second source's too). */
struct h90_cp_thread {
    int64_t kvh;
    const int32_t *bt;
    uint32_t c, rr;
    const char *kc, *vc, *kc2, *vc2;
};

/* The h90_cp_thread of this thread (0 .. 127 of the producer warpgroup) for head h of batch
 * row `row`, head size D.  Cannot fail. */
template <int D>
static __device__ __forceinline__ h90_cp_thread
h90_cp_setup(const dk_attention_args &a, int64_t h, int64_t row)
{
    constexpr int CH = D / 8; /* 16-byte chunks per key row */
    /* chunks per row a pass of the 128 threads takes: all, or one 64-dim panel at 192 dims */
    constexpr int CW = 128 % CH == 0 ? CH : 8;
    const int tid = (int)threadIdx.x;
    return {h / (a.num_heads / a.num_kv_heads),
            a.block_table + row * a.bt_stride_row,
            (uint32_t)(tid % CW),
            (uint32_t)(tid / CW),
            (const char *)a.key_cache,
            (const char *)a.value_cache,
            (const char *)a.key_cache2,
            (const char *)a.value_cache2};
}

/*
 * The producer warpgroup of attention_sm90_ws_kernel when the cache does not suit TMA boxes
 * (blocks under the TMA's smallest box or not a power of two, dense key indices) nor the group
 * form below: per key tile, thread t resolves key t's K and V row addresses (either source) into
 * a shared ring of two tiles, then every thread copies 16-byte chunk t % 16 of rows t / 16 + 8 i
 * -- a warp moves two whole 256-byte key rows per instruction -- with cp.async, zero-filling rows
 * past kv_end, and arrives on the slot's full barrier when its copies land (count 128).  K slot
 * i of ST at sk0 + i * BN * D * 2 with barriers full_k + 8 i / empty_k + 8 i, V likewise with
 * SV slots; n_tiles tiles of BN keys, keys past kv_end zeros.  Called by the producer
 * warpgroup's 128 threads (it has a 128-thread named barrier).  DR < D: the cache's rows have
 * DR dims, the tiles D (a padded head size): chunks DR / 8 .. D / 8 - 1 are not copied (the
 * kernel zeroed them once).
 */
template <int D, int BN, int ST, int SV, int DR = D>
static __device__ __forceinline__ void
h90_produce_cp_async(const dk_attention_args &a, int64_t h, int64_t row, int32_t kv_end,
                     int32_t n_tiles, uint32_t sk0, uint32_t sv0, uint32_t full_k, uint32_t full_v,
                     uint32_t empty_k, uint32_t empty_v)
{
    constexpr uint32_t KVB = BN * D * 2;
    constexpr int CH = D / 8; /* 16-byte chunks per key row */
    /* A pass of the 128 threads copies CW chunks of RP rows: whole rows where a row's chunks
     * divide 128, else (192 dims) one 64-dim panel of 16 rows, the panels one after another. */
    constexpr int CW = 128 % CH == 0 ? CH : 8;
    constexpr int RP = 128 / CW; /* rows per pass */
    constexpr int NPN = CH / CW; /* passes per row: 1, or 3 panels */
    static_assert(BN % RP == 0 && CH % CW == 0, "whole passes");
    __shared__ const char *s_prow[2][2][BN]; /* [tile & 1][K, V][row]: row addresses */
    const int tid = (int)threadIdx.x;        /* 0 .. 127 */
    const auto [kvh, bt, c, rr, kc, vc, kc2, vc2] = h90_cp_setup<D>(a, h, row);
    /* Block ids of this thread's keys (tid and tid + 128 of every tile: BN <= 256), loaded one
     * tile ahead so that the block-table latency hides behind a tile's copies. */
    constexpr int KPT = (BN + 127) / 128;
    const uint32_t bs = (uint32_t)a.block_size;
    int32_t blk[KPT];
#pragma unroll
    for (int u = 0; u < KPT; u++) {
        const int32_t j = tid + 128 * u;
        blk[u] = j < BN && j < kv_end ? bt[(uint32_t)j / bs] : 0;
    }
    for (int32_t kt = 0; kt < n_tiles; kt++) {
        const int32_t j0 = kt * BN;
#pragma unroll
        for (int u = 0; u < KPT; u++) {
            const int32_t r = tid + 128 * u;
            const int32_t j = j0 + r;
            if (r < BN) {
                /* resolved once per key and tile, so the copies below are one add each */
                const int64_t off =
                    j < kv_end ? kv_block_offset(a, dk_safe_block(a, blk[u]), (uint32_t)j % bs, kvh)
                               : 0;
                s_prow[kt & 1][0][r] = kv_row(kc, kc2, off);
                s_prow[kt & 1][1][r] = kv_row(vc, vc2, off);
                const int32_t jn = j + BN; /* the next tile's key */
                blk[u] = jn < kv_end ? bt[(uint32_t)jn / bs] : 0;
            }
        }
        named_barrier(15u, 128u); /* also: every thread is done reading tile kt - 2's ring slot */
#pragma unroll
        for (int kv = 0; kv < 2; kv++) {
            const int stages = kv == 0 ? ST : SV;
            const uint32_t slot = (uint32_t)(kt % stages);
            if (kt >= stages) { /* the phase the slot's last use ended */
                mbar_wait((kv == 0 ? empty_k : empty_v) + 8u * slot,
                          (uint32_t)((kt / stages - 1) & 1));
            }
            const uint32_t dst = (kv == 0 ? sk0 : sv0) + slot * KVB;
            const char *const *rows = s_prow[kt & 1][kv];
            /* a padded tile's chunks past DR stay the kernel's zeros */
            if constexpr (NPN == 1) {
                if (DR == D || c < DR / 8) {
#pragma unroll
                    for (int i = 0; i < BN / RP; i++) {
                        const uint32_t r = rr + (uint32_t)(RP * i);
                        cp_async16(dst + sw128(BN, r, c), rows[r] + c * 16u,
                                   j0 + (int32_t)r < kv_end ? 16u : 0u);
                    }
                }
            }
            else {
#pragma unroll
                for (int i = 0; i < BN / RP; i++) {
                    const uint32_t r = rr + (uint32_t)(RP * i);
                    const uint32_t n = j0 + (int32_t)r < kv_end ? 16u : 0u;
#pragma unroll
                    for (int pn = 0; pn < NPN; pn++) {
                        const uint32_t cc = c + (uint32_t)(CW * pn);
                        if (DR == D || cc < DR / 8) {
                            cp_async16(dst + sw128(BN, r, cc), rows[r] + cc * 16u, n);
                        }
                    }
                }
            }
            cp_async_arrive_noinc((kv == 0 ? full_k : full_v) + 8u * slot);
        }
    }
    cp_async_wait_all(); /* nothing lands after the thread exits */
}

/*
 * The cp.async producer for caches whose blocks hold a power of two of at least 16 keys:
 * every 16 consecutive keys of a tile lie in one block, so instead of resolving each key's row
 * into a shared ring (h90_produce_cp_async) each warp resolves 16-key groups itself -- one
 * block-table load (an L1 broadcast, loaded a tile ahead) and one offset per group -- and its
 * lanes add the token offsets of their rows.  The four warps split a tile's groups (warp w
 * takes groups w, w + 4, ..): each copies whole 16-row groups, so a group's address arithmetic
 * (64-bit, on the uniform datapath) runs once per tile and not once per warp -- those
 * instructions share the SM's issue slots with the consumers' softmax.  No shared-memory traffic
 * besides the copies, which keeps the memory pipe free for the consumers' wgmma issue (the ring's
 * loads and stores competed with it there).  K and V of a tile are copied together, row by row,
 * once both slots are free (V has one slot more than K so that K is not held back), and every
 * thread then arrives on both full barriers.  Slots, barriers, tiles and DR as
 * h90_produce_cp_async; SPLIT: K of a tile is copied as soon as its slot is free and V after it
 * once V's is (the 192- and 256-dim forms' two slots of each: V frees a P V after K, and waiting
 * for both held the next K back); TWO: the cache has a second source (dense joint tokens), else
 * the head's and the lane's offsets are folded into the base pointers.
 */
template <int D, int BN, int ST, int SV, bool TWO, int DR = D, bool SPLIT = false>
static __device__ __forceinline__ void
h90_produce_cp_async_groups(const dk_attention_args &a, int64_t h, int64_t row, int32_t kv_end,
                            int32_t n_tiles, uint32_t sk0, uint32_t sv0, uint32_t full_k,
                            uint32_t full_v, uint32_t empty_k, uint32_t empty_v)
{
    constexpr uint32_t KVB = BN * D * 2;
    constexpr int CH = D / 8; /* 16-byte chunks per key row (8, 16, 24 or 32) */
    /* A warp-wide copy takes CW chunks of RW rows: whole rows where a row's chunks divide the
     * warp, else (192 dims) one 64-dim panel of 4 rows, the row's panels one after another. */
    constexpr int CW = 32 % CH == 0 ? CH : 8;
    constexpr int RW = 32 / CW;      /* rows per warp-wide copy (1, 2 or 4) */
    constexpr int NPN = CH / CW;     /* such copies per row: 1, or 3 panels */
    constexpr int NG = BN / 16;      /* 16-key groups per tile */
    constexpr int GW = (NG + 3) / 4; /* per warp (some warps one fewer where 4 does not divide) */
    static_assert(BN % 16 == 0 && CH % CW == 0, "four warps split a tile's 16-key groups");
    /* th.c and th.rr spread the warpgroup's threads over a pass's rows; here each warp copies
     * whole groups, so its lanes take c and rr below instead */
    const h90_cp_thread th = h90_cp_setup<D>(a, h, row);
    const int64_t kvh = th.kvh;
    const int32_t *const bt = th.bt;
    const char *const kc = th.kc, *const vc = th.vc, *const kc2 = th.kc2, *const vc2 = th.vc2;
    const uint32_t lane = threadIdx.x & 31u;
    const int32_t warp = (int32_t)((threadIdx.x >> 5) & 3u);
    const uint32_t c = lane % CW;  /* this lane's chunk of a row (of its first panel) */
    const uint32_t rr = lane / CW; /* and its row within each RW-row copy */
    const uint32_t bs = (uint32_t)a.block_size;
    const uint32_t shift = (uint32_t)__ffs((int)bs) - 1u; /* bs is a power of two */
    const int64_t tbytes = a.cache_stride_token * 2;
    const int64_t t0 = (int64_t)rr * tbytes + (int64_t)c * 16; /* the lane's bytes in a group */
    /* One source (every paged cache): the head's and the lane's offsets folded into the base
     * pointers, so that a group costs one multiply-add on its block id and token. */
    const int64_t head_bytes = kvh * a.cache_stride_head * 2 + t0;
    const char *const kb = kc + head_bytes;
    const char *const vb = vc + head_bytes;
    const int64_t bbytes = a.cache_stride_block * 2;
    /* dk_safe_block's bound in 32 bits (block ids are int32; a negative one clamps too) */
    const uint32_t nblocks = (uint32_t)min(a.num_blocks, (int64_t)INT32_MAX);
    /* whether group g of each tile (the warp's g-th) exists: with 80-key tiles warp 0 has two */
    auto has_group = [&](int g) { return NG % 4 == 0 || warp + 4 * g < NG; };
    int32_t blk[GW]; /* block ids of this warp's groups of the next tile */
#pragma unroll
    for (int g = 0; g < GW; g++) {
        const int32_t key = 16 * (warp + 4 * g);
        blk[g] = key < kv_end && has_group(g) ? bt[(uint32_t)key >> shift] : 0;
    }
    /* Group g's K and V row addresses in tile j0 (this lane's), and its block id of the next
     * tile loaded into blk[g]. */
    auto group_rows = [&](int g, int32_t j0, const char **kr, const char **vr) {
        const int32_t gk = j0 + 16 * (warp + 4 * g); /* the group's first key */
        if (TWO) { /* dense joint tokens: a block of either source */
            const int64_t off = gk < kv_end ? kv_block_offset(a, dk_safe_block(a, blk[g]),
                                                              (uint32_t)gk & (bs - 1u), kvh)
                                            : 0;
            *kr = kv_row(kc, kc2, off) + t0;
            *vr = kv_row(vc, vc2, off) + t0;
        }
        else { /* dk_safe_block's clamp; past kv_end any real block (never read) */
            const uint32_t b = gk < kv_end && (uint32_t)blk[g] < nblocks ? (uint32_t)blk[g] : 0u;
            const int64_t off = (int64_t)b * bbytes + (int64_t)((uint32_t)gk & (bs - 1u)) * tbytes;
            *kr = kb + off;
            *vr = vb + off;
        }
        const int32_t nk = gk + BN; /* the same group of the next tile */
        blk[g] = nk < kv_end ? bt[(uint32_t)nk >> shift] : 0;
    };
    /* Copies group g's 16 rows from src into the slot at dst and, with both, those of src2 into
     * dst2 row by row beside them (a padded tile's chunks past DR stay the kernel's zeros). */
    auto copy_group = [&](int g, int32_t j0, uint32_t dst, const char *src, bool both,
                          uint32_t dst2, const char *src2) {
        const int32_t q = warp + 4 * g;
        /* row pass p, panel pn (the chunk c + CW pn of the row) */
        auto copy = [&](int p, int pn) {
            const uint32_t r = (uint32_t)(16 * q + RW * p) + rr; /* row in the tile */
            const uint32_t cc = c + (uint32_t)(CW * pn);
            const int64_t t = (int64_t)(RW * p) * tbytes + 16 * CW * pn;
            const uint32_t n = j0 + (int32_t)r < kv_end ? 16u : 0u;
            cp_async16(dst + sw128(BN, r, cc), src + t, n);
            if (both) {
                cp_async16(dst2 + sw128(BN, r, cc), src2 + t, n);
            }
        };
        /* (ptxas spills the 56-register producer if the padded forms test their chunk per copy
         * or the panels' loop is the outer one) */
        if constexpr (NPN == 1) {
            if (DR == D || c < DR / 8) {
#pragma unroll
                for (int p = 0; p < 16 / RW; p++) {
                    copy(p, 0);
                }
            }
        }
        else {
#pragma unroll
            for (int p = 0; p < 16 / RW; p++) {
#pragma unroll
                for (int pn = 0; pn < NPN; pn++) {
                    if (DR == D || c + (uint32_t)(CW * pn) < DR / 8) {
                        copy(p, pn);
                    }
                }
            }
        }
    };
    for (int32_t kt = 0; kt < n_tiles; kt++) {
        const int32_t j0 = kt * BN;
        const uint32_t slot_k = (uint32_t)(kt % ST);
        const uint32_t slot_v = (uint32_t)(kt % SV);
        if (kt >= ST) { /* the phase the slot's last use ended */
            mbar_wait(empty_k + 8u * slot_k, (uint32_t)((kt / ST - 1) & 1));
        }
        const uint32_t dk = sk0 + slot_k * KVB;
        const uint32_t dv = sv0 + slot_v * KVB;
        if constexpr (SPLIT) {
            const char *vr[GW];
#pragma unroll
            for (int g = 0; g < GW; g++) {
                if (has_group(g)) {
                    const char *kr;
                    group_rows(g, j0, &kr, &vr[g]);
                    copy_group(g, j0, dk, kr, false, 0u, nullptr);
                }
            }
            cp_async_arrive_noinc(full_k + 8u * slot_k);
            if (kt >= SV) {
                mbar_wait(empty_v + 8u * slot_v, (uint32_t)((kt / SV - 1) & 1));
            }
#pragma unroll
            for (int g = 0; g < GW; g++) {
                if (has_group(g)) {
                    copy_group(g, j0, dv, vr[g], false, 0u, nullptr);
                }
            }
            cp_async_arrive_noinc(full_v + 8u * slot_v);
            continue;
        }
        if (kt >= SV) {
            mbar_wait(empty_v + 8u * slot_v, (uint32_t)((kt / SV - 1) & 1));
        }
#pragma unroll
        for (int g = 0; g < GW; g++) {
            if (has_group(g)) {
                const char *kr, *vr;
                group_rows(g, j0, &kr, &vr);
                copy_group(g, j0, dk, kr, true, dv, vr);
            }
        }
        cp_async_arrive_noinc(full_k + 8u * slot_k);
        cp_async_arrive_noinc(full_v + 8u * slot_v);
    }
    cp_async_wait_all(); /* nothing lands after the thread exits */
}

/* The producer of caches cut into 16-key chunks (dims.k_groups, the kernel's VG): TMA boxes,
 * one thread per chunk of a tile (its block from the table, its first 8-row group within the
 * block) bringing its K and its V each as one 5-d box of h90_kgroups_encode's maps (4 KB, both
 * halves), so both tiles land in the K_GROUPS layout.  The producer warpgroup's
 * H90_TMA16_WARPS warps share a tile's chunks (chunk warp + 4 lane): a TMA takes its
 * coordinates in uniform registers, so a warp issues its lanes' boxes one after another, and
 * four warps issue a tile's 11 in three rounds instead of eleven.  The producer's issue latency
 * is on the consumers' path with two K stages, so the FLAT form is an instantiation of its own
 * rather than a runtime switch.  Chunk 0's thread
 * expects the tile's bytes: the full barrier's one arrival, so boxes that land before it
 * leave the phase open.  KA (the kernel's K_AHEAD): K of tile kt before V of tile kt - 1.
 * FLAT (the kernel's VG 2, dims.k_groups 3): dense_attention's vouched chunks -- every 16 keys
 * of a row are 16 consecutive token rows of one source from a multiple of 8 -- with each
 * source one map of a single block (kmap / vmap, kmap2 / vmap2 past blocks2), so a chunk's
 * coordinates are its first row / 8 in its source.  hnd: the maps fold the kv head into the
 * block (HND), else into the halves (NHD).  first_ok: first_blk is this thread's block-table
 * entry of tile 0, loaded at the kernel's start.  Slots, barriers and tiles as
 * h90_produce_cp_async, except that tile kt takes the slots and phases of ring position base +
 * kt (base: the tiles a persistent CTA's earlier work items took, attention_sm90_persist.cu);
 * called by the H90_TMA16_WARPS producer warps.
 * No cp.async at all: the copies of a cp.async producer share the memory pipe with the
 * consumers' wgmma issue. */
template <int D, int BN, int ST, int SV, bool KA, bool FLAT>
static __device__ __forceinline__ void
h90_produce_tma_groups(const dk_attention_args &a, int64_t h, int64_t row, int32_t kv_end,
                       int32_t n_tiles, uint32_t sk0, uint32_t sv0, uint32_t full_k,
                       uint32_t full_v, uint32_t empty_k, uint32_t empty_v, const CUtensorMap *kmap,
                       const CUtensorMap *vmap, const CUtensorMap *kmap2, const CUtensorMap *vmap2,
                       bool hnd, bool first_ok, int32_t first_blk, int32_t base = 0)
{
    constexpr uint32_t KVB = BN * D * 2;
    constexpr int NG = BN / 16; /* 16-key chunks per tile */
    static_assert(D % 64 == 0 && NG <= 32, "64-dim panels, a thread per chunk");
    constexpr uint32_t CB = 32u * D; /* bytes of a 16-key chunk */
    constexpr int32_t PN = D / 64;   /* its panels */
    constexpr int PW = H90_TMA16_WARPS;
    const int32_t warp = (int32_t)(threadIdx.x >> 5);
    const int32_t lane = (int32_t)(threadIdx.x & 31u);
    const int32_t chunk = warp + PW * lane; /* this thread's chunk of a tile */
    const int32_t kvh = (int32_t)(h / (a.num_heads / a.num_kv_heads));
    const int32_t *const bt = a.block_table + row * a.bt_stride_row;
    const uint32_t nblocks = (uint32_t)min(a.num_blocks, (int64_t)INT32_MAX);
    const int32_t heads = (int32_t)a.num_kv_heads;
    const uint32_t bs = (uint32_t)a.block_size;
    /* the block of this thread's chunk of tile kt, clamped as dk_safe_block does, and the
     * chunk's first 8-row group within the block (FLAT: its source, 0 or 1, and its first row
     * / 8 there); -1: none (past kv_end) */
    const auto block_of = [&](int32_t kt, int32_t &g) -> int32_t {
        const int32_t key = kt * BN + 16 * chunk;
        g = 0;
        if (chunk >= NG || key >= kv_end) {
            return -1;
        }
        const uint32_t q = (uint32_t)key / bs;
        /* tile 0's entry was loaded at the kernel's start (first_ok), or is read now */
        const int32_t entry = kt == 0 && first_ok ? first_blk : bt[q];
        if constexpr (FLAT) { /* the host keeps num_blocks * block_size under 2^31 */
            const int32_t b0 = entry;
            const uint32_t b = (uint32_t)b0 < nblocks ? (uint32_t)b0 : 0u;
            const uint32_t blocks2 = (uint32_t)min(a.blocks2, (int64_t)INT32_MAX);
            const bool second = a.key_cache2 != NULL && b >= blocks2;
            g = (int32_t)(((second ? b - blocks2 : b) * bs + ((uint32_t)key - q * bs)) >> 3);
            return second ? 1 : 0;
        }
        else {
            g = (int32_t)(((uint32_t)key - q * bs) >> 3);
            const int32_t b = entry;
            return (uint32_t)b < nblocks ? b : 0;
        }
    };
    const auto issue = [&](int32_t kt, int kv, int32_t b, int32_t g) {
        const int stages = kv == 0 ? ST : SV;
        const int32_t pos = base + kt; /* ring position */
        const uint32_t slot = (uint32_t)(pos % stages);
        const uint32_t bar = (kv == 0 ? full_k : full_v) + 8u * slot;
        if (pos >= stages) { /* the phase the slot's last use ended */
            mbar_wait((kv == 0 ? empty_k : empty_v) + 8u * slot,
                      (uint32_t)((pos / stages - 1) & 1));
        }
        if (chunk == 0) {
            const int32_t blocks = min(NG, (kv_end - kt * BN + 15) / 16);
            mbar_arrive_expect_tx(bar, (uint32_t)blocks * CB);
        }
        if (b >= 0) {
            const uint32_t dst = (kv == 0 ? sk0 : sv0) + slot * KVB + (uint32_t)chunk * CB;
            if constexpr (FLAT) {
                const CUtensorMap *map = kv == 0 ? (b ? kmap2 : kmap) : (b ? vmap2 : vmap);
                tma_load_5d(dst, map, bar, 0, 0, PN * kvh, g, 0);
            }
            else {
                const CUtensorMap *map = kv == 0 ? kmap : vmap;
                if (hnd) {
                    tma_load_5d(dst, map, bar, 0, 0, 0, g, b * heads + kvh);
                }
                else {
                    tma_load_5d(dst, map, bar, 0, 0, PN * kvh, g, b);
                }
            }
        }
    };
    if constexpr (KA) {
        int32_t prev = -1, prev_g = 0;
        for (int32_t kt = 0; kt <= n_tiles; kt++) {
            int32_t g = 0;
            const int32_t b = kt < n_tiles ? block_of(kt, g) : -1;
            if (kt < n_tiles) {
                issue(kt, 0, b, g);
            }
            if (kt > 0) {
                issue(kt - 1, 1, prev, prev_g);
            }
            prev = b;
            prev_g = g;
        }
    }
    else {
        for (int32_t kt = 0; kt < n_tiles; kt++) {
            int32_t g;
            const int32_t b = block_of(kt, g);
            issue(kt, 0, b, g);
            issue(kt, 1, b, g);
        }
    }
}

#endif /* H90_DEVICE_CODE */

#endif /* DIFFKV_SM90_PRODUCERS_CUH */
