"""A conversation on disk: a cache's K/V, token ids and per-layer state as one file of checksummed records.

::

    record "conversation"  header: format, block_tokens, batch, layers [{index, sliding_window, dropped,
                           length}], namespace, fingerprint, ids_shape    payload: the token ids (<i8), if known
    record "kv" ...        header: layer, first (block index), dtype, shape [B, n, 2, H_kv, bt, D]
                           payload: those blocks (a layer's partial tail block zero-padded)
    record "state" ...     header: layer (the model's), part (conv / recurrent), index, dtype, shape
                           payload: that state tensor (models whose layers keep recurrent state; the header's
                           ``states`` lists those layers and the tokens each has taken in)
    record "end"           header: records (the count before it) — a file cut at a record boundary is caught

Each layer is written in chunks of at most ``CHUNK_BYTES``, so saving and loading hold one chunk at a time
outside the tiers. Records are written to a fresh temporary file beside ``path`` (``O_EXCL``, mode 0600,
:func:`tierkv.safefs.replacing`), fsynced and renamed over ``path``: a crash while saving leaves the previous
file intact, and a link planted at ``path`` is replaced, never followed.

Every file carries the fingerprint of the model that computed its K/V (:func:`records` refuses to write one
without). A file is input from anywhere: :func:`open_file` refuses anything but a regular file (a FIFO is
never waited on), :func:`tierkv.persist.record.read` checks each length against the bytes the file really
has and against what the record's own header allows (:func:`ids_limit`, :meth:`Reader.limit`: a sparse file
has every byte it claims) before allocating, and :func:`check_header` and :class:`Reader` check every field's
type and range (a
layer drops whole blocks, only with a sliding window, never one the window still reaches) and that each K/V
record has exactly the shape the header's geometry implies — any failure is an
:class:`~tierkv.errors.IntegrityError` naming the file and the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierkv import safefs
from tierkv.atomic import finished
from tierkv.errors import DiskFullError, DiskTierError, IntegrityError, InvalidConfigError, TierKVError
from tierkv.inputs import output_problem
from tierkv.persist import record
from tierkv.persist.keys import KEY_BYTES, Namespace
from tierkv.store import KVStore
from tierkv.tiers.disk import limit_advice

FORMAT = 1
CHUNK_BYTES = 64 << 20
FINGERPRINT = re.compile(rf"^[0-9a-f]{{{2 * KEY_BYTES}}}$")
MAX_LAYERS = 1 << 12
MAX_BATCH = 1 << 16
MAX_BLOCK_TOKENS = 1 << 20
MAX_TOKENS = 1 << 40
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 16
KV_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2"})
STATE_PARTS = ("conv", "recurrent")
MAX_STATES = 64  # conv / recurrent state pairs a layer may keep
MAX_STATE_DIMS = 6


@dataclass(frozen=True, slots=True)
class LayerState:
    """One layer as the adapter sees it: its window, the tokens freed from its front, its total length."""

    index: int
    sliding_window: int | None
    dropped: int
    length: int


@dataclass(frozen=True, slots=True)
class StatePart:
    """One state tensor of a layer that keeps recurrent state: the model's layer, conv or recurrent, which pair."""

    layer: int
    part: str
    index: int
    tensor: torch.Tensor


@dataclass(frozen=True, slots=True)
class Header:
    block_tokens: int
    batch: int
    layers: tuple[LayerState, ...]  # the layers that hold K/V, in order
    ids: np.ndarray | None  # [B, T]
    namespace: dict[str, Any] | None
    fingerprint: str | None
    states: dict[int, int] | None = None  # model layer -> tokens its recurrent state has taken in


def records(kv: KVStore | None, header: Header,
            states: Sequence[StatePart] = ()) -> Iterator[tuple[bytes, memoryview]]:
    """The records of ``header``, of every layer's blocks (read from ``kv`` one chunk at a time) and of the
    ``states`` of the layers ``header.states`` names. InvalidConfigError at once if ``header`` has no model
    fingerprint: a file must say which model it fits."""
    if header.fingerprint is None:
        raise InvalidConfigError("save() needs the model whose K/V this cache holds, so that the file can only be "
                                 "loaded into that model: cache.save(path, model=model).")
    return _records(kv, header, states)


