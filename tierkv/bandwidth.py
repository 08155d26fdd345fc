"""Link models, presets, calibration and the decode-step time model.

This module knows nothing about tensors: it works in bytes and seconds, so the planner, ``tierkv bench``
and the runtime can all use it, and it can be tested exhaustively on a CPU.

A *link* is one direction of one data path (PCIe host->device, NVMe read, a memcpy) modelled as
``t = n_transfers * latency + nbytes / bandwidth``. A :class:`LinkProfile` holds the links of one machine,
from presets or from ``tierkv bench``. :func:`predict_step` turns a per-layer :class:`Placement` (how many
bytes each layer needs from the host and from disk this step, and its compute time) into a
:class:`StepForecast` under the layer-ahead pipeline of the exact-gather executor::

    layer:         0        1        2        3
    disk->host   [D0][D1]     [D2]     [D3]            disk read of layer i ...
    host->device [H0]  [H1]     [H2]     [H3]          ... then its copy to the device
    compute            [C0 ]    [C1 ]    [C2 ]    [C3 ]
                 |fill|         (prefetch depth 1: layer i's transfers start when
                                 layer i-2 has finished and freed its staging buffer)

The equations are in ``docs/bandwidth-model.md``.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
import json
import math
import os
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from tierkv import safefs
from tierkv.errors import InvalidConfigError
from tierkv.inputs import printable, read_json
from tierkv.vocabulary import PROFILE_LINKS, LinkName

LINK_KEYS = PROFILE_LINKS
"""The directions a :class:`LinkProfile` describes. ``device->device`` is the gather of device-resident
blocks into the staging buffer; ``host->host`` is a memcpy (the bounce buffer of a POSIX disk read)."""

DISK_READ_AHEAD = 4
"""Layers whose disk reads the executors submit ahead of their prefetch (``PipelinedExecutor._read_ahead``):
the disk engine works through them on its own threads while the mover copies and the model computes."""


MIN_LINK_BANDWIDTH = 1e3  # bytes/s a profile file may claim for a link or the host's attention: every real one lies
MAX_LINK_BANDWIDTH = 1e15  # between, and a prediction from outside overflows or divides by nearly zero
MAX_LINK_LATENCY_S = 60.0
MAX_HOST_THREADS = 65536
MAX_COMPUTE_FLOPS = 1e18  # FLOP/s a profile's machine["compute_flops"] may claim: far above any host's
PROFILE_FORMAT = 1  # a saved profile's "format": a later one is a newer tierkv's (absent: written before it was)
_PROFILE_FIELDS = {"format", "links", "machine", "serial_mover", "contention", "layer_overhead_s", "host_attention",
                   "disk_contention"}  # (the last: profiles written before the four contention factors; not read)
_COMPUTE_FLOPS_KEY = "compute_flops"  # tierkv.planner.COMPUTE_FLOPS_KEY (the planner imports this module)


@dataclass(frozen=True, slots=True)
class Link:
    """One direction of one data path: ``time = n_transfers * latency + nbytes / bandwidth``.

    Two numbers are enough for the copies tierkv issues (large, batched, sequential): the latency term is
    what makes small transfers slow, the bandwidth term what makes big ones slow.
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise InvalidConfigError(
                f"link {self.name!r}: bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} must be a "
                "positive finite number of bytes per second (e.g. 25e9 for PCIe 4.0 x16)."
            )
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise InvalidConfigError(
                f"link {self.name!r}: latency_s={self.latency_s!r} must be a finite number of seconds >= 0."
            )

    def transfer_time(self, nbytes: int, n_transfers: int = 1) -> float:
        """Seconds to move ``nbytes`` split into ``n_transfers`` copies issued back to back."""
        if nbytes < 0 or n_transfers < 0:
            raise InvalidConfigError(
                f"link {self.name!r}: nbytes={nbytes} and n_transfers={n_transfers} must both be >= 0."
            )
        return n_transfers * self.latency_s + nbytes / self.bandwidth_bytes_per_s


def fit_link(name: str, sizes_bytes: Sequence[int], seconds: Sequence[float]) -> Link:
    """Fit ``t = latency + nbytes / bandwidth`` to measured (size, time) pairs by least squares.

    Measurements over a range of sizes separate the two terms: the intercept is the per-transfer latency,
    the slope the inverse bandwidth. Noise can push the unconstrained intercept below zero; a latency
    cannot be negative, so the fit is then redone with the latency fixed at 0 (the constrained optimum
    of this convex problem lies on that boundary). One sample slowed by a busy host can tilt the least-squares
    slope to zero or below; the fit then falls back to Theil-Sen (the median of the pairwise slopes), which
    ignores such outliers, so a noisy run still yields the link instead of dropping it from the profile.
    """
    if len(sizes_bytes) != len(seconds):
        raise InvalidConfigError(
            f"fit_link({name!r}): {len(sizes_bytes)} sizes but {len(seconds)} times; give one time per size."
        )
    xs = [float(s) for s in sizes_bytes]
    ts = [float(t) for t in seconds]
    if any(not math.isfinite(x) or x < 0 for x in xs) or any(not math.isfinite(t) or t <= 0 for t in ts):
        raise InvalidConfigError(
            f"fit_link({name!r}): sizes must be finite and >= 0 and times finite and > 0; "
            "drop failed or zero-time measurements before fitting."
        )
    if len(set(xs)) < 2:
        raise InvalidConfigError(
            f"fit_link({name!r}): need measurements at >= 2 distinct sizes to separate latency from "
            f"bandwidth, got sizes {sorted(set(sizes_bytes))}; measure e.g. 64 KiB, 1 MiB and 64 MiB."
        )
    n = len(xs)
    mean_x, mean_t = sum(xs) / n, sum(ts) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxt = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, ts, strict=True))
    slope = sxt / sxx
    latency = mean_t - slope * mean_x
    if latency < 0:
        slope = sum(x * t for x, t in zip(xs, ts, strict=True)) / sum(x * x for x in xs)
        latency = 0.0
    if slope <= 0 and len(set(xs)) >= 3:  # an outlier, not a flat series: the robust estimate
        pairs = [(xs[j], ts[j], xs[i], ts[i]) for i in range(n) for j in range(i) if xs[i] != xs[j]]
        slope = statistics.median((t2 - t1) / (x2 - x1) for x1, t1, x2, t2 in pairs)
        latency = max(0.0, statistics.median(t - slope * x for x, t in zip(xs, ts, strict=True)))
    if slope <= 0:
        raise InvalidConfigError(
            f"fit_link({name!r}): time does not grow with size (slope {slope:.3g} s/B), so no bandwidth "
            "can be fitted; the sizes are probably too small to leave the latency regime: measure larger "
            "transfers."
        )
    return Link(name, 1.0 / slope, latency)


