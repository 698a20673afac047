/*
 * layer.c -- the layer call: KV write + attention in one call.
 *
 * Entry points: forward_paged (on CUDA one submission for both kernels, cuda/launch.cu) and
 * new_with_slots (the per-call context's fast constructor).  The Python side describes a layer
 * call once (ops.paged_layer_inputs) and hands this file its arguments: nothing here reads the
 * per-call context or calls back into Python.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

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

/* forward_paged(query, key, value, kv_cache, slot_mapping, block_table, query_start_loc,
 * seq_lens, key_limits, mask, scale, out, host_block_table, host_query_start_loc,
 * host_seq_lens[, k_scale, v_scale]): every check of both steps, then the KV write and the
 * attention (on CUDA one submission).  out may be [N, H, Dv] or [N, H * Dv], written through
 * its [N, H, Dv] view.  With scales, a float8_e4m3fn kv_cache: the write quantizes and the
 * attention dequantizes with them (on CUDA: the Hopper e4m3 kernel, or a refusal before the
 * write). */
static PyObject *
py_forward_paged(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "forward_paged";
    if (dkpy_check_nargs_either(op, nargs, 15, 17) != 0) {
        return NULL;
    }
    /* args: query, key, value, kv_cache, slot_mapping, block_table, query_start_loc, seq_lens,
     *       key_limits, mask, scale, out, host_block_table, host_query_start_loc, host_seq_lens
     *       [, k_scale, v_scale: a float8_e4m3fn kv_cache's] */
    PyObject *const none[2] = {Py_None, Py_None};
    PyObject *kv_args[4] = {args[1], args[2], args[3], args[4]};
    PyObject *attn_args[12] = {args[0], args[3],  args[5],  args[6],  args[7],  args[8],
                               args[9], args[10], args[11], args[12], args[13], args[14]};
    dk_kv_write_args w;
    dk_attention_args a;
    dk_tensor kv[4], q, o;
    const dk_tensor *k = &kv[0];
    if (dkpy_parse_kv_write(module, kv_args, op, &w, kv) != 0) {
        return NULL;
    }
    if (dkpy_parse_attention(module, attn_args, op, &a, &kv[2], &q, &o, NULL, 1, 1,
                             nargs == 17 ? args + 15 : none) != 0) {
        return NULL;
    }
    if (a.kv_fp8) {
        /* the write quantizes with the scales the attention dequantizes with */
        w.k_scale = a.k_scale;
        w.v_scale = a.v_scale;
        w.scale_stride_head = a.scale_stride_head;
        if (dkpy_check_scales(module, args + 15, args[0], &q, a.k_scale, a.v_scale,
                              a.scale_stride_head ? a.num_kv_heads : 1, op) != 0) {
            return NULL;
        }
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
    /* the CPU reference's thread count asked before the write, so that a failure to get it
     * writes nothing */
    a.cpu_threads = dk_bridge_cpu_threads(&state_of(module)->bridge);
    if (a.cpu_threads < 0) {
        return NULL;
    }
    if (dkpy_run_kv_write(module, args[1], k, &w) != 0 ||
        dkpy_run_attention(module, args[0], &q, &a) != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
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

PyMethodDef dkpy_layer_methods[] = {
    FAST(forward_paged, "KV write + paged attention in one call."),
    FAST(new_with_slots, "new_with_slots(cls, descriptors, *values): cls's instance, no __init__."),
    {NULL, NULL, 0, NULL},
};
