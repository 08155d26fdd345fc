"""Decode-step telemetry, the optional timeline trace, and the shape of ``cache.stats()``.

:class:`CacheStats` is what ``TieredCache.stats()`` returns: a plain dict (JSON-ready, as before) whose keys and
value types are declared here, with the unit in every name (``bytes_*``, ``*_s``, ``blocks``, ``tokens``);
:mod:`tierkv.metrics` exposes the same counters to Prometheus.

:class:`Timeline` keeps the last :data:`HISTORY` steps (forward passes) of one cache as
:class:`StepTelemetry` records: wall time, model compute time, prefetch stall, the time the mover spent on
copies and reads per link (measured), the bytes and copies per link, and what the bandwidth model
(:mod:`tierkv.bandwidth`) predicts for the same bytes under a :class:`~tierkv.bandwidth.LinkProfile`.
:meth:`Timeline.summary` gives medians (``cache.stats()["steps"]``). A step's per-stage records
(:class:`LayerRecord`) are its layers under exact gather and its chunks, in order, under streaming attention.

:class:`Trace` records spans (mover copies and reads, synchronous reads, prefetch waits, layer compute)
and writes them as Chrome trace JSON for chrome://tracing or https://ui.perfetto.dev. It is created only
when asked for (``TieredCache(trace=True)`` or ``TIERKV_TRACE=path``); when off, the executor's only cost is
a ``None`` check per read.

Links are named as in ``stats()["bytes_moved"]``: ``device->device`` (gather of device-resident blocks into
staging), ``host->device``, ``disk->device`` (one batched engine read into a host bounce buffer, then a copy
to the device).

This module knows nothing of tensors (CUDA event pairs are resolved through a callable).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypedDict

from tierkv import safefs, settings
from tierkv.bandwidth import (
    DISK_READ_AHEAD,
    PRESETS,
    LayerLoad,
    Link,
    LinkProfile,
    Placement,
    min_prefetch_depth,
    predict_step,
)
from tierkv.errors import InvalidConfigError
from tierkv.inputs import output_problem
from tierkv.vocabulary import LinkName

log = logging.getLogger("tierkv")

HISTORY = 256
HELD_RECORDS = 16384
"""The most per-stage records the steps not yet run through the bandwidth model keep (streaming records one per
chunk, so a long context's steps hold thousands each): past it the oldest are predicted (and their detail dropped)
as they close, so the telemetry's memory does not grow with the context."""


# ------------------------------------------------------------------------------------ stats() shape
class WritebackStats(TypedDict):
    """Blocks on their way to disk, and why background writes stopped (None while they run)."""

    pending_blocks: int
    paused: str | None


class _CacheStatsAlways(TypedDict):
    """The keys every ``stats()`` has, a cache that holds no tokens yet included."""

    tokens: int  # sequence length
    bytes_resident: dict[str, int]  # tier -> KV bytes held (tokens x token bytes)
    bytes_moved: dict[str, int]  # link -> bytes moved since the cache was built
    blocks: dict[str, int]  # tier -> blocks held
    prefetch_hits: int
    prefetch_misses: int
    prefetch_stall_s: float  # time the model waited for prefetched data
    state_bytes: int  # device bytes of layers' recurrent state and its rollback copy (tierkv.hf.state)


class CacheStats(_CacheStatsAlways, total=False):
    """``TieredCache.stats()``: occupancy, traffic and prefetch effectiveness of one cache.

    Tier keys are ``device``, ``host``, ``disk``; link keys as in :data:`~tierkv.vocabulary.READ_LINKS` plus the
    write links (``device->host``, ``host->disk``, ``device->disk``). The keys below are there once the cache
    holds tokens (its tiers exist), ``sparse`` after a sparse step, ``remote`` with a remote tier (the keys of
    the base class always). docs/architecture.md ("Statistics") says what each counts. The counters never go back
    over the cache's life; after ``close()`` they keep their final figures while every tier reads empty.
    """

    bytes_allocated: dict[str, int]  # tier -> bytes held now (slots, whole chunks)
    peak_bytes_allocated: dict[str, int]  # tier -> high-water mark of bytes_allocated
    budget_bytes: dict[str, int]  # tier -> its budget
    bytes_staging: int  # device bytes reserved for staging buffers, sparse key summaries and rest copy
    bytes_summaries: int  # device bytes of the sparse key summaries alone
    bytes_rest_copy: int  # device bytes of sparse attention's low-bit copy of the unselected blocks (rest_bits)
    blocks_promoted: int  # blocks moved up by policy="attention"
    writeback: WritebackStats  # blocks on their way to disk
    disk_read_ahead_hits: int  # reads whose disk part was already in flight
    mover: str  # the mover implementation
    disk_engine: str | None  # the disk engine (None without a disk tier; "unopened" before its first file)
    prefetch_depth: int  # layers prefetched ahead now (0 while the budget leaves no room to prefetch)
    prefetch_auto: list[dict[str, Any]]  # prefetch_depth="auto" decisions (DepthChoice.as_dict)
    steps: dict[str, Any]  # Timeline.summary(): medians of the last HISTORY decode steps
    sparse: dict[str, Any]  # sparse steps' selection and reads (SparseCounters.as_dict)
    remote: dict[str, Any]  # the remote tier's lookups, hits and bytes (docs/remote.md)


TIERS = ("device", "host", "disk")
"""Tier names, as ``stats()`` keys them."""


def empty_stats() -> CacheStats:
    """``stats()`` of a cache that holds no tokens yet: every tier empty, nothing moved."""
    return {"tokens": 0, "bytes_resident": dict.fromkeys(TIERS, 0), "bytes_moved": {},
            "blocks": dict.fromkeys(TIERS, 0), "prefetch_hits": 0, "prefetch_misses": 0, "prefetch_stall_s": 0.0,
            "state_bytes": 0}


# --------------------------------------------------------------------------------------- profile
def default_profile(device_type: str, cuda_major: int = 0) -> LinkProfile:
    """Presets by device type, used when neither ``profile=`` nor ``TIERKV_PROFILE`` gives a measured one.

    CUDA: PCIe 5.0 x16 for compute capability >= 9 (H100/H200/B200 hosts), PCIe 4.0 x16 below, a Gen4 NVMe,
    the HBM gather. CPU-only: the "device" tier is CPU memory, so host->device, device->host and the gather
    are all the ``dram`` memcpy preset; disk is a Gen4 NVMe.
    """
    if device_type == "cuda":
        return LinkProfile.from_presets("pcie5" if cuda_major >= 9 else "pcie4", "nvme-gen4")
    dram = PRESETS["dram"]
    links: dict[str, Link] = {
        LinkName.HOST_TO_DEVICE: dram, LinkName.DEVICE_TO_HOST: dram, LinkName.DEVICE_TO_DEVICE: dram,
        LinkName.HOST_TO_HOST: dram, LinkName.DISK_TO_HOST: PRESETS["nvme-gen4"],
        LinkName.HOST_TO_DISK: PRESETS["nvme-gen4-write"]}
    return LinkProfile(links, {"source": "presets: dram (CPU-only host), nvme-gen4"}, serial_mover=True)


def check_profile(profile: LinkProfile | str | os.PathLike | None) -> None:
    """Read the profile a cache would use from a file (``profile=``, else ``$TIERKV_PROFILE``), so that a missing or
    malformed one is refused when the cache is built (InvalidConfigError naming it), not at its first forward."""
    if profile is None:
        setting_profile()
    elif not isinstance(profile, LinkProfile):
        if not isinstance(profile, (str, os.PathLike)):
            raise InvalidConfigError(f"profile must be a LinkProfile or the path of one saved as JSON (tierkv bench "
                                     f"--profile-out), got {type(profile).__name__}.")
        LinkProfile.load(profile)


def setting_profile() -> LinkProfile | None:
    """The profile ``$TIERKV_PROFILE`` names (None when unset); any error names the variable and how to unset it,
    a malformed file's as a missing one's, so the user knows which setting to change."""
    path = settings.get("profile")
    if path is None:
        return None
    try:
        return LinkProfile.load(path)
    except InvalidConfigError as exc:
        variable = settings.SETTINGS["profile"].variable
        if variable in str(exc):
            raise
        raise InvalidConfigError(f"{variable}: {str(exc).rstrip('.')}; or unset {variable}.") from None


def resolve_profile(profile: LinkProfile | str | os.PathLike | None, device_type: str,
                    cuda_major: int = 0) -> tuple[LinkProfile, str]:
    """The profile the telemetry and ``prefetch_depth="auto"`` use, and where it came from:
    ``profile=`` (a :class:`LinkProfile` or a JSON path), else the ``profile`` setting (``$TIERKV_PROFILE``:
    JSON written by ``tierkv bench``), else :func:`default_profile`."""
    if isinstance(profile, LinkProfile):
        return profile, "profile= (LinkProfile)"
    if profile is not None:
        return LinkProfile.load(profile), f"profile={os.fspath(profile)}"
    measured = setting_profile()
    if measured is not None:
        return measured, settings.source("profile")
    preset = default_profile(device_type, cuda_major)
    return preset, preset.machine["source"]


def _time(profile: LinkProfile, key: str, nbytes: int, transfers: int) -> float:
    link: Link | None = profile.links.get(key)
    if link is None or nbytes <= 0:
        return 0.0
    return link.transfer_time(nbytes, max(transfers, 1))


# --------------------------------------------------------------------------------------- records
@dataclass(slots=True)
class LayerRecord:
    """What one layer moved and computed in one step."""

    compute_s: float = 0.0  # from the end of its gather to the next layer's gather (incl. the next append)
    bytes: dict[str, int] = field(default_factory=dict)  # per link
    copies: dict[str, int] = field(default_factory=dict)  # read calls per link (the unit of the profile latency)

    def load(self, compute_s: float | None = None) -> LayerLoad:
        return LayerLoad(self.compute_s if compute_s is None else compute_s,
                         device_bytes=self.bytes.get(LinkName.DEVICE_TO_DEVICE, 0),
                         host_bytes=self.bytes.get(LinkName.HOST_TO_DEVICE, 0),
                         disk_bytes=self.bytes.get(LinkName.DISK_TO_DEVICE, 0),
                         host_transfers=max(1, self.copies.get(LinkName.HOST_TO_DEVICE, 0)),
                         disk_transfers=max(1, self.copies.get(LinkName.DISK_TO_DEVICE, 0)))


@dataclass(slots=True)
class StepTelemetry:
    """One forward pass through the layers (a decode step when ``new_tokens == 1``)."""

    index: int
    new_tokens: int  # tokens appended per row to the first layer in this pass
    context: int  # tokens the first layer attends over
    prefetch_depth: int
    started: float  # perf_counter at the first layer's gather
    wall_s: float = 0.0  # first layer's gather to the next pass's first gather
    compute_s: float = 0.0  # sum of the layers' compute spans (everything outside the cache's gathers)
    stall_s: float = 0.0  # waits for prefetches
    sync_read_s: float = 0.0  # reads done on the compute thread (new tokens, prefetch misses)
    transfer_s: dict[str, float] = field(default_factory=dict)  # measured, per link
    bytes: dict[str, int] = field(default_factory=dict)
    copies: dict[str, int] = field(default_factory=dict)
    predicted_transfer_s: dict[str, float] = field(default_factory=dict)
    predicted_step_s: float = 0.0  # predict_step on this step's bytes and measured compute spans
    layers: dict[int, LayerRecord] | None = field(default_factory=dict)  # kept for the latest steps only

    @property
    def decode(self) -> bool:
        return self.new_tokens == 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.index, "new_tokens": self.new_tokens, "context": self.context,
            "prefetch_depth": self.prefetch_depth, "wall_s": self.wall_s, "compute_s": self.compute_s,
            "stall_s": self.stall_s, "sync_read_s": self.sync_read_s,
            "transfer_s": sum(self.transfer_s.values()), "transfer_s_by_link": dict(self.transfer_s),
            "predicted_transfer_s": sum(self.predicted_transfer_s.values()),
            "predicted_transfer_s_by_link": dict(self.predicted_transfer_s),
            "predicted_step_s": self.predicted_step_s,
            "bytes_by_link": dict(self.bytes), "copies_by_link": dict(self.copies),
        }


