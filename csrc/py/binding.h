/*
 * binding.h -- the private header of diffkv._C's Python boundary (the files in csrc/py/).
 *
 * csrc/py/ is the only folder that includes Python.h.  Each file binds one concern and ends
 * with its table of _C functions (dkpy_<file>_methods), which module.c adds to the module:
 *
 *   module.c     module state, init (PEP 489 multi-phase), constants, CudaError
 *   tensor.c     torch tensor -> dk_tensor through DLPack (bridge.h), torch's current stream
 *   args.c       argument conversion and the checks every binding shares (dkpy_want_*)
 *   launch.c     running a dk_cuda_* launcher on torch's current stream
 *   info.c       the bridge's settings, build info, the attention kernel choice
 *   rules.c      vLLM-Omni's adapter's row, metadata and layer-head rules
 *   qkv.c        prepare_layer_context's query/key/value rules
 *   batch.c      prepare_batch's rules and the batch arrays it builds
 *   tables.c     block tables, slot mappings, the block pool
 *   plan.c       the piecewise plan
 *   copies.c     KV cache write and row gather/scatter
 *   attention.c  paged attention (with the log-sum-exp variant)
 *   dense.c      attention over key/value tensors (dense forward)
 *   layer.c      the layer call (forward_paged) and the per-call context's constructor
 *
 * Conventions: every function that can fail returns NULL or -1 with a Python exception set;
 * messages read "<op>(): <arg> must <expectation>, got <actual>" except where vLLM-Omni's adapter
 * fixes the text; nothing is written (cache, tables) before every check of a call has passed.
 */
#ifndef DIFFKV_PY_BINDING_H
#define DIFFKV_PY_BINDING_H

#include "bridge.h"

/* The CUDA targets this build compiled for ("80;90a"), "" for a CPU-only build (setup.py). */
#ifndef DIFFKV_CUDA_ARCHS
#define DIFFKV_CUDA_ARCHS ""
#endif

/* check_layer_qkv's layout facts, one bit each (exported as _C.LAYOUT_*): what the caller would
 * otherwise read back from torch to build the [N, heads, size] views. */
enum {
    LAYOUT_PACK_ROWS = 1,         /* right-padded [B, T] rows: gather the valid tokens */
    LAYOUT_QUERY_HEADS = 2,       /* the query is already [N, heads, size]: no reshape */
    LAYOUT_KEY_HEADS = 4,         /* the key likewise */
    LAYOUT_VALUE_HEADS = 8,       /* the value likewise */
    LAYOUT_KEY_CONTIGUOUS = 16,   /* the key needs .contiguous() (the writer reads heads and */
    LAYOUT_VALUE_CONTIGUOUS = 32, /* dims densely, tokens at any stride); the value likewise */
};

typedef struct {
    dk_bridge bridge;
    PyObject *cuda_error; /* diffkv.CudaError */
} module_state;

/* The module's state.  Cannot fail for diffkv._C's own module object. */
static inline module_state *
state_of(PyObject *module)
{
    return (module_state *)PyModule_GetState(module);
}

/* One METH_FASTCALL entry of a method table: FAST(name, doc) binds py_<name>, the static function
 * behind _C.<name>, whose contract (arguments, shapes, errors) is its docstring in
 * python/diffkv/_C.pyi.  Each returns a new reference, or NULL with an exception set. */
#define FAST(name, doc)                                                                            \
    {                                                                                              \
#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, doc                          \
    }

/* The method tables module.c adds, one per file, each ending with a NULL entry. */
extern PyMethodDef dkpy_info_methods[];
extern PyMethodDef dkpy_rules_methods[];
extern PyMethodDef dkpy_qkv_methods[];
extern PyMethodDef dkpy_batch_methods[];
extern PyMethodDef dkpy_tables_methods[];
extern PyMethodDef dkpy_plan_methods[];
extern PyMethodDef dkpy_copies_methods[];
extern PyMethodDef dkpy_attention_methods[];
extern PyMethodDef dkpy_dense_methods[];
extern PyMethodDef dkpy_layer_methods[];

/* ---- args.c: argument conversion ---------------------------------------------------------- */

/* Raises the exception a dk_status maps to (TypeError, ValueError, RuntimeError, MemoryError,
 * diffkv.CudaError) with err's message; returns NULL for `return dkpy_raise_status(...)`. */
