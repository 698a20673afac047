/*
 * layer.c -- the layer call: KV write + attention in one call.
 *
 * Entry points: forward_paged (the explicit arguments; on CUDA one submission for both kernels,
 * cuda/launch.cu), forward_context (DiffKVAttentionImpl.forward_paged of a per-call context, in
 * one call) and new_with_slots (the per-call context's fast constructor).
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

const char *const dkpy_ctx_name_text[CTX_NAMES] = {
    "layer",
    "kv_cache",
    "impl",
    "native_metadata",
    "piecewise_plan",
    "key_limits",
    "causal",
    "query",
    "key_write",
    "value_write",
    "slot_mapping",
    "block_table",
    "query_start_loc",
    "seq_lens",
    "softmax_scale",
    "block_table_cpu",
    "query_start_loc_cpu",
    "seq_lens_cpu",
    "restore_output",
    "output_scatter_indices",
    "query_has_head_dims",
    "query_token_shape",
    "num_heads",
    "head_size_v",
    "new_empty",
};

/* forward_paged's two steps on the GPU: the KV write, then the attention over it. */
typedef struct layer_launch {
    const dk_kv_write_args *w;
    const dk_attention_args *a;
} layer_launch;

static dk_status
launch_layer(const void *l, void *stream, dk_error *err)
{
    const layer_launch *x = (const layer_launch *)l;
    return dk_cuda_layer(x->w, x->a, stream, err);
}

/* forward_paged's work (args as there); out_flat: out may be [N, H * D] (dkpy_parse_attention). */
static PyObject *
forward_paged_impl(PyObject *module, PyObject *const *args, int out_flat)
{
    static const char *op = "forward_paged";
    /* args: query, key, value, kv_cache, slot_mapping, block_table, query_start_loc, seq_lens,
     *       key_limits, mask, scale, out, host_block_table, host_query_start_loc, host_seq_lens */
    PyObject *kv_args[4] = {args[1], args[2], args[3], args[4]};
    PyObject *attn_args[12] = {args[0], args[3],  args[5],  args[6],  args[7],  args[8],
                               args[9], args[10], args[11], args[12], args[13], args[14]};
    dk_kv_write_args w;
    dk_attention_args a;
    dk_tensor kv[4], q, o;
    const dk_tensor *k = &kv[0];
    if (dkpy_parse_kv_write(module, kv_args, op, &w, kv) != 0 ||
        dkpy_parse_attention(module, attn_args, op, &a, &kv[2], &q, &o, NULL, 1, out_flat) != 0) {
        return NULL;
    }
    if (dkpy_no_overlap(&o, "out", &kv[0], "key", op) ||
        dkpy_no_overlap(&o, "out", &kv[1], "value", op) ||
        dkpy_no_overlap(&o, "out", &kv[3], "slot_mapping", op)) {
        return NULL;
    }
    if (k->device_type != q.device_type || k->device_id != q.device_id) {
        PyErr_Format(PyExc_TypeError, "%s(): key must be on the query's device", op);
        return NULL;
    }
    if (w.num_kv_heads != a.num_kv_heads || w.head_size != a.head_size) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): key must have [%lld, %lld] heads x head_size, got "
                     "[%lld, %lld]",
                     op, (long long)a.num_kv_heads, (long long)a.head_size,
                     (long long)w.num_kv_heads, (long long)w.head_size);
        return NULL;
    }
    if (w.num_tokens != a.num_tokens) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): key must have one token per query token (%lld), got "
                     "%lld",
                     op, (long long)a.num_tokens, (long long)w.num_tokens);
        return NULL;
    }
    if (q.device_type == DK_CPU && a.num_tokens > 0) {
        /* The reference's own dtype and head_size limits, before the write changes the cache:
         * with no rows it checks them and touches nothing. */
        dk_attention_args dry = a;
        dk_error err = {{0}};
        dry.num_rows = 0;
        dk_status s = dk_ref_attention(&dry, &err);
        if (s != DK_OK) {
            return dkpy_raise_status(module, s, &err);
        }
    }
    if (q.device_type == DK_CUDA) {
        /* one submission for both kernels (dk_cuda_layer), on the query's stream as before */
        const layer_launch l = {&w, &a};
        if (dkpy_run_cuda(module, args[0], q.device_id, launch_layer, &l) != 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    if (dkpy_run_kv_write(module, args[1], k, &w) != 0 ||
        dkpy_run_attention(module, args[0], &q, &a) != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
py_forward_paged(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dkpy_check_nargs("forward_paged", nargs, 15) != 0) {
        return NULL;
    }
    return forward_paged_impl(module, args, 0);
}

/* *slot = module.name, looked up on the first call and kept (a new reference owned by the
 * module state): 0, or -1 with the import's or getattr's error.  The import may release the
 * GIL, so another thread may have set *slot meanwhile: the first one stays. */
static int
cached_attr(PyObject **slot, const char *module, const char *name)
{
    if (*slot != NULL) {
        return 0;
    }
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL) {
        return -1;
    }
    PyObject *v = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    if (v == NULL) {
        return -1;
    }
    if (*slot == NULL) {
        *slot = v;
    }
    else {
        Py_DECREF(v);
    }
    return 0;
}

/* ctx's attribute `name` as a new reference; *plain = 0 (and no error) when it is missing
 * (AttributeError) or None -- getattr(ctx, name, None) is None in Python; NULL with the error set
 * for anything else getattr raised. */
static PyObject *
ctx_required(PyObject *obj, PyObject *name, int *plain)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            *plain = 0;
        }
        return NULL;
    }
    if (v == Py_None) {
        Py_DECREF(v);
        *plain = 0;
        return NULL;
    }
    return v;
}

