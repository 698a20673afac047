/*
 * attention_sm90.cu -- paged attention for Hopper (sm_90a): the tensor-core kernel of
 * attention_sm80.cu rebuilt on warpgroup MMAs (wgmma), selected by dk_cuda_attention on
 * compute capability 9.x when this file's sm_90a code is in the binary.
 *
 * fp16/bf16, head_size 64 or 128, every mask, GQA, any block size.  One CTA of two
 * warpgroups (256 threads) per (query tile of 128 tokens of one batch row, head); warpgroup w
 * owns query rows 64w .. 64w + 63.  Key tiles of 128 keys (head 128) or 64 keys
 * (head 64, two CTAs per SM).
 *   - Shared memory holds Q, and two stages of (K tile, V tile), in the layout wgmma reads
 *     with 128-byte swizzling: a tile of R rows is cut into panels of 64 columns (128 bytes
 *     per row), panel p at p * R * 128 bytes; 16-byte chunk c of row r of a panel sits at
 *     chunk c ^ (r % 8).  Q and K are "K-major" operands (contraction over head dims, the
 *     contiguous ones), V the "MN-major" B operand of P V (transposed by wgmma itself).
 *   - Loads: as in the sm80 kernel, one thread per key resolves the key's cache offset
 *     through the block table (any block_size) into a double-buffered shared array; K and V
 *     chunks are 16-byte cp.async (element loads for odd strides); rows past the last
 *     visible key are zero-filled.
 *   - Per key tile kt: wait for the loads, fence the generic-proxy writes for wgmma's async
 *     proxy, one barrier, issue the loads of K_{kt+1} and V_kt, then each warpgroup issues
 *     S_kt = Q K_kt^T (D/16 wgmma.m64n128k16 from shared memory) and O += P_{kt-1} V_{kt-1}
 *     (BN/16 wgmma.m64nDk16, P from registers, V the transposed B operand), waits for S_kt
 *     only and runs its online softmax (fp32, exp2 with the scale folded in) while the P V
 *     product is still on the tensor cores; then waits for that, rescales O and packs P_kt
 *     to fp16/bf16 registers.  The accumulator layouts are those of mma.sync m16n8 per
 *     16-row slice, so masking, softmax and the epilogue are the sm80 kernel's.  A
 *     warpgroup skips the tiles past all of its rows' limits; masks are applied only on
 *     tiles that reach past the smallest limit of the warpgroup's rows.
 * Register use and shared memory: `nvcc -Xptxas -v` (docs/hopper-kernels.md).
 */
#include "attention_common.cuh"
#include "cuda_common.cuh"
#include "sm90_async.cuh"

#include <cuda.h> /* CUtensorMap and its encoder's types (header only) */
#include <stdlib.h>
#include <string.h>

#define H90_BM 128      /* query rows per CTA */
#define H90_THREADS 256 /* two warpgroups */

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define H90_DEVICE_CODE 1
#endif

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

template <int D> struct h90_tile {
    static constexpr int BN = h90_cfg<D>::BN;
    /* bytes: Q, 2 stages of K and V, 3 x BN key offsets, and slack to align the tiles to
     * 1024 bytes (the swizzle repeats every 8 rows of 128 bytes) */
    static constexpr uint32_t Q_BYTES = H90_BM * D * 2;
    static constexpr uint32_t KV_BYTES = BN * D * 2; /* one K or one V tile */
    static constexpr size_t SMEM = (size_t)Q_BYTES + 4 * KV_BYTES + 3 * BN * 8 + 1024;
};

#ifdef H90_DEVICE_CODE
/* Byte offset of 16-byte chunk c of row r in a swizzled tile of `rows` rows. */
static __device__ __forceinline__ uint32_t
sw128(uint32_t rows, uint32_t r, uint32_t c)
{
    return (c >> 3) * rows * 128u + r * 128u + (((c & 7u) ^ (r & 7u)) << 4);
}

/* wgmma shared-memory matrix descriptor: start address, leading and stride byte offsets (all
 * in 16-byte units), 128-byte swizzle. */
static __device__ __forceinline__ uint64_t
wgmma_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((saddr >> 4) & 0x3FFFu) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

static __device__ __forceinline__ void
wgmma_fence(void)
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

static __device__ __forceinline__ void
wgmma_commit(void)
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

static __device__ __forceinline__ void
wgmma_wait_all(void)
{
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

static __device__ __forceinline__ void
wgmma_wait_1(void)
{
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}

/* Generic-proxy shared-memory writes (stores, cp.async) made visible to wgmma's async proxy. */
static __device__ __forceinline__ void
fence_proxy_async(void)
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* Barrier `id` (1..15) over `n` threads. */
static __device__ __forceinline__ void
named_barrier(uint32_t id, uint32_t n)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

/* Arrives on barrier `id` (1..15) of `n` threads without waiting. */
static __device__ __forceinline__ void
named_arrive(uint32_t id, uint32_t n)
{
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

/* One 32-bit shared store. */
static __device__ __forceinline__ void
st_shared_f32(uint32_t addr, float v)
{
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}

/* Keeps the compiler from moving accumulator reads or writes across a wgmma issue or wait. */
template <int N>
static __device__ __forceinline__ void
fence_regs(float (&r)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++) {
        asm volatile("" : "+f"(r[i])::"memory");
    }
}

/* ---- wgmma instructions: one asm per shape and type, from the macros below ---- */
/* The accumulator operands d[0 .. N/2) ("+f") and their register list "{%0, ..., %N/2-1}". */
#define H90_D8(i)                                                                                  \
    "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]),          \
        "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define H90_D32 H90_D8(0), H90_D8(8), H90_D8(16), H90_D8(24)
#define H90_D64 H90_D32, H90_D8(32), H90_D8(40), H90_D8(48), H90_D8(56)
#define H90_D88 H90_D64, H90_D8(64), H90_D8(72), H90_D8(80)
#define H90_R32_BODY                                                                               \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define H90_R32 "{" H90_R32_BODY "}"
#define H90_R64                                                                                    \
    "{" H90_R32_BODY ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "    \
    "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define H90_R88                                                                                    \
    "{" H90_R32_BODY ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "    \
    "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "   \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "   \
    "%82, %83, %84, %85, %86, %87}"

/* d (m64 x N) = A B + (scale_d ? d : 0), A and B from shared memory (both K-major). IA, IB, IP:
 * the operand numbers of desc_a, desc_b and scale_d (after the N/2 accumulators). */
#define H90_WGMMA_SS(NAME, N, TY, REGS, OUTS, IA, IB, IP)                                          \
    static __device__ __forceinline__ void NAME(float(&d)[(N) / 2], uint64_t desc_a,               \
                                                uint64_t desc_b, int scale_d)                      \
    {                                                                                              \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " IP ", 0;\n"                               \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", " IA  \
                     ", " IB ", p, 1, 1, 0, 0;\n}\n"                                               \
                     : OUTS                                                                        \
                     : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                    \
    }

/* d (m64 x N) += A B, A (m64 x k16) from registers, B from shared memory transposed (MN-major).
 * IA0: the operand number of a[0] (a[1..3] follow), IB of desc_b, IP of scale_d. */
#define H90_WGMMA_RS(NAME, N, TY, REGS, OUTS, IA0, IA1, IA2, IA3, IB, IP)                          \
    static __device__ __forceinline__ void NAME(float(&d)[(N) / 2], const uint32_t(&a)[4],         \
                                                uint64_t desc_b, int scale_d)                      \
    {                                                                                              \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " IP ", 0;\n"                               \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS          \
                     ", {" IA0 ", " IA1 ", " IA2 ", " IA3 "}, " IB ", p, 1, 1, 1;\n}\n"            \
                     : OUTS                                                                        \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));     \
    }

H90_WGMMA_SS(wgmma_ss_m64n128_bf16, 128, "bf16", H90_R64, H90_D64, "%64", "%65", "%66")
H90_WGMMA_SS(wgmma_ss_m64n128_f16, 128, "f16", H90_R64, H90_D64, "%64", "%65", "%66")
H90_WGMMA_SS(wgmma_ss_m64n176_bf16, 176, "bf16", H90_R88, H90_D88, "%88", "%89", "%90")
H90_WGMMA_SS(wgmma_ss_m64n176_f16, 176, "f16", H90_R88, H90_D88, "%88", "%89", "%90")
H90_WGMMA_SS(wgmma_ss_m64n64_bf16, 64, "bf16", H90_R32, H90_D32, "%32", "%33", "%34")
H90_WGMMA_SS(wgmma_ss_m64n64_f16, 64, "f16", H90_R32, H90_D32, "%32", "%33", "%34")
H90_WGMMA_RS(wgmma_rs_m64n128_bf16, 128, "bf16", H90_R64, H90_D64, "%64", "%65", "%66", "%67",
             "%68", "%69")
H90_WGMMA_RS(wgmma_rs_m64n128_f16, 128, "f16", H90_R64, H90_D64, "%64", "%65", "%66", "%67", "%68",
             "%69")
H90_WGMMA_RS(wgmma_rs_m64n64_bf16, 64, "bf16", H90_R32, H90_D32, "%32", "%33", "%34", "%35", "%36",
             "%37")
H90_WGMMA_RS(wgmma_rs_m64n64_f16, 64, "f16", H90_R32, H90_D32, "%32", "%33", "%34", "%35", "%36",
             "%37")

/* S (m64 x N keys) = Q K^T (+ S) and O (m64 x D) += P V for element type T. */
template <typename T> struct h90_mma;

template <> struct h90_mma<__nv_bfloat16> {
    static __device__ __forceinline__ void qk(float (&s)[64], uint64_t a, uint64_t b, int acc)
    {
        wgmma_ss_m64n128_bf16(s, a, b, acc);
    }
    static __device__ __forceinline__ void qk(float (&s)[32], uint64_t a, uint64_t b, int acc)
    {
        wgmma_ss_m64n64_bf16(s, a, b, acc);
    }
    static __device__ __forceinline__ void qk(float (&s)[88], uint64_t a, uint64_t b, int acc)
    {
        wgmma_ss_m64n176_bf16(s, a, b, acc);
    }
    static __device__ __forceinline__ void pv(float (&o)[64], const uint32_t (&p)[4], uint64_t b)
    {
        wgmma_rs_m64n128_bf16(o, p, b, 1);
    }
    static __device__ __forceinline__ void pv(float (&o)[32], const uint32_t (&p)[4], uint64_t b)
    {
        wgmma_rs_m64n64_bf16(o, p, b, 1);
    }
};
template <> struct h90_mma<__half> {
    static __device__ __forceinline__ void qk(float (&s)[64], uint64_t a, uint64_t b, int acc)
    {
        wgmma_ss_m64n128_f16(s, a, b, acc);
    }
    static __device__ __forceinline__ void qk(float (&s)[32], uint64_t a, uint64_t b, int acc)
    {
        wgmma_ss_m64n64_f16(s, a, b, acc);
    }
    static __device__ __forceinline__ void qk(float (&s)[88], uint64_t a, uint64_t b, int acc)
    {
        wgmma_ss_m64n176_f16(s, a, b, acc);
    }
    static __device__ __forceinline__ void pv(float (&o)[64], const uint32_t (&p)[4], uint64_t b)
    {
        wgmma_rs_m64n128_f16(o, p, b, 1);
    }
    static __device__ __forceinline__ void pv(float (&o)[32], const uint32_t (&p)[4], uint64_t b)
    {
        wgmma_rs_m64n64_f16(o, p, b, 1);
    }
};

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

/* Issues O += P V for one key tile (no commit): keys 16 kk .. 16 kk + 15 of P (registers) times
 * V rows 16 kk .. (the transposed B operand at shared address sv: 8-key groups 1024 bytes
 * apart, the stride; 64-dim panels BN * 128 bytes apart, the leading offset). */
template <typename T, int D, int BN, bool VG = false>
static __device__ __forceinline__ void
h90_pv(float (&o)[D / 2], const uint32_t (&pa)[BN / 16][4], uint32_t sv)
{
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
        if constexpr (VG) { /* K_GROUPS layout: 4 KB a 16-key block, panels 1024 apart */
            h90_mma<T>::pv(o, pa[kk], wgmma_desc(sv + (uint32_t)kk * 4096u, 1024u, 2048u));
        }
        else {
            h90_mma<T>::pv(o, pa[kk], wgmma_desc(sv + (uint32_t)kk * 2048u, BN * 128u, 1024u));
        }
    }
}

