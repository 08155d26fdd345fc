"""``RemoteBlockStore`` against a real ``redis-server`` started by the test (tests/redis_server.py)."""

from __future__ import annotations

import gc
import os

import pytest

from tierkv.errors import InvalidConfigError
from tierkv.remote import RemoteBlockStore


def keys_and_blocks(n: int, size: int = 4096, tag: str = "a") -> tuple[list[str], list[bytes]]:
    keys = [f"{tag}{i:031x}" for i in range(n)]
    return keys, [os.urandom(size) for _ in range(n)]


def fill(store: RemoteBlockStore, keys: list[str], blocks: list[bytes]) -> None:
    for key, block in zip(keys, blocks):
        assert store.put(key, block)
    assert store.flush(10)


def test_round_trip_in_batches(redis_server) -> None:
    keys, blocks = keys_and_blocks(37)
    with RemoteBlockStore(redis_server.url, "model-a", keys_per_request=4, inflight=3) as store:
        fill(store, keys[:30], blocks[:30])
        assert store.contains(keys[28:32]) == [True, True, False, False]
        assert store.prefix_length(keys) == 30
        payloads = store.get_many(keys)
        assert [bytes(p) for p in payloads[:30]] == blocks[:30] and payloads[30:] == [None] * 7
        stats = store.stats()
    assert stats["writes"] == 30 and stats["read_hits"] == 30 and stats["reads"] == 37
    assert stats["bytes_written"] == 30 * (4096 + stats["header_bytes"]) == stats["bytes_read"]
    raw = redis_server.client()
    assert raw.dbsize() == 30
    assert raw.exists(f"tierkv:model-a:{keys[0]}")  # namespaced, readable keys


def test_namespaces_keep_models_apart(redis_server) -> None:
    keys, blocks = keys_and_blocks(3)
    with RemoteBlockStore(redis_server.url, "model-a") as a, RemoteBlockStore(redis_server.url, "model-b") as b:
        fill(a, keys, blocks)
        assert b.prefix_length(keys) == 0 and b.get_many(keys) == [None] * 3
        assert a.clear() == 3 and a.prefix_length(keys) == 0


def test_a_block_the_server_holds_is_not_sent_again(redis_server) -> None:
    keys, blocks = keys_and_blocks(4)
    with RemoteBlockStore(redis_server.url, "m") as first, RemoteBlockStore(redis_server.url, "m") as second:
        fill(first, keys, blocks)
        fill(second, keys, blocks)
        assert second.stats()["writes_existing"] == 4 and second.stats()["bytes_written"] == 0


def test_puts_never_wait_and_a_full_queue_drops(redis_server) -> None:
    """While the server is paused, put() returns with the write still pending; beyond the queue's bound it
    drops and counts, and once the server answers again the queued blocks arrive."""
    keys, blocks = keys_and_blocks(10)
    with RemoteBlockStore(redis_server.url, "m", queue_items=2, timeout_s=5.0) as store:
        redis_server.pause(1.0)
        queued = [store.put(key, block) for key, block in zip(keys, blocks)]
        assert store.stats()["pending"] >= 1  # put() returned before its write was done
        assert not all(queued)
        assert store.stats()["writes_dropped"] == queued.count(False)
        assert store.flush(10)
        assert store.contains(keys) == queued  # exactly what was queued arrived
        assert store.stats()["warnings_dropped"] == queued.count(False)


def test_the_queue_is_bounded_in_bytes(redis_server) -> None:
    keys, blocks = keys_and_blocks(6, size=1 << 16)
    with RemoteBlockStore(redis_server.url, "m", queue_bytes=3 << 16, timeout_s=5.0) as store:
        redis_server.pause(0.5)
        queued = [store.put(key, block) for key, block in zip(keys, blocks)]
        assert queued.count(True) <= 3 + 3  # three queued, at most one batch of three taken by the writer
        assert not all(queued)
        store.flush(10)


def test_tls_and_password(redis_factory, tmp_path) -> None:
    from redis_server import make_tls_files

    server = redis_factory(tls=make_tls_files(tmp_path / "tls"), password="s3cret")
    keys, blocks = keys_and_blocks(3)
    with RemoteBlockStore(server.url, "m") as store:
        fill(store, keys, blocks)
        assert [bytes(p) for p in store.get_many(keys)] == blocks
    plain = server.url.replace("rediss://", "redis://").split("?")[0]
    with RemoteBlockStore(plain, "m", timeout_s=0.5) as store:  # TLS server, plain client: a miss, never data
        assert store.get_many(keys) == [None] * 3 and store.stats()["errors"] == 1


