/*
 * ref_attention.c -- the CPU reference of the tensor ops: KV write into the paged cache (and the
 * dense forward's fp8 rounding of its keys and values, a KV write with scales from them), the
 * host-side bounds check of paged attention, paged attention itself (every mask mode, GQA,
 * fp32 accumulation, optionally the log-sum-exp of every (token, head) that context-parallel
 * ranks need to merge their partial outputs) and the packed <-> padded row copies.  Plain loops;
 * every address is computed from int64 element strides, so any view (transposed, block-major,
 * packed) works. The CUDA kernels in cuda/ are checked against these routines.
 *
 * Entry points: dk_ref_kv_write, dk_ref_quantize_kv, dk_attention_check, dk_ref_attention,
 * dk_ref_rows_gather, dk_ref_rows_scatter.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include "diffkv.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* Element helpers                                                                             */
/* ------------------------------------------------------------------------------------------ */

static int
is_float_dtype(dk_dtype dtype)
{
    return dtype == DK_F32 || dtype == DK_F16 || dtype == DK_BF16;
}

/* Copies one [num_heads, head_size] token bit for bit; offsets are in elements. */
static void
copy_token(char *dst, int64_t dst_off, int64_t dst_stride_head, int64_t dst_stride_dim,
           const char *src, int64_t src_off, int64_t src_stride_head, int64_t src_stride_dim,
           int64_t num_heads, int64_t head_size, size_t es)
{
    for (int64_t h = 0; h < num_heads; h++) {
        char *d = dst + (dst_off + h * dst_stride_head) * (int64_t)es;
        const char *s = src + (src_off + h * src_stride_head) * (int64_t)es;
        if (dst_stride_dim == 1 && src_stride_dim == 1) {
            memcpy(d, s, (size_t)head_size * es);
            continue;
        }
        for (int64_t k = 0; k < head_size; k++) {
            memcpy(d + k * dst_stride_dim * (int64_t)es, s + k * src_stride_dim * (int64_t)es, es);
        }
    }
}

/* Zeroes one [num_heads, head_size] token (all-zero bits are +0 in every float dtype). */
static void
zero_token(char *dst, int64_t dst_off, int64_t stride_head, int64_t stride_dim, int64_t num_heads,
           int64_t head_size, size_t es)
{
    for (int64_t h = 0; h < num_heads; h++) {
        char *d = dst + (dst_off + h * stride_head) * (int64_t)es;
        if (stride_dim == 1) {
            memset(d, 0, (size_t)head_size * es);
            continue;
        }
        for (int64_t k = 0; k < head_size; k++) {
            memset(d + k * stride_dim * (int64_t)es, 0, es);
        }
    }
}

/* out[k] = base[off + k * stride] as fp32, k < n; one dtype switch per row. */
static void
load_row(const void *base, int64_t off, int64_t stride, int64_t n, dk_dtype dtype, float *out)
{
    switch (dtype) {
    case DK_F32: {
        const float *p = (const float *)base + off;
        for (int64_t k = 0; k < n; k++) {
            out[k] = p[k * stride];
        }
        break;
    }
    case DK_F16: {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int64_t k = 0; k < n; k++) {
            out[k] = dk_f16_to_f32(p[k * stride]);
        }
        break;
    }
    case DK_BF16: {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int64_t k = 0; k < n; k++) {
            out[k] = dk_bf16_to_f32(p[k * stride]);
        }
        break;
    }
    default:
        break; /* callers have checked the dtype */
    }
}

/* out[k] = e4m3 base[off + k * stride] * scale in fp32, k < n (a float8_e4m3fn cache row). */
static void
load_row_e4m3(const void *base, int64_t off, int64_t stride, int64_t n, float scale, float *out)
{
    const uint8_t *p = (const uint8_t *)base + off;
    for (int64_t k = 0; k < n; k++) {
        out[k] = dk_e4m3_to_f32(p[k * stride]) * scale;
    }
}

/* base[off + k * stride] = in[k] rounded to dtype (nearest even), k < n. */
static void
store_row(void *base, int64_t off, int64_t stride, int64_t n, dk_dtype dtype, const float *in)
{
    switch (dtype) {
    case DK_F32: {
        float *p = (float *)base + off;
        for (int64_t k = 0; k < n; k++) {
            p[k * stride] = in[k];
        }
        break;
    }
    case DK_F16: {
        uint16_t *p = (uint16_t *)base + off;
        for (int64_t k = 0; k < n; k++) {
            p[k * stride] = dk_f32_to_f16(in[k]);
        }
        break;
    }
    case DK_BF16: {
        uint16_t *p = (uint16_t *)base + off;
        for (int64_t k = 0; k < n; k++) {
            p[k * stride] = dk_f32_to_bf16(in[k]);
        }
        break;
    }
    default:
        break; /* callers have checked the dtype */
    }
}

