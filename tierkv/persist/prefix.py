"""``PrefixPersistence``: a sequence's token ids tied to its full blocks in a :class:`PersistentStore`.

The cache's K/V does not know which tokens it encodes; the ids come from the user
(``TieredCache.load_prefix(model, ids)``), once per prompt. With them:

- *load*: the longest prefix whose block-rows are all stored (for every row of the batch) is read,
  verified and handed back as per-layer K/V, never the last token (the model must compute at least one,
  to produce the next token's logits);
- *persist*: each full block column that every layer holds (a sliding-window layer may have freed it) and
  whose ids are known is exported from the store, encoded and written by a background thread
  (:class:`_Writer`), so the decode loop only pays for a host copy once every ``block_tokens`` steps.

Memory outside the tier budgets is bounded by constants: one export batch holds at most
``BATCH_BYTES`` of K/V, and the writer's queue at most ``QUEUE_BATCHES`` batches. When it is full, a forward
leaves the rest in the tiers for a later forward to queue (persistence lags behind a slow store, the forward
never waits for it); ``flush()``, ``close()`` and ``reset()`` wait for room.

The ids the user passes for tokens already in the cache are taken on trust — transformers' own contract
for a pre-filled cache (``generate`` skips them) — except that ids known from an earlier call must match.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import numpy as np
import torch

from tierkv import forks
from tierkv.atomic import deferred_interrupts
from tierkv.errors import IntegrityError, InvalidConfigError
from tierkv.persist import record
from tierkv.persist.blockfile import Item
from tierkv.persist.keys import Namespace, block_keys
from tierkv.store import KVStore

log = logging.getLogger("tierkv")

BATCH_BYTES = 64 << 20  # K/V bytes exported at once for the writer
QUEUE_BATCHES = 4  # batches waiting for the writer; so at most (QUEUE_BATCHES + 1) * BATCH_BYTES in flight


class BlockStore(Protocol):
    """What :class:`PrefixPersistence` needs of a store of block records: a :class:`PersistentStore`, or a
    :class:`tierkv.remote.chain.ChainedBlockStore` (local disk, then the remote tier)."""

    def __contains__(self, key: str) -> bool: ...

    def lookup(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` (a chain) are stored, counted from the first."""
        ...

    def get(self, keys: Sequence[str], namespace: Namespace | None = None) -> list[bytearray]:
        """The records of the leading ``keys`` that could be read (stops at the first miss). With ``namespace``
        (``keys``: a chain from its first block) only block records of it at their depth, read no further than
        such a record's size; one that is not is removed from the store and is a miss."""
        ...

    def put(self, items: Sequence[Item], touch: Sequence[str] = ()) -> int:
        """Store ``items`` (and mark ``touch``, the chain they extend, as used); how many were added."""
        ...

    def close(self) -> None: ...


