"""``TieredCache(remote=...)`` end to end against a real ``redis-server``: a prefix computed by one cache is
loaded by another, and under every fault the generated tokens equal a cold run's (wrong KV is never used)."""

from __future__ import annotations

import struct

import pytest
import torch
from helpers import prefix_worker
from models import prompt, tiny_model
from test_memory_bound import LOAD_PREFIX_CHILD, check_load_prefix_rss
from transformers import DynamicCache

from tierkv import settings
from tierkv.errors import InvalidConfigError, NewerFormatError
from tierkv.hf import TieredCache
from tierkv.persist import record
from tierkv.persist.keys import Namespace, block_keys
from tierkv.remote.framing import frame, unframe

BT = 16
NEW = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3)


_references: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}


def reference(model, ids) -> torch.Tensor:
    """The cold run's tokens (DynamicCache), once per model and prompt."""
    key = (id(model), tuple(ids[0].tolist()))
    if key not in _references:
        _references[key] = model.generate(ids, cache=DynamicCache(), max_new_tokens=NEW, do_sample=False)
    return _references[key]


def run(model, ids, **options) -> tuple[torch.Tensor, int, dict]:
    return prefix_worker(model, ids, BT, NEW, **options)


def keys_on(server) -> list[bytes]:
    return sorted(server.client().keys("tierkv:*"))


def test_a_second_worker_loads_the_prefix_from_redis(model, redis_server) -> None:
    ids, _ = prompt(1, 100)  # 6 full blocks; the last is computed (at least one token must be)
    expected = reference(model, ids)
    first, loaded, stats = run(model, ids, remote=redis_server.url)
    assert loaded == 0 and torch.equal(first, expected)
    assert stats["remote"]["writes"] == len(keys_on(redis_server)) >= 6
    second, loaded, stats = run(model, ids, remote=redis_server.url)
    assert loaded == 96 and torch.equal(second, expected)
    assert stats["remote"]["remote_blocks"] == 6 and stats["remote"]["read_hits"] == 6
    other, _ = prompt(1, 100, seed=1)  # another prompt shares no block
    assert run(model, other, remote=redis_server.url)[1] == 0


def test_a_shared_prefix_with_another_tail(model, redis_server) -> None:
    ids, _ = prompt(1, 70)
    run(model, ids, remote=redis_server.url)
    longer = torch.cat([ids[:, :64], prompt(1, 30, seed=5)[0]], dim=1)  # 4 shared blocks, then new tokens
    out, loaded, _ = run(model, longer, remote=redis_server.url)
    assert loaded == 64 and torch.equal(out, reference(model, longer))


def test_remote_counters_stay_readable_after_close(model, redis_server, tmp_path) -> None:
    ids, _ = prompt(1, 100)
    cache = TieredCache(block_tokens=BT, remote=redis_server.url, disk_dir=tmp_path, persist=True)
    cache.load_prefix(model, ids)
    model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False)
    cache.close()  # sends the queued writes
    remote = cache.stats()["remote"]
    assert remote["writes"] == len(keys_on(redis_server)) >= 6 and remote["pending"] == 0
    assert remote["local"]["blocks"] >= 6


def test_local_disk_first_then_remote(model, redis_server, tmp_path) -> None:
    """A worker with its own persistent disk loads what it has locally, the rest from the server, and keeps
    the remote blocks on its disk for next time."""
    ids, _ = prompt(1, 100)
    run(model, ids, remote=redis_server.url)  # another machine filled the server
    disk = dict(disk_dir=tmp_path / "node", persist=True)
    out, loaded, stats = run(model, ids, remote=redis_server.url, **disk)
    assert loaded == 96 and stats["remote"]["remote_blocks"] == 6 and torch.equal(out, reference(model, ids))
    out, loaded, stats = run(model, ids, remote=redis_server.url, **disk)
    assert loaded == 96 and stats["remote"]["local_blocks"] == 6 and stats["remote"]["remote_blocks"] == 0
    assert torch.equal(out, reference(model, ids))


