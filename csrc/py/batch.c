/*
 * batch.c -- prepare_batch: its rules and the batch arrays it builds.
 *
 * check_batch_rows (row count, mode, identities), check_batch_bindings (rows against the block
 * tables and the token budget: the numbers go to dk_batch_check in csrc/batch.c, the Python types
 * are judged here), build_batch (row indices, query_start_loc, seq_lens, positions) and
 * dcp_local_seq_lens (context-parallel local lengths).
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

static PyObject *
py_check_batch_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (dkpy_check_nargs("check_batch_rows", nargs, 3) != 0) {
        return NULL;
    }
    PyObject *rows = args[0];
    Py_ssize_t n = PyObject_Length(rows);
    if (n < 0) {
        return NULL;
    }
    if (n == 0) {
        return dkpy_value_error("Paged attention batch must contain at least one row");
    }
    int active = PyObject_IsTrue(args[1]);
    if (active < 0) {
        return NULL;
    }
    if (active) {
        PyErr_SetString(PyExc_RuntimeError,
                        "Cannot prepare paged attention metadata during an active forward");
        return NULL;
    }
    PyObject *nlen = PyLong_FromSsize_t(n);
    if (nlen == NULL) {
        return NULL;
    }
    int over = PyObject_RichCompareBool(nlen, args[2], Py_GT);
    Py_DECREF(nlen);
    if (over < 0) {
        return NULL;
    }
    if (over) {
        PyErr_Format(PyExc_ValueError, "Paged attention batch has %zd rows; Worker capacity is %S",
                     n, args[2]);
        return NULL;
    }
    PyObject *ids = dkpy_identities_of(rows);
    if (ids == NULL) {
        return NULL;
    }
    PyObject *set = PySet_New(ids);
    Py_ssize_t unique = set == NULL ? -1 : PySet_Size(set);
    Py_XDECREF(set);
    Py_DECREF(ids);
    if (unique < 0) {
        return NULL;
    }
    if (unique != n) {
        return dkpy_value_error("Paged attention batch contains duplicate row identities");
    }
    Py_RETURN_NONE;
}

static PyObject *
py_check_batch_bindings(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "check_batch_bindings";
    if (dkpy_check_nargs(op, nargs, 10) != 0) {
        return NULL;
    }
    PyObject *rows = NULL, *bindings = NULL, *row_index_objs = NULL, *capacity_objs = NULL;
    PyObject *result = NULL;
    int64_t *query_lens = NULL, *seq_lens = NULL, *row_indices = NULL, *capacities = NULL;
    uint8_t *row_is_int = NULL, *cap_is_int = NULL;
    int64_t *block_sizes = NULL, *multipliers = NULL;
    Py_ssize_t num_groups = 0, num_mult = 0;

    rows = dkpy_as_tuple(args[0], op, "rows");
    bindings = rows == NULL ? NULL : dkpy_as_tuple(args[1], op, "bindings");
    if (bindings == NULL) {
        goto done;
    }
    Py_ssize_t n = PyTuple_Size(rows);
    if (PyTuple_Size(bindings) != n) {
        PyErr_Format(PyExc_ValueError, "%s(): bindings must have one entry per row (%zd), got %zd",
                     op, n, PyTuple_Size(bindings));
        goto done;
    }
    row_index_objs = PyTuple_New(n);
    capacity_objs = row_index_objs == NULL ? NULL : PyTuple_New(n);
    size_t cnt = (size_t)(n > 0 ? n : 1);
    query_lens = (int64_t *)calloc(cnt, sizeof(int64_t));
    seq_lens = (int64_t *)calloc(cnt, sizeof(int64_t));
    row_indices = (int64_t *)calloc(cnt, sizeof(int64_t));
    capacities = (int64_t *)calloc(cnt, sizeof(int64_t));
    row_is_int = (uint8_t *)calloc(cnt, 1);
    cap_is_int = (uint8_t *)calloc(cnt, 1);
    if (capacity_objs == NULL || !query_lens || !seq_lens || !row_indices || !capacities ||
        !row_is_int || !cap_is_int) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_GetItem(rows, i);
        PyObject *binding = PyTuple_GetItem(bindings, i);
        if (dkpy_row_i64(row, "query_len", &query_lens[i]) != 0 ||
            dkpy_row_i64(row, "seq_len", &seq_lens[i]) != 0) {
            goto done;
        }
        PyObject *ri = dkpy_get_attr(binding, "row_index");
        if (ri == NULL) {
            goto done;
        }
        PyTuple_SetItem(row_index_objs, i, ri);
        row_is_int[i] = (uint8_t)dkpy_is_exact_int(ri);
        row_indices[i] = row_is_int[i] ? dkpy_int_saturated(ri) : -1;
        PyObject *cap = dkpy_get_attr(binding, "max_seq_len");
        if (cap == NULL) {
            goto done;
        }
        PyTuple_SetItem(capacity_objs, i, cap);
        cap_is_int[i] = (uint8_t)dkpy_is_exact_int(cap);
        capacities[i] = cap_is_int[i] ? dkpy_int_saturated(cap) : -1;
    }
    /* Two rows on one Worker row: Python set semantics over whatever the resolver returned. */
    {
        PyObject *set = PySet_New(row_index_objs);
        if (set == NULL) {
            goto done;
        }
        Py_ssize_t unique = PySet_Size(set);
        Py_DECREF(set);
        if (unique != n) {
            dkpy_value_error(
                "Paged attention batch resolves multiple inputs to the same Worker row");
            goto done;
        }
    }
    int64_t threshold = -1, max_reqs = 0, max_tokens = 0, cp_size = 0;
    int has_threshold = args[2] != Py_None;
    if (has_threshold && dkpy_get_i64(args[2], op, "reorder_threshold", &threshold) != 0) {
        goto done;
    }
    int any_causal = PyObject_IsTrue(args[3]);
    if (any_causal < 0 || dkpy_get_i64(args[4], op, "max_num_reqs", &max_reqs) != 0 ||
        dkpy_get_i64(args[5], op, "max_num_batched_tokens", &max_tokens) != 0 ||
        dkpy_i64_list(args[6], op, "block_sizes", &block_sizes, &num_groups) != 0 ||
        dkpy_i64_list(args[7], op, "blocks_per_kv_block", &multipliers, &num_mult) != 0 ||
        dkpy_get_i64(args[8], op, "cp_size", &cp_size) != 0) {
        goto done;
    }
    if (num_mult != num_groups) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): blocks_per_kv_block must have one entry per cache group (%zd), got %zd",
                     op, num_groups, num_mult);
        goto done;
    }
    for (Py_ssize_t g = 0; g < num_groups; g++) {
        if (block_sizes[g] <= 0 || multipliers[g] <= 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): block sizes and blocks_per_kv_block must be positive, got %lld and "
                         "%lld for group %zd",
                         op, (long long)block_sizes[g], (long long)multipliers[g], g);
            goto done;
        }
    }
    if (cp_size <= 0) {
        PyErr_Format(PyExc_ValueError, "%s(): cp_size must be positive, got %lld", op,
                     (long long)cp_size);
        goto done;
    }
    if (has_threshold && threshold < 0) {
        /* A negative threshold makes every row "long": no ordering can be violated. */
        has_threshold = 0;
    }
    dk_tensor nb;
    if (dkpy_tensor_arg(module, args[9], op, "num_blocks", &nb) != 0 ||
        dkpy_want_cpu(&nb, op, "num_blocks") != 0 ||
        dkpy_want_ndim(&nb, 2, op, "num_blocks") != 0) {
        goto done;
    }
    if (nb.dtype != DK_I32 && nb.dtype != DK_I64) {
        PyErr_Format(PyExc_TypeError, "%s(): num_blocks must be int32 or int64, got %s", op,
                     dk_dtype_name(nb.dtype));
        goto done;
    }
    if (nb.shape[0] < num_groups || nb.shape[1] < max_reqs) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): num_blocks must have shape [>= %zd groups, >= %lld rows], got [%lld, "
                     "%lld]",
                     op, num_groups, (long long)max_reqs, (long long)nb.shape[0],
                     (long long)nb.shape[1]);
        goto done;
    }
    dk_batch_check_args ca = {
        .num_rows = n,
        .query_lens = query_lens,
        .seq_lens = seq_lens,
        .row_indices = row_indices,
        .row_index_is_int = row_is_int,
        .capacities = capacities,
        .capacity_is_int = cap_is_int,
        .reorder_threshold = has_threshold ? threshold : -1,
        .any_causal = any_causal,
        .max_num_reqs = max_reqs,
        .max_num_batched_tokens = max_tokens,
        .num_groups = num_groups,
        .block_sizes = block_sizes,
        .blocks_per_kv_block = multipliers,
        .cp_size = cp_size,
        .num_blocks = nb.data,
        .num_blocks_dtype = nb.dtype,
        .num_blocks_stride_group = nb.strides[0],
        .num_blocks_stride_row = nb.strides[1],
    };
    dk_batch_fault fault;
    memset(&fault, 0, sizeof(fault));
    dk_error err = {{0}};
    dk_status s = dk_batch_check(&ca, &fault, &err);
    if (s == DK_OK && fault.rule == DK_BATCH_OK) {
        result = PyLong_FromLongLong((long long)fault.num_tokens);
        goto done;
    }
    PyObject *row = fault.row >= 0 && fault.row < n ? PyTuple_GetItem(rows, fault.row) : NULL;
    PyObject *identity = row == NULL ? NULL : dkpy_get_attr(row, "identity");
    if (row != NULL && identity == NULL) {
        goto done;
    }
    switch (fault.rule) {
    case DK_BATCH_DUP_WORKER_ROW:
        dkpy_value_error("Paged attention batch resolves multiple inputs to the same Worker row");
        break;
    case DK_BATCH_BAD_CAPACITY:
        PyErr_Format(PyExc_ValueError,
                     "Paged attention row %R resolved to invalid logical capacity %R", identity,
                     PyTuple_GetItem(capacity_objs, fault.row));
        break;
    case DK_BATCH_SEQ_LEN_OVER_CAPACITY:
        PyErr_Format(PyExc_ValueError,
                     "Paged attention row %R uses seq_len=%lld, but its installed allocation has "
                     "logical length %S",
                     identity, (long long)seq_lens[fault.row],
                     PyTuple_GetItem(capacity_objs, fault.row));
        break;
    case DK_BATCH_ORDER:
        PyErr_Format(PyExc_ValueError,
                     "Causal paged attention rows must place native decode/short-query rows "
                     "before prefill/long-query rows (decode threshold=%S)",
                     args[2]);
        break;
    case DK_BATCH_BAD_WORKER_ROW:
        PyErr_Format(PyExc_ValueError, "Paged attention row %R resolved to invalid Worker row %R",
                     identity, PyTuple_GetItem(row_index_objs, fault.row));
        break;
    case DK_BATCH_TOO_FEW_BLOCKS:
        PyErr_Format(PyExc_ValueError,
                     "Paged attention row %R requires %lld blocks in cache group %lld for "
                     "seq_len=%lld, but its installed Worker row contains only %lld blocks",
                     identity, (long long)fault.required_blocks, (long long)fault.group,
                     (long long)seq_lens[fault.row], (long long)fault.installed_blocks);
        break;
    case DK_BATCH_TOO_MANY_TOKENS:
        PyErr_Format(PyExc_ValueError,
                     "Paged attention batch has %lld tokens; Worker capacity is %S",
                     (long long)fault.num_tokens, args[5]);
        break;
    default:
        dkpy_raise_status(module, s == DK_OK ? DK_ERR_VALUE : s, &err);
        break;
    }
    Py_XDECREF(identity);

