/*
 * probe_gather.cu -- how fast one CTA per SM can stream a paged K/V cache into shared memory
 * on the current GPU, per producer form, with no attention math: the ceiling each producer of
 * cuda/attention_sm90_ws.cu works under.  Standalone (not part of the package):
 *
 *     nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/probe_gather \
 *         benchmarks/probe_gather.cu -lcuda && /tmp/probe_gather [num_blocks]
 *
 * The cache is vLLM's NHD layout, bf16, [num_blocks, 16, 8 kv heads, 128], 16-key blocks read
 * in a random order (a shuffled block table per group of CTAs); num_blocks 1024 (33.5 MB per
 * cache) stays in L2 like the attention kernel's K/V (97 % L2 hits in Nsight).  Every CTA
 * streams all blocks of one kv head through a ring of 32 KB tiles (128 keys, both 64-dim halves
 * in the 128-byte-swizzled layout wgmma reads); one thread waits on each tile and frees it.
 * Forms:
 *   tma-half-boxes  two TMA boxes per block (16 rows x one 64-dim half), the per-block boxes of
 *                   the kernel's TMA producer
 *   tma-block-box   one TMA box per block from a 5-d map (64 dims, 8 rows, 2 halves, 2 row
 *                   groups, block) -- the kv head folded into the halves' coordinate; the tile
 *                   lands as 8-row groups of both halves
 *   tma-flat        two 128-row boxes per tile from a flat map over consecutive blocks (the
 *                   kernel's allocation-order runs): no gather, the reference
 *   cp-async        128 threads of 16-byte cp.async, each warp two 16-key groups per tile (the
 *                   kernel's block-group cp.async producer)
 *   split           K tiles by tma-block-box and V tiles by cp-async at the same time (two
 *                   rings; the bytes of both counted)
 * Prints GB/s into shared memory and bytes per SM clock at the device's reported clock.
 */
#include "../cuda/sm90_async.cuh" /* the kernel's mbarrier and TMA instructions */

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x)                                                                                   \
    do {                                                                                           \
        const int e_ = (int)(x);                                                                   \
        if (e_ != 0) {                                                                             \
            fprintf(stderr, "error %d at %s:%d\n", e_, __FILE__, __LINE__);                        \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

constexpr int HEADS = 8, HEAD = 128, BS = 16, TILE = 128;
constexpr int TILE_BYTES = TILE * HEAD * 2; /* one K (or V) tile: 32 KB */
constexpr int STAGES = 3;

enum form { TMA_HALF_BOXES, TMA_BLOCK_BOX, TMA_FLAT, CP_ASYNC, SPLIT, NUM_FORMS };
static const char *const form_names[NUM_FORMS] = {"tma-half-boxes", "tma-block-box", "tma-flat",
                                                  "cp-async",
                                                  "split (K tma-block-box, V cp-async)"};

static __device__ __forceinline__ uint32_t
smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

struct probe_args {
    CUtensorMap half_boxes; /* 4-d: head_size, token, kv head, block; box 64 x 16 */
    CUtensorMap block_box;  /* 5-d: 64 dims, 8 rows, 2 * HEADS halves, 2 row groups, block */
    CUtensorMap flat;       /* 3-d: 64 dims, 2 * HEADS halves, token rows; box 64 x 1 x 128 */
};

/* Tile t of this CTA: TMA boxes of `f` into dst, completing `bar`. */
static __device__ __forceinline__ void
issue_tma(form f, const probe_args &p, const int *tb, int t, int head, uint32_t dst, uint32_t bar)
{
    mbar_arrive_expect_tx(bar, TILE_BYTES);
    for (int j = 0; j < TILE / BS; j++) {
        const int b = tb[t * (TILE / BS) + j];
        if (f == TMA_HALF_BOXES) {
            tma_load_4d(dst + j * BS * 128, &p.half_boxes, bar, 0, 0, head, b);
            tma_load_4d(dst + TILE_BYTES / 2 + j * BS * 128, &p.half_boxes, bar, 64, 0, head, b);
        }
        else if (f == TMA_BLOCK_BOX) {
            tma_load_5d(dst + j * BS * 256, &p.block_box, bar, 0, 0, 2 * head, 0, b);
        }
    }
    if (f == TMA_FLAT) {
        const int row = (tb[t * (TILE / BS)] & ~(TILE / BS - 1)) * BS; /* an aligned run */
        tma_load_3d(dst, &p.flat, bar, 0, 2 * head, row);
        tma_load_3d(dst + TILE_BYTES / 2, &p.flat, bar, 0, 2 * head + 1, row);
    }
}

/* Tile t by the 128 threads' cp.async (thread tid < 128), completing `bar` (count 128). */
static __device__ __forceinline__ void
issue_cp_async(const char *cache, const int *tb, int t, int head, int tid, uint32_t dst,
               uint32_t bar)
{
    const int w = tid >> 5, c = tid & 15, rr = (tid >> 4) & 1;
    for (int g = w; g < TILE / BS; g += 4) {
        const char *src =
            cache + ((int64_t)tb[t * (TILE / BS) + g] * BS * HEADS + head) * HEAD * 2 + c * 16;
        for (int p = 0; p < BS; p += 2) {
            const uint32_t r = (uint32_t)(g * BS + p + rr);
            const uint32_t half = (uint32_t)c >> 3, ch = (uint32_t)c & 7u;
            const uint32_t d = dst + half * (TILE_BYTES / 2) + r * 128u + ((ch ^ (r & 7u)) << 4);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d),
                         "l"(src + (int64_t)(p + rr) * HEADS * HEAD * 2)
                         : "memory");
        }
    }
    cp_async_arrive_noinc(bar);
}

