"""A TieredCache as an encoder-decoder model's self-attention cache (T5, BART, Whisper).

transformers' ``EncoderDecoderCache`` holds the decoder's self-attention K/V in one cache and the cross-attention
K/V (computed once from the encoder) in another. Its ``crop`` and batch edits — what assisted decoding, prompt
lookup and contrastive search call — accept only ``DynamicCache`` halves (a ``StaticCache`` cannot give tokens
back) and raise a ``TypeError`` for any other; a TieredCache can (:meth:`TieredCache.crop`, its row selection).
:class:`TieredEncoderDecoderCache` is that wrapper with the check widened to a TieredCache self-attention half,
so those generation modes decode as with two ``DynamicCache`` s: ``cache.encoder_decoder()`` makes one.
"""

from __future__ import annotations

from transformers.cache_utils import DynamicCache, EncoderDecoderCache


class TieredEncoderDecoderCache(EncoderDecoderCache):
    """``EncoderDecoderCache(tiered, DynamicCache())`` whose crop and batch edits take the TieredCache half."""

    def check_dynamic_cache(self, method: str) -> None:
        from tierkv.hf.cache import TieredCache

        if isinstance(self.self_attention_cache, TieredCache) and \
                isinstance(self.cross_attention_cache, (DynamicCache, TieredCache)):  # fmt: skip
            return
        super().check_dynamic_cache(method)
