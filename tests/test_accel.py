"""The accelerator seam (tierkv/accel.py): what the CPU-only backend offers and refuses."""

from __future__ import annotations

import pytest
import torch

from tierkv.accel import HOST_ONLY
from tierkv.errors import TierKVError


def test_the_cpu_backend_has_no_streams_and_says_so():
    assert not HOST_ONLY.streams  # callers check this before asking for a stream or an event
    cpu = torch.device("cpu")
    for call in (lambda: HOST_ONLY.Stream(cpu), HOST_ONLY.Event, lambda: HOST_ONLY.current_stream(cpu),
                 lambda: HOST_ONLY.on_stream(None, cpu)):
        with pytest.raises(TierKVError, match="no streams"):
            call()
