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
saved KV changes nothing; ``sparse@f``: ``cache.sparse(model, tokens=f)``) against them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tierkv import safefs
from tierkv.errors import IntegrityError, InvalidConfigError
from tierkv.hf import cache_keyword
from tierkv.inputs import read_json
from tierkv.quality.metrics import Agreement, compare
from tierkv.quality.tasks import TASKS, Prompt, answer_matches

REFERENCE_FILE = "reference.json"
MAX_REFERENCE_BYTES = 256 << 20
"""Largest ``reference.json`` read: it holds every prompt's token ids, about 7 bytes a token (the default lengths,
4K to 64K, depths and samples make some 36 MB), so this bounds what a planted or damaged file can cost."""
MAX_RESULTS_BYTES = 64 << 20
"""Largest results file read (``tierkv*.json``, ``kvpress*.json``): a few hundred bytes a record."""
FRESH_FOLDER = "move it out of the folder, or give a fresh --out"
KV_MODEL, KV_IDS = "tierkv_model", "tierkv_prompt_ids"
"""The metadata a saved KV file carries: the model's name and :func:`ids_hash` of the ids it was prefilled from."""
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


def file_name(prompt: Prompt) -> str:
    """``needle_8192_d0.50_#0.safetensors``: one file per prompt, named by its key."""
    return prompt.key.replace("/", "_") + ".safetensors"


def _kv_path(folder: Path, prompt: Prompt) -> Path:
    return folder / "kv" / file_name(prompt)


BASELINE_METHODS = ("full", "exact", "kvpress-full")


def check_records(records: Any, path: str | Path, fix: str) -> list[dict[str, Any]]:
    """``records`` (a file's ``results``) if each is a record the harness or kvpress_run.py writes, as far as the
    tables read it; else an InvalidConfigError naming the file, the record and ``fix``."""
    if not isinstance(records, list):
        raise InvalidConfigError(f"{str(path)!r}: its \"results\" is not a list of records; {fix}.")
    for index, record in enumerate(records):
        problem = _record_problem(record)
        if problem:
            raise InvalidConfigError(f"{str(path)!r}: record {index + 1} {problem}; {fix}.")
    return records


def _record_problem(record: Any) -> str | None:
    """Why ``record`` is not a result record (a phrase), or None."""
    if not isinstance(record, dict):
        return f"is {type(record).__name__}, not an object"
    if not all(isinstance(record.get(name), str) for name in ("prompt", "method", "task")):
        return "lacks a prompt, method or task name"
    if record["task"] not in TASKS:
        return f"has task {record['task']!r}, not one of {', '.join(TASKS)}"
    length = record.get("length")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        return "has no length in tokens"
    if not _is_method(record["method"]):
        return f"has method {record['method']!r}, not full, exact, kvpress-full or NAME@BUDGET"
    if record["task"] == "fidelity":
        agreement = record.get("agreement")
        fields = ("top1", "kl_mean")
        if not isinstance(agreement, dict) or not _is_number(agreement.get("steps")) or agreement["steps"] < 1 \
                or not all(_is_number(agreement.get(name)) for name in fields):
            return "has no agreement (steps, top1, kl_mean) for its fidelity prompt"
    elif not isinstance(record.get("correct"), bool) and not _is_ids(record.get("generated")):
        return "says neither whether it is correct nor what it generated"
    return None


def _is_method(method: str) -> bool:
    if method in BASELINE_METHODS:
        return True
    family, at, budget = method.partition("@")
    try:
        return bool(at and family) and 0.0 < float(budget) <= 1.0
    except ValueError:
        return False


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def ids_hash(ids: Sequence[int]) -> str:
    """A digest of token ids, stored with a prompt's KV so that only the KV of these very ids is reused."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(",".join(map(str, ids)).encode())


def logprob_path(folder: Path, prompt: Prompt) -> Path:
    return folder / "logprobs" / file_name(prompt)


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


def _save_kv(cache, path: Path, model_name: str, ids: Sequence[int]) -> None:
    """Write the prefill's KV with the model's name and the hash of the ``ids`` it was prefilled from."""
    import safetensors.torch

    tensors = {}
    for i, layer in enumerate(cache.layers):
        tensors[f"k{i}"], tensors[f"v{i}"] = layer.keys.contiguous(), layer.values.contiguous()
    _write_private(path, safetensors.torch.save(tensors, metadata={KV_MODEL: model_name, KV_IDS: ids_hash(ids)}))


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (in ``kv/`` or ``logprobs/`` of the run folder): the subfolder is tierkv's own
    (0700, never a link), the file replaced by a fresh 0600 one (a link planted there is replaced, never
    followed)."""
    with safefs.directory(path.parent.parent) as parent, \
            safefs.own_directory(parent, path.parent.name, path.parent) as folder:
        problem = safefs.replace_problem(folder, path.name)
        if problem is not None:
            raise safefs.refuse(path, problem[1], "Remove it.", problem[0])
        with safefs.replacing(folder, path.name) as fd:
            safefs.write_all(fd, [data])


