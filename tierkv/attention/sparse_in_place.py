"""Sparse attention's selection attended where it lives, on a CPU host (every tier's slab is host memory).

:class:`SparseInPlace` is the part of :class:`~tierkv.attention.sparse.SparseAttention` that needs no staging
there: the host kernel (:mod:`tierkv.attention.host_kernel`) attends the sink, recent and tail blocks and the
selected pages of blocks in memory in the device and host tiers' own slabs, through a table of (slot, start), and
the pages of blocks on disk (a whole block on disk as its pages) in the layer's kept buffer
(:mod:`tierkv.attention.kept`), the misses read straight into it while the rest copy is attended. Each call also
returns every entry's own log-sum-exp (``entry_lse``), the measured shares the sticky selection and the attention
policy are given. Accelerators stage instead (the executor's own path): the host kernel reads host memory.

The memory tiers' slab chunks are joined and packed for the kernel once, and again only when a pool grows or gives
a chunk back (:class:`_Joined`): a layer-step does nothing per chunk, however many the pools hold.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tierkv.attention import host_kernel
from tierkv.attention.kept import KeptLayer, Placed
from tierkv.blocks import Tier
from tierkv.layout import BlockLayout
from tierkv.store import KVStore
from tierkv.store.pages import PageRead
from tierkv.tiers.memory import MemoryTier, joined_slabs

_DISK = int(Tier.DISK)  # an int: numpy compares it without ~6 Python calls of enum lookups


@dataclass(slots=True)
class PendingPages:
    """A layer-step's disk pages placed in its kept layer, their misses' read in flight (None: all hits), and the
    device's link counters before it (:meth:`SparseInPlace.start_disk_pages`)."""

    kept: KeptLayer
    placed: Placed
    ids: np.ndarray
    on_disk: np.ndarray
    columns: np.ndarray  # [B, P] each page's grid column (0 where none)
    row: np.ndarray  # [B, 1]
    read: PageRead | None
    moved: dict[str, int]


PoolMark = tuple[int, "weakref.ref[torch.Tensor] | None"]
"""A memory tier's pool as seen: its chunk count and its last chunk (weakly). Chunks are only appended (new tensors)
and popped, so the pool holds the same chunks exactly while the count and the last chunk are the same."""


def _mark(memory: MemoryTier, slot_bytes: int) -> PoolMark:
    pool = memory.pools.get(slot_bytes)
    if pool is None or not pool.chunks:
        return 0, None
    return len(pool.chunks), weakref.ref(pool.chunks[-1])


def _unchanged(memory: MemoryTier, slot_bytes: int, mark: PoolMark) -> bool:
    """Whether ``memory``'s pool for ``slot_bytes`` still holds the chunks it held at ``mark``."""
    pool = memory.pools.get(slot_bytes)
    count, last = mark
    if pool is None or last is None:
        return (0 if pool is None else len(pool.chunks)) == count
    return len(pool.chunks) == count and last() is pool.chunks[-1]


@dataclass(frozen=True, slots=True)
class _Joined:
    """The device and host tiers' slab chunks of one layout joined for the host kernel, looked up and packed once
    per change of their pools (no Python per chunk per layer-step)."""

    memories: tuple[MemoryTier, ...]
    marks: tuple[PoolMark, ...]  # each memory's pool as it was joined
    slabs: host_kernel.PackedSlabs | None  # None: the C kernel does not load; the chunks are passed per call
    offset: np.ndarray  # [tier kinds]: the first slot id of each memory's chunks in the joined slab

    def current(self, slot_bytes: int) -> bool:
        return all(_unchanged(memory, slot_bytes, mark) for memory, mark in zip(self.memories, self.marks))


