"""Background write-back: keep free room on the host tier by writing its coldest blocks to disk ahead of need.

Without it, a host tier that is full makes the next demotion (or a new block's placement) wait for a
synchronous disk write. With it, once the host's free room drops under a low watermark (1/16 of its
budget), the policy's victims are copied into a private bounce buffer and written to disk asynchronously
while decoding goes on. Until the write completes the blocks stay on the host, readable and unchanged, and
pinned in the policy (no one else demotes them); completion (polled at the next store operation, or awaited
when the host is full) retargets them to their disk slots and frees the host slots.

A failed background write loses nothing: the disk slots are released, the blocks stay on the host, the
failure is logged once and write-back pauses. If the space is then really needed, the store's
synchronous path raises the error (``DiskFullError`` ...) with the cache consistent.

It talks to its collaborators (tiers, table, policy) through their public methods — the host tier's ``room``,
``start_read`` and ``free``, never its slab pools — and never to the store.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tierkv.accel import host_backend
from tierkv.atomic import deferred_interrupts
from tierkv.blocks import Block, BlockTable, Tier
from tierkv.errors import TierKVError
from tierkv.io import IOHandle
from tierkv.layout import SlotBytes
from tierkv.policy import Policy
from tierkv.tiers.base import Scratch
from tierkv.tiers.disk import BounceBuffer, DiskTier
from tierkv.tiers.memory import MemoryTier

log = logging.getLogger("tierkv")

LOW_WATERMARK = 1 / 16  # start writing back when the host's free room falls under this share of its budget
TARGET_FREE = 1 / 8  # ... and write back until this share would be free


@dataclass(slots=True)
class PendingWrite:
    """Blocks (still on the host) being written to ``disk_slots``."""

    blocks: list[Block]
    disk_slots: list[int]
    host_slots: list[int]  # where the blocks were when the write started
    slot_bytes: int
    handle: IOHandle


class Writeback:
    """The host tier's background write-back to the disk tier (at most one batch in flight)."""

    def __init__(self, host: MemoryTier, disk: DiskTier | None, table: Callable[[], BlockTable], policy: Policy,
                 barrier: Callable[[], None], on_moved: Callable[[Block, Tier, Tier], None]) -> None:
        self.host, self.disk = host, disk
        self._table, self.policy, self.barrier, self.on_moved = table, policy, barrier, on_moved
        self.enabled = disk is not None
        self.pending: PendingWrite | None = None
        self.paused_reason: str | None = None
        self._bounce = BounceBuffer(accel=host_backend())  # host slab -> disk: no GPU copy touches it, not pinned
        self._scratch = Scratch(lambda: BounceBuffer(accel=host_backend()))  # host reads need none of its buffers

    @property
    def pending_ids(self) -> set[int]:
        return {block.id for block in self.pending.blocks} if self.pending else set()

    def reap(self, wait: bool = False) -> bool:
        """Finish the pending write if it is done (or ``wait``); return True if host slots were freed.

        Interrupted while waiting (KeyboardInterrupt), the write stays pending and is reaped later; once it is
        done, its blocks move in one step (interrupts deferred), after the barrier."""
        pending = self.pending
        if pending is None or not (wait or pending.handle.done()):
            return False
        assert self.disk is not None
        table = self._table()
        try:
            pending.handle.wait()
        except OSError as exc:
            with deferred_interrupts():
                self.pending = None
                self._give_back(pending, 0)
            self._pause(f"a background write failed ({exc}); blocks stay on the host")
            return False
        self.barrier()  # host slots are about to be reused: no read may still be on them
        moved = []
        with deferred_interrupts():
            self.pending = None
            for block, slot, host_slot in zip(pending.blocks, pending.disk_slots, pending.host_slots):
                live = table.blocks.get(block.id) is block
                if not live or block.tier != Tier.HOST or block.slot != host_slot:  # released or moved meanwhile
                    self.disk.free(pending.slot_bytes, slot)
                    if live:
                        self.policy.unpin(block)
                    continue
                self.host.free(pending.slot_bytes, block.slot)
                table.place(block, Tier.DISK, slot)
                self.policy.unpin(block)
                self.policy.on_move(block, Tier.HOST)
                moved.append(block)
        for block in moved:
            self.on_moved(block, Tier.HOST, Tier.DISK)
        return bool(moved)

    def _give_back(self, pending: PendingWrite, start: int) -> None:
        """Release the disk slots of ``pending``'s blocks from ``start`` on; they stay (unpinned) on the host."""
        assert self.disk is not None
        table = self._table()
        for block, slot in zip(pending.blocks[start:], pending.disk_slots[start:]):
            self.disk.free(pending.slot_bytes, slot)
            if table.blocks.get(block.id) is block:
                self.policy.unpin(block)

    def maybe_start(self) -> None:
        """Start a write-back batch if the host's free room is under the low watermark (O(pools))."""
        self.reap()
        if not self.enabled or self.disk is None or self.pending is not None or self.paused_reason is not None:
            return
        host = self.host
        for slot_bytes in host.slot_sizes():
            capacity = host.budget // slot_bytes
            free = host.room(slot_bytes)
            if capacity == 0 or free >= capacity * LOW_WATERMARK:
                continue
            want = min(max(1, int(capacity * TARGET_FREE) - free), max(1, self.disk.bounce_bytes // slot_bytes))
            victims = self.policy.victims(Tier.HOST, slot_bytes, want)
            if victims:  # in sequence order: a layer's blocks land in consecutive disk slots and read back as runs
                self._start(sorted(victims, key=lambda block: (block.layer, block.index)), slot_bytes)
            return

    def _start(self, blocks: list[Block], slot_bytes: int) -> None:
        """Write ``blocks`` to new disk slots in the background. Whatever interrupts it (a full disk, an
        ``OSError``, a KeyboardInterrupt) gives the disk slots back before the exception goes on."""
        assert self.disk is not None
        slots: list[int] = []
        handle: IOHandle | None = None
        try:
            try:
                for block in blocks:
                    slot = self.disk.alloc(slot_bytes, (block.layer, block.index))
                    if slot is None:
                        break
                    slots.append(slot)
            except TierKVError as exc:  # e.g. the filesystem is full: the foreground will report it if it matters
                self._pause(str(exc))
            if not slots:
                if self.paused_reason is None:
                    self._pause("the disk tier is full")
                return
            blocks = blocks[: len(slots)]
            bounce = self._bounce.get(len(blocks) * slot_bytes, self.disk.bounce_bytes)
            staged = torch.from_numpy(bounce).view(len(blocks), slot_bytes)
            host_slots = np.asarray([block.slot for block in blocks], dtype=np.int64)
            self.host.start_read(SlotBytes(slot_bytes), host_slots, self._scratch).finish([(0, len(blocks), staged)])
            # submitted and recorded in one section: a Ctrl-C mid-submit would lose the handle of queued writes,
            # and from the end of it reap() owns the slots and the blocks are out of the victims
            with deferred_interrupts():
                handle = self.disk.write(slot_bytes, slots, bounce)
                self.pending = PendingWrite(blocks, slots, host_slots.tolist(), slot_bytes, handle)
                for block in blocks:
                    self.policy.pin(block)
        except BaseException as exc:
            if handle is not None and self.pending is None:  # no write may still land in slots given back
                with contextlib.suppress(OSError):
                    handle.wait()
            if self.pending is None:
                with deferred_interrupts():
                    for slot in slots:
                        self.disk.free(slot_bytes, slot)
            if not isinstance(exc, OSError):
                raise
            self._pause(f"a background write could not be submitted ({exc})")
            return

    def _pause(self, reason: str) -> None:
        if self.paused_reason is None:
            log.warning("tierkv: background write-back paused: %s", reason)
        self.paused_reason = reason

    def resume(self) -> None:
        """Try background writes again (after a reset, when the disk may have room again)."""
        self.paused_reason = None