def steady_state_placement(layers: Sequence[LayerRecord]) -> Placement:
    """The :class:`Placement` of one step as the runtime pipelines it.

    The executor issues layer 0's prefetch of step ``t + 1`` as soon as the last layer of step ``t`` has
    its data, so layer 0's transfers overlap the last layer's compute (and the LM head, sampling and
    embedding counted with it). :func:`~tierkv.bandwidth.predict_step` starts a step with nothing in
    flight, so the step is rotated: a transfer-free pseudo-layer carrying the last layer's compute comes
    first, the last layer keeps its transfers and no compute. The predicted time is then the period
    between two consecutive steps' "last layer has its data" moments, which in steady state is the step time.
    """
    if len(layers) < 2:
        return Placement(tuple(layer.load() for layer in layers))
    last = layers[-1]
    head = LayerLoad(last.compute_s)
    body = [layer.load() for layer in layers[:-1]] + [last.load(compute_s=0.0)]
    return Placement((head, *body))


# ------------------------------------------------------------------------------------- timeline
class Timeline:
    """Per-step telemetry of one cache, bounded to the last ``history`` steps.

    Recording is cheap (a few dictionary updates per layer); the bandwidth model's predictions for the
    recorded steps are computed when they are read (:meth:`completed`, :meth:`summary`), so a decode loop
    that never asks pays nothing for them. Until then each kept step holds its per-layer records."""

    def __init__(self, profile: LinkProfile, profile_source: str, history: int = HISTORY) -> None:
        self.profile = profile
        self.profile_source = profile_source
        self.history: deque[StepTelemetry] = deque(maxlen=history)
        self.current: StepTelemetry | None = None
        self.steps_seen = 0
        self._pending: list[tuple[StepTelemetry, str, Any, Any]] = []  # CUDA event pairs not yet resolved
        self._unpredicted: deque[StepTelemetry] = deque()  # closed, not yet run through the model
        self._held = 0  # their per-stage records (HELD_RECORDS)
        self.resolve: Callable[[Any, Any, bool], float | None] | None = None  # (start, end, block) -> s | None

    # -- recording (compute thread) ---------------------------------------------------------------
    def begin_step(self, now: float, new_tokens: int, context: int, depth: int) -> StepTelemetry:
        previous = self.current
        if previous is not None:
            self._close(previous, now)
        self.current = StepTelemetry(self.steps_seen, new_tokens, context, depth, now)
        self.steps_seen += 1
        return self.current

    def end_step(self, now: float) -> None:
        """Close the step in progress now (an executor hand-off): the next record starts a new step."""
        if self.current is not None:
            self._close(self.current, now)
            self.current = None

    def layer(self, index: int) -> LayerRecord:
        step = self.current
        assert step is not None and step.layers is not None
        record = step.layers.get(index)
        if record is None:
            record = step.layers[index] = LayerRecord()
        return record

    def add_compute(self, layer: int, seconds: float) -> None:
        if self.current is not None:
            self.layer(layer).compute_s += seconds
            self.current.compute_s += seconds

    def add_stall(self, seconds: float) -> None:
        if self.current is not None:
            self.current.stall_s += seconds

    def add_layer(self, layer: int, reads: Sequence[ReadTiming], compute: tuple[int, float] | None = None,
                  begin: tuple[float, int, int, int] | None = None) -> None:
        """One layer's gather in one call: the compute span of the layer before it (``(layer, seconds)``), a new
        step (:meth:`begin_step`'s arguments, at the first layer of a pass), then the layer's synchronous reads —
        what :meth:`add_compute`, :meth:`begin_step` and :meth:`add_reads` record, in that order."""
        if compute is not None:
            self.add_compute(*compute)
        if begin is not None:
            self.begin_step(*begin)
        self.add_reads(layer, reads, sync=True)

    def add_reads(self, layer: int, reads: Sequence[ReadTiming], sync: bool) -> None:
        """Fold the timings of one executed read job (prefetch or synchronous) into the current step."""
        step = self.current
        if step is None:
            return
        record = self.layer(layer)
        for read in reads:
            for target in (record.bytes, step.bytes):
                target[read.link] = target.get(read.link, 0) + read.nbytes
            for target in (record.copies, step.copies):
                target[read.link] = target.get(read.link, 0) + read.copies
            if read.end is None:
                continue
            if isinstance(read.start, float):
                seconds = read.end - read.start
                step.transfer_s[read.link] = step.transfer_s.get(read.link, 0.0) + seconds
                if sync:
                    step.sync_read_s += seconds
            else:
                self._pending.append((step, read.link, read.start, read.end))
                if sync:
                    self._pending.append((step, "sync", read.start, read.end))

    # -- closing ----------------------------------------------------------------------------------
    def _close(self, step: StepTelemetry, now: float) -> None:
        step.wall_s = now - step.started
        self.history.append(step)
        self._unpredicted.append(step)  # predicted when read (completed()): most steps are never looked at
        self._held += len(step.layers or ())
        while len(self._unpredicted) > len(self.history):  # out of the history unread: never predicted
            self._held -= len(self._unpredicted.popleft().layers or ())
        while self._held > HELD_RECORDS:
            self._predict_oldest()
        self._resolve_pending(block=False)

    def _predict_oldest(self) -> None:
        step = self._unpredicted.popleft()
        self._held -= len(step.layers or ())
        self._predict(step)

    def _predict(self, step: StepTelemetry) -> None:
        """The bandwidth model's times for a closed step's bytes (its per-layer detail is then dropped, but for
        the latest two steps)."""
        layers = [step.layers[i] for i in sorted(step.layers)] if step.layers else []
        for record in layers:
            for link, nbytes in record.bytes.items():
                predicted = _predict_link(self.profile, link, nbytes, record.copies.get(link, 0))
                step.predicted_transfer_s[link] = step.predicted_transfer_s.get(link, 0.0) + predicted
        if layers:
            try:
                step.predicted_step_s = predict_step(steady_state_placement(layers), self.profile,
                                                     step.prefetch_depth, read_ahead=DISK_READ_AHEAD).step_s
            except InvalidConfigError:  # a link missing from the profile
                step.predicted_step_s = 0.0
        if all(step is not latest for latest in list(self.history)[-2:]):
            step.layers = None  # per-layer detail is kept for the last two steps only

    def _resolve_pending(self, block: bool) -> None:
        if not self._pending or self.resolve is None:
            return
        left = []
        for entry in self._pending:
            step, link, start, end = entry
            seconds = self.resolve(start, end, block)
            if seconds is None:
                left.append(entry)
            elif link == "sync":
                step.sync_read_s += seconds
            else:
                step.transfer_s[link] = step.transfer_s.get(link, 0.0) + seconds
        self._pending = left

    # -- reading ----------------------------------------------------------------------------------
    def completed(self) -> list[StepTelemetry]:
        self._resolve_pending(block=True)
        while self._unpredicted:
            self._predict_oldest()
        return list(self.history)

    def last_decode_layers(self) -> list[LayerRecord] | None:
        """Per-layer records of the latest completed decode step, in layer order (None before one)."""
        for step in reversed(self.history):
            if step.layers is not None and step.decode and step.layers:
                return [step.layers[i] for i in sorted(step.layers)]
        return None

    def summary(self) -> dict[str, Any]:
        """Medians over the kept decode steps (all kept passes if none was a decode step yet)."""
        steps = self.completed()
        decode = [s for s in steps if s.decode]
        chosen = decode or steps
        out: dict[str, Any] = {"count": len(chosen), "kind": "decode" if decode else "all passes",
                               "window": self.history.maxlen, "profile": self.profile_source}
        if not chosen:
            return out
        rows = [s.as_dict() for s in chosen]
        median: dict[str, Any] = {}
        for key, value in rows[-1].items():
            if key in ("step", "prefetch_depth"):
                continue
            if isinstance(value, dict):
                links = sorted({link for row in rows for link in row[key]})
                median[key] = {link: statistics.median(row[key].get(link, 0) for row in rows) for link in links}
            else:
                median[key] = statistics.median(row[key] for row in rows)
        out["median"] = median
        out["last"] = rows[-1]
        return out


