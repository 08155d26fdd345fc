"""Blocks that sparse attention read in earlier decode steps, kept on the device per layer, so that a step
reads from the tiers only the blocks its selection did not hold yet.

Why: the selection needs the layer's query, so its read cannot start before the layer attends, and a read that
touches the disk waits for the disk's latency (on a virtio disk about 1 ms for a few scattered blocks, more
than everything else a sparse layer-step does). But selections are stable: on the demo
model at 16K tokens, 75-80% of a layer's selected blocks were selected the step before, and 90-97% within the
last few steps. Keeping each layer's recent selections turns most steps' reads into a device gather.

Per kept layer, a device buffer ``[B, 2, H_kv, capacity · block_tokens, D]`` (reserved against the device
budget, like staging; each row's part laid out like one block of ``capacity · block_tokens`` tokens, so the host
kernel attends kept units where they are: :meth:`KeptLayer.slab`) and, per position, the block held there and the
step it was last attended::

    held[b, k]   = selected block (b, k) sits at position pos[b, k]      (full blocks never change)
    staging      = kept[:, b, :, pos[b, k]]                               (one gather, in selection order)
    read         = the others straight into staging: one ReadPlan, one batched read per tier; and the layer's
                   last column, the open tail (it changes every step), copied straight from its device slot
                   (``SparseBlocks.copy_open_tails``: no plan for the one block every step reads)
    keep         = the blocks just read into the positions attended longest ago (one indexed copy), as many
                   as the layer has positions not hit this step

Where sparse attention selects *pages* (``page_tokens`` below the block), a kept layer holds pages the same way:
its unit is the page, a page's id is ``block id · pages per block + page`` (block ids never repeat, so neither do
these), and the misses are read with one page read (:meth:`KVStore.read_pages`). Selections of pages are as
stable as those of blocks, so most of a step's pages come from the device and the disk sees only the new ones.

Kept blocks are copies: the store's table is untouched and nothing is dropped from it. A table edit (crop, row
selection, reset) calls :meth:`KeptBlocks.clear`; block ids never repeat, so a kept block is never mistaken
for another one.

Memory: a layer keeps up to :data:`KEEP_FACTOR` times its selection's blocks (the previous selection and the
blocks that recently left it) but no more than its part of what all kept layers could take together beside the
device's other reservations now, within :data:`KEEP_SHARE` of the device budget (at least its selection's): an
equal part, except that layers whose :data:`KEEP_FACTOR` selections need less (a sliding layer's window) count
at that and leave the rest to the others (a layer sized before the others' needs were known grows to its larger
part at a later step); or only its selection's, or as much of that as fits, whichever fits in what is left of that share
and still leaves the device room for every layer's open tail (``tierkv.staging.device_minimum``). The other
reservations grow as the first layers attend (each layer's summaries): a layer that finds less than it wants
makes the layers holding more than their part now give it back where every layer's selection fits its part,
and they take their part at their next step, so that no layer is left keeping nothing while the first ones keep
more than theirs. A layer that keeps part of its selection reads the rest every step, and speculation guesses
that rest (its previous selection less what it keeps); one that keeps nothing reads its whole selection every
step (the behaviour without this module).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tierkv.attention import host_kernel
from tierkv.errors import BudgetTooSmallError
from tierkv.layout import BlockLayout
from tierkv.staging import CHUNKS_PER_BUDGET, Staging, device_minimum, open_tail_bytes
from tierkv.store import KVStore

# A kept layer holds up to KEEP_FACTOR times its selection's blocks; all kept layers together take at most
# KEEP_SHARE of the device budget (measured: docs/benchmarks.md, "Attention policy against lru").
KEEP_FACTOR = 4
KEEP_SHARE = 0.65
GROWTH = 1.25  # a kept layer is re-allocated larger only where its part grew by this much (it drops what it held)
_ROW_SHIFT = 40  # (row << 40) | block id: one sorted key per (row, block) for a single vectorized search


@dataclass(slots=True)
class Placed:
    """Where a step's selection sits in a kept layer, and what must be read for it.

    ``positions`` ``[B, K]``: the kept position of each selected block (-1: not kept — the open tail, or a miss
    of a layer that keeps fewer blocks than it selects); ``hit`` ``[B, K]``: already held there; ``targets``
    ``[B, K]``: the grid column to read into each staging position (-1: none, it is held); ``reused``: the hits."""

    positions: np.ndarray
    hit: np.ndarray
    targets: np.ndarray
    reused: int


class KeptLayer:
    """One layer's kept units (blocks, or pages of ``unit_tokens``): the device buffer and, per position, the unit's
    id (-1: none) and last use."""

    def __init__(self, buffer: torch.Tensor, batch: int, capacity: int, unit_tokens: int) -> None:
        self.buffer = buffer  # flat uint8, reserved against the device budget
        self.unit_tokens = unit_tokens
        self.ids = np.full((batch, capacity), -1, dtype=np.int64)  # [B, capacity]
        self.used = np.full((batch, capacity), -1, dtype=np.int64)  # [B, capacity]: step last attended
        self._packed: tuple[BlockLayout, host_kernel.PackedSlabs] | None = None  # (layout, its slab packed)

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def capacity(self) -> int:
        return self.ids.shape[1]

    def slab(self, layout: BlockLayout) -> torch.Tensor:
        """The buffer as a slab of one slot per row, ``[B, 2, H_kv, capacity · unit_tokens, D]``: the unit at
        position ``k`` of row ``b`` is the ``unit_tokens`` tokens from ``k · unit_tokens`` of slot ``b`` (the host
        kernel's pages, :func:`tierkv.attention.host_kernel.paged_attention` with ``starts``)."""
        tokens = self.capacity * self.unit_tokens
        nbytes = self.batch * tokens * layout.token_bytes
        return self.buffer[:nbytes].view(layout.dtype).view(self.batch, 2, layout.kv_heads, tokens, layout.head_dim)

    def kernel_slab(self, layout: BlockLayout) -> torch.Tensor | host_kernel.PackedSlabs:
        """:meth:`slab` as the host kernel takes it: packed once (:func:`host_kernel.pack_slabs`; the buffer stays
        while this layer does), or the slab itself where the C kernel does not load."""
        if self._packed is not None and self._packed[0] == layout:
            return self._packed[1]
        slab = self.slab(layout)
        packed = host_kernel.pack_slabs(slab)
        if packed is None:
            return slab
        self._packed = (layout, packed)
        return packed

    def view(self, layout: BlockLayout) -> torch.Tensor:
        """The buffer as ``[2, B, H_kv, capacity · unit_tokens, D]`` (a view of :meth:`slab`)."""
        return self.slab(layout).transpose(0, 1)

    def place(self, ids: np.ndarray, columns: np.ndarray, tail: np.ndarray, step: int) -> Placed:
        """Place a selection: ``ids`` / ``columns`` ``[B, K]`` (block ids and grid columns), ``tail`` ``[B, K]``
        flags the open tail (always read, never kept). Each miss takes a position not hit now (empty ones first,
        then those attended longest ago) while there are any; the rest are read but not kept. Positions taken
        are forgotten now (a failed read leaves them empty, never holding stale data); call :meth:`hold` once
        the read has landed."""
        # numpy's methods, not its functions: the same operations, without the functions' Python wrappers
        batch, capacity = self.ids.shape
        offsets = np.arange(batch, dtype=np.int64)[:, None] << _ROW_SHIFT
        held = np.where(self.ids >= 0, self.ids | offsets, -1).ravel()  # [B·capacity], -1 sorts first
        order = held.argsort(kind="stable")
        wanted = (ids | offsets).ravel()  # [B·K]
        found = np.minimum(held[order].searchsorted(wanted), held.size - 1)
        flat = order[found]  # flat position of the match (if any)
        match = (held[flat] == wanted).reshape(ids.shape)  # [B, K]
        positions = np.where(match, flat.reshape(ids.shape) % capacity, -1)
        stale = match & tail  # the open tail is never held (it changes), unless a table edit made it the tail
        self.ids[stale.nonzero()[0], positions[stale]] = -1
        hit = match & ~tail
        keep = np.zeros((batch, capacity), dtype=bool)
        keep[hit.nonzero()[0], positions[hit]] = True
        rank = np.where(keep, np.iinfo(np.int64).max, self.used)
        free = rank.argsort(axis=1, kind="stable")  # [B, capacity]: the positions not hit now come first
        miss = ~hit & ~tail
        nth = miss.cumsum(axis=1) - 1  # the j-th miss of a row takes that row's j-th free position ...
        kept = miss & (nth < capacity - keep.sum(axis=1, keepdims=True))  # ... while the row has one
        rows = kept.nonzero()[0]
        positions = np.where(tail, -1, positions)
        positions[kept] = free[rows, nth[kept]]
        self.ids[rows, positions[kept]] = -1
        taken = positions >= 0
        self.used[taken.nonzero()[0], positions[taken]] = step
        targets = np.where(hit, -1, columns)
        return Placed(positions, hit, targets, int(hit.sum()))

    def gather(self, layout: BlockLayout, placed: Placed, dest: torch.Tensor) -> None:
        """Copy the held blocks of ``placed`` into ``dest`` ``[2, B, H_kv, K · bt, D]`` (contiguous) at their
        selection positions: one ``index_select`` per row and K/V straight into ``dest`` (no temporary: on the
        CPU a large one costs fresh pages every step). The positions to be read get some held block meanwhile
        (the read overwrites them): one copy for all is cheaper than picking the hits out."""
        batch, count = placed.positions.shape
        source = self.view(layout).unflatten(3, (self.capacity, -1))  # [2, B, H_kv, capacity, bt, D]
        target = dest.unflatten(3, (count, -1))  # [2, B, H_kv, K, bt, D]
        index = torch.from_numpy(np.maximum(placed.positions, 0)).to(dest.device)
        for row in range(batch):
            for part in range(2):  # K, V
                torch.index_select(source[part, row], 1, index[row], out=target[part, row])

    def hold(self, layout: BlockLayout, placed: Placed, ids: np.ndarray, staged: torch.Tensor) -> None:
        """The read of ``placed`` landed in ``staged`` ``[2, B, H_kv, K · bt, D]``: copy the blocks read that took
        a kept position into it (one indexed copy), which then holds them."""
        new = (placed.positions >= 0) & ~placed.hit
        if not new.any():
            return
        rows, picks = np.nonzero(new)
        positions = placed.positions[new]
        device = staged.device
        row, pick, position = (torch.from_numpy(a).to(device) for a in (rows, picks, positions))
        blocks = staged.unflatten(3, (placed.positions.shape[1], -1))  # [2, B, H_kv, K, bt, D]
        source = self.view(layout).unflatten(3, (self.capacity, -1))
        source[:, row, :, position] = blocks[:, row, :, pick]
        self.ids[rows, positions] = ids[new]

    def record(self, placed: Placed, ids: np.ndarray) -> None:
        """The read of ``placed``'s misses landed at their kept positions (read there directly): they are held."""
        new = (placed.positions >= 0) & ~placed.hit
        self.ids[new.nonzero()[0], placed.positions[new]] = ids[new]


class KeptBlocks:
    """The kept layers of one sparse executor, and their device reservation: a cache, so it gives way when the
    device has nothing else to make room with (a growing summary table, an open block to place: the store calls
    :meth:`give_way` through ``placement.yielding`` before it refuses)."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.staging = Staging(store)
        self._taking = False  # while a kept layer reserves, the others do not give way to it
        store.placement.yielding.append(self.give_way)
        self.layers: dict[int, KeptLayer] = {}
        self.refused: dict[int, tuple[int, int, int]] = {}  # layer -> (batch, units, unit tokens): nothing fit
        self.sized: dict[int, int] = {}  # layer -> the selection its kept layer was allocated for
        self._sizings = 0  # how many times kept layers were allocated or dropped
        self._checked: dict[int, int] = {}  # layer -> ``_sizings`` when its part was last compared with its size

    @property
    def reserved(self) -> int:
        return self.staging.reserved

    def layer(self, layer: int, batch: int, count: int, unit_tokens: int | None = None) -> KeptLayer | None:
        """The kept layer for a selection of ``count`` units of ``unit_tokens`` per row (default: whole blocks;
        allocated, or grown, on first need)."""
        store = self.store
        unit = unit_tokens or store.block_tokens
        kept = self.layers.get(layer)
        fits = kept is not None and kept.batch == batch and kept.unit_tokens == unit \
            and max(kept.capacity, self.sized[layer]) >= count  # fmt: skip
        if fits and self._checked.get(layer) == self._sizings:
            return kept  # the step's common case: nothing was sized since this layer's part was last compared
        layout = store.layouts[layer]
        block_bytes = batch * unit * layout.token_bytes
        if fits:
            assert kept is not None
            tails = open_tail_bytes(len(store.layouts), batch, layout.slot_bytes)
            self._checked[layer] = self._sizings
            if not self._grows(layer, kept, count, block_bytes, tails):
                return kept
        elif self.refused.get(layer) == (batch, count, unit):
            return None  # nothing fits (a larger selection would not either)
        tails = open_tail_bytes(len(store.layouts), batch, layout.slot_bytes)  # must stay possible beside it
        self._drop(layer)
        device, cap = store.device, self._share()
        fair = self._part(layer, block_bytes, tails)
        wanted = min(KEEP_FACTOR * count, max(count, fair))
        if count <= fair and not self._fits(wanted * block_bytes, tails):
            # layers sized while less else was reserved give back what exceeds their part now (each takes its part
            # at its next step); only where a selection fits a part, or the layers would take turns (a unit's slack:
            # layers of other widths round their parts to their own units)
            for index in [i for i, held in self.layers.items() if held.buffer.numel() > (fair + 1) * block_bytes]:
                self._drop(index)
        room = min(count, _fitting_blocks(device.budget, device.reserved, tails, cap - self.reserved, block_bytes))
        # KEEP_FACTOR selections within the fair part, else the selection, else what fits: a layer that keeps part
        # of its selection still reads only the rest and its new blocks (one that keeps none reads all of it)
        for capacity in dict.fromkeys((wanted, count, room)):
            nbytes = capacity * block_bytes
            if capacity < 1 or not self._fits(nbytes, tails):
                continue
            try:
                self._taking = True
                buffer = self.staging.take(nbytes)
            except BudgetTooSmallError:
                break
            finally:
                self._taking = False
            self.layers[layer] = kept = KeptLayer(buffer, batch, capacity, unit)
            self.sized[layer] = count
            self._sizings += 1
            self._checked[layer] = self._sizings
            return kept
        self.refused[layer] = (batch, count, unit)
        return None

    def _part(self, layer: int, block_bytes: int, tails: int) -> int:
        """``layer``'s part, in its units of ``block_bytes``, of what the kept layers could take together beside
        everything else reserved now: an equal part, except that the other layers whose :data:`KEEP_FACTOR`
        selections need less (a sliding layer's window) are counted at that and leave the rest to the others."""
        device = self.store.device
        total = _fitting_blocks(device.budget, device.reserved - self.reserved, tails, self._share(), block_bytes)
        layers = self.store.layouts
        wants = sorted(KEEP_FACTOR * self.sized[i] * kept.batch * kept.unit_tokens * layers[i].token_bytes
                       for i, kept in self.layers.items() if i != layer)  # fmt: skip
        left, room = len(layers), total * block_bytes
        for want in wants:
            if want * left > room:
                break
            left, room = left - 1, room - want
        return room // left // block_bytes

    def _grows(self, layer: int, kept: KeptLayer, count: int, block_bytes: int, tails: int) -> bool:
        """Whether ``layer``'s part grew (layers sized since need less than theirs) to at least GROWTH times what it
        keeps, and the larger buffer fits where this one is given back."""
        more = min(KEEP_FACTOR * count, self._part(layer, block_bytes, tails))
        return more >= GROWTH * kept.capacity and self._fits((more - kept.capacity) * block_bytes, tails)

    def _share(self) -> int:
        """The device bytes all kept layers may take together."""
        return int(self.store.device.budget * KEEP_SHARE)

    def _fits(self, nbytes: int, tails: int) -> bool:
        """Whether a kept buffer of ``nbytes`` more fits the kept layers' share and the device beside ``tails``."""
        device = self.store.device
        return self.reserved + nbytes <= self._share() \
            and device_minimum(device.reserved + nbytes, tails) <= device.budget  # fmt: skip

    def clear(self, layer: int | None = None) -> None:
        """Forget what is held (a table edit): the buffers stay reserved for the next steps."""
        for index, kept in self.layers.items():
            if layer is None or index == layer:
                kept.ids.fill(-1)
                kept.used.fill(-1)

    def _drop(self, layer: int) -> None:
        self.sized.pop(layer, None)
        kept = self.layers.pop(layer, None)
        if kept is not None:
            self.staging.give_back(kept.buffer)
            self._sizings += 1

    def release(self) -> None:
        self.layers.clear()
        self.sized.clear()
        self._checked.clear()
        self.staging.release()
        self.refused.clear()

    def give_way(self) -> bool:
        """Give every kept layer's device bytes back (the device needs them); whether there were any."""
        if self._taking or not self.reserved:
            return False
        self.release()
        return True

    def close(self) -> None:
        """Release, and stop being asked to give way."""
        self.release()
        if self.give_way in self.store.placement.yielding:
            self.store.placement.yielding.remove(self.give_way)


def _fitting_blocks(budget: int, reserved: int, tails: int, share: int, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` that fit both ``share`` and a device of ``budget`` bytes with ``reserved`` taken,
    beside ``tails`` bytes of open blocks (:func:`tierkv.staging.device_minimum`; it is monotonic)."""
    room = (budget - tails) * (CHUNKS_PER_BUDGET - 1) // CHUNKS_PER_BUDGET - reserved  # device_minimum, inverted
    blocks = max(0, min(share, room) // block_bytes)
    while blocks and device_minimum(reserved + blocks * block_bytes, tails) > budget:
        blocks -= 1  # the rounding of the inversion: once at most
    return blocks
