"""Save a cache's conversation to a file and load it back: one implementation behind the sync and async faces.

The file format, its checks and the atomic writes are :mod:`tierkv.persist.conversation`'s; this module maps a
:class:`~tierkv.hf.cache.TieredCache` to and from it. Loading is a :class:`Restore` fed one record at a time, so
:func:`load` (a file) and :func:`aload` (aiofiles) differ only in how they read a record. A loaded conversation
is private: its K/V is never written to the persistent or remote store (:mod:`tierkv.hf.session`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from tierkv.errors import BudgetTooSmallError, CapacityError, IntegrityError, InvalidConfigError
from tierkv.hf import sizing
from tierkv.hf.attention import cache_keyword
from tierkv.hf.layer import TieredLayer
from tierkv.hf.state import StateLayer
from tierkv.hf.turn import aturn, turn
from tierkv.persist import conversation
from tierkv.persist import record as records
from tierkv.persist.keys import kv_dtype, model_fingerprint
from tierkv.units import format_bytes

if TYPE_CHECKING:
    from tierkv.hf.cache import TieredCache


def save(cache: TieredCache, path: str | os.PathLike, model: torch.nn.Module | None) -> None:
    _check_model(model, "save")
    with turn(cache):
        conversation.save(path, _records(cache, model))


async def asave(cache: TieredCache, path: str | os.PathLike, model: torch.nn.Module | None) -> None:
    _check_model(model, "asave")
    _aiofiles()
    async with aturn(cache):
        await conversation.asave(path, _records(cache, model))


def load(cls: type[TieredCache], path: str | os.PathLike, model: torch.nn.Module | None,
         device: str | torch.device | None, options: dict[str, Any]) -> TieredCache:
    model = _required(model)
    _check_device(device)
    what = os.fspath(path)
    with conversation.open_file(path) as f, Restore(cls, model, device, options, what) as restore:
        restore.start(*records.read(f, what, restore.header_limit))
        while restore.take(*records.read(f, what, restore.record_limit)):
            pass
        return restore.finish(f.read(1))


async def aload(cls: type[TieredCache], path: str | os.PathLike, model: torch.nn.Module | None,
                device: str | torch.device | None, options: dict[str, Any]) -> TieredCache:
    model = _required(model)
    _check_device(device)
    aiofiles = _aiofiles()
    what = os.fspath(path)
    async with aiofiles.open(conversation.open_fd(path), "rb") as f:
        with Restore(cls, model, device, options, what) as restore:
            restore.start(*(await records.aread(f, what, restore.header_limit)))
            while restore.take(*(await records.aread(f, what, restore.record_limit))):
                pass
            return restore.finish(await f.read(1))


def _required(model: torch.nn.Module | None) -> torch.nn.Module:
    """``model``, which loading requires: a file's K/V is only right for the model that computed it, and only
    ``model=`` lets the fingerprint, layer count and K/V geometry be checked before any is used."""
    if model is None:
        raise InvalidConfigError("load() needs the model that will decode the conversation, so that a file of "
                                 "another model (or one that does not fit it) is refused instead of decoded into "
                                 "wrong output: TieredCache.load(path, model=model).")
    _check_model(model, "load")
    return model


def _check_model(model: object, call: str) -> None:
    """Refuse a ``model=`` that is not a torch module (its weights are the file's fingerprint): a config or a
    name is the usual slip."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise InvalidConfigError(f"{call}() takes model= as the torch model itself (its weights identify the "
                                 f"conversation's K/V), got {type(model).__name__}: pass the model, e.g. "
                                 f"cache.{call.removeprefix('a')}(path, model).")


def _check_device(device: object) -> None:
    """Refuse a ``device=`` that names no device the K/V could be held on, before the file is opened."""
    if device is None:
        return
    try:
        kind = torch.device(device).type  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError):
        kind = None
    if kind is None or kind == "meta":
        raise InvalidConfigError(f"load() takes device= as a device the K/V is held on ('cpu', 'cuda', 'cuda:1' or a "
                                 f"torch.device; None: the model's), got {device!r}.")
    if kind == "cuda":  # a CUDA build of torch parses 5 as cuda:5 on any host
        index, count = torch.device(device).index or 0, torch.cuda.device_count()  # type: ignore[call-overload]
        if index >= count:
            raise InvalidConfigError(f"load() takes device= as a device the K/V is held on, got {device!r}, but this "
                                     f"torch sees {count} CUDA GPU{'' if count == 1 else 's'}: give a GPU it sees, "
                                     "'cpu', or None (the model's device).")


