/*
 * rows.cu -- token-row copies on the GPU between a right-padded layout and a packed one
 * (dk_rows_args in diffkv.h): gather dst[n] = src[index[n]]; scatter zero-fills dst, then
 * dst[index[n]] = src[n].  Bit copies in 16-byte units when every address is 16-byte aligned
 * and the dim strides are 1 (checked on the host), else one element at a time, any strides.
 *
 * Entry points: dk_cuda_rows_gather, dk_cuda_rows_scatter.
 */
#include "diffkv.h"

#include "cuda_common.cuh"

#include <cuda_runtime.h>

#include <stdint.h>

#define ROWS_MAX_THREADS 256

/*
 * One block per index entry n; its threads walk the (head, unit) items of one token row,
 * a unit being one U (16 bytes or one element).  Gather reads src row index[n] into dst row n,
 * scatter reads src row n into dst row index[n].  Indices are range-checked by the caller; a
 * repeated scatter index leaves one of the rows, unspecified which.
 */
template <typename U>
static __global__ void
rows_copy_kernel(const dk_rows_args a, bool scatter, int64_t elem_size, int32_t units_per_head,
                 int32_t elems_per_unit)
{
    int64_t n = blockIdx.x;
    int64_t src_tok = scatter ? n : a.index[n];
    int64_t dst_tok = scatter ? a.index[n] : n;
    int32_t items = (int32_t)a.num_heads * units_per_head;
    for (int32_t i = (int32_t)threadIdx.x; i < items; i += (int32_t)blockDim.x) {
        int64_t h = i / units_per_head;
        int64_t d = (int64_t)(i % units_per_head) * elems_per_unit;
        const char *src = (const char *)a.src + (src_tok * a.src_stride_token +
                                                 h * a.src_stride_head + d * a.src_stride_dim) *
                                                    elem_size;
        char *dst = (char *)a.dst +
                    (dst_tok * a.dst_stride_token + h * a.dst_stride_head + d * a.dst_stride_dim) *
                        elem_size;
        *(U *)dst = *(const U *)src;
    }
}

/* One block per dst row: every element of the row becomes all-zero bits. */
template <typename U>
static __global__ void
rows_zero_kernel(const dk_rows_args a, int64_t elem_size, int32_t units_per_head,
                 int32_t elems_per_unit)
{
    int64_t tok = blockIdx.x;
    int32_t items = (int32_t)a.num_heads * units_per_head;
    for (int32_t i = (int32_t)threadIdx.x; i < items; i += (int32_t)blockDim.x) {
        int64_t h = i / units_per_head;
        int64_t d = (int64_t)(i % units_per_head) * elems_per_unit;
        char *dst =
            (char *)a.dst +
            (tok * a.dst_stride_token + h * a.dst_stride_head + d * a.dst_stride_dim) * elem_size;
        *(U *)dst = U();
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

/* How one side (src or dst) of a copy may be read or written. */
static bool
side_vec(const void *p, int64_t stride_token, int64_t stride_head, int64_t stride_dim,
         int64_t head_size, int64_t es)
{
    return stride_dim == 1 && aligned16(head_size * es) && ptr_aligned16(p) &&
           aligned16(stride_token * es) && aligned16(stride_head * es);
}

/* Launch shape of one row of items; fills *threads and returns DK_OK, or an error when the
 * row is too wide for int32 item indices. */
static dk_status
row_shape(const char *op, const dk_rows_args *a, bool vec, int64_t es, int32_t *units_per_head,
          int32_t *elems_per_unit, unsigned *threads, dk_error *err)
{
    if (a->num_heads * a->head_size > (int64_t)INT32_MAX / 2) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "%s: num_heads * head_size must be at most %lld, got %lld", op,
                       (long long)(INT32_MAX / 2), (long long)(a->num_heads * a->head_size));
    }
    *elems_per_unit = vec ? (int32_t)(16 / es) : 1;
    *units_per_head = (int32_t)(a->head_size / *elems_per_unit);
    int64_t t = dk_cdiv(a->num_heads * *units_per_head, 32) * 32;
    *threads = (unsigned)(t > ROWS_MAX_THREADS ? ROWS_MAX_THREADS : t);
    return DK_OK;
}

/* The checks both directions share before launching: a->dtype has a fixed element size and
 * grid (the launch's one-dimensional grid: the number of rows it walks) fits DK_MAX_GRID_X.
 * DK_OK, or DK_ERR_UNSUPPORTED with a message naming op. */
