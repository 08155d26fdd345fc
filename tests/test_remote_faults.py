"""Faults of the remote tier, each against a real ``redis-server``: every one is a miss or a warning, never an
exception out of the store and never wrong bytes (the cache-level versions are in test_remote_cache.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import tracemalloc

import pytest
from redis_server import RedisServer

from tierkv.remote import RemoteBlockStore, RemoteURL
from tierkv.remote.connection import RemoteConnection
from tierkv.remote.framing import frame


def blocks(n: int, size: int = 4096) -> tuple[list[str], list[bytes]]:
    return [f"{i:032x}" for i in range(n)], [os.urandom(size) for _ in range(n)]


def fill(store: RemoteBlockStore, keys: list[str], values: list[bytes]) -> None:
    for key, value in zip(keys, values):
        store.put(key, value)
    assert store.flush(10)


def assert_never_wrong(payloads, values) -> None:
    """Each payload is the block that was written under its key, or a miss."""
    for payload, value in zip(payloads, values):
        assert payload is None or bytes(payload) == value


@contextlib.contextmanager
def stored(redis_server, n: int, at: int):
    """A store holding ``n`` blocks; with it the keys, the values, a raw client, and the server's name and value
    of block ``at``."""
    keys, values = blocks(n)
    raw = redis_server.client()
    name = f"tierkv:m:{keys[at]}"
    with RemoteBlockStore(redis_server.url, "m") as store:
        fill(store, keys, values)
        yield store, keys, values, raw, name, raw.get(name)


def wait_until_up(store: RemoteBlockStore, deadline_s: float = 10.0) -> None:
    """Poll until the store's breaker lets a command through again and the server answers."""
    end = time.monotonic() + deadline_s
    while not store.ping():
        assert time.monotonic() < end, f"the store did not reconnect: {store.stats()}"
        time.sleep(0.05)


def test_server_down_at_start_then_up(tmp_path, redis_factory, caplog) -> None:
    redis_factory()  # (skips without redis-server)
    server = RedisServer(tmp_path / "late")
    keys, values = blocks(4)
    with RemoteBlockStore(server.url, "m", backoff_s=0.05) as store:
        assert store.prefix_length(keys) == 0 and store.get_many(keys) == [None] * 4
        fill(store, keys, values)  # writes fail in the background, counted
        stats = store.stats()
        assert stats["down"] and stats["errors"] >= 1 and stats["writes"] == 0
        assert stats["writes_failed"] == 4
        assert "unreachable" in caplog.text and caplog.text.count("unreachable") == 1  # warned once
        server.start()
        try:
            wait_until_up(store)
            fill(store, keys, values)
            assert [bytes(p) for p in store.get_many(keys)] == values
        finally:
            server.stop()


def test_server_killed_mid_run_and_restarted_empty(redis_server) -> None:
    keys, values = blocks(12)
    with RemoteBlockStore(redis_server.url, "m", keys_per_request=3, backoff_s=0.05) as store:
        fill(store, keys[:8], values[:8])
        assert store.prefix_length(keys) == 8
        redis_server.kill()
        payloads = store.get_many(keys)
        assert payloads == [None] * 12 and store.stats()["down"]
        fill(store, keys[8:], values[8:])  # dropped or failed, never raised
        redis_server.start()  # same port, empty: a restarted server without persistence
        wait_until_up(store)
        assert store.prefix_length(keys) == 0
        fill(store, keys, values)
        assert [bytes(p) for p in store.get_many(keys)] == values


def test_a_slow_server_is_a_miss_within_the_timeout(redis_server) -> None:
    keys, values = blocks(4)
    with RemoteBlockStore(redis_server.url, "m", timeout_s=0.2, backoff_s=0.05) as store:
        fill(store, keys, values)
        redis_server.pause(1.0)
        assert store.get_many(keys) == [None] * 4
        stats = store.stats()
        assert stats["errors"] >= 1 and stats["warnings_down"] >= 1
        time.sleep(1.0)  # the pause ends; the values are still there
        wait_until_up(store)
        assert [bytes(p) for p in store.get_many(keys)] == values


