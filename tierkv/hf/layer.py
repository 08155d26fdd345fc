"""``TieredLayer``: one model layer's KV in the shared store, and its own step.

A step (``update``) appends the layer's new tokens to the store, then hands the active executor one immutable
:class:`~tierkv.attention.base.Span`; executors that replace the model's attention function get the same span
back through :meth:`TieredLayer.attend`. The layer owns its state — the tokens a sliding window freed from its
front, the length to roll back to, the keys it handed the model — and gives its step back itself when the step
fails (the cache then rolls back the layers before it: :meth:`TieredCache.roll_back`).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from transformers.cache_utils import CacheLayerMixin

from tierkv.attention.base import Executor, Span
from tierkv.errors import (
    BudgetTooSmallError,
    InterruptedStepError,
    InvalidConfigError,
    TierKVError,
    UnsupportedLayerError,
)
from tierkv.hf.attention import hand_over, masks_built
from tierkv.hf.forward import closed_error

if TYPE_CHECKING:
    from tierkv.hf.cache import TieredCache
    from tierkv.store import KVStore


def not_held(what: str) -> str:
    """The refusal of a model that keeps ``what`` in its cache."""
    return (f"this model keeps {what} in its cache; TieredCache holds full and sliding-window attention K/V only "
            f"(given config=, it refuses such a model when it is built). Use transformers' DynamicCache for this "
            f"architecture.")


_LAYER_NOT_COPIED = (
    "a TieredCache layer cannot be copied: it is a view of the cache's shared store, so a copy would read and write "
    "the same layer's blocks. This model copies its cache's layers to give a layer run several times its own K/V "
    "per pass (looped layers, e.g. Dory's recurrent_kv_cache_mode='per_loop'), which TieredCache does not hold. "
    "Use transformers' DynamicCache for this architecture.")


class _NoBackward(torch.autograd.Function):
    """``value`` as it is (no copy), tied to the autograd graph of ``sources`` so that a backward reaching it raises
    with the fix: the tiers hold K/V without autograd history, so gradients through a TieredCache's attention would
    miss its K/V (exact gather's), the K/V of earlier forwards, or fail on a reused buffer (streaming's) — never
    silently wrong."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> NoReturn:
        raise TierKVError(
            "backward through a forward with a TieredCache: the cache's tiers hold K/V without autograd history, so "
            "gradients through its attention would be wrong. TieredCache is for inference: decode under "
            "torch.no_grad() or torch.inference_mode(); to train or take gradients, use transformers' DynamicCache.")


def _without_backward(value: torch.Tensor, *sources: torch.Tensor | None) -> torch.Tensor:
    """``value``, raising at backward (:class:`_NoBackward`) where a forward takes gradients through any of
    ``sources`` (the step's query and K/V; the cache's mark of K/V stored with autograd history)."""
    if not torch.is_grad_enabled():  # (decoding: the step's only cost here)
        return value
    given = [source for source in sources if source is not None]
    return _NoBackward.apply(value, *given) if any(source.requires_grad for source in given) else value


class Uncopyable:
    """Refuses ``copy.deepcopy``, ``copy.copy`` and pickling with :meth:`copy_refusal`: what it owns or views a
    copy could not share."""

    def copy_refusal(self) -> Exception:
        raise NotImplementedError

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise self.copy_refusal()

    def __copy__(self) -> NoReturn:
        raise self.copy_refusal()

    def __reduce__(self) -> NoReturn:
        raise self.copy_refusal()