done:
    Py_XDECREF(rows);
    Py_XDECREF(bindings);
    Py_XDECREF(row_index_objs);
    Py_XDECREF(capacity_objs);
    free(query_lens);
    free(seq_lens);
    free(row_indices);
    free(capacities);
    free(row_is_int);
    free(cap_is_int);
    free(block_sizes);
    free(multipliers);
    return result;
}

/* *t = a CPU int32 1-D contiguous tensor of at least n entries: 0, or -1 with the message. */
static int
cpu_i32_1d(PyObject *module, PyObject *obj, const char *op, const char *arg, int64_t n,
           dk_tensor *t)
{
    return dkpy_tensor(
        module, obj, op,
        &(dkpy_want){
            .arg = arg, .dtype = DK_I32, .ndim = DKPY_VECTOR, .min_len = n, .device = DKPY_HOST},
        t);
}

static PyObject *
py_build_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "build_batch";
    if (dkpy_check_nargs(op, nargs, 6) != 0) {
        return NULL;
    }
    PyObject *rows = dkpy_as_tuple(args[0], op, "rows");
    if (rows == NULL) {
        return NULL;
    }
    PyObject *result = NULL;
    int64_t *kv_start = NULL, *ri = NULL;
    Py_ssize_t n = PyTuple_Size(rows), nri = 0;
    if (dkpy_i64_list(args[1], op, "row_indices", &ri, &nri) != 0) {
        goto done;
    }
    if (nri != n) {
        PyErr_Format(PyExc_ValueError, "%s(): row_indices must have %zd entries, got %zd", op, n,
                     nri);
        goto done;
    }
    dk_tensor t_ri, t_qsl, t_sl, t_pos;
    if (cpu_i32_1d(module, args[2], op, "row_indices_out", n, &t_ri) != 0 ||
        cpu_i32_1d(module, args[3], op, "query_start_loc_out", n + 1, &t_qsl) != 0 ||
        cpu_i32_1d(module, args[4], op, "seq_lens_out", n, &t_sl) != 0 ||
        dkpy_no_overlap(&t_qsl, "query_start_loc_out", &t_ri, "row_indices_out", op) ||
        dkpy_no_overlap(&t_qsl, "query_start_loc_out", &t_sl, "seq_lens_out", op) ||
        dkpy_no_overlap(&t_sl, "seq_lens_out", &t_ri, "row_indices_out", op)) {
        goto done;
    }
    kv_start = (int64_t *)calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
    if (kv_start == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int32_t *qsl = (int32_t *)t_qsl.data;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_GetItem(rows, i);
        int64_t q = 0, s = 0;
        if (dkpy_row_i64(row, "query_len", &q) != 0 || dkpy_row_i64(row, "seq_len", &s) != 0 ||
            dkpy_row_i64(row, "kv_start_pos", &kv_start[i]) != 0) {
            goto done;
        }
        /* Negative lengths would send the positions loop below index 0. */
        if (q < 0 || s < 0 || kv_start[i] < 0 || kv_start[i] > INT64_MAX - q) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): rows[%zd] must have query_len, seq_len, kv_start_pos >= 0 and "
                         "kv_start_pos + query_len within int64, got %lld, %lld, %lld",
                         op, i, (long long)q, (long long)s, (long long)kv_start[i]);
            goto done;
        }
        /* total <= INT32_MAX here, so INT32_MAX - total cannot wrap (total + q could) */
        if (s > INT32_MAX || q > INT32_MAX - total || ri[i] < INT32_MIN || ri[i] > INT32_MAX) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): row %zd must fit int32 metadata (query_len %lld, seq_len %lld, "
                         "tokens so far %lld, row index %lld)",
                         op, i, (long long)q, (long long)s, (long long)total, (long long)ri[i]);
            goto done;
        }
        qsl[i] = (int32_t)total;
        total += q;
        ((int32_t *)t_sl.data)[i] = (int32_t)s;
        ((int32_t *)t_ri.data)[i] = (int32_t)ri[i];
    }
    qsl[n] = (int32_t)total;
    if (dkpy_tensor(module, args[5], op,
                    &(dkpy_want){.arg = "positions_out",
                                 .dtype = DK_I64,
                                 .ndim = DKPY_VECTOR,
                                 .min_len = total,
                                 .device = DKPY_HOST},
                    &t_pos) ||
        dkpy_no_overlap(&t_pos, "positions_out", &t_qsl, "query_start_loc_out", op) ||
        dkpy_no_overlap(&t_pos, "positions_out", &t_ri, "row_indices_out", op) ||
        dkpy_no_overlap(&t_pos, "positions_out", &t_sl, "seq_lens_out", op)) {
        goto done;
    }
    dk_positions_build(kv_start, qsl, n, (int64_t *)t_pos.data);
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(rows);
    free(kv_start);
    free(ri);
    return result;
}