PRESETS: dict[str, Link] = {
    # PCIe x16, one direction, pinned host memory. Raw: 16 GT/s * 16 lanes * 128/130 = 31.5 GB/s (4.0),
    # 63 GB/s (5.0). Achieved: CUDA bandwidthTest reports ~25 GB/s on A100-PCIe and ~50-55 GB/s on
    # H100-PCIe. Latency: ~10 us per cudaMemcpyAsync (launch + DMA setup). Pageable memory roughly halves it.
    "pcie4": Link("pcie4-x16", 25e9, 10e-6),
    "pcie5": Link("pcie5-x16", 50e9, 10e-6),
    # NVMe, large sequential reads/writes at high queue depth, vendor data sheets: Gen4 drives ~7 GB/s
    # read / ~6 GB/s write (Samsung 990 Pro 7.45 / 6.9), Gen5 ~14 / ~12 (Crucial T705 14.5 / 12.7).
    # Latency: ~80 us per request (flash read latency + submission), an assumption, not a data-sheet value.
    "nvme-gen4": Link("nvme-gen4-read", 7e9, 80e-6),
    "nvme-gen5": Link("nvme-gen5-read", 14e9, 80e-6),
    "nvme-gen4-write": Link("nvme-gen4-write", 6e9, 80e-6),
    "nvme-gen5-write": Link("nvme-gen5-write", 12e9, 80e-6),
    # Host memcpy, multi-threaded on a current server socket (single-threaded is ~10 GB/s); ~1 us call cost.
    "dram": Link("dram-memcpy", 20e9, 1e-6),
    # Device-to-device copy on H100-class HBM3: 3.35 TB/s peak, a copy reads and writes every byte, so
    # ~1.3 TB/s of copied bytes is achieved; ~5 us kernel launch.
    "hbm": Link("hbm-copy", 1.3e12, 5e-6),
}
"""Named links with documented, typical achieved values. Prefer a measured :class:`LinkProfile`."""

_PCIE_PRESETS = ("pcie4", "pcie5")
_DISK_PRESETS = ("nvme-gen4", "nvme-gen5")


def _preset(name: str, allowed: Sequence[str], what: str) -> Link:
    if name not in allowed:
        raise InvalidConfigError(f"unknown {what} preset {name!r}; choose one of: {', '.join(allowed)}.")
    return PRESETS[name]


MAX_SLOWDOWN = 4.0


@dataclass(frozen=True, slots=True)
class HostAttention:
    """The host paged-attention kernel's measured rate (``tierkv bench``): bytes of K/V attended per second in
    place, on every thread torch uses (``threads``) and on one, and which implementation ran (``native``: the C
    kernel of ``native/tierkv_attn.c``; ``torch``: its fallback)."""

    bandwidth_bytes_per_s: float
    single_thread_bytes_per_s: float
    threads: int
    kernel: str = "native"

    def __post_init__(self) -> None:
        for name in ("bandwidth_bytes_per_s", "single_thread_bytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InvalidConfigError(f"HostAttention.{name}={value!r} must be a positive finite number of bytes "
                                         "per second; measure it with `tierkv bench`.")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise InvalidConfigError(f"HostAttention.threads={self.threads!r} must be an int >= 1.")


@dataclass(frozen=True, slots=True)
class Contention:
    """How much the mover's work and the model's compute slow each other where they overlap, on a CPU-only
    host (cores, caches and DRAM are shared), as slowdown factors >= 1, each side measured separately by
    ``tierkv bench``: the compute's while the mover copies or reads, the mover's copies and disk reads while
    the compute runs. 1 everywhere means independent (e.g. DMA engines on a GPU host)."""

    compute_by_copies: float = 1.0
    copies_by_compute: float = 1.0
    compute_by_disk: float = 1.0
    disk_by_compute: float = 1.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and 1.0 <= value <= MAX_SLOWDOWN):
                raise InvalidConfigError(
                    f"Contention.{name}={value!r} must be a slowdown in [1, {MAX_SLOWDOWN:g}] (1: no slowdown); "
                    "measure it with `tierkv bench`."
                )

    @classmethod
    def uniform(cls, factor: float) -> Contention:
        """Every side slowed by ``factor``: processor sharing of one resource."""
        return cls(factor, factor, factor, factor)

    @property
    def is_none(self) -> bool:
        return all(value == 1.0 for value in asdict(self).values())


