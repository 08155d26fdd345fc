"""``cache.stats()`` as Prometheus metrics, for servers (``pip install 'tierkv[metrics]'``).

    from prometheus_client import start_http_server
    import tierkv.metrics

    tierkv.metrics.register(cache, model="smollm2")   # the default registry; labels are optional
    start_http_server(9100)                            # http://host:9100/metrics

The collector reads ``cache.stats()`` when Prometheus scrapes, so a decode loop pays nothing between scrapes.
Every metric carries the counters of :class:`tierkv.stats.CacheStats` under the name Prometheus' conventions
give it (base units, ``_total`` for counters):

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
``tierkv_state_bytes``                      gauge    ``state_bytes``
``tierkv_moved_bytes_total{link}``          counter  ``bytes_moved``
``tierkv_prefetch_hits_total``              counter  ``prefetch_hits``
``tierkv_prefetch_misses_total``            counter  ``prefetch_misses``
``tierkv_prefetch_stall_seconds_total``     counter  ``prefetch_stall_s``
``tierkv_disk_read_ahead_hits_total``       counter  ``disk_read_ahead_hits``
``tierkv_writeback_pending_blocks``         gauge    ``writeback["pending_blocks"]``
``tierkv_prefetch_depth``                   gauge    ``prefetch_depth``
``tierkv_decode_step_seconds``              gauge    ``steps["median"]["wall_s"]`` (median, last 256)
==========================================  =======  =============================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tierkv.errors import InvalidConfigError
from tierkv.stats import CacheStats

try:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as exc:  # the optional extra
    raise ImportError("tierkv.metrics needs prometheus_client: pip install 'tierkv[metrics]'") from exc

_PER_TIER = (("resident_bytes", "bytes_resident", "KV bytes held"), ("blocks", "blocks", "blocks held"),
             ("allocated_bytes", "bytes_allocated", "bytes allocated (whole slots and chunks)"),
             ("peak_allocated_bytes", "peak_bytes_allocated", "high-water mark of the allocated bytes"),
             ("budget_bytes", "budget_bytes", "budget"))
_COUNTERS = (("prefetch_hits", "prefetch_hits", "layer reads whose data a prefetch had ready"),
             ("prefetch_misses", "prefetch_misses", "layer reads no prefetch had started"),
             ("prefetch_stall_seconds", "prefetch_stall_s", "time the model waited for prefetched data"),
             ("disk_read_ahead_hits", "disk_read_ahead_hits", "reads whose disk part was already in flight"))


class CacheCollector:
    """A Prometheus collector of one cache's ``stats()`` (any callable returning :class:`CacheStats`)."""

    def __init__(self, stats: Callable[[], CacheStats], labels: Mapping[str, str] | None = None) -> None:
        self.stats = stats
        self.labels = dict(labels or {})
        for name in self.labels:
            if name in ("tier", "link") or not name.isidentifier():
                raise InvalidConfigError(f"metrics label {name!r} is reserved or not a valid name; use another.")

    def _gauge(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"tierkv_{name}", doc, labels=[*self.labels, *extra])

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(f"tierkv_{name}", doc, labels=[*self.labels, *extra])

    def collect(self) -> Iterator[Metric]:
        stats: dict[str, Any] = dict(self.stats())
        values = list(self.labels.values())
        tokens = self._gauge("tokens", "tokens the cache holds (sequence length)")
        tokens.add_metric(values, stats.get("tokens", 0))
        yield tokens
        for name, key, doc in _PER_TIER:
            if key in stats:
                family = self._gauge(name, f"per tier: {doc}", ("tier",))
                for tier, value in stats[key].items():
                    family.add_metric([*values, tier], value)
                yield family
        if "bytes_staging" in stats:
            staging = self._gauge("staging_bytes", "device bytes reserved for staging buffers and key summaries")
            staging.add_metric(values, stats["bytes_staging"])
            yield staging
        state = self._gauge("state_bytes", "device bytes of recurrent state (layers that keep it)")
        state.add_metric(values, stats.get("state_bytes", 0))
        yield state
        moved = self._counter("moved_bytes", "bytes moved per link", ("link",))
        for link, value in stats.get("bytes_moved", {}).items():
            moved.add_metric([*values, link], value)
        yield moved
        for name, key, doc in _COUNTERS:
            if key in stats:
                counter = self._counter(name, doc)
                counter.add_metric(values, stats[key])
                yield counter
        if "writeback" in stats:
            pending = self._gauge("writeback_pending_blocks", "blocks in flight to disk")
            pending.add_metric(values, stats["writeback"]["pending_blocks"])
            yield pending
        if stats.get("prefetch_depth") is not None:
            depth = self._gauge("prefetch_depth", "layers prefetched ahead")
            depth.add_metric(values, stats["prefetch_depth"])
            yield depth
        wall = stats.get("steps", {}).get("median", {}).get("wall_s")
        if wall is not None:
            step = self._gauge("decode_step_seconds", "median wall time of the last decode steps")
            step.add_metric(values, wall)
            yield step


def register(cache: Any, registry: CollectorRegistry | None = None, **labels: str) -> CacheCollector:
    """Expose ``cache.stats()`` on ``registry`` (default: prometheus_client's global one), with ``labels`` on
    every metric (e.g. ``model="smollm2"``: one collector per cache, told apart by their labels)."""
    collector = CacheCollector(cache.stats, labels)
    (REGISTRY if registry is None else registry).register(collector)
    return collector


def exposition(cache: Any, **labels: str) -> bytes:
    """The metrics of ``cache`` in Prometheus' text format (a server's own ``/metrics`` handler can return it)."""
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache.stats, labels))
    return generate_latest(registry)
