/*
 * attention_sm90_ws.cu -- the warp-specialized Hopper (sm_90a) paged attention kernel
 * ("sm90-tma16", "sm90-tma", "sm90-ws": the name says which producer fed it), head 64 or 128,
 * K/V rows in 16-byte chunks: the per-warpgroup wgmma pipeline of attention_sm90.cu, fed by a
 * producer warpgroup.  Also head 256 (80-key tiles -- 64 where the cache's blocks are not a
 * power of two of 16+ keys --, two consumer warpgroups of 224 registers: O 128 per thread, S 40,
 * P 20; two K and two V slots, 224 KB of tiles), head 192 in rows of three 64-dim panels
 * (112-key tiles, FlashAttention-3's choice there: O 96 registers per thread, S 56, P 28; two
 * K and two V slots, 216 KB of tiles with Q) -- both fed by the per-chunk TMA producer where
 * the cache's maps fold it, by cp.async otherwise -- and, padded to 64, 128 or 192 dims with
 * zeros past the head size (the template's DR), heads 32, 72, 80, 96 and 160, whose products
 * skip what they can of the zeros (KD, NP); these take the cp.async producers only.  72 to 96
 * run three consumer warpgroups over 112-key tiles (FlashAttention-3 takes 192 query rows below
 * 128 dims too): their softmax, as long as head 128's, has the products of two other
 * warpgroups to hide under.
 *
 * NC + 1 warpgroups, 1 CTA per SM: warpgroup 0 is the producer (setmaxnreg leaves it 56
 * registers with NC = 2, 32 with 3, 24 where it only issues TMA), warpgroups 1 .. NC the
 * consumers (224, 240 or 160 registers)
 * with query rows 64 (w - 1) ...  Key tiles of BN = 128 keys, or 176 for head-128 calls over
 * long rows fed by TMA (producer 24 registers, consumers 240: a tile's fixed costs spread over
 * 37 % more keys).  K has ST slots and V SV, each with a "full" mbarrier and an "empty" one (one
 * arrive per consumer warp): H90T_STAGES of each at head 128, one V slot more with 128-key
 * tiles, one more of each at head 64.  Producers:
 *   - TMA boxes (in this file): one warp brings a key tile in as TMA boxes of the cache's
 *     tensor map, one box per (cache block, 64-dim half) -- BN / block_size blocks per tile, or
 *     a BN-key slice of one larger block -- each landing 1024-byte aligned, so the TMA's
 *     128-byte swizzle is the layout wgmma reads; the full barrier waits for the warp's
 *     arrive.expect_tx and the bytes.  Only blocks that start before the CTA's last visible key
 *     are fetched.  A flat cache (block stride = block_size * token stride: vLLM's NHD layout)
 *     also has a map over its num_blocks * block_size token rows, and a tile whose blocks are
 *     consecutive ids (a cache filled in allocation order) comes in from it as one BN-row box
 *     per half: the TMA unit's box rate, not bandwidth, is what makes small boxes slow.
 *   - cp.async rows (sm90_producers.cuh): h90_produce_cp_async_groups for power-of-two blocks
 *     of 16+ keys, h90_produce_cp_async otherwise; the full barrier counts the 128 threads'
 *     cp.async arrivals, and the consumers fence the generic-proxy writes for wgmma after
 *     waiting.
 *   - TMA per 16-key chunk (sm90_producers.cuh, h90_produce_tma_groups; dims.k_groups, the
 *     kernel's VG): K and V tiles land as 8-row groups of both panels (h90_qk's K_GROUPS
 *     layout, h90_pv's VG).  The host takes it for every cache whose per-chunk maps it can
 *     encode (attention.cu).
 * Which producer serves which cache is decided on the host (attention.cu, sm90_tma_map.cu).
 * On the last tile the consumers zero the V rows past the last visible key (stale or unwritten
 * data, 0 * nan = nan) and the mask drops the K rows.  Consumers release a K slot as soon as
 * S = Q K^T is done and a V slot when P V is, so the producer refills K one softmax before V
 * (head 128 itself: P V is waited for after the next tile's softmax, LATE_PV_WAIT; with 176-key
 * tiles the TMA producer then issues K of a tile before V of the tile before, K_AHEAD).
 * No CTA-wide barrier inside the key loop.
 * A CTA's fixed costs were cut where they were serial: the consumers issue their Q rows right
 * after the CTA's place is known (not after the key limits' barrier), the per-chunk producer
 * loads its tile-0 block-table entry at the start, the output tile's place stays in registers
 * (not reloaded from global memory at the end), and 16-byte aligned output rows are written
 * through shared memory with 16-byte stores (h90_store_o_staged) instead of 4 bytes per thread
 * and row from the accumulators.
 *
 * Entry point (attention_internal.cuh): attn_sm90_ws_launch.
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

#define H90T_STAGES 2

/* Whether h90_produce_cp_async_groups serves a cache of this block size: a power of two of 16+
 * keys, so that no 16-key group of a tile straddles two blocks (the kernel's producer branch
 * makes the same test; the launcher gives such caches the head-256 form's 80-key tiles).
 * Cannot fail. */
