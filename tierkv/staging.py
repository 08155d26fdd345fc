"""Device staging: how much device memory an executor holds besides blocks, and the one lifecycle it is held by.

The runtime (executors, landing buffers), ``TieredCache.min_device_bytes`` /
``min_streaming_device_bytes`` and the planner all size staging here, so the documented minimum is the
one the runtime actually needs (the sizes are pure arithmetic). :class:`Staging` is how every executor
holds that memory: reserved against the device budget first, then allocated through :mod:`tierkv.accel`,
and given back (reservation and allocator cache) when the executor grows, switches out or closes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tierkv.store import KVStore

MAX_PREFETCH_DEPTH = 64  # layers read ahead at most (the runtime's cap, and the planner's): beyond a few, only
# staging memory grows
GROWTH = 1.25  # exact-gather staging grows by at least this factor, so it reallocates rarely
LANDING_BYTES = 32 * 2**20  # per landing buffer (CUDA): host/disk runs cross PCIe as copies this large
LANDING_SHARE = 16  # ... and at most 1/16 of the device budget each
CHUNKS_PER_BUDGET = 16  # memory tiers grow their slabs by 1/16 of the budget (see tierkv.tiers.memory)
REST_BITS = (0, 2, 4, 8)  # bits per key and value of sparse attention's rest copy (0: none; tierkv.store.summaries)
DEFAULT_REST_BITS = 4  # cache.sparse's rest copy: at 10% the one with top-1 >= 97% on every model (docs/quality.md)
VALUE_GROUP = 32  # channels per value scale of the rest copy (a head dimension not divisible by it: one group)
SLOT_ALIGN = 4096  # a slot's bytes are a multiple of this (tierkv.layout.SLOT_ALIGN, here without torch)
TABLE_MIN_ROWS = 8  # a key-summary table's first capacity, in rows (a row: one block's page summaries, rest copy)
TABLE_GROWTH = 1.25  # a full summary table grows by this factor: doubling could reserve twice the bytes needed


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


def landed_device_minimum(staging: int, tails: int, slot_bytes: int) -> int:
    """:func:`device_minimum` on CUDA, where the two landing buffers (:func:`landing_bytes`, sized from the
    budget itself) are staging too: the smallest budget that holds what it implies, found by bisection."""

    def needs(budget: int) -> int:
        return device_minimum(staging + 2 * landing_bytes(budget, slot_bytes), tails)

    low, high = device_minimum(staging, tails), needs(1 << 62)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if needs(middle) <= middle else (middle + 1, high)
    return high


def split_scratch_bytes(batch: int, q_heads: int, kv_heads: int, head_dim: int, piece_tokens: int) -> int:
    """Device bytes a ``split`` decode step holds besides blocks on an accelerator: the query, the (out, lse)
    of the host part landed on the device and the merge's, and the fp32 temporaries of attending the device
    share — bounded by ``piece_tokens``, not by the context. The executor attends the device share a quarter
    piece at a time, so the rows it gathers from the slab, their fp32 copy and the fp32 buffer they land in
    (at most 5/8 of one piece's fp32 K/V for 16-bit K/V) and the scores and their softmax for each query head
    fit in what is counted here for one piece."""
    landing = 3 * batch * q_heads * (head_dim + 1) * 4  # query (as fp32), host part's and merged (out, lse)
    blocks = batch * piece_tokens * 2 * kv_heads * head_dim * 4
    scores = 6 * batch * q_heads * piece_tokens * 4 + 4 * batch * piece_tokens * 8  # scores, masks, positions
    return landing + blocks + scores


def split_staging_bytes(batch: int, chunk_tokens: int, token_bytes: int, block_tokens: int, q_heads: int,
                        kv_heads: int, head_dim: int, accelerated: bool) -> int:
    """Device bytes besides blocks of a ``cache.split`` mode: the streaming prefill's two chunk buffers, and on
    an accelerator the split step's scratch (:func:`split_scratch_bytes`, pieces of one chunk). On a CPU host
    split attends every share in place and holds nothing of its own. Independent of the context."""
    prefill = streaming_staging_bytes(batch, chunk_tokens, token_bytes, block_tokens)
    if not accelerated:
        return prefill
    piece = streaming_chunk_tokens(chunk_tokens, block_tokens)
    return prefill + split_scratch_bytes(batch, q_heads, kv_heads, head_dim, piece)


def split_device_minimum(layers: int, batch: int, q_heads: int, kv_heads: int, head_dim: int, element_size: int,
                         block_tokens: int, chunk_tokens: int, accelerated: bool) -> int:
    """The smallest device budget (bytes) for exact decoding with ``cache.split`` after a streaming prefill in
    ``chunk_tokens`` chunks, at any context: :func:`split_staging_bytes` beside the open tail blocks, and on an
    accelerator (CUDA) the two landing buffers. Torch-free, for the planner; ``TieredCache.min_split_device_bytes``
    reads the numbers from a model config."""
    token_bytes = 2 * kv_heads * head_dim * element_size
    slot_bytes = -(-token_bytes * block_tokens // SLOT_ALIGN) * SLOT_ALIGN
    staging = split_staging_bytes(batch, chunk_tokens, token_bytes, block_tokens, q_heads, kv_heads, head_dim,
                                  accelerated)
    tails = open_tail_bytes(layers, batch, slot_bytes)
    return landed_device_minimum(staging, tails, slot_bytes) if accelerated else device_minimum(staging, tails)


DEFAULT_PAGE_TOKENS = 16  # tokens per selected page of sparse attention (docs/quality.md: 8-16-token units select well)


def default_page_tokens(block_tokens: int) -> int:
    """Sparse attention's default page in ``block_tokens``-token blocks: the largest divisor of the block up to
    :data:`DEFAULT_PAGE_TOKENS` (a 100-token block: 10-token pages; a prime one: single tokens)."""
    return max(d for d in range(1, min(block_tokens, DEFAULT_PAGE_TOKENS) + 1) if block_tokens % d == 0)


def summary_element_size(element_size: int) -> int:
    """Bytes per element of the key summaries of K/V of ``element_size``-byte elements: fp32 K/V get bf16
    summaries (:data:`tierkv.store.summaries.SUMMARY_DTYPES`), 16-bit ones their own."""
    return 2 if element_size == 4 else element_size


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


class Staging:
    """The device buffers one executor (or its kept blocks) holds besides blocks: reserve, allocate, release.

    Every buffer is flat ``uint8`` of the bytes reserved for it; :meth:`allocate` replaces the whole set (a
    resize), :meth:`take` / :meth:`give_back` add and remove one (kept layers), :meth:`release` returns all of
    it — to the budget and, on CUDA, out of the caching allocator, so that what the budget no longer counts is
    not held either.
    """

    def __init__(self, store: KVStore) -> None:
        from tierkv import accel

        self.store = store
        self._accel = accel.backend(store.device.device)
        self.buffers: list[torch.Tensor] = []
        self.reserved = 0

    def allocate(self, count: int, nbytes: int) -> list[torch.Tensor]:
        """Release what is held, then hold ``count`` buffers of ``nbytes`` each (BudgetTooSmallError, holding
        nothing, when the budget cannot)."""
        self.release()
        self.store.reserve_device(count * nbytes)
        self.reserved = count * nbytes
        try:
            self.buffers = [self._empty(nbytes) for _ in range(count)]
        except BaseException:
            self.release()
            raise
        return self.buffers

    def take(self, nbytes: int) -> torch.Tensor:
        """One more buffer of ``nbytes`` beside those held (BudgetTooSmallError when the budget cannot)."""
        self.store.reserve_device(nbytes)
        try:
            buffer = self._empty(nbytes)
        except BaseException:
            self.store.device.unreserve(nbytes)
            raise
        self.reserved += nbytes
        self.buffers.append(buffer)
        return buffer

    def _empty(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes`` on the device; CapacityError where the memory is not there although the budget
        allows it (the budget is a cap, the machine's memory the fact)."""
        from tierkv.errors import memory_for
        from tierkv.units import format_bytes

        device = self.store.device.device
        with memory_for(f"{device} could not allocate {format_bytes(nbytes)} of attention staging although gpu_gb "
                        "allows it", "give budgets the machine has, or decode with cache.streaming(model), whose "
                        "staging does not grow with the context"):
            return self._accel.empty(nbytes, device)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return one buffer of :meth:`take` to the budget."""
        self.buffers = [held for held in self.buffers if held is not buffer]
        self.store.device.unreserve(buffer.numel())
        self.reserved -= buffer.numel()

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` beside the buffers held, for temporaries torch allocates inside a call (BudgetTooSmallError
        when the budget cannot); :meth:`release` gives them back with the rest."""
        self.store.reserve_device(nbytes)
        self.reserved += nbytes

    def release(self) -> None:
        """Return every buffer to the budget (idempotent)."""
        held, self.reserved = self.reserved, 0
        self.buffers = []
        if held:
            self.store.device.unreserve(held)
            self._accel.release_cached()


def sparse_budget_tokens(tokens: int | float, context: int) -> int:
    """Tokens a sparse step attends per row over ``context`` tokens: ``tokens`` itself, or that fraction of the
    context (at least one), never more than the context (a budget above it sized buffers for tokens that are not
    there)."""
    return max(1, math.floor(tokens * context)) if isinstance(tokens, float) else max(1, min(int(tokens), context))


def summary_table_rows(batch: int, tokens: int, block_tokens: int) -> int:
    """Rows a layer's key-summary table has reserved once it holds ``tokens`` of ``batch`` rows (a row per full
    block): grown by :data:`TABLE_GROWTH` past what it holds, and one more, at least :data:`TABLE_MIN_ROWS` (a bound
    on what :mod:`tierkv.store.summaries` reserves, for the minimum budgets)."""
    return max(TABLE_MIN_ROWS, math.ceil(batch * (tokens // block_tokens) * TABLE_GROWTH) + 1)
