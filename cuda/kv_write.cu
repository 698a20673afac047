/*
 * kv_write.cu -- the K/V scatter into the paged cache on the GPU (dk_kv_write_args in
 * diffkv.h): cache[slot / block_size][slot % block_size][h][:] = src[t][h][:] for the key and
 * the value of every token whose slot is >= 0 (a slot at or past num_blocks * block_size is
 * skipped too: the caller range-checks slots, the kernel never writes outside the cache).
 * A bit copy, so fp32/fp16/bf16 share the kernels:
 *   - kv_write_vec_kernel<KV_COPY> when every address is 16-byte aligned and the dim strides
 *     are 1 (checked on the host): 16-byte units, several tokens per thread with all loads issued
 *     before the stores, K and V of a unit in the same thread;
 *   - kv_write_kernel otherwise: one element at a time with any strides.
 *
 * A float8_e4m3fn cache (cache_dtype DK_F8E4M3) stores each element quantized, x / scale in
 * fp32 rounded to e4m3 (dk_f32_to_e4m3's rounding, bit for bit):
 *   - kv_write_wide_kernel<DT> for 16-bit inputs whose heads are multiples of 16 elements
 *     and whose cache side is 16-byte aligned: two 16-byte loads per 16-byte store;
 *     kv_write_vec_kernel<DT> under the fast path's other conditions (the cache side
 *     aligned to its units of 16 / element-size bytes): 16-byte loads, 8- or 4-byte stores;
 *     both take the quotient from the scale's reciprocal and two exact residual steps
 *     (quotient_e4m3: no division);
 *   - kv_write_fp8_kernel otherwise: one element at a time with any strides.
 *
 * The dense forward's fp8 rounding of its keys and values (dk_cuda_quantize_kv): kv_amax_kernel
 * takes the largest magnitude of the keys and of the values (atomicMax on the fp32 bits),
 * kv_amax_scales_kernel turns both into scales, then the fp8 writes above store each pair into
 * its outputs (no slot mapping: token t into row t).
 *
 * Entry points: dk_cuda_kv_write, dk_cuda_kv_write_prepare (the launch described, for
 * dk_cuda_layer: cuda/launch.cu), dk_cuda_quantize_kv.
 */
#include "diffkv.h"

#include "cuda_common.cuh"

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#define KV_WRITE_MAX_THREADS 256
/* kv_write_vec_kernel's OUT for a cache of the inputs' dtype (no dk_dtype is negative) */
#define KV_COPY (-1)
/* Tokens one thread of the fast path moves per unit: its 2 * KV_WRITE_TOKENS 16-byte loads
 * (K and V) are all in flight before the first store, 128 bytes per thread, enough to cover
 * HBM latency at a modest occupancy (one unit per thread did not: docs/performance.md, KV
 * write). */
#define KV_WRITE_TOKENS 4
/* The same for kv_write_wide_kernel<DT>, whose units are twice as wide: one token, 64 bytes in
 * flight per thread -- fewer registers, more CTAs per SM; 2 and 4 tokens measured slower
 * (docs/fp8.md, *The quantizing write's bandwidth*). */
#define KV_WRITE_TOKENS_WIDE 1
/* kv_write_wide_kernel's CTA size and the CTAs per SM its registers must leave room for (12 x
 * 128 threads: at most 40 registers a thread).  Smaller CTAs split rows of 256+ units into
 * passes, and more of them fit an SM; both measured faster (docs/fp8.md). */
#define KV_WRITE_WIDE_THREADS 128
#define KV_WRITE_WIDE_CTAS 12

/*
 * Strided fallback.  One block per token; its threads walk the (tensor, head, unit) items of
 * the token, where a unit is one U (one element) and a head holds units_per_head of them.
 * elems_per_unit = sizeof(U) / element size; the dim stride is 1 whenever it is > 1.
 */
template <typename U>
static __global__ void
kv_write_kernel(const dk_kv_write_args a, int64_t elem_size, int32_t units_per_head,
                int32_t elems_per_unit)
{
    int64_t t = blockIdx.x;
    int64_t slot = a.slot_mapping ? a.slot_mapping[t * a.slot_stride] : t;
    if (slot < 0 || slot >= a.num_blocks * a.block_size) {
        return;
    }
    int64_t blk = slot / a.block_size;
    int64_t off = slot % a.block_size;
    int64_t cache_base = blk * a.cache_stride_block + off * a.cache_stride_token;
    int32_t per_tensor = (int32_t)a.num_kv_heads * units_per_head;
    for (int32_t i = (int32_t)threadIdx.x; i < 2 * per_tensor; i += (int32_t)blockDim.x) {
        bool is_value = i >= per_tensor;
        int32_t r = is_value ? i - per_tensor : i;
        int64_t h = r / units_per_head;
        int64_t d = (int64_t)(r % units_per_head) * elems_per_unit;
        const char *src;
        char *dst;
        if (is_value) {
            src = (const char *)a.value +
                  (t * a.value_stride_token + h * a.value_stride_head + d * a.value_stride_dim) *
                      elem_size;
            dst = (char *)a.value_cache;
        }
        else {
            src =
                (const char *)a.key +
                (t * a.key_stride_token + h * a.key_stride_head + d * a.key_stride_dim) * elem_size;
            dst = (char *)a.key_cache;
        }
        dst += (cache_base + h * a.cache_stride_head + d * a.cache_stride_dim) * elem_size;
        *(U *)dst = *(const U *)src;
    }
}