/* 16 bytes from shared address `addr`. */
static __device__ __forceinline__ uint4
ld_shared16(uint32_t addr)
{
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

/* One 32-bit shared store. */
static __device__ __forceinline__ void
st_shared_u32(uint32_t addr, uint32_t v)
{
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

/*
 * The epilogue of a consumer warpgroup (rows 64 cw .. 64 cw + 63 of the CTA's BM) whose output
 * rows are 16-byte aligned: its accumulators, scaled by 1 / row sum and converted, go to its own
 * rows of the Q tile at sq (free once its last Q K^T is done; the other warpgroups' rows are
 * not touched) in the same 128-byte swizzle -- the 8 rows of a warp's 4-byte stores land in 8
 * different 16-byte chunks, no bank conflicts -- and the warpgroup then copies whole rows out
 * with 16-byte loads and stores, whole rows per warp instruction (two 256-byte rows at head
 * 128), where the accumulator layout gives 4 bytes per thread and row (8 scattered 16-byte
 * pieces per instruction, 32 instructions per thread at head 128).  Row sums, zero rows and the LSE
 * as attn_store_row; t0: the packed token of the CTA's first row, tile_rows: its rows inside the
 * batch row.
 */
template <typename T, int D, int BM>
static __device__ __forceinline__ void
h90_store_o_staged(const dk_attention_args &a, uint32_t sq, int cw, int wt, int64_t h, int64_t t0,
                   int64_t tile_rows, const float (&l)[2], const float (&m)[2], float scale_log2,
                   const float (&o)[D / 2])
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
                sum > 0.0f ? (__fmul_rn(m[hf], scale_log2) + log2f(sum)) / LOG2E : -INFINITY;
        }
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            st_shared_u32(
                sq + sw128(BM, (uint32_t)r, (uint32_t)dt) + 4u * (uint32_t)tq,
                half_ops<T>::pack(o[4 * dt + 2 * hf] * inv, o[4 * dt + 2 * hf + 1] * inv));
        }
    }
    named_barrier(1u + (uint32_t)cw, 128u);
    constexpr int CH = D / 8;     /* 16-byte chunks per row */
    constexpr int RPP = 128 / CH; /* rows per pass of the warpgroup */
    const int c = wt % CH;
#pragma unroll
    for (int p = 0; p < 64 / RPP; p++) {
        const int r = cw * 64 + p * RPP + wt / CH;
        if (r < tile_rows) {
            uint16_t *dst =
                (uint16_t *)a.out + h * a.o_stride_head + (t0 + r) * a.o_stride_token + 8 * c;
            *reinterpret_cast<uint4 *>(dst) = ld_shared16(sq + sw128(BM, (uint32_t)r, (uint32_t)c));
        }
    }
}

/*
 * Q rows row0 .. row0 + ROWS - 1 of the CTA's tile (zeros past the row's end) into the swizzled
 * Q tile at sq (BM rows) by THREADS threads, t being this one's index among them: 16-byte
 * cp.async chunks, element gathers for an odd-strided query; then a cp.async commit.
 */
template <int D, int BM, int THREADS, int ROWS>
static __device__ __forceinline__ void
h90_load_q(const dk_attention_args &a, uint32_t sq, int t, int row0, int64_t q0, int64_t q_start,
           int64_t query_len, int64_t h, bool q_vec)
{
    constexpr int CHUNKS = D / 8;
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
    const uint32_t c = (uint32_t)(t % CHUNKS);
    const uint32_t r0 = (uint32_t)(row0 + t / CHUNKS);
#pragma unroll
    for (int pass = 0; pass < ROWS / ROWS_PER_PASS; pass++) {
        const uint32_t r = r0 + (uint32_t)(pass * ROWS_PER_PASS);
        const uint32_t dst = sq + sw128(BM, r, c);
        if (q0 + r < query_len) {
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
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
    const uint32_t c = (uint32_t)(t % CHUNKS);
    const uint32_t r0 = (uint32_t)(row0 + t / CHUNKS);
#pragma unroll
    for (int pass = 0; pass < ROWS / ROWS_PER_PASS; pass++) {
        const uint32_t dst = sq + sw128(BM, r0 + (uint32_t)(pass * ROWS_PER_PASS), c);
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
 * (each panel a block of rows), or 1024 and 2048 (K_GROUPS: the panels of each 8-row group
 * side by side, as one TMA box per 16-key block lands them). */
template <typename T, int D, int BN, int BM = H90_BM>
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

/*
 * Online softmax of one S tile in place (s becomes P, fp32): masks keys at or past each row's
 * limit (only on a tile reaching past the warpgroup's smallest limit), updates the running
 * max m (raw scores) and this thread's partial sums l, and returns the factor alpha by which
 * O must be rescaled.  s[4 nt + e]: row g (e < 2) or g + 8, key j0 + 8 nt + 2 tq + (e & 1).
 * p = 2^(s * scale_log2 - m * scale_log2); a row with no visible key so far keeps max -inf
 * and subtracts 0 instead, so that 2^-inf = 0 rather than nan.  Returns whether O needs
 * the rescale: with SKIP, false when no row of the warp raised its max in this tile (every
 * alpha is then exactly 1, as the eager form computes it: skipping is bit-identical); without,
 * always true.
 */
template <int NT, bool SKIP = false>
static __device__ __forceinline__ bool
h90_softmax(float (&s)[NT * 4], float (&m)[2], float (&l)[2], float (&alpha)[2], int32_t j0,
            const h90_rows &r)
{
    bool raised = false;
    if (j0 + NT * 8 > r.g_min) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (j0 + nt * 8 + 2 * r.tq + (e & 1) >= (e < 2 ? r.lim0 : r.lim1)) {
                    s[4 * nt + e] = -INFINITY;
                }
            }
        }
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float mx = fmaxf(s[2 * hf], s[2 * hf + 1]);
#pragma unroll
        for (int nt = 1; nt < NT; nt++) {
            mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m[hf], mx);
        raised = raised || mn > m[hf];
        const float base = mn == -INFINITY ? 0.0f : __fmul_rn(mn, r.scale_log2);
        alpha[hf] = fast_exp2(__fmul_rn(m[hf], r.scale_log2) - base);
        m[hf] = mn;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float p0 = fast_exp2(fmaf(s[4 * nt + 2 * hf], r.scale_log2, -base));
            const float p1 = fast_exp2(fmaf(s[4 * nt + 2 * hf + 1], r.scale_log2, -base));
            s[4 * nt + 2 * hf] = p0;
            s[4 * nt + 2 * hf + 1] = p1;
            sum += p0 + p1;
        }
        l[hf] = l[hf] * alpha[hf] + sum;
    }
    return !SKIP || __any_sync(0xffffffffu, raised) != 0; /* warp-uniform */
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
        int32_t wmax, wmin;
        attn_row_limit(a, tid, q0, q_start, query_len, seq_len, s_lim, &wmax, &wmin);
        if (lane == 0) {
            s_wmax[tid / 32] = wmax;
            s_wmin[tid / 32] = wmin;
        }
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
                h90_qk<T, D, BN>(s, rows.q_slab, sk);
                wgmma_commit();
                wgmma_wait_all();
                fence_regs(s);
                h90_softmax<NT>(s, m, l, alpha, j0, rows);
            }
            else {
                h90_qk<T, D, BN>(s, rows.q_slab, sk);
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
    __trap(); /* launched only where the sm_90a code exists (dk_cuda_attention_sm90_ready) */
#endif
}

