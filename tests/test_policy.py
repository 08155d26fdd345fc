"""The contract every registered policy keeps, and the registry's error."""

import pytest

from tierkv.blocks import Block, Tier
from tierkv.errors import InvalidConfigError
from tierkv.policy import POLICIES, make_policy


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_victims_contract(name):
    policy = make_policy(name)
    blocks = [Block(i, 0, Tier.DEVICE, i, 4096, tokens=4) for i in range(6)]
    for tick, block in enumerate(blocks):
        policy.on_insert(block, tick)
    for block in blocks[:3]:
        policy.on_access(block, 10)
    victims = policy.victims(blocks, 2)
    assert len(victims) == 2 and len({v.id for v in victims}) == 2
    assert all(v in blocks for v in victims)
    assert policy.victims(blocks, 0) == [] and policy.victims([], 3) == []


def test_lru_demotes_least_recent_first():
    policy = make_policy("lru")
    blocks = [Block(i, 0, Tier.DEVICE, i, 4096) for i in range(4)]
    for tick, block in enumerate(blocks):
        policy.on_insert(block, tick)
    policy.on_access(blocks[0], 9)
    assert [b.id for b in policy.victims(blocks, 2)] == [1, 2]


def test_unknown_policy_lists_valid_names():
    with pytest.raises(InvalidConfigError, match="valid policies: lru"):
        make_policy("belady")
