"""The block table's grids and the store's read plans: incremental arrays, cached plans, runs."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import kv, make_store

from tierkv.blocks import Tier


def test_grid_tracks_every_move(tmp_path):
    store = make_store(tmp_path, device_slots=4, host_slots=4, block_tokens=4)
    store.append(0, *kv(2, 14))  # 4 columns: 3 full blocks and an open tail per row
    rows = store.table.rows[0]
    assert rows.ids.shape == (2, 4)
    full = [store.table.blocks[int(b)] for b in rows.ids[0, :2]]
    store.demote(full)
    assert (rows.tiers[0, :2] != Tier.DEVICE).all()
    store.check()


def test_plans_are_cached_until_the_grid_changes(tmp_path):
    store = make_store(tmp_path, device_slots=16, host_slots=16, block_tokens=4)
    store.append(0, *kv(1, 6))
    plan = store.plan_read(0, 0, 6)
    store.append(0, *kv(1, 1))  # into the open tail: no place changes
    assert store.plan_read(0, 0, 7) is plan
    store.append(0, *kv(1, 2))  # opens a new column
    assert store.plan_read(0, 0, 9) is not plan
    assert store.plan_read(0, 0, 9).blocks == 3


def test_a_plan_groups_each_tier_into_runs(tmp_path):
    store = make_store(tmp_path, device_slots=4, host_slots=32, block_tokens=4)
    store.append(0, *kv(1, 40))  # 10 blocks: the oldest go to the host, the newest stay on the device
    plan = store.plan_read(0, 0, 40)
    assert plan.blocks == 10 and set(plan.tiers) <= {Tier.HOST, Tier.DEVICE}
    for part in plan.parts:
        covered = sum(run.hi - run.lo for run in part.runs)
        assert covered == part.blocks and len(part.runs) <= 2


def test_a_layers_disk_blocks_read_as_few_runs(tmp_path):
    """Two layers fill in interleaved chunks (a chunked prefill); each layer's disk blocks still coalesce."""
    store = make_store(tmp_path, device_slots=4, host_slots=4, block_tokens=4, disk_bytes=2**23, extent_slots=64)
    for _ in range(8):
        for layer in range(2):
            store.append(layer, *kv(1, 8))
    store.writeback.reap(wait=True)
    for layer in range(2):
        disk = [part for part in store.plan_read(layer, 0, 64).parts if part.tier == Tier.DISK][0]
        columns = np.concatenate([np.arange(run.column, run.column + run.hi - run.lo) for run in disk.runs])
        offsets = disk.slots - columns  # constant along a run of slots in sequence order
        assert disk.blocks >= 8 and np.count_nonzero(np.diff(offsets)) <= 2, disk.slots.tolist()


@pytest.mark.parametrize("cut", [1, 3])
def test_bytes_past_a_blocks_tokens_are_zero(tmp_path, cut):
    """Partial blocks hold zeros past their tokens wherever they go (checksums and content addresses of the
    next issues hash whole slots)."""
    store = make_store(tmp_path, device_slots=8, host_slots=8, block_tokens=4)
    store.append(0, *kv(1, 12))
    store.crop(0, cut)  # the last block keeps 4 - cut tokens
    tail = store.table.tail(0)
    store.demote([tail])
    store.demote([tail])
    assert tail.tier == Tier.DISK
    raw = store.transfer.read_blocks(store.layouts[0], Tier.DISK, [tail.slot])[0]  # [2, H, 4, D]
    assert raw[:, :, tail.tokens :].abs().sum() == 0 and raw[:, :, : tail.tokens].abs().sum() > 0
    torch_ref = store.read_tokens(0)
    assert torch_ref.shape[3] == 12 - cut
    store.close()


def test_a_layer_emptied_and_refilled_gets_a_fresh_plan(tmp_path):
    """Regression (found by the property test): a new grid restarted its version at 0, so a plan cached for
    the old grid could come back for the new one."""
    store = make_store(tmp_path, device_slots=16, host_slots=16, block_tokens=4)
    store.append(0, *kv(1, 2, seed=1))
    store.read_tokens(0)
    store.crop(0, 2)
    keys, values = kv(1, 1, seed=2)
    store.append(0, keys, values)
    got = store.read_tokens(0)
    assert got.shape[3] == 1
    assert (got[0] == keys).all() and (got[1] == values).all()
    store.close()
