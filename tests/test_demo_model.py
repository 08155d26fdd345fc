"""The shipped demo model: it loads, it retrieves, and the eval harness runs end to end (CPU, seconds)."""

from __future__ import annotations

import argparse
import json

import pytest

from tierkv.demo.evaluate import evaluate, greedy_generate, plot_heatmap
from tierkv.demo.model import DemoWeightsMissingError, load_demo_model
from tierkv.demo.task import make_example
from tierkv.errors import InvalidConfigError


@pytest.fixture(scope="module")
def demo():
    return load_demo_model()


def test_missing_weights_say_how_to_train(tmp_path):
    with pytest.raises(DemoWeightsMissingError, match="python -m tierkv.demo.train --out"):
        load_demo_model(path=tmp_path)


def test_model_is_small_gqa_llama(demo):
    model, tokenizer = demo
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert len(tokenizer) == model.config.vocab_size


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_retrieves_passkey_at_2k(demo, seed):
    model, tokenizer = demo
    ex = make_example(seed, 2048, depth=[0.1, 0.5, 0.9][seed])
    ids = greedy_generate(model, ex.prompt_ids, len(ex.answer_ids), prefill_chunk_size=512)
    assert tokenizer.decode(ids).replace(" ", "") == ex.answer


def test_evaluate_tiny_with_cache_factory(demo, tmp_path):
    from transformers import DynamicCache

    model, tokenizer = demo
    made = []

    def factory():
        made.append(DynamicCache(config=model.config))
        return made[-1]

    result = evaluate(model, tokenizer, lengths=[512, 1024], depths=[0.0, 1.0], samples=1, cache_factory=factory)
    assert len(made) == len(result.trials) == 4
    assert made[0].get_seq_length() == 512  # the prompt (a one-token answer is never fed back)
    assert 0.0 <= result.accuracy() <= 1.0
    record = result.to_dict()
    assert set(record["accuracy"]) == {"512", "1024"}
    png = plot_heatmap(result, tmp_path / "heat.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_eval_command_json(tmp_path, capsys):
    from tierkv.commands import eval as eval_command

    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    args = parser.parse_args(
        ["--lengths", "512", "--depths", "0.5", "--samples", "1", "--json", "--out", str(tmp_path)]
    )
    assert eval_command.run(args) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["lengths"] == [512] and len(record["trials"]) == 1
    assert (tmp_path / "heatmap.png").is_file() and (tmp_path / "eval.json").is_file()


def test_bad_eval_arguments(demo):
    model, tokenizer = demo
    with pytest.raises(InvalidConfigError, match="depths"):
        evaluate(model, tokenizer, lengths=[512], depths=[2.0], samples=1)
    with pytest.raises(InvalidConfigError, match="samples"):
        evaluate(model, tokenizer, lengths=[512], samples=0)


@pytest.mark.parametrize("executor", ["streaming", "gather"])
def test_eval_command_tiered_cache_gives_the_same_answers(tmp_path, capsys, monkeypatch, executor):
    """`tierkv eval --cache tiered`: every trial through all three tiers, same outputs as full attention."""
    from tierkv import TieredCache
    from tierkv.commands import eval as eval_command

    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    common = ["--lengths", "1K,2K", "--depths", "0,1", "--samples", "1", "--json"]
    assert eval_command.run(parser.parse_args(common)) == 0
    reference = json.loads(capsys.readouterr().out)
    from_disk, close = [], TieredCache.close

    def close_and_count(cache):
        from_disk.append(cache.stats()["bytes_moved"].get("disk->device", 0))
        close(cache)

    monkeypatch.setattr(TieredCache, "close", close_and_count)
    budgets = ["--chunk-tokens", "256", "--gpu-gb", "600KB"] if executor == "streaming" else ["--gpu-gb", "3MB"]
    tiered = ["--cache", "tiered", "--executor", executor, "--cpu-gb", "256KB", "--disk-dir", str(tmp_path), *budgets]
    assert eval_command.run(parser.parse_args(common + tiered)) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["cache"]["mode"] == "tiered" and record["cache"]["executor"] == executor
    assert [t["output"] for t in record["trials"]] == [t["output"] for t in reference["trials"]]
    assert len(from_disk) == 4 and all(n > 0 for n in from_disk[2:])  # the 2K trials read KV back from disk
    assert not list(tmp_path.iterdir())  # every trial's cache was closed and its disk files removed


def test_loading_prints_no_progress_bar_and_keeps_the_users_setting(capsys):
    from transformers.utils import logging as hf_logging

    from tierkv.demo.model import load_demo_model

    load_demo_model()
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