static bool
h90_group_blocks(int64_t block_size)
{
    return block_size >= 16 && (block_size & (block_size - 1)) == 0;
}

/* VG: a cache cut into 16-key chunks (dims.k_groups): tmk and tmv are the per-chunk 5-d maps,
 * h90_produce_tma_groups fills the K and V slots, both in the K_GROUPS layout.  DR < D: a padded
 * head size -- the call's head dims DR, the tiles' D (64, 128 or 192), dims DR .. D - 1 zeros in
 * Q, K and V (zeroed once in every K and V slot: the cp.async producers, the only ones such a
 * call takes, never copy them), skipped by the products where wgmma's shapes allow (KD, NP
 * below) and not written out. */
template <typename T, int ST, int D, int NC, int SV, int BN, int VG = 0, int DR = D>
/* clang-format off */
static __global__ void __launch_bounds__(128 * (NC + 1), 1)
attention_sm90_ws_kernel(const __grid_constant__ CUtensorMap tmk,
                          const __grid_constant__ CUtensorMap tmv,
                          const __grid_constant__ CUtensorMap tfk,
                          const __grid_constant__ CUtensorMap tfv,
                          const __grid_constant__ CUtensorMap tfk2,
                          const __grid_constant__ CUtensorMap tfv2, const dk_attention_args a,
                          h90_tma_dims dims, int64_t tiles_per_row, int64_t head_group,
                          float scale_log2, bool neg_q, bool q_vec, bool o_vec, bool o16,
                          bool sort_rows)
