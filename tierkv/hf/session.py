"""Prefix persistence of one cache: which token ids it holds, which of its full blocks are persisted, and
``load_prefix`` — over the local persistent blocks (``persist=True``), a Redis server (``remote=``), or both.

A conversation loaded from a file (:meth:`TieredCache.load`) is *private*: its K/V came from the file, not from
this process's forward passes, so neither it nor anything computed on top of it is written to the shared
stores under the token ids the file claims (a crafted file would otherwise serve its K/V to other prompts).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import psutil
import torch

from tierkv.atomic import deferred_interrupts
from tierkv.errors import InvalidConfigError
from tierkv.persist.blockfile import PersistentStore
from tierkv.persist.keys import Namespace
from tierkv.persist.prefix import PrefixPersistence
from tierkv.units import parse_size

if TYPE_CHECKING:
    from tierkv.hf.cache import TieredCache
    from tierkv.remote.chain import ChainedBlockStore

log = logging.getLogger("tierkv")

DEFAULT_PERSIST_FRACTION = 0.1  # of free space under disk_dir, when persist=True and persist_gb is None


class PrefixSession:
    """The ids and persisted blocks of the sequence a cache holds (``persist=True`` and/or ``remote=``)."""

    def __init__(self, disk_dir: str | os.PathLike | None, persist: bool, persist_gb: float | str | None,
                 remote: str | None, block_tokens: int) -> None:
        local = None
        self.remote: ChainedBlockStore | None = None
        if persist:
            if disk_dir is None:
                raise InvalidConfigError("persist=True keeps blocks in disk_dir; pass disk_dir='/path/on/nvme'.")
            capacity = parse_size(persist_gb, name="persist_gb") if persist_gb is not None else \
                int(psutil.disk_usage(os.fspath(disk_dir)).free * DEFAULT_PERSIST_FRACTION)
            local = PersistentStore(disk_dir, max(capacity, 1))
        if remote is not None:
            from tierkv.remote.chain import ChainedBlockStore  # imports redis-py only when asked for

            try:
                self.remote = ChainedBlockStore(local, remote)
            except BaseException:
                if local is not None:
                    local.close()
                raise
        store = self.remote or local
        if store is None:
            raise InvalidConfigError("a prefix session needs persist=True (with disk_dir) or remote=.")
        self.prefix = PrefixPersistence(store, block_tokens)
        self.block_tokens = block_tokens
        self.private = False  # a conversation from a file: nothing of it is persisted

    @property
    def ids(self) -> np.ndarray | None:
        return self.prefix.ids

    @property
    def namespace(self) -> Namespace | None:
        return self.prefix.namespace

    def load(self, cache: TieredCache, model: torch.nn.Module, input_ids: torch.Tensor | Sequence[int]) -> int:
        """:meth:`TieredCache.load_prefix` (see there)."""
        ids = token_ids(input_ids)
        held = cache.get_seq_length()
        if held:
            batch = cache.batch_size
            if ids.shape[1] <= held or (cache.runtime.store is not None and ids.shape[0] != batch):
                raise InvalidConfigError(
                    f"the cache holds {held} tokens of {batch} rows; load_prefix needs the same rows with at least "
                    f"one new token, got ids of shape {tuple(ids.shape)}. Call cache.reset() for a new prompt.")
            if not self.private:
                self.prefix.extend(ids, held)
            return held
        namespace = Namespace.of_model(model, self.block_tokens)
        if cache.runtime.num_layers is not None and len(cache.layers) != namespace.layers:
            raise InvalidConfigError(f"the model has {namespace.layers} layers but this cache was built for "
                                     f"{len(cache.layers)} (config=); pass that model's config.")
        self.private = False
        self.prefix.start(namespace, ids)
        if self.remote is not None:
            self.remote.bind(namespace)
        blocks, kv = self.prefix.load()
        if blocks:
            _import(cache, kv, next(model.parameters()).device)
        return blocks * self.block_tokens

    def loaded_from_file(self) -> None:
        """The cache now holds a conversation read from a file: it is private (module docstring)."""
        self.prefix.reset()
        self.private = True

    def collect(self, cache: TieredCache) -> None:
        """Hand the full blocks with known ids that are not persisted yet to the background writer. Never raises:
        persistence is a copy, and its failure must not fail decoding (it is logged)."""
        store = cache.runtime.store
        if store is None or self.private:
            return
        try:
            self.prefix.collect(store, [layer.get_seq_length() for layer in cache.layers],
                                [layer.dropped for layer in cache.layers])
        except Exception:
            log.exception("tierkv: persisting this sequence's blocks failed; it is no longer persisted")
            self.prefix.reset()

    def truncate(self, length: int) -> None:
        self.prefix.truncate(length)

    def select_rows(self, indices: Sequence[int]) -> None:
        self.prefix.select_rows(indices)

    def reset(self) -> None:
        self.prefix.reset()
        self.private = False

    def flush(self) -> None:
        self.prefix.flush()
        if self.remote is not None:
            self.remote.flush()  # the remote's writes (each bounded by its timeout)

    def close(self) -> None:
        try:
            self.prefix.close()  # waits for the writer, releases the store
        except Exception:  # noqa: BLE001 - close() never raises; what was listed stays listed
            log.exception("tierkv: closing the persistent block store failed")


def _import(cache: TieredCache, kv: list[torch.Tensor], device: torch.device) -> None:
    """Append ``kv[layer]`` ``[2, B, H_kv, T, D]`` to every layer of the empty ``cache`` (all or nothing)."""
    cache.ensure_layers(len(kv))
    try:
        for layer, layer_kv in zip(cache.layers, kv):
            layer_kv = layer_kv.to(device)
            layer.load(layer_kv[0], layer_kv[1])
    except BaseException:
        with deferred_interrupts():  # all or nothing, even under a second Ctrl-C
            cache.reset()
        raise


def token_ids(input_ids: torch.Tensor | Sequence[int]) -> np.ndarray:
    """Token ids as an int64 ``[B, T]`` array (a 1-D sequence is one row)."""
    ids = np.asarray(input_ids.detach().cpu() if isinstance(input_ids, torch.Tensor) else input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise InvalidConfigError(f"input_ids must be token ids of shape [batch, tokens], got {ids.dtype} "
                                 f"{tuple(ids.shape)}.")
    return ids.astype(np.int64)