def test_one_stall_seen_by_reads_in_flight_costs_one_back_off(redis_server) -> None:
    """Read pipelines in flight when the server stalls all fail; that is one outage: the breaker stays open for
    the first back-off, not doubled once per pipeline (8 s for four of them, while the warning said 1 s)."""
    keys, values = blocks(64, size=100)  # 8 read pipelines of 8 keys, 4 in flight at once
    with RemoteBlockStore(redis_server.url, "m", timeout_s=0.3, backoff_s=0.5) as store:
        fill(store, keys, values)
        redis_server.pause(0.6)
        assert store.get_many(keys) == [None] * 64
        failed = time.monotonic()
        assert store.stats()["errors"] >= 2  # several calls failed in the one outage
        time.sleep(0.4)  # the pause is over; the back-off (0.5 s) is not
        wait_until_up(store, deadline_s=5.0)
        assert time.monotonic() - failed < 1.5, "the breaker's back-off grew with the calls in flight (4 s for 4)"
        assert [bytes(p) for p in store.get_many(keys)] == values


class SlowLink:
    """A TCP proxy on loopback to ``port`` that carries what clients send at ``rate`` bytes/s: a slow link, on which
    a small command crosses at once and a large block takes its size per rate (replies are not slowed)."""

    def __init__(self, port: int, rate: float) -> None:
        self.target, self.rate = port, rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, self.rate), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, rate: float | None) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(64 << 10):
                sink.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (Linux), which close() alone does not
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.thread.join(timeout=10)


def test_a_write_has_longer_than_a_read_to_cross(redis_server) -> None:
    """Regression: writes had the reads' socket timeout (``timeout_s``, 2 s), which bounds a pipeline's whole
    ``sendall`` and its reply: a block that could not cross a slow link in 2 s was never written (a 12 MiB block
    at 4 MB/s), far above the documented drop threshold. A write now has ``timeout_s + queue_wait_s``; here a
    4 MiB block on a 5 MB/s link (about 0.8 s) crosses with a 0.2 s ``timeout_s``, and the small commands around
    it (``EXISTS``, ``GET``) keep the short one."""
    keys, values = blocks(1, size=4 << 20)
    link = SlowLink(redis_server.port, rate=5e6)
    try:
        with RemoteBlockStore(f"redis://127.0.0.1:{link.port}/0", "m", timeout_s=0.2, queue_wait_s=2.0,
                              backoff_s=0.05) as store:
            assert store.ping()
            fill(store, keys, values)
            stats = store.stats()
            assert stats["writes"] == 1 and stats["errors"] == 0, stats
            assert [bytes(p) for p in store.get_many(keys)] == values
    finally:
        link.close()


def test_full_server_without_eviction_refuses_writes(redis_factory, caplog) -> None:
    server = redis_factory(maxmemory="3mb", policy="noeviction")
    keys, values = blocks(80, size=64 << 10)  # 5 MiB
    with RemoteBlockStore(server.url, "m") as store:
        fill(store, keys, values)
        stats = store.stats()
        assert stats["rejected_full"] > 0 and stats["writes"] + stats["rejected_full"] == 80
        assert not stats["down"]  # full is not down: reads go on
        payloads = store.get_many(keys)
        assert sum(p is not None for p in payloads) == stats["writes"]
        assert_never_wrong(payloads, values)
    assert "allkeys-lru" in caplog.text  # the warning names the fix


def test_full_server_with_eviction_forgets_old_blocks(redis_factory) -> None:
    server = redis_factory(maxmemory="3mb", policy="allkeys-lru")
    keys, values = blocks(80, size=64 << 10)
    with RemoteBlockStore(server.url, "m") as store:
        fill(store, keys, values)
        stats = store.stats()
        assert stats["writes"] == 80 and stats["rejected_full"] == 0
        payloads = store.get_many(keys)
        assert 0 < sum(p is not None for p in payloads) < 80
        assert_never_wrong(payloads, values)
        assert store.prefix_length(keys) < 80


