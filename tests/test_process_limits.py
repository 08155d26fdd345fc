"""Limits of the process, not of the drive: an address-space limit (``ulimit -v``), a file-size limit (``ulimit
-f``, a filesystem's largest file), no file descriptor left, fewer threads than the engine asks for. The disk tier
works within them where the KV fits (tokens equal ``DynamicCache``'s), or stops with an error that names the limit
and its fix, not the drive. Each limit is set in a subprocess (it binds the whole process)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.errors import TierKVError
from tierkv.io import native
from tierkv.tiers.disk import disk_error

_DECODE = """
import os, resource, signal, sys, torch, transformers
from transformers import DynamicCache
from tierkv import TieredCache
import tierkv.io.native
tierkv.io.native.library()  # loaded before the limit (as a process that used it once has)
torch.set_num_threads(1)
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=None)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).eval()
model.generation_config.pad_token_id = 0
ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(0))
reference = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=NEW, do_sample=False)
LIMIT
try:
    with TieredCache(gpu_gb="48KB", cpu_gb="16KB", disk_dir=sys.argv[1], block_tokens=4, disk_engine=ENGINE) as c:
        out = model.generate(ids, past_key_values=c, max_new_tokens=NEW, do_sample=False)
        print("equal" if torch.equal(out, reference) else "DIFFERENT", c.stats()["blocks"]["disk"])
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


def _decode(tmp_path: Path, limit: str, engine: str = "native", new: int = 40) -> str:
    script = _DECODE.replace("LIMIT", textwrap.dedent(limit)).replace("ENGINE", repr(engine)).replace("NEW", str(new))
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_an_address_space_limit_leaves_room_for_the_native_engines_threads(tmp_path) -> None:
    """Regression: the native engine's 16 I/O threads took the default 8 MiB of stack each, so under ``ulimit -v``
    with tens of MiB to spare the first spill failed mid-prefill ("could not start its 16 I/O threads ... check
    the drive"). Their stacks are 1 MiB now: decoding with most blocks on disk is exact."""
    outcome = _decode(tmp_path, """
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (40 << 20), resource.RLIM_INFINITY))
    """)
    assert outcome.startswith("equal"), outcome


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_a_file_size_limit_is_grown_to_in_single_slots_then_named(tmp_path, engine: str) -> None:
    """Regression: a file-size limit (``ulimit -f``; FAT32's 4 GiB) failed the disk tier's first 1 MiB extent with
    "check the drive" although the KV fitted under it. Now the file grows a slot at a time near the limit, as near
    a full disk: exact; and where the KV does not fit the error names the limit and the fix."""
    fits = _decode(tmp_path, """
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 << 10, resource.RLIM_INFINITY))
    """, engine)
    assert fits.startswith("equal"), fits
    too_small = _decode(tmp_path, """
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (48 << 10, resource.RLIM_INFINITY))
    """, engine)
    assert too_small.startswith("DiskTierError") and "ulimit -f" in too_small and "dmesg" not in too_small, too_small


def test_a_native_pool_that_cannot_start_every_thread_goes_on_with_fewer(tmp_path, monkeypatch, caplog) -> None:
    """A thread or process limit that leaves room for fewer I/O threads than ``TIERKV_IO_QUEUE_DEPTH`` asks for:
    the native engine halves its pool until it starts (a warning says how many), instead of failing the spill."""
    lib = native.library()
    start = lib.tkv_pool_new
    monkeypatch.setattr(lib, "tkv_pool_new", lambda threads: start(threads) if threads <= 4 else None)
    model = tiny_model("llama")
    ids, mask = prompt(1, 30, seed=8)
    reference = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(), max_new_tokens=20,
                               do_sample=False)
    with caplog.at_level(logging.WARNING, logger="tierkv"), \
            TieredCache(gpu_gb="48KB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4,
                        disk_engine="native") as cache:  # fmt: skip
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=20, do_sample=False)
        assert cache.stats()["blocks"]["disk"] > 0
    assert torch.equal(out, reference)
    assert "could start only 4 of its 16 I/O threads" in caplog.text


def test_a_conversation_saved_beyond_a_file_size_limit_names_the_limit(tmp_path) -> None:
    """Regression: ``save()`` beyond ``ulimit -f`` said "check the directory's permissions and the drive"."""
    script = textwrap.dedent("""
        import resource, signal, sys, torch, transformers
        from tierkv import TieredCache
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        model = transformers.LlamaForCausalLM(config).eval()
        with TieredCache(gpu_gb="1MB", block_tokens=4) as cache, torch.no_grad():
            model(torch.randint(2, 128, (1, 200)), past_key_values=cache)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.RLIM_INFINITY))
            try:
                cache.save(sys.argv[1], model=model)
            except Exception as exc:
                print(f"{type(exc).__name__}: {exc}")
    """)
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "chat.tkv")], capture_output=True,
                            text=True, timeout=300)
    said = result.stdout.strip()
    assert said.startswith("DiskTierError") and "ulimit -f" in said and "save to another filesystem" in said, said
    assert "disk_gb" not in said and not (tmp_path / "chat.tkv").exists()


@pytest.mark.parametrize("code, says", [(errno.EMFILE, "ulimit -n"), (errno.ENFILE, "ulimit -n"),
                                        (errno.EFBIG, "ulimit -f"), (errno.EAGAIN, "TIERKV_IO_QUEUE_DEPTH"),
                                        (errno.EDQUOT, "quota")])
