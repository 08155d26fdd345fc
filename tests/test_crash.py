"""Crash safety of the persistent directory: real child processes killed with SIGKILL at random points
while they write; the next process opens the directory without error, every listed block verifies, and
nothing unlisted or abandoned is left."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tierkv.errors import DiskFullError, DiskTierError
from tierkv.persist import record
from tierkv.persist.blockfile import DIRECTORY_NAME, SUFFIX, Item, PersistentStore

KILLS = 24

# Writes batches of records of random sizes for ever (evicting: the capacity is small), printing "ready"
# once its store is open.
WRITER = """
import random, sys
from tierkv.persist import record
from tierkv.persist.blockfile import Item, PersistentStore
store = PersistentStore(sys.argv[1], 6 << 20)
print("ready", flush=True)
rng = random.Random(int(sys.argv[2]))
n = 0
while True:
    batch = []
    for depth in range(rng.randint(1, 6)):
        key = f"{sys.argv[2]:>08}{n:024x}"
        n += 1
        head, payload = record.encode({"kind": "block", "key": key}, rng.randbytes(rng.randint(1, 400_000)))
        batch.append(Item(key, depth, head, payload))
    store.put(batch)
"""


def _files(root):
    return sorted(p.name for p in (root / "blocks").rglob(f"*{SUFFIX}"))


def test_sigkill_at_random_points_leaves_a_directory_that_opens_clean(tmp_path):
    rng = random.Random(11)
    root = tmp_path / DIRECTORY_NAME
    recovered = []
    listed_counts = []
    for attempt in range(KILLS):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(attempt)],
                                 stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()})
        if attempt % 3:  # after it is writing ...
            assert child.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0.0, 0.25))
        else:  # ... or anywhere, also while it starts or recovers after the previous one
            time.sleep(rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        child.stdout.close()

        store = PersistentStore(tmp_path, 6 << 20)  # opens without error
        recovered.append(store.recovery)
        assert store.verify() == []  # every listed block reads back and checks
        listed = store._listing().entries
        assert _files(root) == sorted(f"{key}{SUFFIX}" for key in listed)  # nothing unlisted is left
        assert sorted(p.name for p in (root / "tmp").iterdir()) == [store._scratch.name, f"{store._scratch.name}.lock"]
        assert not (root / "manifest.tmp").exists()
        for key in list(listed)[:3]:
            header, _ = record.decode(store.get([key])[0])
            assert header["key"] == key
        listed_counts.append(len(listed))
        store.close()
    assert sum(r.scratch_areas for r in recovered) >= KILLS // 2  # the kills did land while writers were alive
    assert max(listed_counts) > 0  # and some of them after blocks had been listed


# A TieredCache(persist=True) process: prompt after prompt (sharing prefixes of various lengths), each
# generated and flushed, printing the seed once its blocks are stored; killed while it keeps going.
CACHE_WRITER = """
import sys
sys.path.insert(0, "tests")
import torch
from models import prompt, tiny_model
from tierkv.hf import TieredCache, cache_keyword
model = tiny_model("llama")
base, _ = prompt(1, 64, seed=0)
for seed in range(1, 10_000):
    ids, _ = prompt(1, 64, seed=seed)
    ids[:, : 4 * (seed % 12)] = base[:, : 4 * (seed % 12)]
    with TieredCache(disk_dir=sys.argv[1], persist=True, block_tokens=4, gpu_gb="64MiB", cpu_gb="64MiB") as cache:
        cache.load_prefix(model, ids)
        model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_keyword(model): cache}, max_new_tokens=2,
                       do_sample=False)
        cache.flush()
    print(seed, flush=True)
