"""The contract every registered policy keeps (event hooks, an index, recency), and the registry's error."""

import numpy as np
import pytest

from tierkv.blocks import Block, Tier
from tierkv.errors import InvalidConfigError
from tierkv.policy import POLICIES, make_policy

SLOT = 4096


def inserted(policy, layers: int = 2, per_layer: int = 4) -> list[Block]:
    """Blocks created in time order, interleaved over ``layers`` (as decoding makes them)."""
    blocks = []
    for i in range(layers * per_layer):
        block = Block(i, i % layers, Tier.DEVICE, i, SLOT, tokens=4, index=i // layers)
        policy.on_insert(block, tick=i // layers)
        blocks.append(block)
    return blocks


@pytest.fixture(params=sorted(POLICIES))
def policy(request):
    return make_policy(request.param)


def test_victims_are_distinct_live_blocks_of_the_tier(policy):
    blocks = inserted(policy)
    victims = policy.victims(Tier.DEVICE, SLOT, 3)
    assert len(victims) == 3 and len({v.id for v in victims}) == 3 and all(v in blocks for v in victims)
    assert policy.victims(Tier.DEVICE, SLOT, 0) == []
    assert policy.victims(Tier.HOST, SLOT, 3) == []  # nothing there
    assert policy.victims(Tier.DEVICE, 2 * SLOT, 3) == []  # no blocks of that size
    assert len(policy.victims(Tier.DEVICE, SLOT, 100)) == len(blocks)


def test_excluded_pinned_and_released_blocks_are_never_victims(policy):
    blocks = inserted(policy)
    policy.pin(blocks[0])
    policy.on_release(blocks[1])
    victims = policy.victims(Tier.DEVICE, SLOT, 100, exclude={blocks[2].id})
    assert {v.id for v in victims} == {b.id for b in blocks[3:]}
    policy.unpin(blocks[0])
    assert blocks[0] in policy.victims(Tier.DEVICE, SLOT, 100)


def test_moved_blocks_are_victims_of_their_new_tier(policy):
    blocks = inserted(policy)
    blocks[0].tier = Tier.HOST
    policy.on_move(blocks[0], Tier.DEVICE)
    assert policy.victims(Tier.HOST, SLOT, 5) == [blocks[0]]
    assert blocks[0] not in policy.victims(Tier.DEVICE, SLOT, 100)


def test_recency_decides_between_layers(policy):
    """A layer read recently keeps its blocks; the victims come from the layer read longest ago. A policy
    that ignores recency (e.g. the first n candidates) fails here."""
    blocks = inserted(policy, layers=2, per_layer=4)
    policy.on_access(0, tick=10)
    policy.on_access(1, tick=9)
    victims = policy.victims(Tier.DEVICE, SLOT, 4)
    assert {v.layer for v in victims} == {1}
    policy.on_access(1, tick=11)
    assert {v.layer for v in policy.victims(Tier.DEVICE, SLOT, 4)} == {0}
    assert len(blocks) == 8


def test_recency_decides_within_a_layer(policy):
    """Blocks read on their own (sparse access) are the last to go."""
    blocks = inserted(policy, layers=1, per_layer=5)
    policy.on_access(0, tick=20, block_ids=[blocks[0].id, blocks[1].id])
    victims = policy.victims(Tier.DEVICE, SLOT, 3)
    assert blocks[0] not in victims and blocks[1] not in victims


def test_lru_is_fifo_over_a_cyclic_scan():
    """Exact decoding reads every layer each step: LRU then demotes the oldest blocks, spread over layers."""
    policy = make_policy("lru")
    blocks = inserted(policy, layers=2, per_layer=3)
    for tick in range(3, 6):
        for layer in range(2):
            policy.on_access(layer, tick)
    assert [b.id for b in policy.victims(Tier.DEVICE, SLOT, 4)] == [0, 1, 2, 3]
    assert len(blocks) == 6


def test_lru_takes_a_layer_steps_reads_as_one_array_and_orders_by_last_read():
    """Sparse attention names the blocks it read as an array (one vectorized event); a block read on its own
    goes after every block read or inserted before that, and before those inserted after it."""
    policy = make_policy("lru")
    blocks = inserted(policy, layers=1, per_layer=4)  # ticks 0..3
    policy.on_access(0, tick=5, block_ids=np.array([blocks[0].id, blocks[2].id, 999]))  # 999: never inserted
    late = Block(4, 0, Tier.DEVICE, 4, SLOT, tokens=4, index=4)
    policy.on_insert(late, tick=7)
    assert [b.id for b in policy.victims(Tier.DEVICE, SLOT, 5)] == [1, 3, 0, 2, 4]
    policy.on_access(0, tick=8, block_ids=np.array([blocks[1].id]))
    assert [b.id for b in policy.victims(Tier.DEVICE, SLOT, 5, exclude={3})] == [0, 2, 4, 1]


def test_unknown_policy_lists_valid_names():
    with pytest.raises(InvalidConfigError, match="valid policies: attention, lru"):
        make_policy("belady")


# ------------------------------------------------------------------ the attention policy's vectorized events
def test_attention_mass_arrives_as_arrays_and_repeated_ids_add_up():
    policy = make_policy("attention")
    blocks = inserted(policy, layers=1, per_layer=3)
    a, b, c = blocks
    policy.on_attention(0, 4, np.array([a.id, a.id, b.id, 99]), np.array([0.2, 0.3, 0.1, 0.9]))  # 99: unknown
    assert policy.score(a) == pytest.approx(0.5) and policy.score(b) == pytest.approx(0.1)
    assert policy.score(c) == 0.0
    assert policy.victims(Tier.DEVICE, SLOT, 3) == [c, b, a]  # never attended first, then by ascending score


def test_attention_victims_follow_mass_received_after_a_block_was_indexed():
    """The index keeps the score a block had when it was placed; mass only adds, so a block that gained
    since must not be offered before one that did not."""
    policy = make_policy("attention")
    a, b = inserted(policy, layers=1, per_layer=2)
    policy.on_attention(0, 0, np.array([a.id, b.id]), np.array([0.1, 0.2]))
    assert policy.victims(Tier.DEVICE, SLOT, 2) == [a, b]
    policy.on_attention(0, 1, np.array([a.id]), np.array([1.0]))
    assert policy.victims(Tier.DEVICE, SLOT, 2) == [b, a]
    a.tier = Tier.HOST
    policy.on_move(a, Tier.DEVICE)
    assert policy.victims(Tier.HOST, SLOT, 2) == [a] and policy.victims(Tier.DEVICE, SLOT, 2) == [b]
    policy.on_release(b)
    assert policy.victims(Tier.DEVICE, SLOT, 2) == []


def test_attention_promotions_are_ids_hottest_first_within_the_limit():
    policy = make_policy("attention")
    blocks = inserted(policy, layers=1, per_layer=4)
    ids = np.array([b.id for b in blocks])
    policy.on_attention(0, 0, ids, np.array([0.3, 0.9, 0.01, 0.5]))
    assert policy.promotions(np.repeat(ids, 2), 2) == [blocks[1].id, blocks[3].id]  # 0.01 is below the bar
    policy.pin(blocks[1])
    assert policy.promotions(ids, 5) == [blocks[3].id, blocks[0].id]
    assert make_policy("lru").promotions(ids, 5) == []
