/*
 * blocks.c -- the block pool and block-table row writes diffkv does itself when it runs
 * without vLLM (the roles of vLLM's KV block manager and BlockTables.append_block_ids).
 *
 * Entry points: dk_pool_init, dk_pool_allocate, dk_pool_free, dk_table_append.
 *
 * The state lives in caller-owned tensors, so every routine treats it as untrusted input:
 * ids read from the free stack and counts read from the table are range-checked, and every
 * check runs before the first write.
 */
#include "diffkv.h"

#include <stdint.h>

/* ------------------------------------------------------------------------------------------ */
/* Block pool                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* in_use marker for an id seen earlier in the same free() call (restored on failure). */
#define IN_USE_FREEING 2

void
dk_pool_init(dk_pool *pool)
{
    for (int64_t i = 0; i < pool->num_blocks; i++) {
        pool->free_stack[i] = (int32_t)(pool->num_blocks - 1 - i);
        pool->in_use[i] = 0;
    }
    pool->num_free = pool->num_blocks;
}

dk_status
dk_pool_allocate(dk_pool *pool, int64_t n, int32_t *out, dk_error *err)
{
    static const char *op = "BlockPool.allocate()";
    if (n < 0) {
        return dk_fail(err, DK_ERR_VALUE, "%s: n must be non-negative, got %lld", op, (long long)n);
    }
    if (pool->num_free < 0 || pool->num_free > pool->num_blocks) {
        return dk_fail(err, DK_ERR_RUNTIME, "%s: the free count must be in [0, %lld], got %lld", op,
                       (long long)pool->num_blocks, (long long)pool->num_free);
    }
    if (n > pool->num_free) {
        return dk_fail(err, DK_ERR_RUNTIME,
                       "%s: n must be at most the number of free blocks (%lld), got %lld", op,
                       (long long)pool->num_free, (long long)n);
    }
    for (int64_t j = 0; j < n; j++) {
        int64_t id = pool->free_stack[pool->num_free - 1 - j];
        if (id < 0 || id >= pool->num_blocks || pool->in_use[id]) {
            return dk_fail(err, DK_ERR_RUNTIME,
                           "%s: free-stack entry %lld must be an unallocated id in [0, %lld), got "
                           "%lld",
                           op, (long long)(pool->num_free - 1 - j), (long long)pool->num_blocks,
                           (long long)id);
        }
    }
    for (int64_t j = 0; j < n; j++) {
        int32_t id = pool->free_stack[pool->num_free - 1 - j];
        pool->in_use[id] = 1;
        out[j] = id;
    }
    pool->num_free -= n;
    return DK_OK;
}

/* Undoes the IN_USE_FREEING marks of ids[0 .. n). */
static void
pool_unmark(dk_pool *pool, const int64_t *ids, int64_t n)
{
    for (int64_t j = 0; j < n; j++) {
        pool->in_use[ids[j]] = 1;
    }
}

