"""Device staging sizes: the one place that says how much device memory an executor holds besides blocks.

The runtime (executors, landing buffers), ``TieredCache.min_device_bytes`` /
``min_streaming_device_bytes`` and the planner all size staging here, so the documented minimum is the
one the runtime actually needs (pure arithmetic: no tensors, no transformers).
"""

from __future__ import annotations

import math

GROWTH = 1.25  # exact-gather staging grows by at least this factor, so it reallocates rarely
LANDING_BYTES = 32 * 2**20  # per landing buffer (CUDA): host/disk runs cross PCIe as copies this large
LANDING_SHARE = 16  # ... and at most 1/16 of the device budget each
CHUNKS_PER_BUDGET = 16  # memory tiers grow their slabs by 1/16 of the budget (see tierkv.tiers.memory)


def round_to_blocks(tokens: int, block_tokens: int) -> int:
    """``tokens`` rounded up to whole blocks (at least one)."""
    return max(block_tokens, math.ceil(tokens / block_tokens) * block_tokens)


def gather_capacity(tokens: int, block_tokens: int, previous: int = 0) -> int:
    """Tokens per exact-gather staging buffer for a layer read of ``tokens`` (whole blocks), after a buffer
    of ``previous`` tokens: grown by :data:`GROWTH` at least, so decoding reallocates rarely."""
    return round_to_blocks(max(tokens, int(previous * GROWTH)), block_tokens)


def gather_staging_bytes(batch: int, context: int, token_bytes: int, block_tokens: int, prefetch_depth: int) -> int:
    """Peak device bytes of exact-gather staging at ``context`` tokens: ``prefetch_depth + 1`` buffers of the
    largest capacity growth can reach (just under ``GROWTH`` x the context, in whole blocks)."""
    capacity = round_to_blocks(math.ceil(round_to_blocks(context, block_tokens) * GROWTH), block_tokens)
    return (prefetch_depth + 1) * batch * capacity * token_bytes


def streaming_chunk_tokens(chunk_tokens: int, block_tokens: int) -> int:
    """A streaming chunk in whole blocks (at least one)."""
    return max(block_tokens, chunk_tokens // block_tokens * block_tokens)


def streaming_staging_bytes(batch: int, chunk_tokens: int, token_bytes: int, block_tokens: int) -> int:
    """Device bytes of streaming staging: two chunk buffers (one attended, one in flight)."""
    return 2 * batch * streaming_chunk_tokens(chunk_tokens, block_tokens) * token_bytes


def landing_bytes(device_budget: int, slot_bytes: int = 0) -> int:
    """Bytes of each of the two landing buffers a CUDA device tier reserves (caller's and mover's threads):
    at least one block of ``slot_bytes`` (a landing piece is whole blocks)."""
    return max(slot_bytes, min(LANDING_BYTES, device_budget // LANDING_SHARE))


def open_tail_bytes(layers: int, batch: int, slot_bytes: int) -> int:
    """The blocks being filled (one per row and layer) plus one being allocated: they must be on the device."""
    return (layers + 1) * batch * slot_bytes


def device_minimum(staging: int, tails: int) -> int:
    """The smallest device budget that holds ``staging`` bytes beside ``tails`` bytes of open blocks.

    Blocks live in slab chunks of 1/16 of the budget, and a chunk that holds a block cannot be given to
    staging: the open tails cost at least one whole chunk, so the budget must also hold staging in the
    other 15/16.
    """
    return max(staging + tails, -(-staging * CHUNKS_PER_BUDGET // (CHUNKS_PER_BUDGET - 1)) + tails)
