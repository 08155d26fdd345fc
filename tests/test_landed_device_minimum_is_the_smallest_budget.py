"""The CUDA device minimum (staging, open blocks and the two landing buffers sized from the budget itself) is the
smallest budget that holds what it implies: that budget holds it, one byte less does not."""

from __future__ import annotations

import pytest

from tierkv.staging import device_minimum, landed_device_minimum, landing_bytes


@pytest.mark.parametrize(("staging", "tails", "slot"), [(10**6, 0, 4096), (123_457, 196_608, 65_536),
                                                        (409_600, 4096, 4096), (5 * 2**30, 65_536, 65_536)])
def test_the_landed_minimum_holds_its_landing_buffers_and_one_byte_less_does_not(staging, tails, slot):
    def needs(budget: int) -> int:
        return device_minimum(staging + 2 * landing_bytes(budget, slot), tails)

    minimum = landed_device_minimum(staging, tails, slot)
    assert needs(minimum) <= minimum
    assert needs(minimum - 1) > minimum - 1
