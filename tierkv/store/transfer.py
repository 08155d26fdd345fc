"""Moving block data: plans into staging, new blocks into their tiers, demoted blocks down the chain.

Each tier does its own I/O (:mod:`tierkv.tiers.base`); this module only decides the order. A read submits
its slowest tier first (the disk engine reads on its own threads), copies the memory tiers' blocks while
that read is in flight, and lands the disk blocks last. Per-thread bounce and landing buffers
(:class:`~tierkv.tiers.base.Scratch`) keep a read on the mover thread and one on the caller's apart.

Counts per layer per step (a run is a stretch of one row's consecutive columns on one tier; a chunk run
also stays within one slab chunk, of which a pool has few, see :mod:`tierkv.tiers.memory`): one
``index_select`` per device chunk run and per host chunk run (CPU hosts); on CUDA one host->landing copy per
run of consecutive host slots and one landing->staging copy per landing piece; one batched engine call for all
disk blocks, then one copy per run (through the landing buffer on CUDA).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierkv.accel import backend
from tierkv.blocks import Tier
from tierkv.layout import BlockLayout, SlotBytes
from tierkv.store.plan import ReadPlan, TierPart
from tierkv.tiers.base import Dest, PendingRead, Scratch, StorageTier
from tierkv.tiers.disk import BOUNCE_BYTES, BounceBuffer

MEMO_DESTINATIONS = 4  # destinations a plan part keeps views for (an executor's staging buffers)

LINKS = ("device->device", "device->host", "host->device", "host->disk", "device->disk", "disk->device")


@dataclass(frozen=True, slots=True)
class PartTiming:
    """One source tier's part of a read, for the telemetry (:mod:`tierkv.attention.timed_read`): ``perf_counter``
    from its submission to its data landing, and on an accelerator with streams the events recorded at both ends
    on the stream that ran the copies (None elsewhere). ``copies``: the part's runs."""

    tier: Tier
    nbytes: int
    copies: int
    begun: float
    ended: float
    start_event: Any = None
    end_event: Any = None


_LINKS = {(source, target): f"{source.label}->{target.label}" for source in Tier for target in Tier}


def link(source: Tier, target: Tier) -> str:
    return _LINKS[(source, target)]


