"""Multimodal models whose towers attend with different implementations, through ``cache.streaming/split(model)``:

- each (sub-)config gets its own implementation back when the block ends, so the model is the user's again: a
  PaliGemma 2 (Gemma2 text model: eager only; wrapper and SigLIP tower: sdpa) and a Gemma 3 with a mix the user
  chose (eager text, sdpa vision), also when entering is refused after the switch;
- such a model engages again and decodes as ``DynamicCache`` does, token for token (logits within 1e-4);
- a model engaged while its config still names tierkv's own attention is refused with the fix, not a recursion;
- a vision or audio tower's config is refused as the cache's config, with the text model's config as the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from helpers import assert_same_generation
from models import PAD, VOCAB, prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.errors import InvalidConfigError, TierKVError
from tierkv.hf import attention as engagement
from tierkv.hf import cache_keyword

ATOL = 1e-4
IMAGE = VOCAB - 1
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, pad_token_id=PAD, bos_token_id=1, eos_token_id=None, max_position_embeddings=256,
            num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def instantiate(model_class: type, config: transformers.PreTrainedConfig) -> transformers.PreTrainedModel:
    torch.manual_seed(99)
    model = model_class(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def paligemma2() -> tuple[transformers.PreTrainedModel, dict]:
    """A tiny PaliGemma 2: a Gemma2 text model (sliding and full layers) under a SigLIP tower, with an image."""
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=8, patch_size=4)
    config = transformers.PaliGemmaConfig(vision_config=vision, text_config=transformers.Gemma2Config(**TEXT),
                                          image_token_id=IMAGE, projection_dim=64, hidden_size=64)
    ids = torch.cat([torch.tensor([[IMAGE] * 4 + [1]]), prompt(1, 10, seed=3)[0]], 1)
    pixels = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "pixel_values": pixels}
    return instantiate(transformers.PaliGemmaForConditionalGeneration, config), inputs


def gemma3() -> tuple[transformers.PreTrainedModel, dict]:
    """A tiny Gemma 3 with a SigLIP tower, with an image."""
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=16, patch_size=4)
    config = transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**TEXT), vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=VOCAB - 2,
                                       eoi_token_index=VOCAB - 3, tie_word_embeddings=False)
    ids = torch.cat([torch.tensor([[1, VOCAB - 2] + [IMAGE] * 4 + [VOCAB - 3]]), prompt(1, 10, seed=3)[0]], 1)
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "token_type_ids": (ids == IMAGE).long(), "pixel_values": pixels}
    return instantiate(transformers.Gemma3ForConditionalGeneration, config), inputs


def generate(model: transformers.PreTrainedModel, inputs: dict, cache) -> object:
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=6, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **{cache_keyword(model): cache})  # fmt: skip


def implementations(model: transformers.PreTrainedModel) -> dict[str, str]:
    """The implementation each config of the model names, and the first text attention module's."""
    config = model.config
    return {"": config._attn_implementation, "text": config.text_config._attn_implementation,
            "vision": config.vision_config._attn_implementation,
            "module": model.model.language_model.layers[0].self_attn.config._attn_implementation}