@dataclass
class LinkProfile:
    """Per-direction links of one machine. Keys of `links`: "host->device", "device->host", "disk->host",
    "host->disk", "device->device" (block gather into the device tier), "host->host" (memcpy)."""

    links: dict[str, Link]
    machine: dict[str, str] = field(default_factory=dict)
    serial_mover: bool = False
    """True on CPU-only hosts: one mover thread runs a layer's copies and disk reads one after the other,
    device gathers included, beside compute. False (CUDA): disk reads and copies pipeline on their own
    queues, and device gathers share HBM with compute."""
    contention: Contention = field(default_factory=Contention)
    """How the mover's copies and disk reads and compute slow each other where they overlap (CPU-only hosts;
    measured by ``tierkv bench``)."""
    layer_overhead_s: float = 0.0
    """The cache's own work per layer on the compute thread once the layer's data is ready (bookkeeping,
    the read of the newest tokens, submitting the next prefetch): it delays the layer's compute and, when
    the mover is the bottleneck, the mover's next job. Measured by ``tierkv bench`` on CPU-only hosts."""
    host_attention: HostAttention | None = None
    """The host attention kernel's measured rate (``tierkv bench``); None in presets and in profiles measured
    before it was (the planner then estimates it: ``tierkv.planner.host_attention_rate``)."""
    path: str = field(default="", compare=False, repr=False)
    """The file :meth:`load` read it from (errors name it); empty for a profile built in code."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.links) - set(LINK_KEYS))
        if unknown:
            raise InvalidConfigError(
                f"LinkProfile: unknown link keys {unknown}; valid keys: {', '.join(LINK_KEYS)}."
            )
        if not (isinstance(self.layer_overhead_s, (int, float)) and math.isfinite(self.layer_overhead_s)
                and self.layer_overhead_s >= 0):
            raise InvalidConfigError(
                f"LinkProfile.layer_overhead_s={self.layer_overhead_s!r} must be a finite number of seconds >= 0."
            )
        if self.host_attention is not None and not isinstance(self.host_attention, HostAttention):
            raise InvalidConfigError(f"LinkProfile.host_attention={self.host_attention!r} must be a HostAttention "
                                     "or None; measure it with `tierkv bench`.")
        if not isinstance(self.contention, Contention):
            raise InvalidConfigError(
                f"LinkProfile.contention={self.contention!r} must be a Contention (slowdowns of compute and of the "
                "mover's copies and disk reads where they overlap); measure it with `tierkv bench`."
            )

    def link(self, key: str) -> Link:
        """The link for direction ``key``, with an error that says how to get it when it is missing."""
        try:
            return self.links[key]
        except KeyError:
            where = f" {self.path!r}" if self.path else ""
            raise InvalidConfigError(
                f"the link profile{where} has no '{key}' link (it has: {', '.join(self.links) or 'none'}); "
                "measure it with `tierkv bench` or start from LinkProfile.from_presets()."
            ) from None

    def replace(self, **links: Link) -> LinkProfile:
        """A copy with some links swapped, e.g. ``profile.replace(**{"host->device": PRESETS["pcie5"]})``."""
        return dataclasses.replace(self, links={**self.links, **links}, machine=dict(self.machine))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON (``{"links": {key: Link fields}, "machine": {...}}``)."""
        data = {"format": PROFILE_FORMAT, "links": {key: asdict(link) for key, link in self.links.items()},
                "machine": self.machine,
                "serial_mover": self.serial_mover, "contention": asdict(self.contention),
                "layer_overhead_s": self.layer_overhead_s}
        if self.host_attention is not None:
            data["host_attention"] = asdict(self.host_attention)
        # never through a planted link, never group-shared (only the persistent tree is)
        safefs.write_file(path, [(json.dumps(data, indent=2) + "\n").encode()], shared=False)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LinkProfile:
        """Read a profile written by :meth:`save` (``tierkv bench --profile-out``); one of a later format (a newer
        tierkv's) or with fields no profile has is refused, not planned with in part."""
        data = read_json(path, "link profile", "create one with `tierkv bench` or use presets")
        _check_profile_fields(data, os.fspath(path))
        try:
            links = {
                key: Link(printable(v["name"]), _number(v["bandwidth_bytes_per_s"], f"{key}.bandwidth_bytes_per_s"),
                          _number(v["latency_s"], f"{key}.latency_s"))
                for key, v in data["links"].items()
            }
            machine = {printable(k): printable(v) for k, v in data.get("machine", {}).items()}
            _check_flops(machine.get(_COMPUTE_FLOPS_KEY))
            serial, contention = data.get("serial_mover", False), data.get("contention", {})
            if isinstance(contention, (int, float)):  # profiles written before the four factors: one for all
                contention = Contention.uniform(_number(contention, "contention"))
            else:
                contention = Contention(**{str(k): _number(v, f"contention.{k}") for k, v in contention.items()})
            overhead = _number(data.get("layer_overhead_s", 0.0), "layer_overhead_s")
            attention = data.get("host_attention")  # absent in profiles measured before the kernel was
            if attention is not None:
                attention = HostAttention(
                    _number(attention["bandwidth_bytes_per_s"], "host_attention.bandwidth_bytes_per_s"),
                    _number(attention["single_thread_bytes_per_s"], "host_attention.single_thread_bytes_per_s"),
                    _threads(attention["threads"]), printable(attention.get("kernel", "native")))
            if not isinstance(serial, bool):
                raise TypeError(f"serial_mover must be true or false, got {_shown(serial)}")
            _check_plausible(links, attention, overhead)
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
            if isinstance(e, InvalidConfigError):
                raise
            raise InvalidConfigError(
                f"link profile {os.fspath(path)!r} is malformed ({type(e).__name__}: {e}); expected "
                '{"links": {"host->device": {"name": ..., "bandwidth_bytes_per_s": ..., "latency_s": ...}, '
                "...}, "
                '"machine": {...}}.'
            ) from None
        return cls(links, machine, serial, contention, overhead, attention, os.fspath(path))

    @classmethod
    def from_presets(cls, link: str = "pcie4", disk: str = "nvme-gen4") -> LinkProfile:
        """A profile assembled from :data:`PRESETS`: PCIe both ways, NVMe read/write, HBM gather, memcpy."""
        pcie = _preset(link, _PCIE_PRESETS, "link")
        read = _preset(disk, _DISK_PRESETS, "disk")
        return cls(
            {
                LinkName.HOST_TO_DEVICE: pcie,
                LinkName.DEVICE_TO_HOST: pcie,
                LinkName.DISK_TO_HOST: read,
                LinkName.HOST_TO_DISK: PRESETS[f"{disk}-write"],
                LinkName.DEVICE_TO_DEVICE: PRESETS["hbm"],
                LinkName.HOST_TO_HOST: PRESETS["dram"],
            },
            {"source": f"presets: {link}, {disk}"},
        )


# --------------------------------------------------------------------------- step-time model


@dataclass(frozen=True, slots=True)
class LayerLoad:
    """What one layer needs during one decode step.

    ``device_bytes`` are gathered on the device into the staging buffer (device->device); they use the same
    HBM bandwidth as the compute, so their time is added to the layer's compute rather than overlapped.
    ``host_bytes`` cross host->device; ``disk_bytes`` cross disk->host and then host->device. The
    ``*_transfers`` counts are how many separate copies carry them (1 when the mover batches a layer's
    blocks into one copy per link); they only matter through the links' latency. ``repeat`` runs the load that
    many times in a row, each a pipeline stage of its own (a streaming layer's equal chunks): a run of any length
    costs :func:`predict_step` a bounded amount of work.
    """

    compute_s: float
    device_bytes: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0
    host_transfers: int = 1
    disk_transfers: int = 1
    repeat: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compute_s) and self.compute_s >= 0):
            raise InvalidConfigError(f"LayerLoad.compute_s={self.compute_s!r} must be a finite number >= 0.")
        if isinstance(self.repeat, bool) or not isinstance(self.repeat, int) or self.repeat < 1:
            raise InvalidConfigError(f"LayerLoad.repeat={self.repeat!r} must be an int >= 1 (stages in a row).")
        for name in ("device_bytes", "host_bytes", "disk_bytes", "host_transfers", "disk_transfers"):
            if getattr(self, name) < 0:
                raise InvalidConfigError(f"LayerLoad.{name}={getattr(self, name)} must be >= 0.")