def test_password_from_the_environment(redis_factory, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    server = redis_factory(password="s3cret")
    url = f"redis://127.0.0.1:{server.port}/0"
    keys, blocks = keys_and_blocks(2)
    with RemoteBlockStore(url, "m") as store:  # no password: refused, warned with the fix
        assert store.get_many(keys) == [None, None]
        assert store.stats()["down"]
    assert "TIERKV_REDIS_PASSWORD" in caplog.text
    monkeypatch.setenv("TIERKV_REDIS_PASSWORD", "s3cret")
    with RemoteBlockStore(url, "m") as store:
        fill(store, keys, blocks)
        assert [bytes(p) for p in store.get_many(keys)] == blocks
    assert "s3cret" not in caplog.text


def test_cluster(redis_cluster) -> None:
    """Blocks spread over the primaries (keys hash to different slots); batched reads span nodes."""
    keys, blocks = keys_and_blocks(24)
    with RemoteBlockStore(redis_cluster.url, "m", keys_per_request=5) as store:
        fill(store, keys, blocks)
        assert store.prefix_length(keys) == 24
        assert [bytes(p) for p in store.get_many(keys)] == blocks
        assert sum(1 for server in redis_cluster.servers if server.client().dbsize()) >= 2
        assert store.clear() == 24


def test_dropped_without_close_stops_its_threads(redis_server) -> None:
    store = RemoteBlockStore(redis_server.url, "m", keys_per_request=2)
    keys, blocks = keys_and_blocks(6)  # three read pipelines: on the reader threads
    fill(store, keys, blocks)
    store.get_many(keys)
    threads = [store._writer._thread, *store._readers._threads]
    assert len(threads) > 1
    del store
    gc.collect()
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()


def test_bad_arguments() -> None:
    with pytest.raises(InvalidConfigError, match="namespace"):
        RemoteBlockStore("redis://127.0.0.1:1/0", "has space")
    with pytest.raises(InvalidConfigError, match="inflight must be a positive int"):
        RemoteBlockStore("redis://127.0.0.1:1/0", "m", inflight=0)
    with pytest.raises(InvalidConfigError, match="timeout_s"):
        RemoteBlockStore("redis://127.0.0.1:1/0", "m", timeout_s=0)
    with pytest.raises(InvalidConfigError, match="ttl_s"):
        RemoteBlockStore("redis://127.0.0.1:1/0", "m", ttl_s=1.5)


def test_tls_checks_the_host_name(redis_factory, tmp_path, caplog) -> None:
    """A certificate the trusted CA signed for another host is refused (redis-py 5 checks no host name unless
    asked), and every TLS client asks."""
    from redis_server import make_tls_files

    server = redis_factory(tls=make_tls_files(tmp_path / "tls", names="DNS:elsewhere.invalid"))
    with RemoteBlockStore(server.url, "m", timeout_s=2) as store:
        assert not store.ping() and store.stats()["down"]
        pool = store._wire.conn._get_client().connection_pool
        assert pool.connection_kwargs["ssl_check_hostname"] is True
    assert "mismatch" in caplog.text and "not for the host name" in caplog.text
    with RemoteBlockStore(server.url + "&ssl_cert_reqs=none", "m") as store:  # nothing verified: nothing to check
        assert store.ping()
        assert store._wire.conn._get_client().connection_pool.connection_kwargs["ssl_check_hostname"] is False


def test_a_server_without_hello_is_used_without_a_warning(redis_factory, caplog) -> None:
    """RESP2 (no HELLO): Redis < 6, proxies and servers that renamed HELLO are used quietly, with an ACL user."""
    server = redis_factory(password="root", extra=("--rename-command", "HELLO", ""))
    server.client().acl_setuser("worker", enabled=True, passwords=["+pw"], keys=["tierkv:*"], commands=["+@all"])
    keys, blocks = keys_and_blocks(3)
    with RemoteBlockStore(f"redis://worker:pw@127.0.0.1:{server.port}/0", "m") as store:
        fill(store, keys, blocks)
        assert [bytes(p) for p in store.get_many(keys)] == blocks
        assert store._wire.conn._get_client().connection_pool.connection_kwargs["protocol"] == 2
    assert not caplog.records, caplog.text


MINIMAL_ACL = ["+exists", "+get", "+getrange", "+set", "+del", "+ping"]  # docs/remote.md, Security


@pytest.mark.parametrize("cluster", [False, True])
def test_the_documented_least_privilege_acl_is_enough(redis_server, redis_cluster, cluster: bool) -> None:
    """The ACL docs/remote.md gives a worker: the data commands, and for a cluster +cluster|slots and +command."""
    servers = redis_cluster.servers if cluster else [redis_server]
    for server in servers:
        server.client().acl_setuser("worker", enabled=True, passwords=["+pw"], keys=["tierkv:*"],
                                    commands=MINIMAL_ACL + (["+cluster|slots", "+command"] if cluster else []))
    hosts = ",".join(f"127.0.0.1:{server.port}" for server in servers)
    url = f"redis+cluster://worker:pw@{hosts}" if cluster else f"redis://worker:pw@{hosts}/0"
    keys, blocks = keys_and_blocks(6)
    with RemoteBlockStore(url, "m") as store:
        fill(store, keys, blocks)
        assert [bytes(p) for p in store.get_many(keys, max_bytes=8192)] == blocks
        store.discard(keys[0], "is a test")
        assert store.flush(10)
        stats = store.stats()
        assert stats["writes"] == 6 and stats["refused"] == stats["errors"] == 0, stats