def _predict_link(profile: LinkProfile, link: str, nbytes: int, copies: int) -> float:
    if link == LinkName.DISK_TO_DEVICE:  # disk -> host bounce buffer (one batched read), then host -> device
        return (_time(profile, LinkName.DISK_TO_HOST, nbytes, copies)
                + _time(profile, LinkName.HOST_TO_DEVICE, nbytes, copies))
    return _time(profile, link, nbytes, copies)


@dataclass(slots=True)
class ReadTiming:
    """One link's share of one read job: bytes, copies and its start/end marks (floats, or CUDA events)."""

    link: str
    nbytes: int
    copies: int
    start: Any = None
    end: Any = None


def add_counts(into: Any, other: Any) -> None:
    """Add the counters of dataclass ``other`` to ``into``, of the same class: numbers summed, dicts of numbers
    summed per key, nested counter dataclasses likewise (a rebuilt executor's counters go on from its
    predecessor's)."""
    for item in fields(into):
        mine, theirs = getattr(into, item.name), getattr(other, item.name)
        if isinstance(mine, dict):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0) + value
        elif is_dataclass(mine):
            add_counts(mine, theirs)
        else:
            setattr(into, item.name, mine + theirs)


# ---------------------------------------------------------------------------------------- trace
class Trace:
    """Spans in Chrome trace format (``ph: "X"``, microseconds), kept in memory until :meth:`save`."""

    def __init__(self, path: str | os.PathLike | None = None, limit: int = 2_000_000) -> None:
        self.path = path  # written by the cache's close() when set (TIERKV_TRACE=path, trace=path)
        self.events: list[dict[str, Any]] = []
        self.limit = limit
        self.dropped = 0
        self.pid = os.getpid()
        self.origin = time.perf_counter()
        self._threads: dict[int, str] = {}

    def span(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        """Record ``[start, end]`` (``time.perf_counter`` seconds) on the calling thread."""
        if len(self.events) >= self.limit:
            self.dropped += 1
            return
        tid = threading.get_native_id()
        if tid not in self._threads:
            self._threads[tid] = threading.current_thread().name
        event = {"name": name, "cat": category, "ph": "X", "ts": (start - self.origin) * 1e6,
                 "dur": max(end - start, 0.0) * 1e6, "pid": self.pid, "tid": tid}
        if args:
            event["args"] = args
        self.events.append(event)

    def to_json(self) -> dict[str, Any]:
        meta = [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": name}}
                for tid, name in self._threads.items()]
        meta.append({"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": "tierkv"}})
        return {"traceEvents": meta + list(self.events), "displayTimeUnit": "ms",
                "otherData": {"dropped_events": self.dropped}}

    def save(self, path: str | os.PathLike) -> None:
        """Replace ``path`` atomically with the trace, mode 0600 (a link there is replaced, never followed)."""
        from tierkv import safefs

        safefs.write_file(path, [json.dumps(self.to_json()).encode()], shared=False)