@dataclass(frozen=True, slots=True)
class Placement:
    """Per-layer loads of one decode step, in layer order, plus the work outside the layers.

    ``other_compute_s`` (embedding, final norm, LM head, sampling) runs after the last layer and hides no
    transfer: the next step's layer-0 prefetch is not issued before the step starts.
    """

    layers: tuple[LayerLoad, ...]
    other_compute_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.layers:
            raise InvalidConfigError("Placement needs at least one layer.")
        if not (math.isfinite(self.other_compute_s) and self.other_compute_s >= 0):
            raise InvalidConfigError(f"Placement.other_compute_s={self.other_compute_s!r} must be >= 0.")

    @property
    def stages(self) -> int:
        """Pipeline stages: every load counted ``repeat`` times."""
        return sum(layer.repeat for layer in self.layers)

    def spelled_out(self) -> tuple[LayerLoad, ...]:
        """One load per stage: each run of ``repeat`` loads written out (work in proportion to :attr:`stages`)."""
        return tuple(dataclasses.replace(layer, repeat=1) for layer in self.layers for _ in range(layer.repeat))

    @classmethod
    def uniform(
        cls,
        n_layers: int,
        compute_s_per_layer: float,
        *,
        host_bytes_per_layer: int = 0,
        disk_bytes_per_layer: int = 0,
        device_bytes_per_layer: int = 0,
        other_compute_s: float = 0.0,
    ) -> Placement:
        """``n_layers`` identical layers: as in a model whose layers all hold the full context."""
        if n_layers < 1:
            raise InvalidConfigError(f"n_layers={n_layers} must be >= 1.")
        layer = LayerLoad(
            compute_s_per_layer,
            device_bytes=device_bytes_per_layer,
            host_bytes=host_bytes_per_layer,
            disk_bytes=disk_bytes_per_layer,
        )
        return cls((layer,) * n_layers, other_compute_s)


class Bottleneck(str, enum.Enum):
    """The resource whose total busy time in a step is the largest: the one to buy more of."""

    COMPUTE = "compute"
    HOST_TO_DEVICE = "host->device"
    DISK = "disk"
    HOST_ATTENTION = "host attention"  # the split executor: the host's CPUs attending the KV where it lives


@dataclass(frozen=True, slots=True)
class StepForecast:
    """Predicted time of one decode step and where it goes.

    ``compute_s``, ``host_to_device_s`` and ``disk_s`` are each resource's total busy time; the step can
    be no shorter than the largest of them (``lower_bound_s``). ``fill_s`` is the time before layer 0
    can start computing (its transfers are not hidden); ``stall_s`` all the time compute waits on data.
    """

    step_s: float
    compute_s: float
    host_to_device_s: float
    disk_s: float
    fill_s: float
    stall_s: float
    prefetch_depth: int
    bottleneck: Bottleneck
    serial_mover: bool = False  # one mover thread does copies and disk reads in turn (CPU-only host, no read-ahead)
    host_attention_s: float = 0.0  # the split executor: the host's CPUs attending host (and disk) KV in place
    attention_on_compute: bool = False  # ... on the compute thread, after the layer's compute (CPU-only host)

    @property
    def lower_bound_s(self) -> float:
        """A perfectly overlapped step: ``max(compute, host->device, disk, host attention)``; with a serial mover
        ``max(compute, host->device + disk)``; with the attention on the compute thread ``max(compute + host
        attention, disk)``."""
        if self.serial_mover:
            return max(self.compute_s, self.host_to_device_s + self.disk_s)
        if self.attention_on_compute:
            return max(self.compute_s + self.host_attention_s, self.host_to_device_s, self.disk_s)
        return max(self.compute_s, self.host_to_device_s, self.disk_s, self.host_attention_s)

    @property
    def overlap_efficiency(self) -> float:
        """``lower_bound_s / step_s`` in (0, 1]: 1 when every transfer hides behind the bottleneck."""
        return self.lower_bound_s / self.step_s if self.step_s > 0 else 1.0


def _stage(link_key: str, links: LinkProfile, nbytes: int, n_transfers: int) -> float:
    """Time of one pipeline stage; an empty stage costs nothing and needs no link in the profile."""
    return links.link(link_key).transfer_time(nbytes, n_transfers) if nbytes > 0 else 0.0


