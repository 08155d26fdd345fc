"""``ChainedBlockStore``: the local persistent blocks (if any), then the shared remote tier, as one store.

:class:`tierkv.persist.prefix.PrefixPersistence` finds, reads and writes block records through a store with
``lookup`` / ``get`` / ``put`` / ``in``; this one answers from the local disk first and asks the remote tier
only for the rest of a chain::

    lookup(keys)  local prefix L, then the remote's from L on (one EXISTS pipeline)     -> L + R
    get(keys)     the local records, then the remote's (batched reads of at most one record's size,
                  verified twice: the remote frame's checksum, then the record's own checksum, key,
                  namespace root, dtype, shape and depth in the chain)
    put(items)    every record queued for the remote (write-through; called on the persistence
                  thread, it waits for room while the server keeps up), then the local store

A remote value whose frame is intact but whose record is not this key's block of the bound namespace
(another block's record, a torn record framed anew, another namespace's, another shape, dtype or depth) is
a miss there, counted as ``corrupt`` and deleted from the server, so the block this worker computes next is
written in its place and later workers load past it. A local record that fails the same checks is removed
from the local store (:meth:`PersistentStore.get` with the namespace). A record of a newer tierkv (a later record
version or block format) is a miss left on the server as it is, for the workers that read it: warned, never
counted corrupt, deleted or overwritten.

Records read from the remote — only those that passed every check — are also written to the local store in
the background (bounded, dropped when full; each checked again, header field by field, before it is listed),
so the next process on this machine finds them on its own disk; records the local store holds but the remote
lacks are queued for the remote when they are read, so a block persisted while the server was down reaches
it later.

Remote keys are namespaced by the chain's root (a hash of the model fingerprint and layout,
:class:`tierkv.persist.keys.Namespace`): ``tierkv:<root>:<key>``. A record's own header names its root,
so writes go to the right namespace whatever the cache does meanwhile; reads use the namespace of the
last :meth:`bind` (``TieredCache.load_prefix`` binds before it looks up), which also bounds what one value
may cost to read: a value longer than the namespace's block record is read only that far, then refused.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from tierkv import settings
from tierkv.errors import IntegrityError, NewerFormatError, TierKVError
from tierkv.inputs import printable
from tierkv.persist import manifest, record
from tierkv.persist.blockfile import Item, PersistentStore
from tierkv.persist.keys import Namespace
from tierkv.remote.framing import HEADER
from tierkv.remote.store import RemoteBlockStore
from tierkv.remote.url import RemoteURL, parse_remote_url
from tierkv.remote.writer import WriteBehind

log = logging.getLogger("tierkv.remote")


class ChainedBlockStore:
    """``local`` (a :class:`PersistentStore`, or None for a worker without disk persistence) above the remote
    tier at ``url``; ``options`` go to every :class:`RemoteBlockStore` (one per namespace root)."""

    def __init__(self, local: PersistentStore | None, url: str | RemoteURL, **options: Any) -> None:
        self.local = local
        self.url = parse_remote_url(url, password=settings.get("redis_password")) if isinstance(url, str) else url
        RemoteBlockStore.check_available()
        self.options = options
        self._remotes: dict[str, RemoteBlockStore] = {}
        self._root: str | None = None
        self._namespaces: dict[str, Namespace] = {}  # bound so far, by root: what a record saved locally must fit
        self._local_missing_remotely: set[str] = set()  # read from local, absent remotely: pushed on get()
        self.counts = {"local_blocks": 0, "remote_blocks": 0, "pushed_from_local": 0, "saved_locally": 0}
        # a block read remotely and offered to the local store -> (its chain's keys from the first, its depth): saved
        # beside the blocks before it, which the save marks used so that it never evicts them
        self._chains: dict[str, tuple[tuple[str, ...], int]] = {}
        self._saver = WriteBehind(functools.partial(self._save_locally, local), on_drop=lambda size, reason: None,
                                  on_error=self._save_failed) if local is not None else None

    def remote(self, root: str) -> RemoteBlockStore:
        """The remote store of namespace ``root`` (built on first use; a bad URL raised at construction)."""
        if root not in self._remotes:
            self._remotes[root] = RemoteBlockStore(self.url, root, **self.options)
        return self._remotes[root]

    def bind(self, namespace: Namespace) -> None:
        """Lookups and reads from now on are in ``namespace`` (its root names the model's blocks on the server),
        and a remote value is read only up to the size of one of its block records."""
        self._root = namespace.root
        self._namespaces[namespace.root] = namespace
        self.remote(self._root)

    # ---------------------------------------------------------------------------------------- reading
    def __contains__(self, key: str) -> bool:
        """Held locally (a cheap check on the persisting path; the remote skips blocks it holds by itself)."""
        return self.local is not None and key in self.local

    def lookup(self, keys: Sequence[str]) -> int:
        local = self.local.lookup(keys) if self.local is not None else 0
        if self._root is None:
            return local
        held = self.remote(self._root).contains(keys)
        self._local_missing_remotely = {key for key, there in zip(keys[:local], held) if not there}
        return local + _leading(held[local:])

    def get(self, keys: Sequence[str], namespace: Namespace | None = None) -> list[bytearray]:
        """The records of the leading ``keys`` (a chain from its first block): local, then remote. Each is
        checked as a block of ``namespace`` (default: the bound one) at its depth before it is returned, pushed
        or saved; a local one that fails is removed, a remote one discarded (counted corrupt, deleted). With no
        namespace at all, only local records (checked byte by byte) are returned."""
        namespace = namespace or (self._namespaces[self._root] if self._root is not None else None)
        found = self.local.get(keys, namespace) if self.local is not None else []
        self.counts["local_blocks"] += len(found)
        if namespace is None:
            return found
        remote = self.remote(namespace.root)
        for key, data in zip(keys, found):
            if key in self._local_missing_remotely:
                remote.put(key, bytes(data))
                self.counts["pushed_from_local"] += 1
        self._local_missing_remotely.clear()
        if len(found) == len(keys):
            return found
        limit = HEADER.size + record.max_block_bytes(namespace)  # a longer value is read that far, then refused
        chain = tuple(keys)
        # each value is copied, then dropped, and no read is sent past the first miss: the prefix is held once
        with contextlib.closing(remote.iter_many(keys[len(found):], limit)) as values:
            for depth, (key, payload) in enumerate(values, start=len(found)):
                if payload is None:
                    break
                try:
                    why = _wrong_record(payload, key, namespace, depth)
                except NewerFormatError as error:  # a newer tierkv's block: a miss, left on the server for it
                    remote.newer(key, str(error))
                    break
                if why:
                    remote.discard(key, why)
                    break
                data = bytearray(payload)  # writable, for the tensor view that decoding makes
                del payload
                found.append(data)
                self.counts["remote_blocks"] += 1
                if self._saver is not None:
                    self._chains[key] = (chain, depth)
                    if not self._saver.offer(key, data):
                        self._chains.pop(key, None)
        return found

    # ---------------------------------------------------------------------------------------- writing
    def put(self, items: Sequence[Item], touch: Sequence[str] = ()) -> int:
        """Queue each of ``items`` for the remote, then store them locally (raises as the local store does: a
        full local disk does not keep the blocks from the other workers). Called on the persistence thread,
        so it waits for room in the remote queue (bounded: :mod:`tierkv.remote.writer`) rather than drop."""
        for item in items:
            root = json.loads(item.head[record.PREFIX_BYTES:])["namespace"]
            self.remote(root).put(item.key, item.head + item.payload, wait=True)
        return self.local.put(items, touch) if self.local is not None else len(items)

    def _save_locally(self, local: PersistentStore, batch: list[tuple[str, Any]]) -> None:
        """Writer thread: records the remote gave us, into the ``local`` store. Each is checked again, every
        header field (kind, key, a namespace bound here, its dtype and shape, a depth the manifest can list),
        so nothing the local manifest's readers would refuse is listed; one that fails is not saved. Each is saved
        after the block before it in its chain, and those before it are marked used: a chain whose shallow end the
        save evicted, or that lost it since, would be unreachable."""
        items = []
        extended: dict[tuple[str, ...], int] = {}  # chain -> the shallowest depth saved of it: the blocks before it
        for key, data in batch:
            chain, at = self._chains.pop(key, ((), 0))
            what = f"block {key}"
            try:
                header, payload = record.decode(data, what=what)
                depth = header.get("depth")
                namespace = self._namespaces.get(str(header.get("namespace")))
                if namespace is None or type(depth) is not int:
                    raise IntegrityError(f"{what}: namespace {str(header.get('namespace'))[:40]!r} or depth "
                                         f"{str(depth)[:40]!r} is not one this store read.")
                record.check_block(header, len(payload), key, namespace, what, depth)
                manifest.entry(key, [len(data), 0, depth], 0, what)
            except IntegrityError as error:
                self._save_failed(error)
                continue
            parent = chain[depth - 1] if 0 < depth == at else None
            if parent is not None:
                extended[chain] = min(extended.get(chain, depth), depth)
            items.append(Item(key, depth, bytes(data[: len(data) - len(payload)]), payload, parent))
        try:
            before = [key for chain, depth in extended.items() for key in chain[:depth]]
            self.counts["saved_locally"] += local.put(items, before)
        except TierKVError as error:
            self._save_failed(error)

    def _save_failed(self, error: BaseException) -> None:
        log.warning("tierkv: keeping remote blocks on the local disk failed (they stay remote): %s",
                    printable(error))  # (the server's bytes may be in it)

    # ---------------------------------------------------------------------------------- management
    def stats(self) -> dict[str, Any]:
        """The remote stores' counters (summed over namespaces; see :meth:`RemoteBlockStore.stats`), blocks
        served locally and remotely, pushed from local to remote, saved locally, and the local store's."""
        remote: dict[str, Any] = {}
        for store in self._remotes.values():
            for name, value in store.stats().items():
                remote[name] = (remote.get(name, False) or value) if isinstance(value, bool) else \
                    remote.get(name, 0) + value
        return {**remote, **self.counts, "local": self.local.stats() if self.local is not None else {}}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued remote writes and local saves: False if ``timeout`` s (for all of them) passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        done = all([store.flush(left()) for store in list(self._remotes.values())])
        return (self._saver.flush(left()) if self._saver is not None else True) and done

    def __repr__(self) -> str:
        return f"ChainedBlockStore(local={self.local is not None}, remote={self.url.redacted()!r})"

    def close(self) -> None:
        """Stop the saver, then close the remote stores and the local one — each whatever the others met (a Ctrl-C
        in one still closes the rest: no thread or scratch area is left behind)."""
        with contextlib.ExitStack() as closing:  # (its callbacks run last first)
            if self.local is not None:
                closing.callback(self.local.close)
            for store in self._remotes.values():
                closing.callback(store.close)
            if self._saver is not None:
                closing.callback(self._saver.close)


def _wrong_record(value: memoryview, key: str, namespace: Namespace, depth: int) -> str:
    """Why ``value`` (a remote payload whose frame checked out) is not the record of block ``key``, at ``depth``
    in its chain, of ``namespace`` (its dtype and shape too); "" when it is. A record of a newer tierkv raises
    :class:`NewerFormatError`: it is not wrong, only unreadable here."""
    what = f"block {key}"
    try:
        header, payload = record.decode(value, what=what)
    except NewerFormatError:
        raise
    except TierKVError as error:
        return f"holds no valid record ({error})"
    found = tuple(header.get(field) for field in ("kind", "key", "namespace"))
    if found != ("block", key, namespace.root):
        shown = ", ".join(repr(text)[:80] for text in found)  # the server's text: quoted and cut short
        return f"passed its frame's checksum but holds the record of another block ({shown})"
    try:
        record.check_block(header, len(payload), key, namespace, what, depth)
    except NewerFormatError:
        raise
    except IntegrityError as error:
        return f"passed its frame's checksum but its record does not fit this model's blocks ({error})"
    return ""


def _leading(found: Sequence[bool]) -> int:
    return found.index(False) if False in found else len(found)