@contextlib.contextmanager
def _opened_saved(path: Path, what: str) -> Iterator[str]:
    """A name that opens the regular file ``path`` of the run folder's ``kv/`` or ``logprobs/`` (its descriptor's,
    :func:`tierkv.safefs.fd_path`): neither the subfolder nor the file is followed through a link."""
    with safefs.directory(path.parent.parent) as parent, safefs.directory_at(parent, path.parent.name) as folder, \
            safefs.opened(folder, path.name, what) as fd:
        yield safefs.fd_path(fd)


def _cache_of(model, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (keys, values) in enumerate(kv):
        cache.update(keys, values, i)
    return cache


class _Unusable(Exception):
    """Why a saved KV file is not the KV of a prompt (a phrase)."""


def _load_kv(path: Path, model, model_name: str | None, prompt: Prompt, unmarked: bool = False
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The KV saved for ``prompt`` at ``path``, checked before its tensors are read: made by ``model_name`` (None:
    any) from the prompt's very ids, one ``[1, H, T, D]`` key and value per layer of ``model`` (None: as many as it
    holds) with ``T`` the prefilled tokens. ``unmarked``: a file without that metadata (saved before tierkv wrote
    it, with its ``reference.json`` after it) is taken on its shapes alone. _Unusable (why) otherwise, or OSError
    where it cannot be opened."""
    from safetensors import SafetensorError, safe_open

    try:
        with _opened_saved(path, "saved KV") as name, safe_open(name, "pt") as saved:
            meta = saved.metadata() or {}
            if not (unmarked and KV_IDS not in meta):
                if meta.get(KV_IDS) != ids_hash(prompt.ids[:-1]):
                    raise _Unusable("was not prefilled from this prompt's token ids")
                if model_name is not None and meta.get(KV_MODEL) != model_name:
                    raise _Unusable(f"was prefilled by model {meta.get(KV_MODEL)!r}, not {model_name!r}")
            layers = model.config.num_hidden_layers if model is not None else len(saved.keys()) // 2
            names = {f"{kind}{i}" for kind in "kv" for i in range(layers)}
            if set(saved.keys()) != names:
                raise _Unusable(f"does not hold a key and a value for each of the model's {layers} layers")
            for key in names:
                shape = saved.get_slice(key).get_shape()
                if len(shape) != 4 or shape[0] != 1 or shape[2] != len(prompt.ids) - 1:
                    raise _Unusable(f"holds {key} of shape {shape}, not [1, heads, {len(prompt.ids) - 1}, dim]")
            return [(saved.get_tensor(f"k{i}"), saved.get_tensor(f"v{i}")) for i in range(layers)]
    except IntegrityError as exc:
        raise _Unusable("is a symbolic link or not a regular file" if exc.errno in (errno.ELOOP, errno.EINVAL)
                        else str(exc)) from None
    except SafetensorError as exc:
        raise _Unusable(f"is not a safetensors file ({str(exc)[:120]})") from None


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
    kept, records = _kept_reference(folder, model_name) if os.path.lexists(path) else ([], [])
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
            _write_private(logprob_path(folder, prompt), safetensors.torch.save({"logprobs": logprobs}))
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
    saved = _kv_path(folder, prompt)
    if os.path.lexists(saved):
        try:
            return _cache_of(model, _load_kv(saved, model, model_name, prompt))
        except (_Unusable, OSError) as exc:
            log(f"{saved} {exc if isinstance(exc, _Unusable) else 'cannot be read'}: prefilling it again")
    cache = prefill(model, prompt.ids[:-1], chunk)
    _save_kv(cache, saved, model_name, prompt.ids[:-1])
    return cache


def _kept_reference(folder: Path, model_name: str) -> tuple[list[Prompt], list[dict[str, Any]]]:
    """The prompts and results of the folder's ``reference.json``, refused if a model other than ``model_name``
    made them ("": not checked)."""
    data = read_reference(folder)
    if model_name and data.get("model", model_name) != model_name:
        raise InvalidConfigError(f"{str(folder / REFERENCE_FILE)!r} holds the prompts of model {data['model']!r}, "
                                 f"not {model_name!r}: give --model {data['model']} or a fresh --out folder.")
    return load_reference(folder, data)


def _check_same_prompt(path: Path, kept: Prompt, prompt: Prompt) -> None:
    """Refuse a run whose prompt ``prompt`` differs from the one of that key ``path`` keeps (its results would be
    reported as this run's)."""
    if kept != prompt:
        raise InvalidConfigError(f"{str(path)!r} holds prompt {prompt.key} with other token ids than this run's "
                                 "(made with another --seed or --fidelity-steps): rerun with that run's options, "
                                 "or give a fresh --out folder.")


def load_kv(folder: str | Path, prompt: Prompt, model=None, model_name: str | None = None
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The saved full-attention KV of ``prompt`` (its ``ids[:-1]``): per layer ``(keys, values)`` ``[1, H, T, D]``;
    InvalidConfigError naming the file unless it was prefilled from these ids by ``model_name`` (None: any) with
    ``model``'s layers (None: not checked). A file saved before tierkv marked them is taken on its shapes."""
    path = _kv_path(Path(folder), prompt)
    try:
        return _load_kv(path, model, model_name, prompt, unmarked=True)
    except _Unusable as exc:
        problem = str(exc)
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror or exc})"
    raise InvalidConfigError(f"the saved KV {str(path)!r} {problem}; rerun `tierkv eval --stage reference` into a "
                             "fresh --out folder.")


def decode_saved(model, folder: str | Path, prompt: Prompt) -> tuple[list[int], torch.Tensor]:
    """Decode ``prompt`` from its saved KV in a ``DynamicCache``, through the model's attention implementation
    as set (a study of selection rules registers its own): the generated tokens and every step's logits."""
    return _decode(model, _cache_of(model, load_kv(folder, prompt, model)), _fed(prompt), prompt.answer_tokens)


REFERENCE_FIX = "rerun `tierkv eval --stage reference` into a fresh --out folder"


def read_reference(folder: str | Path) -> dict[str, Any]:
    """The object in the folder's ``reference.json`` (:func:`tierkv.inputs.read_json`, never through a link), its
    model a name."""
    path = Path(folder) / REFERENCE_FILE
    data = read_json(path, "reference", REFERENCE_FIX, MAX_REFERENCE_BYTES, follow=False)
    if not isinstance(data, dict) or not isinstance(data.get("model", ""), str):
        raise InvalidConfigError(f"reference {str(path)!r} is not an object with a model name; {REFERENCE_FIX}.")
    return data


def load_reference(folder: str | Path, data: dict[str, Any] | None = None
                   ) -> tuple[list[Prompt], list[dict[str, Any]]]:
    """The prompts and full attention's results written by :func:`reference` (``data``: its ``reference.json``
    already read), each checked: an InvalidConfigError names the file and the fix."""
    path = Path(folder) / REFERENCE_FILE
    data = read_reference(folder) if data is None else data
    if not isinstance(data.get("prompts"), list):
        raise InvalidConfigError(f"reference {str(path)!r} has no list of prompts; {REFERENCE_FIX}.")
    try:
        prompts = [Prompt.from_dict(p) for p in data["prompts"]]
    except (ValueError, TypeError) as exc:
        raise InvalidConfigError(f"reference {str(path)!r}: {exc}; {REFERENCE_FIX}.") from None
    return prompts, check_records(data.get("results"), path, REFERENCE_FIX)


def check_vocabulary(prompts: Sequence[Prompt], model, path: str | Path) -> None:
    """Refuse prompts with token ids beyond ``model``'s vocabulary (those of another model's reference)."""
    vocabulary = model.config.vocab_size
    beyond = next((p for p in prompts if max((*p.ids, *p.continuation_ids)) >= vocabulary), None)
    if beyond is not None:
        raise InvalidConfigError(f"{str(path)!r}: prompt {beyond.key} has token ids beyond the model's vocabulary "
                                 f"of {vocabulary} (made for another model); {REFERENCE_FIX}.")


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
        prompts, _ = _kept_reference(folder, model_name)
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
        logprobs = _load_logprobs(logprob_path(folder, prompt), prompt) if prompt.task == "fidelity" else None
        for method in todo:
            record = _run_method(model, tokenizer, prompt, kv, logprobs, method, setup)
            records.append(record)
            on_record(record)
            on_prompt(_line(record))
    return records


def _load_logprobs(path: Path, prompt: Prompt) -> torch.Tensor:
    """Full attention's saved log-probabilities of a fidelity ``prompt``: ``[S, V]``, one row per compared step;
    an InvalidConfigError naming the file unless it is that (never read through a link)."""
    from safetensors import SafetensorError, safe_open

    problem = "does not hold one row of log-probabilities per compared step"
    try:
        with _opened_saved(path, "saved log-probabilities") as name, safe_open(name, "pt") as saved:
            if list(saved.keys()) == ["logprobs"]:
                shape = saved.get_slice("logprobs").get_shape()
                if len(shape) == 2 and shape[0] == len(prompt.continuation_ids):
                    return saved.get_tensor("logprobs")
    except (OSError, SafetensorError) as exc:
        problem = f"cannot be read ({getattr(exc, 'strerror', None) or str(exc)[:120]})"
    raise InvalidConfigError(f"{str(path)!r} {problem}; {REFERENCE_FIX}.")


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
