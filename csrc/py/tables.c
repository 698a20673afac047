/*
 * tables.c -- block tables, slot mappings and the block pool.
 *
 * Entry points: table_append, gather_block_tables, compute_slot_mappings (CPU or CUDA),
 * pool_init, pool_allocate, pool_free.  The pool's state lives in a caller-owned int64 tensor.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

static dk_status
launch_slots(const void *a, void *stream, dk_error *err)
{
    return dk_cuda_slots((const dk_slots_args *)a, stream, err);
}

/* *t = a CPU int32 2-D tensor with unit column stride (a host block table): 0 or -1. */
static int
cpu_i32_2d(PyObject *module, PyObject *obj, const char *op, const char *arg, dk_tensor *t)
{
    if (dkpy_tensor(module, obj, op,
                    &(dkpy_want){.arg = arg, .dtype = DK_I32, .ndim = 2, .device = DKPY_HOST}, t)) {
        return -1;
    }
    if (t->shape[1] > 1 && t->strides[1] != 1) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must have unit column stride, got %lld", op, arg,
                     (long long)t->strides[1]);
        return -1;
    }
    return 0;
}

static PyObject *
py_table_append(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "BlockTables.append_block_ids";
    if (dkpy_check_nargs(op, nargs, 7) != 0) {
        return NULL;
    }
    dk_tensor table, counts;
    int64_t row = 0, k = 0, nk = 0;
    if (cpu_i32_2d(module, args[0], op, "table", &table) != 0 ||
        dkpy_tensor(module, args[1], op,
                    &(dkpy_want){.arg = "counts",
                                 .dtype = DK_I32,
                                 .ndim = 1,
                                 .min_len = table.shape[0],
                                 .device = DKPY_HOST},
                    &counts) ||
        dkpy_get_i64(args[2], op, "row", &row) ||
        dkpy_get_i64(args[4], op, "blocks_per_kv_block", &k) ||
        dkpy_get_i64(args[5], op, "num_kernel_blocks", &nk)) {
        return NULL;
    }
    if (dkpy_no_overlap(&counts, "counts", &table, "table", op) != 0) {
        return NULL;
    }
    int overwrite = PyObject_IsTrue(args[6]);
    if (overwrite < 0) {
        return NULL;
    }
    int64_t *ids = NULL;
    Py_ssize_t n = 0;
    if (dkpy_i64_list(args[3], op, "block_ids", &ids, &n) != 0) {
        return NULL;
    }
    dk_table_append_args a = {
        .table = (int32_t *)table.data,
        .table_stride_row = table.strides[0],
        .table_rows = table.shape[0],
        .table_cols = table.shape[1],
        .counts = (int32_t *)counts.data,
        .counts_stride = counts.strides[0],
        .row = row,
        .block_ids = ids,
        .n = n,
        .blocks_per_kv_block = k,
        .num_kernel_blocks = nk,
        .overwrite = overwrite,
    };
    dk_error err = {{0}};
    dk_status s = dk_table_append(&a, &err);
    free(ids);
    if (s != DK_OK) {
        return dkpy_raise_status(module, s, &err);
    }
    Py_RETURN_NONE;
}

