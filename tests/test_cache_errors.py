"""TieredCache input validation, disk-tier failures and no-loss guarantees, on a real model."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import traceback

import pytest
import torch
from helpers import tiny_tmpfs
from models import small_llama
from transformers import DynamicCache

from tierkv import (
    BudgetTooSmallError,
    CapacityError,
    DiskFullError,
    DiskTierError,
    InvalidConfigError,
    TieredCache,
)
from tierkv.blocks import Tier
from tierkv.units import parse_size


@pytest.fixture(scope="module")
def model():
    return small_llama()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"gpu_gb": "lots"}, "gpu_gb='lots' is not a size"),
    ({"cpu_gb": -1}, "negative"),
    ({"disk_gb": 1}, "without disk_dir"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"prefetch_depth": -1}, "prefetch_depth"),
    ({"prefetch_depth": 10**9}, "at most 64"),  # accepted: a warning asked for 65536000.0 MB more
    ({"policy": "nope"}, "valid policies"),
    ({"disk_dir": ""}, "empty path"),  # os.environ.get("UNSET", "") used to drop the disk tier silently
    ({"disk_dir": " "}, "empty path"),
])
def test_invalid_arguments(kwargs, match):
    with pytest.raises(InvalidConfigError, match=match):
        TieredCache(**kwargs)


def test_unwritable_disk_dir(tmp_path):
    target = tmp_path / "file-not-dir"
    target.write_text("x")
    with pytest.raises(DiskTierError, match="not writable") as info:
        TieredCache(disk_dir=target / "sub")
    assert isinstance(info.value, OSError)


def test_budget_below_minimum_is_refused_with_the_smaller_one_without_prefetch(model):
    """The error names the budget that reads a layer ahead, and says that less decodes without; that smaller
    minimum decodes exactly with prefetch_depth=0."""
    ids = torch.randint(0, 128, (1, 64))
    needed = TieredCache.min_device_bytes(model.config, context=64, block_tokens=4)
    with TieredCache(gpu_gb=f"{needed // 8}B", block_tokens=4) as cache, \
            pytest.raises(BudgetTooSmallError, match="raise gpu_gb") as info:
        model(ids, past_key_values=cache)
    assert "min_device_bytes(..., prefetch_depth=0)" in str(info.value)
    least = TieredCache.min_device_bytes(model.config, context=64, block_tokens=4, prefetch_depth=0)
    assert least < needed
    with TieredCache(gpu_gb=f"{least}B", block_tokens=4, prefetch_depth=0, config=model.config) as cache:
        torch.testing.assert_close(model(ids, past_key_values=cache).logits,
                                   model(ids, past_key_values=DynamicCache()).logits, atol=1e-5, rtol=0)


def test_kv_that_does_not_fit_keeps_accepted_tokens(model):
    """Decode until the budgets run out: the error names the fix and earlier tokens still read back."""
    ids = torch.randint(0, 128, (1, 16))
    with TieredCache(gpu_gb="40KB", cpu_gb="40KB", block_tokens=4) as cache:
        reference = DynamicCache()
        model(ids, past_key_values=cache)
        model(ids, past_key_values=reference)
        token = ids[:, -1:]
        with pytest.raises(CapacityError, match="pass disk_dir"):
            for _ in range(200):
                model(token, past_key_values=cache)
                model(token, past_key_values=reference)
        length = cache.get_seq_length()
        assert all(layer.get_seq_length() == length for layer in cache.layers)
        for index, layer in enumerate(reference.layers):
            stored = cache.store.read_tokens(index)
            torch.testing.assert_close(stored[0], layer.keys[..., :length, :], rtol=0, atol=0)
            torch.testing.assert_close(stored[1], layer.values[..., :length, :], rtol=0, atol=0)


def test_real_enospc_keeps_cache_consistent(model, tmp_path):
    """A disk tier on a 64 KiB tmpfs that another program fills up for real: decoding stops with DiskFullError
    and nothing is lost."""
    with tiny_tmpfs(tmp_path / "tiny", "64k") as mount:
        ids = torch.randint(0, 128, (1, 12))
        with TieredCache(gpu_gb="48KB", cpu_gb="24KB", disk_dir=mount, block_tokens=4) as cache:
            (mount / "other-program").write_bytes(bytes(40 * 1024))  # someone else fills the filesystem
            reference = DynamicCache()
            model(ids, past_key_values=cache)
            model(ids, past_key_values=reference)
            token = ids[:, -1:]
            with pytest.raises(DiskFullError, match="ran out of space") as info:
                for _ in range(400):
                    model(token, past_key_values=cache)
                    model(token, past_key_values=reference)
            assert info.value.errno == errno.ENOSPC
            assert cache.stats()["blocks"]["disk"] > 0
            length = cache.get_seq_length()
            for index, layer in enumerate(reference.layers):
                stored = cache.store.read_tokens(index)
                torch.testing.assert_close(stored[0], layer.keys[..., :length, :], rtol=0, atol=0)


def test_files_removed_on_close(model, tmp_path):
    ids = torch.randint(0, 128, (1, 40))
    with TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache:
        model(ids, past_key_values=cache)
        assert cache.store.tiers[Tier.DISK].used_bytes > 0
        assert list(tmp_path.glob("tierkv-*"))
    assert not list(tmp_path.glob("tierkv-*"))


def _spilled(disk_dir) -> str:
    """A script that decodes into a cache ``c`` whose blocks reached the disk tier in ``disk_dir``."""
    return (
        "import os, torch; from tierkv import TieredCache\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=1)).eval()\n"
        f"c = TieredCache(gpu_gb='40KB', cpu_gb='12KB', disk_dir={str(disk_dir)!r}, block_tokens=4)\n"
        "m(torch.randint(0, 64, (1, 40)), past_key_values=c)\n"
        "assert c.stats()['blocks']['disk'] > 0\n"
    )


def test_files_removed_at_interpreter_exit(tmp_path):
    subprocess.run([os.sys.executable, "-c", _spilled(tmp_path)], check=True, capture_output=True)
    assert not list(tmp_path.glob("tierkv-*"))


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root reads any directory")
def test_files_that_cannot_be_looked_at_on_close_are_warned_and_removed_at_exit(tmp_path):
    """``disk_dir`` made unsearchable (chmod 000) before close: the files could not even be looked at, which was
    taken for "already gone" (nothing logged, nothing retried). Now warned, and the K/V file removed at exit once
    the directory is searchable again (root runs without its override of file permissions)."""
    as_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--inh-caps=-all"] \
        if os.geteuid() == 0 else []
    script = _spilled(tmp_path) + f"os.chmod({str(tmp_path)!r}, 0)\nc.close()\nos.chmod({str(tmp_path)!r}, 0o700)\n"
    result = subprocess.run([*as_user, os.sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "could not remove the disk tier file" in result.stderr and "retrying at exit" in result.stderr
    assert "could not remove the lock file" in result.stderr
    assert not list(tmp_path.glob("tierkv-*.kv"))


def test_missing_disk_dir_is_created_with_a_real_budget(tmp_path):
    target = tmp_path / "a" / "b"
    with TieredCache(disk_dir=target) as cache:
        assert target.is_dir()
        assert cache.runtime.disk.budget > 0


def test_unsupported_layer_kinds_are_named(model):
    config = model.config.__class__(**model.config.to_dict())
    config.layer_types = ["full_attention", "indexed_attention"]
    with pytest.raises(InvalidConfigError, match="indexed_attention layers"):
        TieredCache(config=config)


# ------------------------------------------------------------- newcomer sweep 7, 8: one budget error, in its mode
def _named_budgets(message: str) -> list[str]:
    return re.findall(r'gpu_gb="([0-9]+B)"', message)


def _tracebacks(error: BaseException) -> int:
    """How many tracebacks Python prints for ``error`` (one per exception of its chain)."""
    return "".join(traceback.format_exception(error)).count("Traceback (most recent call last)")


def test_streaming_budget_error_names_shorter_chunks_that_fit(model):
    """Inside ``cache.streaming(model)`` a budget too small for its chunks is refused in streaming's terms: its
    minimum (min_streaming_device_bytes), and shorter chunks that fit (never "use cache.streaming", which is on);
    one exception, no chain; the chunk it names runs and matches DynamicCache."""
    ids = torch.randint(0, 128, (1, 128))
    budget = TieredCache.min_streaming_device_bytes(model.config, block_tokens=4, chunk_tokens=32)
    need = TieredCache.min_streaming_device_bytes(model.config, block_tokens=4, chunk_tokens=256)
    assert budget < need

    def stream(chunk_tokens: int) -> torch.Tensor:
        with TieredCache(gpu_gb=f"{budget}B", cpu_gb="64MB", block_tokens=4, config=model.config) as cache, \
                cache.streaming(model, chunk_tokens=chunk_tokens):
            return model(ids, past_key_values=cache).logits

    with pytest.raises(BudgetTooSmallError) as info:
        stream(256)
    message = str(info.value)
    assert _tracebacks(info.value) == 1, message
    assert "attend with cache.streaming(model)" not in message and "2 layers" in message, message
    assert _named_budgets(message) == [f"{need}B"], message
    chunk = re.search(r"cache\.streaming\(model, chunk_tokens=([0-9]+)\) fits this budget", message)
    assert chunk is not None and 32 <= int(chunk.group(1)) < 256, message
    expected = model(ids, past_key_values=DynamicCache()).logits
    torch.testing.assert_close(stream(int(chunk.group(1))), expected, atol=1e-5, rtol=0)


def test_gather_budget_error_gives_one_minimum_for_every_layer(model):
    """Exact gather, ``config=`` given: one minimum (min_device_bytes'), for the model's 2 layers; no chain."""
    ids = torch.randint(0, 128, (1, 256))
    need = TieredCache.min_device_bytes(model.config, context=256, block_tokens=4)
    with TieredCache(gpu_gb=f"{need // 4}B", cpu_gb="64MB", block_tokens=4, config=model.config) as cache, \
            pytest.raises(BudgetTooSmallError) as info:
        model(ids, past_key_values=cache)
    message = str(info.value)
    assert _tracebacks(info.value) == 1, message
    takes = re.findall(r"takes ([0-9.]+[KMG]?B)", message)  # the same minimum in the size grammar, rounded up
    assert _named_budgets(message) == [f"{need}B"] and len(takes) == 1 and parse_size(takes[0]) >= need, message
    assert "over 2 layers at 256 tokens" in message, message


def test_budget_error_without_config_counts_the_layers_it_has_seen(model):
    """Without ``config=`` the cache has seen one layer when the first one fails: said so (not "1 layers"), with
    the way to count them all."""
    with TieredCache(gpu_gb="1KB", cpu_gb="64MB", block_tokens=4) as cache, \
            pytest.raises(BudgetTooSmallError) as info:
        model(torch.randint(0, 128, (1, 64)), past_key_values=cache)
    message = str(info.value)
    assert "1 layers" not in message and "the 1 layer seen so far" in message, message
    assert "config=model.config" in message and len(_named_budgets(message)) == 1, message


def test_a_budget_for_fewer_rows_names_the_rows_and_the_batch_that_prices_them(model, tmp_path):
    """A budget priced for a batch of 2 and given beams over it (6 rows): the error names the rows and the
    ``batch=`` that gives their minimum, which then decodes exactly."""
    ids = torch.randint(2, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    options = dict(num_beams=3, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    short = TieredCache.min_device_bytes(model.config, 23, batch=2, block_tokens=4)
    with TieredCache(gpu_gb=f"{short}B", cpu_gb="64MB", block_tokens=4, config=model.config) as cache, \
            pytest.raises(BudgetTooSmallError) as info:
        model.generate(ids, past_key_values=cache, **options)
    message = str(info.value)
    assert "in 6 rows" in message and "with batch=6" in message, message
    need = TieredCache.min_device_bytes(model.config, 23, batch=6, block_tokens=4)
    with TieredCache(gpu_gb=f"{need}B", cpu_gb="64MB", block_tokens=4, config=model.config) as cache:
        out = model.generate(ids, past_key_values=cache, **options)
    assert torch.equal(out, model.generate(ids, past_key_values=DynamicCache(), **options))


@pytest.mark.parametrize("index", [torch.tensor([[0], [2]]), torch.tensor([0.0, 2.0]), torch.tensor([True, False])])
def test_rows_chosen_by_an_index_of_another_shape_are_refused_and_nothing_changes(model, tmp_path, index):
    """A 2-D or float index, or a mask of another length, selects nothing: refused with the form that works, and
    every token stays readable (a 2-D index was applied as fancy indexing: the layers could not be read)."""
    ids = torch.randint(2, 128, (3, 12), generator=torch.Generator().manual_seed(1))
    with TieredCache(gpu_gb="60KB", cpu_gb="6KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        model(ids, past_key_values=cache)
        before = [layer.keys.clone() for layer in cache.layers]
        with pytest.raises(InvalidConfigError, match=r"batch_select_indices\(torch.tensor\(\[0, 2\]\)\)|one entry "
                                                     r"per row of the batch \(3\)"):  # fmt: skip
            cache.batch_select_indices(index)
        assert all(torch.equal(layer.keys, keys) for layer, keys in zip(cache.layers, before))
        cache.batch_select_indices(torch.tensor([0, 2]))
        reference = DynamicCache()
        model(ids[[0, 2]], past_key_values=reference)
        step = torch.randint(2, 128, (2, 1))
        torch.testing.assert_close(model(step, past_key_values=cache).logits,
                                   model(step, past_key_values=reference).logits, atol=1e-5, rtol=0)


def test_a_filesystem_out_of_inodes_is_named_not_out_of_space(model, tmp_path):
    """Space left but no inode (another program's many small files): the error said "ran out of space ... lower
    disk_gb", which cannot help; it names the inodes now, and the prefill it stopped is taken back."""
    ids = torch.randint(0, 128, (1, 40))
    with tiny_tmpfs(tmp_path / "fs", "16M", inodes=16) as mount, \
            TieredCache(gpu_gb="48KB", cpu_gb="24KB", disk_dir=mount, block_tokens=4) as cache:
        taken = 0
        with pytest.raises(OSError):
            while True:
                (mount / f"other-{taken}").touch()
                taken += 1
        with pytest.raises(DiskFullError, match=r"no inodes left \(df -i"):
            model(ids, past_key_values=cache)
        assert cache.get_seq_length() == 0
        for name in range(taken):
            (mount / f"other-{name}").unlink()
        torch.testing.assert_close(model(ids, past_key_values=cache).logits,
                                   model(ids, past_key_values=DynamicCache()).logits, atol=1e-5, rtol=0)
