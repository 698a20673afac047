/*
 * runtime.cu -- the CUDA runtime helpers of diffkv: device selection around a launch,
 * device->host copies for setup paths, build/device facts, and the post-launch error check
 * every launcher calls.
 *
 * Entry points: dk_cuda_compiled, dk_cuda_device_enter, dk_cuda_device_exit,
 * dk_cuda_copy_to_host, dk_cuda_stream_capturing, dk_cuda_driver_version, dk_cuda_device_count,
 * dk_cuda_capability, dk_cuda_runtime_version (diffkv.h) and dk_cuda_after_launch
 * (cuda_common.cuh).
 */
#include "diffkv.h"

#include "cuda_common.cuh"

#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

static bool
sync_debug_from_env(void)
{
    const char *v = getenv("DIFFKV_SYNC_DEBUG");
    return v != NULL && strcmp(v, "1") == 0;
}

/* Read once: a function-local static is initialised exactly once, thread-safely. */
static bool
sync_debug(void)
{
    static const bool enabled = sync_debug_from_env();
    return enabled;
}

dk_status
dk_cuda_after_launch(const char *op, void *stream, dk_error *err)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        return dk_fail(err, DK_ERR_CUDA, "%s: CUDA error %s (%d)", op, cudaGetErrorString(e),
                       (int)e);
    }
    if (sync_debug()) {
        e = cudaStreamSynchronize((cudaStream_t)stream);
        if (e != cudaSuccess) {
            return dk_fail(err, DK_ERR_CUDA, "%s: CUDA error %s (%d)", op, cudaGetErrorString(e),
                           (int)e);
        }
    }
    return DK_OK;
}

extern "C" int
dk_cuda_compiled(void)
{
    return 1;
}

/* dk_driver_check of the installed driver against this build's runtime, once per process (a
 * race checks twice, with the same result): 1 compatible, else -1 with the message kept. */
static dk_status
driver_ok(dk_error *err)
{
    static volatile int state; /* 0 unchecked, 1 compatible, -1 not */
    static dk_error failure;
    if (state == 0) {
        dk_error e = {{0}};
        const dk_status s = dk_driver_check(dk_cuda_driver_version(), CUDART_VERSION, &e);
        if (s != DK_OK) {
            failure = e;
        }
        state = s == DK_OK ? 1 : -1;
    }
    if (state > 0) {
        return DK_OK;
    }
    *err = failure;
    return DK_ERR_CUDA;
}

extern "C" int
dk_cuda_driver_version(void)
{
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return v;
}

/* The first CUDA call of every binding comes through here: a driver too old for this build is
 * refused with dk_driver_check's message before anything else runs. */
extern "C" dk_status
dk_cuda_device_enter(int32_t device, int32_t *prev, dk_error *err)
{
    const dk_status ok = driver_ok(err);
    if (ok != DK_OK) {
        *prev = 0;
        return ok;
    }
    int cur = 0;
    cudaError_t e = cudaGetDevice(&cur);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return dk_fail(err, DK_ERR_CUDA, "device_enter(): CUDA error %s (%d)",
                       cudaGetErrorString(e), (int)e);
    }
    *prev = (int32_t)cur;
    if (cur != (int)device) {
        e = cudaSetDevice((int)device);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return dk_fail(err, DK_ERR_CUDA, "device_enter(): CUDA error %s (%d)",
                           cudaGetErrorString(e), (int)e);
        }
    }
    return DK_OK;
}

extern "C" void
dk_cuda_device_exit(int32_t prev)
{
    int cur = 0;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == (int)prev) {
        return;
    }
    (void)cudaSetDevice((int)prev);
    /* Errors are ignored by contract; clear them so the next launch check does not report
     * them as its own. */
    (void)cudaGetLastError();
}

extern "C" dk_status
dk_cuda_copy_to_host(void *dst, const void *src, size_t n, void *stream, dk_error *err)
{
    if (n == 0) {
        return DK_OK;
    }
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) {
        e = cudaStreamSynchronize(s);
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return dk_fail(err, DK_ERR_CUDA, "copy_to_host(): CUDA error %s (%d)",
                       cudaGetErrorString(e), (int)e);
    }
    return DK_OK;
}

extern "C" int
dk_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        /* No driver or no device: report none, and leave no error behind. */
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" int
dk_cuda_capability(int32_t device)
{
    int major = 0;
    int minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, (int)device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, (int)device) !=
            cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return major * 10 + minor;
}

extern "C" int
dk_cuda_runtime_version(void)
{
    return CUDART_VERSION;
}

/* diffkv.h's contract. */
extern "C" int
dk_cuda_stream_capturing(void *stream)
{
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing((cudaStream_t)stream, &status) != cudaSuccess) {
        (void)cudaGetLastError();
        return 1;
    }
    return status != cudaStreamCaptureStatusNone;
}