/* x / scale as float8_e4m3fn, bit for bit dk_f32_to_e4m3(x / scale): the IEEE division with
 * subnormals (div.rn.f32 itself: --use_fast_math would make __fdiv_rn flush them to zero, and
 * a subnormal input over a tiny scale can land in e4m3's range), then round to nearest even
 * saturating at +-448; a NaN keeps its sign (0x7F / 0xFF), as torch's conversion gives it. */
static __device__ __forceinline__ uint8_t
quantize_e4m3(float x, float scale)
{
    float q;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(x), "f"(scale));
    if (isnan(q)) {
        return (uint8_t)(0x7Fu | ((__float_as_uint(q) >> 24) & 0x80u));
    }
    return (uint8_t)__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
}

/* Element j of a 16-byte unit of DT (DK_F32, DK_F16 or DK_BF16) values, as fp32. */
template <int DT>
static __device__ __forceinline__ float
unit_element(const uint4 &u, int j)
{
    if (DT == DK_F32) {
        return __uint_as_float((&u.x)[j]);
    }
    const uint16_t bits = (uint16_t)((&u.x)[j / 2] >> (16 * (j % 2)));
    if (DT == DK_BF16) {
        return __uint_as_float((uint32_t)bits << 16);
    }
    return __half2float(__ushort_as_half(bits));
}

/* Element src[i] of DT values as fp32. */
template <int DT>
static __device__ __forceinline__ float
load_element(const char *src, int64_t i)
{
    if (DT == DK_F32) {
        return ((const float *)src)[i];
    }
    const uint16_t bits = ((const uint16_t *)src)[i];
    if (DT == DK_BF16) {
        return __uint_as_float((uint32_t)bits << 16);
    }
    return __half2float(__ushort_as_half(bits));
}

/* The scales the vec kernel divides by with quotient_e4m3 instead of quantize_e4m3's
 * division: within them 1 / scale is a normal number and the residuals below are exact. */
#define KV_FAST_SCALE_MIN 0x1p-64f
#define KV_FAST_SCALE_MAX 0x1p64f

/* RN(1 / scale) when scale is within [KV_FAST_SCALE_MIN, KV_FAST_SCALE_MAX], else 0 (the vec
 * kernel then divides). */
static __device__ __forceinline__ float
fast_reciprocal(float scale)
{
    float r;
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(scale));
    return scale >= KV_FAST_SCALE_MIN && scale <= KV_FAST_SCALE_MAX ? r : 0.0f;
}

/* RN(x / scale) as far as its e4m3 rounding can tell, from neg_scale = -scale and
 * r = RN(1 / scale): q0 = x * r is
 * within 1.5 ulp of x / scale; one residual step (x - q0 * scale is exact in an fma) brings it
 * within 1 ulp, and a second gives the correctly rounded quotient (Markstein's theorem: r
 * correctly rounded, the quotient within 1 ulp, no underflow -- the scale's range above keeps
 * every quotient that e4m3 does not flush to zero out of it).  Where |q0| >= 1024 (saturated
 * to 448 either way, or inf, or NaN: x * r is a NaN only for a NaN x) q0 itself is returned,
 * so the residuals never see an infinity.  The sign is x's: the residual steps would turn
 * -0 / scale into +0.  Non-ftz PTX, as --use_fast_math would flush the subnormal residuals. */
static __device__ __forceinline__ float
quotient_e4m3(float x, float neg_scale, float r)
{
    float q0, e, q1, q2;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(q0) : "f"(x), "f"(r));
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(e) : "f"(q0), "f"(neg_scale), "f"(x));
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(q1) : "f"(e), "f"(r), "f"(q0));
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(e) : "f"(q1), "f"(neg_scale), "f"(x));
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(q2) : "f"(e), "f"(r), "f"(q1));
    return fabsf(q0) < 1024.0f ? copysignf(q2, x) : q0;
}

