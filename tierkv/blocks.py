"""The block table: which block holds which tokens, on which tier and slot.

Every (sequence row, layer) owns an ordered list of blocks; a block covers ``block_tokens`` consecutive
tokens (all full except the last, the *tail*). All rows of a layer hold the same number of tokens, so a
layer's blocks form a grid: column ``j`` covers tokens ``[j * block_tokens, (j + 1) * block_tokens)`` of
every row. :class:`LayerRows` keeps that grid as numpy arrays — block ids, tiers and slots, ``[B, n]`` —
updated incrementally by every edit, so a decode step turns a layer's read into a few array operations
instead of a walk over block objects (vLLM keeps its worker-side block table the same way). Beam reorder,
batch selection and crop are edits of these arrays with refcounts — no data is copied; a shared tail is
copied on the next write (copy-on-write).

::

    layer 3      col 0          col 1          col 2 (tail)
    row 0:  [b7: 16 tok, host] [b9: 16, disk] [b12: 5, device]
    row 1:  [b7 (shared)     ] [b9 (shared) ] [b13: 5, device]
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np


class Tier(enum.IntEnum):
    """Storage tiers, fastest first. The order of a store's tier chain is data (``KVStore.chain``)."""

    DEVICE = 0
    HOST = 1
    DISK = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True, eq=False)
class Block:
    """One block's metadata. ``slot`` indexes the pool of ``tier`` for blocks of ``slot_bytes``;
    ``index`` is the block's position in its sequence (column ``index - LayerRows.front``)."""

    id: int
    layer: int
    tier: Tier
    slot: int
    slot_bytes: int
    tokens: int = 0
    refcount: int = 1
    index: int = 0


_VERSIONS = itertools.count()  # one sequence for every grid: a version never repeats, even in a new grid


class LayerRows:
    """One layer's grid of blocks: ``ids``/``tiers``/``slots`` as ``[B, n]`` arrays (views into buffers that
    grow geometrically, so appending a column is amortised O(B)).

    ``version`` changes with every edit that moves data to another place (new columns, tail replaced,
    rows selected, a block moved to another tier or slot), so read plans can be cached until it does.
    """

    def __init__(self, batch: int) -> None:
        self._ids = np.zeros((batch, 8), dtype=np.int64)
        self._tiers = np.zeros((batch, 8), dtype=np.int8)
        self._slots = np.zeros((batch, 8), dtype=np.int64)
        self.count = 0
        self.front = 0  # sequence index of column 0 (blocks dropped from the front before it)
        self.version = next(_VERSIONS)
        self._views()

    def _views(self) -> None:
        """Set ``batch`` and the ``[B, count]`` views ``ids``, ``tiers`` and ``slots``: plain attributes, refreshed
        by every edit that changes the count or the buffers, so the decode step reads them without a call."""
        self.batch = self._ids.shape[0]
        self.ids = self._ids[:, : self.count]
        self.tiers = self._tiers[:, : self.count]
        self.slots = self._slots[:, : self.count]

    def __len__(self) -> int:
        return self.batch

    def __getitem__(self, row: int) -> np.ndarray:
        return self.ids[row]

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.ids)

    def append_column(self, blocks: list[Block]) -> None:
        """Add one column: ``blocks[r]`` becomes row ``r``'s new last block."""
        if self.count == self._ids.shape[1]:
            self._grow()
        for r, block in enumerate(blocks):
            self.put(r, self.count, block)
        self.count += 1
        self._views()

    def put(self, row: int, column: int, block: Block) -> None:
        self._ids[row, column] = block.id
        self._tiers[row, column] = block.tier
        self._slots[row, column] = block.slot
        self.version = next(_VERSIONS)

    def moved(self, block: Block) -> None:
        """``block`` changed tier or slot: update every row that holds it (shared blocks share a column)."""
        column = block.index - self.front
        holders = self._ids[:, column] == block.id
        self._tiers[holders, column] = block.tier
        self._slots[holders, column] = block.slot
        self.version = next(_VERSIONS)

    def truncate(self, count: int) -> None:
        self.count = count
        self.version = next(_VERSIONS)
        self._views()

    def drop_front(self, columns: int) -> None:
        for array in (self._ids, self._tiers, self._slots):
            array[:, : self.count - columns] = array[:, columns : self.count].copy()
        self.count -= columns
        self.front += columns
        self.version = next(_VERSIONS)
        self._views()

    def select(self, indices: list[int]) -> None:
        self._ids, self._tiers, self._slots = self._ids[indices], self._tiers[indices], self._slots[indices]
        self.version = next(_VERSIONS)
        self._views()

    def _grow(self) -> None:
        width = 2 * self._ids.shape[1]
        for name in ("_ids", "_tiers", "_slots"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], width), dtype=old.dtype)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)
        self._views()