/* An int attribute of obj into *v: 1, or 0 when it is not an int (no error), -1 on error. */
static int
ctx_int(PyObject *obj, PyObject *name, long long *v)
{
    PyObject *x = PyObject_GetAttr(obj, name);
    if (x == NULL) {
        return -1;
    }
    int ok = PyLong_Check(x);
    if (ok) {
        *v = PyLong_AsLongLong(x);
        if (*v == -1 && PyErr_Occurred()) {
            PyErr_Clear(); /* beyond int64: not the identity case */
            ok = 0;
        }
    }
    Py_DECREF(x);
    return ok;
}

/* What DiffusionPagedAttentionContext.restore_output does to the attention output. */
enum {
    OUT_RESTORE = 0,  /* something else: call the method */
    OUT_IDENTITY = 1, /* out [N, H, Dv] itself (the caller's query was [N, H, D]) */
    OUT_FLAT = 2      /* out.reshape(N, H * Dv) (the caller's query was [N, H * D]): allocated
                         that way, the kernels write its [N, H, Dv] view, nothing to restore */
};

/*
 * Which OUT_* restore_output(out) amounts to for this context, from the context (no scatter,
 * query_token_shape a 1-tuple (N,), query_has_head_dims) and the query q the output will be
 * like ([N, H, Dv] with H = num_heads, Dv = head_size_v) -- decided before the output is
 * allocated; *flat_shape receives (N, H * Dv).  -1 with an error set where reading an
 * attribute raised.
 */
