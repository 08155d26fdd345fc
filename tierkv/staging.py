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
REST_BITS = (0, 2, 4, 8)  # bits per key and value of sparse attention's rest copy (0: none; tierkv.store.summaries)
VALUE_GROUP = 32  # channels per value scale of the rest copy (a head dimension not divisible by it: one group)


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


def value_groups(head_dim: int) -> int:
    """Value groups per token and head of the rest copy: one (min, step) per :data:`VALUE_GROUP` channels."""
    return head_dim // VALUE_GROUP if head_dim % VALUE_GROUP == 0 else 1


def rest_copy_bytes(kv_bytes: int, bits: int, element_size: int, head_dim: int) -> int:
    """Device bytes of the ``bits``-bit rest copy of ``kv_bytes`` of K/V (elements of ``element_size`` bytes,
    heads of ``head_dim`` channels): ``bits`` per key and value, and per value group a min and a step. Keys
    need no scale of their own: they are coded on their block's summary (min, max)."""
    if not bits:
        return 0
    pairs = kv_bytes // (2 * element_size)  # key (and value) elements
    return pairs * 2 * bits // 8 + pairs * value_groups(head_dim) // head_dim * 2 * element_size