class PrefixPersistence:
    """Which tokens a cache holds (``ids`` ``[B, T]``) and which of its block columns are persisted."""

    def __init__(self, store: BlockStore, block_tokens: int) -> None:
        self.store = store
        self.block_tokens = block_tokens
        self.namespace: Namespace | None = None
        self.ids: np.ndarray | None = None  # [B, T] int64: tokens held, then the ones about to be appended
        self.persisted = 0  # block columns [0, persisted) are stored, or can never be (freed before full)
        self._keys: list[list[str]] = []  # per row, the chain of its full blocks of ids
        self._writer = _Writer(store)
        # dropped without close(): what is queued is still written, and the store's scratch area released
        self._finalizer = forks.finalize(self, _close, self._writer, store)

    # ---------------------------------------------------------------------------------------- ids
    def start(self, namespace: Namespace, ids: np.ndarray) -> None:
        """A new sequence (the cache is empty) of ``ids`` ``[B, T]`` computed in ``namespace``."""
        self.namespace, self.persisted = namespace, 0
        self._set_ids(ids)

    def extend(self, ids: np.ndarray, held: int) -> None:
        """The cache holds ``held`` tokens and is about to take the rest of ``ids`` ``[B, T]``."""
        if self.ids is not None:
            known = min(self.ids.shape[1], held, ids.shape[1])
            if ids.shape[0] != self.ids.shape[0] or not np.array_equal(ids[:, :known], self.ids[:, :known]):
                raise InvalidConfigError(
                    "these ids do not start with the tokens this cache holds; pass the whole conversation so far "
                    "(the previous ids, the generated tokens, then the new ones), or call cache.reset() first.")
        self._set_ids(ids)

    def truncate(self, length: int) -> None:
        """The cache was cropped to ``length`` tokens: ids after it are no longer what it will hold."""
        if self.ids is not None and self.ids.shape[1] > length:
            self._set_ids(self.ids[:, :length])
        self.persisted = min(self.persisted, length // self.block_tokens)

    def select_rows(self, indices: Sequence[int]) -> None:
        if self.ids is not None:
            self._set_ids(self.ids[list(indices)])

    def reset(self) -> None:
        self.namespace, self.ids, self._keys, self.persisted = None, None, [], 0

    def _set_ids(self, ids: np.ndarray) -> None:
        self.ids = ids
        root = self.namespace.root if self.namespace is not None else ""
        self._keys = [block_keys(root, row, self.block_tokens) for row in ids]

    # --------------------------------------------------------------------------------------- load
    def load(self, most: int | None = None) -> tuple[int, list[torch.Tensor]]:
        """``(blocks, kv)``: the stored prefix of every row — ``kv[layer]`` ``[2, B, H_kv, blocks * bt, D]`` on
        the host — leaving at least the last id to compute, and at most ``most`` tokens. ``(0, [])`` if nothing is
        stored. Call after :meth:`start`."""
        ids, namespace = self.ids, self.namespace
        if ids is None or namespace is None:
            raise InvalidConfigError("PrefixPersistence.load() has no sequence to load; call start(namespace, "
                                     "ids) first.")
        limit = min(ids.shape[1] - 1, ids.shape[1] if most is None else most) // self.block_tokens
        blocks = min(self.store.lookup(keys[:limit]) for keys in self._keys)
        rows: list[list[torch.Tensor | None]] = []
        for keys in self._keys:
            decoded: list[torch.Tensor | None] = []
            for depth, (key, data) in enumerate(zip(keys, self.store.get(keys[:blocks], namespace))):
                try:
                    decoded.append(record.decode_block(data, key=key, namespace=namespace, what=f"block {key}",
                                                       depth=depth))
                except IntegrityError as error:  # listed under the right key, not this namespace's shape: a miss
                    log.warning("tierkv: persistent block %s not used: %s", key, error)
                    break
            blocks = min(blocks, len(decoded))
            rows.append(decoded)
        self.persisted = blocks
        if blocks == 0:
            return 0, []
        bt, dtype = self.block_tokens, cast(torch.Tensor, rows[0][0]).dtype
        shapes = [namespace.layer_shape(layer) for layer in range(namespace.layers)]
        kv = [torch.empty((2, len(rows), heads, blocks * bt, dim), dtype=dtype) for heads, dim in shapes]
        for r, row in enumerate(rows):  # each record's bytes go once copied: the prefix is held once
            for j in range(blocks):
                for layer, block in enumerate(_layer_blocks(cast(torch.Tensor, row[j]), namespace)):
                    kv[layer][:, r, :, j * bt : (j + 1) * bt] = block
                row[j] = None
        return blocks, kv

    # ------------------------------------------------------------------------------------ persist
    def collect(self, kv: KVStore, lengths: Sequence[int], dropped: Sequence[int], wait: bool = True,
                valid: Callable[[], bool] | None = None) -> bool:
        """Queue the block columns that became persistable: full in every layer (``lengths[l]`` tokens of
        which the first ``dropped[l]`` were freed, a sliding window's), ids known, not stored yet. Without
        ``wait`` (a forward's), only as many batches as the writer's queue has room for: the rest stay in the
        tiers and are queued by a later call, so a slow store (a remote server behind a slow link) makes
        persistence lag, never the forward wait. ``valid``: asked before any is queued (False: none is, it said
        why). Whether every persistable column is queued now."""
        if self.ids is None or self.namespace is None or len(lengths) != self.namespace.layers:
            return True
        bt = self.block_tokens
        target = min(self.ids.shape[1], *lengths) // bt
        first = max(self.persisted, max(dropped) // bt)  # columns a window freed can never be persisted
        self.persisted = max(self.persisted, min(first, target))
        if first >= target or (valid is not None and not valid()):
            return True
        self._check_layouts(kv)
        if self.namespace is None:
            return True
        batch = len(self._keys)
        per_column = batch * math.prod(self.namespace.block_shape) * getattr(torch, self.namespace.dtype).itemsize
        step = max(1, BATCH_BYTES // per_column)
        for start in range(first, target, step):
            if not wait and self._writer.full():
                self.persisted = start  # queued by a later call
                return False
            stop = min(start + step, target)
            if all(keys[c] in self.store for keys in self._keys for c in range(start, stop)):
                continue  # another process (or an earlier run) stored them
            exported = [kv.export_blocks(layer, start, stop) for layer in range(len(lengths))]  # [B, n, 2, H, bt, D]
            if self.namespace.shapes:  # layers of several shapes: [B, n, Σ elements], each layer's in a row
                blocks = torch.cat([layer.flatten(2) for layer in exported], dim=2)
            else:  # [B, n, L, 2, H, bt, D]
                blocks = torch.stack(exported, dim=2)
            del exported
            jobs = [(keys[c], c, blocks[r, c - start], keys[c - 1] if c else None)
                    for r, keys in enumerate(self._keys) for c in range(start, stop)]
            self._writer.submit(self.namespace.root, jobs, [k for keys in self._keys for k in keys[:start]])
        self.persisted = target
        return True

    def _check_layouts(self, kv: KVStore) -> None:
        ns = self.namespace
        if ns is None:
            return
        for layer, layout in kv.layouts.items():
            found = (layout.kv_heads, layout.head_dim, str(layout.dtype).removeprefix("torch."), layout.block_tokens)
            expected = (*ns.layer_shape(layer), ns.dtype, ns.block_tokens)
            if found != expected:
                log.warning("tierkv: layer %d's K/V %s differ from the model config's %s; this sequence is not "
                            "persisted", layer, found, expected)
                self.namespace = None
                return

    def flush(self) -> None:
        """Wait until everything queued is written (or its failure logged)."""
        self._writer.flush()

    def close(self) -> None:
        """Write what is queued, stop the writer and release the store (idempotent)."""
        self._finalizer()


def _close(writer: _Writer, store: BlockStore) -> None:
    try:
        writer.close()
    finally:  # a Ctrl-C while the queued blocks are written: the store is released all the same
        store.close()


class _Writer:
    """One background thread that encodes and stores queued block-rows, started on first use.

    It holds the store, never the cache, so a dropped cache is collected; a failure is logged (once) and
    the blocks are not persisted — persistence never breaks decoding."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()  # two threads submitting first would start two writers (close joins one)
        self._warned = False

    def submit(self, root: str, jobs: list[tuple[str, int, torch.Tensor, str | None]], touch: list[str]) -> None:
        """Queue block-rows ``(key, depth, K/V, the key before it in its chain)`` to store, ``touch``: the keys of the
        chains they extend (marked used, so that the store never evicts a block they need)."""
        with self._starting:
            if self._thread is None:
                with deferred_interrupts():  # started and recorded together: a thread made but never started, or
                    # started twice, would leave queued blocks nobody writes (flush() would never return)
                    thread = threading.Thread(target=self._run, name="tierkv-persist", daemon=True)
                    thread.start()
                    self._thread = thread
        self._queue.put((root, jobs, touch))

    def full(self) -> bool:
        """No room for another batch now (only the caller's thread adds: room seen here is still there)."""
        return self._queue.full()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                root, blocks, touch = job
                items = [Item(key, depth, *record.encode_block(key, root, depth, kv), parent=parent)
                         for key, depth, kv, parent in blocks]
                self.store.put(items, touch=touch)
            except Exception as error:
                if not self._warned:
                    log.warning("tierkv: persisting blocks failed, they will be recomputed next time: %s", error)
                    self._warned = True
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


def _layer_blocks(block: torch.Tensor, namespace: Namespace) -> list[torch.Tensor]:
    """A decoded block record's K/V, per layer ``[2, H_kv, bt, D]`` (views of it)."""
    if not namespace.shapes:
        return list(block.unbind(0))  # [L, 2, H, bt, D]
    sizes = [namespace.layer_elements(layer) for layer in range(namespace.layers)]
    return [part.view(2, heads, namespace.block_tokens, dim)
            for part, (heads, dim) in zip(block.split(sizes), namespace.shapes)]
