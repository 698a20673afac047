/*
 * attention.c -- paged attention.
 *
 * Entry points: paged_attention and paged_attention_lse (also the log-sum-exp per token and head,
 * for context parallelism).  dkpy_parse_attention checks an attention call's arguments once for
 * every caller (dense.c and layer.c too); dkpy_run_attention runs it on the CPU reference or CUDA.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

static dk_status
launch_attention(const void *a, void *stream, dk_error *err)
{
    return dk_cuda_attention((const dk_attention_args *)a, stream, err);
}

/* An [N, H * D] output o read as the [N, H, D] view of the query q's heads and size: 1 with o
 * rewritten, 0 (o untouched) when o is not such a tensor.  Cannot fail. */
static int
heads_of_flat(dk_tensor *o, const dk_tensor *q)
{
    if (o->ndim != 2 || q->ndim != 3 || q->shape[1] <= 0 || q->shape[2] <= 0 ||
        o->shape[1] != q->shape[1] * q->shape[2]) {
        return 0;
    }
    const int64_t n = o->shape[0], ts = o->strides[0], ds = o->strides[1];
    o->ndim = 3;
    o->shape[0] = n;
    o->shape[1] = q->shape[1];
    o->shape[2] = q->shape[2];
    o->strides[0] = ts;
    o->strides[1] = q->shape[2] * ds;
    o->strides[2] = ds;
    return 1;
}

/*
 * Parses the attention arguments starting at args[0] = query:
 * query, kv_cache, block_table, query_start_loc, seq_lens, key_limits, mask, scale, out,
 * host_block_table, host_query_start_loc, host_seq_lens (all three may be None, see below).
 * Fills `a` and runs dk_attention_check on the host copies (on CPU on the very tensors the
 * reference then reads, so host_* that differ from them cannot smuggle in an unchecked block
 * id).  `written` (or NULL) is the kv_cache a KV write fills before the attention reads its
 * inputs: none of them may share bytes with it.  *q_out and *o_out receive the query and out
 * views.  dense_kv (dense_attention, else NULL): key, value, joint_key, joint_value (the last
 * two ndim -1 when absent; checked by the caller); key_block: keys per block of key_index
 * (dividing num_keys, 1 with joint keys; checked by the caller).  out_flat (forward_paged
 * only): out may also be [num_tokens, num_heads * head_size], read as the [N, H, D] view of it.
 */