/* clang-format on */
{
#ifdef H90_DEVICE_CODE
    constexpr int BM = 64 * NC; /* query rows per CTA */
    /* Whether a tile's softmax overlaps the warpgroup's own P V of the tile before (the wait for
     * it after the softmax, where the source puts it, kept there by the store below): the
     * V slot is then released a softmax later, so this goes with a third V slot (head 128,
     * 128-key tiles) or, where a third does not fit (176-key tiles, the 192- and 256-dim
     * forms), with K_AHEAD in the TMA producers; the split group producer copies K before V
     * anyway.  Head 192 gained 9 % (cp.async) and 10-11 % (per-chunk TMA) with it, head 256
     * fed by TMA 6-8 %.  Head 64 (three slots of each, three consumer warpgroups), the padded
     * head-128 forms (72 to 96 dims) and head 256 fed by cp.async keep ptxas's early wait: the
     * late one measured slower or no faster there; head 160 too (3-8 % slower in its earlier
     * 256-dim form, not measured in this one; head-sizes.md). */
    constexpr bool LATE_PV_WAIT = (D == 128 && DR == D && (SV > ST || BN == 176)) ||
                                  (D == 192 && DR == D) || (D == 256 && VG != 0);
    /* The TMA producer's order with as many V slots as K and the late wait: K of tile kt
     * before V of tile kt - 1, which a consumer needs a tile later (its P V is issued with the
     * next tile's Q K^T) and whose slot frees a softmax later -- waiting for that slot first
     * holds the K load back behind it. */
    constexpr bool K_AHEAD = LATE_PV_WAIT && SV == ST;
    static_assert(BN == 128 || (BN == 176 && D == 128 && NC == 2) ||
                      ((BN == 64 || BN == 80) && D == 256) ||
                      (BN == 112 && (D == 192 || (D == 128 && DR < D && NC == 3))),
                  "key tile");
    static_assert(D < 192 || (NC == 2 && VG <= 1 && (D == 192 || DR == D)),
                  "the 192- and 256-dim forms: two consumer warpgroups, per-chunk or cp.async "
                  "producers");
    static_assert(DR == D || (VG == 0 && BN != 176 && DR % 8 == 0 && DR < D), "padded head");
    /* the TMA producers (one warp; per-chunk boxes: four) run in 24 registers, the cp.async
     * ones need 56 */
    constexpr bool TMA_ONLY = BN == 176 || (VG != 0 && D >= 192);
    constexpr int PRODUCER_REGS = NC == 3 ? 32 : (TMA_ONLY ? 24 : 56);
    constexpr int CONSUMER_REGS = NC == 3 ? 160 : (TMA_ONLY ? 240 : 224);
    using regs = h90_ws_regs<PRODUCER_REGS, CONSUMER_REGS, NC>;
    constexpr int NT = BN / 8;
    /* A padded head size's products skip what they can of the zero dims: S = Q K^T sums over
     * its dims rounded up to the 16-dim k-step (KD), P V computes its NP = DR dims of O
     * (wgmma's N, a multiple of 8: the last 64-dim panel of V read in part). */
    constexpr int KD = (DR + 15) / 16 * 16;
    constexpr int NP = DR;
    constexpr int DT = NP / 8;
    constexpr uint32_t QB = BM * D * 2;
    constexpr uint32_t KVB = BN * D * 2;

    extern __shared__ uint4 h90_smem[];
    __shared__ int32_t s_lim[BM];
    __shared__ int32_t s_wmax[BM / 32], s_wmin[BM / 32];
    __shared__ int32_t s_row;
    /* full K[ST], full V[SV], empty K[ST], empty V[SV] */
    __shared__ __align__(8) uint64_t s_bar[2 * (ST + SV)];
    __shared__ float s_sink[LATE_PV_WAIT ? 128 * NC : 1]; /* LATE_PV_WAIT's stores */
    const uint32_t raw = smem_addr(h90_smem);
    const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
    const uint32_t sq = raw + pad;       /* Q tile */
    const uint32_t sk0 = sq + QB;        /* K slot i at sk0 + i KVB */
    const uint32_t sv0 = sk0 + ST * KVB; /* V slot i at sv0 + i KVB */
    const uint32_t full_k = smem_addr(s_bar);
    const uint32_t full_v = full_k + 8u * ST;
    const uint32_t empty_k = full_v + 8u * SV;
    const uint32_t empty_v = empty_k + 8u * ST;

    /* The per-chunk producer's first block-table entry (its chunk of key tile 0), loaded before
     * anything else: its row comes from blockIdx alone (unless rows are sorted by length), so
     * the load runs alongside attn_cta_begin's instead of after the row's key limits. */
    int32_t first_blk = 0;
    bool first_ok = false;
    if constexpr (VG != 0) {
        const int32_t chunk =
            (int32_t)(threadIdx.x >> 5) + H90_TMA16_WARPS * (int32_t)(threadIdx.x & 31u);
        if (!sort_rows && threadIdx.x < 32 * H90_TMA16_WARPS && chunk < BN / 16) {
            int64_t ph, prow, ptile;
            attn_cta_place(a, blockIdx.x, tiles_per_row, head_group, false, NULL, &ph, &prow,
                           &ptile);
            const int64_t col = (int64_t)(16 * chunk) / a.block_size;
            if (col < a.bt_cols) {
                first_blk = a.block_table[prow * a.bt_stride_row + col];
                first_ok = true;
            }
        }
    }
    attn_cta cta;
    if (!attn_cta_begin(a, tiles_per_row, head_group, sort_rows, BM, &s_row, &cta)) {
        return;
    }
    const int64_t h = cta.h, row = cta.row, q0 = cta.q0;
    const int64_t q_start = cta.q_start, query_len = cta.query_len, seq_len = cta.seq_len;
    const int tid = (int)threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0); /* warp-uniform for ptxas */
    const int lane = tid % 32;

    /* Each consumer warpgroup's 64 Q rows (zeros past the row's end) go out first: they need
     * only the CTA's place, and until now they were issued after the key limits' barrier, on
     * every CTA's path to its first tile. */
    if (wg > 0) {
        h90_load_q<D, BM, 128, 64, DR>(a, sq, tid - 128 * wg, (wg - 1) * 64, q0, q_start, query_len,
                                       h, q_vec);
    }

    /* Key limits of the BM query rows (threads 0 .. BM - 1), barriers. */
    if (tid < BM) {
        attn_warp_limits(a, tid, lane, q0, q_start, query_len, seq_len, s_lim, s_wmax, s_wmin);
        if (tid == 0) {
#pragma unroll
            for (int i = 0; i < ST + SV; i++) { /* full K and V, then empty K and V */
                /* the TMA producer's one expect_tx, or each producer thread's cp.async */
                const bool tma = dims.box > 0 || VG;
                mbar_init(full_k + 8u * (uint32_t)i, tma ? 1u : 128u);
                mbar_init(empty_k + 8u * (uint32_t)i, 4u * NC); /* the consumers' warps */
            }
            mbar_init_fence();
        }
    }
    if constexpr (DR < D) {
        /* the padded dims of every K and V slot (V's follow K's), before any tile lands */
        constexpr int PC = (D - DR) / 8; /* padded 16-byte chunks per key row */
        for (int i = tid; i < (ST + SV) * BN * PC; i += 128 * (NC + 1)) {
            const int slot = i / (BN * PC), r = i / PC % BN, c = DR / 8 + i % PC;
            st_shared16(sk0 + (uint32_t)slot * KVB + sw128(BN, (uint32_t)r, (uint32_t)c),
                        make_uint4(0u, 0u, 0u, 0u));
        }
        fence_proxy_async(); /* generic-proxy zeros, for wgmma */
    }
    __syncthreads();
    const int32_t kv_end = attn_kv_end<BM>(s_wmax);
    const int32_t n_tiles = (kv_end + BN - 1) / BN;

    if (wg == 0) {
        regs::producer();
        if constexpr (VG != 0) {
            if (tid < 32 * H90_TMA16_WARPS) {
                h90_produce_tma_groups<D, BN, ST, SV, K_AHEAD, VG == 2>(
                    a, h, row, kv_end, n_tiles, sk0, sv0, full_k, full_v, empty_k, empty_v, &tmk,
                    &tmv, &tfk2, &tfv2, dims.k_groups == 2, first_ok, first_blk);
            }
            return;
        }
        if constexpr (BN == 176) { /* the host gives 176-key tiles TMA boxes only */
            if (dims.box == 0) {
                __trap();
            }
        }
        else if (dims.box == 0) {
            /* ---------------- producer: 128 threads of cp.async ---------------- */
            /* h90_group_blocks's test, written out: calling it here reorders the kernel's code
             * (cuobjdump), a change not measured on the GPU yet */
            if (a.block_size >= 16 && (a.block_size & (a.block_size - 1)) == 0) {
                if (a.key_cache2 != NULL) {
                    h90_produce_cp_async_groups<D, BN, ST, SV, true, DR, D >= 192>(
                        a, h, row, kv_end, n_tiles, sk0, sv0, full_k, full_v, empty_k, empty_v);
                }
                else {
                    h90_produce_cp_async_groups<D, BN, ST, SV, false, DR, D >= 192>(
                        a, h, row, kv_end, n_tiles, sk0, sv0, full_k, full_v, empty_k, empty_v);
                }
            }
            else if constexpr (BN == 80) { /* the host gives 80-key tiles the group producer
                                            * only: the per-row producer's row table does not
                                            * fit beside them */
                __trap();
            }
            else {
                h90_produce_cp_async<D, BN, ST, SV, DR>(a, h, row, kv_end, n_tiles, sk0, sv0,
                                                        full_k, full_v, empty_k, empty_v);
            }
            return;
        }
        /* ---------------- producer: warp 0 of TMA ---------------- */
        if (tid >= 32) {
            return;
        }
        if constexpr (DR < D || D >= 192) { /* the host gives these cp.async producers only */
            __trap();
        }
        const int32_t bs = (int32_t)a.block_size;
        const int32_t box = dims.box;                    /* keys per box */
        const int32_t pages = BN / box;                  /* boxes per tile and half */
        const uint32_t box_bytes = (uint32_t)box * 128u; /* one half (64 dims) */
        const int32_t kvh = (int32_t)(h / (a.num_heads / a.num_kv_heads));
        const int32_t *bt = a.block_table + row * a.bt_stride_row;
        constexpr int HALVES = D / 64;      /* 64-dim panels per key row */
        const int32_t p = lane / HALVES;    /* this lane's block within the tile ... */
        const int32_t half = lane % HALVES; /* ... and 64-dim half */
        /* K (kv 0) and/or V (kv 1) of tile kt: [kv0, kv1) */
        auto load = [&](const int32_t kt, const int kv0, const int kv1) {
            const int32_t j0 = kt * BN;
            const int32_t jp = j0 + p * box; /* first key of the lane's box */
            const bool mine = p < pages && jp < kv_end;
            int32_t blk = 0;
            if (mine) {
                blk = dk_safe_block(a, bt[jp / bs]);
            }
            /* consecutive blocks in a flat cache: one BN-row box per half from the flat map */
            const int32_t blk0 = __shfl_sync(0xffffffffu, blk, 0);
            const bool run =
                dims.flat != 0 &&
                (dims.flat_only != 0 || __all_sync(0xffffffffu, !mine || blk == blk0 + p) != 0);
            const int32_t tok = jp % bs;
            const int32_t c1 = dims.token == 1 ? tok : dims.head == 1 ? kvh : blk;
            const int32_t c2 = dims.token == 2 ? tok : dims.head == 2 ? kvh : blk;
            const int32_t c3 = dims.token == 3 ? tok : dims.head == 3 ? kvh : blk;
            const int32_t boxes = min(pages, (kv_end - j0 + box - 1) / box);
            const uint32_t bytes =
                run ? (uint32_t)(HALVES * BN) * 128u : (uint32_t)(boxes * HALVES) * box_bytes;
            /* flat map coordinates: blk0's source (the second from block blocks2 on) and row */
            const bool second = a.key_cache2 != NULL && blk0 >= a.blocks2;
            const int32_t frow = (second ? blk0 - (int32_t)a.blocks2 : blk0) * bs;
            const int32_t f1 = dims.flat == 1 ? frow : kvh;
            const int32_t f2 = dims.flat == 1 ? kvh : frow;
            const uint32_t off = (uint32_t)half * (BN * 128u) + (uint32_t)p * box_bytes;
#pragma unroll
            for (int kv = kv0; kv < kv1; kv++) {
                const int stages = kv == 0 ? ST : SV;
                const uint32_t slot = (uint32_t)(kt % stages);
                const uint32_t full = (kv == 0 ? full_k : full_v) + 8u * slot;
                if (kt >= stages) { /* the phase the slot's last use ended */
                    mbar_wait((kv == 0 ? empty_k : empty_v) + 8u * slot,
                              (uint32_t)((kt / stages - 1) & 1));
                }
                if (lane == 0) {
                    mbar_arrive_expect_tx(full, bytes);
                }
                __syncwarp();
                if (run) {
                    if (p == 0) {
                        tma_load_3d((kv == 0 ? sk0 : sv0) + slot * KVB + off,
                                    kv == 0 ? (second ? &tfk2 : &tfk) : (second ? &tfv2 : &tfv),
                                    full, half * 64, f1, f2);
                    }
                }
                else if (mine) {
                    tma_load_4d((kv == 0 ? sk0 : sv0) + slot * KVB + off, kv == 0 ? &tmk : &tmv,
                                full, half * 64, c1, c2, c3);
                }
            }
        };
        if constexpr (K_AHEAD) {
            for (int32_t kt = 0; kt <= n_tiles; kt++) {
                if (kt < n_tiles) {
                    load(kt, 0, 1);
                }
                if (kt > 0) {
                    load(kt - 1, 1, 2);
                }
            }
        }
        else {
            for (int32_t kt = 0; kt < n_tiles; kt++) {
                load(kt, 0, 2);
            }
        }
        return;
    }

    /* ---------------- consumers ---------------- */
    regs::consumer();
    const int cw = wg - 1;         /* query rows 64 cw .. 64 cw + 63 */
    const int wt = tid - 128 * wg; /* thread within the warpgroup */
    const int w4 = wt / 32;
    const int g = lane >> 2;
    const int tq = lane & 3;
    const uint32_t sink = smem_addr(&s_sink[LATE_PV_WAIT ? tid - 128 : 0]);
    /* K tiles' layout (h90_qk) */
    constexpr uint32_t khalf = VG ? 1024u : BN * 128u;
    constexpr uint32_t ksbo = VG ? 1024u * (D / 64) : 1024u;

    /* This warpgroup's 64 Q rows (issued above), negated for a negative scale. */
    cp_async_wait_all();
    if (neg_q) {
        h90_negate_q<D, BM, 128, 64>(sq, wt, cw * 64);
    }
    fence_proxy_async();
    named_barrier(1u + (uint32_t)cw, 128u);

    float o[NP / 2];
