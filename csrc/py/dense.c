/*
 * dense.c -- attention over key/value tensors (the dense forward).
 *
 * Entry points: dense_attention: keys addressed per row through key_index, optional joint keys;
 * the paged kernels read key/value as a cache of one-token blocks.  quantize_kv: the fp8 dense
 * forward's rounding of its keys and values into float8_e4m3fn tensors, scales from their amax.
 */
#include "binding.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * dense_attention's optional second K/V source: args[0] = joint_key, args[1] = joint_value
 * (both tensors or both None) into kv[2], kv[3] (ndim -1 when None): [num_joint, num_kv_heads,
 * head_size] with the key's dtype, device, trailing shape and strides (the kernels address
 * both sources with one stride set), at most INT32_MAX keys in all.  0, or -1 with an
 * exception set.
 */
static int
joint_kv(PyObject *module, PyObject *const *args, const char *op, dk_tensor *kv)
{
    static const char *names[2] = {"joint_key", "joint_value"};
    if ((args[0] == Py_None) != (args[1] == Py_None)) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): joint_key and joint_value must both be tensors or "
                     "both be None",
                     op);
        return -1;
    }
    if (args[0] == Py_None) {
        kv[2].ndim = -1;
        kv[3].ndim = -1;
        return 0;
    }
    for (int i = 0; i < 2; i++) {
        dk_tensor *t = &kv[2 + i];
        if (dkpy_tensor(
                module, args[i], op,
                &(dkpy_want){.arg = names[i], .dtype = kv[0].dtype, .ndim = 3, .device = &kv[0]},
                t)) {
            return -1;
        }
        int ok = t->shape[0] == kv[2].shape[0];
        for (int d = 1; d < 3; d++) {
            ok = ok && t->shape[d] == kv[0].shape[d] &&
                 (t->shape[d] <= 1 || t->strides[d] == kv[0].strides[d]);
        }
        ok = ok && (t->shape[0] <= 1 || t->strides[0] == kv[0].strides[0]);
        if (!ok) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): %s must have shape [num_joint, %lld, %lld] (joint_value: "
                         "joint_key's) and the key's strides [%lld, %lld, %lld], got shape [%lld, "
                         "%lld, %lld] strides [%lld, %lld, %lld]",
                         op, names[i], (long long)kv[0].shape[1], (long long)kv[0].shape[2],
                         (long long)kv[0].strides[0], (long long)kv[0].strides[1],
                         (long long)kv[0].strides[2], (long long)t->shape[0],
                         (long long)t->shape[1], (long long)t->shape[2], (long long)t->strides[0],
                         (long long)t->strides[1], (long long)t->strides[2]);
            return -1;
        }
    }
    if (kv[2].shape[0] > INT32_MAX - kv[0].shape[0]) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): key and joint_key must have at most %d tokens together, got %lld", op,
                     INT32_MAX, (long long)(kv[0].shape[0] + kv[2].shape[0]));
        return -1;
    }
    return 0;
}

/*
 * dense_attention: attention over keys and values held in two plain tensors
 * key/value [num_keys, num_kv_heads, head_size] (one stride set), addressed per row through
 * key_index [num_rows, cols] int32: key j of row r is key token key_index[r, j] (a block table
 * over blocks of one token).  Serves DiffKVAttentionImpl.forward: dense, key-padded and
 * packed varlen batches all become rows of key indices, so the paged kernels run them with
 * no copy of K or V.  A row may have fewer keys than queries in every mask mode (a key-padding
 * mask leaves fewer keys; a token that sees none gets zeros): see dkpy_short_rows_mask.
 * args: query, key, value, key_index, query_start_loc, seq_lens, key_limits, mask, scale, out,
 *       host_key_index, host_query_start_loc, host_seq_lens, max_query_len
 * max_query_len (> 0) sizes the launch when the host copies are None (CUDA, trusted metadata:
 * the caller vouches that no row has more queries); 0 = up to every query token, as in
 * paged_attention.  With host copies it is ignored (the checked copies give the exact max).
 * Then joint_key, joint_value, key_block (blocks of that many consecutive key tokens) and
 * consecutive, bits the caller vouches for (the kernels' TMA producers rely on them):
 * DK_CONSECUTIVE_TILES (1) every row's keys are runs of consecutive rows whose 128-key tiles
 * each lie in one source; DK_CONSECUTIVE_CHUNKS (2) every 16 keys of a row (0-15, 16-31, ..)
 * are 16 consecutive rows of one source starting at a multiple of 8 (the row's last 16 may run
 * past its keys); DK_CONSECUTIVE_SCALES_FROM_KV (4, with scales) the scales were computed
 * from key/value themselves (the dense forward's amax / 448, never <= 0), so their values are
 * not copied to the host to be checked -- no synchronisation; a NaN or inf among them comes
 * from NaN or inf inputs and gives NaN outputs, as unquantized attention does.
 * Then, optionally, k_scale and v_scale: key/value (and joint_key/joint_value) are
 * float8_e4m3fn, read as e4m3 * scale (paged_attention's scales: float32, one per tensor or
 * per KV head, finite and positive unless DK_CONSECUTIVE_SCALES_FROM_KV says otherwise).
 */
