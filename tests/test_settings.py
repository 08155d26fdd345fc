"""``tierkv.settings``: environment, defaults, scoped overrides and the errors of bad values."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache, settings, stats
from tierkv.cli import main
from tierkv.errors import InvalidConfigError
from tierkv.hf import cache_keyword
from tierkv.inputs import MAX_JSON_BYTES
from tierkv.io import ALIGN, ENGINES

pytestmark = pytest.mark.usefixtures("no_tierkv_env")  # the environment's TIERKV_* knobs: none


def test_defaults_are_typed() -> None:
    assert settings.get("disk_engine") == "auto"
    assert settings.get("direct_io") is None
    assert settings.get("io_queue_depth") == 16
    assert settings.get("io_chunk") == 4 << 20
    assert settings.get("profile") is None and settings.get("trace") is None
    assert settings.get("debug") is False
    assert isinstance(settings.get("cache_dir"), Path)
    assert settings.source("io_chunk") == "default"


def test_environment_is_read_and_parsed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIERKV_DISK_ENGINE", " Posix ")
    monkeypatch.setenv("TIERKV_DIRECT_IO", "0")
    monkeypatch.setenv("TIERKV_IO_QUEUE_DEPTH", "4")
    monkeypatch.setenv("TIERKV_IO_CHUNK", "1MiB")
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TIERKV_TRACE", str(tmp_path / "trace.json"))
    monkeypatch.setenv("TIERKV_DEBUG", "yes")
    assert settings.get("disk_engine") == "posix" and settings.get("direct_io") is False
    assert settings.get("io_queue_depth") == 4 and settings.get("io_chunk") == 1 << 20
    assert settings.get("cache_dir") == tmp_path and settings.get("trace") == tmp_path / "trace.json"
    assert settings.get("debug") is True
    assert settings.source("io_queue_depth") == "TIERKV_IO_QUEUE_DEPTH=4"
    monkeypatch.setenv("TIERKV_DIRECT_IO", "auto")
    assert settings.get("direct_io") is None
    monkeypatch.setenv("TIERKV_DEBUG", "")  # empty counts as unset
    assert settings.get("debug") is False


def test_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert settings.get("cache_dir") == tmp_path / "tierkv"


@pytest.mark.parametrize("value", ["~/.cache", "relcache", "./x"])
def test_a_relative_xdg_cache_home_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str) -> None:
    """Regression: an unexpanded ``XDG_CACHE_HOME=~/.cache`` (a systemd unit, a Dockerfile ENV) made the build cache
    ``./~/.cache/tierkv`` wherever the process ran (a folder named ``~``: ``rm -rf ~`` then deletes the home).
    Relative values are ignored, as the XDG spec says."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", value)
    assert settings.get("cache_dir") == tmp_path / ".cache" / "tierkv"


def test_override_beats_the_environment_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERKV_DISK_ENGINE", "native")
    with settings.override(disk_engine="posix", direct_io=False):
        assert settings.get("disk_engine") == "posix" and settings.get("direct_io") is False
        assert settings.source("disk_engine") == "override(disk_engine='posix')"
    assert settings.get("disk_engine") == "native" and settings.get("direct_io") is None


def test_nested_overrides_restore_in_any_exit_order() -> None:
    with settings.override(io_queue_depth=2):
        with settings.override(io_queue_depth=3, io_chunk=ALIGN):
            assert (settings.get("io_queue_depth"), settings.get("io_chunk")) == (3, ALIGN)
        assert (settings.get("io_queue_depth"), settings.get("io_chunk")) == (2, 4 << 20)
    assert settings.get("io_queue_depth") == 16
    outer, inner = settings.override(io_queue_depth=5), settings.override(io_queue_depth=6)
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # the outer block ends first (another thread's, say)
    assert settings.get("io_queue_depth") == 6
    inner.__exit__(None, None, None)
    assert settings.get("io_queue_depth") == 16


def test_override_is_seen_by_other_threads_and_restored_on_error() -> None:
    seen: list[int] = []
    with pytest.raises(RuntimeError), settings.override(io_queue_depth=7):
        worker = threading.Thread(target=lambda: seen.append(settings.get("io_queue_depth")))
        worker.start()
        worker.join()
        raise RuntimeError
    assert seen == [7] and settings.get("io_queue_depth") == 16


def test_override_can_turn_an_environment_trace_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIERKV_TRACE", str(tmp_path / "t.json"))
    with settings.override(trace=None):
        assert settings.get("trace") is None


