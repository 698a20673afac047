/*
 * slots.cu -- slot mapping on the GPU: the cache slot of every packed query token, by vLLM's
 * BlockTables.compute_slot_mappings rule (context-parallel interleave included; see
 * dk_slots_args in diffkv.h).  One thread per token of [0, num_tokens_padded).
 *
 * Entry point: dk_cuda_slots.
 */
#include "diffkv.h"

#include "cuda_common.cuh"

#include <cuda_runtime.h>

#define SLOTS_THREADS 256

/*
 * One thread per token t of [0, num_tokens_padded): slot_mapping[t * slot_stride] = the cache
 * slot of packed query token t (its row's table row, block positions[t] / (block_size *
 * cp_size), then the offset within it as dk_slots_args describes), -1 for a padding token
 * (t >= num_tokens), a token stored on another context-parallel rank or a block the table
 * does not hold.  Assumes query_start_loc and row_indices were validated on the host; reads
 * nothing outside block_table whatever it holds.
 */
static __global__ void
slots_kernel(const dk_slots_args a)
{
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= a.num_tokens_padded) {
        return;
    }
    int64_t slot = -1;
    if (t < a.num_tokens) {
        int64_t i = dk_row_of_token(a.query_start_loc, a.num_rows, t);
        int64_t row = a.row_indices[i];
        int64_t p = a.positions[t];
        int64_t span = a.block_size * a.cp_size;
        int64_t blk = p / span;
        int64_t off = p % span;
        /* Row and block were validated on the host; a device table that disagrees gives -1
         * (skip), never a read outside the table. */
        int64_t phys = row >= 0 && row < a.table_rows && blk >= 0 && blk < a.table_cols
                           ? a.block_table[row * a.bt_stride_row + blk]
                           : -1;
        if (phys < 0) {
            slot = -1;
        }
        else if (a.cp_size == 1) {
            slot = phys * a.block_size + off;
        }
        else if ((off / a.cp_interleave) % a.cp_size == a.cp_rank) {
            slot = phys * a.block_size + (off / (a.cp_interleave * a.cp_size)) * a.cp_interleave +
                   off % a.cp_interleave;
        }
    }
    a.slot_mapping[t * a.slot_stride] = slot;
}

extern "C" dk_status
dk_cuda_slots(const dk_slots_args *a, void *stream, dk_error *err)
{
    if (a->num_tokens_padded <= 0) {
        return DK_OK;
    }
    if (a->num_tokens > 0 && a->num_rows <= 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "compute_slot_mappings(): num_rows must be positive when num_tokens > 0, "
                       "got %lld",
                       (long long)a->num_rows);
    }
    if (a->block_size <= 0 || a->cp_size <= 0 || a->cp_interleave <= 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "compute_slot_mappings(): block_size, cp_size and cp_interleave must be "
                       "positive, got %lld, %lld, %lld",
                       (long long)a->block_size, (long long)a->cp_size,
                       (long long)a->cp_interleave);
    }
    int64_t blocks = dk_cdiv(a->num_tokens_padded, SLOTS_THREADS);
    if (blocks > DK_MAX_GRID_X) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "compute_slot_mappings(): num_tokens_padded must be at most %lld, got %lld",
                       (long long)(DK_MAX_GRID_X * SLOTS_THREADS), (long long)a->num_tokens_padded);
    }
    slots_kernel<<<(unsigned)blocks, SLOTS_THREADS, 0, (cudaStream_t)stream>>>(*a);
    return dk_cuda_after_launch("compute_slot_mappings()", stream, err);
}