/* ------------------------------------------------------------------------------------------ */
/* KV write                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* One [num_heads, head_size] token of src (dtype, element offsets) into the float8_e4m3fn
 * cache at dst_off: dk_f32_to_e4m3(x / scale[h * scale_stride]). */
static void
quantize_token(uint8_t *dst, int64_t dst_off, int64_t dst_stride_head, int64_t dst_stride_dim,
               const char *src, int64_t src_off, int64_t src_stride_head, int64_t src_stride_dim,
               dk_dtype dtype, const float *scale, int64_t scale_stride, int64_t num_heads,
               int64_t head_size)
{
    float row[DK_REF_MAX_HEAD_SIZE];
    for (int64_t h = 0; h < num_heads; h++) {
        const float s = scale[h * scale_stride];
        uint8_t *d = dst + dst_off + h * dst_stride_head;
        for (int64_t k0 = 0; k0 < head_size; k0 += DK_REF_MAX_HEAD_SIZE) {
            const int64_t n =
                head_size - k0 < DK_REF_MAX_HEAD_SIZE ? head_size - k0 : DK_REF_MAX_HEAD_SIZE;
            load_row(src, src_off + h * src_stride_head + k0 * src_stride_dim, src_stride_dim, n,
                     dtype, row);
            for (int64_t k = 0; k < n; k++) {
                d[(k0 + k) * dst_stride_dim] = dk_f32_to_e4m3(row[k] / s);
            }
        }
    }
}

dk_status
dk_ref_kv_write(const dk_kv_write_args *a, dk_error *err)
{
    if (!is_float_dtype(a->dtype)) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "kv_write(): dtype must be float32, float16 or bfloat16, got %s",
                       dk_dtype_name(a->dtype));
    }
    if (a->num_tokens < 0 || a->num_kv_heads < 0 || a->head_size < 0 || a->block_size < 1 ||
        a->num_blocks < 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "kv_write(): sizes must be non-negative with block_size >= 1, got "
                       "num_tokens=%lld num_kv_heads=%lld head_size=%lld block_size=%lld "
                       "num_blocks=%lld",
                       (long long)a->num_tokens, (long long)a->num_kv_heads,
                       (long long)a->head_size, (long long)a->block_size, (long long)a->num_blocks);
    }
    /* Saturating, like the attention check (only an empty view could claim more). */
    const int64_t num_slots =
        a->num_blocks > INT64_MAX / a->block_size ? INT64_MAX : a->num_blocks * a->block_size;
    /* Every slot is checked before the first byte moves: a bad slot leaves the cache as it was. */
    for (int64_t t = 0; t < a->num_tokens; t++) {
        const int64_t slot = a->slot_mapping ? a->slot_mapping[t * a->slot_stride] : t;
        if (slot >= num_slots) {
            return dk_fail(err, DK_ERR_VALUE,
                           "kv_write(): slot_mapping[%lld] must be < num_blocks * block_size = "
                           "%lld (or < 0 to skip), got %lld",
                           (long long)t, (long long)num_slots, (long long)slot);
        }
    }
    const int fp8 = a->cache_dtype == DK_F8E4M3;
    if (!fp8 && a->cache_dtype != a->dtype) {
        return dk_fail(
            err, DK_ERR_UNSUPPORTED,
            "kv_write(): the cache must hold the inputs' dtype %s or float8_e4m3fn, got %s",
            dk_dtype_name(a->dtype), dk_dtype_name(a->cache_dtype));
    }
    const size_t es = dk_dtype_size(a->dtype);
    for (int64_t t = 0; t < a->num_tokens; t++) {
        /* Read once and re-checked where used: with the GIL released another thread could
         * rewrite the mapping between the check above and this loop. */
        const int64_t slot = a->slot_mapping ? a->slot_mapping[t * a->slot_stride] : t;
        if (slot < 0 || slot >= num_slots) {
            continue;
        }
        const int64_t dst_off = (slot / a->block_size) * a->cache_stride_block +
                                (slot % a->block_size) * a->cache_stride_token;
        if (fp8) {
            quantize_token((uint8_t *)a->key_cache, dst_off, a->cache_stride_head,
                           a->cache_stride_dim, (const char *)a->key, t * a->key_stride_token,
                           a->key_stride_head, a->key_stride_dim, a->dtype, a->k_scale,
                           a->scale_stride_head, a->num_kv_heads, a->head_size);
            quantize_token((uint8_t *)a->value_cache, dst_off, a->cache_stride_head,
                           a->cache_stride_dim, (const char *)a->value, t * a->value_stride_token,
                           a->value_stride_head, a->value_stride_dim, a->dtype, a->v_scale,
                           a->scale_stride_head, a->num_kv_heads, a->head_size);
            continue;
        }
        copy_token((char *)a->key_cache, dst_off, a->cache_stride_head, a->cache_stride_dim,
                   (const char *)a->key, t * a->key_stride_token, a->key_stride_head,
                   a->key_stride_dim, a->num_kv_heads, a->head_size, es);
        copy_token((char *)a->value_cache, dst_off, a->cache_stride_head, a->cache_stride_dim,
                   (const char *)a->value, t * a->value_stride_token, a->value_stride_head,
                   a->value_stride_dim, a->num_kv_heads, a->head_size, es);
    }
    return DK_OK;
}