/* Two fp32 quotients as e4m3 bytes, a in the low byte: saturating round to nearest even, a
 * NaN as 0x7F (the GPU's quotients carry no NaN sign).  One conversion for both on sm_89+. */
static __device__ __forceinline__ uint32_t
pack_e4m3x2(float a, float b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint16_t d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(b), "f"(a));
    return d;
#else
    return (uint32_t)__nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E4M3) |
           (uint32_t)__nv_cvt_float_to_fp8(b, __NV_SATFINITE, __NV_E4M3) << 8;
#endif
}

/* A 16-byte unit of DT values quantized with scale (recip = fast_reciprocal(scale)): element j
 * at byte j of the result, 16 / sizeof(DT) bytes (8, or 4 in .x for fp32). */
template <int DT>
static __device__ __forceinline__ uint2
quantize_unit(const uint4 &unit, float scale, float recip)
{
    constexpr int E = DT == DK_F32 ? 4 : 8;
    uint32_t q[2] = {0, 0};
    if (recip != 0.0f) {
#pragma unroll
        for (int j = 0; j < E; j += 2) {
            const float a = quotient_e4m3(unit_element<DT>(unit, j), -scale, recip);
            const float b = quotient_e4m3(unit_element<DT>(unit, j + 1), -scale, recip);
            q[j / 4] |= pack_e4m3x2(a, b) << (8 * (j % 4));
        }
    }
    else {
#pragma unroll
        for (int j = 0; j < E; j++) {
            q[j / 4] |= (uint32_t)quantize_e4m3(unit_element<DT>(unit, j), scale) << (8 * (j % 4));
        }
    }
    return make_uint2(q[0], q[1]);
}

/* W 16-byte input units of the vec kernel into the cache at dst: as they are (OUT == KV_COPY,
 * W == 1, 16 bytes), or quantized with scale from DT = OUT values, W * 16 / sizeof(DT) bytes
 * (W == 2 only for 16-bit DT: one 16-byte store). */
