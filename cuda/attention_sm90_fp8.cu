/*
 * attention_sm90_fp8.cu -- attn_sm90_fp8_launch (attention_internal.cuh): the e4m3 kernel of
 * attention_sm90_fp8.cuh with the TMA producer where the cache's per-chunk maps exist (its forms
 * in attention_sm90_fp8_tma.cu, compiled with other ptxas options), else with the cp.async
 * producer, whose forms are instantiated here.
 */
#include "attention_sm90_fp8.cuh"

/* attention_internal.cuh's contract: the TMA producer where h8_tma_chunk_maps encodes the
 * cache's maps (head 64 or 128, one source, h8_box_keys not 0), else cp.async. */
cudaError_t
attn_sm90_fp8_launch(const dk_attention_args *a, int64_t head_group, float scale_log2, bool neg_q,
                     bool q_vec, bool o_vec, cudaStream_t s, bool *tma)
{
    CUtensorMap maps[2];
    memset(maps, 0, sizeof(maps));
    *tma = h8_tma_chunk_maps(a, &maps[0], &maps[1]);
    if (*tma) {
        return attn_sm90_fp8_launch_tma(a, maps, head_group, scale_log2, neg_q, q_vec, o_vec, s);
    }
    return h8_launch_form<false>(a, maps, head_group, scale_log2, neg_q, q_vec, o_vec, s);
}
