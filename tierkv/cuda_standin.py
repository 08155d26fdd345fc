"""A CPU stand-in for CUDA that checks the runtime's stream and event protocol (``TIERKV_CUDA_STANDIN=1``).

The CUDA paths (copy stream, events, landing buffers, pinned and registered host memory) never run on a
CPU-only host, and a missing ``wait_event`` there does not fail: it silently returns KV that was not
copied yet. With the ``cuda_standin`` setting on, a cache on the CPU takes those paths with this module in
place of ``torch.cuda``. Work runs at once on the CPU (so results are exact), while a *race detector* over
vector clocks replays what a GPU would do with it:

- every stream and every host thread is an agent with a vector clock; an operation issued on a stream
  happens after what its issuing thread did before; ``Event.record`` snapshots a stream, ``wait_event``
  joins that snapshot into a stream, ``synchronize`` / ``query`` into the calling thread; a job handed to
  the mover's thread joins its submitter (:meth:`StandIn.fork` / :meth:`StandIn.join`);
- every access to memory allocated through it (device staging, landing buffers and slabs, pinned host
  slabs, registered bounce buffers) is checked against earlier conflicting accesses (one of them a write)
  by other agents: each must *happen before* it. One that does not is a violation — a wait missing or on
  the wrong stream — and :meth:`StandIn.check` fails the test with both operations;
- host registrations are bookkept like the driver does: registering memory twice (CUDA error 712) or
  releasing what is not registered is a violation, and :attr:`StandIn.registered` lists what is pinned now.

Every operation is also appended to :attr:`StandIn.log` (``(agent, op, detail)``), so a test can assert
the order itself (e.g. that the copy stream waited for the compute stream before its first copy).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierkv.accel import DEVICE, HOST, HostOnly

MAX_ACCESSES = 256  # per buffer: older accesses are forgotten (tests are small; this bounds the checker)
MAX_SEGMENTS = 1 << 16  # a strided view with more contiguous pieces than this is checked by its hull

Clock = dict[str, int]


def _join(into: Clock, other: Clock) -> None:
    for agent, tick in other.items():
        if into.get(agent, 0) < tick:
            into[agent] = tick


class FakeStream:
    """A stream: an agent whose clock advances with each operation issued on it."""

    def __init__(self, owner: StandIn, name: str) -> None:
        self.owner, self.name = owner, name
        self.clock: Clock = {}

    def wait_event(self, event: FakeEvent) -> None:
        self.owner._stream_op(self, "wait_event", event.name, lambda: _join(self.clock, event.clock))

    def wait_stream(self, other: FakeStream) -> None:
        self.owner._stream_op(self, "wait_stream", other.name, lambda: _join(self.clock, dict(other.clock)))

    def synchronize(self) -> None:
        self.owner._host_sync(f"synchronize {self.name}", self.clock)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    """An event: a snapshot of a stream's clock when it was recorded (empty until then)."""

    def __init__(self, owner: StandIn, name: str, timing: bool) -> None:
        self.owner, self.name, self.timing = owner, name, timing
        self.clock: Clock = {}
        self.recorded: float | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.owner.current_stream(None)

        def snapshot() -> None:
            self.clock = dict(stream.clock)
            self.recorded = time.perf_counter()

        self.owner._stream_op(stream, "record", self.name, snapshot)

    def synchronize(self) -> None:
        self.owner._host_sync(f"synchronize {self.name}", self.clock)

    def query(self) -> bool:
        """True (the work ran at once), but it orders nothing: on a GPU it may be False, so code that relied on
        a True for ordering would be wrong there (the runtime polls events only to read timings)."""
        return True

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.owner.current_stream(None)).wait_event(self)

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.timing and end.timing) or self.recorded is None or end.recorded is None:
            raise RuntimeError("elapsed_time needs two recorded events created with enable_timing=True")
        return (end.recorded - self.recorded) * 1e3


@dataclass(slots=True)
class _Access:
    starts: np.ndarray
    ends: np.ndarray
    agent: str
    tick: int
    write: bool
    what: str


@dataclass(slots=True)
class _Buffer:
    """Memory allocated (or registered) through the stand-in: its space, and recent accesses to it."""

    start: int
    end: int
    space: str
    pinned: bool
    label: str
    accesses: list[_Access]