static PyObject *
py_gather_block_tables(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "BlockTables.gather_block_tables";
    if (dkpy_check_nargs(op, nargs, 5) != 0) {
        return NULL;
    }
    dk_tensor table, counts, ri, out;
    int64_t padded = 0;
    if (cpu_i32_2d(module, args[0], op, "table", &table) != 0 ||
        dkpy_tensor(module, args[1], op,
                    &(dkpy_want){.arg = "counts",
                                 .dtype = DK_I32,
                                 .ndim = 1,
                                 .min_len = table.shape[0],
                                 .device = DKPY_HOST},
                    &counts) ||
        dkpy_tensor(
            module, args[2], op,
            &(dkpy_want){
                .arg = "row_indices", .dtype = DK_I32, .ndim = DKPY_VECTOR, .device = DKPY_HOST},
            &ri) ||
        cpu_i32_2d(module, args[3], op, "out", &out) != 0 ||
        dkpy_get_i64(args[4], op, "num_reqs_padded", &padded)) {
        return NULL;
    }
    if (out.shape[1] != table.shape[1]) {
        PyErr_Format(PyExc_ValueError, "%s(): out must have %lld columns, got %lld", op,
                     (long long)table.shape[1], (long long)out.shape[1]);
        return NULL;
    }
    if (dkpy_no_overlap(&out, "out", &table, "table", op) ||
        dkpy_no_overlap(&out, "out", &counts, "counts", op) ||
        dkpy_no_overlap(&out, "out", &ri, "row_indices", op)) {
        return NULL;
    }
    dk_gather_args a = {
        .table = (const int32_t *)table.data,
        .table_stride_row = table.strides[0],
        .table_rows = table.shape[0],
        .table_cols = table.shape[1],
        .counts = (const int32_t *)counts.data,
        .counts_stride = counts.strides[0],
        .row_indices = (const int32_t *)ri.data,
        .num_rows = ri.shape[0],
        .out = (int32_t *)out.data,
        .out_stride_row = out.strides[0],
        .out_rows = out.shape[0],
        .num_reqs_padded = padded,
    };
    dk_error err = {{0}};
    dk_status s = dk_ref_gather_block_tables(&a, &err);
    if (s != DK_OK) {
        return dkpy_raise_status(module, s, &err);
    }
    Py_RETURN_NONE;
}

static PyObject *
py_compute_slot_mappings(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "BlockTables.compute_slot_mappings";
    if (dkpy_check_nargs(op, nargs, 11) != 0) {
        return NULL;
    }
    dk_tensor table, ri, qsl, pos, out;
    int64_t num_tokens = 0, padded = 0, bs = 0, c = 0, r = 0, il = 0;
    if (dkpy_tensor(module, args[0], op, &(dkpy_want){.arg = "table", .dtype = DK_I32, .ndim = 2},
                    &table) ||
        dkpy_tensor(
            module, args[1], op,
            &(dkpy_want){
                .arg = "row_indices", .dtype = DK_I32, .ndim = DKPY_VECTOR, .device = &table},
            &ri) ||
        dkpy_tensor(module, args[2], op,
                    &(dkpy_want){.arg = "query_start_loc",
                                 .dtype = DK_I32,
                                 .ndim = DKPY_VECTOR,
                                 .min_len = ri.shape[0] + 1,
                                 .device = &table},
                    &qsl) ||
        dkpy_tensor(module, args[3], op,
                    &(dkpy_want){
                        .arg = "positions", .dtype = DK_I64, .ndim = DKPY_VECTOR, .device = &table},
                    &pos) ||
        dkpy_tensor(module, args[4], op,
                    &(dkpy_want){.arg = "out", .dtype = DK_I64, .ndim = 1, .device = &table},
                    &out) ||
        dkpy_get_i64(args[5], op, "num_tokens", &num_tokens) ||
        dkpy_get_i64(args[6], op, "num_tokens_padded", &padded) ||
        dkpy_get_i64(args[7], op, "block_size", &bs) || dkpy_get_i64(args[8], op, "cp_size", &c) ||
        dkpy_get_i64(args[9], op, "cp_rank", &r) ||
        dkpy_get_i64(args[10], op, "cp_interleave", &il)) {
        return NULL;
    }
    if (table.shape[1] > 1 && table.strides[1] != 1) {
        PyErr_Format(PyExc_ValueError, "%s(): table must have unit column stride", op);
        return NULL;
    }
    if (dkpy_no_overlap(&out, "out", &table, "table", op) ||
        dkpy_no_overlap(&out, "out", &ri, "row_indices", op) ||
        dkpy_no_overlap(&out, "out", &qsl, "query_start_loc", op) ||
        dkpy_no_overlap(&out, "out", &pos, "positions", op)) {
        return NULL;
    }
    if (num_tokens < 0 || padded < num_tokens || pos.shape[0] < num_tokens ||
        out.shape[0] < padded) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): need 0 <= num_tokens (%lld) <= num_tokens_padded (%lld), positions "
                     "with >= num_tokens entries (%lld) and out with >= num_tokens_padded entries "
                     "(%lld)",
                     op, (long long)num_tokens, (long long)padded, (long long)pos.shape[0],
                     (long long)out.shape[0]);
        return NULL;
    }
    if (bs < 1 || c < 1 || r < 0 || r >= c || il < 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): block_size >= 1, cp_size >= 1, cp_rank in [0, cp_size) and "
                     "cp_interleave >= 1 required, got %lld, %lld, %lld, %lld",
                     op, (long long)bs, (long long)c, (long long)r, (long long)il);
        return NULL;
    }
    if (c > 1 && bs % il != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): cp_interleave must divide block_size under context parallelism, got "
                     "cp_interleave=%lld, block_size=%lld",
                     op, (long long)il, (long long)bs);
        return NULL;
    }
    dk_slots_args a = {
        .block_table = (const int32_t *)table.data,
        .bt_stride_row = table.strides[0],
        .table_rows = table.shape[0],
        .table_cols = table.shape[1],
        .row_indices = (const int32_t *)ri.data,
        .query_start_loc = (const int32_t *)qsl.data,
        .positions = (const int64_t *)pos.data,
        .slot_mapping = (int64_t *)out.data,
        .slot_stride = out.strides[0],
        .num_rows = ri.shape[0],
        .num_tokens = num_tokens,
        .num_tokens_padded = padded,
        .block_size = bs,
        .cp_size = c,
        .cp_rank = r,
        .cp_interleave = il,
    };
    if (table.device_type == DK_CUDA) {
        if (dkpy_run_cuda(module, args[0], table.device_id, launch_slots, &a) != 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    const int32_t *q = (const int32_t *)qsl.data;
    if (q[ri.shape[0]] != num_tokens) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): query_start_loc must end at num_tokens (%lld), got %d", op,
                     (long long)num_tokens, (int)q[ri.shape[0]]);
        return NULL;
    }
    dk_error err = {{0}};
    dk_status s = dk_ref_slots(&a, &err);
    if (s != DK_OK) {
        return dkpy_raise_status(module, s, &err);
    }
    Py_RETURN_NONE;
}