def engaged_generation(tmp_path, model, inputs: dict, executor: str) -> object:
    with TieredCache(gpu_gb="64MB", cpu_gb="1KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache, \
            getattr(cache, executor)(model, chunk_tokens=8):
        return generate(model, inputs, cache)


@pytest.mark.parametrize("executor", ["streaming", "split"])
def test_paligemma2_gets_each_tower_its_own_implementation_back_and_engages_again(tmp_path, executor):
    """Leaving the block gave every tower the wrapper's sdpa, which Gemma2 refuses: the exit raised, the text model
    kept tierkv's attention, and the next plain generate recursed. Now each config gets its own back."""
    model, inputs = paligemma2()
    before = implementations(model)
    assert before["text"] == "eager" or before["text"] == before[""]  # (eager where Gemma2 refuses sdpa)
    reference = generate(model, inputs, DynamicCache(config=model.config))
    for turn in range(2):
        assert_same_generation(engaged_generation(tmp_path / str(turn), model, inputs, executor), reference, ATOL)
        assert implementations(model) == before
    assert_same_generation(generate(model, inputs, DynamicCache(config=model.config)), reference, ATOL)


def test_a_mix_of_implementations_the_user_chose_is_kept(tmp_path):
    """The block ended with every tower on the wrapper's implementation (text: sdpa, not the user's eager)."""
    model, inputs = gemma3()
    model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    before = implementations(model)
    assert before["text"] == before["module"] == "eager" and before["vision"] == "sdpa"
    reference = generate(model, inputs, DynamicCache(config=model.config))
    assert_same_generation(engaged_generation(tmp_path, model, inputs, "streaming"), reference, ATOL)
    assert implementations(model) == before


def test_an_engagement_refused_after_the_switch_gives_each_tower_its_own_back(tmp_path, monkeypatch):
    """An engagement that refuses the model after switching it undid the switch with the wrapper's one name."""
    model, inputs = paligemma2()
    before = implementations(model)
    monkeypatch.setattr(engagement, "_kept_its_own", lambda module: True)  # (as T5's stacks' copies of the config)
    with TieredCache(gpu_gb="64MB", cpu_gb="1KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache, \
            pytest.raises(InvalidConfigError, match="cannot take its attention over"), cache.streaming(model):
        pass
    assert implementations(model) == before


def test_a_model_engaged_while_it_names_tierkv_attention_is_refused_not_recursed(tmp_path):
    """A copy made inside a block keeps tierkv's name as its implementation; engaged itself, its forward through
    another cache ran that name's function, which is itself: a RecursionError."""
    model = tiny_model("llama")
    ids, mask = prompt(1, 9, seed=4)
    with TieredCache(gpu_gb="64MB", cpu_gb="1KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        with cache.streaming(model, chunk_tokens=8):
            twin = copy.deepcopy(model)
        with cache.streaming(twin, chunk_tokens=8), \
                pytest.raises(TierKVError, match=r"still named 'tierkv_streaming'.*set_attn_implementation\('sdpa'\)"):
            twin.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                          **{cache_keyword(twin): DynamicCache(config=twin.config)})


@pytest.mark.parametrize("tower", ["vision_config", "audio_config"])
def test_a_vision_or_audio_towers_config_is_refused_with_the_text_config_as_the_fix(tmp_path, tower):
    """A SigLIP or audio encoder's config has layers, so it was sized and decoded with as the language model's."""
    if tower == "vision_config":
        config = gemma3()[0].config
    else:
        config = transformers.Qwen2AudioConfig(audio_config=transformers.Qwen2AudioEncoderConfig(),
                                               text_config=transformers.Qwen2Config(**{
                                                   key: TEXT[key] for key in ("vocab_size", "hidden_size",
                                                                              "num_attention_heads")}))
    fix = r"not tokens.*config=model.config.*text_config or model.config.get_text_config\(\)"
    with pytest.raises(InvalidConfigError, match=fix):
        TieredCache.min_device_bytes(getattr(config, tower), 64, 1, 4)
    with pytest.raises(InvalidConfigError, match=fix):
        TieredCache(gpu_gb="64MB", cpu_gb="1KB", disk_dir=tmp_path, block_tokens=4, config=getattr(config, tower))
    assert TieredCache.min_device_bytes(config.text_config, 64, 1, 4) == TieredCache.min_device_bytes(config, 64, 1, 4)


def test_the_decoders_transformers_lists_are_not_taken_for_encoders():
    """Every causal and image-text-to-text LM config of this transformers release (text config: the one sized)."""
    from transformers.models.auto import modeling_auto

    from tierkv.hf.sizing import _is_an_encoder

    names = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    names |= set(getattr(modeling_auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {}))
    taken = []
    for name in sorted(names):
        try:
            config = transformers.AutoConfig.for_model(name)
        except Exception:  # (a config that needs arguments or packages this environment lacks)
            continue
        if type(config).__name__.endswith("VisionConfig"):  # (5.0 maps "pixtral", a vision tower's type, to Llava)
            continue
        if _is_an_encoder(config.get_text_config(decoder=True)):
            taken.append(name)
    assert taken == []