def test_different_models_never_share_blocks(redis_server) -> None:
    ids, _ = prompt(1, 60)
    run(tiny_model("llama", layers=3), ids, remote=redis_server.url)
    assert run(tiny_model("qwen2", layers=3), ids, remote=redis_server.url)[1] == 0
    assert run(tiny_model("llama", layers=2), ids, remote=redis_server.url)[1] == 0


def test_remote_argument_is_checked() -> None:
    with pytest.raises(InvalidConfigError, match="is not one of"):
        TieredCache(remote="http://h:6379")
    with pytest.raises(InvalidConfigError, match="remote must be a Redis URL"):
        TieredCache(remote=6379)


# ------------------------------------------------------------------------------------------- faults
def test_server_down_at_start(model, redis_factory, tmp_path) -> None:
    redis_factory()  # skips without redis-server
    from redis_server import RedisServer

    dead = RedisServer(tmp_path / "never-started")
    ids, _ = prompt(1, 100)
    out, loaded, stats = run(model, ids, remote=dead.url)
    assert loaded == 0 and torch.equal(out, reference(model, ids))
    assert stats["remote"]["errors"] >= 1 and stats["remote"]["writes"] == 0  # "down" lasts only its backoff


def test_server_killed_between_workers_and_mid_run(model, redis_server) -> None:
    ids, _ = prompt(1, 100)
    expected = reference(model, ids)
    run(model, ids, remote=redis_server.url)
    redis_server.kill()
    out, loaded, _ = run(model, ids, remote=redis_server.url)
    assert loaded == 0 and torch.equal(out, expected)
    redis_server.start()  # back, empty
    with TieredCache(block_tokens=BT, remote=redis_server.url) as cache:
        cache.load_prefix(model, ids)
        redis_server.kill()  # while this worker prefills and decodes: its write-through fails quietly
        out = model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, expected)


def test_slow_server_is_a_miss(model, redis_server) -> None:
    ids, _ = prompt(1, 100)
    expected = reference(model, ids)
    run(model, ids, remote=redis_server.url)
    with settings.override(remote_timeout=0.2):
        redis_server.pause(1.0)
        out, loaded, stats = run(model, ids, remote=redis_server.url)
    assert loaded == 0 and torch.equal(out, expected) and stats["remote"]["errors"] >= 1


@pytest.mark.parametrize("policy", ["noeviction", "allkeys-lru"])
def test_full_server(model, redis_factory, policy: str) -> None:
    """64 KiB above an empty server's footprint cannot hold a prompt's 12 blocks (3 layers x 2 x 2 heads x 16
    tokens x 16 dims, fp32: 12 KiB each): a worker loads what is there, if anything."""
    server = redis_factory(policy=policy)
    raw = server.client()
    raw.config_set("maxmemory", raw.info("memory")["used_memory"] + (64 << 10))
    ids, _ = prompt(1, 200)
    expected = reference(model, ids)
    _, _, stats = run(model, ids, remote=server.url)
    out, loaded, _ = run(model, ids, remote=server.url)
    assert torch.equal(out, expected) and loaded < 192
    if policy == "noeviction":
        assert stats["remote"]["rejected_full"] > 0  # refused (counted, warned), and the output is still right


def test_a_block_evicted_between_lookup_and_read(model, redis_server, monkeypatch) -> None:
    from tierkv.remote.chain import ChainedBlockStore

    ids, _ = prompt(1, 100)
    run(model, ids, remote=redis_server.url)
    lookup = ChainedBlockStore.lookup

    def lookup_then_evict(self, keys):
        found = lookup(self, keys)
        redis_server.client().delete(f"tierkv:{self._root}:{keys[3]}")  # the server evicts block 3 now
        return found

    monkeypatch.setattr(ChainedBlockStore, "lookup", lookup_then_evict)
    out, loaded, _ = run(model, ids, remote=redis_server.url)
    assert loaded == 3 * BT and torch.equal(out, reference(model, ids))


