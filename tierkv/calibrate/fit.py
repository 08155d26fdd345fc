"""From measured series to a :class:`~tierkv.bandwidth.LinkProfile`: which series stands for which link.

Each link of the profile is fitted (latency + bytes / bandwidth) from the series the runtime will really
use: the disk engine auto-selection picks, pinned copies on CUDA (the host tier is pinned), the store's own
gather for the device tier; a series that cannot be fitted is reported, never guessed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.bandwidth import Contention, Link, LinkProfile, fit_link
from tierkv.calibrate.results import Measurement


def _fit(name: str, rows: Sequence[Measurement]) -> Link | str:
    """Fit per-transfer latency and bandwidth; the reason instead if the series cannot separate them.

    Rows whose transfers all have the row's size (disk requests, single copies) are fitted per transfer;
    a per-block gather row moves ``nbytes`` in ``transfers`` block copies of one size, so its total time is
    fitted against its total bytes (the latency is then per gather, and the per-block cost is in the slope).
    """
    if len({m.size for m in rows}) < 2:
        return f"{name}: fewer than 2 transfer sizes measured"
    per_transfer = all(m.nbytes == m.size * m.transfers for m in rows)
    sizes = [m.size if per_transfer else m.nbytes for m in rows]
    seconds = [m.seconds / m.transfers if per_transfer else m.seconds for m in rows]
    try:
        return fit_link(name, sizes, seconds)
    except ValueError as exc:
        return f"{name}: not fitted ({exc})"


def build_profile(
    measurements: Sequence[Measurement], machine: dict[str, str], disk_engine: str | None,
    contention: Contention | None = None, layer_overhead_s: float = 0.0,
) -> tuple[LinkProfile, list[str]]:
    """Fit the profile's links from the series the runtime will actually use.

    disk links come from the engine auto-selection picks (``disk_engine``); on CUDA the PCIe links from
    pinned copies (the host tier is pinned); without CUDA host->device and device->host are the memcpy,
    the mover is one thread (``serial_mover``), ``contention``
    (:func:`~tierkv.calibrate.contention.measure_contention`) says how much its copies and disk reads and
    compute slow each other and ``layer_overhead_s`` (:func:`~tierkv.calibrate.overhead.measure_layer_overhead`)
    is the cache's own work per layer on the compute thread.
    """

    def rows(link: str, method: str) -> list[Measurement]:
        return [m for m in measurements if m.link == link and m.method == method]

    # what the executors' gathers do; per-block copies where the store series was not measured (small sizes)
    gather = rows("device->device", "store read_into") or rows("device->device", "gather per-block copy_")
    sources = {"host->host": rows("host->host", "memcpy"), "device->device": gather}
    if torch.cuda.is_available():
        sources["host->device"] = rows("host->device", "pinned")
        sources["device->host"] = rows("device->host", "pinned")
    else:  # the "device" is CPU memory: host blocks are copied into staging like device blocks
        sources["host->device"] = rows("host->device", "store read_into") or gather
        sources["device->host"] = sources["host->host"]
    if disk_engine is not None:  # reads: the per-layer batches of blocks the disk tier issues, when measured
        sources["disk->host"] = rows("disk->host", f"{disk_engine} block batch") or rows("disk->host", disk_engine)
        sources["host->disk"] = rows("host->disk", disk_engine)
        machine = {**machine, "disk_engine": disk_engine}
    fits = {key: _fit(key, series) for key, series in sources.items()}
    links = {key: fit for key, fit in fits.items() if isinstance(fit, Link)}
    notes = [fit for fit in fits.values() if isinstance(fit, str)]
    if torch.cuda.is_available():
        return LinkProfile(links, machine), notes
    return LinkProfile(links, machine, serial_mover=True, contention=contention or Contention(),
                       layer_overhead_s=layer_overhead_s), notes
