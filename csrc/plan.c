/*
 * plan.c -- piecewise (mixed causal / full) attention plans: vLLM-Omni's adapter's
 * build_paged_piecewise_plan over plain integers.  Validates the spans and query range of
 * every row, cuts each row into causal and full segments, checks that the rows line up, and
 * turns the plan into one exclusive key bound per packed query token (what the single-launch
 * attention kernel consumes).
 *
 * Entry points: dk_plan_segment_capacity, dk_plan_build.
 *
 * All validation runs before the first write to segments or key_limits; the segment walk is
 * a small iterator so the checks need no scratch memory.
 */
#include "diffkv.h"

#include <stdint.h>

static const char MSG_BAD_SPANS[] =
    "Paged piecewise spans must be sorted, non-overlapping, and within the sequence";
static const char MSG_BAD_QUERY_RANGE[] = "Paged piecewise query range must be within the sequence";
static const char MSG_UNALIGNED[] = "Paged piecewise rows must produce aligned segments";
static const char MSG_MODE_MISMATCH[] =
    "Paged piecewise rows must use the same attention mode per segment";
static const char MSG_INPUTS[] = "Paged piecewise inputs must have one entry per row";

/* vLLM-Omni's adapter's build_segments for one row, one segment per call. */
typedef struct seg_iter {
    const int64_t *spans; /* this row's (start, end) pairs */
    int64_t num_spans;
    int64_t next_span;
    int64_t q_start; /* query range [q_start, q_end), global positions */
    int64_t q_end;
    int64_t cursor;
    int has_pending; /* a full segment queued behind the causal gap just returned */
    dk_segment pending;
} seg_iter;

/* An iterator over row r's segments (seg_next), at its first query token.  Cannot fail. */
static void
seg_iter_init(seg_iter *it, const dk_plan_args *a, int64_t r)
{
    int64_t first = a->span_offsets[r];
    it->spans = a->spans + 2 * first;
    it->num_spans = a->span_offsets[r + 1] - first;
    it->next_span = 0;
    it->q_start = a->query_offsets[r];
    it->q_end = a->query_offsets[r] + a->query_lens[r];
    it->cursor = it->q_start;
    it->has_pending = 0;
}

/* A segment of queries [q_start, q_end) seeing keys below kv_end in `mode`.  Cannot fail. */
static dk_segment
make_segment(int64_t q_start, int64_t q_end, int64_t kv_end, dk_mode mode)
{
    dk_segment s;
    s.q_start = q_start;
    s.q_end = q_end;
    s.kv_end = kv_end;
    s.mode = (int32_t)mode;
    return s;
}

/* Returns 1 and the next segment, or 0 when the row is done. */
static int
seg_next(seg_iter *it, dk_segment *out)
{
    if (it->has_pending) {
        it->has_pending = 0;
        *out = it->pending;
        return 1;
    }
    while (it->next_span < it->num_spans) {
        int64_t start = it->spans[2 * it->next_span];
        int64_t end = it->spans[2 * it->next_span + 1];
        it->next_span++;
        int64_t overlap_start = start > it->q_start ? start : it->q_start;
        int64_t overlap_end = end < it->q_end ? end : it->q_end;
        if (overlap_start >= overlap_end) {
            continue;
        }
        /* kv_end of a full segment is the span's own end, not the clipped one. */
        dk_segment full = make_segment(overlap_start, overlap_end, end, DK_MODE_FULL);
        int64_t gap_start = it->cursor;
        it->cursor = overlap_end;
        if (gap_start < overlap_start) {
            it->pending = full;
            it->has_pending = 1;
            *out = make_segment(gap_start, overlap_start, overlap_start, DK_MODE_CAUSAL);
            return 1;
        }
        *out = full;
        return 1;
    }
    if (it->cursor < it->q_end) {
        *out = make_segment(it->cursor, it->q_end, it->q_end, DK_MODE_CAUSAL);
        it->cursor = it->q_end;
        return 1;
    }
    return 0;
}

/* How many segments row r splits into (a checked row).  Cannot fail. */
static int64_t
row_segment_count(const dk_plan_args *a, int64_t r)
{
    seg_iter it;
    dk_segment s;
    int64_t n = 0;
    seg_iter_init(&it, a, r);
    while (seg_next(&it, &s)) {
        n++;
    }
    return n;
}

int64_t
dk_plan_segment_capacity(const dk_plan_args *a)
{
    int64_t max_spans = 0;
    for (int64_t r = 0; r < a->num_rows; r++) {
        int64_t n = a->span_offsets[r + 1] - a->span_offsets[r];
        if (n > max_spans) {
            max_spans = n;
        }
    }
    return a->num_rows * (2 * max_spans + 1);
}