PyObject *dkpy_raise_status(PyObject *module, dk_status status, const dk_error *err);
/* TypeError unless an internal call got exactly `expected` arguments: 0 or -1. */
int dkpy_check_nargs(const char *op, Py_ssize_t nargs, Py_ssize_t expected);
/* Likewise for a call taking either of two argument counts (an optional tail). */
int dkpy_check_nargs_either(const char *op, Py_ssize_t nargs, Py_ssize_t fewer, Py_ssize_t more);
/* *out = an int argument (bool refused: TypeError; beyond int64: ValueError): 0 or -1. */
int dkpy_get_i64(PyObject *obj, const char *op, const char *arg, int64_t *out);
/* Python's `type(obj) is int`.  Cannot fail. */
int dkpy_is_exact_int(PyObject *obj);
/* The sign (-1, 0, 1) of an exact int of any size.  Cannot fail. */
int dkpy_int_sign(PyObject *obj);
/* An exact int's value, saturated to int64.  Cannot fail. */
int64_t dkpy_int_saturated(PyObject *obj);
/* getattr(obj, name): a new reference, or NULL with the error. */
PyObject *dkpy_get_attr(PyObject *obj, const char *name);
/* *out = row.<name> as int64 (a row the row rules already accepted): 0 or -1. */
int dkpy_row_i64(PyObject *row, const char *name, int64_t *out);
/* tuple(seq) as a new reference; TypeError naming op/arg when seq is not a sequence, ValueError
 * when it is neither a list nor a tuple and longer than DKPY_MAX_LAZY_SEQUENCE. */
PyObject *dkpy_as_tuple(PyObject *seq, const char *op, const char *arg);
/* The most entries dkpy_as_tuple takes from a sequence that is not a list or tuple (ValueError
 * past it, before anything is materialized): 2^24, far past any row, block-id or length list. */
#define DKPY_MAX_LAZY_SEQUENCE ((Py_ssize_t)1 << 24)
/* A tuple of n Python ints: a new reference or NULL (MemoryError). */
PyObject *dkpy_int_tuple(const int64_t *v, int n);
/* A sequence of ints (or objects with __index__) into a calloc'ed array *out of *n entries,
 * which the caller frees: 0, or -1 with TypeError/ValueError/MemoryError naming op/arg. */
int dkpy_i64_list(PyObject *seq, const char *op, const char *arg, int64_t **out, Py_ssize_t *n);

/* ---- args.c: tensor checks (each 0, or -1 with the message "<op>(): <arg> must ...") ------ */

/* *t = the borrowed view of a torch tensor (tensor.c); TypeError for anything else. */
int dkpy_tensor_arg(PyObject *module, PyObject *obj, const char *op, const char *arg, dk_tensor *t);
int dkpy_want_dtype(const dk_tensor *t, dk_dtype dtype, const char *op, const char *arg);
/* float32, float16 or bfloat16 */
int dkpy_want_float(const dk_tensor *t, const char *op, const char *arg);
int dkpy_want_ndim(const dk_tensor *t, int ndim, const char *op, const char *arg);
int dkpy_want_cpu(const dk_tensor *t, const char *op, const char *arg);
/* t on ref's device (TypeError) */
int dkpy_same_device(const dk_tensor *ref, const dk_tensor *t, const char *op, const char *arg);
/* at least n entries along dimension 0 */
int dkpy_want_min_len(const dk_tensor *t, int64_t n, const char *op, const char *arg);
/* What a tensor argument must be, for dkpy_tensor: one description instead of a chain of
 * dkpy_want_* calls.  The checks run in this order (type-like before size-like), each raising
 * its dkpy_want_* message: on the CPU (device DKPY_HOST), the dtype, the rank, the device of
 * another tensor, the length. */
typedef struct dkpy_want {
    const char *arg;         /* the argument's name in messages */
    int dtype;               /* a dk_dtype, DKPY_FLOAT: float32, float16 or bfloat16, or
                                DKPY_ANY_DTYPE: checked by the caller */
    int ndim;                /* its rank, or DKPY_VECTOR: 1-D with unit stride */
    int64_t min_len;         /* at least this many entries along dimension 0; 0: any */
    const dk_tensor *device; /* on this tensor's device, DKPY_HOST: a CPU tensor, NULL: any */
} dkpy_want;

enum { DKPY_FLOAT = -1, DKPY_VECTOR = -1, DKPY_ANY_DTYPE = -2, DKPY_ANY_NDIM = -2 };
extern const dk_tensor dkpy_host;
#define DKPY_HOST (&dkpy_host)

/* *t = the view of obj, checked against *want: 0, or -1 with the first failure's message. */
int dkpy_tensor(PyObject *module, PyObject *obj, const char *op, const dkpy_want *want,
                dk_tensor *t);
/* The same checks of a view already read (an optional tensor, say). */
int dkpy_check(const dk_tensor *t, const char *op, const dkpy_want *want);

/* ValueError when out and in (same device) share a byte: an output must not alias an input. */
int dkpy_no_overlap(const dk_tensor *out, const char *out_name, const dk_tensor *in,
                    const char *in_name, const char *op);
/* buf = "[v0, v1, ...]" (n entries), truncated to size. */
void dkpy_format_dims(char *buf, size_t size, const int64_t *v, int n);
/* The same for two outputs that may be row ranges of one buffer: views of 4 dimensions [B, S,
 * ., .] with the same strides, whose rows are disjoint byte ranges and whose row ranges within
 * each batch entry (stride 0 a whole number of rows) do not meet, pass even where their byte
 * ranges interleave (quantize_kv's joint and main outputs in one buffer). */