def test_a_key_evicted_between_lookup_and_read(redis_server) -> None:
    keys, values = blocks(10)
    with RemoteBlockStore(redis_server.url, "m", keys_per_request=4) as store:
        fill(store, keys, values)
        assert store.prefix_length(keys) == 10
        redis_server.client().delete(f"tierkv:m:{keys[5]}")
        payloads = store.get_many(keys)
        assert payloads[5] is None
        assert [bytes(p) for i, p in enumerate(payloads) if i != 5] == values[:5] + values[6:]


def test_a_key_evicted_before_a_bounded_read_and_written_again_is_not_deleted(redis_server, monkeypatch) -> None:
    """Regression: a bounded read (``GETRANGE``) that finds nothing asked the server in a second round-trip whether
    an empty value was planted there; a block another worker wrote in between was taken for one, counted corrupt
    and deleted. The check now rides in the read's own pipeline, next to each ``GETRANGE``."""
    from tierkv.remote.connection import RemoteConnection

    with stored(redis_server, 1, 0) as (store, keys, _, raw, name, written):
        raw.delete(name)  # evicted after the lookup
        run = RemoteConnection.run

        def then_another_worker_writes(self, op, fallback):
            result = run(self, op, fallback)
            raw.set(name, written)  # right after each command the store sends
            return result

        monkeypatch.setattr(RemoteConnection, "run", then_another_worker_writes)
        assert store.get_many(keys, max_bytes=1 << 20) == [None]
        monkeypatch.setattr(RemoteConnection, "run", run)
        assert store.flush(5) and store.stats()["corrupt"] == 0 and raw.get(name) == written


