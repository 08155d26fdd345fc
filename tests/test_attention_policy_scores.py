"""The attention-aware policy's arithmetic, checked by hand: a block's score is its softmax mass halved every
HALF_LIFE ticks; promotion needs a decayed score of PROMOTE_SCORE, replacement a score PREFER_MARGIN times the
resident's, and victims go coldest first, never a pinned or excluded block."""

import math

import numpy as np
import pytest

from tierkv.blocks import Block, Tier
from tierkv.policy.attention import HALF_LIFE, PREFER_MARGIN, PROMOTE_SCORE, AttentionPolicy

SLOT = 4096


def make(count: int, tier: Tier = Tier.DEVICE) -> tuple[AttentionPolicy, list[Block]]:
    policy = AttentionPolicy()
    blocks = [Block(i, 0, tier, i, SLOT, tokens=4, index=i) for i in range(count)]
    for block in blocks:
        policy.on_insert(block, tick=0)
    return policy, blocks


def attend(policy: AttentionPolicy, tick: int, masses: dict[int, float]) -> None:
    policy.on_attention(0, tick, np.array(list(masses), dtype=np.int64), np.array(list(masses.values())))


def test_scores_decay_by_half_every_half_life():
    policy, (a, b) = make(2)
    attend(policy, 0, {a.id: 0.5})
    attend(policy, int(HALF_LIFE), {b.id: 0.5})
    assert policy.score(a) == pytest.approx(0.25)  # one half-life old
    assert policy.score(b) == pytest.approx(0.5)
    policy.on_access(0, int(3 * HALF_LIFE))
    assert policy.score(a) == pytest.approx(0.5 / 8)
    assert policy.score(b) == pytest.approx(0.5 / 4)


def test_the_block_attended_longest_ago_is_the_colder_victim():
    policy, (old, new) = make(2)
    attend(policy, 0, {old.id: 0.5})
    attend(policy, 64, {new.id: 0.5})
    assert policy.victims(Tier.DEVICE, SLOT, 2) == [old, new]


def test_replacement_needs_the_margin():
    assert PREFER_MARGIN > 1
    policy, (resident, close, far) = make(3)
    attend(policy, 0, {resident.id: 0.2, close.id: 0.2 * (1 + PREFER_MARGIN) / 2, far.id: 0.2 * PREFER_MARGIN * 1.1})
    assert not policy.prefers(close, resident)  # hotter, but not by the margin: no swap back and forth
    assert policy.prefers(far, resident)
    assert not policy.prefers(resident, far)


def test_promotion_counts_the_decayed_score_and_ranks_hottest_first():
    policy, blocks = make(4, Tier.HOST)
    attend(policy, 0, {blocks[0].id: 2 * PROMOTE_SCORE})  # hot at tick 0, cold two half-lives later
    later = int(2 * HALF_LIFE)
    attend(policy, later, {blocks[1].id: 1.5 * PROMOTE_SCORE, blocks[2].id: 3 * PROMOTE_SCORE,
                           blocks[3].id: 0.5 * PROMOTE_SCORE})
    assert policy.score(blocks[0]) == pytest.approx(PROMOTE_SCORE / 2)
    ids = np.array([b.id for b in blocks], dtype=np.int64)
    assert policy.promotions(ids, 10) == [blocks[2].id, blocks[1].id]
    assert policy.promotions(ids, 1) == [blocks[2].id]
    policy.pin(blocks[2])
    assert policy.promotions(ids, 1) == [blocks[1].id]
    assert math.isclose(policy.score(blocks[2]), 3 * PROMOTE_SCORE)


def test_victims_skip_excluded_and_pinned_attended_blocks():
    policy, blocks = make(3)
    attend(policy, 0, {b.id: 0.1 * (i + 1) for i, b in enumerate(blocks)})
    assert policy.victims(Tier.DEVICE, SLOT, 3) == blocks
    assert policy.victims(Tier.DEVICE, SLOT, 3, exclude={blocks[0].id}) == blocks[1:]
    policy.pin(blocks[1])
    assert policy.victims(Tier.DEVICE, SLOT, 3) == [blocks[0], blocks[2]]


def test_mass_for_a_released_block_is_ignored():
    policy, (gone, kept) = make(2)
    policy.on_release(gone)
    attend(policy, 0, {gone.id: 0.9, kept.id: 0.1})
    assert policy.score(gone) == 0.0
    assert policy.victims(Tier.DEVICE, SLOT, 5) == [kept]