_SETTING_TRACES: dict[str, int] = {}  # a $TIERKV_TRACE path -> the caches of this process that traced to it
_SETTING_TRACES_LOCK = threading.Lock()


def make_trace(trace: bool | str | os.PathLike | None) -> Trace | None:
    """``TieredCache(trace=...)``: True records in memory (``save_trace``); a path also writes it there when
    the cache closes; None reads the ``trace`` setting (``$TIERKV_TRACE``, a path: the n-th cache of a process
    that reads it writes ``<stem>-<n><suffix>``, so every cache's trace survives); False is off whatever the
    settings say."""
    if trace is False:
        return None
    if trace is None:
        path = settings.get("trace")
        if path is None:
            return None
        return Trace(_setting_trace_path(checked_trace_path(path, settings.source("trace"))))
    if trace is True:
        return Trace()
    if not isinstance(trace, (str, os.PathLike)):
        raise InvalidConfigError(f"trace must be True (kept for save_trace), a file path (also written there when the "
                                 f"cache closes), False or None (the TIERKV_TRACE setting), got {trace!r}.")
    return Trace(checked_trace_path(trace, f"trace={os.fspath(trace)!r}"))


def check_trace_setting() -> None:
    """Refuse a ``$TIERKV_TRACE`` path no trace can be written to (as :func:`make_trace` would), without counting a
    cache against it."""
    path = settings.get("trace")
    if path is not None:
        checked_trace_path(path, settings.source("trace"))


