/*
 * attention_sm90_persist.cu -- the persistent form of the warp-specialized Hopper kernel
 * ("sm90-persist"): one CTA per SM walking the work items (query tiles) of a short call, so that
 * a CTA's fixed costs overlap the work before them instead of following it.
 *
 * Over 1-2 rows of 1k-4k tokens the kernel of attention_sm90_ws.cu, one CTA per 128-row query
 * tile, spent about 4 us of every CTA outside its key loop against 1.4 us per 128-key tile: the
 * row's span, Q and the first K tile coming in, the epilogue, the SM's next CTA starting
 * (hopper-kernels.md, *CTA prologue and epilogue*).  cuDNN's SDPA, 1.05-1.2x faster there, runs
 * one CTA per SM (grid 132 on the H200, 232 KB of shared memory).  Here a CTA takes items
 * blockIdx.x, blockIdx.x + gridDim.x, ... in attn_cta_place's order (the CTAs that run together
 * take the items the one-CTA-per-item grid would run together), and:
 *   - the producer warpgroup runs on into the next item's K/V tiles as soon as slots free up:
 *     the slots, their full / empty mbarriers and phases count tiles over the whole CTA (ring
 *     position base + kt), so the next item's first tiles land while the consumers finish;
 *   - two Q buffers, filled by the producer's TMA (two boxes of the query's map per item,
 *     h90_persist_maps; a full / empty mbarrier pair per buffer): an item's Q lands while the
 *     item before it runs, and the consumers issue no copies (the next item's Q as 8 cp.async
 *     per consumer thread, at the start of an item, had held its first Q K^T back by about
 *     1 us: per-item clock stamps, hopper-kernels.md, *Q in and O out by TMA*);
 *   - the epilogue by TMA store: each warpgroup stages its 64 rows of O in its rows of the
 *     item's Q buffer and one thread stores them as two boxes of the output's map; the buffer
 *     goes back to the producer at the next item's first softmax, once the stores have read it;
 *   - the consumers' turns for the tensor cores (ping-pong, named barriers 8 + cw) continue
 *     across items: one opening before the first item, one closing after the last;
 *   - nothing is read from global memory to find an item's rows: the host passes a uniform
 *     batch's query and key lengths (dk_attention_args.uniform_query_len / uniform_seq_len, or
 *     up to 8 rows' row_seq_lens, checked on its copies of the metadata), and under the one mask
 *     this form takes, none, every row sees all kv_end = seq_len keys: an item's tiles follow
 *     from its index, and a thread's row limits are kv_end or 0 past the row's end (no shared
 *     limits, no CTA barrier per item);
 *   - a consumer issues the next item's first Q K^T with the item's last P V (one turn; the
 *     next Q and K tile waited for first) and runs the epilogue while it computes: the next
 *     item starts at its first softmax.  Each branch waits for everything it issued before
 *     the paths join (a wgmma in flight past a join makes ptxas serialize them all).  1 % faster
 *     on 2k-8k-token rows than finishing an item first; a form with the next item's first Q K^T
 *     beside the last P V and the epilogue under the next softmax, one loop over every tile of
 *     every item, had measured 2-9 % slower (hopper-kernels.md, *The persistent form*).
 * Everything else is the ws kernel's head-128 form with the per-chunk TMA producer
 * (sm90-tma16): 128-query-row items, 128-key tiles in two K and three V slots, the late P V
 * wait.  Shared memory: two Q tiles and five K/V slots, 224 KB.  The query's and the output's
 * maps are 4-d over the rows (a row's tokens, then the rows), so a tile's rows past its row's
 * end come in as zeros and are not written (their limits are 0 as well).
 *
 * Entry point (attention_internal.cuh): attn_sm90_persist_launch.
 */
#include "attention_common.cuh"
#include "attention_internal.cuh"
#include "cuda_common.cuh"
#include "sm90_async.cuh"
#include "sm90_producers.cuh"
#include "sm90_tiles.cuh"
#include "sm90_tma_map.cuh"
#include "sm90_wgmma.cuh"

