/*
 * common.c -- small helpers every C file shares: error formatting, dtype names and sizes,
 * element counts and the fp16/bf16 <-> fp32 conversions of the CPU reference.
 *
 * Entry points: dk_fail, dk_dtype_size, dk_dtype_name, dk_tensor_numel, dk_f16_to_f32,
 * dk_f32_to_f16, dk_bf16_to_f32, dk_f32_to_bf16, dk_f32_to_e4m3, dk_e4m3_to_f32,
 * dk_attention_kernel_choice, dk_set_attention_kernel, dk_head_size_supported.
 */
#include "diffkv.h"

#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The attention kernel choice (dk_kernel_choice); -1 until set or read from the environment. */
static _Atomic int kernel_choice = -1;

/* DIFFKV_ATTENTION_KERNEL ("sm90", "sm80", anything else: auto) as a dk_kernel_choice.
 * Cannot fail. */
static int
kernel_choice_from_env(void)
{
    const char *v = getenv("DIFFKV_ATTENTION_KERNEL");
    if (v != NULL && strcmp(v, "sm90") == 0) {
        return DK_KERNEL_SM90;
    }
    if (v != NULL && strcmp(v, "sm80") == 0) {
        return DK_KERNEL_SM80;
    }
    return DK_KERNEL_AUTO;
}

dk_kernel_choice
dk_attention_kernel_choice(void)
{
    int c = atomic_load_explicit(&kernel_choice, memory_order_relaxed);
    if (c < 0) {
        int unread = -1;
        c = kernel_choice_from_env();
        /* a concurrent first read or a dk_set_attention_kernel in between wins */
        if (!atomic_compare_exchange_strong(&kernel_choice, &unread, c)) {
            c = unread;
        }
    }
    return (dk_kernel_choice)c;
}

dk_kernel_choice
dk_set_attention_kernel(dk_kernel_choice choice)
{
    (void)dk_attention_kernel_choice(); /* the environment's, if nothing was chosen yet */
    return (dk_kernel_choice)atomic_exchange(&kernel_choice, (int)choice);
}

int
dk_head_size_supported(int32_t device_type, dk_dtype dtype, int kv_fp8, int64_t head_size)
{
    if (dtype != DK_F32 && dtype != DK_F16 && dtype != DK_BF16) {
        return 0;
    }
    if (device_type == DK_CPU) {
        return head_size >= 1 && head_size <= DK_REF_MAX_HEAD_SIZE;
    }
    if (device_type != DK_CUDA || !dk_cuda_compiled()) {
        return 0;
    }
    if (dtype == DK_F32) {
        return !kv_fp8 && head_size >= 1 && head_size <= DK_CUDA_F32_MAX_HEAD;
    }
#define DK_HEAD_CASE(d) case d:
    switch (head_size) { /* fp16/bf16 over either cache: every instantiation has an e4m3 form */
        DK_CUDA_HEAD_SIZES(DK_HEAD_CASE)
        return 1;
    default:
        return 0;
    }
#undef DK_HEAD_CASE
}

dk_status
dk_fail(dk_error *err, dk_status status, const char *fmt, ...)
{
    if (err != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
        va_end(ap);
    }
    return status;
}

size_t
dk_dtype_size(dk_dtype dtype)
{
    switch (dtype) {
    case DK_F32:
    case DK_I32:
        return 4;
    case DK_F16:
    case DK_BF16:
    case DK_I16:
        return 2;
    case DK_F64:
    case DK_I64:
        return 8;
    case DK_U8:
    case DK_BOOL:
    case DK_I8:
    case DK_F8E4M3:
        return 1;
    default:
        return 0;
    }
}

dk_status
dk_driver_check(int driver, int runtime, dk_error *err)
{
    /* the oldest Linux driver of each CUDA major version (NVIDIA's compatibility table) */
    static const struct {
        int major;
        const char *driver;
    } oldest[] = {{11, "450.80.02"}, {12, "525.60.13"}, {13, "580.65.06"}};
    /* the CUDA major versions diffkv's release wheels are built for: +cu12 and +cu13 */
    const int oldest_wheel = 12;
    const int major = runtime / 1000;
    if (runtime <= 0 || (driver > 0 && driver / 1000 >= major)) {
        return DK_OK;
    }
    const char *needs = "a newer one";
    const char *wheel_needs = "a newer one";
    for (size_t i = 0; i < sizeof(oldest) / sizeof(oldest[0]); i++) {
        if (oldest[i].major == major) {
            needs = oldest[i].driver;
        }
        if (oldest[i].major == oldest_wheel) {
            wheel_needs = oldest[i].driver;
        }
    }
    if (driver <= 0) {
        return dk_fail(
            err, DK_ERR_CUDA,
            "diffkv was built with CUDA %d.%d and needs an NVIDIA driver for CUDA %d (%s "
            "or newer), but no driver was found",
            major, (runtime % 1000) / 10, major, needs);
    }
    if (driver / 1000 < oldest_wheel) {
        return dk_fail(
            err, DK_ERR_CUDA,
            "diffkv was built with CUDA %d.%d and needs an NVIDIA driver for CUDA %d (%s or "
            "newer), but this driver supports CUDA %d.%d: update the driver (diffkv's "
            "oldest wheel, +cu%d, needs %s or newer)",
            major, (runtime % 1000) / 10, major, needs, driver / 1000, (driver % 1000) / 10,
            oldest_wheel, wheel_needs);
    }
    return dk_fail(
        err, DK_ERR_CUDA,
        "diffkv was built with CUDA %d.%d and needs an NVIDIA driver for CUDA %d (%s or "
        "newer), but this driver supports CUDA %d.%d: install the diffkv wheel for CUDA %d "
        "(the +cu%d variant: README, Install) or update the driver",
        major, (runtime % 1000) / 10, major, needs, driver / 1000, (driver % 1000) / 10,
        driver / 1000, driver / 1000);
}

