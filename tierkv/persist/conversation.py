"""A conversation on disk: a cache's K/V, token ids and per-layer state as one file of checksummed records.

::

    record "conversation"  header: format, block_tokens, batch, layers [{index, sliding_window, dropped,
                           length}], namespace, fingerprint, ids_shape    payload: the token ids (<i8), if known
    record "kv" ...        header: layer, first (block index), dtype, shape [B, n, 2, H_kv, bt, D]
                           payload: those blocks (a layer's partial tail block zero-padded)
    record "end"           header: records (the count before it) — a file cut at a record boundary is caught

Each layer is written in chunks of at most ``CHUNK_BYTES``, so saving and loading hold one chunk at a time
outside the tiers. Records are written to ``<path>.tmp``, fsynced and renamed over ``path``: a crash
while saving leaves the previous file intact.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierkv.errors import IntegrityError
from tierkv.persist import record
from tierkv.persist.manifest import fsync_directory
from tierkv.store import KVStore

FORMAT = 1
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class LayerState:
    """One layer as the adapter sees it: its window, the tokens freed from its front, its total length."""

    index: int
    sliding_window: int | None
    dropped: int
    length: int


@dataclass(frozen=True, slots=True)
class Header:
    block_tokens: int
    batch: int
    layers: tuple[LayerState, ...]
    ids: np.ndarray | None  # [B, T]
    namespace: dict[str, Any] | None
    fingerprint: str | None


def records(kv: KVStore, header: Header) -> Iterator[tuple[bytes, memoryview]]:
    """The records of ``header`` and of every layer's blocks (read from ``kv`` one chunk at a time)."""
    ids = header.ids if header.ids is not None else np.zeros((0, 0), dtype="<i8")
    yield record.encode({"kind": "conversation", "format": FORMAT, "block_tokens": header.block_tokens,
                         "batch": header.batch, "layers": [_layer_dict(layer) for layer in header.layers],
                         "namespace": header.namespace, "fingerprint": header.fingerprint,
                         "ids_shape": list(ids.shape) if header.ids is not None else None},
                        np.ascontiguousarray(ids, dtype="<i8").tobytes())
    count = 1
    bt = header.block_tokens
    for layer in header.layers:
        first, stop = layer.dropped // bt, -(-layer.length // bt)
        if stop <= first:
            continue
        layout = kv.layouts[layer.index]
        step = max(1, CHUNK_BYTES // (header.batch * layout.block_bytes))
        for start in range(first, stop, step):
            blocks = kv.export_blocks(layer.index, start, min(start + step, stop))  # [B, n, 2, H, bt, D]
            yield record.encode({"kind": "kv", "layer": layer.index, "first": start,
                                 "dtype": str(blocks.dtype).removeprefix("torch."), "shape": list(blocks.shape)},
                                record.tensor_bytes(blocks))
            count += 1
    yield record.encode({"kind": "end", "records": count}, b"")


def _layer_dict(layer: LayerState) -> dict[str, Any]:
    return {"index": layer.index, "sliding_window": layer.sliding_window, "dropped": layer.dropped,
            "length": layer.length}


def parse_header(header: dict[str, Any], payload: bytearray, what: str) -> Header:
    if header.get("kind") != "conversation" or header.get("format") != FORMAT:
        raise IntegrityError(f"{what}: not a tierkv conversation of format {FORMAT} (first record: {header}).")
    shape = header.get("ids_shape")
    ids = np.frombuffer(bytes(payload), dtype="<i8").reshape(shape).astype(np.int64) if shape is not None else None
    layers = tuple(LayerState(int(d["index"]), d["sliding_window"], int(d["dropped"]), int(d["length"]))
                   for d in header["layers"])
    return Header(int(header["block_tokens"]), int(header["batch"]), layers, ids, header.get("namespace"),
                  header.get("fingerprint"))


class Reader:
    """Checks the records after the header, in order: ``take`` each; it returns the ``(layer, first, blocks)``
    of a K/V record, or None at the end record (after which the file must end)."""

    def __init__(self, header: Header, what: str) -> None:
        self.header, self.what = header, what
        self.count = 1
        self.next_block = {layer.index: layer.dropped // header.block_tokens for layer in header.layers}

    def take(self, header: dict[str, Any], payload: bytearray) -> tuple[int, int, torch.Tensor] | None:
        kind = header.get("kind")
        if kind == "end":
            if header.get("records") != self.count:
                raise IntegrityError(f"{self.what}: {self.count} records before the end, it says {header}.")
            bt = self.header.block_tokens
            short = [layer.index for layer in self.header.layers
                     if self.next_block[layer.index] < -(-layer.length // bt)]
            if short:
                raise IntegrityError(f"{self.what}: layers {short} are incomplete.")
            return None
        if kind != "kv":
            raise IntegrityError(f"{self.what}: unexpected record {header}.")
        self.count += 1
        layer, first = int(header["layer"]), int(header["first"])
        if self.next_block.get(layer) != first:
            raise IntegrityError(f"{self.what}: blocks of layer {layer} out of order (at {first}).")
        blocks = record.tensor_from(payload, header["dtype"], header["shape"], self.what)
        self.next_block[layer] = first + blocks.shape[1]
        return layer, first, blocks


def temporary(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def finish(path: Path) -> None:
    """Rename the fsynced ``<path>.tmp`` over ``path`` and make the rename durable."""
    os.replace(temporary(path), path)
    fsync_directory(path.parent)
