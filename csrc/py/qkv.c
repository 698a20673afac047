/*
 * qkv.c -- prepare_layer_context's rules on query, key and value.
 *
 * How the caller's tensors flatten into [tokens, heads, head_size] views, which leading dims are
 * tokens, whether the padded-row scatter is needed, dtype/device agreement, in vLLM-Omni's
 * adapter's order and words.  Entry point: check_layer_qkv.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

/* vLLM-Omni's adapter's _flatten_tensor decision: *tok_ndim leading dims are tokens, or the
 * adapter's error when the trailing dims are neither [heads, size] nor [heads * size]. */
static int
flatten_layout(const dk_tensor *t, int64_t heads, int64_t size, const char *name, int *has_heads,
               int *tok_ndim)
{
    int nd = t->ndim;
    if (nd >= 3 && t->shape[nd - 2] == heads && t->shape[nd - 1] == size) {
        *has_heads = 1;
        *tok_ndim = nd - 2;
        return 0;
    }
    if (nd >= 1 && t->shape[nd - 1] == heads * size) {
        *has_heads = 0;
        *tok_ndim = nd - 1;
        return 0;
    }
    PyObject *shape = dkpy_int_tuple(t->shape, nd);
    if (shape != NULL) {
        PyErr_Format(PyExc_ValueError,
                     "Paged attention %s must end in (%lld, %lld) or (%lld,); got shape=%R", name,
                     (long long)heads, (long long)size, (long long)(heads * size), shape);
        Py_DECREF(shape);
    }
    return -1;
}

/* 1 when a's first an dims equal b's first bn dims (an == bn), else 0.  Cannot fail. */
static int
same_token_shape(const dk_tensor *a, int an, const dk_tensor *b, int bn)
{
    if (an != bn) {
        return 0;
    }
    for (int i = 0; i < an; i++) {
        if (a->shape[i] != b->shape[i]) {
            return 0;
        }
    }
    return 1;
}

/* The token dims of key ("key") or value ("value") against the query's. */
static int
token_shape_mismatch(const dk_tensor *q, int qn, const dk_tensor *t, int tn, const char *name)
{
    PyObject *qs = dkpy_int_tuple(q->shape, qn);
    PyObject *ts = qs == NULL ? NULL : dkpy_int_tuple(t->shape, tn);
    if (ts != NULL) {
        if (tn == 1) {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention %s token count must match the query layout: query=%R, "
                         "%s=%R",
                         name, qs, name, ts);
        }
        else {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention batched %s layout must match prepared rows and the query "
                         "layout: query=%R, %s=%R",
                         name, qs, name, ts);
        }
    }
    Py_XDECREF(qs);
    Py_XDECREF(ts);
    return -1;
}

/* "torch.<dtype>" for the floating dtypes a layer may hold, NULL for others.  Cannot fail. */
static const char *
torch_dtype_name(dk_dtype dtype)
{
    switch (dtype) {
    case DK_F32:
        return "torch.float32";
    case DK_F16:
        return "torch.float16";
    case DK_BF16:
        return "torch.bfloat16";
    case DK_F64:
        return "torch.float64";
    default:
        return NULL;
    }
}

/* Compares dtypes exactly; for dtypes DLPack cannot name, asks the tensors themselves. */
static int
dtypes_differ(PyObject *a, const dk_tensor *ta, PyObject *b, const dk_tensor *tb)
{
    if (ta->dtype != DK_OTHER && tb->dtype != DK_OTHER) {
        return ta->dtype != tb->dtype;
    }
    PyObject *da = PyObject_GetAttrString(a, "dtype");
    PyObject *db = da == NULL ? NULL : PyObject_GetAttrString(b, "dtype");
    int ne = db == NULL ? -1 : PyObject_RichCompareBool(da, db, Py_NE);
    Py_XDECREF(da);
    Py_XDECREF(db);
    return ne;
}

/*
 * Describes a tensor DLPack cannot export (a "meta" tensor, another backend's device) from its
 * Python attributes, so the adapter's device check can name it: shape from .shape, device type 0
 * (matches no adapter device) unless .device is cpu/cuda, dtype DK_OTHER (compared through
 * the tensors' own .dtype).  Returns 0, or -1 with the original export error restored.
 */