/* The largest magnitude of a [num_tokens, num_kv_heads, head_size] input (its strides) as the
 * bits of the fp32 value, folded into *bits: non-negative floats order as their bits, and a NaN's
 * magnitude above an infinity's, so a NaN anywhere wins (as torch's amax propagates it). */
static void
amax_bits(const void *src, int64_t stride_token, int64_t stride_head, int64_t stride_dim,
          const dk_kv_write_args *a, uint32_t *bits)
{
    float row[DK_REF_MAX_HEAD_SIZE];
    for (int64_t t = 0; t < a->num_tokens; t++) {
        for (int64_t h = 0; h < a->num_kv_heads; h++) {
            for (int64_t k0 = 0; k0 < a->head_size; k0 += DK_REF_MAX_HEAD_SIZE) {
                const int64_t n = a->head_size - k0 < DK_REF_MAX_HEAD_SIZE ? a->head_size - k0
                                                                           : DK_REF_MAX_HEAD_SIZE;
                load_row(src, t * stride_token + h * stride_head + k0 * stride_dim, stride_dim, n,
                         a->dtype, row);
                for (int64_t k = 0; k < n; k++) {
                    uint32_t b;
                    memcpy(&b, &row[k], sizeof(b));
                    b &= 0x7FFFFFFFu;
                    *bits = b > *bits ? b : *bits;
                }
            }
        }
    }
}

/* amax / 448 in fp32, or 1 where amax is not > 0 (zero, or NaN). */
static float
scale_of_amax(uint32_t bits)
{
    float amax;
    memcpy(&amax, &bits, sizeof(amax));
    return amax > 0.0f ? amax / 448.0f : 1.0f;
}

