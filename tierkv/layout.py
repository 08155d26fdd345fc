"""KV geometry of one attention layer, and the byte size of a block derived from it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tierkv.errors import InvalidConfigError

SLOT_ALIGN = 4096  # disk slots and host slots are multiples of this, so O_DIRECT can move them as they are


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The shape of one block: K and V of ``block_tokens`` tokens of one layer of one sequence.

    A block is stored as ``[2, kv_heads, block_tokens, head_dim]`` (K then V), so one block is one contiguous
    run of bytes: one copy, one disk request.
    """

    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype
    # derived once (the hot path asks for them on every layer of every step)
    token_bytes: int = field(init=False, compare=False, repr=False)
    block_bytes: int = field(init=False, compare=False, repr=False)
    slot_bytes: int = field(init=False, compare=False, repr=False)
    shape: tuple[int, int, int, int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidConfigError(f"BlockLayout.{name} must be a positive int, got {value!r}.")
        token_bytes = 2 * self.kv_heads * self.head_dim * self.dtype.itemsize  # K and V of one token
        block_bytes = token_bytes * self.block_tokens
        object.__setattr__(self, "token_bytes", token_bytes)
        object.__setattr__(self, "block_bytes", block_bytes)
        # a block's slot: its bytes rounded up to the I/O alignment
        object.__setattr__(self, "slot_bytes", math.ceil(block_bytes / SLOT_ALIGN) * SLOT_ALIGN)
        object.__setattr__(self, "shape", (2, self.kv_heads, self.block_tokens, self.head_dim))

    def blocks_of(self, raw: torch.Tensor) -> torch.Tensor:
        """Slots ``raw`` ``[n, slot_bytes]`` (uint8, contiguous rows) as blocks ``[n, 2, H_kv, block_tokens, D]``
        (a strided view: the slot padding is skipped, nothing is copied)."""
        return raw[:, : self.block_bytes].view(self.dtype).view(raw.shape[0], *self.shape)

    @classmethod
    def of(cls, key_states: torch.Tensor, block_tokens: int) -> BlockLayout:
        """Layout of the layer whose new keys are ``key_states`` ``[B, H_kv, T, D]``."""
        if key_states.dim() != 4:
            raise InvalidConfigError(
                f"expected key states of shape [batch, kv_heads, tokens, head_dim], got {tuple(key_states.shape)}."
            )
        return cls(int(key_states.shape[1]), int(key_states.shape[3]), block_tokens, key_states.dtype)


@dataclass(frozen=True, slots=True)
class SlotBytes:
    """A layout for moving whole slots as raw bytes, whatever layer they hold (demotion, evacuation):
    it duck-types the parts of :class:`BlockLayout` the tiers use."""

    slot_bytes: int

    @property
    def shape(self) -> tuple[int]:
        return (self.slot_bytes,)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def blocks_of(self, raw: torch.Tensor) -> torch.Tensor:
        return raw
