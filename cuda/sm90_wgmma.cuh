/*
 * sm90_wgmma.cuh -- the Hopper (sm_90a) primitives of the wgmma kernels, as inline PTX: the
 * warpgroup MMAs (wgmma.mma_async, one function per shape and type, and h90_mma<T> choosing
 * among them), their shared-memory matrix descriptors, fences and waits, named barriers,
 * shared-memory loads and stores by address, and setmaxnreg's register hand-over between a
 * producer and its consumers.  The companion sm90_async.cuh holds the asynchronous copies
 * (mbarriers, TMA).
 *
 * H90_DEVICE_CODE is defined where these instructions exist (the sm_90a pass of nvcc); every
 * device function here and in the sm90_*.cuh headers is compiled only there, and the kernels
 * built from them are trapping stubs elsewhere.  Everything is static (each translation unit
 * gets its own copy).
 */
#ifndef DIFFKV_SM90_WGMMA_CUH
#define DIFFKV_SM90_WGMMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdint.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define H90_DEVICE_CODE 1
#endif

#ifdef H90_DEVICE_CODE
/* wgmma shared-memory matrix descriptor: start address, leading and stride byte offsets (all
 * in 16-byte units), 128-byte swizzle. */
static __device__ __forceinline__ uint64_t
wgmma_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((saddr >> 4) & 0x3FFFu) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

/* Orders this warpgroup's register and shared-memory accesses before the wgmma issued next. */
static __device__ __forceinline__ void
wgmma_fence(void)
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

/* Closes the group of wgmma issued since the last commit. */
static __device__ __forceinline__ void
wgmma_commit(void)
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/* Waits until every committed wgmma group of this warpgroup has completed. */
static __device__ __forceinline__ void
wgmma_wait_all(void)
{
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

/* Waits until at most the last committed wgmma group is still running. */
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

template <int N>
static __device__ __forceinline__ void
fence_regs(uint32_t (&r)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++) {
        asm volatile("" : "+r"(r[i])::"memory");
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

/* ---- wgmma instructions: one asm per shape and type, from the macros below ---- */
/* The accumulator operands d[0 .. N/2) ("+f") and their register list "{%0, ..., %N/2-1}". */
#define H90_D8(i)                                                                                  \
    "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]),          \
        "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define H90_D32 H90_D8(0), H90_D8(8), H90_D8(16), H90_D8(24)
#define H90_D64 H90_D32, H90_D8(32), H90_D8(40), H90_D8(48), H90_D8(56)
#define H90_D88 H90_D64, H90_D8(64), H90_D8(72), H90_D8(80)
#define H90_D4(i) "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define H90_D16 H90_D8(0), H90_D8(8)
#define H90_D36 H90_D32, H90_D4(32)
#define H90_D40 H90_D32, H90_D8(32)
#define H90_D48 H90_D40, H90_D8(40)
#define H90_D56 H90_D48, H90_D8(48)
#define H90_D68 H90_D64, H90_D4(64)
#define H90_D80 H90_D64, H90_D8(64), H90_D8(72)
#define H90_D96 H90_D88, H90_D8(88)
#define H90_D128 H90_D88, H90_D8(88), H90_D8(96), H90_D8(104), H90_D8(112), H90_D8(120)
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
#define H90_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define H90_R36 "{" H90_R32_BODY ", %32, %33, %34, %35}"
#define H90_R40 "{" H90_R32_BODY ", %32, %33, %34, %35, %36, %37, %38, %39}"
#define H90_R48                                                                                    \
    "{" H90_R32_BODY                                                                               \
    ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define H90_R56                                                                                    \
    "{" H90_R32_BODY                                                                               \
    ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, "      \
    "%49, %50, %51, %52, %53, %54, %55}"
#define H90_R68                                                                                    \
    "{" H90_R32_BODY                                                                               \
    ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, "      \
    "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, "        \
    "%66, %67}"
#define H90_R80                                                                                    \
    "{" H90_R32_BODY                                                                               \
    ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, "      \
    "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, "        \
    "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}"
#define H90_R96                                                                                    \
    "{" H90_R32_BODY                                                                               \
    ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, "      \
    "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, "        \
    "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, "        \
    "%83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define H90_R128                                                                                   \
    "{" H90_R32_BODY ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "    \
    "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "   \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "   \
    "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, "   \
    "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, "   \
    "%115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

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

