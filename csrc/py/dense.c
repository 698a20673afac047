/*
 * dense.c -- attention over key/value tensors (the dense forward).
 *
 * Entry point: dense_attention: keys addressed per row through key_index, optional joint keys;
 * the paged kernels read key/value as a cache of one-token blocks.
 */
#include "binding.h"

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

PyMethodDef dkpy_dense_methods[] = {
    FAST(dense_attention, "Attention over key/value tensors addressed per row by key indices."),
    {NULL, NULL, 0, NULL},
};
