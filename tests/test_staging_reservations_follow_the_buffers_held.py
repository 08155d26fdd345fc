"""What ``Staging`` reserves against the device budget is exactly what it holds, through every way of taking and
returning buffers — also when the machine does not have the memory the budget allows.

A reservation left behind by a failed allocation or a returned buffer would shrink the device budget for the rest
of the cache's life (blocks demoted for nothing, then BudgetTooSmallError at a budget that fits). The failing
allocations are real: a petabyte the budget allows but no machine has, which the CPU allocator refuses.
"""

from __future__ import annotations

import pytest
from helpers import make_store

from tierkv import cuda_standin, settings
from tierkv.errors import CapacityError
from tierkv.staging import Staging

HUGE = 2**50  # bytes the budget below allows and the allocator refuses


@pytest.fixture
def store(tmp_path):
    store = make_store(tmp_path, device_slots=4, host_slots=4, disk_bytes=None, staging_bytes=2**52)
    yield store
    store.close()


def test_an_allocation_the_machine_refuses_reserves_nothing(store):
    """``allocate`` and ``take`` raise CapacityError and give the reservation back; what was held before stays."""
    staging = Staging(store)
    with pytest.raises(CapacityError, match="the memory is not there"):
        staging.allocate(2, HUGE)
    assert staging.reserved == 0 and store.device.reserved == 0 and staging.buffers == []
    kept = staging.take(4096)
    with pytest.raises(CapacityError, match="the memory is not there"):
        staging.take(HUGE)
    assert staging.buffers == [kept]
    assert staging.reserved == store.device.reserved == 4096


def test_buffers_given_back_one_at_a_time_and_all_at_once_leave_no_reservation(store):
    """``take`` / ``give_back`` (kept layers), ``reserve`` (temporaries) and ``allocate`` (a resize) each move the
    device reservation by their bytes, and ``release`` returns all of it."""
    staging = Staging(store)
    first, second = staging.take(4096), staging.take(8192)
    staging.reserve(1000)
    assert staging.reserved == store.device.reserved == 4096 + 8192 + 1000
    staging.give_back(first)
    assert staging.buffers == [second]
    assert staging.reserved == store.device.reserved == 8192 + 1000
    staging.release()
    assert staging.reserved == store.device.reserved == 0 and staging.buffers == []
    buffers = staging.allocate(3, 2048)
    assert [buffer.numel() for buffer in buffers] == [2048] * 3
    assert staging.reserved == store.device.reserved == 3 * 2048
    staging.allocate(2, 4096)  # a resize replaces the whole set
    assert staging.reserved == store.device.reserved == 2 * 4096
    staging.release()
    staging.release()  # idempotent
    assert staging.reserved == store.device.reserved == 0


def test_released_staging_leaves_the_accelerators_allocator_cache(tmp_path):
    """On CUDA (here its stand-in) a release also empties the caching allocator: memory the budget no longer counts
    is not kept by torch either, so the next executor (or another process) can have it."""
    with settings.override(cuda_standin=True):
        standin = cuda_standin.fresh()
        store = make_store(tmp_path, device_slots=4, host_slots=4, disk_bytes=None, staging_bytes=2**20)
        staging = Staging(store)
        staging.allocate(2, 4096)
        before = len(standin.ops())
        staging.release()
        assert "empty_cache" in [op for _, op, _ in standin.ops()[before:]]
        store.close()