static int
output_kind(PyObject *module, PyObject *ctx, PyObject *layer, PyObject *q_obj,
            long long flat_shape[2])
{
    PyObject *const *nm = state_of(module)->ctx_names;
    PyObject *x = PyObject_GetAttr(ctx, nm[CTX_OUTPUT_SCATTER_INDICES]);
    if (x == NULL) {
        return -1;
    }
    int none = x == Py_None;
    Py_DECREF(x);
    if (!none) {
        return OUT_RESTORE;
    }
    if ((x = PyObject_GetAttr(ctx, nm[CTX_QUERY_HAS_HEAD_DIMS])) == NULL) {
        return -1;
    }
    int heads = PyObject_IsTrue(x);
    Py_DECREF(x);
    if (heads < 0) {
        return -1;
    }
    if ((x = PyObject_GetAttr(ctx, nm[CTX_QUERY_TOKEN_SHAPE])) == NULL) {
        return -1;
    }
    long long n = -1;
    if (PyTuple_Check(x) && PyTuple_Size(x) == 1 && PyLong_Check(PyTuple_GetItem(x, 0))) {
        n = PyLong_AsLongLong(PyTuple_GetItem(x, 0));
        if (n == -1 && PyErr_Occurred()) {
            PyErr_Clear();
        }
    }
    Py_DECREF(x);
    if (n < 0) {
        return OUT_RESTORE;
    }
    long long h = -1, dv = -1;
    int rc = ctx_int(layer, nm[CTX_NUM_HEADS], &h);
    if (rc > 0) {
        rc = ctx_int(layer, nm[CTX_HEAD_SIZE_V], &dv);
    }
    if (rc <= 0) {
        return rc < 0 ? -1 : OUT_RESTORE;
    }
    dk_tensor q;
    if (dk_bridge_tensor_layout(&state_of(module)->bridge, q_obj, "forward_context", "query", &q) !=
        0) {
        PyErr_Clear(); /* not a tensor: forward_paged reports it in its own words */
        return OUT_RESTORE;
    }
    if (q.ndim != 3 || q.shape[0] != n || q.shape[1] != h || q.shape[2] != dv) {
        return OUT_RESTORE;
    }
    flat_shape[0] = n;
    flat_shape[1] = h * dv;
    return heads ? OUT_IDENTITY : OUT_FLAT;
}

/*
 * forward_context(ctx): DiffKVAttentionImpl.forward_paged of a per-call context
 * (adapter.prepare_layer_context) in one call, for eager execution -- what
 * backends.diffkv.run_forward_paged does in Python (the context's mask, the output from
 * torch.empty_like(query), forward_paged with the batch's host tables, ctx.restore_output), with
 * the same attribute reads in the same order and the same errors, minus the interpreter's ~1 us
 * (~3 us on the H200 hosts) per layer call.  Returns None, having read only ctx.layer and its
 * kv_cache and impl and done nothing, when one of those is missing or None: the Python path then
 * raises the contract's errors.
 */