#pragma unroll
    for (int i = 0; i < NP / 2; i++) {
        o[i] = 0.0f;
    }
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.0f, 0.0f};
    uint32_t pa[BN / 16][4];
    float s[NT * 4];
    h90_rows rows;
    rows.q_slab = sq + (uint32_t)cw * 64u * 128u;
    rows.lim0 = s_lim[cw * 64 + w4 * 16 + g];
    rows.lim1 = s_lim[cw * 64 + w4 * 16 + 8 + g];
    rows.g_min = min(s_wmin[2 * cw], s_wmin[2 * cw + 1]);
    rows.tq = tq;
    rows.scale_log2 = scale_log2;
    /* S = Q K^T of the K slot at sk (no commit) */
    auto issue_qk = [&](uint32_t sk) { h90_qk<T, KD, BN, BM>(s, rows.q_slab, sk, khalf, ksbo); };
    /* O's rescale is skipped on tiles where no row of the warp raised its max (h90_softmax
     * SKIP; bit-identical: alpha is exp2(0) = 1 exactly there).  The lossy lazy form, which
     * rescales only when a max grows by 2^8, lost accuracy on growing scores. */

    if (n_tiles > 0) {
        /* Ping-pong (FlashAttention-3's inter-warpgroup schedule): the consumer warpgroups take
         * turns issuing a tile's GEMMs, 0, 1, .., NC - 1, 0, ..  (named barrier 8 + cw: this
         * warpgroup's 128 threads wait, the previous warpgroup's 128 arrive), so that one
         * warpgroup's softmax runs while the others' GEMMs do rather than all warpgroups
         * contending for the tensor cores at once; the last warpgroup opens the first turn. */
        if (cw == NC - 1) {
            named_arrive(8u, 256u);
        }
        for (int32_t kt = 0; kt < n_tiles; kt++) {
            const int32_t j0 = kt * BN;
            const uint32_t slot = (uint32_t)(kt % ST);
            float alpha[2];
            if (kt == 0) {
                mbar_wait(full_k + 8u * slot, (uint32_t)((kt / ST) & 1)); /* K_kt landed */
                if (!VG && dims.box == 0) {
                    fence_proxy_async(); /* cp.async (generic proxy) writes, for wgmma */
                }
                named_barrier(8u + (uint32_t)cw, 256u);
                issue_qk(sk0);
                wgmma_commit();
                named_arrive(8u + (uint32_t)((cw + 1) % NC), 256u);
                wgmma_wait_all();
                fence_regs(s);
                if (lane == 0) {
                    mbar_arrive(empty_k + 8u * slot);
                }
                h90_softmax<NT, true>(s, m, l, alpha, j0, rows);
            }
            else {
                const uint32_t pslot = (uint32_t)((kt - 1) % SV);
                /* K_kt landed, V_{kt-1}: both tests issued before either is waited on */
                mbar_wait2(full_k + 8u * slot, (uint32_t)((kt / ST) & 1), full_v + 8u * pslot,
                           (uint32_t)(((kt - 1) / SV) & 1));
                if (!VG && dims.box == 0) {
                    fence_proxy_async(); /* cp.async (generic proxy) writes, for wgmma */
                }
                named_barrier(8u + (uint32_t)cw, 256u);
                issue_qk(sk0 + slot * KVB);
                wgmma_commit();
                h90_pv<T, NP, BN, VG != 0, D / 64>(o, pa, sv0 + pslot * KVB);
                wgmma_commit();
                named_arrive(8u + (uint32_t)((cw + 1) % NC), 256u);
                wgmma_wait_1(); /* S_kt done; P_{kt-1} V_{kt-1} may still run */
                fence_regs(s);
                if (lane == 0) {
                    mbar_arrive(empty_k + 8u * slot);
                }
                const bool rescale = h90_softmax<NT, true>(s, m, l, alpha, j0, rows);
                if constexpr (LATE_PV_WAIT) {
                    /* ptxas schedules a wait_group as early as its basic block allows -- above
                     * the softmax (WARPGROUP.DEPBAR 0 before the first MUFU.EX2), which then no
                     * longer overlaps this P V -- unless a memory access that needs the
                     * softmax's results comes before it: this thread's row sums, stored to a
                     * word nothing reads.  (Two copies of the wait in the arms of the rescale
                     * branch kept it in place too, but warps of one warpgroup can take
                     * different arms, and wgmma.wait_group is .aligned: compute-sanitizer
                     * synccheck flags the mismatched pcs.) */
                    st_shared_f32(sink, l[0] + l[1]);
                }
                wgmma_wait_all();
                fence_regs(o);
                if (lane == 0) {
                    mbar_arrive(empty_v + 8u * pslot);
                }
                if (rescale) { /* head 128: skipped while the warp's rows keep their max */
                    h90_rescale_o<DT>(o, alpha);
                }
            }
            h90_pack_p<T, BN>(pa, s);
        }
        if (cw == 0) {
            named_barrier(8u, 256u); /* the last turn's hand-over back to warpgroup 0 */
        }
        /* The last tile's V: rows past kv_end become zeros (by both warpgroups: the same
         * values), then P V. */
        const uint32_t lslot = (uint32_t)((n_tiles - 1) % SV);
        const uint32_t sv = sv0 + lslot * KVB;
        mbar_wait(full_v + 8u * lslot, (uint32_t)(((n_tiles - 1) / SV) & 1));
        const int32_t valid = kv_end - (n_tiles - 1) * BN;
        for (int i = valid * (D / 8) + wt; i < BN * (D / 8); i += 128) {
            const uint32_t r = (uint32_t)(i / (D / 8)), c = (uint32_t)(i % (D / 8));
            if constexpr (VG != 0) { /* K_GROUPS: [8-row group][64-dim panel][8 rows x 128 B] */
                st_shared16(sv + (r / 8u) * (1024u * (D / 64)) + (c / 8u) * 1024u +
                                (r % 8u) * 128u + ((c % 8u) ^ (r % 8u)) * 16u,
                            make_uint4(0u, 0u, 0u, 0u));
            }
            else {
                st_shared16(sv + sw128(BN, r, c), make_uint4(0u, 0u, 0u, 0u));
            }
        }
        fence_proxy_async();
        named_barrier(1u + (uint32_t)cw, 128u);
        fence_regs(o);
        wgmma_fence();
        h90_pv<T, NP, BN, VG != 0, D / 64>(o, pa, sv);
        wgmma_commit();
        wgmma_wait_all();
        fence_regs(o);
    }

    /* Epilogue: this warpgroup's rows.  The tile's place is held across the key loop (no
     * spills); recomputing it here, as before, reloaded the row's span from global memory on
     * every CTA's way out. */
    const int64_t t0 = q_start + q0, tile_rows = query_len - q0;
    if (o16) {
        const float sl2[2] = {scale_log2, scale_log2};
        h90_store_o_staged<T, D, BM, DR>(a, sq, cw, wt, h, t0, tile_rows, l, m, sl2, o);
    }
    else {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int r = cw * 64 + w4 * 16 + hf * 8 + g;
            attn_store_row<T, DR / 8>(a, h, t0 + r, r < tile_rows, l[hf], m[hf], scale_log2,
                                      &o[2 * hf], tq, o_vec);
        }
    }