@pytest.mark.parametrize("damage", ["wrong bytes", "a valid frame around another block's record"])
def test_a_corrupted_value(model, redis_server, damage: str, caplog) -> None:
    ids, _ = prompt(1, 100)
    run(model, ids, remote=redis_server.url)
    raw = redis_server.client()
    names = {name.decode().rsplit(":", 1)[1]: name for name in keys_on(redis_server)}
    keys = block_keys(Namespace.of_model(model, BT).root, ids[0], BT)  # the chain: pick blocks 2 and 4
    target, other = names[keys[2]], names[keys[4]]
    if damage == "wrong bytes":
        value = raw.get(target)
        raw.set(target, value[:100] + bytes(b ^ 0xFF for b in value[100:200]) + value[200:])
    else:  # passes the frame's checksum; the record inside names another key: refused when decoded
        inner = raw.get(other)[20:]
        raw.set(target, frame(keys[2].encode(), inner))
    out, loaded, _ = run(model, ids, remote=redis_server.url)
    assert loaded == 2 * BT and torch.equal(out, reference(model, ids))
    assert "checksum" in caplog.text or "not used" in caplog.text


def test_a_newer_tierkvs_record_is_a_miss_left_on_the_server(model, redis_server, caplog) -> None:
    """A block record of a newer tierkv (a later record version, valid checksums) is a miss here: warned, not
    counted corrupt, neither deleted nor overwritten by this version's record (the newer workers read it)."""
    ids, _ = prompt(1, 100)
    run(model, ids, remote=redis_server.url)
    raw = redis_server.client()
    keys = block_keys(Namespace.of_model(model, BT).root, ids[0], BT)
    name = f"tierkv:{Namespace.of_model(model, BT).root}:{keys[1]}"
    inner = bytearray(unframe(keys[1].encode(), raw.get(name)))
    struct.pack_into("<H", inner, 4, struct.unpack_from("<H", inner, 4)[0] + 1)  # the record's version
    with pytest.raises(NewerFormatError):
        record.decode(inner)
    newer = frame(keys[1].encode(), bytes(inner))
    raw.set(name, newer)
    out, loaded, stats = run(model, ids, remote=redis_server.url)
    assert loaded == BT and torch.equal(out, reference(model, ids))
    assert stats["remote"]["corrupt"] == 0 and stats["remote"]["newer"] == 1
    assert raw.get(name) == newer  # not deleted, not overwritten
    assert "newer tierkv" in caplog.text and "wrong bytes" not in caplog.text


def test_load_prefix_from_redis_holds_the_prefix_about_once(redis_server, tmp_path) -> None:
    """``test_memory_bound.py::test_load_prefix_holds_the_prefix_about_once`` with the prefix (192 MiB) served by
    Redis: each value read is dropped once copied, so the prefix is held once, as read from the local store (it
    was held twice: the values read, all kept until every record was copied)."""
    child = LOAD_PREFIX_CHILD.replace("CONTEXT, BLOCK = 8, 4, 64, 6144, 256", "CONTEXT, BLOCK = 8, 4, 64, 12288, 256")
    child = child.replace("store = PersistentStore(folder, 1 << 30)",
                          "import redis\nfrom tierkv.remote.framing import frame\n"
                          "raw = redis.Redis(port=int(sys.argv[2]))")
    child = child.replace("    store.put([Item(key, depth, *record.encode_block(key, namespace.root, depth, kv))])",
                          "    head, payload = record.encode_block(key, namespace.root, depth, kv)\n"
                          "    raw.set(f'tierkv:{namespace.root}:{key}', frame(key.encode(), head + bytes(payload)))")
    child = child.replace("store.close()", "").replace(
        "disk_dir=folder, block_tokens=BLOCK, persist=True, config=config)",
        "disk_dir=folder, block_tokens=BLOCK, remote=f'redis://127.0.0.1:{sys.argv[2]}/0', config=config)")
    assert "raw.set" in child and "remote=" in child and "12288" in child
    check_load_prefix_rss(child, 12288, str(tmp_path), str(redis_server.port))