const char *
dk_dtype_name(dk_dtype dtype)
{
    switch (dtype) {
    case DK_F32:
        return "float32";
    case DK_F16:
        return "float16";
    case DK_BF16:
        return "bfloat16";
    case DK_F64:
        return "float64";
    case DK_I32:
        return "int32";
    case DK_I64:
        return "int64";
    case DK_U8:
        return "uint8";
    case DK_BOOL:
        return "bool";
    case DK_I8:
        return "int8";
    case DK_I16:
        return "int16";
    case DK_F8E4M3:
        return "float8_e4m3fn";
    default:
        return "unsupported dtype";
    }
}

int64_t
dk_tensor_numel(const dk_tensor *t)
{
    int64_t n = 1;
    for (int32_t i = 0; i < t->ndim; i++) {
        n *= t->shape[i];
    }
    return n;
}

/* The IEEE bits of f, and back (bits_float).  Cannot fail. */
static uint32_t
float_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static float
bits_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

float
dk_bf16_to_f32(uint16_t h)
{
    return bits_float((uint32_t)h << 16);
}

uint16_t
dk_f32_to_bf16(float f)
{
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        /* NaN: keep it a quiet NaN with the sign. */
        return (uint16_t)((u >> 16) | 0x0040u);
    }
    /* Round to nearest, ties to even. */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float
dk_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        if (man == 0) {
            return bits_float(sign);
        }
        /* Subnormal: value = man * 2^-24. */
        float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (exp == 31) {
        return bits_float(sign | 0x7f800000u | (man << 13));
    }
    return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t
dk_f32_to_f16(float f)
{
    uint32_t u = float_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) {
        return (uint16_t)(sign | 0x7e00u); /* NaN */
    }
    if (absu >= 0x477ff000u) {
        /* >= 65520 rounds to infinity (65504 is the largest finite half). */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (absu < 0x38800000u) {
        /* Below the smallest normal half (2^-14): subnormal or zero, rounded to even by
         * letting the FPU do the scaling (exact for this range). */
        float a = bits_float(absu) * 16777216.0f; /* units of 2^-24 */
        uint32_t q = (uint32_t)a;
        float rem = a - (float)q;
        if (rem > 0.5f || (rem == 0.5f && (q & 1u))) {
            q++;
        }
        return (uint16_t)(sign | q);
    }
    /* Normal: rebias the exponent and round the 13 dropped mantissa bits to even. */
    uint32_t rounded = absu + 0xfffu + ((absu >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

uint8_t
dk_f32_to_e4m3(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    const uint32_t mag = bits & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) {
        return (uint8_t)(sign | 0x7Fu); /* NaN */
    }
    if (mag >= 0x43E00000u) {
        return (uint8_t)(sign | 0x7Eu); /* >= 448 (inf included): the largest finite, 448 */
    }
    if (mag < 0x3C800000u) {
        /* below 2^-6, the smallest normal: multiples of 2^-9, 0..8 of them (8 is 2^-6 itself,
         * code 0x08); the scaling is exact and rintf rounds half to even */
        float a;
        memcpy(&a, &mag, sizeof(a));
        return (uint8_t)(sign | (uint8_t)rintf(a * 512.0f));
    }
    /* normal: 3 of the 23 mantissa bits kept, the rest rounded half to even */
    uint32_t exponent = (mag >> 23) - 127u + 7u; /* 1..15 */
    uint32_t keep = (mag >> 20) & 7u;
    const uint32_t rest = mag & 0xFFFFFu;
    if (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) {
        keep++;
        if (keep == 8u) {
            keep = 0;
            exponent++;
        }
    }
    return (uint8_t)(sign | (exponent << 3) | keep); /* < 448 rounds to at most 0x7E */
}

float
dk_e4m3_to_f32(uint8_t b)
{
    const float sign = (b & 0x80u) ? -1.0f : 1.0f;
    const uint32_t exponent = (b >> 3) & 15u;
    const uint32_t mantissa = b & 7u;
    if (exponent == 15u && mantissa == 7u) {
        return sign * NAN;
    }
    if (exponent == 0) {
        return sign * ldexpf((float)mantissa, -9);
    }
    return sign * ldexpf((float)(8u + mantissa), (int)exponent - 10);
}
