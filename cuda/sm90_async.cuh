/*
 * sm90_async.cuh -- the asynchronous-copy primitives of the warp-specialized Hopper kernel
 * (attention_sm90_ws.cu, sm90_producers.cuh), as inline PTX: 64-bit mbarriers in shared memory
 * (init, arrive, arrive with expected transaction bytes, parity wait), TMA tensor-map loads of 3 to
 * 5 dims completing on an mbarrier, and the cp.async arrival on one.  Also included by
 * benchmarks/probe_gather.cu, so that the probe issues exactly the instructions the kernel does.
 * Everything is static (each translation unit gets its own copy); only sm_90a code may call the TMA
 * loads.
 */
#ifndef DIFFKV_SM90_ASYNC_CUH
#define DIFFKV_SM90_ASYNC_CUH

#include <cuda.h> /* CUtensorMap */
#include <stdint.h>

/* ---- mbarriers (64-bit, in shared memory at shared address `bar`) and TMA ---- */
static __device__ __forceinline__ void
mbar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

/* Makes the barrier initialisations visible to the async proxy (TMA's complete_tx). */
static __device__ __forceinline__ void
mbar_init_fence(void)
{
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

/* Arrives on the barrier (one of its count). */
static __device__ __forceinline__ void
mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

/* Arrives and adds `bytes` to the transactions the current phase waits for. */
static __device__ __forceinline__ void
mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

/* Waits until the phase of parity `parity` of the barrier has completed. */
static __device__ __forceinline__ void
mbar_wait(uint32_t bar, uint32_t parity)
{
    asm volatile("{\n.reg .pred done;\n"
                 "H90_WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra H90_WAIT_%=;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

/* mbar_wait on two barriers at once: both phases tested back to back (their tests' latencies
 * overlap), then whichever is not complete waited for. */
static __device__ __forceinline__ void
mbar_wait2(uint32_t bar0, uint32_t parity0, uint32_t bar1, uint32_t parity1)
{
    asm volatile("{\n.reg .pred d0, d1;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 d0, [%0], %1;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 d1, [%2], %3;\n"
                 "@!d0 bra H90_W0_%=;\n"
                 "@!d1 bra H90_W1_%=;\n"
                 "bra.uni H90_WD_%=;\n"
                 "H90_W0_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 d0, [%0], %1;\n"
                 "@!d0 bra H90_W0_%=;\n"
                 "H90_W1_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 d1, [%2], %3;\n"
                 "@!d1 bra H90_W1_%=;\n"
                 "H90_WD_%=:\n}\n" ::"r"(bar0),
                 "r"(parity0), "r"(bar1), "r"(parity1)
                 : "memory");
}

/* One TMA box of a 4-d tensor map out of shared memory at src (coordinates innermost first), in
 * this thread's bulk group: commit it with tma_store_commit, and wait for its reads of shared
 * memory (tma_store_wait_read) before the tile is written again. */
static __device__ __forceinline__ void
tma_store_4d(const CUtensorMap *map, uint32_t src, int32_t c0, int32_t c1, int32_t c2, int32_t c3)
{
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], "
                 "[%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}

/* Closes this thread's bulk group of TMA stores. */
static __device__ __forceinline__ void
tma_store_commit(void)
{
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

/* Waits until this thread's committed TMA stores have read their shared memory. */
static __device__ __forceinline__ void
tma_store_wait_read(void)
{
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

/* Waits until this thread's committed TMA stores are done (their global writes too). */
static __device__ __forceinline__ void
tma_store_wait(void)
{
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

/* Brings the 128-byte line holding p into L2 ahead of a load (no register written). */
static __device__ __forceinline__ void
prefetch_l2(const void *p)
{
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

/* Brings a tensor map (a __grid_constant__ kernel parameter) into the TMA unit's descriptor
 * cache ahead of its first box. */
static __device__ __forceinline__ void
tma_prefetch_map(const CUtensorMap *map)
{
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

/* One TMA box of a 4-d tensor map (coordinates innermost first) into shared memory at dst,
 * completing `bar`'s transactions by its size. */
static __device__ __forceinline__ void
tma_load_4d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int32_t c0, int32_t c1, int32_t c2,
            int32_t c3)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}

/* One TMA box of a 3-d tensor map, as tma_load_4d. */
static __device__ __forceinline__ void
tma_load_3d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int32_t c0, int32_t c1, int32_t c2)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}

/* One TMA box of a 5-d tensor map, as tma_load_4d. */
static __device__ __forceinline__ void
tma_load_5d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int32_t c0, int32_t c1, int32_t c2,
            int32_t c3, int32_t c4)
{
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4),
                 "r"(bar)
                 : "memory");
}

/* Arrive on `bar` once all of this thread's earlier cp.async copies have landed, without
 * counting as a pending arrival (the barrier's count includes it). */
static __device__ __forceinline__ void
cp_async_arrive_noinc(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

#endif /* DIFFKV_SM90_ASYNC_CUH */
