"""A pinned block (a write-back of it in flight) is never offered as a victim, on any tier: not after it moves
while pinned (the write-back's own completion retargets it), only once it is unpinned."""

import pytest

from tierkv.blocks import Block, Tier
from tierkv.policy import POLICIES, make_policy

SLOT = 4096


@pytest.fixture(params=sorted(POLICIES))
def policy(request):
    return make_policy(request.param)


def test_a_block_moved_while_pinned_is_no_victim_until_unpinned(policy):
    blocks = []
    for i in range(4):
        block = Block(i, 0, Tier.DEVICE, i, SLOT, tokens=4, index=i)
        policy.on_insert(block, tick=i)
        blocks.append(block)
    moving = blocks[0]
    policy.pin(moving)
    moving.tier = Tier.HOST
    policy.on_move(moving, Tier.DEVICE)
    assert policy.victims(Tier.HOST, SLOT, 10) == []
    assert moving not in policy.victims(Tier.DEVICE, SLOT, 10)
    policy.unpin(moving)
    assert policy.victims(Tier.HOST, SLOT, 10) == [moving]
    assert moving not in policy.victims(Tier.DEVICE, SLOT, 10)