@pytest.mark.parametrize(
    ("variable", "raw", "reason"),
    [
        ("TIERKV_DISK_ENGINE", "gds", "is not a disk engine"),
        ("TIERKV_DIRECT_IO", "maybe", "must be 1 (on), 0 (off) or auto"),
        ("TIERKV_IO_QUEUE_DEPTH", "0", "positive integer"),
        ("TIERKV_IO_QUEUE_DEPTH", "many", "positive integer"),
        ("TIERKV_IO_QUEUE_DEPTH", "²", "positive integer"),  # str.isdigit() is True, int() refuses it
        ("TIERKV_IO_QUEUE_DEPTH", "1²", "positive integer"),
        ("TIERKV_IO_QUEUE_DEPTH", "9" * 5000, "positive integer"),  # int() refuses over 4,300 digits itself
        ("TIERKV_CACHE_DIR", "~no-such-user-of-tierkv/cache", "whose home directory cannot be found"),
        ("TIERKV_IO_CHUNK", "6KiB", f"multiple of {ALIGN}"),
        ("TIERKV_IO_CHUNK", "big", "is not a size"),
        ("TIERKV_DEBUG", "loud", "must be 1 or 0"),
    ],
)
def test_bad_environment_names_the_variable_and_an_example(
    monkeypatch: pytest.MonkeyPatch, variable: str, raw: str, reason: str
) -> None:
    monkeypatch.setenv(variable, raw)
    name = next(s.name for s in settings.SETTINGS.values() if s.variable == variable)
    with pytest.raises(InvalidConfigError) as info:
        settings.get(name)
    message = str(info.value)
    assert f"{variable}={raw!r}" in message and reason in message
    assert f"e.g. {variable}={settings.SETTINGS[name].example}" in message


def test_bad_override_is_refused_before_anything_changes() -> None:
    bad_chunk = r"override\(io_chunk=5000\).*e\.g\. TIERKV_IO_CHUNK=4MiB"
    with pytest.raises(InvalidConfigError, match=bad_chunk), settings.override(io_queue_depth=2, io_chunk=5000):
        pass
    assert settings.get("io_queue_depth") == 16
    unknown = "unknown tierkv setting 'disk'.*disk_engine"
    with pytest.raises(InvalidConfigError, match=unknown), settings.override(disk="posix"):
        pass
    with pytest.raises(InvalidConfigError, match="positive integer"), settings.override(io_queue_depth=True):
        pass


