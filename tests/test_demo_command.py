"""`tierkv demo` end to end: all three tiers used, tokens checked against DynamicCache, JSON written."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tierkv.cli import main

KEYS = {"context", "expected", "answer", "match", "bytes_resident", "bytes_moved", "decode_tokens_per_s"}


@pytest.mark.parametrize("executor", ["streaming", "gather"])
def test_random_model_demo_uses_every_tier_and_matches_reference(tmp_path, executor):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--random-model", "--context", "1024", "--executor", executor, "--block-tokens", "16",
               "--prefill-chunk", "256", "--chunk-tokens", "256", "--max-new-tokens", "4", "--disk-dir",
               str(tmp_path / "disk"), "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result.keys() >= KEYS
    assert result["tokens_match_reference"] is True
    assert all(result["bytes_resident"][tier] > 0 for tier in ("device", "host", "disk"))
    assert result["budgets"]["device"] < result["kv_bytes"]
    assert not list((tmp_path / "disk").glob("tierkv-*"))  # files removed on exit


def test_local_checkpoint_with_prompt_file(tmp_path):
    words = ["<unk>"] + [f"w{i}" for i in range(63)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(tmp_path / "ckpt")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(f"w{(i * 7) % 63}" for i in range(600)))
    out = tmp_path / "demo.json"
    rc = main(["demo", "--model", str(tmp_path / "ckpt"), "--prompt-file", str(prompt), "--block-tokens", "16",
               "--chunk-tokens", "128", "--max-new-tokens", "3", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["context"] == 600 and result["expected"] is None
    assert result["tokens_match_reference"] is True


def test_model_without_prompt_file_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["demo", "--model", str(tmp_path)]) == 2
    assert "--model needs --prompt-file" in capsys.readouterr().err


def test_default_decode_is_16_steps_and_json_to_stdout(tmp_path, capsys):
    """No --max-new-tokens: 16 tokens, the decode rate over their 15 steps; --json - keeps stdout pure JSON."""
    rc = main(["demo", "--random-model", "--context", "512", "--block-tokens", "16", "--prefill-chunk", "256",
               "--chunk-tokens", "128", "--no-reference", "--disk-dir", str(tmp_path), "--json", "-"])
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert rc == 0 and result["decode_tokens"] == 16 and result["decode_steps"] == 15
    assert result["decode_tokens_per_s"] > 0 and "tierkv demo" in captured.err


def test_demo_emits_no_future_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert main(["demo", "--random-model", "--context", "256", "--block-tokens", "16", "--prefill-chunk", "128",
                     "--chunk-tokens", "64", "--max-new-tokens", "2", "--disk-dir", str(tmp_path)]) == 0


@pytest.mark.parametrize("rest_bits", ["0", "2"])
def test_sparse_executor_demo_reports_what_it_read(tmp_path, rest_bits):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--context", "2048", "--executor", "sparse", "--sparse-tokens", "0.25", "--block-tokens", "16",
               "--prefill-chunk", "512", "--chunk-tokens", "256", "--max-new-tokens", "2", "--disk-dir",
               str(tmp_path / "disk"), "--sparse-rest-bits", rest_bits, "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["match"] is True and result["executor"] == "sparse"
    assert 0.2 < result["sparse"]["selected_fraction"] < 0.35 and result["bytes_resident"]["disk"] > 0
    assert (result["sparse"]["rest_layer_steps"] > 0) == (rest_bits != "0")


def test_a_rest_copy_without_sparse_attention_is_refused(capsys):
    assert main(["demo", "--random-model", "--sparse-rest-bits", "2"]) == 2
    assert "--sparse-rest-bits needs --executor sparse" in capsys.readouterr().err
