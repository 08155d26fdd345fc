"""Tiny, randomly initialised Hugging Face decoder models shared by the transformers integration tests.

Every model is fp32, ``.eval()``, built from a fixed seed, and small enough that a forward pass costs a few
milliseconds on one CPU core: hidden 64, 4 query heads, 2 KV heads (head_dim 16), vocab 128.
Models are cached per (family, attention implementation, sliding window); never mutate them in a test.
"""

from __future__ import annotations

import functools

import torch
import transformers

VOCAB = 128
PAD = 0
BOS = 1

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=None,
    tie_word_embeddings=False,
)

FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # layers: sliding, full (Gemma2's alternating default), with soft-capping on
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"query_pre_attn_scalar": 16, "sliding_window": 4096}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}
MODEL_NAMES = tuple(FAMILIES)


@functools.cache
def tiny_model(family: str, attn: str = "sdpa", sliding_window: int | None = None,
               layers: int | None = None) -> transformers.PreTrainedModel:
    """A tiny ``family`` model. ``sliding_window`` overrides the config's (Mistral, Gemma2); ``layers`` the
    number of decoder layers (2 by default)."""
    config_name, model_name, extra = FAMILIES[family]
    kwargs = {**COMMON, **extra}
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(1234)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.set_attn_implementation(attn)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    model.generation_config.bos_token_id = BOS
    return model


def prompt(batch: int, length: int, seed: int = 0,
           left_pad: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids ``[batch, length]`` (never PAD/BOS) and their attention mask; row ``i`` gets
    ``left_pad[i]`` padding tokens on the left."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(left_pad):
        ids[row, :pad] = PAD
        mask[row, :pad] = 0
    return ids, mask


def small_llama() -> transformers.LlamaForCausalLM:
    """A fresh 2-layer Llama (seed 0) whose KV sizes the cache-error and reliability tests' budgets assume."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(config).eval()
