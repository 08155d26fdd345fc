"""Paged decode attention on the host's CPUs, over a memory tier's slab in place (``native/tierkv_attn.c``).

:func:`paged_attention` attends a query over the K/V blocks a block table names, where they lie in the slab
(no gather into a staging buffer) — or, with ``starts`` and ``entry_tokens``, over pages of tokens inside those
blocks (sparse attention's selection) — and returns the partial result every executor merges —
the softmax-normalised output and the log-sum-exp per (row, query head, query), fp32, in
:mod:`tierkv.attention.lse`'s convention. :func:`paged_attention_torch` computes the same in plain torch (it
gathers the blocks first); it is what runs where the C library cannot be built, and the reference the C
kernel is tested against.

The C library is found like the native disk engine's (:mod:`tierkv.io.native`), in order:

1. *extension*: built by ``setup.py`` as ``tierkv/attention/_attn*.so`` (optional: installing succeeds without
   a compiler), unless it was built from an older source than the checkout's (the source hash is compiled in);
2. *built on first use* from ``native/tierkv_attn.c`` by ``$CC`` (else ``cc``) into the ``cache_dir``
   setting's ``native/`` folder, under a name carrying the hash of source and flags, with OpenMP where the
   compiler has it, else single-threaded;
3. otherwise unavailable, with the reason; :func:`paged_attention` then runs the torch version (logged once).

The kernel picks its widest code path at run time (AVX-512, AVX2, portable C: :data:`ISAS`). A call costs
little beyond the attention itself: a slab's geometry is checked once per shape (cached), the arguments are
packed into the C struct by one ``struct.pack``, and the C side resolves the table's slot ids (and starts) into
entry addresses (checking them against the slab) — no per-block Python, nothing proportional to the table in
Python. A caller that attends the same slabs through a new table each step (sparse attention's selection) passes
them packed once (:func:`pack_slabs`): nothing per chunk is done per call either. A caller that attends the same
table step after step (a layer's decode steps) does less still: :func:`prepare` checks and packs once, and each
call of the :class:`PagedCall` it returns writes only the query's and the outputs' addresses and the key count into
the packed struct.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from tierkv import cbuild
from tierkv.errors import InvalidConfigError
from tierkv.io.base import EngineUnavailableError

logger = logging.getLogger("tierkv")

SOURCE = Path(__file__).resolve().parents[2] / "native" / "tierkv_attn.c"
"""The C source in a source checkout (also an editable install); a wheel ships only the built extension."""
_FIX = "Install a C compiler (e.g. `apt-get install gcc`) or set CC; meanwhile the torch version runs."
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ENOMEM = -1  # TKV_ENOMEM in the C source

ISAS = ("portable", "avx2", "avx512")
"""The C kernel's code paths (``TKV_PORTABLE``..``TKV_AVX512``), each needing the CPU features of the one before."""
ISA = -1
"""The widest path :func:`paged_attention` may use, an index into :data:`ISAS`; -1: the best the CPU has (tests
pin each path in turn)."""

Table = torch.Tensor | np.ndarray
Ints = int | Sequence[int] | torch.Tensor | np.ndarray


_ARGS = struct.Struct("<16q2d10Q")
"""``tkv_attn_args`` of the C source, packed in one call: batch, q_heads, kv_heads, q_len, head_dim, block_tokens,
entry_tokens, n_blocks, dtype, window, mask_len, mask_start, mask_batch_stride, threads, isa, n_chunks; scaling,
softcap; the addresses of query, table, starts, positions, lengths, query_start, mask, out, lse, entry_lse (0:
none). Then
come the chunks (address, slots, slot stride in bytes; int64 each), in the same buffer."""
_POSITION_LIMIT = 1 << 62
"""Bound on key positions, lengths, query starts and windows: the C kernel's int64 sums of two of them stay exact."""
_ESLOT = -3  # TKV_ESLOT in the C source
_ESTART = -4  # TKV_ESTART in the C source


def source_digest() -> str | None:
    """sha256 of :data:`SOURCE` (16 hex digits, as ``setup.py`` compiles it in); None without the source."""
    return cbuild.source_digest(SOURCE)


def extension() -> Path | None:
    """The library the install built (``tierkv/attention/_attn<ABI suffix>``), if it did."""
    return cbuild.extension(Path(__file__).parent, "_attn")


_built_from = functools.partial(cbuild.built_from, symbol="tkv_attn_source_sha")
"""The source hash a loaded library's ``tkv_attn_source_sha()`` returns ("" if it has none)."""


@functools.cache
def _build() -> ctypes.CDLL | EngineUnavailableError:
    """Open the library once per process (the extension, else built on first use: module docstring) and declare its
    functions; the failure, too, is cached."""
    try:
        return cbuild.open_kernel("host attention kernel", SOURCE, source_digest(), extension(), _built_from, _FIX,
                                  {"tkv_attn_args_size": (ctypes.c_int64, None),
                                   "tkv_attn_max_threads": (ctypes.c_int64, None),
                                   "tkv_attn_isa": (ctypes.c_int64, None),
                                   "tkv_attn": (ctypes.c_int, [ctypes.c_char_p])},
                                  ("tkv_attn_args_size", _ARGS.size))
    except EngineUnavailableError as exc:
        return exc


def library() -> ctypes.CDLL:
    """The loaded C library; raise :class:`EngineUnavailableError` if it cannot be built here."""
    lib = _build()
    if isinstance(lib, EngineUnavailableError):
        raise lib
    return lib


def kernel_address() -> int:
    """The address of the C kernel's entry (``int tkv_attn(const char *)``), for a C loop that calls it with
    :meth:`PagedCall.pack`'s arguments (:meth:`tierkv.tiers.disk._DiskRead.consume_rounds`)."""
    return ctypes.cast(library().tkv_attn, ctypes.c_void_p).value or 0