static dk_status
check_common(const char *op, const dk_rows_args *a, int64_t grid, dk_error *err)
{
    size_t es = dk_dtype_size(a->dtype);
    if (es == 0) {
        return dk_fail(err, DK_ERR_UNSUPPORTED, "%s: dtype must have a fixed element size, got %s",
                       op, dk_dtype_name(a->dtype));
    }
    if (grid > DK_MAX_GRID_X) {
        return dk_fail(err, DK_ERR_UNSUPPORTED, "%s: token count must be at most %lld, got %lld",
                       op, (long long)DK_MAX_GRID_X, (long long)grid);
    }
    return DK_OK;
}

/* Launches rows_copy_kernel for one direction. */
static dk_status
launch_copy(const char *op, const dk_rows_args *a, bool scatter, void *stream, dk_error *err)
{
    int64_t es = (int64_t)dk_dtype_size(a->dtype);
    bool vec = side_vec(a->src, a->src_stride_token, a->src_stride_head, a->src_stride_dim,
                        a->head_size, es) &&
               side_vec(a->dst, a->dst_stride_token, a->dst_stride_head, a->dst_stride_dim,
                        a->head_size, es);
    int32_t units_per_head = 0;
    int32_t elems_per_unit = 0;
    unsigned threads = 0;
    dk_status st = row_shape(op, a, vec, es, &units_per_head, &elems_per_unit, &threads, err);
    if (st != DK_OK) {
        return st;
    }
    dim3 grid((unsigned)a->num_index);
    cudaStream_t s = (cudaStream_t)stream;
    if (vec) {
        rows_copy_kernel<uint4>
            <<<grid, threads, 0, s>>>(*a, scatter, es, units_per_head, elems_per_unit);
    }
    else if (es == 8) {
        rows_copy_kernel<uint64_t>
            <<<grid, threads, 0, s>>>(*a, scatter, es, units_per_head, elems_per_unit);
    }
    else if (es == 4) {
        rows_copy_kernel<uint32_t>
            <<<grid, threads, 0, s>>>(*a, scatter, es, units_per_head, elems_per_unit);
    }
    else if (es == 2) {
        rows_copy_kernel<uint16_t>
            <<<grid, threads, 0, s>>>(*a, scatter, es, units_per_head, elems_per_unit);
    }
    else {
        rows_copy_kernel<uint8_t>
            <<<grid, threads, 0, s>>>(*a, scatter, es, units_per_head, elems_per_unit);
    }
    return dk_cuda_after_launch(op, stream, err);
}

extern "C" dk_status
dk_cuda_rows_gather(const dk_rows_args *a, void *stream, dk_error *err)
{
    const char *op = "rows_gather()";
    dk_status st = check_common(op, a, a->num_index, err);
    if (st != DK_OK) {
        return st;
    }
    if (a->num_index <= 0 || a->num_heads <= 0 || a->head_size <= 0) {
        return DK_OK;
    }
    return launch_copy(op, a, false, stream, err);
}

extern "C" dk_status
dk_cuda_rows_scatter(const dk_rows_args *a, void *stream, dk_error *err)
{
    const char *op = "rows_scatter()";
    dk_status st =
        check_common(op, a, a->dst_tokens > a->num_index ? a->dst_tokens : a->num_index, err);
    if (st != DK_OK) {
        return st;
    }
    if (a->dst_tokens <= 0 || a->num_heads <= 0 || a->head_size <= 0) {
        return DK_OK;
    }
    int64_t es = (int64_t)dk_dtype_size(a->dtype);
    bool vec = side_vec(a->dst, a->dst_stride_token, a->dst_stride_head, a->dst_stride_dim,
                        a->head_size, es);
    int32_t units_per_head = 0;
    int32_t elems_per_unit = 0;
    unsigned threads = 0;
    st = row_shape(op, a, vec, es, &units_per_head, &elems_per_unit, &threads, err);
    if (st != DK_OK) {
        return st;
    }
    dim3 grid((unsigned)a->dst_tokens);
    cudaStream_t s = (cudaStream_t)stream;
    if (vec) {
        rows_zero_kernel<uint4><<<grid, threads, 0, s>>>(*a, es, units_per_head, elems_per_unit);
    }
    else if (es == 8) {
        rows_zero_kernel<uint64_t><<<grid, threads, 0, s>>>(*a, es, units_per_head, elems_per_unit);
    }
    else if (es == 4) {
        rows_zero_kernel<uint32_t><<<grid, threads, 0, s>>>(*a, es, units_per_head, elems_per_unit);
    }
    else if (es == 2) {
        rows_zero_kernel<uint16_t><<<grid, threads, 0, s>>>(*a, es, units_per_head, elems_per_unit);
    }
    else {
        rows_zero_kernel<uint8_t><<<grid, threads, 0, s>>>(*a, es, units_per_head, elems_per_unit);
    }
    st = dk_cuda_after_launch(op, stream, err);
    if (st != DK_OK || a->num_index <= 0) {
        return st;
    }
    return launch_copy(op, a, true, stream, err);
}