int
dkpy_parse_attention(PyObject *module, PyObject *const *args, const char *op, dk_attention_args *a,
                     const dk_tensor *written, dk_tensor *q_out, dk_tensor *o_out,
                     const dk_tensor *dense_kv, int64_t key_block, int out_flat,
                     PyObject *const *scale_objs)
{
    dk_tensor q, c, bt, qsl, sl, kl, o, hbt, hqsl, hsl;
    int64_t mask = 0;
    /* the block table is dense_attention's key_index */
    const char *bt_name = dense_kv != NULL ? "key_index" : "block_table";
    const char *hbt_name = dense_kv != NULL ? "host_key_index" : "host_block_table";
    if (written != NULL) {
        /* forward_paged: the cache its KV write parsed is this call's kv_cache (the same
         * argument), not parsed a second time */
        c = *written;
    }
    else if (dense_kv != NULL) {
        /* key/value [num_keys, num_kv_heads, head_size] with one stride set (checked by the
         * caller): a cache of num_keys blocks of one token whose V half starts at value. */
        c = dense_kv[0];
        c.ndim = 5;
        c.shape[0] = 2;
        c.shape[1] = dense_kv[0].shape[0] / key_block;
        c.shape[2] = key_block;
        c.shape[3] = dense_kv[0].shape[1];
        c.shape[4] = dense_kv[0].shape[2];
        c.strides[0] = 0;
        c.strides[1] = dense_kv[0].strides[0] * key_block;
        c.strides[2] = key_block > 1 ? dense_kv[0].strides[0] : 0;
        c.strides[3] = dense_kv[0].strides[1];
        c.strides[4] = dense_kv[0].strides[2];
    }
    if (dkpy_tensor_arg(module, args[0], op, "query", &q) != 0 ||
        dkpy_want_float(&q, op, "query") || dkpy_want_ndim(&q, 3, op, "query") ||
        (dense_kv == NULL &&
         ((written == NULL && dkpy_tensor_arg(module, args[1], op, "kv_cache", &c) != 0) ||
          (!(c.dtype == DK_F8E4M3 && scale_objs != NULL) &&
           dkpy_want_dtype(&c, q.dtype, op, "kv_cache")) ||
          dkpy_want_ndim(&c, 5, op, "kv_cache"))) ||
        (dense_kv != NULL && !(c.dtype == DK_F8E4M3 && scale_objs != NULL) &&
         dkpy_want_dtype(&c, q.dtype, op, "key")) ||
        dkpy_same_device(&q, &c, op, dense_kv != NULL ? "key" : "kv_cache") ||
        dkpy_tensor(module, args[2], op,
                    &(dkpy_want){.arg = bt_name, .dtype = DK_I32, .ndim = 2, .device = &q}, &bt) ||
        dkpy_tensor(
            module, args[3], op,
            &(dkpy_want){
                .arg = "query_start_loc", .dtype = DK_I32, .ndim = DKPY_VECTOR, .device = &q},
            &qsl) ||
        dkpy_tensor(
            module, args[4], op,
            &(dkpy_want){.arg = "seq_lens", .dtype = DK_I32, .ndim = DKPY_VECTOR, .device = &q},
            &sl) ||
        dk_bridge_optional_tensor(&state_of(module)->bridge, args[5], op, "key_limits", &kl) ||
        dkpy_get_i64(args[6], op, "mask", &mask) ||
        dkpy_tensor_arg(module, args[8], op, "out", &o) != 0 ||
        dkpy_want_dtype(&o, q.dtype, op, "out") ||
        (!(out_flat && heads_of_flat(&o, &q)) && dkpy_want_ndim(&o, 3, op, "out")) ||
        dkpy_same_device(&q, &o, op, "out")) {
        return -1;
    }
    /* The host copies are all given (checked here) or all None: then CPU tensors are checked
     * themselves, and on CUDA the caller vouches for the device metadata (diffkv.ops, whose
     * batches were checked when prepared) while the kernels clamp every index they read. */
    int n_none = (args[9] == Py_None) + (args[10] == Py_None) + (args[11] == Py_None);
    const int trusted = n_none == 3;
    if (n_none != 0 && !trusted) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): %s, host_query_start_loc and host_seq_lens must all be tensors or all "
                     "be None, got %d None",
                     op, hbt_name, n_none);
        return -1;
    }
    if (trusted) {
        hbt = bt;
        hqsl = qsl;
        hsl = sl;
    }
    else if (dkpy_tensor(
                 module, args[9], op,
                 &(dkpy_want){.arg = hbt_name, .dtype = DK_I32, .ndim = 2, .device = DKPY_HOST},
                 &hbt) ||
             dkpy_tensor(module, args[10], op,
                         &(dkpy_want){.arg = "host_query_start_loc",
                                      .dtype = DK_I32,
                                      .ndim = DKPY_VECTOR,
                                      .device = DKPY_HOST},
                         &hqsl) ||
             dkpy_tensor(module, args[11], op,
                         &(dkpy_want){.arg = "host_seq_lens",
                                      .dtype = DK_I32,
                                      .ndim = DKPY_VECTOR,
                                      .device = DKPY_HOST},
                         &hsl)) {
        return -1;
    }
    double scale = PyFloat_AsDouble(args[7]);
    if (scale == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    if (!(scale > 0.0) || scale > 1e30) {
        PyErr_Format(PyExc_ValueError, "%s(): scale must be a positive finite float, got %R", op,
                     args[7]);
        return -1;
    }
    if (mask < DK_MASK_NONE || mask > DK_MASK_LIMITS) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): mask must be 0 (none), 1 (causal) or 2 (limits), got %lld", op,
                     (long long)mask);
        return -1;
    }
    int64_t n = q.shape[0], h = q.shape[1], d = q.shape[2], r = sl.shape[0];
    if (dense_kv != NULL && (c.shape[4] != d || c.shape[3] <= 0 || h % c.shape[3] != 0)) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): key must have shape [num_keys, num_kv_heads, %lld] with num_heads "
                     "(%lld) divisible by num_kv_heads, got [%lld, %lld, %lld]",
                     op, (long long)d, (long long)h, (long long)c.shape[1], (long long)c.shape[3],
                     (long long)c.shape[4]);
        return -1;
    }
    if (c.shape[0] != 2 || c.shape[4] != d || c.shape[3] <= 0 || h % c.shape[3] != 0) {
        PyErr_Format(
            PyExc_ValueError,
            "%s(): kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, %lld] "
            "with num_heads (%lld) divisible by num_kv_heads, got [%lld, %lld, %lld, %lld, "
            "%lld]",
            op, (long long)d, (long long)h, (long long)c.shape[0], (long long)c.shape[1],
            (long long)c.shape[2], (long long)c.shape[3], (long long)c.shape[4]);
        return -1;
    }
    if (o.shape[0] != n || o.shape[1] != h || o.shape[2] != d) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): out must have shape [%lld, %lld, %lld], got [%lld, "
                     "%lld, %lld]",
                     op, (long long)n, (long long)h, (long long)d, (long long)o.shape[0],
                     (long long)o.shape[1], (long long)o.shape[2]);
        return -1;
    }
    if (qsl.shape[0] != r + 1 || bt.shape[0] < r || hqsl.shape[0] != r + 1 || hsl.shape[0] != r ||
        hbt.shape[0] != bt.shape[0] || hbt.shape[1] != bt.shape[1]) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): query_start_loc must have num_rows + 1 = %lld entries, %s at least "
                     "num_rows rows, and the host_* copies the shapes of their device tensors",
                     op, (long long)(r + 1), bt_name);
        return -1;
    }
    if ((bt.shape[1] > 1 && bt.strides[1] != 1) || (hbt.shape[1] > 1 && hbt.strides[1] != 1)) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must have unit column stride", op, bt_name);
        return -1;
    }
    if (mask == DK_MASK_LIMITS) {
        if (kl.ndim < 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): key_limits must be a tensor when mask is 2 (limits)", op);
            return -1;
        }
        if (dkpy_check(&kl, op,
                       &(dkpy_want){.arg = "key_limits",
                                    .dtype = DK_I32,
                                    .ndim = DKPY_VECTOR,
                                    .min_len = n,
                                    .device = &q})) {
            return -1;
        }
    }
    const int joint = dense_kv != NULL && dense_kv[2].ndim == 3;
    if (dkpy_no_overlap(&o, "out", &q, "query", op) ||
        dkpy_no_overlap(&o, "out", &c, dense_kv != NULL ? "key" : "kv_cache", op) ||
        (dense_kv != NULL && dkpy_no_overlap(&o, "out", &dense_kv[1], "value", op)) ||
        (joint && (dkpy_no_overlap(&o, "out", &dense_kv[2], "joint_key", op) ||
                   dkpy_no_overlap(&o, "out", &dense_kv[3], "joint_value", op))) ||
        dkpy_no_overlap(&o, "out", &bt, bt_name, op) ||
        dkpy_no_overlap(&o, "out", &qsl, "query_start_loc", op) ||
        dkpy_no_overlap(&o, "out", &sl, "seq_lens", op) ||
        (mask == DK_MASK_LIMITS && dkpy_no_overlap(&o, "out", &kl, "key_limits", op)) ||
        dkpy_no_overlap(&o, "out", &hbt, hbt_name, op) ||
        dkpy_no_overlap(&o, "out", &hqsl, "host_query_start_loc", op) ||
        dkpy_no_overlap(&o, "out", &hsl, "host_seq_lens", op)) {
        return -1;
    }
    if (written != NULL &&
        (dkpy_no_overlap(written, "kv_cache", &q, "query", op) ||
         dkpy_no_overlap(written, "kv_cache", &bt, "block_table", op) ||
         dkpy_no_overlap(written, "kv_cache", &qsl, "query_start_loc", op) ||
         dkpy_no_overlap(written, "kv_cache", &sl, "seq_lens", op) ||
         (mask == DK_MASK_LIMITS && dkpy_no_overlap(written, "kv_cache", &kl, "key_limits", op)) ||
         dkpy_no_overlap(written, "kv_cache", &hbt, "host_block_table", op) ||
         dkpy_no_overlap(written, "kv_cache", &hqsl, "host_query_start_loc", op) ||
         dkpy_no_overlap(written, "kv_cache", &hsl, "host_seq_lens", op))) {
        return -1;
    }
    if (q.device_type == DK_CPU) {
        hbt = bt;
        hqsl = qsl;
        hsl = sl;
    }
    dk_tensor scales[2];
    const float *k_scale = NULL, *v_scale = NULL;
    int64_t scale_stride = 0;
    if (scale_objs != NULL &&
        dkpy_parse_scales(module, scale_objs[0], scale_objs[1], op, c.dtype == DK_F8E4M3,
                          c.shape[3], &q, &c, scales, &k_scale, &v_scale, &scale_stride) != 0) {
        return -1;
    }
    memset(a, 0, sizeof(*a));
    a->kv_fp8 = k_scale != NULL;
    a->k_scale = k_scale;
    a->v_scale = v_scale;
    a->scale_stride_head = scale_stride;
    size_t es = dk_dtype_size(c.dtype); /* the cache's element */
    a->query = q.data;
    a->q_stride_token = q.strides[0];
    a->q_stride_head = q.strides[1];
    a->q_stride_dim = q.strides[2];
    a->key_cache = c.data;
    a->value_cache = dense_kv != NULL ? dense_kv[1].data
                     : c.data == NULL
                         ? NULL
                         : (const void *)((const char *)c.data + (size_t)c.strides[0] * es);
    a->cache_stride_block = c.strides[1];
    a->cache_stride_token = c.strides[2];
    a->cache_stride_head = c.strides[3];
    a->cache_stride_dim = c.strides[4];
    a->out = o.data;
    a->o_stride_token = o.strides[0];
    a->o_stride_head = o.strides[1];
    a->o_stride_dim = o.strides[2];
    a->block_table = (const int32_t *)hbt.data;
    a->bt_stride_row = hbt.strides[0];
    a->bt_cols = hbt.shape[1];
    a->query_start_loc = (const int32_t *)hqsl.data;
    a->seq_lens = (const int32_t *)hsl.data;
    a->key_limits = mask == DK_MASK_LIMITS ? (const int32_t *)kl.data : NULL;
    a->mask = (int32_t)mask;
    a->num_rows = r;
    a->num_tokens = n;
    a->num_heads = h;
    a->num_kv_heads = c.shape[3];
    a->head_size = d;
    a->block_size = c.shape[2];
    a->num_blocks = c.shape[1];
    a->scale = (float)scale;
    a->dtype = q.dtype;
    a->dense = dense_kv == NULL ? DK_KEYS_PAGED
               : key_block > 1  ? DK_KEYS_DENSE_BLOCKS
                                : DK_KEYS_DENSE;
    if (joint) {
        /* key indices num_keys .. num_keys + joint tokens - 1 read joint_key / joint_value */
        a->key_cache2 = dense_kv[2].data;
        a->value_cache2 = dense_kv[3].data;
        a->blocks2 = c.shape[1];
        a->num_blocks = c.shape[1] + dense_kv[2].shape[0];
    }
    if (trusted && q.device_type == DK_CUDA) {
        /* Device metadata cannot be read here: launch for the bounds (tiles past a row's end
         * exit at once) and skip the host check. */
        a->max_query_len = n;
        a->max_seq_len = a->bt_cols > 0 && a->block_size > INT64_MAX / a->bt_cols
                             ? INT64_MAX
                             : a->bt_cols * a->block_size;
        a->block_table = (const int32_t *)bt.data;
        a->query_start_loc = (const int32_t *)qsl.data;
        a->seq_lens = (const int32_t *)sl.data;
        *q_out = q;
        *o_out = o;
        return 0;
    }
    int64_t maxq = 0, maxs = 0;
    for (int64_t i = 0; i < r; i++) {
        int64_t ql = (int64_t)a->query_start_loc[i + 1] - a->query_start_loc[i];
        maxq = ql > maxq ? ql : maxq;
        maxs = a->seq_lens[i] > maxs ? a->seq_lens[i] : maxs;
    }
    a->max_query_len = maxq;
    a->max_seq_len = maxs;
    /* The host check reads key limits only on CPU (on CUDA they live on the device). */
    const int32_t *kl_dev = a->key_limits;
    if (q.device_type == DK_CUDA) {
        a->key_limits = NULL;
        if (mask == DK_MASK_LIMITS) {
            a->mask = DK_MASK_CAUSAL; /* the check's rules for LIMITS and CAUSAL are the same */
        }
    }
    dk_error err = {{0}};
    dk_status s = dk_attention_check(a, &err);
    a->key_limits = kl_dev;
    a->mask = (int32_t)mask;
    if (s != DK_OK) {
        dkpy_raise_status(module, s, &err);
        return -1;
    }
    if (q.device_type == DK_CUDA && a->block_size < 32 &&
        (a->block_size & (a->block_size - 1)) == 0 && (a->head_size != 64 || a->block_size < 16) &&
        dk_attention_chunk_layout(a) == 0) {
        /* blocks under 32 keys: the sm90 kernel's TMA boxes pay only when enough tiles are
         * runs of consecutive blocks (all of them for blocks under 4 / 8 keys); head 64 takes
         * 16-key blocks through cp.async whatever their order, and caches of 16-key chunks at
         * head 128 the per-chunk boxes (attention_sm90.cu): no count for those */
        a->table_runs = dk_attention_table_runs(a, 128);
    }
    if (q.device_type == DK_CUDA) {
        dk_attention_uniform_rows(a); /* the persistent sm90 kernel's rows (attention.cu) */
    }
    /* From here on the kernels use the tensors on the query's device. */
    a->block_table = (const int32_t *)bt.data;
    a->bt_stride_row = bt.strides[0];
    a->query_start_loc = (const int32_t *)qsl.data;
    a->seq_lens = (const int32_t *)sl.data;
    *q_out = q;
    *o_out = o;
    return 0;
}