/* d (m64 x N) = A B + (scale_d ? d : 0), A (m64 x k16) from registers, B from shared memory
 * transposed (MN-major: P V, V's rows of dims).  IA0: the operand number of a[0] (a[1..3]
 * follow), IB of desc_b, IP of scale_d. */
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
H90_WGMMA_SS(wgmma_ss_m64n80_bf16, 80, "bf16", H90_R40, H90_D40, "%40", "%41", "%42")
H90_WGMMA_SS(wgmma_ss_m64n80_f16, 80, "f16", H90_R40, H90_D40, "%40", "%41", "%42")
H90_WGMMA_SS(wgmma_ss_m64n112_bf16, 112, "bf16", H90_R56, H90_D56, "%56", "%57", "%58")
H90_WGMMA_SS(wgmma_ss_m64n112_f16, 112, "f16", H90_R56, H90_D56, "%56", "%57", "%58")
H90_WGMMA_RS(wgmma_rs_m64n32_bf16, 32, "bf16", H90_R16, H90_D16, "%16", "%17", "%18", "%19", "%20",
             "%21")
H90_WGMMA_RS(wgmma_rs_m64n32_f16, 32, "f16", H90_R16, H90_D16, "%16", "%17", "%18", "%19", "%20",
             "%21")
H90_WGMMA_RS(wgmma_rs_m64n72_bf16, 72, "bf16", H90_R36, H90_D36, "%36", "%37", "%38", "%39", "%40",
             "%41")
H90_WGMMA_RS(wgmma_rs_m64n72_f16, 72, "f16", H90_R36, H90_D36, "%36", "%37", "%38", "%39", "%40",
             "%41")
H90_WGMMA_RS(wgmma_rs_m64n80_bf16, 80, "bf16", H90_R40, H90_D40, "%40", "%41", "%42", "%43", "%44",
             "%45")
H90_WGMMA_RS(wgmma_rs_m64n80_f16, 80, "f16", H90_R40, H90_D40, "%40", "%41", "%42", "%43", "%44",
             "%45")
H90_WGMMA_RS(wgmma_rs_m64n96_bf16, 96, "bf16", H90_R48, H90_D48, "%48", "%49", "%50", "%51", "%52",
             "%53")
H90_WGMMA_RS(wgmma_rs_m64n96_f16, 96, "f16", H90_R48, H90_D48, "%48", "%49", "%50", "%51", "%52",
             "%53")
H90_WGMMA_RS(wgmma_rs_m64n160_bf16, 160, "bf16", H90_R80, H90_D80, "%80", "%81", "%82", "%83",
             "%84", "%85")
H90_WGMMA_RS(wgmma_rs_m64n160_f16, 160, "f16", H90_R80, H90_D80, "%80", "%81", "%82", "%83", "%84",
             "%85")
H90_WGMMA_RS(wgmma_rs_m64n192_bf16, 192, "bf16", H90_R96, H90_D96, "%96", "%97", "%98", "%99",
             "%100", "%101")
H90_WGMMA_RS(wgmma_rs_m64n192_f16, 192, "f16", H90_R96, H90_D96, "%96", "%97", "%98", "%99", "%100",
             "%101")
H90_WGMMA_RS(wgmma_rs_m64n256_bf16, 256, "bf16", H90_R128, H90_D128, "%128", "%129", "%130", "%131",
             "%132", "%133")
H90_WGMMA_RS(wgmma_rs_m64n256_f16, 256, "f16", H90_R128, H90_D128, "%128", "%129", "%130", "%131",
             "%132", "%133")
H90_WGMMA_RS(wgmma_rs_m64n128_bf16, 128, "bf16", H90_R64, H90_D64, "%64", "%65", "%66", "%67",
             "%68", "%69")
H90_WGMMA_RS(wgmma_rs_m64n128_f16, 128, "f16", H90_R64, H90_D64, "%64", "%65", "%66", "%67", "%68",
             "%69")
H90_WGMMA_RS(wgmma_rs_m64n64_bf16, 64, "bf16", H90_R32, H90_D32, "%32", "%33", "%34", "%35", "%36",
             "%37")
H90_WGMMA_RS(wgmma_rs_m64n64_f16, 64, "f16", H90_R32, H90_D32, "%32", "%33", "%34", "%35", "%36",
             "%37")

