"""A forked child and its parent's cache (tierkv/forks.py): the child neither hangs at exit, nor removes the
parent's files, nor decodes with the parent's cache (refused with the fix), and may make its own.

Each scenario runs in a fresh interpreter (``fork()`` inside pytest's own process would run pytest in the child).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCENARIO = textwrap.dedent("""
    import os, sys, time
    import torch, transformers
    from tierkv import TieredCache

    torch.set_num_threads(1)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    directory, engine, child = sys.argv[1], sys.argv[2], sys.argv[3]
    generator = torch.Generator().manual_seed(1)
    ids, second = (torch.randint(2, 128, (1, 40), generator=generator) for _ in range(2))
    device = TieredCache.min_device_bytes(config, 80, 1, 4) + 8192

    def make():
        return TieredCache(gpu_gb=f"{device}B", cpu_gb="16KiB", disk_dir=directory, disk_gb="64MiB", block_tokens=4,
                           config=config, disk_engine=engine, persist=True)

    def generate(cache, prompt, new=5):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                              max_new_tokens=new, do_sample=False)

    cache = make()
    cache.load_prefix(model, ids)
    out = generate(cache, ids)
    assert cache.stats()["blocks"]["disk"] > 0
    files = sorted(os.listdir(directory))
    pid = os.fork()
    if pid == 0:
        if child == "uses it":
            try:
                generate(cache, out, 3)
                print("child decoded with the parent's cache", flush=True)
            except Exception as error:
                print("child refused:", type(error).__name__, error, flush=True)
        elif child == "makes its own":
            with make() as own:
                same = torch.equal(generate(own, ids), out)
            print("child's own cache equal:", same, flush=True)
        sys.exit(0)  # a normal exit: finalizers and atexit handlers run
    deadline = time.monotonic() + 60
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            print("child hung at exit", flush=True)
            break
        time.sleep(0.05)
    assert sorted(os.listdir(directory)) == files or child == "makes its own", (files, os.listdir(directory))
    cache.reset()  # the parent goes on with its next prompt, whose blocks persist as before
    cache.load_prefix(model, second)
    more = generate(cache, second, 3)
    reference = model.generate(second, attention_mask=torch.ones_like(second), max_new_tokens=3, do_sample=False)
    print("parent equal:", torch.equal(more, reference), flush=True)
    cache.close()
    with make() as warm:
        print("loaded:", warm.load_prefix(model, second), "of", second.shape[1], flush=True)
""")


def _run(tmp_path: Path, engine: str, child: str) -> str:
    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "disk"), engine, child], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hung" not in result.stdout, result.stdout
    assert "parent equal: True" in result.stdout, result.stdout
    loaded = result.stdout.split("loaded: ")[1].split()
    assert int(loaded[0]) == (int(loaded[2]) - 1) // 4 * 4, result.stdout  # every full block but the last token's
    return result.stdout


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_a_child_exiting_leaves_the_parents_cache_and_files_alone(tmp_path, engine):
    """Regression: at the child's exit the inherited finalizers joined the parent's I/O threads (the native
    engine: a hang) and removed the parent's disk tier, its locks and the persistent store's scratch area."""
    _run(tmp_path, engine, "exits")


def test_a_child_using_the_parents_cache_is_refused_and_may_make_its_own(tmp_path):
    """Regression: a child decoding with the inherited cache hung in its first step (no mover or I/O threads)."""
    out = _run(tmp_path, "posix", "uses it")
    assert "child refused: InvalidConfigError" in out and "forked child cannot use it" in out, out
    out = _run(tmp_path / "own", "posix", "makes its own")
    assert "child's own cache equal: True" in out, out


LOCKS = textwrap.dedent("""
    import fcntl, os, signal, sys, threading, time
    from tierkv import safefs, settings
    from tierkv.hf import attention
    from tierkv.persist.lock import OwnerLock, locked

    def free(directory, name):  # whether another open of the lock file can take it now
        fd = os.open(name, os.O_RDONLY, dir_fd=directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    def child(then):
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a lock the child cannot take: killed, not hung
            then()
            os._exit(0)
        return pid

    with safefs.directory(sys.argv[1]) as directory:
        # a child forked while a lock is held keeps the open file, not the lock, once the parent lets it go
        with locked(directory, "store.lock", exclusive=True):
            sleeper = child(lambda: time.sleep(5))
        owner = OwnerLock(directory, "owner.lock")
        sleeper2 = child(lambda: time.sleep(5))
        owner.release()
        print("locks free:", free(directory, "store.lock"), free(directory, "owner.lock"))
        for pid in (sleeper, sleeper2):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)

    # a child forked while another thread holds a module lock takes its own
    for held in (settings._lock, attention._LOCK):
        taken, done = threading.Event(), threading.Event()
        def hold(lock=held):
            with lock:
                taken.set()
                done.wait()
        thread = threading.Thread(target=hold)
        thread.start()
        taken.wait()
        pid = child(lambda: (settings.get("disk_engine"), attention._switched_inside()))
        _, status = os.waitpid(pid, 0)
        done.set()
        thread.join()
        print("child exit:", os.waitstatus_to_exitcode(status))
""")


def test_a_child_forked_while_locks_are_held_neither_keeps_nor_waits_for_them(tmp_path):
    """A child forked while the persistent store's lock was held shared its open file, and the lock with it, until
    the child exited (the parent's next flush waited its timeout, naming itself); one forked while another thread
    held tierkv's settings or engagement lock waited for ever on its first use. The parent unlocks, and the child
    takes module locks anew."""
    result = subprocess.run([sys.executable, "-c", LOCKS, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["locks free: True True", "child exit: 0", "child exit: 0"], result.stdout


HELD = textwrap.dedent("""
    import os, sys, torch, transformers
    from tierkv import TieredCache

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128)
    model = transformers.LlamaForCausalLM(config).eval()
    cache = TieredCache(gpu_gb="48KB", cpu_gb="16KB", disk_dir=sys.argv[1], block_tokens=4, config=config,
                        disk_engine=sys.argv[2], persist=True)
    model(torch.randint(2, 128, (1, 40)), past_key_values=cache)
    assert cache.stats()["blocks"]["disk"] > 0
    def tierkv_files():
        names = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                names.append(os.readlink(f"/proc/self/fd/{fd}"))
            except FileNotFoundError:  # the listing's own descriptor, closed since
                pass
        return sorted(os.path.basename(name) for name in names if name.endswith((".kv", ".lock")))
    print("parent:", bool(tierkv_files()))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, repr(tierkv_files()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    print("child:", os.read(read, 65536).decode())
    cache.close()
""")


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_a_child_holds_none_of_the_parents_tier_files_or_locks(tmp_path, engine):
    """A child forked from a process with a cache kept the disk tier's files and the lock files open: the space of
    files the parent removed stayed taken while the child lived, and after the parent died its locks still said
    it lived (the next cache could not reclaim its files). The child closes them."""
    result = subprocess.run([sys.executable, "-c", HELD, str(tmp_path), engine], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["parent: True", "child: []"], result.stdout
