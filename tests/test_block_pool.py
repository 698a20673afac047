"""diffkv.BlockPool: allocation order, free, num_free, and every error (the "BlockPool" and
"BlockPool methods" cases of error_cases.py) leaving the pool as it was."""

from __future__ import annotations

import pytest

import diffkv
from error_cases import check, public_case, public_cases


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


@pytest.mark.parametrize("name", [case.name for case in public_cases()["BlockPool methods"]])
def test_errors_change_nothing(name):
    """Each refusal of error_cases.py's "BlockPool methods" leaves its pool as it was."""
    case = public_case(name)
    pool = case.env
    state = _state(pool)
    check(case)
    _assert_unchanged(pool, state)


def test_exhausted_pool_still_allocates_what_is_free():
    case = public_case("pool exhausted")
    check(case)
    assert case.env.allocate(3) == [2, 3, 4]


def test_free_accepts_iterables():
    pool = diffkv.BlockPool(3)
    ids = pool.allocate(3)
    pool.free(tuple(ids[:1]))
    pool.free(iter(ids[1:2]))
    pool.free(range(2, 3))
    assert pool.num_free == 3
