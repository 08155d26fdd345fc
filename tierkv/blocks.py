"""The block table: which block holds which tokens, on which tier and slot. Plain Python, no tensors.

Every (sequence row, layer) owns an ordered list of block ids; a block covers ``tokens`` consecutive
tokens (all full except the last, the *tail*). Beam reorder, batch selection and crop are edits of these
lists with refcounts — no data is copied; a shared tail is copied on the next write (copy-on-write).

::

    row 0, layer 3:  [b7: 16 tok, host] [b9: 16 tok, disk] [b12: 5 tok, device]  <- tail
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass


class Tier(enum.IntEnum):
    """Storage tiers, fastest first; a demotion moves a block to ``tier + 1``."""

    DEVICE = 0
    HOST = 1
    DISK = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class Block:
    """One block's metadata. ``slot`` indexes the pool of ``tier`` for blocks of ``slot_bytes``."""

    id: int
    layer: int
    tier: Tier
    slot: int
    slot_bytes: int
    tokens: int = 0
    refcount: int = 1
    last_access: int = 0


class BlockTable:
    """Blocks and the per-(row, layer) lists that order them.

    Invariants (checked by :meth:`check`): every listed block is live with ``refcount`` equal to the number
    of lists holding it; all rows of a layer hold the same number of tokens; only a list's last block may be
    partly filled.
    """

    def __init__(self) -> None:
        self.blocks: dict[int, Block] = {}
        self.rows: dict[int, list[list[int]]] = {}  # layer -> row -> block ids
        self._ids = itertools.count()

    def new_block(self, layer: int, tier: Tier, slot: int, slot_bytes: int) -> Block:
        block = Block(next(self._ids), layer, tier, slot, slot_bytes)
        self.blocks[block.id] = block
        return block

    def layer_rows(self, layer: int) -> list[list[int]]:
        return self.rows.get(layer, [])

    def seq_length(self, layer: int) -> int:
        rows = self.rows.get(layer)
        if not rows:
            return 0
        return sum(self.blocks[b].tokens for b in rows[0])

    def release(self, block_id: int) -> Block | None:
        """Drop one reference; return the block if that was the last one (its slot is then the caller's to free)."""
        block = self.blocks[block_id]
        block.refcount -= 1
        if block.refcount > 0:
            return None
        del self.blocks[block_id]
        return block

    def select_rows(self, layer: int, indices: list[int]) -> list[Block]:
        """Make row ``i`` a copy of old row ``indices[i]``; return blocks left without references."""
        old = self.rows.get(layer, [])
        new = [list(old[i]) for i in indices]
        for row in new:
            for block_id in row:
                self.blocks[block_id].refcount += 1
        freed = [b for row in old for block_id in row if (b := self.release(block_id)) is not None]
        self.rows[layer] = new
        return freed

    def check(self) -> None:
        """Raise ``AssertionError`` if an invariant is broken (used by tests after every operation)."""
        counts: dict[int, int] = {}
        for layer, rows in self.rows.items():
            lengths = set()
            for row in rows:
                for position, block_id in enumerate(row):
                    counts[block_id] = counts.get(block_id, 0) + 1
                    block = self.blocks[block_id]
                    if block.layer != layer:
                        raise AssertionError(f"block {block_id} of layer {block.layer} listed under layer {layer}")
                    if position < len(row) - 1 and block.tokens == 0:
                        raise AssertionError(f"empty block {block_id} in the middle of a row")
                lengths.add(sum(self.blocks[b].tokens for b in row))
            if len(lengths) > 1:
                raise AssertionError(f"rows of layer {layer} differ in length: {sorted(lengths)}")
        for block_id, block in self.blocks.items():
            if counts.get(block_id, 0) != block.refcount:
                raise AssertionError(f"block {block_id}: refcount {block.refcount} != {counts.get(block_id, 0)} uses")
