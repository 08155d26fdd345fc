"""Page reads: token ranges inside blocks, from every tier, so a selection can be finer than the transfer block.

Page ``p`` of a block (tokens ``[p * pt, (p + 1) * pt)``) is ``2 * H_kv`` strided *runs* of ``pt * D`` elements in
the block's slot (``[2, H_kv, block_tokens, D]``): K and V of each head. A read moves those runs only:

- device and host tiers: the slab chunks are viewed as rows of runs (an ``as_strided`` view, nothing copied), one
  ``index_select`` per chunk the pages live in gathers them into a device buffer (host runs: by the CPU into a
  pinned buffer first, then one copy over the link, on accelerators with streams), then one ``index_copy`` puts
  them into the destination, itself viewed as rows of runs;
- disk tier: the 4 KiB sectors holding the runs, adjacent ones coalesced, in one array submission to the engine
  (:meth:`~tierkv.io.DiskFile.submit_array`) into the disk tier's bounce buffer (submitted first, so it overlaps
  the memory tiers' gathers); every sector is verified against the xxh3-64 taken when it was written
  (:meth:`~tierkv.tiers.disk.DiskSlotFile.verify_sectors`) before a byte of it is copied on, then the runs take
  the host runs' way. A read larger than the bounce limit runs in rounds. (Engines that read into GPU memory,
  kvikio with GDS, read pages through this host bounce too.)

Planning is numpy over all pages at once, and the calls per slab chunk are a ``map`` over torch's functions: the
Python loops are over tiers and rounds of the bounce limit, never over blocks, pages, chunks or disk requests. Like
the sparse executor's block reads, a page read is synchronous on the caller's thread and plans from the table as it
is: no table edit (a demotion, a write-back landing) can run until it returns.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierkv.accel import DEVICE
from tierkv.atomic import deferred_interrupts
from tierkv.blocks import Tier
from tierkv.errors import InvalidConfigError
from tierkv.io import IOHandle
from tierkv.io.checksum import xxh3_rows
from tierkv.layout import BlockLayout
from tierkv.store.transfer import link
from tierkv.tiers.disk import BOUNCE_BYTES, SECTOR_BYTES, DiskTier, disk_error
from tierkv.tiers.memory import MemoryTier

_DISK = int(Tier.DISK)  # an int: numpy compares it without ~6 Python calls of enum lookups

if TYPE_CHECKING:
    from tierkv.store.kvstore import KVStore

def read_pages(store: KVStore, layer: int, columns: np.ndarray, pages: np.ndarray, page_tokens: int,
               dest: torch.Tensor) -> None:
    """Copy page ``pages[b, k]`` of grid column ``columns[b, k]`` of row ``b`` of ``layer`` into ``dest[:, b, :,
    k * page_tokens : (k + 1) * page_tokens]`` (``dest``: ``[2, B, H_kv, >= K * page_tokens, D]`` on the device
    tier's device, its last two dimensions contiguous); -1 columns leave their position alone. Full blocks only.
    One batched request per source tier; ``store.transfer`` counts the page bytes of the memory tiers and the
    sector bytes read from the disk."""
    start_read_pages(store, layer, columns, pages, page_tokens, dest).finish()


def start_read_pages(store: KVStore, layer: int, columns: np.ndarray, pages: np.ndarray, page_tokens: int,
                     dest: torch.Tensor) -> PageRead:
    """:func:`read_pages` in two halves: the memory tiers' pages are copied and the disk's request submitted now;
    :meth:`PageRead.finish` waits for the disk, verifies and lands its pages (the caller works meanwhile: sparse
    attention attends the rest copy while the disk reads). Until then nothing else may use the calling thread's
    read bounce buffer, nor edit the table."""
    layout = store.layouts[layer]
    columns, pages = _checked(store, layer, layout, columns, pages, page_tokens, dest)
    row, position = (columns >= 0).nonzero()
    if row.size == 0:
        return PageRead(None, None)
    grid = store.table.rows[layer]
    column, page = columns[row, position], pages[row, position]
    tiers, slots = grid.tiers[row, column], grid.slots[row, column]
    run = page_tokens * layout.head_dim
    heads = np.arange(2 * layout.kv_heads)
    # per page and run (K then V of each head): its element offset in the slot and in the destination
    within = heads * layout.block_tokens * layout.head_dim + (page * run)[:, None]  # [n, 2H]
    kv, head = np.divmod(heads, layout.kv_heads)
    stride = dest.stride()
    into = kv * stride[0] + head * stride[2] + (row * stride[1] + position * page_tokens * stride[3])[:, None]
    sink = _Sink(store, dest, into, run)
    on_disk = tiers == _DISK
    disk = _DiskPages(store, layout, slots[on_disk], within[on_disk], sink.rows[on_disk], run) if on_disk.any() \
        else None
    memory_tiers = () if disk is not None and on_disk.all() else (Tier.HOST, Tier.DEVICE)  # none: all on disk
    try:
        for tier in memory_tiers:  # while the disk read is in flight
            mine = (tiers == int(tier)).nonzero()[0]
            if mine.size:
                memory = store.tiers[tier]
                assert isinstance(memory, MemoryTier)
                sources, counts, index, order = _slab_runs(memory, layout, slots[mine], within[mine], run)
                sink.land(sources, counts, index, sink.rows[mine[order]].ravel(), host=memory.space != DEVICE)
                store.transfer.count(link(tier, Tier.DEVICE), mine.size * page_tokens * layout.token_bytes)
    except BaseException:
        if disk is not None:
            disk.settle()
        raise
    return PageRead(disk, sink)


class PageRead:
    """A page read whose memory tiers' part has landed and whose disk part (if any) is in flight."""

    def __init__(self, disk: _DiskPages | None, sink: _Sink | None) -> None:
        self._disk, self._sink = disk, sink

    def finish(self) -> None:
        """Wait for the disk's sectors, verify them and land their pages (then nothing is in flight)."""
        disk, self._disk = self._disk, None
        if disk is None:
            return
        try:
            assert self._sink is not None
            disk.finish(self._sink)
        finally:
            disk.settle()

    def settle(self) -> None:
        """Leave nothing in flight without landing it (after a failure elsewhere; raises nothing)."""
        disk, self._disk = self._disk, None
        if disk is not None:
            disk.settle()


def _checked(store: KVStore, layer: int, layout: BlockLayout, columns: np.ndarray, pages: np.ndarray,
             page_tokens: int, dest: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``columns`` and ``pages`` as int64 ``[B, K]`` (pages 0 where no column), or an error that says what is wrong."""
    columns, pages = np.asarray(columns, dtype=np.int64), np.asarray(pages, dtype=np.int64)
    grid = store.table.rows[layer]
    bt = store.block_tokens
    if not isinstance(page_tokens, int) or page_tokens <= 0 or bt % page_tokens:
        raise InvalidConfigError(f"page_tokens must be a positive divisor of block_tokens={bt}, got {page_tokens!r}.")
    if columns.ndim != 2 or columns.shape != pages.shape or columns.shape[0] != grid.batch:
        raise InvalidConfigError(f"columns and pages must both be [batch={grid.batch}, K]; got {columns.shape} and "
                                 f"{pages.shape}.")
    wanted = (2, grid.batch, layout.kv_heads, columns.shape[1] * page_tokens, layout.head_dim)
    if (dest.dim() != 5 or dest.shape[:3] != wanted[:3] or dest.shape[3] < wanted[3] or dest.shape[4] != wanted[4]
            or dest.dtype != layout.dtype or dest.device != store.device.device):
        raise InvalidConfigError(f"read_pages needs dest [2, B, H_kv, >= K * page_tokens, D] = {list(wanted)} of "
                                 f"{layout.dtype} on {store.device.device}; got {list(dest.shape)} of {dest.dtype} on "
                                 f"{dest.device}.")
    if dest.stride(4) != 1 or dest.stride(3) != layout.head_dim:
        raise InvalidConfigError("read_pages needs dest's tokens and head_dim dimensions contiguous (each page of a "
                                 "head one run of memory); pass a contiguous staging buffer or a slice of one.")
    tail = store.table.blocks[int(grid.ids[0, -1])]
    full = grid.count - (tail.tokens < bt)
    chosen = columns >= 0
    if (columns >= full).any():
        raise InvalidConfigError(f"read_pages reads full blocks only: layer {layer} has {full} full columns, asked "
                                 f"for column {int(columns.max())}; read the open tail with read_tokens.")
    pages = np.where(chosen, pages, 0)
    if ((pages < 0) | (pages >= bt // page_tokens)).any():
        raise InvalidConfigError(f"pages must be in [0, {bt // page_tokens}) where a column is chosen.")
    return columns, pages


def _rows_view(source: torch.Tensor, offsets: np.ndarray, run: int) -> tuple[torch.Tensor, np.ndarray]:
    """``source``'s memory as rows of ``run`` elements starting at every multiple of the offsets' common divisor
    (a view: rows overlap where runs are not that far apart), and the row of each offset."""
    step = int(np.gcd.reduce(offsets.ravel(), initial=run))
    count = int(offsets.max()) // step + 1
    return torch.as_strided(source, (count, run), (step, 1)), offsets // step


def _slab_runs(tier: MemoryTier, layout: BlockLayout, slots: np.ndarray, within: np.ndarray,
               run: int) -> tuple[list[torch.Tensor], np.ndarray, np.ndarray, np.ndarray]:
    """The runs of the pages in ``slots`` (run offsets ``within`` their slot, ``[n, 2H]``) as rows of the slab chunks
    holding them: one rows view per chunk touched, the runs taken from each (``[chunks]``), their rows in those views
    (``[runs]``, chunk after chunk), and the order of the pages they come in. One numpy computation for all chunks;
    the views are made by ``map`` over torch's own functions, so no Python runs per chunk (a pool has a few dozen at
    most, but more as the KV grows)."""
    pool = tier.pools[layout.slot_bytes]
    chunk, row = pool.locate(slots)
    order = np.argsort(chunk, kind="stable")
    touched, pages = np.unique(chunk[order], return_counts=True)
    slot_elements = layout.slot_bytes // layout.dtype.itemsize
    step = math.gcd(slot_elements, run)  # divides every run offset: page runs start at multiples of ``run``
    index = (row[order, None] * slot_elements + within[order]) // step
    chunks = list(map(pool.chunks.__getitem__, touched.tolist()))
    sizes = np.fromiter(map(torch.Tensor.size, chunks, repeat(0)), dtype=np.int64, count=len(chunks))
    shapes = zip(((sizes * slot_elements - run) // step + 1).tolist(), repeat(run))
    views = list(map(torch.as_strided, map(torch.Tensor.view, chunks, repeat(layout.dtype)), shapes, repeat((step, 1))))
    return views, pages * within.shape[1], index.ravel(), order


class _Sink:
    """The destination viewed as rows of runs, and the buffers runs cross on their way there: a device buffer
    (the caller thread's landing buffer, counted in the device budget, where there is one; else a transient one
    of at most the bounce limit, like the cold paths' reads), and on accelerators with streams a pinned host
    buffer for host-side runs."""

    def __init__(self, store: KVStore, dest: torch.Tensor, into: np.ndarray, run: int) -> None:
        self.store, self.dest, self.run = store, dest, run
        self.accel = store.transfer.accel
        self.view, self.rows = _rows_view(dest, into, run)  # rows: [n, 2H]
        self.row_bytes = run * dest.element_size()
        disk = store.tiers.get(Tier.DISK)
        self.limit = disk.bounce_bytes if isinstance(disk, DiskTier) else BOUNCE_BYTES
        self._device: torch.Tensor | None = None

    def _buffer(self, count: int) -> torch.Tensor:
        """A device buffer of at least ``min(count, capacity)`` rows (the landing buffer, or a transient one)."""
        landing = self.store.transfer.scratch.landing()
        if landing is not None and landing.numel() >= self.row_bytes:
            raw = landing
        else:
            need = min(count, max(1, self.limit // self.row_bytes)) * self.row_bytes
            if self._device is None or self._device.numel() < need:
                self._device = self.accel.empty(need, self.dest.device)
            raw = self._device
        rows = raw.numel() // self.row_bytes
        return raw[: rows * self.row_bytes].view(self.dest.dtype).view(rows, self.run)

    def land(self, sources: Sequence[torch.Tensor], counts: np.ndarray, index: np.ndarray, dest_rows: np.ndarray,
             host: bool) -> None:
        """Copy rows ``index`` of ``sources`` (``counts[i]`` rows of source ``i``, then of the next) into the
        destination rows ``dest_rows``: per round of the buffer's capacity, one ``index_select`` per source into
        the buffer (from host memory: by the CPU, through the pinned buffer and one copy where the accelerator has
        streams), then one ``index_copy``; host memory into host memory from one source, in one round, skips the
        buffer. The sources are iterated by ``map`` in C: as many Python calls for one slab chunk as for forty (on
        the device, through the accelerator's ``index_select``, one call per chunk)."""
        accel, device = self.accel, self.dest.device
        total = len(dest_rows)
        if host and device.type == "cpu" and len(sources) == 1 and total * self.row_bytes <= self.limit:
            # a disk round, or a host tier's pages in one slab chunk, on a CPU host: the gathered runs (at most the
            # bounce limit, as the staging buffer would be) go straight in, without the buffer and split bookkeeping
            gathered = torch.index_select(sources[0], 0, torch.from_numpy(index))
            accel.index_copy(self.view, torch.from_numpy(dest_rows), gathered)
            return
        ends = counts.cumsum()
        rows = torch.from_numpy(index) if host else torch.from_numpy(index).to(device)
        pinned = host and accel.streams
        lo = 0
        while lo < total:  # rounds of the buffer's capacity: one, unless the read is large
            buffer = self._buffer(total - lo)
            hi = min(total, lo + buffer.shape[0])
            out = buffer[: hi - lo]
            staged = out
            owner = None
            if pinned:
                owner = self.store.transfer.scratch.bounce_buffer("pages")
                raw = owner.get((hi - lo) * self.row_bytes, self.limit)
                staged = torch.from_numpy(raw).view(self.dest.dtype).view(hi - lo, self.run)
            inside = np.minimum(ends, hi) - np.maximum(ends - counts, lo)  # rows of each source in this round
            these = (inside > 0).nonzero()[0]
            split = inside[these].tolist()
            picked = map(sources.__getitem__, these.tolist())
            parts, outs = torch.split(rows[lo:hi], split), torch.split(staged, split)
            if host and len(split) == 1:  # host memory: the CPU gathers, as it does everything else there
                torch.index_select(next(picked), 0, parts[0], out=outs[0])
            elif host:  # index_select takes out= by keyword only, so map's gathers land in temporaries first
                collections.deque(map(torch.Tensor.copy_, outs, map(torch.index_select, picked, repeat(0), parts)),
                                  maxlen=0)
            else:
                collections.deque(map(accel.index_select, picked, parts, outs), maxlen=0)
            if owner is not None:
                accel.copy(out, staged)
                event = accel.Event()
                event.record(accel.current_stream(device))
                owner.fence(event)  # the pinned buffer's next user waits until the copy read it
            accel.index_copy(self.view, torch.from_numpy(dest_rows[lo:hi]).to(device), out)
            lo = hi


class _DiskPages:
    """The disk tier's part of a page read: the sectors holding the pages' runs, in rounds of at most the bounce
    limit (one, unless the selection is large), the first submitted at once; each round verified, then landed."""

    def __init__(self, store: KVStore, layout: BlockLayout, slots: np.ndarray, within: np.ndarray,
                 dest_rows: np.ndarray, run: int) -> None:
        tier = store.tiers[Tier.DISK]
        assert isinstance(tier, DiskTier)
        self.tier, self.store, self.layout, self.run = tier, store, layout, run
        self.slot_file = tier.files[layout.slot_bytes]
        self.start = within * layout.dtype.itemsize  # [n, 2H] byte offsets of the runs in their slot
        first = self.start // SECTOR_BYTES
        span = (self.start + run * layout.dtype.itemsize - 1) // SECTOR_BYTES - first + 1
        width = int(span.max())
        self.first = slots[:, None] * self.slot_file.sectors_per_slot + first  # [n, 2H] file sectors
        if width == 1:  # every run inside one sector (runs of at most a sector: the common case)
            sectors = self.first
        else:  # [n, 2H, width]: the sectors of every run, past its end masked
            steps = np.arange(width)
            sectors = np.where(steps < span[:, :, None], self.first[:, :, None] + steps, self.first[:, :1, None])
        self.sectors = sectors.reshape(len(slots), -1)  # [n, sectors]: each page's, with repeats
        self.dest_rows = dest_rows
        self.bounds = [0, len(slots)]
        if self.sectors.size * SECTOR_BYTES > tier.bounce_bytes:  # may not fit one round: rounds of pages
            self._plan_rounds(np.lexsort((within[:, 0], slots)), tier.bounce_bytes)
        self.owner = store.transfer.scratch.bounce_buffer("read")  # the caller thread's: free while this runs
        self.handle: IOHandle | None = None
        self._submit(0)

    def _plan_rounds(self, order: np.ndarray, limit: int) -> None:
        """Put the pages in file ``order`` (reads ahead, coalesces) and cut them into rounds of at most ``limit``
        bytes of sectors (the most one page needs times the pages of a round)."""
        self.start, self.first, self.sectors = self.start[order], self.first[order], self.sectors[order]
        self.dest_rows = self.dest_rows[order]
        ordered = np.sort(self.sectors, axis=1)
        most = int(((ordered[:, 1:] != ordered[:, :-1]).sum(axis=1) + 1).max())  # the most sectors one page needs
        per_round = max(1, limit // SECTOR_BYTES // most)
        self.bounds = [*range(0, len(order), per_round), len(order)]

    def _submit(self, k: int) -> None:
        """Submit round ``k``: its pages' sectors, sorted and unique, in one engine call."""
        lo, hi = self.bounds[k], self.bounds[k + 1]
        ordered = np.sort(self.sectors[lo:hi], axis=None)
        keep = np.empty(ordered.size, dtype=bool)
        keep[:1] = True
        np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
        self.round = ordered[keep]  # np.unique, in fewer calls
        self.buffer = self.owner.get(self.round.size * SECTOR_BYTES, self.tier.bounce_bytes)
        try:
            with deferred_interrupts():  # a Ctrl-C mid-submit must not lose the handle of reads already queued
                self.handle, self.digests = self.tier.read_sectors(self.layout.slot_bytes, self.round, self.buffer)
                self.owner.landing(self.handle)  # the buffer's next user waits for it, whatever happens here
        except OSError as exc:
            raise disk_error(exc, self.slot_file.path) from exc

    def finish(self, sink: _Sink) -> None:
        """Wait for each round, verify its sectors, count them, and land its runs (submitting the next)."""
        itemsize = self.layout.dtype.itemsize
        for k in range(len(self.bounds) - 1):
            if k:
                self._submit(k)
            assert self.handle is not None
            self.tier.wait(self.handle, self.layout.slot_bytes)
            self.handle = None
            sectors, buffer = self.round, self.buffer
            self.store.transfer.count(link(Tier.DISK, Tier.DEVICE), sectors.size * SECTOR_BYTES)
            digests = self.digests if self.digests is not None else xxh3_rows(buffer.reshape(-1, SECTOR_BYTES))
            self.slot_file.verify_sectors(sectors, digests)
            lo, hi = self.bounds[k], self.bounds[k + 1]
            landed = np.searchsorted(sectors, self.first[lo:hi]) * SECTOR_BYTES + self.start[lo:hi] % SECTOR_BYTES
            view, rows = _rows_view(torch.from_numpy(buffer).view(self.layout.dtype), landed // itemsize, self.run)
            sink.land([view], np.array([rows.size]), rows.ravel(), self.dest_rows[lo:hi].ravel(), host=True)

    def settle(self) -> None:
        """No read of this one may still land in the bounce buffer (after a failure elsewhere; raises nothing)."""
        if self.handle is not None:
            with contextlib.suppress(OSError):
                self.handle.wait()
            self.handle = None