#include <cuda.h> /* CUtensorMap */

#define HP_D 128  /* head size */
#define HP_NC 2   /* consumer warpgroups */
#define HP_BM 128 /* query rows per item */
#define HP_BN 128 /* keys per tile */
#define HP_ST 2   /* K slots */
#define HP_SV 3   /* V slots */

static_assert(HP_BM == ATTN_BM, "attn_persist_items counts ATTN_BM-row items");

#ifdef H90_DEVICE_CODE
/* One work item: its head, batch row, first query row q0 (of the batch row) and the batch row's
 * first packed token. */
struct hp_item {
    int64_t h, row, q0, q_start;
};

static __device__ __forceinline__ hp_item
hp_place(const dk_attention_args &a, int64_t item, int64_t tiles_per_row, int64_t head_group)
{
    hp_item it;
    int64_t tile_rev;
    attn_cta_place(a, item, tiles_per_row, head_group, false, NULL, &it.h, &it.row, &tile_rev);
    it.q0 = (tiles_per_row - 1 - tile_rev) * HP_BM;
    it.q_start = it.row * a.uniform_query_len;
    return it;
}

/* Item i's keys: the rows' seq_len, or its row's (i / row_items, by comparisons: uniform
 * registers), bounded by the block table's reach. */
static __device__ __forceinline__ int32_t
hp_keys(const dk_attention_args &a, int64_t i, int64_t row_items, int32_t reach)
{
    int32_t seq = a.uniform_seq_len > 0 ? a.uniform_seq_len : a.row_seq_lens[0];
#pragma unroll
    for (int r = 1; r < DK_ROW_SEQ_LENS; r++) {
        if (a.uniform_seq_len <= 0 && r < a.num_rows && i >= r * row_items) {
            seq = a.row_seq_lens[r];
        }
    }
    return min(seq, reach);
}

/* The producer's Q of the CTA's n-th item `it` into buffer n & 1 (two boxes of 64 dims x 128
 * rows, 16 KB each, the tiles' 128-byte swizzle; rows past the row's end come in as zeros),
 * once both warpgroups are done with the item two before it; by one thread. */
static __device__ __forceinline__ void
hp_produce_q(const CUtensorMap *tmq, const hp_item &it, int n, uint32_t sq0, uint32_t full_q,
             uint32_t empty_q)
{
    constexpr uint32_t QB = HP_BM * HP_D * 2;
    const uint32_t b = (uint32_t)(n & 1);
    if (n >= 2) {
        mbar_wait(empty_q + 8u * b, (uint32_t)(((n >> 1) - 1) & 1));
    }
    mbar_arrive_expect_tx(full_q + 8u * b, QB);
#pragma unroll
    for (int p = 0; p < HP_D / 64; p++) {
        tma_load_4d(sq0 + b * QB + (uint32_t)p * (HP_BM * 128u), tmq, full_q + 8u * b, 64 * p,
                    (int32_t)it.h, (int32_t)it.q0, (int32_t)it.row);
    }
}

/* The epilogue of consumer warpgroup cw (thread wt) for item `it`: its rows and LSE staged in
 * its rows of the item's Q buffer sq (h90_stage_o), then the warpgroup's first thread stores
 * the rows by two TMA boxes of the output's map (rows past the row's end are not written) and
 * commits them: it waits for their reads of sq (tma_store_wait_read) before the buffer goes
 * back to the producer. */