/* One CTA per SM: ring 0 filled by form f (split: TMA block boxes), ring 1 (split only) by
 * cp.async; thread 256 consumes. */
template <form F>
static __global__ void __launch_bounds__(384)
    probe_kernel(const __grid_constant__ probe_args p, const char *cache, const int *table,
                 int blocks_per_cta, unsigned long long *sink)
{
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[2][STAGES], empty[2][STAGES];
    const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
    const int tid = (int)threadIdx.x, head = (int)blockIdx.x % HEADS;
    constexpr int RINGS = F == SPLIT ? 2 : 1;
    if (tid == 0) {
        for (int r = 0; r < RINGS; r++) {
            for (int s = 0; s < STAGES; s++) {
                const bool cp = F == CP_ASYNC || r == 1;
                mbar_init(smem_u32(&full[r][s]), cp ? 128u : 1u);
                mbar_init(smem_u32(&empty[r][s]), 1u);
            }
        }
        mbar_init_fence();
    }
    __syncthreads();
    const int ntiles = blocks_per_cta / (TILE / BS);
    const int *tb = table + (int64_t)(blockIdx.x / HEADS) * blocks_per_cta;
    const int ring = F == SPLIT && tid < 128 ? 1 : 0; /* the producer's ring */
    const bool tma_thread = tid == 128 && F != CP_ASYNC;
    const bool cp_threads = tid < 128 && (F == CP_ASYNC || F == SPLIT);
    if (tma_thread || cp_threads) {
        for (int t = 0; t < ntiles; t++) {
            const int s = t % STAGES;
            if (t >= STAGES) {
                mbar_wait(smem_u32(&empty[ring][s]), (uint32_t)((t / STAGES - 1) & 1));
            }
            const uint32_t dst = base + (uint32_t)((ring * STAGES + s) * TILE_BYTES);
            const uint32_t bar = smem_u32(&full[ring][s]);
            if (tma_thread) {
                issue_tma(F == SPLIT ? TMA_BLOCK_BOX : F, p, tb, t, head, dst, bar);
            }
            else {
                issue_cp_async(cache, tb, t, head, tid, dst, bar);
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
    }
    else if (tid == 256) {
        unsigned long long acc = 0;
        for (int t = 0; t < ntiles; t++) {
            const int s = t % STAGES;
            for (int r = 0; r < RINGS; r++) {
                mbar_wait(smem_u32(&full[r][s]), (uint32_t)((t / STAGES) & 1));
                uint32_t v;
                asm volatile(
                    "ld.shared.u32 %0, [%1];"
                    : "=r"(v)
                    : "r"(base + (uint32_t)((r * STAGES + s) * TILE_BYTES + (t & 63) * 16)));
                acc += v;
                mbar_arrive(smem_u32(&empty[r][s]));
            }
        }
        sink[blockIdx.x] = acc;
    }
}

typedef CUresult (*encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                              const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                              const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static void
encode(encode_fn enc, CUtensorMap *m, void *base, int rank, const cuuint64_t *dims,
       const cuuint64_t *strides, const cuuint32_t *box)
{
    const cuuint32_t one[5] = {1, 1, 1, 1, 1};
    CHECK(enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, base, dims, strides, box, one,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
}

int
main(int argc, char **argv)
{
    const int num_blocks = argc > 1 ? atoi(argv[1]) : 1024;
    if (num_blocks < 8 || num_blocks % 8 != 0) {
        fprintf(stderr, "num_blocks must be a positive multiple of 8\n");
        return 2;
    }
    const size_t bytes = (size_t)num_blocks * BS * HEADS * HEAD * 2;
    const cuuint64_t tok = HEADS * HEAD * 2, blk = (cuuint64_t)BS * tok; /* byte strides */
    char *cache;
    CHECK(cudaMalloc(&cache, bytes));
    CHECK(cudaMemset(cache, 1, bytes));
    int sms = 0, clock_khz = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    const int groups = (sms + HEADS - 1) / HEADS; /* CTAs of one group share a block order */
    std::vector<int> table((size_t)groups * num_blocks);
    std::mt19937 rng(1);
    for (int g = 0; g < groups; g++) {
        int *t = table.data() + (size_t)g * num_blocks;
        for (int i = 0; i < num_blocks; i++) {
            t[i] = i;
        }
        std::shuffle(t, t + num_blocks, rng);
    }
    int *dtable;
    CHECK(cudaMalloc(&dtable, table.size() * sizeof(int)));
    CHECK(cudaMemcpy(dtable, table.data(), table.size() * sizeof(int), cudaMemcpyHostToDevice));
    unsigned long long *sink;
    CHECK(cudaMalloc(&sink, sizeof(unsigned long long) * sms));

    encode_fn enc = nullptr;
    cudaDriverEntryPointQueryResult found;
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void **)&enc, 12000,
                                           cudaEnableDefault, &found));
    probe_args p;
    {
        const cuuint64_t dims[4] = {HEAD, BS, HEADS, (cuuint64_t)num_blocks};
        const cuuint64_t strides[3] = {tok, HEAD * 2, blk};
        const cuuint32_t box[4] = {64, BS, 1, 1};
        encode(enc, &p.half_boxes, cache, 4, dims, strides, box);
    }
    {
        const cuuint64_t dims[5] = {64, 8, 2 * HEADS, BS / 8, (cuuint64_t)num_blocks};
        const cuuint64_t strides[4] = {tok, 128, 8 * tok, blk};
        const cuuint32_t box[5] = {64, 8, 2, BS / 8, 1};
        encode(enc, &p.block_box, cache, 5, dims, strides, box);
    }
    {
        const cuuint64_t dims[3] = {64, 2 * HEADS, (cuuint64_t)num_blocks * BS};
        const cuuint64_t strides[2] = {128, tok};
        const cuuint32_t box[3] = {64, 1, TILE};
        encode(enc, &p.flat, cache, 3, dims, strides, box);
    }

    void (*kernels[NUM_FORMS])(probe_args, const char *, const int *, int, unsigned long long *) = {
        probe_kernel<TMA_HALF_BOXES>, probe_kernel<TMA_BLOCK_BOX>, probe_kernel<TMA_FLAT>,
        probe_kernel<CP_ASYNC>, probe_kernel<SPLIT>};
    /* two rings of STAGES tiles and slack up to a size that keeps one CTA per SM */
    const int smem = 2 * STAGES * TILE_BYTES + 1024 + 20 * 1024;
    for (int f = 0; f < NUM_FORMS; f++) {
        CHECK(cudaFuncSetAttribute(kernels[f], cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    printf("%d SMs, %d MHz, %d blocks of 16 keys (%.1f MB per cache), random order\n", sms,
           clock_khz / 1000, num_blocks, bytes / 1e6);
    const int reps = 20;
    for (int round = 0; round < 3; round++) {
        for (int f = 0; f < NUM_FORMS; f++) {
            kernels[f]<<<sms, 384, smem>>>(p, cache, dtable, num_blocks, sink);
            CHECK(cudaGetLastError());
            CHECK(cudaEventRecord(e0));
            for (int i = 0; i < reps; i++) {
                kernels[f]<<<sms, 384, smem>>>(p, cache, dtable, num_blocks, sink);
            }
            CHECK(cudaEventRecord(e1));
            CHECK(cudaEventSynchronize(e1));
            float ms = 0;
            CHECK(cudaEventElapsedTime(&ms, e0, e1));
            const double moved = (f == SPLIT ? 2.0 : 1.0) * reps * sms * (double)num_blocks * BS *
                                 HEAD * 2; /* bytes into shared memory */
            const double rate = moved / (ms / 1e3);
            printf("round %d  %-38s %7.1f GB/s  %5.1f B/clk/SM\n", round, form_names[f], rate / 1e9,
                   rate / sms / (clock_khz * 1e3));
        }
    }
    return 0;
}
