"""Arguments of the public API and the commands that would give a wrong number, a raw error from deep inside
(``decimal.InvalidOperation``, ``AttributeError``, a ``TypeError`` at the first decode), or an advice no one could
follow: each is refused up front with an :class:`~tierkv.errors.InvalidConfigError` that names the argument, the
value and the fix (or, on the command line, a one-line usage error, exit status 2)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import transformers
from models import tiny_model

from tierkv import InvalidConfigError, TieredCache
from tierkv.cli import build_parser, main
from tierkv.commands import bench_run
from tierkv.units import MAX_CHUNK_TOKENS, parse_size, parse_tokens

CONFIG = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=128)


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one-line error of ``tierkv ARGV`` run in this process (exit status 2)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------------ 1: numpy numbers as budgets
@pytest.mark.parametrize("budget", ["gpu_gb", "cpu_gb"])
def test_numpy_budgets_are_their_python_values(budget):
    """``np.float64(0.5)`` was a ``decimal.InvalidOperation`` (its repr is ``np.float64(0.5)``, no decimal), and
    numpy's ints were refused: both read as the Python number they hold."""
    with TieredCache(**{"gpu_gb": "64MB", "cpu_gb": "64MB", budget: np.float64(0.5)}) as cache:
        assert getattr(cache.runtime.budgets, budget.removesuffix("_gb")) == 500_000_000
    with TieredCache(**{"gpu_gb": "64MB", "cpu_gb": "64MB", budget: np.int64(1)}) as cache:
        assert getattr(cache.runtime.budgets, budget.removesuffix("_gb")) == 10**9


def test_numpy_and_other_real_numbers_parse_as_sizes_and_token_counts():
    assert parse_size(np.float64(0.5), name="disk_gb") == 500_000_000
    assert parse_size(np.float32(0.5), name="persist_gb") == 500_000_000
    assert parse_size(Fraction(1, 4)) == 250_000_000
    assert parse_tokens(np.int64(4096)) == parse_tokens(np.float64(4096.0)) == 4096


@pytest.mark.parametrize(("value", "needle"), [
    (np.float64("nan"), "is not finite"),
    (np.float64(-0.5), "is negative"),
    (np.int64(-1), "is negative"),
    (Fraction(10**400), "beyond any machine"),
    (True, "is a bool"),
    (np.bool_(True), "not bool"),
])
def test_bad_numbers_of_any_kind_are_refused_naming_the_budget(value, needle):
    with pytest.raises(InvalidConfigError, match="gpu_gb") as refused:
        TieredCache(gpu_gb=value, cpu_gb="64MB")
    assert needle in str(refused.value)


# ------------------------------------------------------------------------------ 2: the sizing helpers
@pytest.mark.parametrize("tokens", [-1, math.inf, math.nan, 1.5, None, "2K"])
def test_kv_bytes_held_refuses_what_is_no_token_count(tokens):
    """``kv_bytes_held(config, -1)`` was -512 bytes; inf and NaN came back as they went in."""
    with pytest.raises(InvalidConfigError, match=r"tokens must be an int >= 0"):
        TieredCache.kv_bytes_held(CONFIG, tokens)
    assert TieredCache.kv_bytes_held(CONFIG, 0) == 0


@pytest.mark.parametrize("bits", [-1, 3, 16, "4", 4.0, True])
def test_rest_copy_bytes_takes_the_rest_bits_sparse_takes(bits):
    """A rest copy of -1 or 3 bits was sized, though ``cache.sparse`` refuses them."""
    with pytest.raises(InvalidConfigError, match=r"rest_bits=.*give one of 0, 2, 4, 8"):
        TieredCache.rest_copy_bytes(CONFIG, 1024, bits)
    assert TieredCache.rest_copy_bytes(CONFIG, 1024, 0) == 0
    assert TieredCache.rest_copy_bytes(CONFIG, 1024, None) == TieredCache.rest_copy_bytes(CONFIG, 1024, 4) > 0


def test_rest_copy_bytes_refuses_a_negative_token_count():
    with pytest.raises(InvalidConfigError, match="tokens must be an int >= 0, got -1"):
        TieredCache.rest_copy_bytes(CONFIG, -1, 4)


