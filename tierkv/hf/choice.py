"""Which exact executor decodes fastest on the machine at hand: exact gather or split (``cache.exact(model)``).

Exact gather copies each layer's K/V into device staging, then the model's attention reads the copy; split
attends every byte once, where it lives, with the host kernel. On a CPU-only host (the device tier is host
memory) split is chosen when the profile's *measured* host-kernel rate beats gather even on gather's best terms —
its copy at the profile's ``device->device`` rate plus one more read of the copy at the ``host->host`` memcpy
rate (attention can read no faster than memory)::

    1 / host_attention  <  1 / device->device  +  1 / host->host      (seconds per byte)

Without a measured rate (presets, a profile from before ``tierkv bench`` measured the kernel), without the C
kernel, or on an accelerator, gather stays: the choice changes only on a measurement. On a GPU the one
measurement so far says gather (an H200, 8K tokens all on the host tier: split's step 1.73x gather's, its device
share's paged torch path and the hand-off to the CPU costing more than PCIe saves; docs/benchmarks.md, "The GPU
check"); ``tierkv plan --executor split`` prices what a fused paged device kernel would make of it.
"""

from __future__ import annotations

from tierkv.bandwidth import LinkName, LinkProfile
from tierkv.errors import InvalidConfigError

EXACT_EXECUTORS = ("auto", "gather", "split")


def choose_executor(profile: LinkProfile, accelerated: bool, requested: str = "auto",
                    kernel_available: bool | None = None) -> str:
    """``"gather"`` or ``"split"``: ``requested`` unless it is ``"auto"``, then the rule of the module docstring.
    ``kernel_available``: whether the host kernel loads (default: try it)."""
    if requested not in EXACT_EXECUTORS:
        raise InvalidConfigError(f"executor={requested!r} is not an exact executor; choose one of "
                                 f"{', '.join(EXACT_EXECUTORS)}.")
    if requested != "auto":
        return requested
    measured = profile.host_attention
    if accelerated or measured is None:
        return "gather"
    if kernel_available is None:
        from tierkv.attention import host_kernel

        kernel_available = host_kernel.available()
    if not kernel_available:
        return "gather"
    copy = profile.links.get(LinkName.DEVICE_TO_DEVICE)
    read = profile.links.get(LinkName.HOST_TO_HOST)
    if copy is None or read is None:
        return "gather"
    gather_s = 1 / copy.bandwidth_bytes_per_s + 1 / read.bandwidth_bytes_per_s
    return "split" if 1 / measured.bandwidth_bytes_per_s < gather_s else "gather"