/* The e4m3 forms (m64nNk32, fp32 accumulators): both operands K-major -- wgmma has no
 * transposed 8-bit operand, so V comes in transposed (attention_sm90_fp8.cuh) -- and no
 * transpose immediates.  SS: d = A B + (scale_d ? d : 0) from two descriptors; RS: d += A B,
 * A (m64 x k32) from registers (4 bytes per register, the lowest byte the lowest k). */
#define H90_WGMMA_SS8(NAME, N, REGS, OUTS, IA, IB, IP)                                             \
    static __device__ __forceinline__ void NAME(float(&d)[(N) / 2], uint64_t desc_a,               \
                                                uint64_t desc_b, int scale_d)                      \
    {                                                                                              \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " IP ", 0;\n"                               \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS ", " IA      \
                     ", " IB ", p, 1, 1;\n}\n"                                                     \
                     : OUTS                                                                        \
                     : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                    \
    }
#define H90_WGMMA_RS8(NAME, N, REGS, OUTS, IA0, IA1, IA2, IA3, IB, IP)                             \
    static __device__ __forceinline__ void NAME(float(&d)[(N) / 2], const uint32_t(&a)[4],         \
                                                uint64_t desc_b, int scale_d)                      \
    {                                                                                              \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " IP ", 0;\n"                               \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS ", {" IA0    \
                     ", " IA1 ", " IA2 ", " IA3 "}, " IB ", p, 1, 1;\n}\n"                         \
                     : OUTS                                                                        \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));     \
    }

H90_WGMMA_SS8(wgmma_ss_m64n128_e4m3, 128, H90_R64, H90_D64, "%64", "%65", "%66")
H90_WGMMA_RS8(wgmma_rs_m64n128_e4m3, 128, H90_R64, H90_D64, "%64", "%65", "%66", "%67", "%68",
              "%69")
H90_WGMMA_RS8(wgmma_rs_m64n64_e4m3, 64, H90_R32, H90_D32, "%32", "%33", "%34", "%35", "%36", "%37")
H90_WGMMA_RS8(wgmma_rs_m64n136_e4m3, 136, H90_R68, H90_D68, "%68", "%69", "%70", "%71", "%72",
              "%73")
H90_WGMMA_RS8(wgmma_rs_m64n72_e4m3, 72, H90_R36, H90_D36, "%36", "%37", "%38", "%39", "%40", "%41")

/* S (m64 x 128) += A B in e4m3 with f16 accumulators, A from registers: register 2 nt + hf holds
 * row g + 8 hf, columns 8 nt + 2 tq (low half) and + 1 (high half) -- the fp32 form's pairs. */
#define H90_U8(i)                                                                                  \
    "+r"(d[(i)]), "+r"(d[(i) + 1]), "+r"(d[(i) + 2]), "+r"(d[(i) + 3]), "+r"(d[(i) + 4]),          \
        "+r"(d[(i) + 5]), "+r"(d[(i) + 6]), "+r"(d[(i) + 7])
