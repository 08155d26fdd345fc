"""tierkv.quality: the prompts, the metrics, the harness (checked against full attention) and the report."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tierkv import models
from tierkv.cli import main
from tierkv.demo.task import WORD_TO_ID
from tierkv.errors import InvalidConfigError
from tierkv.quality import harness, report, run_folder
from tierkv.quality.metrics import Agreement, compare
from tierkv.quality.tasks import (
    KEYS,
    NEEDLE_KEYS,
    DemoTaskWriter,
    Prompt,
    TextTaskWriter,
    answer_matches,
    build_prompts,
)
from tierkv.quality.text import reference_text

# KL of an exact method against the saved reference: fp32 rounding only. The reference and the decode run the same
# math in other chunkings, which round differently per CPU (1.7e-6 at most on an AVX2 host for both exact gather
# and sparse over every block); a wrong block moves it by orders of magnitude more.
ROUNDING_KL = 1e-5


@pytest.mark.parametrize(("output", "expected"), [(" 48213.", True), ("48213", True), (" 4821.", False),
                                                  (" 48213 and 1", True), ("number 482135", False), ("", False)])
def test_answer_matches_the_first_run_of_digits(output, expected):
    assert answer_matches("48213", output) is expected


def test_compare_identical_distributions():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    agreement = compare(torch.log_softmax(logits, -1), logits)
    assert agreement.steps == 5 and agreement.top1 == 1.0 and agreement.kl_mean < 1e-6  # float32 log-softmax vs float64


def test_compare_counts_disagreement_and_kl_by_hand():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]])
    q = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.3, 0.2]])
    agreement = compare(p.log(), q.log())  # logits = log q (softmax gives q back)
    by_hand = sum(pi * math.log(pi / qi) for pi, qi in zip(p[0].tolist(), q[0].tolist(), strict=True))
    assert agreement.top1 == 0.5  # step 0 disagrees (0 vs 1), step 1 agrees
    assert agreement.kl_mean == pytest.approx(by_hand / 2, rel=1e-6) and agreement.kl_max == pytest.approx(by_hand)
    total = agreement + Agreement(2, 2, 0.0, 0.0)
    assert total.steps == 4 and total.top1 == 0.75


def test_reference_text_is_cpythons_language_reference():
    text = reference_text()
    assert len(text) > 400_000 and 'The "assert" statement' in text


def test_demo_prompts_split_at_the_question_and_round_trip():
    writer = DemoTaskWriter()
    needle = writer.needle(1024, 0.5, 0)
    assert len(needle.ids) == needle.length == 1024
    assert needle.question_ids[0] == WORD_TO_ID["what"] and WORD_TO_ID["what"] not in needle.context_ids
    assert WORD_TO_ID[needle.answer] in needle.context_ids
    multi = writer.needle(1024, 0.5, 0, keys=NEEDLE_KEYS)
    assert multi.task == "multi-needle" and multi.answer_tokens == 1
    fidelity = writer.fidelity(1024, 0, 32)
    assert len(fidelity.context_ids) == 1024 and len(fidelity.continuation_ids) == 32 and not fidelity.question_ids
    assert Prompt.from_dict(json.loads(json.dumps(needle.to_dict()))) == needle


def test_build_prompts_is_deterministic_and_checks_tasks():
    args = (DemoTaskWriter(), ["needle", "fidelity"], [512], [0.0, 1.0], 2, 8)
    first, again = build_prompts(*args), build_prompts(*args)
    assert first == again and [p.task for p in first].count("needle") == 4 and len(first) == 6
    with pytest.raises(ValueError, match="unknown task haystack"):
        build_prompts(DemoTaskWriter(), ["haystack"], [512], [0.5], 1, 8)


def test_chat_needles_in_real_text(smollm2):
    _, tokenizer = smollm2
    writer = TextTaskWriter(tokenizer)
    prompt = writer.needle(2048, 0.25, 0, keys=NEEDLE_KEYS)
    assert len(prompt.ids) == 2048
    context = tokenizer.decode(prompt.context_ids)
    question = tokenizer.decode(prompt.question_ids)
    facts = [line.strip() for line in context.splitlines() if "The special magic number for " in line]
    assert len(facts) == NEEDLE_KEYS and len({f.split()[5] for f in facts}) == NEEDLE_KEYS
    asked = next(k for k in KEYS if f"number for {k} mentioned" in question)
    target = f"The special magic number for {asked} is {prompt.answer}."
    assert target in facts
    assert 0.15 < context.index(target) / len(context) < 0.35  # at the requested depth (by characters)
    fidelity = writer.fidelity(512, 0, 16)
    assert tokenizer.decode(fidelity.context_ids + fidelity.continuation_ids) in reference_text()


def test_harness_exact_path_is_full_attention(tmp_path):
    """From the saved prefill KV, tierkv's exact executor gives full attention's answers and distributions."""
    model, tokenizer = models.load("demo")
    prompts = build_prompts(DemoTaskWriter(), ["needle", "fidelity"], [700], [0.5], 1, 24)
    harness.reference(model, tokenizer, prompts, tmp_path, prefill_chunk=256, meta={"model": "demo"})
    records = harness.measure(model, tokenizer, tmp_path, [harness.Method("exact")],
                              harness.CacheSetup(block_tokens=16, device_fraction=0.1, device_extra=1 << 20))
    _, full = run_folder.load_reference(tmp_path)
    needle = next(r for r in records if r["task"] == "needle")
    assert needle["output"] == full[0]["output"] and needle["correct"] == full[0]["correct"]
    fidelity = next(r for r in records if r["task"] == "fidelity")["agreement"]
    assert fidelity["steps"] == 24 and fidelity["top1"] == 1.0 and fidelity["kl_max"] < ROUNDING_KL
    (tmp_path / "tierkv.json").write_text(json.dumps({"results": records}))  # as `tierkv eval` writes it
    text = report.markdown(report.load_results(tmp_path))
    assert "| tierkv exact | 100.0% / 0.000 |" in text and "**needle**" in text


def test_harness_sparse_covering_budget_is_exact_and_small_budget_reads_little(tmp_path):
    """sparse@1.0 covers every block (the executor's exact fast path); sparse@0.1 reads about a tenth of them."""
    model, tokenizer = models.load("demo")
    prompts = build_prompts(DemoTaskWriter(), ["needle", "fidelity"], [1024], [0.5], 1, 16)
    harness.reference(model, tokenizer, prompts, tmp_path, prefill_chunk=512, meta={"model": "demo"})
    methods = [harness.Method("sparse", 1.0), harness.Method("sparse", 0.1)]
    records = harness.measure(model, tokenizer, tmp_path, methods,
                              harness.CacheSetup(block_tokens=16, device_fraction=0.1, device_extra=1 << 20))
    by = {(r["task"], r["method"]): r for r in records}
    assert by[("fidelity", "sparse@1")]["agreement"]["kl_max"] < ROUNDING_KL
    assert by[("needle", "sparse@1")]["selected_fraction"] == 1.0
    assert 0.05 < by[("needle", "sparse@0.1")]["selected_fraction"] < 0.15
    assert by[("fidelity", "sparse@0.1")]["agreement"]["steps"] == 16
    dense = harness.CacheSetup(block_tokens=16, dense_layers=model.config.num_hidden_layers, device_fraction=0.1,
                               device_extra=1 << 20)  # every layer dense: exact whatever the budget
    (fidelity,) = harness.measure(model, tokenizer, tmp_path, [harness.Method("sparse", 0.1)], dense,
                                  done=[r for r in records if r["task"] == "needle"])
    assert fidelity["selected_fraction"] == 1.0 and fidelity["agreement"]["kl_max"] < ROUNDING_KL


@pytest.mark.parametrize(("argv", "message"), [
    (["--tasks", "haystack", "--out", "X"], "--tasks='haystack': valid tasks are needle, multi-needle, fidelity"),
    (["--tasks", "needle"], "--tasks needs --out"),
    (["--tasks", "needle", "--model", "smollm2", "--lengths", "16K", "--out", "X"],
     "model 'smollm2' was trained for 8K tokens"),
    (["--model", "smollm2"], "the retrieval heat map is the demo model's own task"),
])
def test_eval_quality_usage_errors(argv, message, capsys, tmp_path):
    argv = [str(tmp_path) if a == "X" else a for a in argv]
    assert main(["eval", *argv]) == 2
    assert message in capsys.readouterr().err


def test_runs_on_other_blocks_keep_their_own_results_file():
    assert harness.results_file(harness.CacheSetup()) == "tierkv.json"
    assert harness.results_file(harness.CacheSetup(block_tokens=8)) == "tierkv-8.json"
    assert harness.results_file(harness.CacheSetup(block_tokens=8, rest_bits=4)) == "tierkv-8-rest4.json"


def test_report_gives_other_block_sizes_rows_of_their_own(tmp_path):
    """A run measured with 8-token blocks (``tierkv-8.json``, its setup saying so) is reported beside the
    default 16-token one, as its own family, never averaged into it."""
    prompt = {"task": "needle", "length": 2048, "depth": 0.5, "sample": 0, "answer": "12345"}
    record = dict(prompt, prompt="needle/2048/d0.50/#0")
    (tmp_path / "reference.json").write_text(json.dumps(
        {"prompts": [prompt], "results": [dict(record, method="full", correct=True)]}))
    runs = (("tierkv.json", 16, 0, False), ("tierkv-8.json", 8, 0, True), ("tierkv-8-rest4.json", 8, 4, False))
    for name, block_tokens, rest_bits, correct in runs:
        (tmp_path / name).write_text(json.dumps({"setup": {"block_tokens": block_tokens, "rest_bits": rest_bits},
                                                 "results": [dict(record, method="sparse@0.1", budget=0.1,
                                                                  correct=correct)]}))
    text = report.markdown(report.load_results(tmp_path))
    assert "| tierkv sparse 10% | 0% (1) |" in text
    assert "| tierkv sparse, 8-token blocks 10% | 100% (1) |" in text
    assert "| tierkv sparse, 8-token blocks, 4-bit rest 10% | 0% (1) |" in text
    assert text.index("tierkv sparse 10%") < text.index("8-token blocks 10%") < text.index("4-bit rest 10%")


def test_saved_log_probabilities_of_another_vocabulary_are_refused_naming_the_file(tmp_path):
    """Full attention's saved log-probabilities must be as wide as the model's logits: a planted or stale file of
    another width is refused on its header, naming it, before any method runs."""
    import safetensors.torch

    model, tokenizer = models.load("demo")
    prompts = build_prompts(DemoTaskWriter(), ["fidelity"], [512], [0.5], 1, 8)
    harness.reference(model, tokenizer, prompts, tmp_path, prefill_chunk=256, meta={"model": "demo"})
    path = run_folder.logprob_path(tmp_path, prompts[0])
    width = model.get_output_embeddings().out_features
    path.write_bytes(safetensors.torch.save({"logprobs": torch.zeros(8, width + 7)}))
    with pytest.raises(InvalidConfigError, match=f"{path.name}.*one row of {width} log-probabilities"):
        harness.measure(model, tokenizer, tmp_path, [harness.Method("exact")],
                        harness.CacheSetup(block_tokens=16, device_fraction=0.1, device_extra=1 << 20))