def _layer_kinds(model: torch.nn.Module) -> list[sizing.LayerKind | None]:
    """Each layer's kind in ``model``'s config (none without a config)."""
    config = getattr(model, "config", None)
    return sizing.layer_kinds(config) if config is not None else []


def _fits_model(header: conversation.Header, model: torch.nn.Module, what: str) -> list[tuple[int, int]] | None:
    """Check the header's layers against ``model``'s config before anything is allocated: the same layer count, a
    sliding window only where the model has that window (a length is backed by the file's K/V records, which the
    reader checks; a conversation may outgrow ``max_position_embeddings``). The fingerprint already matched, so a
    difference means a damaged or crafted file (IntegrityError). Returns each layer's (kv_heads, head_dim) for the
    K/V records to match (None: the model has no config)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    windows = sizing.layer_windows(config)
    problems = [f"it holds {len(header.layers)} layers, the model {len(windows)} that hold K/V"] \
        if len(windows) != len(header.layers) else []
    problems += [f"layer {saved.index}'s sliding window is {saved.sliding_window}, the model's {window}"
                 for saved, window in zip(header.layers, windows)
                 if saved.sliding_window not in (None, window)]  # None: a cache without config= keeps every token
    if problems:
        raise IntegrityError(f"{what}: {'; '.join(problems[:3])}, although the file names this model: it is "
                             "damaged or was not written by tierkv. Save the conversation again.")
    return [(layout.kv_heads, layout.head_dim)
            for layout in sizing.layer_layouts(config, header.block_tokens, None)]


def _kv_claim(header: conversation.Header, model: torch.nn.Module) -> tuple[int, int] | None:
    """The K/V bytes the header says its layers hold (``length - dropped`` tokens of every row, at the model's
    per-token K/V bytes of each layer, in the file's dtype, else the model's), and the bytes of one block of every
    layer for the whole batch (the open blocks the device tier holds while the cache decodes; a record carries
    one such block column whole); None if the model has no config."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    dtype = getattr(torch, header.namespace["dtype"]) if header.namespace is not None else kv_dtype(model)
    layouts = sizing.layer_layouts(config, header.block_tokens, dtype)
    held = sum((layer.length - layer.dropped) * header.batch * layout.token_bytes
               for layer, layout in zip(header.layers, layouts))
    return held, header.batch * sum(layout.block_bytes for _, layout in zip(header.layers, layouts))


def _state_geometry(model: torch.nn.Module) -> dict[tuple[int, str, int], tuple[str, tuple[int, ...]]]:
    """The dtype and shape after the batch of every state ``model`` keeps, by ``(layer, conv / recurrent,
    index)``, as the model makes them: one token through a ``DynamicCache`` of its config (each family sizes its
    state from fields of its own), so that a file's state records are checked before any is read."""
    from transformers import DynamicCache

    config: Any = getattr(model, "config", None)
    probe = DynamicCache(config=config)
    token = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    with torch.inference_mode():  # by the keyword the model takes (Mamba models ignore past_key_values= now)
        model(input_ids=token, use_cache=True, **{cache_keyword(model): probe})
    return {(index, part, i): (str(state.dtype).removeprefix("torch."), tuple(state.shape[1:]))
            for index, layer in enumerate(probe.layers)
            for part, states in (("conv", getattr(layer, "conv_states", {})),
                                 ("recurrent", getattr(layer, "recurrent_states", {})))
            for i, state in states.items() if state is not None}