static __device__ __forceinline__ void
wgmma_rs_m64n128_e4m3_f16(uint32_t (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f16.e4m3.e4m3 " H90_R32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : H90_U8(0), H90_U8(8), H90_U8(16), H90_U8(24)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

static __device__ __forceinline__ void
wgmma_rs_m64n256_e4m3_f16(uint32_t (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k32.f16.e4m3.e4m3 " H90_R64
                 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : H90_U8(0), H90_U8(8), H90_U8(16), H90_U8(24), H90_U8(32), H90_U8(40), H90_U8(48),
                   H90_U8(56)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}
/* S (m64 x N) += Q K^T k-step, f16 accumulators: N = 2 x the registers. */
static __device__ __forceinline__ void
wgmma_rs_e4m3_f16(uint32_t (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d)
{
    wgmma_rs_m64n128_e4m3_f16(d, a, desc_b, scale_d);
}
static __device__ __forceinline__ void
wgmma_rs_e4m3_f16(uint32_t (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d)
{
    wgmma_rs_m64n256_e4m3_f16(d, a, desc_b, scale_d);
}

/* O (m64 x D + 8) += P V in e4m3, D 128 or 64: 8 columns past the head dims
 * (attention_sm90_fp8.cuh: V^T's row of ones, so that O's column D is P's row sum). */
static __device__ __forceinline__ void
h90_pv_e4m3(float (&o)[68], const uint32_t (&p)[4], uint64_t b)
{
    wgmma_rs_m64n136_e4m3(o, p, b, 1);
}
static __device__ __forceinline__ void
h90_pv_e4m3(float (&o)[36], const uint32_t (&p)[4], uint64_t b)
{
    wgmma_rs_m64n72_e4m3(o, p, b, 1);
}

/* S (m64 x N keys) = Q K^T (+ S) and O (m64 x D) += P V for element type T, one overload per
 * wgmma shape (by the accumulators' count, N / 2): qk for the key tiles of 64, 80, 112, 128 and
 * 176 keys (Q from shared memory), pv for every head size's O (N = 32 .. 256). */
template <typename T> struct h90_mma;

#define H90_QK(N, TY)                                                                              \
    static __device__ __forceinline__ void qk(float(&s)[(N) / 2], uint64_t a, uint64_t b, int acc) \
    {                                                                                              \
        wgmma_ss_m64n##N##_##TY(s, a, b, acc);                                                     \
    }
#define H90_PV(N, TY)                                                                              \
    static __device__ __forceinline__ void pv(float(&o)[(N) / 2], const uint32_t(&p)[4],           \
                                              uint64_t b)                                          \
    {                                                                                              \
        wgmma_rs_m64n##N##_##TY(o, p, b, 1);                                                       \
    }
#define H90_MMA(TY)                                                                                \
    H90_QK(64, TY)                                                                                 \
    H90_QK(128, TY)                                                                                \
    H90_QK(176, TY)                                                                                \
    H90_QK(80, TY)                                                                                 \
    H90_QK(112, TY)                                                                                \
    H90_PV(32, TY)                                                                                 \
    H90_PV(64, TY)                                                                                 \
    H90_PV(72, TY)                                                                                 \
    H90_PV(80, TY)                                                                                 \
    H90_PV(96, TY)                                                                                 \
    H90_PV(128, TY)                                                                                \
    H90_PV(160, TY)                                                                                \
    H90_PV(192, TY)                                                                                \
    H90_PV(256, TY)

template <> struct h90_mma<__nv_bfloat16> {
    H90_MMA(bf16)
};
template <> struct h90_mma<__half> {
    H90_MMA(f16)
};
#undef H90_QK
#undef H90_QKR
#undef H90_PV
#undef H90_MMA

#undef H90_D8
#undef H90_D32
#undef H90_D64
#undef H90_D88
#undef H90_D128
#undef H90_D4
#undef H90_D16
#undef H90_D36
#undef H90_D40
#undef H90_D48
#undef H90_D56
#undef H90_D80
#undef H90_D96
#undef H90_R32_BODY
#undef H90_R32
#undef H90_R64
#undef H90_R88
#undef H90_R128
#undef H90_R16
#undef H90_R36
#undef H90_R40
#undef H90_R48
#undef H90_R56
#undef H90_R80
#undef H90_R96
#undef H90_WGMMA_SS
#undef H90_WGMMA_RS
#undef H90_WGMMA_SS8
#undef H90_WGMMA_RS8

/* Registers after setmaxnreg: the producer warpgroup keeps PRODUCER, the consumer warpgroups
 * take the rest of what the CTA was launched with -- 168 per thread at 384 threads, 64,512; a
 * consumer asking for more than is free waits in setmaxnreg forever (multiples of 8 each):
 * 56 / 224 with two consumers and 128-key tiles, 24 / 240 with 176-key tiles (S, P and O of a
 * warpgroup: 88 + 44 + 64 registers per thread; only the TMA producer, one warp, runs with 24),
 * 32 / 160 with three (128 per thread at 512 threads).  NC: the consumer warpgroups; the pool
 * is the launch's count per thread (65,536 over the CTA's threads, down to a multiple of 8)
 * times NC + 1 warpgroups -- 504 at 384 threads, not 512: 32 / 240 there hangs. */
template <int PRODUCER, int CONSUMER, int NC> struct h90_ws_regs {
    static_assert(PRODUCER % 8 == 0 && CONSUMER % 8 == 0, "setmaxnreg takes multiples of 8");
    static_assert(
        PRODUCER + NC * CONSUMER <= 65536 / (128 * (NC + 1)) / 8 * 8 * (NC + 1),
        "setmaxnreg: the warpgroups ask for more registers than the CTA was launched with");
    static __device__ __forceinline__ void producer()
    {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER) : "memory");
    }
    static __device__ __forceinline__ void consumer()
    {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER) : "memory");
    }
};

#endif /* H90_DEVICE_CODE */

#endif /* DIFFKV_SM90_WGMMA_CUH */
