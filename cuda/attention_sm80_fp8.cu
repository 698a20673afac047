/*
 * attention_sm80_fp8.cu -- the mma.sync kernel's e4m3-cache form (attention_sm80.cuh: the cache
 * widened to fp16 in shared memory), every head size of DK_CUDA_HEAD_SIZES; a file of its own so
 * that the build compiles it beside attention_sm80.cu.
 */
#include "attention_sm80.cuh"

#define MMA_HEAD(d) mma_head<d, true>(),
static const mma_launchers mma_kv8_heads[] = {DK_CUDA_HEAD_SIZES(MMA_HEAD)};
#undef MMA_HEAD

/* attention_sm80.cuh's contract: the call over an e4m3 cache (K/V rows the caller checked). */
cudaError_t
attn_mma_kv8_launch(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group,
                    float scale_log2, bool neg_q, bool q_vec, bool kv_vec, bool o_vec,
                    cudaStream_t s, attn_mma_form *form)
{
    return mma_run(mma_kv8_heads, sizeof(mma_kv8_heads) / sizeof(mma_kv8_heads[0]), a,
                   tiles_per_row, head_group, scale_log2, neg_q, q_vec, kv_vec, o_vec, s, form);
}
