"""A model of how a persistent kernel's static schedule spreads query tiles over the SMs.

A persistent kernel runs min(items, SMs) CTAs and hands each its items statically; the
one-CTA-per-tile grid leaves that to the hardware, which starts the next CTA (item) wherever
an SM frees up: list scheduling in the grid's order.  This model takes attn_cta_place's order
(cuda/attention_common.cuh: head within a group of `head_group` heads fastest, then the query
tile from the last -- most keys under a causal mask -- to the first, then the head group, then
the batch row), each item's cost in key tiles plus a fixed cost per item, and reports the
busiest CTA's work over the mean (1.0 is a perfect spread) for:

  - round-robin: CTA c takes items c, c + G, c + 2G, .. (G CTAs);
  - snake: the same waves, every other one reversed (CTA c takes the wave's G - 1 - c-th item);
  - list: the hardware's dynamic start of one CTA per item, in the grid's order.

One row of `tokens` queries and keys (bottom-right causal or no mask), 128-query tiles, key
tiles of `key_tile` keys.  docs/fp8-log.md quotes it for the e4m3 kernel's persistent form (256-key
tiles): under a causal mask the cost falls within each head group and jumps back at the next,
which the snake does not balance; one group of all heads keeps the cost falling.

    python benchmarks/model_persist_schedule.py [--tokens 16384] [--heads 24] [--sms 132]
        [--key-tile 256] [--fixed 1.0] [--head-groups 8,24] [--mask causal]
"""

from __future__ import annotations

import argparse
import heapq

BM = 128  # query rows per tile (ATTN_BM)


def item_costs(tokens: int, heads: int, head_group: int, key_tile: int, causal: bool, fixed: float):
    """Each item's cost, in key tiles plus `fixed`, in attn_cta_place's order (one batch row)."""
    tiles_per_row = -(-tokens // BM)
    costs = []
    for k in range(heads * tiles_per_row):
        rest = k // head_group
        tile_rev = rest % tiles_per_row
        q0 = (tiles_per_row - 1 - tile_rev) * BM
        last = min(q0 + BM, tokens) - 1  # the tile's last query row: its furthest key
        keys = last + 1 if causal else tokens
        costs.append(-(-keys // key_tile) + fixed)
    return costs


def static_spread(costs: list[float], ctas: int, snake: bool) -> float:
    """Busiest CTA's work over the mean, items handed out in waves of `ctas`."""
    work = [0.0] * ctas
    for i, cost in enumerate(costs):
        wave, pos = divmod(i, ctas)
        work[ctas - 1 - pos if snake and wave % 2 else pos] += cost
    return max(work) / (sum(costs) / ctas)


def list_spread(costs: list[float], ctas: int) -> float:
    """The same for list scheduling in order (each item to the SM that frees up first)."""
    free = [0.0] * ctas
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free) / (sum(costs) / ctas)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--key-tile", type=int, default=256)
    ap.add_argument("--fixed", type=float, default=1.0, help="fixed cost per item, in key tiles")
    ap.add_argument("--head-groups", default="8,24")
    ap.add_argument("--mask", choices=("causal", "none"), default="causal")
    args = ap.parse_args()
    shape = f"1 x {args.heads} heads x {args.tokens} tokens, {args.mask}"
    print(f"{shape}, {args.key_tile}-key tiles, {args.sms} SMs")
    print("head group | round-robin | snake | list (one CTA per tile)")
    for hg in (int(x) for x in args.head_groups.split(",")):
        costs = item_costs(args.tokens, args.heads, hg, args.key_tile, args.mask == "causal", args.fixed)
        rr = static_spread(costs, args.sms, snake=False)
        sn = static_spread(costs, args.sms, snake=True)
        li = list_spread(costs, args.sms)
        print(f"{hg:10d} | {rr:11.4f} | {sn:5.4f} | {li:.4f}")


if __name__ == "__main__":
    main()