dk_status
dk_ref_quantize_kv(const dk_quantize_kv_args *a, dk_error *err)
{
    for (int i = 0; i < 2; i++) {
        if (a->kv[i].num_tokens > 0 && !is_float_dtype(a->kv[i].dtype)) {
            return dk_fail(err, DK_ERR_UNSUPPORTED,
                           "quantize_kv(): dtype must be float32, float16 or bfloat16, got %s",
                           dk_dtype_name(a->kv[i].dtype));
        }
    }
    uint32_t bits[2] = {0, 0}; /* keys, values */
    for (int i = 0; i < 2; i++) {
        const dk_kv_write_args *w = &a->kv[i];
        amax_bits(w->key, w->key_stride_token, w->key_stride_head, w->key_stride_dim, w, &bits[0]);
        amax_bits(w->value, w->value_stride_token, w->value_stride_head, w->value_stride_dim, w,
                  &bits[1]);
    }
    a->scales[0] = scale_of_amax(bits[0]);
    a->scales[1] = scale_of_amax(bits[1]);
    for (int i = 0; i < 2; i++) {
        if (a->kv[i].num_tokens > 0) {
            const dk_status s = dk_ref_kv_write(&a->kv[i], err);
            if (s != DK_OK) {
                return s;
            }
        }
    }
    return DK_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Paged attention                                                                             */
/* ------------------------------------------------------------------------------------------ */

dk_status
dk_attention_check(const dk_attention_args *a, dk_error *err)
{
    /* dense_attention's table holds key tokens (blocks of one token) or blocks of key_block
     * consecutive key tokens: its own names */
    const char *op = a->dense != DK_KEYS_PAGED ? "dense_attention" : "paged_attention";
    const char *bt = a->dense != DK_KEYS_PAGED ? "key_index" : "block_table";
    const char *nb = a->dense == DK_KEYS_DENSE_BLOCKS ? "num_keys / key_block"
                     : a->dense == DK_KEYS_DENSE      ? "num_keys"
                                                      : "num_blocks";
    if (a->mask != DK_MASK_NONE && a->mask != DK_MASK_CAUSAL && a->mask != DK_MASK_LIMITS) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s(): mask must be MASK_NONE (0), MASK_CAUSAL (1) or MASK_LIMITS (2), "
                       "got %d",
                       op, (int)a->mask);
    }
    if (a->num_rows < 0 || a->num_tokens < 0 || a->head_size < 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s(): num_rows, num_tokens and head_size must be >= 0, got %lld, %lld and "
                       "%lld",
                       op, (long long)a->num_rows, (long long)a->num_tokens,
                       (long long)a->head_size);
    }
    if (a->block_size < 1 || a->num_blocks < 0 || a->bt_cols < 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s(): block_size must be >= 1 with %s and %s columns >= 0, got "
                       "block_size=%lld %s=%lld columns=%lld",
                       op, nb, bt, (long long)a->block_size, nb, (long long)a->num_blocks,
                       (long long)a->bt_cols);
    }
    if (a->num_kv_heads < 1 || a->num_heads < 1 || a->num_heads % a->num_kv_heads != 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s(): num_heads must be a positive multiple of num_kv_heads >= 1, got "
                       "num_heads=%lld num_kv_heads=%lld",
                       op, (long long)a->num_heads, (long long)a->num_kv_heads);
    }
    if (a->mask == DK_MASK_LIMITS && a->key_limits == NULL && a->num_tokens > 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s(): key_limits must be given when mask is MASK_LIMITS, got None", op);
    }
    const int32_t *qsl = a->query_start_loc;
    if (qsl[0] != 0) {
        return dk_fail(err, DK_ERR_VALUE, "%s(): query_start_loc[0] must be 0, got %d", op,
                       (int)qsl[0]);
    }
    for (int64_t r = 0; r < a->num_rows; r++) {
        if (qsl[r + 1] < qsl[r]) {
            return dk_fail(err, DK_ERR_VALUE,
                           "%s(): query_start_loc must be non-decreasing, got "
                           "query_start_loc[%lld]=%d after query_start_loc[%lld]=%d",
                           op, (long long)(r + 1), (int)qsl[r + 1], (long long)r, (int)qsl[r]);
        }
    }
    if ((int64_t)qsl[a->num_rows] != a->num_tokens) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s(): query_start_loc[%lld] must equal num_tokens=%lld, got %d", op,
                       (long long)a->num_rows, (long long)a->num_tokens, (int)qsl[a->num_rows]);
    }
    /* Saturating: a zero-stride cache view may claim a block_size near INT64_MAX. */
    const int64_t capacity =
        a->bt_cols > INT64_MAX / a->block_size ? INT64_MAX : a->bt_cols * a->block_size;
    for (int64_t r = 0; r < a->num_rows; r++) {
        const int64_t seq_len = a->seq_lens[r];
        if (seq_len < 0 || seq_len > capacity) {
            if (a->dense != DK_KEYS_PAGED) {
                return dk_fail(err, DK_ERR_VALUE,
                               "%s(): seq_lens[%lld] must be in [0, %lld] (key_index columns), "
                               "got %lld",
                               op, (long long)r, (long long)capacity, (long long)seq_len);
            }
            return dk_fail(err, DK_ERR_VALUE,
                           "%s(): seq_lens[%lld] must be in [0, %lld] (block_table columns * "
                           "block_size), got %lld",
                           op, (long long)r, (long long)capacity, (long long)seq_len);
        }
        const int64_t query_len = (int64_t)qsl[r + 1] - qsl[r];
        if (a->mask != DK_MASK_NONE && query_len > seq_len) {
            return dk_fail(err, DK_ERR_VALUE,
                           "%s(): seq_lens[%lld] must be >= the row's query length %lld for a "
                           "causal or limits mask (bottom-right alignment), got %lld",
                           op, (long long)r, (long long)query_len, (long long)seq_len);
        }
        const int64_t reach = seq_len / a->block_size + (seq_len % a->block_size != 0);
        const int32_t *row = a->block_table + r * a->bt_stride_row;
        for (int64_t b = 0; b < reach; b++) {
            if (row[b] < 0 || (int64_t)row[b] >= a->num_blocks) {
                return dk_fail(
                    err, DK_ERR_VALUE, "%s(): %s[%lld][%lld] must be in [0, %s=%lld), got %d", op,
                    bt, (long long)r, (long long)b, nb, (long long)a->num_blocks, (int)row[b]);
            }
        }
    }
    return DK_OK;
}

