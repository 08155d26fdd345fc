"""Prefix persistence of one cache: which token ids it holds, which of its full blocks are persisted, and
``load_prefix`` — over the local persistent blocks (``persist=True``), a Redis server (``remote=``), or both.

A conversation loaded from a file (:meth:`TieredCache.load`) is *private*: its K/V came from the file, not from
this process's forward passes, so neither it nor anything computed on top of it is written to the shared
stores under the token ids the file claims (a crafted file would otherwise serve its K/V to other prompts).

A block is keyed by its token ids, so it is stored and served only where its K/V depends on the ids and their
positions alone. Two things a forward's inputs can add to that: an attention mask that masks a token (left padding:
every later token's K/V then differs, positions shift too), and a rotary embedding whose frequencies depend on the
forward's length (dynamic NTK, LongRoPE: a forward that reaches the model's original length rescales every
position). A forward pre-hook on the model given to ``load_prefix`` (:class:`ForwardWatch`) sees each forward's
inputs: tokens after the first masked one, those computed by a forward past that length, with other positions, from
embeddings, with any module in training mode, another config or attention implementation than at ``load_prefix``,
or inputs it cannot check (``token_type_ids``, images) are never persisted, nor are ids other than the ones the
forward computed (its ``input_ids`` are compared with the ids ``load_prefix`` was given, and those it computes past
them — generated tokens — are recorded, so the next turn's ids must repeat them). Inputs are checked by name,
passed positionally or by keyword. A forward that grows the cache by another count than its ids (peft's prompt
tuning prepends virtual tokens; prefix tuning attends a cache of its own) persists nothing from its start (their
on/off state is part of the fingerprint); one that grew it over K/V loaded from the store is refused, and this cache's
``load_prefix`` loads nothing for that model from then on. While the model has forward hooks of the user's
(:func:`~tierkv.persist.keys.user_hooks`: a steering vector, rewritten inputs), nothing is loaded or persisted.
Nor is a token decoded with sparse attention, or any after it (the layer sees the approximate executor): its K/V,
and every later token's, is not what full attention computes. A forward the hook did not see (another module, the
cache passed positionally) is not persisted either. A forward that would mix masked tokens or rescaled positions
with K/V loaded from the store is refused before it runs (nothing changes). ``load_prefix(..., attention_mask=)``
loads only what the mask leaves untouched, and nothing for a prompt past that length.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
import torch

from tierkv.atomic import deferred_interrupts
from tierkv.errors import InvalidConfigError
from tierkv.hf import sizing
from tierkv.hf.attention import own_implementation
from tierkv.persist import record
from tierkv.persist.blockfile import PersistentStore
from tierkv.persist.keys import (
    Namespace,
    model_fingerprint,
    prompt_learning,
    tensor_state,
    user_hooks,
    weights_sample,
)
from tierkv.persist.prefix import PrefixPersistence
from tierkv.units import format_bytes, parse_size

if TYPE_CHECKING:
    from tierkv.hf.cache import TieredCache
    from tierkv.remote.chain import ChainedBlockStore
    from tierkv.tiers.disk import DiskTier

log = logging.getLogger("tierkv")

DEFAULT_PERSIST_FRACTION = 0.1  # of free space under disk_dir, when persist=True and persist_gb is None


class PrefixSession:
    """The ids and persisted blocks of the sequence a cache holds (``persist=True`` and/or ``remote=``)."""

    def __init__(self, disk_dir: str | os.PathLike | None, persist: bool, persist_gb: float | str | None,
                 remote: str | None, block_tokens: int) -> None:
        local = None
        self.remote: ChainedBlockStore | None = None
        self.capacity_from = "persist_gb"  # what set the local store's capacity (named when it is too small)
        if persist:
            if disk_dir is None:
                raise InvalidConfigError("persist=True keeps blocks in disk_dir; pass disk_dir='/path/on/nvme'.")
            if persist_gb is not None:
                capacity = parse_size(persist_gb, name="persist_gb")
                if not capacity:
                    raise InvalidConfigError(f"persist_gb={persist_gb!r} keeps no block: give the persistent store's "
                                             "size (e.g. persist_gb=10, in GB), or leave persist=True out.")
            else:
                capacity, self.capacity_from = default_capacity(disk_dir)
            local = PersistentStore(disk_dir, capacity)
        self.local = local
        if remote is not None:
            from tierkv.remote.chain import ChainedBlockStore  # imports redis-py only when asked for

            try:
                self.remote = ChainedBlockStore(local, remote)
            except BaseException:
                if local is not None:
                    local.close()
                raise
        store = self.remote or local
        if store is None:
            raise InvalidConfigError("a prefix session needs persist=True (with disk_dir) or remote=.")
        self.prefix = PrefixPersistence(store, block_tokens)
        self.block_tokens = block_tokens
        self.private = False  # a conversation from a file: nothing of it is persisted
        self.clean: int | None = None  # tokens from the start whose K/V depends on ids and positions alone
        self.loaded = 0  # tokens of this sequence loaded from the store
        self.watches: dict[int, ForwardWatch] = {}  # id(model) -> its hook
        self.computed: list[np.ndarray] = []  # ids forwards computed past the known ids, in order: [rows, n] each
        self.recorded = 0  # tokens in them (a count kept, not summed: one chunk a decode step)
        self.announced: int | None = None  # the length at which the forward the hook checked last begins
        # the model load_prefix was given (weakly), its tensors' state then and how it computed (:func:`setup`):
        # blocks are persisted only while the weights are those its namespace was computed of
        self.source: tuple[weakref.ref[torch.nn.Module], tuple, torch.Tensor, tuple[str, str]] | None = None

    @property
    def ids(self) -> np.ndarray | None:
        return self.prefix.ids

    @property
    def namespace(self) -> Namespace | None:
        return self.prefix.namespace

    def load(self, cache: TieredCache, model: torch.nn.Module, input_ids: torch.Tensor | Sequence[int],
             attention_mask: torch.Tensor | None = None) -> int:
        """:meth:`TieredCache.load_prefix` (see there)."""
        ids = token_ids(input_ids)
        if attention_mask is not None and tuple(np.shape(attention_mask)) != ids.shape:
            raise InvalidConfigError(f"attention_mask has shape {tuple(np.shape(attention_mask))}, the ids "
                                     f"{ids.shape}: pass the mask of these ids (the one generate() gets).")
        unmasked = first_masked(None if attention_mask is None else torch.as_tensor(attention_mask))
        held = cache.get_seq_length()
        if held:
            batch = cache.batch_size
            if ids.shape[1] <= held or (cache.runtime.store is not None and ids.shape[0] != batch):
                raise InvalidConfigError(
                    f"the cache holds {held} tokens of {batch} rows; load_prefix needs the same rows with at least "
                    f"one new token, got ids of shape {tuple(ids.shape)}. Call cache.reset() for a new prompt.")
            if not self.private:
                self.check_computed(ids, held)
                self.prefix.extend(ids, held)
                self._record([])
                self.narrow(unmasked, "load_prefix's attention_mask")
            return held
        config = getattr(model, "config", None)  # (of_model refuses a model without one)
        namespace = Namespace.of_model(model, self.block_tokens, attention=own_implementation(model),
                                       shapes=sizing.kv_shapes(config) if config is not None else ())
        if cache.runtime.num_layers is not None and len(cache.layers) != namespace.layers:
            raise InvalidConfigError(f"the model has {namespace.layers} layers but this cache was built for "
                                     f"{len(cache.layers)} (config=); pass that model's config.")
        self.check_capacity(namespace)
        self.leave_room(cache.runtime.disk)
        watch = self.watches.get(id(model))
        if watch is None or watch.model() is not model:
            watch = self.watches[id(model)] = ForwardWatch(self, cache, model)
        self.private, self.loaded, self.clean = False, 0, unmasked
        self._record([])
        self.source = (weakref.ref(model), tensor_state(model), weights_sample(model), setup(model))
        self.prefix.start(namespace, ids)
        if self.remote is not None:
            self.remote.bind(namespace)
        most = unmasked
        if watch.rope_limit is not None and ids.shape[1] >= watch.rope_limit:
            most = 0  # the prompt's forward rescales every position: nothing stored was computed so
        if watch.hooked(model) or watch.grew_otherwise:
            most = 0  # its K/V is not of the ids alone
        blocks, kv = self.prefix.load(most)
        if blocks:
            _import(cache, kv, next(model.parameters()).device)
        self.loaded = blocks * self.block_tokens
        return self.loaded

    def check_capacity(self, namespace: Namespace) -> None:
        """Refuse a local store that cannot hold one block record of ``namespace``: it would write every block and
        drop it at once, persisting nothing."""
        local = self.local
        if local is None:
            return
        need = record.block_bytes(namespace)
        if local.capacity_bytes < need:
            raise InvalidConfigError(
                f"persist=True can keep nothing: one block record of this model takes {format_bytes(need)} but the "
                f"persistent store's capacity ({self.capacity_from}) is {format_bytes(local.capacity_bytes)}. Pass "
                f"persist_gb=\"{need}B\" or more (each block's record takes about as much), or free space under "
                "disk_dir.")

    def leave_room(self, disk: DiskTier | None) -> None:
        """Make the local store's writer keep the free space the disk tier ``disk`` has yet to reserve, where both
        are on one filesystem: persistence is a copy, and must never make decoding meet a full disk."""
        local = self.local
        if local is None or disk is None:
            return
        try:
            shared = os.stat(disk.directory).st_dev == os.stat(local.root).st_dev
        except OSError:
            shared = True  # cannot tell: keep the room
        local.keep_free = unreserved(weakref.ref(disk)) if shared else None

    def narrow(self, clean: int | None, why: str) -> None:
        """Only the first ``clean`` tokens (None: all) depend on ids and positions alone (``why``: what says so):
        nothing after them is persisted; refused before anything changes if the store's K/V is among them."""
        if clean is None:
            return
        if clean < self.loaded:
            raise InvalidConfigError(
                f"the first {self.loaded} tokens of this cache were loaded from the prefix store, computed with "
                f"every token attended at its own position, but {why} masks token {clean}, so the model's K/V of "
                "them differs. Pass load_prefix the attention_mask the forward gets (it then loads only the tokens "
                "before any masked one), or call cache.reset() and run the prompt without load_prefix.")
        self.clean = clean if self.clean is None else min(self.clean, clean)

    def check_computed(self, ids: np.ndarray, held: int) -> None:
        """The next turn's ``ids`` must repeat the tokens the cache computed past the ids it knew (generated):
        their K/V is of those tokens, whatever ids a caller claims."""
        known = self.prefix.ids
        if known is None or not self.computed:
            return
        computed = np.concatenate(self.computed, axis=1)[:, : max(0, held - known.shape[1])]
        start, stop = known.shape[1], known.shape[1] + computed.shape[1]
        if ids.shape[0] != computed.shape[0] or ids.shape[1] < stop or \
                not np.array_equal(ids[:, start:stop], computed):
            raise InvalidConfigError(
                "these ids do not start with the tokens this cache holds: tokens "
                f"{start}-{stop - 1} differ from the ones it computed (generated); pass the whole conversation so "
                "far (the previous ids, the generated tokens, then the new ones), or call cache.reset() first.")

    def observe(self, ids: np.ndarray, held: int) -> None:
        """A checked forward computes ``ids`` ``[rows, n]`` after ``held`` tokens: where they are not the known ids,
        nothing from ``held`` on is persisted; past the known ids they are recorded (:meth:`check_computed`)."""
        known = self.prefix.ids
        assert known is not None
        stop = held + ids.shape[1]
        overlap = max(0, min(known.shape[1], stop) - held)
        if ids.shape[0] != known.shape[0] or not np.array_equal(known[:, held:held + overlap], ids[:, :overlap]) \
                or (stop > known.shape[1] and max(held, known.shape[1]) != known.shape[1] + self.recorded):
            self.narrow(held, "this forward's input_ids")  # other ids, other rows, or a forward not seen between
            return
        if stop > known.shape[1]:
            self.computed.append(ids[:, overlap:].copy())
            self.recorded += ids.shape[1] - overlap
        self.announced = held

    def match_rows(self, rows: int, held: int) -> None:
        """A forward of ``rows`` rows: ``generate`` repeating each row (``num_return_sequences``, beams) before its
        first forward repeats the known ids' rows alike; other rows than the ids' persist nothing. A cache that holds
        tokens refuses a forward of other rows than its own, which then changes nothing here either."""
        known = self.prefix.ids
        assert known is not None
        if rows == known.shape[0] or held:
            return
        if rows % known.shape[0] == 0:
            repeats = rows // known.shape[0]
            self.select_rows([row for row in range(known.shape[0]) for _ in range(repeats)])
            return
        self.prefix.reset()  # rows the ids do not describe: this sequence is not persisted
        self._record([])

    def began(self, held: int) -> None:
        """A forward begins at ``held`` tokens: unless the hook checked it, nothing it computes is persisted."""
        if self.announced != held and self.prefix.ids is not None and not self.private:
            if self.clean is None or self.clean > held:
                log.info("tierkv: a forward with this cache did not go through the model given to load_prefix "
                         "(another module, or the cache passed positionally): from token %d nothing is persisted",
                         held)
            self.narrow(held, "a forward load_prefix's model did not run")
        self.announced = None

    def loaded_from_file(self) -> None:
        """The cache now holds a conversation read from a file: it is private (module docstring)."""
        self.prefix.reset()
        self.private = True

    def collect(self, cache: TieredCache, wait: bool = True) -> bool:
        """Hand the full blocks with known ids that are not persisted yet to the background writer (without
        ``wait``, a forward's: only what its queue has room for, :meth:`PrefixPersistence.collect`); whether all
        were. Never raises: persistence is a copy, and its failure must not fail decoding (it is logged)."""
        store = cache.runtime.store
        if store is None or self.private:
            return True
        clean = self.clean if self.clean is not None else cache.get_seq_length()
        try:
            return self.prefix.collect(store, [min(layer.get_seq_length(), clean) for layer in cache.layers],
                                       [layer.dropped for layer in cache.layers], wait, self.same_weights)
        except Exception:
            log.exception("tierkv: persisting this sequence's blocks failed; it is no longer persisted")
            self.prefix.reset()
            return True

    def same_weights(self) -> bool:
        """Whether the model load_prefix was given still computes what the sequence's namespace says (asked before
        blocks are persisted, once a block: tensor states and a few elements of each, ~10 us a tensor). Weights
        changed in place since (a fine-tune's ``load_state_dict``, a ``.to()``, a write through ``.data``) make
        every block from then on of another model, computed over K/V of this one: none of this sequence is
        persisted any more (logged). A write through ``.data`` of elements the sample does not read is not seen."""
        source, namespace = self.source, self.prefix.namespace
        if source is None or namespace is None:
            return True
        model = source[0]()
        if model is not None:
            state, sample = tensor_state(model), weights_sample(model)
            if state == source[1] and torch.equal(sample, source[2]):
                return True
            if model_fingerprint(model, cached=False) == namespace.fingerprint:
                self.source = (source[0], state, sample, source[3])  # the same bytes in new tensors
                return True
        log.info("tierkv: the weights of the model given to load_prefix changed since (or it is gone); nothing more "
                 "of this sequence is persisted (cache.reset() and load_prefix start a new one)")
        self.source = None
        self.prefix.reset()
        return False

    def truncate(self, length: int) -> None:
        """The cache was cropped to ``length`` tokens: what it loaded or computed past them is gone."""
        self.loaded = min(self.loaded, length)
        known = self.prefix.ids
        if known is not None and self.computed:
            kept = max(0, length - known.shape[1])
            self._record([np.concatenate(self.computed, axis=1)[:, :kept]] if kept else [])
        self.prefix.truncate(length)

    def select_rows(self, indices: Sequence[int]) -> None:
        self.prefix.select_rows(indices)
        if self.computed:  # one array again: beams reorder every step
            self._record([np.concatenate(self.computed, axis=1)[list(indices)]])

    def reset(self) -> None:
        self.prefix.reset()
        self.private, self.loaded, self.clean, self.announced, self.source = False, 0, None, None, None
        self._record([])

    def _record(self, chunks: list[np.ndarray]) -> None:
        """The ids computed past the known ones are now ``chunks``."""
        self.computed, self.recorded = chunks, sum(chunk.shape[1] for chunk in chunks)

    def flush(self) -> None:
        self.prefix.flush()
        if self.remote is not None:
            self.remote.flush()  # the remote's writes (each bounded by its timeout)

    def close(self) -> None:
        for watch in self.watches.values():
            watch.remove()
        self.watches.clear()
        try:
            self.prefix.close()  # waits for the writer, releases the store
        except Exception:  # noqa: BLE001 - close() never raises; what was listed stays listed
            log.exception("tierkv: closing the persistent block store failed")


