/*
 * sm90_tma_map.cu -- host side of the warp-specialized Hopper kernel's TMA: fetches the driver's
 * tensor-map encoder, encodes the maps a cache suits (per block, flat over token rows, per
 * 16-key chunk) and keeps them in a per-thread cache keyed by the cache's pointers, shape and
 * strides.
 *
 * Entry points (attention_internal.cuh): h90_tma_maps, h8_tma_chunk_maps, h90_tma_encoder_ready.
 */
#include "attention_internal.cuh"
#include "sm90_tma_map.cuh"

#include <cuda.h>
#include <cuda_runtime.h>
#include <string.h>

/* Smallest block (keys) brought in by per-block TMA boxes in any order: a box of 16 rows costs
 * more than the cp.async producer's rows, 32+ rows less.  Smaller blocks of a flat cache take
 * TMA only as flat boxes over runs of consecutive blocks (the dispatcher counts the runs). */
#define H90T_MIN_BOX 32

/* cuTensorMapEncodeTiled's type: the extension links no libcuda, the driver gives the entry
 * point at run time. */
typedef CUresult (*h90_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                  const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                  const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* The driver's encoder, fetched at the first call (a race fetches the same pointer twice);
 * NULL when the driver has none.  Cannot fail otherwise. */
static h90_encode_fn
h90_encoder(void)
{
    static h90_encode_fn volatile fn;
    static volatile int tried;
    if (!tried) {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
        /* CUDA 13 has only the ByVersion form (12.5 added it) */
        const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                               cudaEnableDefault, &q);
#else
        const cudaError_t e =
            cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q);
#endif
        if (e == cudaSuccess && q == cudaDriverEntryPointSuccess) {
            fn = (h90_encode_fn)p;
        }
        tried = 1; /* a race fetches the same pointer twice */
    }
    return fn;
}

/* Encodes a map of `rank` dims of the cache's dtype over `base` (byte strides of dims 1..), in
 * the one form every map here takes: 128-byte swizzle (the wgmma layout), 256-byte L2
 * promotion, no interleave, zeros out of bounds.  Returns whether the driver encoded it. */
