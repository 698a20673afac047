/*
 * batch.c -- host side of prepare_batch: vLLM-Omni's adapter's batch checks, token positions,
 * the context-parallel local sequence lengths, the block-table gather and the CPU slot mapping
 * (vLLM BlockTables.compute_slot_mappings).
 *
 * Entry points: dk_ref_slots, dk_positions_build, dk_dcp_local_seq_lens,
 * dk_ref_gather_block_tables, dk_batch_check.
 *
 * Every routine that can fail checks all of its input before it writes anything, so a failed
 * call leaves the caller's buffers as they were.
 */
#include "diffkv.h"

#include <stdint.h>

/* ------------------------------------------------------------------------------------------ */
/* Exact int64 arithmetic with Python semantics (the adapter computes on unbounded ints)       */
/* ------------------------------------------------------------------------------------------ */

/* *out = a * b; returns 1 (and leaves *out unset) when the product does not fit in int64. */
static int
mul_overflows(int64_t a, int64_t b, int64_t *out)
{
    uint64_t ua = a < 0 ? 0u - (uint64_t)a : (uint64_t)a;
    uint64_t ub = b < 0 ? 0u - (uint64_t)b : (uint64_t)b;
    int negative = (a < 0) != (b < 0);
    if (ua != 0 && ub > UINT64_MAX / ua) {
        return 1;
    }
    uint64_t m = ua * ub;
    uint64_t limit = negative ? (uint64_t)INT64_MAX + 1u : (uint64_t)INT64_MAX;
    if (m > limit) {
        return 1;
    }
    if (!negative) {
        *out = (int64_t)m;
    }
    else if (m == (uint64_t)INT64_MAX + 1u) {
        *out = INT64_MIN;
    }
    else {
        *out = -(int64_t)m;
    }
    return 0;
}

/* Python's a // b for b != 0 and (a, b) != (INT64_MIN, -1). */
static int64_t
floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    int64_t r = a % b;
    if (r != 0 && ((r < 0) != (b < 0))) {
        q -= 1;
    }
    return q;
}

/* vLLM's cdiv(a, b) = -(a // -b), i.e. the ceiling of a / b, for b != 0 and
 * (a, b) != (INT64_MIN, -1). */
static int64_t
ceil_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    int64_t r = a % b;
    if (r != 0 && ((r < 0) == (b < 0))) {
        q += 1;
    }
    return q;
}

/* Whether a * b > c holds exactly (no overflow). */
static int
product_exceeds(int64_t a, int64_t b, int64_t c)
{
    int64_t p;
    if (mul_overflows(a, b, &p)) {
        /* |a * b| > INT64_MAX >= |c| except for c == INT64_MIN; the sign decides. */
        return (a < 0) == (b < 0);
    }
    return p > c;
}

/* ------------------------------------------------------------------------------------------ */
/* Slot mapping                                                                                */
/* ------------------------------------------------------------------------------------------ */