static int
describe_unexported(PyObject *obj, dk_tensor *t)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *shape = PyObject_GetAttrString(obj, "shape");
    PyObject *dims = shape == NULL ? NULL : PySequence_Tuple(shape);
    PyObject *device = PyObject_GetAttrString(obj, "device");
    PyObject *dtype_name = device == NULL ? NULL : PyObject_GetAttrString(device, "type");
    int ok = dims != NULL && dtype_name != NULL && PyTuple_Size(dims) <= DK_MAX_DIMS;
    if (ok) {
        memset(t, 0, sizeof(*t));
        t->ndim = (int32_t)PyTuple_Size(dims);
        for (int32_t i = 0; ok && i < t->ndim; i++) {
            t->shape[i] = dkpy_int_saturated(PyTuple_GetItem(dims, i));
        }
        const char *dev =
            PyUnicode_Check(dtype_name) ? PyUnicode_AsUTF8AndSize(dtype_name, NULL) : "";
        t->device_type = dev != NULL && strcmp(dev, "cpu") == 0 ? DK_CPU : 0;
        t->device_id = -1;
        t->dtype = DK_OTHER;
    }
    Py_XDECREF(shape);
    Py_XDECREF(dims);
    Py_XDECREF(device);
    Py_XDECREF(dtype_name);
    if (!ok) {
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
        return -1;
    }
    PyErr_Clear();
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return 0;
}

/* The layout of a Q/K/V tensor (these checks never read the data, so a negative-bit view is
 * left to the binding that reads it), or the attribute description above when DLPack cannot
 * export the tensor. */
static int
layer_tensor(PyObject *module, PyObject *obj, const char *arg, dk_tensor *t)
{
    if (dk_bridge_tensor_layout(&state_of(module)->bridge, obj, "prepare_layer_context", arg, t) ==
        0) {
        return 0;
    }
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
        return -1; /* not a tensor at all */
    }
    return describe_unexported(obj, t);
}

/* vLLM-Omni's adapter's K/V normalisation rule on the flattened [N, heads, size] view: dims dense
 * and heads `size` apart (one head: any head stride).  A tensor DLPack could not export counts as
 * not dense.  Cannot fail. */
static int
dense_heads(const dk_tensor *t, int has_heads, int64_t heads, int64_t size)
{
    if (t->device_type == 0 || t->ndim < 1) {
        return 0;
    }
    int nd = t->ndim;
    if (t->shape[nd - 1] > 1 && t->strides[nd - 1] != 1) {
        return 0;
    }
    if (has_heads && heads > 1 && t->strides[nd - 2] != size) {
        return 0;
    }
    return 1;
}