class ForwardWatch:
    """A forward pre-hook on a model ``load_prefix`` was given: before each of its forwards with this cache, the
    tokens whose K/V the forward's mask or length makes depend on more than ids and positions
    (:meth:`PrefixSession.narrow`; module docstring); and a forward hook that checks the cache grew by the
    forward's token count. Holds its session and cache weakly."""

    def __init__(self, session: PrefixSession, cache: TieredCache, model: torch.nn.Module) -> None:
        self.session, self.cache, self.model = weakref.ref(session), weakref.ref(cache), weakref.ref(model)
        self.rope_limit = rope_limit(getattr(model, "config", None))
        self.expected: tuple[int, int] | None = None  # a forward of ids alone: (held, tokens), until it returns
        self.grew_otherwise = False  # a forward of this model grew the cache by another count than its tokens
        self.reported: list[str] = []  # the user hooks last logged
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)
        self.after = model.register_forward_hook(self.finished, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        if kwargs is None:  # torch looks a hook's with_kwargs up after its list: this one was registered or removed
            return  # meanwhile, by another thread's cache, so the forward is not with this cache
        session, cache = self.session(), self.cache()
        if session is None or cache is None:
            self.remove()
            return
        given: object = next((kwargs[name] for name in CACHE_KEYWORDS if kwargs.get(name) is not None), None)
        if given is not cache or module is not self.model():
            return  # (a deep copy of the model carries a copy of this hook: not the model load_prefix was given)
        self.expected = None  # (a forward that raised never reached :meth:`finished`)
        if session.private or session.prefix.ids is None:
            return
        self.check(session, cache, module, args, kwargs)

    def check(self, session: PrefixSession, cache: TieredCache, module: torch.nn.Module, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
        held = cache.get_seq_length()
        if driven_by_prompt_learning(module):
            if session.loaded:
                raise InvalidConfigError(
                    f"peft's prompt learning drives this model's forwards (its virtual tokens come after the "
                    f"{session.loaded} tokens loaded from the prefix store, which were computed without them), so "
                    "they would not compute what the peft model does. Call cache.reset() and give load_prefix no "
                    "part of a prompt-tuned model, or use a cache without persist=True and remote=.")
            session.narrow(held, "peft's prompt learning")  # virtual tokens among the ids' K/V
            return
        named = forward_inputs(module, args, kwargs)
        if named is None:
            session.narrow(held, "this forward's inputs")  # they do not bind to its forward's parameters
            return
        ids = named.get("input_ids")
        inputs = ids if ids is not None else named.get("inputs_embeds")
        rows, new = tuple(inputs.shape[:2]) if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 else (0, 0)
        if new:
            session.match_rows(rows, held)
            if session.prefix.ids is None:
                return
        session.narrow(first_masked(named.get("attention_mask"), held), "this forward's attention_mask")
        if self.rope_limit is not None and held + new >= self.rope_limit:
            if session.loaded > 0 and held <= session.loaded:
                raise InvalidConfigError(
                    f"this model's rotary embedding rescales every position of a forward that reaches "
                    f"{self.rope_limit} tokens; the {session.loaded} tokens loaded from the prefix store were "
                    f"computed by shorter forwards, and this one reaches {held + new}. Give load_prefix the whole "
                    "prompt (it loads nothing for one that long), or call cache.reset().")
            session.narrow(held, "a forward that rescales positions")
        unchecked = sorted(name for name, value in named.items()
                           if value is not None and name not in CHECKED and name not in CACHE_KEYWORDS)
        source = session.source
        if unchecked or not isinstance(ids, torch.Tensor) or ids.dim() != 2 \
                or any(part.training for part in module.modules()) or not _default_positions(named, held, new) \
                or (source is not None and setup(module) != source[3]) or self.hooked(module):
            session.narrow(held, "this forward's inputs")  # K/V of more than ids at their positions
            return
        self.expected = (held, new)  # a forward of ids alone: :meth:`finished` checks the cache grew by as many
        session.observe(ids.detach().cpu().numpy().astype(np.int64, copy=False), held)

    def finished(self, module: torch.nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        """After a forward (``rest``: its keywords and output): one that grew this cache by another count than the
        tokens it was given (peft's prompt tuning prepends virtual tokens, prefix tuning attends a cache of its own)
        put K/V under ids it is not of: nothing from its start is persisted; where the cache holds K/V loaded from
        the store, computed without such tokens, the forward's output is not this model's, and is refused."""
        session, cache = self.session(), self.cache()
        if len(rest) != 2 or session is None or cache is None or self.expected is None \
                or module is not self.model() or not any(rest[0].get(name) is cache for name in CACHE_KEYWORDS):
            return  # (torch calls it without keywords where it was registered or removed meanwhile: not this cache)
        (held, new), self.expected = self.expected, None
        grew = cache.get_seq_length() - held
        if grew == new:
            return
        self.grew_otherwise = True
        if session.loaded:
            raise InvalidConfigError(
                f"this forward added {grew} tokens to the cache for its {new} tokens (the model adds tokens of its "
                f"own, as peft's prompt tuning does), so the {session.loaded} tokens loaded from the prefix store, "
                "computed without them, are not what this model computes. Call cache.reset() and run the prompt "
                "again (this cache's load_prefix loads nothing for this model from now on).")
        if session.clean is None or session.clean > held:
            log.info("tierkv: a forward added %d tokens to the cache for its %d (the model adds or keeps tokens of "
                     "its own, as peft's prompt and prefix tuning do): from token %d nothing is persisted", grew, new,
                     held)
        session.narrow(held, "a forward that added other tokens than its own")

    def hooked(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` has forward hooks of the user's (:func:`~tierkv.persist.keys.user_hooks`), which may
        make its K/V depend on more than the ids; logged once for each set of them."""
        hooks = user_hooks(model)
        if hooks and hooks != self.reported:
            log.info("tierkv: the model has forward hooks of your own (%s), which may change its K/V: while it has "
                     "them no prefix is loaded or persisted for it. Remove them (handle.remove()), or use a cache "
                     "without persist=True and remote=.", ", ".join(hooks))
        self.reported = hooks
        return bool(hooks)

    def remove(self) -> None:
        self.handle.remove()
        self.after.remove()


CACHE_KEYWORDS = ("past_key_values", "cache", "cache_params")  # what transformers' forwards call the cache
CHECKED = frozenset({"input_ids", "attention_mask", "position_ids", "cache_position", "use_cache", "return_dict",
                     "logits_to_keep", "num_logits_to_keep", "output_attentions", "output_hidden_states", "labels"})
"""Forward inputs the hook checks (ids, mask, positions) or that change no K/V; any other given is not persisted."""


_SIGNATURES: weakref.WeakKeyDictionary[Any, inspect.Signature] = weakref.WeakKeyDictionary()
"""A forward function -> its signature (without ``self``)."""


def forward_inputs(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """A forward's inputs by parameter name, positional and keyword alike (those its ``**kwargs`` takes among
    them); None where they do not bind to ``module``'s forward or fill a ``*args`` (then they cannot be checked)."""
    forward = getattr(module, "_orig_mod", module).forward  # (torch.compile's wrapper takes *args, **kwargs)
    function = getattr(forward, "__func__", forward)  # keyed by function: peft's disable_adapter() swaps forward
    try:
        signature = _SIGNATURES.get(function)
        if signature is None:
            signature = _SIGNATURES[function] = inspect.signature(forward)
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def driven_by_prompt_learning(model: torch.nn.Module) -> bool:
    """Whether a peft model with prompt learning active drives ``model`` (the model it wraps): its ``generate()``
    sets the wrapped model's ``prepare_inputs_for_generation`` to its own, which puts virtual tokens before the
    ids, so the wrapped model's forwards compute K/V of more than the ids (a fingerprint of the wrapped model alone
    cannot say so)."""
    owner = getattr(vars(model).get("prepare_inputs_for_generation"), "__self__", None)
    state = prompt_learning(owner) if isinstance(owner, torch.nn.Module) and owner is not model else None
    return state is not None and not state[-1]  # (the last: turned off)


def setup(model: torch.nn.Module) -> tuple[str, str]:
    """What decides ``model``'s K/V besides its tensors and can change in place: its config (every entry: a
    ``sliding_window`` edited) and the attention implementation it computes with (``set_attn_implementation``)."""
    config = getattr(model, "config", None)
    described = json.dumps(config.to_dict(), sort_keys=True, default=str) if config is not None else ""
    return described, own_implementation(model)



def _default_positions(kwargs: dict[str, Any], held: int, new: int) -> bool:
    """Whether the forward's ``position_ids`` and ``cache_position`` (where given) are the positions its tokens
    take after ``held`` tokens, as without them."""
    expected = torch.arange(held, held + new)
    for name in ("position_ids", "cache_position"):
        given = kwargs.get(name)
        if given is not None and not (isinstance(given, torch.Tensor) and given.shape[-1] == new
                                      and bool((given.detach().cpu() == expected).all())):
            return False
    return True


def first_masked(mask: Any, fallback: int = 0) -> int | None:
    """The first token position any row of a 2-D ``attention_mask`` masks (None: none, or no mask); ``fallback``
    for a mask of another form (a 4-D one may mask anything)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return fallback
    masked = torch.nonzero((mask == 0).any(0)).flatten()
    return int(masked[0]) if masked.numel() else None


def rope_limit(config: Any) -> int | None:
    """The forward length from which ``config``'s rotary embedding rescales positions (dynamic NTK scaling from
    the model's length, LongRoPE's long factors past its original length), the smallest of its layer types';
    None if its K/V does not depend on the forward's length."""
    if config is None:
        return None
    text = config.get_text_config(decoder=True)
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kinds = list(params.values()) if params and all(isinstance(p, dict) for p in params.values()) else [params]
    limits = [int(length) for p in kinds if "dynamic" in str(p.get("rope_type", p.get("type", "")))
              or p.get("rope_type", p.get("type")) == "longrope"
              for length in (p.get("original_max_position_embeddings"),
                             getattr(text, "original_max_position_embeddings", None), text.max_position_embeddings)
              if isinstance(length, int) and length > 0]
    return min(limits) if limits else None


def _import(cache: TieredCache, kv: list[torch.Tensor], device: torch.device) -> None:
    """Append ``kv[layer]`` ``[2, B, H_kv, T, D]`` to every layer of the empty ``cache`` (all or nothing), taking
    each out of ``kv`` as it goes: the host holds the prefix once, not again as the tiers fill."""
    cache.ensure_layers(len(kv))
    try:
        for layer in cache.layers[: len(kv)]:
            layer_kv = kv.pop(0).to(device)
            layer.load(layer_kv[0], layer_kv[1])
            del layer_kv
    except BaseException:
        with deferred_interrupts():  # all or nothing, even under a second Ctrl-C
            cache.reset()
        raise


def default_capacity(disk_dir: str | os.PathLike) -> tuple[int, str]:
    """The local store's capacity without ``persist_gb`` (``DEFAULT_PERSIST_FRACTION`` of the free space under
    ``disk_dir``) and how to name it; refused where that is no space at all (a filesystem that reports no size,
    such as ramfs, or a full one), where every block would be dropped as soon as it is written."""
    usage = psutil.disk_usage(os.fspath(disk_dir))
    if usage.total == 0:
        raise InvalidConfigError(
            f"the filesystem under disk_dir {os.fspath(disk_dir)!r} reports no size (ramfs, some FUSE and network "
            "filesystems), so the persistent store's capacity cannot default to its free space: pass persist_gb.")
    capacity = int(usage.free * DEFAULT_PERSIST_FRACTION)
    source = f"{DEFAULT_PERSIST_FRACTION:.0%} of the {format_bytes(usage.free)} free under disk_dir"
    if capacity <= 0:
        raise InvalidConfigError(
            f"persist=True can keep nothing: the persistent store's capacity defaults to {source}. Free space there, "
            "choose another disk_dir, or pass persist_gb.")
    return capacity, source


def unreserved(disk: weakref.ref[DiskTier]) -> Callable[[], int]:
    """The bytes of the disk tier's budget it has not reserved on its filesystem yet, read when asked (0 once the
    tier is gone; its whole budget while another thread changes its files)."""
    def measure() -> int:
        tier = disk()
        if tier is None:
            return 0
        try:
            return max(0, tier.budget - tier.allocated_bytes)
        except RuntimeError:  # its files changed while they were summed (a growth on the decoding thread)
            return tier.budget
    return measure


def token_ids(input_ids: torch.Tensor | Sequence[int]) -> np.ndarray:
    """Token ids as an int64 ``[B, T]`` array (a 1-D sequence is one row)."""
    ids = np.asarray(input_ids.detach().cpu() if isinstance(input_ids, torch.Tensor) else input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise InvalidConfigError(f"input_ids must be token ids of shape [batch, tokens], got {ids.dtype} "
                                 f"{tuple(ids.shape)}.")
    return ids.astype(np.int64)
