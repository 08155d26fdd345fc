"""Split attention: attend each tier's share of a layer where it lives, merge the shares by log-sum-exp.

Exact gather copies a whole layer into device staging every step before attending it; split moves no K/V for
the blocks already in memory. Per layer-step, the layer's block columns ``[start // bt, ceil(stop / bt))`` are
divided by the tier that holds each (row, column)::

    device blocks  -> the host kernel over the device tier's slab, in place (CPU hosts: that slab is host memory)
    host blocks    -> the host kernel over the host tier's slab, in place
    disk blocks    -> read (verified) in rounds into the disk tier's bounce buffer, the host kernel over each there

Each share is a partial attention (normalised output and log-sum-exp, :mod:`tierkv.attention.host_kernel`),
and the shares merge exactly (:func:`tierkv.attention.lse.merge`) — FlexGen's ``cpu_cache_compute`` and vLLM's
paged attention through a block table, with no staging buffer: on a CPU host the executor holds no memory of
its own (a disk share is attended where its read lands, in the disk tier's bounce buffer).

On a CPU host every memory tier's share is host memory, so they take one kernel call and need no merge: the
layer's columns become one table over the memory tiers' slab chunks concatenated (each tier's slot ids offset by
the slots of the tiers before it), kept per layer until its grid or a pool's chunks change (:class:`_Combined`),
and the call prepared for that table runs (:class:`~tierkv.attention.host_kernel.PagedCall`: checked and packed
once): per layer-step a few dozen calls into Python and C and, without a mask, four aten ops, whatever the context
(``tests/test_split_calls.py``).

Which path each phase takes: split runs one-token (decode) steps; multi-token steps (prefill) run on the mode's
prefill executor (streaming: exact, two chunk buffers). Key positions are counted from ``span.start`` (the
first attended token; a sliding window may start inside its first block, whose earlier tokens then have
negative positions and are not attended), which is also where the attention mask's columns start.

A disk share is read in rounds through a ring of pieces of about :data:`RING_PIECE_BYTES` in three of the disk
tier's bounce buffers (:meth:`SplitAttention.ring`), and attended round by round where it landed
(:meth:`SplitAttention._attend_rounds`, over :meth:`~tierkv.tiers.disk._DiskRead.each_round`): a step with one runs
the memory tiers' call first while the first rounds are read, then one kernel call per round, each verified before
it is attended and over the round's part of the table (:class:`_DiskShare`: the share's columns restricted to the
round's blocks, the same positions and mask columns), while the disk reads into the ring's other pieces; the parts
merge by log-sum-exp (:func:`merge_all`). Nothing is copied out of the bounce buffers, and the disk reads while the
CPU attends. A round's requests are planned (:meth:`~tierkv.tiers.disk.DiskTier.plan_rounds`) and its kernel call
prepared once per layer table, so a round costs a submit, a verification and a call with only its buffer new: on a
two-core host, Python run between kernel calls that each stream 2 MiB through the caches was 4-6x slower than in
a loop (``benchmarks/split_disk_profile.py``, docs/benchmarks.md "Scale").

The next layers' disk shares are submitted ahead (:meth:`PipelinedExecutor._read_ahead`,
:attr:`SplitAttention.read_ahead` = 2): the next layer's is in flight while this layer's rounds are attended, and
the one after is submitted into this layer's ring as soon as this layer is attended, so the disk engine reads on
its own threads across the layer boundary, while the model computes between two attentions; they are consumed
the same way.

**Memory and queue depth.** Split's reads hold the buffers exact gather's reads ahead may hold, ``READ_AHEAD + 2``
bounce buffers of at most ``DiskTier.bounce_bytes`` (the same names, ``ahead0`` .. ``ahead5``, so the mode's
prefill executor reuses them), spent differently: two reads at once (the layer attended and the next) of three
buffers each, instead of six reads of one buffer each, four of which would sit full until their layers came.
While a layer is attended all of its ring's pieces but one are in flight (several engine requests; at a 4 MiB
bounce limit, five rounds of 2 MiB) instead of one half of a bounce buffer, so at small budgets the disk queue
stays deep through the layer, and the read of the layer after next keeps it busy across the boundary; a layer's
share larger than one piece is cut into pieces even when it fits the ring, all in flight at once, so its first
round is attended while the rest land. A read that finds no read ahead (the first step, a table edit) takes the
ring the next layer's read does not hold.

On an accelerator (CUDA, or its checking stand-in) the parts run concurrently. The host share goes to the mover's
thread (:meth:`ThreadMover.submit`: its copy stream first waits for the compute stream's work so far): the query
is copied into pinned host memory on that stream, an event is recorded and waited for, the host kernel attends
the host slab, and its (out, lse) is copied up into device tensors on the same stream, which the compute stream
waits for (:meth:`MoveHandle.wait`) before the final merge. The disk share is read and attended on the calling
thread meanwhile, round by round in its bounce buffer as on a CPU host (the buffer is that thread's; the query and
mask go down once, the merged (out, lse) up once), after the device share's work was queued: the device share
is attended on the compute stream straight from the device slab through its block table, in pieces of at most
``piece_tokens / 4`` per row: torch's paged fallback, each piece's table made device tensors once per grid and
pool (:class:`_DeviceShare`, :class:`~tierkv.attention.host_kernel.TorchCall`: a step copies no index from the
host and queues the same kernels per piece whatever the context), whose fp32 temporaries per piece are reserved
against the device budget (:func:`tierkv.staging.split_scratch_bytes`) — a paged device kernel (FlashInfer /
flash-attention ``block_table``, FlexAttention) would read it without them. Nothing is staged: the device budget
needs only the open tails and that bounded scratch (``TieredCache.min_split_device_bytes``).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from tierkv.attention import host_kernel
from tierkv.attention import lse as _lse
from tierkv.attention.base import READ_AHEAD, DiskAhead, PipelinedExecutor, Span, register_executor
from tierkv.attention.streaming import DEFAULT_CHUNK_TOKENS
from tierkv.blocks import Tier
from tierkv.errors import InvalidConfigError
from tierkv.layout import BlockLayout
from tierkv.mover import MoveHandle, ThreadMover
from tierkv.staging import split_scratch_bytes, streaming_chunk_tokens
from tierkv.stats import Timeline, Trace
from tierkv.store import KVStore, ReadPlan
from tierkv.store.transfer import link
from tierkv.tiers.base import PendingRead
from tierkv.tiers.disk import DiskTier, _DiskRead
from tierkv.tiers.memory import MemoryTier, SlabPool, joined_slabs

RING_PIECE_BYTES = 2 * 2**20
"""The size each round of split's disk reads aims at (a piece of the read's ring; whole slots, at least one): half
the engine's 4 MiB chunk, so each round is one engine request and a ring of a few bounce buffers' bytes keeps
several of them in flight."""


@register_executor
class SplitAttention(PipelinedExecutor):
    """Each tier's blocks attended where they live — on the CPU from host memory, on an accelerator from its slab
    — and merged by log-sum-exp (module docstring)."""

    name = "split"
    replaces_attention = True
    read_ahead = 2
    """The next two layers' disk shares are read ahead: the next one's while this layer's rounds are attended, the
    one after as soon as this layer's read gave its ring back (at the end of :meth:`attend`), so the disk keeps
    reading across the layer boundary, while the model computes between two attentions. Each read rings through
    three bounce buffers (:meth:`ring`) instead of one, so the disk queue stays deep through a layer, in the buffers
    that ``READ_AHEAD`` reads ahead of one bounce buffer each would hold, most of them full and idle until their
    layers were attended (module docstring, "Memory and queue depth")."""

    @property
    def ahead_buffers(self) -> int:
        """Reads that hold a ring at once (``ahead0``, ``ahead1``: :meth:`ring_names`): the layer attended now and
        the next; the one after takes this layer's ring once the layer is attended (a claimed read is used up
        inside :meth:`attend`)."""
        return 2

    def __init__(self, store: KVStore, mover: ThreadMover, *, num_layers: int | None = None,
                 threads: int | None = None, piece_tokens: int = DEFAULT_CHUNK_TOKENS,
                 timeline: Timeline | None = None, trace: Trace | None = None) -> None:
        super().__init__(store, mover, num_layers=num_layers, timeline=timeline, trace=trace)
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise InvalidConfigError(f"threads must be a positive int or None (torch's), got {threads!r}.")
        if isinstance(piece_tokens, bool) or not isinstance(piece_tokens, int) or piece_tokens < 1:
            raise InvalidConfigError(f"piece_tokens must be a positive int, got {piece_tokens!r}.")
        self.threads = threads
        self.piece_tokens = streaming_chunk_tokens(piece_tokens, store.block_tokens)  # device share, per row
        self._shares: dict[int, tuple[int, int, int, list[tuple[Tier, np.ndarray]], np.ndarray,
                                      _DiskShare | None, _DeviceShare | None]] = {}  # fmt: skip
        self._here: dict[int, _Combined] = {}  # layer -> its one-call table on a CPU host (_attend_here)

    def attend(self, span: Span, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
               softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query`` ``[B, H_q, q, D]`` over stored tokens ``[span.start, span.stop)`` of
        ``span.layer``; ``mask`` None (causal) or ``[B, 1, q, stop - start]``. Returns the output ``[B, H_q, q, D]``
        and its log-sum-exp ``[B, H_q, q]``, fp32 (:meth:`Executor.attend`)."""
        timeline = self.timeline  # telemetry: a layer at or below the last one starts a step (its wall time)
        if timeline is not None and (span.layer <= self.last_layer or timeline.current is None):
            timeline.begin_step(time.perf_counter(), query.shape[2], span.stop, 0)
        self._see_layer(span)
        accelerated = self._accel.streams
        if accelerated:  # before the tables: a reservation may move device blocks to the host
            self._reserve_scratch(query, span.layer)
        layer, start, stop = span.layer, span.start, span.stop
        plan = self.store.plan_read(layer, start, stop)  # also the access, as every executor records it
        upcoming: list[tuple[int, int, int]] = []
        if Tier.DISK in self.store.tiers:  # the next layer's disk share is read (if not yet), on the engine's threads
            target = self.next_layer(layer)
            while target is not None and target != layer and len(upcoming) < self.read_ahead:
                if target in self.store.layouts:
                    upcoming.append((target, self.start_of(target), self.store.seq_length(target)))
                target = self.next_layer(target)
            self._drop_unused_ahead({(layer, plan.first), *((t, begin // self.store.block_tokens)
                                                            for t, begin, _ in upcoming)})  # fmt: skip
            self._read_ahead(upcoming[:1])  # this layer's read holds the other ring
        if not accelerated:  # every slab is host memory: every share on the CPU, here, in one kernel call
            attended = self._attend_here(plan, query, mask, scaling, softcap, start, stop)
            self._read_ahead(upcoming)  # this layer's ring is free: the layer after next starts reading now
            return attended
        # host share on the mover's thread, device share on the compute stream, disk share on this thread
        shares, columns, shift, disk, device = self._tables(layer, start, stop)
        attend = _Attend(self, plan, query, mask, scaling, softcap, columns, shift, stop - start)
        by_tier = dict(shares)
        host = [(Tier.HOST, by_tier[Tier.HOST])] if Tier.HOST in by_tier else []
        handle = self._start_cpu_part(attend, host) if host else None
        try:
            out, lse = attend.device_part(device) if device is not None else (None, None)
            if disk is not None:
                out, lse = merge(out, lse, *self._disk_part(attend, disk, columns, shift))
        finally:
            if handle is not None:
                handle.wait()  # re-raises the CPU part's error; the compute stream waits for its copy up
        self._read_ahead(upcoming)  # as on a CPU host: the layer after next, into this layer's ring
        if attend.landed is not None:
            out, lse = merge(out, lse, *attend.landed)
        if out is None or lse is None:
            raise InvalidConfigError(f"layer {layer} has no stored tokens in [{start}, {stop}) to attend.")
        return out, lse

    def _attend_here(self, plan: ReadPlan, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
                     softcap: float | None, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every share of a layer-step on a CPU host (each slab is host memory): one host kernel call over the
        layer's table across the memory tiers (:class:`_Combined`) — the call prepared for the layer
        (:class:`~tierkv.attention.host_kernel.PagedCall`), with only the query, the key count, the mask and the
        positions (a moved window start) new — then, with a disk share, one call per round of its read, in the
        bounce buffer (:meth:`_attend_rounds`; its rounds read meanwhile), merged. Returns the output
        ``[B, H_q, q, D]`` and its log-sum-exp, fp32."""
        layer, layout, bt = plan.layer, self.store.layouts[plan.layer], self.store.block_tokens
        here = self._here.get(layer)
        chunks = None  # the tiers' chunks, where this step looked them up
        if here is None or not here.current((self.store.table.rows[layer].version, start // bt, -(-stop // bt)),
                                            layout.slot_bytes):  # fmt: skip
            here, chunks = _Combined.of(self.store, layer, start, stop)
            self._here[layer] = here
        if here.empty:
            raise InvalidConfigError(f"layer {layer} has no stored tokens in [{start}, {stop}) to attend.")
        shift = start - here.first_position
        if here.disk is None:
            return self._attend_memory(here, chunks, layout, query, mask, scaling, softcap, stop - start, shift)
        with self._reading(plan, here.disk) as read:  # its first rounds are in flight while the memory share attends
            parts = [] if not here.held else [
                self._attend_memory(here, chunks, layout, query, mask, scaling, softcap, stop - start, shift)]
            parts += self._attend_rounds(read, layout, here.disk, query, mask, scaling, softcap, stop - start,
                                         here.columns, shift, layer)  # fmt: skip
        return merge_all(parts)

    def _attend_memory(self, here: _Combined, chunks: list[torch.Tensor] | None, layout: BlockLayout,
                       query: torch.Tensor, mask: torch.Tensor | None, scaling: float, softcap: float | None,
                       length: int, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The memory tiers' share of ``here`` in one kernel call (:class:`_TableCall`), over the chunks (``chunks``:
        looked up already, or None: looked up only if the call needs them)."""
        def slabs() -> list[torch.Tensor]:
            return here.chunks(layout) if chunks is None else chunks

        return here.attention.attend(slabs, query, length, mask, shift, scaling, softcap, self.threads)

    def ring(self) -> tuple[int, int, int]:
        """``(buffers, limit, parts)`` of each of split's disk reads: a ring through ``buffers`` bounce buffers of at
        most ``limit`` (``DiskTier.bounce_bytes``) each, ``parts`` pieces of about :data:`RING_PIECE_BYTES` in each,
        whatever the limit (the engine queues requests beyond its depth; fewer, larger pieces that stayed within
        it made 32 MiB buffers 1.27-1.31x the disk bound instead of 1.06-1.13x: docs/benchmarks.md, "Scale").
        ``buffers`` is the executor's share of the read-ahead bound, ``READ_AHEAD + 2`` bounce buffers
        (:data:`~tierkv.attention.base.READ_AHEAD_BYTES`), over its :attr:`ahead_buffers` reads: three, so
        ``3 * parts - 1`` rounds are in flight while one is attended."""
        buffers, limit = (READ_AHEAD + 2) // self.ahead_buffers, self._disk().bounce_bytes
        return buffers, limit, max(1, limit // RING_PIECE_BYTES)

    def ring_names(self, purpose: str) -> list[str]:
        """The bounce buffers of the ring a read holds under ``purpose`` (``ahead<g>``, :meth:`_free_buffer_name`):
        ``ahead<g * buffers>`` .. — the names exact gather's and streaming's reads ahead use, so a mode's prefill
        executor and split share those buffers instead of holding more."""
        buffers = self.ring()[0]
        group = int(purpose.removeprefix("ahead"))
        return [f"ahead{group * buffers + j}" for j in range(buffers)]

    def _disk(self) -> DiskTier:
        disk = self.store.tiers[Tier.DISK]
        assert isinstance(disk, DiskTier)
        return disk

    def _start_ring(self, layout: BlockLayout, slots: np.ndarray, memo: dict | None, purpose: str) -> _DiskRead:
        """A read of disk ``slots`` through the ring (:meth:`ring`) held under ``purpose`` (:meth:`ring_names`)."""
        _, limit, parts = self.ring()
        scratch, names = self.store.transfer.scratch, self.ring_names(purpose)
        return self._disk().start_read(layout, slots, scratch, memo, names, limit=limit, parts=parts, in_pieces=True)

    def _submit_ahead(self, layer: int, plan: ReadPlan, purpose: str) -> PendingRead | None:
        """The disk part of ``plan``, read through a ring (:meth:`ring`) instead of one bounce buffer."""
        for part in plan.parts:
            if part.tier == Tier.DISK:
                return self._start_ring(self.store.layouts[layer], part.slots, part.memo, purpose)
        return None

    def _drop_unused_ahead(self, keep: set[tuple[int, int]]) -> None:
        """Drop the reads ahead that no key of ``keep`` (this layer's plan, the next layers' first columns) will
        claim — a sliding window moved their first column — so their buffers are free for the reads that will."""
        for key in [key for key in self._disk_ahead if key not in keep]:
            self._drop_ahead_read(key)

    @contextlib.contextmanager
    def _reading(self, plan: ReadPlan, share: _DiskShare) -> Iterator[_DiskRead]:
        """The read of ``plan``'s disk share (the same blocks as ``share``, in the same order): the read submitted
        ahead when there is one (:meth:`_claim_ahead`), else one submitted now, through the ring the next layer's
        read does not hold (:meth:`_drop_unused_ahead` left no other read holding one). An error or interrupt inside
        waits for its rounds in flight; its bytes count as ``disk->host`` once it was used."""
        layout = self.store.layouts[plan.layer]
        held = self._claim_ahead(plan.layer, plan)
        try:
            if held is None:
                purpose = self._free_buffer_name()
                assert purpose is not None, self._disk_ahead
                ring = self._start_ring(layout, share.slots, share.memo, purpose)
                held = DiskAhead(plan, ring, purpose, len(share.slots) * layout.slot_bytes)
                self._buffer_users[purpose] = held
            read = held.pending
            assert isinstance(read, _DiskRead)
            try:
                yield read
            except BaseException:
                read.settle()
                raise
        finally:
            if held is not None:  # (an interrupt may come before a ring submitted here was recorded)
                self._buffer_users.pop(held.purpose, None)
        self.store.transfer.count(link(Tier.DISK, Tier.HOST), len(share.slots) * layout.block_bytes)

    def _attend_rounds(self, read: _DiskRead, layout: BlockLayout, share: _DiskShare, query: torch.Tensor,
                       mask: torch.Tensor | None, scaling: float, softcap: float | None, length: int,
                       columns: np.ndarray, shift: int, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The disk share attended round by round where each round landed, in the disk tier's bounce buffer (no
        copy): one kernel call per round over its blocks (:meth:`_DiskShare.attend`), while the next round is read.
        Returns each round's (out, lse); the time spent waiting for a round is stall. ``query`` and ``mask`` are in
        host memory; ``columns - shift`` ``[B, n]``: each column's first key position."""
        query = query.detach().float().contiguous()  # once, not per round
        looped = share.attend_all(read, layout, query, length, mask, columns, shift, scaling, softcap, self.threads)
        if looped is not None:
            if looped[1] > 0:
                self._stalled(time.perf_counter() - looped[1], layer)  # (the waits, as one span ending now)
            return looped[0]
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        with contextlib.closing(read.each_round()) as rounds:
            while True:
                waited_from = time.perf_counter()
                landed = next(rounds, None)
                if landed is None:
                    return parts
                self._stalled(waited_from, layer)
                lo, hi, staged = landed
                parts.append(share.attend(lo, hi, layout.blocks_of(staged), query, length, mask, columns, shift,
                                          scaling, softcap, self.threads))  # fmt: skip

    def _reserve_scratch(self, query: torch.Tensor, layer: int) -> None:
        """Count the device temporaries of a step (:func:`split_scratch_bytes`) against the budget, growing the
        reservation when a larger batch or model needs more."""
        batch, q_heads, _, head_dim = query.shape
        need = split_scratch_bytes(batch, q_heads, self.store.layouts[layer].kv_heads, head_dim, self.piece_tokens)
        if need > self.staging.reserved:
            self.staging.release()
            self.staging.reserve(need)

    def _disk_part(self, attend: _Attend, share: _DiskShare, columns: np.ndarray,
                   shift: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The disk share attended round by round in the bounce buffer on this thread (:meth:`_attend_rounds`,
        while the device part runs on the compute stream and the host part on the mover's thread), its (out, lse)
        moved up."""
        query, mask = attend.query.cpu(), None if attend.mask is None else attend.mask.cpu()
        with self._reading(attend.plan, share) as read:
            parts = self._attend_rounds(read, attend.layout, share, query, mask, attend.scaling, attend.softcap,
                                        attend.length, columns, shift, attend.plan.layer)  # fmt: skip
        out, lse = merge_all(parts)
        return out.to(attend.query.device), lse.to(attend.query.device)

    def _start_cpu_part(self, attend: _Attend, shares: list[tuple[Tier, np.ndarray]]) -> MoveHandle:
        """The host share on the mover's thread and copy stream: the query and mask down into pinned memory, an
        event waited for, the host kernel over the host slab, the (out, lse) copied up into device tensors."""
        accel: Any = self._accel
        query, mask = attend.query, attend.mask
        device = query.device
        batch, heads, q_len, head_dim = query.shape
        out = torch.empty((batch, heads, q_len, head_dim), dtype=torch.float32, device=device)
        lse = torch.empty((batch, heads, q_len), dtype=torch.float32, device=device)
        attend.landed = (out, lse)

        held: list[torch.Tensor] = []  # the pinned buffers themselves (an accelerator tracks them while they live)

        def pinned(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            held.append(accel.host_empty((like.numel() * dtype.itemsize,), True))
            return held[-1].view(dtype).view(like.shape)

        def job() -> None:  # runs on the mover's copy stream, after the compute stream's work so far
            stream = accel.current_stream(device)
            host_query = pinned(query, query.dtype)
            accel.copy(host_query, query.detach())
            host_mask = None if mask is None else pinned(mask, mask.dtype)
            if mask is not None:
                accel.copy(host_mask, mask.detach())
            down = accel.Event()
            down.record(stream)
            down.synchronize()
            accel.host_write(host_query)  # the kernel's read of it, checked (on the stand-in) as an access
            part_out, part_lse = attend.cpu_part(shares, host_query, host_mask)
            assert part_out is not None and part_lse is not None
            up_out, up_lse = pinned(part_out, torch.float32), pinned(part_lse, torch.float32)
            accel.host_write(up_out)
            accel.host_write(up_lse)
            up_out.copy_(part_out)
            up_lse.copy_(part_lse)
            accel.copy(out, up_out)  # on this stream; the compute stream waits for it (MoveHandle.wait)
            accel.copy(lse, up_lse)

        return self.mover.submit(job)

    def _tables(self, layer: int, start: int, stop: int) -> tuple[list[tuple[Tier, np.ndarray]], np.ndarray, int,
                                                                  _DiskShare | None, _DeviceShare | None]:  # fmt: skip
        """Per tier, the block table of its share (``[B, n]`` slots, -1 where another tier holds the block); each
        column's first token counted from the first column's, and ``shift``, where ``start`` lies in it (key
        positions: ``columns - shift``); the disk share (which keeps its rounds' requests and calls) and the device
        share (which keeps its prepared tables). Cached until the layer's grid changes."""
        rows = self.store.table.rows[layer]
        bt = self.store.block_tokens
        first, end = start // bt, -(-stop // bt)
        shift = start - first * bt
        cached = self._shares.get(layer)
        if cached is not None and cached[:3] == (rows.version, first, end):
            return cached[3], cached[4], shift, cached[5], cached[6]
        tiers, slots = rows.tiers[:, first:end], rows.slots[:, first:end]
        shares = [(tier, np.where(tiers == tier, slots, -1)) for tier in self.store.chain if (tiers == tier).any()]
        columns = np.ascontiguousarray(np.broadcast_to(np.arange(end - first) * bt, slots.shape), dtype=np.int64)
        disk = next((_DiskShare(table) for tier, table in shares if tier == Tier.DISK), None)
        per = max(1, self.piece_tokens // 4 // bt)  # within the scratch (split_scratch_bytes)
        device = next((_DeviceShare(table, columns, per) for tier, table in shares if tier == Tier.DEVICE), None)
        self._shares[layer] = (rows.version, first, end, shares, columns, disk, device)
        return shares, columns, shift, disk, device

    # ------------------------------------------------------------------------------------ bookkeeping
    def invalidate(self) -> None:
        self.wait_all()
        self._drop_all_ahead()
        self._shares.clear()
        self._here.clear()
        self.version += 1

    def reset(self) -> None:
        self.invalidate()

    def drop(self, layer: int) -> None:
        self._shares.pop(layer, None)
        self._here.pop(layer, None)
        for key in [key for key in self._disk_ahead if key[0] == layer]:
            self._drop_ahead_read(key)

    def wait_all(self) -> None:
        """Only disk reads ahead may be in flight (the shares are read inside :meth:`attend`)."""
        self._settle_ahead()

    def close(self) -> None:
        self.invalidate()
        self.staging.release()


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, part_out: torch.Tensor,
          part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tierkv.attention.lse.merge` where a row may hold no block of either part (each tier holds some rows'
    blocks only): such a query keeps output 0 and log-sum-exp ``-inf`` instead of NaN (a NaN of its keys stays NaN,
    as softmax gives it)."""
    merged_out, merged_lse = _lse.merge(out, lse, part_out, part_lse)
    return merged_out.masked_fill(torch.isneginf(merged_lse).unsqueeze(-1), 0.0), merged_lse  # (a NaN stays)


def merge_all(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge` of any number of (out, lse) parts at once (a disk share's rounds): a few ops in all, not a
    few per part. A query that no part attended keeps output 0 and log-sum-exp ``-inf``."""
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse for _, lse in parts])
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse).masked_fill_(torch.isneginf(lses), 0.0)  # -inf - -inf: no key in that part
    return (torch.stack([out for out, _ in parts]) * weights.unsqueeze(-1)).sum(dim=0), lse


class _PoolState(NamedTuple):
    """A memory tier's pool as a :class:`_Combined` table saw it: the pool and its last chunk (weakly), the chunk
    count."""

    memory: MemoryTier
    pool: weakref.ref[SlabPool] | None
    chunk_count: int
    last: weakref.ref[torch.Tensor] | None

    @classmethod
    def of(cls, memory: MemoryTier, slot_bytes: int) -> _PoolState:
        pool = memory.pools.get(slot_bytes)
        if pool is None:
            return cls(memory, None, 0, None)
        return cls(memory, weakref.ref(pool), len(pool.chunks), weakref.ref(pool.chunks[-1]) if pool.chunks else None)

    def unchanged(self, slot_bytes: int) -> bool:
        """Whether the tier's pool for ``slot_bytes`` still has exactly the chunks it had."""
        pool = self.memory.pools.get(slot_bytes)
        if pool is None or self.pool is None:
            return pool is None and self.pool is None
        chunks = pool.chunks
        return (self.pool() is pool and len(chunks) == self.chunk_count
                and (self.last is None or self.last() is chunks[-1]))  # fmt: skip


class _Combined:
    """A layer's block columns ``[first, end)`` as one table over the memory tiers' blocks, all in host memory:
    their slab chunks concatenated (each tier's slot ids offset by the slots of the tiers before it; the tier with
    the fewest chunks first), -1 where no memory tier holds the block; and the disk share's blocks
    (:class:`_DiskShare`). One kernel call attends the memory tiers' share exactly; the disk share is attended
    round by round and merged.

    Valid while the layer's grid (version, columns) and the memory tiers' pools are unchanged; a pool's chunks
    change only at its end (a chunk added or the last given back), so its chunk count and last chunk tell. It
    holds the pools and chunks weakly: a chunk given back is freed, and the entry is then stale."""

    def __init__(self, version: int, first: int, end: int, first_position: int, pools: list[_PoolState],
                 table: np.ndarray, columns: np.ndarray, disk: _DiskShare | None) -> None:
        self.key = (version, first, end)
        self.first_position = first_position  # the first column's first token
        self.pools = pools
        self.table = table  # [B, n] ids into the concatenated chunks, -1: no block in a memory tier
        self.columns = columns  # [B, n] each column's first token, from the first column's
        self.disk = disk  # None: nothing on disk
        self.held = bool((table >= 0).any())  # a memory tier holds some block
        self.empty = not self.held and disk is None
        self.attention = _TableCall(table, columns)  # the memory tiers' share's call

    @classmethod
    def of(cls, store: KVStore, layer: int, start: int, stop: int) -> tuple[_Combined, list[torch.Tensor]]:
        """The entry for ``layer``'s columns over ``[start, stop)``, and the memory tiers' chunks it numbers."""
        rows, layout, bt = store.table.rows[layer], store.layouts[layer], store.block_tokens
        first, end = start // bt, -(-stop // bt)
        tiers, slots = rows.tiers[:, first:end], rows.slots[:, first:end]
        table = np.full(slots.shape, -1, dtype=np.int64)
        pools: list[_PoolState] = []
        slabs = {memory: memory.slabs(layout) for memory in map(store.tiers.get, store.chain)
                 if isinstance(memory, MemoryTier)}  # fmt: skip
        # the tier with the fewest chunks first: the kernel finds an entry's chunk by walking the chunks before it
        memories = sorted(slabs, key=lambda memory: len(slabs[memory]))
        chunks, firsts = joined_slabs([slabs[memory] for memory in memories])
        for memory, offset in zip(memories, firsts):  # a few tiers: vectorised
            held = tiers == memory.kind
            table[held] = slots[held] + offset
            pools.append(_PoolState.of(memory, layout.slot_bytes))
        on_disk = tiers == Tier.DISK
        disk = _DiskShare(np.where(on_disk, slots, -1)) if on_disk.any() else None
        columns = np.ascontiguousarray(np.broadcast_to(np.arange(end - first, dtype=np.int64) * bt, slots.shape))
        return cls(rows.version, first, end, first * bt, pools, table, columns, disk), chunks

    def current(self, key: tuple[int, int, int], slot_bytes: int) -> bool:
        """Whether the entry still holds for the grid ``key`` (version, first column, end column) and the pools."""
        return key == self.key and all(pool.unchanged(slot_bytes) for pool in self.pools)

    def chunks(self, layout: BlockLayout) -> list[torch.Tensor]:
        """The memory tiers' chunks, concatenated in the order the table numbers them."""
        return [chunk for state in self.pools for chunk in state.memory.slabs(layout)]


class _DiskShare:
    """A layer-step's disk blocks: their slots in row-major table order (the order its read lands them in), and
    for each round of the read, a table of that round's blocks in the bounce buffer and the kernel call prepared
    for it. Kept with the layer's table (:class:`_Combined`), so a decode step plans and checks nothing per round:
    the read's round requests are in :attr:`memo`, each round's call only takes the buffer it landed in."""

    def __init__(self, table: np.ndarray) -> None:
        """``table`` ``[B, n]``: the disk slot of each block column's block, -1 where another tier holds it."""
        held = table >= 0
        self.rows, self.columns = np.nonzero(held)  # row-major, as the slots
        self.slots = table[held]
        self.batch = table.shape[0]
        self.memo: dict = {}  # the read's round requests (DiskTier.plan_rounds), as a cached plan's memo keeps them
        self._rounds: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._calls: dict[tuple[int, int], _TableCall] = {}

    def round(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The share's blocks ``[lo, hi)`` (a round): their table ``[B, m]`` over the ``m`` columns that hold one
        (ids ``0 .. hi - lo`` into the round's buffer, -1 elsewhere), and those columns, for the positions and the
        mask. Kept: each step reads the same rounds until the grid changes."""
        kept = self._rounds.get((lo, hi))
        if kept is None:
            columns = np.unique(self.columns[lo:hi])
            table = np.full((self.batch, columns.size), -1, dtype=np.int64)
            table[self.rows[lo:hi], np.searchsorted(columns, self.columns[lo:hi])] = np.arange(hi - lo)
            kept = self._rounds[(lo, hi)] = (table, columns)
        return kept

    def attend(self, lo: int, hi: int, slab: torch.Tensor, query: torch.Tensor, length: int,
               mask: torch.Tensor | None, columns: np.ndarray, shift: int, scaling: float, softcap: float | None,
               threads: int | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Round ``[lo, hi)``, landed as the blocks ``slab``, attended by the host kernel through the round's
        :class:`_TableCall` (``columns - shift`` ``[B, n]``: the share's columns' first key positions), which each
        step hands only the buffer, the query, the key count, the mask and a moved ``shift``."""
        return self._call(lo, hi, columns).attend(lambda: slab, query, length, mask, shift, scaling, softcap, threads,
                                                  bind=slab)  # fmt: skip

    def attend_all(self, read: _DiskRead, layout: BlockLayout, query: torch.Tensor, length: int,
                   mask: torch.Tensor | None, columns: np.ndarray, shift: int, scaling: float, softcap: float | None,
                   threads: int | None) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float] | None:  # fmt: skip
        """Every round of ``read`` attended where it lands, all in one C loop
        (:meth:`~tierkv.tiers.disk._DiskRead.consume_rounds`): each round's kernel call is bound to the piece of the
        ring its round lands in and packed before the loop, and the loop calls the kernel as each round lands and
        passes its checksums, with no Python between rounds. Returns each round's (out, lse) and the seconds spent
        waiting for rounds; None where the loop cannot run (:meth:`~tierkv.tiers.disk._DiskRead.ring_views`, or the
        C kernel does not load): the caller attends round by round."""
        views = read.ring_views()
        if views is None:
            return None
        packed, parts, alive = [], [], []  # alive: the query and mask as each call reads them, until the loop ran
        for lo, hi, staged in views:
            call = self._ready(lo, hi, layout.blocks_of(staged), query, length, mask, columns, shift, scaling, softcap,
                               threads)  # fmt: skip
            if call is None:
                return None
            args, out, lse, held = call.pack(query, length, mask)
            packed.append((args, call))
            parts.append((out, lse))
            alive.append(held)
        arguments = np.array([ctypes.addressof(args) for args, _ in packed], dtype=np.uint64)
        outcome = read.consume_rounds(host_kernel.kernel_address(), arguments)
        if outcome.failed is not None:  # (a checksum mismatch raised already)
            packed[outcome.failed][1].raise_for(outcome.status)
        return parts, outcome.waited_s

    def _ready(self, lo: int, hi: int, slab: torch.Tensor, query: torch.Tensor, length: int,
               mask: torch.Tensor | None, columns: np.ndarray, shift: int, scaling: float, softcap: float | None,
               threads: int | None) -> host_kernel.PagedCall | None:  # fmt: skip
        """Round ``[lo, hi)``'s kernel call bound to ``slab``, where the round lands (:meth:`_TableCall.ready`)."""
        return self._call(lo, hi, columns).ready(lambda: slab, query, length, mask, shift, scaling, softcap, threads,
                                                 bind=slab)  # fmt: skip

    def _call(self, lo: int, hi: int, columns: np.ndarray) -> _TableCall:
        """Round ``[lo, hi)``'s :class:`_TableCall`, made on first use (``columns``: the share's first key positions
        before the shift)."""
        kept = self._calls.get((lo, hi))
        if kept is None:
            table, round_columns = self.round(lo, hi)
            kept = self._calls[(lo, hi)] = _TableCall(table, columns[:, round_columns])
        return kept


class _TableCall:
    """A block table over host slabs, its columns' first key positions before the shift, and the host kernel call
    prepared for it (:class:`~tierkv.attention.host_kernel.PagedCall`; None where the C kernel does not load): no
    checking or packing per step. Prepared again for a new query shape, scaling, softcap, causality or thread
    count; its positions rewritten in place when the shift moves (a sliding window's start inside the same blocks).
    A layer's memory share keeps one (:class:`_Combined`), and each round of its disk share (:class:`_DiskShare`)."""

    __slots__ = ("table", "base", "call", "options", "shift")

    def __init__(self, table: np.ndarray, base: np.ndarray) -> None:
        self.table, self.base = table, base
        self.call: host_kernel.PagedCall | None = None
        self.options: tuple | None = None  # what the call was prepared for
        self.shift = 0  # what its positions hold

    def attend(self, slabs: Callable[[], torch.Tensor | list[torch.Tensor]], query: torch.Tensor, length: int,
               mask: torch.Tensor | None, shift: int, scaling: float, softcap: float | None, threads: int | None, *,
               bind: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The table attended over ``slabs()`` (called only to prepare, or for the torch version) with key positions
        ``base - shift``; ``bind``: the one slab chunk, where it lies elsewhere than when prepared (a round's bounce
        buffer), so the call is bound to it first."""
        call = self.ready(slabs, query, length, mask, shift, scaling, softcap, threads, bind=bind)
        if call is None:
            return host_kernel.paged_attention(query, slabs(), self.table, length, scaling=scaling, softcap=softcap,
                                               causal=mask is None, mask=mask, positions=self.base - shift,
                                               threads=threads)  # fmt: skip
        return call(query, length, mask)

    def ready(self, slabs: Callable[[], torch.Tensor | list[torch.Tensor]], query: torch.Tensor, length: int,
              mask: torch.Tensor | None, shift: int, scaling: float, softcap: float | None, threads: int | None, *,
              bind: torch.Tensor | None = None) -> host_kernel.PagedCall | None:  # fmt: skip
        """The kernel call for :meth:`attend`'s arguments: prepared (again where they changed), its positions
        shifted, bound to ``bind``; None where the C kernel does not load."""
        options = (query.shape, scaling, softcap, mask is None, threads)
        if options != self.options:
            self.call = host_kernel.prepare(query, slabs(), self.table, length, scaling=scaling, softcap=softcap,
                                            causal=mask is None, masked=mask is not None, positions=self.base - shift,
                                            threads=threads)  # fmt: skip
            self.options, self.shift = options, shift
        if self.call is None:
            return None
        if self.shift != shift:
            assert self.call.positions is not None
            np.subtract(self.base, shift, out=self.call.positions)
            self.shift = shift
        if bind is not None:
            self.call.bind(bind)
        return self.call


class _Attend:
    """One layer-step's arguments, and its two parts: shares attended on the CPU, the device share on the device."""

    def __init__(self, executor: SplitAttention, plan: ReadPlan, query: torch.Tensor, mask: torch.Tensor | None,
                 scaling: float, softcap: float | None, columns: np.ndarray, shift: int, length: int) -> None:
        self.executor, self.plan, self.query, self.mask = executor, plan, query, mask
        self.scaling, self.softcap, self.shift, self.length = scaling, softcap, shift, length
        self.positions = columns - shift  # each column's first key position
        self.layout = executor.store.layouts[plan.layer]
        self.landed: tuple[torch.Tensor, torch.Tensor] | None = None  # the CPU part's (out, lse), on the device

    def cpu_part(self, shares: list[tuple[Tier, np.ndarray]], query: torch.Tensor,
                 mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The memory tiers' shares in host memory, attended in place by the host kernel. ``query`` and ``mask``
        are in host memory."""
        executor, layout = self.executor, self.layout
        out = lse = None
        for tier, table in shares:
            memory = executor.store.tiers[tier]
            assert isinstance(memory, MemoryTier)
            slabs = memory.slabs(layout)
            part = host_kernel.paged_attention(query, slabs, table, self.length, scaling=self.scaling,
                                               softcap=self.softcap, causal=mask is None, mask=mask,
                                               positions=self.positions, threads=executor.threads)  # fmt: skip
            out, lse = merge(out, lse, *part)
        return out, lse

    def device_part(self, share: _DeviceShare) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The device share attended on the compute stream straight from the device slab, through its prepared
        tables (:class:`_DeviceShare`)."""
        memory = self.executor.store.tiers[Tier.DEVICE]
        assert isinstance(memory, MemoryTier)
        slabs = memory.slabs(self.layout)
        self.executor._accel.used(*slabs)  # the compute stream reads the slab now
        return share.attend(memory, slabs, self.layout, self.query, self.length, self.mask, self.shift,
                            self.scaling, self.softcap)  # fmt: skip


class _DeviceShare:
    """A layer's device blocks over its grid, attended on the device from the device slab: only the columns that
    hold a device block, a quarter of ``piece_tokens`` per row at a time (the fp32 temporaries of each piece fit in
    the reserved scratch), each piece's table prepared once as device tensors
    (:class:`~tierkv.attention.host_kernel.TorchCall`), so a step copies no index from the host. Prepared again
    for a new query shape, scaling, softcap or causality, or when the device pool's chunks change; a moved
    ``shift`` (a sliding window's start inside the same blocks) moves the prepared key positions."""

    def __init__(self, table: np.ndarray, columns: np.ndarray, per: int) -> None:
        """``table`` ``[B, n]``: the device slot of each column's block, -1 where another tier holds it;
        ``columns``: each column's first token, from the first column's; ``per``: columns per piece."""
        held = np.flatnonzero((table >= 0).any(axis=0))
        self.pieces = [held[first:first + per] for first in range(0, len(held), per)]
        self.table, self.columns = table, columns
        self.calls: list[host_kernel.TorchCall] = []
        self.options: tuple | None = None  # what the calls were prepared for
        self.pool: _PoolState | None = None
        self.shift = 0  # the shift the calls' positions were prepared at

    def attend(self, memory: MemoryTier, slabs: list[torch.Tensor], layout: BlockLayout, query: torch.Tensor,
               length: int, mask: torch.Tensor | None, shift: int, scaling: float,
               softcap: float | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        options = (query.shape, scaling, softcap, mask is None)
        if options != self.options or self.pool is None or not self.pool.unchanged(layout.slot_bytes):
            self.calls = [host_kernel.prepare_torch(query, slabs, self.table[:, piece], length, scaling=scaling,
                                                    softcap=softcap, causal=mask is None,
                                                    positions=self.columns[:, piece] - shift)
                          for piece in self.pieces]  # fmt: skip
            self.options, self.pool, self.shift = options, _PoolState.of(memory, layout.slot_bytes), shift
        out = lse = None
        for call in self.calls:  # (a piece's own output is 0 where it attends no key)
            part = call(query, slabs, length, mask, shift - self.shift)
            out, lse = part if out is None else merge(out, lse, *part)
        return out, lse
