"""The files of a ``tierkv eval --tasks`` run folder, read as untrusted input: a folder may be handed over with
anything planted in it. ``reference.json`` (the prompts, full attention's results), the results files
(``tierkv*.json``, ``kvpress*.json``), the saved prefill KV (``kv/``) and log-probabilities (``logprobs/``): each read
only as a regular file within a size, never through a link, and checked before use; a saved KV is taken only for the
model and the very token ids it was prefilled from (its safetensors metadata). Every refusal names the file and
the fix. :mod:`tierkv.quality.harness` writes them; :mod:`tierkv.quality.report` tabulates them.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tierkv import safefs
from tierkv.errors import IntegrityError, InvalidConfigError
from tierkv.inputs import printable, read_json
from tierkv.quality.tasks import TASKS, Prompt

REFERENCE_FILE = "reference.json"


MAX_REFERENCE_BYTES = 256 << 20
"""Largest ``reference.json`` read: it holds every prompt's token ids, about 7 bytes a token (the default lengths,
4K to 64K, depths and samples make some 36 MB), so this bounds what a planted or damaged file can cost."""


MAX_RESULTS_BYTES = 64 << 20
"""Largest results file read (``tierkv*.json``, ``kvpress*.json``): a few hundred bytes a record."""


FRESH_FOLDER = "move it out of the folder, or give a fresh --out"
REFERENCE_FIX = "rerun `tierkv eval --stage reference` into a fresh --out folder"
BASELINE_METHODS = ("full", "exact", "kvpress-full")


KV_MODEL, KV_IDS = "tierkv_model", "tierkv_prompt_ids"
"""The metadata a saved KV file carries: the model's name and :func:`ids_hash` of the ids it was prefilled from."""


def file_name(prompt: Prompt) -> str:
    """``needle_8192_d0.50_#0.safetensors``: one file per prompt, named by its key."""
    return prompt.key.replace("/", "_") + ".safetensors"


def kv_path(folder: Path, prompt: Prompt) -> Path:
    return folder / "kv" / file_name(prompt)


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


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (in ``kv/`` or ``logprobs/`` of the run folder): the subfolder is tierkv's own
    (0700, never a link), the file replaced by a fresh 0600 one (a link planted there is replaced, never
    followed)."""
    with safefs.directory(path.parent.parent) as parent, \
            safefs.own_directory(parent, path.parent.name, path.parent) as folder:
        safefs.write_at(folder, path.name, [data], path)


def save_kv(cache, path: Path, model_name: str, ids: Sequence[int]) -> None:
    """Write the prefill's KV with the model's name and the hash of the ``ids`` it was prefilled from."""
    import safetensors.torch

    tensors = {}
    for i, layer in enumerate(cache.layers):
        tensors[f"k{i}"], tensors[f"v{i}"] = layer.keys.contiguous(), layer.values.contiguous()
    write_private(path, safetensors.torch.save(tensors, metadata={KV_MODEL: model_name, KV_IDS: ids_hash(ids)}))


@contextlib.contextmanager
def opened_saved(path: Path, what: str) -> Iterator[str]:
    """A name that opens the regular file ``path`` of the run folder's ``kv/`` or ``logprobs/`` (its descriptor's,
    :func:`tierkv.safefs.fd_path`): neither the subfolder nor the file is followed through a link."""
    with safefs.directory(path.parent.parent) as parent, safefs.directory_at(parent, path.parent.name) as folder, \
            safefs.opened(folder, path.name, what) as fd:
        yield safefs.fd_path(fd)


class Unusable(Exception):
    """Why a saved KV file is not the KV of a prompt (a phrase)."""


SAVED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""The safetensors dtypes a saved KV or log-probabilities file may hold (a model's floating-point dtypes)."""

MAX_KV_BYTES_PER_TOKEN = 8 << 20
"""Most K/V bytes a saved KV may hold per prefilled token where no model is given to size it by: the largest
real caches take some 5 MB a token (DeepSeek-V3's expanded latent attention), so a planted file cannot cost more
than a real prefill of its length."""

MAX_VOCABULARY = 1 << 20
"""Most log-probabilities a saved row may hold where the model's vocabulary is not given: the largest real
vocabularies are some 260K tokens."""