"""


def test_a_killed_persistent_cache_leaves_blocks_a_later_cache_reuses_exactly(tmp_path):
    import torch
    from models import prompt, tiny_model
    from transformers import DynamicCache

    from tierkv.hf import TieredCache, cache_keyword

    # one child (its start costs seconds: torch and transformers); the random kills are the test above's
    child = subprocess.Popen([sys.executable, "-c", CACHE_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    done = [int(child.stdout.readline())]  # one prompt is stored ...
    time.sleep(random.Random(5).uniform(0.05, 0.5))  # ... and it is somewhere in the next ones
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.stdout.close()
    model = tiny_model("llama")
    base, _ = prompt(1, 64, seed=0)
    ids, _ = prompt(1, 64, seed=done[-1])
    ids[:, : 4 * (done[-1] % 12)] = base[:, : 4 * (done[-1] % 12)]
    keyword = cache_keyword(model)
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, output_logits=True,
                   return_dict_in_generate=True)
    reference = model.generate(ids, **{keyword: DynamicCache(config=model.config)}, **options)
    with TieredCache(disk_dir=tmp_path, persist=True, block_tokens=4, gpu_gb="64MiB", cpu_gb="64MiB") as cache:
        assert cache.session.prefix.store.verify() == []
        assert cache.load_prefix(model, ids) == 60  # the stored prompt's 15 full blocks before its last token
        out = model.generate(ids, **{keyword: cache}, **options)
    assert torch.equal(out.sequences, reference.sequences)
    for a, b in zip(reference.logits, out.logits):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_a_persistent_tree_removed_under_a_running_store_is_named_with_its_errno(tmp_path):
    """``rm -r disk_dir/tierkv-persist`` while a store runs: its next ``put`` says the folders were removed
    (ENOENT), not "free space there" with no errno; the next store makes the tree again and works."""
    def item(key: str) -> Item:
        head, payload = record.encode({"kind": "block", "key": key}, bytes(1000))
        return Item(key, 0, head, bytes(payload))

    store = PersistentStore(tmp_path, 1 << 20)
    assert store.put([item("a" * 32)]) == 1
    shutil.rmtree(tmp_path / DIRECTORY_NAME)
    with pytest.raises(DiskTierError, match="were removed while this cache used them") as info:
        store.put([item("b" * 32)])
    assert info.value.errno == errno.ENOENT and not isinstance(info.value, DiskFullError)
    store.close()
    again = PersistentStore(tmp_path, 1 << 20)
    assert again.lookup(["a" * 32]) == 0 and again.put([item("b" * 32)]) == 1 and again.verify() == []
    again.close()


# Saves a conversation file whose records stop coming after the first (the writer is blocked mid-save), printing
# "writing" once the first bytes are in its temporary file.
STALLED_SAVER = """
import sys, time
from tierkv.persist import conversation

def records():
    yield bytes(4096), memoryview(b"")
    print("writing", flush=True)
    time.sleep(3600)

conversation.save(sys.argv[1], records())
"""


def test_saves_killed_mid_write_leave_no_temporary_behind_the_next_save(tmp_path):
    """Regression: each ``save()`` SIGKILLed mid-write left its temporary (``.chat.tkv.<hex>.tmp``, as large as the
    conversation) for ever. The next save of that file removes the dead writers' temporaries, never a live
    writer's, and the file is always either the previous version or the new one."""
    from tierkv.persist import conversation

    target = tmp_path / "chat.tkv"
    conversation.save(target, [(b"first", memoryview(b""))])

    def stalled_saver() -> subprocess.Popen:
        child = subprocess.Popen([sys.executable, "-c", STALLED_SAVER, str(target)], stdout=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert child.stdout.readline() == b"writing\n"
        return child

    def temporaries() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir() if p.name != "chat.tkv")

    live = stalled_saver()
    for _ in range(2):  # each saver, as it starts, removes the temporary the one before it left
        child = stalled_saver()
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        child.stdout.close()
    assert len(temporaries()) == 2 and target.read_bytes() == b"first"  # the live one's and the last killed one's
    (tmp_path / ".chat.tkv.0123456789ab.tmp").write_bytes(b"")  # created by a writer that did not write yet
    (tmp_path / ".other.tkv.0123456789ab.tmp").write_bytes(b"another file's")
    stranger = tmp_path / ".chat.tkv.ba9876543210.tmp"
    stranger.symlink_to(tmp_path / "chat.tkv")
    mine = temporaries()
    conversation.save(target, [(b"second", memoryview(b""))])
    assert target.read_bytes() == b"second"
    left = temporaries()  # the live writer's, the empty one, another file's and the link stay
    assert len(left) == 4 and set(left) < set(mine) and stranger.name in left
    live.send_signal(signal.SIGKILL)
    assert live.wait(timeout=30) == -signal.SIGKILL
    live.stdout.close()
    conversation.save(target, [(b"third", memoryview(b""))])
    assert target.read_bytes() == b"third" and len(temporaries()) == 3