class Restore:
    """A cache being filled from a conversation's records. :meth:`header_limit` checks the header record
    before its payload (the token ids) is read: its fields, the model, and that the K/V it claims fits the
    budgets of the cache it builds; :meth:`start` takes the header record, :meth:`take` each K/V record
    (:meth:`record_limit` checks its header first), :meth:`finish` checks the end. Used as a context manager, it
    closes the cache on any error (the disk tier's files go with it)."""

    def __init__(self, cls: type[TieredCache], model: torch.nn.Module, device: str | torch.device | None,
                 options: dict[str, Any], what: str) -> None:
        self.cls, self.model, self.options, self.what = cls, model, options, what
        self.device = torch.device(device if device is not None else next(model.parameters()).device)
        self.cache: TieredCache | None = None
        self.header: conversation.Header | None = None
        self.reader: conversation.Reader | None = None
        self.budget = 0
        self.states: dict[int, dict[tuple[str, int], torch.Tensor]] = {}  # model layer -> its state records
        self.state_kinds: dict[int, sizing.LayerKind] = {}  # model layer -> its kind, of those that keep state
        self.made: dict[tuple[int, str, int], Any] | None = None  # the states the model makes (_state_geometry)

    def __enter__(self) -> Restore:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None and self.cache is not None:
            self.cache.close()

    def header_limit(self, head: dict[str, Any]) -> tuple[int, str]:
        """Check the header record's fields and the model, build the cache and check that the K/V the header
        claims fits its budgets — all before the ids are read; the ids payload bytes the header allows."""
        what, model, options = self.what, self.model, self.options
        header, _ = conversation.check_header(head, what)
        if options.setdefault("block_tokens", header.block_tokens) != header.block_tokens:
            raise InvalidConfigError(f"{what} was saved with block_tokens={header.block_tokens}; load it with the "
                                     "same (or leave block_tokens out).")
        if model_fingerprint(model) != header.fingerprint:
            raise InvalidConfigError(f"{what} was saved from another model (weights or config differ); load it "
                                     "with the model that produced it.")
        geometry = _fits_model(header, model, what)
        kinds = _layer_kinds(model)
        self.state_kinds = {i: kind for i, kind in enumerate(kinds) if kind is not None and kind.states}
        if set(self.state_kinds) != set(header.states or {}):
            raise IntegrityError(f"{what}: the file says layers {sorted(header.states or {})[:20]} keep recurrent "
                                 f"state, the model's config {sorted(self.state_kinds)[:20]}; the file is damaged or "
                                 "crafted.")
        if any(kind is None or kind.states or not kind.kv for kind in kinds):
            options.setdefault("config", model.config)  # layers of other kinds than K/V alone: each built as its kind
        self.cache = cache = self.cls(**options)  # closed by __exit__ on any refusal
        windows = [layer.sliding_window for layer in header.layers]
        built = [layer.sliding_window for layer in cache.kv_layers]
        if cache.runtime.num_layers is not None and built != windows:
            if not any(windows) and options.get("config") == getattr(model, "config", None):
                raise InvalidConfigError(f"{what} was saved from a cache built without config= (its sliding-window "
                                         f"layers keep every token); load it without config= too (config= gives "
                                         f"them windows {built}).")
            raise InvalidConfigError(f"{what} holds {len(windows)} layers with sliding windows {windows}; the "
                                     "config= given describes other layers. Pass the model's own config, or none.")
        # the tiers' budgets on the device (those left out: the shares of free memory or disk the store takes)
        device_budget, host_budget = cache.runtime.memory_budgets(self.device)
        disk = cache.runtime.disk
        self.budget = budget = device_budget + host_budget + (disk.budget if disk is not None else 0)
        claim, open_blocks = _kv_claim(header, model) or (None, None)
        if claim is not None and claim > budget:
            rows = (f" The file holds each of its {header.batch} rows' K/V on its own, so rows that shared blocks when "
                    "it was saved (beams, num_return_sequences, batch_repeat_interleave over one prompt) take "
                    f"{header.batch}x their tokens here." if header.batch > 1 else "")
            raise CapacityError(f"{what} holds {format_bytes(claim)} of K/V ({claim} bytes), more than the "
                                f"{format_bytes(budget)} ({budget} bytes) of the cache's budgets (gpu_gb + cpu_gb + "
                                "disk_gb): raise the budgets, e.g. TieredCache.load(path, model=model, cpu_gb=..., "
                                f"disk_dir=..., disk_gb=...). Nothing of the file was loaded.{rows}")
        if open_blocks is not None and open_blocks > device_budget:  # (before a record of one whole block is read)
            raise BudgetTooSmallError(
                f"{what} was saved with block_tokens={header.block_tokens} for {header.batch} rows: one block of "
                f"every layer (those the device holds while decoding) takes {format_bytes(open_blocks)}, more than "
                f"the device budget's {format_bytes(device_budget)}: raise gpu_gb (TieredCache.min_device_bytes "
                "gives the least that decodes), or the file is damaged or crafted. Nothing of the file was loaded.")
        states = self.made = _state_geometry(model) if self.state_kinds else None
        self.reader = conversation.Reader(header, what, geometry, budget, str(kv_dtype(model)).removeprefix("torch."),
                                          states)
        return conversation.ids_limit(head, what)

    def start(self, head: dict[str, Any], payload: bytearray) -> None:
        """Take the header record (checked by :meth:`header_limit` before its payload was read)."""
        if self.cache is None or self.reader is None:
            self.header_limit(head)
        assert self.cache is not None and self.reader is not None
        self.header = header = conversation.parse_header(head, payload, self.what)
        self.reader.header = header
        if not self.cache.mixed:
            self.cache.set_layers([layer.sliding_window for layer in header.layers])

    def record_limit(self, head: dict[str, Any]) -> tuple[int, str]:
        """The payload bytes the next record's header allows (:meth:`tierkv.persist.conversation.Reader.limit`)."""
        assert self.reader is not None, "start() takes the header record first"
        return self.reader.limit(head)

    def take(self, head: dict[str, Any], payload: bytearray) -> bool:
        """Append one K/V record's blocks; False at the end record."""
        assert self.cache is not None and self.reader is not None and self.header is not None
        with self.cache.using:  # its tensors normal ones under the caller's inference mode too (as in every call)
            chunk = self.reader.take(head, payload)
            if chunk is None:
                return False
            if isinstance(chunk, conversation.StatePart):
                self.states.setdefault(chunk.layer, {})[chunk.part, chunk.index] = chunk.tensor
                return True
            index, first, blocks = chunk  # blocks: [B, n, 2, H, bt, D]
            bt = self.header.block_tokens
            end = min((first + blocks.shape[1]) * bt, self.header.layers[index].length) - first * bt  # its tokens
            kv = blocks.permute(2, 0, 3, 1, 4, 5).flatten(3, 4)[:, :, :, :end].to(self.device)  # [2, B, H, n, D]
            self.cache.kv_layers[index].load(kv[0], kv[1], first)
        return True

    def finish(self, trailing: bytes) -> TieredCache:
        """Set what the K/V records do not carry and check every layer's length against the header."""
        if trailing:
            raise IntegrityError(f"{self.what}: data after the end record.")
        cache, header = self.cache, self.header
        assert cache is not None and header is not None
        config = getattr(self.model, "config", None)
        widths = sizing.layer_kv_widths(config) if config is not None else {}
        for saved, layer in zip(header.layers, cache.kv_layers):
            layer.dropped = saved.dropped
            # keys and values of two head dims (latent attention) are read back at their own
            layer.widths = widths.get(layer.index)
            if TieredLayer.get_seq_length(layer) != saved.length:
                raise IntegrityError(f"layer {saved.index} holds {layer.get_seq_length()} tokens after loading, "
                                     f"the file says {saved.length}.")
        with cache.using:
            self._restore_states(cache, header)
        if cache.session is not None:
            cache.session.loaded_from_file()  # its K/V is the file's: never persisted under the ids it claims
        return cache

    def _restore_states(self, cache: TieredCache, header: conversation.Header) -> None:
        """Give each layer that keeps recurrent state the states the file holds for it: every one its kind keeps
        (a convolution state per pair, and a recurrent one unless it is a convolution layer), after as many
        tokens as the K/V layers hold — else the model would decode on from a state it never had."""
        if header.states is None:
            return
        tokens = max(header.states.values())  # as many as every layer's (conversation.check_header)
        for layer in cache.layers:
            if not isinstance(layer, StateLayer):
                continue
            assert self.made is not None
            # what the model makes, not what its layer kind suggests (Inkling 2's hybrid layers: convolutions only)
            needed = {(part, i) for position, part, i in self.made if position == layer.position}
            parts = self.states.get(layer.position, {})
            if set(parts) != needed:
                raise IntegrityError(f"{self.what}: layer {layer.position} keeps {sorted(needed)} state, the file "
                                     f"holds {sorted(parts)}; it is damaged or crafted. Save the conversation again.")
            layer.restore(parts, tokens, self.device)