template <int OUT, int W>
static __device__ __forceinline__ void
store_unit(char *dst, const uint4 *unit, float scale, float recip)
{
    if constexpr (OUT == KV_COPY) {
        *(uint4 *)dst = unit[0];
    }
    else if constexpr (W == 2) {
        const uint2 lo = quantize_unit<OUT>(unit[0], scale, recip);
        const uint2 hi = quantize_unit<OUT>(unit[1], scale, recip);
        *(uint4 *)dst = make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
    else if constexpr (OUT == DK_F32) {
        *(uint32_t *)dst = quantize_unit<OUT>(unit[0], scale, recip).x;
    }
    else {
        *(uint2 *)dst = quantize_unit<OUT>(unit[0], scale, recip);
    }
}

/*
 * Fast path: units of W 16-byte loads (W * elems_per_unit elements), dim strides 1, all
 * addresses 16-byte aligned.  A CTA is blockDim.y token lanes x blockDim.x unit columns and
 * owns the tile of blockDim.y * TOK consecutive tokens starting at blockIdx.x * tile; lane y
 * moves tokens y, y + blockDim.y, ... of the tile.  A thread walks the num_kv_heads *
 * units_per_head units of a token row in steps of blockDim.x (a single step whenever the row
 * fits the CTA) and moves the same unit of K and of V.  It loads every one of its tokens' units
 * first (key/value are read-only here, hence the non-coherent path), then stores those whose
 * slot is in the cache.  Rows of skipped tokens are loaded too: they lie inside key/value, and
 * the loads need not wait for the slots.
 *
 * OUT is KV_COPY for a cache of the inputs' dtype (each 16-byte unit stored as it is, W 1), or
 * the inputs' dtype DT for a float8_e4m3fn cache: each unit quantized with its head's scales
 * and stored as W * 16 / sizeof(DT) bytes, the cache offsets in bytes.  W 2 (16-bit DT): one
 * 16-byte store per unit (W 1's 8-byte stores: 3.35 against 3.66 TB/s, docs/fp8.md).
 */
template <int OUT, int W>
static __device__ __forceinline__ void
kv_write_vec(const dk_kv_write_args &a, int64_t elem_size, int32_t units_per_head,
             int32_t elems_per_unit)
{
    static_assert(W == 1 || (W == 2 && (OUT == DK_F16 || OUT == DK_BF16)), "unit width");
    constexpr int TOK = W == 2 ? KV_WRITE_TOKENS_WIDE : KV_WRITE_TOKENS;
    const int32_t units = (int32_t)a.num_kv_heads * units_per_head;
    const int64_t capacity = a.num_blocks * a.block_size;
    const int64_t t0 = (int64_t)blockIdx.x * blockDim.y * TOK + threadIdx.y;
    const char *key = (const char *)a.key;
    const char *value = (const char *)a.value;
    char *key_cache = (char *)a.key_cache;
    char *value_cache = (char *)a.value_cache;
    const int64_t cache_elem_size = OUT == KV_COPY ? elem_size : 1;
    /* fp8: W * 16 / sizeof(DT), what prepare_fp8 passes, known here at compile time */
    const int32_t unit_elems = OUT == KV_COPY ? elems_per_unit : W * (OUT == DK_F32 ? 4 : 8);
    int64_t slot[TOK];
#pragma unroll
    for (int i = 0; i < TOK; i++) {
        int64_t t = t0 + (int64_t)i * blockDim.y;
        slot[i] = t >= a.num_tokens ? -1
                  : a.slot_mapping  ? __ldg(a.slot_mapping + t * a.slot_stride)
                                    : t;
    }
    for (int32_t u = (int32_t)threadIdx.x; u < units; u += (int32_t)blockDim.x) {
        const int64_t h = u / units_per_head;
        const int64_t d = (int64_t)(u % units_per_head) * unit_elems;
        const int64_t key_off = h * a.key_stride_head + d;
        const int64_t value_off = h * a.value_stride_head + d;
        const int64_t cache_off = h * a.cache_stride_head + d;
        float ks = 0.0f, vs = 0.0f, kr = 0.0f, vr = 0.0f;
        if (OUT != KV_COPY) {
            ks = __ldg(a.k_scale + h * a.scale_stride_head);
            vs = __ldg(a.v_scale + h * a.scale_stride_head);
            kr = fast_reciprocal(ks);
            vr = fast_reciprocal(vs);
        }
        uint4 k[TOK][W];
        uint4 v[TOK][W];
#pragma unroll
        for (int i = 0; i < TOK; i++) {
            int64_t t = t0 + (int64_t)i * blockDim.y;
            const uint4 *ksrc =
                (const uint4 *)(key + (t * a.key_stride_token + key_off) * elem_size);
            const uint4 *vsrc =
                (const uint4 *)(value + (t * a.value_stride_token + value_off) * elem_size);
#pragma unroll
            for (int w = 0; w < W; w++) {
                k[i][w] = make_uint4(0, 0, 0, 0);
                v[i][w] = make_uint4(0, 0, 0, 0);
                if (t < a.num_tokens) {
                    k[i][w] = __ldg(ksrc + w);
                    v[i][w] = __ldg(vsrc + w);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < TOK; i++) {
            if (slot[i] >= 0 && slot[i] < capacity) {
                int64_t off = (slot[i] / a.block_size) * a.cache_stride_block +
                              (slot[i] % a.block_size) * a.cache_stride_token + cache_off;
                store_unit<OUT, W>(key_cache + off * cache_elem_size, k[i], ks, kr);
                store_unit<OUT, W>(value_cache + off * cache_elem_size, v[i], vs, vr);
            }
        }
    }
}

/* The fast path, units of one 16-byte load (kv_write_vec<OUT, 1>): copies and fp8 writes. */
template <int OUT>
static __global__ void
kv_write_vec_kernel(const dk_kv_write_args a, int64_t elem_size, int32_t units_per_head,
                    int32_t elems_per_unit)
{
    kv_write_vec<OUT, 1>(a, elem_size, units_per_head, elems_per_unit);
}

/* The fast path, units of two 16-byte loads and one 16-byte e4m3 store (kv_write_vec<DT, 2>). */
template <int DT>
static __global__ void
__launch_bounds__(KV_WRITE_WIDE_THREADS, KV_WRITE_WIDE_CTAS)
    kv_write_wide_kernel(const dk_kv_write_args a, int64_t elem_size, int32_t units_per_head,
                         int32_t elems_per_unit)
{
    kv_write_vec<DT, 2>(a, elem_size, units_per_head, elems_per_unit);
}

/* The strided path into a float8_e4m3fn cache: kv_write_kernel's walk, one element at a time
 * (units_per_head = head_size), each quantized with its head's scale. */
template <int DT>
static __global__ void
kv_write_fp8_kernel(const dk_kv_write_args a, int64_t elem_size, int32_t units_per_head,
                    int32_t elems_per_unit)
{
    (void)elem_size;
    (void)elems_per_unit;
    int64_t t = blockIdx.x;
    int64_t slot = a.slot_mapping ? a.slot_mapping[t * a.slot_stride] : t;
    if (slot < 0 || slot >= a.num_blocks * a.block_size) {
        return;
    }
    int64_t cache_base =
        (slot / a.block_size) * a.cache_stride_block + (slot % a.block_size) * a.cache_stride_token;
    int32_t per_tensor = (int32_t)a.num_kv_heads * units_per_head;
    for (int32_t i = (int32_t)threadIdx.x; i < 2 * per_tensor; i += (int32_t)blockDim.x) {
        bool is_value = i >= per_tensor;
        int32_t r = is_value ? i - per_tensor : i;
        int64_t h = r / units_per_head;
        int64_t d = r % units_per_head;
        float x;
        float scale;
        uint8_t *dst;
        if (is_value) {
            x = load_element<DT>((const char *)a.value, t * a.value_stride_token +
                                                            h * a.value_stride_head +
                                                            d * a.value_stride_dim);
            scale = a.v_scale[h * a.scale_stride_head];
            dst = (uint8_t *)a.value_cache;
        }
        else {
            x = load_element<DT>((const char *)a.key, t * a.key_stride_token +
                                                          h * a.key_stride_head +
                                                          d * a.key_stride_dim);
            scale = a.k_scale[h * a.scale_stride_head];
            dst = (uint8_t *)a.key_cache;
        }
        dst[cache_base + h * a.cache_stride_head + d * a.cache_stride_dim] =
            quantize_e4m3(x, scale);
    }
}

static bool
aligned16(int64_t bytes)
{
    return bytes % 16 == 0;
}

static bool
ptr_aligned16(const void *p)
{
    return (uintptr_t)p % 16 == 0;
}

/* Whether a's key and value (elements of es bytes) read as 16-byte units: contiguous head
 * dims, rows and every address 16-byte aligned -- the input side of the vec kernels' fast path
 * (the KV write's, with its cache's own conditions beside it, and the amax kernel's). */
static bool
inputs_vec(const dk_kv_write_args *a, int64_t es)
{
    return a->key_stride_dim == 1 && a->value_stride_dim == 1 && aligned16(a->head_size * es) &&
           ptr_aligned16(a->key) && ptr_aligned16(a->value) &&
           aligned16(a->key_stride_token * es) && aligned16(a->key_stride_head * es) &&
           aligned16(a->value_stride_token * es) && aligned16(a->value_stride_head * es);
}

/* The vec kernels' CTA of up to `threads` threads for rows of `units` units: rows up to
 * `threads` units wide, one unit column per thread and threads / units token lanes; wider rows
 * one lane, blockDim.x the row split into even passes (rounded to warps).  grid[0] covers
 * num_tokens in tiles of lanes * tok tokens. */
static void
vec_shape(dk_pending_launch *p, int64_t units, int64_t num_tokens, int64_t tok, int64_t threads)
{
    int64_t bx = units;
    int64_t by = threads / units;
    if (units >= threads) {
        int64_t passes = dk_cdiv(units, threads);
        bx = dk_cdiv(dk_cdiv(units, passes), 32) * 32;
        by = 1;
    }
    p->grid[0] = (uint32_t)dk_cdiv(num_tokens, by * tok);
    p->block[0] = (uint32_t)bx;
    p->block[1] = (uint32_t)by;
}

/* The fp8 write's launch (sizes checked by the caller): the vec kernel when the inputs meet
 * the fast path's conditions and the cache its units of E = 16 / element-size bytes -- with
 * 16-bit inputs, heads of whole 16-element units and a 16-byte aligned cache side, units of
 * two loads and one 16-byte store. */
static dk_status
prepare_fp8(const dk_kv_write_args *a, dk_pending_launch *p)
{
    const int64_t es = (int64_t)dk_dtype_size(a->dtype);
    const int64_t e = 16 / es; /* elements (= cache bytes) per 16-byte load */
    const bool vec = inputs_vec(a, es) && a->cache_stride_dim == 1 &&
                     (uintptr_t)a->key_cache % e == 0 && (uintptr_t)a->value_cache % e == 0 &&
                     a->cache_stride_block % e == 0 && a->cache_stride_token % e == 0 &&
                     a->cache_stride_head % e == 0;
    const bool wide = vec && es == 2 && a->head_size % 16 == 0 && ptr_aligned16(a->key_cache) &&
                      ptr_aligned16(a->value_cache) && aligned16(a->cache_stride_block) &&
                      aligned16(a->cache_stride_token) && aligned16(a->cache_stride_head);
    p->kv = *a;
    p->elem_size = es;
    p->grid[1] = p->grid[2] = p->block[1] = p->block[2] = 1;
    if (wide) {
        p->elems_per_unit = 16;
        p->units_per_head = (int32_t)(a->head_size / 16);
        vec_shape(p, a->num_kv_heads * p->units_per_head, a->num_tokens, KV_WRITE_TOKENS_WIDE,
                  KV_WRITE_WIDE_THREADS);
        p->func = a->dtype == DK_F16 ? (const void *)kv_write_wide_kernel<DK_F16>
                                     : (const void *)kv_write_wide_kernel<DK_BF16>;
        return DK_OK;
    }
    if (vec) {
        p->elems_per_unit = (int32_t)e;
        p->units_per_head = (int32_t)(a->head_size / e);
        vec_shape(p, a->num_kv_heads * p->units_per_head, a->num_tokens, KV_WRITE_TOKENS,
                  KV_WRITE_MAX_THREADS);
        p->func = a->dtype == DK_F32   ? (const void *)kv_write_vec_kernel<DK_F32>
                  : a->dtype == DK_F16 ? (const void *)kv_write_vec_kernel<DK_F16>
                                       : (const void *)kv_write_vec_kernel<DK_BF16>;
        return DK_OK;
    }
    p->elems_per_unit = 1;
    p->units_per_head = (int32_t)a->head_size;
    int64_t threads = dk_cdiv(2 * a->num_kv_heads * a->head_size, 32) * 32;
    p->grid[0] = (uint32_t)a->num_tokens;
    p->block[0] = (uint32_t)(threads > KV_WRITE_MAX_THREADS ? KV_WRITE_MAX_THREADS : threads);
    p->func = a->dtype == DK_F32   ? (const void *)kv_write_fp8_kernel<DK_F32>
              : a->dtype == DK_F16 ? (const void *)kv_write_fp8_kernel<DK_F16>
                                   : (const void *)kv_write_fp8_kernel<DK_BF16>;
    return DK_OK;
}

extern "C" dk_status
dk_cuda_kv_write_prepare(const dk_kv_write_args *a, dk_pending_launch *p, dk_error *err)
{
    memset(p, 0, sizeof(*p));
    if (a->dtype != DK_F32 && a->dtype != DK_F16 && a->dtype != DK_BF16) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "kv_write(): dtype must be one of float32, float16, bfloat16, got %s",
                       dk_dtype_name(a->dtype));
    }
    if (a->num_tokens <= 0 || a->num_kv_heads <= 0 || a->head_size <= 0) {
        return DK_OK;
    }
    if (a->block_size <= 0) {
        return dk_fail(err, DK_ERR_VALUE, "kv_write(): block_size must be positive, got %lld",
                       (long long)a->block_size);
    }
    if (a->num_tokens > DK_MAX_GRID_X) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "kv_write(): num_tokens must be at most %lld, got %lld",
                       (long long)DK_MAX_GRID_X, (long long)a->num_tokens);
    }
    if (a->num_kv_heads * a->head_size > (int64_t)INT32_MAX / 2) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "kv_write(): num_kv_heads * head_size must be at most %lld, got %lld",
                       (long long)(INT32_MAX / 2), (long long)(a->num_kv_heads * a->head_size));
    }
    if (a->cache_dtype == DK_F8E4M3) {
        return prepare_fp8(a, p);
    }
    if (a->cache_dtype != a->dtype) {
        return dk_fail(
            err, DK_ERR_UNSUPPORTED,
            "kv_write(): the cache must hold the inputs' dtype %s or float8_e4m3fn, got %s",
            dk_dtype_name(a->dtype), dk_dtype_name(a->cache_dtype));
    }
    int64_t es = (int64_t)dk_dtype_size(a->dtype);
    bool vec = inputs_vec(a, es) && a->cache_stride_dim == 1 && ptr_aligned16(a->key_cache) &&
               ptr_aligned16(a->value_cache) && aligned16(a->cache_stride_block * es) &&
               aligned16(a->cache_stride_token * es) && aligned16(a->cache_stride_head * es);
    p->kv = *a;
    p->elem_size = es;
    p->elems_per_unit = vec ? (int32_t)(16 / es) : 1;
    p->units_per_head = (int32_t)(a->head_size / p->elems_per_unit);
    p->grid[1] = p->grid[2] = p->block[1] = p->block[2] = 1;
    if (vec) {
        vec_shape(p, a->num_kv_heads * p->units_per_head, a->num_tokens, KV_WRITE_TOKENS,
                  KV_WRITE_MAX_THREADS);
        p->func = (const void *)kv_write_vec_kernel<KV_COPY>;
        return DK_OK;
    }
    int64_t items = 2 * a->num_kv_heads * p->units_per_head;
    int64_t threads = dk_cdiv(items, 32) * 32;
    if (threads > KV_WRITE_MAX_THREADS) {
        threads = KV_WRITE_MAX_THREADS;
    }
    p->grid[0] = (uint32_t)a->num_tokens;
    p->block[0] = (uint32_t)threads;
    p->func =
        es == 4 ? (const void *)kv_write_kernel<uint32_t> : (const void *)kv_write_kernel<uint16_t>;
    return DK_OK;
}