@pytest.mark.parametrize("damage", ["random bytes", "one payload bit", "truncated", "another key's value", "empty"])
def test_a_corrupted_value_is_a_miss_and_is_replaced(redis_server, caplog, damage: str) -> None:
    with stored(redis_server, 3, 1) as (store, keys, values, raw, name, good):
        bad = {"random bytes": os.urandom(len(good)),
               "one payload bit": good[:-1] + bytes([good[-1] ^ 0x10]),
               "truncated": good[: len(good) // 2],
               "another key's value": raw.get(f"tierkv:m:{keys[2]}"),
               "empty": b""}[damage]
        raw.set(name, bad)
        payloads = store.get_many(keys)
        assert payloads[1] is None and bytes(payloads[0]) == values[0] and bytes(payloads[2]) == values[2]
        assert store.stats()["corrupt"] == 1 and ("is empty" if damage == "empty" else "failed its checksum") \
            in caplog.text
        assert store.flush(5) and not raw.exists(name)  # deleted, so a write-through can replace it
        fill(store, keys[1:2], values[1:2])
        assert bytes(store.get_many(keys[1:2])[0]) == values[1]


@pytest.mark.parametrize("reply", [b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
                                   b"+OK\r\n" * 64,  # data nobody asked for (once an OK to HELLO, not a map)
                                   b"*1\r\n" * 5000 + b":1\r\n"])  # nested deeper than Python's recursion limit
def test_a_service_that_does_not_speak_redis_is_a_miss(caplog, reply: bytes) -> None:
    """Regression: another service on the URL's port (an HTTP server answering every connection with text) made
    ``load_prefix`` raise redis-py's raw ``InvalidResponse``, and replies redis-py's parser chokes on raised
    AttributeError or RecursionError; each is a server that is down: a miss, warned once with the hint to check
    the host and port, never an exception out of the store."""
    pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[redis]')")
    listener = socket.create_server(("127.0.0.1", 0))
    answered: list[socket.socket] = []

    def answer_in_http() -> None:
        with contextlib.suppress(OSError):  # the listener closed: the test is over
            while True:
                connection, _ = listener.accept()
                answered.append(connection)
                connection.sendall(reply)

    server = threading.Thread(target=answer_in_http, daemon=True)
    server.start()
    keys, values = blocks(4)
    try:
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        with RemoteBlockStore(url, "m", backoff_s=0.05) as store:
            assert store.prefix_length(keys) == 0 and store.get_many(keys) == [None] * 4
            fill(store, keys, values)  # writes fail in the background, counted
            stats = store.stats()
            assert stats["down"] and stats["errors"] >= 1 and stats["writes"] == 0
        assert answered and "does not speak the Redis protocol" in caplog.text
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (Linux), which close() alone does not
        listener.close()
        server.join(timeout=10)
        for connection in answered:
            connection.close()


def test_an_outage_met_by_many_caches_is_warned_once(tmp_path, redis_factory, caplog) -> None:
    """A pool of workers' caches that meet one outage log it once a minute for the process (each cache warned on
    its own: a flood), each counting what it met."""
    redis_factory()  # (skips without redis-server)
    server = RedisServer(tmp_path / "never")  # never started: connections are refused
    keys, _ = blocks(2)
    stores = [RemoteBlockStore(server.url, "m") for _ in range(4)]
    try:
        for store in stores:
            assert store.prefix_length(keys) == 0
            assert store.stats()["warnings_down"] >= 1
        assert caplog.text.count("unreachable") == 1
    finally:
        for store in stores:
            store.close()


def test_a_corrupt_value_is_replaced_where_del_is_refused(redis_factory, caplog) -> None:
    """An ACL user without DEL (or a read-only replica) cannot delete a corrupt value: the refusal is counted and
    warned, and the next write of the block overwrites the value instead of skipping a key the server holds."""
    server = redis_factory(password="root")
    raw = server.client()
    raw.acl_setuser("worker", enabled=True, passwords=["+pw"], keys=["tierkv:*"], commands=["+@all", "-del", "-unlink"])
    keys, values = blocks(3)
    name = f"tierkv:m:{keys[1]}"
    with RemoteBlockStore(f"redis://worker:pw@127.0.0.1:{server.port}/0", "m") as store:
        fill(store, keys, values)
        raw.setrange(name, 40, b"XXXX")
        assert store.get_many(keys)[1] is None and store.flush(10)
        stats = store.stats()
        assert stats["corrupt"] == 1 and stats["refused"] == 1 and raw.exists(name)
        assert "no permissions to run the 'del' command" in caplog.text and "docs/remote.md" in caplog.text
        fill(store, keys, values)  # the worker computed the block again
        assert store.stats()["writes"] == 4  # three, then the one found corrupt (not skipped as held)
        assert [bytes(p) for p in store.get_many(keys)] == values
        fill(store, keys, values)
        assert store.stats()["writes"] == 4  # rewritten once: then held again, skipped


def test_flush_and_close_keep_to_their_timeout_with_a_frozen_server(redis_server) -> None:
    """A frozen server (SIGSTOP: its connections stay open, nothing answers) costs a flush about ``timeout_s``, not
    the writes' longer timeout (``timeout_s + queue_wait_s``, which the writer's ``EXISTS`` had), and
    ``close(timeout)`` returns within ``timeout`` in all (it waited ``timeout`` to flush, then again to join)."""
    keys, values = blocks(3)
    with RemoteBlockStore(redis_server.url, "m", timeout_s=0.5, queue_wait_s=10.0) as store:
        fill(store, keys[:1], values[:1])
        with redis_server.frozen():
            store.put(keys[1], values[1])
            start = time.monotonic()
            store.flush()
            assert time.monotonic() - start < 0.5 + 2.0
    store = RemoteBlockStore(redis_server.url, "m", timeout_s=8.0, queue_wait_s=10.0)
    try:
        assert store.ping()
        with redis_server.frozen():
            store.put(keys[2], values[2])
            start = time.monotonic()
            store.close(timeout=3.0)
            assert time.monotonic() - start < 3.0 + 2.0
    finally:
        store.close()


def test_a_full_server_is_warned_once_for_all_caches(redis_factory, caplog) -> None:
    """Every cache of a process (one per conversation) meeting one full server logs it once a minute for the
    process, as an outage is, each counting what it met."""
    server = redis_factory(maxmemory="2mb", policy="noeviction")
    stores = [RemoteBlockStore(server.url, f"m{i}") for i in range(3)]
    try:
        for store in stores:
            fill(store, *blocks(48, size=64 << 10))
            assert store.stats()["rejected_full"] > 0 and store.stats()["warnings_full"] >= 1
        assert caplog.text.count("the server is full") == 1
    finally:
        for store in stores:
            store.close()


def test_a_cluster_node_behind_a_plain_url_names_redis_cluster(redis_cluster, caplog) -> None:
    keys, values = blocks(8, size=100)
    with RemoteBlockStore(f"redis://127.0.0.1:{redis_cluster.servers[0].port}/0", "m") as store:
        fill(store, keys, values)  # most keys hash to other nodes' slots: MOVED
        assert store.stats()["refused"] > 0
    assert "Redis Cluster node" in caplog.text and "redis+cluster://host:port" in caplog.text


def _default_node_port(store: RemoteBlockStore) -> int:
    """The port of the node a cluster client sends keyless commands (PING) to."""
    return store._wire.conn._get_client().get_default_node().port


def test_a_frozen_cluster_primary_costs_one_timeout_and_opens_the_breaker(redis_cluster) -> None:
    """A primary frozen (SIGSTOP) under a cluster: redis-py resent each of its keys' commands one at a time after
    the pipeline's timeout, a full timeout each (60 keys, a third on the frozen node: ~10 s at timeout_s=0.5), and
    counted them as refusals, so the breaker stayed closed and the next call paid again. Now a call costs about
    one timeout, is a miss, and the breaker opens; a flush finds a frozen primary that is not the one PING goes to."""
    keys, values = blocks(60, size=100)
    with RemoteBlockStore(redis_cluster.url, "m", timeout_s=0.5, backoff_s=30.0, keys_per_request=60) as store:
        fill(store, keys, values)
        assert store.prefix_length(keys) == 60
        default = _default_node_port(store)
        node = next(server for server in redis_cluster.servers if server.port != default)
        # redis-py 5.x-6.x resend through a method tierkv cannot bound: there the first such call still pays per key
        bounded = hasattr(store._wire.conn._get_client().pipeline(), "parent_execute_command")
        with node.frozen():
            start = time.monotonic()
            payloads = store.get_many(keys)
            assert time.monotonic() - start < 4.0 or not bounded  # (one timeout: 0.5 s; the resends took ~10 s)
            assert_never_wrong(payloads, values)
            assert store.stats()["down"]
    with RemoteBlockStore(redis_cluster.url, "m", timeout_s=0.5, queue_wait_s=10.0) as store:
        assert store.ping()
        node = next(server for server in redis_cluster.servers if server.port != _default_node_port(store))
        with node.frozen():
            assert not store.ping()  # every primary asked
            store.put(keys[0], values[0])
            start = time.monotonic()
            store.flush()
            assert time.monotonic() - start < 4.0


def _move_slot(cluster, slot: int) -> int:
    """Migrate ``slot`` (and its keys) to another primary behind the clients' backs; returns its old owner's port."""
    nodes = {server.port: server.client() for server in cluster.servers}
    ids = {port: client.execute_command("CLUSTER", "MYID").decode() for port, client in nodes.items()}
    source = next(port for port, client in nodes.items() if client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot))
    target = next(port for port in nodes if port != source)
    nodes[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
    nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
    keys = nodes[source].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    nodes[source].execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
    for client in nodes.values():
        client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
    return source


def test_a_moved_key_is_followed_when_slow_nodes_still_answer(redis_cluster) -> None:
    """Bounding the resends that follow a frozen node must not drop a MOVED: nodes busy in turn, each answering
    within the timeout, make the pipeline as a whole outlast it, and the moved key is still read."""
    keys, values = blocks(8, size=100)
    with RemoteBlockStore(redis_cluster.url, "m", timeout_s=0.5, backoff_s=30.0, keys_per_request=8) as store:
        fill(store, keys, values)
        client = store._wire.conn._get_client()
        source = _move_slot(redis_cluster, client.keyslot(store._wire.name(keys[0])))  # the client's map is stale
        busy = [server.client() for server in redis_cluster.servers if server.port != source]
        busy[0].execute_command("CLIENT", "PAUSE", 300, "ALL")
        busy[1].execute_command("CLIENT", "PAUSE", 600, "ALL")
        assert [bytes(p) if p is not None else None for p in store.get_many(keys)] == values
        assert not store.stats()["down"]


def test_a_redirection_is_named_as_one(redis_cluster, caplog) -> None:
    """redis-py's MOVED error reads "3406 127.0.0.1:7003": the warning says MOVED."""
    keys, values = blocks(8, size=100)
    with RemoteBlockStore(f"redis://127.0.0.1:{redis_cluster.servers[0].port}/0", "m") as store:
        fill(store, keys, values)
    assert "the server refused a command: MOVED " in caplog.text


def test_cluster_urls_that_cannot_work_say_why(redis_cluster, redis_factory, caplog) -> None:
    """A redis+cluster:// URL to a server that is no cluster, or with a wrong password; both are misses."""
    plain = redis_factory()
    with RemoteBlockStore(f"redis+cluster://127.0.0.1:{plain.port}", "m") as store:
        assert not store.ping()
    assert "+cluster|slots" in caplog.text and "use redis://" in caplog.text
    for server in redis_cluster.servers:
        server.client().config_set("requirepass", "right")
    with RemoteBlockStore(f"redis+cluster://:wrong@127.0.0.1:{redis_cluster.servers[0].port}", "m") as store:
        assert not store.ping()
    assert "$TIERKV_REDIS_PASSWORD" in caplog.text and "on every node, replicas too" in caplog.text


def test_server_settings_that_refuse_say_which(redis_factory, caplog, tmp_path) -> None:
    """A database the server does not have, a block over proto-max-bulk-len (the server cuts the connection, or
    replies), a rediss:// URL to a port without TLS: each warning names the setting to change."""
    server = redis_factory(extra=("--proto-max-bulk-len", "1mb"))
    with RemoteBlockStore(f"redis://127.0.0.1:{server.port}/16", "m") as store:
        assert not store.ping()
    assert "/16" in caplog.text and "'databases'" in caplog.text
    with RemoteBlockStore(server.url, "m") as store:
        fill(store, *blocks(1, size=2 << 20))
        assert store.stats()["writes_failed"] == 1
    assert "proto-max-bulk-len" in caplog.text
    with RemoteBlockStore(f"rediss://127.0.0.1:{server.port}/0?ssl_cert_reqs=none", "m", timeout_s=0.5,
                          connect_timeout_s=0.5) as store:
        assert not store.ping()
    assert "check that the port serves TLS" in caplog.text


def test_a_value_over_the_bulk_limit_names_the_setting_however_the_server_says_it(caplog) -> None:
    """The server refuses a value over proto-max-bulk-len by cutting the connection while it is sent, or, where the
    whole value fit in the socket buffers first (one run in five or so on loopback), by a reply: both name the
    setting (the reply named none, so the test above failed at random)."""
    redis = pytest.importorskip("redis")
    from tierkv.remote.connection import RemoteConnection
    from tierkv.remote.url import parse_remote_url

    connection = RemoteConnection(parse_remote_url("redis://127.0.0.1:7/3"))  # (never connected)
    connection.refused([redis.exceptions.ResponseError("Protocol error: invalid bulk length")])
    assert connection.counts["refused"] == 1
    assert "proto-max-bulk-len" in caplog.text


def test_a_read_only_replica_is_a_miss_that_names_the_primary(redis_factory, caplog) -> None:
    primary = redis_factory()
    replica = redis_factory(extra=("--replicaof", "127.0.0.1", str(primary.port)))
    with RemoteBlockStore(replica.url, "m") as store:
        fill(store, *blocks(2))
        assert store.stats()["writes_failed"] == 2 and store.stats()["refused"] == 2
    assert "read-only replica" in caplog.text and "point the URL at its primary" in caplog.text


def test_a_host_the_resolver_cannot_take_is_a_warned_miss(caplog) -> None:
    """A host name whose IDNA encoding fails inside the socket (an empty label), given past the URL's checks:
    a connection failure (a miss, warned), never a UnicodeError out of the store."""
    with RemoteBlockStore(RemoteURL(nodes=(("a..b", 6379),)), "m", timeout_s=1.0) as store:
        assert store.contains(["ab" * 16]) == [False] and store.get_many(["ab" * 16]) == [None]
        assert store.stats()["errors"] == 1 and store.stats()["down"]
    assert "unreachable" in caplog.text and "host" in caplog.text


def test_a_server_frozen_between_exists_and_set_costs_a_flush_about_timeout_s(redis_server, monkeypatch) -> None:
    """The writer's ``EXISTS`` answered, then the server froze: its ``SET`` pipeline waits out the long write
    timeout (``timeout_s + queue_wait_s``, 61 s here), but ``flush()`` pings the server meanwhile and returns
    False after about ``timeout_s`` (bounded here far below the write timeout, so a busy host passes too)."""
    keys, values = blocks(2)
    with RemoteBlockStore(redis_server.url, "m", timeout_s=1.0, queue_wait_s=60.0) as store:
        fill(store, keys[:1], values[:1])
        run = RemoteConnection.run

        def freeze_before_the_set(self, op, fallback, write=False):
            if write:
                redis_server.process.send_signal(signal.SIGSTOP)
            return run(self, op, fallback, write=write)

        monkeypatch.setattr(RemoteConnection, "run", freeze_before_the_set)
        try:
            store.put(keys[1], values[1])
            start = time.monotonic()
            assert not store.flush()
            elapsed = time.monotonic() - start
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        monkeypatch.setattr(RemoteConnection, "run", run)
        assert elapsed < 15.0, f"flush took {elapsed:.1f} s with a frozen server (the write timeout: 61 s)"
        assert store.stats()["errors"] >= 1


def test_get_many_without_max_bytes_reads_a_value_only_so_far(redis_server, caplog) -> None:
    """``get_many(keys)`` reads each value at most ``max_value_bytes`` far (default: the write queue's bound): a
    planted 64 MiB value costs about the bound, then is corrupt and deleted; a valid frame longer than the bound
    (a block of a store with a larger bound) is a miss left on the server, warned with the fix."""
    key, other = "ab" * 16, "cd" * 16
    raw = redis_server.client()
    raw.set(f"tierkv:m:{key}", b"\0" * (64 << 20))
    raw.set(f"tierkv:m:{other}", frame(other.encode(), os.urandom(2 << 20)))
    with RemoteBlockStore(redis_server.url, "m", max_value_bytes=1 << 20) as store:
        assert store.prefix_length([key]) == 1
        tracemalloc.start()
        try:
            assert store.get_many([key]) == [None]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, f"reading a 64 MiB value bounded at 1 MiB took {peak >> 20} MiB"
        assert store.stats()["corrupt"] == 1 and store.flush(5) and not raw.exists(f"tierkv:m:{key}")
        assert store.get_many([other]) == [None]
        assert store.stats()["too_large"] == 1 and store.stats()["corrupt"] == 1 and raw.exists(f"tierkv:m:{other}")
        assert "raise max_value_bytes" in caplog.text
    with RemoteBlockStore(redis_server.url, "m", queue_bytes=4 << 20) as store:
        assert store.max_value_bytes == 4 << 20 and len(store.get_many([other])[0]) == 2 << 20


def test_close_during_a_stall_is_not_warned_as_an_outage(redis_server, caplog) -> None:
    """``close()`` shuts the sockets under a write still in flight on a frozen server: that call's failure is the
    close's doing, not the server's, and is not warned as an outage ("Bad file descriptor ... retrying")."""
    keys, values = blocks(2)
    store = RemoteBlockStore(redis_server.url, "m", timeout_s=5.0)
    try:
        fill(store, keys[:1], values[:1])
        with redis_server.frozen():
            store.put(keys[1], values[1])
            time.sleep(0.3)  # the writer's EXISTS is in flight
            store.close(timeout=0.2)
            time.sleep(0.5)  # the writer's call fails on its closed socket meanwhile
    finally:
        store.close()
    assert "unreachable" not in caplog.text and store.stats()["errors"] == 0