static PyObject *
py_forward_context(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "forward_context";
    if (dkpy_check_nargs(op, nargs, 1) != 0) {
        return NULL;
    }
    module_state *st = state_of(module);
    PyObject *const *nm = st->ctx_names;
    if (cached_attr(&st->empty_like, "torch", "empty_like") != 0) { /* no libtorch link */
        return NULL;
    }
    PyObject *ctx = args[0];
    /* owned references, released at the end */
    PyObject *layer = NULL, *kv_cache = NULL, *impl = NULL, *meta = NULL, *plan = NULL;
    PyObject *key_limits = NULL, *mask = NULL, *scale = NULL, *out = NULL, *result = NULL;
    PyObject *t[7] = {NULL}; /* query, key_write, value_write, slot_mapping, block_table,
                                query_start_loc, seq_lens */
    PyObject *host[3] = {NULL, NULL, NULL};
    int plain = 1;
    layer = ctx_required(ctx, nm[CTX_LAYER], &plain);
    if (layer != NULL) {
        kv_cache = ctx_required(layer, nm[CTX_KV_CACHE], &plain);
    }
    if (kv_cache != NULL) {
        impl = ctx_required(layer, nm[CTX_IMPL], &plain);
    }
    if (impl == NULL) {
        if (!plain) {
            result = Py_NewRef(Py_None); /* not the plain kind: the Python path decides */
        }
        goto done;
    }
    if ((meta = PyObject_GetAttr(ctx, nm[CTX_NATIVE_METADATA])) == NULL ||
        (plan = PyObject_GetAttr(ctx, nm[CTX_PIECEWISE_PLAN])) == NULL) {
        goto done;
    }
    if (plan != Py_None) { /* ops.context_mask */
        mask = PyLong_FromLong(DK_MASK_LIMITS);
        key_limits = PyObject_GetAttr(plan, nm[CTX_KEY_LIMITS]);
    }
    else {
        PyObject *causal = PyObject_GetAttr(meta, nm[CTX_CAUSAL]);
        int c = causal == NULL ? -1 : PyObject_IsTrue(causal);
        Py_XDECREF(causal);
        if (c >= 0) {
            mask = PyLong_FromLong(c ? DK_MASK_CAUSAL : DK_MASK_NONE);
            key_limits = Py_NewRef(Py_None);
        }
    }
    if (mask == NULL || key_limits == NULL) {
        goto done;
    }
    static const int ctx_field[4] = {CTX_QUERY, CTX_KEY_WRITE, CTX_VALUE_WRITE, CTX_SLOT_MAPPING};
    static const int meta_field[3] = {CTX_BLOCK_TABLE, CTX_QUERY_START_LOC, CTX_SEQ_LENS};
    for (int i = 0; i < 4; i++) {
        if ((t[i] = PyObject_GetAttr(ctx, nm[ctx_field[i]])) == NULL) {
            goto done;
        }
    }
    for (int i = 0; i < 3; i++) {
        if ((t[4 + i] = PyObject_GetAttr(meta, nm[meta_field[i]])) == NULL) {
            goto done;
        }
    }
    PyObject *raw_scale = PyObject_GetAttr(layer, nm[CTX_SOFTMAX_SCALE]);
    if (raw_scale == NULL) {
        goto done;
    }
    scale = PyNumber_Float(raw_scale);
    Py_DECREF(raw_scale);
    if (scale == NULL ||
        cached_attr(&st->context_type, "diffkv.adapter", "DiffusionPagedAttentionContext") != 0) {
        goto done;
    }
    /* ctx.restore_output(out): for diffkv's own context without scattered rows, out itself
     * ([N, H, D] queries) or out.reshape(N, H * Dv) ([N, H * D] queries) -- then out is
     * allocated [N, H * Dv] and the kernels write its [N, H, Dv] view: a Python method call and
     * a view less (~2.5 us on the H200 hosts) */
    long long flat_shape[2] = {0, 0};
    const int kind = (PyObject *)Py_TYPE(ctx) == st->context_type
                         ? output_kind(module, ctx, layer, t[0], flat_shape)
                         : OUT_RESTORE;
    if (kind < 0) {
        goto done;
    }
    if (kind == OUT_FLAT) {
        PyObject *size = Py_BuildValue("(LL)", flat_shape[0], flat_shape[1]);
        if (size == NULL) {
            goto done;
        }
        out = PyObject_CallMethodObjArgs(t[0], nm[CTX_NEW_EMPTY], size, NULL);
        Py_DECREF(size);
    }
    else {
        out = PyObject_CallFunctionObjArgs(st->empty_like, t[0], NULL);
    }
    if (out == NULL) {
        goto done;
    }
    static const int host_field[3] = {CTX_BLOCK_TABLE_CPU, CTX_QUERY_START_LOC_CPU,
                                      CTX_SEQ_LENS_CPU};
    for (int i = 0; i < 3; i++) {
        if ((host[i] = PyObject_GetAttr(meta, nm[host_field[i]])) == NULL) {
            goto done;
        }
    }
    PyObject *fp_args[15] = {t[0],       t[1], t[2],  kv_cache, t[3],    t[4],    t[5],   t[6],
                             key_limits, mask, scale, out,      host[0], host[1], host[2]};
    PyObject *r = forward_paged_impl(module, fp_args, kind == OUT_FLAT);
    if (r == NULL) {
        goto done;
    }
    Py_DECREF(r);
    result = kind != OUT_RESTORE
                 ? Py_NewRef(out)
                 : PyObject_CallMethodObjArgs(ctx, nm[CTX_RESTORE_OUTPUT], out, NULL);
done:
    Py_XDECREF(layer);
    Py_XDECREF(kv_cache);
    Py_XDECREF(impl);
    Py_XDECREF(meta);
    Py_XDECREF(plan);
    Py_XDECREF(key_limits);
    Py_XDECREF(mask);
    Py_XDECREF(scale);
    Py_XDECREF(out);
    for (int i = 0; i < 7; i++) {
        Py_XDECREF(t[i]);
    }
    for (int i = 0; i < 3; i++) {
        Py_XDECREF(host[i]);
    }
    return result;
}