#else
    (void)tmk;
    (void)tmv;
    (void)tfk;
    (void)tfv;
    (void)tfk2;
    (void)tfv2;
    (void)a;
    (void)dims;
    (void)tiles_per_row;
    (void)head_group;
    (void)scale_log2;
    (void)neg_q;
    (void)q_vec;
    (void)o_vec;
    (void)o16;
    (void)sort_rows;
    __trap();
#endif
}

/* Launches one instantiation of the kernel (attn_sm90_ws_launch's contract): ST K and SV V
 * slots of BN keys, NC consumer warpgroups (64 NC query rows per CTA), VG the per-chunk
 * producer's form, DR the call's head size where it pads to D.  The shared-memory attribute is set
 * once per (instantiation, device). */
template <typename T, int ST, int D, int NC, int SV, int BN = 128, int VG = 0, int DR = D>
static cudaError_t
h90_launch_tma(const dk_attention_args *a, const h90_maps &m, int64_t head_group, float scale_log2,
               bool neg_q, bool q_vec, bool o_vec, cudaStream_t s)
{
    static volatile bool attr_set[ATTN_MAX_DEVICES];
    constexpr int BM = 64 * NC;
    /* Q, ST K and SV V slots of BN keys, alignment slack */
    const size_t smem = (size_t)BM * D * 2 + (size_t)(ST + SV) * BN * D * 2 + 1024;
    const cudaError_t e = attn_allow_smem(
        (const void *)attention_sm90_ws_kernel<T, ST, D, NC, SV, BN, VG, DR>, smem, attr_set);
    if (e != cudaSuccess) {
        return e;
    }
    /* BM >= the caller's 128-row tiles: the grid fits whatever the caller checked */
    int64_t tiles_per_row = dk_cdiv(a->max_query_len, BM);
    bool sort_rows = a->num_rows >= 2 && a->num_rows <= ATTN_SORT_ROWS;
    const unsigned blocks = (unsigned)(a->num_heads * a->num_rows * tiles_per_row);
    /* 16-byte aligned output rows: the staged epilogue (h90_store_o_staged) */
    bool o16 = attn_out_rows16(a);
    /* the kernel's parameters, in order (with a pending KV write: one submission) */
    h90_tma_dims dims = m.dims;
    void *args[] = {(void *)&m.k,
                    (void *)&m.v,
                    (void *)&m.flat_k,
                    (void *)&m.flat_v,
                    (void *)&m.flat_k2,
                    (void *)&m.flat_v2,
                    (void *)a,
                    &dims,
                    &tiles_per_row,
                    &head_group,
                    &scale_log2,
                    &neg_q,
                    &q_vec,
                    &o_vec,
                    &o16,
                    &sort_rows};
    return dk_launch_after(a->pending,
                           (const void *)attention_sm90_ws_kernel<T, ST, D, NC, SV, BN, VG, DR>,
                           dim3(blocks), dim3(128 * (NC + 1)), smem, s, args);
}