def _records(cache: TieredCache, model: torch.nn.Module | None) -> Iterator[tuple[bytes, memoryview]]:
    """The conversation's records, each made under the cache's guard: a ``close()`` (or a forward) from another
    thread lands between two records, and a close stops the save with a clear error (the file is not replaced)."""
    with cache.using:
        records = _unguarded_records(cache, model)
        return _guarded(cache, records, _held(cache))  # what the header counts, taken with it under the guard


def _guarded(cache: TieredCache, records: Iterator[tuple[bytes, memoryview]],
             held: tuple[int, int, list[tuple[int, int]]]) -> Iterator[tuple[bytes, memoryview]]:
    while True:
        with cache.using:
            if cache.closed:
                raise InvalidConfigError("this TieredCache was closed while it was being saved; the file was not "
                                         "written (one saved before at that path is kept). Save before close().")
            if _held(cache) != held:
                raise InvalidConfigError("this TieredCache changed while it was being saved (a forward, a crop, a "
                                         "reorder of its rows: on another thread, or while an asave was pending); "
                                         "the file was not written (one saved before at that path is kept). Save "
                                         "between forwards, and await asave before the cache's next use.")
            record = next(records, None)
        if record is None:
            return
        yield record


def _held(cache: TieredCache) -> tuple[int, int, list[tuple[int, int]]]:
    """What any forward or edit changes: the count of forwards begun and edits (a crop, a row selection or
    reorder, a reset), the layers the current forward updated, each K/V layer's tokens and the front tokens its
    window freed."""
    return cache.edits, cache.forward.layers_updated, [(TieredLayer.get_seq_length(layer), layer.dropped)
                                                       for layer in cache.kv_layers]


