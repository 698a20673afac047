"""benchmarks/model_persist_schedule.py: the schedule model docs/fp8-log.md quotes for the e4m3
kernel's persistent form (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from model_persist_schedule import item_costs, list_spread, static_spread  # noqa: E402


def test_item_costs_follow_attn_cta_place():
    """Causal 1k rows, 2 heads, 256-key tiles: in one group of both heads the last query tile
    (1,024 keys, 4 tiles) first for head 0, then for head 1, down to the first tile (128 keys, 1
    tile); in groups of one head, head 0's tiles all before head 1's."""
    assert item_costs(1024, 2, 2, 256, True, 0.0) == [4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1]
    assert item_costs(1024, 2, 1, 256, True, 0.0) == [4, 4, 3, 3, 2, 2, 1, 1] * 2
    assert item_costs(1024, 2, 2, 256, False, 1.0) == [5.0] * 16


def test_equal_items_spread_as_their_count_allows():
    """3,072 equal items on 132 CTAs: 24 on the busiest against 23.27 on average, however
    handed out."""
    costs = item_costs(16384, 24, 1, 256, False, 1.0)
    spreads = (static_spread(costs, 132, False), static_spread(costs, 132, True), list_spread(costs, 132))
    assert all(abs(spread - 24 / (3072 / 132)) < 1e-9 for spread in spreads)


def test_the_snake_needs_one_falling_order():
    """docs/fp8-log.md's numbers: 16k causal rows, 24 heads, 256-key tiles, one tile of fixed cost
    an item -- the snake over groups of 8 heads leaves the busiest CTA 10.8 % over the mean,
    over one group of all heads 0.05 %, and the hardware's list scheduling 0.2-0.3 %."""
    by_group = {hg: item_costs(16384, 24, hg, 256, True, 1.0) for hg in (8, 24)}
    assert 1.10 < static_spread(by_group[8], 132, True) < 1.12
    assert static_spread(by_group[24], 132, True) < 1.001
    assert static_spread(by_group[24], 132, False) > 1.03  # round-robin alone does not balance
    assert all(list_spread(c, 132) < 1.004 for c in by_group.values())
