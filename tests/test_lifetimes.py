"""Lifetimes: a cache dropped without close() releases its threads, descriptors and files at once (no reference
cycle holds it); close() is idempotent and never raises; files of processes that died are reclaimed by the
next cache that opens the directory, and a live process's files are never touched."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import psutil
import pytest
import torch
from helpers import held_before
from models import small_llama
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.errors import InvalidConfigError
from tierkv.tiers import disk as disk_module
from tierkv.tiers.disk import DiskTier


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    """Every thread of the process, the native engine's C threads included."""
    return len(os.listdir("/proc/self/task"))


def settled_threads(at_most: int) -> int:
    """The thread count once it is at most ``at_most``, or after 2 s (another test's thread may be exiting)."""
    deadline = time.monotonic() + 2
    while threads() > at_most and time.monotonic() < deadline:
        time.sleep(0.02)
    return threads()


def thread_names() -> list[str]:
    """Their names, for a failure message."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return sorted(names)


def use(cache: TieredCache, layers: int = 2, tokens: int = 24) -> None:
    """Fill ``cache`` past its memory budgets (so blocks land on disk) and read every layer back."""
    keys = torch.randn(1, 2, tokens, 8)
    for layer in range(layers):
        cache.update(keys, keys, layer)
    for layer in range(layers):
        cache.update(keys[:, :, :1], keys[:, :, :1], layer)


def small_cache(directory, engine: str = "posix") -> TieredCache:
    return TieredCache(gpu_gb="40KB", cpu_gb="8KB", disk_dir=directory, block_tokens=4, disk_engine=engine)


@pytest.mark.parametrize("engine", ["posix", "native"])
def test_a_dropped_cache_is_released_at_once(tmp_path, engine):
    """Regression: a cache dropped without close() kept two open descriptors and 16 native I/O threads until
    the process exited (reference cycles through TieredLayer.cache and the executors' callbacks)."""
    warm = small_cache(tmp_path, engine)
    use(warm)
    warm.close()
    before_fds, before_threads = fds(), threads()
    gc.disable()  # freed by reference counting alone: nothing may wait for the cycle collector
    try:
        cache = small_cache(tmp_path, engine)
        use(cache)
        assert cache.stats()["blocks"]["disk"] > 0
        assert fds() > before_fds and list(tmp_path.iterdir())
        alive = weakref.ref(cache)
        del cache
        assert alive() is None
        assert fds() <= before_fds  # at most: earlier tests' collected pools may still be winding down
        assert settled_threads(before_threads) <= before_threads, thread_names()
        assert not list(tmp_path.iterdir())
    finally:
        gc.enable()


def test_a_thousand_caches_leave_nothing_behind(tmp_path):
    """Create, use and drop 1,000 caches, half of them without close(): no file, descriptor or thread is
    left, and RSS does not grow beyond noise."""
    process = psutil.Process()
    for warmup in range(20):
        use(small_cache(tmp_path, "native" if warmup % 2 else "posix"))
    gc.collect()
    before_fds, before_threads, before_rss = fds(), threads(), process.memory_info().rss
    for index in range(1000):
        cache = small_cache(tmp_path, "native" if index % 4 < 2 else "posix")
        use(cache, tokens=12)
        if index % 2:
            cache.close()
        del cache
    assert not list(tmp_path.iterdir())
    # at most the baseline: threads of earlier tests' collected pools may still be exiting, none of ours remain
    assert fds() <= before_fds
    assert settled_threads(before_threads) <= before_threads, thread_names()
    gc.collect()
    growth = process.memory_info().rss - before_rss
    assert growth < 64 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 1,000 caches"


def test_close_is_idempotent_and_use_after_close_is_refused(tmp_path):
    cache = small_cache(tmp_path)
    use(cache)
    cache.close()
    cache.close()
    assert not list(tmp_path.iterdir())
    with pytest.raises(Exception, match="closed"):
        use(cache)
    for edit in (lambda: cache.crop(-1), lambda: cache.reorder_cache(torch.tensor([0])),
                 lambda: cache.batch_select_indices(torch.tensor([0]))):  # not silently nothing
        with pytest.raises(InvalidConfigError, match="was closed"):
            edit()


def _chattr(path, flag: str) -> bool:
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


@pytest.fixture
def immutable(tmp_path):
    """Make a directory immutable (``chattr +i``; root only) for the test, and mutable again after it."""
    made = []

    def make(path) -> None:
        if not _chattr(path, "+i"):
            pytest.skip("cannot make a directory immutable here (needs root and a filesystem with chattr)")
        made.append(path)

    yield make
    for path in made:
        _chattr(path, "-i")


def test_close_never_raises_and_retries_at_exit(tmp_path, immutable, caplog):
    """A directory made immutable after the files exist: close() logs and does not raise; the files are
    removed by the retry at exit once they can be."""
    directory = tmp_path / "kv"
    cache = small_cache(directory)
    use(cache)
    immutable(directory)
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        cache.close()
    assert "retrying at exit" in caplog.text
    assert list(directory.glob("*.kv"))
    _chattr(directory, "-i")
    disk_module._remove_left_over()  # what atexit runs
    assert not list(directory.glob("*.kv"))


CHILD = """
import sys
from tierkv.tiers.disk import DiskTier
tier = DiskTier(sys.argv[1], budget=2**20)
assert tier.alloc(4096) is not None  # a lock file and a fallocated .kv file
print("ready", flush=True)
sys.stdin.readline()
tier.close()
"""


def _children(directory, count: int) -> list[subprocess.Popen]:
    """``count`` processes that each hold a disk tier in ``directory`` (started together: imports are slow)."""
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(directory)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
                for _ in range(count)]
    for child in children:
        assert child.stdout.readline().strip() == "ready"
    return children