template <typename T>
static __device__ __forceinline__ void
hp_store_o(const dk_attention_args &a, const CUtensorMap *tmo, uint32_t sq, int cw, int wt,
           const hp_item &it, int64_t query_len, const float (&l)[2], const float (&m)[2],
           float scale_log2, const float (&o)[HP_D / 2])
{
    const float sl2[2] = {scale_log2, scale_log2};
    h90_stage_o<T, HP_D, HP_BM>(a, sq, cw, wt, it.h, it.q_start + it.q0, query_len - it.q0, l, m,
                                sl2, o);
    fence_proxy_async(); /* the stores, before the TMA unit reads them */
    named_barrier(1u + (uint32_t)cw, 128u);
    if (wt == 0) {
#pragma unroll
        for (int p = 0; p < HP_D / 64; p++) {
            tma_store_4d(tmo, sq + (uint32_t)p * (HP_BM * 128u) + (uint32_t)cw * 64u * 128u, 64 * p,
                         (int32_t)it.h, (int32_t)it.q0 + 64 * cw, (int32_t)it.row);
        }
        tma_store_commit();
    }
}

/* A consumer warpgroup's release of Q buffer b (its item's epilogue done, and the TMA stores'
 * reads of it, which its thread wt 0 waits for): one arrival per warp. */
static __device__ __forceinline__ void
hp_release_q(uint32_t empty_q, uint32_t b, int wt)
{
    if (wt == 0) {
        tma_store_wait_read();
    }
    __syncwarp();
    if ((wt & 31) == 0) {
        mbar_arrive(empty_q + 8u * b);
    }
}
#endif

template <typename T>
/* clang-format off */
static __global__ void __launch_bounds__(128 * (HP_NC + 1), 1)
attention_sm90_persist_kernel(const __grid_constant__ CUtensorMap tmk,
                              const __grid_constant__ CUtensorMap tmv,
                              const __grid_constant__ CUtensorMap tmq,
                              const __grid_constant__ CUtensorMap tmo, const dk_attention_args a,
                              int64_t items, int64_t tiles_per_row, int64_t head_group,
                              float scale_log2, bool neg_q, bool hnd)