int
dkpy_run_attention(PyObject *module, PyObject *query_obj, const dk_tensor *q,
                   const dk_attention_args *a)
{
    if (a->num_tokens == 0) {
        return 0;
    }
    if (q->device_type == DK_CUDA) {
        return dkpy_run_cuda(module, query_obj, q->device_id, launch_attention, a);
    }
    dk_attention_args run = *a;
    if (run.cpu_threads == 0) {
        run.cpu_threads = dk_bridge_cpu_threads(&state_of(module)->bridge);
        if (run.cpu_threads < 0) {
            return -1;
        }
    }
    dk_error err = {{0}};
    dk_status s;
    Py_BEGIN_ALLOW_THREADS s = dk_ref_attention(&run, &err);
    Py_END_ALLOW_THREADS if (s != DK_OK)
    {
        dkpy_raise_status(module, s, &err);
        return -1;
    }
    return 0;
}

/* paged_attention(query, kv_cache, ..., host_seq_lens[, k_scale, v_scale]): with scales, a
 * float8_e4m3fn kv_cache (the CPU reference; on CUDA the Hopper e4m3 kernel). */
static PyObject *
py_paged_attention(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "paged_attention";
    if (dkpy_check_nargs_either(op, nargs, 12, 14) != 0) {
        return NULL;
    }
    PyObject *const none[2] = {Py_None, Py_None};
    dk_attention_args a;
    dk_tensor q, o;
    if (dkpy_parse_attention(module, args, op, &a, NULL, &q, &o, NULL, 1, 0,
                             nargs == 14 ? args + 12 : none) != 0) {
        return NULL;
    }
    if (a.kv_fp8 && dkpy_check_scales(module, args + 12, args[0], &q, a.k_scale, a.v_scale,
                                      a.scale_stride_head ? a.num_kv_heads : 1, op) != 0) {
        return NULL;
    }
    if (dkpy_run_attention(module, args[0], &q, &a) != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/*
 * paged_attention_lse and dense_attention allow rows with fewer keys than queries in every mask
 * mode (a context-parallel rank's share of the keys, a key-padding mask), so they run
 * dkpy_parse_attention with MASK_NONE, whose host check has no bottom-right rule, reading the real
 * mask before (dkpy_short_rows_mask) and attaching it, with its key_limits checked, after
 * (dkpy_short_rows_set_mask).  Both return 0, or -1 with an exception set.
 */
int
dkpy_short_rows_mask(PyObject *obj, const char *op, int64_t *mask)
{
    if (dkpy_get_i64(obj, op, "mask", mask) != 0) {
        return -1;
    }
    if (*mask < DK_MASK_NONE || *mask > DK_MASK_LIMITS) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): mask must be 0 (none), 1 (causal) or 2 (limits), got %lld", op,
                     (long long)*mask);
        return -1;
    }
    return 0;
}

