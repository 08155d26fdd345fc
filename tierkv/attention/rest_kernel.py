"""Attention over sparse attention's low-bit rest copy without decoding it first (``native/tierkv_rest.c``).

:func:`rest_attention` attends a decode query over pages of a layer's rest copy (:mod:`tierkv.store.summaries`)
straight from their packed codes: each code byte is read once, no decoded page is materialised, and every query
head of a KV head's group shares the pass. It returns the partial result every executor merges (the normalised
output and the log-sum-exp, fp32, :mod:`tierkv.attention.lse`'s convention). Where the C library cannot be built,
or the codes live in accelerator memory, it returns None and the caller decodes with torch
(:meth:`~tierkv.store.summaries.KeySummaries.rest`, then :func:`~tierkv.attention.lse.partial_attention`): the
reference this kernel is tested against.

The library is found like the host attention kernel's (:mod:`tierkv.cbuild`): the extension built at install
(``tierkv/attention/_rest*.so``), else built on first use from the source checkout, else unavailable (logged once).
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

SOURCE = Path(__file__).resolve().parents[2] / "native" / "tierkv_rest.c"
"""The C source in a source checkout (also an editable install); a wheel ships only the built extension."""
_FIX = "Install a C compiler (e.g. `apt-get install gcc`) or set CC; meanwhile the torch decoding runs."
_ARGS = struct.Struct("<13qd9Q")
"""``tkv_rest_args``: batch, kv_heads, groups, head_dim, page_tokens, entries, bits, value_groups, rows, threads,
summary fields per row, the summaries' and the scales' dtype codes; softcap (0: none); the addresses of query, codes,
pages, counts, summaries, scales, bias (0: none), out, lse."""
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # TKV_F32, TKV_F16, TKV_BF16 in the C source
_ENOMEM, _EROW = -1, -3  # TKV_ENOMEM, TKV_EROW in the C source
MAX_GROUP, MAX_DIM, MAX_PAGE = 64, 1024, 256  # TKV_MAX_* in the C source: larger shapes are decoded by torch


def source_digest() -> str | None:
    """sha256 of :data:`SOURCE` (16 hex digits, as ``setup.py`` compiles it in); None without the source."""
    return cbuild.source_digest(SOURCE)


def extension() -> Path | None:
    """The library the install built (``tierkv/attention/_rest<ABI suffix>``), if it did."""
    return cbuild.extension(Path(__file__).parent, "_rest")


_built_from = functools.partial(cbuild.built_from, symbol="tkv_rest_source_sha")
"""The source hash a loaded library's ``tkv_rest_source_sha()`` returns ("" if it has none)."""


@functools.cache
def _build() -> ctypes.CDLL | EngineUnavailableError:
    """Open the library once per process and declare its functions; the failure, too, is cached."""
    try:
        return cbuild.open_kernel("rest-copy attention kernel", SOURCE, source_digest(), extension(), _built_from,
                                  _FIX, {"tkv_rest_args_size": (ctypes.c_int64, None),
                                         "tkv_rest": (ctypes.c_int, [ctypes.c_char_p])},
                                  ("tkv_rest_args_size", _ARGS.size))
    except EngineUnavailableError as exc:
        return exc


def available() -> bool:
    """Whether the C kernel loads here."""
    return not isinstance(_build(), EngineUnavailableError)


def runs_on(device: torch.device) -> bool:
    """Whether :func:`rest_attention` can run for a rest copy on ``device``: in CPU memory, with the library loaded
    (else the reason is logged, once)."""
    if device.type != "cpu":
        return False
    lib = _build()
    if isinstance(lib, EngineUnavailableError):
        _log_unavailable(str(lib))
        return False
    return True


@functools.cache
def _log_unavailable(reason: str) -> None:
    logger.warning("rest-copy attention kernel unavailable (%s): decoding the rest copy with torch", reason)


def takes(groups: int, dim: int, page_tokens: int) -> bool:
    """Whether the kernel takes a query group of ``groups`` heads of ``dim`` channels over pages of ``page_tokens``
    (:data:`MAX_GROUP`, :data:`MAX_DIM`, :data:`MAX_PAGE`); larger shapes are decoded by torch."""
    return groups <= MAX_GROUP and dim <= MAX_DIM and page_tokens <= MAX_PAGE