dk_status
dk_ref_slots(const dk_slots_args *a, dk_error *err)
{
    static const char *op = "compute_slot_mappings()";
    if (a->num_rows < 0) {
        return dk_fail(err, DK_ERR_VALUE, "%s: num_rows must be >= 0, got %lld", op,
                       (long long)a->num_rows);
    }
    if (a->block_size < 1) {
        return dk_fail(err, DK_ERR_VALUE, "%s: block_size must be >= 1, got %lld", op,
                       (long long)a->block_size);
    }
    if (a->cp_size < 1) {
        return dk_fail(err, DK_ERR_VALUE, "%s: cp_size must be >= 1, got %lld", op,
                       (long long)a->cp_size);
    }
    if (a->cp_rank < 0 || a->cp_rank >= a->cp_size) {
        return dk_fail(err, DK_ERR_VALUE, "%s: cp_rank must be in [0, %lld), got %lld", op,
                       (long long)a->cp_size, (long long)a->cp_rank);
    }
    if (a->cp_interleave < 1) {
        return dk_fail(err, DK_ERR_VALUE, "%s: cp_interleave must be >= 1, got %lld", op,
                       (long long)a->cp_interleave);
    }
    /* vLLM's config guarantees this; without it a rank's share of a virtual block spills
     * into the next physical block. */
    if (a->cp_size > 1 && a->block_size % a->cp_interleave != 0) {
        return dk_fail(
            err, DK_ERR_VALUE,
            "%s: block_size must be a multiple of cp_interleave (%lld) when cp_size > 1, "
            "got %lld",
            op, (long long)a->cp_interleave, (long long)a->block_size);
    }
    int64_t span;
    if (mul_overflows(a->block_size, a->cp_size, &span)) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s: block_size * cp_size must fit in int64, got %lld * %lld", op,
                       (long long)a->block_size, (long long)a->cp_size);
    }
    int64_t group;
    if (mul_overflows(a->cp_interleave, a->cp_size, &group)) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s: cp_interleave * cp_size must fit in int64, got %lld * %lld", op,
                       (long long)a->cp_interleave, (long long)a->cp_size);
    }
    if (a->num_tokens < 0) {
        return dk_fail(err, DK_ERR_VALUE, "%s: num_tokens must be >= 0, got %lld", op,
                       (long long)a->num_tokens);
    }
    if (a->num_tokens_padded < a->num_tokens) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s: num_tokens_padded must be >= num_tokens (%lld), got %lld", op,
                       (long long)a->num_tokens, (long long)a->num_tokens_padded);
    }
    if (a->query_start_loc[0] != 0) {
        return dk_fail(err, DK_ERR_VALUE, "%s: query_start_loc[0] must be 0, got %lld", op,
                       (long long)a->query_start_loc[0]);
    }
    for (int64_t i = 0; i < a->num_rows; i++) {
        int64_t start = a->query_start_loc[i];
        int64_t end = a->query_start_loc[i + 1];
        if (end < start) {
            return dk_fail(err, DK_ERR_VALUE,
                           "%s: query_start_loc must be non-decreasing, got %lld after %lld at "
                           "index %lld",
                           op, (long long)end, (long long)start, (long long)(i + 1));
        }
    }
    if (a->query_start_loc[a->num_rows] != a->num_tokens) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s: query_start_loc[%lld] must equal num_tokens (%lld), got %lld", op,
                       (long long)a->num_rows, (long long)a->num_tokens,
                       (long long)a->query_start_loc[a->num_rows]);
    }

    /* Every row index and block index is checked before the first write. */
    for (int64_t i = 0; i < a->num_rows; i++) {
        int64_t row = a->row_indices[i];
        if (row < 0 || row >= a->table_rows) {
            return dk_fail(err, DK_ERR_VALUE,
                           "%s: row_indices[%lld] must be in [0, %lld), got %lld", op, (long long)i,
                           (long long)a->table_rows, (long long)row);
        }
        for (int64_t t = a->query_start_loc[i]; t < a->query_start_loc[i + 1]; t++) {
            int64_t p = a->positions[t];
            if (p < 0) {
                return dk_fail(
                    err, DK_ERR_VALUE,
                    "%s: position of token %lld of batch row %lld must be >= 0, got %lld", op,
                    (long long)(t - a->query_start_loc[i]), (long long)i, (long long)p);
            }
            int64_t blk = p / span;
            if (blk >= a->table_cols) {
                return dk_fail(
                    err, DK_ERR_VALUE,
                    "%s: block index %lld of batch row %lld (table row %lld) must be < %lld "
                    "table columns, got position %lld",
                    op, (long long)blk, (long long)i, (long long)row, (long long)a->table_cols,
                    (long long)p);
            }
            /* A negative id would turn into a "skip" slot, a huge one overflow the product. */
            int64_t phys = a->block_table[row * a->bt_stride_row + blk];
            if (phys < 0 || phys > (INT64_MAX - (a->block_size - 1)) / a->block_size) {
                return dk_fail(err, DK_ERR_VALUE,
                               "%s: block_table[%lld][%lld] must be a block id >= 0 whose slots "
                               "fit in int64, got %lld",
                               op, (long long)row, (long long)blk, (long long)phys);
            }
        }
    }

    for (int64_t i = 0; i < a->num_rows; i++) {
        const int32_t *table_row = a->block_table + a->row_indices[i] * a->bt_stride_row;
        for (int64_t t = a->query_start_loc[i]; t < a->query_start_loc[i + 1]; t++) {
            int64_t p = a->positions[t];
            int64_t phys = table_row[p / span];
            int64_t off = p % span;
            int64_t slot;
            if (a->cp_size == 1) {
                slot = phys * a->block_size + off;
            }
            else if ((off / a->cp_interleave) % a->cp_size == a->cp_rank) {
                slot = phys * a->block_size + (off / group) * a->cp_interleave +
                       off % a->cp_interleave;
            }
            else {
                slot = -1;
            }
            a->slot_mapping[t * a->slot_stride] = slot;
        }
    }
    for (int64_t t = a->num_tokens; t < a->num_tokens_padded; t++) {
        a->slot_mapping[t * a->slot_stride] = -1;
    }
    return DK_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Positions, DCP lengths, block-table gather                                                  */