dk_status
dk_pool_free(dk_pool *pool, const int64_t *ids, int64_t n, dk_error *err)
{
    static const char *op = "BlockPool.free()";
    if (n < 0) {
        return dk_fail(err, DK_ERR_VALUE, "%s: the number of ids must be non-negative, got %lld",
                       op, (long long)n);
    }
    /* Mark while checking so a repeated id is found in one pass; undo the marks on failure. */
    for (int64_t j = 0; j < n; j++) {
        int64_t id = ids[j];
        if (id < 0 || id >= pool->num_blocks) {
            pool_unmark(pool, ids, j);
            return dk_fail(err, DK_ERR_VALUE, "%s: block id must be in [0, %lld), got %lld", op,
                           (long long)pool->num_blocks, (long long)id);
        }
        if (pool->in_use[id] == IN_USE_FREEING) {
            pool_unmark(pool, ids, j);
            return dk_fail(err, DK_ERR_VALUE,
                           "%s: block ids must not repeat, got block id %lld twice", op,
                           (long long)id);
        }
        if (pool->in_use[id] != 1) {
            pool_unmark(pool, ids, j);
            return dk_fail(err, DK_ERR_VALUE, "%s: block id %lld is not allocated (double free?)",
                           op, (long long)id);
        }
        pool->in_use[id] = IN_USE_FREEING;
    }
    /* Distinct allocated ids always fit unless the caller-owned state was corrupted. */
    if (pool->num_free < 0 || pool->num_free > pool->num_blocks - n) {
        pool_unmark(pool, ids, n);
        return dk_fail(err, DK_ERR_VALUE,
                       "%s: the free count must be in [0, %lld] to take back %lld ids, got %lld",
                       op, (long long)(pool->num_blocks - n), (long long)n,
                       (long long)pool->num_free);
    }
    for (int64_t j = 0; j < n; j++) {
        pool->in_use[ids[j]] = 0;
        pool->free_stack[pool->num_free + j] = (int32_t)ids[j];
    }
    pool->num_free += n;
    return DK_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Block-table rows                                                                            */
/* ------------------------------------------------------------------------------------------ */

dk_status
dk_table_append(const dk_table_append_args *a, dk_error *err)
{
    static const char *op = "BlockTables.append_block_ids()";
    if (a->row < 0 || a->row >= a->table_rows) {
        return dk_fail(err, DK_ERR_VALUE, "%s: row must be in [0, %lld), got %lld", op,
                       (long long)a->table_rows, (long long)a->row);
    }
    if (a->blocks_per_kv_block < 1) {
        return dk_fail(err, DK_ERR_VALUE, "%s: blocks_per_kv_block must be >= 1, got %lld", op,
                       (long long)a->blocks_per_kv_block);
    }
    if (a->n < 0) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s: the number of block ids must be non-negative, got %lld", op,
                       (long long)a->n);
    }
    int64_t k = a->blocks_per_kv_block;
    /* Kernel ids b*k .. b*k+k-1 must be stored as int32 and, when the cache size is known,
     * name existing kernel blocks: b*k + k - 1 < limit  <=>  b < limit / k. */
    int64_t limit = (int64_t)INT32_MAX + 1;
    if (a->num_kernel_blocks > 0 && a->num_kernel_blocks < limit) {
        limit = a->num_kernel_blocks;
    }
    int64_t max_id = limit / k;
    for (int64_t j = 0; j < a->n; j++) {
        int64_t b = a->block_ids[j];
        if (b < 0) {
            return dk_fail(err, DK_ERR_VALUE, "%s: block ids must be non-negative, got %lld", op,
                           (long long)b);
        }
        if (b >= max_id) {
            if (a->num_kernel_blocks > 0 && a->num_kernel_blocks <= (int64_t)INT32_MAX + 1) {
                return dk_fail(err, DK_ERR_VALUE,
                               "%s: block ids must be < %lld (%lld kernel blocks, %lld per "
                               "block), got %lld",
                               op, (long long)max_id, (long long)a->num_kernel_blocks, (long long)k,
                               (long long)b);
            }
            return dk_fail(err, DK_ERR_VALUE,
                           "%s: block ids must be < %lld (int32 kernel ids, %lld per block), got "
                           "%lld",
                           op, (long long)max_id, (long long)k, (long long)b);
        }
    }
    int64_t base = 0;
    if (!a->overwrite) {
        base = a->counts[a->row * a->counts_stride];
        if (base < 0 || base > a->table_cols) {
            return dk_fail(err, DK_ERR_VALUE,
                           "%s: the installed count of row %lld must be in [0, %lld], got %lld", op,
                           (long long)a->row, (long long)a->table_cols, (long long)base);
        }
    }
    int64_t room = a->table_cols - base;
    if (a->n > room / k) {
        return dk_fail(err, DK_ERR_VALUE,
                       "%s: block ids must fit in the %lld free kernel-block columns of row %lld "
                       "(%lld per block), got %lld ids",
                       op, (long long)room, (long long)a->row, (long long)k, (long long)a->n);
    }

    int32_t *dst = a->table + a->row * a->table_stride_row + base;
    for (int64_t j = 0; j < a->n; j++) {
        int64_t first = a->block_ids[j] * k;
        for (int64_t c = 0; c < k; c++) {
            dst[j * k + c] = (int32_t)(first + c);
        }
    }
    a->counts[a->row * a->counts_stride] = (int32_t)(base + a->n * k);
    return DK_OK;
}
