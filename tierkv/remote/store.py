"""``RemoteBlockStore``: content-addressed blocks on a shared Redis (or Valkey) server, as a cache below disk.

Many workers share one server: a block one of them computed and wrote is loaded by the others instead of
being prefilled again (LMCache's ``redis://`` backend, SGLang HiCache's L3). The store is a *cache* — it may
lose any block at any time (eviction, restart, a corrupted value) and every failure is a miss, counted and
logged, never an exception and never wrong data::

    store = RemoteBlockStore("redis://10.0.0.5:6379/0", namespace="a3f9...-l3h2d32f32b256")
    store.put(key, payload)                 # returns at once; a background thread writes it
    n = store.prefix_length(keys)           # how many leading keys the server holds (one round-trip)
    payloads = store.get_many(keys[:n])     # verified payloads (memoryviews), None for a miss;
                                            # each value read at most max_value_bytes far

Keys are the caller's content hashes (hex strings: :func:`tierkv.persist.keys.block_keys`), stored as
``tierkv:<namespace>:<key>``: the namespace (model
fingerprint and layout) keeps models apart and lets an operator find or drop one model's blocks with
``SCAN MATCH tierkv:<namespace>:*``. Values carry a checksum over key and payload
(:mod:`tierkv.remote.framing`), verified on every read; a value that fails, or a key that holds another Redis
type (a list, a hash: the server answers WRONGTYPE), is a miss, counted as corrupt and deleted, and the next
write of the block overwrites it without the ``EXISTS`` check (so it is replaced even where DEL is refused).

Reads are batched: ``keys_per_request`` bounded reads (``GETRANGE``) per pipeline (one round-trip),
``inflight`` pipelines at once on a small thread pool, each on its own pooled connection. Writes go through
:class:`WriteBehind` (bounded; ``put(..., wait=True)`` from a background thread waits for room while the server
keeps up) and skip blocks the server already holds (an ``EXISTS`` before the ``SET``), so workers that computed
the same block at once send it only as often as they race.

Values from a shared server are untrusted: a value is used only if its frame's length equals its real size
and its checksum (over key and payload) matches; lengths it claims are compared, never allocated, and no
read goes past ``max_bytes`` (the caller's) or ``max_value_bytes`` (the store's default). A value
that passes but holds the wrong record for its key is refused by the caller, which reports it with
:meth:`RemoteBlockStore.discard` (counted as corrupt, deleted, then overwritten by the next write of the block).
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tierkv import forks, settings
from tierkv.errors import InvalidConfigError
from tierkv.remote.connection import RemoteConnection, redis_module
from tierkv.remote.framing import HEADER, MAGIC, frame, unframe
from tierkv.remote.url import RemoteURL, parse_remote_url
from tierkv.remote.writer import DEFAULT_QUEUE_ITEMS, Item, WriteBehind

KEY_PREFIX = "tierkv"
LOOKUP_KEYS = 512  # EXISTS per lookup pipeline
REWRITE_KEYS = 4096  # keys found corrupt that are remembered until written again (the oldest are forgotten)
_NAMESPACE = re.compile(r"[A-Za-z0-9._+-]{1,200}")


def _dropping(keys: Sequence[str], payloads: list[memoryview | None]) -> Generator[tuple[str, memoryview | None]]:
    """``(key, payload)`` pairs, each payload let go of here once yielded (so the caller's copy is the only one)."""
    for index, key in enumerate(keys):
        payload, payloads[index] = payloads[index], None
        yield key, payload
        del payload


def _claims_more(value: bytes, max_bytes: int) -> bool:
    """Whether ``value``, cut at ``max_bytes + 1`` bytes, starts with a frame header claiming a longer payload."""
    if len(value) <= max_bytes or len(value) < HEADER.size:
        return False
    magic, length, _ = HEADER.unpack_from(value)
    return bool(magic == MAGIC and HEADER.size + length > max_bytes)


def _wrong_type(value: object) -> bool:
    """Whether a per-command result is the server's WRONGTYPE error: that key holds another type of value."""
    return isinstance(value, Exception) and str(value).startswith("WRONGTYPE")


class _Wire:
    """The commands, over one :class:`RemoteConnection`; shared by the store, its reader pool and its writer
    thread (and referencing none of them back, so a dropped store can be collected and finalized)."""

    def __init__(self, conn: RemoteConnection, namespace: str, ttl_s: int | None) -> None:
        self.conn = conn
        self.prefix = f"{KEY_PREFIX}:{namespace}:".encode()
        self.ttl_s = ttl_s
        self.writer: WriteBehind | None = None
        self._lock = threading.Lock()
        self._rewrite: dict[str, None] = {}  # keys found corrupt, oldest first: their next write skips the EXISTS

    def name(self, key: str) -> bytes:
        return self.prefix + key.encode()

    def _each(self, command: str, keys: Sequence[str]) -> Callable[[Any], list[Any]]:
        """One pipeline (one round-trip) of ``command`` per key; per-command errors come back as values."""
        def op(client: Any) -> list[Any]:
            pipe = self.conn.pipeline(client)
            for key in keys:
                getattr(pipe, command)(self.name(key))
            return pipe.execute(raise_on_error=False)

        return op

    def exists(self, keys: Sequence[str], count: bool = True) -> list[bool]:
        """Whether the server holds each key (a reply other than an integer: no); ``count``: in the lookups."""
        results = self.conn.run(self._each("exists", keys), fallback=[False] * len(keys))
        self.conn.refused(results)
        found = [type(result) is int and result > 0 for result in results]
        if count:
            self.conn.count("lookups", len(keys))
            self.conn.count("lookup_hits", sum(found))
        return found

    def get(self, keys: Sequence[str], max_bytes: int, strict: bool = True) -> list[memoryview | None]:
        """Verified payloads, each value read as ``GETRANGE 0..max_bytes`` so a value longer than that costs at
        most ``max_bytes + 1`` bytes here. Such a value fails its frame (corrupt) unless ``strict`` is False (the
        bound is a default, not the known size of a block): then one whose header claims a larger payload is
        a miss left on the server, warned with the fix."""
        def op(client: Any) -> list[Any]:
            pipe = self.conn.pipeline(client)
            for key in keys:  # each GETRANGE with its EXISTS, adjacent: both see the same value
                pipe.getrange(self.name(key), 0, max_bytes)
                pipe.exists(self.name(key))
            return pipe.execute(raise_on_error=False)

        values = self.conn.run(op, fallback=[None] * len(keys) * 2)
        values, there = values[0::2], values[1::2]  # b"": no such key, or an empty value planted there
        for key, value, exists in zip(keys, values, there):
            if value == b"" and type(exists) is int and exists > 0:
                self.discard(key, "is empty")
        values = [None if value == b"" else value for value in values]
        self.conn.refused([value for value in values if not _wrong_type(value)])
        payloads: list[memoryview | None] = []
        for key, value in zip(keys, values):
            payload = unframe(key.encode(), value) if isinstance(value, bytes) else None
            if _wrong_type(value):  # a list, hash ... at a block's name: only deleting it lets the block be written
                self.discard(key, "is a Redis value of another type (WRONGTYPE), not a block")
            elif isinstance(value, bytes) and payload is None and not strict and _claims_more(value, max_bytes):
                self.conn.count("too_large")
                self.conn.warn("too_large", f"value of {self.name(key).decode()} is longer than the read bound "
                                            f"({max_bytes} bytes); it is a miss, left on the server: pass max_bytes= "
                                            "to get_many or raise max_value_bytes")
            elif isinstance(value, bytes) and payload is None:
                self.discard(key, f"failed its checksum ({len(value)} bytes)")
            elif payload is not None:
                self.conn.count("bytes_read", len(value))
            payloads.append(payload)
        self.conn.count("reads", len(keys))
        self.conn.count("read_hits", sum(p is not None for p in payloads))
        return payloads

    def discard(self, key: str, why: str) -> None:
        """Count the value of ``key`` as corrupt, warn, queue its deletion, and have the next write of the block
        overwrite it without asking whether the server holds it (where DEL is refused, the value stays)."""
        self.conn.count("corrupt")
        self.conn.warn("corrupt", f"value of {self.name(key).decode()} {why}; it is a miss (wrong bytes on the "
                                  "server): tierkv deletes it and the next write of the block overwrites it")
        with self._lock:
            self._rewrite.pop(key, None)
            self._rewrite[key] = None
            while len(self._rewrite) > REWRITE_KEYS:
                del self._rewrite[next(iter(self._rewrite))]
        if self.writer is not None:
            self.writer.offer(key, None)

    def write(self, batch: list[Item]) -> None:
        """One writer batch: deletes, then ``SET`` of the blocks the server does not hold yet (and of those found
        corrupt, whatever it holds). The deletes and ``EXISTS`` go on the readers' client, whose timeout is
        ``timeout_s``: a frozen server fails them fast and opens the breaker, so the ``SET`` (whose client allows a
        large pipeline longer) is not even sent, and a flush waits about ``timeout_s``, not the write timeout."""
        deletes = [key for key, payload in batch if payload is None]
        sets = [(key, payload) for key, payload in batch if payload is not None]
        with self._lock:
            forced = {key for key, _ in sets if key in self._rewrite}
        checked = [item for item in sets if item[0] not in forced]

        def ask(client: Any) -> list[Any]:
            pipe = self.conn.pipeline(client)
            for key in deletes:
                pipe.delete(self.name(key))
            for key, _ in checked:
                pipe.exists(self.name(key))
            return pipe.execute(raise_on_error=False)

        answers = self.conn.run(ask, fallback=None) if deletes or checked else []
        if answers is None:
            self.conn.count("writes_failed", len(sets))
            return
        self.conn.refused(answers[:len(deletes)])  # a DEL refused (an ACL without it, a replica): counted, warned
        held = {key for (key, _), present in zip(checked, answers[len(deletes):])
                if not isinstance(present, Exception) and present}
        todo = [(key, payload) for key, payload in sets if key not in held]

        def put(client: Any) -> tuple[int, int]:
            pipe = self.conn.pipeline(client)
            sizes = []
            for key, payload in todo:
                value = frame(key.encode(), payload)
                sizes.append(len(value))
                pipe.set(self.name(key), value, ex=self.ttl_s)
            results = pipe.execute(raise_on_error=False)
            self.conn.refused(results)
            ok = [not isinstance(result, Exception) for result in results]
            with self._lock:
                for (key, _), good in zip(todo, ok):
                    if good:
                        self._rewrite.pop(key, None)
            return sum(ok), sum(size for size, good in zip(sizes, ok) if good)

        written, size = self.conn.run(put, fallback=(0, 0), write=True) if todo else (0, 0)
        self.conn.count("writes", written)
        self.conn.count("bytes_written", size)
        self.conn.count("writes_existing", len(held))
        self.conn.count("writes_failed", len(todo) - written)


class RemoteBlockStore:
    """Blocks on a Redis/Valkey server (or cluster) shared by many workers; see the module doc.

    Args:
        url: ``redis://``, ``rediss://``, ``redis+cluster://`` ... (:mod:`tierkv.remote.url`); the password
            comes from the URL, else ``$TIERKV_REDIS_PASSWORD``.
        namespace: model fingerprint and layout, e.g. ``"<fingerprint>-<layout>"`` (letters, digits, ``._+-``).
        timeout_s / connect_timeout_s: per command (default ``$TIERKV_REMOTE_TIMEOUT``, 2 s) / per connect;
            a server slower than this is a miss and is marked down for a back-off
            (:class:`~tierkv.remote.connection.RemoteConnection`).
        inflight: read pipelines in flight at once (threads, and pooled connections).
        keys_per_request: reads (``GETRANGE``) per read pipeline.
        queue_items / queue_bytes: bounds of the write-behind queue (default 1,024 blocks and the
            ``remote_queue`` setting, 64 MiB); a full queue drops, counted, unless the put may wait.
        queue_wait_s: how long ``put(..., wait=True)`` waits for room without a batch sent before it drops
            (default the ``remote_queue_wait`` setting, 10 s; :mod:`tierkv.remote.writer`).
        ttl_s: expiry of written blocks; None keeps them until the server evicts them (``allkeys-lru``).
        backoff_s: how long a failed server is left alone before the next try (doubling, up to 30 s).
        max_value_bytes: how far :meth:`get_many` without ``max_bytes`` reads a value (default ``queue_bytes``,
            raised to the largest value this store was given to write): a longer one is not read whole.
    """

    def __init__(self, url: str | RemoteURL, namespace: str, *, timeout_s: float | None = None,
                 connect_timeout_s: float = 1.0, inflight: int = 4, keys_per_request: int = 8,
                 queue_items: int = DEFAULT_QUEUE_ITEMS, queue_bytes: int | None = None,
                 queue_wait_s: float | None = None, ttl_s: int | None = None, backoff_s: float = 1.0,
                 max_value_bytes: int | None = None) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise InvalidConfigError(f"remote namespace {namespace!r} must be 1-200 letters, digits or ._+- "
                                     "(e.g. the model fingerprint and layout).")
        queue_bytes = settings.get("remote_queue") if queue_bytes is None else queue_bytes
        queue_wait_s = settings.get("remote_queue_wait") if queue_wait_s is None else queue_wait_s
        if isinstance(queue_wait_s, bool) or not isinstance(queue_wait_s, (int, float)) or not queue_wait_s >= 0:
            raise InvalidConfigError(f"queue_wait_s must be a number of seconds >= 0, got {queue_wait_s!r}.")
        max_value_bytes = queue_bytes if max_value_bytes is None else max_value_bytes
        for name, value in (("inflight", inflight), ("keys_per_request", keys_per_request),
                            ("queue_items", queue_items), ("queue_bytes", queue_bytes),
                            ("max_value_bytes", max_value_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfigError(f"{name} must be a positive int, got {value!r}.")
        if timeout_s is None:
            timeout_s = settings.get("remote_timeout")
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s),
                            ("backoff_s", backoff_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidConfigError(f"{name} must be a positive number of seconds, got {value!r}.")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1):
            raise InvalidConfigError(f"ttl_s must be a positive int (seconds) or None, got {ttl_s!r}.")
        if isinstance(url, str):
            url = parse_remote_url(url, password=settings.get("redis_password"))
        self.url = url
        self.namespace = namespace
        self.keys_per_request = keys_per_request
        self.inflight = inflight
        self.max_value_bytes = max_value_bytes
        # a write pipeline (at most BATCH_BYTES, or one larger block) goes in one sendall that the socket timeout
        # bounds as a whole: it has as long as the writer waits for a batch, so a block is dropped only when the
        # link is slower than its size per (timeout_s + queue_wait_s), 12 s by default, not per timeout_s
        conn = RemoteConnection(url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                                # readers, one lookup, the writer's EXISTS (its SETs have a client of their own)
                                max_connections=inflight + 2,
                                backoff_s=backoff_s, max_backoff_s=max(30.0, backoff_s),
                                write_timeout_s=timeout_s + queue_wait_s)
        self._wire = _Wire(conn, namespace, ttl_s)
        self._writer = WriteBehind(self._wire.write, on_drop=_dropped(conn), on_error=_write_bug(conn),
                                   max_items=queue_items, max_bytes=queue_bytes, wait_s=queue_wait_s,
                                   is_down=lambda: conn.down)
        self._wire.writer = self._writer
        self._readers = ThreadPoolExecutor(max_workers=inflight, thread_name_prefix="tierkv-remote-read")
        self._finalizer = forks.finalize(self, _shut_down, self._writer, self._readers, conn)

    @staticmethod
    def check_available() -> None:
        """Raise :class:`~tierkv.errors.InvalidConfigError` (with the install command) without redis-py."""
        redis_module()

    # ------------------------------------------------------------------------------------- reads
    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether the server holds each key (batched ``EXISTS``); all False while it is down."""
        found: list[bool] = []
        for start in range(0, len(keys), LOOKUP_KEYS):
            found += self._wire.exists(keys[start:start + LOOKUP_KEYS])
        return found

    def prefix_length(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the server holds (a prefix chain is usable only that far)."""
        found = self.contains(keys)
        return found.index(False) if False in found else len(found)

    def get_many(self, keys: Sequence[str], max_bytes: int | None = None) -> list[memoryview | None]:
        """Verified payloads of ``keys`` in order (None: missing, evicted, corrupt, or the server failed),
        read ``keys_per_request`` per pipeline with up to ``inflight`` pipelines in flight. ``max_bytes``
        bounds what one value may cost to read (the largest valid value: a shared server's values are
        untrusted); a longer one is corrupt. Without it, a value is read at most :attr:`max_value_bytes` far,
        and one whose frame claims more is a miss left on the server (warned)."""
        return [payload for _, payload in self.iter_many(keys, max_bytes)]

    def iter_many(self, keys: Sequence[str], max_bytes: int | None = None) -> Generator[tuple[str, memoryview | None]]:
        """``(key, payload)`` of :meth:`get_many`, in order, as the pipelines answer: at most ``inflight`` of them
        are in flight or waiting, each value is dropped here once yielded, and a caller that stops (at a miss)
        sends no further reads. So the values held at once are one window of pipelines, not all of ``keys``."""
        bound, strict = (self.max_value_bytes, False) if max_bytes is None else (max_bytes, True)
        if len(keys) <= self.keys_per_request:  # one pipeline: on this thread (also after close(): a miss)
            yield from _dropping(keys, self._wire.get(keys, bound, strict))
            return
        groups = deque(keys[start:start + self.keys_per_request]
                       for start in range(0, len(keys), self.keys_per_request))
        window: deque[tuple[Sequence[str], Future[list[memoryview | None]]]] = deque()
        try:
            while groups or window:
                while groups and len(window) < self.inflight:
                    group = groups.popleft()
                    window.append((group, self._readers.submit(self._wire.get, group, bound, strict)))
                group, future = window.popleft()
                yield from _dropping(group, future.result())
        finally:
            for _, future in window:
                future.cancel()

    # ------------------------------------------------------------------------------------ writes
    def put(self, key: str, payload: bytes | memoryview, wait: bool = False) -> bool:
        """Queue ``payload`` for ``key``; False when it was dropped (counted, warned). Returns at once, or with
        ``wait`` (a background thread's put) waits for room while the server keeps up: it drops only while
        the server is down or no batch was sent for ``queue_wait_s``. ``payload`` must not change afterwards
        (``bytes``, or a view of memory nobody writes again)."""
        self.max_value_bytes = max(self.max_value_bytes, HEADER.size + len(payload))  # what it writes, it reads
        queued = self._writer.offer(key, payload, wait=wait)
        if queued:
            self._wire.conn.count("writes_queued")
        return queued

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent (or failed); False if ``timeout`` passed first, or as soon as the
        server stops answering: a ``SET`` pipeline in flight has the long write timeout (``timeout_s +
        queue_wait_s``), so while writes are pending the server is pinged (a command bounded by ``timeout_s``)
        every ``timeout_s / 4``, and a frozen one costs a flush about ``timeout_s`` (the write is left to its
        socket timeout, then counted as failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        step = self._wire.conn.timeout_s / 4
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._writer.flush(step if left is None else min(step, left)):
                return True
            if left is not None and left <= step or not self.ping():
                return self._writer.flush(0.0)

    def newer(self, key: str, why: str) -> None:
        """A value of ``key`` holding a newer tierkv's record (``why``): a miss, counted as ``newer`` and warned, left
        on the server (the next write of the block finds it there and skips it)."""
        self._wire.conn.count("newer")
        self._wire.conn.warn("newer", f"value of {self._wire.name(key).decode()}: {why} It is a miss here, left on "
                                      "the server for the workers that read it.")

    def discard(self, key: str, why: str) -> None:
        """A value of ``key`` that passed its frame but was refused by the caller (another block's record, say):
        counted as ``corrupt``, warned with ``why``, deleted, and overwritten by the next write of the block."""
        self._wire.discard(key, why)

    # ------------------------------------------------------------------------------- management
    def ping(self) -> bool:
        """True if the server answers now; False while it is down (the breaker), unreachable or slow."""
        if self.url.cluster:  # a cluster's PING goes to one node: ask every primary (a frozen one is the one to find)
            return self._wire.conn.run(lambda client: bool(client.ping(target_nodes=client.PRIMARIES)), fallback=False)
        return self._wire.conn.run(lambda client: bool(client.ping()), fallback=False)

    def clear(self) -> int:
        """Delete this namespace's blocks on the server (``SCAN`` + ``DEL``); the number deleted."""
        def op(client: Any) -> int:
            deleted = 0
            for name in client.scan_iter(match=self._wire.prefix + b"*", count=1000):
                deleted += client.delete(name)
            return deleted

        return self._wire.conn.run(op, fallback=0)

    def stats(self) -> dict[str, Any]:
        """Counters since construction: ``lookups``/``lookup_hits`` (keys asked/held), ``reads``/``read_hits``,
        ``corrupt`` (values that failed the checksum, or held another block's record), ``too_large`` (values
        longer than ``max_value_bytes``, left on the server), ``newer`` (a newer tierkv's records, left there),
        ``bytes_read``/``bytes_written`` (values on the wire, header included), ``writes`` (sent),
        ``writes_existing`` (skipped: the server had them), ``writes_dropped`` (not queued: the queue stayed full,
        the server was down, or the store closed), ``writes_failed``, ``rejected_full`` (server out of memory),
        ``refused`` (other commands the server refused: a DEL or SET an ACL or a read-only replica denies, say),
        ``errors`` (connection failures and timeouts), ``skipped_down`` (calls answered as misses while down),
        ``warnings_*``; ``down`` and ``pending`` (queued writes) now."""
        conn = self._wire.conn
        with conn._lock:
            counts = dict(conn.counts)
        names = ("lookups", "lookup_hits", "reads", "read_hits", "corrupt", "too_large", "newer", "bytes_read",
                 "bytes_written", "writes_queued", "writes", "writes_existing", "writes_dropped", "writes_failed",
                 "rejected_full", "refused", "errors", "skipped_down")
        return {**{name: counts.get(name, 0) for name in names}, **counts, "down": conn.down,
                "pending": self._writer.pending, "header_bytes": HEADER.size}

    def close(self, timeout: float = 5.0) -> None:
        """Send queued writes (up to ``timeout`` s), stop the threads, close the connections. Idempotent."""
        if self._finalizer.alive:
            try:
                self._writer.close(timeout)
            finally:  # a Ctrl-C while the writes drain: the threads and sockets go all the same
                self._finalizer()

    def __enter__(self) -> RemoteBlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteBlockStore({self.url.redacted()!r}, namespace={self.namespace!r})"


_DROPPED = {
    "full": "the write-behind queue is full (the server is slower than blocks arrive)",
    "slow": "the write-behind queue stayed full with no write sent for queue_wait_s (the server is slower than "
            "one 16 MiB pipeline per queue_wait_s: TIERKV_REMOTE_QUEUE_WAIT)",
    "down": "the server is down",
    "closed": "the store closed before they were sent",
}


def _dropped(conn: RemoteConnection):
    def on_drop(size: int, reason: str) -> None:
        conn.count("writes_dropped")
        with conn._lock:
            dropped = conn.counts["writes_dropped"]
        conn.warn("dropped", f"{_DROPPED[reason]}: blocks are not written ({dropped} dropped so far); they will be "
                             "recomputed by whoever needs them", counted=True)

    return on_drop


def _write_bug(conn: RemoteConnection):
    def on_error(exc: BaseException) -> None:
        conn.count("writes_failed")
        conn.warn("writer", f"a background write failed unexpectedly: {type(exc).__name__}: {exc}")

    return on_error


def _shut_down(writer: WriteBehind, readers: ThreadPoolExecutor, conn: RemoteConnection) -> None:
    """Finalizer (also when a store is dropped without close()): stop the threads, close the sockets."""
    try:
        writer.close(timeout=0.0)
    finally:  # each step whatever the one before it met (a Ctrl-C)
        try:
            readers.shutdown(wait=False, cancel_futures=True)
        finally:
            conn.close()