def available() -> bool:
    """Whether the C kernel loads here (else :func:`paged_attention` runs the torch version)."""
    return not isinstance(_build(), EngineUnavailableError)


@functools.cache
def _log_fallback(reason: str) -> None:
    logger.warning("host attention kernel unavailable (%s): attending with the torch version", reason)


class PackedSlabs(NamedTuple):
    """Slab chunks checked once and their addresses packed for the C kernel (:func:`pack_slabs`), passed to
    :func:`paged_attention` in their place step after step: no Python per chunk per call. Keeps no chunk, only
    their addresses: valid while the caller's pools keep those chunks (it packs again when a pool grows or
    shrinks)."""

    geometry: torch.Tensor  # [0, 2, H_kv, bt, D]: the chunks' dtype, device and shape past the slots
    slots: int  # slots over every chunk
    chunks: int
    packed: bytes  # (address, slots, slot stride in bytes) per chunk: the tail of the C kernel's arguments


class _Inputs(NamedTuple):
    """Checked, normalised arguments shared by both implementations."""

    query: torch.Tensor  # [B, H_q, q, D] fp32 contiguous
    slabs: list[torch.Tensor] | PackedSlabs  # [slots, 2, H_kv, bt, D] each; packed: the C kernel's only
    table: np.ndarray  # [B, n] int64, -1: no block
    starts: np.ndarray | None  # [B, n] int64 first token of each entry in its slot; None: whole blocks
    entry_tokens: int  # tokens per table entry (block_tokens without starts)
    positions: np.ndarray | None  # [B, n] int64
    lengths: np.ndarray  # [B] int64
    query_start: np.ndarray | None  # [B] int64; None: not causal
    window: int  # 0: none
    mask: torch.Tensor | None  # [1 or B, q, M] fp32 contiguous
    mask_start: int
    scaling: float
    softcap: float  # 0: none

    @property
    def first(self) -> torch.Tensor:
        """A chunk of the slab, for its geometry (a packed slab's empty stand-in)."""
        return self.slabs.geometry if isinstance(self.slabs, PackedSlabs) else self.slabs[0]

    @property
    def total_slots(self) -> int:
        if isinstance(self.slabs, PackedSlabs):
            return self.slabs.slots
        return sum(int(chunk.shape[0]) for chunk in self.slabs)

    @property
    def kv_heads(self) -> int:
        return int(self.first.shape[2])

    @property
    def block_tokens(self) -> int:
        return int(self.first.shape[3])


def _rows(value: Ints, batch: int, name: str) -> np.ndarray:
    """An int or ``batch`` ints as int64 ``[batch]``."""
    if isinstance(value, int) and not isinstance(value, bool):
        rows = np.empty(batch, dtype=np.int64)
        rows.fill(value)  # (np.full costs three more Python calls)
        return rows
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype.kind not in "iu" or array.ndim > 1 or (array.ndim == 1 and array.shape[0] != batch):
        raise InvalidConfigError(f"{name} must be an int or {batch} ints (one per row), got {value!r}.")
    return np.array(np.broadcast_to(array.astype(np.int64), (batch,)))  # a writable copy


def _table(value: Table, name: str) -> np.ndarray:
    if isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 2 and value.flags.c_contiguous:
        return value  # as the lines below return it, in one call (a decode step passes several tables per call)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.ndim != 2 or array.dtype.kind not in "iu":
        raise InvalidConfigError(f"{name} must be an integer array [batch, blocks], got {array.dtype} "
                                 f"of shape {array.shape}.")  # fmt: skip
    return np.ascontiguousarray(array, dtype=np.int64)


SlabGeometry = tuple[tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device], ...]


@functools.lru_cache(maxsize=256)
def _check_slabs(chunks: SlabGeometry, query_device: torch.device, host: bool) -> None:
    """Check the slab chunks' (shape, stride, dtype, device); raise InvalidConfigError. A pure function of
    them, so a pool's slab is checked once, not on every decode step."""
    first_shape, _, first_dtype, _ = chunks[0]
    for shape, stride, dtype, device in chunks:
        if len(shape) != 5 or shape[1] != 2:
            raise InvalidConfigError(f"a slab must be [slots, 2, kv_heads, block_tokens, head_dim] (K then V), got "
                                     f"{tuple(shape)}: view raw slots with BlockLayout.blocks_of.")  # fmt: skip
        if dtype not in _DTYPES:
            raise InvalidConfigError(f"slab dtype {dtype} is not supported: K/V must be fp32, fp16 or bf16.")
        if shape[1:] != first_shape[1:] or dtype != first_dtype:
            raise InvalidConfigError(f"slab chunks differ: {tuple(shape[1:])} {dtype} beside "
                                     f"{tuple(first_shape[1:])} {first_dtype}; pass one pool's chunks.")  # fmt: skip
        if host and device.type != "cpu":
            raise InvalidConfigError(f"the host kernel reads host memory; this slab is on {device}.")
        if device != query_device:
            raise InvalidConfigError(f"the slab is on {device} but the query on {query_device}.")
        dense = (shape[2] * shape[3] * shape[4], shape[3] * shape[4], shape[4], 1)
        if any(size > 1 and step != want for size, step, want in zip(shape[1:], stride[1:], dense)):
            raise InvalidConfigError("each slot of the slab must be one contiguous block [2, kv_heads, "
                                     "block_tokens, head_dim]; only the slot stride may differ.")  # fmt: skip


def _geometry(chunks: Sequence[torch.Tensor]) -> SlabGeometry:
    return tuple((c.shape, c.stride(), c.dtype, c.device) for c in chunks)