/* BlockPool's state tensors (args[0..2]: state int64, free_stack int32, in_use uint8, all CPU
 * and contiguous, free_stack and in_use of one length) into *pool; *state = the state's data:
 * 0 or -1. */
static int
pool_args(PyObject *module, PyObject *const *args, const char *op, dk_pool *pool, int64_t **state)
{
    dk_tensor st, fs, iu;
    if (dkpy_tensor(module, args[0], op,
                    &(dkpy_want){.arg = "state",
                                 .dtype = DK_I64,
                                 .ndim = DKPY_VECTOR,
                                 .min_len = 1,
                                 .device = DKPY_HOST},
                    &st) ||
        dkpy_tensor(
            module, args[1], op,
            &(dkpy_want){
                .arg = "free_stack", .dtype = DK_I32, .ndim = DKPY_VECTOR, .device = DKPY_HOST},
            &fs) ||
        dkpy_tensor(
            module, args[2], op,
            &(dkpy_want){.arg = "in_use", .dtype = DK_U8, .ndim = DKPY_VECTOR, .device = DKPY_HOST},
            &iu)) {
        return -1;
    }
    if (iu.shape[0] != fs.shape[0]) {
        PyErr_Format(PyExc_ValueError, "%s(): in_use must have %lld entries, got %lld", op,
                     (long long)fs.shape[0], (long long)iu.shape[0]);
        return -1;
    }
    if (dkpy_no_overlap(&fs, "free_stack", &st, "state", op) ||
        dkpy_no_overlap(&iu, "in_use", &st, "state", op) ||
        dkpy_no_overlap(&iu, "in_use", &fs, "free_stack", op)) {
        return -1;
    }
    *state = (int64_t *)st.data;
    pool->free_stack = (int32_t *)fs.data;
    pool->in_use = (uint8_t *)iu.data;
    pool->num_blocks = fs.shape[0];
    pool->num_free = **state;
    if (pool->num_free < 0 || pool->num_free > pool->num_blocks) {
        PyErr_Format(PyExc_ValueError, "%s(): state holds %lld free blocks of %lld", op,
                     (long long)pool->num_free, (long long)pool->num_blocks);
        return -1;
    }
    return 0;
}

