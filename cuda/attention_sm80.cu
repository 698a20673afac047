/*
 * attention_sm80.cu -- the mma.sync kernel (attention_sm80.cuh) over caches of the query dtype
 * (fp16/bf16), every head size of DK_CUDA_HEAD_SIZES, and its entry point; the e4m3-cache
 * instantiations are attention_sm80_fp8.cu's.
 */
#include "attention_sm80.cuh"

#define MMA_HEAD(d) mma_head<d, false>(),
static const mma_launchers mma_heads[] = {DK_CUDA_HEAD_SIZES(MMA_HEAD)};
#undef MMA_HEAD

/* attention_internal.cuh's contract: the instantiation for the call's dtype, head size and
 * cache dtype (kv_fp8: attention_sm80_fp8.cu's). */
cudaError_t
attn_mma_launch(const dk_attention_args *a, int64_t tiles_per_row, int64_t head_group,
                float scale_log2, bool neg_q, bool q_vec, bool kv_vec, bool o_vec, cudaStream_t s,
                attn_mma_form *form)
{
    if (a->kv_fp8) {
        return attn_mma_kv8_launch(a, tiles_per_row, head_group, scale_log2, neg_q, q_vec, kv_vec,
                                   o_vec, s, form);
    }
    return mma_run(mma_heads, sizeof(mma_heads) / sizeof(mma_heads[0]), a, tiles_per_row,
                   head_group, scale_log2, neg_q, q_vec, kv_vec, o_vec, s, form);
}