def _unguarded_records(cache: TieredCache, model: torch.nn.Module | None) -> Iterator[tuple[bytes, memoryview]]:
    if cache.closed:
        raise InvalidConfigError("this TieredCache was closed (its tiers are released); save before close().")
    cache.settle_stopped()  # a forward stopped part-way (a Ctrl-C in generate): save what its layers all hold
    if cache.state_in_model:
        raise InvalidConfigError(
            "this model keeps its recurrent layers' state in its own modules, not in the cache (RecurrentGemma): a "
            "saved conversation would hold the attention K/V without that state, and continue from the wrong one. "
            "Keep the model and cache in one process instead.")
    store = cache.runtime.store
    if (store is None and not cache.stateful) or not cache.get_seq_length():
        raise InvalidConfigError("this cache holds no tokens yet; save it after a forward pass or generate().")
    session = cache.session
    namespace = session.namespace if session is not None else None
    fingerprint = model_fingerprint(model) if model is not None else namespace.fingerprint if namespace else None
    layers = tuple(conversation.LayerState(layer.index, layer.sliding_window, layer.dropped,
                                           TieredLayer.get_seq_length(layer)) for layer in cache.kv_layers)
    ids = session.ids if session is not None else None
    if ids is not None:  # ids of tokens about to be appended (load_prefix of the next turn) are not held yet
        ids = ids[:, : max(layer.length for layer in layers)]
    held = [layer for layer in cache.layers if isinstance(layer, StateLayer)]
    states = {layer.position: layer.tokens() for layer in held} if held else None
    header = conversation.Header(cache.block_tokens, cache.batch_size, layers, ids,
                                 namespace.to_dict() if namespace is not None else None, fingerprint, states)
    return conversation.records(store, header, [conversation.StatePart(layer.position, *part)
                                                for layer in held for part in layer.parts()])


def _aiofiles() -> Any:
    try:
        import aiofiles
    except ImportError:
        raise InvalidConfigError("asave/aload need aiofiles: pip install 'tierkv[aio]' (or pip install aiofiles); "
                                 "save/load work without it.") from None
    return aiofiles
