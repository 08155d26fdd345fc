"""kvpress presses on the prompts of a tierkv quality reference, written as JSON for the report.

Runs in kvpress's own environment (``bash benchmarks/quality/kvpress_env.sh``: kvpress 0.5.5 pins
transformers<5.3). It reads the prompts that ``tierkv eval --tasks ...`` wrote (``reference.json``, token
ids) and full attention's log-probabilities, so both sides measure the very same prompts::

    /tmp/tierkv-kvpress-venv/bin/python benchmarks/quality/kvpress_run.py \
        --reference results/quality/smollm2 --model-dir ~/.cache/tierkv/models/smollm2-135m-instruct-q4_1-0.1.2 \
        --out results/quality/smollm2/kvpress.json

What is run, as kvpress's own pipeline does it (``KVPressTextGenerationPipeline._forward``): the context is
prefilled in one forward of ``model.model`` with the press's hooks, so the press prunes each layer's KV to
``(1 - compression_ratio)`` of the context; then the question is fed uncompressed with ``position_ids``
continuing the uncompressed positions, and the answer is decoded greedily. Fidelity prompts prefill
``context[:-1]`` the same way and then teacher-force ``context[-1], continuation[:-1]`` (one forward,
positions continued) for the next-token distributions that are compared with full attention's.

One prefill serves every (press, budget): a forward hook on each attention layer calls every variant's
``press.compress(module, hidden_states, keys, values, attentions, kwargs)`` — the call kvpress's own
``BasePress.forward_hook`` makes — on the layer's full KV and keeps each result in that variant's cache,
leaving the forward's own cache uncompressed. A press's scores of a layer depend only on that layer's
inputs in the prefill, which pruning earlier layers does not change (kvpress prunes after each layer's
attention), so this gives each variant exactly the cache its own ``with press(model):`` prefill would.
The uncompressed cache is decoded too (``kvpress-full``): full attention in this environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tierkv.quality's prompts and metrics (plain torch, no transformers needed)

from tierkv import safefs  # noqa: E402
from tierkv.quality.metrics import compare  # noqa: E402
from tierkv.quality.run_folder import load_logprobs, load_reference, logprob_path, read_results  # noqa: E402

PRESSES = ("snapkv", "streaming_llm", "expected_attention", "knorm")


def make_press(name: str, ratio: float):
    import kvpress

    classes = {"snapkv": kvpress.SnapKVPress, "streaming_llm": kvpress.StreamingLLMPress,
               "expected_attention": kvpress.ExpectedAttentionPress, "knorm": kvpress.KnormPress}
    return classes[name](compression_ratio=ratio)


def fan_out_prefill(model, ids: list[int], variants: dict[str, object]):
    """Prefill ``ids`` once; return ``{name: DynamicCache}`` compressed by each variant, plus ``"full"``."""
    from transformers import DynamicCache

    language_model = model.model
    kept: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in variants}

    def hook(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        layer = cache.layers[module.layer_idx]
        for name, press in variants.items():
            kept[name].append(press.compress(module, kwargs["hidden_states"], layer.keys, layer.values, output[1],
                                             kwargs))
        return output

    for press in variants.values():
        press.post_init_from_model(model)
    hooks = []
    full = DynamicCache()
    try:
        for layer in language_model.layers:
            layer.self_attn.rotary_emb = language_model.rotary_emb  # as kvpress's BasePress.__call__ does
            hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        with torch.inference_mode():
            language_model(input_ids=torch.tensor([ids]), past_key_values=full)
    finally:
        for h in hooks:
            h.remove()
    caches = {"full": full}
    for name, layers in kept.items():
        cache = DynamicCache()
        for i, (keys, values) in enumerate(layers):
            cache.update(keys, values, i)
        caches[name] = cache
    return caches


@torch.inference_mode()
def answer(model, cache, question: list[int], context_length: int, tokens: int) -> list[int]:
    """kvpress's ``generate_answer``: question at positions after the uncompressed context, then greedy."""
    position = torch.arange(context_length, context_length + len(question)).unsqueeze(0)
    out = model(input_ids=torch.tensor([question]), past_key_values=cache, position_ids=position, logits_to_keep=1)
    generated = [int(out.logits[0, -1].argmax())]
    next_position = context_length + len(question)
    while len(generated) < tokens:
        out = model(input_ids=torch.tensor([generated[-1:]]), past_key_values=cache,
                    position_ids=torch.tensor([[next_position]]), logits_to_keep=1)
        generated.append(int(out.logits[0, -1].argmax()))
        next_position += 1
    return generated