def test_files_of_a_killed_process_are_reclaimed_and_a_live_ones_are_not(tmp_path):
    """Regression: a SIGKILLed process left its files (each a fallocated extent) for ever. The next cache
    opening the directory removes them; a live process's files stay; another program's files stay."""
    (tmp_path / "notes.txt").write_text("not tierkv's")
    killed, live = _children(tmp_path, 2)
    killed_files = {p.name for p in tmp_path.glob(f"tierkv-{killed.pid}-*")}
    live_files = {p.name for p in tmp_path.glob(f"tierkv-{live.pid}-*")}
    assert len(killed_files) == 2 and len(live_files) == 2  # a lock file and a .kv file each
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert {p.name for p in tmp_path.glob(f"tierkv-{killed.pid}-*")} == killed_files  # nobody removed them
    cache = small_cache(tmp_path)
    assert not list(tmp_path.glob(f"tierkv-{killed.pid}-*"))
    assert {p.name for p in tmp_path.glob(f"tierkv-{live.pid}-*")} == live_files
    assert (tmp_path / "notes.txt").exists()
    use(cache)
    cache.close()
    live.communicate("\n")
    assert live.returncode == 0
    assert {p.name for p in tmp_path.iterdir()} == {"notes.txt"}


def test_a_second_cache_in_the_same_process_keeps_the_first_ones_files(tmp_path):
    """flock locks, not per-process record locks: a cache never reclaims another live cache's files in its
    own process."""
    first = small_cache(tmp_path)
    use(first)
    names = {p.name for p in tmp_path.iterdir()}
    second = DiskTier(tmp_path, budget=2**20)
    assert names <= {p.name for p in tmp_path.iterdir()}
    use(first)  # still readable
    second.close()
    first.close()
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def model():
    return small_llama()


