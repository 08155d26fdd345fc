"""Size parsing, and the checks TieredCache runs when it is built (tierkv.hf.sizing)."""

import shutil

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from tierkv import TieredCache, settings
from tierkv.errors import InvalidConfigError, TierKVError
from tierkv.hf.sizing import (
    check_budgets_fit_machine,
    check_count,
    check_disk_engine,
    check_model_config,
)
from tierkv.io.select import engine_status
from tierkv.units import parse_size


@pytest.mark.parametrize(("value", "expected"), [
    (20, 20 * 10**9), (0.5, 5 * 10**8), ("512MB", 512 * 10**6), ("20GiB", 20 * 2**30), ("1.5 gb", 1_500_000_000),
    ("4096", 4096 * 10**9), ("64KiB", 65536), ("0", 0),
])
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["12 apples", "-1GB", -3, float("nan"), True, None, "GB"])
def test_parse_size_rejects(value):
    with pytest.raises(InvalidConfigError, match="gpu_gb") as info:
        parse_size(value, name="gpu_gb")
    assert isinstance(info.value, ValueError) and isinstance(info.value, TierKVError)


def _tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1)


def test_model_instead_of_its_config_names_the_fix():
    check_model_config(_tiny_config())
    with pytest.raises(InvalidConfigError, match=r"pass its config: config=model.config"):
        check_model_config(LlamaForCausalLM(_tiny_config()))
    with pytest.raises(InvalidConfigError, match="PreTrainedConfig"):
        check_model_config({"num_hidden_layers": 2})


def test_budget_beyond_the_machine_names_its_memory(tmp_path):
    check_budgets_fit_machine(2**20, 2**20, 2**20, tmp_path)
    bytes_as_gb = r"gpu_gb is 8,000,000 GB \(.*PiB\) but this machine has .* of RAM.*byte count"
    with pytest.raises(InvalidConfigError, match=bytes_as_gb):
        check_budgets_fit_machine(parse_size(8_000_000), None, None, None)  # 8 PB: bytes passed as GB
    with pytest.raises(InvalidConfigError, match="cpu_gb"):
        check_budgets_fit_machine(None, 2**62, None, None)
    with pytest.raises(InvalidConfigError, match="cpu_gb") as caught:  # GB asked for: no hint about bytes
        check_budgets_fit_machine(None, parse_size(100_000), None, None)
    assert "cpu_gb is 100,000 GB (" in str(caught.value) and "byte count" not in str(caught.value)
    with pytest.raises(InvalidConfigError, match="filesystem under"):
        check_budgets_fit_machine(None, None, 2**62, tmp_path / "not" / "yet")


def test_a_disk_budget_beyond_the_free_space_is_refused_with_the_free_figure(tmp_path):
    """Larger than what is free (not than the filesystem): it would fill the disk mid-generation, so it is refused
    at construction with the free figure and the fix; up to the free space is accepted."""
    usage = shutil.disk_usage(tmp_path)
    check_budgets_fit_machine(None, None, usage.free // 2, tmp_path)
    if usage.total - usage.free < 2**30:
        pytest.skip("this filesystem is nearly empty: no budget lies between its free space and its size")
    between = usage.free + (usage.total - usage.free) // 2
    with pytest.raises(InvalidConfigError, match=r"but only [0-9.]+ [KMGT]iB are free on the filesystem under .* "
                                                 r"\(of [0-9.]+ [KMGT]iB\); free some space, give a smaller disk_gb"):
        TieredCache(disk_dir=tmp_path, disk_gb=f"{between}B")
    assert not list(tmp_path.iterdir())  # refused before any file was made


def test_disk_engine_names_are_checked_up_front(monkeypatch):
    check_disk_engine(None)
    check_disk_engine("auto")
    check_disk_engine("posix")
    with pytest.raises(InvalidConfigError, match="'io_uring' is not a disk engine; choose one of kvikio, native"):
        check_disk_engine("io_uring")

    if engine_status()["kvikio"] is None:
        pytest.skip("kvikio loads on this host")
    with settings.override(disk_engine="kvikio"), pytest.raises(InvalidConfigError, match="cannot load.*'auto'"):
        check_disk_engine(None)  # a forced engine that cannot load here (no GPU / no kvikio)
    monkeypatch.setenv("TIERKV_DISK_ENGINE", "kvikio")  # the fix of a variable is said in the variable's words
    with pytest.raises(InvalidConfigError, match="cannot load.*unset TIERKV_DISK_ENGINE"):
        check_disk_engine(None)


def test_check_count():
    assert check_count(3, name="batch") == 3
    for bad in (0, True, 1.0, "2"):
        with pytest.raises(InvalidConfigError, match="batch must be an int >= 1"):
            check_count(bad, name="batch")


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(gpu_gb=8_000_000), "but this machine has"),
    (dict(gpu_gb=10**400), "beyond any machine"),
    (dict(config="model"), "PreTrainedConfig"),
    (dict(disk_engine="posix"), "disk_engine was given without disk_dir"),
])  # fmt: skip
def test_tiered_cache_refuses_at_construction(kwargs, needle):
    from tierkv import TieredCache

    with pytest.raises(InvalidConfigError, match=needle):
        TieredCache(**kwargs)


def test_tiered_cache_refuses_unknown_engine_and_model_as_config(tmp_path):
    from tierkv import TieredCache

    with pytest.raises(InvalidConfigError, match="'io_uring' is not a disk engine"):
        TieredCache(disk_dir=tmp_path, disk_engine="io_uring")
    with pytest.raises(InvalidConfigError, match="config=model.config"):
        TieredCache(config=LlamaForCausalLM(_tiny_config()))
    with pytest.raises(InvalidConfigError, match="config=model.config"):
        TieredCache.min_device_bytes(LlamaForCausalLM(_tiny_config()), 1024)


@pytest.mark.parametrize("bad", [True, 0, -4, 2.5, "16"])
def test_block_tokens_must_be_a_positive_int(bad):
    from tierkv import TieredCache

    with pytest.raises(InvalidConfigError, match="block_tokens"):
        TieredCache(gpu_gb="1MB", block_tokens=bad)
