/*
 * nocuda.c -- the dk_cuda_* entry points of a CPU-only build (no nvcc at build time, or
 * DIFFKV_CUDA=0).  Every launcher returns DK_ERR_NO_CUDA with a message that says how to
 * rebuild; the query helpers report "no CUDA" (0).  Compiled only when DIFFKV_WITH_CUDA is not
 * defined; with CUDA, cuda/runtime.cu and the kernel files define these symbols instead.
 *
 * Entry points: dk_cuda_slots, dk_cuda_kv_write, dk_cuda_quantize_kv, dk_cuda_attention,
 * dk_cuda_layer, dk_cuda_rows_gather, dk_cuda_rows_scatter, dk_cuda_compiled,
 * dk_cuda_device_enter, dk_cuda_device_exit, dk_cuda_copy_to_host, dk_cuda_stream_capturing,
 * dk_cuda_device_count, dk_cuda_capability, dk_cuda_runtime_version, dk_cuda_driver_version,
 * dk_cuda_attention_kernel.
 */
#ifndef DIFFKV_WITH_CUDA

#include "diffkv.h"

#define NO_CUDA_MSG                                                                                \
    "diffkv was built without CUDA support (no nvcc at build time or DIFFKV_CUDA=0); reinstall "   \
    "with nvcc on PATH: pip install --no-build-isolation --force-reinstall --no-deps ."

/* Every CUDA entry point of a CPU-only build: DK_ERR_NO_CUDA with how to rebuild. */
static dk_status
no_cuda(dk_error *err)
{
    return dk_fail(err, DK_ERR_NO_CUDA, "%s", NO_CUDA_MSG);
}

dk_status
dk_cuda_slots(const dk_slots_args *a, void *stream, dk_error *err)
{
    (void)a;
    (void)stream;
    return no_cuda(err);
}

dk_status
dk_cuda_kv_write(const dk_kv_write_args *a, void *stream, dk_error *err)
{
    (void)a;
    (void)stream;
    return no_cuda(err);
}

dk_status
dk_cuda_quantize_kv(const dk_quantize_kv_args *a, void *stream, dk_error *err)
{
    (void)a;
    (void)stream;
    return no_cuda(err);
}

dk_status
dk_cuda_attention(const dk_attention_args *a, void *stream, dk_error *err)
{
    (void)a;
    (void)stream;
    return no_cuda(err);
}

dk_status
dk_cuda_layer(const dk_kv_write_args *w, const dk_attention_args *a, void *stream, dk_error *err)
{
    (void)w;
    (void)a;
    (void)stream;
    return no_cuda(err);
}

dk_status
dk_cuda_rows_gather(const dk_rows_args *a, void *stream, dk_error *err)
{
    (void)a;
    (void)stream;
    return no_cuda(err);
}

dk_status
dk_cuda_rows_scatter(const dk_rows_args *a, void *stream, dk_error *err)
{
    (void)a;
    (void)stream;
    return no_cuda(err);
}

int
dk_cuda_compiled(void)
{
    return 0;
}

dk_status
dk_cuda_device_enter(int32_t device, int32_t *prev, dk_error *err)
{
    (void)device;
    if (prev != NULL) {
        *prev = 0;
    }
    return no_cuda(err);
}

void
dk_cuda_device_exit(int32_t prev)
{
    (void)prev;
}

dk_status
dk_cuda_copy_to_host(void *dst, const void *src, size_t n, void *stream, dk_error *err)
{
    (void)dst;
    (void)src;
    (void)n;
    (void)stream;
    return no_cuda(err);
}

int
dk_cuda_stream_capturing(void *stream)
{
    (void)stream;
    return 0;
}

int
dk_cuda_device_count(void)
{
    return 0;
}

int
dk_cuda_capability(int32_t device)
{
    (void)device;
    return 0;
}

int
dk_cuda_runtime_version(void)
{
    return 0;
}

int
dk_cuda_driver_version(void)
{
    return 0;
}

const char *
dk_cuda_attention_kernel(void)
{
    return "none";
}

const char *
dk_cuda_last_attention_kernel(void)
{
    return "none";
}

#endif /* DIFFKV_WITH_CUDA */