def test_a_dropped_cache_used_by_a_real_model_is_released(model, tmp_path):
    before_fds = fds()
    cache = TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4, config=model.config)
    model.generate(torch.randint(2, 128, (1, 30)), past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert cache.stats()["blocks"]["disk"] > 0
    alive = weakref.ref(cache)
    del cache
    if alive() is not None:  # generate() may keep a frame (and so the cache) in a traceback or cycle of its own
        gc.collect()
    assert alive() is None
    assert fds() == before_fds
    assert not list(tmp_path.iterdir())



def test_a_reset_from_another_thread_mid_forward_refuses_the_rest_of_that_forward(model, tmp_path):
    """A server resets a cache while its request thread is between two layers of a decode step: the reset goes
    ahead, and the request's forward is refused the layers it had not reached (they would attend a cache that no
    longer holds its sequence: wrong logits, and their step written into the emptied cache, where the next request
    found layers of unequal length and a misleading "stopped part-way" error). The cache is left empty, and the
    next request decodes as DynamicCache does."""
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = TieredCache(gpu_gb="120KB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=16, config=model.config)
    with held_before(model.model.layers[-1], call=2) as (between, resume):  # the first decode step
        worker, outputs, errors = _decoding(model, ids, cache, 4)
        assert between.wait(60)
        cache.reset()
        resume.set()
        worker.join(120)
    assert not outputs and len(errors) == 1 and isinstance(errors[0], InvalidConfigError), errors
    assert "in the middle of this thread's forward" in str(errors[0])
    assert [layer.get_seq_length() for layer in cache.layers] == [0] * len(cache.layers)  # nothing of the cut step
    other = torch.randint(2, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.generate(other, past_key_values=DynamicCache(), max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(other, past_key_values=cache, max_new_tokens=6, do_sample=False), expected)
    cache.store.check()
    cache.close()


@pytest.mark.parametrize("edit", ["reset", "crop", "reorder", "load_prefix"])
def test_an_edit_from_another_thread_before_a_forwards_first_layer_refuses_that_forward(model, tmp_path, edit):
    """Another thread edits the cache after a decode step took its positions and sized its mask from it, before its
    first layer (no layer is half done, so the edit goes ahead): the step is refused with the reason (it attended the
    edited cache: wrong tokens, or a raw shape error and layers of unequal length), the cache stays consistent, and
    the next request decodes as DynamicCache does."""
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = TieredCache(gpu_gb="120KB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=16, config=model.config,
                        persist=edit == "load_prefix")
    edits = {"reset": cache.reset, "crop": lambda: cache.crop(-1), "reorder": lambda: cache.reorder_cache([0]),
             "load_prefix": lambda: cache.load_prefix(model, ids)}
    if edit == "load_prefix":  # the prompt persisted by an earlier request, loaded before the prefill's layer 0
        cache.load_prefix(model, ids)  # (nothing yet: it records the ids, so their blocks are persisted)
        with torch.no_grad():
            model.generate(ids, past_key_values=cache, max_new_tokens=1)
        cache.flush()
        cache.reset()
    with held_before(model.model.layers[0], call=1 if edit == "load_prefix" else 2) as (between, resume):
        worker, outputs, errors = _decoding(model, ids, cache, 4)
        assert between.wait(60)
        edits[edit]()
        resume.set()
        worker.join(120)
    assert not outputs and len(errors) == 1 and "before its first layer" in str(errors[0]), errors
    assert len({layer.get_seq_length() for layer in cache.layers}) == 1
    cache.store.check()
    cache.reset()
    other = torch.randint(2, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model.generate(other, past_key_values=DynamicCache(), max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(other, past_key_values=cache, max_new_tokens=6, do_sample=False), expected)
    cache.close()


def _decoding(model, ids: torch.Tensor, cache: TieredCache, new: int, start: threading.Barrier | None = None,
              ) -> tuple[threading.Thread, list[torch.Tensor], list[BaseException]]:
    """A started thread that generates ``new`` tokens after ``ids`` with ``cache`` (after ``start``, if given), and
    the lists its output or its error land in."""
    outputs: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def decode() -> None:
        try:
            if start is not None:
                start.wait()
            with torch.no_grad():
                outputs.append(model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new,
                                              do_sample=False))  # fmt: skip
        except BaseException as error:  # noqa: BLE001 - what reaches the user is the subject
            errors.append(error)

    worker = threading.Thread(target=decode)
    worker.start()
    return worker, outputs, errors


@pytest.mark.parametrize("engine", ["posix", "native"])
def test_close_on_another_thread_while_decoding_is_clean(model, tmp_path, engine):
    """A server closing a cache whose request thread decodes (blocks on every tier): ``close()`` waits for the
    layer-step in progress; the decoding thread then finishes or gets "closed" at its next step — never a raw
    KeyError / AssertionError / "slot not in use" from tiers released under it, nor a crash or a hang; the
    directory is left empty."""
    ids = torch.randint(2, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    outcomes = set()
    for attempt in range(24):
        cache = TieredCache(gpu_gb="120KB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=16, disk_engine=engine,
                            config=model.config)  # fmt: skip
        worker, _, errors = _decoding(model, ids, cache, 40)
        time.sleep(0.02 * (attempt % 12))
        cache.close()
        worker.join(60)
        assert not worker.is_alive(), "the decoding thread hangs after close()"
        for error in errors:
            assert isinstance(error, InvalidConfigError) and "was closed" in str(error), repr(error)
        outcomes.add("closed" if errors else "finished")
        assert not list(tmp_path.iterdir())
    assert "closed" in outcomes  # the close came during decoding at least once


def test_a_second_thread_is_refused_while_anothers_forward_is_half_done(model, tmp_path):
    """One cache holds one sequence of steps. A request thread stopped between two layers of its forward (a hook
    holds it there) while a second thread calls the model with the same cache: the second is refused with the fix
    (it used to interleave its step with the first's: a misleading InterruptedStepError, a slot leaked, one prompt
    in the other's KV), nothing of it is stored, and the first thread's tokens equal DynamicCache's."""
    ids = torch.randint(2, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=8, do_sample=False)
    cache = TieredCache(gpu_gb="120KB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=16, config=model.config)
    with held_before(model.model.layers[-1]) as (between, resume):  # the request's first forward, before its last layer
        worker, outputs, errors = _decoding(model, ids, cache, 8)
        assert between.wait(60)
        held = cache.get_seq_length()
        with pytest.raises(InvalidConfigError, match="another thread"), torch.no_grad():
            model(ids[:, :5], past_key_values=cache)
        assert cache.get_seq_length() == held  # nothing of the refused step stored
        resume.set()
        worker.join(120)
    assert not errors and torch.equal(outputs[0], reference)
    cache.store.check()
    cache.close()


def test_an_interrupt_once_the_lock_file_is_in_place_leaves_no_lock_file(tmp_path, monkeypatch):
    """A Ctrl-C (or any error) after the tier's lock file was renamed into place, before the tier holds it, removes
    that file, not the temporary name it no longer has."""
    from tierkv.tiers import lease

    def interrupted(fd: int) -> tuple[int, int]:
        raise KeyboardInterrupt

    monkeypatch.setattr(lease.forks, "private_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        disk_module.DiskTier(tmp_path, 1 << 20)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(("tierkv-", ".tierkv-"))]
