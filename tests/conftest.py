"""Fixtures for every test: the suite prefetches everything, so the prefetch paths run at test sizes."""

from __future__ import annotations

import pytest
from redis_server import redis_cluster, redis_factory, redis_server  # noqa: F401  (fixtures of the remote tier)

from tierkv import settings


@pytest.fixture(autouse=True)
def prefetch_every_layer():
    """Tests use small layers, which the runtime would read without prefetching (``prefetch_min``)."""
    with settings.override(prefetch_min=0):
        yield
