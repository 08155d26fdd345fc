"""How executors that replace the attention function plug into a transformers model.

``cache.streaming(model)`` / ``cache.sparse(model)`` / ``cache.split(model)`` return an :class:`Engagement`:
entered, it pushes its :class:`~tierkv.hf.runtime.Mode` and points the model's attention at
:data:`STREAMING_ATTENTION`, which hands each layer's query to its :meth:`~tierkv.hf.layer.TieredLayer.attend`;
on exit the model is the user's again.
An engagement that is made but never entered (``cache.streaming(model)`` as a plain statement) would decode
with exact gather while the caller believes otherwise: the cache's next forward raises instead.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch

from tierkv.atomic import deferred_interrupts
from tierkv.errors import InvalidConfigError, TierKVError
from tierkv.hf.runtime import Mode

if TYPE_CHECKING:
    from tierkv.attention.sparse import SparseBudget
    from tierkv.hf.cache import TieredCache

STREAMING_ATTENTION = "tierkv_streaming"  # the AttentionInterface name of the executors that attend themselves


def streaming_mode(chunk_tokens: int, budget: SparseBudget | None = None) -> Mode:
    """Multi-token steps stream in chunks of ``chunk_tokens``; one-token steps too, or sparsely within ``budget``."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise InvalidConfigError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}.")
    options = {"streaming": {"chunk_tokens": chunk_tokens}}
    return Mode("streaming", "streaming" if budget is None else "sparse", options, budget)


def split_mode(chunk_tokens: int) -> Mode:
    """Multi-token steps stream in chunks of ``chunk_tokens``; one-token steps attend each tier's share in place."""
    options = {**streaming_mode(chunk_tokens).options, "split": {"piece_tokens": chunk_tokens}}
    return Mode("streaming", "split", options)


class Engagement:
    """``with cache.streaming(model):`` — the model attends through ``mode``'s executors inside the block."""

    def __init__(self, cache: TieredCache, model: Any, mode: Mode, what: str) -> None:
        self.cache, self.model, self.mode, self.what = cache, model, mode, what
        self.entered = False
        self.previous: str | None = None
        self.modules: list[Any] = []
        cache.unentered = self

    def __enter__(self) -> TieredCache:
        cache = self.cache
        if cache.unentered is self:
            cache.unentered = None
        self.entered = True
        _register_streaming_attention()
        self.previous = self.model.config._attn_implementation
        self.modules = [m for m in self.model.modules() if isinstance(getattr(m, "layer_idx", None), int)]
        if not takes_attention_functions(self.model):
            raise InvalidConfigError(self._not_an_interface())
        cache.runtime.push(self.mode)  # exact-gather staging is released: the new mode may need all the budget
        try:  # every change to the user's model happens inside the try, so a failure undoes all of it
            for module in self.modules:
                module._tierkv_cache = cache
            self.model.set_attn_implementation(STREAMING_ATTENTION)
            if self.model.config.get_text_config(decoder=True)._attn_implementation != STREAMING_ATTENTION:
                raise InvalidConfigError(self._not_an_interface())
        except BaseException:
            self._restore()
            raise
        return cache

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _not_an_interface(self) -> str:
        return (f"{type(self.model).__name__} attends with its own code, not through transformers' "
                f"AttentionInterface, so `cache.{self.what}(model)` cannot take its attention over. Decode it with "
                f"exact gather: leave out the `with cache.{self.what}(model)` block (outputs equal DynamicCache's).")

    def _restore(self) -> None:
        with deferred_interrupts():  # a Ctrl-C while leaving waits until the model is the user's again
            try:
                self.cache.runtime.pop()
            finally:  # the model is restored even if the executors' bookkeeping fails
                for module in self.modules:
                    module.__dict__.pop("_tierkv_cache", None)
                self.model.set_attn_implementation(self.previous)

    def refuse(self) -> None:
        """The cache is used without this engagement having been entered: say so (once)."""
        self.entered = True  # reported: no warning when it is collected
        raise InvalidConfigError(f"cache.{self.what}(model) was called but never entered, so this forward would not "
                                 f"attend as asked; use it as a context manager: `with cache.{self.what}(model): "
                                 "model.generate(...)`.")

    def __del__(self) -> None:
        if not self.entered:
            warnings.warn(f"cache.{self.what}(model) was never entered (use `with cache.{self.what}(model): ...`); "
                          "it had no effect.", RuntimeWarning, stacklevel=2)


def _streaming_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                                 scaling: float | None = None, dropout: float = 0.0, softcap: float | None = None,
                                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function for ``TieredCache.streaming``: ``key``/``value`` are only this step's
    tokens (already stored); attention runs over everything the cache holds for ``module.layer_idx``."""
    cache = getattr(module, "_tierkv_cache", None)
    if cache is None:
        raise TierKVError(f"attention '{STREAMING_ATTENTION}' runs only inside `with cache.streaming(model):`.")
    if module.training and dropout:
        raise TierKVError("streaming attention is for inference; call model.eval() (dropout is not supported).")
    if module.layer_idx >= len(cache.layers):
        raise TierKVError("inside `cache.streaming(model)` the model must be called with that cache "
                          "(cache=cache); another cache was passed, or none.")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")  # gpt-oss: a learnt logit per query head that takes softmax mass and no value
    return cache.layers[module.layer_idx].attend(key, query, attention_mask, scale, softcap, sinks), None


@functools.cache
def _register_streaming_attention() -> None:
    """Register the attention function and its (boolean, sdpa-style) mask builder once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(STREAMING_ATTENTION, _streaming_attention_forward)
    AttentionMaskInterface.register(STREAMING_ATTENTION, sdpa_mask)


def takes_attention_functions(model: torch.nn.Module) -> bool:
    """Whether ``model`` attends through transformers' AttentionInterface, so that streaming, split and sparse
    attention can take its attention over (Bloom, MPT and other models with their own attention code do not):
    transformers' own test where this release has it (a look at the model's source), else True (the engagement
    then checks that the implementation took)."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    return bool(can_set()) if callable(can_set) else True


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword this transformers release's ``forward`` takes the cache by: ``cache`` (newer 5.x, where
    ``past_key_values`` warns that it goes away) or ``past_key_values`` (earlier 5.x, e.g. 5.17, where a
    ``cache=`` would land in ``**kwargs`` and be ignored: decoding without the cache)."""
    # torch's stubs declare Module.__hash__ in a way mypy does not count as Hashable; classes are hashable
    return _cache_keyword(type(model))  # type: ignore[arg-type]


@functools.cache
def _cache_keyword(model_class: type[torch.nn.Module]) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
