"""Train the demo model from scratch on the retrieval task, on a laptop CPU, reproducibly.

    python -m tierkv.demo.train --out tierkv/demo/weights

How it is meant to generalise from <=2K-token training prompts to 64K-token ones: the position ids seen
in training are not ``0..n-1`` but ``0..n-1`` with 1-4 random *skips* inserted (PoSE, Zhu et al. 2023; a
local form of the randomised positions of Ruoss et al. 2023). Tokens between two skips stay contiguous,
so local heads see the unit gaps they meet at test time, while the needle-to-question distance ranges
over the whole ``[0, MAX_POSITION)`` window, so retrieval heads see RoPE rotations up to 80K tokens apart.

The rest of the recipe is about leaving the initial plateau within a CPU budget (see docs/demo.md for
the runs behind it): a length curriculum that starts at 64 tokens, the first 200 steps without skips,
a loss on the answer plus a plain language-model term on every other token (repeated filler sentences
and the repeated passkey give it copy targets), and a shared init direction for the number tokens.
After the main schedule, 300 *extension* steps on 2K-8K-token prompts widen the needle's attention
margin, which is what retrieval at 32K needs (85% -> 100% at 32K in docs/demo.md).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tierkv.demo.task import (
    BOS_ID,
    EOS_ID,
    NUMBERS,
    PAD_ID,
    VOCAB,
    WORD_TO_ID,
    make_example,
    save_tokenizer,
)
from tierkv.errors import InvalidConfigError

DIGITS = 3  # one answer token (see tierkv.demo.task)
ANSWER_TOKENS = (DIGITS + 2) // 3
MAX_POSITION = 80_000  # training positions span up to here; eval at 64K + question stays inside


def model_config(layers: int, hidden: int):
    """A small GQA Llama: 4 query heads share 2 KV heads (so the KV cache looks like a real model's)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131_072,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    config._attn_implementation = "sdpa"
    return config


def skip_positions(rng: random.Random, n: int, max_position: int) -> list[int]:
    """``n`` increasing positions in ``[0, max_position)``: runs of consecutive ids split by 1-4 skips.

    Few skips, so almost every token still has its predecessor at distance 1, as at test time.
    """
    span = rng.randint(n, max_position)
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 4))))
    shares = sorted(rng.randint(0, span - n) for _ in cuts)
    extra = [b - a for a, b in zip([0, *shares], shares, strict=False)]
    gaps = [1] * n
    gaps[0] = 0
    for cut, add in zip(cuts, extra, strict=True):
        gaps[cut] += add
    positions, total = [], 0
    for gap in gaps:
        total += gap
        positions.append(total)
    return positions


def share_number_direction(model) -> None:
    """Add one shared random direction to the embeddings of all number tokens, at init.

    Each of the 900 values is the answer in only ~1/900 of the examples; with a shared component "this is
    a number" is one feature from step 0 instead of 900 to learn, while the independent parts keep the
    values apart so they can still be copied (embeddings are tied: copying = reading that vector). Not
    ablated on its own; the shipped weights were trained with it.
    """
    emb = model.get_input_embeddings().weight  # [V, H]
    ids = torch.tensor([WORD_TO_ID[w] for w in NUMBERS])
    with torch.no_grad():
        emb[ids] += torch.randn(emb.shape[1]) * emb.std()