/* Dot product with independent partial sums so the compiler can keep several lanes busy. */
static float
dot_f32(const float *x, const float *y, int64_t n)
{
    float s[8] = {0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        for (int u = 0; u < 8; u++) {
            s[u] += x[k + u] * y[k + u];
        }
    }
    for (; k < n; k++) {
        s[0] += x[k] * y[k];
    }
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* Keys [0, n) that query token t (index i within its row) sees. */
static int64_t
visible_keys(const dk_attention_args *a, int64_t t, int64_t i, int64_t query_len, int64_t seq_len)
{
    int64_t n;
    if (a->mask == DK_MASK_CAUSAL) {
        n = i + seq_len - query_len + 1;
    }
    else if (a->mask == DK_MASK_LIMITS) {
        n = a->key_limits[t];
    }
    else {
        n = seq_len;
    }
    if (n > seq_len) {
        n = seq_len;
    }
    return n < 0 ? 0 : n;
}

int32_t
dk_attention_table_runs(const dk_attention_args *a, int64_t tile_keys)
{
    const int64_t per = tile_keys > a->block_size ? tile_keys / a->block_size : 1; /* per tile */
    int64_t tiles = 0, runs = 0;
    for (int64_t r = 0; r < a->num_rows; r++) {
        const int64_t reach = (a->seq_lens[r] + a->block_size - 1) / a->block_size;
        const int32_t *row = a->block_table + r * a->bt_stride_row;
        for (int64_t t0 = 0; t0 < reach; t0 += per) {
            const int64_t end = t0 + per < reach ? t0 + per : reach;
            int64_t b = t0 + 1;
            while (b < end && (int64_t)row[b] == (int64_t)row[b - 1] + 1) { /* no int overflow */
                b++;
            }
            tiles++;
            runs += b == end;
        }
    }
    return tiles > 0 ? (int32_t)(runs * DK_TABLE_RUNS_ALL / tiles) : 0;
}

void
dk_attention_uniform_rows(dk_attention_args *a)
{
    a->uniform_query_len = 0;
    a->uniform_seq_len = 0;
    memset(a->row_seq_lens, 0, sizeof(a->row_seq_lens));
    if (a->num_rows < 1) {
        return;
    }
    const int64_t q = (int64_t)a->query_start_loc[1] - a->query_start_loc[0];
    if (a->query_start_loc[0] != 0 || q <= 0 || q > INT32_MAX) {
        return;
    }
    int same_seq = 1;
    for (int64_t r = 0; r < a->num_rows; r++) {
        if ((int64_t)a->query_start_loc[r + 1] != (r + 1) * q) {
            return;
        }
        same_seq = same_seq && a->seq_lens[r] == a->seq_lens[0];
    }
    if (a->num_rows >= 2 && a->num_rows <= DK_ROW_SEQ_LENS) {
        for (int64_t r = 0; r < a->num_rows; r++) {
            a->row_seq_lens[r] = a->seq_lens[r];
        }
    }
    a->uniform_query_len = (int32_t)q;
    a->uniform_seq_len = same_seq ? a->seq_lens[0] : 0;
}

int32_t
dk_attention_chunk_layout(const dk_attention_args *a)
{
    /* NHD: kv heads D = head_size elements apart; HND ([blocks, kv heads, block_size, D] in
     * memory: rows D apart, heads block_size rows, blocks all heads) */
    const int64_t bs = a->block_size, d = a->head_size;
    const int nhd = a->cache_stride_head == d;
    const int hnd = a->cache_stride_token == d && a->cache_stride_head == bs * d &&
                    a->cache_stride_block == a->num_kv_heads * a->cache_stride_head &&
                    a->num_kv_heads >= 1 && a->num_blocks <= (int64_t)INT32_MAX / a->num_kv_heads;
    /* 16-key chunks never straddle two blocks: blocks of a multiple of 16 keys, or one block
     * per row of a multiple of 8 (the chunk past its end reads zeros: out of the map) */
    const int chunks = bs >= 8 && bs / 8 <= (int64_t)INT32_MAX &&
                       (bs % 16 == 0 || (a->bt_cols == 1 && bs % 8 == 0));
    if (!(d == 128 || d == 192 || d == 256) || !chunks || a->key_cache2 != NULL || !(nhd || hnd) ||
        a->num_blocks < 1 || a->num_blocks > (int64_t)INT32_MAX || a->num_kv_heads < 1 ||
        a->num_kv_heads > (int64_t)INT32_MAX / (d / 64) || a->cache_stride_token <= 0 ||
        a->cache_stride_block <= 0 || a->cache_stride_token % 8 != 0 ||
        a->cache_stride_block % 8 != 0 || a->cache_stride_block * 2 >= ((int64_t)1 << 40) ||
        a->cache_stride_token * 16 >= ((int64_t)1 << 40)) {
        return 0;
    }
    return nhd ? 1 : 2;
}

/* One (row, kv head) of dk_ref_attention: the row's keys and values for kv head g converted to
 * fp32 once, then every query token of the row for every query head of g's group.  scratch:
 * 2 * max_seq * D + max_seq + 2 * D floats of the caller's thread.  Items are independent (each
 * writes only its own tokens' heads), so any number of threads gives the same bits. */
static void
ref_row_head(const dk_attention_args *a, int64_t max_seq, int64_t r, int64_t g, float *scratch)
{
    const int64_t D = a->head_size;
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int32_t *qsl = a->query_start_loc;
    float *kf = scratch;
    float *vf = kf + max_seq * D;
    float *scores = vf + max_seq * D;
    float *qf = scores + max_seq;
    float *acc = qf + D;

    /* Every index is read once and clamped to what was checked and allocated: the GIL is
     * released, so another thread could rewrite these host arrays during the call. */
    const int64_t t0 = qsl[r];
    const int64_t t1 = qsl[r + 1];
    if (t0 < 0 || t1 > a->num_tokens || t1 <= t0) {
        return;
    }
    const int64_t query_len = t1 - t0;
    int64_t seq_len = a->seq_lens[r];
    seq_len = seq_len < 0 ? 0 : (seq_len > max_seq ? max_seq : seq_len);
    const int32_t *row_table = a->block_table + r * a->bt_stride_row;
    for (int64_t j = 0; j < seq_len; j++) {
        const int64_t block = row_table[j / a->block_size];
        if (block < 0 || block >= a->num_blocks || j / a->block_size >= a->bt_cols) {
            /* Only reachable if the table changed after the host check. */
            memset(kf + j * D, 0, (size_t)D * sizeof(float));
            memset(vf + j * D, 0, (size_t)D * sizeof(float));
            continue;
        }
        /* a block id past blocks2 is the second source's (dense joint tokens) */
        const int second = a->key_cache2 != NULL && block >= a->blocks2;
        const int64_t off = (second ? block - a->blocks2 : block) * a->cache_stride_block +
                            (j % a->block_size) * a->cache_stride_token + g * a->cache_stride_head;
        if (a->kv_fp8) {
            load_row_e4m3(second ? a->key_cache2 : a->key_cache, off, a->cache_stride_dim, D,
                          a->k_scale[g * a->scale_stride_head], kf + j * D);
            load_row_e4m3(second ? a->value_cache2 : a->value_cache, off, a->cache_stride_dim, D,
                          a->v_scale[g * a->scale_stride_head], vf + j * D);
            continue;
        }
        load_row(second ? a->key_cache2 : a->key_cache, off, a->cache_stride_dim, D, a->dtype,
                 kf + j * D);
        load_row(second ? a->value_cache2 : a->value_cache, off, a->cache_stride_dim, D, a->dtype,
                 vf + j * D);
    }
    for (int64_t i = 0; i < query_len; i++) {
        const int64_t t = t0 + i;
        const int64_t n = visible_keys(a, t, i, query_len, seq_len);
        for (int64_t h = g * group; h < (g + 1) * group; h++) {
            for (int64_t k = 0; k < D; k++) {
                acc[k] = 0.0f;
            }
            float lse = -INFINITY; /* no visible key: the empty sum's log */
            if (n > 0) {
                load_row(a->query, t * a->q_stride_token + h * a->q_stride_head, a->q_stride_dim, D,
                         a->dtype, qf);
                float m = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    scores[j] = a->scale * dot_f32(qf, kf + j * D, D);
                    if (scores[j] > m) {
                        m = scores[j];
                    }
                }
                float sum = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    const float p = expf(scores[j] - m);
                    const float *v = vf + j * D;
                    sum += p;
                    for (int64_t k = 0; k < D; k++) {
                        acc[k] += p * v[k];
                    }
                }
                const float inv = 1.0f / sum;
                for (int64_t k = 0; k < D; k++) {
                    acc[k] *= inv;
                }
                /* sum >= 1 (the max term is exp(0)), so the log is finite. */
                lse = m + logf(sum);
            }
            if (a->lse != NULL) {
                a->lse[t * a->lse_stride_token + h * a->lse_stride_head] = lse;
            }
            store_row(a->out, t * a->o_stride_token + h * a->o_stride_head, a->o_stride_dim, D,
                      a->dtype, acc);
        }
    }
}

