"""diffkv.BlockPool: allocation order, free, num_free, and every error leaving the pool as it was."""

from __future__ import annotations

import pytest

import diffkv


def _state(pool):
    return pool.num_free, pool._free_stack.clone(), pool._in_use.clone()


def _assert_unchanged(pool, state):
    num_free, free_stack, in_use = state
    assert pool.num_free == num_free
    assert pool._free_stack.equal(free_stack)
    assert pool._in_use.equal(in_use)


def test_allocate_in_order_and_reuse():
    pool = diffkv.BlockPool(6)
    assert pool.num_blocks == 6 and pool.num_free == 6
    assert pool.allocate(0) == []
    first = pool.allocate(3)
    assert first == [0, 1, 2]
    assert pool.num_free == 3
    pool.free([1])
    assert pool.num_free == 4
    again = pool.allocate(1)
    assert again == [1]
    rest = pool.allocate(3)
    assert sorted(rest) == [3, 4, 5]
    assert pool.num_free == 0
    pool.free(first[:1] + rest)
    assert pool.num_free == 4
    assert sorted(pool.allocate(4)) == [0, 3, 4, 5]


def test_all_ids_distinct_through_churn():
    pool = diffkv.BlockPool(32)
    held = []
    for step in range(20):
        held.extend(pool.allocate(3))
        if step % 3 == 2:
            pool.free(held[::2])
            held = held[1::2]
        assert len(set(held)) == len(held)
        assert pool.num_free == 32 - len(held)
        assert all(0 <= b < 32 for b in held)


def test_exhaustion_changes_nothing():
    pool = diffkv.BlockPool(5)
    pool.allocate(2)
    state = _state(pool)
    with pytest.raises(
        RuntimeError,
        match=r"^BlockPool.allocate\(\): n must be at most the number of free blocks \(3\), got 5$",
    ):
        pool.allocate(5)
    _assert_unchanged(pool, state)
    assert pool.allocate(3) == [2, 3, 4]


def test_negative_n():
    pool = diffkv.BlockPool(2)
    state = _state(pool)
    with pytest.raises(ValueError, match=r"^BlockPool.allocate\(\): n must be non-negative, got -1$"):
        pool.allocate(-1)
    _assert_unchanged(pool, state)


def test_double_free_changes_nothing():
    pool = diffkv.BlockPool(4)
    ids = pool.allocate(3)
    pool.free([ids[0]])
    state = _state(pool)
    with pytest.raises(
        ValueError, match=r"^BlockPool.free\(\): block id 0 is not allocated \(double free\?\)$"
    ):
        pool.free([ids[1], ids[0]])
    _assert_unchanged(pool, state)


def test_repeated_id_changes_nothing():
    pool = diffkv.BlockPool(4)
    pool.allocate(3)
    state = _state(pool)
    with pytest.raises(
        ValueError, match=r"^BlockPool.free\(\): block ids must not repeat, got block id 2 twice$"
    ):
        pool.free([2, 1, 2])
    _assert_unchanged(pool, state)


def test_out_of_range_changes_nothing():
    pool = diffkv.BlockPool(4)
    pool.allocate(4)
    state = _state(pool)
    with pytest.raises(ValueError, match=r"^BlockPool.free\(\): block id must be in \[0, 4\), got 4$"):
        pool.free([0, 4])
    with pytest.raises(ValueError, match=r"^BlockPool.free\(\): block id must be in \[0, 4\), got -1$"):
        pool.free([-1])
    _assert_unchanged(pool, state)


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"^BlockPool\(\): num_blocks must be positive, got 0$"):
        diffkv.BlockPool(0)
    with pytest.raises(TypeError, match=r"^BlockPool\(\): num_blocks must be an int, got 2.0$"):
        diffkv.BlockPool(2.0)


def test_free_accepts_iterables():
    pool = diffkv.BlockPool(3)
    ids = pool.allocate(3)
    pool.free(tuple(ids[:1]))
    pool.free(iter(ids[1:2]))
    pool.free(range(2, 3))
    assert pool.num_free == 3


def test_type_errors_change_nothing():
    pool = diffkv.BlockPool(3)
    pool.allocate(2)
    state = _state(pool)
    with pytest.raises(TypeError, match=r"^BlockPool.allocate\(\): n must be an int, got 2.0$"):
        pool.allocate(2.0)
    with pytest.raises(TypeError, match=r"^BlockPool.allocate\(\): n must be an int, got True$"):
        pool.allocate(True)
    with pytest.raises(TypeError, match=r"^BlockPool.free\(\): block_ids\[1\] must be an int, got 'a'$"):
        pool.free([0, "a"])
    with pytest.raises(TypeError, match=r"^BlockPool.free\(\): block_ids must be a sequence of ints, got 5$"):
        pool.free(5)
    _assert_unchanged(pool, state)
