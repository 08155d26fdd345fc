"""The error types of tierkv.

Every error a user can cause derives from :class:`TierKVError`, and also from the builtin type that fits
(``ValueError`` for bad arguments, ``OSError`` for disk trouble, ``MemoryError`` for a KV that does not
fit), so callers can catch either. Messages name the problem *and* the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class TierKVError(Exception):
    """Base class of every error raised by tierkv."""


class InvalidConfigError(TierKVError, ValueError):
    """An argument or environment setting is malformed (a budget of "12 apples", a negative size ...)."""


class UnsupportedLayerError(InvalidConfigError, AttributeError):
    """The model asks the cache for state of a kind it does not hold (convolution or recurrent state, compressed or
    indexed attention); an AttributeError too, so that probing with ``hasattr`` still says it is absent."""


class BudgetTooSmallError(TierKVError, ValueError):
    """A budget is below the minimum the cache needs to work at all (e.g. the device staging area)."""


class CapacityError(TierKVError, MemoryError):
    """The KV cache no longer fits in the sum of the tier budgets."""


class DiskTierError(TierKVError, OSError):
    """The disk tier cannot be created, written or read."""

    def __str__(self) -> str:
        """The message alone, without ``[Errno N]`` before it (it says what is wrong and the fix itself)."""
        if len(self.args) == 2 and self.strerror and self.filename is None:
            return str(self.strerror)
        return super().__str__()


class DiskFullError(DiskTierError):
    """The filesystem under the disk tier ran out of space (ENOSPC)."""


class IntegrityError(DiskTierError):
    """A block read back from below the host tier does not match the checksum taken when it was written
    (a failing drive, or another program wrote to the file): its data is never returned."""


class NewerFormatError(IntegrityError):
    """A file or record was written by a newer tierkv, in a format this one does not read: it is refused and left
    as it is (never taken for a damaged one and removed)."""


class CheckpointError(TierKVError, RuntimeError):
    """A model checkpoint folder cannot be loaded (a missing or unreadable file, pickle weights, a config or
    tensor transformers refuses): a failure while running, not a malformed argument."""


class InterruptedStepError(TierKVError, RuntimeError):
    """The previous forward stopped between two layers (a Ctrl-C or an error in the model's own code): the layers
    it reached were rolled back, and this forward, whose positions were computed before, is refused."""


@contextlib.contextmanager
def memory_for(what: str, fix: str) -> Iterator[None]:
    """Allocate ``what`` ("the host tier could not allocate 64 MiB more on cpu although cpu_gb allows it") in the
    block: an allocator's refusal becomes a CapacityError that says so and ``fix`` (the budget is a cap, the
    machine's memory the fact)."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:  # torch's allocators raise RuntimeError (OutOfMemoryError: CUDA)
        if not out_of_memory(exc):
            raise
        raise CapacityError(f"{what}: the memory is not there (other processes, a ulimit -v, a container's memory "
                            f"limit); {fix}.") from exc


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's refusal: MemoryError, torch's OutOfMemoryError (CUDA), or its CPU
    allocator's RuntimeError ("can't allocate memory"). Told by name, so that callers need not import torch."""
    return isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError" \
        or "can't allocate memory" in str(error)