def _layer_shapes(model, layers: int) -> list[tuple[int, int]]:
    """(KV heads, widest head dim) of what each of ``model``'s ``layers`` layers caches; the widest layer's for
    each where not every layer holds K/V."""
    from tierkv.hf.sizing import layer_layouts

    layouts = layer_layouts(model.config, 1, model.dtype)
    if len(layouts) != layers:
        layouts = [max(layouts, key=lambda layout: layout.token_bytes)] * layers
    return [(layout.kv_heads, layout.head_dim) for layout in layouts]


def _check_kv_tensors(saved, model, layers: int, tokens: int) -> None:
    """Unusable unless every ``k<i>``/``v<i>`` of the open safetensors file ``saved`` is ``[1, H, tokens, D]`` of
    a float dtype (the model's, and its layer's H and at most its D, when ``model`` is given; else at most
    :data:`MAX_KV_BYTES_PER_TOKEN` in all): checked on the header, before a tensor is read."""
    shapes = _layer_shapes(model, layers) if model is not None else None
    total = 0
    for i in range(layers):
        for key in (f"k{i}", f"v{i}"):
            piece = saved.get_slice(key)
            shape, dtype = piece.get_shape(), piece.get_dtype()
            heads, dim = shapes[i] if shapes is not None else (0, 0)
            if len(shape) != 4 or shape[0] != 1 or shape[2] != tokens or shapes is not None and (
                    shape[1] != heads or not 1 <= shape[3] <= dim):
                wanted = f"[1, {heads}, {tokens}, {dim} or fewer]" if shapes else f"[1, heads, {tokens}, dim]"
                raise Unusable(f"holds {key} of shape {shape}, not {wanted}")
            if dtype not in SAVED_DTYPES or model is not None and SAVED_DTYPES[dtype] != model.dtype:
                wanted = f"the model's {model.dtype}" if model is not None else "a float dtype"
                raise Unusable(f"holds {key} of dtype {printable(dtype)[:20]!r}, not {wanted}")
            total += math.prod(shape) * SAVED_DTYPES[dtype].itemsize
    if shapes is None and total > tokens * MAX_KV_BYTES_PER_TOKEN:
        raise Unusable(f"holds {total:,} bytes of K/V for {tokens} tokens, more than "
                       f"{MAX_KV_BYTES_PER_TOKEN >> 20} MiB a token")


def read_kv(path: Path, model, model_name: str | None, prompt: Prompt, unmarked: bool = False
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The KV saved for ``prompt`` at ``path``, checked before its tensors are read: made by ``model_name`` (None:
    any) from the prompt's very ids, one ``[1, H, T, D]`` key and value per layer of ``model`` (None: as many as it
    holds) with ``T`` the prefilled tokens. ``unmarked``: a file without that metadata (saved before tierkv wrote
    it, with its ``reference.json`` after it) is taken on its shapes alone. Unusable (why) otherwise, or OSError
    where it cannot be opened."""
    from safetensors import SafetensorError, safe_open

    try:
        with opened_saved(path, "saved KV") as name, safe_open(name, "pt") as saved:
            meta = saved.metadata() or {}
            if not (unmarked and KV_IDS not in meta):
                if meta.get(KV_IDS) != ids_hash(prompt.ids[:-1]):
                    raise Unusable("was not prefilled from this prompt's token ids")
                if model_name is not None and meta.get(KV_MODEL) != model_name:
                    raise Unusable(f"was prefilled by model {meta.get(KV_MODEL)!r}, not {model_name!r}")
            layers = model.config.num_hidden_layers if model is not None else len(saved.keys()) // 2
            names = {f"{kind}{i}" for kind in "kv" for i in range(layers)}
            if set(saved.keys()) != names:
                raise Unusable(f"does not hold a key and a value for each of the model's {layers} layers")
            _check_kv_tensors(saved, model, layers, len(prompt.ids) - 1)
            return [(saved.get_tensor(f"k{i}"), saved.get_tensor(f"v{i}")) for i in range(layers)]
    except IntegrityError as exc:
        raise Unusable("is a symbolic link or not a regular file" if exc.errno in (errno.ELOOP, errno.EINVAL)
                        else str(exc)) from None
    except SafetensorError as exc:
        raise Unusable(f"is not a safetensors file ({printable(exc)[:120]})") from None


def kept_reference(folder: Path, model_name: str) -> tuple[list[Prompt], list[dict[str, Any]]]:
    """The prompts and results of the folder's ``reference.json``, refused if a model other than ``model_name``
    made them ("": not checked)."""
    data = read_reference(folder)
    if model_name and data.get("model", model_name) != model_name:
        raise InvalidConfigError(f"{str(folder / REFERENCE_FILE)!r} holds the prompts of model {data['model']!r}, "
                                 f"not {model_name!r}: give --model {printable(data['model'])} or a fresh --out "
                                 "folder.")
    return load_reference(folder, data)


def load_kv(folder: str | Path, prompt: Prompt, model=None, model_name: str | None = None
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The saved full-attention KV of ``prompt`` (its ``ids[:-1]``): per layer ``(keys, values)`` ``[1, H, T, D]``;
    InvalidConfigError naming the file unless it was prefilled from these ids by ``model_name`` (None: any) with
    ``model``'s layers (None: not checked). A file saved before tierkv marked them is taken on its shapes."""
    path = kv_path(Path(folder), prompt)
    try:
        return read_kv(path, model, model_name, prompt, unmarked=True)
    except Unusable as exc:
        problem = str(exc)
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror or exc})"
    raise InvalidConfigError(f"the saved KV {str(path)!r} {problem}; rerun `tierkv eval --stage reference` into a "
                             "fresh --out folder.")


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