extern "C" dk_status
dk_cuda_kv_write(const dk_kv_write_args *a, void *stream, dk_error *err)
{
    dk_pending_launch p;
    dk_status s = dk_cuda_kv_write_prepare(a, &p, err);
    if (s != DK_OK) {
        return s;
    }
    return dk_cuda_launch_pending(&p, stream, err);
}

/* ------------------------------------------------------------------------------------------ */
/* The dense forward's fp8 rounding (dk_quantize_kv_args)                                      */
/* ------------------------------------------------------------------------------------------ */

#define KV_AMAX_THREADS 256
#define KV_AMAX_MAX_CTAS 1024 /* a grid-stride loop past these (about a wave of 8 an SM) */

/* The largest magnitude among a 16-byte unit's DT values, as the bits of the fp32 value:
 * non-negative floats order as their bits, and a NaN's magnitude above an infinity's (in fp16
 * and bf16 as in fp32), so a NaN wins, as torch's amax propagates it. */
template <int DT>
static __device__ __forceinline__ uint32_t
unit_amax_bits(const uint4 &u)
{
    if constexpr (DT == DK_F32) {
        return max(max(u.x & 0x7FFFFFFFu, u.y & 0x7FFFFFFFu),
                   max(u.z & 0x7FFFFFFFu, u.w & 0x7FFFFFFFu));
    }
    else {
        const uint32_t m = __vmaxu2(__vmaxu2(u.x & 0x7FFF7FFFu, u.y & 0x7FFF7FFFu),
                                    __vmaxu2(u.z & 0x7FFF7FFFu, u.w & 0x7FFF7FFFu));
        const uint32_t h = max(m & 0xFFFFu, m >> 16);
        if constexpr (DT == DK_BF16) {
            return h << 16;
        }
        else {
            return __float_as_uint(__half2float(__ushort_as_half((uint16_t)h)));
        }
    }
}