class OfCache(Uncopyable):
    """A layer of one TieredCache: the reference back to it (``_cache``, weak: the cache holds its layers, a strong
    reference back would be a cycle) and the batch edits, which the cache makes for all its layers at once."""

    _cache: weakref.ReferenceType[TieredCache]

    @property
    def cache(self) -> TieredCache:
        cache = self._cache()
        if cache is None:
            raise TierKVError("this layer's TieredCache was garbage-collected; keep a reference to the cache while "
                              "its layers are in use.")
        return cache

    def belongs_to(self, cache: TieredCache) -> bool:
        return self._cache() is cache

    def gone(self) -> bool:
        """Whether this layer's cache was closed or collected."""
        cache = self._cache()
        return cache is None or cache.closed

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.cache.reorder_cache(beam_idx)

    def copy_refusal(self) -> Exception:
        return UnsupportedLayerError(_LAYER_NOT_COPIED)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.cache.batch_select_indices(indices)


class TieredLayer(OfCache, CacheLayerMixin):
    """One model layer's view of the shared store. Sliding-window layers keep only their window."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False
    record_past = False  # a sliding layer keeps what leaves its window until the next crop (activate_past_recording)

    def __init__(self, cache: TieredCache, index: int, sliding_window: int | None = None,
                 position: int | None = None) -> None:
        CacheLayerMixin.__init__(self)  # by name: in HybridLayer the next class after this one is the state's
        self._cache = weakref.ref(cache)
        self.index = index  # in the store (the layers that hold K/V, in order)
        self.position = index if position is None else position  # in the model (layers with state only count too)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.dropped = 0  # tokens freed from the front (sliding layers only)
        self.length_before = 0  # sequence length before the update in progress (the rollback target)
        self.pending: tuple[Executor, Span, torch.Tensor, torch.Tensor] | None = None  # the step attend() completes
        self.widths: tuple[int, int] | None = None  # (keys, values) head dims where they differ
        self.past_front = 0  # recording the past: the stored tokens before what the layer shows (:meth:`_held`)

    def __getattr__(self, name: str) -> Any:
        """A cache-layer attribute this layer lacks is state of another kind of attention (DeepSeek V4's
        compression weights): refused with the fix, and still an AttributeError for ``hasattr``."""
        if name.startswith("_"):
            raise AttributeError(name)
        raise UnsupportedLayerError(not_held(f"state TieredCache's layers lack (layer.{name})"))

    # ------------------------------------------------------------------------------------------ the step
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's K/V ``[B, H_kv, T, D]`` and return what the model's attention function gets. Keys
        and values of different head dims (multi-head latent attention caches its latent and its rotary key) are
        stored at the wider one, the narrower zero-padded, and handed back at their own (:meth:`_widen`)."""
        widths = None
        if key_states.shape != value_states.shape:
            key_states, value_states, widths = self._widen(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache = self.cache
        if cache.stateful:
            cache.enter(self, "update")
        runtime = cache.runtime
        store = runtime.store
        if self.index == 0 or store is None or cache.closed:
            store = cache.begin_layer(self.index, key_states)
        cache.forward.announced = False
        if cache.forward.last_update == self.index:  # (a forward's first K/V layer: it began one, so never)
            cache.refuse_repeated(self)
        if cache.forward.tokens is None:
            cache.forward.tokens = key_states.shape[2]
        elif key_states.shape[2] != cache.forward.tokens and not cache.forward.may_repeat:
            cache.refuse_uneven(self, key_states.shape[2])
        cache.forward.last_update = self.index
        cache.forward.layers_updated += 1
        stored = store.seq_length(self.index)
        self.length_before = self.dropped + stored
        new = key_states.shape[2]
        try:
            # Blocks that left the window during the previous step go now, not then: until this step is
            # committed, a rollback may still need them.
            if self.sliding_window is not None and stored >= self.sliding_window and not self.record_past:
                stored -= self._drop_front(store, stored)
            stop = stored + new
            window = None if self.record_past else self.sliding_window
            # what the window drops at the next update needs no key summary (a long step would size them all)
            store.append(self.index, key_states, value_states,
                         summarise_from=0 if window is None else stop - (window - 1))
            span = Span(self.index, self._start(stop, new), stop, new, key_states.shape[0], self.sliding_window,
                        self.dropped + stop)
            executor = runtime.decode if new == 1 else runtime.prefill
            if executor is None or executor is not runtime.attending:
                executor = runtime.hand_off(new)
            if executor.approximate and cache.session is not None:
                cache.session.narrow(self.length_before, "a step decoded with approximate (sparse) attention")
            if executor.replaces_attention:
                if widths is not None:
                    raise InvalidConfigError(
                        f"layer {self.index} caches keys of {widths[0]} and values of {widths[1]} dims (multi-head "
                        f"latent attention: the model expands them after the cache, or values of another head dim "
                        f"than its keys); streaming, split and sparse attention attend the stored K/V of one head dim. "
                        f"Decode this model with exact gather: leave out the `with cache.streaming/split/"
                        f"sparse(model)` block (outputs equal DynamicCache's).")  # fmt: skip
                self.pending = (executor, span, key_states, value_states)
                hand_over(self)
            keys, values = executor.step(span, key_states, value_states)
            if not executor.replaces_attention:  # (those attend(): the model must pass back these very tensors)
                history = cache.history
                keys = _without_backward(keys, key_states, value_states, history)
                values = _without_backward(values, key_states, value_states, history)
            if cache.history is None and torch.is_grad_enabled() and (key_states.requires_grad or
                                                                       value_states.requires_grad):
                cache.history = torch.zeros((), requires_grad=True)  # the tiers' copies of these K/V lose theirs
            return (keys, values) if widths is None else (keys[..., :widths[0]], values[..., :widths[1]])
        except BaseException as error:  # a KeyboardInterrupt too: the layers that took this step give it back
            cache.roll_back(self.length_before)
            if isinstance(error, BudgetTooSmallError):
                raise runtime.budget_error(error, self.length_before + new, key_states.shape[0],
                                           cache.records_past) from error
            raise

    def _widen(self, key_states: torch.Tensor,
               value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:  # fmt: skip
        """Keys and values that differ only in head dim, the narrower zero-padded to the wider (zeros add nothing
        to a dot product or a weighted sum, and are never handed back), and their own widths (kept: every step of
        the layer must bring the same)."""
        widths = (key_states.shape[-1], value_states.shape[-1])
        if key_states.shape[:-1] != value_states.shape[:-1] or (self.widths or widths) != widths:
            earlier = f" (its earlier steps: {self.widths})" if self.widths else ""
            raise InvalidConfigError(
                f"layer {self.index}'s keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} differ in "
                f"more than their head dim, or in other head dims than before{earlier}: TieredCache stores K and V of "
                f"one head count and length; use transformers' DynamicCache for this model.")  # fmt: skip
        self.widths = widths
        wide = max(widths)
        pad = torch.nn.functional.pad
        return pad(key_states, (0, wide - widths[0])), pad(value_states, (0, wide - widths[1])), widths

    def handed(self, key_states: torch.Tensor) -> bool:
        """Whether this layer's last update handed the model ``key_states`` for an executor to attend."""
        return self.pending is not None and self.pending[2] is key_states

    def refuse(self, error: TierKVError) -> NoReturn:
        """Refuse the step this layer handed over, before attending it: every layer that took the step gives it
        back (else a retry would find this layer a step ahead of the next ones)."""
        self.pending = None
        self.cache.roll_back(self.length_before)
        raise error

    def refuse_changed_kv(self) -> NoReturn:
        """The model attends this step with K/V other than those :meth:`update` returned (JetMoE repeats them per
        expert, DiffLlama splits the values): the executors read the stored K/V, so the step is given back and
        refused with the fix."""
        self.refuse(InvalidConfigError(
            "the model attends with keys or values other than those the cache's update returned (it repeats, splits "
            "or changes them after the update, as JetMoE and DiffLlama do); streaming, split and sparse attention "
            "read the stored K/V. Decode this model with exact gather: leave out the `with "
            "cache.streaming/split/sparse(model)` block (outputs equal DynamicCache's)."))

    def attend(self, key_states: torch.Tensor, value_states: torch.Tensor, query: torch.Tensor,
               mask: torch.Tensor | None, scaling: float, softcap: float | None,
               sinks: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        """The attention of this layer's step (the model's attention function with ``key_states`` and
        ``value_states`` from :meth:`update`): ``query`` ``[B, H_q, q, D]`` -> ``[B, q, H_q, D]`` in the query's
        dtype. ``sinks`` (``[H_q]``, gpt-oss's ``s_aux``): one more logit per query head in the softmax's
        denominator, attached to no value — the output scaled by ``sigmoid(lse - sink)``, exactly. ``causal``
        False with no ``mask`` (an encoder's attention): every query attends every key, as sdpa's."""
        with self.cache.using:
            return self._attend(key_states, value_states, query, mask, scaling, softcap, sinks, causal)

    def _attend(self, key_states: torch.Tensor, value_states: torch.Tensor, query: torch.Tensor,
                mask: torch.Tensor | None, scaling: float, softcap: float | None,
                sinks: torch.Tensor | None, causal: bool) -> torch.Tensor:
        if self.cache.closed:
            raise closed_error()
        pending, self.pending = self.pending, None
        if pending is None or pending[2] is not key_states:
            raise TierKVError("inside `cache.streaming(model)` the model must be called with that cache "
                              "(cache=cache); another cache was passed, or none.")
        executor, span, _, values = pending
        if value_states is not values:
            self.pending = pending
            self.refuse_changed_kv()
        try:
            if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1):
                raise InvalidConfigError(
                    f"the model passes an attention mask of shape {tuple(mask.shape)} (one per head, as ALiBi or "
                    f"dynamic masks are); streaming, split and sparse attention take one [batch, 1, queries, keys] "
                    f"mask for every head. Decode this model with exact gather: leave out the `with "
                    f"cache.streaming/split/sparse(model)` block, or use `cache.exact(model, executor=\"gather\")` "
                    f"(outputs equal DynamicCache's).")  # fmt: skip
            if mask is None and not causal and query.shape[2] > 1:  # no mask, not causal: every query, every key
                mask = torch.ones((1, 1, query.shape[2], span.stop - span.start), dtype=torch.bool,
                                  device=query.device)  # fmt: skip
            zeros = None  # fully masked query rows (lse.MaskedRows): zeros, or the mean of the keys
            if mask is not None and (rows := self.cache.fully_masked(mask)) is not None:
                zeros = rows.empty
                if rows.uniform is not None and sinks is not None:  # the sinks take all the mass: zeros
                    zeros = rows.uniform if zeros is None else zeros | rows.uniform
                elif rows.uniform is not None:  # a softmax of equal logits: the pieces merge to the mean exactly
                    uniform = rows.uniform[..., None]
                    query, mask = query.masked_fill(uniform, 0), mask.masked_fill(uniform, 0)
                zeros = None if zeros is None else zeros[..., None]
            given = query
            with torch.no_grad():  # (a backward is refused below: the executors' buffers hold no history)
                out, lse = executor.attend(span, query, mask, scaling, softcap)
                if sinks is not None:
                    out = out * torch.sigmoid(lse - sinks.to(lse).view(1, -1, 1)).unsqueeze(-1)
                if zeros is not None:
                    out = out.masked_fill(zeros, 0)
                out = out.transpose(1, 2).contiguous().to(query.dtype)  # contiguous as sdpa's: models .view() it
            return _without_backward(out, given, key_states, value_states, self.cache.history)
        except BaseException as error:
            cache = self.cache
            cache.roll_back(self.length_before)
            if isinstance(error, BudgetTooSmallError):
                raise cache.runtime.budget_error(error, span.context, span.batch, cache.records_past) from error
            raise

    def _start(self, stop: int, new: int) -> int:
        """First stored token attention reads after ``new`` tokens were appended (HF's sliding semantics)."""
        if self.sliding_window is None:
            return 0
        before = self.dropped + stop - new
        return stop - (min(before, self.sliding_window - 1) + new)

    def _drop_front(self, store: KVStore, stored: int) -> int:
        """Free the whole blocks of a sliding layer that can no longer be attended to; the tokens freed."""
        assert self.sliding_window is not None
        dropped = store.drop_front(self.index, stored - (self.sliding_window - 1))
        if dropped:
            self.dropped += dropped
            for executor in self.cache.runtime.executors.values():
                executor.drop(self.index)  # its prefetch counted tokens from the old front
        return dropped

    def load(self, keys: torch.Tensor, values: torch.Tensor, first_block: int = 0) -> None:
        """Append K/V that no forward of this cache computed (a persisted prefix, a saved conversation);
        ``first_block``: the sequence's block the first of them begins (a sliding layer's dropped ones before)."""
        self.cache.begin_layer(self.index, keys, forward=False).append(self.index, keys, values, first_block)

    # ---------------------------------------------------------------------------------------- queries
    def stored(self) -> int:
        store = self.cache.runtime.store
        return store.seq_length(self.index) if store is not None else 0

    def furthest(self) -> int:
        """The tokens a rollback measures this layer by (a hybrid layer: its part further on)."""
        return self.get_seq_length()

    def get_seq_length(self) -> int:
        return self.dropped + self.stored()

    @property  # a plain attribute in CacheLayerMixin; these K/V live in the tiers
    def keys(self) -> torch.Tensor | None:
        """The keys this layer holds, ``[B, H_kv, tokens, D]``: a new host tensor read from every tier, for
        inspection (it costs their bytes in host memory; decoding never reads it). None while it holds none; a
        sliding-window layer's last ``window - 1`` tokens, as ``DynamicSlidingWindowLayer`` keeps."""
        return self._held(0)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The values this layer holds, as :attr:`keys`."""
        return self._held(1)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._refuse_assignment("values", value)

    def _held(self, part: int) -> torch.Tensor | None:
        cache = self.cache
        with cache.using:  # not while another thread closes the cache or steps this layer
            store = cache.runtime.store
            stored = store.seq_length(self.index) if store is not None else 0
            if store is None or not stored:
                return None
            rows = store.table.rows[self.index]
            blocks = store.export_blocks(self.index, rows.front, rows.front + rows.count)  # [B, n, 2, H, bt, D]
        held = blocks[:, :, part].transpose(1, 2).flatten(2, 3)[:, :, :stored]
        if self.sliding_window is not None and self.record_past:  # what DynamicSlidingWindowLayer shows: its window
            held = held[:, :, self.past_front:]  # when recording began or the last crop, and every token since
        elif self.sliding_window is not None:  # what attention still sees, as DynamicSlidingWindowLayer keeps
            held = held[:, :, -(self.sliding_window - 1):] if self.sliding_window > 1 else held[:, :, :0]
        return (held if self.widths is None else held[..., : self.widths[part]]).contiguous()

    @staticmethod
    def _refuse_assignment(name: str, value: torch.Tensor | None) -> None:
        if value is not None:  # CacheLayerMixin's __init__ sets None: nothing is held yet, as here
            raise InvalidConfigError(f"a TieredLayer's {name} are read from its tiers and cannot be assigned: the "
                                     f"cache takes K/V through update() (a model's forward) and edits through crop(), "
                                     f"reset() and the batch methods.")

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers 5.0 passes the cache positions
            query_length = query_length.shape[0]
        cache = self.cache
        cache.sized_at = masks_built()  # a forward's mask begins (see hand_over)
        cache.forward.announced = True  # (Forward.begin)
        length = self.get_seq_length()
        sized = cache.forward.sized
        if sized is None or sized[0] != threading.get_ident():  # (transformers 5.0 asks no get_query_offset first)
            cache.note_sized()
        if query_length == 0 and length and cache.settle_stopped():  # generate() sliced the ids by a stopped length
            raise InterruptedStepError(
                f"the previous forward stopped part-way (a Ctrl-C or an error in the model between layers), so this "
                f"cache's length read {length} tokens and generate() passed the model none of the input's; the layers "
                f"were rolled back to {self.get_seq_length()} tokens. Call generate() again: it resumes from there.")
        if query_length == 0 and length:  # else the model fails on an empty reshape, naming neither cause nor fix
            raise InvalidConfigError(
                f"the input brings no new tokens: this cache already holds {length} tokens, and generate() passes the "
                f"model only the input's tokens beyond those. To continue, pass the ids the cache holds followed by "
                f"the new ones (the previous output, then the next turn); for another prompt (a pipeline call, a new "
                f"request), call cache.reset() first or use a new cache.")  # fmt: skip
        if self.sliding_window is None:
            return length + query_length, 0
        window = self.sliding_window
        offset = max(length - window + 1, 0)
        visible = window - 1 if length >= window else length
        return visible + query_length, offset

    def get_max_length(self) -> int:
        return self.sliding_window or -1

    get_max_cache_shape = get_max_length  # its name in transformers 5.0

    # ------------------------------------------------------------------------------------------ edits
    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        TieredLayer.check_crop(self, tokens_to_remove)  # (a HybridLayer checks its two parts on its own)
        cache = self.cache
        store = cache.runtime.store
        remove = min(-tokens_to_remove, store.seq_length(self.index) if store is not None else 0)
        if remove > 0:  # (as DynamicCache: more than the layer holds empties it)
            assert store is not None
            cache.runtime.invalidate()
            store.crop(self.index, remove)
            if cache.session is not None:
                cache.session.truncate(self.get_seq_length())
        if self.record_past and self.sliding_window is not None and store is not None:
            stored = store.seq_length(self.index)
            if stored >= self.sliding_window:  # back to the window, as transformers' sliding layer after a crop
                cache.runtime.invalidate()
                self._drop_front(store, stored)
            self._mark_past_front()

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep what leaves a sliding window until the next :meth:`crop`, as transformers' sliding layer does, so a
        crop may go back further than the window (assisted decoding of a sliding model with long drafts)."""
        self.record_past = True
        self._mark_past_front()

    def _mark_past_front(self) -> None:
        """What transformers' recording sliding layer holds from here on is its window now and every token after
        it: the stored tokens before that window (whole blocks are dropped, so some may be) are not shown."""
        store = self.cache.runtime.store
        stored = store.seq_length(self.index) if store is not None else 0
        self.past_front = 0 if self.sliding_window is None else max(0, stored - (self.sliding_window - 1))

    def check_crop(self, tokens_to_remove: int) -> None:
        """Refuse :meth:`crop` into the tokens a sliding window dropped (before the cache crops any layer)."""
        store = self.cache.runtime.store
        if self.sliding_window is None or not self.dropped or store is None:
            return
        stored = store.seq_length(self.index)
        if -tokens_to_remove > stored - (self.sliding_window - 1):
            most = max(0, stored - (self.sliding_window - 1))
            raise InvalidConfigError(
                f"cannot crop {-tokens_to_remove} tokens from layer {self.index}: its sliding window of "
                f"{self.sliding_window} dropped the tokens before its last {stored}, so at most {most} can be cropped "
                "(the window must stay whole); crop fewer tokens, or build the cache without config= to keep all "
                "tokens.")

    def reset(self) -> None:
        self.dropped = 0
        self.pending = None
        self.widths = None
        self.past_front = 0

    def offload(self) -> None:
        """Nothing to move: the store already places this layer's blocks on the tiers by their budgets (transformers'
        own offloading would move K/V tensors this layer does not hold)."""

    def prefetch(self) -> None:
        """Nothing to move: the executors read the next layers' blocks ahead themselves (``prefetch_depth``)."""