static PyObject *
py_dcp_local_seq_lens(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "dcp_local_seq_lens";
    if (dkpy_check_nargs(op, nargs, 5) != 0) {
        return NULL;
    }
    dk_tensor sl, out;
    int64_t c = 0, r = 0, il = 0;
    if (dkpy_tensor(
            module, args[0], op,
            &(dkpy_want){
                .arg = "seq_lens", .dtype = DK_I32, .ndim = DKPY_VECTOR, .device = DKPY_HOST},
            &sl) ||
        cpu_i32_1d(module, args[1], op, "out", sl.shape[0], &out) != 0 ||
        dkpy_get_i64(args[2], op, "cp_size", &c) || dkpy_get_i64(args[3], op, "cp_rank", &r) ||
        dkpy_get_i64(args[4], op, "cp_interleave", &il)) {
        return NULL;
    }
    if (c < 1 || r < 0 || r >= c || il < 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): cp_size must be >= 1, cp_rank in [0, cp_size) and cp_interleave >= 1, "
                     "got %lld, %lld, %lld",
                     op, (long long)c, (long long)r, (long long)il);
        return NULL;
    }
    if (c > INT64_MAX / il) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): cp_size * cp_interleave must fit in int64, got %lld * %lld", op,
                     (long long)c, (long long)il);
        return NULL;
    }
    if (dkpy_no_overlap(&out, "out", &sl, "seq_lens", op) != 0) {
        return NULL;
    }
    dk_dcp_local_seq_lens((const int32_t *)sl.data, sl.shape[0], c, r, il, (int32_t *)out.data);
    Py_RETURN_NONE;
}

PyMethodDef dkpy_batch_methods[] = {
    FAST(check_batch_rows,
         "prepare_batch's row checks: at least one row, no active forward, at most "
         "max_num_reqs rows, unique identities."),
    FAST(check_batch_bindings,
         "prepare_batch's checks of the rows against the Worker's block tables and "
         "token budget; returns num_tokens."),
    FAST(build_batch, "Fills row_indices, query_start_loc, seq_lens, positions (CPU)."),
    FAST(dcp_local_seq_lens, "Context-parallel local sequence lengths (CPU)."),
    {NULL, NULL, 0, NULL},
};