MAX_TRACE_NUMBER = 10_000
"""Most numbered names :func:`_setting_trace_path` tries before it refuses (a folder already full of traces)."""


def _setting_trace_path(path: str | os.PathLike) -> str | os.PathLike:
    """``path`` for the process's first cache traced by ``$TIERKV_TRACE``; for its n-th (logged once) the first of
    ``<stem>-<n><suffix>``, ``<stem>-<n+1><suffix>`` ... that does not exist yet, claimed now (created exclusively,
    holding an empty trace) so that no cache's trace replaces another's, nor a file the user did not name, and the
    name is still free when the cache closes."""
    key = os.fspath(path)
    with _SETTING_TRACES_LOCK:
        count = _SETTING_TRACES[key] = _SETTING_TRACES.get(key, 0) + 1
        if count == 1:
            return path
        numbered = _claim_numbered(key, count)
    log.info("tierkv: %s is traced to by another cache of this process; this cache's trace is written to %s",
             key, numbered)
    return numbered


def _claim_numbered(key: str, first: int) -> str:
    """Create ``<stem>-<n><suffix>`` for the smallest ``n >= first`` whose name is free (``O_EXCL``: whatever is
    there, a link too, is left alone) and return it; InvalidConfigError naming it where none can be created."""
    stem, suffix = os.path.splitext(key)
    empty = json.dumps(Trace().to_json()).encode()
    for number in range(first, first + MAX_TRACE_NUMBER):
        candidate = f"{stem}-{number}{suffix}"
        try:
            fd = safefs.open_regular(None, candidate, candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # 0600
        except FileExistsError:
            continue
        except OSError as exc:
            problem = output_problem(candidate)
            why = problem[1] if problem is not None else f"cannot be created ({exc.strerror or exc})"
            raise InvalidConfigError(f"{settings.source('trace')}: the trace path of this process's cache {first} "
                                     f"would be {candidate!r}, which {why}, so its trace could not be written; give "
                                     "each cache its own trace= path, or a TIERKV_TRACE in a folder you can write."
                                     ) from None
        try:
            safefs.write_all(fd, [empty])
        finally:
            os.close(fd)
        return candidate
    raise InvalidConfigError(f"{settings.source('trace')}: {stem}-{first}{suffix} to {stem}-{number}{suffix} all "
                             "exist, so this cache's trace has no free name; remove old traces or set TIERKV_TRACE to "
                             "a new path.")


def checked_trace_path(path: str | os.PathLike, given: str) -> str | os.PathLike:
    """``path`` if a trace can be written there; else InvalidConfigError now (``given`` names where the path came
    from), not a trace lost at close with only a logged traceback."""
    problem = (errno.ENOENT, "is empty") if not os.fspath(path).strip() else output_problem(path)
    if problem is not None:
        fix = ("choose a path of your own (e.g. in your home directory)" if problem[0] == errno.EPERM
               else "give a file path in an existing directory (e.g. /tmp/tierkv-trace.json)")
        raise InvalidConfigError(f"{given}: the trace path {problem[1]}, so no trace can be written there; {fix}.")
    return os.path.abspath(path)  # where it was given: the process may change folder before it closes


def make_timeline(profile: LinkProfile | str | os.PathLike | None, device: Any) -> Timeline:
    """The telemetry of a cache whose device tier is on ``device`` (a ``torch.device``)."""
    major = 0
    if device.type == "cuda":
        import torch

        major = torch.cuda.get_device_capability(device)[0]
    links, source = resolve_profile(profile, device.type, major)
    return Timeline(links, source)


# ------------------------------------------------------------------------------ prefetch "auto"
MAX_AUTO_DEPTH = 8


@dataclass(frozen=True, slots=True)
class DepthChoice:
    """What ``prefetch_depth="auto"`` decided, and the predicted step time of every depth it weighed."""

    depth: int
    previous: int
    predicted_step_s: dict[int, float]
    free_depth: int  # deepest prefetch whose staging fits in free device memory (no KV evacuated)
    cap: int  # deepest considered: budget, layer count and MAX_AUTO_DEPTH
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"depth": self.depth, "previous": self.previous, "free_depth": self.free_depth, "cap": self.cap,
                "predicted_step_s": dict(self.predicted_step_s), "reason": self.reason}