/*
 * Warp-specialized kernel (attention_sm90_tma_kernel, head 64 or 128): the same per-warpgroup
 * pipeline, fed by a producer.  NC + 1 warpgroups, 1 CTA per SM: warpgroup 0 is the producer
 * (setmaxnreg leaves it 56 registers with NC = 2, 32 with 3), warpgroups 1 .. NC the consumers
 * (224 or 160 registers) with query rows 64 (w - 1) ...  Key tiles of BN = 128 keys, or 176
 * for head-128 calls over long rows fed by TMA (h90_wide_tiles; producer 24 registers, consumers
 * 240: a tile's fixed costs over 37 % more keys).  K has ST slots and V SV, each with a
 * "full" mbarrier and an "empty" one (one arrive per consumer warp): H90T_STAGES of each at
 * head 128, one V slot more with 128-key tiles, one more of each at head 64.  Producers:
 *   - TMA: one warp brings a key tile in as TMA boxes of the cache's tensor map, one box per
 *     (cache block, 64-dim half) -- BN / block_size blocks per tile, or a BN-key slice of one
 *     larger block -- each landing 1024-byte aligned, so the TMA's 128-byte swizzle is the
 *     layout wgmma reads; the full barrier waits for the warp's arrive.expect_tx and the bytes.
 *     Only blocks that start before the CTA's last visible key are fetched.  A flat cache
 *     (block stride = block_size * token stride: vLLM's NHD layout) also has a map over its
 *     num_blocks * block_size token rows, and a tile whose blocks are consecutive ids (a cache
 *     filled in allocation order) comes in from it as one BN-row box per half: the TMA unit's
 *     box rate, not bandwidth, is what makes small boxes slow.
 *   - cp.async: h90_produce_cp_async_groups for power-of-two blocks of 16+ keys (per 16-key
 *     group addresses in registers), h90_produce_cp_async otherwise (per-key addresses through
 *     a shared ring), coalesced rows; the full barrier counts the 128 threads' cp.async
 *     arrivals, and the consumers fence the generic-proxy writes for wgmma after waiting.
 *   - TMA per 16-key chunk (dims.k_groups, the kernel's VG; head 128, blocks of 16 n keys
 *     -- or one block per row of 8 n -- with adjacent kv-head rows or contiguous HND, in any
 *     order): the producer's four warps, lane l of warp w issuing chunk w + 4 l's K and V
 *     as one box each of a 5-d map
 *     (h90_kgroups_encode: both 64-dim halves, 4 KB), so K and V tiles land as 8-row groups
 *     of both panels (h90_qk's K_GROUPS layout, h90_pv's VG) -- 8 or 11 boxes a tile where
 *     per-half boxes of 16-key blocks would take 16 or 22, and no cp.async at all.  The host
 *     takes it for every cache it can encode (the fastest of the three: see
 *     dk_cuda_attention_sm90); the rules below are for the rest.
 * TMA takes power-of-two blocks of H90T_MIN_BOX keys or more, one block of 128+ keys per row
 * (dense K/V), and smaller power-of-two blocks of a flat cache when at least
 * H90T_MIN_RUNS per mille of the call's key tiles are consecutive blocks (the host counts them
 * in the block table it checks) -- blocks too small for a box per lane (under 8 keys at head
 * 128, 4 at head 64: a dense call's one-token blocks) only when every tile is such a run (the
 * host's count, or dense_attention's caller vouching for it: packed varlen documents), then
 * as flat boxes only; cp.async the rest.
 * On the last tile the consumers zero the V rows past the last visible key (stale or unwritten
 * data, 0 * nan = nan) and the mask drops the K rows.  Consumers release a K slot as soon as
 * S = Q K^T is done and a V slot when P V is, so the producer refills K one softmax before V
 * (head 128: P V is waited for after the next tile's softmax, LATE_PV_WAIT; with 176-key tiles
 * the TMA producer then issues K of a tile before V of the tile before, K_AHEAD).
 * No CTA-wide barrier inside the key loop.
 * A CTA's fixed costs (per-CTA clock64 stamps, H200, 1x32x2048x128 non-causal: ~2.9 us to its
 * first S against ~1.4 us per key tile, 1.2 us of epilogue, 0.4 us until the SM's next CTA
 * starts) are cut where they were serial: the consumers issue their Q rows right after the
 * CTA's place is known (not after the key limits' barrier), the per-chunk producer loads its
 * tile-0 block-table entry at the start, the output tile's place stays in registers (it was
 * reloaded from global memory at the end), and 16-byte aligned output rows are written through
 * shared memory with 16-byte stores (h90_store_o_staged) instead of 4 bytes per thread and row
 * from the accumulators.  Interleaved A/B against the kernel before (three builds, three
 * rounds, ratios to cuDNN): 1x32x2048 0.87 -> 0.92, 1x32x4096 0.93 -> 0.96, causal 4096 1.04 ->
 * 1.09, two rows of 1024 0.85 -> 0.94, denoise 1.04 -> 1.05; without the staged stores only
 * 0.87 -> 0.89 at 2048 and no change on the denoise rows.
 */
#define H90T_STAGES 2
/* Producer warps issuing the per-chunk boxes (h90_produce_tma_groups). */
#define H90_TMA16_WARPS 4
/* Smallest block (keys) brought in by TMA boxes in any order: a box of 16 rows costs more
 * than the cp.async producer's rows (H200, 1x24x16384x128, blocks in random order: 475 vs 488
 * TFLOP/s), 32+ rows less.  A tile of consecutive 16-key blocks of a flat cache, one box per
 * half, runs at 587-615, so TMA pays for 16-key blocks once ~15 % of the tiles are such runs;
 * it is taken from 25 %. */
#define H90T_MIN_BOX 32
#define H90T_MIN_RUNS 250
/* Longest row (keys) from which calls take 176-key tiles: H200, bf16, unmasked, 176- against
 * 128-key tiles -- 1x24x16384x128 in allocation order 604-678 TFLOP/s (median of six runs 648)
 * vs 586-611, 40 heads x 32760 dense 606-620 vs 583-589, but four packed 8190-key documents
 * 552 vs 564-569 (interleaved in one run). */
#define H90_WIDE_MIN_KEYS 16384

#ifdef H90_DEVICE_CODE
/*
 * The producer warpgroup of attention_sm90_tma_kernel when the cache does not suit TMA boxes
 * (blocks under H90T_MIN_BOX keys or not a power of two, dense key indices): per key tile, thread t
 * resolves key t's K and V row addresses (either source) into a shared ring of two, then every
 * thread copies 16-byte chunk t % 16 of rows t / 16 + 8 i -- a warp moves two whole 256-byte key
 * rows per instruction -- with cp.async, zero-filling rows past kv_end, and arrives on the slot's
 * full barrier when its copies land (count 128).
 */
/* What each of a cp.async producer's 128 threads needs about its CTA's row: the kv head, the
 * row's block table, its 16-byte chunk c of a key row and first row rr of a pass, the caches
 * (the second source's too). */
struct h90_cp_thread {
    int64_t kvh;
    const int32_t *bt;
    uint32_t c, rr;
    const char *kc, *vc, *kc2, *vc2;
};

template <int D>
static __device__ __forceinline__ h90_cp_thread
h90_cp_setup(const dk_attention_args &a, int64_t h, int64_t row)
{
    constexpr int CH = D / 8; /* 16-byte chunks per key row */
    const int tid = (int)threadIdx.x;
    return {h / (a.num_heads / a.num_kv_heads),
            a.block_table + row * a.bt_stride_row,
            (uint32_t)(tid % CH),
            (uint32_t)(tid / CH),
            (const char *)a.key_cache,
            (const char *)a.value_cache,
            (const char *)a.key_cache2,
            (const char *)a.value_cache2};
}