int
dkpy_short_rows_set_mask(PyObject *module, PyObject *key_limits, const char *op, int64_t mask,
                         const dk_tensor *q, const dk_tensor *o, dk_attention_args *a)
{
    if (mask == DK_MASK_LIMITS) {
        dk_tensor kl;
        if (dk_bridge_optional_tensor(&state_of(module)->bridge, key_limits, op, "key_limits",
                                      &kl)) {
            return -1;
        }
        if (kl.ndim < 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): key_limits must be a tensor when mask is 2 (limits), got None", op);
            return -1;
        }
        if (dkpy_check(&kl, op,
                       &(dkpy_want){.arg = "key_limits",
                                    .dtype = DK_I32,
                                    .ndim = DKPY_VECTOR,
                                    .min_len = a->num_tokens,
                                    .device = q}) ||
            dkpy_no_overlap(o, "out", &kl, "key_limits", op)) {
            return -1;
        }
        a->key_limits = (const int32_t *)kl.data;
    }
    a->mask = (int32_t)mask;
    return 0;
}

/*
 * paged_attention_lse: paged_attention that also fills lse_out[t, h], the log-sum-exp of every
 * (token, head), on the CPU and on CUDA (the same kernels, which then also write the LSE).
 * Unlike paged_attention, a row's seq_len may be below its query length
 * in every mask mode: a context-parallel rank holds a share of each row's keys, so its local
 * key count is usually below the query length; a token then sees fewer keys, possibly none
 * (zeros in out, -inf in lse): see dkpy_short_rows_mask.
 * args: query, kv_cache, block_table, query_start_loc, seq_lens, key_limits, mask, scale, out,
 *       lse_out, host_block_table, host_query_start_loc, host_seq_lens
 */