static PyObject *
py_dense_attention(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "dense_attention";
    if (dkpy_check_nargs_either(op, nargs, 18, 20) != 0) {
        return NULL;
    }
    /* with k_scale, v_scale (args 18, 19): float8_e4m3fn key/value */
    const int fp8 = nargs == 20;
    int64_t max_query_len = 0, key_block = 0, consecutive = 0;
    if (dkpy_get_i64(args[13], op, "max_query_len", &max_query_len) != 0) {
        return NULL;
    }
    if (max_query_len < 0) {
        PyErr_Format(PyExc_ValueError, "%s(): max_query_len must be >= 0, got %lld", op,
                     (long long)max_query_len);
        return NULL;
    }
    dk_tensor kv[4], q, o;
    if (dkpy_tensor(module, args[1], op,
                    &(dkpy_want){.arg = "key", .dtype = fp8 ? DK_F8E4M3 : DKPY_FLOAT, .ndim = 3},
                    &kv[0]) ||
        dkpy_tensor(module, args[2], op,
                    &(dkpy_want){.arg = "value", .dtype = kv[0].dtype, .ndim = 3, .device = &kv[0]},
                    &kv[1])) {
        return NULL;
    }
    for (int i = 0; i < 3; i++) {
        if (kv[1].shape[i] != kv[0].shape[i] ||
            (kv[0].shape[i] > 1 && kv[1].strides[i] != kv[0].strides[i])) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): value must have the key's shape and strides, got shape [%lld, "
                         "%lld, %lld] strides [%lld, %lld, %lld] for key shape [%lld, %lld, %lld] "
                         "strides [%lld, %lld, %lld]",
                         op, (long long)kv[1].shape[0], (long long)kv[1].shape[1],
                         (long long)kv[1].shape[2], (long long)kv[1].strides[0],
                         (long long)kv[1].strides[1], (long long)kv[1].strides[2],
                         (long long)kv[0].shape[0], (long long)kv[0].shape[1],
                         (long long)kv[0].shape[2], (long long)kv[0].strides[0],
                         (long long)kv[0].strides[1], (long long)kv[0].strides[2]);
            return NULL;
        }
    }
    if (kv[0].shape[0] > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s(): key must have at most %d tokens, got %lld", op,
                     INT32_MAX, (long long)kv[0].shape[0]);
        return NULL;
    }
    if (joint_kv(module, args + 14, op, kv) != 0 ||
        dkpy_get_i64(args[16], op, "key_block", &key_block)) {
        return NULL;
    }
    if (key_block < 1 || (kv[0].shape[0] % key_block) != 0 || (key_block > 1 && kv[2].ndim == 3)) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): key_block must be >= 1 and divide the %lld key tokens (1 with "
                     "joint_key), got %lld",
                     op, (long long)kv[0].shape[0], (long long)key_block);
        return NULL;
    }
    if (dkpy_get_i64(args[17], op, "consecutive", &consecutive) != 0) {
        return NULL;
    }
    if (consecutive < 0 || consecutive > (DK_CONSECUTIVE_TILES | DK_CONSECUTIVE_CHUNKS |
                                          DK_CONSECUTIVE_SCALES_FROM_KV)) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): consecutive must be 0 to 7 (bits 1, 2 and 4), got %lld", op,
                     (long long)consecutive);
        return NULL;
    }
    int64_t mask = 0;
    if (dkpy_short_rows_mask(args[7], op, &mask) != 0) {
        return NULL;
    }
    /* dkpy_parse_attention's argument order (kv_cache slot unused), mask replaced by MASK_NONE */
    PyObject *none_mask = PyLong_FromLong(DK_MASK_NONE);
    if (none_mask == NULL) {
        return NULL;
    }
    PyObject *attn_args[12] = {args[0],   Py_None, args[3], args[4],  args[5],  args[6],
                               none_mask, args[8], args[9], args[10], args[11], args[12]};
    dk_attention_args a;
    PyObject *const none[2] = {Py_None, Py_None};
    int rc = dkpy_parse_attention(module, attn_args, op, &a, NULL, &q, &o, kv, key_block, 0,
                                  fp8 ? args + 18 : none);
    Py_DECREF(none_mask);
    if (rc != 0) {
        return NULL;
    }
    if (a.kv_fp8 && !(consecutive & DK_CONSECUTIVE_SCALES_FROM_KV) &&
        dkpy_check_scales(module, args + 18, args[0], &q, a.k_scale, a.v_scale,
                          a.scale_stride_head ? a.num_kv_heads : 1, op) != 0) {
        return NULL;
    }
    if (consecutive & DK_CONSECUTIVE_TILES) {
        a.table_runs = DK_TABLE_RUNS_ALL; /* the caller vouches: every tile is one run */
        a.keys_consecutive = a.key_cache2 == NULL ? DK_CONSECUTIVE_TILES : 0;
    }
    a.keys_consecutive |= (int32_t)(consecutive & DK_CONSECUTIVE_CHUNKS); /* and 16-key chunks */
    if (dkpy_no_overlap(&o, "out", &kv[0], "key", op) ||
        dkpy_no_overlap(&o, "out", &kv[1], "value", op) ||
        dkpy_short_rows_set_mask(module, args[6], op, mask, &q, &o, &a) != 0) {
        return NULL;
    }
    if (q.device_type == DK_CUDA && args[10] == Py_None && max_query_len > 0 &&
        max_query_len < a.max_query_len) {
        a.max_query_len = max_query_len;
    }
    if (dkpy_run_attention(module, args[0], &q, &a) != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static dk_status
launch_quantize_kv(const void *a, void *stream, dk_error *err)
{
    return dk_cuda_quantize_kv((const dk_quantize_kv_args *)a, stream, err);
}

/* kv_write's arguments for one pair of quantize_kv: k, v into ko, vo, with scales[0] /
 * scales[1] and no slot mapping -- 3-d outputs as caches of one-token blocks (token t into row
 * t), 4-d [B, S, ., .] outputs as caches of B blocks of S tokens (token t into entry t / S, row
 * t % S). */
static void
quantize_pair(dk_kv_write_args *w, const dk_tensor *k, const dk_tensor *v, const dk_tensor *ko,
              const dk_tensor *vo, float *scales)
{
    memset(w, 0, sizeof(*w));
    if (k->ndim < 0) {
        return; /* no joint pair: num_tokens 0 */
    }
    w->key = k->data;
    w->value = v->data;
    w->key_stride_token = k->strides[0];
    w->key_stride_head = k->strides[1];
    w->key_stride_dim = k->strides[2];
    w->value_stride_token = v->strides[0];
    w->value_stride_head = v->strides[1];
    w->value_stride_dim = v->strides[2];
    const int r = ko->ndim == 4; /* the token dimensions of ko: [0] or [0, 1] */
    w->key_cache = ko->data;
    w->value_cache = vo->data;
    w->cache_stride_block = ko->strides[0];
    w->cache_stride_token = ko->strides[r];
    w->cache_stride_head = ko->strides[r + 1];
    w->cache_stride_dim = ko->strides[r + 2];
    w->slot_mapping = NULL;
    w->num_tokens = k->shape[0];
    w->num_kv_heads = k->shape[1];
    w->head_size = k->shape[2];
    w->block_size = r ? ko->shape[1] : 1;
    w->num_blocks = ko->shape[0];
    w->dtype = k->dtype;
    w->cache_dtype = DK_F8E4M3;
    w->k_scale = scales;
    w->v_scale = scales + 1;
    w->scale_stride_head = 0;
}

/*
 * quantize_kv: the dense forward's fp8 rounding of its keys and values in one call, with no
 * temporaries (dk_quantize_kv_args).
 * args: key, value [tokens, num_kv_heads, head_size] (float32, float16 or bfloat16, any
 *       strides), key_out, value_out (float8_e4m3fn, their shape or [B, S, num_kv_heads,
 *       head_size] with B * S = tokens -- token t into entry t / S, row t % S -- one stride
 *       set; a joint output of 4 dimensions may interleave with its main output's rows in one
 *       buffer, checked row by row), scales
 *       (float32 [2], written: the keys', the values'), then joint_key, joint_value,
 *       joint_key_out, joint_value_out (all four None, or tensors: the joint pair, rounded with
 *       the same two scales, which cover both pairs).
 * Every output must be on the key's device and share no byte with an input or another output.
 */
static PyObject *
py_quantize_kv(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "quantize_kv";
    static const char *names[8] = {"key",     "value",     "joint_key",     "joint_value",
                                   "key_out", "value_out", "joint_key_out", "joint_value_out"};
    /* args index of names[i] */
    static const int at[8] = {0, 1, 5, 6, 2, 3, 7, 8};
    if (dkpy_check_nargs(op, nargs, 9) != 0) {
        return NULL;
    }
    dk_tensor t[8], sc; /* t: names' order, ndim -1 for an absent joint pair */
    if (dkpy_tensor(module, args[0], op, &(dkpy_want){.arg = "key", .dtype = DKPY_FLOAT, .ndim = 3},
                    &t[0])) {
        return NULL;
    }
    const int joint = args[5] != Py_None;
    for (int i = 5; i < 9; i++) {
        if ((args[i] != Py_None) != joint) {
            PyErr_Format(PyExc_TypeError,
                         "%s(): joint_key, joint_value, joint_key_out and joint_value_out must "
                         "all be tensors or all be None",
                         op);
            return NULL;
        }
    }
    for (int i = 1; i < 8; i++) {
        if (!joint && (i == 2 || i == 3 || i == 6 || i == 7)) {
            t[i].ndim = -1;
            continue;
        }
        const int src = i < 4 ? i & ~1 : i - 4; /* the input whose shape this one has */
        if (dkpy_tensor(module, args[at[i]], op,
                        &(dkpy_want){.arg = names[i],
                                     .dtype = i < 4 ? (int)t[0].dtype : (int)DK_F8E4M3,
                                     .ndim = i < 4 ? 3 : DKPY_ANY_NDIM,
                                     .device = &t[0]},
                        &t[i])) {
            return NULL;
        }
        if (i >= 4 && t[i].ndim == 4) { /* [B, S, Hkv, D]: B * S of its input's tokens */
            const dk_tensor *r = &t[src];
            if (i & 1 && (t[i - 1].ndim != 4 || t[i - 1].shape[0] != t[i].shape[0])) {
                /* value_out: key_out's [B, S] (the write takes key_out's geometry) */
                char want[96], got[96];
                dkpy_format_dims(want, sizeof(want), t[i - 1].shape, t[i - 1].ndim);
                dkpy_format_dims(got, sizeof(got), t[i].shape, 4);
                PyErr_Format(PyExc_ValueError, "%s(): %s must have %s's shape %s, got %s", op,
                             names[i], names[i - 1], want, got);
                return NULL;
            }
            if (t[i].shape[0] * t[i].shape[1] != r->shape[0] || t[i].shape[2] != r->shape[1] ||
                t[i].shape[3] != r->shape[2]) {
                PyErr_Format(PyExc_ValueError,
                             "%s(): %s must have shape [B, S, %lld, %lld] with B * S = %lld (%s's "
                             "tokens), got [%lld, %lld, %lld, %lld]",
                             op, names[i], (long long)r->shape[1], (long long)r->shape[2],
                             (long long)r->shape[0], names[src], (long long)t[i].shape[0],
                             (long long)t[i].shape[1], (long long)t[i].shape[2],
                             (long long)t[i].shape[3]);
                return NULL;
            }
            continue;
        }
        if (i >= 4 && t[i].ndim != 3) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): %s must have 3 dimensions [tokens, Hkv, D] or 4 [B, S, Hkv, D], "
                         "got %d",
                         op, names[i], (int)t[i].ndim);
            return NULL;
        }
        if (i & 1 && i >= 4 && t[i - 1].ndim != 3) {
            char want[96], got[96];
            dkpy_format_dims(want, sizeof(want), t[i - 1].shape, 4);
            dkpy_format_dims(got, sizeof(got), t[i].shape, 3);
            PyErr_Format(PyExc_ValueError, "%s(): %s must have %s's shape %s, got %s", op, names[i],
                         names[i - 1], want, got);
            return NULL;
        }
        int ok = 1;
        for (int d = 0; d < 3; d++) {
            /* joint_key: the key's heads and head size; the others: their source's shape */
            ok = ok && (i == 2 && d == 0 ? 1 : t[i].shape[d] == t[i == 2 ? 0 : src].shape[d]);
        }
        if (!ok) {
            const dk_tensor *r = &t[i == 2 ? 0 : src];
            char first[32] = "num_joint";
            if (i != 2) {
                snprintf(first, sizeof(first), "%lld", (long long)r->shape[0]);
            }
            PyErr_Format(PyExc_ValueError,
                         "%s(): %s must have shape [%s, %lld, %lld], got [%lld, %lld, %lld]", op,
                         names[i], first, (long long)r->shape[1], (long long)r->shape[2],
                         (long long)t[i].shape[0], (long long)t[i].shape[1],
                         (long long)t[i].shape[2]);
            return NULL;
        }
    }
    for (int i = 5; i < 8; i += 2) { /* value_out / joint_value_out: key_out's strides */
        if (t[i].ndim < 0) {
            continue;
        }
        int same = 1;
        for (int d = 0; d < t[i].ndim; d++) {
            same = same && (t[i].shape[d] <= 1 || t[i].strides[d] == t[i - 1].strides[d]);
        }
        if (!same) {
            char want[96], got[96];
            dkpy_format_dims(want, sizeof(want), t[i - 1].strides, t[i].ndim);
            dkpy_format_dims(got, sizeof(got), t[i].strides, t[i].ndim);
            PyErr_Format(PyExc_ValueError, "%s(): %s must have %s's strides %s, got %s", op,
                         names[i], names[i - 1], want, got);
            return NULL;
        }
    }
    if (dkpy_tensor(
            module, args[4], op,
            &(dkpy_want){.arg = "scales", .dtype = DK_F32, .ndim = DKPY_VECTOR, .device = &t[0]},
            &sc)) {
        return NULL;
    }
    if (sc.shape[0] != 2) {
        PyErr_Format(PyExc_ValueError, "%s(): scales must have 2 entries, got %lld", op,
                     (long long)sc.shape[0]);
        return NULL;
    }
    /* what is written (the outputs, the scales) shares no byte with anything else */
    for (int i = 4; i < 8 && t[i].ndim >= 0; i++) {
        for (int j = 0; j < 8; j++) {
            /* a main output and a joint one: row ranges of one buffer may interleave */
            const int rows = j > i && (j - i) % 2 == 0;
            if (j != i && (j < 4 || j > i) &&
                (rows ? dkpy_no_overlap_rows(&t[i], names[i], &t[j], names[j], op)
                      : dkpy_no_overlap(&t[i], names[i], &t[j], names[j], op))) {
                return NULL;
            }
        }
    }
    for (int j = 0; j < 8; j++) {
        if (dkpy_no_overlap(&sc, "scales", &t[j], names[j], op)) {
            return NULL;
        }
    }
    dk_quantize_kv_args q;
    float *scales = (float *)sc.data;
    quantize_pair(&q.kv[0], &t[0], &t[1], &t[4], &t[5], scales);
    quantize_pair(&q.kv[1], &t[2], &t[3], &t[6], &t[7], scales);
    q.scales = scales;
    if (t[0].device_type == DK_CUDA) {
        if (dkpy_run_cuda(module, args[0], t[0].device_id, launch_quantize_kv, &q) != 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    dk_error err = {{0}};
    dk_status st;
    Py_BEGIN_ALLOW_THREADS st = dk_ref_quantize_kv(&q, &err);
    Py_END_ALLOW_THREADS if (st != DK_OK)
    {
        return dkpy_raise_status(module, st, &err);
    }
    Py_RETURN_NONE;
}

PyMethodDef dkpy_dense_methods[] = {
    FAST(dense_attention, "Attention over key/value tensors addressed per row by key indices."),
    FAST(quantize_kv, "The dense forward's fp8 rounding of key/value (and joint key/value)."),
    {NULL, NULL, 0, NULL},
};