class SparseInPlace:
    """Attention of a sparse layer-step's blocks and pages where they lie (module docstring). ``counters``: the
    executor's (:class:`~tierkv.attention.sparse.SparseCounters`); ``moved_in``: its links' byte counters now."""

    def __init__(self, store: KVStore, counters, moved_in: Callable[[], dict[str, int]]) -> None:
        self.store, self.counters, self.moved_in = store, counters, moved_in
        self._joined: dict[BlockLayout, _Joined] = {}

    def host_only(self) -> bool:
        """Whether every tier is host memory (a CPU host), where the host kernel attends any slab in place."""
        return not self.store.transfer.accel.streams and self.store.device.device.type == "cpu"

    def memory_pages(self, layer: int, pages: np.ndarray, per: int, page: int, query: torch.Tensor,
                             mask: torch.Tensor | None, start: int, stop: int, scaling: float,
                             softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """On a CPU host, the selected pages ``pages`` ``[B, P]`` (``column · per + page``; -1: none) of blocks in
        memory, attended in the device and host tiers' own slabs by one host-kernel call through a table of
        (slot, start), at their real key positions (so the mask and a window's start apply): nothing is read or
        copied. Returns the output ``[B, H_q, 1, D]``, the log-sum-exp ``[B, H_q, 1]`` and each page's own
        log-sum-exp ``[B, H_q, P]`` (its share of the softmax, from the same pass; ``-inf`` for the others), or
        None where no selected page is in memory."""
        columns, row, tiers = self._page_columns(layer, pages, per)
        in_memory = (pages >= 0) & (tiers != _DISK)
        if not in_memory.any():
            return None
        chunks, table = self._memory_table(layer, columns, in_memory)
        return self._attend_page_table(query, chunks, table, pages % per * page, columns, pages, per, page, mask,
                                       start, stop, scaling, softcap)  # fmt: skip

    def _memory_table(self, layer: int, columns: np.ndarray,
                      held: np.ndarray) -> tuple[list[torch.Tensor] | host_kernel.PackedSlabs, np.ndarray]:
        """The device and host tiers' slab chunks of ``layer``, concatenated (each tier's slot ids offset by the
        slots before it; packed for the C kernel once per change of the pools), and the table ``[B, K]`` of the
        blocks of grid ``columns`` ``[B, K]`` where ``held`` (each in a memory tier), -1 elsewhere."""
        store = self.store
        grid, layout = store.table.rows[layer], store.layouts[layer]
        row = np.arange(columns.shape[0])[:, None]
        joined = self._joined.get(layout)
        if joined is None or not joined.current(layout.slot_bytes):
            joined = self._joined[layout] = self._join(layout)
        slabs = joined.slabs if joined.slabs is not None else self._chunks(joined.memories, layout)
        tiers = grid.tiers[row, columns]
        return slabs, np.where(held, grid.slots[row, columns] + joined.offset[np.where(held, tiers, 0)], -1)

    def _join(self, layout: BlockLayout) -> _Joined:
        """The device and host tiers' chunks of ``layout`` joined (:class:`_Joined`), as their pools are now."""
        memories = tuple(m for m in map(self.store.tiers.get, (Tier.DEVICE, Tier.HOST)) if isinstance(m, MemoryTier))
        marks = tuple(_mark(memory, layout.slot_bytes) for memory in memories)
        chunks, firsts = joined_slabs([memory.slabs(layout) for memory in memories])
        offset = np.zeros(max(m.kind for m in memories) + 1, dtype=np.int64)
        offset[[m.kind for m in memories]] = firsts
        return _Joined(memories, marks, host_kernel.pack_slabs(chunks) if chunks else None, offset)

    @staticmethod
    def _chunks(memories: tuple[MemoryTier, ...], layout: BlockLayout) -> list[torch.Tensor]:
        return joined_slabs([memory.slabs(layout) for memory in memories])[0]

    def blocks(self, layer: int, columns: np.ndarray, query: torch.Tensor, mask: torch.Tensor | None, start: int,
               stop: int, scaling: float, softcap: float | None,
               disk_as_pages: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """On a CPU host, the whole blocks of ``columns`` ``[B, K]`` (sinks, recent blocks, the open tail) attended
        where they lie in the device and host tiers' slabs, by one host-kernel call at their real key positions
        (the tail's empty slots are past ``stop``: not attended): the output ``[B, H_q, 1, D]``, the log-sum-exp
        ``[B, H_q, 1]`` and each block's own log-sum-exp ``[B, H_q, K]`` (``-inf`` for blocks on disk, which
        ``disk_as_pages`` attends as pages: :meth:`disk_block_pages`). None where a block is on disk otherwise
        (whole-block selection keeps blocks: all are staged then)."""
        grid = self.store.table.rows[layer]
        row = np.arange(columns.shape[0])[:, None]
        in_memory = grid.tiers[row, columns] != _DISK
        if not disk_as_pages and not in_memory.all():
            return None
        chunks, table = self._memory_table(layer, columns, in_memory)
        block_lse = torch.empty((columns.shape[0], query.shape[1], 1, columns.shape[1]), dtype=torch.float32)
        out, lse = host_kernel.paged_attention(query, chunks, table, stop - start, scaling=scaling, softcap=softcap,
                                               causal=mask is None, mask=mask,
                                               positions=columns * self.store.block_tokens - start,
                                               entry_lse=block_lse)  # fmt: skip
        return out, lse, block_lse[:, :, 0]

    def disk_block_pages(self, layer: int, columns: np.ndarray, per: int, page: int,
                          start: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The pages (``column · per + page``, ``[B, E]``, -1 padded) of the whole blocks of ``columns`` that are on
        disk, less those wholly before ``start`` (a window's start), to be attended as pages in the kept layer
        (read once, then kept like the selection's), and the position in ``columns`` of each one's block (``[B,
        E]``, -1 padded); None where no such block is on disk (the open tail never is)."""
        grid = self.store.table.rows[layer]
        batch, count = columns.shape
        on_disk = grid.tiers[np.arange(batch)[:, None], columns] == _DISK
        if not on_disk.any():
            return None
        every = (columns[:, :, None] * per + np.arange(per)).reshape(batch, -1)  # [B, K·per]
        block = np.repeat(np.arange(count)[None], batch, axis=0).repeat(per, axis=1)  # [B, K·per]: its position
        wanted = np.repeat(on_disk, per, axis=1) & ((every % per + 1) * page + every // per * self.store.block_tokens
                                                    > start)  # fmt: skip
        counts = wanted.sum(axis=1)
        order = (~wanted).argsort(axis=1, kind="stable")[:, : int(counts.max())]
        valid = np.arange(order.shape[1]) < counts[:, None]
        return (np.where(valid, np.take_along_axis(every, order, axis=1), -1),
                np.where(valid, np.take_along_axis(block, order, axis=1), -1))

    @staticmethod
    def with_disk_blocks(block_lse: torch.Tensor, extra_lse: torch.Tensor, blocks: np.ndarray) -> torch.Tensor:
        """``block_lse`` ``[B, H_q, K]`` (``-inf`` at blocks on disk) with each disk block's own log-sum-exp: the
        log-sum-exp of its pages' (``extra_lse`` ``[B, H_q, E]``; ``blocks`` ``[B, E]``: each page's block position,
        -1: padding), one scatter for all."""
        batch, heads, count = block_lse.shape
        index = torch.from_numpy(np.where(blocks < 0, count, blocks)).to(block_lse.device)[:, None].expand(
            batch, heads, -1).contiguous()  # fmt: skip
        empty = torch.full((batch, heads, count + 1), float("-inf"), dtype=block_lse.dtype, device=block_lse.device)
        peak = empty.scatter_reduce(2, index, extra_lse, "amax").nan_to_num(neginf=0.0)  # each block's largest
        total = torch.zeros_like(empty).scatter_add(2, index, torch.exp(extra_lse - peak.gather(2, index)))
        return torch.logaddexp(block_lse, (peak + total.log())[:, :, :count])

    def start_disk_pages(self, layer: int, kept: KeptLayer, pages: np.ndarray, per: int,
                          page: int) -> PendingPages | None:
        """On a CPU host, place the selected pages of blocks on disk in the kept layer and submit the read of the
        misses straight into their kept positions (one page read, :meth:`KVStore.start_read_pages`), which
        :meth:`attend_disk_pages` finishes (the rest copy is attended meanwhile). None: no selected page is on
        disk."""
        store = self.store
        columns, row, tiers = self._page_columns(layer, pages, per)
        on_disk = (pages >= 0) & (tiers == _DISK)
        if not on_disk.any():
            return None
        moved = self.moved_in()
        ids = np.where(on_disk, store.table.rows[layer].ids[row, columns] * per + pages % per, -1)
        chosen = np.where(on_disk, pages, -1)
        placed = kept.place(ids, chosen, ~on_disk, self.counters.layer_steps)
        new = (placed.positions >= 0) & ~placed.hit
        read = None
        if new.any():  # the read's destination is the kept buffer itself
            into = np.full((pages.shape[0], kept.capacity), -1, dtype=np.int64)
            index = np.zeros_like(into)
            rows, positions = new.nonzero()[0], placed.positions[new]
            into[rows, positions], index[rows, positions] = np.divmod(chosen[new], per)
            read = store.start_read_pages(layer, into, index, page, kept.view(store.layouts[layer]))
        return PendingPages(kept, placed, ids, on_disk, columns, row, read, moved)

    def attend_disk_pages(self, layer: int, pending: PendingPages, pages: np.ndarray, per: int, page: int,
                           query: torch.Tensor, mask: torch.Tensor | None, start: int, stop: int, scaling: float,
                           softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Finish :meth:`start_disk_pages`' read and attend the disk pages where the kept layer holds them (one
        host-kernel call over the kept buffer, slot ``b`` for row ``b``); count the reuse and the bytes moved.
        Returns what :meth:`memory_pages` returns, for these pages."""
        kept, placed, counters = pending.kept, pending.placed, self.counters
        if pending.read is not None:
            pending.read.finish()
            kept.record(placed, pending.ids)
        counters.pages_reused += placed.reused
        counters.add_fetched(pending.moved, self.moved_in())
        columns = pending.columns
        table = np.where(pending.on_disk, pending.row, -1)
        starts = np.where(pending.on_disk, placed.positions * page, 0)
        return self._attend_page_table(query, kept.kernel_slab(self.store.layouts[layer]), table, starts, columns,
                                       pages, per, page, mask, start, stop, scaling, softcap)  # fmt: skip

    def _page_columns(self, layer: int, pages: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The grid column of each page ``[B, P]`` (0 where none), the rows ``[B, 1]``, and the tier holding each."""
        columns = np.where(pages < 0, 0, pages // per)
        row = np.arange(pages.shape[0])[:, None]
        return columns, row, self.store.table.rows[layer].tiers[row, columns]

    def _attend_page_table(self, query: torch.Tensor,
                           slabs: torch.Tensor | list[torch.Tensor] | host_kernel.PackedSlabs, table: np.ndarray,
                           starts: np.ndarray, columns: np.ndarray, pages: np.ndarray, per: int, page: int,
                           mask: torch.Tensor | None, start: int, stop: int, scaling: float,
                           softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One host-kernel call over the pages ``table`` names in ``slabs`` (each ``page`` tokens from ``starts``),
        every page at its real key position from ``start`` (so the mask and a window's start apply): the output
        ``[B, H_q, 1, D]``, the log-sum-exp ``[B, H_q, 1]`` and each page's own log-sum-exp ``[B, H_q, P]``."""
        page_lse = torch.empty((pages.shape[0], query.shape[1], 1, pages.shape[1]), dtype=torch.float32)
        positions = columns * self.store.block_tokens + pages % per * page - start
        out, lse = host_kernel.paged_attention(query, slabs, table, stop - start, scaling=scaling, softcap=softcap,
                                               causal=mask is None, mask=mask, positions=positions, starts=starts,
                                               entry_tokens=page, entry_lse=page_lse)  # fmt: skip
        return out, lse, page_lse[:, :, 0]
