"""Sparse attention's page scores read straight from the key summaries table (``native/tierkv_scores.c``).

:func:`page_scores` gives, for a decode query and each candidate page, Quest's bound ``q⁻·min + q⁺·max`` and the
logit estimate ``0.5 · (bound + q·mean)`` (:mod:`tierkv.store.summaries`) per query head, reading each page's
min, max and mean once where the table holds them: nothing is gathered, widened or concatenated per step (torch
makes three copies of the bytes it scores before its two matmuls). Where the C library cannot be built, or the
table lives in accelerator memory, it returns None and the caller gathers the rows and runs
:func:`page_scores_torch`: the reference this kernel is tested against.

The library is found like the host attention kernel's (:mod:`tierkv.cbuild`): the extension built at install
(``tierkv/attention/_scores*.so``), else built on first use from the source checkout, else unavailable (logged
once).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
from pathlib import Path

import torch

from tierkv import cbuild
from tierkv.errors import InvalidConfigError
from tierkv.io.base import EngineUnavailableError

logger = logging.getLogger("tierkv")

SOURCE = Path(__file__).resolve().parents[2] / "native" / "tierkv_scores.c"
"""The C source in a source checkout (also an editable install); a wheel ships only the built extension."""
_FIX = "Install a C compiler (e.g. `apt-get install gcc`) or set CC; meanwhile torch scores the pages."
_ARGS = struct.Struct("<9q5Q")
"""``tkv_scores_args``: batch, kv_heads, groups, head_dim, entries, rows, fields per row, the table's dtype code,
threads; the addresses of query, table, pages, bound, logits."""
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # TKV_F32, TKV_F16, TKV_BF16 in the C source
_ENOMEM, _EROW = -1, -3  # TKV_ENOMEM, TKV_EROW in the C source


def source_digest() -> str | None:
    """sha256 of :data:`SOURCE` (16 hex digits, as ``setup.py`` compiles it in); None without the source."""
    return cbuild.source_digest(SOURCE)


def extension() -> Path | None:
    """The library the install built (``tierkv/attention/_scores<ABI suffix>``), if it did."""
    return cbuild.extension(Path(__file__).parent, "_scores")


_built_from = functools.partial(cbuild.built_from, symbol="tkv_scores_source_sha")
"""The source hash a loaded library's ``tkv_scores_source_sha()`` returns ("" if it has none)."""


@functools.cache
def _build() -> ctypes.CDLL | EngineUnavailableError:
    """Open the library once per process and declare its functions; the failure, too, is cached."""
    try:
        return cbuild.open_kernel("page scoring kernel", SOURCE, source_digest(), extension(), _built_from, _FIX,
                                  {"tkv_scores_args_size": (ctypes.c_int64, None),
                                   "tkv_scores": (ctypes.c_int, [ctypes.c_char_p])},
                                  ("tkv_scores_args_size", _ARGS.size))
    except EngineUnavailableError as exc:
        return exc


def available() -> bool:
    """Whether the C kernel loads here."""
    return not isinstance(_build(), EngineUnavailableError)


def runs_on(device: torch.device) -> bool:
    """Whether :func:`page_scores` can run for a table on ``device``: in CPU memory, with the library loaded (else
    the reason is logged, once)."""
    if device.type != "cpu":
        return False
    lib = _build()
    if isinstance(lib, EngineUnavailableError):
        _log_unavailable(str(lib))
        return False
    return True


@functools.cache
def _log_unavailable(reason: str) -> None:
    logger.warning("page scoring kernel unavailable (%s): scoring the summaries with torch", reason)


def page_scores_torch(query: torch.Tensor, stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's bound ``q⁻·min + q⁺·max`` and the logit estimate ``0.5 · (bound + q·mean)`` of ``query``
    ``[B, H_kv, G, D]`` (fp32, scaled) for pages of gathered summaries ``stacked`` ``[B, H_kv, N, ≥ 3·D]`` (fp32:
    each page's key min, max and mean, then anything): each ``[B, H_kv, G, N]`` — two matmuls."""
    dim = query.shape[-1]
    bound = torch.matmul(torch.cat((query.clamp_max(0), query.clamp_min(0)), dim=-1),
                         stacked[..., : 2 * dim].transpose(-1, -2))  # [B, H_kv, G, N]: q⁻·min + q⁺·max
    logits = torch.matmul(query, stacked[..., 2 * dim : 3 * dim].transpose(-1, -2)).add_(bound).mul_(0.5)
    return bound, logits


def page_scores(query: torch.Tensor, table: torch.Tensor,
                pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`page_scores_torch` of ``query`` ``[B, H_kv, G, D]`` (fp32, scaled) for the pages ``pages`` ``[B, n]``
    (int64 rows of ``table``: a block's row · pages + page), read where they are in the summary ``table`` ``[H_kv,
    rows, fields, D]`` (fields 0, 1, 2: the key min, max and mean; fp32, fp16 or bf16): (bound, logits), each
    ``[B, H_kv, G, n]`` fp32; None where the kernel cannot run here (not built, the table not in CPU memory or of
    another dtype). The (row, KV head) pairs run across torch's threads, cut into pieces of pages where there are
    fewer pairs than threads."""
    if not runs_on(table.device) or table.dtype not in _DTYPES:
        return None
    lib = _build()
    assert not isinstance(lib, EngineUnavailableError)  # runs_on said it loads
    batch, heads, groups, dim = query.shape
    rows, fields, entries = table.shape[1], table.shape[2], pages.shape[1]
    wanted = {"query": (query, torch.float32, (batch, heads, groups, dim)),
              "table": (table, table.dtype, (heads, rows, max(fields, 3), dim)),
              "pages": (pages, torch.int64, (batch, entries))}
    for name, (tensor, dtype, shape) in wanted.items():
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise InvalidConfigError(f"page_scores: {name} must be contiguous {dtype} {list(shape)}, got "
                                     f"{tensor.dtype} {list(tensor.shape)}.")
        if tensor.device.type != "cpu":  # the C kernel would read a device address as host memory
            raise InvalidConfigError(f"page_scores: {name} is on {tensor.device}; the C kernel reads CPU memory only.")
    bound = torch.empty((batch, heads, groups, entries), dtype=torch.float32)
    logits = torch.empty((batch, heads, groups, entries), dtype=torch.float32)
    packed = _ARGS.pack(batch, heads, groups, dim, entries, rows, fields, _DTYPES[table.dtype],
                        torch.get_num_threads(), query.data_ptr(), table.data_ptr(), pages.data_ptr(),
                        bound.data_ptr(), logits.data_ptr())
    status = lib.tkv_scores(packed)
    if status == _ENOMEM:
        raise MemoryError("page_scores: the kernel's scratch (a query group's signed parts) was refused.")
    if status == _EROW:
        raise InvalidConfigError("page_scores: a page names a row outside the summary table.")
    if status:
        raise InvalidConfigError(f"page_scores: the kernel refused its arguments (status {status}).")
    return bound, logits