/* The instantiation for a call (attn_sm90_ws_launch's contract).  Head 128: two consumer
 * warpgroups (128 query rows per CTA), two K/V stages (a third of each does not fit in shared
 * memory) and with 128-key tiles a third V stage (192 KB of tiles: h90_produce_cp_async_groups
 * copies K and V of a tile together once both slots are free, and the extra V slot frees them
 * one tile earlier; at 128 dims every producer's consumers wait for P V after the softmax,
 * which holds a V slot longer -- LATE_PV_WAIT in the kernel; 176-key tiles keep two V slots and
 * their TMA producer runs K a tile ahead of V, K_AHEAD); head 64: three consumer warpgroups (192
 * rows) -- its smaller tiles leave registers for a third -- and three stages.  m.tile 176 where the
 * host chose 176-key tiles.  Heads 192 and 256 have forms of their own (two slots of each; the
 * per-chunk TMA producer where the host encoded its maps, m.dims.k_groups, else cp.async), and
 * the padded head sizes (attention.cu's h90_cp_async_head; cp.async producers, m.dims.box 0)
 * run head 64's form (32), one of their own (72, 80, 96: rows padded to 128 dims, three consumer
 * warpgroups of 160 registers -- at 96 O takes 48, S 56, P 28 -- over 112-key tiles, two K and
 * three V slots, 188 KB with Q; 8-12 % faster than head 128's form with Q's fragments in
 * registers, docs/head-sizes.md) or head 192's (160).  The head-256 form takes
 * 80-key tiles (FlashAttention-3's choice there: 3-4 % faster than 64) where the per-chunk TMA
 * producer or the group one serves the cache (blocks of 16 n keys, or of a power of two of 16+
 * keys: a 16-key group never straddles two blocks); the per-row producer's row table does not fit
 * beside 80-key slots (224 KB), so other block sizes keep 64.  The 192-dim form's 112-key slots
 * (216 KB with Q) leave room for that table: one form serves every block size. */