def _records(kv: KVStore | None, header: Header, states: Sequence[StatePart]) -> Iterator[tuple[bytes, memoryview]]:
    ids = header.ids if header.ids is not None else np.zeros((0, 0), dtype="<i8")
    fields = {"kind": "conversation", "format": FORMAT, "block_tokens": header.block_tokens,
              "batch": header.batch, "layers": [_layer_dict(layer) for layer in header.layers],
              "namespace": header.namespace, "fingerprint": header.fingerprint,
              "ids_shape": list(ids.shape) if header.ids is not None else None}
    if header.states is not None:  # written only where there is state: other files stay as they were
        fields["states"] = [{"layer": layer, "tokens": tokens} for layer, tokens in header.states.items()]
    yield record.encode(fields, np.ascontiguousarray(ids, dtype="<i8").tobytes())
    count = 1
    bt = header.block_tokens
    for layer in header.layers:
        first, stop = layer.dropped // bt, -(-layer.length // bt)
        if stop <= first:
            continue
        assert kv is not None, "a layer that holds tokens has a store"
        layout = kv.layouts[layer.index]
        step = max(1, CHUNK_BYTES // (header.batch * layout.block_bytes))
        for start in range(first, stop, step):
            blocks = kv.export_blocks(layer.index, start, min(start + step, stop))  # [B, n, 2, H, bt, D]
            yield record.encode({"kind": "kv", "layer": layer.index, "first": start,
                                 "dtype": str(blocks.dtype).removeprefix("torch."), "shape": list(blocks.shape)},
                                record.tensor_bytes(blocks))
            count += 1
    for state in states:
        tensor = state.tensor.detach().to("cpu").contiguous()
        yield record.encode({"kind": "state", "layer": state.layer, "part": state.part, "index": state.index,
                             "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)},
                            record.tensor_bytes(tensor))
        count += 1
    yield record.encode({"kind": "end", "records": count}, b"")


def _layer_dict(layer: LayerState) -> dict[str, Any]:
    return {"index": layer.index, "sliding_window": layer.sliding_window, "dropped": layer.dropped,
            "length": layer.length}


# ------------------------------------------------------------------------------------------- files
def save(path: str | os.PathLike, chunks: Iterable[tuple[bytes, memoryview]]) -> None:
    """Write the records ``chunks`` to ``path`` atomically (see the module's docstring)."""
    check_target(path)
    with _save_errors(path):
        safefs.write_file(path, (part for pair in chunks for part in pair), shared=False)  # a prompt's K/V: 0600


async def asave(path: str | os.PathLike, chunks: Iterable[tuple[bytes, memoryview]]) -> None:
    """:func:`save` for asyncio: the records are produced on the loop's thread (they read the tiers); the
    writes, the fsyncs and the rename run on worker threads, so the event loop never waits for the disk."""
    check_target(path)
    target = Path(path)
    with _save_errors(path):
        await _asave(target, chunks)


async def _asave(target: Path, chunks: Iterable[tuple[bytes, memoryview]]) -> None:
    """:func:`asave`'s writes, fsyncs and rename (its errors as they come). Cancelled, it stops after the
    worker's call in progress (:func:`~tierkv.atomic.finished`: never closing a descriptor a worker writes
    through) and removes the temporary file; a cancellation during the rename leaves the new file complete."""
    directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)  # at once: no worker holds it unassigned
    try:
        fd, temporary = safefs.new_temporary(directory, target.name, shared=False)
        try:
            try:
                for head, payload in chunks:
                    await finished(asyncio.to_thread(safefs.write_all, fd, (head, payload)))
                await finished(asyncio.to_thread(os.fsync, fd))
                await finished(asyncio.to_thread(os.replace, temporary, target.name, src_dir_fd=directory,
                                                 dst_dir_fd=directory))
            finally:
                os.close(fd)  # after the rename: its lock keeps reapers away until then
        except BaseException:
            safefs.remove_regular(directory, temporary)
            raise
        await finished(asyncio.to_thread(safefs.fsync_directory, directory))
    finally:
        os.close(directory)


@contextlib.contextmanager
def _save_errors(path: str | os.PathLike) -> Iterator[None]:
    """A failed write, fsync or rename while saving (a full disk, EIO, a read-only remount) raised as a
    DiskTierError naming ``path`` and the fix, not a bare OSError (the previous file is left as it was)."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, TierKVError):
            raise
        where = os.fspath(path)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(exc.errno, f"cannot save the conversation to {where!r}: {exc.strerror}; free space "
                                           "there or save to another filesystem (a file already at that path is "
                                           "unchanged).") from exc
        limit = limit_advice(exc, "save to another filesystem")
        if limit is not None:
            raise DiskTierError(exc.errno, f"cannot save the conversation to {where!r}: {limit} A file already at "
                                           "that path is unchanged.") from exc
        raise DiskTierError(exc.errno, f"cannot save the conversation to {where!r}: {exc.strerror or exc}; check "
                                       "the directory's permissions and the drive (a file already at that path is "
                                       "unchanged).") from exc


def check_target(path: str | os.PathLike) -> None:
    """DiskTierError naming ``path`` and the fix if no file can be saved there (a directory is there, its folder
    is missing): said before any K/V is copied, never as a bare OSError about a temporary name."""
    problem = output_problem(path)
    if problem is not None:
        code, why = problem
        raise DiskTierError(code, f"cannot save the conversation to {os.fspath(path)!r}: it {why}; "
                                  f"{_target_fix(code)}.")


def _target_fix(code: int) -> str:
    """What to do about a save target refused with ``code`` (:func:`check_target`)."""
    if code == errno.EROFS:
        return "its filesystem is mounted read-only: save to a writable filesystem, or remount it read-write"
    if code == errno.EACCES:
        return "save in a directory you can write to, e.g. in your home directory"
    if code == errno.EPERM:
        return "choose a path of your own, e.g. in your home directory"
    if code == errno.ENAMETOOLONG:
        return "give a shorter file name"
    return ("give a file path in an existing directory, e.g. save('chats/chat.tkv', model=model) after "
            "os.makedirs('chats', exist_ok=True)")


def open_fd(path: str | os.PathLike) -> int:
    """A read-only descriptor of the conversation file ``path`` (a link the user made is followed); refused
    (IntegrityError) unless it is a regular file — a FIFO or a device is never read or waited on. A path that
    cannot be opened (missing, no permission) is a DiskTierError naming it."""
    try:
        return safefs.open_regular(None, path, os.fspath(path), follow=True)
    except OSError as exc:
        if isinstance(exc, TierKVError):
            raise
        raise DiskTierError(exc.errno, f"cannot load the conversation file {os.fspath(path)!r}: {exc.strerror}; "
                                       "give the path of a file written by cache.save(path, model=model).") from None


def open_file(path: str | os.PathLike) -> io.BufferedReader:
    """:func:`open_fd` as a buffered binary file."""
    return os.fdopen(open_fd(path), "rb")


# ------------------------------------------------------------------------------------------ checks
def _integer(value: Any, what: str, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise IntegrityError(f"{what}: field {name!r} is {str(value)[:40]!r}, not an integer in [{low}, {high}].")
    return value


def _text(value: Any, what: str, name: str, pattern: str = r"^[A-Za-z0-9_.\-]{1,64}$") -> str:
    if not isinstance(value, str) or not re.match(pattern, value):
        raise IntegrityError(f"{what}: field {name!r} is {str(value)[:40]!r}, not a valid name.")
    return value


def _namespace(value: Any, what: str, block_tokens: int, layers: int) -> dict[str, Any] | None:
    """The namespace a conversation's blocks were computed in, every field checked (or None)."""
    if value is None:
        return None
    names = {f.name for f in fields(Namespace)} - {"shapes"}  # (only where the layers' shapes differ)
    if not isinstance(value, dict) or set(value) - {"shapes"} != names:
        raise IntegrityError(f"{what}: field 'namespace' is not an object with exactly {sorted(names)} (and "
                             "'shapes' where the layers' differ).")
    _text(value["fingerprint"], what, "namespace.fingerprint", FINGERPRINT.pattern)
    if _integer(value["layers"], what, "namespace.layers", 1, MAX_LAYERS) != layers:
        raise IntegrityError(f"{what}: field 'namespace.layers' is {value['layers']}, the file has {layers} layers.")
    _integer(value["kv_heads"], what, "namespace.kv_heads", 1, MAX_HEADS)
    _integer(value["head_dim"], what, "namespace.head_dim", 1, MAX_HEAD_DIM)
    if value["dtype"] not in KV_DTYPES:
        raise IntegrityError(f"{what}: field 'namespace.dtype' is {str(value['dtype'])[:40]!r}, not a K/V dtype.")
    if value["block_tokens"] != block_tokens:
        raise IntegrityError(f"{what}: field 'namespace.block_tokens' is {str(value['block_tokens'])[:40]!r}, the "
                             f"file's block_tokens is {block_tokens}.")
    _text(value["device_type"], what, "namespace.device_type")
    _text(value["attention"], what, "namespace.attention")
    if "shapes" in value:
        shapes = value["shapes"]
        if not isinstance(shapes, list) or len(shapes) != layers or not all(
                isinstance(shape, list) and len(shape) == 2 for shape in shapes):  # fmt: skip
            raise IntegrityError(f"{what}: field 'namespace.shapes' is not a list of {layers} [KV heads, head dim].")
        for i, (heads, dim) in enumerate(shapes):
            _integer(heads, what, f"namespace.shapes[{i}][0]", 1, MAX_HEADS)
            _integer(dim, what, f"namespace.shapes[{i}][1]", 1, MAX_HEAD_DIM)
        if len({tuple(shape) for shape in shapes}) < 2:
            raise IntegrityError(f"{what}: field 'namespace.shapes' gives every layer one shape; a namespace of one "
                                 "shape has no 'shapes' field.")
    return dict(value)


def _layers(value: Any, what: str, block_tokens: int, fewest: int = 1) -> tuple[LayerState, ...]:
    """Each layer's state, checked as the cache makes it: tokens are ``dropped`` only from a sliding layer, whole
    blocks at a time, and never one its window still reaches (``length - (window - 1)`` tokens at most), so
    no file makes a layer attend without tokens it needs."""
    if not isinstance(value, list) or not fewest <= len(value) <= MAX_LAYERS:
        raise IntegrityError(f"{what}: field 'layers' is not a list of {fewest} to {MAX_LAYERS} layers.")
    layers = []
    for i, d in enumerate(value):
        name = f"layers[{i}]"
        if not isinstance(d, dict) or set(d) != {"index", "sliding_window", "dropped", "length"}:
            raise IntegrityError(f"{what}: field {name!r} is not an object of index, sliding_window, dropped, length.")
        _integer(d["index"], what, f"{name}.index", i, i)
        window = d["sliding_window"]
        if window is not None:
            _integer(window, what, f"{name}.sliding_window", 1, MAX_TOKENS)
        length = _integer(d["length"], what, f"{name}.length", 0, MAX_TOKENS)
        dropped = _integer(d["dropped"], what, f"{name}.dropped", 0, length)
        if window is None and dropped:
            raise IntegrityError(f"{what}: field '{name}.dropped' is {dropped}, but the layer has no sliding window: "
                                 "a full-attention layer never drops a token.")
        if window is not None and dropped > max(0, length - (window - 1)):
            raise IntegrityError(f"{what}: field '{name}.dropped' is {dropped}, but a window of {window} over "
                                 f"{length} tokens still reaches token {max(0, length - (window - 1))}.")
        if dropped % block_tokens:
            raise IntegrityError(f"{what}: field '{name}.dropped' is {dropped}, not a whole number of blocks of "
                                 f"{block_tokens} tokens.")
        layers.append(LayerState(i, window, dropped, length))
    return tuple(layers)


def check_header(header: dict[str, Any], what: str) -> tuple[Header, int]:
    """The first record's header, every field checked (IntegrityError naming the field), before its payload is
    read: ``(the header without its ids, the exact bytes of its ids payload)``. The ids are ``batch x
    ids_shape[1]`` int64, and a file knows the ids of no more tokens than its longest layer holds, so the payload
    a file may make the loader allocate is bounded by what the header says it holds (a sparse file has every byte
    it claims: only the header can bound it)."""
    record.check_format(header, "conversation", FORMAT, what)
    expected = {"kind", "format", "block_tokens", "batch", "layers", "namespace", "fingerprint", "ids_shape"}
    if set(header) - {"states"} != expected:
        raise IntegrityError(f"{what}: the first record's fields are {sorted(header)[:20]}, not {sorted(expected)} "
                             "(and 'states' where layers keep recurrent state).")
    fingerprint = header["fingerprint"]
    if fingerprint is None:
        raise IntegrityError(f"{what}: field 'fingerprint' is missing: the file does not say which model computed "
                             "its K/V, so it cannot be loaded safely; save it again with save(path, model=model).")
    _text(fingerprint, what, "fingerprint", FINGERPRINT.pattern)
    block_tokens = _integer(header["block_tokens"], what, "block_tokens", 1, MAX_BLOCK_TOKENS)
    batch = _integer(header["batch"], what, "batch", 1, MAX_BATCH)
    states = _states(header.get("states"), what)
    layers = _layers(header["layers"], what, block_tokens, 0 if states else 1)
    lengths = {layer.length for layer in layers} | set((states or {}).values())
    if len(lengths) > 1:
        raise IntegrityError(f"{what}: its layers hold {sorted(lengths)[:8]} tokens; a conversation's layers hold as "
                             "many each (its K/V would decode wrong). The file is damaged or crafted.")
    namespace = _namespace(header["namespace"], what, block_tokens, len(layers))
    shape = header["ids_shape"]
    ids_bytes = 0
    if shape is not None:
        if not isinstance(shape, list) or len(shape) != 2:
            raise IntegrityError(f"{what}: field 'ids_shape' is not [batch, tokens].")
        _integer(shape[0], what, "ids_shape[0]", batch, batch)
        longest = max([layer.length for layer in layers] + list((states or {}).values()))
        tokens = _integer(shape[1], what, "ids_shape[1]", 0, MAX_TOKENS)
        if tokens > longest:
            raise IntegrityError(f"{what}: field 'ids_shape' is {shape}: the ids of {tokens} tokens, but its longest "
                                 f"layer holds {longest}; the file is damaged or crafted. Save the conversation "
                                 "again.")
        ids_bytes = batch * tokens * 8
    return Header(block_tokens, batch, layers, None, namespace, fingerprint, states), ids_bytes


def _states(value: Any, what: str) -> dict[int, int] | None:
    """The layers that keep recurrent state and the tokens each has taken in (None: no such layers), checked."""
    if value is None:
        return None
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_LAYERS:
        raise IntegrityError(f"{what}: field 'states' is not a list of 1 to {MAX_LAYERS} layers.")
    states: dict[int, int] = {}
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or set(entry) != {"layer", "tokens"}:
            raise IntegrityError(f"{what}: field 'states[{i}]' is not an object of layer, tokens.")
        layer = _integer(entry["layer"], what, f"states[{i}].layer", max(states, default=-1) + 1, MAX_LAYERS - 1)
        states[layer] = _integer(entry["tokens"], what, f"states[{i}].tokens", 0, MAX_TOKENS)
    return states


def ids_limit(header: dict[str, Any], what: str) -> tuple[int, str]:
    """The most payload bytes the first record may have (:func:`check_header`), as a
    :data:`tierkv.persist.record.Limit`."""
    _, ids_bytes = check_header(header, what)
    return ids_bytes, f"its field 'ids_shape' {str(header['ids_shape'])[:80]} (batch x tokens x 8 bytes) allows"


def parse_header(header: dict[str, Any], payload: bytearray, what: str) -> Header:
    """The first record of a conversation file, every field checked (IntegrityError naming the field); its ids
    are a view of ``payload`` (int64, little-endian: no copy where that is the machine's order)."""
    checked, ids_bytes = check_header(header, what)
    shape = header["ids_shape"]
    if shape is None:
        if len(payload):
            raise IntegrityError(f"{what}: {len(payload)} bytes of token ids, but field 'ids_shape' is null.")
        return checked
    if len(payload) != ids_bytes:
        raise IntegrityError(f"{what}: {len(payload)} bytes of token ids, field 'ids_shape' {shape} needs "
                             f"{ids_bytes}.")
    ids = np.frombuffer(payload, dtype="<i8").reshape(shape[0], shape[1]).astype(np.int64, copy=False)
    return replace(checked, ids=ids)


class Reader:
    """Checks the records after the header, in order: ``take`` each; it returns the ``(layer, first, blocks)``
    of a K/V record, or None at the end record (after which the file must end). A K/V record must continue
    its layer where the last one stopped, stay within the layer's length, and have exactly the shape
    ``[batch, n, 2, H_kv, block_tokens, head_dim]`` of the header (and its namespace, if any), in one dtype
    per layer, of at most ``max(CHUNK_BYTES, one block column of the batch)`` (what :func:`records` writes) and
    at most ``budget`` bytes (what the cache can hold, if known). ``geometry``: each layer's ``(H_kv,
    head_dim)`` in the loading model's config, which every record must also have; ``dtype``: the K/V dtype of that
    model; ``states``: the dtype and shape after the batch of each state it keeps, by ``(layer, part, index)``.
    :meth:`limit` checks a record's header before its payload is read (a :data:`tierkv.persist.record.Limit`)."""

    def __init__(self, header: Header, what: str, geometry: Sequence[tuple[int, int]] | None = None,
                 budget: int | None = None, dtype: str | None = None,
                 states: dict[tuple[int, str, int], tuple[str, tuple[int, ...]]] | None = None) -> None:
        self.header, self.what = header, what
        self.heads_dims = geometry  # per layer (H_kv, D) of the model that loads the file, if known
        self.dtype, self.state_geometry = dtype, states
        self.budget = budget
        self.count = 1
        bt = header.block_tokens
        self.next_block = {layer.index: layer.dropped // bt for layer in header.layers}
        self.stop = {layer.index: -(-layer.length // bt) for layer in header.layers}
        ns = header.namespace
        self.geometry: dict[int, tuple[str, int, int]] = {}  # layer -> (dtype, H_kv, D) of its first record
        self.namespace = ns
        self.states_taken: set[tuple[int, str, int]] = set()
        self.state_bytes = 0

    def _expected(self, layer: int) -> tuple[str, int, int] | None:
        """(dtype, KV heads, head dim) the file's namespace gives ``layer`` (None: the file has no namespace)."""
        ns = self.namespace
        if ns is None:
            return None
        heads, dim = ns["shapes"][layer] if "shapes" in ns else (ns["kv_heads"], ns["head_dim"])
        return ns["dtype"], heads, dim

    def limit(self, header: dict[str, Any]) -> tuple[int, str]:
        """The payload bytes the next record's ``header`` allows (its checks, without taking it)."""
        if header.get("kind") == "end":
            return 0, "an end record carries no payload, it allows"
        if header.get("kind") == "state":
            dtype, shape = self._check_state(header)[3:]
            size = math.prod(shape) * getattr(torch, dtype).itemsize
            return size, f"its field 'record {self.count}.shape' {shape} of {dtype} allows"
        layer, _, dtype, shape = self._check(header)
        name = f"record {self.count}"
        itemsize = getattr(torch, dtype).itemsize
        column = shape[0] * math.prod(shape[2:]) * itemsize  # one block column of the whole batch
        size = math.prod(shape) * itemsize
        most = max(CHUNK_BYTES, column)
        if size > most:
            raise IntegrityError(f"{self.what}: field '{name}.shape' is {shape}: {size} bytes of layer {layer}'s K/V "
                                 f"in one record, more than the {most} a saved file's records hold (max of "
                                 f"{CHUNK_BYTES} and one block column, {column}); the file is damaged or crafted "
                                 "(refused before reading it). Save the conversation again.")
        if self.budget is not None and size > self.budget:
            raise IntegrityError(f"{self.what}: field '{name}.shape' is {shape}: {size} bytes of K/V in one record, "
                                 f"more than the {self.budget} bytes of the cache's budgets; the file is damaged or "
                                 "crafted (refused before reading it). Save the conversation again.")
        return size, f"its field '{name}.shape' {shape} of {dtype} allows"

    def _check(self, header: dict[str, Any]) -> tuple[int, int, str, list[int]]:
        """``(layer, first, dtype, shape)`` of the K/V record ``header``, every field checked; no state changes."""
        what = self.what
        if header.get("kind") != "kv" or set(header) != {"kind", "layer", "first", "dtype", "shape"}:
            raise IntegrityError(f"{what}: unexpected record {str(header)[:200]}.")
        name = f"record {self.count}"
        layer = _integer(header["layer"], what, f"{name}.layer", 0, len(self.header.layers) - 1)
        first = _integer(header["first"], what, f"{name}.first", 0, MAX_TOKENS)
        if self.next_block[layer] != first:
            raise IntegrityError(f"{what}: blocks of layer {layer} out of order (at {first}).")
        dtype = header["dtype"]
        if dtype not in KV_DTYPES:
            raise IntegrityError(f"{what}: field '{name}.dtype' is {str(dtype)[:40]!r}, not a K/V dtype.")
        shape = header["shape"]
        if not isinstance(shape, list) or len(shape) != 6:
            raise IntegrityError(f"{what}: field '{name}.shape' is not [batch, blocks, 2, kv_heads, block_tokens, "
                                 "head_dim].")
        bt = self.header.block_tokens
        _integer(shape[0], what, f"{name}.shape[0] (batch)", self.header.batch, self.header.batch)
        _integer(shape[1], what, f"{name}.shape[1] (blocks)", 1, self.stop[layer] - first)
        _integer(shape[2], what, f"{name}.shape[2] (K and V)", 2, 2)
        heads = _integer(shape[3], what, f"{name}.shape[3] (kv_heads)", 1, MAX_HEADS)
        _integer(shape[4], what, f"{name}.shape[4] (block_tokens)", bt, bt)
        dim = _integer(shape[5], what, f"{name}.shape[5] (head_dim)", 1, MAX_HEAD_DIM)
        geometry = self.geometry.get(layer, (dtype, heads, dim))
        expected = self._expected(layer)
        if geometry != (dtype, heads, dim) or (expected is not None and geometry != expected):
            raise IntegrityError(f"{what}: {name} of layer {layer} holds {dtype} K/V of {heads} heads of {dim}; the "
                                 f"file says {expected or geometry}.")
        if self.dtype is not None and dtype != self.dtype:
            raise IntegrityError(f"{what}: {name} of layer {layer} holds {dtype} K/V; the model computes "
                                 f"{self.dtype}. Load it with the model (and dtype) that saved it.")
        if self.heads_dims is not None and self.heads_dims[layer] != (heads, dim):
            model_heads, model_dim = self.heads_dims[layer]
            raise IntegrityError(f"{what}: {name} of layer {layer} holds K/V of {heads} heads of {dim}; the model's "
                                 f"config has {model_heads} heads of {model_dim} in that layer.")
        return layer, first, dtype, shape

    def _check_state(self, header: dict[str, Any]) -> tuple[int, str, int, str, list[int]]:
        """``(layer, part, index, dtype, shape)`` of the state record ``header``, every field checked: a layer the
        header lists, each state once, a float dtype, ``batch`` rows, and its bytes with every state record's
        before it within the cache's budgets (a sparse file claims what it likes: only its header can bound it)."""
        what, name = self.what, f"record {self.count}"
        if set(header) != {"kind", "layer", "part", "index", "dtype", "shape"}:
            raise IntegrityError(f"{what}: unexpected record {str(header)[:200]}.")
        states = self.header.states or {}
        layer = header["layer"]
        if type(layer) is not int or layer not in states:
            raise IntegrityError(f"{what}: field '{name}.layer' is {str(layer)[:40]!r}, not a layer the file says "
                                 f"keeps state ({sorted(states)[:20]}).")
        part = header["part"]
        if part not in STATE_PARTS:
            raise IntegrityError(f"{what}: field '{name}.part' is {str(part)[:40]!r}, not one of {STATE_PARTS}.")
        index = _integer(header["index"], what, f"{name}.index", 0, MAX_STATES - 1)
        if (layer, part, index) in self.states_taken:
            raise IntegrityError(f"{what}: {name} repeats the {part} state {index} of layer {layer}.")
        dtype = header["dtype"]
        if dtype not in KV_DTYPES:
            raise IntegrityError(f"{what}: field '{name}.dtype' is {str(dtype)[:40]!r}, not a state dtype.")
        shape = header["shape"]
        if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_STATE_DIMS:
            raise IntegrityError(f"{what}: field '{name}.shape' is not a list of 1 to {MAX_STATE_DIMS} sizes.")
        _integer(shape[0], what, f"{name}.shape[0] (batch)", self.header.batch, self.header.batch)
        for i, size in enumerate(shape[1:], 1):
            _integer(size, what, f"{name}.shape[{i}]", 1, MAX_TOKENS)
        expected = self.state_geometry.get((layer, part, index)) if self.state_geometry is not None else None
        if self.state_geometry is not None and (dtype, tuple(shape[1:])) != expected:
            made = f"{expected[0]} of shape {list(expected[1])} a row" if expected else "no such state"
            raise IntegrityError(f"{what}: {name} holds the {part} state {index} of layer {layer} as {dtype} of shape "
                                 f"{shape[1:]} a row; the model makes {made}. The file is damaged or crafted (refused "
                                 "before reading it).")
        size = math.prod(shape) * getattr(torch, dtype).itemsize
        if self.budget is not None and self.state_bytes + size > self.budget:
            raise IntegrityError(f"{what}: field '{name}.shape' is {shape}: with the state records before it, "
                                 f"{self.state_bytes + size} bytes of state, more than the {self.budget} bytes of the "
                                 "cache's budgets; the file is damaged or crafted (refused before reading it).")
        return layer, part, index, dtype, shape

    def take(self, header: dict[str, Any],
             payload: bytearray) -> tuple[int, int, torch.Tensor] | StatePart | None:  # fmt: skip
        what = self.what
        if header.get("kind") == "state":
            layer, part, index, dtype, shape = self._check_state(header)
            self.count += 1
            self.states_taken.add((layer, part, index))
            self.state_bytes += math.prod(shape) * getattr(torch, dtype).itemsize
            return StatePart(layer, part, index, record.tensor_from(payload, dtype, shape, what))
        if header.get("kind") == "end":
            if header.get("records") != self.count or set(header) != {"kind", "records"}:
                raise IntegrityError(f"{what}: {self.count} records before the end, it says {str(header)[:200]}.")
            if payload:
                raise IntegrityError(f"{what}: {len(payload)} payload bytes in the end record, which has none.")
            short = [index for index, stop in self.stop.items() if self.next_block[index] < stop]
            if short:
                raise IntegrityError(f"{what}: layers {short[:20]} are incomplete.")
            return None
        layer, first, dtype, shape = self._check(header)
        self.count += 1
        self.geometry.setdefault(layer, (dtype, shape[3], shape[5]))
        blocks = record.tensor_from(payload, dtype, shape, what)
        self.next_block[layer] = first + shape[1]
        return layer, first, blocks
