"""``cache.stats()`` as Prometheus metrics, for servers (``pip install 'tierkv[metrics]'``).

    from prometheus_client import start_http_server
    import tierkv.metrics

    tierkv.metrics.register(cache, model="smollm2")   # the default registry; labels are optional
    tierkv.metrics.register(other, model="qwen3")     # more caches: the same families, told apart by labels
    start_http_server(9100, addr="127.0.0.1")          # http://127.0.0.1:9100/metrics; its default binds
                                                       # every interface (a proxy or firewall for remote scrapes)

Each registry gets one :class:`CacheCollector`, which yields every family once with the samples of every live
cache registered on it (two caches with the same labels are refused: their series would collide). It reads
``cache.stats()`` when Prometheus scrapes, so a decode loop pays nothing between scrapes. The registry holds its
caches weakly: keep a reference to a cache while it is to be scraped. A closed or collected cache is dropped
from the collector at the next scrape or registration, so its series end (Prometheus marks them stale); its
final counters stay readable in ``cache.stats()``.

Every metric carries the counters of :class:`tierkv.stats.CacheStats` under the name Prometheus' conventions
give it (base units, ``_total`` for counters, monotonic for a cache's life):

==========================================  =======  =============================================
metric                                      type     from ``stats()``
==========================================  =======  =============================================
``tierkv_tokens``                           gauge    ``tokens``
``tierkv_resident_bytes{tier}``             gauge    ``bytes_resident``
``tierkv_blocks{tier}``                     gauge    ``blocks``
``tierkv_allocated_bytes{tier}``            gauge    ``bytes_allocated``
``tierkv_peak_allocated_bytes{tier}``       gauge    ``peak_bytes_allocated``
``tierkv_budget_bytes{tier}``               gauge    ``budget_bytes``
``tierkv_staging_bytes``                    gauge    ``bytes_staging``
``tierkv_summaries_bytes``                  gauge    ``bytes_summaries``
``tierkv_rest_copy_bytes``                  gauge    ``bytes_rest_copy``
``tierkv_state_bytes``                      gauge    ``state_bytes``
``tierkv_moved_bytes_total{link}``          counter  ``bytes_moved``
``tierkv_prefetch_hits_total``              counter  ``prefetch_hits``
``tierkv_prefetch_misses_total``            counter  ``prefetch_misses``
``tierkv_prefetch_stall_seconds_total``     counter  ``prefetch_stall_s``
``tierkv_disk_read_ahead_hits_total``       counter  ``disk_read_ahead_hits``
``tierkv_writeback_pending_blocks``         gauge    ``writeback["pending_blocks"]``
``tierkv_prefetch_depth``                   gauge    ``prefetch_depth`` (0 while prefetch is off)
``tierkv_decode_step_seconds``              gauge    ``steps["median"]["wall_s"]`` (median, last 256)
==========================================  =======  =============================================
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from tierkv.errors import InvalidConfigError

try:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as exc:  # the optional extra
    raise ImportError("tierkv.metrics needs prometheus_client: pip install 'tierkv[metrics]'") from exc

_PER_TIER = (("resident_bytes", "bytes_resident", "KV bytes held"), ("blocks", "blocks", "blocks held"),
             ("allocated_bytes", "bytes_allocated", "bytes allocated (whole slots and chunks)"),
             ("peak_allocated_bytes", "peak_bytes_allocated", "high-water mark of the allocated bytes"),
             ("budget_bytes", "budget_bytes", "budget"))
_GAUGES = (("staging_bytes", "bytes_staging", "device bytes reserved for staging buffers, key summaries and the "
            "rest copy"),
           ("summaries_bytes", "bytes_summaries", "device bytes of sparse attention's key summaries"),
           ("rest_copy_bytes", "bytes_rest_copy", "device bytes of sparse attention's low-bit copy of the rest"),
           ("prefetch_depth", "prefetch_depth", "layers prefetched ahead now (0 while prefetch is off)"))
_COUNTERS = (("prefetch_hits", "prefetch_hits", "layer reads whose data a prefetch had ready"),
             ("prefetch_misses", "prefetch_misses", "prefetched reads not used (failed, stale after a table edit, "
              "or of another range): their bytes were read for nothing"),
             ("prefetch_stall_seconds", "prefetch_stall_s", "time the model waited for prefetched data"),
             ("disk_read_ahead_hits", "disk_read_ahead_hits", "reads whose disk part was already in flight"))
_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("tokens", "gauge", "tokens the cache holds (sequence length)"),
    *((name, "gauge", f"per tier: {doc}") for name, _, doc in _PER_TIER),
    *((name, "gauge", doc) for name, _, doc in _GAUGES),
    ("state_bytes", "gauge", "device bytes of recurrent state (layers that keep it)"),
    ("moved_bytes", "counter", "bytes moved per link"),
    *((name, "counter", doc) for name, _, doc in _COUNTERS),
    ("writeback_pending_blocks", "gauge", "blocks in flight to disk"),
    ("decode_step_seconds", "gauge", "median wall time of the last decode steps"))
_DOCS = {name: (kind, doc) for name, kind, doc in _FAMILIES}


def _samples(stats: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(family, extra labels, value)`` of one cache's ``stats()``, in :data:`_FAMILIES` order."""
    yield "tokens", {}, stats.get("tokens", 0)
    for name, key, _ in _PER_TIER:
        for tier, value in stats.get(key, {}).items():
            yield name, {"tier": tier}, value
    for name, key, _ in _GAUGES:
        if stats.get(key) is not None:
            yield name, {}, stats[key]
    yield "state_bytes", {}, stats.get("state_bytes", 0)
    for link, value in stats.get("bytes_moved", {}).items():
        yield "moved_bytes", {"link": link}, value
    for name, key, _ in _COUNTERS:
        if key in stats:
            yield name, {}, stats[key]
    if "writeback" in stats:
        yield "writeback_pending_blocks", {}, stats["writeback"]["pending_blocks"]
    wall = stats.get("steps", {}).get("median", {}).get("wall_s")
    if wall is not None:
        yield "decode_step_seconds", {}, wall


