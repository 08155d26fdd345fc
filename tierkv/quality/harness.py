"""Full attention and tierkv's sparse executor on the same prompts, every answer token a decode step.

The expensive part of a long prompt is its prefill, and prefill is exact in every tierkv mode. So each
prompt is prefilled once with full attention (chunked, through transformers' ``DynamicCache``) and its KV
saved (``kv/<n>.safetensors``); every method then starts from that KV: it is written into a fresh
``TieredCache`` (as its own exact prefill would have written it) and the method decodes from there.

The prompt's last token is *not* prefilled: it is fed as the first decode step, so every answer token —
also the first — comes out of a step of the method being measured, and for fidelity each of the 256
compared distributions does::

    needle / multi-needle   prefill ids[:-1]   decode ids[-1], then greedily answer_tokens - 1 more
    fidelity                prefill ctx[:-1]   decode ctx[-1], cont[0], ..., cont[S-2] (teacher-forced)
                            and compare the S next-token distributions with full attention's

``reference`` writes the prompts, the KV, full attention's answers and (fidelity) its log-probabilities;
``measure`` runs methods (``exact``: TieredCache with exact streaming attention, a check that the path from
saved KV changes nothing; ``sparse@f``: ``cache.sparse(model, tokens=f)``) against them. The folder's files are
written and read back through :mod:`tierkv.quality.run_folder`, which checks them as untrusted input.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tierkv import safefs
from tierkv.errors import InvalidConfigError
from tierkv.hf import cache_keyword
from tierkv.quality.metrics import Agreement, compare
from tierkv.quality.run_folder import (
    REFERENCE_FILE,
    Unusable,
    check_vocabulary,
    kept_reference,
    kv_path,
    load_kv,
    load_logprobs,
    load_reference,
    logprob_path,
    read_kv,
    save_kv,
    write_private,
)
from tierkv.quality.tasks import Prompt, answer_matches

DEFAULT_BLOCK_TOKENS = 16  # Quest's page size (2% of 2K is 40 tokens: the sink and the tail alone)


@dataclass(frozen=True, slots=True)
class Method:
    """One way to decode: ``full`` (DynamicCache), ``exact`` (TieredCache, exact) or ``sparse`` at a budget."""

    kind: str
    budget: float | None = None  # sparse: attended fraction of the context (sinks and recent included)

    @property
    def name(self) -> str:
        return f"sparse@{self.budget:g}" if self.kind == "sparse" else self.kind


@dataclass(frozen=True, slots=True)
class CacheSetup:
    """How each method's TieredCache is built; placement changes no result, only what a step moves."""

    block_tokens: int = DEFAULT_BLOCK_TOKENS
    sinks: int | None = None  # default: one block
    recent: int | None = None  # default: the open tail only
    dense_layers: int = 0  # first layers attended in full (their blocks come out of the others' budgets)
    rest_bits: int = 0  # the pages a sparse step does not read: attended from a copy of this many bits (0: not)
    page_tokens: int | None = None  # tokens per selected page inside a block (None: the library's default)
    device_fraction: float = 0.25  # device budget: the streaming minimum, this share of the KV, and ...
    device_extra: int = 64 << 20  # ... this much for the sparse staging (sparse runs: and their key summaries)
    disk_dir: str | None = None  # None: the rest lives on the host tier

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.inference_mode()
def prefill(model, ids: Sequence[int], chunk: int):
    """Full attention's prefill into a cache whose every layer keeps every token: a sliding-window layer's own
    cache keeps only its window, and saved KV that lacks where it starts would be loaded as the prompt's start
    (the model still attends only within the window: its mask comes from the config)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    tensor = torch.tensor([list(ids)])  # [1, T]
    for start in range(0, tensor.shape[1], chunk):
        model(input_ids=tensor[:, start : start + chunk], **{cache_keyword(model): cache}, logits_to_keep=1)
    return cache


@torch.inference_mode()
def _decode(model, cache, fed: Sequence[int], greedy: int) -> tuple[list[int], torch.Tensor]:
    """Feed ``fed`` one token per step, then ``greedy`` more tokens chosen by argmax.

    Returns the generated tokens and the logits of every step ``[len(fed) + greedy - 1 or len(fed), V]``
    (for fidelity ``greedy`` is 0 and the rows are the next-token logits after each fed token).
    """
    rows: list[torch.Tensor] = []
    generated: list[int] = []
    queue = list(fed)
    while queue:
        out = model(input_ids=torch.tensor([[queue.pop(0)]]), **{cache_keyword(model): cache}, logits_to_keep=1)
        rows.append(out.logits[0, -1].float())
        if not queue and len(generated) < greedy:
            generated.append(int(rows[-1].argmax()))
            if len(generated) < greedy:
                queue.append(generated[-1])
    return generated, torch.stack(rows)


def _cache_of(model, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (keys, values) in enumerate(kv):
        cache.update(keys, values, i)
    return cache


def reference(model, tokenizer, prompts: Sequence[Prompt], out: str | Path, *, prefill_chunk: int = 2048,
              on_prompt: Callable[[str], None] = lambda line: None, meta: dict[str, Any] | None = None) -> Path:
    """Prefill every prompt with full attention, save its KV, and decode it (the ``full`` method).

    Writes ``out/reference.json`` (the prompts and full attention's results), ``out/kv/<key>.safetensors`` and,
    for fidelity prompts, ``out/logprobs/<key>.safetensors`` (full attention's log-probabilities ``[S, V]``).
    ``meta`` (the model's name and checkpoint folder) goes into ``reference.json`` too. The folder grows:
    prompts already in its ``reference.json`` are kept and skipped, so runs with other lengths or tasks add to
    it, and ``reference.json`` is rewritten after each prompt (an interrupted run resumes where it stopped).
    """
    folder = Path(out)
    os.close(safefs.open_user_directory(folder))  # created 0700 if missing
    path = folder / REFERENCE_FILE
    model_name = (meta or {}).get("model", "")
    kept, records = kept_reference(folder, model_name) if os.path.lexists(path) else ([], [])
    done = {p.key: p for p in kept}
    for prompt in prompts:
        if prompt.key in done:
            _check_same_prompt(path, done[prompt.key], prompt)
            continue
        started = time.perf_counter()
        cache = _prefilled(model, model_name, folder, prompt, prefill_chunk, on_prompt)
        prefill_s = time.perf_counter() - started
        generated, logits = _decode(model, cache, _fed(prompt), prompt.answer_tokens)
        record = _record(prompt, Method("full"), tokenizer, generated)
        if prompt.task == "fidelity":
            import safetensors.torch

            logprobs = torch.log_softmax(logits, -1).contiguous()
            write_private(logprob_path(folder, prompt), safetensors.torch.save({"logprobs": logprobs}))
            record["agreement"] = Agreement(len(logits), len(logits), 0.0, 0.0).to_dict()
        record["prefill_s"] = round(prefill_s, 2)
        kept.append(prompt)
        records.append(record)
        safefs.write_file(path, [json.dumps({**(meta or {}), "prompts": [p.to_dict() for p in kept],
                                             "results": records}).encode()])
        on_prompt(_line(record))
    return path


def _prefilled(model, model_name: str, folder: Path, prompt: Prompt, chunk: int, log: Callable[[str], None]):
    """Full attention's prefill of ``prompt``: the KV an interrupted run saved, if it was made by this model from
    these very ids, else prefilled now (and saved, replacing any other file there)."""
    saved = kv_path(folder, prompt)
    if os.path.lexists(saved):
        try:
            return _cache_of(model, read_kv(saved, model, model_name, prompt))
        except (Unusable, OSError) as exc:
            log(f"{saved} {exc if isinstance(exc, Unusable) else 'cannot be read'}: prefilling it again")
    cache = prefill(model, prompt.ids[:-1], chunk)
    save_kv(cache, saved, model_name, prompt.ids[:-1])
    return cache


def _check_same_prompt(path: Path, kept: Prompt, prompt: Prompt) -> None:
    """Refuse a run whose prompt ``prompt`` differs from the one of that key ``path`` keeps (its results would be
    reported as this run's)."""
    if kept != prompt:
        raise InvalidConfigError(f"{str(path)!r} holds prompt {prompt.key} with other token ids than this run's "
                                 "(made with another --seed or --fidelity-steps): rerun with that run's options, "
                                 "or give a fresh --out folder.")


def decode_saved(model, folder: str | Path, prompt: Prompt) -> tuple[list[int], torch.Tensor]:
    """Decode ``prompt`` from its saved KV in a ``DynamicCache``, through the model's attention implementation
    as set (a study of selection rules registers its own): the generated tokens and every step's logits."""
    return _decode(model, _cache_of(model, load_kv(folder, prompt, model)), _fed(prompt), prompt.answer_tokens)


def measure(model, tokenizer, folder: str | Path, methods: Sequence[Method], setup: CacheSetup = CacheSetup(),
            on_prompt: Callable[[str], None] = lambda line: None, done: Sequence[dict[str, Any]] = (),
            on_record: Callable[[dict[str, Any]], None] = lambda record: None,
            model_name: str | None = None) -> list[dict[str, Any]]:
    """Run ``methods`` from the saved KV of every prompt in ``folder`` (see the module docstring).

    Pairs (prompt, method) that ``done`` already holds a record of are skipped (a resumed run);
    ``on_record`` sees each new record as it is made. ``model_name``: the model run, refused unless it made the
    reference (None: not checked).
    """
    folder = Path(folder)
    if model_name is not None:
        prompts, _ = kept_reference(folder, model_name)
    else:
        prompts, _ = load_reference(folder)
    check_vocabulary(prompts, model, folder / REFERENCE_FILE)
    skip = {(r["prompt"], r["method"]) for r in done}
    records = []
    for prompt in prompts:
        todo = [m for m in methods if (prompt.key, m.name) not in skip]
        if not todo:
            continue
        kv = load_kv(folder, prompt, model, model_name)
        logprobs = load_logprobs(logprob_path(folder, prompt), prompt, _vocabulary(model)) \
            if prompt.task == "fidelity" else None  # fmt: skip
        for method in todo:
            record = _run_method(model, tokenizer, prompt, kv, logprobs, method, setup)
            records.append(record)
            on_record(record)
            on_prompt(_line(record))
    return records


RESULT_OPTIONS = ("block_tokens", "page_tokens", "sinks", "recent", "dense_layers", "rest_bits")
"""The :class:`CacheSetup` fields that change a run's results (the others only place its blocks): every one is in
the name of the run's results file (:func:`results_file`), so a record is reused only with the options it was
measured with."""


def results_file(setup: CacheSetup) -> str:
    """The file of a run's tierkv records, named by every option in :data:`RESULT_OPTIONS` but a default one:
    ``tierkv.json``, ``tierkv-8.json`` for 8-token blocks, ``tierkv-256-p16.json`` with ``page_tokens=16`` given,
    ``tierkv-sinks0-recent32-dense2.json`` with those sparse options, ``tierkv-8-rest2.json`` with a 2-bit rest
    copy; so runs of other setups resume and are reported on their own (tierkv.quality.report)."""
    name = "tierkv" if setup.block_tokens == DEFAULT_BLOCK_TOKENS else f"tierkv-{setup.block_tokens}"
    if setup.page_tokens is not None:
        name += f"-p{setup.page_tokens}"
    for option, value in (("sinks", setup.sinks), ("recent", setup.recent), ("dense", setup.dense_layers or None)):
        if value is not None:
            name += f"-{option}{value}"
    return f"{name}-rest{setup.rest_bits}.json" if setup.rest_bits else f"{name}.json"


def setup_differences(setup: CacheSetup, saved: dict[str, Any]) -> dict[str, Any]:
    """``{option: saved value}`` of each :data:`RESULT_OPTIONS` where ``saved`` (a results file's ``setup``; a field
    it lacks: the default) differs from ``setup``: a file written before its name said every option."""
    defaults = CacheSetup().to_dict()
    return {name: saved.get(name, defaults[name]) for name in RESULT_OPTIONS
            if saved.get(name, defaults[name]) != getattr(setup, name)}


def _vocabulary(model) -> int | None:
    """The width of ``model``'s logits (its output embedding's rows), which full attention's saved
    log-probabilities must have; None where the model does not say."""
    head = model.get_output_embeddings()
    return getattr(head, "out_features", None)


def _run_method(model, tokenizer, prompt: Prompt, kv, logprobs, method: Method, setup: CacheSetup) -> dict:
    from tierkv import TieredCache
    from tierkv.attention.sparse import SparseBudget
    from tierkv.planner import kv_summary_bytes
    from tierkv.staging import rest_copy_bytes

    kv_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
    floor = TieredCache.min_streaming_device_bytes(model.config, block_tokens=setup.block_tokens)
    gpu = floor + int(kv_bytes * setup.device_fraction) + setup.device_extra
    if method.kind == "sparse":  # the key summaries: 3 vectors per page, 18.75% of the KV at 8-token pages
        page = SparseBudget(method.budget or 1.0, page_tokens=setup.page_tokens).page_size(setup.block_tokens)
        gpu += kv_summary_bytes(kv_bytes, page)
        gpu += rest_copy_bytes(kv_bytes, setup.rest_bits, kv[0][0].element_size(), kv[0][0].shape[-1])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tierkv-quality-") as tmp, \
            TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{2 * kv_bytes + (64 << 20)}B", config=model.config,
                        block_tokens=setup.block_tokens, disk_dir=setup.disk_dir and tmp) as cache:
        with _context(cache, model, method, setup), torch.inference_mode():
            for i, (keys, values) in enumerate(kv):  # the exact prefill's KV, appended as the prefill would
                cache.update(keys, values, i)
            generated, logits = _decode(model, cache, _fed(prompt), prompt.answer_tokens)
        stats = cache.stats()
    record = _record(prompt, method, tokenizer, generated)
    record["decode_s"] = round(time.perf_counter() - started, 2)
    sparse = stats.get("sparse")
    if sparse:
        record["selected_fraction"] = sparse.get("selected_fraction")
        record["pages_selected"] = sparse.get("pages_selected")  # pages read without their block
    if logprobs is not None:
        record["agreement"] = compare(logprobs, logits).to_dict()
    return record


def _context(cache, model, method: Method, setup: CacheSetup):
    if method.kind == "sparse":
        return cache.sparse(model, tokens=method.budget, sinks=setup.sinks, recent=setup.recent,
                            dense_layers=setup.dense_layers, rest_bits=setup.rest_bits, page_tokens=setup.page_tokens)
    return cache.streaming(model)


def _fed(prompt: Prompt) -> list[int]:
    """Tokens fed as decode steps: the prompt's last token, then (fidelity) the continuation but its last."""
    return [prompt.ids[-1], *prompt.continuation_ids[:-1]]


def _record(prompt: Prompt, method: Method, tokenizer, generated: list[int]) -> dict[str, Any]:
    record: dict[str, Any] = {"prompt": prompt.key, "task": prompt.task, "length": prompt.length,
                              "depth": prompt.depth, "sample": prompt.sample, "method": method.name,
                              "budget": method.budget}
    if prompt.answer is not None:
        text = tokenizer.decode(generated, skip_special_tokens=True)
        record.update(answer=prompt.answer, output=text, correct=answer_matches(prompt.answer, text))
    return record


def _line(record: dict[str, Any]) -> str:
    if "correct" in record:
        mark = "ok" if record["correct"] else f"got {record['output']!r}"
        return f"{record['prompt']} {record['method']}: {record['answer']} {mark}"
    agreement = record["agreement"]
    return f"{record['prompt']} {record['method']}: top-1 {agreement['top1']:.3f}, KL {agreement['kl_mean']:.4f}"