class Transfer:
    """The store's data movement and its byte counters (``bytes_moved`` per link)."""

    def __init__(self, tiers: Mapping[Tier, StorageTier], device: torch.device) -> None:
        self.tiers = tiers
        self.device = device
        self.accel = accel = backend(device)
        self.scratch = Scratch(lambda: BounceBuffer(pin=accel.streams, accel=accel), device=device, accel=accel)
        self.bytes_moved = dict.fromkeys(LINKS, 0)
        self._lock = threading.Lock()  # reads run on the mover thread too

    def count(self, name: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_moved[name] = self.bytes_moved.get(name, 0) + nbytes

    # ----------------------------------------------------------------------------------------- reads
    def read_into(self, layout: BlockLayout, plan: ReadPlan, dest: torch.Tensor, tail_tokens: int,
                  timings: list[PartTiming] | None = None, ahead: PendingRead | None = None) -> None:
        """Fill ``dest`` ``[2, B, H_kv, >= plan.blocks * block_tokens, D]`` with the plan's blocks; ``ahead`` is
        this plan's disk part already submitted by :meth:`read_ahead`. With ``timings`` (telemetry on), each part
        appends its :class:`PartTiming` as it lands (timed here, so a read makes no call per part to a probe)."""
        bt = layout.block_tokens
        where = (dest.data_ptr(), dest.shape, dest.stride(), dest.dtype)  # the destination views are cached for it
        blocks: list[torch.Tensor] = []  # [B, n, 2, H, bt, D] once a part needs it (see _dests)
        started: list[tuple[TierPart, PendingRead, float, Any]] = []
        events = timings is not None and self.accel.streams
        try:
            for part in plan.parts:  # slowest tier first
                begun = time.perf_counter() if timings is not None else 0.0
                event = self._event() if events else None
                if ahead is not None and part.tier == Tier.DISK:
                    pending, ahead = ahead, None
                else:
                    pending = self.tiers[part.tier].start_read(layout, part.slots, self.scratch, part.memo)
                started.append((part, pending, begun, event))
            while started:
                part, pending, begun, event = started[-1]  # fastest first: the disk read lands last
                pending.finish(_dests(part, where, dest, plan.blocks, bt, blocks))
                started.pop()
                nbytes = (len(part.slots) * bt - part.tail_blocks * (bt - tail_tokens)) * layout.token_bytes
                self.count(link(part.tier, Tier.DEVICE), nbytes)
                if timings is not None:
                    timings.append(PartTiming(part.tier, nbytes, len(part.runs), begun, time.perf_counter(),
                                              event, self._event() if events else None))
        finally:
            for _, pending, _, _ in started:  # a failure above: no read may still land in a buffer being reused
                pending.settle()
            if ahead is not None:  # given but not used (the plan has no disk part)
                ahead.settle()

    def _event(self) -> Any:
        """A timing event recorded on the stream this thread issues its copies on (the mover's, or the compute's)."""
        event = self.accel.Event(timing=True)
        event.record(self.accel.current_stream(self.device))
        return event

    def read_ahead(self, layout: BlockLayout, plan: ReadPlan, purpose: str) -> PendingRead | None:
        """Submit the disk part of ``plan`` now, into the scratch buffer named ``purpose`` (which the caller
        keeps for it until the read is finished or settled); None if the plan reads nothing from disk."""
        for part in plan.parts:
            if part.tier == Tier.DISK:
                return self.tiers[part.tier].start_read(layout, part.slots, self.scratch, part.memo, purpose)
        return None

    def read_blocks(self, layout: BlockLayout | SlotBytes, tier: Tier, slots: list[int],
                    into: Tier = Tier.DEVICE) -> torch.Tensor:
        """Blocks of ``tier`` as a fresh ``[n, *layout.shape]`` tensor in the memory of tier ``into`` (the device
        tier's, or the host's for a tier below it) — for the cold paths: copy-on-write, demotion."""
        shape = (len(slots), *layout.shape)
        if into == Tier.DEVICE:
            out = self.accel.empty_blocks(shape, layout.dtype, self.device)  # device memory (the stand-in's too)
        else:
            out = self.accel.host_blocks(shape, layout.dtype)
        pending = self.tiers[tier].start_read(layout, np.asarray(slots, dtype=np.int64), self.scratch)
        try:
            pending.finish([(0, len(slots), out)])
        except BaseException:
            pending.settle()
            raise
        return out

    # ---------------------------------------------------------------------------------------- writes
    def write_blocks(self, layout: BlockLayout | SlotBytes, tier: Tier, slots: list[int],
                     data: torch.Tensor) -> None:
        """Write whole blocks ``data`` ``[n, *layout.shape]`` into ``slots`` of ``tier``."""
        self.tiers[tier].write_from(layout, np.asarray(slots, dtype=np.int64), data, self.scratch)

    def copy_slots(self, slot_bytes: int, source: Tier, slots: list[int], target: Tier,
                   target_slots: list[int]) -> None:
        """Copy whole slots, as bytes, from ``source`` to ``target``."""
        raw = SlotBytes(slot_bytes)
        limit = getattr(self.tiers.get(Tier.DISK), "bounce_bytes", BOUNCE_BYTES)
        step = max(1, limit // slot_bytes)  # what is held in between is bounded like a bounce buffer
        for lo in range(0, len(slots), step):
            data = self.read_blocks(raw, source, slots[lo : lo + step], into=min(source, Tier.HOST))  # source's side
            self.write_blocks(raw, target, target_slots[lo : lo + step], data)


def _dests(part: TierPart, where: tuple, dest: torch.Tensor, columns: int, bt: int,
           blocks: list[torch.Tensor]) -> list[Dest]:
    """The destinations of ``part``'s runs in ``dest``: one strided view ``[hi - lo, 2, H, bt, D]`` per run. Kept in
    the part's memo for the last few destinations (``where``: address, shape, strides and dtype; an executor reads a
    layer into one of its few staging buffers), so a decode step slices nothing; the tier's own memo then keys its
    compiled copies on this list. (A memo holding views keeps that memory alive: the store drops its plans before
    staging or slab chunks change.)"""
    known = part.memo.get("dests")
    if known is None:
        known = part.memo["dests"] = {}
    dests = known.get(where)
    if dests is not None:
        return dests
    if not blocks:
        grid = dest[..., : columns * bt, :].unflatten(3, (columns, bt))  # [2, B, H, n, bt, D]
        blocks.append(grid.permute(1, 3, 0, 2, 4, 5))  # [B, n, 2, H, bt, D]
    view = blocks[0]
    if len(known) >= MEMO_DESTINATIONS:
        known.clear()
    dests = known[where] = [(r.lo, r.hi, view[r.row, r.column : r.column + r.hi - r.lo]) for r in part.runs]
    return dests