static PyObject *
py_pool_init(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dkpy_check_nargs("pool_init", nargs, 3) != 0) {
        return NULL;
    }
    dk_pool pool;
    int64_t *state = NULL;
    dk_tensor st;
    if (dkpy_tensor(module, args[0], "BlockPool",
                    &(dkpy_want){.arg = "state",
                                 .dtype = DK_I64,
                                 .ndim = DKPY_VECTOR,
                                 .min_len = 1,
                                 .device = DKPY_HOST},
                    &st)) {
        return NULL;
    }
    /* pool_args range-checks the stored free count: start from 0, put it back on failure. */
    int64_t before = *(int64_t *)st.data;
    *(int64_t *)st.data = 0;
    if (pool_args(module, args, "BlockPool", &pool, &state) != 0) {
        *(int64_t *)st.data = before;
        return NULL;
    }
    dk_pool_init(&pool);
    *state = pool.num_free;
    Py_RETURN_NONE;
}

static PyObject *
py_pool_allocate(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "BlockPool.allocate";
    if (dkpy_check_nargs(op, nargs, 4) != 0) {
        return NULL;
    }
    dk_pool pool;
    int64_t *state = NULL, n = 0;
    if (pool_args(module, args, op, &pool, &state) != 0) {
        return NULL;
    }
    if (!PyLong_Check(args[3]) || PyBool_Check(args[3])) {
        PyErr_Format(PyExc_TypeError, "%s(): n must be an int, got %R", op, args[3]);
        return NULL;
    }
    int overflow = 0;
    n = PyLong_AsLongLongAndOverflow(args[3], &overflow);
    if (overflow > 0) {
        n = INT64_MAX;
    }
    else if (overflow < 0) {
        n = -1;
    }
    int32_t *ids =
        (int32_t *)malloc((size_t)(n > 0 && n <= pool.num_free ? n : 1) * sizeof(int32_t));
    if (ids == NULL) {
        return PyErr_NoMemory();
    }
    dk_error err = {{0}};
    dk_status s = dk_pool_allocate(&pool, n, ids, &err);
    if (s != DK_OK) {
        free(ids);
        return dkpy_raise_status(module, s, &err);
    }
    *state = pool.num_free;
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (int64_t i = 0; list != NULL && i < n; i++) {
        PyObject *x = PyLong_FromLong(ids[i]);
        if (x == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SetItem(list, (Py_ssize_t)i, x);
    }
    free(ids);
    return list;
}

static PyObject *
py_pool_free(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "BlockPool.free";
    if (dkpy_check_nargs(op, nargs, 4) != 0) {
        return NULL;
    }
    dk_pool pool;
    int64_t *state = NULL, *ids = NULL;
    Py_ssize_t n = 0;
    if (pool_args(module, args, op, &pool, &state) != 0 ||
        dkpy_i64_list(args[3], op, "block_ids", &ids, &n) != 0) {
        return NULL;
    }
    dk_error err = {{0}};
    dk_status s = dk_pool_free(&pool, ids, n, &err);
    free(ids);
    if (s != DK_OK) {
        return dkpy_raise_status(module, s, &err);
    }
    *state = pool.num_free;
    Py_RETURN_NONE;
}

PyMethodDef dkpy_tables_methods[] = {
    FAST(table_append, "BlockTables.append_block_ids on a host table."),
    FAST(gather_block_tables, "BlockTables.gather_block_tables on host tables."),
    FAST(compute_slot_mappings, "Slot mapping (CPU or CUDA)."),
    FAST(pool_init, "BlockPool state init."),
    FAST(pool_allocate, "BlockPool.allocate."),
    FAST(pool_free, "BlockPool.free."),
    {NULL, NULL, 0, NULL},
};
