"""The ``min_*_device_bytes`` helpers against what unusual architectures actually store: configs that spell their
heads otherwise (GPT-2, multi-query GPT-BigCode, Falcon's ``num_kv_heads``), values wider or narrower than keys
with sliding layers of more KV heads (MiMo-V2-Flash), and configs with no attention at all (RWKV, xLSTM)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from helpers import assert_same_generation
from models import prompt
from transformers import DynamicCache

from tierkv import InvalidConfigError, TieredCache

SMALL = dict(vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=None)
SLACK = 512  # bytes: the helpers' numbers are the minimum, as the sizing helpers give them
NEW = 6

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4)),
    "gpt_bigcode_mqa": ("gpt_bigcode", dict(n_embd=64, n_layer=2, n_head=4, multi_query=True)),
    "falcon_kv_heads": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                                       new_decoder_architecture=True)),
    "mimo_wide_values": ("mimo_v2_flash", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                               v_head_dim=128, sliding_window=24)),
    "mimo_narrow_values": ("mimo_v2_flash", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                 v_head_dim=16, sliding_window=24)),
}
TWO_WIDTHS = {"mimo_wide_values", "mimo_narrow_values"}  # streaming, split and sparse refuse them


def tiny(name: str) -> transformers.PreTrainedModel:
    model_type, extra = CONFIGS[name]
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.generation_config.eos_token_id = None
    return model


def generate(model: transformers.PreTrainedModel, ids: torch.Tensor, cache: Any) -> Any:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, cache=cache, output_logits=True,
                              return_dict_in_generate=True)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_min_device_bytes_decodes_with_prefetch_on(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                   name: str) -> None:
    """``min_device_bytes`` (+ a little slack) decodes exactly, K/V spilled to disk, reading a layer ahead: the
    README's "what suffices (prefetching on)". MiMo's values wider than its keys were refused at it (its
    sliding layers keep twice the KV heads, values of ``v_head_dim``), narrower ones ran with prefetch off."""
    model = tiny(name)
    ids, _ = prompt(1, 40, seed=3)
    reference = generate(model, ids, DynamicCache(config=model.config))
    need = TieredCache.min_device_bytes(model.config, 40 + NEW, block_tokens=8, device="cpu")
    with caplog.at_level(logging.WARNING, logger="tierkv"), \
            TieredCache(gpu_gb=f"{need + SLACK}B", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=8,
                        config=model.config) as cache:  # fmt: skip
        out = generate(model, ids, cache)
        assert cache.stats()["blocks"]["disk"] > 0
    assert "prefetch is off" not in caplog.text
    assert_same_generation(out, reference, atol=1e-4)


@pytest.mark.parametrize("executor", ["streaming", "split"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_streaming_and_split_minimums_decode_or_are_refused_up_front(tmp_path: Path, name: str,
                                                                     executor: str) -> None:
    """``min_streaming_device_bytes`` / ``min_split_device_bytes`` (+ slack) run their executor to the end, K/V on
    disk; for a model whose keys and values differ in width (which both executors refuse at the first step) the
    helper refuses by name instead of returning a budget no run could use."""
    model = tiny(name)
    helper = {"streaming": TieredCache.min_streaming_device_bytes, "split": TieredCache.min_split_device_bytes}
    if name in TWO_WIDTHS:
        with pytest.raises(InvalidConfigError, match=f"keys of .* values of .*cache.{executor}.*exact gather"):
            helper[executor](model.config, block_tokens=8, chunk_tokens=16, device="cpu")
        return
    ids, _ = prompt(1, 40, seed=3)
    reference = generate(model, ids, DynamicCache(config=model.config))
    need = helper[executor](model.config, block_tokens=8, chunk_tokens=16, device="cpu")
    with TieredCache(gpu_gb=f"{need + SLACK}B", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=8,
                     config=model.config) as cache:  # fmt: skip
        with getattr(cache, executor)(model, chunk_tokens=16):
            out = generate(model, ids, cache)
        assert cache.stats()["blocks"]["disk"] > 0
    assert_same_generation(out, reference, atol=1e-4)


@pytest.mark.parametrize(("model_type", "extra"), [
    ("rwkv", dict(hidden_size=64, num_hidden_layers=2, attention_hidden_size=64)),
    ("xlstm", dict(hidden_size=64, num_hidden_layers=2)),
])
def test_a_config_with_no_attention_heads_is_refused_by_name(model_type: str, extra: dict[str, Any]) -> None:
    """RWKV and xLSTM name no attention heads (they keep their own state, never the cache's K/V): each helper
    says so and what to do (it was an AttributeError on ``num_attention_heads``)."""
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **extra)
    for helper in (lambda c: TieredCache.min_device_bytes(c, 128), TieredCache.min_streaming_device_bytes,
                   TieredCache.min_split_device_bytes):
        with pytest.raises(InvalidConfigError, match="names no attention heads.*default cache"):
            helper(config)


def test_mimo_sizes_each_layer_as_its_attention_stores_it() -> None:
    """MiMo-V2-Flash's sliding layers keep twice ``num_key_value_heads``, its values ``v_head_dim`` wide (stored
    at the wider of keys and values): the helpers' per-layer shapes match what DynamicCache holds."""
    from tierkv.hf import sizing

    model = tiny("mimo_wide_values")
    cache = DynamicCache(config=model.config)
    generate(model, prompt(1, 10, seed=3)[0], cache)
    held = [(layer.keys.shape[1], max(layer.keys.shape[-1], layer.values.shape[-1])) for layer in cache.layers]
    assert [(layout.kv_heads, layout.head_dim) for layout in sizing.layer_layouts(model.config, 8, None)] == held
    assert sizing.kv_widths(model.config) == (16, 128)


def test_a_config_without_decoder_layers_is_refused_by_name(tmp_path):
    """An encoder's config (a vision tower's) has no decoder layers to size or hold: refused with the fix, by the
    sizing helpers and the cache alike, not an AttributeError."""
    config = transformers.PreTrainedConfig()
    for attempt in (lambda: TieredCache.min_device_bytes(config, 64),
                    lambda: TieredCache.min_streaming_device_bytes(config),
                    lambda: TieredCache(gpu_gb="1MB", disk_dir=tmp_path, config=config)):
        with pytest.raises(InvalidConfigError, match=r"names no decoder layers .*pass the language model's config"):
            attempt()