@torch.inference_mode()
def teacher_forced(model, cache, fed: list[int], context_length: int) -> torch.Tensor:
    """Next-token logits after each of ``fed`` ``[S, V]``, positions continuing the uncompressed context."""
    position = torch.arange(context_length, context_length + len(fed)).unsqueeze(0)
    out = model(input_ids=torch.tensor([fed]), past_key_values=cache, position_ids=position)
    return out.logits[0].float()


def load_model(folder: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa", use_safetensors=True,
                                            trust_remote_code=False).eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="folder written by tierkv eval --tasks")
    parser.add_argument("--model-dir", type=Path, required=True, help="the model checkpoint folder")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--presses", default=",".join(PRESSES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--budgets", default="0.02,0.05,0.1",
                        help="kept fraction of the context (default: %(default)s)")
    parser.add_argument("--tasks", default="needle,multi-needle,fidelity",
                        help="only the prompts of these tasks (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import importlib.metadata

    import transformers

    kvpress_version = importlib.metadata.version("kvpress")

    tasks = set(args.tasks.split(","))
    prompts = [p for p in load_reference(args.reference)[0] if p.task in tasks]  # the folder's files checked
    model = load_model(args.model_dir)
    budgets = [float(b) for b in args.budgets.split(",")]
    names = [p.strip() for p in args.presses.split(",") if p.strip()]
    records = read_results(args.out)[1] if os.path.lexists(args.out) else []  # resume; a link is refused
    finished = {r["prompt"] for r in records}
    prompts = [p for p in prompts if p.key not in finished]
    started = time.perf_counter()
    for done, prompt in enumerate(prompts):
        variants = {f"{n}@{b:g}": make_press(n, 1.0 - b) for n in names for b in budgets}
        fidelity = prompt.task == "fidelity"
        context = list(prompt.context_ids[:-1] if fidelity else prompt.context_ids)
        t0 = time.perf_counter()
        caches = fan_out_prefill(model, context, variants)
        prefill_s = time.perf_counter() - t0
        reference = None
        if fidelity:  # checked against the model's vocabulary before it is read, never through a link
            reference = load_logprobs(logprob_path(args.reference, prompt), prompt, model.config.vocab_size)
        for variant, cache in caches.items():
            kept = cache.get_seq_length()
            record = {"prompt": prompt.key, "task": prompt.task, "length": prompt.length, "depth": prompt.depth,
                      "sample": prompt.sample, "method": "kvpress-full" if variant == "full" else variant,
                      "budget": None if variant == "full" else float(variant.split("@")[1]),
                      "kept_context_tokens": kept, "prefill_s": round(prefill_s, 2)}
            if fidelity:
                fed = [prompt.context_ids[-1], *prompt.continuation_ids[:-1]]
                logits = teacher_forced(model, cache, fed, len(context))
                record["agreement"] = compare(reference, logits).to_dict()
            else:
                record["generated"] = answer(model, cache, list(prompt.question_ids), len(context),
                                             prompt.answer_tokens)
            records.append(record)
            print(f"[{done + 1}/{len(prompts)}] {prompt.key} {record['method']}: "
                  f"{record.get('agreement') or record.get('generated')}", flush=True)
        os.close(safefs.open_user_directory(args.out.parent))  # created 0700 if missing
        # after every prompt (a rerun resumes from here); a link planted there is replaced, never written through
        safefs.write_file(args.out, [json.dumps({"kvpress": kvpress_version, "transformers": transformers.__version__,
                                                 "torch": torch.__version__, "presses": names, "budgets": budgets,
                                                 "results": records}).encode()])
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