/* ------------------------------------------------------------------------------------------ */

void
dk_positions_build(const int64_t *kv_start_pos, const int32_t *query_start_loc, int64_t num_rows,
                   int64_t *positions)
{
    for (int64_t i = 0; i < num_rows; i++) {
        int64_t start = query_start_loc[i];
        int64_t end = query_start_loc[i + 1];
        for (int64_t t = start; t < end; t++) {
            positions[t] = kv_start_pos[i] + (t - start);
        }
    }
}

void
dk_dcp_local_seq_lens(const int32_t *seq_lens, int64_t num_rows, int64_t cp_size, int64_t cp_rank,
                      int64_t cp_interleave, int32_t *out)
{
    int64_t round = cp_size * cp_interleave;
    for (int64_t i = 0; i < num_rows; i++) {
        int64_t s = seq_lens[i];
        int64_t base = (s / round) * cp_interleave;
        int64_t rem = s - base * cp_size;
        int64_t extra = rem - cp_rank * cp_interleave;
        if (extra < 0) {
            extra = 0;
        }
        else if (extra > cp_interleave) {
            extra = cp_interleave;
        }
        out[i] = (int32_t)(base + extra);
    }
}

dk_status
dk_ref_gather_block_tables(const dk_gather_args *a, dk_error *err)
{
    static const char *op = "gather_block_tables()";
    if (a->num_rows < 0 || a->num_reqs_padded < a->num_rows || a->num_reqs_padded > a->out_rows) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s: num_reqs_padded must be in [%lld, %lld] (batch rows to output rows), "
                       "got %lld",
                       op, (long long)a->num_rows, (long long)a->out_rows,
                       (long long)a->num_reqs_padded);
    }
    for (int64_t i = 0; i < a->num_rows; i++) {
        int64_t row = a->row_indices[i];
        if (row < 0 || row >= a->table_rows) {
            return dk_fail(err, DK_ERR_VALUE,
                           "%s: row_indices[%lld] must be in [0, %lld), got %lld", op, (long long)i,
                           (long long)a->table_rows, (long long)row);
        }
        int64_t count = a->counts[row * a->counts_stride];
        if (count < 0 || count > a->table_cols) {
            return dk_fail(err, DK_ERR_VALUE,
                           "%s: installed block count of table row %lld must be in [0, %lld], got "
                           "%lld",
                           op, (long long)row, (long long)a->table_cols, (long long)count);
        }
    }
    for (int64_t i = 0; i < a->num_rows; i++) {
        int64_t row = a->row_indices[i];
        int64_t count = a->counts[row * a->counts_stride];
        const int32_t *src = a->table + row * a->table_stride_row;
        int32_t *dst = a->out + i * a->out_stride_row;
        for (int64_t c = 0; c < count; c++) {
            dst[c] = src[c];
        }
    }
    for (int64_t i = a->num_rows; i < a->num_reqs_padded; i++) {
        int32_t *dst = a->out + i * a->out_stride_row;
        for (int64_t c = 0; c < a->table_cols; c++) {
            dst[c] = 0;
        }
    }
    return DK_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* prepare_batch's checks of rows against the Worker's tables and token budget               */
/* ------------------------------------------------------------------------------------------ */

/* Exact sum of int64 values as hi * 2^64 + lo (cannot overflow for fewer than 2^63 terms). */
typedef struct wide_sum {
    int64_t hi;
    uint64_t lo;
} wide_sum;

/* s += v, exactly (a 128-bit two's-complement sum).  Cannot fail. */
static void
wide_add(wide_sum *s, int64_t v)
{
    uint64_t lo = s->lo + (uint64_t)v;
    int64_t carry = lo < s->lo ? 1 : 0;
    s->hi += carry + (v < 0 ? -1 : 0);
    s->lo = lo;
}

/* 1 when the sum fits in int64 (then *out holds it). */
static int
wide_fits(const wide_sum *s, int64_t *out)
{
    if ((s->hi == 0 && s->lo <= (uint64_t)INT64_MAX) ||
        (s->hi == -1 && s->lo > (uint64_t)INT64_MAX)) {
        *out = s->hi == 0
                   ? (int64_t)s->lo
                   : (s->lo == (uint64_t)INT64_MAX + 1u ? INT64_MIN : -(int64_t)(0u - s->lo));
        return 1;
    }
    return 0;
}