def _live(cache: Any) -> bool:
    """Whether a registered cache is still scraped: not collected, not closed."""
    return cache is not None and not getattr(cache, "closed", False)


def _family(name: str) -> Metric:
    kind, doc = _DOCS[name]
    family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return family(f"tierkv_{name}", doc)


class CacheCollector:
    """The Prometheus collector of one registry: each family once, with the samples of every live cache
    registered on it (held weakly, told apart by their labels)."""

    def __init__(self) -> None:
        self._caches: list[tuple[weakref.ref[Any], dict[str, str]]] = []
        self._lock = threading.Lock()

    def add(self, cache: Any, labels: Mapping[str, str]) -> None:
        """Scrape ``cache`` too, its samples labelled ``labels`` (refused if a live cache has the same labels)."""
        labels = dict(labels)
        for name in labels:
            if name in ("tier", "link") or not name.isidentifier():
                raise InvalidConfigError(f"metrics label {name!r} is reserved or not a valid name; use another.")
        with self._lock:
            self._prune()
            if any(other == labels for _, other in self._caches):
                raise InvalidConfigError(f"a cache with the labels {labels} is registered already; give each cache "
                                         "of a registry its own labels (e.g. model=...).")
            self._caches.append((weakref.ref(cache), labels))

    def _prune(self) -> None:
        """Forget the caches collected or closed (under the lock), so the registry does not grow with them."""
        self._caches = [(ref, labels) for ref, labels in self._caches if _live(ref())]

    def describe(self) -> Iterator[Metric]:
        """Every family this collector may yield (the registry checks names against other collectors')."""
        for name, _, _ in _FAMILIES:
            yield _family(name)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._prune()
            entries = list(self._caches)
        families: dict[str, Metric] = {}
        for ref, labels in entries:
            cache = ref()
            if cache is None or not _live(cache):
                continue
            for name, extra, value in _samples(cache.stats()):
                family = families.get(name)
                if family is None:
                    family = families[name] = _family(name)
                sample = f"{family.name}_total" if family.type == "counter" else family.name
                family.add_sample(sample, {**labels, **extra}, value)
        yield from (families[name] for name, _, _ in _FAMILIES if name in families)


_COLLECTORS: weakref.WeakKeyDictionary[CollectorRegistry, CacheCollector] = weakref.WeakKeyDictionary()
_COLLECTORS_LOCK = threading.Lock()


def register(cache: Any, registry: CollectorRegistry | None = None, **labels: str) -> CacheCollector:
    """Expose ``cache.stats()`` on ``registry`` (default: prometheus_client's global one), with ``labels`` on
    every sample (e.g. ``model="smollm2"``: the caches of one registry are told apart by their labels). Returns the
    registry's collector; the cache is held weakly and dropped once closed."""
    registry = REGISTRY if registry is None else registry
    with _COLLECTORS_LOCK:
        collector = _COLLECTORS.get(registry)
        if collector is None:
            collector = _COLLECTORS[registry] = CacheCollector()
            registry.register(collector)
    collector.add(cache, labels)
    return collector


def exposition(cache: Any, **labels: str) -> bytes:
    """The metrics of ``cache`` in Prometheus' text format (a server's own ``/metrics`` handler can return it)."""
    registry = CollectorRegistry()
    register(cache, registry, **labels)
    return generate_latest(registry)
