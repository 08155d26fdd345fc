"""How executors that replace the attention function plug into a transformers model.

``cache.streaming(model)`` / ``cache.sparse(model)`` / ``cache.split(model)`` return an :class:`Engagement`:
entered, it pushes its :class:`~tierkv.hf.runtime.Mode` and points the model's attention at
:data:`STREAMING_ATTENTION`, which hands each layer's query to its :meth:`~tierkv.hf.layer.TieredLayer.attend`
where the cache's update handed the step over, and runs the model's own implementation for a forward through any
other cache; on exit the model is the user's again.
An engagement that is made but never entered (``cache.streaming(model)`` as a plain statement) would decode
with exact gather while the caller believes otherwise: the cache's next forward raises instead.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch

from tierkv import forks
from tierkv.atomic import deferred_interrupts
from tierkv.errors import InvalidConfigError, TierKVError
from tierkv.hf.forward import alive
from tierkv.hf.runtime import Mode
from tierkv.hf.sizing import check_chunk_tokens, kv_producers
from tierkv.hf.turn import turn

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedConfig

    from tierkv.attention.sparse import SparseBudget
    from tierkv.hf.cache import TieredCache
    from tierkv.hf.layer import TieredLayer

STREAMING_ATTENTION = "tierkv_streaming"  # the AttentionInterface name of the executors that attend themselves
_READ = frozenset({"s_aux", "position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k"})
"""Tensor keywords of an attention call that the executors apply (gpt-oss's sinks) or that say nothing the mask and
the cache do not (positions, varlen offsets); any other tensor (T5's ``position_bias``, ``sinks``, DSA's
``indices``) changes the scores over keys the executors cannot see it for, so the step is refused."""


def streaming_mode(chunk_tokens: int, budget: SparseBudget | None = None,
                   config: PreTrainedConfig | None = None) -> Mode:
    """Multi-token steps stream in chunks of ``chunk_tokens``; one-token steps too, or sparsely within ``budget``
    (``config``: the engaged model's, for the sparse minimum a budget error names)."""
    check_chunk_tokens(chunk_tokens)
    options = {"streaming": {"chunk_tokens": chunk_tokens}}
    return Mode("streaming", "streaming" if budget is None else "sparse", options, budget, config)


def split_mode(chunk_tokens: int) -> Mode:
    """Multi-token steps stream in chunks of ``chunk_tokens``; one-token steps attend each tier's share in place."""
    options = {**streaming_mode(chunk_tokens).options, "split": {"piece_tokens": chunk_tokens}}
    return Mode("streaming", "split", options)


_LOCK = threading.Lock()  # guards the three below: engagements enter and leave on any thread
_HELD: dict[int, int] = {}  # id(model) -> its engagements entered and not yet left, on every thread
_BEFORE: dict[int, str] = {}  # id of an engaged model, its attention modules, its configs -> the implementation before
_ENGAGED: dict[int, Any] = {}  # id(model) -> the engaged model's config (whose implementation a user may switch inside)
forks.lock_anew_in_child(globals(), "_LOCK")
_STEP = threading.local()  # .layer: the TieredLayer whose update just handed this thread's attention over;
# .masks: masks this thread built (one or two a forward); .handed_at: .masks when .layer handed over


def masks_built() -> int:
    """Masks the engaged models' forwards built on this thread so far (one or two a forward)."""
    return getattr(_STEP, "masks", 0)


def hand_over(layer: TieredLayer) -> None:
    """``layer``'s update gave the model only the step's K/V: this thread's next attention call is the layer's
    (whatever the attention module's own index: HRM's modules update layer ``layer_idx + cycle_offset``).

    A forward that asked the cache for its mask sizes without building its mask through :func:`_mask` is a model
    that was not engaged (another instance than the one passed to ``cache.streaming``) or one that builds its masks
    itself (Inkling2): its own attention would see only the step's K/V, so the step is refused."""
    cache = layer.cache
    sized_at, cache.sized_at = cache.sized_at, None
    if sized_at is not None and sized_at == masks_built():
        switched = _switched_inside()
        if switched is not None:
            layer.refuse(InvalidConfigError(
                f"the engaged model's attention implementation was set to {switched!r} inside `with "
                "cache.streaming/split/sparse(model)`, which attends through its own; set it before entering the "
                "block or after leaving it (the model keeps the one you set when the block ends)."))
        layer.refuse(InvalidConfigError(
            "this cache is engaged (`with cache.streaming/split/sparse(model)`) but the forward calling it built no "
            "attention mask through transformers' mask functions: either the model called is not the engaged one, "
            "or it builds its masks with code of its own; either way its attention would see only each step's K/V. "
            "Engage the model object you call: pass that very model to `cache.streaming/split/sparse(...)` (not a "
            "copy, another instance, or its base model); a model that builds its own masks decodes with exact "
            "gather: leave out the `with` block (outputs equal DynamicCache's)."))
    _STEP.layer, _STEP.handed_at = layer, masks_built()


def _switched_inside() -> str | None:
    """The implementation an engaged model was switched to inside its block (``set_attn_implementation``), or None."""
    with _LOCK:
        configs = list(_ENGAGED.values())
    for config in configs:
        current = getattr(config, "_attn_implementation", STREAMING_ATTENTION)
        if current != STREAMING_ATTENTION:
            return str(current)
    return None


def drop_hand_over(cache: TieredCache) -> None:
    """``cache``'s step was given back: a hand-over of it that this thread's attention has not taken yet goes too
    (a model attending with its own code never takes one; left, it would be taken for the next forward's)."""
    layer = getattr(_STEP, "layer", None)
    if layer is not None and layer.belongs_to(cache):
        layer.pending, _STEP.layer = None, None


def _kept_its_own(module: Any) -> bool:
    """Whether an attention module (one with a layer index) kept its implementation through the model's switch: its
    config is a copy that ``set_attn_implementation`` does not reach (T5's stacks on some releases)."""
    config = getattr(module, "config", None)
    return isinstance(getattr(module, "layer_idx", None), int) and \
        getattr(config, "_attn_implementation", STREAMING_ATTENTION) != STREAMING_ATTENTION


def own_implementation(model: Any) -> str:
    """The attention implementation ``model`` computes with: the one an engagement switched from while engaged
    (streaming and split compute that attention; :data:`STREAMING_ATTENTION` names only the switch)."""
    with _LOCK:
        return _BEFORE.get(id(model)) or str(model.config._attn_implementation)


def check_model(model: Any, what: str) -> None:
    """``cache.<what>(model)`` switches the attention of the model itself: a config or a name is refused."""
    if not isinstance(model, torch.nn.Module):
        raise InvalidConfigError(f"cache.{what}(model) takes the model object you call generate() or forward on, "
                                 f"got a {type(model).__name__}; pass the model itself (not its config or name).")


class Engagement:
    """``with cache.streaming(model):`` — the model attends through ``mode``'s executors inside the block.

    A model's attention implementation is one setting for every thread, so it is switched when the model's first
    engagement enters and back when its last leaves. Which attention a forward runs is decided by its cache: an
    engaged cache's update hands the step over (:func:`hand_over`) to the executors, in whatever thread calls the
    model (a ``TextIteratorStreamer``'s generate thread); a forward with any other cache — a server's other request
    on the same model — runs the implementation the model had, with its own mask."""

    def __init__(self, cache: TieredCache, model: Any, mode: Mode, what: str) -> None:
        check_model(model, what)
        self.cache, self.model, self.mode, self.what = cache, model, mode, what
        self.entered = False
        self.modules: list[Any] = []
        self.held = 0  # times counted on the model (_HELD): entered and not yet left
        self.thread = threading.get_ident()  # the thread that made it: its own forwards are refused until it enters
        cache.unentered = self

    def __enter__(self) -> TieredCache:
        cache = self.cache
        if cache.unentered is self:
            cache.unentered = None
        self.entered = True
        _register_streaming_attention()
        self.modules = list(self.model.modules())  # a vision tower's or an encoder's attention has no layer_idx
        if not takes_attention_functions(self.model):
            raise InvalidConfigError(self._not_an_interface())
        if kv_producers(self.model.config):
            raise InvalidConfigError(self._reuses_kv())
        # between two forwards (another thread's may be decoding), the executors and the model's attention switch
        # together: a forward sizes its mask after the switch, or has attended before it
        with turn(cache, _ENTER_FIX), cache.using:
            cache.runtime.push(self.mode)  # exact-gather staging is released: the new mode may need all the budget
            try:  # every change to the user's model happens inside the try, so a failure undoes all of it
                self._hold()
            except BaseException:
                cache.runtime.pop()
                raise
        return cache

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _configs(self) -> list[Any]:
        config = self.model.config
        return [*_config_tree(config), config.get_text_config(decoder=True),
                *(m.config for m in self.modules if getattr(m, "config", None) is not None)]

    def _before(self, previous: str) -> dict[int, str]:
        """What each of the model's modules and configs attended with before the switch (a vision tower's config
        may name another implementation than the text model's)."""
        def own(config: Any) -> str:
            return getattr(config, "_attn_implementation", None) or previous
        return {id(self.model): previous, **{id(c): own(c) for c in self._configs()},
                **{id(m): own(getattr(m, "config", None)) for m in self.modules}}

    def _hold(self) -> None:
        """Count this engagement on the model; the first switches its attention implementation."""
        model = self.model
        with _LOCK:
            held = _HELD.get(id(model), 0)
            if not held:
                previous = model.config._attn_implementation
                before = self._before(previous)
                # first: another thread's forward on this model (no cache of it engaged) that meets the switched
                # implementation finds what to run instead (its mask builder and attention) at once
                _BEFORE.update(before)
                _ENGAGED[id(model)] = model.config
                try:
                    model.set_attn_implementation(STREAMING_ATTENTION)
                    if model.config.get_text_config(decoder=True)._attn_implementation != STREAMING_ATTENTION \
                            or any(map(_kept_its_own, self.modules)):
                        raise InvalidConfigError(self._not_an_interface())
                except BaseException:
                    try:
                        _restore_implementations(model, before)
                    finally:
                        _ENGAGED.pop(id(model), None)
                        for key in before:
                            _BEFORE.pop(key, None)
                    raise
            _HELD[id(model)] = held + 1
        self.held += 1

    def _release(self) -> None:
        """Uncount this engagement; the model's last gets its attention implementation back."""
        model = self.model
        with _LOCK:
            held = _HELD.pop(id(model)) - 1
            if held:
                _HELD[id(model)] = held
                return
            _ENGAGED.pop(id(model), None)
            try:  # first: a forward of another thread sees the model's own implementations at once
                _restore_implementations(model, _BEFORE)
            finally:  # a restore that failed leaves no record behind for the model's next engagement to reuse
                for key in (id(model), *map(id, self.modules), *map(id, self._configs())):
                    _BEFORE.pop(key, None)

    def _not_an_interface(self) -> str:
        return (f"{type(self.model).__name__} attends with its own code, not through transformers' "
                f"AttentionInterface (or its attention modules keep settings of their own that switching the model's "
                f"implementation does not reach), so `cache.{self.what}(model)` cannot take its attention over. "
                f"Decode it with exact gather: leave out the `with cache.{self.what}(model)` block (outputs equal "
                f"DynamicCache's).")

    def _reuses_kv(self) -> str:
        return (f"{type(self.model).__name__}'s last layers attend over the K/V of earlier layers (KV shared across "
                f"layers), but `cache.{self.what}(model)` hands the model only each step's K/V, so those layers "
                f"would attend the step alone. Decode it with exact gather: leave out the `with "
                f"cache.{self.what}(model)` block (outputs equal DynamicCache's).")

    def _restore(self) -> None:
        with deferred_interrupts():  # a Ctrl-C while leaving waits until the model is the user's again
            cache = self.cache
            with turn(cache, fix=None), cache.using:  # a generate thread (a streamer's) may be mid-forward
                try:
                    cache.runtime.pop()
                finally:  # the model is restored even if the executors' bookkeeping fails
                    if self.held:
                        self.held -= 1
                        self._release()

    def made_here(self) -> bool:
        """Whether a forward on this thread meets the engagement unentered: one made on this thread (or on one that
        ended without entering it); another live thread's may be entering it now, which waits for the forward."""
        return self.thread == threading.get_ident() or not alive(self.thread)

    def refuse(self) -> None:
        """The cache is used without this engagement having been entered: say so (once)."""
        self.entered = True  # reported: no warning when it is collected
        raise InvalidConfigError(f"cache.{self.what}(model) was called but never entered, so this forward would not "
                                 f"attend as asked; use it as a context manager: `with cache.{self.what}(model): "
                                 "model.generate(...)`.")

    def __del__(self) -> None:
        if not getattr(self, "entered", True):  # (an __init__ that refused the model set nothing to warn about)
            warnings.warn(f"cache.{self.what}(model) was never entered (use `with cache.{self.what}(model): ...`); "
                          "it had no effect.", RuntimeWarning, stacklevel=2)


def _sub_configs(config: Any) -> dict[str, Any]:
    """``config``'s sub-configs that are set, by the name transformers' ``set_attn_implementation`` keys them by
    (``text_config``, ``vision_config``, ...)."""
    names = getattr(config, "sub_configs", None) or {}
    return {name: sub for name in names if (sub := getattr(config, name, None)) is not None}


def _config_tree(config: Any) -> list[Any]:
    """``config`` and its sub-configs at any depth: each names the attention implementation of its own sub-model."""
    return [config, *(each for sub in _sub_configs(config).values() for each in _config_tree(sub))]


def _implementations(config: Any, implementation: Callable[[Any], str]) -> str | dict[str, Any]:
    """The ``set_attn_implementation`` argument that gives ``config`` and each of its sub-configs, at any depth,
    ``implementation(that config)``: transformers' dict form (``{"": own, "<sub-config name>": ...}``, nested for a
    sub-config's own sub-configs), or one name where the whole tree shares it."""
    own = implementation(config)
    subs = {name: _implementations(sub, implementation) for name, sub in _sub_configs(config).items()}
    return own if all(spec == own for spec in subs.values()) else {"": own, **subs}


@functools.cache
def _takes_nested_implementations() -> bool:
    """Whether this transformers release's ``set_attn_implementation`` applies a dict value to a sub-model's own
    sub-configs (5.25 does); earlier 5.x releases take one level of sub-config names only."""
    import transformers

    major, minor = (int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])
    return (major, minor) >= (5, 25)


def _for_this_release(spec: str | dict[str, Any]) -> str | dict[str, Any]:
    """``spec`` as this release takes it: a sub-config's nested dict becomes its own name where nested dicts are
    not taken (its sub-models then get the name transformers gives them)."""
    if isinstance(spec, str) or _takes_nested_implementations():
        return spec
    return {name: value if isinstance(value, str) else value[""] for name, value in spec.items()}


def _restore_implementations(model: Any, before: dict[int, str]) -> None:
    """Give each of ``model``'s configs that names :data:`STREAMING_ATTENTION` the implementation ``before`` recorded
    for it (by id), each its own: one name for all would overwrite a mix the user chose, and a sub-model may refuse
    its wrapper's (PaliGemma 2's Gemma2 text model: sdpa). A config the user set inside the block keeps that one."""
    config = model.config
    fallback = before.get(id(model)) or before.get(id(config))

    def restored(each: Any) -> str:
        current = each._attn_implementation
        if current != STREAMING_ATTENTION:
            return str(current)
        return before.get(id(each)) or fallback or STREAMING_ATTENTION

    if any(each._attn_implementation == STREAMING_ATTENTION for each in _config_tree(config)):
        model.set_attn_implementation(_for_this_release(_implementations(config, restored)))


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The attention function registered as :data:`STREAMING_ATTENTION`: the streaming executors' where this
    thread's last cache update handed this very step over (its keys), else the implementation the model had
    before it was engaged. A step handed over in this forward (no mask built since) whose attention gets other
    keys (the model changed them after the update) is refused: its own attention would see only the step's; a
    hand-over from before the forward's mask (direct ``cache.update`` calls) is dropped."""
    layer = getattr(_STEP, "layer", None)
    if layer is not None:
        _STEP.layer = None
        if layer.gone():  # (a hand-over its cache's close or collection left behind: not this forward's)
            layer = None
    if layer is not None:
        if layer.handed(key):
            return _streaming_attention_forward(layer, module, query, key, value, attention_mask, *args, **kwargs)
        if layer.pending is not None and _STEP.handed_at == getattr(_STEP, "masks", 0):
            layer.refuse_changed_kv()
    before = _BEFORE.get(id(module))
    if before is None:  # a forward of another thread that took this function while the last engagement left:
        before = getattr(getattr(module, "config", None), "_attn_implementation", None)  # the model's own again
        if before is None or before == STREAMING_ATTENTION:
            raise TierKVError(f"attention '{STREAMING_ATTENTION}' runs only inside `with cache.streaming(model):`; "
                              "a copy of a model made inside such a block (copy.deepcopy) keeps that name: give the "
                              "copy an implementation of its own, e.g. copy.set_attn_implementation('sdpa').")
    if before == STREAMING_ATTENTION:  # (its own function: calling it would recurse without end)
        raise TierKVError(_ENGAGED_WHILE_SWITCHED)
    return _implementation(module, before)(module, query, key, value, attention_mask, *args, **kwargs)


_ENTER_FIX = ("enter the `with cache.streaming/split/sparse(model)` block before that thread's generate() starts, or "
              "once it has returned")
_ENGAGED_WHILE_SWITCHED = (
    f"this model was engaged while its attention implementation still named '{STREAMING_ATTENTION}' (a copy of a "
    "model made inside a `with cache.streaming/split/sparse(model)` block, or a model whose implementation could not "
    "be given back when such a block ended), so outside the executors' steps it has no attention of its own to run. "
    "Leave the block and give the model an implementation of its own, e.g. model.set_attn_implementation('sdpa') "
    "(or 'eager' for a model that refuses sdpa), before engaging it again.")


def _implementation(module: Any, name: str) -> Any:
    """transformers' attention function ``name``; ``eager`` (registered nowhere) is the module's own file's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    try:
        return ALL_ATTENTION_FUNCTIONS[name]
    except KeyError:
        return sys.modules[type(module).__module__].eager_attention_forward


def _mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
    """The mask builder registered as :data:`STREAMING_ATTENTION`: the builder of the implementation the model had
    where it is sdpa's (boolean) or eager's (additive) — both the executors and that implementation take it, so a
    forward through another cache gets its own mask — else sdpa's."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    _STEP.masks = getattr(_STEP, "masks", 0) + 1  # a forward begins: earlier hand-overs are not its own

    # (no record: the last engagement left as this forward began, and the config names the model's own again)
    before = None if config is None else _BEFORE.get(id(config), config._attn_implementation)
    builder = ALL_MASK_ATTENTION_FUNCTIONS[before] if before in ("sdpa", "eager") else sdpa_mask
    return builder(*args, config=config, **kwargs)


def _streaming_attention_forward(layer: TieredLayer, module: Any, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                                 scaling: float | None = None, dropout: float = 0.0, softcap: float | None = None,
                                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The streaming executors' attention for ``layer``'s step: ``key``/``value`` are only this step's tokens
    (already stored); attention runs over everything the cache holds for the layer."""
    if module.training and dropout:
        layer.refuse(TierKVError("streaming attention is for inference; call model.eval() (dropout is not supported)."))
    if kwargs.get("output_attentions"):
        layer.refuse(InvalidConfigError(
            "output_attentions=True asks for the attention weights, which streaming, split and sparse attention never "
            "form (they merge chunks, tiers or pages by log-sum-exp). Leave it out, or decode with exact gather: leave "
            "out the `with cache.streaming/split/sparse(model)` block (outputs equal DynamicCache's, weights too)."))
    unknown = sorted(name for name, value in kwargs.items() if isinstance(value, torch.Tensor) and name not in _READ)
    if unknown:
        layer.refuse(InvalidConfigError(
            f"{type(module).__name__} passes {', '.join(f'`{name}`' for name in unknown)} to its attention function "
            "(a position bias, learnt sinks or a selection of keys, sized to the keys the model sees), which "
            "streaming, split and sparse attention cannot apply to the K/V they read from the tiers. Decode this "
            "model with exact gather: leave out the `with cache.streaming/split/sparse(model)` block (outputs equal "
            "DynamicCache's)."))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")  # gpt-oss: a learnt logit per query head that takes softmax mass and no value
    causal = kwargs.get("is_causal")  # as sdpa decides it: an encoder's module (BERT-style models) is not causal
    causal = getattr(module, "is_causal", True) if causal is None else causal
    return layer.attend(key, value, query, attention_mask, scale, softcap, sinks, causal=bool(causal)), None


@functools.cache
def _register_streaming_attention() -> None:
    """Register the attention function and its mask builder once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(STREAMING_ATTENTION, _attention)
    AttentionMaskInterface.register(STREAMING_ATTENTION, _mask)


def takes_attention_functions(model: torch.nn.Module) -> bool:
    """Whether ``model`` attends through transformers' AttentionInterface, so that streaming, split and sparse
    attention can take its attention over (Bloom, MPT and other models with their own attention code do not):
    transformers' own test where this release has it (a look at the model's source), and every module that updates
    the cache attends through the interface too (GIT's text attention multiplies the K/V itself)."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        return False
    return all(_attends_through_interface(type(module)) for module in model.modules()  # type: ignore[arg-type]
               if isinstance(getattr(module, "layer_idx", None), int))


# ``past_key_values.update(``, ``curr_past_key_values.update(`` (T5), ``self_attention_cache.update(``, ...
_UPDATES_THE_CACHE = re.compile(r"\b\w*(cache|past_key_values?|layer_past)\w*\.update\(")


@functools.cache
def _attends_through_interface(module_class: type[torch.nn.Module]) -> bool:
    """Whether a module class whose ``forward`` updates the cache also calls the attention interface there (a
    module whose source cannot be read is given the benefit of the doubt)."""
    try:
        source = inspect.getsource(module_class.forward)
    except (OSError, TypeError):
        return True
    return not _UPDATES_THE_CACHE.search(source) or "ALL_ATTENTION_FUNCTIONS" in source or \
        "attention_interface" in source


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword this transformers release's ``forward`` takes the cache by: ``cache`` (newer 5.x, where
    ``past_key_values`` warns that it goes away) or ``past_key_values`` (earlier 5.x, e.g. 5.17, where a
    ``cache=`` would land in ``**kwargs`` and be ignored: decoding without the cache)."""
    # torch's stubs declare Module.__hash__ in a way mypy does not count as Hashable; classes are hashable
    return _cache_keyword(type(model))  # type: ignore[arg-type]


@functools.cache
def _cache_keyword(model_class: type[torch.nn.Module]) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