/*
 * new_with_slots(cls, descriptors, *values): object.__new__(cls) -- cls a Python class whose
 * instances object.__new__ creates (a heap type with object's tp_new, not abstract) -- with
 * descriptors[i] (a slot's member descriptor, or any data descriptor) set to values[i] through
 * its __set__, and no __init__.  The frozen dataclass __init__ of the per-call context does the
 * same through object.__setattr__, several times slower.  Returns a new reference, or NULL with
 * TypeError for wrong arguments, or whatever object.__new__ or a __set__ raised.
 */
static PyObject *
py_new_with_slots(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 2 || !PyTuple_Check(args[1]) || PyTuple_Size(args[1]) != nargs - 2) {
        PyErr_Format(PyExc_TypeError,
                     "new_with_slots(): arguments must be a class, a tuple of n descriptors and n "
                     "values, got %zd arguments",
                     nargs);
        return NULL;
    }
    newfunc object_new = (newfunc)PyType_GetSlot(&PyBaseObject_Type, Py_tp_new);
    if (!PyType_Check(args[0]) ||
        (PyType_GetFlags((PyTypeObject *)args[0]) &
         (Py_TPFLAGS_HEAPTYPE | Py_TPFLAGS_IS_ABSTRACT)) != Py_TPFLAGS_HEAPTYPE ||
        (newfunc)PyType_GetSlot((PyTypeObject *)args[0], Py_tp_new) != object_new) {
        PyErr_Format(PyExc_TypeError,
                     "new_with_slots(): cls must be a Python class that object.__new__ creates, "
                     "got %R",
                     args[0]);
        return NULL;
    }
    PyObject *no_args = PyTuple_New(0);
    if (no_args == NULL) {
        return NULL;
    }
    PyObject *obj = object_new((PyTypeObject *)args[0], no_args, NULL);
    Py_DECREF(no_args);
    if (obj == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs - 2; i++) {
        PyObject *descr = PyTuple_GetItem(args[1], i);
        descrsetfunc set = (descrsetfunc)PyType_GetSlot(Py_TYPE(descr), Py_tp_descr_set);
        if (set == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "new_with_slots(): descriptors[%zd] must be a data descriptor, got %R", i,
                         descr);
            Py_DECREF(obj);
            return NULL;
        }
        if (set(descr, obj, args[i + 2]) != 0) {
            Py_DECREF(obj);
            return NULL;
        }
    }
    return obj;
}

/* ------------------------------------------------------------------------------------------ */
/* Module definition                                                                           */
/* ------------------------------------------------------------------------------------------ */

PyMethodDef dkpy_layer_methods[] = {
    FAST(forward_paged, "KV write + paged attention in one call."),
    FAST(new_with_slots, "new_with_slots(cls, descriptors, *values): cls's instance, no __init__."),
    FAST(forward_context, "forward_context(ctx): a per-call context's forward_paged in one call "
                          "(None when ctx is not the plain kind)."),
    {NULL, NULL, 0, NULL},
};
