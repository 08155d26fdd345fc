"""Load the shipped demo model (a ~0.8M-parameter Llama trained by ``tierkv.demo.train``).

The weights live inside the package (``tierkv/demo/weights/``) so ``tierkv demo`` and ``tierkv eval`` work
offline on a fresh install: nothing is downloaded at run time.
"""

from __future__ import annotations

from pathlib import Path

from tierkv.demo.task import load_tokenizer
from tierkv.errors import TierKVError

WEIGHTS_DIR = Path(__file__).parent / "weights"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


class DemoWeightsMissingError(TierKVError, FileNotFoundError):
    """The demo model's files are not where the loader looks for them."""


def load_demo_model(device: str = "cpu", path: str | Path | None = None):
    """Return ``(model, tokenizer)``: the demo ``LlamaForCausalLM`` (fp32, sdpa, eval mode) on ``device``
    and its ``PreTrainedTokenizerFast``. ``path`` defaults to the weights packaged with tierkv; a folder given
    is read as :func:`tierkv.models.load_folder` reads one (safetensors only, no code of its run, its files
    checked first) and whatever transformers raises on it is one CheckpointError naming it.
    """
    from transformers import LlamaForCausalLM

    from tierkv.models import check_folder_files, transformers_load

    folder = Path(path) if path is not None else WEIGHTS_DIR
    missing = missing_files(folder)
    if missing:
        raise DemoWeightsMissingError(
            f"demo model files missing in {folder}: {', '.join(missing)}. Train them (about 30 minutes on a "
            f"2-core CPU) with: python -m tierkv.demo.train --out {folder}"
        )
    what = f"demo model folder {str(folder)!r}"
    check_folder_files(folder, {entry.name for entry in folder.iterdir()}, what)

    def load() -> tuple:
        model = quietly(lambda: LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa",
                                                                 use_safetensors=True, trust_remote_code=False))
        return model.to(device).eval(), load_tokenizer(folder / "tokenizer.json")

    return transformers_load(what, load)


def missing_files(folder: Path) -> list[str]:
    """The demo model's files that ``folder`` lacks (none: it can be loaded)."""
    return [name for name in _REQUIRED if not (folder / name).is_file()]


def quietly(load):
    """Run ``load`` without transformers' "Loading weights" progress bar (it would cut into the demo's own
    output, and a 0.8M-parameter model loads in milliseconds); the user's setting is restored after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load()
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