def load_logprobs(path: Path, prompt: Prompt, vocabulary: int | None = None) -> torch.Tensor:
    """Full attention's saved log-probabilities of a fidelity ``prompt``: ``[S, V]`` of a float dtype, one row per
    compared step, ``V`` the model's ``vocabulary`` (None: at most :data:`MAX_VOCABULARY`); an InvalidConfigError
    naming the file unless it is that (checked on its header before it is read; never read through a link)."""
    from safetensors import SafetensorError, safe_open

    width = vocabulary or "vocabulary"
    problem = f"does not hold one row of {width} log-probabilities per compared step"
    try:
        with opened_saved(path, "saved log-probabilities") as name, safe_open(name, "pt") as saved:
            if list(saved.keys()) == ["logprobs"]:
                piece = saved.get_slice("logprobs")
                shape = piece.get_shape()
                if len(shape) == 2 and shape[0] == len(prompt.continuation_ids) and (
                        shape[1] == vocabulary if vocabulary else 1 <= shape[1] <= MAX_VOCABULARY):
                    if piece.get_dtype() in SAVED_DTYPES:
                        return saved.get_tensor("logprobs")
                    problem = f"holds log-probabilities of dtype {printable(piece.get_dtype())[:20]!r}, not a float"
    except (OSError, SafetensorError) as exc:
        problem = f"cannot be read ({printable(getattr(exc, 'strerror', None) or str(exc))[:120]})"
    raise InvalidConfigError(f"{str(path)!r} {problem}; {REFERENCE_FIX}.")


TIERKV_RESULTS = re.compile(r"tierkv(-\d+)?(-p\d+)?(-sinks\d+)?(-recent\d+)?(-dense\d+)?(-rest\d+)?\.json")
"""The names :func:`tierkv.quality.harness.results_file` gives: other ``tierkv*.json`` files (notes, a copy) are
not results and are left out of the tables."""


def results_files(folder: str | Path) -> list[Path]:
    """The results files in ``folder``: tierkv's (:data:`TIERKV_RESULTS`), then kvpress's (``kvpress*.json``)."""
    names = sorted(os.listdir(folder))
    return [Path(folder) / name for name in names if TIERKV_RESULTS.fullmatch(name)] + \
        [Path(folder) / name for name in names if name.startswith("kvpress") and name.endswith(".json")]


RESULTS_FIX = f"{FRESH_FOLDER} (a results file of tierkv eval or kvpress_run.py is an object with a list of results)"


def read_results_file(path: Path) -> tuple[dict[str, Any], Any]:
    """``(setup, results)`` of the object in a results file (:func:`tierkv.inputs.read_json`, never through a
    link), the records not yet checked."""
    data = read_json(path, "results file", RESULTS_FIX, MAX_RESULTS_BYTES, follow=False)
    if not isinstance(data, dict) or not isinstance(data.get("setup", {}), dict):
        raise InvalidConfigError(f"results file {str(path)!r} is not an object with a setup and results; "
                                 f"{RESULTS_FIX}.")
    return data.get("setup", {}), data.get("results")


def read_results(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(setup, records)`` of a results file, each checked (:func:`check_records`): an
    InvalidConfigError names the file and the fix."""
    setup, results = read_results_file(path)
    return setup, check_records(results, path, RESULTS_FIX)


def check_results(folder: str | Path) -> None:
    """Refuse (before a run) a results file in ``folder`` that the tables after it could not read."""
    for path in results_files(folder):
        read_results(path)