/* clang-format on */
{
#ifdef H90_DEVICE_CODE
    constexpr int D = HP_D, NC = HP_NC, BM = HP_BM, BN = HP_BN, ST = HP_ST, SV = HP_SV;
    constexpr int NT = BN / 8;
    constexpr int DT = D / 8;
    constexpr uint32_t QB = BM * D * 2;
    constexpr uint32_t KVB = BN * D * 2;
    using regs = h90_ws_regs<56, 224, HP_NC>;

    extern __shared__ uint4 hp_smem[];
    /* full K[ST], full V[SV], empty K[ST], empty V[SV], full Q[2], empty Q[2] */
    __shared__ __align__(8) uint64_t s_bar[2 * (ST + SV) + 4];
    __shared__ float s_sink[128 * NC]; /* the late P V wait's stores */
    const uint32_t raw = smem_addr(hp_smem);
    const uint32_t sq0 = raw + ((1024u - (raw & 1023u)) & 1023u); /* Q buffers 0 and 1 */
    const uint32_t sk0 = sq0 + 2 * QB;                            /* K slot i at sk0 + i KVB */
    const uint32_t sv0 = sk0 + ST * KVB;                          /* V slot i at sv0 + i KVB */
    const uint32_t full_k = smem_addr(s_bar);
    const uint32_t full_v = full_k + 8u * ST;
    const uint32_t empty_k = full_v + 8u * SV;
    const uint32_t empty_v = empty_k + 8u * ST;
    const uint32_t full_q = empty_v + 8u * SV;
    const uint32_t empty_q = full_q + 16u;

    const int64_t query_len = a.uniform_query_len;
    /* Every item sees its row's keys (mask none): one seq_len, or each row's own (up to
     * DK_ROW_SEQ_LENS rows) -- row r's items are those from r row_items on (attn_cta_place
     * numbers the rows slowest), so an item's keys follow from its index and the kernel's
     * parameters alone (hp_keys), and the ring's slots, phases and tile addresses stay in
     * uniform registers (the same from a row's seq_len read per item ran 11 % slower: vector
     * registers, an R2UR before every wgmma). */
    const int32_t reach = (int32_t)min((int64_t)INT32_MAX, a.bt_cols * a.block_size);
    const int64_t row_items = a.num_heads * tiles_per_row;
    const int64_t step = gridDim.x;
    const int tid = (int)threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0); /* warp-uniform for ptxas */
    const int lane = tid % 32;

    if (tid == 32) { /* K's and V's maps fetched while the first Q comes in */
        tma_prefetch_map(&tmk);
        tma_prefetch_map(&tmv);
    }
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < ST + SV; i++) { /* full K and V: one expect_tx; empties: 8 warps */
            mbar_init(full_k + 8u * (uint32_t)i, 1u);
            mbar_init(empty_k + 8u * (uint32_t)i, 4u * NC);
        }
        mbar_init(full_q, 1u); /* full and empty Q likewise */
        mbar_init(full_q + 8u, 1u);
        mbar_init(empty_q, 4u * NC);
        mbar_init(empty_q + 8u, 4u * NC);
        mbar_init_fence();
        /* the first item's Q goes out first */
        hp_produce_q(&tmq, hp_place(a, blockIdx.x, tiles_per_row, head_group), 0, sq0, full_q,
                     empty_q);
    }
    __syncthreads();

    if (wg == 0) {
        regs::producer();
        if (tid < 32 * H90_TMA16_WARPS) {
            int32_t base = 0;
            int n = 0;
            for (int64_t i = blockIdx.x; i < items; i += step, n++) {
                const hp_item p = hp_place(a, i, tiles_per_row, head_group);
                if (tid == 0 && n > 0) {
                    hp_produce_q(&tmq, p, n, sq0, full_q, empty_q);
                }
                const int32_t kv_end = hp_keys(a, i, row_items, reach);
                const int32_t n_tiles = (kv_end + BN - 1) / BN;
                h90_produce_tma_groups<D, BN, ST, SV, false, false>(
                    a, p.h, p.row, kv_end, n_tiles, sk0, sv0, full_k, full_v, empty_k, empty_v,
                    &tmk, &tmv, NULL, NULL, hnd, false, 0, base);
                base += n_tiles;
            }
        }
        return;
    }

    /* ---------------- consumers ---------------- */
    regs::consumer();
    const int cw = wg - 1;         /* query rows 64 cw .. 64 cw + 63 of an item */
    const int wt = tid - 128 * wg; /* thread within the warpgroup */
    const int w4 = wt / 32;
    const int g = lane >> 2;
    const int tq = lane & 3;
    const uint32_t sink = smem_addr(&s_sink[tid - 128]);
    constexpr uint32_t khalf = 1024u, ksbo = 1024u * (D / 64); /* K_GROUPS tiles (h90_qk) */

    /* The turns: the last warpgroup opens the first one, for the whole CTA; every tile's
     * Q K^T is one turn. */
    if (cw == NC - 1) {
        named_arrive(8u, 256u);
    }
    int32_t base = 0; /* ring position of the item's first tile */
    int n = 0;        /* items done: Q buffer n & 1 */
    /* the item's placement; the next one's is worked out under a product in flight */
    hp_item cur = hp_place(a, blockIdx.x, tiles_per_row, head_group), next = cur;
    /* whether the item's first S came with the item before's last P V (its Q waited for, and
     * negated for a negative scale, its K slot given back) */
    bool ahead = false;
    float s[NT * 4]; /* S: an item's last one, then (ahead) the next item's first */
    uint32_t pa[BN / 16][4];
    for (int64_t i = blockIdx.x; i < items; i += step, n++) {
        const uint32_t sq = sq0 + (uint32_t)(n & 1) * QB;
        if (!ahead) { /* this item's Q, negated for a negative scale */
            mbar_wait(full_q + 8u * (uint32_t)(n & 1), (uint32_t)((n >> 1) & 1));
            if (neg_q) {
                h90_negate_q<D, BM, 128, 64>(sq, wt, cw * 64);
                fence_proxy_async();
                named_barrier(1u + (uint32_t)cw, 128u);
            }
        }

        float o[D / 2];
#pragma unroll
        for (int k = 0; k < D / 2; k++) {
            o[k] = 0.0f;
        }
        float m[2] = {-INFINITY, -INFINITY};
        float l[2] = {0.0f, 0.0f};
        h90_rows rows;
        rows.q_slab = sq + (uint32_t)cw * 64u * 128u;
        const int32_t kv_end = hp_keys(a, i, row_items, reach);
        const int32_t n_tiles = (kv_end + BN - 1) / BN;
        const int32_t valid = kv_end - (n_tiles - 1) * BN; /* keys of the last tile */
        const int64_t r0 = cur.q0 + cw * 64 + w4 * 16 + g; /* this thread's rows r0, r0 + 8 */
        rows.lim0 = r0 < query_len ? kv_end : 0;
        rows.lim1 = r0 + 8 < query_len ? kv_end : 0;
        rows.g_min = cur.q0 + cw * 64 + 63 < query_len ? kv_end : 0; /* the warpgroup's least */
        rows.tq = tq;
        rows.scale_log2 = scale_log2;
        const bool was_ahead = ahead;
        ahead = false;

        if (n_tiles > 0) {
            for (int32_t kt = 0; kt < n_tiles; kt++) {
                const int32_t j0 = kt * BN;
                const int32_t pos = base + kt;
                const uint32_t slot = (uint32_t)(pos % ST);
                float alpha[2];
                if (kt == 0) {
                    if (!was_ahead) {
                        mbar_wait(full_k + 8u * slot, (uint32_t)((pos / ST) & 1)); /* K_0 */
                        named_barrier(8u + (uint32_t)cw, 256u);
                        h90_qk<T, D, BN, BM>(s, rows.q_slab, sk0 + slot * KVB, khalf, ksbo);
                        wgmma_commit();
                        named_arrive(8u + (uint32_t)((cw + 1) % NC), 256u);
                        if (i + step < items) {
                            next = hp_place(a, i + step, tiles_per_row, head_group);
                        }
                        if (n > 0) { /* the item before's buffer, its stores issued long ago */
                            hp_release_q(empty_q, (uint32_t)((n + 1) & 1), wt);
                        }
                        wgmma_wait_all();
                        fence_regs(s);
                        if (lane == 0) {
                            mbar_arrive(empty_k + 8u * slot);
                        }
                    }
                    h90_softmax<NT, true>(s, m, l, alpha, j0, rows);
                    if (was_ahead) { /* the item before's buffer, its stores issued before */
                        hp_release_q(empty_q, (uint32_t)((n + 1) & 1), wt);
                    }
                }
                else {
                    const uint32_t pslot = (uint32_t)((pos - 1) % SV);
                    /* K_kt landed, V_kt-1 */
                    mbar_wait2(full_k + 8u * slot, (uint32_t)((pos / ST) & 1), full_v + 8u * pslot,
                               (uint32_t)(((pos - 1) / SV) & 1));
                    named_barrier(8u + (uint32_t)cw, 256u);
                    h90_qk<T, D, BN, BM>(s, rows.q_slab, sk0 + slot * KVB, khalf, ksbo);
                    wgmma_commit();
                    h90_pv<T, D, BN, true, D / 64>(o, pa, sv0 + pslot * KVB);
                    wgmma_commit();
                    named_arrive(8u + (uint32_t)((cw + 1) % NC), 256u);
                    wgmma_wait_1(); /* S_kt done; P_{kt-1} V_{kt-1} may still run */
                    fence_regs(s);
                    if (lane == 0) {
                        mbar_arrive(empty_k + 8u * slot);
                    }
                    const bool rescale = h90_softmax<NT, true>(s, m, l, alpha, j0, rows);
                    /* the late P V wait (attention_sm90_ws.cu, LATE_PV_WAIT) */
                    st_shared_f32(sink, l[0] + l[1]);
                    wgmma_wait_all();
                    fence_regs(o);
                    if (lane == 0) {
                        mbar_arrive(empty_v + 8u * pslot);
                    }
                    if (rescale) {
                        h90_rescale_o<DT>(o, alpha);
                    }
                }
                h90_pack_p<T, BN>(pa, s);
            }
            /* The last tile's V: rows past kv_end become zeros (stale or unwritten data, 0 * nan
             * = nan; by both warpgroups: the same values), then P V, then the slot goes back to
             * the producer. */
            const int32_t lpos = base + n_tiles - 1;
            const uint32_t lslot = (uint32_t)(lpos % SV);
            const uint32_t sv = sv0 + lslot * KVB;
            mbar_wait(full_v + 8u * lslot, (uint32_t)((lpos / SV) & 1));
            if (valid < BN) {
                for (int k = valid * (D / 8) + wt; k < BN * (D / 8); k += 128) {
                    const uint32_t r = (uint32_t)(k / (D / 8)), c = (uint32_t)(k % (D / 8));
                    st_shared16(sv + (r / 8u) * (1024u * (D / 64)) + (c / 8u) * 1024u +
                                    (r % 8u) * 128u + ((c % 8u) ^ (r % 8u)) * 16u,
                                make_uint4(0u, 0u, 0u, 0u));
                }
                fence_proxy_async();
                named_barrier(1u + (uint32_t)cw, 128u);
            }
            /* The next item's first Q K^T goes with this last P V (one turn), so that it runs
             * under this item's epilogue: its Q (negated here for a negative scale) and its
             * first K tile waited for first. */
            const int64_t ni = i + step;
            ahead = ni < items && hp_keys(a, ni, row_items, reach) > 0;
            const uint32_t nsq = sq0 + (uint32_t)((n + 1) & 1) * QB;
            const int32_t npos = base + n_tiles;
            const uint32_t nslot = (uint32_t)(npos % ST);
            if (ahead) {
                mbar_wait2(full_q + 8u * (uint32_t)((n + 1) & 1), (uint32_t)(((n + 1) >> 1) & 1),
                           full_k + 8u * nslot, (uint32_t)((npos / ST) & 1));
                if (neg_q) {
                    h90_negate_q<D, BM, 128, 64>(nsq, wt, cw * 64);
                    fence_proxy_async();
                    named_barrier(1u + (uint32_t)cw, 128u);
                }
                named_barrier(8u + (uint32_t)cw, 256u);
            }
            fence_regs(o);
            wgmma_fence();
            h90_pv<T, D, BN, true, D / 64>(o, pa, sv);
            wgmma_commit();
            /* (each branch waits for all it issued: ptxas serializes every wgmma of the kernel
             * when one may be in flight past a join) */
            if (ahead) {
                h90_qk<T, D, BN, BM>(s, nsq + (uint32_t)cw * 64u * 128u, sk0 + nslot * KVB, khalf,
                                     ksbo);
                wgmma_commit();
                named_arrive(8u + (uint32_t)((cw + 1) % NC), 256u);
                if (was_ahead) { /* placed under this product, as under the first Q K^T */
                    next = hp_place(a, ni, tiles_per_row, head_group);
                }
                wgmma_wait_1(); /* this item's P V done; the next item's S may still run */
                fence_regs(o);
                if (lane == 0) {
                    mbar_arrive(empty_v + 8u * lslot);
                }
                /* the epilogue under the next item's first Q K^T */
                hp_store_o<T>(a, &tmo, sq, cw, wt, cur, query_len, l, m, scale_log2, o);
                wgmma_wait_all();
                fence_regs(s);
                if (lane == 0) {
                    mbar_arrive(empty_k + 8u * nslot);
                }
                cur = next;
            }
            else {
                wgmma_wait_all();
                fence_regs(o);
                if (lane == 0) {
                    mbar_arrive(empty_v + 8u * lslot);
                }
                hp_store_o<T>(a, &tmo, sq, cw, wt, cur, query_len, l, m, scale_log2, o);
                cur = was_ahead ? hp_place(a, ni, tiles_per_row, head_group) : next;
            }
        }
        else {
            if (n > 0) {
                hp_release_q(empty_q, (uint32_t)((n + 1) & 1), wt);
            }
            hp_store_o<T>(a, &tmo, sq, cw, wt, cur, query_len, l, m, scale_log2, o);
            cur = hp_place(a, i + step, tiles_per_row, head_group);
        }
        base += n_tiles;
    }
    if (wt == 0) {
        tma_store_wait(); /* the last item's stores read their rows before the CTA ends */
    }
    if (cw == 0) {
        named_barrier(8u, 256u); /* the last turn's hand-over back to warpgroup 0 */
    }
