"""Speculative disk reads for sparse attention: the next layer's likely selection, read while this one attends.

Why: a sparse layer-step's selection needs that layer's query, so its disk read cannot start before the layer
attends, and on a host where a few scattered blocks take ~0.5-1 ms to come off the disk, most of a layer's
time is that wait. The layer's *previous* step is known, though (InfiniGen and ShadowKV speculate from it, or
from an earlier layer's activations). So when layer ``i`` starts attending, layer ``i + 1``'s (after the last
layer: layer 0's, for the next step) likely selection is submitted to the disk engine, which reads it on its
own threads into a host bounce buffer while layer ``i`` scores, reads, attends and the model computes on::

    guess[i + 1]  = its previous step's selection                      (minus the open tail: it is on the device)
                  ∪ its best-scored blocks it did not select   (``SparseAttention.speculate_runners`` per row)
                  minus the blocks it keeps on the device (tierkv.attention.kept: all of its previous selection
                  where it has room, so such a layer's guess is its runners-up alone), minus those not on disk
    submit        one batched engine read of the guess's disk slots (ascending: runs coalesce)
    layer i + 1:  hit  = a block the real selection must read that the guess holds, at the same disk slot
                  read the misses as usual (one ReadPlan); copy the hits out of the bounce buffer
                  (verified against their checksums like any disk read); the rest of the guess is dropped

A speculation never changes what is attended: a hit is the same immutable block from the same slot, a miss is
read synchronously as before, and a failed speculative read is read again the ordinary way (which raises the
ordinary error if the disk really failed). Every speculative byte counts in ``bytes_moved["disk->device"]``,
used or not (``stats()["sparse"]`` splits hits, misses and wasted blocks). Memory: at most
:data:`IN_FLIGHT` bounce buffers, host memory outside the budgets like the other disk read-aheads' (each at
most ``tierkv.tiers.disk.BOUNCE_BYTES``); the device budget is untouched (hits land where the blocks go anyway:
the kept layer's positions or staging).

A table edit (crop, reorder, reset) or an executor switch drops every speculation (:meth:`Speculation.drop`);
the store's barrier settles those in flight (:meth:`Speculation.settle`) — a speculated block that moved
since is not at its slot any more, which the hit test sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tierkv.attention.sparse_store import SparseBlocks
from tierkv.blocks import LayerRows, Tier
from tierkv.errors import TierKVError
from tierkv.store import KVStore, ReadPlan, Run, TierPart
from tierkv.tiers.base import PendingRead

IN_FLIGHT = 3  # speculative reads in flight at most (the next layer's, and one or two not yet claimed)
_ROW_SHIFT = 40  # (row << 40) | block id: a per-row key for one vectorized membership test
_DISK = int(Tier.DISK)  # an int: numpy compares it without ~6 Python calls of enum lookups


@dataclass(slots=True)
class SpeculationCounters:
    """What speculation read (``cache.stats()["sparse"]["speculation"]``)."""

    reads: int = 0  # speculative reads submitted
    blocks: int = 0  # blocks they read from disk
    hits: int = 0  # selected blocks that a speculation had read (not read again)
    misses: int = 0  # selected disk blocks that were neither kept nor speculated (read synchronously)
    wasted: int = 0  # speculated blocks that no selection used (claimed without them, or dropped unclaimed)
    failed: int = 0  # speculative reads that failed (their hits were read again, the ordinary way)

    def as_dict(self) -> dict:
        wanted = self.hits + self.misses
        return {"reads": self.reads, "blocks": self.blocks, "hits": self.hits, "misses": self.misses,
                "wasted": self.wasted, "failed": self.failed, "hit_rate": self.hits / wanted if wanted else 0.0}


@dataclass(slots=True)
class _InFlight:
    """One submitted speculation: its blocks (sorted by id, with their slots and read positions) and the read."""

    ids: np.ndarray  # [n] block ids, ascending
    slots: np.ndarray  # [n] their disk slots
    index: np.ndarray  # [n] each one's position in the read (the read goes in ascending slot order)
    pending: PendingRead
    purpose: str


@dataclass(slots=True)
class Claim:
    """The blocks of one layer-step's read that a speculation holds: ``hits`` ``[B, P]`` over the read's
    positions; :meth:`land` copies them into the destination."""

    hits: np.ndarray
    flight: _InFlight
    index: np.ndarray  # [h] the read positions of the hits, in np.nonzero(hits) order

    def land(self, dest: torch.Tensor, block_tokens: int) -> None:
        """Copy the hits into ``dest`` ``[2, B, H_kv, >= P · block_tokens, D]`` at their positions: the read's span
        of hits lands in host memory in one piece (verified against the checksums, every round), one gather
        picks the hits out of it and one indexed copy puts them at their grid positions — no per-block work."""
        positions = self.hits.shape[1]
        grid = dest[..., : positions * block_tokens, :].unflatten(3, (positions, block_tokens))
        blocks = grid.permute(1, 3, 0, 2, 4, 5)  # [B, P, 2, H_kv, bt, D]
        lo, hi = int(self.index.min()), int(self.index.max()) + 1
        span = torch.empty((hi - lo, *blocks.shape[2:]), dtype=dest.dtype)
        self.flight.pending.finish([(lo, hi, span)])
        rows, columns = (torch.from_numpy(axis) for axis in np.nonzero(self.hits))
        blocks[rows, columns] = span[torch.from_numpy(self.index - lo)].to(dest.device)


class Speculation:
    """The speculative reads of one sparse executor (one per layer at most) and their counters."""

    def __init__(self, store: KVStore, counters: SpeculationCounters) -> None:
        self.store = store
        self.counters = counters
        self._selected: dict[int, np.ndarray] = {}  # layer -> its last selection [B, K] (grid columns)
        self._runners: dict[int, np.ndarray] = {}  # layer -> its last runners-up [B, r] (grid columns)
        self._flights: dict[int, _InFlight] = {}  # layer -> its speculation in flight

    def remember(self, layer: int, columns: np.ndarray, runners: np.ndarray | None) -> None:
        """Layer ``layer`` selected ``columns`` ``[B, K]`` this step (``runners`` ``[B, r]``: the next best)."""
        self._selected[layer] = columns
        if runners is None:
            self._runners.pop(layer, None)
        else:
            self._runners[layer] = runners

    def launch(self, layer: int, held: np.ndarray | None) -> int:
        """Submit the disk read of ``layer``'s guess; ``held`` ``[B, capacity]``: the block ids its kept layer
        holds (-1: none), or None without a kept layer. Returns the bytes it reads (0: no read)."""
        store = self.store
        previous = self._selected.get(layer)
        if previous is None or layer in self._flights or len(self._flights) >= IN_FLIGHT \
                or Tier.DISK not in store.tiers:
            return 0
        rows = store.table.layer_rows(layer)
        if rows is None or rows.batch != previous.shape[0]:
            return 0
        runners = self._runners.get(layer)
        if runners is not None and runners.shape[0] != previous.shape[0]:
            runners = None
        if held is not None and runners is None and held.shape[1] >= previous.shape[1]:
            return 0  # a kept layer with room for its whole selection holds all of it: nothing to guess
        guess = previous if runners is None else np.concatenate((previous, runners), axis=1)
        row = np.arange(rows.batch)[:, None].repeat(guess.shape[1], axis=1)
        inside = (guess >= 0) & (guess < rows.count - 1)  # a full block (the open tail is on the device)
        row, guess = row[inside], guess[inside]
        ids, tiers, slots = rows.ids[row, guess], rows.tiers[row, guess], rows.slots[row, guess]
        wanted = tiers == _DISK
        if held is not None and held.shape[0] == rows.batch:
            keys = (np.arange(rows.batch, dtype=np.int64)[:, None] << _ROW_SHIFT) | held
            wanted &= ~np.isin((row.astype(np.int64) << _ROW_SHIFT) | ids, keys[held >= 0])
        if not wanted.any():
            return 0
        ids, first = np.unique(ids[wanted], return_index=True)  # a block shared by rows is read once
        slots = slots[wanted][first]
        order = slots.argsort(kind="stable")  # the read goes in ascending slot order
        index = np.empty_like(order)
        index[order] = np.arange(order.size)
        purpose = self._free_purpose()
        part = TierPart(Tier.DISK, slots[order], (Run(0, int(order.size), 0, 0),), 0)
        pending = store.read_ahead(layer, ReadPlan(layer, 0, int(order.size), (part,)), purpose)
        if pending is None:
            return 0
        self._flights[layer] = _InFlight(ids, slots, index, pending, purpose)
        SparseBlocks(store).count_speculated(layer, int(ids.size))
        self.counters.reads += 1
        self.counters.blocks += int(ids.size)
        return int(ids.size) * store.layouts[layer].block_bytes

    def claim(self, layer: int, rows: LayerRows, targets: np.ndarray) -> Claim | None:
        """Of grid columns ``targets`` ``[B, P]`` (-1: nothing) that ``layer`` must read now, the ones its
        speculation holds; counts the disk blocks it missed. None: no speculation in flight (and then every
        disk block is a miss)."""
        flight = self._flights.pop(layer, None)
        picked = (np.arange(rows.batch)[:, None], np.maximum(targets, 0))
        on_disk = (targets >= 0) & (rows.tiers[picked] == _DISK)
        if flight is None:
            self.counters.misses += int(on_disk.sum())
            return None
        ids, slots = rows.ids[picked], rows.slots[picked]
        found = np.minimum(np.searchsorted(flight.ids, ids), flight.ids.size - 1)  # [B, P]
        hits = on_disk & (flight.ids[found] == ids) & (flight.slots[found] == slots)
        used = np.unique(found[hits])
        self.counters.hits += int(hits.sum())
        self.counters.misses += int((on_disk & ~hits).sum())
        self.counters.wasted += int(flight.ids.size - used.size)
        if not hits.any():
            self._settle(flight)
            return None
        return Claim(hits, flight, flight.index[found[hits]])

    def land(self, claim: Claim, dest: torch.Tensor) -> bool:
        """Copy ``claim``'s hits into ``dest``; False if the speculative read failed (the caller reads those
        blocks again the ordinary way, which reports a real failure)."""
        try:
            claim.land(dest, self.store.block_tokens)
        except (TierKVError, OSError):
            self.counters.failed += 1
            return False
        finally:
            self._settle(claim.flight)
        return True

    def forget(self, layer: int) -> None:
        """Layer ``layer``'s grid shifted (a sliding window dropped blocks): its history and guess are void."""
        self._selected.pop(layer, None)
        self._runners.pop(layer, None)
        flight = self._flights.pop(layer, None)
        if flight is not None:  # never claimed: all of it was read for nothing
            self.counters.wasted += int(flight.ids.size)
            self._settle(flight)

    def drop(self) -> None:
        """A table edit or an executor switch: forget every guess and let every read in flight land."""
        for layer in list(self._flights):
            self.forget(layer)
        self._selected.clear()
        self._runners.clear()

    def settle(self) -> None:
        """The store's barrier: no speculative read is still landing (they stay claimable)."""
        for flight in self._flights.values():
            flight.pending.settle()

    def _settle(self, flight: _InFlight) -> None:
        flight.pending.settle()

    def _free_purpose(self) -> str:
        used = {flight.purpose for flight in self._flights.values()}
        return next(f"speculation{i}" for i in range(IN_FLIGHT + 1) if f"speculation{i}" not in used)