/* The (row, kv head) items of one dk_ref_attention call, shared by its threads. */
typedef struct ref_items {
    const dk_attention_args *a;
    int64_t max_seq;
    int64_t count;     /* num_rows * num_kv_heads */
    atomic_llong next; /* the next item to take: row * num_kv_heads + kv head */
} ref_items;

typedef struct ref_worker {
    ref_items *items;
    float *scratch;
    pthread_t thread;
    int own_thread; /* 1: a thread of its own (named DK_REF_THREAD_NAME), 0: the caller's */
} ref_worker;

/* Takes items until none is left (the caller's thread runs it too). */
static void *
ref_work(void *arg)
{
    const ref_worker *w = arg;
    ref_items *it = w->items;
    if (w->own_thread) {
        (void)pthread_setname_np(pthread_self(), DK_REF_THREAD_NAME); /* for profilers; may fail */
    }
    for (;;) {
        const long long i = atomic_fetch_add_explicit(&it->next, 1, memory_order_relaxed);
        if (i >= it->count) {
            return NULL;
        }
        ref_row_head(it->a, it->max_seq, i / it->a->num_kv_heads, i % it->a->num_kv_heads,
                     w->scratch);
    }
}

/* Threads for a call of `macs` multiply-adds (query heads x visible pairs x head size, counted
 * without masks) over `count` items, each thread needing `scratch_bytes` of its own: at most
 * a->cpu_threads, one per item, one per DK_REF_THREAD_MACS of work (a thread's start costs tens
 * of microseconds: small calls stay on the caller's thread), and as many as fit
 * DK_REF_THREADS_SCRATCH bytes of scratch (one always). */
