/*
 * plan.c -- the piecewise plan (vLLM-Omni's build_paged_piecewise_plan).
 *
 * Entry point: build_plan.  Rows' spans are read here as Python ints; csrc/plan.c validates and
 * segments them and computes each token's key limit.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

/* Sets ValueError(msg) (the planner's messages) and returns NULL. */
static PyObject *
plan_error(const char *msg)
{
    PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
}

static PyObject *
py_build_plan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "build_paged_piecewise_plan";
    if (dkpy_check_nargs(op, nargs, 6) != 0) {
        return NULL;
    }
    PyObject *spans_rows = NULL, *norm = NULL, *result = NULL, *segs_py = NULL;
    int64_t *offsets = NULL, *qlens = NULL, *slens = NULL, *span_off = NULL, *spans = NULL;
    int32_t *limits = NULL;
    dk_segment *segs = NULL;
    Py_ssize_t n = 0, n_off = 0, n_ql = 0, n_sl = 0;

    spans_rows = dkpy_as_tuple(args[0], op, "full_attn_spans");
    if (spans_rows == NULL || dkpy_i64_list(args[1], op, "query_offsets", &offsets, &n_off) != 0 ||
        dkpy_i64_list(args[2], op, "query_lens", &qlens, &n_ql) != 0 ||
        dkpy_i64_list(args[3], op, "seq_lens", &slens, &n_sl) != 0) {
        goto done;
    }
    n = PyTuple_Size(spans_rows);
    if (n == 0 || n_off != n || n_ql != n || n_sl != n) {
        plan_error("Paged piecewise inputs must have one entry per row");
        goto done;
    }
    /* Normalise: tuple(tuple((int(start), int(end)) ...) ...). */
    norm = PyTuple_New(n);
    span_off = (int64_t *)calloc((size_t)n + 1, sizeof(int64_t));
    if (norm == NULL || span_off == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    Py_ssize_t total_spans = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *row = dkpy_as_tuple(PyTuple_GetItem(spans_rows, r), op, "full_attn_spans row");
        if (row == NULL) {
            goto done;
        }
        Py_ssize_t m = PyTuple_Size(row);
        PyObject *nrow = PyTuple_New(m);
        if (nrow == NULL) {
            Py_DECREF(row);
            goto done;
        }
        PyTuple_SetItem(norm, r, nrow);
        for (Py_ssize_t i = 0; i < m; i++) {
            PyObject *pair = dkpy_as_tuple(PyTuple_GetItem(row, i), op, "span");
            if (pair == NULL) {
                Py_DECREF(row);
                goto done;
            }
            if (PyTuple_Size(pair) != 2) {
                PyErr_Format(PyExc_ValueError,
                             "%s(): each span must be a (start, end) pair, got %R", op, pair);
                Py_DECREF(pair);
                Py_DECREF(row);
                goto done;
            }
            PyObject *a = PyNumber_Long(PyTuple_GetItem(pair, 0));
            PyObject *b = a == NULL ? NULL : PyNumber_Long(PyTuple_GetItem(pair, 1));
            Py_DECREF(pair);
            if (b == NULL) {
                Py_XDECREF(a);
                Py_DECREF(row);
                goto done;
            }
            PyObject *np = PyTuple_Pack(2, a, b);
            Py_DECREF(a);
            Py_DECREF(b);
            if (np == NULL) {
                Py_DECREF(row);
                goto done;
            }
            PyTuple_SetItem(nrow, i, np);
        }
        Py_DECREF(row);
        total_spans += m;
        span_off[r + 1] = total_spans;
    }
    spans = (int64_t *)calloc((size_t)(total_spans > 0 ? 2 * total_spans : 1), sizeof(int64_t));
    if (spans == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0, k = 0; r < n; r++) {
        PyObject *nrow = PyTuple_GetItem(norm, r);
        for (Py_ssize_t i = 0; i < PyTuple_Size(nrow); i++, k++) {
            PyObject *pair = PyTuple_GetItem(nrow, i);
            /* Huge values saturate: they fail the "within the sequence" rule as in vLLM-Omni's
             * adapter. */
            spans[2 * k] = dkpy_int_saturated(PyTuple_GetItem(pair, 0));
            spans[2 * k + 1] = dkpy_int_saturated(PyTuple_GetItem(pair, 1));
        }
    }
    dk_plan_args pa = {
        .num_rows = n,
        .span_offsets = span_off,
        .spans = spans,
        .query_offsets = offsets,
        .query_lens = qlens,
        .seq_lens = slens,
    };
    int64_t total_q = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (qlens[r] > 0) {
            /* Saturate: a wrapped total would let the outputs below look big enough. */
            total_q = qlens[r] > INT64_MAX - total_q ? INT64_MAX : total_q + qlens[r];
        }
    }
    dk_tensor kl, qi;
    if (dk_bridge_optional_tensor(&state_of(module)->bridge, args[4], op, "key_limits_out", &kl) ||
        dk_bridge_optional_tensor(&state_of(module)->bridge, args[5], op, "query_indices_out",
                                  &qi)) {
        goto done;
    }
    if (kl.ndim >= 0 && dkpy_check(&kl, op,
                                   &(dkpy_want){.arg = "key_limits_out",
                                                .dtype = DK_I32,
                                                .ndim = DKPY_VECTOR,
                                                .min_len = total_q,
                                                .device = DKPY_HOST})) {
        goto done;
    }
    if (qi.ndim >= 0 && dkpy_check(&qi, op,
                                   &(dkpy_want){.arg = "query_indices_out",
                                                .dtype = DK_I64,
                                                .ndim = DKPY_VECTOR,
                                                .min_len = total_q,
                                                .device = DKPY_HOST})) {
        goto done;
    }
    if (kl.ndim >= 0 && qi.ndim >= 0 &&
        dkpy_no_overlap(&qi, "query_indices_out", &kl, "key_limits_out", op) != 0) {
        goto done;
    }
    int64_t cap = dk_plan_segment_capacity(&pa);
    segs = (dk_segment *)calloc((size_t)(cap > 0 ? cap : 1), sizeof(dk_segment));
    if (kl.ndim >= 0) {
        limits = (int32_t *)calloc((size_t)(total_q > 0 ? total_q : 1), sizeof(int32_t));
    }
    if (segs == NULL || (kl.ndim >= 0 && limits == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t num_segments = 0;
    dk_plan_rule rule = DK_PLAN_OK;
    dk_error err = {{0}};
    dk_status s = dk_plan_build(&pa, segs, cap, &num_segments, limits, &rule, &err);
    if (s != DK_OK) {
        dkpy_raise_status(module, s, &err);
        goto done;
    }
    if (kl.ndim >= 0 && total_q > 0) {
        memcpy(kl.data, limits, (size_t)total_q * sizeof(int32_t));
    }
    if (qi.ndim >= 0) {
        int64_t *dst = (int64_t *)qi.data, w = 0;
        for (int64_t k = 0; k < num_segments; k++) {
            int64_t packed = 0;
            for (Py_ssize_t r = 0; r < n; r++) {
                const dk_segment *sg = &segs[k * n + r];
                for (int64_t p = sg->q_start; p < sg->q_end; p++) {
                    dst[w++] = packed + (p - offsets[r]);
                }
                packed += qlens[r];
            }
        }
    }
    segs_py = PyTuple_New((Py_ssize_t)num_segments);
    if (segs_py == NULL) {
        goto done;
    }
    for (int64_t k = 0; k < num_segments; k++) {
        PyObject *rowsegs = PyTuple_New(n);
        if (rowsegs == NULL) {
            goto done;
        }
        PyTuple_SetItem(segs_py, (Py_ssize_t)k, rowsegs);
        for (Py_ssize_t r = 0; r < n; r++) {
            const dk_segment *sg = &segs[k * n + r];
            PyObject *t =
                Py_BuildValue("(LLLs)", (long long)sg->q_start, (long long)sg->q_end,
                              (long long)sg->kv_end, sg->mode == DK_MODE_FULL ? "full" : "causal");
            if (t == NULL) {
                goto done;
            }
            PyTuple_SetItem(rowsegs, r, t);
        }
    }
    result = PyTuple_Pack(2, norm, segs_py);
done:
    Py_XDECREF(spans_rows);
    Py_XDECREF(norm);
    Py_XDECREF(segs_py);
    free(offsets);
    free(qlens);
    free(slens);
    free(span_off);
    free(spans);
    free(limits);
    free(segs);
    return result;
}

PyMethodDef dkpy_plan_methods[] = {
    FAST(build_plan, "Piecewise plan (vLLM-Omni's adapter's build_paged_piecewise_plan)."),
    {NULL, NULL, 0, NULL},
};