def test_vocabulary_matches_the_io_package() -> None:
    """The engine names and the chunk alignment the settings check are those tierkv.io uses."""
    assert settings.DISK_ENGINES == ENGINES
    with settings.override(io_chunk=3 * ALIGN):
        assert settings.get("io_chunk") == 3 * ALIGN
    with pytest.raises(InvalidConfigError), settings.override(io_chunk=ALIGN // 2):
        pass


def test_every_tierkv_variable_is_a_setting() -> None:
    """No module of the package reads a TIERKV_* variable behind the settings' back."""
    direct_read = re.compile(r"""(environ\b|getenv|env_str)\W{0,8}["']TIERKV_""")
    package = Path(settings.__file__).parent
    offenders = [p.name for p in package.rglob("*.py") if p.name != "settings.py" and direct_read.search(p.read_text())]
    assert not offenders


def _alarm(signum: int, frame: object) -> None:
    raise TimeoutError("reading TIERKV_PROFILE hung")


@pytest.mark.parametrize(("kind", "problem"), [
    ("directory", "is a directory"),
    ("FIFO", "is a FIFO"),
    ("oversized", f"larger than {MAX_JSON_BYTES >> 20} MiB"),
    ("deeply nested", "would take about [0-9]+ MiB of memory to parse"),
])  # fmt: skip
def test_a_profile_that_is_no_json_file_is_refused_when_the_cache_is_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str, problem: str
) -> None:
    """Sweep finding 4: ``TIERKV_PROFILE`` naming a directory was a bare IsADirectoryError, a FIFO hung the first
    forward for ever, and any size was read whole. Each is an InvalidConfigError naming the variable, the path
    and the fix; the path is left as it was, and a real profile there is then used and decodes exactly."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 12)
    path = tmp_path / "profile.json"
    real = tmp_path / "real.json"
    stats.default_profile("cpu").save(real)
    if kind == "directory":
        path.mkdir()
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "oversized":  # a valid profile, padded: only its size is wrong
        path.write_bytes(real.read_bytes() + b" " * MAX_JSON_BYTES)
    else:
        path.write_text("[" * 200_000 + "]" * 200_000)
    monkeypatch.setenv("TIERKV_PROFILE", str(path))
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        with pytest.raises(InvalidConfigError, match=problem) as info, TieredCache(block_tokens=4) as cache:
            model(ids, **{cache_keyword(model): cache})
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    message = str(info.value)
    assert f"{str(path)!r} (TIERKV_PROFILE)" in message and "or unset TIERKV_PROFILE" in message
    assert path.exists() and (kind != "FIFO" or path.is_fifo())
    monkeypatch.setenv("TIERKV_PROFILE", str(real))
    with TieredCache(block_tokens=4) as cache:
        logits = model(ids, **{cache_keyword(model): cache}).logits
        assert cache.runtime.timeline.profile_source == f"TIERKV_PROFILE={real}"
    assert (logits - model(ids, past_key_values=DynamicCache()).logits).abs().max() <= 1e-5


def test_a_profile_on_a_device_is_never_read(tmp_path: Path) -> None:
    """Sweep finding 4: ``TIERKV_PROFILE=/dev/zero`` read until memory ran out. In a process limited to 2 GiB of
    address space it is refused at once, naming the variable."""
    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from tierkv import stats\n"
        "try:\n"
        "    stats.resolve_profile(None, 'cpu')\n"
        "except BaseException as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TIERKV_PROFILE": "/dev/zero"},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("InvalidConfigError link profile '/dev/zero' (TIERKV_PROFILE) is a character "
                                 "device"), out.stdout + out.stderr


def test_a_bad_knob_or_profile_is_refused_when_the_cache_is_built(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """Knobs a cache reads only in its first forward, and ``profile=``, are checked when it is built: a prefill
    is not computed to be given back."""
    monkeypatch.setenv("TIERKV_DIRECT_IO", "maybe")
    with pytest.raises(InvalidConfigError, match="TIERKV_DIRECT_IO='maybe' must be 1"):
        TieredCache()
    monkeypatch.delenv("TIERKV_DIRECT_IO")
    with pytest.raises(InvalidConfigError, match="does not exist; create one with `tierkv bench`"):
        TieredCache(profile=tmp_path / "nope.json")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(InvalidConfigError, match="is malformed"):
        TieredCache(profile=tmp_path / "empty.json")


def test_a_bad_knob_read_when_the_first_layer_steps_is_one_clean_error(tmp_path):
    """``TIERKV_PREFETCH_MIN`` (read when the exact executor is built) is refused with the variable named when the
    cache is built, and nothing half-built is left for close() to fail on (it logged "close failed ... no attribute
    'pending'"). A process of its own: the suite overrides the setting."""
    script = tmp_path / "step.py"
    script.write_text(
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from tierkv import TieredCache, InvalidConfigError\n"
        "config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        "                     num_attention_heads=4, num_key_value_heads=2)\n"
        "model = LlamaForCausalLM(config).eval()\n"
        "try:\n"
        "    with TieredCache(gpu_gb='64MB', cpu_gb='64MB', config=config) as cache:\n"
        "        model.generate(torch.ones(1, 10, dtype=torch.long), cache=cache, max_new_tokens=2)\n"
        "except InvalidConfigError as error:\n"
        "    print('refused:', error)\n")
    env = {**os.environ, "TIERKV_PREFETCH_MIN": "-1"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("refused: TIERKV_PREFETCH_MIN"), result
    assert "close failed" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_misspelt_variable_is_warned_about_once_with_the_closest_name(monkeypatch, capsys):
    """A ``TIERKV_*`` variable that names no setting was silently ignored (``TIERKV_PREFETCHMIN=0`` left
    prefetching as it was); the benchmarks' own ``TIERKV_BENCH_*`` are not settings and say nothing."""
    monkeypatch.setattr(settings, "_reported", set())
    monkeypatch.setenv("TIERKV_PREFETCHMIN", "0")
    monkeypatch.setenv("TIERKV_BENCH_ROUNDS", "3")
    with pytest.warns(UserWarning, match="TIERKV_PREFETCHMIN is not a tierkv setting and is ignored; did you mean "
                                         "TIERKV_PREFETCH_MIN") as caught:  # fmt: skip
        settings.check_all()
    assert len(caught) == 1
    settings.check_all()  # once per process
    monkeypatch.setattr(settings, "_reported", set())
    assert main(["plan", "--model", "llama-3-8b", "--context", "8K", "--gpu-gb", "20", "--cpu-gb", "64"]) == 0
    assert "tierkv: warning: TIERKV_PREFETCHMIN is not a tierkv setting" in capsys.readouterr().err


def test_describe_names_a_misspelt_variable_every_time(monkeypatch):
    """``describe()`` is where a user looks when a variable seems to have no effect: it lists each ``TIERKV_*``
    variable that names no setting, also once the one-time warning has been given."""
    monkeypatch.setenv("TIERKV_DISK_ENGNE", "posix")
    monkeypatch.setenv("TIERKV_BENCH_ROUNDS", "3")
    settings.unknown_variables()  # the warning's turn: describe() still names it
    for _ in range(2):
        text = str(settings.describe())
        assert "TIERKV_DISK_ENGNE is not a tierkv setting and is ignored; did you mean TIERKV_DISK_ENGINE?" in text
        assert "TIERKV_BENCH_ROUNDS" not in text
    assert "TIERKV_DISK_ENGNE" not in settings.describe()  # still a dict of the settings only
