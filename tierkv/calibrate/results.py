"""What a calibration run measured: one :class:`Measurement` per point, and the run's :class:`BenchResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.bandwidth import LinkProfile


@dataclass(frozen=True, slots=True)
class Measurement:
    """The median time of one operation moving ``nbytes`` in ``transfers`` requests/copies over ``link``."""

    link: str  # "host->host", "device->device", "disk->host", "host->disk", "host->device", ...
    method: str  # "memcpy", "gather index_select", "native", "raw O_DIRECT", "pinned", ...
    size: int  # transfer size the row is plotted at: bytes per request (disk) or per copy (memory)
    nbytes: int  # bytes moved by one timed operation
    transfers: int  # requests or copies in one timed operation
    seconds: float  # median over the repeats

    @property
    def gbps(self) -> float:
        """Achieved bandwidth in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9


@dataclass
class BenchResult:
    """Everything one run measured, the profile fitted from it and the machine it ran on."""

    measurements: list[Measurement]
    profile: LinkProfile
    machine: dict[str, str]
    notes: list[str] = field(default_factory=list)

    def series(self, link: str, method: str) -> list[Measurement]:
        return [m for m in self.measurements if m.link == link and m.method == method]
