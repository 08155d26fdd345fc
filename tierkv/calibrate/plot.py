"""The bandwidth plot of ``tierkv bench``: GB/s against transfer size, one panel per family of links.

Both axes are logarithmic: sizes run from 4 KiB to 1 GiB and bandwidths from tens of MB/s (small per-block
copies) to tens of GB/s, so on a linear axis the slow series would sit flat at zero. Lines are named by
where the bytes really are on this host (on a CPU-only host the device tier is CPU memory), and the legends
sit below their panels, inside the saved image.
"""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING

from tierkv import safefs
from tierkv.calibrate.results import BenchResult
from tierkv.units import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PANELS = {
    "memory": ("host->host", "device->device", "host->device", "device->host", "host<->device"),
    "disk read": ("disk->host",),
    "disk write": ("host->disk",),
}


def tier_names(gpu: bool) -> dict[str, str]:
    """What each end of a link is on this host."""
    device = "GPU memory (device tier)" if gpu else "CPU memory (device tier)"
    return {"device": device, "host": "CPU memory (host tier)", "disk": "disk"}


def link_label(link: str, method: str, gpu: bool) -> str:
    """``"CPU memory (host tier) -> CPU memory (device tier): store read_into"`` for ``host->device``."""
    names = tier_names(gpu)
    if "<->" in link:
        first, second = link.split("<->")
        return f"{names[first]} <-> {names[second]}: {method}"
    source, dest = link.split("->")
    where = f"within {names[source]}" if source == dest else f"{names[source]} -> {names[dest]}"
    return f"{where}: {method}"


def figure(result: BenchResult) -> Figure:
    """The plot of ``result`` as a matplotlib figure (no window: the Agg canvas). Each panel's legend has
    its own row of the layout below it, so no label is cut or laid over the axis."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogFormatter

    class PlainLogFormatter(LogFormatter):
        """The ticks matplotlib would label on a log axis, as plain numbers (0.6, not 6e-01)."""

        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    gpu = result.machine.get("gpu", "none") != "none"
    fig = Figure(figsize=(6 * len(PANELS), 6.5), layout="constrained")
    grid = fig.subplots(2, len(PANELS), height_ratios=(3, 1))
    for ax, legend_ax, (title, links) in zip(grid[0], grid[1], PANELS.items(), strict=True):
        series = sorted({(m.link, m.method) for m in result.measurements if m.link in links})
        for link, method in series:
            rows = result.series(link, method)
            ax.plot([m.size for m in rows], [m.gbps for m in rows], marker="o", label=link_label(link, method, gpu))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda nbytes, _: format_bytes(nbytes)))
        ax.yaxis.set_major_formatter(PlainLogFormatter())
        ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))
        ax.tick_params(axis="x", labelrotation=30)
        ax.set_xlabel("transfer size (bytes per request / copy)")
        ax.set_ylabel("GB/s (log scale)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        legend_ax.axis("off")
        if series:
            legend_ax.legend(*ax.get_legend_handles_labels(), loc="upper center", fontsize=8, frameon=False)
    m = result.machine
    fig.suptitle(
        f"tierkv bench: {m['cpu']}, {m['cores']}, GPU {m['gpu']}, {m['filesystem']}, {m['date']}", fontsize=9
    )
    return fig


def plot(result: BenchResult, path: str | os.PathLike[str]) -> None:
    """Write the plot of ``result`` to ``path`` as a PNG, whatever its suffix (matplotlib would add ``.png`` to a
    name without one, and pick another format by another suffix): rendered in memory, then written as tierkv
    writes every file (:func:`tierkv.safefs.write_file`: 0600, a link planted at ``path`` replaced, never
    written through)."""
    image = io.BytesIO()
    figure(result).savefig(image, format="png", dpi=110, bbox_inches="tight")  # "tight": legends, title never cut
    safefs.write_file(path, [image.getvalue()])
