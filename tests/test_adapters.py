"""A model with LoRA adapters (peft) computes other K/V under each adapter, and other again with them turned off,
while its parameters and config stay the same: stored K/V and conversation files are one adapter's, never
another's. Prompt learning (peft's prompt and prefix tuning) adds K/V of its own to what the ids compute: none of
it is persisted under the ids."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import reuse_prefix, stored_blocks
from models import tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.errors import InvalidConfigError
from tierkv.persist.keys import model_fingerprint

peft = pytest.importorskip("peft")


def lora_model() -> torch.nn.Module:
    """A tiny Llama with two LoRA adapters "a" and "b" of random (non-zero) weights (peft edits the model it
    wraps: a copy of the shared one)."""
    torch.manual_seed(0)
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
              "init_lora_weights": False}
    model = peft.get_peft_model(copy.deepcopy(tiny_model("llama")), peft.LoraConfig(**config), adapter_name="a")
    model.add_adapter("b", peft.LoraConfig(**config))
    return model.eval()


def applying(model: torch.nn.Module, adapter: str) -> contextlib.AbstractContextManager:
    """Adapter ``adapter`` active, or "off": every adapter turned off (the base model)."""
    if adapter == "off":
        return model.disable_adapter()
    model.set_adapter(adapter)
    return contextlib.nullcontext()


def test_a_prefix_stored_under_one_adapter_is_not_loaded_under_another(tmp_path):
    model = lora_model()
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(5))

    def turn(adapter: str) -> int:
        with applying(model, adapter):
            return reuse_prefix(model, ids, tmp_path)

    assert turn("a") == 0
    assert turn("b") == 0  # adapter a's blocks are not b's
    assert turn("off") == 0  # nor the base model's
    assert turn("a") == 32  # the same adapter reuses its own (four full 8-token blocks before the last token)
    fingerprints = set()
    for adapter in ("a", "b", "off"):
        with applying(model, adapter):
            fingerprints.add(model_fingerprint(model))
    assert len(fingerprints) == 3


def test_a_conversation_saved_under_one_adapter_is_refused_under_another(tmp_path):
    model = lora_model()
    ids = torch.randint(2, 128, (1, 24), generator=torch.Generator().manual_seed(6))
    model.set_adapter("a")
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=8) as cache, torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        cache.save(tmp_path / "c.tkv", model=model)
    model.set_adapter("b")
    with pytest.raises(InvalidConfigError, match="saved from another model"):
        TieredCache.load(tmp_path / "c.tkv", model=model, gpu_gb="1MB", cpu_gb="1MB")
    model.set_adapter("a")
    with TieredCache.load(tmp_path / "c.tkv", model=model, gpu_gb="1MB", cpu_gb="1MB") as loaded:
        assert loaded.get_seq_length() == 24


def test_an_adapter_switched_mid_sequence_persists_nothing_after_the_switch(tmp_path):
    model = lora_model()
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    options = {"gpu_gb": "1MB", "cpu_gb": "1MB", "disk_dir": tmp_path, "persist": True, "block_tokens": 8,
               "config": model.config}
    model.set_adapter("a")
    with TieredCache(**options) as cache, torch.no_grad():
        assert cache.load_prefix(model, ids) == 0
        model(input_ids=ids[:, :16], past_key_values=cache)
        model.set_adapter("b")  # the rest is computed by another model
        model(input_ids=ids[:, 16:], past_key_values=cache)
    model.set_adapter("a")
    with TieredCache(**options) as cache, torch.no_grad():
        loaded = cache.load_prefix(model, ids)
        logits = model(input_ids=ids[:, loaded:], past_key_values=cache).logits[0, -1]
    assert loaded <= 16
    reference = model(input_ids=ids, past_key_values=DynamicCache()).logits[0, -1]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)


def prompt_learning_model(kind: str) -> torch.nn.Module:
    """A tiny Llama with a peft prompt-learning adapter of 4 virtual tokens: "prompt" tuning (embeddings before the
    ids) or "prefix" tuning (learned K/V in front of a cache of its own)."""
    torch.manual_seed(0)
    config = (peft.PromptTuningConfig if kind == "prompt" else peft.PrefixTuningConfig)(task_type="CAUSAL_LM",
                                                                                         num_virtual_tokens=4)
    return peft.get_peft_model(copy.deepcopy(tiny_model("llama")), config).eval()


@pytest.mark.parametrize("kind", ["prompt", "prefix"])
def test_prompt_learning_persists_nothing_and_never_loads_the_base_models_blocks(tmp_path, kind, caplog):
    model = prompt_learning_model(kind)
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(8))

    def turn() -> int:
        with caplog.at_level("INFO", logger="tierkv"):
            return reuse_prefix(model, ids, tmp_path)

    assert turn() == 0
    assert stored_blocks(tmp_path) == 0  # the cache held 44 (prompt) or 0 (prefix) tokens for 40 ids
    assert "nothing is persisted" in caplog.text
    with model.disable_adapter():
        assert turn() == 0  # the base model stores its own blocks
        assert turn() == 32
    assert stored_blocks(tmp_path) == 5
    assert turn() == 0  # not the base model's


def test_a_conversation_saved_with_prompt_tuning_is_refused_without_it(tmp_path):
    model = prompt_learning_model("prompt")
    ids = torch.randint(2, 128, (1, 24), generator=torch.Generator().manual_seed(9))
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=8) as cache, torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        cache.save(tmp_path / "c.tkv", model=model)
    with model.disable_adapter(), pytest.raises(InvalidConfigError, match="saved from another model"):
        TieredCache.load(tmp_path / "c.tkv", model=model, gpu_gb="1MB", cpu_gb="1MB")
    with TieredCache.load(tmp_path / "c.tkv", model=model, gpu_gb="1MB", cpu_gb="1MB") as loaded:
        assert loaded.get_seq_length() == 28  # 4 virtual tokens and the ids


def test_the_model_a_prompt_tuned_peft_model_wraps_never_takes_the_base_models_blocks(tmp_path):
    """``PeftModel.generate`` runs the model it wraps, whose own fingerprint is the plain model's: over blocks that
    plain use stored, the prompt-tuned forwards are refused (its virtual tokens would follow K/V computed without
    them), and on a fresh cache they persist nothing."""
    model = prompt_learning_model("prompt")
    inner = model.get_base_model()
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(10))
    with model.disable_adapter():
        assert reuse_prefix(inner, ids, tmp_path) == 0
        assert reuse_prefix(inner, ids, tmp_path) == 32
    stored = stored_blocks(tmp_path)
    options = {"gpu_gb": "1MB", "cpu_gb": "1MB", "disk_dir": tmp_path, "persist": True, "block_tokens": 8,
               "config": inner.config}
    with TieredCache(**options) as cache, torch.no_grad():
        assert cache.load_prefix(inner, ids) == 32
        with pytest.raises(InvalidConfigError, match="peft's prompt learning drives this model's forwards"):
            model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    other = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(11))
    with TieredCache(**options) as cache, torch.no_grad():
        assert cache.load_prefix(inner, other) == 0
        model.generate(input_ids=other, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert stored_blocks(tmp_path) == stored  # nothing of the prompt-tuned run