@pytest.mark.parametrize("chunk", [0, -1, math.nan, None, "4K", MAX_CHUNK_TOKENS + 1])
def test_every_chunked_minimum_refuses_the_same_chunks(chunk):
    """``min_sparse_device_bytes(chunk_tokens=0)`` was a smaller budget than the default's; a chunk past any context
    asked for a budget no machine has."""
    for size in (lambda: TieredCache.min_sparse_device_bytes(CONFIG, 1024, chunk_tokens=chunk),
                 lambda: TieredCache.min_streaming_device_bytes(CONFIG, chunk_tokens=chunk),
                 lambda: TieredCache.min_split_device_bytes(CONFIG, chunk_tokens=chunk)):
        with pytest.raises(InvalidConfigError, match="chunk_tokens") as refused:
            size()
        assert "e.g. 4096" in str(refused.value)


SIZERS = {
    "min_device_bytes": lambda **kw: TieredCache.min_device_bytes(CONFIG, 1024, **kw),
    "min_streaming_device_bytes": lambda **kw: TieredCache.min_streaming_device_bytes(CONFIG, **kw),
    "min_split_device_bytes": lambda **kw: TieredCache.min_split_device_bytes(CONFIG, **kw),
    "min_sparse_device_bytes": lambda **kw: TieredCache.min_sparse_device_bytes(CONFIG, 1024, **kw),
    "kv_bytes_per_token": lambda **kw: TieredCache.kv_bytes_per_token(CONFIG, **kw),
    "kv_bytes_held": lambda **kw: TieredCache.kv_bytes_held(CONFIG, 1024, **kw),
    "rest_copy_bytes": lambda **kw: TieredCache.rest_copy_bytes(CONFIG, 1024, 4, **kw),
}
WITH_DEVICE = ("min_device_bytes", "min_streaming_device_bytes", "min_split_device_bytes", "min_sparse_device_bytes")


@pytest.mark.parametrize("helper", SIZERS)
@pytest.mark.parametrize("dtype", ["xyz", 5, "Tensor", float])
def test_every_sizing_helper_refuses_what_is_no_torch_dtype(helper, dtype):
    """``dtype='xyz'`` was ``AttributeError: module 'torch' has no attribute 'xyz'``, ``dtype=5`` one about
    ``itemsize``."""
    with pytest.raises(InvalidConfigError, match=r"dtype=.* is not a torch dtype; give .*torch\.bfloat16"):
        SIZERS[helper](dtype=dtype)


@pytest.mark.parametrize("helper", SIZERS)
def test_every_sizing_helper_takes_a_dtype_or_its_name(helper):
    assert SIZERS[helper](dtype=torch.float16) == SIZERS[helper](dtype="float16") \
        == SIZERS[helper](dtype="torch.float16")


@pytest.mark.parametrize("helper", WITH_DEVICE)
@pytest.mark.parametrize("device", ["xyz", 5])
def test_every_minimum_refuses_what_is_no_torch_device(helper, device):
    """A device torch cannot parse was its ``RuntimeError`` (``5`` one about a missing accelerator)."""
    with pytest.raises(InvalidConfigError, match=r"device=.* is not a torch device; give e\.g\. 'cuda'"):
        SIZERS[helper](device=device)
    assert SIZERS[helper](device="cpu") == SIZERS[helper](device=torch.device("cpu"))


def test_the_sparse_minimum_refuses_a_record_past_that_is_no_bool():
    with pytest.raises(InvalidConfigError, match="record_past must be True or False, got None"):
        TieredCache.min_sparse_device_bytes(CONFIG, 1024, record_past=None)


def test_a_bool_prefetch_depth_is_refused():
    """``prefetch_depth=True`` was taken as one layer read ahead."""
    with pytest.raises(InvalidConfigError, match="prefetch_depth must be an int >= 0 or 'auto', got True"):
        TieredCache(gpu_gb="64MB", cpu_gb="64MB", prefetch_depth=True)