/*
 * bits[g] = max(bits[g], the largest magnitude's fp32 bits) over source blockIdx.y of q: pair
 * blockIdx.y / 2 (the inputs, then the joint ones), its key (g 0) or value (g 1).  A CTA is
 * blockDim.y token lanes x blockDim.x unit columns; lane y walks tokens blockIdx.x * blockDim.y
 * + y, then gridDim.x * blockDim.y further.  VEC: 16-byte units (dim stride 1, every row and
 * address 16-byte aligned: checked on the host), else single elements at any strides.  One
 * atomicMax a warp on bits, which the caller zeroed.
 */
template <int DT, bool VEC>
static __global__ void
__launch_bounds__(KV_AMAX_THREADS) kv_amax_kernel(const dk_quantize_kv_args q, uint32_t *bits)
{
    const int src = (int)blockIdx.y;
    /* the source's fields by selects (an index into the parameters would copy them to the
     * stack); both pairs have the same heads and head size */
    const dk_kv_write_args &a0 = q.kv[0], &a1 = q.kv[1];
    const bool second = src >= 2, value = (src & 1) != 0;
    const void *ptr = second ? (value ? a1.value : a1.key) : (value ? a0.value : a0.key);
    const char *base = (const char *)ptr;
    const int64_t st = second ? (value ? a1.value_stride_token : a1.key_stride_token)
                              : (value ? a0.value_stride_token : a0.key_stride_token);
    const int64_t sh = second ? (value ? a1.value_stride_head : a1.key_stride_head)
                              : (value ? a0.value_stride_head : a0.key_stride_head);
    const int64_t sd = second ? (value ? a1.value_stride_dim : a1.key_stride_dim)
                              : (value ? a0.value_stride_dim : a0.key_stride_dim);
    const int64_t tokens = second ? a1.num_tokens : a0.num_tokens;
    constexpr int64_t ES = DT == DK_F32 ? 4 : 2;
    constexpr int32_t E = VEC ? (int32_t)(16 / ES) : 1; /* elements per unit */
    const int32_t per_head = (int32_t)(a0.head_size / E);
    const int32_t units = (int32_t)a0.num_kv_heads * per_head;
    uint32_t m = 0;
#pragma unroll 4
    for (int64_t t = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; t < tokens;
         t += (int64_t)gridDim.x * blockDim.y) {
        for (int32_t u = (int32_t)threadIdx.x; u < units; u += (int32_t)blockDim.x) {
            const int32_t h = u / per_head;
            const int64_t off = t * st + h * sh + (int64_t)(u - h * per_head) * E * sd;
            if constexpr (VEC) {
                m = max(m, unit_amax_bits<DT>(__ldg((const uint4 *)(base + off * ES))));
            }
            else { /* the bits, not fabsf: --use_fast_math's abs.ftz would flush subnormals */
                m = max(m, __float_as_uint(load_element<DT>(base, off)) & 0x7FFFFFFFu);
            }
        }
    }
    m = __reduce_max_sync(0xffffffffu, m);
    if ((threadIdx.x & 31u) == 0u) {
        atomicMax(bits + (src & 1), m);
    }
}

