"""Asynchronous movement of KV into the device staging area.

One interface, two implementations:

- :class:`ThreadMover` (CPU-only hosts): a worker thread runs each job; torch copies and disk reads release
  the GIL, so a layer's gather overlaps the previous layer's compute.
- :class:`CudaMover`: a worker thread issues each job's copies on a dedicated copy stream (host->device
  from pinned slabs is then asynchronous DMA) after that stream has waited for the compute stream — the
  destination buffer was last read by attention there. Completion is a CUDA event; waiting on a handle
  makes the *compute stream* wait for the event, it does not block the host on the copies themselves.

Streams and events come from the device's :mod:`~tierkv.accel` backend: ``torch.cuda``, or on a CPU host with
``TIERKV_CUDA_STANDIN=1`` the stand-in that checks this protocol (:mod:`tierkv.cuda_standin`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tierkv.accel import HOST_ONLY, CudaAccelerator, HostOnly, backend


class MoveHandle:
    """A submitted job; :meth:`wait` returns once its data is usable on the compute stream."""

    def __init__(self, future: Future, event: Any = None, device: torch.device | None = None,
                 accel: HostOnly = HOST_ONLY, finished: list | None = None) -> None:
        self._future = future
        self._event = event
        self._device = device
        self._accel: Any = accel  # streams and events: CUDA's or the stand-in's, whenever there is an event
        self._finished = finished  # the job's thread's fork token at its end (the stand-in's host ordering)

    def wait(self) -> None:
        """Wait for the job; re-raise its error (the data is then unusable)."""
        try:
            self._future.result()
        finally:
            self._observed()
        if self._event is not None:  # the compute stream of the job's device (not the current device's)
            self._accel.current_stream(self._device).wait_event(self._event)

    def settle(self) -> None:
        """Wait until the job and its copies are finished, without raising: for barriers, which must not
        fail on others' errors and must know no copy still reads a slot about to be reused (also after a
        failed job: copies it queued before failing may still run)."""
        futures.wait([self._future])
        self._observed()
        if self._event is not None:
            self._event.synchronize()

    def _observed(self) -> None:
        if self._finished:
            self._accel.join(self._finished[0])

    def done(self) -> bool:
        return self._future.done()


class ThreadMover:
    """Runs jobs on one background thread, in submission order."""

    name = "thread"

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-mover")

    def submit(self, job: Callable[[], None]) -> MoveHandle:
        return MoveHandle(self._pool.submit(_in_callers_mode(job)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaMover(ThreadMover):
    """Runs jobs' copies on a side CUDA stream, ordered after the compute stream's work so far."""

    name = "cuda-stream"

    def __init__(self, device: torch.device, accel: CudaAccelerator | HostOnly | None = None) -> None:
        super().__init__()
        self.device = device
        streams: Any = accel or backend(device)  # one with streams (CUDA, or the stand-in)
        self.accel = streams
        self.stream = streams.Stream(device)

    def submit(self, job: Callable[[], None]) -> MoveHandle:
        accel = self.accel
        ready = accel.Event()
        ready.record(accel.current_stream(self.device))
        done = accel.Event()
        submitted = accel.fork()
        finished: list = []

        def run() -> None:
            accel.join(submitted)
            try:
                with accel.on_stream(self.stream, self.device):
                    self.stream.wait_event(ready)
                    try:
                        job()
                    finally:  # recorded after whatever the job queued, also when it failed half-way
                        done.record(self.stream)
            finally:
                finished.append(accel.fork())

        return MoveHandle(self._pool.submit(_in_callers_mode(run)), done, self.device, accel, finished)


def _in_callers_mode(job: Callable[[], None]) -> Callable[[], None]:
    """Run ``job`` on a worker thread under the caller's inference/grad mode (they are thread-local)."""
    inference = torch.is_inference_mode_enabled()
    grad = torch.is_grad_enabled()

    def run() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            job()

    return run


def make_mover(device: torch.device) -> ThreadMover:
    accel = backend(device)
    return CudaMover(device, accel) if accel.streams else ThreadMover()
