"""Read plans: which slots of which tier fill which part of a layer's staging, as a few index arrays.

A plan covers whole block columns ``[first, first + blocks)`` of one layer's grid; column ``i`` of the
plan lands at tokens ``[i * block_tokens, (i + 1) * block_tokens)`` of the destination. Per source tier
it holds the slots in destination order and the *runs* of destination positions they fill — a run is a
stretch of consecutive columns of one row, so it is one strided view of the destination and one
``index_select`` (or one batched disk read) however many blocks it holds::

    row 0:  [host host host disk disk dev ]      parts: host  slots [5 9 13]   runs (0..3 -> row 0, col 0)
                                                        disk  slots [2 3]      runs (0..2 -> row 0, col 3)
                                                        device slots [7]       runs (0..1 -> row 0, col 5)

Plans are immutable and cached by the store until the layer's grid changes (its ``version``), so a decode
step builds none: appending a token to an open tail changes no place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from tierkv.blocks import LayerRows, Tier


@dataclass(frozen=True, slots=True)
class Run:
    """Slots ``[lo, hi)`` of a part land in row ``row``, columns ``[column, column + hi - lo)`` of the plan."""

    lo: int
    hi: int
    row: int
    column: int


@dataclass(frozen=True, slots=True)
class TierPart:
    """The blocks a plan reads from one tier: ``slots`` in destination order, grouped into ``runs``.

    ``tail_blocks`` of them sit in the layer's last column, which may be partly filled (the byte count of
    a read uses the tail's length at read time)."""

    tier: Tier
    slots: np.ndarray  # [n] int64
    runs: tuple[Run, ...]
    tail_blocks: int
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # the tier's derived index tensors

    @property
    def blocks(self) -> int:
        return len(self.slots)


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Columns ``[first, first + blocks)`` of ``layer`` (grid columns), per source tier, slowest tier first."""

    layer: int
    first: int
    blocks: int
    parts: tuple[TierPart, ...]

    def only(self, tier: Tier) -> ReadPlan:
        """The same plan restricted to one source tier (for per-link benchmarks and timing)."""
        return dataclasses.replace(self, parts=tuple(part for part in self.parts if part.tier == tier))

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(part.tier for part in self.parts)


def build_plan(layer: int, rows: LayerRows, first: int, stop: int, chain: tuple[Tier, ...]) -> ReadPlan:
    """The plan for grid columns ``[first, stop)`` of ``rows``: a handful of numpy operations, no loop over
    blocks (only over tiers and the runs found)."""
    columns = stop - first
    tiers = rows.tiers[:, first:stop].ravel()  # [B * columns], row-major: position = row * columns + column
    slots = rows.slots[:, first:stop].ravel()
    last = np.arange(first, stop) == rows.count - 1  # [columns]: the plan column of the layer's tail
    return ReadPlan(layer, first, columns, _parts(tiers, slots, np.tile(last, rows.batch), columns, chain))


def build_selection_plan(layer: int, rows: LayerRows, columns: np.ndarray, chain: tuple[Tier, ...]) -> ReadPlan:
    """The plan for a different set of grid columns per row (sparse attention): ``columns`` ``[B, K]``; plan
    column ``j`` of row ``r`` is grid column ``columns[r, j]``, or nothing where it is -1 (that part of the
    destination is left as it is: sparse attention keeps blocks of earlier steps there). ``first`` is then
    row 0's first column (the plan is not a range: it is never cached, nor read ahead)."""
    batch, count = columns.shape
    skip = columns < 0
    picked = (np.arange(batch)[:, None], np.where(skip, 0, columns))
    tiers, slots = rows.tiers[picked].ravel(), rows.slots[picked].ravel()
    if skip.any():
        tiers = np.where(skip.ravel(), -1, tiers)  # no tier: not read
    last = (columns == rows.count - 1).ravel()
    return ReadPlan(layer, int(columns[0, 0]) if count else 0, count, _parts(tiers, slots, last, count, chain))


def _parts(tiers: np.ndarray, slots: np.ndarray, last: np.ndarray, columns: int,
           chain: tuple[Tier, ...]) -> tuple[TierPart, ...]:
    """Per source tier (slowest first: its read is submitted first and overlaps the others) the slots of the
    row-major positions ``[B * columns]`` it holds, grouped into runs; ``last`` flags the layer's tail column."""
    parts = []
    for tier in reversed(chain):
        positions = np.flatnonzero(tiers == tier)
        if positions.size == 0:
            continue
        row, column = np.divmod(positions, columns)
        breaks = (np.diff(positions) != 1) | (np.diff(row) != 0)
        cuts = (np.flatnonzero(breaks) + 1).tolist()
        starts, ends = [0, *cuts], [*cuts, positions.size]
        runs = tuple(Run(lo, hi, int(row[lo]), int(column[lo])) for lo, hi in zip(starts, ends))
        parts.append(TierPart(tier, slots[positions], runs, int(np.count_nonzero(last[positions]))))
    return tuple(parts)