def pack_slabs(slabs: torch.Tensor | Sequence[torch.Tensor]) -> PackedSlabs | None:
    """``slabs`` (as :func:`paged_attention` takes them) checked and their addresses packed once, to pass in their
    place while they stay (:class:`PackedSlabs`); None where the C kernel does not load (pass the chunks: the torch
    version reads them)."""
    if not available():
        return None
    chunks = _chunks(slabs)
    first = chunks[0]
    _check_slabs(_geometry(chunks), first.device, True)
    return PackedSlabs(first.new_empty((0, *first.shape[1:])), sum(int(chunk.shape[0]) for chunk in chunks),
                       len(chunks), _pack_chunks(chunks))  # fmt: skip


def _chunks(slabs: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    chunks = [slabs] if isinstance(slabs, torch.Tensor) else list(slabs)
    if not chunks:
        raise InvalidConfigError("slabs is empty: pass the tier's slab [slots, 2, kv_heads, block_tokens, "
                                 "head_dim] (or its chunks).")  # fmt: skip
    return chunks


def _check(query: torch.Tensor, slabs: torch.Tensor | Sequence[torch.Tensor] | PackedSlabs, block_table: Table,
           lengths: Ints, *,
           scaling: float, softcap: float | None, causal: bool, query_start: Ints | None, window: int | None,
           mask: torch.Tensor | None, mask_start: int, positions: Table | None, starts: Table | None,
           entry_tokens: int | None, threads: int | None, host: bool = True) -> _Inputs:  # fmt: skip
    """Check every argument (the C side trusts them) and normalise them; raise InvalidConfigError. ``host``:
    everything must be in host memory (the C kernel's inputs), else on the query's device. Packed slabs were
    checked when packed: only their device is checked against the query's."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InvalidConfigError(f"threads must be a positive int or None (torch's count), got {threads!r}.")
    if isinstance(slabs, PackedSlabs):
        chunks: list[torch.Tensor] | PackedSlabs = slabs
        first = slabs.geometry
        if first.device != query.device:
            raise InvalidConfigError(f"the slab is on {first.device} but the query on {query.device}.")
    else:
        chunks = _chunks(slabs)
        first = chunks[0]
        _check_slabs(_geometry(chunks), query.device, host)
    _, _, kv_heads, block_tokens, head_dim = first.shape
    if query.dim() != 4 or not query.is_floating_point():
        raise InvalidConfigError(f"query must be a float tensor [batch, q_heads, q_len, head_dim], got "
                                 f"{query.dtype} of shape {tuple(query.shape)}.")  # fmt: skip
    batch, q_heads, q_len, q_dim = query.shape
    if q_dim != head_dim or q_heads % kv_heads or q_len < 1:
        raise InvalidConfigError(f"query {tuple(query.shape)} does not fit the slab's {kv_heads} kv heads of dim "
                                 f"{head_dim}: q_heads must be a multiple of kv_heads and head_dim equal, "
                                 f"q_len >= 1.")  # fmt: skip
    if host and query.device.type != "cpu":
        raise InvalidConfigError(f"the host kernel attends on the CPU; move the query from {query.device} first.")
    table = _table(block_table, "block_table")
    if table.shape[0] != batch:
        raise InvalidConfigError(f"block_table has {table.shape[0]} rows for a query of batch {batch}.")
    pos = None
    if positions is not None:
        pos = _table(positions, "positions")
        if pos.shape != table.shape:
            raise InvalidConfigError(f"positions {pos.shape} must match block_table {table.shape}.")
    page_starts = None
    if (starts is None) != (entry_tokens is None):
        raise InvalidConfigError("starts and entry_tokens go together: pass both to attend pages inside the blocks, "
                                 "neither to attend whole blocks.")  # fmt: skip
    if starts is not None:
        if (isinstance(entry_tokens, bool) or not isinstance(entry_tokens, int) or entry_tokens < 1
                or block_tokens % entry_tokens):  # fmt: skip
            raise InvalidConfigError(f"entry_tokens must be a positive divisor of the slab's block_tokens "
                                     f"({block_tokens}), got {entry_tokens!r}.")  # fmt: skip
        page_starts = _table(starts, "starts")
        if page_starts.shape != table.shape:
            raise InvalidConfigError(f"starts {page_starts.shape} must match block_table {table.shape}.")
    length = _rows(lengths, batch, "lengths")
    start = None
    if causal:
        start = length - q_len if query_start is None else _rows(query_start, batch, "query_start")
    elif query_start is not None or window is not None:
        raise InvalidConfigError("query_start and window place the queries: they need causal=True.")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise InvalidConfigError(f"window must be a positive number of keys or None, got {window!r}.")
    # mask_start whether or not a mask is given: prepare(masked=True) checks it here, its mask comes per call
    for name, values in (("positions", pos), ("lengths", length), ("query_start", start),
                         ("window", None if window is None else np.array([window])),
                         ("mask_start", np.array([int(mask_start)]))):
        if values is not None and values.size and (int(values.max()) >= _POSITION_LIMIT
                                                   or int(values.min()) <= -_POSITION_LIMIT):
            raise InvalidConfigError(f"{name} must lie within +-2**62 (the C kernel adds positions, query offsets "
                                     f"and windows in int64), got {int(values.min())}..{int(values.max())}.")
    if softcap is not None and not softcap > 0:
        raise InvalidConfigError(f"softcap must be positive or None, got {softcap!r}.")
    bias = None if mask is None else _bias(mask, batch, q_len, query.device, mask_start, int(length.max(initial=0)))
    q = query if query.dtype == torch.float32 and not query.requires_grad and query.is_contiguous() else \
        query.detach().float().contiguous()  # fmt: skip
    return _Inputs(q, chunks, table, page_starts, int(entry_tokens or block_tokens), pos, length, start, window or 0,
                   bias, int(mask_start), float(scaling), float(softcap or 0.0))  # fmt: skip


def _bias(mask: torch.Tensor, batch: int, q_len: int, device: torch.device, mask_start: int,
          keys: int) -> torch.Tensor:  # fmt: skip
    """``mask`` (``[B or 1, 1, q_len, M]``, bool or additive) as the kernel's additive fp32 bias ``[B or 1, q_len,
    M]``, checked to cover key positions below ``keys``; raise InvalidConfigError."""
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] != 1 or mask.shape[2] != q_len:
        raise InvalidConfigError(f"mask must be [batch or 1, 1, q_len={q_len}, keys], got {tuple(mask.shape)}.")
    mask = mask.detach().to(device)
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill(
            ~mask, torch.finfo(torch.float32).min)  # fmt: skip
    else:
        bias = mask.float().clamp_min(torch.finfo(torch.float32).min)
    bias = bias[:, 0].contiguous()
    if mask_start + bias.shape[-1] < keys:
        raise InvalidConfigError(f"the mask covers key positions [{mask_start}, {mask_start + bias.shape[-1]}) "
                                 f"but keys reach position {keys - 1}.")  # fmt: skip
    return bias


def _check_slots(inputs: _Inputs, total_slots: int | None = None) -> None:
    """Raise InvalidConfigError if the table names a slot past the slab (of ``total_slots``: default, the slabs'),
    or an entry's start is not a page of its block (the C kernel checks both itself)."""
    if total_slots is None:
        total_slots = inputs.total_slots
    if inputs.table.size and int(inputs.table.max()) >= total_slots:
        raise InvalidConfigError(f"block_table names slot {int(inputs.table.max())} of a slab of {total_slots} "
                                 f"slots.")  # fmt: skip
    if inputs.starts is not None:
        starts, entry, block = inputs.starts[inputs.table >= 0], inputs.entry_tokens, inputs.block_tokens
        bad = starts[(starts < 0) | (starts >= block) | (starts % entry != 0)]
        if bad.size:
            raise InvalidConfigError(f"starts names token {int(bad[0])} of a slot: each start must be a multiple "
                                     f"of entry_tokens={entry} below block_tokens={block} (a page's first token, "
                                     f"not its index).")  # fmt: skip


def _address(array: np.ndarray | None) -> int:
    return 0 if array is None else array.__array_interface__["data"][0]


def paged_attention(query: torch.Tensor, slabs: torch.Tensor | Sequence[torch.Tensor] | PackedSlabs,
                    block_table: Table, lengths: Ints, *, scaling: float, softcap: float | None = None,
                    causal: bool = True, query_start: Ints | None = None, window: int | None = None,
                    mask: torch.Tensor | None = None, mask_start: int = 0, positions: Table | None = None,
                    starts: Table | None = None, entry_tokens: int | None = None, threads: int | None = None,
                    entry_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attend ``query`` over the blocks ``block_table`` names in ``slabs`` (or pages inside them), in place, on
    the CPU.

    - ``query``: ``[B, H_q, q_len, D]``; query head ``j`` reads kv head ``j // (H_q // H_kv)`` (GQA).
    - ``slabs``: the tier's slab as blocks ``[slots, 2, H_kv, block_tokens, D]`` (K then V; fp32, fp16 or bf16;
      only the slot stride may be padded), or a pool's chunks of it, whose slot ids count on across chunks, or
      those chunks packed once (:func:`pack_slabs`, for repeated calls: nothing per chunk is done per call).
    - ``block_table``: ``[B, n]`` slot ids; negative: no entry. Each entry is ``entry_tokens`` tokens of its slot
      (the whole block without ``starts``); entry ``j`` holds the key positions from ``positions[b, j]`` on
      (``j * entry_tokens`` without ``positions``: the entries concatenated in table order).
    - ``starts`` with ``entry_tokens`` (together or neither): entry ``[b, j]`` is the ``entry_tokens`` tokens of
      its slot from token ``starts[b, j]`` on (``[B, n]`` ints, each a multiple of ``entry_tokens``, a divisor of
      ``block_tokens``): sparse attention's selected pages, attended where the block lies. Positions stay the
      caller's choice: the pages' real positions (block position + start) keep causal, window and mask
      meaningful; the default (concatenated) suits ``causal=False`` or one query after every key.
    - ``lengths``: per row (or one int), keys at positions ``>= length`` are not attended (a partial last block
      or page), nor keys at negative positions (a span that starts inside its first block).
    - ``causal``: query ``i`` sits at position ``query_start + i`` (default ``length - q_len``) and attends keys
      at positions ``<= `` it, and ``> position - window`` with a sliding ``window``.
    - ``mask``: ``[B or 1, 1, q_len, M]`` bool (True: attend) or additive, column ``position - mask_start``;
      keys before ``mask_start`` are not attended. ``softcap``: ``tanh(s / cap) * cap`` before the mask.
    - ``entry_lse``: where given, an fp32 ``[B, H_q, q_len, n]`` tensor that receives each table entry's own
      log-sum-exp (``-inf``: no key of it attended), so that ``exp(entry_lse - lse)`` is the entry's share of the
      softmax — sparse attention's measured share of each page, without a second pass over the keys.

    Returns the normalised output ``[B, H_q, q_len, D]`` and the log-sum-exp ``[B, H_q, q_len]``, fp32, as
    :func:`tierkv.attention.lse.merge` takes them; a query that attends no key gets 0 and ``-inf``. Runs the C
    kernel on ``threads`` threads (default: torch's), else :func:`paged_attention_torch`.
    """
    inputs = _check(query, slabs, block_table, lengths, scaling=scaling, softcap=softcap, causal=causal,
                    query_start=query_start, window=window, mask=mask, mask_start=mask_start, positions=positions,
                    starts=starts, entry_tokens=entry_tokens, threads=threads)
    entries = _entry_lse(entry_lse, inputs)
    lib = _build()
    if isinstance(lib, EngineUnavailableError):
        _log_fallback(lib.reason)
        return _attend_torch(inputs, entries)
    return _attend_native(lib, inputs, threads, entries)


def _pack_chunks(chunks: Sequence[torch.Tensor]) -> bytes:
    """The chunks' part of the C kernel's arguments: (address, slots, slot stride in bytes) each."""
    fields = [v for c in chunks for v in (c.data_ptr(), c.shape[0], c.stride(0) * c.element_size())]
    return struct.pack(f"<{len(fields)}q", *fields)


def _entry_lse(entry_lse: torch.Tensor | None, inputs: _Inputs) -> torch.Tensor | None:
    """``entry_lse`` checked to be the ``[B, H_q, q_len, n]`` fp32 contiguous tensor on the query's device that
    :func:`paged_attention` fills, and filled with ``-inf`` (entries that attend no key keep it); raise
    InvalidConfigError."""
    if entry_lse is None:
        return None
    wanted = (*inputs.query.shape[:-1], inputs.table.shape[1])
    if (tuple(entry_lse.shape) != wanted or entry_lse.dtype != torch.float32 or not entry_lse.is_contiguous()
            or entry_lse.device != inputs.query.device):  # fmt: skip
        raise InvalidConfigError(f"entry_lse must be a contiguous fp32 tensor {list(wanted)} on "
                                 f"{inputs.query.device}, got {entry_lse.dtype} {list(entry_lse.shape)} on "
                                 f"{entry_lse.device}.")  # fmt: skip
    return entry_lse.fill_(float("-inf"))


def _attend_native(lib: ctypes.CDLL, inputs: _Inputs, threads: int | None,
                   entry_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    out = torch.empty_like(inputs.query)
    lse = torch.empty(inputs.query.shape[:-1], dtype=torch.float32)
    entries = 0 if entry_lse is None else entry_lse.data_ptr()
    _raise_for(lib.tkv_attn(_pack(inputs, threads, out.data_ptr(), lse.data_ptr(), entries)), inputs)
    return out, lse


def _pack(inputs: _Inputs, threads: int | None, out: int, lse: int, entry_lse: int = 0) -> bytes:
    """The C kernel's argument struct for ``inputs``, writing to the addresses ``out``, ``lse`` and ``entry_lse``
    (0: none)."""
    q, table, mask, slabs = inputs.query, inputs.table, inputs.mask, inputs.slabs
    batch, q_heads, q_len, head_dim = q.shape
    first = inputs.first
    _, _, kv_heads, block_tokens, _ = first.shape
    chunks, tail = (slabs.chunks, slabs.packed) if isinstance(slabs, PackedSlabs) else (len(slabs), _pack_chunks(slabs))
    return _ARGS.pack(
        batch, q_heads, kv_heads, q_len, head_dim, block_tokens, inputs.entry_tokens, table.shape[1],
        _DTYPES[first.dtype], inputs.window, 0 if mask is None else mask.shape[-1], inputs.mask_start,
        0 if mask is None or mask.shape[0] == 1 else mask.stride(0),
        threads if threads is not None else torch.get_num_threads(), ISA, chunks,
        inputs.scaling, inputs.softcap,
        q.data_ptr(), _address(table), _address(inputs.starts), _address(inputs.positions), _address(inputs.lengths),
        _address(inputs.query_start), 0 if mask is None else mask.data_ptr(), out, lse, entry_lse,
    ) + tail  # fmt: skip


def _raise_for(code: int, inputs: _Inputs, total_slots: int | None = None) -> None:
    """Raise for the C kernel's return ``code`` (0: success); ``total_slots`` as :func:`_check_slots` takes it."""
    if code == _ENOMEM:
        raise MemoryError("host attention kernel: out of memory for its per-thread buffers")
    if code in (_ESLOT, _ESTART):
        _check_slots(inputs, total_slots)
    if code:
        raise InvalidConfigError(f"host attention kernel refused its arguments (code {code}): a bug in _check.")


# Offsets into the packed _ARGS (fields in its order) of those a PagedCall writes per call: keep with _ARGS.
_MASK_SHAPE_AT = struct.calcsize("<10q")  # mask_len, mask_start, mask_batch_stride
_THREADS_AT = struct.calcsize("<13q")  # threads, isa
_QUERY_AT = struct.calcsize("<16q2d")  # the query's address
_MASK_AT = struct.calcsize("<16q2d6Q")  # the mask's address
_OUTPUTS_AT = struct.calcsize("<16q2d7Q")  # out's and lse's addresses
_TWO_INTS, _THREE_INTS = struct.Struct("<2q"), struct.Struct("<3q")
_ADDRESS, _TWO_ADDRESSES = struct.Struct("<Q"), struct.Struct("<2Q")


class PagedCall:
    """:func:`paged_attention` prepared for repeated calls over the same slabs and block table with a new query of
    the same shape each time (a layer's decode steps): every argument is checked and packed once
    (:func:`prepare`); a call writes the query's and the outputs' addresses and the rows' key count into the
    packed struct and runs the C kernel — no checking, no packing, nothing proportional to the table in Python.
    Prepared ``masked``, each call takes its step's mask (its key columns may grow), converted as
    :func:`paged_attention` converts it.

    Only the slabs' addresses are kept, not the chunks: the caller keeps them alive, and prepares again when they
    change (a pool grown or shrunk), for as long as it calls. :attr:`positions` (``[B, n]``, or None for the
    concatenated default) may be rewritten in place between calls (a sliding window's start moves inside the same
    blocks).
    """

    def __init__(self, lib: ctypes.CDLL, inputs: _Inputs, threads: int | None, masked: bool) -> None:
        self._kernel = lib.tkv_attn
        self._args = ctypes.create_string_buffer(_pack(inputs, threads, 0, 0))
        # what stays: the arrays whose addresses are packed, the first chunk's geometry and the slot count
        first = inputs.first
        self._inputs = inputs._replace(query=torch.empty(0), slabs=[first.new_empty((0, *first.shape[1:]))])
        self._slots = inputs.total_slots
        one = not isinstance(inputs.slabs, PackedSlabs) and len(inputs.slabs) == 1
        self._geometry = (first.dtype, first.shape[1:], first.stride()) if one else None  # what bind() accepts
        self.positions = inputs.positions
        self.shape = tuple(inputs.query.shape)
        self._threads = threads
        self._causal = inputs.query_start is not None
        self._length = -1  # the key count the lengths hold
        self.masked = masked
        self._mask_start = inputs.mask_start

    def bind(self, slab: torch.Tensor) -> None:
        """Read ``slab`` from the next call on, in place of the one slab chunk prepared: a CPU tensor of its dtype,
        block shape and strides, with at least its slots (a disk round that landed in another bounce buffer). The
        caller keeps it alive while it calls."""
        if (self._geometry is None or (slab.dtype, slab.shape[1:], slab.stride()) != self._geometry
                or slab.shape[0] < self._slots or not slab.is_cpu):  # fmt: skip
            raise InvalidConfigError(f"this PagedCall reads one slab chunk like {self._geometry} of at least "
                                     f"{self._slots} slots; got {slab.dtype} {tuple(slab.shape)} strides "
                                     f"{slab.stride()} on {slab.device}: prepare another.")  # fmt: skip
        _THREE_INTS.pack_into(self._args, _ARGS.size, slab.data_ptr(), slab.shape[0],
                              slab.stride(0) * slab.element_size())  # fmt: skip

    def __call__(self, query: torch.Tensor, length: int,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """:func:`paged_attention` of ``query`` (of the prepared shape, on the CPU) over the keys at positions below
        ``length`` (in every row), with ``mask`` where prepared ``masked``: the normalised output and the
        log-sum-exp, fp32."""
        args, out, lse, _ = self.pack(query, length, mask)
        code = self._kernel(args)
        if code:
            self.raise_for(code)
        return out, lse

    def pack(self, query: torch.Tensor, length: int, mask: torch.Tensor | None = None
             ) -> tuple[ctypes.Array[ctypes.c_char], torch.Tensor, torch.Tensor, list[torch.Tensor]]:  # fmt: skip
        """The call of :meth:`__call__` packed and not run: the kernel's argument (for :func:`kernel_address`'s
        function, or a C loop that calls it), the output and log-sum-exp it will write, and the tensors whose
        addresses it holds besides (the query and mask as converted), which the caller keeps alive until it ran;
        :meth:`raise_for` its nonzero status."""
        if query.shape != self.shape or not query.is_cpu or (mask is None) == self.masked:
            raise InvalidConfigError(f"this PagedCall was prepared for a CPU query of shape {self.shape} "
                                     f"{'with' if self.masked else 'without'} a mask, got {tuple(query.shape)} on "
                                     f"{query.device} {'without' if mask is None else 'with'} one: prepare "
                                     f"another.")  # fmt: skip
        if query.dtype != torch.float32 or not query.is_contiguous():
            query = query.detach().float().contiguous()
        if length != self._length:
            if not -_POSITION_LIMIT < length < _POSITION_LIMIT:  # as _check: the C kernel's int64 sums
                raise InvalidConfigError(f"lengths must lie within +-2**62, got {length}.")
            inputs = self._inputs
            inputs.lengths.fill(length)
            if self._causal:
                assert inputs.query_start is not None
                inputs.query_start.fill(length - self.shape[2])
            self._length = length
        out = torch.empty(self.shape, dtype=torch.float32)
        lse = torch.empty(self.shape[:-1], dtype=torch.float32)
        args = self._args
        if mask is not None:
            bias = _bias(mask, self.shape[0], self.shape[2], query.device, self._mask_start, length)
            _THREE_INTS.pack_into(args, _MASK_SHAPE_AT, bias.shape[-1], self._mask_start,
                                  0 if bias.shape[0] == 1 else bias.stride(0))  # fmt: skip
            _ADDRESS.pack_into(args, _MASK_AT, bias.data_ptr())
        _TWO_INTS.pack_into(args, _THREADS_AT, self._threads or torch.get_num_threads(), ISA)
        _ADDRESS.pack_into(args, _QUERY_AT, query.data_ptr())
        _TWO_ADDRESSES.pack_into(args, _OUTPUTS_AT, out.data_ptr(), lse.data_ptr())
        return args, out, lse, [query] if mask is None else [query, bias]

    def raise_for(self, code: int) -> None:
        """Raise for the kernel's nonzero status ``code`` over this call's arguments."""
        _raise_for(code, self._inputs, self._slots)


def prepare(query: torch.Tensor, slabs: torch.Tensor | Sequence[torch.Tensor], block_table: Table, lengths: int, *,
            scaling: float, softcap: float | None = None, causal: bool = True, window: int | None = None,
            masked: bool = False, mask_start: int = 0, positions: Table | None = None, starts: Table | None = None,
            entry_tokens: int | None = None, threads: int | None = None) -> PagedCall | None:  # fmt: skip
    """:func:`paged_attention`'s arguments (without an explicit ``query_start``: causal queries are the last
    ``q_len`` positions) checked and packed for repeated calls (:class:`PagedCall`); ``masked``: each call passes
    its mask (keys from ``mask_start``). None where the C kernel does not load (call :func:`paged_attention`,
    which runs the torch version). The table, positions and starts are copied; ``query`` gives the shape (and is
    not kept), ``lengths`` the first call's key count."""
    lib = _build()
    if isinstance(lib, EngineUnavailableError):
        return None
    inputs = _check(query, slabs, block_table, lengths, scaling=scaling, softcap=softcap, causal=causal,
                    query_start=None, window=window, mask=None, mask_start=mask_start, positions=positions,
                    starts=starts, entry_tokens=entry_tokens, threads=threads)  # fmt: skip
    inputs = inputs._replace(table=inputs.table.copy(), starts=None if inputs.starts is None else inputs.starts.copy(),
                             positions=None if inputs.positions is None else inputs.positions.copy())  # fmt: skip
    return PagedCall(lib, inputs, threads, masked)


def paged_attention_torch(query: torch.Tensor, slabs: torch.Tensor | Sequence[torch.Tensor], block_table: Table,
                          lengths: Ints, *, scaling: float, softcap: float | None = None, causal: bool = True,
                          query_start: Ints | None = None, window: int | None = None,
                          mask: torch.Tensor | None = None, mask_start: int = 0, positions: Table | None = None,
                          starts: Table | None = None, entry_tokens: int | None = None, threads: int | None = None,
                          entry_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`paged_attention` in plain torch (gathers the named blocks or pages, then attends them in fp32), on
    the device the query and the slab share (the host's, or an accelerator's); ``threads`` is accepted for the
    same signature and ignored."""
    inputs = _check(query, slabs, block_table, lengths, scaling=scaling, softcap=softcap, causal=causal,
                    query_start=query_start, window=window, mask=mask, mask_start=mask_start, positions=positions,
                    starts=starts, entry_tokens=entry_tokens, threads=threads, host=False)  # fmt: skip
    return _attend_torch(inputs, _entry_lse(entry_lse, inputs))


def prepare_torch(query: torch.Tensor, slabs: torch.Tensor | Sequence[torch.Tensor], block_table: Table,
                  lengths: int, *, scaling: float, softcap: float | None = None, causal: bool = True,
                  window: int | None = None, mask_start: int = 0, positions: Table | None = None,
                  starts: Table | None = None, entry_tokens: int | None = None) -> TorchCall:  # fmt: skip
    """:func:`paged_attention_torch`'s arguments (without an explicit ``query_start``: causal queries are the last
    ``q_len`` positions) checked once and their tables made device tensors (:class:`TorchCall`), for repeated
    calls on the slabs' device: an accelerator's decode steps then copy no index from the host."""
    inputs = _check(query, slabs, block_table, lengths, scaling=scaling, softcap=softcap, causal=causal,
                    query_start=None, window=window, mask=None, mask_start=mask_start, positions=positions,
                    starts=starts, entry_tokens=entry_tokens, threads=None, host=False)  # fmt: skip
    return TorchCall(inputs)


def _attend_torch(inputs: _Inputs, entry_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(inputs.slabs, PackedSlabs):
        raise InvalidConfigError("packed slabs hold only addresses, for the C kernel: pass the chunks themselves.")
    return TorchCall(inputs).attend(inputs.query, inputs.slabs, inputs.lengths, inputs.mask, inputs.query_start,
                                    entry_lse=entry_lse)  # fmt: skip


class TorchCall:
    """:func:`paged_attention_torch` over one block table, its gather indices, key positions and presence made
    device tensors once (:func:`prepare_torch`): a call gathers the named blocks or pages into fp32 and attends
    them, a dozen kernels whatever the table, with nothing copied from the host but a per-row length or start
    where a call passes arrays. The caller passes the slab chunks each call (the pool's, unchanged since
    preparing: the indices name slots of those chunks); ``offset`` moves every key position down (a sliding
    window's start moved inside the same blocks)."""

    def __init__(self, inputs: _Inputs) -> None:
        _check_slots(inputs)
        assert not isinstance(inputs.slabs, PackedSlabs)
        table, device, entry = inputs.table, inputs.query.device, inputs.entry_tokens
        self.device, self.entry, self.scaling, self.softcap = device, entry, inputs.scaling, inputs.softcap
        self.shape = tuple(inputs.query.shape)
        self.columns = table.shape[1]
        self.causal, self.window, self.mask_start = inputs.query_start is not None, inputs.window, inputs.mask_start
        self.chunk_slots = tuple(int(chunk.shape[0]) for chunk in inputs.slabs)
        tokens = torch.arange(entry, device=device)
        self.gathers: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        start = 0
        for index, slots in enumerate(self.chunk_slots):  # one gather per chunk of the pool that holds entries
            inside = (table >= start) & (table < start + slots)
            if inside.any():
                page = None if inputs.starts is None else self._tensor(inputs.starts[inside])[:, None] + tokens
                self.gathers.append((index, self._tensor(table[inside] - start), self._tensor(np.flatnonzero(inside)),
                                     page))  # fmt: skip
            start += slots
        batch, n = table.shape
        self.dense = len(self.gathers) == 1 and bool((table >= 0).all())  # one gather fills every entry in order
        first = np.broadcast_to(inputs.positions if inputs.positions is not None else
                                np.arange(n, dtype=np.int64)[None] * entry, table.shape)  # fmt: skip
        # per entry, not per token: what stays on the device between calls is a few bytes a block
        self.first = self._tensor(first)[:, :, None]  # [B, n, 1] each entry's first key position
        self.present = self._tensor(table >= 0)[:, :, None]
        self.negative = bool((first < 0).any())  # a key before position 0 (a window starting inside a block)
        self.tokens = tokens
        self.query_offsets = torch.arange(self.shape[2], device=device)[None, :, None]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        # a writable copy (broadcast views are read-only); on an accelerator queued, not waited for: pageable
        # memory is staged at once, so the copy does not stall the host behind the device's queue
        return torch.from_numpy(np.array(array)).to(self.device, non_blocking=True)

    def __call__(self, query: torch.Tensor, chunks: Sequence[torch.Tensor], length: int,
                 mask: torch.Tensor | None = None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """:func:`paged_attention_torch` of ``query`` over the keys at positions below ``length`` (in every row),
        moved down by ``offset``, with ``mask`` (``[B or 1, 1, q_len, keys]``, bool or additive) or None: the
        normalised output and the log-sum-exp, fp32."""
        bias = None if mask is None else _bias(mask, self.shape[0], self.shape[2], self.device, self.mask_start,
                                                length)  # fmt: skip
        return self.attend(query, chunks, length, bias, offset=offset)

    @staticmethod
    def _gather(chunks: Sequence[torch.Tensor], index: int, slots: torch.Tensor, where: torch.Tensor,
                page: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """The entries one chunk holds, in fp32 ``[entries, 2, H_kv, entry, D]``."""
        if page is None:
            return chunks[index][slots].float()
        # each entry's tokens of its slot: [entries, entry, 2, H_kv, D] -> [entries, 2, H_kv, entry, D]
        return chunks[index][slots[:, None], :, :, page].permute(0, 2, 3, 1, 4).float()

    def attend(self, query: torch.Tensor, chunks: Sequence[torch.Tensor], lengths: int | np.ndarray,
               bias: torch.Tensor | None = None, query_start: np.ndarray | None = None, *, offset: int = 0,
               entry_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Attention of ``query`` (of the prepared shape) over the keys below ``lengths`` (an int for every row, or
        one per row) with positions moved down by ``offset``, ``bias`` ``[1 or B, q, M]`` fp32 (keys from the
        prepared ``mask_start``, :func:`_bias`) or None, causal queries from ``query_start`` (default: the last
        ``q_len`` positions): the normalised output and the log-sum-exp, fp32; ``entry_lse`` ``[B, H_q, q, n]``,
        if given, receives each entry's log-sum-exp."""
        if tuple(query.shape) != self.shape or len(chunks) != len(self.chunk_slots):
            raise InvalidConfigError(f"this TorchCall was prepared for a query of shape {self.shape} over "
                                     f"{len(self.chunk_slots)} slab chunks, got {tuple(query.shape)} over "
                                     f"{len(chunks)}: prepare another.")  # fmt: skip
        q = query.detach().float()
        batch, q_heads, q_len, head_dim = self.shape
        first = chunks[0]
        kv_heads, entry, n = int(first.shape[2]), self.entry, self.columns
        group = q_heads // kv_heads
        if self.dense:
            blocks = self._gather(chunks, *self.gathers[0]).view(batch, n, 2, kv_heads, entry, head_dim)
        else:
            blocks = torch.zeros((batch, n, 2, kv_heads, entry, head_dim), dtype=torch.float32, device=self.device)
            entries = blocks.view(batch * n, 2, kv_heads, entry, head_dim)  # integer indices: no boolean mask (a sync)
            for gather in self.gathers:
                entries[gather[2]] = self._gather(chunks, *gather)
        keys = blocks[:, :, 0].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, n * entry, head_dim)
        values = blocks[:, :, 1].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, n * entry, head_dim)
        key_pos = self.first + (self.tokens if not offset else self.tokens - offset)  # [B, n, entry]
        # per-row numbers as [B, 1, 1] device tensors; one number for every row stays a Python scalar (no copy)
        stop: int | torch.Tensor = lengths if isinstance(lengths, int) else self._tensor(lengths)[:, None, None]
        allowed = self.present & (key_pos < stop)
        if self.negative or offset > 0:
            allowed = allowed & (key_pos >= 0)
        key_pos, allowed = key_pos.reshape(batch, 1, n * entry), allowed.reshape(batch, 1, n * entry)  # [B, 1, keys]
        if self.causal and (q_len > 1 or query_start is not None or self.window):
            start = stop - q_len if query_start is None else self._tensor(query_start)[:, None, None]
            query_pos = self.query_offsets + start
            allowed = allowed & (key_pos <= query_pos)
            if self.window:
                allowed = allowed & (key_pos > query_pos - self.window)
        rows = (q * self.scaling).view(batch, kv_heads, group * q_len, head_dim)
        scores = torch.matmul(rows, keys.transpose(-1, -2)).view(batch, kv_heads, group, q_len, -1)
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if bias is not None:
            allowed = allowed & (key_pos >= self.mask_start)
            column = (key_pos - self.mask_start).clamp(0, bias.shape[-1] - 1)
            keys_bias = torch.gather(bias.expand(batch, q_len, -1), 2, column.expand(batch, q_len, -1))
            scores = (scores + keys_bias[:, None, None]).clamp_min(torch.finfo(torch.float32).min)
        allowed = allowed[:, None, None].expand(scores.shape)  # [B, H_kv, G, q, keys]
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        if entry_lse is not None:  # [B, H_kv, G, q, n] -> [B, H_q, q, n]
            entry_lse.copy_(torch.logsumexp(scores.unflatten(-1, (n, entry)), dim=-1).flatten(1, 2))
        weights = torch.softmax(scores, dim=-1)  # (exp(scores - lse) is not normalised where lse rounds to -FLT_MAX)
        weights = weights.masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0)  # a query with no key: 0 (a NaN stays)
        out = torch.matmul(weights.view(batch, kv_heads, group * q_len, -1), values)
        return out.view(self.shape), lse.view(self.shape[:-1])