#else
    (void)tmk;
    (void)tmv;
    (void)tmo;
    (void)a;
    (void)items;
    (void)tiles_per_row;
    (void)head_group;
    (void)tmq;
    (void)scale_log2;
    (void)neg_q;
    (void)hnd;
    __trap();
#endif
}

/* Launches the kernel for dtype T over as few CTAs as take the items in cdiv(items, SMs)
 * rounds (attn_sm90_persist_launch's contract).  The shared-memory attribute is set once per
 * (dtype, device). */
template <typename T>
static cudaError_t
hp_launch(const dk_attention_args *a, const h90_maps &m, const CUtensorMap &q, const CUtensorMap &o,
          int64_t head_group, float scale_log2, bool neg_q, int64_t sms, cudaStream_t s)
{
    static volatile bool attr_set[ATTN_MAX_DEVICES];
    /* two Q buffers, ST K and SV V slots, alignment slack */
    const size_t smem =
        (size_t)2 * HP_BM * HP_D * 2 + (size_t)(HP_ST + HP_SV) * HP_BN * HP_D * 2 + 1024;
    const void *kernel = (const void *)attention_sm90_persist_kernel<T>;
    const cudaError_t e = attn_allow_smem(kernel, smem, attr_set);
    if (e != cudaSuccess) {
        return e;
    }
    int64_t tiles_per_row = dk_cdiv(a->uniform_query_len, HP_BM);
    int64_t items = attn_persist_items(a);
    /* as few CTAs as take the items in the same number of rounds (128, not 132, for 512-2048
     * items on an H200): the same makespan in items, every CTA as many, the SMs left idle
     * instead of idling at the end (0.3-1.5 % faster at 2-4k tokens, docs/hopper-kernels.md) */
    const int64_t rounds = items > 0 ? dk_cdiv(items, sms) : 1;
    const unsigned blocks = (unsigned)dk_cdiv(items, rounds);
    bool hnd = m.dims.k_groups == 2;
    void *args[] = {(void *)&m.k,   (void *)&m.v, (void *)&q,  (void *)&o, (void *)a, &items,
                    &tiles_per_row, &head_group,  &scale_log2, &neg_q,     &hnd};
    return dk_launch_after(a->pending, kernel, dim3(blocks), dim3(128 * (HP_NC + 1)), smem, s,
                           args);
}

/* attention_internal.cuh's contract. */
cudaError_t
attn_sm90_persist_launch(const dk_attention_args *a, const h90_maps &m, const CUtensorMap &q,
                         const CUtensorMap &o, int64_t head_group, float scale_log2, bool neg_q,
                         int64_t sms, cudaStream_t s)
{
    return a->dtype == DK_BF16
               ? hp_launch<__nv_bfloat16>(a, m, q, o, head_group, scale_log2, neg_q, sms, s)
               : hp_launch<__half>(a, m, q, o, head_group, scale_log2, neg_q, sms, s);
}