static PyObject *
py_check_layer_qkv(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "prepare_layer_context";
    if (dkpy_check_nargs("check_layer_qkv", nargs, 14) != 0) {
        return NULL;
    }
    /* query, key, value, num_heads, num_kv_heads, head_size, head_size_v, device_type,
     * device_index, device, expected_dtype_code, expected_dtype, num_tokens, query_lens */
    PyObject *qo = args[0], *ko = args[1], *vo = args[2];
    int64_t h = 0, hkv = 0, d = 0, dv = 0, dev_type = 0, dev_index = 0, want_code = 0, n = 0;
    if (dkpy_get_i64(args[3], op, "num_heads", &h) ||
        dkpy_get_i64(args[4], op, "num_kv_heads", &hkv) ||
        dkpy_get_i64(args[5], op, "head_size", &d) ||
        dkpy_get_i64(args[6], op, "head_size_v", &dv) ||
        dkpy_get_i64(args[7], op, "device_type", &dev_type) ||
        dkpy_get_i64(args[8], op, "device_index", &dev_index) ||
        dkpy_get_i64(args[10], op, "expected_dtype_code", &want_code) ||
        dkpy_get_i64(args[12], op, "num_tokens", &n)) {
        return NULL;
    }
    dk_tensor q, k, v;
    int q_heads = 0, k_heads = 0, v_heads = 0, qn = 0, kn = 0, vn = 0;
    if (layer_tensor(module, qo, "query", &q) || flatten_layout(&q, h, d, "query", &q_heads, &qn) ||
        layer_tensor(module, ko, "key", &k) || flatten_layout(&k, hkv, d, "key", &k_heads, &kn) ||
        layer_tensor(module, vo, "value", &v) ||
        flatten_layout(&v, hkv, dv, "value", &v_heads, &vn)) {
        return NULL;
    }
    if (!same_token_shape(&q, qn, &k, kn)) {
        token_shape_mismatch(&q, qn, &k, kn, "key");
        return NULL;
    }
    if (!same_token_shape(&q, qn, &v, vn)) {
        token_shape_mismatch(&q, qn, &v, vn, "value");
        return NULL;
    }
    /* The token layout, as vLLM-Omni's adapter's _token_packing_indices decides it: packed
     * [N] tokens, or uniform batched [B, T] that needs packing when a row is shorter than T. */
    int needs_packing = 0;
    if (qn == 1) {
        if (q.shape[0] != n) {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention Q/K/V token count must match the prepared write batch: "
                         "tokens=%lld, prepared=%lld",
                         (long long)q.shape[0], (long long)n);
            return NULL;
        }
    }
    else if (qn == 2) {
        PyObject *lens = dkpy_as_tuple(args[13], op, "query_lens");
        if (lens == NULL) {
            return NULL;
        }
        Py_ssize_t rows = PyTuple_Size(lens);
        int bad = q.shape[0] != rows, all_full = 1;
        for (Py_ssize_t i = 0; i < rows && !bad; i++) {
            int64_t ql = dkpy_int_saturated(PyTuple_GetItem(lens, i));
            bad = ql > q.shape[1];
            all_full = all_full && ql == q.shape[1];
        }
        if (bad) {
            PyObject *shape = dkpy_int_tuple(q.shape, 2);
            if (shape != NULL) {
                PyErr_Format(
                    PyExc_ValueError,
                    "Paged attention batched Q/K/V layout must match prepared rows for the "
                    "current write: shape=%R, row_query_lens=%R",
                    shape, lens);
                Py_DECREF(shape);
            }
            Py_DECREF(lens);
            return NULL;
        }
        Py_DECREF(lens);
        needs_packing = !all_full;
    }
    else {
        PyObject *shape = dkpy_int_tuple(q.shape, qn);
        if (shape != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention Q/K/V supports packed [T, ...] or uniform batched [B, T, "
                         "...] token layouts; got token shape=%R",
                         shape);
            Py_DECREF(shape);
        }
        return NULL;
    }
    /* Devices, after normalisation ("cuda" = the current device, resolved by the caller). */
    const dk_tensor *ts[3] = {&q, &k, &v};
    for (int i = 0; i < 3; i++) {
        if (ts[i]->device_type != dev_type ||
            (dev_type == DK_CUDA && ts[i]->device_id != dev_index)) {
            PyObject *qd = PyObject_GetAttrString(qo, "device");
            PyObject *kd = qd == NULL ? NULL : PyObject_GetAttrString(ko, "device");
            PyObject *vd = kd == NULL ? NULL : PyObject_GetAttrString(vo, "device");
            if (vd != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "Paged attention Q/K/V must be on %S; got query=%S, key=%S, value=%S",
                             args[9], qd, kd, vd);
            }
            Py_XDECREF(qd);
            Py_XDECREF(kd);
            Py_XDECREF(vd);
            return NULL;
        }
    }
    /* Dtypes: key and value like the query, the query like the layer's. */
    int ne_k = dtypes_differ(qo, &q, ko, &k);
    int ne_v = ne_k < 0 ? -1 : dtypes_differ(qo, &q, vo, &v);
    if (ne_k < 0 || ne_v < 0) {
        return NULL;
    }
    if (ne_k || ne_v) {
        PyObject *qd = PyObject_GetAttrString(qo, "dtype");
        PyObject *kd = qd == NULL ? NULL : PyObject_GetAttrString(ko, "dtype");
        PyObject *vd = kd == NULL ? NULL : PyObject_GetAttrString(vo, "dtype");
        if (vd != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention Q/K/V dtypes must match; got %S, %S, %S", qd, kd, vd);
        }
        Py_XDECREF(qd);
        Py_XDECREF(kd);
        Py_XDECREF(vd);
        return NULL;
    }
    int wrong = 0;
    if (want_code >= 0 && q.dtype != DK_OTHER) {
        wrong = (int64_t)q.dtype != want_code;
    }
    else {
        PyObject *qd = PyObject_GetAttrString(qo, "dtype");
        wrong = qd == NULL ? -1 : PyObject_RichCompareBool(qd, args[11], Py_NE);
        Py_XDECREF(qd);
        if (wrong < 0) {
            return NULL;
        }
    }
    if (wrong) {
        const char *name = torch_dtype_name(q.dtype);
        PyObject *qd =
            name != NULL ? PyUnicode_FromString(name) : PyObject_GetAttrString(qo, "dtype");
        if (qd != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention Q/K/V dtype must match model activation dtype %S; got %S",
                         args[11], qd);
            Py_DECREF(qd);
        }
        return NULL;
    }
    PyObject *tok = dkpy_int_tuple(q.shape, qn);
    if (tok == NULL) {
        return NULL;
    }
    long flags = needs_packing ? LAYOUT_PACK_ROWS : 0;
    flags |= (q.ndim == 3 && q_heads) ? LAYOUT_QUERY_HEADS : 0;
    flags |= (k.ndim == 3 && k_heads) ? LAYOUT_KEY_HEADS : 0;
    flags |= (v.ndim == 3 && v_heads) ? LAYOUT_VALUE_HEADS : 0;
    if (!needs_packing) {
        flags |= dense_heads(&k, k_heads, hkv, d) ? 0 : LAYOUT_KEY_CONTIGUOUS;
        flags |= dense_heads(&v, v_heads, hkv, dv) ? 0 : LAYOUT_VALUE_CONTIGUOUS;
    }
    return Py_BuildValue("(NOl)", tok, q_heads ? Py_True : Py_False, flags);
}

PyMethodDef dkpy_qkv_methods[] = {
    FAST(check_layer_qkv,
         "prepare_layer_context's query/key/value rules; returns (token shape, has head "
         "dims, LAYOUT_* bits)."),
    {NULL, NULL, 0, NULL},
};