# ------------------------------------------------------------------------------ 3, 4: the attention modes
@pytest.mark.parametrize(("arguments", "needle"), [
    ({"dense_layers": None}, "sparse dense_layers=None must be an int >= 0"),
    ({"rest_means": "x"}, "sparse rest_means='x' must be True or False"),
    ({"rest_means": 1}, "sparse rest_means=1 must be True or False"),
    ({"rest_means": True}, "pass rest_bits=0 with rest_means=True"),
    ({"rest_means": True, "rest_bits": 8}, "rest_bits=8 keeps"),
    ({"rest_bits": "4"}, "sparse rest_bits='4': give one of 0, 2, 4, 8"),
    ({"chunk_tokens": MAX_CHUNK_TOKENS + 1}, f"is more than {MAX_CHUNK_TOKENS:,} tokens"),
])
def test_sparse_refuses_each_bad_argument_when_called(arguments, needle):
    """``dense_layers=None`` was a ``TypeError`` at the first decode step; ``rest_means`` was never looked at (a
    rest copy, the default, made it do nothing)."""
    model = tiny_model("llama")
    with TieredCache(gpu_gb="64MB", cpu_gb="64MB") as cache:
        with pytest.raises(InvalidConfigError) as refused:
            cache.sparse(model, **arguments)
        assert needle in str(refused.value)
        with cache.sparse(model, rest_bits=0, rest_means=True):  # the cache is as it was
            pass


@pytest.mark.parametrize("mode", ["streaming", "split", "sparse"])
def test_a_chunk_past_any_context_is_refused_before_a_step(mode):
    """``cache.streaming(model, chunk_tokens=2**63)`` reached the first step, whose budget error asked for some
    5e21 bytes (more than any size parses to)."""
    model = tiny_model("llama")
    with TieredCache(gpu_gb="64MB", cpu_gb="64MB") as cache:
        for chunk in (MAX_CHUNK_TOKENS + 1, 2**63):
            with pytest.raises(InvalidConfigError, match=r"chunk_tokens=.* is more than 16,777,216 tokens.*e\.g\. "):
                getattr(cache, mode)(model, chunk_tokens=chunk)
        with getattr(cache, mode)(model, chunk_tokens=MAX_CHUNK_TOKENS):
            pass


# ------------------------------------------------------------------------------ 5: empty values on the command line
@pytest.mark.parametrize("argv", [
    ["demo", "--disk-dir", ""],
    ["demo", "--disk-dir", "  "],
    ["demo", "--prompt-file", ""],
    ["demo", "--model", ""],
    ["eval", "--disk-dir", ""],
    ["eval", "--out", ""],
    ["bench", "--dir", ""],
    ["plan", "--model", "llama-3-8b", "--context", "8K", "--gpu-gb", "20", "--cpu-gb", "64", "--profile", ""],
])
def test_an_empty_path_is_a_usage_error_while_parsing(argv, capsys):
    """``--disk-dir ""`` was the current directory (``Path("")``): the demo ran there; ``--profile ""`` planned with
    the presets as if it had been left out. Parsed only: nothing runs, refused or not."""
    with pytest.raises(SystemExit) as exited:
        build_parser(argv[0]).parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"{argv[-2]} {argv[-1]!r} names no path" in err, err


def test_an_empty_engine_list_is_refused_before_measuring(tmp_path):
    """``--engines ""`` measured every engine, as if it had been left out."""
    args = build_parser("bench").parse_args(["bench", "--quick", "--dir", str(tmp_path), "--engines", ""])
    with pytest.raises(InvalidConfigError, match="--engines '' names no disk engine; give one or more of"):
        bench_run._config(args)


@pytest.mark.parametrize("command", [["demo"], ["eval"], ["plan", "--model", "llama-3-8b", "--context", "8K",
                                                            "--gpu-gb", "20", "--cpu-gb", "64"]])
def test_a_chunk_past_any_context_is_a_usage_error(command, capsys):
    err = _cli_error(capsys, [*command, "--chunk-tokens", "32M"])
    assert "--chunk-tokens='32M' is more than 16,777,216 tokens" in err