def predict_step(placement: Placement, links: LinkProfile, prefetch_depth: int = 1, *,
                 jitter: float = 0.0, read_ahead: int = 0) -> StepForecast:
    """Predict one decode step's time with transfers overlapped with compute.

    The model is the exact-gather pipeline with ``prefetch_depth + 1`` staging buffers on the device:
    layer ``i``'s transfers may start once layer ``i - depth - 1`` has finished computing and freed its
    buffer (at step start for the first ``depth + 1`` layers). Depth 1 is layer-ahead prefetch
    (layer L+1's copies run while layer L computes); depth 0 is no prefetch. A layer computes once its
    data is on the device and the previous layer is done. How the transfers queue depends on the host
    (``links.serial_mover``): on CUDA each link is a FIFO queue in layer order (a layer's disk bytes go
    disk->host then host->device, its host bytes host->device only) and the device gather is added to
    compute; on a CPU-only host one mover thread runs each layer's gather, copies and disk read in turn,
    and where its job overlaps compute both slow down as ``links.contention`` says. See
    ``docs/bandwidth-model.md`` for the recurrences.

    ``jitter`` (0 = exact times) is the coefficient of variation of every per-layer stage time, e.g. the
    spread of a noisy CPU host's per-layer compute spans in the telemetry; the step is then the expected
    one (:func:`_mean_with_jitter`). ``read_ahead``: a layer's disk read is submitted that many layers
    before its prefetch, on the disk engine's own threads — the executors do so with
    :data:`DISK_READ_AHEAD`; 0 submits it with the prefetch (inside the mover's job on a CPU host).
    """
    if prefetch_depth < 0:
        raise InvalidConfigError(f"prefetch_depth={prefetch_depth} must be >= 0 (0 = no prefetch).")
    if not (math.isfinite(jitter) and 0.0 <= jitter <= 1.0):
        raise InvalidConfigError(f"jitter={jitter!r} must be a coefficient of variation in [0, 1] (0: exact times).")
    layers = placement.spelled_out() if jitter > 0 else placement.layers  # each stage varies on its own
    contended = links.serial_mover and prefetch_depth > 0 and not links.contention.is_none
    if contended:
        layers = _edges(layers, prefetch_depth)
    counts = [layer.repeat for layer in layers]
    disk = [_stage(LinkName.DISK_TO_HOST, links, layer.disk_bytes, layer.disk_transfers) for layer in layers]
    host = [_stage(LinkName.HOST_TO_DEVICE, links, layer.host_bytes, layer.host_transfers) for layer in layers]
    host_disk = [_stage(LinkName.HOST_TO_DEVICE, links, layer.disk_bytes, layer.disk_transfers) for layer in layers]
    gather = [_stage(LinkName.DEVICE_TO_DEVICE, links, layer.device_bytes, 1) for layer in layers]
    if links.serial_mover:
        compute = [layer.compute_s for layer in layers]
        copies = [g + h + hd for g, h, hd in zip(gather, host, host_disk)]
        if contended:
            compute, copies, disk = _contended(compute, copies, disk, counts, prefetch_depth, links.contention)
        # the copy out of a layer's disk bounce buffer can only follow its read: its share of the mover's job
        host_disk = [c * hd / (g + h + hd) if g + h + hd > 0 else 0.0
                     for c, g, h, hd in zip(copies, gather, host, host_disk)]
        copies = [c - hd for c, hd in zip(copies, host_disk)]
    else:
        compute = [layer.compute_s + g for layer, g in zip(layers, gather)]
        copies = [0.0] * len(layers)
    stages = (compute, host, host_disk, disk, copies)
    overhead = links.layer_overhead_s
    shape = (links.serial_mover, prefetch_depth, overhead, read_ahead)
    end, first_compute_start = _pipeline(*stages, counts, *shape)
    if jitter > 0:
        end = _mean_with_jitter(stages, *shape, jitter)

    def total(times: list[float]) -> float:
        return sum(t * n for t, n in zip(times, counts))

    compute_total = total(compute) + sum(counts) * overhead + placement.other_compute_s
    h2d_total = total(copies) + total(host_disk) if links.serial_mover else total(host) + total(host_disk)
    disk_total = total(disk)
    step = end + placement.other_compute_s
    busy = {Bottleneck.HOST_TO_DEVICE: h2d_total, Bottleneck.DISK: disk_total}
    transfer = max(busy, key=busy.__getitem__)
    serial_disk = links.serial_mover and not read_ahead  # the disk read inside the mover's job
    mover = h2d_total + disk_total if serial_disk else busy[transfer]
    return StepForecast(
        step_s=step,
        compute_s=compute_total,
        host_to_device_s=h2d_total,
        disk_s=disk_total,
        fill_s=first_compute_start,
        stall_s=max(0.0, step - compute_total),
        prefetch_depth=prefetch_depth,
        bottleneck=Bottleneck.COMPUTE if compute_total >= mover else transfer,
        serial_mover=serial_disk,
    )


def predict_split_step(placement: Placement, links: LinkProfile, host_attention_bytes_per_s: float, *,
                       query_bytes: int = 0, partial_bytes: int = 0, read_ahead: int = DISK_READ_AHEAD,
                       on_compute_thread: bool = False) -> StepForecast:
    """Predict one decode step of the split executor: each tier's KV attended where it lives, nothing staged.

    Per layer (``docs/bandwidth-model.md``, "Split"): the device computes the layer with its own KV in place
    (``compute_s``; ``device_bytes`` move nowhere), while the host's CPUs attend ``host_bytes`` at
    ``host_attention_bytes_per_s`` and then ``disk_bytes`` once their read has landed; the query goes down
    (``query_bytes``, device->host) and the CPU part's (output, log-sum-exp), its host and disk shares merged
    there, comes up (``partial_bytes``), and the layer ends when both sides have. Disk reads queue on the disk in layer
    order, each submitted ``read_ahead`` layers ahead (when layer ``i - read_ahead`` starts). With
    ``on_compute_thread`` (a CPU-only host: the "device" is host memory) one thread computes the layer, then
    attends every share (device blocks too) in turn, and no query crosses a link.
    """
    if not (math.isfinite(host_attention_bytes_per_s) and host_attention_bytes_per_s > 0):
        raise InvalidConfigError(f"host_attention_bytes_per_s={host_attention_bytes_per_s!r} must be a positive "
                                 "number of bytes per second.")
    if read_ahead < 0:
        raise InvalidConfigError(f"read_ahead={read_ahead} must be >= 0.")
    layers = placement.spelled_out()  # the planner's split loads are one per layer
    starts: list[float] = []
    t = disk_free = 0.0
    compute_total = attention_total = merge_total = disk_total = 0.0
    for i, layer in enumerate(layers):
        starts.append(t)
        disk = _stage(LinkName.DISK_TO_HOST, links, layer.disk_bytes, layer.disk_transfers)
        landed = t
        if layer.disk_bytes > 0:
            disk_free = landed = max(starts[i - read_ahead] if i >= read_ahead else 0.0, disk_free) + disk
        in_memory = layer.host_bytes + (layer.device_bytes if on_compute_thread else 0)
        memory_s = in_memory / host_attention_bytes_per_s
        disk_attention_s = layer.disk_bytes / host_attention_bytes_per_s
        if on_compute_thread:
            merge = 0.0
            end = max(t + layer.compute_s + memory_s, landed) + disk_attention_s
        else:
            cpu_part = layer.host_bytes + layer.disk_bytes > 0
            merge = (_stage(LinkName.DEVICE_TO_HOST, links, query_bytes, 1)
                     + _stage(LinkName.HOST_TO_DEVICE, links, partial_bytes, 1)) if cpu_part else 0.0
            cpu_end = max(t + memory_s, landed) + disk_attention_s + merge if cpu_part else t
            end = max(t + layer.compute_s, cpu_end)
        compute_total += layer.compute_s
        attention_total += memory_s + disk_attention_s
        merge_total += merge
        disk_total += disk
        t = end
    step = t + placement.other_compute_s
    compute_total += placement.other_compute_s
    if on_compute_thread:
        busy = {Bottleneck.COMPUTE: compute_total + attention_total, Bottleneck.DISK: disk_total}
        if attention_total > compute_total and busy[Bottleneck.COMPUTE] >= disk_total:
            busy[Bottleneck.HOST_ATTENTION] = busy.pop(Bottleneck.COMPUTE)
    else:
        busy = {Bottleneck.COMPUTE: compute_total, Bottleneck.HOST_ATTENTION: attention_total,
                Bottleneck.HOST_TO_DEVICE: merge_total, Bottleneck.DISK: disk_total}
    work = compute_total + (attention_total if on_compute_thread else 0.0)
    return StepForecast(
        step_s=step,
        compute_s=compute_total,
        host_to_device_s=merge_total,
        disk_s=disk_total,
        fill_s=0.0,  # layer 0 computes at once: nothing is staged before it
        stall_s=max(0.0, step - work),
        prefetch_depth=0,
        bottleneck=max(busy, key=busy.__getitem__),
        host_attention_s=attention_total,
        attention_on_compute=on_compute_thread,
    )