static int64_t
ref_threads(const dk_attention_args *a, double macs, int64_t count, size_t scratch_bytes)
{
    int64_t n = a->cpu_threads < 1 ? 1 : a->cpu_threads;
    n = n > DK_REF_MAX_THREADS ? DK_REF_MAX_THREADS : n;
    n = n > count ? count : n;
    const double by_work = macs / DK_REF_THREAD_MACS;
    n = by_work < (double)n ? (int64_t)by_work : n;
    const size_t by_memory = DK_REF_THREADS_SCRATCH / (scratch_bytes > 0 ? scratch_bytes : 1);
    n = (size_t)n > by_memory ? (int64_t)by_memory : n;
    return n < 1 ? 1 : n;
}

dk_status
dk_ref_attention(const dk_attention_args *a, dk_error *err)
{
    if (!is_float_dtype(a->dtype)) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "paged_attention(): dtype must be float32, float16 or bfloat16, got %s",
                       dk_dtype_name(a->dtype));
    }
    if (a->head_size > DK_REF_MAX_HEAD_SIZE) {
        return dk_fail(err, DK_ERR_UNSUPPORTED,
                       "paged_attention(): head_size must be at most %d on the CPU reference, "
                       "got %lld",
                       DK_REF_MAX_HEAD_SIZE, (long long)a->head_size);
    }
    const int64_t D = a->head_size;
    const int32_t *qsl = a->query_start_loc;

    /* The scratch is sized from seq_lens itself, not from the caller's max_seq_len, so a stale
     * max can never overrun it.  Rows without queries are skipped, so they need no room. */
    int64_t max_seq = 0;
    double macs = 0.0;
    for (int64_t r = 0; r < a->num_rows; r++) {
        const int64_t q = (int64_t)qsl[r + 1] - qsl[r];
        if (q > 0 && a->seq_lens[r] > max_seq) {
            max_seq = a->seq_lens[r];
        }
        macs += q > 0 && a->seq_lens[r] > 0 ? (double)q * a->seq_lens[r] : 0.0;
    }
    macs *= (double)a->num_heads * (double)D;
    /* A thread's layout: K rows [max_seq, D], V rows [max_seq, D], scores [max_seq], q [D],
     * acc [D]. */
    const uint64_t nfloats =
        2u * (uint64_t)max_seq * (uint64_t)D + (uint64_t)max_seq + 2u * (uint64_t)D + 1u;
    if (nfloats > SIZE_MAX / sizeof(float) / DK_REF_MAX_THREADS) {
        return dk_fail(err, DK_ERR_NOMEM,
                       "paged_attention(): could not allocate host scratch for %llu floats",
                       (unsigned long long)nfloats);
    }
    ref_items items = {.a = a, .max_seq = max_seq, .count = a->num_rows * a->num_kv_heads};
    atomic_init(&items.next, 0);
    const int64_t threads = ref_threads(a, macs, items.count, (size_t)nfloats * sizeof(float));
    /* All the scratch first: a call that cannot have it fails before writing anything. */
    float *scratch = malloc((size_t)threads * (size_t)nfloats * sizeof(float));
    ref_worker *workers = calloc((size_t)threads, sizeof(ref_worker));
    if (scratch == NULL || workers == NULL) {
        free(scratch);
        free(workers);
        return dk_fail(err, DK_ERR_NOMEM,
                       "paged_attention(): could not allocate %llu bytes of host scratch",
                       (unsigned long long)((uint64_t)threads * nfloats * sizeof(float)));
    }
    for (int64_t i = 0; i < threads; i++) {
        workers[i].items = &items;
        workers[i].scratch = scratch + (size_t)i * (size_t)nfloats;
    }
    /* Workers 1.. on threads of their own, worker 0 on the caller's.  A thread that cannot be
     * started leaves its share to the others (the items are taken, not assigned): the same
     * result on fewer threads. */
    int64_t started = 1;
    for (int64_t i = 1; i < threads; i++) {
        workers[i].own_thread = 1;
        if (pthread_create(&workers[i].thread, NULL, ref_work, &workers[i]) != 0) {
            break;
        }
        started++;
    }
    ref_work(&workers[0]);
    for (int64_t i = 1; i < started; i++) {
        pthread_join(workers[i].thread, NULL);
    }
    free(workers);
    free(scratch);
    return DK_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Row copies                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* Shared checks of gather and scatter: a copyable dtype and every index in [0, limit). */
