"""The accelerator operations the runtime uses, behind one seam: CUDA, its CPU stand-in, or none.

Every stream, event, pinned allocation, host registration and device copy the cache issues goes through
an :class:`Accelerator`, so the same code runs three ways:

- :class:`HostOnly` (a CPU-only host): every tier is CPU memory, copies are plain, nothing is asynchronous;
- :class:`CudaAccelerator`: ``torch.cuda`` streams and events, pinned slabs, ``cudaHostRegister``-ed bounce
  buffers, non-blocking copies;
- the stand-in (:mod:`tierkv.cuda_standin`, setting ``cuda_standin`` / ``TIERKV_CUDA_STANDIN=1``): the CUDA
  code paths on a CPU-only host — landing buffers, registration bookkeeping, a copy stream and its events —
  with fake streams and events that record the order of operations and report any access to a buffer
  that no event, wait or synchronize orders after a conflicting one. The CPU suite runs the GPU's protocol.

The device-side memory a tier or an executor allocates comes from :meth:`Accelerator.empty` (and host
memory the GPU reads from :meth:`Accelerator.host_empty`), so the stand-in knows which memory stands for
the GPU's. Nothing here is on a per-block path except the copies themselves (one call per run).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from tierkv import settings
from tierkv.errors import TierKVError

log = logging.getLogger("tierkv")

DEVICE, HOST = "device", "host"


class HostRegistrationError(TierKVError):
    """The driver refused to page-lock (or release) a host buffer."""


class HostOnly:
    """No accelerator: plain CPU tensors and copies (also the base of the others' defaults)."""

    name = "cpu"
    streams = False  # no copy stream: the mover is a plain worker thread

    def space(self, tensor: torch.Tensor) -> str:
        """Whether ``tensor`` is in device or host memory (all host here)."""
        return HOST

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of uint8 device memory (staging, landing buffers, device slab chunks)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def empty_blocks(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A typed device tensor (blocks read for the cold paths: copy-on-write, demotions)."""
        return torch.empty(shape, dtype=dtype, device=device)

    def host_empty(self, shape: tuple[int, ...], pin: bool) -> torch.Tensor:
        """uint8 host memory the device copies from (a host slab chunk); page-locked with ``pin``."""
        return torch.empty(shape, dtype=torch.uint8)

    def host_blocks(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A typed host tensor (blocks read on their way down the tiers)."""
        return torch.empty(shape, dtype=dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, asynchronous on the current stream where there is one."""
        dst.copy_(src)

    def index_select(self, src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(src, 0, index, out=out)

    def index_copy(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        dst.index_copy_(0, index, src)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` into host memory, complete when this returns (a blocking device->host DMA)."""
        dst.copy_(src)

    def host_write(self, tensor: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """The CPU is about to write ``tensor`` (only ``rows`` of its first dimension, if given)."""

    def used(self, *tensors: torch.Tensor) -> None:
        """The model reads ``tensors`` on the compute stream now (attention over staged K/V)."""

    def release_cached(self) -> None:
        """Device memory was freed: hand it back to the driver (the budget counts what the cache holds)."""

    def fork(self) -> Any:
        """A token for work handed to another thread (it happens after everything done here so far)."""
        return None

    def join(self, token: Any) -> None:
        """The work behind ``token`` (from :meth:`fork` on another thread) is finished and observed here."""

    def register_host(self, address: int, nbytes: int, pin: bool) -> None:
        """A host buffer the device copies from or into; page-locked with ``pin``."""

    def unregister_host(self, address: int, pin: bool) -> None:
        """Undo :meth:`register_host` (the buffer is about to be freed)."""

    # streams and events: only an accelerator whose ``streams`` is True has them (callers check it first)
    def Stream(self, device: torch.device) -> Any:  # noqa: N802 - mirrors torch.cuda.Stream
        """A new copy stream on ``device``."""
        raise self._no_streams("Stream")

    def Event(self, timing: bool = False) -> Any:  # noqa: N802 - mirrors torch.cuda.Event
        """A new event (recording its time with ``timing``)."""
        raise self._no_streams("Event")

    def current_stream(self, device: torch.device) -> Any:
        """The stream work on ``device`` is issued to now."""
        raise self._no_streams("current_stream")

    def on_stream(self, stream: Any, device: torch.device) -> contextlib.AbstractContextManager:
        """Run what the block issues on ``stream`` of ``device``."""
        raise self._no_streams("on_stream")

    def _no_streams(self, call: str) -> TierKVError:
        return TierKVError(f"the {self.name!r} accelerator has no streams or events ({call} was called); "
                           "check its .streams before using them.")


class CudaAccelerator(HostOnly):
    """``torch.cuda``: a copy stream and events, pinned slabs, registered bounce buffers, async copies."""

    name = "cuda"
    streams = True

    def space(self, tensor: torch.Tensor) -> str:
        return DEVICE if tensor.is_cuda else HOST

    def host_empty(self, shape: tuple[int, ...], pin: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=pin)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def release_cached(self) -> None:
        torch.cuda.empty_cache()

    # streams and events
    def Stream(self, device: torch.device) -> Any:  # noqa: N802 - mirrors torch.cuda.Stream
        return torch.cuda.Stream(device=device)

    def Event(self, timing: bool = False) -> Any:  # noqa: N802 - mirrors torch.cuda.Event
        return torch.cuda.Event(enable_timing=timing)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def on_stream(self, stream: Any, device: torch.device) -> contextlib.AbstractContextManager:
        """Run what the block issues on ``stream`` of ``device``."""
        return _both(torch.cuda.device(device), torch.cuda.stream(stream))

    def register_host(self, address: int, nbytes: int, pin: bool) -> None:
        if pin:
            _check(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0), "cudaHostRegister", nbytes)

    def unregister_host(self, address: int, pin: bool) -> None:
        if pin:
            code = _code(torch.cuda.cudart().cudaHostUnregister(address))
            if code != 0:  # in a finalizer: say so, never raise (the next launch would report a bogus error)
                log.warning("tierkv: cudaHostUnregister of a bounce buffer failed (CUDA error %s)", code)


@contextlib.contextmanager
def _both(first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


def _code(status: Any) -> int:
    """The number of a CUDA runtime status (an int, or a pybind enum with ``.value``)."""
    return int(getattr(status, "value", status))


def _check(status: Any, call: str, nbytes: int) -> None:
    code = _code(status)
    if code != 0:
        raise HostRegistrationError(
            f"{call} of a {nbytes}-byte disk bounce buffer failed (CUDA error {code}); the host may be out of "
            "page-lockable memory: lower cpu_gb, or raise the memlock limit (ulimit -l)."
        )


HOST_ONLY = HostOnly()


@functools.cache
def _cuda() -> CudaAccelerator:
    return CudaAccelerator()


def standin_on() -> bool:
    return bool(settings.get("cuda_standin"))


def backend(device: torch.device) -> HostOnly:
    """The accelerator behind a device tier on ``device``: CUDA for a cuda device, the stand-in for the CPU
    when the ``cuda_standin`` setting is on, else :data:`HOST_ONLY`."""
    if device.type == "cuda":
        return _cuda()
    if device.type == "cpu" and standin_on():
        from tierkv.cuda_standin import current

        return current()
    return HOST_ONLY


def host_backend() -> HostOnly:
    """The accelerator a host tier serves: the stand-in when it is on, CUDA where it exists, else none."""
    if standin_on():
        from tierkv.cuda_standin import current

        return current()
    return _cuda() if torch.cuda.is_available() else HOST_ONLY