def rest_attention(query: torch.Tensor, codes: torch.Tensor, summaries: torch.Tensor, scales: torch.Tensor,
                   pages: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor | None, bits: int,
                   softcap: float | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of ``query`` ``[B, H_kv, G, D]`` (fp32, scaled) over the rest-copy pages ``pages`` ``[B, n]`` (table
    rows; the first ``counts[b]`` of row ``b`` are attended), read where they are: the packed ``codes`` ``[H_kv, rows,
    2, pt, D · bits / 8]``, the key bounds in fields 0 and 1 of ``summaries`` ``[H_kv, rows, fields, D]`` and the
    value scales ``[H_kv, rows, pt, groups, 2]`` (fp32, fp16 or bf16 each; nothing gathered), with an additive
    ``bias`` ``[B, n · pt]`` (fp32) or None: (output ``[B, H_kv, G, D]``, log-sum-exp ``[B, H_kv, G]``); None where
    the kernel cannot run here (not built, the tensors not in CPU memory, or a query group, head or page beyond
    :data:`MAX_GROUP`, :data:`MAX_DIM`, :data:`MAX_PAGE`). The rows' entries are cut into pieces
    across torch's threads when there are fewer rows x KV heads than threads, merged by log-sum-exp."""
    batch, heads, groups, dim = query.shape
    rows, pt = codes.shape[1], codes.shape[3]
    value_groups = scales.shape[3]
    if not runs_on(codes.device) or not takes(groups, dim, pt):
        return None
    lib = _build()
    assert not isinstance(lib, EngineUnavailableError)  # runs_on said it loads
    entries = pages.shape[1]
    for name, tensor in (("summaries", summaries), ("scales", scales)):
        if tensor.dtype not in _DTYPES:
            raise InvalidConfigError(f"rest_attention: {name} must be fp32, fp16 or bf16, got {tensor.dtype}.")
    wanted = {"query": (query, torch.float32, (batch, heads, groups, dim)),
              "codes": (codes, torch.uint8, (heads, rows, 2, pt, dim * bits // 8)),
              "summaries": (summaries, summaries.dtype, (heads, rows, max(summaries.shape[2], 2), dim)),
              "scales": (scales, scales.dtype, (heads, rows, pt, value_groups, 2)),
              "pages": (pages, torch.int64, (batch, entries)), "counts": (counts, torch.int64, (batch,))}
    if bias is not None:
        wanted["bias"] = (bias, torch.float32, (batch, entries * pt))
    for name, (tensor, dtype, shape) in wanted.items():
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise InvalidConfigError(f"rest_attention: {name} must be contiguous {dtype} {list(shape)}, got "
                                     f"{tensor.dtype} {list(tensor.shape)}.")
        if tensor.device.type != "cpu":  # the C kernel would read a device address as host memory
            raise InvalidConfigError(f"rest_attention: {name} is on {tensor.device}; the C kernel reads CPU memory "
                                     "only.")
    out = torch.empty((batch, heads, groups, dim), dtype=torch.float32)
    lse = torch.empty((batch, heads, groups), dtype=torch.float32)
    packed = _ARGS.pack(batch, heads, groups, dim, pt, entries, bits, value_groups, rows, torch.get_num_threads(),
                        summaries.shape[2], _DTYPES[summaries.dtype], _DTYPES[scales.dtype], float(softcap or 0.0),
                        query.data_ptr(), codes.data_ptr(), pages.data_ptr(), counts.data_ptr(),
                        summaries.data_ptr(), scales.data_ptr(), 0 if bias is None else bias.data_ptr(),
                        out.data_ptr(), lse.data_ptr())
    status = lib.tkv_rest(packed)
    if status == _ENOMEM:
        raise MemoryError("rest_attention: the kernel's scratch (a page's decoded codes per piece) was refused.")
    if status == _EROW:
        raise InvalidConfigError("rest_attention: a page names a row outside the rest copy's table.")
    if status:
        raise InvalidConfigError(f"rest_attention: the kernel refused its arguments (status {status}).")
    return out, lse