static bool
h90_encode_tiled(h90_encode_fn encode, CUtensorMap *map, const dk_attention_args *a,
                 const void *base, int rank, const cuuint64_t *gdim, const cuuint64_t *gstride,
                 const cuuint32_t *box)
{
    const cuuint32_t estride[5] = {1, 1, 1, 1, 1};
    const CUtensorMapDataType ty =
        a->dtype == DK_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return encode(map, ty, (cuuint32_t)rank, (void *)base, gdim, gstride, box, estride,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* Encodes one 4-d (per block) or 3-d (flat) map of `base`: dim 0 the head_size elements, then
 * the given extents and element strides (dims[0] fastest in memory), box 64 x box_rows on the
 * token dim (tok, 1-based) x 1.  Returns false, leaving *map unspecified, when a stride or
 * extent is out of the map's range or the driver refuses it. */
static bool
h90_encode(h90_encode_fn encode, CUtensorMap *map, const dk_attention_args *a, const void *base,
           int rank, const int64_t *extent, const int64_t *stride, int tok, int32_t box_rows)
{
    cuuint64_t gdim[4] = {(cuuint64_t)a->head_size, 0, 0, 0};
    cuuint64_t gstride[3] = {0, 0, 0};
    cuuint32_t box[4] = {64, 1, 1, 1};
    for (int k = 0; k + 1 < rank; k++) {
        if (stride[k] <= 0 || stride[k] * 2 >= ((int64_t)1 << 40) ||
            extent[k] > (int64_t)INT32_MAX) {
            return false;
        }
        gdim[k + 1] = (cuuint64_t)extent[k];
        gstride[k] = (cuuint64_t)(stride[k] * 2);
    }
    box[tok] = (cuuint32_t)box_rows;
    return h90_encode_tiled(encode, map, a, base, rank, gdim, gstride, box);
}

/* The K (or V) map of the per-chunk producer ("sm90-tma16"): a cache of head size D = 128, 192
 * or 256 whose kv heads are adjacent D-element rows (vLLM's NHD layout, or one layer of a
 * layer-strided one), as 5 dims -- 64 elements (one 64-dim panel), 8 tokens, P = D / 64 panels
 * times num_kv_heads (the kv head folded into the panel: 128 bytes apart either way),
 * block_size / 8 groups of 8 tokens, block -- or a contiguous HND cache with the kv head folded
 * into the block instead (dims 64, 8, P, block_size / 8, num_blocks * num_kv_heads); returns the
 * h90_tma_dims.k_groups it encoded for, 0 for none.  One 64 x 8 x P x 2 box brings a 16-key
 * chunk, every panel, as two 8-row groups of all P panels (P KB a group: the K_GROUPS layout
 * of h90_qk).  Random 16-key tables then take one box per chunk per K or V tile instead of
 * one per block and panel.  Cannot fail: a cache the maps cannot fold, or a driver that
 * refuses the map, gives 0. */
static int32_t
h90_kgroups_encode(const dk_attention_args *a, CUtensorMap *map, const void *base)
{
    /* NHD: the kv head folded into the halves; HND: into the blocks */
    const int32_t layout = dk_attention_chunk_layout(a);
    if (layout == 0) {
        return 0;
    }
    const bool nhd = layout == 1;
    const int64_t bs = a->block_size;
    const h90_encode_fn encode = h90_encoder();
    if (encode == NULL) {
        return 0;
    }
    const cuuint64_t tok = (cuuint64_t)a->cache_stride_token * 2; /* bytes */
    const cuuint32_t panels = (cuuint32_t)(a->head_size / 64);    /* 64-dim panels per row */
    const cuuint64_t gdim[5] = {
        64, 8, (cuuint64_t)(nhd ? panels * a->num_kv_heads : panels), (cuuint64_t)(bs / 8),
        (cuuint64_t)(nhd ? a->num_blocks : a->num_blocks * a->num_kv_heads)};
    const cuuint64_t gstride[4] = {
        tok, 128, 8 * tok, (cuuint64_t)(nhd ? a->cache_stride_block : a->cache_stride_head) * 2};
    const cuuint32_t box[5] = {64, 8, panels, 2, 1};
    if (!h90_encode_tiled(encode, map, a, base, 5, gdim, gstride, box)) {
        return 0;
    }
    return nhd ? 1 : 2;
}

/* The per-chunk maps of dense_attention's vouched chunks (DK_CONSECUTIVE_CHUNKS in
 * keys_consecutive): each source ([rows, num_kv_heads, 128] token rows, NHD) as one block of
 * all its rows, so a chunk's coordinates are its first row / 8 (h90_produce_tma_groups, FLAT);
 * rows a multiple of 8 (the map then ends where the source does: a chunk half past it reads
 * zeros) and under 2^31.  Returns 3 when all four maps are encoded, else 0. */
static int32_t
h90_kgroups_flat(const dk_attention_args *a, h90_maps *m)
{
    const bool two = a->key_cache2 != NULL;
    const int64_t bs = a->block_size;
    if (bs < 1 || a->num_blocks > (int64_t)INT32_MAX / bs) {
        return 0;
    }
    const int64_t rows1 = (two ? a->blocks2 : a->num_blocks) * bs;
    const int64_t rows2 = two ? (a->num_blocks - a->blocks2) * bs : 0;
    dk_attention_args one = *a;
    one.key_cache2 = NULL;
    one.value_cache2 = NULL;
    one.num_blocks = 1;
    one.bt_cols = 1;
    one.cache_stride_token = h90_row_stride(a); /* a one-token block's is the block stride */
    one.cache_stride_block = one.cache_stride_token * 8; /* never stepped: one block */
    const struct {
        const void *k, *v;
        int64_t rows;
        CUtensorMap *km, *vm;
    } src[2] = {{a->key_cache, a->value_cache, rows1, &m->k_groups, &m->v_groups},
                {two ? a->key_cache2 : a->key_cache, two ? a->value_cache2 : a->value_cache,
                 two ? rows2 : rows1, &m->k_groups2, &m->v_groups2}};
    for (int i = 0; i < 2; i++) {
        one.block_size = src[i].rows;
        if (src[i].rows < 8 || src[i].rows % 8 != 0 ||
            h90_kgroups_encode(&one, src[i].km, src[i].k) != 1 ||
            h90_kgroups_encode(&one, src[i].vm, src[i].v) != 1) {
            return 0;
        }
    }
    return 3;
}

/* Encodes the tensor maps that suit this cache (the caller checked 16-byte chunks) into *m and
 * returns the producer they allow: per-block boxes for a power-of-two block_size of at least
 * H90T_MIN_BOX or one block of 128+ keys per row (dims 1..3 of those maps ordered by stride,
 * as m->dims records), plus the flat map of a flat cache of blocks under 128 keys (m->dims.flat);
 * smaller power-of-two blocks of a flat cache (at most 32 boxes per tile: one per lane) only
 * with enough runs (H90_TMA_RUNS), yet smaller ones flat boxes only and only when every tile is
 * a run (H90_TMA_ALL_RUNS; the launch checks the runs); cp.async otherwise (or when the driver
 * cannot encode maps).  The per-chunk maps are h90_tma_maps's business. */
static h90_producer
h90_tma_maps_encode(const dk_attention_args *a, int32_t tile, h90_maps *m)
{
    const int64_t bs = a->block_size;
    /* power-of-two blocks: a tile never straddles two; one block per row (dense K/V): a tile
     * never leaves it, and the part of its last box past the block is TMA's zero fill */
    const bool pow2 = (bs & (bs - 1)) == 0;
    const bool one_block = a->bt_cols == 1 && bs >= 128;
    /* flat: consecutive blocks' rows are consecutive token rows (a tile of BN keys spans
     * several blocks only when bs < BN) */
    const int64_t row_stride = h90_row_stride(a);
    const bool flat = pow2 && bs < 128 && a->cache_stride_block == bs * row_stride &&
                      a->num_blocks <= (int64_t)INT32_MAX / bs;
    const bool small = flat && bs < H90T_MIN_BOX && (tile / bs) * (a->head_size / 64) <= 32;
    /* blocks too small for a box each (dense one-token blocks): flat boxes or nothing */
    const bool all_runs = flat && bs < H90T_MIN_BOX && !small;
    /* a second source (blocks blocks2 .. of key_cache2): flat boxes only, a tile from one */
    const bool two = a->key_cache2 != NULL;
    if (!((pow2 && bs >= H90T_MIN_BOX) || one_block || small || all_runs) || a->num_blocks < 1 ||
        (two && !(all_runs && a->blocks2 > 0 && a->blocks2 < a->num_blocks))) {
        return H90_CP_ASYNC;
    }
    const h90_encode_fn encode = h90_encoder();
    if (encode == NULL) {
        return H90_CP_ASYNC;
    }
    m->dims.flat = 0;
    m->dims.flat_only = 0;
    if (flat) {
        /* token rows and kv heads, by stride */
        const bool tok_first = row_stride <= a->cache_stride_head;
        const int64_t rows1 = (two ? a->blocks2 : a->num_blocks) * bs;
        const int64_t rows2 = (a->num_blocks - a->blocks2) * bs;
        const int64_t fx[2] = {tok_first ? rows1 : a->num_kv_heads,
                               tok_first ? a->num_kv_heads : rows1};
        const int64_t fx2[2] = {tok_first ? rows2 : a->num_kv_heads,
                                tok_first ? a->num_kv_heads : rows2};
        const int64_t fs[2] = {tok_first ? row_stride : a->cache_stride_head,
                               tok_first ? a->cache_stride_head : row_stride};
        const int tok = tok_first ? 1 : 2;
        if (h90_encode(encode, &m->flat_k, a, a->key_cache, 3, fx, fs, tok, tile) &&
            h90_encode(encode, &m->flat_v, a, a->value_cache, 3, fx, fs, tok, tile) &&
            (!two ||
             (h90_encode(encode, &m->flat_k2, a, a->key_cache2, 3, fx2, fs, tok, tile) &&
              h90_encode(encode, &m->flat_v2, a, a->value_cache2, 3, fx2, fs, tok, tile)))) {
            m->dims.flat = tok;
        }
        else if (small || all_runs) {
            return H90_CP_ASYNC; /* small boxes only pay with the flat map */
        }
    }
    if (all_runs) {
        m->dims.box = (int32_t)bs; /* the TMA producer, every tile one flat box per half */
        m->dims.flat_only = 1;
        return H90_TMA_ALL_RUNS;
    }
    /* 0: token within the block, 1: kv head, 2: block -- sorted by element stride */
    const int64_t stride[3] = {a->cache_stride_token, a->cache_stride_head, a->cache_stride_block};
    const int64_t extent[3] = {bs, a->num_kv_heads, a->num_blocks};
    int order[3] = {0, 1, 2};
    for (int i = 1; i < 3; i++) {
        for (int k = i; k > 0 && stride[order[k]] < stride[order[k - 1]]; k--) {
            const int t = order[k];
            order[k] = order[k - 1];
            order[k - 1] = t;
        }
    }
    int64_t sx[3], sst[3];
    for (int k = 0; k < 3; k++) {
        sx[k] = extent[order[k]];
        sst[k] = stride[order[k]];
        int32_t *slot = order[k] == 0   ? &m->dims.token
                        : order[k] == 1 ? &m->dims.head
                                        : &m->dims.block;
        *slot = k + 1;
    }
    m->dims.box = (int32_t)(bs < tile ? bs : tile);
    if (!h90_encode(encode, &m->k, a, a->key_cache, 4, sx, sst, m->dims.token, m->dims.box) ||
        !h90_encode(encode, &m->v, a, a->value_cache, 4, sx, sst, m->dims.token, m->dims.box)) {
        return H90_CP_ASYNC;
    }
    return small ? H90_TMA_RUNS : H90_TMA;
}

/* What the maps of a cache depend on: encoding costs microseconds of host time per map, and a
 * model's layers call with the same few caches again and again. */
struct h90_maps_key {
    const void *k, *v, *k2, *v2;
    int64_t block_size, num_blocks, blocks2, num_kv_heads, head_size, bt_cols_one;
    int64_t stride_token, stride_head, stride_block;
    int32_t dtype, tile, chunks;
};

#define H90_MAPS_CACHE 64 /* caches (layers) remembered per host thread */

/* The key fields every map cache fills from the call (zeros elsewhere, padding included). */
static h90_maps_key
h90_cache_key(const dk_attention_args *a)
{
    h90_maps_key key;
    memset(&key, 0, sizeof(key)); /* padding compares equal */
    key.k = a->key_cache;
    key.v = a->value_cache;
    key.block_size = a->block_size;
    key.num_blocks = a->num_blocks;
    key.num_kv_heads = a->num_kv_heads;
    key.head_size = a->head_size;
    key.stride_token = a->cache_stride_token;
    key.stride_head = a->cache_stride_head;
    key.stride_block = a->cache_stride_block;
    return key;
}

/* attention_internal.cuh's contract: h90_tma_maps_encode and the per-chunk maps through a
 * per-thread cache of the last H90_MAPS_CACHE caches' maps (hashed by the K pointer and the
 * tile).  A cache the maps cannot serve is remembered too. */
h90_producer
h90_tma_maps(const dk_attention_args *a, int32_t tile, h90_maps *m)
{
    struct entry {
        h90_maps_key key;
        h90_maps maps;
        bool used;
        h90_producer producer;
    };
    static thread_local entry cache[H90_MAPS_CACHE];
    h90_maps_key key = h90_cache_key(a);
    key.bt_cols_one = a->bt_cols == 1;
    key.dtype = (int32_t)a->dtype;
    key.tile = tile;
    key.chunks = (a->keys_consecutive & DK_CONSECUTIVE_CHUNKS) != 0;
    key.k2 = a->key_cache2;
    key.v2 = a->value_cache2;
    key.blocks2 = a->key_cache2 != NULL ? a->blocks2 : 0;
    const uintptr_t p = (uintptr_t)a->key_cache;
    /* the tile in the hash: a cache's maps for 128- and 176-key tiles take different entries */
    entry &e = cache[(p >> 8 ^ p >> 20 ^ (uintptr_t)tile) % H90_MAPS_CACHE];
    if (!(e.used && memcmp(&e.key, &key, sizeof(key)) == 0)) {
        memset(&e.maps, 0, sizeof(e.maps));
        e.producer = h90_tma_maps_encode(a, tile, &e.maps);
        if (e.producer == H90_CP_ASYNC) {
            memset(&e.maps, 0, sizeof(e.maps)); /* dims.box 0, no flat map */
        }
        if ((a->keys_consecutive & DK_CONSECUTIVE_CHUNKS) != 0) {
            e.maps.k_groups_ok = h90_kgroups_flat(a, &e.maps);
        }
        else {
            e.maps.k_groups_ok = h90_kgroups_encode(a, &e.maps.k_groups, a->key_cache);
            if (e.maps.k_groups_ok != 0 &&
                h90_kgroups_encode(a, &e.maps.v_groups, a->value_cache) != e.maps.k_groups_ok) {
                e.maps.k_groups_ok = 0;
            }
        }
        e.key = key;
        e.used = true;
    }
    *m = e.maps;
    return e.producer;
}

/* One per-chunk map of an e4m3 cache (h8_tma_chunk_maps): 4 dims -- the head_size bytes of a
 * key row (64 or 128), the token within a block, the kv head, the block, each with its own byte
 * stride (any order: NHD, HND, layer-strided) -- and a box of 128 x ck x 1 x 1 (ck:
 * h8_box_keys's answer): at head 64 the box's second 64 bytes of a row lie past the map's rows and
 * land as zeros (the kernel's slots keep 128-byte rows at either head size), as do a one-block
 * row's keys past its block.  Returns whether the driver encoded it. */
static bool
h8_chunk_encode(const dk_attention_args *a, CUtensorMap *map, const void *base, int ck)
{
    const h90_encode_fn encode = h90_encoder();
    const int64_t stride[3] = {a->cache_stride_token, a->cache_stride_head, a->cache_stride_block};
    const int64_t extent[3] = {a->block_size, a->num_kv_heads, a->num_blocks};
    if (encode == NULL || (a->head_size != 128 && a->head_size != 64) || a->cache_stride_dim != 1) {
        return false;
    }
    cuuint64_t gdim[4] = {(cuuint64_t)a->head_size, 0, 0, 0};
    cuuint64_t gstride[3];
    for (int k = 0; k < 3; k++) {
        if (stride[k] <= 0 || stride[k] % 16 != 0 || stride[k] >= ((int64_t)1 << 40) ||
            extent[k] > (int64_t)INT32_MAX) {
            return false;
        }
        gdim[k + 1] = (cuuint64_t)extent[k];
        gstride[k] = (cuuint64_t)stride[k]; /* one byte per element */
    }
    const cuuint32_t box[4] = {128, (cuuint32_t)ck, 1, 1};
    const cuuint32_t estride[4] = {1, 1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, (void *)base, gdim, gstride, box, estride,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* attention_internal.cuh's contract. */
bool
h8_tma_chunk_maps(const dk_attention_args *a, CUtensorMap *k, CUtensorMap *v)
{
    struct entry {
        h90_maps_key key;
        CUtensorMap k, v;
        bool used, ok;
    };
    static thread_local entry cache[H90_MAPS_CACHE];
    const int ck = h8_box_keys(a);
    if (a->key_cache2 != NULL || ck == 0) {
        return false;
    }
    h90_maps_key key = h90_cache_key(a);
    key.dtype = DK_F8E4M3; /* the cache's, where the other maps key the query's */
    key.tile = ck;         /* the box's keys, which bt_cols can change */
    const uintptr_t p = (uintptr_t)a->key_cache;
    entry &e = cache[(p >> 8 ^ p >> 20) % H90_MAPS_CACHE];
    if (!(e.used && memcmp(&e.key, &key, sizeof(key)) == 0)) {
        e.ok = h8_chunk_encode(a, &e.k, a->key_cache, ck) &&
               h8_chunk_encode(a, &e.v, a->value_cache, ck);
        e.key = key;
        e.used = true;
    }
    if (e.ok) {
        *k = e.k;
        *v = e.v;
    }
    return e.ok;
}

/* One map of the persistent kernel (h90_persist_maps): `base` (a query or an output of the
 * call's dtype) as 4 dims -- head_size elements, the heads, a row's uniform_query_len tokens,
 * the rows -- from its element strides between heads and tokens (each row's tokens follow the
 * row before's), box 64 elements x 1 x `box_rows` x 1.  Returns false when a stride or extent
 * is out of the map's range or the driver refuses it. */
static bool
h90_rows_map(h90_encode_fn encode, CUtensorMap *map, const dk_attention_args *a, const void *base,
             int64_t stride_token, int64_t stride_head, int64_t stride_dim, uint32_t box_rows)
{
    const int64_t sh = stride_head * 2, st = stride_token * 2; /* bytes */
    const int64_t sr = st * a->uniform_query_len;
    if (stride_dim != 1 || (uintptr_t)base % 16 != 0 || sh <= 0 || st <= 0 || sh % 16 != 0 ||
        st % 16 != 0 || sh >= ((int64_t)1 << 40) || sr >= ((int64_t)1 << 40) ||
        a->num_heads > INT32_MAX || a->num_rows > INT32_MAX) {
        return false;
    }
    const cuuint64_t gdim[4] = {(cuuint64_t)a->head_size, (cuuint64_t)a->num_heads,
                                (cuuint64_t)a->uniform_query_len, (cuuint64_t)a->num_rows};
    const cuuint64_t gstride[3] = {(cuuint64_t)sh, (cuuint64_t)st, (cuuint64_t)sr};
    const cuuint32_t box[4] = {64, 1, box_rows, 1};
    return h90_encode_tiled(encode, map, a, base, 4, gdim, gstride, box);
}

/* attention_internal.cuh's contract: the query's map (boxes of 128 rows) and the output's (64
 * rows), kept for the last call of this host thread (a layer's steps pass the same buffers). */
bool
h90_persist_maps(const dk_attention_args *a, CUtensorMap *q, CUtensorMap *o)
{
    struct rows_key {
        const void *query, *out;
        int64_t q_token, q_head, q_dim, o_token, o_head, o_dim, rows, heads, head_size;
        int32_t query_len, dtype;
    };
    static thread_local rows_key last;
    static thread_local CUtensorMap last_q, last_o;
    static thread_local bool last_ok;
    rows_key key;
    memset(&key, 0, sizeof(key)); /* compared with memcmp: no stray padding bytes */
    key.query = a->query;
    key.out = a->out;
    key.q_token = a->q_stride_token;
    key.q_head = a->q_stride_head;
    key.q_dim = a->q_stride_dim;
    key.o_token = a->o_stride_token;
    key.o_head = a->o_stride_head;
    key.o_dim = a->o_stride_dim;
    key.rows = a->num_rows;
    key.heads = a->num_heads;
    key.head_size = a->head_size;
    key.query_len = a->uniform_query_len;
    key.dtype = (int32_t)a->dtype;
    if (!(last_ok && memcmp(&key, &last, sizeof(key)) == 0)) {
        const h90_encode_fn encode = h90_encoder();
        last_ok = encode != NULL && a->uniform_query_len > 0 &&
                  h90_rows_map(encode, &last_q, a, a->query, a->q_stride_token, a->q_stride_head,
                               a->q_stride_dim, 128) &&
                  h90_rows_map(encode, &last_o, a, a->out, a->o_stride_token, a->o_stride_head,
                               a->o_stride_dim, 64);
        last = key;
    }
    if (last_ok) {
        *q = last_q;
        *o = last_o;
    }
    return last_ok;
}

/* attention_internal.cuh's contract. */
bool
h90_tma_encoder_ready(void)
{
    return h90_encoder() != NULL;
}