int dkpy_no_overlap_rows(const dk_tensor *a, const char *a_name, const dk_tensor *b,
                         const char *b_name, const char *op);

/* ---- launch.c ------------------------------------------------------------------------------ */

/* A C launcher: dk_cuda_<op> behind a uniform signature (args is the op's dk_<op>_args). */
typedef dk_status (*cuda_launcher)(const void *args, void *stream, dk_error *err);

/* Runs launch(args) on torch's current stream of `device`, with that device current: 0, or -1
 * with the launcher's error raised (in a CPU-only build: how to rebuild with CUDA). */
int dkpy_run_cuda(PyObject *module, PyObject *tensor_obj, int32_t device, cuda_launcher launch,
                  const void *args);

/* ---- rules.c ------------------------------------------------------------------------------- */

/* Sets ValueError(msg) and returns NULL. */
PyObject *dkpy_value_error(const char *msg);
/* tuple(row.identity for row in rows): a new reference, or NULL with the error. */
PyObject *dkpy_identities_of(PyObject *rows);

/* ---- copies.c: the KV write, shared with the layer call ------------------------------------ */

/* Checks kv_write's 4 arguments (key, value, kv_cache, slot_mapping) and fills *a; views[4]
 * receives their tensor views: 0 or -1.  Writes nothing. */
int dkpy_parse_kv_write(PyObject *module, PyObject *const *args, const char *op,
                        dk_kv_write_args *a, dk_tensor *views);
/* Runs a checked KV write on k's device (CPU reference or CUDA): 0 or -1. */
int dkpy_run_kv_write(PyObject *module, PyObject *key_obj, const dk_tensor *k,
                      const dk_kv_write_args *a);
/* k_scale / v_scale of a call over cache (fp8: its dtype is float8_e4m3fn): None both when
 * !fp8, else float32 vectors of 1 or num_kv_heads entries on device's device that do not
 * overlap cache, into scales[0..1], *k_scale, *v_scale and *stride (0: one entry).  Their
 * values are dkpy_check_scale_values's.  0, or -1 with the exception set. */
int dkpy_parse_scales(PyObject *module, PyObject *k_obj, PyObject *v_obj, const char *op, int fp8,
                      int64_t num_kv_heads, const dk_tensor *device, const dk_tensor *cache,
                      dk_tensor *scales, const float **k_scale, const float **v_scale,
                      int64_t *stride);
/* Host copies of n scales each are finite and positive: 0, or -1 with ValueError. */
int dkpy_check_scale_values(const float *k_scale, const float *v_scale, int64_t n, const char *op);
/* The values of a call's parsed scales (scale_objs: the two tensors, n entries each) on the
 * query's device are dkpy_check_scale_values's: read directly on the CPU; on CUDA copied to the
 * host (one synchronisation of the query's stream) the first time a tensor is seen in its
 * current state -- the same tensor, data pointer and torch version counter (in-place writes
 * bump it) -- and not again until that changes.  Not read while the stream captures a CUDA
 * graph: the graph reads the scales at each replay, whatever they hold then.  0, or -1 with
 * the exception set. */
int dkpy_check_scales(PyObject *module, PyObject *const *scale_objs, PyObject *q_obj,
                      const dk_tensor *q, const float *k_scale, const float *v_scale, int64_t n,
                      const char *op);

/* ---- attention.c: the attention, shared with dense.c and the layer call --------------------- */

/* Checks paged_attention's 12 arguments (query .. host_seq_lens) and fills *a, *q_out, *o_out;
 * written, dense_kv, key_block and out_flat are described at the definition; scale_objs: NULL
 * (the cache holds the query's dtype), or k_scale and v_scale (both None: likewise; tensors: a
 * float8_e4m3fn cache).  0 or -1.  Writes nothing. */
int dkpy_parse_attention(PyObject *module, PyObject *const *args, const char *op,
                         dk_attention_args *a, const dk_tensor *written, dk_tensor *q_out,
                         dk_tensor *o_out, const dk_tensor *dense_kv, int64_t key_block,
                         int out_flat, PyObject *const *scale_objs);
/* Runs a checked attention on q's device: 0 or -1.  On the CPU, on a->cpu_threads threads, or
 * on dk_bridge_cpu_threads' count when that is 0. */
int dkpy_run_attention(PyObject *module, PyObject *query_obj, const dk_tensor *q,
                       const dk_attention_args *a);
/* Rows with fewer keys than queries (paged_attention_lse, dense_attention): the call is parsed
 * with MASK_NONE; dkpy_short_rows_mask reads the real mask argument (0, 1 or 2) first and
 * dkpy_short_rows_set_mask attaches it, with its key_limits checked, after.  0 or -1. */
int dkpy_short_rows_mask(PyObject *obj, const char *op, int64_t *mask);
int dkpy_short_rows_set_mask(PyObject *module, PyObject *key_limits, const char *op, int64_t mask,
                             const dk_tensor *q, const dk_tensor *o, dk_attention_args *a);

#endif /* DIFFKV_PY_BINDING_H */
