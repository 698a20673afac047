/*
 * cuda_common.cuh -- what the .cu files of cuda/ share and diffkv.h must not see (it holds no
 * CUDA types): the post-launch error check and small launch-shape helpers.
 *
 * Entry points: dk_cuda_after_launch (defined in cuda/runtime.cu), dk_launch_after and
 * dk_cuda_launch_pending (cuda/launch.cu), dk_cdiv, dk_row_of_token.
 */
#ifndef DIFFKV_CUDA_COMMON_CUH
#define DIFFKV_CUDA_COMMON_CUH

#include "diffkv.h"

#include <cuda_runtime.h>

#include <stdint.h>

/*
 * Call right after every kernel launch.  Reports a launch error (cudaGetLastError) as
 * DK_ERR_CUDA "<op>: CUDA error <string> (<code>)"; when the environment variable
 * DIFFKV_SYNC_DEBUG=1 (read once per process), also synchronises `stream` and reports an
 * execution error the same way.  Returns DK_OK otherwise.
 */
dk_status dk_cuda_after_launch(const char *op, void *stream, dk_error *err);

/*
 * Launches (cuda/launch.cu).  dk_launch_after launches `func` (cudaLaunchKernel's arguments)
 * after the pending KV write *p when there is one (p may be NULL): as one cached two-kernel
 * CUDA graph (dk_cuda_layer), or as two launches while `s` is being captured, when the
 * environment says DIFFKV_LAUNCH_GRAPH=0, or when the graph calls fail (their error cleared).
 * *p is consumed either way.  Returns the launch error.  dk_cuda_launch_pending launches *p
 * alone, if still pending (DK_OK when nothing is), and reports a launch error as
 * dk_cuda_after_launch does.
 */
cudaError_t dk_launch_after(dk_pending_launch *p, const void *func, dim3 grid, dim3 block,
                            size_t smem, cudaStream_t s, void **args);
dk_status dk_cuda_launch_pending(dk_pending_launch *p, void *stream, dk_error *err);

/* Ceiling division for non-negative operands.  Cannot fail. */
static inline int64_t
dk_cdiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

/* Batch row of token t: the i in [0, num_rows) with qsl[i] <= t < qsl[i + 1].  Needs
 * qsl[0] <= t < qsl[num_rows]; empty rows are stepped over.  Cannot fail. */
static __device__ __forceinline__ int64_t
dk_row_of_token(const int32_t *qsl, int64_t num_rows, int64_t t)
{
    int64_t lo = 0;        /* qsl[lo] <= t */
    int64_t hi = num_rows; /* t < qsl[hi] */
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if ((int64_t)qsl[mid] <= t) {
            lo = mid;
        }
        else {
            hi = mid;
        }
    }
    return lo;
}

/* Largest grid.x a launch may use. */
#define DK_MAX_GRID_X ((int64_t)2147483647)
/* Largest grid.y / grid.z a launch may use. */
#define DK_MAX_GRID_YZ ((int64_t)65535)

#endif /* DIFFKV_CUDA_COMMON_CUH */