def make_batch(rng: random.Random, batch: int, n: int, contiguous: bool = False):
    """``(input_ids [B, n], position_ids [B, n], answers [B, A])``; each row prompt + answer (A tokens)."""
    ids, pos, answers = [], [], []
    for _ in range(batch):
        max_keys = min(6, (n - 36) // 11)  # a multikey prompt takes 28 + 11 * keys tokens; keep >= 8 filler
        kind = "passkey" if max_keys < 2 or rng.random() < 0.4 else "multikey"
        keys = rng.randint(2, max_keys) if kind == "multikey" else 1
        ex = make_example(rng, n - ANSWER_TOKENS, rng.random(), kind, num_keys=keys, digits=DIGITS)
        ids.append(list(ex.prompt_ids) + list(ex.answer_ids))
        pos.append(list(range(n)) if contiguous else skip_positions(rng, n, MAX_POSITION))
        answers.append(list(ex.answer_ids))
    return torch.tensor(ids), torch.tensor(pos), torch.tensor(answers)


def answer_logits(model, ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """Logits at the positions that predict the answer tokens: ``[B, A, V]``."""
    hidden = model.model(input_ids=ids, position_ids=pos).last_hidden_state  # [B, n, H]
    return model.lm_head(hidden[:, -ANSWER_TOKENS - 1 : -1])


def training_loss(model, ids: torch.Tensor, pos: torch.Tensor, answers: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``answer CE + language-model CE on every other token``; also returns the answer CE alone."""
    logits = model(input_ids=ids, position_ids=pos).logits[:, :-1]  # [B, n-1, V] predicts ids[:, 1:]
    answer = F.cross_entropy(logits[:, -ANSWER_TOKENS:].flatten(0, 1), answers.flatten())
    lm = F.cross_entropy(logits[:, :-ANSWER_TOKENS].flatten(0, 1), ids[:, 1:-ANSWER_TOKENS].flatten())
    return answer + lm, answer.item()


@torch.no_grad()
def quick_accuracy(model, length: int, samples: int, seed: int) -> float:
    """Exact-match accuracy with contiguous positions, teacher forced (= greedy decoding when right)."""
    model.eval()
    rng = random.Random(seed)
    hits = 0
    for _ in range(samples):
        ids, _, answers = make_batch(rng, 1, length, contiguous=True)
        hits += bool((answer_logits(model, ids).argmax(-1) == answers).all())
    model.train()
    return hits / samples


def length_range(args: argparse.Namespace, step: int) -> tuple[float, float]:
    """Training prompt lengths at ``step``: ``(shortest, longest)``, sampled log-uniformly in between.

    Curriculum: short prompts first. At init attention is uniform, so the needle's share of the final
    position's input (and with it the gradient that teaches "attend to the needle") is ~1/n: 64-token
    prompts learn the circuit many times faster than 2K ones. The range grows to ``max_len`` over the
    first half. The *extension* steps after the main schedule use ``max_len``-``extend_len`` prompts: at
    test time one needle competes with 16-32x more filler than at 2K, and only long prompts give a
    gradient that keeps widening the needle's attention margin once short prompts are solved.
    """
    if step >= args.steps:
        return args.max_len, args.extend_len
    return args.min_len, args.min_len + (args.max_len - args.min_len) * min(1.0, 2 * step / args.steps)


def lr_at(args: argparse.Namespace, step: int) -> float:
    """Linear warm-up and cosine decay over the main steps, then a second, lower cosine for the extension."""
    if step >= args.steps:
        k = step - args.steps
        return args.extend_lr * 0.5 * (1 + math.cos(math.pi * k / max(1, args.extend_steps)))
    warmup = min(100, args.steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))


def make_optimizer(model, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )


def run_steps(model, opt, rng: random.Random, args: argparse.Namespace, steps: range) -> list[dict]:
    """Train ``steps`` (indices into the whole schedule, main + extension); return the quick checks."""
    start = time.perf_counter()
    history = []
    last = args.steps + args.extend_steps - 1
    for step in steps:
        shortest, longest = length_range(args, step)
        n = int(math.exp(rng.uniform(math.log(shortest), math.log(longest))))
        batch = max(1, args.batch_tokens // n)
        ids, pos, answers = make_batch(rng, batch, n, contiguous=step < args.contiguous_steps)
        loss, answer_loss = training_loss(model, ids, pos, answers)
        lm_loss = loss.item() - answer_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == last:
            elapsed = time.perf_counter() - start
            print(
                f"step {step:5d}  n {n:5d}  answer loss {answer_loss:.4f}  lm loss {lm_loss:.3f}  {elapsed:7.1f}s",
                flush=True,
            )
        if args.check_every and ((step + 1) % args.check_every == 0 or step == last):
            record = {"step": step + 1, "wall_s": round(time.perf_counter() - start, 1)}
            for length in args.check_lengths:
                record[str(length)] = quick_accuracy(model, length, args.check_samples, seed=10_000 + step)
            history.append(record)
            print("check", json.dumps(record), flush=True)
            save(model, args.out)
    return history


def train(args: argparse.Namespace) -> dict:
    """Run the training schedule; save the model and tokenizer into ``args.out``; return the run record."""
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = LlamaForCausalLM(model_config(args.layers, args.hidden))
    share_number_direction(model)
    opt = make_optimizer(model, args.lr)
    start = time.perf_counter()
    history = run_steps(model, opt, rng, args, range(args.steps + args.extend_steps))
    wall = time.perf_counter() - start
    save(model, args.out)
    return {
        "seed": args.seed,
        "steps": args.steps,
        "extend_steps": args.extend_steps,
        "wall_time_s": round(wall, 1),
        "threads": args.threads,
        "batch_tokens": args.batch_tokens,
        "train_lengths": [args.min_len, args.max_len],
        "extend_lengths": [args.max_len, args.extend_len],
        "contiguous_steps": args.contiguous_steps,
        "max_position": MAX_POSITION,
        "lr": args.lr,
        "extend_lr": args.extend_lr,
        "layers": args.layers,
        "hidden": args.hidden,
        "checks": history,
    }


def save(model, out: str | Path) -> None:
    """Weights as safetensors + config + tokenizer, loadable by ``tierkv.demo.model.load_demo_model``."""
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tierkv.demo.train", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "weights"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--extend-steps", type=int, default=300, help="steps on long prompts after the main schedule")
    p.add_argument("--extend-len", type=int, default=8192, help="longest prompt of the extension steps")
    p.add_argument("--extend-lr", type=float, default=5e-4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contiguous-steps", type=int, default=200, help="first steps use positions 0..n-1 (no skips)")
    p.add_argument("--check-every", type=int, default=300, help="quick accuracy check interval (0: never)")
    p.add_argument("--check-lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--check-samples", type=int, default=8)
    p.add_argument(
        "--eval-lengths",
        type=int,
        nargs="*",
        default=[4096, 16384, 32768, 65536],
        help="final accuracy table stored in training.json (none: skip)",
    )
    p.add_argument("--eval-samples", type=int, default=4, help="seeded haystacks per (length, depth)")
    p.add_argument("--eval-out", default=None, help="also write the table's eval.json and heatmap.png here")
    args = p.parse_args(argv)
    if not 64 <= args.min_len <= args.max_len <= MAX_POSITION:
        raise InvalidConfigError(f"need 64 <= --min-len <= --max-len <= {MAX_POSITION} (the trained positions)")
    if args.extend_steps > 0 and not args.max_len <= args.extend_len <= MAX_POSITION:
        raise InvalidConfigError(f"need --max-len <= --extend-len <= {MAX_POSITION} (or --extend-steps 0)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = train(args)
    if args.eval_lengths:
        from tierkv.demo.evaluate import evaluate, plot_heatmap
        from tierkv.demo.model import load_demo_model

        model, tokenizer = load_demo_model(path=args.out)
        start = time.perf_counter()
        result = evaluate(model, tokenizer, lengths=args.eval_lengths, samples=args.eval_samples)
        record["eval"] = result.to_dict() | {"wall_time_s": round(time.perf_counter() - start, 1)}
        if args.eval_out:
            out = Path(args.eval_out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "eval.json").write_text(json.dumps(record["eval"] | {"device": "cpu"}, indent=2) + "\n")
            plot_heatmap(result, out / "heatmap.png")
    (Path(args.out) / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