static PyObject *
py_paged_attention_lse(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "paged_attention_lse";
    /* The tensor arguments lse_out must not share bytes with (it is written last of all, but
     * a failed call must leave every input as it was and a finished one must not have
     * rewritten an input that is read during the call). */
    static const int inputs[] = {0, 1, 2, 3, 4, 5, 8, 10, 11, 12};
    static const char *input_names[] = {
        "query",      "kv_cache", "block_table",      "query_start_loc",      "seq_lens",
        "key_limits", "out",      "host_block_table", "host_query_start_loc", "host_seq_lens"};
    if (dkpy_check_nargs(op, nargs, 13) != 0) {
        return NULL;
    }
    int64_t mask = 0;
    if (dkpy_short_rows_mask(args[6], op, &mask) != 0) {
        return NULL;
    }
    PyObject *none_mask = PyLong_FromLong(DK_MASK_NONE);
    if (none_mask == NULL) {
        return NULL;
    }
    PyObject *attn_args[12] = {args[0],   args[1], args[2], args[3],  args[4],  args[5],
                               none_mask, args[7], args[8], args[10], args[11], args[12]};
    PyObject *result = NULL;
    dk_attention_args a;
    dk_tensor q, o, lse, in;
    if (dkpy_parse_attention(module, attn_args, op, &a, NULL, &q, &o, NULL, 1, 0, NULL) != 0 ||
        dkpy_short_rows_set_mask(module, args[5], op, mask, &q, &o, &a) != 0) {
        goto done;
    }
    if (dkpy_tensor_arg(module, args[9], op, "lse_out", &lse) != 0 ||
        dkpy_want_dtype(&lse, DK_F32, op, "lse_out") || dkpy_want_ndim(&lse, 2, op, "lse_out") ||
        dkpy_same_device(&q, &lse, op, "lse_out")) {
        goto done;
    }
    if (lse.shape[0] != a.num_tokens || lse.shape[1] != a.num_heads) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): lse_out must have shape [%lld, %lld], got [%lld, %lld]", op,
                     (long long)a.num_tokens, (long long)a.num_heads, (long long)lse.shape[0],
                     (long long)lse.shape[1]);
        goto done;
    }
    for (size_t i = 0; i < sizeof(inputs) / sizeof(inputs[0]); i++) {
        if (inputs[i] == 5 && mask != DK_MASK_LIMITS) {
            continue; /* key_limits is not read in this mode */
        }
        if (dk_bridge_optional_tensor(&state_of(module)->bridge, args[inputs[i]], op,
                                      input_names[i], &in) ||
            dkpy_no_overlap(&lse, "lse_out", &in, input_names[i], op)) {
            goto done;
        }
    }
    a.lse = (float *)lse.data;
    a.lse_stride_token = lse.strides[0];
    a.lse_stride_head = lse.strides[1];
    if (dkpy_run_attention(module, args[0], &q, &a) != 0) {
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(none_mask);
    return result;
}

PyMethodDef dkpy_attention_methods[] = {
    FAST(paged_attention, "Paged attention (CPU or CUDA)."),
    FAST(paged_attention_lse, "Paged attention + log-sum-exp per (token, head)."),
    {NULL, NULL, 0, NULL},
};
