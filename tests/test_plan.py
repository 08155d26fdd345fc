"""Read plans (tierkv.store.plan) against a walk over every block of the grid, and the store's plan cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import kv, make_store

from tierkv.blocks import Block, LayerRows, Tier
from tierkv.store.plan import ReadPlan, build_plan, build_selection_plan

CHAIN = (Tier.DEVICE, Tier.HOST, Tier.DISK)


def random_rows(batch: int, columns: int, seed: int) -> LayerRows:
    """A grid whose blocks sit on random tiers, with distinct slots per tier (runs of one tier are common)."""
    rng = np.random.default_rng(seed)
    rows = LayerRows(batch)
    next_slot = dict.fromkeys(CHAIN, 0)
    block_id = 0
    for column in range(columns):
        blocks = []
        for _ in range(batch):
            tier = CHAIN[int(rng.integers(0, 3))]
            blocks.append(Block(block_id, 0, tier, next_slot[tier], 4096, tokens=4, index=column))
            next_slot[tier] += 1
            block_id += 1
        rows.append_column(blocks)
    return rows


def placements(plan: ReadPlan) -> dict[tuple[int, int], tuple[Tier, int]]:
    """(row, plan column) -> (tier, slot) as the plan's runs say, each position at most once."""
    out: dict[tuple[int, int], tuple[Tier, int]] = {}
    for part in plan.parts:
        for run in part.runs:
            for k in range(run.hi - run.lo):
                position = (run.row, run.column + k)
                assert position not in out, f"{position} is read twice"
                out[position] = (part.tier, int(part.slots[run.lo + k]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_range_plan_reads_every_block_once_from_its_tier_slowest_first(seed):
    rows = random_rows(batch=3, columns=10, seed=seed)
    first, stop = 2, 9
    plan = build_plan(0, rows, first, stop, CHAIN)
    assert (plan.layer, plan.first, plan.blocks) == (0, first, stop - first)
    expected = {(r, c - first): (Tier(int(rows.tiers[r, c])), int(rows.slots[r, c]))
                for r in range(3) for c in range(first, stop)}
    assert placements(plan) == expected
    order = [CHAIN.index(tier) for tier in plan.tiers]
    assert order == sorted(order, reverse=True)  # the slowest tier's read is submitted first
    for part in plan.parts:
        assert part.blocks == len(part.slots) == sum(run.hi - run.lo for run in part.runs)
        assert part.tail_blocks == 0  # the plan stops before the layer's last column
        for a, b in zip(part.runs, part.runs[1:]):  # a run ends where its row or its consecutive columns do
            assert a.hi == b.lo and (a.row != b.row or a.column + (a.hi - a.lo) != b.column)


def test_the_tail_column_is_counted_per_tier():
    rows = random_rows(batch=4, columns=5, seed=7)
    plan = build_plan(0, rows, 0, 5, CHAIN)
    tails = {tier: int(np.count_nonzero(rows.tiers[:, -1] == tier)) for tier in CHAIN}
    assert {part.tier: part.tail_blocks for part in plan.parts} == {t: n for t, n in tails.items() if n}


def test_a_selection_plan_reads_each_rows_columns_and_skips_minus_one():
    rows = random_rows(batch=2, columns=8, seed=3)
    columns = np.array([[0, 3, 7], [5, -1, 6]])
    plan = build_selection_plan(0, rows, columns, CHAIN)
    assert plan.blocks == 3 and plan.first == 0
    expected = {(r, j): (Tier(int(rows.tiers[r, c])), int(rows.slots[r, c]))
                for r in range(2) for j, c in enumerate(columns[r]) if c >= 0}
    assert placements(plan) == expected
    assert sum(part.tail_blocks for part in plan.parts) == 1  # row 0 selected the last column (7)


def test_only_keeps_one_tiers_part():
    rows = random_rows(batch=2, columns=6, seed=1)
    plan = build_plan(0, rows, 0, 6, CHAIN)
    for tier in plan.tiers:
        only = plan.only(tier)
        assert only.tiers == (tier,) and only.parts[0] is next(p for p in plan.parts if p.tier == tier)
        assert (only.first, only.blocks) == (plan.first, plan.blocks)


def test_the_store_caches_a_plan_until_the_layers_grid_changes(tmp_path):
    store = make_store(tmp_path, device_slots=16, host_slots=16)
    store.append(0, *kv(1, 6))  # a full block and an open tail of 2
    plan = store.plan_read(0, 0, 6)
    assert store.plan_read(0, 0, 6) is plan
    store.append(0, *kv(1, 1, seed=1))  # written in place into the open tail: nothing moves
    assert store.plan_read(0, 0, 7) is plan
    store.append(0, *kv(1, 2, seed=2))  # a new column
    grown = store.plan_read(0, 0, 9)
    assert grown is not plan and grown.blocks == 3
    store.demote([store.table.blocks[int(store.table.rows[0].ids[0, 0])]])  # a block moved: a new plan
    moved = store.plan_read(0, 0, 9)
    assert moved is not grown and Tier.HOST in moved.tiers
    dest = torch.empty(2, 1, 2, 12, 8)
    store.read_into(0, moved, dest)
    torch.testing.assert_close(dest[..., :9, :], store.read_tokens(0), rtol=0, atol=0)
    assert store.plan_read(0, 8, 8).blocks == 0  # an empty range reads nothing
    store.close()