/* Decimal text of a non-negative wide sum (hi >= 0) into buf (>= 48 bytes). */
static void
wide_format(const wide_sum *s, char *buf, size_t cap)
{
    /* Four 32-bit limbs, most significant first; repeated division by 10. */
    uint32_t limb[4] = {(uint32_t)((uint64_t)s->hi >> 32), (uint32_t)(uint64_t)s->hi,
                        (uint32_t)(s->lo >> 32), (uint32_t)s->lo};
    char digits[48];
    size_t n = 0;
    for (;;) {
        uint64_t rem = 0;
        int nonzero = 0;
        for (int k = 0; k < 4; k++) {
            uint64_t cur = (rem << 32) | limb[k];
            limb[k] = (uint32_t)(cur / 10u);
            rem = cur % 10u;
            nonzero |= limb[k] != 0;
        }
        digits[n++] = (char)('0' + (int)rem);
        if (!nonzero || n + 1 >= sizeof(digits)) {
            break;
        }
    }
    size_t j = 0;
    while (n > 0 && j + 1 < cap) {
        buf[j++] = digits[--n];
    }
    buf[j] = '\0';
}

/* Fills fault with the broken rule and where, for the caller's message: returns DK_ERR_VALUE. */
static dk_status
batch_fault(dk_batch_fault *fault, dk_batch_rule rule, int64_t row, int64_t group)
{
    fault->rule = rule;
    fault->row = row;
    fault->group = group;
    return DK_ERR_VALUE;
}

