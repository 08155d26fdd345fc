"""Attacks on the shared Redis tier and on the environment knobs (issue: safe on a shared machine).

- A Redis password never reaches an error, a traceback, a log record, a repr or a stat, for any URL,
  well-formed or not (redis-py's ``?password=`` form, a password holding ``/``, ``user:pw/x@host``, no
  ``://``, TLS, cluster lists, percent-encoded characters).
- The write-behind waits for room on its background thread instead of dropping while the server keeps up;
  it drops only while the server is down or stalls, and says how many.
- Values from the shared server are untrusted: one with a valid frame around another block's record, a
  record of another shape or depth (``2**70``: it once wiped the worker's local store), or a key of another
  Redis type is a corrupt miss that is deleted and that the next write-through replaces; nothing refused is
  kept in the local store; claimed lengths are checked, never allocated.
- Every numeric ``TIERKV_*`` knob has an upper bound; the native pool never runs with 0 threads.

Every Redis test runs against a real ``redis-server`` (``tests/redis_server.py``).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import subprocess
import sys
import time
import traceback
import tracemalloc
from pathlib import Path

import pytest
import torch
from helpers import prefix_worker
from models import prompt, tiny_model
from redis_server import RedisServer, _free_port
from transformers import DynamicCache

from tierkv import settings
from tierkv.errors import InvalidConfigError
from tierkv.hf import TieredCache
from tierkv.persist import record
from tierkv.persist.blockfile import Item, PersistentStore, Recovery
from tierkv.persist.keys import Namespace, block_keys
from tierkv.remote import RemoteBlockStore, RemoteURL, parse_remote_url
from tierkv.remote.chain import ChainedBlockStore
from tierkv.remote.framing import HEADER, MAGIC, frame, unframe

pytestmark = pytest.mark.usefixtures("no_tierkv_env")  # the environment's TIERKV_* knobs: none

BT = 16
NEW = 4
SECRET = "Kq7Zp/Wx9@Lm:3Rt"  # holds '/', '@' and ':', the characters that broke the old parser
ENCODED = "Kq7Zp%2FWx9%40Lm%3A3Rt"
PLAIN = "Kq7ZpWx9Lm3Rt"  # a password without special characters, for the forms that cannot hold them


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3)


def leaks(text: str) -> list[str]:
    """The pieces of any test password (3+ characters between its special characters) found in ``text``."""
    pieces = set(re.split(r"[/@:%]|2F|40|3A", SECRET)) | {PLAIN, ENCODED, "Kq7Zp", "Wx9", "Lm", "3Rt"}
    return sorted(piece for piece in pieces if len(piece) >= 3 and piece in text)


def closed_port() -> int:
    return _free_port()  # nothing listens there: connections are refused at once


# ----------------------------------------------------------------------------------------- secrets
def url_forms() -> list[tuple[str, str]]:
    """(name, URL) of every form, each with the secret in it, pointing at a port where nothing listens."""
    port, other = closed_port(), closed_port()
    host = f"127.0.0.1:{port}"
    return [
        ("query password (redis-py's form)", f"redis://{host}/0?password={ENCODED}"),
        ("query password, raw", f"redis://{host}/0?password={PLAIN}"),
        ("password holding '/', '@', ':'", f"redis://:{SECRET}@{host}/0"),
        ("user:pw/x@host", f"redis://user:{PLAIN}/x@{host}/0"),
        ("no ://", f"user:{SECRET}@{host}"),
        ("no ://, password only", f":{PLAIN}@{host}/0"),
        ("single slash", f"redis:/:{SECRET}@{host}/0"),
        ("rediss", f"rediss://:{SECRET}@{host}/0?ssl_cert_reqs=none"),
        ("cluster list", f"redis+cluster://:{PLAIN}@{host},127.0.0.1:{other}"),
        ("rediss cluster list", f"rediss+cluster://alice:{SECRET}@{host},127.0.0.1:{other}"),
        ("percent-encoded", f"redis://:{ENCODED}@{host}/0"),
        ("bad port", f"redis://:{SECRET}@127.0.0.1:99999/0"),
        ("a password the old parser took for a port", f"redis://127.0.0.1:{PLAIN}/x@{host}/0"),
        ("several hosts, no cluster", f"redis://:{SECRET}@h1:1,h2:2/0"),
        ("'?' in the password", f"redis://:Kq7Zp?Wx9@{host}/0"),
        ("query value holding '@'", f"redis://{host}/0?password=Kq7Zp@Wx9"),
        ("bare query item", f"redis://{host}/0?{PLAIN}"),
        ("unknown option beside the password", f"redis://{host}/0?password={PLAIN}&timeout=3"),
        ("bad database", f"redis://:{SECRET}@{host}/x{PLAIN}"),
        ("other scheme", f"http://:{SECRET}@{host}"),
        ("fragment", f"redis://{host}/0#{PLAIN}"),
        ("empty host", f"redis://:{PLAIN}@/0"),
        ("no host, only a password", f"redis://:{PLAIN}"),
        ("password where the database goes", f"redis://127.0.0.1:{port}/{PLAIN}"),
    ]


@pytest.mark.parametrize(("name", "url"), url_forms(), ids=[name for name, _ in url_forms()])
def test_a_password_never_leaks(model, caplog, name: str, url: str) -> None:
    """Through ``TieredCache(remote=...)``: the construction error and its whole traceback, or else the repr,
    the stats and every log record of a lookup and a prefill against a server that refuses connections."""
    caplog.set_level(logging.DEBUG)
    ids, _ = prompt(1, 40)
    try:
        cache = TieredCache(block_tokens=BT, remote=url)
    except InvalidConfigError as error:
        text = "".join(traceback.format_exception(error)) + str(error.__context__)
        assert not leaks(text), text
        assert "remote" in str(error)  # still says what is wrong
    else:
        with cache:
            assert cache.load_prefix(model, ids) == 0
            model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
            cache.flush()
            remote = cache.session.remote
            shown = repr(cache) + repr(remote) + str(cache.stats()) + repr(remote.url)
            shown += "".join(repr(store) for store in remote._remotes.values())
            assert not leaks(shown), shown
            assert cache.stats()["remote"]["errors"] >= 1
        assert "unreachable" in caplog.text
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert not leaks(logged), logged


@pytest.mark.parametrize("url", [f"redis://:{SECRET}@h:1/0".encode(), ["redis://", f":{SECRET}@h"]])
def test_a_url_of_another_type_is_refused_without_its_value(url: object) -> None:
    with pytest.raises(InvalidConfigError, match="must be a Redis URL") as info:
        TieredCache(block_tokens=BT, remote=url)
    assert not leaks("".join(traceback.format_exception(info.value)))


def test_well_formed_urls_still_parse(redis_factory) -> None:
    """The masking changes nothing a well-formed URL means: each form reaches a password-protected server."""
    server = redis_factory(password=SECRET)
    port = server.port
    for url in (f"redis://:{ENCODED}@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0?password={ENCODED}",
                f"redis://default:{ENCODED}@127.0.0.1:{port}/0"):
        with RemoteBlockStore(url, "m") as store:
            assert store.ping(), url
            assert not leaks(repr(store)) and "***" in repr(store)


def test_a_wrong_password_is_warned_without_it(redis_factory, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    server = redis_factory(password="the-right-one")
    with RemoteBlockStore(f"redis://:{ENCODED}@127.0.0.1:{server.port}/0", "m") as store:
        assert not store.ping()
        assert store.stats()["errors"] == 1
    assert "TIERKV_REDIS_PASSWORD" in caplog.text and not leaks(caplog.text)


def test_exception_text_is_scrubbed(caplog) -> None:
    """Whatever a client library puts in an exception, the warning masks the password."""
    store = RemoteBlockStore(f"redis://:{ENCODED}@127.0.0.1:{closed_port()}/0", "m")
    try:
        store._wire.conn.warn("refused", f"the server said: bad auth {SECRET}")
    finally:
        store.close()
    assert "bad auth ***" in caplog.text and not leaks(caplog.text)


# -------------------------------------------------------------------------------- write-behind
def reference(model, ids) -> torch.Tensor:
    return model.generate(ids, cache=DynamicCache(), max_new_tokens=NEW, do_sample=False)


def run(model, ids, **options) -> tuple[torch.Tensor, int, dict]:
    return prefix_worker(model, ids, BT, NEW, **options)


def loaded_host(server: RedisServer) -> None:
    """A busy server: it holds every write for 0.6 s (well inside the 2 s command timeout: slow, not down)."""
    server.client().execute_command("CLIENT", "PAUSE", 600, "WRITE")


def test_a_busy_server_gets_every_block(model, redis_server) -> None:
    """A queue that holds about one block and a server that stalls its writes: the persistence thread waits
    for room instead of dropping, so the next worker loads the whole prefix. Without waiting
    (``remote_queue_wait=0``, the old behaviour) the same load drops blocks."""
    ids, _ = prompt(1, 200)  # 12 full blocks of 12 KiB each
    expected = reference(model, ids)
    with settings.override(remote_queue="16KiB", remote_queue_wait=0):
        loaded_host(redis_server)
        _, _, stats = run(model, ids, remote=redis_server.url)
    assert stats["remote"]["writes_dropped"] > 0  # the load is real: a queue that does not wait drops
    redis_server.client().flushall()
    time.sleep(0.7)  # the pause is over
    with settings.override(remote_queue="16KiB"):
        loaded_host(redis_server)
        out, _, stats = run(model, ids, remote=redis_server.url)
    assert torch.equal(out, expected)
    assert stats["remote"]["writes_dropped"] == 0 and stats["remote"]["writes"] == 12
    assert len(redis_server.client().keys("tierkv:*")) == 12
    out, loaded, _ = run(model, ids, remote=redis_server.url)
    assert loaded == 192 and torch.equal(out, expected)


def test_a_stopped_server_drops_with_a_count_and_never_hangs(model, redis_factory, tmp_path, caplog) -> None:
    redis_factory()  # skips without redis-server
    dead = RedisServer(tmp_path / "never-started")
    ids, _ = prompt(1, 200)
    start = time.monotonic()
    with settings.override(remote_queue="16KiB"):
        out, loaded, stats = run(model, ids, remote=dead.url)
    assert time.monotonic() - start < 30
    assert loaded == 0 and torch.equal(out, reference(model, ids))
    remote = stats["remote"]
    assert remote["writes_dropped"] > 0 and remote["writes"] == 0
    assert remote["writes_dropped"] + remote["writes_failed"] == 12
    assert "the server is down" in caplog.text and re.search(r"\(\d+ dropped so far\)", caplog.text)


def test_a_stalled_server_drops_after_the_documented_wait(model, redis_server, caplog) -> None:
    """A server that takes no write for longer than ``remote_queue_wait`` (but answers within the command
    timeout, so it is not down): the waiting thread gives up after that long, drops and warns."""
    ids, _ = prompt(1, 200)
    with settings.override(remote_queue="16KiB", remote_queue_wait=0.3, remote_timeout=5.0):
        redis_server.client().execute_command("CLIENT", "PAUSE", 2000, "WRITE")
        start = time.monotonic()
        out, _, stats = run(model, ids, remote=redis_server.url)
    assert time.monotonic() - start < 20
    assert torch.equal(out, reference(model, ids))
    assert stats["remote"]["writes_dropped"] > 0 and "no write sent for queue_wait_s" in caplog.text


# --------------------------------------------------------------------------------- wrong records
def test_another_blocks_record_is_corrupt_and_replaced(model, redis_server, caplog) -> None:
    ids, _ = prompt(1, 100)  # 6 full blocks
    expected = reference(model, ids)
    run(model, ids, remote=redis_server.url)
    raw = redis_server.client()
    root = Namespace.of_model(model, BT).root
    keys = block_keys(root, ids[0], BT)
    target = f"tierkv:{root}:{keys[2]}"
    inner = bytes(unframe(keys[4].encode(), raw.get(f"tierkv:{root}:{keys[4]}")))
    raw.set(target, frame(keys[2].encode(), inner))  # intact frame, block 4's record under block 2's key
    out, loaded, stats = run(model, ids, remote=redis_server.url)
    assert loaded == 2 * BT and torch.equal(out, expected)
    assert stats["remote"]["corrupt"] == 1 and "holds the record of another block" in caplog.text
    header, _ = record.decode(unframe(keys[2].encode(), raw.get(target)))
    assert header["key"] == keys[2]  # the write-through replaced it
    out, loaded, _ = run(model, ids, remote=redis_server.url)
    assert loaded == 96 and torch.equal(out, expected)  # the next worker loads past it


def crafted(server: RedisServer, key: str, **header: object) -> None:
    """Replace ``key``'s value on ``server`` by its own record with ``header``'s fields changed (intact frame
    and checksums: what a writer of the server can plant)."""
    raw = server.client()
    name = next(name for name in raw.keys("tierkv:*") if name.decode().endswith(key))
    old, payload = record.decode(unframe(key.encode(), raw.get(name)))
    head, body = record.encode({**old, **header}, bytes(payload))
    raw.set(name, frame(key.encode(), head + bytes(body)))


@pytest.mark.parametrize("depth", [2**70, 2**63, -1, 3])
def test_a_crafted_depth_is_corrupt_and_never_reaches_the_local_store(model, redis_server, tmp_path, caplog,
                                                                       depth: int) -> None:
    """Block 0's value with its depth changed: a miss, deleted and replaced. It is not copied into the local
    persistent store, whose own blocks (another prompt's) all stay usable."""
    ids, _ = prompt(1, 100)
    other, _ = prompt(1, 100, seed=7)
    disk = dict(disk_dir=tmp_path, persist=True)
    run(model, other, **disk)  # this worker's own blocks
    run(model, ids, remote=redis_server.url)  # another worker filled the server
    keys = block_keys(Namespace.of_model(model, BT).root, ids[0], BT)
    crafted(redis_server, keys[0], depth=depth)
    out, loaded, stats = run(model, ids, remote=redis_server.url, **disk)
    assert loaded == 0 and torch.equal(out, reference(model, ids))
    assert stats["remote"]["corrupt"] == 1 and "'depth'" in caplog.text
    store = PersistentStore(tmp_path, 1 << 30)
    assert store.recovery == Recovery() and store.lookup(keys) == 6  # the worker's own computation, listed
    store.close()
    out, loaded, _ = run(model, other, **disk)
    assert loaded == 96 and torch.equal(out, reference(model, other))
    raw = redis_server.client()
    name = f"tierkv:{Namespace.of_model(model, BT).root}:{keys[0]}"
    assert record.decode(unframe(keys[0].encode(), raw.get(name)))[0]["depth"] == 0  # replaced


def test_only_records_that_fit_are_saved_locally(redis_server, tmp_path) -> None:
    """The local saver checks every header field again: a record of a depth, namespace, shape or dtype the
    local manifest could not list, or that is not this namespace's block, is not saved; the good one is, and the
    store reopens with nothing lost."""
    local = PersistentStore(tmp_path, 1 << 20)
    chain = ChainedBlockStore(local, redis_server.url)

    def block(key: str, **changes: object) -> bytearray:
        header = {"kind": "block", "key": key, "namespace": NAMESPACE.root, "depth": 0, "dtype": "float32",
                  "shape": list(NAMESPACE.block_shape), **changes}
        head, payload = record.encode(header, bytes(128))
        return bytearray(head + bytes(payload))

    bad = [{"depth": 2**70}, {"depth": -1}, {"depth": "0"}, {"depth": True}, {"namespace": "0" * 32},
           {"shape": [1, 2, 1, 2, 8]}, {"dtype": "float16", "shape": [1, 2, 1, 4, 8]}, {"kind": "manifest"}]
    batch = [(f"{i:02x}" * 16, block(f"{i:02x}" * 16, **changes)) for i, changes in enumerate(bad)]
    good = "cd" * 16
    try:
        chain.bind(NAMESPACE)
        chain._save_locally(local, [*batch, (good, block(good))])
        assert local.lookup([good]) == 1 and not any(key in local for key, _ in batch)
    finally:
        chain.close()
    again = PersistentStore(tmp_path, 1 << 20)
    assert again.recovery == Recovery() and again.lookup([good]) == 1
    again.close()


@pytest.mark.parametrize("planted", ["a list", "an empty string"])
def test_a_key_of_another_redis_type_is_corrupt_and_replaced(model, redis_server, caplog, planted) -> None:
    """A list at a block's key (GETRANGE answers WRONGTYPE), or an empty string (GETRANGE answers as for no key,
    while EXISTS says it is there, so no write-through replaced it): a corrupt miss, deleted, so the
    write-through stores the block there and the next worker loads the whole prefix."""
    ids, _ = prompt(1, 100)
    expected = reference(model, ids)
    run(model, ids, remote=redis_server.url)
    raw = redis_server.client()
    root = Namespace.of_model(model, BT).root
    name = f"tierkv:{root}:{block_keys(root, ids[0], BT)[1]}"
    raw.delete(name)
    if planted == "a list":
        raw.rpush(name, b"x")
    else:
        raw.set(name, b"")
    out, loaded, stats = run(model, ids, remote=redis_server.url)
    assert loaded == BT and torch.equal(out, expected)
    assert stats["remote"]["corrupt"] == 1 and ("WRONGTYPE" if planted == "a list" else "is empty") in caplog.text
    assert raw.type(name) == b"string" and raw.strlen(name) > 0  # deleted, then written by the write-through
    out, loaded, _ = run(model, ids, remote=redis_server.url)
    assert loaded == 96 and torch.equal(out, expected)


def test_a_record_of_another_shape_is_corrupt_and_never_kept_locally(model, redis_server, tmp_path,
                                                                     caplog) -> None:
    """Block 1's record with the right key and namespace but another shape (the same bytes): a corrupt miss,
    deleted and replaced; the worker's local store lists only the blocks it computed, so once the server loses
    the value the local copy serves the whole prefix."""
    ids, _ = prompt(1, 100)
    expected = reference(model, ids)
    namespace = Namespace.of_model(model, BT)
    keys = block_keys(namespace.root, ids[0], BT)
    run(model, ids, remote=redis_server.url)
    layers, _, heads, tokens, dim = namespace.block_shape
    crafted(redis_server, keys[1], shape=[layers, 2, 1, tokens, heads * dim])
    disk = dict(disk_dir=tmp_path, persist=True)
    out, loaded, stats = run(model, ids, remote=redis_server.url, **disk)
    assert loaded == BT and torch.equal(out, expected)
    assert stats["remote"]["corrupt"] == 1 and "does not fit this model's blocks" in caplog.text
    raw = redis_server.client()
    name = f"tierkv:{namespace.root}:{keys[1]}"
    assert record.decode(unframe(keys[1].encode(), raw.get(name)))[0]["shape"] == list(namespace.block_shape)
    store = PersistentStore(tmp_path, 1 << 30)
    assert len(store.get(keys, namespace)) == 6
    store.close()
    raw.delete(name)
    out, loaded, stats = run(model, ids, remote=redis_server.url, **disk)
    assert loaded == 96 and stats["remote"]["local_blocks"] == 6 and torch.equal(out, expected)


NAMESPACE = Namespace(fingerprint="f" * 16, layers=1, kv_heads=1, head_dim=4, dtype="float32", block_tokens=4,
                      device_type="cpu", attention="sdpa")  # blocks [1, 2, 1, 4, 4]: 128 bytes of K/V


def huge_claims(key: str, root: str) -> dict[str, bytes]:
    """Values for ``key``: each claims, or is, far more than a block of :data:`NAMESPACE`."""
    head, payload = record.encode_block(key, root, 0, torch.zeros(NAMESPACE.block_shape))
    prefix = struct.Struct("<4sHHIQQ")
    magic, version, reserved, header_bytes, _, checksum = prefix.unpack_from(head)
    huge_payload = prefix.pack(magic, version, reserved, header_bytes, 10**15, checksum) + head[prefix.size:]
    huge_header = prefix.pack(magic, version, reserved, 2**32 - 1, len(payload), checksum) + head[prefix.size:]
    big = os.urandom(1 << 10) * (64 << 10)  # 64 MiB
    return {
        "frame claims 2**63 bytes": HEADER.pack(MAGIC, 2**63, 0) + b"x" * 64,
        "frame claims 2**64-1 bytes": HEADER.pack(MAGIC, 2**64 - 1, 0) + b"x" * 64,
        "record claims 10**15 payload bytes": frame(key.encode(), huge_payload + bytes(payload)),
        "record claims a 4 GiB header": frame(key.encode(), huge_header + bytes(payload)),
        "a valid frame of 64 MiB": frame(key.encode(), big),
    }


@pytest.mark.parametrize("claim", list(huge_claims("0" * 32, "r")))
def test_a_huge_value_is_refused_before_allocating(redis_server, claim: str) -> None:
    """Read through the chain (as ``load_prefix`` does): nothing near the claimed or real size is allocated,
    and the value is counted as corrupt and deleted."""
    root, key = NAMESPACE.root, "ab" * 16
    chain = ChainedBlockStore(None, redis_server.url)
    try:
        chain.bind(NAMESPACE)
        redis_server.client().set(f"tierkv:{root}:{key}", huge_claims(key, root)[claim])
        tracemalloc.start()
        try:
            assert chain.lookup([key]) == 1 and chain.get([key]) == []
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20  # nothing near the claim was allocated
        assert chain.stats()["corrupt"] == 1
        assert chain.flush(5) and not redis_server.client().exists(f"tierkv:{root}:{key}")  # deleted
    finally:
        chain.close()


def test_a_valid_block_is_read_within_the_bound(redis_server) -> None:
    """The bound is no smaller than a real block record: one written by the chain reads back."""
    key = "cd" * 16
    head, payload = record.encode_block(key, NAMESPACE.root, 0, torch.arange(32.0).reshape(NAMESPACE.block_shape))
    chain = ChainedBlockStore(None, redis_server.url)
    try:
        chain.bind(NAMESPACE)
        chain.put([Item(key, 0, head, payload)])
        assert chain.flush(5) and chain.lookup([key]) == 1
        assert [bytes(data) for data in chain.get([key])] == [head + bytes(payload)]
    finally:
        chain.close()


# ------------------------------------------------------------------------------------------- knobs
NUMERIC = {  # setting -> (its largest value, a value beyond, the range its error names)
    "io_queue_depth": ("256", "4294967296", "1-256"),
    "io_chunk": ("256MiB", "260MiB", "256.00 MiB"),
    "prefetch_min": ("64GiB", "100TiB", "64.00 GiB"),
    "remote_timeout": ("600", "1e9", "0.001 to 600"),
    "remote_queue": ("16GiB", "17GiB", "4.00 KiB to 16.00 GiB"),
    "remote_queue_wait": ("600", "inf", "0 to 600"),
    "persist_lock_timeout": ("600", "inf", "0 to 600"),
}


def test_every_numeric_knob_is_listed() -> None:
    """Each setting whose default is a number has an upper bound tested below."""
    numeric = {name for name, s in settings.SETTINGS.items()
               if isinstance(s.default(), (int, float)) and not isinstance(s.default(), bool)}
    assert numeric == set(NUMERIC)


@pytest.mark.parametrize("name", list(NUMERIC))
def test_every_numeric_knob_has_an_upper_bound(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Refused from the environment and from an override alike, naming the variable, the range and a fix."""
    largest, beyond, bound = NUMERIC[name]
    variable = settings.SETTINGS[name].variable
    from_environment = not settings.source(name).startswith("override")  # conftest pins prefetch_min
    with settings.override(**{name: largest}):
        pass  # the bound itself is allowed
    for value in (beyond, "-1", "nan"):
        with pytest.raises(InvalidConfigError) as info, settings.override(**{name: value}):
            pass
        messages = [str(info.value)]
        if from_environment:
            monkeypatch.setenv(variable, value)
            with pytest.raises(InvalidConfigError) as info:
                settings.get(name)
            messages.append(str(info.value))
            assert f"{variable}={value!r}" in messages[-1]
        for message in messages:
            assert f"e.g. {variable}=" in message and "unset it" in message
            assert value != beyond or bound in message, message


def test_the_native_pool_refuses_zero_and_absurd_thread_counts(tmp_path: Path) -> None:
    from tierkv.io import native

    lib = native.library()
    for count in (0, -1, 257):
        assert not lib.tkv_pool_new(count)  # NULL: never a pool without workers
    pool = lib.tkv_pool_new(2)
    assert pool
    lib.tkv_pool_free(pool)
    for depth in (0, 2**32, True):
        with pytest.raises(InvalidConfigError, match="1 to 256 I/O threads"):
            native._Pool(lib, depth, -1)


SPILL = """
import numpy as np, sys
from tierkv.io import aligned_empty, open_disk_file
from tierkv.errors import InvalidConfigError
with open(sys.argv[1], "wb") as out:
    out.truncate(1 << 16)
try:
    with open_disk_file(sys.argv[1], engine=sys.argv[2]) as f:
        buf = aligned_empty(1 << 16)
        f.submit_writes([(0, buf)]).wait()
except InvalidConfigError as error:
    print("REFUSED", error)
"""


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_a_queue_depth_of_2_to_the_32_is_a_clear_error(tmp_path: Path, engine: str) -> None:
    """The issue's reproduction: ``TIERKV_IO_QUEUE_DEPTH=2**32`` was a C pool with 0 threads, and the first
    write hung forever. Now the first file open refuses it, naming the variable and its range."""
    env = {**os.environ, "TIERKV_IO_QUEUE_DEPTH": str(2**32)}
    result = subprocess.run([sys.executable, "-c", SPILL, str(tmp_path / "spill.bin"), engine], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "REFUSED TIERKV_IO_QUEUE_DEPTH='4294967296'" in result.stdout and "1-256" in result.stdout


# ------------------------------------------------------------------------- passwords that are not UTF-8
LATIN1_SECRET = "p\udce4sswort-TopSecretTail"  # b"p\xe4sswort-..." read from a Latin-1 environment


def test_a_password_that_is_not_utf8_is_refused_where_it_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte of another encoding in ``$TIERKV_REDIS_PASSWORD`` (a surrogate escape) or in a URL's password is
    a configuration error that names the problem, never shows the password, and is raised before any command."""
    monkeypatch.setenv("TIERKV_REDIS_PASSWORD", LATIN1_SECRET)
    with pytest.raises(InvalidConfigError, match="not UTF-8") as info:
        settings.get("redis_password")
    assert "TopSecretTail" not in str(info.value) and "TIERKV_REDIS_PASSWORD" in str(info.value)
    with pytest.raises(InvalidConfigError, match="not UTF-8") as info:
        RemoteBlockStore(f"redis://127.0.0.1:{closed_port()}/0", "m")
    assert "TopSecretTail" not in str(info.value)
    monkeypatch.delenv("TIERKV_REDIS_PASSWORD")
    with pytest.raises(InvalidConfigError, match="the password holds a character that is not UTF-8") as info:
        parse_remote_url(f"redis://:{LATIN1_SECRET}@127.0.0.1:6379/0")
    assert "TopSecretTail" not in str(info.value)


def test_a_password_redis_py_cannot_encode_is_warned_without_it(redis_server, caplog) -> None:
    """Given directly (past the URL's checks), such a password fails inside redis-py's encoder: a warned miss
    whose message shows neither the password nor its escaped form (an exception's repr quoted it)."""
    url = RemoteURL(nodes=(("127.0.0.1", redis_server.port),), password=LATIN1_SECRET)
    with RemoteBlockStore(url, "m", timeout_s=1.0) as store:
        assert store.contains(["ab" * 16]) == [False] and store.stats()["errors"] == 1
    assert "cannot encode" in caplog.text
    assert "TopSecretTail" not in caplog.text and "sswort" not in caplog.text
    quoted = f"{LATIN1_SECRET!r} {LATIN1_SECRET.encode('utf-8', 'surrogateescape')!r}"  # a repr, and the bytes
    assert RemoteURL(nodes=(), password=LATIN1_SECRET).scrub(quoted) == "'***' b'***'"