Stage = tuple[float, float, float, float, float]
"""One stage's times as :func:`_pipeline` takes them: compute, host copy, disk-bytes copy, disk read, mover copies."""

DIRECT_STAGES = 256
"""Stages of one run that :func:`_pipeline` steps through one by one; the rest of a longer run it jumps over in
closed form (a streaming layer's chunks at a context of millions of tokens, or of tiny chunks)."""


def _pipeline(compute: Sequence[float], host: Sequence[float], host_disk: Sequence[float], disk: Sequence[float],
              copies: Sequence[float], counts: Sequence[int], serial: bool, depth: int, overhead: float,
              read_ahead: int = 0) -> tuple[float, float]:
    """The recurrences of :func:`predict_step` on stage times: (last compute's end, first's start).

    Entry ``k`` of each sequence is a run of ``counts[k]`` equal stages (layers, or a streaming layer's chunks).
    Stage ``i``'s gather returns ``overhead`` after both its data is ready and stage ``i - 1`` is done, and its
    compute starts then. Stage ``i + depth``'s transfers may start when stage ``i - 1`` is done and has
    released its staging buffer; with a serial mover (a CPU host) and prefetch only once stage ``i``'s
    gather returns, because the compute thread submits that job from it, after waiting for stage ``i``'s
    job to finish. Disk reads queue on the disk (FIFO) from ``read_ahead`` stages earlier: stage ``i``'s is
    submitted when stage ``i - depth - read_ahead``'s gather returns; on a serial mover the job copies the
    stage's memory blocks, then waits for its disk read and copies it out of the bounce buffer
    (``host_disk``). Before the first stage every time is 0.

    A run's first :data:`DIRECT_STAGES` stages are stepped through; the rest is one max-plus matrix power
    (:func:`_jump`): each stage's times are maxima of earlier times plus constants, so equal stages compose
    into a matrix, and ``n`` of them cost ``log2(n)`` matrix products.
    """
    ends = [0.0] * (depth + 1)  # compute ends of the last depth + 1 stages
    starts = [0.0] * (depth + read_ahead)  # gather returns of the last depth + read_ahead stages
    free = [0.0, 0.0]  # when the disk and the host->device queue are next free
    shape = (serial, depth, overhead, read_ahead)
    powers: dict[Stage, list[list[list[float]]]] = {}
    for stage, count in zip(zip(compute, host, host_disk, disk, copies), counts, strict=True):
        for _ in range(min(count, DIRECT_STAGES)):
            _advance(ends, starts, free, stage, *shape)
        if count > DIRECT_STAGES:
            _jump(ends, starts, free, stage, count - DIRECT_STAGES, powers.setdefault(stage, []), shape)
    return ends[-1], starts[depth + read_ahead]


def _advance(ends: list[float], starts: list[float], free: list[float], stage: Stage, serial: bool, depth: int,
             overhead: float, read_ahead: int) -> None:
    """One stage of :func:`_pipeline`: appends its compute end and gather return, moves the queues' free times."""
    compute, host, host_disk, disk, copies = stage
    issue = ends[-depth - 1]  # the stage whose staging buffer this one reuses is done
    if serial and depth > 0:
        issue = max(issue, starts[-depth])
    disk_issue = starts[-depth - read_ahead] if read_ahead else issue
    disk_free, h2d_free = free
    ready = -math.inf  # when all of the stage's bytes are on the device
    if serial and not read_ahead:  # the job reads the disk, then copies, in turn
        if copies + disk + host_disk > 0:
            h2d_free = ready = max(issue, h2d_free) + disk + copies + host_disk
    elif serial:  # the read was in flight on the engine's threads; the job copies, then lands it
        if disk > 0:
            disk_free = max(disk_issue, disk_free) + disk
        if copies + disk + host_disk > 0:
            copied = max(issue, h2d_free) + copies
            h2d_free = ready = (max(copied, disk_free) if disk > 0 else copied) + host_disk
    else:
        if disk > 0:
            disk_free = max(disk_issue, disk_free) + disk
        if host > 0:
            h2d_free = ready = max(issue, h2d_free) + host
        if disk > 0:  # its copy into staging waits for the read and for the staging buffer
            h2d_free = ready = max(disk_free, h2d_free, issue) + host_disk
    start = max(ends[-1], ready) + overhead
    starts.append(start)
    ends.append(start + compute)
    free[:] = disk_free, h2d_free


Matrix = list[list[float]]


def _jump(ends: list[float], starts: list[float], free: list[float], stage: Stage, count: int,
          powers: list[Matrix], shape: tuple[bool, int, float, int]) -> None:
    """``count`` more stages of ``stage`` in :func:`_pipeline`, in ``log2(count)`` max-plus products.

    The state the next stage reads is ``x`` = the windows of ``ends`` and ``starts`` and the queues' free times;
    :func:`_advance` maps it to ``max_j (A[i][j] + x[j])`` (it only adds the stage's times and takes maxima), and
    ``A``'s column ``j`` is the stage advanced from ``x[j] = 0``, every other entry -inf. ``powers`` caches
    ``A``, ``A²``, ``A⁴``, ... for runs of the same stage.
    """
    depth, read_ahead = shape[1], shape[3]
    sizes = (depth + 1, depth + read_ahead)

    def state() -> list[float]:
        return [*ends[len(ends) - sizes[0]:], *starts[len(starts) - sizes[1]:], *free]

    if not powers:
        columns = []
        for j in range(sum(sizes) + 2):
            probe = [-math.inf] * (sum(sizes) + 2)
            probe[j] = 0.0
            e, s, f = probe[:sizes[0]], probe[sizes[0]:sizes[0] + sizes[1]], probe[sizes[0] + sizes[1]:]
            _advance(e, s, f, stage, *shape)
            columns.append([*e[len(e) - sizes[0]:], *s[len(s) - sizes[1]:], *f])
        powers.append([list(row) for row in zip(*columns)])
    x, bit = state(), 0
    while count:
        if bit == len(powers):
            powers.append(_product(powers[-1], powers[-1]))
        if count & 1:
            x = [max(a + b for a, b in zip(row, x)) for row in powers[bit]]
        count >>= 1
        bit += 1
    ends.extend(x[:sizes[0]])
    starts.extend(x[sizes[0]:sizes[0] + sizes[1]])
    free[:] = x[sizes[0] + sizes[1]:]


