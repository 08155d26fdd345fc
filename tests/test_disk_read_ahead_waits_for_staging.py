"""The step model of a CUDA host (links queue on their own) with disk reads submitted ahead: a layer's disk bytes
may be read early, but their copy into the staging buffer waits for that buffer. Without prefetch each layer's
buffer is free only once the layer before it computed, so every copy after the first shows in the step:
``step = disk + copy + compute + (copy + compute) * (layers - 1)``, by hand from the recurrences."""

from __future__ import annotations

import pytest

from tierkv.bandwidth import LayerLoad, Link, LinkProfile, Placement, predict_step

DISK_BW, H2D_BW = 1e9, 1e9
NBYTES = 10**7  # 10 ms over each link
COMPUTE = 0.1


def _profile() -> LinkProfile:
    return LinkProfile({"disk->host": Link("disk", DISK_BW, 0.0), "host->device": Link("pcie", H2D_BW, 0.0),
                        "device->device": Link("hbm", 1e12, 0.0)})


@pytest.mark.parametrize("layers", [2, 4])
def test_a_read_ahead_disk_copy_waits_for_the_staging_buffer_without_prefetch(layers):
    placement = Placement(tuple(LayerLoad(COMPUTE, disk_bytes=NBYTES) for _ in range(layers)))
    read, copy = NBYTES / DISK_BW, NBYTES / H2D_BW
    forecast = predict_step(placement, _profile(), prefetch_depth=0, read_ahead=1)
    assert forecast.step_s == pytest.approx(read + copy + COMPUTE + (copy + COMPUTE) * (layers - 1))
