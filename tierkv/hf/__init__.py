"""The transformers integration: :class:`TieredCache` (a ``Cache``) and its :class:`TieredLayer` s.

Modules, cut along transformers' own lines: :mod:`~tierkv.hf.cache` (the cache: layers, resources, executor
modes, forward rollback), :mod:`~tierkv.hf.layer` (one layer's state and step), :mod:`~tierkv.hf.runtime`
(store, mover, executors), :mod:`~tierkv.hf.attention` (the attention function of ``streaming()`` /
``sparse()``), :mod:`~tierkv.hf.conversation` (save / load), :mod:`~tierkv.hf.turn` (a moment between two
forwards for a save or an executor switch from another thread), :mod:`~tierkv.hf.session` (prefix persistence)
and :mod:`~tierkv.hf.sizing` (device budgets and checks from a model config).
"""

from tierkv.hf.attention import STREAMING_ATTENTION, cache_keyword
from tierkv.hf.cache import TieredCache
from tierkv.hf.encoder_decoder import TieredEncoderDecoderCache
from tierkv.hf.layer import TieredLayer
from tierkv.hf.sizing import (
    DEFAULT_BLOCK_TOKENS,
    kv_bytes_held,
    kv_bytes_per_token,
    min_device_bytes,
    min_streaming_device_bytes,
    rest_copy_bytes,
)

__all__ = ["DEFAULT_BLOCK_TOKENS", "STREAMING_ATTENTION", "TieredCache", "TieredEncoderDecoderCache", "TieredLayer",
           "cache_keyword", "kv_bytes_held", "kv_bytes_per_token", "min_device_bytes", "min_streaming_device_bytes",
           "rest_copy_bytes"]