def test_a_limit_of_the_process_is_named_not_the_drive(code: int, says: str) -> None:
    """Regression: running out of file descriptors, a file-size limit or a thread limit said "check the drive and
    its kernel log (dmesg)"."""
    error = disk_error(OSError(code, os.strerror(code)), Path("/somewhere/tierkv.kv"))
    assert says in str(error) and "dmesg" not in str(error), error
    assert error.errno == code


def test_no_descriptor_left_to_read_the_hosts_memory_is_a_clear_error(monkeypatch) -> None:
    """Regression: with no file descriptor left, building a cache without budgets raised psutil's raw OSError
    on /proc/meminfo."""
    import psutil

    def exhausted():
        raise OSError(errno.EMFILE, "Too many open files", "/proc/meminfo")

    monkeypatch.setattr(psutil, "virtual_memory", exhausted)
    model = tiny_model("llama")
    ids, mask = prompt(1, 8, seed=1)
    with pytest.raises(TierKVError, match="ulimit -n"), TieredCache() as cache:
        model(ids, attention_mask=mask, past_key_values=cache)


def test_no_descriptor_left_outside_tierkvs_own_io_is_named_and_the_step_retried_exactly(tmp_path,
                                                                                       monkeypatch) -> None:
    """Regression: with every descriptor taken, a step met the limit in a lazy import of numpy's (``np.unique``
    importing ``numpy.ma``, inside the placement) and raised the import's raw OSError. It names the limit now, and
    the step, retried once descriptors are free, is exact."""
    from tierkv.store import placement

    model = tiny_model("llama")
    ids, mask = prompt(1, 40, seed=2)
    step = torch.tensor([[7]])
    reference = DynamicCache()
    model(ids, attention_mask=mask, past_key_values=reference)
    expected = model(step, past_key_values=reference).logits
    original = placement.BlockPlacement._blocks_on

    def exhausted(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files", "numpy/ma/__init__.py")

    with TieredCache(gpu_gb="48KB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4) as cache:
        model(ids, attention_mask=mask, past_key_values=cache)
        monkeypatch.setattr(placement.BlockPlacement, "_blocks_on", exhausted)
        with pytest.raises(TierKVError, match=r"no file descriptor left; raise the limit \(ulimit -n\)"):
            model(step, past_key_values=cache)
        monkeypatch.setattr(placement.BlockPlacement, "_blocks_on", original)
        torch.testing.assert_close(model(step, past_key_values=cache).logits, expected, atol=1e-5, rtol=0)


def test_o_direct_required_on_a_filesystem_that_refuses_it_is_refused_when_the_cache_is_built(tmp_path) -> None:
    """Regression: with ``TIERKV_DIRECT_IO=1`` and ``disk_dir`` on a filesystem that refuses O_DIRECT (ramfs here;
    tmpfs before Linux 6.6, many FUSE mounts), the cache was built and the refusal came at its first spill, in the
    middle of a forward. Now the disk tier tries it on a probe file when it is built; nothing is left there."""
    from helpers import mounted

    from tierkv import settings
    from tierkv.errors import InvalidConfigError

    with mounted(tmp_path / "ram", "ramfs") as directory, settings.override(direct_io=True):
        with pytest.raises(InvalidConfigError, match="refuses O_DIRECT") as refused:
            TieredCache(gpu_gb="48KB", cpu_gb="16KB", disk_gb="4MB", disk_dir=directory, block_tokens=4)
        assert str(directory) in str(refused.value) and "TIERKV_DIRECT_IO" in str(refused.value)
        assert not [p for p in directory.iterdir() if p.suffix == ".kv"]


def test_a_filesystem_that_reports_no_size_takes_an_explicit_disk_budget(tmp_path) -> None:
    """Regression: on a filesystem whose statvfs reports no size (ramfs; some FUSE and network filesystems) an
    explicit ``disk_gb`` was refused ("holds 0 B ... leave disk_gb unset") and the default was a 0 B budget that
    failed at the first spill ("pass disk_gb"): each message recommended the other. Now ``disk_gb`` is the bound
    there (decoding exact), and the default is refused when the cache is built, with that fix."""
    from helpers import mounted

    from tierkv.errors import InvalidConfigError

    model = tiny_model("llama")
    ids, mask = prompt(1, 30, seed=6)
    reference = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(), max_new_tokens=12,
                               do_sample=False)
    with mounted(tmp_path / "ram", "ramfs") as directory:
        with pytest.raises(InvalidConfigError, match="reports no size.*pass disk_gb"):
            TieredCache(gpu_gb="48KB", cpu_gb="16KB", disk_dir=directory, block_tokens=4)
        with TieredCache(gpu_gb="48KB", cpu_gb="16KB", disk_gb="4MB", disk_dir=directory, block_tokens=4) as cache:
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False)
            assert cache.stats()["blocks"]["disk"] > 0
    assert torch.equal(out, reference)


def test_the_commands_take_a_directory_on_a_filesystem_that_reports_no_size(tmp_path) -> None:
    """``tierkv bench --dir`` (and the other commands' directories) on ramfs: writable, though it reports no size
    (it was called "not a writable directory"); /proc still is not."""
    from helpers import mounted

    from tierkv.commands import _check_writable
    from tierkv.errors import InvalidConfigError

    with mounted(tmp_path / "ram", "ramfs") as directory:
        _check_writable("--dir", str(directory), directory)
    with pytest.raises(InvalidConfigError, match="not a writable directory"):
        _check_writable("--dir", "/proc/self", Path("/proc/self"))
