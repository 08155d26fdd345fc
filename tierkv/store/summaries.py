"""Per-block key summaries for query-aware sparse attention: the per-channel min, max and mean of a block's keys.

For a block whose keys lie channel-wise in ``[lo, hi]``, every key ``k`` of it satisfies (Quest's bound)::

    q · k  <=  Σ_d max(q_d · lo_d, q_d · hi_d)  =  q⁺ · hi + q⁻ · lo      (q⁺ = max(q, 0), q⁻ = min(q, 0))

an upper bound on each of its attention logits, and the mean key ``m`` gives the block's *mean* logit exactly::

    q · m  =  (1 / block_tokens) · Σ_k q · k

— ``3 · H_kv · D`` numbers instead of ``block_tokens · H_kv · D``. The bound alone over-rates blocks with one
outlying channel (measured on SmolLM2, docs/quality.md); the sparse executor ranks blocks by both.
A summary is computed once, when its block fills (the store calls :meth:`KeySummaries.add` with the block's keys,
which it holds at that moment); a full block is immutable, so its summary never changes, and blocks shared
by several rows (beams, a common prefix) share one. The open tail block has none: sparse attention always reads it.

Summaries live on the device tier, one table ``[H_kv, capacity, 3, D]`` per layer in the KV dtype (head-major: a
selection's rows gathered from it are already each head's ``[C, 3·D]`` matrix for scoring), addressed
through ``row_of[block_id]`` (a numpy array, so a layer's grid of block ids maps to table rows in one
vectorized lookup). Their bytes are reserved against the device budget like staging, through the callable the
store passes in, so ``stats()`` and the budget checks include them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

MIN_ROWS = 8  # a table's first capacity
TABLE_GROWTH = 1.25  # a full table grows by this factor: doubling could reserve twice the device bytes needed
VECTORS = 3  # per block and KV head: the keys' per-channel min, max and mean


class _LayerTable:
    """One layer's summaries: ``table`` ``[H_kv, capacity, 3, D]`` (min, max, mean) and its free rows."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.free: list[int] = list(range(table.shape[1] - 1, -1, -1))  # pop() gives the lowest row

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()


class KeySummaries:
    """Summaries of every full block of every layer, on the device, counted in its budget.

    ``reserve(n)`` / ``unreserve(n)`` count device bytes (the store's staging reservation: it may demote blocks
    to make room, and raises :class:`~tierkv.errors.BudgetTooSmallError` when it cannot)."""

    def __init__(self, device: torch.device, reserve: Callable[[int], None], unreserve: Callable[[int], None]) -> None:
        self.device = device
        self._reserve, self._unreserve = reserve, unreserve
        self._layers: dict[int, _LayerTable] = {}
        self.row_of = np.full(1024, -1, dtype=np.int64)  # block id -> row in its layer's table (-1: none)
        self._layer_of: dict[int, int] = {}  # block id -> layer, for release

    @property
    def nbytes(self) -> int:
        """Device bytes the tables hold (all reserved against the device budget)."""
        return sum(t.nbytes for t in self._layers.values())

    def __len__(self) -> int:
        return len(self._layer_of)

    def table(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s table ``[H_kv, capacity, 3, D]`` (row ``r``: min, max, mean), None before its first."""
        entry = self._layers.get(layer)
        return entry.table if entry is not None else None

    def rows(self, block_ids: np.ndarray) -> np.ndarray:
        """Table rows of ``block_ids`` (any shape; -1 where a block has no summary)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        inside = ids < self.row_of.shape[0]
        return np.where(inside, self.row_of[np.minimum(ids, self.row_of.shape[0] - 1)], -1)

    def add(self, layer: int, block_ids: Sequence[int], keys: torch.Tensor) -> None:
        """Summarise full blocks ``block_ids`` of ``layer`` from their keys ``[n, H_kv, block_tokens, D]``.

        All or nothing: room is reserved before any row is written. A block summarised again (a cut block
        that filled up with new tokens) gets its summary replaced."""
        if not block_ids:
            return
        summary = torch.stack((keys.amin(dim=2), keys.amax(dim=2), keys.float().mean(dim=2).to(keys.dtype)),
                              dim=1)  # [n, 3, H_kv, D]
        ids = list(dict.fromkeys(block_ids))  # shared blocks appear once per row holding them
        if len(ids) != len(block_ids):
            first = {block_id: i for i, block_id in reversed(list(enumerate(block_ids)))}
            summary = summary[[first[block_id] for block_id in ids]]
        entry = self._room(layer, summary, sum(1 for i in ids if self._row(i) < 0))
        rows = []
        for block_id in ids:
            row = self._row(block_id)
            if row < 0:
                row = entry.free.pop()
                self._set_row(block_id, row)
                self._layer_of[block_id] = layer
            rows.append(row)
        entry.table[:, torch.tensor(rows, device=self.device)] = summary.permute(2, 0, 1, 3).to(entry.table.dtype)

    def release(self, block_id: int) -> None:
        """``block_id`` was freed: its row goes back to its layer's free list."""
        layer = self._layer_of.pop(block_id, None)
        if layer is None:
            return
        self._layers[layer].free.append(int(self.row_of[block_id]))
        self.row_of[block_id] = -1

    def clear(self) -> None:
        """Forget every summary and give the tables' bytes back to the device budget."""
        self._unreserve(self.nbytes)
        self._layers.clear()
        self._layer_of.clear()
        self.row_of[:] = -1

    # ------------------------------------------------------------------------------------ internals
    def _row(self, block_id: int) -> int:
        return int(self.row_of[block_id]) if block_id < self.row_of.shape[0] else -1

    def _set_row(self, block_id: int, row: int) -> None:
        if block_id >= self.row_of.shape[0]:
            grown = np.full(max(2 * self.row_of.shape[0], block_id + 1), -1, dtype=np.int64)
            grown[: self.row_of.shape[0]] = self.row_of
            self.row_of = grown
        self.row_of[block_id] = row

    def _room(self, layer: int, like: torch.Tensor, new_rows: int) -> _LayerTable:
        """Layer ``layer``'s table with at least ``new_rows`` free rows (grown by 25% steps, bytes reserved first)."""
        entry = self._layers.get(layer)
        if entry is not None and len(entry.free) >= new_rows:
            return entry
        used = entry.table.shape[1] - len(entry.free) if entry is not None else 0
        capacity = max(MIN_ROWS, entry.table.shape[1] if entry is not None else 0)
        while capacity - used < new_rows:
            capacity = max(capacity + 1, int(capacity * TABLE_GROWTH))
        _, vectors, heads, dim = like.shape  # like: [n, 3, H_kv, D]
        table = torch.empty((heads, capacity, vectors, dim), dtype=like.dtype, device=self.device)
        grown = table.numel() * table.element_size() - (entry.nbytes if entry is not None else 0)
        self._reserve(grown)
        if entry is None:
            entry = self._layers[layer] = _LayerTable(table)
            return entry
        old = entry.table.shape[1]
        table[:, :old] = entry.table
        entry.table = table
        entry.free = list(range(capacity - 1, old - 1, -1)) + entry.free
        return entry