template <int D, int BN, int ST, int SV>
static __device__ __forceinline__ void
h90_produce_cp_async(const dk_attention_args &a, int64_t h, int64_t row, int32_t kv_end,
                     int32_t n_tiles, uint32_t sk0, uint32_t sv0, uint32_t full_k, uint32_t full_v,
                     uint32_t empty_k, uint32_t empty_v)
{
    constexpr uint32_t KVB = BN * D * 2;
    constexpr int CH = D / 8;                /* 16-byte chunks per key row */
    constexpr int RP = 128 / CH;             /* rows per pass of the 128 threads */
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
#pragma unroll
            for (int i = 0; i < BN / RP; i++) {
                const uint32_t r = rr + (uint32_t)(RP * i);
                cp_async16(dst + sw128(BN, r, c), rows[r] + c * 16u,
                           j0 + (int32_t)r < kv_end ? 16u : 0u);
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
 * instructions share the SM's issue slots with the consumers' softmax (Nsight Compute: 50 %
 * more instructions issued than the TMA producer's run on the same rows, every warp resolving
 * every group).  No shared-memory traffic besides the copies, which keeps the memory pipe free
 * for the consumers' wgmma issue (the ring's loads and stores competed with it there).  K and V
 * of a tile are copied together, row by row, once both slots are free (V has one slot more than
 * K so that K is not held back), and every thread then arrives on both full barriers.
 */
template <int D, int BN, int ST, int SV, bool TWO>
static __device__ __forceinline__ void
h90_produce_cp_async_groups(const dk_attention_args &a, int64_t h, int64_t row, int32_t kv_end,
                            int32_t n_tiles, uint32_t sk0, uint32_t sv0, uint32_t full_k,
                            uint32_t full_v, uint32_t empty_k, uint32_t empty_v)
{
    constexpr uint32_t KVB = BN * D * 2;
    constexpr int CH = D / 8;       /* 16-byte chunks per key row (16 or 8) */
    constexpr int RW = 32 / CH;     /* rows per warp-wide copy (2 or 4) */
    constexpr int GW = BN / 16 / 4; /* 16-key groups per warp and tile */
    static_assert(BN % 64 == 0 && 32 % CH == 0, "four warps split a tile's 16-key groups");
    /* th.c and th.rr spread the warpgroup's threads over a pass's rows; here each warp copies
     * whole groups, so its lanes take c and rr below instead */
    const h90_cp_thread th = h90_cp_setup<D>(a, h, row);
    const int64_t kvh = th.kvh;
    const int32_t *const bt = th.bt;
    const char *const kc = th.kc, *const vc = th.vc, *const kc2 = th.kc2, *const vc2 = th.vc2;
    const uint32_t lane = threadIdx.x & 31u;
    const int32_t warp = (int32_t)((threadIdx.x >> 5) & 3u);
    const uint32_t c = lane % CH;  /* this lane's chunk of a row */
    const uint32_t rr = lane / CH; /* and its row within each RW-row copy */
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
    int32_t blk[GW]; /* block ids of this warp's groups of the next tile */
#pragma unroll
    for (int g = 0; g < GW; g++) {
        const int32_t key = 16 * (warp + 4 * g);
        blk[g] = key < kv_end ? bt[(uint32_t)key >> shift] : 0;
    }
    for (int32_t kt = 0; kt < n_tiles; kt++) {
        const int32_t j0 = kt * BN;
        const uint32_t slot_k = (uint32_t)(kt % ST);
        const uint32_t slot_v = (uint32_t)(kt % SV);
        if (kt >= ST) { /* the phase the slot's last use ended */
            mbar_wait(empty_k + 8u * slot_k, (uint32_t)((kt / ST - 1) & 1));
        }
        const uint32_t dk = sk0 + slot_k * KVB;
        const uint32_t dv = sv0 + slot_v * KVB;
        if (kt >= SV) {
            mbar_wait(empty_v + 8u * slot_v, (uint32_t)((kt / SV - 1) & 1));
        }
#pragma unroll
        for (int g = 0; g < GW; g++) {
            const int32_t q = warp + 4 * g; /* the group within the tile */
            const int32_t gk = j0 + 16 * q; /* its first key */
            const char *kr, *vr;
            if (TWO) { /* dense joint tokens: a block of either source */
                const int64_t off = gk < kv_end ? kv_block_offset(a, dk_safe_block(a, blk[g]),
                                                                  (uint32_t)gk & (bs - 1u), kvh)
                                                : 0;
                kr = kv_row(kc, kc2, off) + t0;
                vr = kv_row(vc, vc2, off) + t0;
            }
            else { /* dk_safe_block's clamp; past kv_end any real block (never read) */
                const uint32_t b =
                    gk < kv_end && (uint32_t)blk[g] < nblocks ? (uint32_t)blk[g] : 0u;
                const int64_t off =
                    (int64_t)b * bbytes + (int64_t)((uint32_t)gk & (bs - 1u)) * tbytes;
                kr = kb + off;
                vr = vb + off;
            }
            const int32_t nk = gk + BN; /* the same group of the next tile */
            blk[g] = nk < kv_end ? bt[(uint32_t)nk >> shift] : 0;
#pragma unroll
            for (int p = 0; p < 16 / RW; p++) {
                const uint32_t r = (uint32_t)(16 * q + RW * p) + rr; /* row in the tile */
                const int64_t t = (int64_t)(RW * p) * tbytes;
                const uint32_t n = j0 + (int32_t)r < kv_end ? 16u : 0u;
                cp_async16(dk + sw128(BN, r, c), kr + t, n);
                cp_async16(dv + sw128(BN, r, c), vr + t, n);
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
 * four warps issue a tile's 11 in three rounds instead of eleven (H200,
 * interleaved A/B against one warp, two rounds: denoise 626-627 -> 638 TFLOP/s, the layer call
 * 1,333 -> 1,307 us, 24x16k and 40x32760 non-causal within +-0.5 %; the producer's issue
 * latency is on the consumers' path with two K stages: a runtime switch to the FLAT form in
 * this function cost the paged calls ~5 %, hence its own instantiation).  Chunk 0's thread
 * expects the tile's bytes: the full barrier's one arrival, so boxes that land before it
 * leave the phase open.  KA (the kernel's K_AHEAD): K of tile kt before V of tile kt - 1.
 * FLAT (the kernel's VG 2, dims.k_groups 3): dense_attention's vouched chunks -- every 16 keys
 * of a row are 16 consecutive token rows of one source from a multiple of 8 -- with each
 * source one map of a single block (kmap / vmap, kmap2 / vmap2 past blocks2), so a chunk's
 * coordinates are its first row / 8 in its source.
 * Against K by these boxes with V by the block-group cp.async producer (the earlier "mixed"
 * producer, 24x16384x128 random order on the H200): 566 -> 613-655 TFLOP/s non-causal, 590-601
 * -> 664 causal -- the 32 cp.async a thread and tile had shared the memory pipe with the
 * consumers' wgmma issue, and a 176-key tile, which that producer could not cut, is now one. */
template <int D, int BN, int ST, int SV, bool KA, bool FLAT>
static __device__ __forceinline__ void
h90_produce_tma_groups(const dk_attention_args &a, int64_t h, int64_t row, int32_t kv_end,
                       int32_t n_tiles, uint32_t sk0, uint32_t sv0, uint32_t full_k,
                       uint32_t full_v, uint32_t empty_k, uint32_t empty_v, const CUtensorMap *kmap,
                       const CUtensorMap *vmap, const CUtensorMap *kmap2, const CUtensorMap *vmap2,
                       bool hnd, bool first_ok, int32_t first_blk)
{
    constexpr uint32_t KVB = BN * D * 2;
    constexpr int NG = BN / 16; /* 16-key chunks per tile */
    static_assert(D == 128 && NG <= 32, "head 128, a thread per chunk");
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
        const uint32_t slot = (uint32_t)(kt % stages);
        const uint32_t bar = (kv == 0 ? full_k : full_v) + 8u * slot;
        if (kt >= stages) { /* the phase the slot's last use ended */
            mbar_wait((kv == 0 ? empty_k : empty_v) + 8u * slot, (uint32_t)((kt / stages - 1) & 1));
        }
        if (chunk == 0) {
            const int32_t blocks = min(NG, (kv_end - kt * BN + 15) / 16);
            mbar_arrive_expect_tx(bar, (uint32_t)blocks * 4096u);
        }
        if (b >= 0) {
            const uint32_t dst = (kv == 0 ? sk0 : sv0) + slot * KVB + (uint32_t)chunk * 4096u;
            if constexpr (FLAT) {
                const CUtensorMap *map = kv == 0 ? (b ? kmap2 : kmap) : (b ? vmap2 : vmap);
                tma_load_5d(dst, map, bar, 0, 0, 2 * kvh, g, 0);
            }
            else {
                const CUtensorMap *map = kv == 0 ? kmap : vmap;
                if (hnd) {
                    tma_load_5d(dst, map, bar, 0, 0, 0, g, b * heads + kvh);
                }
                else {
                    tma_load_5d(dst, map, bar, 0, 0, 2 * kvh, g, b);
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

/* The tensor map's dimension order: which of dims 1..3 is the token within a block, the kv
 * head and the block (dims sorted by stride; dim 0 is head_size). */
struct h90_tma_dims {
    int32_t token, head, block;
    int32_t box;       /* keys per box: min(block_size, the tile: 128 or 176) */
    int32_t flat;      /* 0: no flat map; else which of its dims 1..2 is the token row (the other
                          is the kv head) */
    int32_t flat_only; /* every tile is a run of consecutive rows (the host counted them all, or
                          the caller vouched): flat boxes only, no per-block map */
    int32_t k_groups;  /* K and V by one TMA box per 16-key chunk (the 5-d maps
                          h90_kgroups_encode makes; tiles in the K_GROUPS layout, the kernel's
                          VG): 1 the kv head folded into the maps' halves (NHD), 2 into their
                          blocks (HND), 3 flat sources of vouched chunks (the kernel's VG 2;
                          dense_attention's consecutive & 2; the second source's maps in
                          tfk2 / tfv2) */
};

/* Registers after setmaxnreg: the producer warpgroup keeps PRODUCER, the consumer warpgroups
 * take the rest of what the CTA was launched with -- 168 per thread at 384 threads, 64,512; a
 * consumer asking for more than is free waits in setmaxnreg forever (multiples of 8 each):
 * 56 / 224 with two consumers and 128-key tiles, 24 / 240 with 176-key tiles (S, P and O of a
 * warpgroup: 88 + 44 + 64 registers per thread; only the TMA producer, one warp, runs with 24),
 * 32 / 160 with three (128 per thread at 512 threads). */
template <int PRODUCER, int CONSUMER> struct h90_ws_regs {
    static_assert(PRODUCER % 8 == 0 && CONSUMER % 8 == 0, "setmaxnreg takes multiples of 8");
    static __device__ __forceinline__ void producer()
    {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER) : "memory");
    }
    static __device__ __forceinline__ void consumer()
    {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER) : "memory");
    }
};

/* VG: a cache cut into 16-key chunks (dims.k_groups): tmk and tmv are the per-chunk 5-d maps,
 * h90_produce_tma_groups fills the K and V slots, both in the K_GROUPS layout. */
template <typename T, int ST, int D, int NC, int SV, int BN, int VG = 0>
/* clang-format off */
static __global__ void __launch_bounds__(128 * (NC + 1), 1)
attention_sm90_tma_kernel(const __grid_constant__ CUtensorMap tmk,
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
     * V slot is then released a softmax later.  Head 128 with 128-key tiles gets a third V
     * slot for it; interleaved A/B on the H200 (bench_attention, three rounds, ratios to
     * cuDNN): +1-3 % (24x16k random non-causal 0.91 -> 0.93, allocation-order causal 0.98 ->
     * 1.00, piecewise 0.98 -> 1.00, 32760 causal 0.94 -> 0.96); with two V slots (and
     * K_AHEAD) 8-13 % slower than with three (allocation-order causal 0.99-1.04 -> 0.89-0.91,
     * denoise 1.01 -> 0.92).  176-key tiles, where a third V slot does not fit, take the late
     * wait with two and K_AHEAD (without K_AHEAD 3-8 % slower than the early wait: 0.97 ->
     * 0.94).  Head 64 (three V slots, three consumer warpgroups): 1-3 % slower, with or without
     * K_AHEAD. */
    constexpr bool LATE_PV_WAIT = D == 128 && (SV > ST || BN == 176);
    /* The TMA producer's order with as many V slots as K and the late wait: K of tile kt
     * before V of tile kt - 1, which a consumer needs a tile later (its P V is issued with the
     * next tile's Q K^T) and whose slot frees a softmax later -- waiting for that slot first
     * holds the K load back behind it.  176-key tiles, interleaved A/B on the H200 (two to
     * three rounds, ratios to cuDNN): 24x16k allocation order 0.97 -> 0.99-1.00, 40x32760
     * allocation order 1.10-1.11 -> 1.13-1.14, dense 40x32760 (bench_dense) 1.00 -> 1.00-1.03. */
    constexpr bool K_AHEAD = LATE_PV_WAIT && SV == ST;
    static_assert(BN == 128 || (BN == 176 && D == 128 && NC == 2), "key tile");
    constexpr int PRODUCER_REGS = NC == 3 ? 32 : (BN == 176 ? 24 : 56);
    constexpr int CONSUMER_REGS = NC == 3 ? 160 : (BN == 176 ? 240 : 224);
    using regs = h90_ws_regs<PRODUCER_REGS, CONSUMER_REGS>;
    constexpr int NT = BN / 8;
    constexpr int DT = D / 8;
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
        h90_load_q<D, BM, 128, 64>(a, sq, tid - 128 * wg, (wg - 1) * 64, q0, q_start, query_len, h,
                                   q_vec);
    }

    /* Key limits of the BM query rows (threads 0 .. BM - 1), barriers. */
    if (tid < BM) {
        int32_t wmax, wmin;
        attn_row_limit(a, tid, q0, q_start, query_len, seq_len, s_lim, &wmax, &wmin);
        if (lane == 0) {
            s_wmax[tid / 32] = wmax;
            s_wmin[tid / 32] = wmin;
        }
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
    __syncthreads();
    int32_t kv_end = s_wmax[0];
#pragma unroll
    for (int w = 1; w < BM / 32; w++) {
        kv_end = max(kv_end, s_wmax[w]);
    }
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
        if constexpr (BN != 128) { /* the host gives 176-key tiles TMA boxes only */
            if (dims.box == 0) {
                __trap();
            }
        }
        else if (dims.box == 0) {
            /* ---------------- producer: 128 threads of cp.async ---------------- */
            if (a.block_size >= 16 && (a.block_size & (a.block_size - 1)) == 0) {
                if (a.key_cache2 != NULL) {
                    h90_produce_cp_async_groups<D, BN, ST, SV, true>(
                        a, h, row, kv_end, n_tiles, sk0, sv0, full_k, full_v, empty_k, empty_v);
                }
                else {
                    h90_produce_cp_async_groups<D, BN, ST, SV, false>(
                        a, h, row, kv_end, n_tiles, sk0, sv0, full_k, full_v, empty_k, empty_v);
                }
            }
            else {
                h90_produce_cp_async<D, BN, ST, SV>(a, h, row, kv_end, n_tiles, sk0, sv0, full_k,
                                                    full_v, empty_k, empty_v);
            }
            return;
        }
        /* ---------------- producer: warp 0 of TMA ---------------- */
        if (tid >= 32) {
            return;
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
    constexpr uint32_t ksbo = VG ? 2048u : 1024u;

    /* This warpgroup's 64 Q rows (issued above), negated for a negative scale. */
    cp_async_wait_all();
    if (neg_q) {
        h90_negate_q<D, BM, 128, 64>(sq, wt, cw * 64);
    }
    fence_proxy_async();
    named_barrier(1u + (uint32_t)cw, 128u);

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) {
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
    /* O's rescale is skipped on tiles where no row of the warp raised its max (h90_softmax
     * SKIP; bit-identical: alpha is exp2(0) = 1 exactly there): 2-7 % faster at head 128 and
     * 2-5 % at head 64 on the H200 (interleaved A/Bs; the lossy lazy form, which rescales only
     * when a max grows by 2^8, lost accuracy on growing scores: docs/hopper-kernels.md, tried and
     * not kept). */

    if (n_tiles > 0) {
        /* Ping-pong (FlashAttention-3's inter-warpgroup schedule): the consumer warpgroups take
         * turns issuing a tile's GEMMs, 0, 1, .., NC - 1, 0, ..  (named barrier 8 + cw: this
         * warpgroup's 128 threads wait, the previous warpgroup's 128 arrive), so that one
         * warpgroup's softmax runs while the others' GEMMs do rather than all warpgroups
         * contending for the tensor cores at once; the last warpgroup opens the first turn.
         * Interleaved A/B on the H200 (bench_attention, bench_dense, two rounds): +1-6 % on the
         * cp.async (sm90-ws) cases at both head sizes, within +-1 % on the TMA-box cases, -2 % on
         * the key-padding dense case. */
        if (cw == NC - 1) {
            named_arrive(8u, 256u);
        }
        for (int32_t kt = 0; kt < n_tiles; kt++) {
            const int32_t j0 = kt * BN;
            const uint32_t slot = (uint32_t)(kt % ST);
            mbar_wait(full_k + 8u * slot, (uint32_t)((kt / ST) & 1)); /* K_kt landed */
            if (!VG && dims.box == 0) {
                fence_proxy_async(); /* cp.async (generic proxy) writes, for wgmma */
            }
            float alpha[2];
            if (kt == 0) {
                named_barrier(8u + (uint32_t)cw, 256u);
                h90_qk<T, D, BN, BM>(s, rows.q_slab, sk0, khalf, ksbo);
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
                mbar_wait(full_v + 8u * pslot, (uint32_t)(((kt - 1) / SV) & 1)); /* V_{kt-1} */
                if (!VG && dims.box == 0) {
                    fence_proxy_async();
                }
                named_barrier(8u + (uint32_t)cw, 256u);
                h90_qk<T, D, BN, BM>(s, rows.q_slab, sk0 + slot * KVB, khalf, ksbo);
                wgmma_commit();
                h90_pv<T, D, BN, VG != 0>(o, pa, sv0 + pslot * KVB);
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
                st_shared16(sv + (r / 8u) * 2048u + (c / 8u) * 1024u + (r % 8u) * 128u +
                                ((c % 8u) ^ (r % 8u)) * 16u,
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
        h90_pv<T, D, BN, VG != 0>(o, pa, sv);
        wgmma_commit();
        wgmma_wait_all();
        fence_regs(o);
    }

    /* Epilogue: this warpgroup's rows.  The tile's place is held across the key loop (no
     * spills); recomputing it here, as before, reloaded the row's span from global memory on
     * every CTA's way out. */
    const int64_t t0 = q_start + q0, tile_rows = query_len - q0;
    if (o16) {
        h90_store_o_staged<T, D, BM>(a, sq, cw, wt, h, t0, tile_rows, l, m, scale_log2, o);
    }
    else {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int r = cw * 64 + w4 * 16 + hf * 8 + g;
            attn_store_row<T, DT>(a, h, t0 + r, r < tile_rows, l[hf], m[hf], scale_log2, &o[2 * hf],
                                  tq, o_vec);
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

/* ------------------------------------------------------------------------------------------ */
/* Host side                                                                                   */
/* ------------------------------------------------------------------------------------------ */

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

/* Whether head-128 calls may take the warp-specialized kernel (the kernel choice sm90 --
 * DIFFKV_ATTENTION_KERNEL=sm90 or set_attention_kernel("sm90") -- keeps them on the cp.async
 * wgmma kernel). */
static bool
h90_ws_allowed(void)
{
    return dk_attention_kernel_choice() != DK_KERNEL_SM90;
}

/* cuTensorMapEncodeTiled, fetched from the driver once (the extension links no libcuda);
 * NULL when the driver has none. */
typedef CUresult (*h90_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                  const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                  const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static h90_encode_fn
h90_encoder(void)
{
    static h90_encode_fn volatile fn;
    static volatile int tried;
    if (!tried) {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess) {
            fn = (h90_encode_fn)p;
        }
        tried = 1; /* a race fetches the same pointer twice */
    }
    return fn;
}

/* The tensor maps of one cache (K and V): per block (dims) and, for a flat cache, over its
 * token rows (flat_k, flat_v; zeros otherwise). */
struct h90_maps {
    CUtensorMap k, v, flat_k, flat_v;
    CUtensorMap flat_k2, flat_v2;     /* the second source's (dense joint tokens), flat-only mode */
    CUtensorMap k_groups;             /* K by one box per 16-key chunk (h90_kgroups_encode) */
    CUtensorMap v_groups;             /* V likewise */
    CUtensorMap k_groups2, v_groups2; /* the second source's, flat chunks (k_groups_ok 3) */
    h90_tma_dims dims;
    int32_t tile;        /* keys per tile the maps' boxes were cut for: 128 or 176 */
    int32_t k_groups_ok; /* k_groups and v_groups are encoded: their h90_tma_dims.k_groups (1 NHD,
                            2 HND, 3 flat chunks), else 0 */
};

/* Encodes a map of `rank` dims of the cache's dtype over `base` (byte strides of dims 1..), in
 * the one form every map here takes: 128-byte swizzle (the wgmma layout), 256-byte L2
 * promotion, no interleave, zeros out of bounds. */
static bool
h90_encode_tiled(h90_encode_fn encode, CUtensorMap *map, const dk_attention_args *a,
                 const void *base, int rank, const cuuint64_t *gdim, const cuuint64_t *gstride,
                 const cuuint32_t *box)
{
    const cuuint32_t estride[5] = {1, 1, 1, 1, 1};
    const CUtensorMapDataType ty =
        a->dtype == DK_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return encode(map, ty, (cuuint32_t)rank, (void *)base, gdim, gstride, box, estride,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* Encodes one 4-d (per block) or 3-d (flat) map of `base`: dim 0 the head_size elements, then
 * the given extents and element strides (dims[0] fastest in memory), box 64 x box_rows on the
 * token dim (tok, 1-based) x 1. */
static bool
h90_encode(h90_encode_fn encode, CUtensorMap *map, const dk_attention_args *a, const void *base,
           int rank, const int64_t *extent, const int64_t *stride, int tok, int32_t box_rows)
{
    cuuint64_t gdim[4] = {(cuuint64_t)a->head_size, 0, 0, 0};
    cuuint64_t gstride[3] = {0, 0, 0};
    cuuint32_t box[4] = {64, 1, 1, 1};
    for (int k = 0; k + 1 < rank; k++) {
        if (stride[k] <= 0 || stride[k] * 2 >= ((int64_t)1 << 40) ||
            extent[k] > (int64_t)INT32_MAX) {
            return false;
        }
        gdim[k + 1] = (cuuint64_t)extent[k];
        gstride[k] = (cuuint64_t)(stride[k] * 2);
    }
    box[tok] = (cuuint32_t)box_rows;
    return h90_encode_tiled(encode, map, a, base, rank, gdim, gstride, box);
}

/* Elements from one token row of a cache to the next within a block (a one-token block's is
 * the block stride): a flat cache -- consecutive blocks' rows consecutive rows -- has
 * cache_stride_block == block_size * this. */
static int64_t
h90_row_stride(const dk_attention_args *a)
{
    return a->block_size == 1 ? a->cache_stride_block : a->cache_stride_token;
}

/* The K (or V) map of the per-chunk producer ("sm90-tma16"): a head-128 cache whose kv heads
 * are adjacent 128-element rows (vLLM's NHD layout, or one layer of a layer-strided one), as 5
 * dims -- 64 elements (one 64-dim half), 8 tokens, 2 * num_kv_heads halves (the kv head folded
 * into the half: 128 bytes apart either way), block_size / 8 groups of 8 tokens, block -- or a
 * contiguous HND cache with the kv head folded into the block instead (dims 64, 8, 2,
 * block_size / 8, num_blocks * num_kv_heads); returns the h90_tma_dims.k_groups it encoded
 * for, 0 for none.  One 64 x 8 x 2 x 2 box brings a 16-key chunk, both halves, as two 8-row
 * groups of both panels (2048 bytes a group: the K_GROUPS layout of h90_qk).  Random 16-key
 * tables then take 8 boxes per K or V tile instead of 16 per-half ones.  H200,
 * benchmarks/probe_gather.cu (one CTA per SM streaming random 16-key blocks, no math): 24.4
 * B/clk/SM with these boxes, 25.9 with cp.async, 20.0 with two boxes per block, 28.7 with flat
 * boxes over consecutive blocks, and 29.8 with K by these boxes and V by cp.async at once --
 * yet inside the kernel these boxes for both win (h90_produce_tma_groups): about 22 B/clk is
 * what 660 TFLOP/s needs, and cp.async takes issue slots from the consumers. */
static int32_t
h90_kgroups_encode(const dk_attention_args *a, CUtensorMap *map, const void *base)
{
    /* NHD: the kv head folded into the halves; HND: into the blocks */
    const int32_t layout = dk_attention_chunk_layout(a);
    if (layout == 0) {
        return 0;
    }
    const bool nhd = layout == 1;
    const int64_t bs = a->block_size;
    const h90_encode_fn encode = h90_encoder();
    if (encode == NULL) {
        return 0;
    }
    const cuuint64_t tok = (cuuint64_t)a->cache_stride_token * 2; /* bytes */
    const cuuint64_t gdim[5] = {
        64, 8, (cuuint64_t)(nhd ? 2 * a->num_kv_heads : 2), (cuuint64_t)(bs / 8),
        (cuuint64_t)(nhd ? a->num_blocks : a->num_blocks * a->num_kv_heads)};
    const cuuint64_t gstride[4] = {
        tok, 128, 8 * tok, (cuuint64_t)(nhd ? a->cache_stride_block : a->cache_stride_head) * 2};
    const cuuint32_t box[5] = {64, 8, 2, 2, 1};
    if (!h90_encode_tiled(encode, map, a, base, 5, gdim, gstride, box)) {
        return 0;
    }
    return nhd ? 1 : 2;
}

/* The per-chunk maps of dense_attention's vouched chunks (keys_consecutive & 2): each source
 * ([rows, num_kv_heads, 128] token rows, NHD) as one block of all its rows, so a chunk's
 * coordinates are its first row / 8 (h90_produce_tma_groups, FLAT); rows a multiple of 8
 * (the map then ends where the source does: a chunk half past it reads zeros) and under 2^31.
 * Returns 3 when all four maps are encoded, else 0. */
static int32_t
h90_kgroups_flat(const dk_attention_args *a, h90_maps *m)
{
    const bool two = a->key_cache2 != NULL;
    const int64_t bs = a->block_size;
    if (bs < 1 || a->num_blocks > (int64_t)INT32_MAX / bs) {
        return 0;
    }
    const int64_t rows1 = (two ? a->blocks2 : a->num_blocks) * bs;
    const int64_t rows2 = two ? (a->num_blocks - a->blocks2) * bs : 0;
    dk_attention_args one = *a;
    one.key_cache2 = NULL;
    one.value_cache2 = NULL;
    one.num_blocks = 1;
    one.bt_cols = 1;
    one.cache_stride_token = h90_row_stride(a); /* a one-token block's is the block stride */
    one.cache_stride_block = one.cache_stride_token * 8; /* never stepped: one block */
    const struct {
        const void *k, *v;
        int64_t rows;
        CUtensorMap *km, *vm;
    } src[2] = {{a->key_cache, a->value_cache, rows1, &m->k_groups, &m->v_groups},
                {two ? a->key_cache2 : a->key_cache, two ? a->value_cache2 : a->value_cache,
                 two ? rows2 : rows1, &m->k_groups2, &m->v_groups2}};
    for (int i = 0; i < 2; i++) {
        one.block_size = src[i].rows;
        if (src[i].rows < 8 || src[i].rows % 8 != 0 ||
            h90_kgroups_encode(&one, src[i].km, src[i].k) != 1 ||
            h90_kgroups_encode(&one, src[i].vm, src[i].v) != 1) {
            return 0;
        }
    }
    return 3;
}

/* How the warp-specialized kernel's producer brings a cache in. */
enum h90_producer {
    H90_CP_ASYNC, /* cp.async rows ("sm90-ws") */
    H90_TMA,      /* TMA boxes ("sm90-tma") */
    H90_TMA_RUNS, /* TMA boxes when enough tiles are runs of consecutive blocks, else cp.async */
    H90_TMA_ALL_RUNS, /* flat boxes when every tile is a run, else cp.async */
};

/* Encodes the tensor maps that suit this cache (the caller checked 16-byte chunks) into *m and
 * returns the producer they allow: per-block boxes for a power-of-two block_size of at least
 * H90T_MIN_BOX or one block of 128+ keys per row (dims 1..3 of those maps ordered by stride,
 * as m->dims records), plus the flat map of a flat cache of blocks under 128 keys (m->dims.flat);
 * smaller power-of-two blocks of a flat cache (at most 32 boxes per tile: one per lane) only
 * with enough runs (H90_TMA_RUNS), yet smaller ones flat boxes only and only when every tile is
 * a run (H90_TMA_ALL_RUNS; the launch checks the runs); cp.async otherwise (or when the driver
 * cannot encode maps). */
static h90_producer
h90_tma_maps_encode(const dk_attention_args *a, int32_t tile, h90_maps *m)
{
    const int64_t bs = a->block_size;
    /* power-of-two blocks: a tile never straddles two; one block per row (dense K/V): a tile
     * never leaves it, and the part of its last box past the block is TMA's zero fill */
    const bool pow2 = (bs & (bs - 1)) == 0;
    const bool one_block = a->bt_cols == 1 && bs >= 128;
    /* flat: consecutive blocks' rows are consecutive token rows (a tile of BN keys spans
     * several blocks only when bs < BN) */
    const int64_t row_stride = h90_row_stride(a);
    const bool flat = pow2 && bs < 128 && a->cache_stride_block == bs * row_stride &&
                      a->num_blocks <= (int64_t)INT32_MAX / bs;
    const bool small = flat && bs < H90T_MIN_BOX && (tile / bs) * (a->head_size / 64) <= 32;
    /* blocks too small for a box each (dense one-token blocks): flat boxes or nothing */
    const bool all_runs = flat && bs < H90T_MIN_BOX && !small;
    /* a second source (blocks blocks2 .. of key_cache2): flat boxes only, a tile from one */
    const bool two = a->key_cache2 != NULL;
    if (!((pow2 && bs >= H90T_MIN_BOX) || one_block || small || all_runs) || a->num_blocks < 1 ||
        (two && !(all_runs && a->blocks2 > 0 && a->blocks2 < a->num_blocks))) {
        return H90_CP_ASYNC;
    }
    const h90_encode_fn encode = h90_encoder();
    if (encode == NULL) {
        return H90_CP_ASYNC;
    }
    m->dims.flat = 0;
    m->dims.flat_only = 0;
    if (flat) {
        /* token rows and kv heads, by stride */
        const bool tok_first = row_stride <= a->cache_stride_head;
        const int64_t rows1 = (two ? a->blocks2 : a->num_blocks) * bs;
        const int64_t rows2 = (a->num_blocks - a->blocks2) * bs;
        const int64_t fx[2] = {tok_first ? rows1 : a->num_kv_heads,
                               tok_first ? a->num_kv_heads : rows1};
        const int64_t fx2[2] = {tok_first ? rows2 : a->num_kv_heads,
                                tok_first ? a->num_kv_heads : rows2};
        const int64_t fs[2] = {tok_first ? row_stride : a->cache_stride_head,
                               tok_first ? a->cache_stride_head : row_stride};
        const int tok = tok_first ? 1 : 2;
        if (h90_encode(encode, &m->flat_k, a, a->key_cache, 3, fx, fs, tok, tile) &&
            h90_encode(encode, &m->flat_v, a, a->value_cache, 3, fx, fs, tok, tile) &&
            (!two ||
             (h90_encode(encode, &m->flat_k2, a, a->key_cache2, 3, fx2, fs, tok, tile) &&
              h90_encode(encode, &m->flat_v2, a, a->value_cache2, 3, fx2, fs, tok, tile)))) {
            m->dims.flat = tok;
        }
        else if (small || all_runs) {
            return H90_CP_ASYNC; /* small boxes only pay with the flat map */
        }
    }
    if (all_runs) {
        m->dims.box = (int32_t)bs; /* the TMA producer, every tile one flat box per half */
        m->dims.flat_only = 1;
        return H90_TMA_ALL_RUNS;
    }
    /* 0: token within the block, 1: kv head, 2: block -- sorted by element stride */
    const int64_t stride[3] = {a->cache_stride_token, a->cache_stride_head, a->cache_stride_block};
    const int64_t extent[3] = {bs, a->num_kv_heads, a->num_blocks};
    int order[3] = {0, 1, 2};
    for (int i = 1; i < 3; i++) {
        for (int k = i; k > 0 && stride[order[k]] < stride[order[k - 1]]; k--) {
            const int t = order[k];
            order[k] = order[k - 1];
            order[k - 1] = t;
        }
    }
    int64_t sx[3], sst[3];
    for (int k = 0; k < 3; k++) {
        sx[k] = extent[order[k]];
        sst[k] = stride[order[k]];
        int32_t *slot = order[k] == 0   ? &m->dims.token
                        : order[k] == 1 ? &m->dims.head
                                        : &m->dims.block;
        *slot = k + 1;
    }
    m->dims.box = (int32_t)(bs < tile ? bs : tile);
    if (!h90_encode(encode, &m->k, a, a->key_cache, 4, sx, sst, m->dims.token, m->dims.box) ||
        !h90_encode(encode, &m->v, a, a->value_cache, 4, sx, sst, m->dims.token, m->dims.box)) {
        return H90_CP_ASYNC;
    }
    return small ? H90_TMA_RUNS : H90_TMA;
}

/* What the maps of a cache depend on: encoding costs microseconds of host time per map, and a
 * model's layers call with the same few caches again and again. */
struct h90_maps_key {
    const void *k, *v, *k2, *v2;
    int64_t block_size, num_blocks, blocks2, num_kv_heads, head_size, bt_cols_one;
    int64_t stride_token, stride_head, stride_block;
    int32_t dtype, tile, chunks;
};

#define H90_MAPS_CACHE 64 /* caches (layers) remembered per host thread */

/* h90_tma_maps_encode through a per-thread cache of the last H90_MAPS_CACHE caches' maps
 * (hashed by the K pointer).  A cache the maps cannot serve is remembered too. */
static h90_producer
h90_tma_maps(const dk_attention_args *a, int32_t tile, h90_maps *m)
{
    struct entry {
        h90_maps_key key;
        h90_maps maps;
        bool used;
        h90_producer producer;
    };
    static thread_local entry cache[H90_MAPS_CACHE];
    h90_maps_key key;
    memset(&key, 0, sizeof(key)); /* padding compares equal */
    key.k = a->key_cache;
    key.v = a->value_cache;
    key.block_size = a->block_size;
    key.num_blocks = a->num_blocks;
    key.num_kv_heads = a->num_kv_heads;
    key.head_size = a->head_size;
    key.bt_cols_one = a->bt_cols == 1;
    key.stride_token = a->cache_stride_token;
    key.stride_head = a->cache_stride_head;
    key.stride_block = a->cache_stride_block;
    key.dtype = (int32_t)a->dtype;
    key.tile = tile;
    key.chunks = (a->keys_consecutive & 2) != 0;
    key.k2 = a->key_cache2;
    key.v2 = a->value_cache2;
    key.blocks2 = a->key_cache2 != NULL ? a->blocks2 : 0;
    const uintptr_t p = (uintptr_t)a->key_cache;
    /* the tile in the hash: a cache's maps for 128- and 176-key tiles take different entries */
    entry &e = cache[(p >> 8 ^ p >> 20 ^ (uintptr_t)tile) % H90_MAPS_CACHE];
    if (!(e.used && memcmp(&e.key, &key, sizeof(key)) == 0)) {
        memset(&e.maps, 0, sizeof(e.maps));
        e.producer = h90_tma_maps_encode(a, tile, &e.maps);
        if (e.producer == H90_CP_ASYNC) {
            memset(&e.maps, 0, sizeof(e.maps)); /* dims.box 0, no flat map */
        }
        if ((a->keys_consecutive & 2) != 0) {
            e.maps.k_groups_ok = h90_kgroups_flat(a, &e.maps);
        }
        else {
            e.maps.k_groups_ok = h90_kgroups_encode(a, &e.maps.k_groups, a->key_cache);
            if (e.maps.k_groups_ok != 0 &&
                h90_kgroups_encode(a, &e.maps.v_groups, a->value_cache) != e.maps.k_groups_ok) {
                e.maps.k_groups_ok = 0;
            }
        }
        e.key = key;
        e.used = true;
    }
    *m = e.maps;
    return e.producer;
}

template <typename T, int ST, int D, int NC, int SV, int BN = 128, int VG = 0>
static cudaError_t
h90_launch_tma(const dk_attention_args *a, const h90_maps &m, int64_t head_group, float scale_log2,
               bool neg_q, bool q_vec, bool o_vec, cudaStream_t s)
{
    static volatile bool attr_set[ATTN_MAX_DEVICES];
    constexpr int BM = 64 * NC;
    /* Q, ST K and SV V slots of BN keys, alignment slack */
    const size_t smem = (size_t)BM * D * 2 + (size_t)(ST + SV) * BN * D * 2 + 1024;
    const cudaError_t e = attn_allow_smem(
        (const void *)attention_sm90_tma_kernel<T, ST, D, NC, SV, BN, VG>, smem, attr_set);
    if (e != cudaSuccess) {
        return e;
    }
    /* BM >= the caller's 128-row tiles: the grid fits whatever the caller checked */
    int64_t tiles_per_row = dk_cdiv(a->max_query_len, BM);
    bool sort_rows = a->num_rows >= 2 && a->num_rows <= ATTN_SORT_ROWS;
    const unsigned blocks = (unsigned)(a->num_heads * a->num_rows * tiles_per_row);
    /* 16-byte aligned output rows: the staged epilogue (h90_store_o_staged) */
    const int64_t es = 2;
    bool o16 = a->o_stride_dim == 1 && (uintptr_t)a->out % 16 == 0 &&
               (a->o_stride_token * es) % 16 == 0 && (a->o_stride_head * es) % 16 == 0;
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
                           (const void *)attention_sm90_tma_kernel<T, ST, D, NC, SV, BN, VG>,
                           dim3(blocks), dim3(128 * (NC + 1)), smem, s, args);
}

/* Whether a head-128 call takes 176-key tiles (FlashAttention-3's choice without a mask: each
 * tile's fixed costs -- the barrier waits, the row maxima's shuffles, O's rescale -- spread over
 * 37 % more keys; 2 K + 2 V stages of them and Q fill 209 KB): rows of at least
 * H90_WIDE_MIN_KEYS keys, and a cache whose tiles TMA can cut at any multiple of 176 keys --
 * one block per row, 16-key blocks of a flat cache (per-block boxes, 11 per tile, or flat boxes
 * over runs) or smaller ones whose rows dense_attention's caller vouched consecutive (flat
 * boxes only); the per-chunk producer (sm90-tma16) cuts 176-key tiles of any cache it takes,
 * which dk_cuda_attention_sm90 decides itself.  Two sources (dense joint tokens) keep 128: their
 * split point is a multiple of 128 keys.  Masked calls too since 176-key tiles take the late P V
 * wait (before, 24x16k causal in allocation order ran 642/638 TFLOP/s with 176 vs 644/642 with
 * 128): H200, interleaved A/B, two rounds, 128 -> 176: 24x16k causal in allocation order 625/653 ->
 * 644/659 TFLOP/s, block-causal chunks of 1560 in allocation order 583/583 -> 609/605, dense
 * 40x32760 causal 620/619 -> 630/614. */
static bool
h90_wide_tiles(const dk_attention_args *a)
{
    if (a->head_size != 128 || a->key_cache2 != NULL || a->max_seq_len < H90_WIDE_MIN_KEYS) {
        return false;
    }
    const int64_t bs = a->block_size;
    const bool one_block = a->bt_cols == 1 && bs >= 128;
    const bool flat = a->cache_stride_block == bs * h90_row_stride(a);
    const bool flat16 = bs == 16 && flat;
    /* smaller power-of-two blocks whose rows the caller vouched consecutive (dense K/V): flat
     * boxes of any length */
    const bool vouched = (a->keys_consecutive & 1) != 0 && flat && bs < 16 && (bs & (bs - 1)) == 0;
    return one_block || flat16 || vouched;
}

/* Head 128: two consumer warpgroups (128 query rows per CTA), two K/V stages (a third of each
 * does not fit in shared memory) and with 128-key tiles a third V stage (192 KB of tiles:
 * h90_produce_cp_async_groups copies K and V of a tile together once both slots are free, and
 * the extra V slot frees them one tile earlier; every producer's consumers wait for P V after
 * the softmax, which holds a V slot longer -- LATE_PV_WAIT in the kernel; 176-key tiles keep
 * two V slots and their TMA producer runs K a tile ahead of V, K_AHEAD); head 64: three
 * consumer warpgroups (192 rows) -- its smaller tiles leave registers for a third: 430 TFLOP/s
 * against 370 with two on the H200 at 1x16x16384x64 (bench_attention h16_s16k_d64_nc) -- and three
 * stages (2,538 vs 2,822 us there, same run).  Head 128 with TMA boxes takes 176-key tiles where
 * h90_wide_tiles says so. */
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
    if (a->head_size == 128) { /* a third V slot (see there) */
        return h90_launch_tma<T, H90T_STAGES, 128, 2, H90T_STAGES + 1>(a, m, head_group, scale_log2,
                                                                       neg_q, q_vec, o_vec, s);
    }
    return h90_launch_tma<T, H90T_STAGES + 1, 64, 3, H90T_STAGES + 1>(a, m, head_group, scale_log2,
                                                                      neg_q, q_vec, o_vec, s);
}

/* 1 when the current device is compute capability 9.x and this binary carries the kernel's
 * sm_90a code (a build without that target would run the trapping stub), cached per device;
 * the kernel choice sm80 (DIFFKV_ATTENTION_KERNEL=sm80 or set_attention_kernel("sm80")) turns
 * it off. */
extern "C" int
dk_cuda_attention_sm90_ready(void)
{
    static volatile int state[ATTN_MAX_DEVICES]; /* 0 unknown, 1 yes, 2 no */
    if (dk_attention_kernel_choice() == DK_KERNEL_SM80) {
        return 0;
    }
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        return 0;
    }
    const bool cached = dev >= 0 && dev < ATTN_MAX_DEVICES;
    if (cached && state[dev] != 0) {
        return state[dev] == 1;
    }
    int major = 0;
    cudaFuncAttributes attr;
    memset(&attr, 0, sizeof(attr));
    int ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        major == 9 &&
        cudaFuncGetAttributes(&attr, attention_sm90_kernel<__nv_bfloat16, 128>) == cudaSuccess &&
        attr.binaryVersion == 90 && attr.ptxVersion == 90;
    if (cached) {
        state[dev] = ok ? 1 : 2;
    }
    return ok;
}

extern "C" int
dk_cuda_attention_sm90_tma_ready(void)
{
    return dk_cuda_attention_sm90_ready() && h90_ws_allowed() && h90_encoder() != NULL;
}

extern "C" dk_status
dk_cuda_attention_sm90(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group,
                       float scale_log2, bool neg_q, bool q_vec, bool kv_vec, bool o_vec,
                       void *stream, dk_error *err)
{
    const bool bf16 = a->dtype == DK_BF16;
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t e;
    h90_maps m;
    const char *kernel = "sm90";
    if (kv_vec && h90_ws_allowed()) {
        /* TMA boxes when the cache suits them, else the cp.async producer (box 0) */
        const int32_t tile = h90_wide_tiles(a) ? 176 : 128;
        h90_producer pr = h90_tma_maps(a, tile, &m);
        m.tile = tile;
        if (m.k_groups_ok != 0) {
            /* Head 128, 16-key chunks within blocks, a layout the 5-d maps fold (NHD, HND,
             * layer-strided): one box per chunk for K and for V, in any block order, cut into
             * 176-key tiles over long rows.  It beats every other producer there (H200,
             * interleaved A/B, ratios to cuDNN): random 16-key tables 0.93 -> 1.01-1.04
             * (the mixed K-TMA/V-cp.async producer before), allocation order 0.99 -> 1.01
             * (flat boxes), 128-key blocks 0.94 -> 1.02 (a 4-d map's per-half boxes). */
            memset(&m.dims, 0, sizeof(m.dims));
            m.k = m.k_groups;
            m.v = m.v_groups;
            m.flat_k2 = m.k_groups2; /* VG 2's second source (tfk2 / tfv2) */
            m.flat_v2 = m.v_groups2;
            m.dims.k_groups = m.k_groups_ok;
            m.tile = a->max_seq_len >= H90_WIDE_MIN_KEYS ? 176 : 128;
            kernel = "sm90-tma16";
        }
        else {
            /* Head 64 takes 16-key blocks through the block-group cp.async producer even
             * when their tiles are runs: it beats the 128-row flat boxes there (H200,
             * 1x16x16384x64, allocation order: 398-415 vs 374-377 TFLOP/s non-causal, 426
             * vs 412-416 causal). */
            const bool cp_d64 = pr == H90_TMA_RUNS && a->head_size == 64 && a->block_size >= 16;
            if (cp_d64 || (pr == H90_TMA_RUNS && a->table_runs < H90T_MIN_RUNS) ||
                (pr == H90_TMA_ALL_RUNS && a->table_runs < 1000)) {
                memset(&m.dims, 0, sizeof(m.dims)); /* box 0, 128-key tiles, no flat map */
                m.tile = 0;
                pr = H90_CP_ASYNC;
            }
            kernel = pr == H90_CP_ASYNC ? "sm90-ws" : "sm90-tma";
        }
        e = bf16
                ? h90_launch_ws<__nv_bfloat16>(a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s)
                : h90_launch_ws<__half>(a, m, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    }
    else if (a->head_size == 64) {
        e = bf16 ? h90_launch<__nv_bfloat16, 64>(a, tiles_per_row, head_group, scale_log2, neg_q,
                                                 q_vec, kv_vec, o_vec, s)
                 : h90_launch<__half, 64>(a, tiles_per_row, head_group, scale_log2, neg_q, q_vec,
                                          kv_vec, o_vec, s);
    }
    else {
        e = bf16 ? h90_launch<__nv_bfloat16, 128>(a, tiles_per_row, head_group, scale_log2, neg_q,
                                                  q_vec, kv_vec, o_vec, s)
                 : h90_launch<__half, 128>(a, tiles_per_row, head_group, scale_log2, neg_q, q_vec,
                                           kv_vec, o_vec, s);
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* reported here: not the next call's error */
        return dk_fail(err, DK_ERR_CUDA, "paged_attention(): CUDA error %s (%d)",
                       cudaGetErrorString(e), (int)e);
    }
    dk_cuda_attention_note(kernel);
    return dk_cuda_after_launch("paged_attention()", stream, err);
}