class BlockTable:
    """Blocks and the per-layer grids that order them.

    Invariants (checked by :meth:`check`): every listed block is live with ``refcount`` equal to the number
    of rows holding it; the grid's tiers and slots equal the blocks'; only a row's last block may be partly
    filled; every row of a layer holds the same number of tokens.
    """

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.blocks: dict[int, Block] = {}
        self.rows: dict[int, LayerRows] = {}  # layer -> its grid
        self._ids = itertools.count()

    def clear(self) -> None:
        """Forget every block and row (ids keep counting, so an old id never names a new block)."""
        self.blocks.clear()
        self.rows.clear()

    def new_block(self, layer: int, tier: Tier, slot: int, slot_bytes: int, index: int) -> Block:
        block = Block(next(self._ids), layer, tier, slot, slot_bytes, index=index)
        self.blocks[block.id] = block
        return block

    def layer_rows(self, layer: int) -> LayerRows | None:
        return self.rows.get(layer)

    def seq_length(self, layer: int) -> int:
        rows = self.rows.get(layer)
        if rows is None or rows.count == 0:
            return 0
        return (rows.count - 1) * self.block_tokens + self.tail(layer).tokens

    def tail(self, layer: int, row: int = 0) -> Block:
        """The last block of ``row`` of ``layer`` (which must hold at least one)."""
        rows = self.rows[layer]
        return self.blocks[int(rows.ids[row, rows.count - 1])]

    def residency(self, token_bytes: Mapping[int, int]) -> tuple[list[int], list[int]]:
        """Blocks and resident KV bytes per tier (list index: the tier's value), from the grids with numpy: each
        block once (a shared one is listed by several rows), a full block holding ``block_tokens`` and a row's
        last as many as its tail (every row's tail holds as many). ``token_bytes``: layer -> K/V bytes per token.
        No Python per block: ``stats()`` is called every step by harnesses, and contexts hold millions of them."""
        counts, nbytes = np.zeros(len(Tier), dtype=np.int64), np.zeros(len(Tier), dtype=np.int64)
        for layer, rows in self.rows.items():
            if rows.count == 0:
                continue
            _, first = np.unique(rows.ids, return_index=True)
            held = np.bincount(rows.tiers.ravel()[first].astype(np.int64), minlength=len(Tier))
            tail_ids, tail_first = np.unique(rows.ids[:, -1], return_index=True)
            tails = np.bincount(rows.tiers[:, -1][tail_first].astype(np.int64), minlength=len(Tier))
            short = self.block_tokens - self.blocks[int(tail_ids[0])].tokens  # empty slots of each tail
            counts += held
            nbytes += (held * self.block_tokens - tails * short) * token_bytes[layer]
        return counts.tolist(), nbytes.tolist()

    def place(self, block: Block, tier: Tier, slot: int) -> None:
        """Move ``block`` to ``slot`` of ``tier`` in the table (its data is the caller's to copy first)."""
        block.tier, block.slot = tier, slot
        rows = self.rows.get(block.layer)
        if rows is not None and 0 <= block.index - rows.front < rows.count:
            rows.moved(block)

    def release(self, block_id: int) -> Block | None:
        """Drop one reference; return the block if that was the last one (its slot is then the caller's to free)."""
        block = self.blocks[block_id]
        block.refcount -= 1
        if block.refcount > 0:
            return None
        del self.blocks[block_id]
        return block

    def select_rows(self, layer: int, indices: list[int]) -> list[Block]:
        """Make row ``i`` a copy of old row ``indices[i]``; return blocks left without references.

        Only blocks whose number of holders changes are touched (found with numpy): a beam reorder, run every
        step, changes the shared prefix's holders not at all, so it costs O(diverging tails), not O(blocks)."""
        rows = self.rows[layer]
        before, held_before = np.unique(rows.ids, return_counts=True)
        rows.select(indices)
        after, held_after = np.unique(rows.ids, return_counts=True)
        change = -held_before
        change[np.searchsorted(before, after)] += held_after  # a selection only copies rows: after ⊆ before
        freed = []
        for block_id, delta in zip(before[change != 0].tolist(), change[change != 0].tolist()):
            block = self.blocks[block_id]
            block.refcount += delta
            if block.refcount == 0:
                del self.blocks[block_id]
                freed.append(block)
        return freed

    def check(self) -> None:
        """Raise ``AssertionError`` if an invariant is broken (used by tests after every operation)."""
        counts: dict[int, int] = {}
        for layer, rows in self.rows.items():
            lengths = set()
            for r in range(rows.batch):
                total = 0
                for column, block_id in enumerate(rows.ids[r].tolist()):
                    counts[block_id] = counts.get(block_id, 0) + 1
                    block = self.blocks[block_id]
                    if block.layer != layer or block.index != rows.front + column:
                        raise AssertionError(f"block {block_id} (layer {block.layer}, index {block.index}) listed "
                                             f"under layer {layer} column {column}")
                    if (int(rows.tiers[r, column]), int(rows.slots[r, column])) != (block.tier, block.slot):
                        raise AssertionError(f"block {block_id}: the grid says tier/slot "
                                             f"{rows.tiers[r, column]}/{rows.slots[r, column]}, "
                                             f"the block {block.tier}/{block.slot}")
                    if column < rows.count - 1 and block.tokens != self.block_tokens:
                        raise AssertionError(f"block {block_id} in the middle of a row is not full")
                    if block.tokens == 0:
                        raise AssertionError(f"empty block {block_id} listed")
                    total += block.tokens
                lengths.add(total)
            if len(lengths) > 1:
                raise AssertionError(f"rows of layer {layer} differ in length: {sorted(lengths)}")
        for block_id, block in self.blocks.items():
            if counts.get(block_id, 0) != block.refcount:
                raise AssertionError(f"block {block_id}: refcount {block.refcount} != {counts.get(block_id, 0)} uses")
