"""The one interface every storage tier implements, so the store never branches on which tier it talks to.

A tier owns slots (``alloc``/``free`` under a byte budget) and its own I/O. Reads are two-phase so that
slow tiers overlap fast ones: ``start_read`` submits (a disk tier's engine starts reading at once), the
returned :class:`PendingRead` ``finish``-es into the destinations. Data moves as typed block views
``[n, 2, H_kv, block_tokens, D]`` (see :meth:`tierkv.layout.BlockLayout.blocks_of`); a destination may be
strided (a slice of a layer's staging buffer), so gathers land in place, without temporaries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from tierkv.accel import HOST_ONLY, HostOnly
from tierkv.blocks import Tier
from tierkv.errors import BudgetTooSmallError
from tierkv.layout import BlockLayout, SlotBytes

if TYPE_CHECKING:
    from tierkv.io import IOHandle

Dest = tuple[int, int, torch.Tensor]
"""``(lo, hi, out)``: slots ``[lo, hi)`` of a read land in ``out`` ``[hi - lo, 2, H_kv, block_tokens, D]``."""


class BounceLike(Protocol):
    def get(self, nbytes: int, limit: int | None = None) -> np.ndarray: ...

    def fence(self, event: object) -> None: ...

    def landing(self, handle: IOHandle) -> None: ...


class PendingRead(Protocol):
    def finish(self, dests: Sequence[Dest]) -> None:
        """Wait for the read (if it is asynchronous) and copy its blocks into ``dests``."""

    def settle(self) -> None:
        """Wait until nothing more lands in the read's buffers, raising nothing (after a failure elsewhere)."""


class StorageTier(Protocol):
    kind: Tier
    device: torch.device
    budget: int
    peak_bytes: int

    @property
    def allocated_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def alloc(self, slot_bytes: int, near: tuple[int, int] | None = None) -> int | None:
        """A free slot, or None when the tier is full; ``near=(layer, index)`` places a block next to its
        neighbours in the sequence (see :class:`~tierkv.tiers.slots.FreeSlots`), so reads coalesce."""

    def free(self, slot_bytes: int, slot: int) -> None: ...

    def free_all(self) -> None:
        """Every slot free again (the store resets: nothing an interrupted operation took stays taken)."""

    def slot_counts(self) -> dict[int, int]:
        """Slots in use per slot size (for the store's consistency check)."""

    def release_unheld(self, held: Mapping[int, Collection[int]]) -> int:
        """Free every slot in use that is not in ``held[slot_bytes]`` (recovery after an interrupt: what an
        operation took and never recorded); return how many."""

    def start_read(self, layout: BlockLayout | SlotBytes, slots: np.ndarray, scratch: Scratch, memo: dict | None = None,
                   purpose: str = "read") -> PendingRead:
        """Submit a read of ``slots``; ``memo`` is a dict that lives as long as ``slots`` (a cached plan's), where
        the tier may keep what it derives from them (index tensors); ``purpose`` names the scratch buffer a
        read in flight holds (reads ahead each hold their own until finished)."""

    def write_from(self, layout: BlockLayout | SlotBytes, slots: np.ndarray, src: torch.Tensor,
                   scratch: Scratch) -> None:
        """Write ``src`` ``[n, 2, H_kv, block_tokens, D]`` (any device) into ``slots``."""

    def close(self) -> None: ...


def landing_pieces(landing: torch.Tensor, slot_bytes: int, lo: int, hi: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Slots ``[lo, hi)`` cut into pieces that fit the landing buffer: ``(start, end, rows)`` with ``rows`` the
    landing buffer as ``[end - start, slot_bytes]``."""
    capacity = landing.numel() // slot_bytes
    if capacity == 0:
        raise BudgetTooSmallError("the landing buffer is smaller than one block; raise gpu_gb.")
    rows = landing[: capacity * slot_bytes].view(capacity, slot_bytes)
    for start in range(lo, hi, capacity):
        end = min(hi, start + capacity)
        yield start, end, rows[: end - start]


class Scratch:
    """Per-thread transfer buffers: a read on the mover thread and one on the caller's thread never share
    a bounce or landing buffer (a ``threading.local``, so any number of threads is safe)."""

    def __init__(self, make_bounce: Callable[[], BounceLike], landing_bytes: int = 0,
                 device: torch.device | None = None, accel: HostOnly = HOST_ONLY) -> None:
        self._make_bounce = make_bounce
        self._local = threading.local()
        self.landing_bytes = landing_bytes
        self.device = device
        self.accel = accel  # where landing buffers come from, and how copies out of bounce buffers are issued

    def bounce(self, nbytes: int, purpose: str) -> np.ndarray:
        """This thread's aligned host buffer for ``purpose`` (``"read"``, ``"write"``) of at least ``nbytes``."""
        return self.bounce_buffer(purpose).get(nbytes)

    def bounce_buffer(self, purpose: str) -> BounceLike:
        """The buffer object behind :meth:`bounce` (to :meth:`~tierkv.tiers.disk.BounceBuffer.fence` it)."""
        buffers = self._local.__dict__.setdefault("bounces", {})
        if purpose not in buffers:
            buffers[purpose] = self._make_bounce()
        return buffers[purpose]

    def landing(self) -> torch.Tensor | None:
        """This thread's device landing buffer (``landing_bytes`` uint8), or None when landing is off (no
        ``landing_bytes``, or no ``device`` to land on)."""
        if not self.landing_bytes or self.device is None:
            return None
        buffer = getattr(self._local, "landing", None)
        if buffer is None or buffer.numel() != self.landing_bytes:
            buffer = self._local.landing = self.accel.empty(self.landing_bytes, self.device)
        return buffer

    def release(self) -> None:
        """Drop every thread's buffers (the cache closes; pinned bounce buffers are unregistered as they go)."""
        self._local = threading.local()
