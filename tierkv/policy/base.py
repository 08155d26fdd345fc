"""The policy interface and registry.

A policy sees block events and answers one question: when a tier is full, which of its blocks move down?
It never drops data — the store demotes what it picks. In exact mode every block is read every step, so
a policy that *promotes* on access would thrash; policies here only choose demotion victims, which keeps
the resident set stable and the streamed set read-only.

Events are O(1) each and the hot path sends one per layer-step: ``on_access(layer, tick)`` says "every
block of this layer was read" (exact executors), ``on_access(layer, tick, ids)`` names the blocks read
(sparse executors), and ``on_attention`` adds each block's softmax mass. ``victims`` answers from the policy's
own index, never from a scan of all blocks. Only sparse attention moves blocks *up* (``promotions``,
``prefers``): what it reads is skewed, so a hot block on the device saves its read every step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable

import numpy as np

from tierkv.blocks import Block, Tier
from tierkv.errors import InvalidConfigError

POLICIES: dict[str, type[Policy]] = {}


class Policy(ABC):
    """Event hooks plus ``victims``. Blocks the store is busy with (a write-back in flight) are *pinned*:
    never offered as victims until unpinned."""

    name: str = ""

    @abstractmethod
    def on_insert(self, block: Block, tick: int) -> None:
        """A new block on ``block.tier``."""

    @abstractmethod
    def on_access(self, layer: int, tick: int, block_ids: Iterable[int] | None = None) -> None:
        """Blocks of ``layer`` were read at ``tick``: all of them (None) or those named."""

    @abstractmethod
    def on_release(self, block: Block) -> None:
        """The block's last reference went away (its slot is freed)."""

    @abstractmethod
    def on_move(self, block: Block, old_tier: Tier) -> None:
        """The block moved from ``old_tier`` to ``block.tier`` (a demotion or a completed write-back)."""

    @abstractmethod
    def pin(self, block: Block) -> None:
        """Keep ``block`` out of :meth:`victims` until :meth:`unpin`."""

    @abstractmethod
    def unpin(self, block: Block) -> None: ...

    @abstractmethod
    def victims(self, tier: Tier, slot_bytes: int, n: int, exclude: Collection[int] = ()) -> list[Block]:
        """Up to ``n`` blocks of ``tier`` and ``slot_bytes`` to demote, best victim first, none in ``exclude``."""

    def on_attention(self, layer: int, tick: int, block_ids: np.ndarray, mass: np.ndarray) -> None:
        """Sparse attention read ``block_ids`` ``[n]`` of ``layer`` at ``tick``, giving each the softmax ``mass``
        ``[n]`` (its share of the attention, averaged over heads; a block listed twice was read by two rows).
        Arrays, so a policy can take a layer-step in a few vectorized operations. Default: an access."""
        self.on_access(layer, tick, np.asarray(block_ids))

    def promotions(self, block_ids: np.ndarray, limit: int) -> list[int]:
        """Of off-device blocks ``block_ids`` ``[n]`` just attended sparsely (an id may repeat), the ids of up to
        ``limit`` to move up to the device, hottest first. Default: none (blocks never move up)."""
        return []

    def prefers(self, block: Block, resident: Block) -> bool:
        """Whether ``block`` deserves ``resident``'s device slot more than ``resident`` does (promotion by
        replacement). Default: never."""
        return False


def register_policy(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str | Policy) -> Policy:
    if isinstance(name, Policy):
        return name
    if name not in POLICIES:
        raise InvalidConfigError(f"unknown policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}.")
    return POLICIES[name]()