def choose_prefetch_depth(layers: Sequence[LayerRecord], profile: LinkProfile, *, current: int, held_buffers: int,
                          buffer_bytes: int, free_device_bytes: int, max_buffers: int, free_host_bytes: int,
                          tolerance: float = 0.01, hard_cap: int = MAX_AUTO_DEPTH,
                          read_ahead: int = DISK_READ_AHEAD) -> DepthChoice:
    """The prefetch depth for the measured step ``layers`` (bytes per link and compute per layer).

    Up to the depth whose staging fits in the device budget's free room (``free_depth``) this is
    :func:`~tierkv.bandwidth.min_prefetch_depth` on the step's steady-state :class:`Placement`: the
    shallowest depth within ``tolerance`` of the best. A deeper prefetch needs staging that only evacuating
    device-resident KV can pay for (the store moves it to the host, or to disk when the host is full), which
    adds the evacuated bytes to every later step's transfers; such a depth is chosen only when the model
    predicts it still beats the best shallower one by more than ``tolerance``.
    """
    cap = max(0, min(hard_cap, len(layers) - 1, max_buffers - 1))
    free_depth = max(0, min(cap, held_buffers - 1 + free_device_bytes // max(buffer_bytes, 1)))
    placement = steady_state_placement(layers)
    try:
        best = min_prefetch_depth(placement, profile, max_depth=free_depth, tolerance=tolerance,
                                  read_ahead=read_ahead)
        predicted = {d: predict_step(placement, profile, d, read_ahead=read_ahead).step_s
                     for d in range(free_depth + 1)}
        for depth in range(free_depth + 1, cap + 1):
            moved = _evacuate(layers, (depth - free_depth) * buffer_bytes, free_host_bytes)
            predicted[depth] = predict_step(steady_state_placement(moved), profile, depth,
                                            read_ahead=read_ahead).step_s
            if predicted[depth] < predicted[best] * (1.0 - tolerance):
                best = depth
    except InvalidConfigError as exc:  # the profile lacks a link this step used
        return DepthChoice(current, current, {}, free_depth, cap, f"kept: {exc}")
    reason = "min_prefetch_depth" if best <= free_depth else "deeper staging pays for the evacuated KV"
    return DepthChoice(best, current, predicted, free_depth, cap, reason)


def _evacuate(layers: Sequence[LayerRecord], nbytes: int, free_host_bytes: int) -> list[LayerRecord]:
    """``layers`` with ``nbytes`` of device-resident KV moved off the device, spread over the layers in
    proportion to their device bytes: to the host while it has room, then to disk."""
    device = sum(layer.bytes.get(LinkName.DEVICE_TO_DEVICE, 0) for layer in layers)
    move = min(nbytes, device)
    if move <= 0:
        return list(layers)
    to_host = min(move, max(free_host_bytes, 0)) / move
    out = []
    for layer in layers:
        share = layer.bytes.get(LinkName.DEVICE_TO_DEVICE, 0) * move / device
        data = dict(layer.bytes)
        data[LinkName.DEVICE_TO_DEVICE] = int(data.get(LinkName.DEVICE_TO_DEVICE, 0) - share)
        data[LinkName.HOST_TO_DEVICE] = int(data.get(LinkName.HOST_TO_DEVICE, 0) + share * to_host)
        data[LinkName.DISK_TO_DEVICE] = int(data.get(LinkName.DISK_TO_DEVICE, 0) + share * (1 - to_host))
        out.append(LayerRecord(layer.compute_s, data, dict(layer.copies)))
    return out