/* Records the broken rule and its message (vLLM-Omni's planner text): returns DK_ERR_VALUE. */
static dk_status
plan_fail(dk_plan_rule *rule, dk_plan_rule which, dk_error *err, const char *msg)
{
    *rule = which;
    return dk_fail(err, DK_ERR_VALUE, "%s", msg);
}

dk_status
dk_plan_build(const dk_plan_args *a, dk_segment *segments, int64_t segment_capacity,
              int64_t *num_segments, int32_t *key_limits, dk_plan_rule *rule, dk_error *err)
{
    static const char *op = "build_plan()";
    *rule = DK_PLAN_OK;
    if (a->num_rows <= 0) {
        return dk_fail(err, DK_ERR_VALUE, "%s", MSG_INPUTS);
    }
    if (a->span_offsets[0] < 0) {
        return dk_fail(err, DK_ERR_VALUE, "%s: span_offsets[0] must be >= 0, got %lld", op,
                       (long long)a->span_offsets[0]);
    }
    for (int64_t r = 0; r < a->num_rows; r++) {
        if (a->span_offsets[r + 1] < a->span_offsets[r]) {
            return dk_fail(err, DK_ERR_VALUE,
                           "%s: span_offsets must be non-decreasing, got %lld after %lld at "
                           "index %lld",
                           op, (long long)a->span_offsets[r + 1], (long long)a->span_offsets[r],
                           (long long)(r + 1));
        }
    }

    /* Per row, in vLLM-Omni's adapter's order: spans, then the query range. */
    for (int64_t r = 0; r < a->num_rows; r++) {
        int64_t seq_len = a->seq_lens[r];
        int64_t previous_end = 0;
        for (int64_t s = a->span_offsets[r]; s < a->span_offsets[r + 1]; s++) {
            int64_t start = a->spans[2 * s];
            int64_t end = a->spans[2 * s + 1];
            if (start < previous_end || !(0 <= start && start < end && end <= seq_len)) {
                return plan_fail(rule, DK_PLAN_BAD_SPANS, err, MSG_BAD_SPANS);
            }
            previous_end = end;
        }
        int64_t offset = a->query_offsets[r];
        int64_t len = a->query_lens[r];
        /* offset + len > seq_len, written so that nothing overflows. */
        if (offset < 0 || len <= 0 || offset > seq_len || len > seq_len - offset) {
            return plan_fail(rule, DK_PLAN_BAD_QUERY_RANGE, err, MSG_BAD_QUERY_RANGE);
        }
    }

    int64_t count = row_segment_count(a, 0);
    for (int64_t r = 1; r < a->num_rows; r++) {
        if (row_segment_count(a, r) != count) {
            return plan_fail(rule, DK_PLAN_UNALIGNED, err, MSG_UNALIGNED);
        }
    }

    /* Modes: walk row 0 and row r side by side (both have `count` segments). */
    for (int64_t r = 1; r < a->num_rows; r++) {
        seg_iter it0, itr;
        dk_segment s0, sr;
        seg_iter_init(&it0, a, 0);
        seg_iter_init(&itr, a, r);
        while (seg_next(&it0, &s0) && seg_next(&itr, &sr)) {
            if (s0.mode != sr.mode) {
                return plan_fail(rule, DK_PLAN_MODE_MISMATCH, err, MSG_MODE_MISMATCH);
            }
        }
    }

    if (count > segment_capacity / a->num_rows) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s: segment_capacity must be at least %lld segments x %lld rows, got %lld",
                       op, (long long)count, (long long)a->num_rows, (long long)segment_capacity);
    }
    if (key_limits != NULL) {
        for (int64_t r = 0; r < a->num_rows; r++) {
            if (a->seq_lens[r] > INT32_MAX) {
                return dk_fail(err, DK_ERR_VALUE,
                               "%s: seq_lens[%lld] must be at most %d for int32 key limits, got "
                               "%lld",
                               op, (long long)r, INT32_MAX, (long long)a->seq_lens[r]);
            }
        }
    }

    /* Everything is valid: write the segments, then the key limits. */
    int64_t packed = 0;
    for (int64_t r = 0; r < a->num_rows; r++) {
        seg_iter it;
        dk_segment s;
        int64_t k = 0;
        seg_iter_init(&it, a, r);
        while (seg_next(&it, &s)) {
            segments[k * a->num_rows + r] = s;
            if (key_limits != NULL) {
                int64_t base = packed - a->query_offsets[r];
                for (int64_t p = s.q_start; p < s.q_end; p++) {
                    int64_t limit = s.mode == DK_MODE_FULL ? s.kv_end : p + 1;
                    key_limits[base + p] = (int32_t)limit;
                }
            }
            k++;
        }
        packed += a->query_lens[r];
    }
    *num_segments = count;
    return DK_OK;
}
