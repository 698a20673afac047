/*
 * attention_f32.cu -- paged attention in fp32 on any CUDA GPU: one warp per (token, head),
 * plain fp32 math over the visible keys, any head_size up to ATTN_F32_MAX_HEAD, every mask --
 * so every dtype the CPU reference takes also runs on CUDA.  The tensor-core kernels serve
 * fp16/bf16.
 *
 * Entry point (attention_internal.cuh): attn_f32_launch, called by dk_cuda_attention.
 */
#include "attention_common.cuh"
#include "attention_internal.cuh"
#include "cuda_common.cuh"

#include <math.h>
#include <stdint.h>

/*
 * One warp per (token, head): w = t * num_heads + h.  Lane l owns dims l + 32k (k < 8).  For
 * each visible key in order: the dot product is reduced over the warp, then the online
 * softmax update runs on every lane with the same numbers.
 */
/* clang-format off */
static __global__ void __launch_bounds__(ATTN_F32_WARPS * 32)
attention_f32_kernel(const dk_attention_args a, float scale_log2)
/* clang-format on */
{
    constexpr int PER_LANE = ATTN_F32_MAX_HEAD / 32;
    const int64_t w = (int64_t)blockIdx.x * ATTN_F32_WARPS + threadIdx.x / 32;
    const int lane = (int)threadIdx.x % 32;
    if (w >= a.num_tokens * a.num_heads) {
        return;
    }
    const int64_t t = w / a.num_heads;
    const int64_t h = w % a.num_heads;
    const int64_t row = dk_row_of_token(a.query_start_loc, a.num_rows, t);
    const int64_t q_start = a.query_start_loc[row];
    const int64_t query_len = a.query_start_loc[row + 1] - q_start;
    /* The table's reach bounds the keys read, whatever the device seq_lens says. */
    const int64_t seq_len = min((int64_t)a.seq_lens[row], a.bt_cols * a.block_size);
    /* A token outside every row (before query_start_loc[0] or past query_start_loc[num_rows])
     * sees no key: zeros and lse -inf, what the callers of the tiled kernels (which leave such
     * tokens alone) have zeroed there beforehand. */
    const int64_t i = t - q_start;
    const int32_t lim = i >= 0 && i < query_len ? key_limit(a, t, i, query_len, seq_len) : 0;
    const int64_t kv_head = h / (a.num_heads / a.num_kv_heads);
    const int32_t *bt = a.block_table + row * a.bt_stride_row;
    const float *q = (const float *)a.query + t * a.q_stride_token + h * a.q_stride_head;
    const float *kc = (const float *)a.key_cache;
    const float *vc = (const float *)a.value_cache;
    const float *kc2 = (const float *)a.key_cache2;
    const float *vc2 = (const float *)a.value_cache2;

    float qv[PER_LANE];
    float o[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        int64_t d = lane + 32 * k;
        qv[k] = d < a.head_size ? q[d * a.q_stride_dim] * scale_log2 : 0.0f;
        o[k] = 0.0f;
    }
    float m = -INFINITY;
    float l = 0.0f;
    for (int32_t j = 0; j < lim; j++) {
        const int32_t blk = dk_safe_block(a, bt[j / a.block_size]);
        const bool second = kc2 != NULL && blk >= a.blocks2; /* dense joint tokens */
        const float *kr = second ? kc2 : kc;
        const float *vr = second ? vc2 : vc;
        const int64_t kv_off = (int64_t)(second ? blk - a.blocks2 : blk) * a.cache_stride_block +
                               (j % a.block_size) * a.cache_stride_token +
                               kv_head * a.cache_stride_head;
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < PER_LANE; k++) {
            int64_t d = lane + 32 * k;
            if (d < a.head_size) {
                dot += qv[k] * kr[kv_off + d * a.cache_stride_dim];
            }
        }
#pragma unroll
        for (int sh = 16; sh > 0; sh >>= 1) {
            dot += __shfl_xor_sync(0xffffffffu, dot, sh);
        }
        const float mn = fmaxf(m, dot);
        const float alpha = exp2f(m - mn); /* m = -inf on the first key: alpha = 0 */
        const float p = exp2f(dot - mn);
        l = l * alpha + p;
#pragma unroll
        for (int k = 0; k < PER_LANE; k++) {
            int64_t d = lane + 32 * k;
            if (d < a.head_size) {
                o[k] = o[k] * alpha + p * vr[kv_off + d * a.cache_stride_dim];
            }
        }
        m = mn;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    if (a.lse != NULL && lane == 0) {
        /* m and the scores are already in log2 units of the scaled scores */
        a.lse[t * a.lse_stride_token + h * a.lse_stride_head] =
            l > 0.0f ? (m + log2f(l)) / LOG2E : -INFINITY;
    }
    float *orow = (float *)a.out + t * a.o_stride_token + h * a.o_stride_head;
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        int64_t d = lane + 32 * k;
        if (d < a.head_size) {
            orow[d * a.o_stride_dim] = o[k] * inv;
        }
    }
}

/* attention_internal.cuh's contract. */
cudaError_t
attn_f32_launch(const dk_attention_args *a, int64_t blocks, float scale_log2, cudaStream_t s)
{
    void *args[] = {(void *)a, &scale_log2};
    return dk_launch_after(a->pending, (const void *)attention_f32_kernel, dim3((unsigned)blocks),
                           dim3(ATTN_F32_WARPS * 32), 0, s, args);
}