/* scales[i] (i = threadIdx.x < 2) from the amax bits it holds: amax / 448 (div.rn.f32, which
 * --use_fast_math would otherwise make an approximation that flushes subnormals), or 1 where
 * amax is not > 0 -- decided on the bits (zero, or a NaN's above an infinity's), as a float
 * comparison under --use_fast_math would flush a subnormal amax to zero. */
static __global__ void
kv_amax_scales_kernel(float *scales)
{
    const uint32_t bits = __float_as_uint(scales[threadIdx.x]);
    float s;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(s) : "f"(__uint_as_float(bits)), "f"(448.0f));
    scales[threadIdx.x] = bits != 0u && bits <= 0x7F800000u ? s : 1.0f;
}

extern "C" dk_status
dk_cuda_quantize_kv(const dk_quantize_kv_args *q, void *stream, dk_error *err)
{
    const dk_kv_write_args *a = q->kv;
    if (a[0].dtype != DK_F32 && a[0].dtype != DK_F16 && a[0].dtype != DK_BF16) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "quantize_kv(): dtype must be one of float32, float16, bfloat16, got %s",
                       dk_dtype_name(a[0].dtype));
    }
    /* both writes checked and described before anything runs */
    dk_pending_launch p[2];
    memset(p, 0, sizeof(p));
    for (int i = 0; i < 2; i++) {
        if (a[i].num_tokens > 0) {
            const dk_status s = dk_cuda_kv_write_prepare(&a[i], &p[i], err);
            if (s != DK_OK) {
                return s;
            }
        }
    }
    const int64_t es = (int64_t)dk_dtype_size(a[0].dtype);
    bool vec = true;
    int64_t most = 0; /* tokens of the longer pair */
    for (int i = 0; i < 2; i++) {
        if (a[i].num_tokens > 0) {
            vec = vec && inputs_vec(&a[i], es);
            most = a[i].num_tokens > most ? a[i].num_tokens : most;
        }
    }
    cudaStream_t s = (cudaStream_t)stream;
    uint32_t *bits = (uint32_t *)q->scales;
    const cudaError_t me = cudaMemsetAsync(bits, 0, 2 * sizeof(uint32_t), s);
    if (me != cudaSuccess) {
        (void)cudaGetLastError();
        return dk_fail(err, DK_ERR_CUDA, "quantize_kv(): CUDA error %s (%d)",
                       cudaGetErrorString(me), (int)me);
    }
    if (most > 0) {
        /* every pair's units in one CTA shape: a[0]'s row (the joint pair's is the same) */
        const int64_t e = vec ? 16 / es : 1;
        const int64_t units = a[0].num_kv_heads * (a[0].head_size / e);
        const int64_t bx = units >= KV_AMAX_THREADS ? KV_AMAX_THREADS : dk_cdiv(units, 32) * 32;
        const int64_t by = KV_AMAX_THREADS / bx;
        int64_t ctas = dk_cdiv(most, by);
        ctas = ctas > KV_AMAX_MAX_CTAS ? KV_AMAX_MAX_CTAS : ctas;
        const dim3 grid((uint32_t)ctas, a[1].num_tokens > 0 ? 4u : 2u);
        const dim3 block((uint32_t)bx, (uint32_t)by);
        const int dt = a[0].dtype;
#define KV_AMAX(DT)                                                                                \
    (vec ? kv_amax_kernel<DT, true> : kv_amax_kernel<DT, false>)<<<grid, block, 0, s>>>(*q, bits)
        if (dt == DK_F32) {
            KV_AMAX(DK_F32);
        }
        else if (dt == DK_F16) {
            KV_AMAX(DK_F16);
        }
        else {
            KV_AMAX(DK_BF16);
        }
#undef KV_AMAX
    }
    kv_amax_scales_kernel<<<1, 2, 0, s>>>(q->scales);
    dk_status st = dk_cuda_after_launch("quantize_kv()", stream, err);
    for (int i = 0; i < 2 && st == DK_OK; i++) {
        st = dk_cuda_launch_pending(&p[i], stream, err);
    }
    return st;
}