def _product(a: Matrix, b: Matrix) -> Matrix:
    """The max-plus product: ``(a ⊗ b)[i][j] = max_k a[i][k] + b[k][j]``."""
    columns = list(zip(*b))
    return [[max(x + y for x, y in zip(row, column)) for column in columns] for row in a]


JITTER_SAMPLES = 64


def _mean_with_jitter(stages: tuple[list[float], ...], serial: bool, depth: int, overhead: float,
                      read_ahead: int, jitter: float) -> float:
    """The expected end of the pipeline when every stage time varies with coefficient of variation ``jitter``.

    A balanced pipeline (compute and transfers of a layer about equal) waits each layer on the slower of two
    noisy stages, so it is slower on average than the recurrences on mean times say. Each stage time is
    multiplied by a lognormal factor; :data:`JITTER_SAMPLES` stratified samples with mean exactly 1 per stage
    (seeded: the forecast is deterministic), so every busy total keeps its mean and the bounds still hold.
    """
    rng = random.Random(0)
    sigma = math.sqrt(math.log1p(jitter * jitter))
    normal = statistics.NormalDist()
    quantiles = [math.exp(sigma * normal.inv_cdf((k + 0.5) / JITTER_SAMPLES)) for k in range(JITTER_SAMPLES)]
    mean = sum(quantiles) / JITTER_SAMPLES
    quantiles = [q / mean for q in quantiles]

    def factors() -> list[float]:
        shuffled = list(quantiles)
        rng.shuffle(shuffled)
        return shuffled

    per_stage = [[factors() for _ in stage] for stage in stages]
    ends = []
    for sample in range(JITTER_SAMPLES):
        varied = [[t * f[sample] for t, f in zip(stage, fs)] for stage, fs in zip(stages, per_stage)]
        compute, host, host_disk, disk, copies = varied
        ends.append(_pipeline(compute, host, host_disk, disk, copies, [1] * len(compute), serial, depth, overhead,
                              read_ahead)[0])
    return sum(ends) / JITTER_SAMPLES


def _edges(layers: Sequence[LayerLoad], depth: int) -> tuple[LayerLoad, ...]:
    """``layers`` with the first and last ``depth`` stages of every run on their own, so that the stages left in a
    run have its own loads ``depth`` stages before and after them (the pairs :func:`_contended` stretches)."""
    out: list[LayerLoad] = []
    for layer in layers:
        one = dataclasses.replace(layer, repeat=1)
        if layer.repeat <= 2 * depth + 1:
            out += [one] * layer.repeat
        else:
            out += [one] * depth + [dataclasses.replace(layer, repeat=layer.repeat - 2 * depth)] + [one] * depth
    return tuple(out)


def _contended(compute: list[float], copies: list[float], disk: list[float], counts: list[int], depth: int,
               contention: Contention) -> tuple[list[float], list[float], list[float]]:
    """Compute, mover-copy and disk-read times stretched where they overlap on a CPU host's shared cores and DRAM.

    With prefetch depth ``d`` the mover's job for stage ``i + d`` (copies ``X``, disk read ``D``) runs while
    stage ``i`` computes (``C``). Both are taken to start together; while both run, compute progresses at
    ``1 / s_c`` and the job at ``1 / s_j`` of their speed alone (``s_c``, ``s_j``: the slowdowns of
    ``contention``, weighted by the job's copy and read time); whichever ends first leaves the other to
    finish at full speed. The job's stretched time is split between copies and read in proportion to
    ``X * s_x : D * s_d``. Entry ``k`` is a run of ``counts[k]`` stages whose every stage has the same loads
    ``d`` stages before and after it (:func:`_edges`).
    """
    stretched_compute, stretched_copies, stretched_disk = list(compute), list(copies), list(disk)
    firsts = list(itertools.accumulate(counts, initial=0))  # the first stage of each run, then the stage count

    def run_of(stage: int) -> int:
        return bisect.bisect_right(firsts, stage) - 1

    def overlap(i: int, j: int) -> tuple[float, float, float] | None:
        """Run ``i``'s compute beside run ``j``'s job, stretched (None: one of them is empty)."""
        job = copies[j] + disk[j]
        if job <= 0 or compute[i] <= 0:
            return None
        c = contention
        compute_factor = (copies[j] * c.compute_by_copies + disk[j] * c.compute_by_disk) / job
        copies_beside, disk_beside = copies[j] * c.copies_by_compute, disk[j] * c.disk_by_compute
        job_factor = (copies_beside + disk_beside) / job
        compute_end, job_end = compute[i] * compute_factor, job * job_factor
        if compute_end <= job_end:  # compute ends first; the job's rest runs alone
            job_end = compute_end + job - compute_end / job_factor
        else:
            compute_end = job_end + compute[i] - job_end / compute_factor
        beside = copies_beside + disk_beside
        return compute_end, job_end * copies_beside / beside, job_end * disk_beside / beside

    for k, first in enumerate(firsts[:-1]):
        if first + depth < firsts[-1] and (ahead := overlap(k, run_of(first + depth))) is not None:
            stretched_compute[k] = ahead[0]
        if first >= depth and (behind := overlap(run_of(first - depth), k)) is not None:
            stretched_copies[k], stretched_disk[k] = behind[1:]
    return stretched_compute, stretched_copies, stretched_disk