template <typename T>
static cudaError_t
h90_launch_ws(const dk_attention_args *a, const h90_maps &m, int64_t head_group, float scale_log2,
              bool neg_q, bool q_vec, bool o_vec, cudaStream_t s)
{
    if (a->head_size == 128 && m.dims.k_groups == 3) { /* dense sources' chunks: VG 2 */
        if (m.tile == 176) {
            return h90_launch_tma<T, H90T_STAGES, 128, 2, H90T_STAGES, 176, 2>(
                a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
        }
        return h90_launch_tma<T, H90T_STAGES, 128, 2, H90T_STAGES + 1, 128, 2>(
            a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    }
    if (a->head_size == 128 && m.dims.k_groups != 0) {
        if (m.tile == 176) {
            return h90_launch_tma<T, H90T_STAGES, 128, 2, H90T_STAGES, 176, 1>(
                a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
        }
        return h90_launch_tma<T, H90T_STAGES, 128, 2, H90T_STAGES + 1, 128, 1>(
            a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    }
    if (a->head_size == 128 && m.dims.box != 0 && m.tile == 176) {
        return h90_launch_tma<T, H90T_STAGES, 128, 2, H90T_STAGES, 176>(
            a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    }
    switch (a->head_size) {
    case 32:
        return h90_launch_tma<T, H90T_STAGES + 1, 64, 3, H90T_STAGES + 1, 128, 0, 32>(
            a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    case 72:
        return h90_launch_tma<T, H90T_STAGES, 128, 3, H90T_STAGES + 1, 112, 0, 72>(
            a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    case 80:
        return h90_launch_tma<T, H90T_STAGES, 128, 3, H90T_STAGES + 1, 112, 0, 80>(
            a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    case 96:
        return h90_launch_tma<T, H90T_STAGES, 128, 3, H90T_STAGES + 1, 112, 0, 96>(
            a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    case 160:
        return h90_launch_tma<T, H90T_STAGES, 192, 2, H90T_STAGES, 112, 0, 160>(
            a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    case 192:
        if (m.dims.k_groups != 0) { /* per-chunk TMA boxes */
            return h90_launch_tma<T, H90T_STAGES, 192, 2, H90T_STAGES, 112, 1>(
                a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
        }
        return h90_launch_tma<T, H90T_STAGES, 192, 2, H90T_STAGES, 112>(
            a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    case 256:
        if (m.dims.k_groups != 0) { /* per-chunk TMA boxes */
            return h90_launch_tma<T, H90T_STAGES, 256, 2, H90T_STAGES, 80, 1>(
                a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
        }
        if (h90_group_blocks(a->block_size)) {
            return h90_launch_tma<T, H90T_STAGES, 256, 2, H90T_STAGES, 80>(
                a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
        }
        return h90_launch_tma<T, H90T_STAGES, 256, 2, H90T_STAGES, 64>(a, m, head_group, scale_log2,
                                                                       neg_q, q_vec, o_vec, s);
    default:
        break;
    }
    if (a->head_size == 128) { /* a third V slot (see there) */
        return h90_launch_tma<T, H90T_STAGES, 128, 2, H90T_STAGES + 1>(a, m, head_group, scale_log2,
                                                                       neg_q, q_vec, o_vec, s);
    }
    return h90_launch_tma<T, H90T_STAGES + 1, 64, 3, H90T_STAGES + 1>(a, m, head_group, scale_log2,
                                                                      neg_q, q_vec, o_vec, s);
}

/* attention_internal.cuh's contract: h90_launch_ws for the call's dtype. */
cudaError_t
attn_sm90_ws_launch(const dk_attention_args *a, const h90_maps &m, int64_t head_group,
                    float scale_log2, bool neg_q, bool q_vec, bool o_vec, cudaStream_t s)
{
    return a->dtype == DK_BF16
               ? h90_launch_ws<__nv_bfloat16>(a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s)
               : h90_launch_ws<__half>(a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
}
