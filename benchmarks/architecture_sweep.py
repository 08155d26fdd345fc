"""Every causal-LM model type of the installed transformers, tiny, through ``TieredCache`` against ``DynamicCache``.

    python benchmarks/architecture_sweep.py                 # all types, one child process each (~15 min)
    python benchmarks/architecture_sweep.py qwen3_next gpt2   # some
    python benchmarks/architecture_sweep.py --executor split  # decode inside `with cache.split(model):` (streaming too)
    python benchmarks/architecture_sweep.py --save-load       # the conversation saved after 2 tokens, loaded, continued

Each type gets a tiny config (4 layers, hidden 64, 4 query heads over 2 KV heads of 16; its own defaults where the
type refuses these), a seeded fp32 model (skipped above 60 M parameters, counted on the meta device first), and
greedy generation of 4 tokens after 24 for two rows: ``DynamicCache(config=)`` against ``TieredCache(config=)`` at
``min_device_bytes`` with host and disk tiers. One JSON line per type: ``equal``, ``DIFF`` (tokens or logits
beyond 1e-3), ``refused`` (tierkv's InvalidConfigError, which names the fix: a model the executor cannot serve), or
where it stopped (``error@config`` / ``build`` / ``reference``: transformers itself; ``error@tiered``: tierkv). The
streaming and split executors run at their own device minimum. ``--save-load`` (exact gather): the tiered cache
is saved (``cache.save``) after 2 of the 4 tokens and a cache loaded from the file (``TieredCache.load``)
generates the other 2, against one ``DynamicCache`` that generated 2 and then 2 more (a continued ``generate()``
is the reference: some models' own continuation differs from one uninterrupted run). A child per type, so a model
too large for the host ends only its own line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import warnings

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, pad_token_id=0, bos_token_id=1,
            eos_token_id=None, tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MAX_PARAMS = 60e6


EXECUTORS = ("gather", "streaming", "split")


def sweep_one(model_type: str, executor: str = "gather", save_load: bool = False) -> dict:
    import contextlib
    from pathlib import Path

    import torch
    import transformers
    from transformers import DynamicCache

    from tierkv import TieredCache
    from tierkv.errors import InvalidConfigError

    stage = "config"
    try:
        try:
            config = transformers.AutoConfig.for_model(model_type, **TINY)
            if not hasattr(type(config)(), "num_key_value_heads"):  # a type without grouped K/V heads (GPT-2)
                del config.num_key_value_heads  # would keep the stray value, and sizing would believe it
        except Exception:  # noqa: BLE001 - a type that refuses the tiny sizes keeps its own
            config = transformers.AutoConfig.for_model(model_type)
        stage = "build"
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(config)
        if sum(p.numel() for p in meta.parameters()) > MAX_PARAMS:
            return {"type": model_type, "result": "skip-big"}
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        head = model.get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else 100
        ids = torch.randint(2, min(vocab, 100), (2, 24), generator=torch.Generator().manual_seed(1))
        options = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
        stage = "reference"
        first, then = {**options, "max_new_tokens": 2}, {**options, "max_new_tokens": 2}
        if save_load:
            dynamic = DynamicCache(config=model.config)
            sequence = model.generate(ids, past_key_values=dynamic, **first).sequences
            ones = torch.ones_like(sequence)  # every token attended (a generated pad id too)
            reference = model.generate(sequence, attention_mask=ones, past_key_values=dynamic, **then)
        else:
            reference = model.generate(ids, past_key_values=DynamicCache(config=model.config), **options)
        stage = "tiered"
        minimum = {"gather": lambda: TieredCache.min_device_bytes(model.config, 64, 2, block_tokens=4),
                   "streaming": lambda: TieredCache.min_streaming_device_bytes(model.config, 2, block_tokens=4),
                   "split": lambda: TieredCache.min_split_device_bytes(model.config, 2, block_tokens=4)}[executor]
        with tempfile.TemporaryDirectory() as directory:
            try:  # the device minimum too: a model the cache cannot size is refused there
                budgets = dict(gpu_gb=f"{minimum() + 65536}B", cpu_gb="32KB", disk_dir=directory, block_tokens=4)
                with TieredCache(config=model.config, **budgets) as cache:
                    engaged = {"streaming": cache.streaming, "split": cache.split}.get(executor)
                    with engaged(model) if engaged is not None else contextlib.nullcontext():
                        out = model.generate(ids, past_key_values=cache, **(first if save_load else options))
                    if save_load:
                        stage = "saved"
                        cache.save(Path(directory) / "turn.tkv", model=model)
            except InvalidConfigError as exc:
                return {"type": model_type, "result": "refused", "error": str(exc)[:200]}
            if save_load:
                stage = "loaded"
                with TieredCache.load(Path(directory) / "turn.tkv", model=model, **budgets) as cache:
                    out = model.generate(sequence, attention_mask=ones, past_key_values=cache, **then)
        error = max((a - b).abs().max().item() for a, b in zip(out.logits, reference.logits, strict=True))
        same = torch.equal(out.sequences, reference.sequences) and error < 1e-3
        return {"type": model_type, "result": "equal" if same else "DIFF", "logit_error": error}
    except Exception as exc:  # noqa: BLE001 - the stage and the error are the result
        return {"type": model_type, "result": f"error@{stage}", "error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", metavar="TYPE",
                        help="transformers model types to sweep, e.g. qwen3_next gpt2 (default: every causal-LM type, "
                             "one child process each; one type runs in this process)")
    parser.add_argument("--executor", choices=EXECUTORS, default="gather",
                        help="gather: exact gather (default); streaming or split: decode inside "
                             "`with cache.streaming(model):` or `with cache.split(model):`")
    parser.add_argument("--save-load", action="store_true",
                        help="save the conversation after 2 tokens, load it into a new cache and generate 2 more")
    args = parser.parse_args(argv)
    types, executor = args.types, args.executor
    if len(types) == 1:
        warnings.filterwarnings("ignore")
        print(json.dumps(sweep_one(types[0], executor, args.save_load)), flush=True)
        return
    if not types:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    counts: dict[str, int] = {}
    for model_type in types:
        try:
            child = subprocess.run([sys.executable, __file__, model_type, "--executor", executor,
                                    *(["--save-load"] if args.save_load else [])],
                                   capture_output=True, text=True, timeout=180)  # fmt: skip
            lines = child.stdout.strip().splitlines()
            line = lines[-1] if lines else json.dumps({"type": model_type, "result": f"died ({child.returncode})"})
        except subprocess.TimeoutExpired:
            line = json.dumps({"type": model_type, "result": "timeout"})
        print(line, flush=True)
        result = json.loads(line)["result"]
        counts[result] = counts.get(result, 0) + 1
    print(json.dumps({"counts": counts}))


if __name__ == "__main__":
    main(sys.argv[1:])
