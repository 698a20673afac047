/*
 * attention_sm90_fp8_tma.cu -- the TMA producer's forms of the e4m3 kernel
 * (attention_sm90_fp8.cuh), for attn_sm90_fp8_launch (attention_sm90_fp8.cu).  A file of its own
 * so that setup.py can build it at ptxas register-usage level 0 (NVCC_FILE_FLAGS), which
 * schedules these forms ~1 % faster and the cp.async ones 0-2 % slower (docs/fp8-log.md,
 * 2026-12-06).
 */
#include "attention_sm90_fp8.cuh"

cudaError_t
attn_sm90_fp8_launch_tma(const dk_attention_args *a, const CUtensorMap *maps, int64_t head_group,
                         float scale_log2, bool neg_q, bool q_vec, bool o_vec, cudaStream_t s)
{
    return h8_launch_form<true>(a, maps, head_group, scale_log2, neg_q, q_vec, o_vec, s);
}