def min_prefetch_depth(
    placement: Placement, links: LinkProfile, *, max_depth: int | None = None, tolerance: float = 0.01,
    read_ahead: int = 0,
) -> int:
    """The smallest prefetch depth whose step time is within ``tolerance`` of the best reachable one.

    Deeper prefetch never slows the modelled step (every start time can only move earlier) but costs one
    more layer of device staging per level, so the runtime wants the shallowest depth that does the job.
    "The best reachable" is the step time at ``max_depth`` (default: the number of layers, i.e. all
    transfers issued at step start). When a link is the bottleneck no depth hides its time; the answer is
    then the depth past which deeper prefetch stops helping. 0 when the placement moves nothing.
    """
    n_layers = placement.stages
    deepest = n_layers if max_depth is None else max_depth
    if deepest < 0:
        raise InvalidConfigError(f"max_depth={max_depth} must be >= 0.")
    if tolerance < 0:
        raise InvalidConfigError(f"tolerance={tolerance} must be >= 0.")
    limit = min(deepest, n_layers)
    best = predict_step(placement, links, limit, read_ahead=read_ahead).step_s
    for depth in range(limit):
        if predict_step(placement, links, depth, read_ahead=read_ahead).step_s <= best * (1.0 + tolerance):
            return depth
    return limit


MAX_MEMORY_LATENCY_S = 1e-3
"""The most one copy within memory or across PCIe costs besides its bytes in a plan: a memcpy or a DMA starts in
microseconds, so a larger fitted latency is a busy host's noise (``tierkv bench`` fitting time other work took),
which a plan would multiply by every layer and chunk of a step."""
DISK_LINKS = (LinkName.DISK_TO_HOST, LinkName.HOST_TO_DISK)


def capped_latencies(profile: LinkProfile) -> tuple[LinkProfile, list[str]]:
    """``profile`` with each memory or PCIe link's latency capped at :data:`MAX_MEMORY_LATENCY_S` (a disk's may be
    milliseconds), and a line for each link capped."""
    capped = {key: dataclasses.replace(link, latency_s=MAX_MEMORY_LATENCY_S) for key, link in profile.links.items()
              if key not in DISK_LINKS and link.latency_s > MAX_MEMORY_LATENCY_S}
    lines = [f"the profile's {key} latency {profile.links[key].latency_s * 1e3:.3g} ms per copy is more than any copy "
             f"within memory or across PCIe takes (a busy host while tierkv bench ran); planned with "
             f"{MAX_MEMORY_LATENCY_S * 1e3:g} ms" for key in capped]
    return (profile.replace(**capped) if capped else profile), lines


def _check_plausible(links: dict[str, Link], attention: HostAttention | None, overhead: float) -> None:
    """A profile file may come from anyone: refuse (ValueError) rates and times no real machine has, which would
    predict infinite or zero steps (the classes themselves take any positive number, as tests' hand-checked ones)."""
    rates = [(f"link {link.name!r}: bandwidth_bytes_per_s", link.bandwidth_bytes_per_s) for link in links.values()]
    if attention is not None:
        rates += [("host_attention.bandwidth_bytes_per_s", attention.bandwidth_bytes_per_s),
                  ("host_attention.single_thread_bytes_per_s", attention.single_thread_bytes_per_s)]
        if attention.threads > MAX_HOST_THREADS:
            raise ValueError(f"host_attention.threads={_shown(attention.threads)} is above {MAX_HOST_THREADS}")
    for what, rate in rates:
        if not MIN_LINK_BANDWIDTH <= rate <= MAX_LINK_BANDWIDTH:
            raise ValueError(f"{what}={rate!r} is outside {MIN_LINK_BANDWIDTH:.0e}-{MAX_LINK_BANDWIDTH:.0e} bytes "
                             "per second")
    times = [(f"link {link.name!r}: latency_s", link.latency_s) for link in links.values()]
    for what, seconds in [*times, ("layer_overhead_s", overhead)]:
        if seconds > MAX_LINK_LATENCY_S:
            raise ValueError(f"{what}={seconds!r} is above {MAX_LINK_LATENCY_S:g} s")


def _shown(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 400-digit number in a profile must not fill the error)."""
    text = printable(repr(value))
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"



def _check_profile_fields(data: object, path: str) -> None:
    """Refuse a profile file of a later format, or one that is not a profile (``tierkv bench --json``'s record)."""
    if not isinstance(data, dict):
        raise InvalidConfigError(f"link profile {path!r} is not a JSON object; create one with `tierkv bench`.")
    found = data.get("format", PROFILE_FORMAT)
    if type(found) is int and found > PROFILE_FORMAT:
        raise InvalidConfigError(f"link profile {path!r} is of format {found}, written by a newer tierkv (this one "
                                 f"reads format {PROFILE_FORMAT}): upgrade tierkv, or measure again with "
                                 "`tierkv bench`.")
    if type(found) is not int or found != PROFILE_FORMAT:
        raise InvalidConfigError(f"link profile {path!r}: field 'format' is {_shown(found)}, not {PROFILE_FORMAT}.")
    if "links" not in data and "profile" in data:
        raise InvalidConfigError(f"{path!r} is `tierkv bench --json`'s record, not a link profile: pass the profile "
                                 "bench saved beside it (--profile-out, tierkv-profile.json by default).")
    unknown = sorted(printable(str(key))[:40] for key in data if key not in _PROFILE_FIELDS)
    if unknown:
        raise InvalidConfigError(f"link profile {path!r} has fields no profile of format {PROFILE_FORMAT} has "
                                 f"({', '.join(unknown[:5])}); create one with `tierkv bench`.")


def _number(value: object, what: str) -> float:
    """The profile field ``what`` as a finite float; ValueError naming it where it is not a number, or one no float
    holds (Infinity, NaN, a 400-digit integer)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what}={_shown(value)} is not a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{what}={_shown(value)} is not a finite number")
    return number


def _threads(value: object) -> int:
    """The profile's ``host_attention.threads`` if it is a whole number (ValueError naming it otherwise: a float
    such as Infinity or 2.5, or true, is no count of threads); its range is checked with the rest
    (:class:`HostAttention`, :func:`_check_plausible`)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"host_attention.threads={_shown(value)} is not a whole number of threads")
    return value


def _check_flops(text: str | None) -> None:
    """Refuse (ValueError) a ``machine["compute_flops"]`` that is a number no host computes at (Infinity, 1e400):
    the planner would price compute at zero. Text that is no number means "not measured"."""
    try:
        flops = float(text) if text is not None else 0.0
    except ValueError:
        return
    if not flops <= MAX_COMPUTE_FLOPS:  # (NaN too)
        raise ValueError(f"machine.{_COMPUTE_FLOPS_KEY}={_shown(text)} is not a FLOP/s rate up to "
                         f"{MAX_COMPUTE_FLOPS:.0e}")