def _intervals(tensor: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The byte ranges ``[starts, ends)`` a (possibly strided) tensor covers, sorted and merged."""
    item = tensor.element_size()
    base = tensor.data_ptr()
    if tensor.numel() == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    dims = [(size, stride) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1]
    dims.sort(key=lambda d: -abs(d[1]))
    segment = 1
    while dims and dims[-1][1] == segment:
        segment *= dims.pop()[0]
    count = int(np.prod([size for size, _ in dims])) if dims else 1
    if count > MAX_SEGMENTS:
        low = base + sum(min(0, (s - 1) * st) for s, st in zip(tensor.shape, tensor.stride())) * item
        high = base + (sum(max(0, (s - 1) * st) for s, st in zip(tensor.shape, tensor.stride())) + 1) * item
        return np.array([low], np.int64), np.array([high], np.int64)
    offsets = np.zeros(1, np.int64)
    for size, stride in dims:
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
    starts = np.sort(base + offsets * item)
    ends = starts + segment * item
    keep = np.ones(len(starts), bool)
    keep[1:] = starts[1:] > ends[:-1]  # merge touching or overlapping pieces
    group = np.cumsum(keep) - 1
    merged_ends = np.zeros(int(group[-1]) + 1, np.int64)
    np.maximum.at(merged_ends, group, ends)
    return starts[keep], merged_ends


def _rows(tensor: torch.Tensor, rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges of rows ``rows`` of a tensor whose rows are contiguous."""
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
    starts = np.sort(tensor.data_ptr() + rows.cpu().numpy().astype(np.int64) * tensor.stride(0) * tensor.element_size())
    return starts, starts + row_bytes


def _overlap(a: _Access, starts: np.ndarray, ends: np.ndarray) -> bool:
    if not len(a.starts) or not len(starts):
        return False
    index = np.searchsorted(ends, a.starts, side="right")  # first range of the new access ending after each start
    valid = index < len(starts)
    return bool(np.any(starts[index[valid]] < a.ends[valid]))


class StandIn(HostOnly):
    """The CUDA stand-in: fake streams and events, device memory that is CPU memory, a race detector."""

    name = "cuda-standin"
    streams = True

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()
        self._names = itertools.count()
        self._threads = itertools.count()
        self.compute = FakeStream(self, "compute")
        self._streams = {"compute"}  # agent names that are streams (the others are host threads)
        self.log: list[tuple[str, str, str]] = []
        self.violations: list[str] = []
        self.pageable_copies = 0  # non-blocking host->device copies from unpinned memory (synchronous on CUDA)
        self.registered: dict[int, int] = {}  # address -> bytes of host memory registered now
        self._buffers: list[_Buffer] = []  # sorted by start
        self._starts: list[int] = []

    # ------------------------------------------------------------------------------ agents, clocks
    def _thread(self) -> tuple[str, Clock]:
        local = self._local
        if not hasattr(local, "clock"):
            ident = threading.get_ident()  # not current_thread(): a thread past its end (a finalizer run as it
            # exits) would become a _DummyThread that threading.enumerate() lists for the rest of the process
            named = next((thread.name for thread in threading.enumerate() if thread.ident == ident), "exiting")
            local.name = f"thread{next(self._threads)}:{named}"
            local.clock = {}
        return local.name, local.clock

    def _stream_op(self, stream: FakeStream, op: str, detail: str, effect: Any = None) -> tuple[str, int]:
        with self._lock:
            _, clock = self._thread()
            _join(stream.clock, clock)  # issued after what this thread did so far
            stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
            if effect is not None:
                effect()
            self.log.append((stream.name, op, detail))
            return stream.name, stream.clock[stream.name]

    def _host_sync(self, what: str, clock: Clock) -> None:
        with self._lock:
            name, mine = self._thread()
            _join(mine, clock)
            self.log.append((name, "wait", what))

    def fork(self) -> Clock:
        with self._lock:
            name, clock = self._thread()
            clock[name] = clock.get(name, 0) + 1
            return dict(clock)

    def join(self, token: Clock | None) -> None:
        if token is not None:
            self._host_sync("join", token)

    # ------------------------------------------------------------------------------ streams, events
    def Stream(self, device: torch.device) -> FakeStream:  # noqa: N802 - mirrors torch.cuda.Stream
        stream = FakeStream(self, f"stream{next(self._names)}")
        self._streams.add(stream.name)
        return stream

    def Event(self, timing: bool = False) -> FakeEvent:  # noqa: N802 - mirrors torch.cuda.Event
        return FakeEvent(self, f"event{next(self._names)}", timing)

    def current_stream(self, device: torch.device | None) -> FakeStream:
        return getattr(self._local, "stream", None) or self.compute

    @contextlib.contextmanager
    def on_stream(self, stream: FakeStream, device: torch.device) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    # ------------------------------------------------------------------------------------- memory
    def space(self, tensor: torch.Tensor) -> str:
        """Host memory is what was allocated or registered as such here; the rest (the model's tensors,
        staging) stands for device memory, as on a GPU host."""
        buffer = self._buffer_at(tensor.data_ptr())
        return buffer.space if buffer is not None else DEVICE

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        self._track(tensor, DEVICE, False, "device")
        return tensor

    def empty_blocks(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self._track(tensor, DEVICE, False, "device blocks")
        return tensor

    def host_empty(self, shape: tuple[int, ...], pin: bool) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=torch.uint8)
        self._track(tensor, HOST, pin, "pinned host slab" if pin else "host slab")
        return tensor

    def host_blocks(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self._track(tensor, HOST, False, "host blocks")
        return tensor

    def register_host(self, address: int, nbytes: int, pin: bool) -> None:
        with self._lock:
            clash = [a for a, n in self.registered.items() if a < address + nbytes and address < a + n]
            if pin and clash:
                self.violations.append(f"cudaHostRegister of {nbytes} bytes at {address:#x}: already registered "
                                       "(CUDA error 712)")
            if pin:
                self.registered[address] = nbytes
            self._add_buffer(_Buffer(address, address + nbytes, HOST, pin, "bounce", []))
            self.log.append((self._thread()[0], "register" if pin else "track", f"{nbytes} bytes at {address:#x}"))

    def unregister_host(self, address: int, pin: bool) -> None:
        with self._lock:
            if pin and self.registered.pop(address, None) is None:
                self.violations.append(f"cudaHostUnregister at {address:#x}: not registered")
            buffer = self._buffer_at(address)
            if buffer is not None:  # freeing it: every GPU access to it must be finished and observed
                agent, clock = self._thread()
                late = [a for a in buffer.accesses if a.tick > clock.get(a.agent, 0) and a.agent in self._streams]
                if late:
                    self.violations.append(f"a bounce buffer was freed while {late[0].what} by {late[0].agent} "
                                           "may still access it")
            self._drop_buffer(address)
            self.log.append((self._thread()[0], "unregister" if pin else "untrack", f"at {address:#x}"))

    def _track(self, tensor: torch.Tensor, space: str, pinned: bool, label: str) -> None:
        start = tensor.data_ptr()
        with self._lock:
            self._add_buffer(_Buffer(start, start + tensor.numel() * tensor.element_size(), space, pinned, label, []))
        weakref.finalize(tensor, self._drop_buffer, start)

    def _add_buffer(self, buffer: _Buffer) -> None:
        if buffer.end <= buffer.start:
            return
        self._drop_buffer(buffer.start)
        index = bisect.bisect_left(self._starts, buffer.start)
        self._starts.insert(index, buffer.start)
        self._buffers.insert(index, buffer)

    def _drop_buffer(self, start: int) -> None:
        with self._lock:
            index = bisect.bisect_left(self._starts, start)
            if index < len(self._starts) and self._starts[index] == start:
                del self._starts[index]
                del self._buffers[index]

    def _buffer_at(self, address: int) -> _Buffer | None:
        with self._lock:
            index = bisect.bisect_right(self._starts, address) - 1
            if index >= 0 and address < self._buffers[index].end:
                return self._buffers[index]
            return None

    # -------------------------------------------------------------------------------- the checker
    def _access(self, tensor: torch.Tensor, agent: str, tick: int, clock: Clock, write: bool, what: str,
                ranges: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        buffer = self._buffer_at(tensor.data_ptr())
        if buffer is None:
            return  # not memory the cache allocated (the model's own tensors): not checked
        starts, ends = ranges if ranges is not None else _intervals(tensor)
        for prior in buffer.accesses:
            if not (prior.write or write) or prior.tick <= clock.get(prior.agent, 0):
                continue  # two reads, or ordered: prior happens before this access
            if _overlap(prior, starts, ends):
                self.violations.append(
                    f"{what} ({'write' if write else 'read'} by {agent}) of {buffer.label} memory is not ordered "
                    f"after {prior.what} ({'write' if prior.write else 'read'} by {prior.agent}): "
                    "an event wait or synchronize is missing, or on the wrong stream")
        buffer.accesses.append(_Access(starts, ends, agent, tick, write, what))
        del buffer.accesses[:-MAX_ACCESSES]

    def _on_stream(self, op: str, reads: list[tuple[torch.Tensor, Any]],
                   writes: list[tuple[torch.Tensor, Any]]) -> None:
        stream = self.current_stream(None)
        with self._lock:
            agent, tick = self._stream_op(stream, op, "")
            for tensor, ranges in reads:
                self._access(tensor, agent, tick, stream.clock, False, op, ranges)
            for tensor, ranges in writes:
                self._access(tensor, agent, tick, stream.clock, True, op, ranges)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._lock:
            source = self._buffer_at(src.data_ptr())
            if self.space(dst) == HOST and self.space(src) == HOST:  # torch copies host to host on the CPU, now
                agent, clock = self._thread()
                clock[agent] = clock.get(agent, 0) + 1
                self._access(src, agent, clock[agent], clock, False, "host copy")
                self._access(dst, agent, clock[agent], clock, True, "host copy")
                self.log.append((agent, "host copy", f"{dst.numel() * dst.element_size()} bytes"))
            else:
                if self.space(dst) == DEVICE and source is not None and source.space == HOST and not source.pinned:
                    self.pageable_copies += 1
                self._on_stream(f"copy {self.space(src)}->{self.space(dst)}", [(src, None)], [(dst, None)])
        dst.copy_(src)

    def index_select(self, src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        self._on_stream("index_select", [(src, _rows(src, index))], [(out, None)])
        torch.index_select(src, 0, index, out=out)

    def index_copy(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        self._on_stream("index_copy", [(src, None)], [(dst, _rows(dst, index))])
        dst.index_copy_(0, index, src)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self.current_stream(None)
        self._on_stream("copy device->host (blocking)", [(src, None)], [(dst, None)])
        self._host_sync(f"blocking copy on {stream.name}", stream.clock)
        dst.copy_(src)

    def host_write(self, tensor: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        with self._lock:
            agent, clock = self._thread()
            clock[agent] = clock.get(agent, 0) + 1
            ranges = _rows(tensor, rows) if rows is not None else None
            self._access(tensor, agent, clock[agent], clock, True, "host write", ranges)
            self.log.append((agent, "host write", f"{tensor.numel() * tensor.element_size()} bytes"))

    def used(self, *tensors: torch.Tensor) -> None:
        self._on_stream("attention reads", [(t, None) for t in tensors], [])

    def release_cached(self) -> None:
        with self._lock:
            self.log.append((self._thread()[0], "empty_cache", ""))

    # ------------------------------------------------------------------------------------ results
    def ops(self, agent: str | None = None) -> list[tuple[str, str, str]]:
        """The log, or one agent's part of it (``"compute"``, a stream's name, a thread's)."""
        with self._lock:
            return [entry for entry in self.log if agent is None or entry[0] == agent]

    def check(self) -> None:
        """Raise ``AssertionError`` naming every unordered access and bookkeeping error seen so far."""
        with self._lock:
            if self.violations:
                shown = "\n  ".join(self.violations[:10])
                raise AssertionError(f"{len(self.violations)} CUDA ordering violation(s):\n  {shown}")


_current: StandIn | None = None
_current_lock = threading.Lock()


def current() -> StandIn:
    """The stand-in in use (created on first use; :func:`fresh` starts a new one)."""
    global _current
    with _current_lock:
        if _current is None:
            _current = StandIn()
        return _current


def fresh() -> StandIn:
    """Start a new stand-in (an empty log, no violations); caches created after this use it."""
    global _current
    with _current_lock:
        _current = StandIn()
        return _current