dk_status
dk_batch_check(const dk_batch_check_args *a, dk_batch_fault *fault, dk_error *err)
{
    static const char *op = "prepare_batch()";
    fault->rule = DK_BATCH_OK;
    fault->row = -1;
    fault->group = -1;
    fault->required_blocks = 0;
    fault->installed_blocks = 0;
    fault->num_tokens = 0;
    if (a->num_blocks_dtype != DK_I32 && a->num_blocks_dtype != DK_I64) {
        return dk_fail(err, DK_ERR_TYPE, "%s: num_blocks must be int32 or int64, got %s", op,
                       dk_dtype_name(a->num_blocks_dtype));
    }

    /* Two rows on one Worker row: only int row indices are compared here; csrc/py/batch.c
     * judges other Python types. */
    for (int64_t i = 0; i < a->num_rows; i++) {
        if (!a->row_index_is_int[i]) {
            continue;
        }
        for (int64_t j = i + 1; j < a->num_rows; j++) {
            if (a->row_index_is_int[j] && a->row_indices[j] == a->row_indices[i]) {
                dk_fail(err, DK_ERR_VALUE,
                        "Paged attention batch resolves multiple inputs to the same Worker row");
                return batch_fault(fault, DK_BATCH_DUP_WORKER_ROW, j, -1);
            }
        }
    }

    /* Per row: the row's capacity is a non-negative int, and seq_len fits in it. */
    for (int64_t i = 0; i < a->num_rows; i++) {
        if (!a->capacity_is_int[i] || a->capacities[i] < 0) {
            dk_fail(err, DK_ERR_VALUE,
                    "Paged attention row %lld resolved to invalid logical capacity", (long long)i);
            return batch_fault(fault, DK_BATCH_BAD_CAPACITY, i, -1);
        }
        if (a->seq_lens[i] > a->capacities[i]) {
            dk_fail(err, DK_ERR_VALUE,
                    "Paged attention row %lld uses seq_len=%lld, but its installed allocation has "
                    "logical length %lld",
                    (long long)i, (long long)a->seq_lens[i], (long long)a->capacities[i]);
            return batch_fault(fault, DK_BATCH_SEQ_LEN_OVER_CAPACITY, i, -1);
        }
    }

    /* Causal ordering: once a row longer than the threshold is seen, no shorter row may follow. */
    if (a->reorder_threshold >= 0 && a->any_causal) {
        int found_long_query = 0;
        for (int64_t i = 0; i < a->num_rows; i++) {
            if (a->query_lens[i] > a->reorder_threshold) {
                found_long_query = 1;
            }
            else if (found_long_query) {
                dk_fail(err, DK_ERR_VALUE,
                        "Causal paged attention rows must place native decode/short-query rows "
                        "before prefill/long-query rows (decode threshold=%lld)",
                        (long long)a->reorder_threshold);
                return batch_fault(fault, DK_BATCH_ORDER, i, -1);
            }
        }
    }

    /* Per row: the Worker row index is in range; per cache group: enough kernel blocks are
     * installed for seq_len. */
    for (int64_t i = 0; i < a->num_rows; i++) {
        int64_t row = a->row_indices[i];
        if (!a->row_index_is_int[i] || row < 0 || row >= a->max_num_reqs) {
            dk_fail(err, DK_ERR_VALUE, "Paged attention row %lld resolved to invalid Worker row",
                    (long long)i);
            return batch_fault(fault, DK_BATCH_BAD_WORKER_ROW, i, -1);
        }
        for (int64_t g = 0; g < a->num_groups; g++) {
            int64_t divisor;
            int64_t required;
            if (mul_overflows(a->block_sizes[g], a->cp_size, &divisor)) {
                /* |divisor| > |seq_len|: the ceiling is 1 for a quotient in (0, 1), else 0. */
                int same_sign = (a->block_sizes[g] < 0) == (a->cp_size < 0);
                required = (a->seq_lens[i] != 0 && (a->seq_lens[i] > 0) == same_sign) ? 1 : 0;
            }
            else if (divisor == 0) {
                return dk_fail(err, DK_ERR_VALUE,
                               "%s: block_sizes[%lld] * cp_size must be nonzero, got %lld * %lld",
                               op, (long long)g, (long long)a->block_sizes[g],
                               (long long)a->cp_size);
            }
            else if (divisor == -1 && a->seq_lens[i] == INT64_MIN) {
                return dk_fail(err, DK_ERR_VALUE,
                               "%s: seq_len of row %lld must be > %lld, got %lld", op, (long long)i,
                               (long long)INT64_MIN, (long long)a->seq_lens[i]);
            }
            else {
                required = ceil_div(a->seq_lens[i], divisor);
            }
            int64_t k = a->blocks_per_kv_block[g];
            int64_t offset = g * a->num_blocks_stride_group + row * a->num_blocks_stride_row;
            int64_t installed = a->num_blocks_dtype == DK_I32
                                    ? (int64_t)((const int32_t *)a->num_blocks)[offset]
                                    : ((const int64_t *)a->num_blocks)[offset];
            if (product_exceeds(required, k, installed)) {
                /* vLLM-Omni's adapter reports installed // k; Python would raise for k == 0. */
                if (k == 0) {
                    return dk_fail(err, DK_ERR_VALUE,
                                   "%s: blocks_per_kv_block[%lld] must be nonzero, got 0", op,
                                   (long long)g);
                }
                if (k == -1 && installed == INT64_MIN) {
                    return dk_fail(err, DK_ERR_VALUE,
                                   "%s: installed kernel blocks of Worker row %lld in cache group "
                                   "%lld must be > %lld, got %lld",
                                   op, (long long)row, (long long)g, (long long)INT64_MIN,
                                   (long long)installed);
                }
                fault->required_blocks = required;
                fault->installed_blocks = floor_div(installed, k);
                dk_fail(err, DK_ERR_VALUE,
                        "Paged attention row %lld requires %lld blocks in cache group %lld for "
                        "seq_len=%lld, but its installed Worker row contains only %lld blocks",
                        (long long)i, (long long)required, (long long)g, (long long)a->seq_lens[i],
                        (long long)fault->installed_blocks);
                return batch_fault(fault, DK_BATCH_TOO_FEW_BLOCKS, i, g);
            }
        }
    }

    /* The token budget, on the exact sum. */
    wide_sum sum = {0, 0};
    for (int64_t i = 0; i < a->num_rows; i++) {
        wide_add(&sum, a->query_lens[i]);
    }
    int64_t num_tokens;
    int fits = wide_fits(&sum, &num_tokens);
    if (!fits && sum.hi >= 0) {
        char text[48];
        wide_format(&sum, text, sizeof(text));
        fault->num_tokens = INT64_MAX;
        dk_fail(err, DK_ERR_VALUE, "Paged attention batch has %s tokens; Worker capacity is %lld",
                text, (long long)a->max_num_batched_tokens);
        return batch_fault(fault, DK_BATCH_TOO_MANY_TOKENS, -1, -1);
    }
    if (!fits) {
        return dk_fail(err, DK_ERR_VALUE, "%s: sum(query_len) must be >= %lld, got less", op,
                       (long long)INT64_MIN);
    }
    fault->num_tokens = num_tokens;
    if (num_tokens > a->max_num_batched_tokens) {
        dk_fail(err, DK_ERR_VALUE, "Paged attention batch has %lld tokens; Worker capacity is %lld",
                (long long)num_tokens, (long long)a->max_num_batched_tokens);
        return batch_fault(fault, DK_BATCH_TOO_MANY_TOKENS, -1, -1);
    }
    return DK_OK;
}