static dk_status
rows_check(const dk_rows_args *a, const char *op, int64_t limit, const char *limit_name,
           dk_error *err)
{
    if (dk_dtype_size(a->dtype) == 0) {
        return dk_fail(err, DK_ERR_UNSUPPORTED, "%s(): dtype must be a supported dtype, got %s", op,
                       dk_dtype_name(a->dtype));
    }
    if (a->num_index < 0 || a->num_heads < 0 || a->head_size < 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s(): num_index, num_heads and head_size must be >= 0, got %lld, %lld "
                       "and %lld",
                       op, (long long)a->num_index, (long long)a->num_heads,
                       (long long)a->head_size);
    }
    for (int64_t n = 0; n < a->num_index; n++) {
        if (a->index[n] < 0 || a->index[n] >= limit) {
            return dk_fail(err, DK_ERR_VALUE, "%s(): index[%lld] must be in [0, %s=%lld), got %lld",
                           op, (long long)n, limit_name, (long long)limit, (long long)a->index[n]);
        }
    }
    return DK_OK;
}

dk_status
dk_ref_rows_gather(const dk_rows_args *a, dk_error *err)
{
    dk_status st = rows_check(a, "rows_gather", a->src_tokens, "src tokens", err);
    if (st != DK_OK) {
        return st;
    }
    const size_t es = dk_dtype_size(a->dtype);
    for (int64_t n = 0; n < a->num_index; n++) {
        const int64_t ix = a->index[n]; /* read once: checked above, re-checked here */
        if (ix < 0 || ix >= a->src_tokens) {
            continue;
        }
        copy_token((char *)a->dst, n * a->dst_stride_token, a->dst_stride_head, a->dst_stride_dim,
                   (const char *)a->src, ix * a->src_stride_token, a->src_stride_head,
                   a->src_stride_dim, a->num_heads, a->head_size, es);
    }
    return DK_OK;
}

dk_status
dk_ref_rows_scatter(const dk_rows_args *a, dk_error *err)
{
    dk_status st = rows_check(a, "rows_scatter", a->dst_tokens, "dst tokens", err);
    if (st != DK_OK) {
        return st;
    }
    const size_t es = dk_dtype_size(a->dtype);
    /* Zero every dst token, then copy: tokens named by index end up with src rows (later
     * duplicates win), every other token stays zero. */
    for (int64_t t = 0; t < a->dst_tokens; t++) {
        zero_token((char *)a->dst, t * a->dst_stride_token, a->dst_stride_head, a->dst_stride_dim,
                   a->num_heads, a->head_size, es);
    }
    for (int64_t n = 0; n < a->num_index; n++) {
        const int64_t ix = a->index[n]; /* read once: checked above, re-checked here */
        if (ix < 0 || ix >= a->dst_tokens) {
            continue;
        }
        copy_token((char *)a->dst, ix * a->dst_stride_token, a->dst_stride_head, a->dst_stride_dim,
                   (const char *)a->src, n * a->src_stride_token, a->src_stride_head,
                   a->src_stride_dim, a->num_heads, a->head_size, es);
    }
    return DK_OK;
}
