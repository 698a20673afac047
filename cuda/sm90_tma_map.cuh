/*
 * sm90_tma_map.cuh -- the TMA tensor maps of a paged cache for the warp-specialized Hopper kernel
 * (attention_sm90_ws.cu): the dimension order the kernel reads (h90_tma_dims, a kernel
 * parameter), the maps of one cache (h90_maps), which producer they allow (h90_producer), and
 * the host functions of cuda/sm90_tma_map.cu that encode them through a per-thread cache.
 */
#ifndef DIFFKV_SM90_TMA_MAP_CUH
#define DIFFKV_SM90_TMA_MAP_CUH

#include "diffkv.h"

#include <cuda.h> /* CUtensorMap and its encoder's types (header only) */

#include <stdint.h>

/* The tensor map's dimension order: which of dims 1..3 is the token within a block, the kv
 * head and the block (dims sorted by stride; dim 0 is head_size). */
struct h90_tma_dims {
    int32_t token, head, block;
    int32_t box;       /* keys per box: min(block_size, the tile: 128 or 176) */
    int32_t flat;      /* 0: no flat map; else which of its dims 1..2 is the token row (the other
                          is the kv head) */
    int32_t flat_only; /* every tile is a run of consecutive rows (the host counted them all, or
                          the caller vouched): flat boxes only, no per-block map */
    int32_t k_groups;  /* K and V by one TMA box per 16-key chunk (the 5-d maps
                          h90_kgroups_encode makes; tiles in the K_GROUPS layout, the kernel's
                          VG): 1 the kv head folded into the maps' panels (NHD), 2 into their
                          blocks (HND), 3 flat sources of vouched chunks (the kernel's VG 2;
                          DK_CONSECUTIVE_CHUNKS; the second source's maps in tfk2 / tfv2) */
};

/* The tensor maps of one cache (K and V): per block (dims) and, for a flat cache, over its
 * token rows (flat_k, flat_v; zeros otherwise). */
struct h90_maps {
    CUtensorMap k, v, flat_k, flat_v;
    CUtensorMap flat_k2, flat_v2;     /* the second source's (dense joint tokens), flat-only mode */
    CUtensorMap k_groups;             /* K by one box per 16-key chunk (h90_kgroups_encode) */
    CUtensorMap v_groups;             /* V likewise */
    CUtensorMap k_groups2, v_groups2; /* the second source's, flat chunks (k_groups_ok 3) */
    h90_tma_dims dims;
    int32_t tile;        /* keys per tile the maps' boxes were cut for: 128 or 176 */
    int32_t k_groups_ok; /* k_groups and v_groups are encoded: their h90_tma_dims.k_groups (1 NHD,
                            2 HND, 3 flat chunks), else 0 */
};

/* How the warp-specialized kernel's producer brings a cache in. */
enum h90_producer {
    H90_CP_ASYNC, /* cp.async rows ("sm90-ws") */
    H90_TMA,      /* TMA boxes ("sm90-tma") */
    H90_TMA_RUNS, /* TMA boxes when enough tiles are runs of consecutive blocks, else cp.async */
    H90_TMA_ALL_RUNS, /* flat boxes when every tile is a run, else cp.async */
};

/* Elements from one token row of a cache to the next within a block (a one-token block's is
 * the block stride): a flat cache -- consecutive blocks' rows consecutive rows -- has
 * cache_stride_block == block_size * this. */
static inline int64_t
h90_row_stride(const dk_attention_args *a)
{
    return a->block_size == 1 ? a->cache_stride_block : a->cache_stride_token;
}

#endif /* DIFFKV_SM90_TMA_MAP_CUH */
