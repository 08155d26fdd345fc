"""Every method of a quality run side by side: tables (terminal and markdown) and plots.

A run folder holds ``reference.json`` (the prompts, full attention), ``tierkv.json`` (``tierkv eval --tasks``)
and ``kvpress*.json`` (``benchmarks/quality/kvpress_run.py``, one file per invocation); the report reads what
is there. kvpress records
carry generated ids; they are decoded and scored here with the same tokenizer and rule as tierkv's::

    python -m tierkv.quality.report results/quality/smollm2 --plot docs/quality/smollm2.png --markdown -
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from tierkv import safefs
from tierkv.errors import InvalidConfigError
from tierkv.inputs import printable
from tierkv.quality.harness import DEFAULT_BLOCK_TOKENS, RESULT_OPTIONS, CacheSetup  # other setups: own rows
from tierkv.quality.run_folder import (
    FRESH_FOLDER,
    REFERENCE_FILE,
    REFERENCE_FIX,
    check_records,
    read_reference,
    read_results,
    results_files,
)
from tierkv.quality.tasks import TASKS, answer_matches
from tierkv.units import format_tokens, plural

FAMILIES = {"sparse": "tierkv sparse", "snapkv": "SnapKV", "streaming_llm": "StreamingLLM",
            "expected_attention": "ExpectedAttention", "knorm": "Knorm"}
BASELINES = {"full": "full attention", "exact": "tierkv exact", "kvpress-full": "full (kvpress env)"}


def load_results(folder: str | Path, tokenizer=None) -> list[dict[str, Any]]:
    """Every record of the run, kvpress's scored with ``tokenizer`` (needed when kvpress.json is there); each file
    read and checked as :func:`read_results` says."""
    folder = Path(folder)
    reference = read_reference(folder)
    answers = _answers(reference, folder / REFERENCE_FILE)
    records = check_records(reference.get("results"), folder / REFERENCE_FILE, REFERENCE_FIX)
    for path in results_files(folder):
        setup, results = read_results(path)
        family = sparse_family(setup) if path.name.startswith("tierkv") else None
        for record in results:
            if family not in (None, "sparse") and record["method"].startswith("sparse@"):
                record["method"] = f"{family}@{record['method'].split('@')[1]}"
            if record["task"] != "fidelity" and "correct" not in record:
                _score(record, answers, tokenizer, path)
            records.append(record)
    return records


def _score(record: dict[str, Any], answers: dict[str, str], tokenizer, path: Path) -> None:
    """Decode and score a kvpress record's generated ids against the reference's answer."""
    if tokenizer is None:
        raise ValueError("kvpress results carry token ids; give the model's tokenizer to score them")
    expected = answers.get(record["prompt"])
    if expected is None:
        raise InvalidConfigError(f"{str(path)!r}: record of prompt {record['prompt']!r} asks for no answer the "
                                 f"reference has; {FRESH_FOLDER}.")
    text = tokenizer.decode(record["generated"], skip_special_tokens=True)
    record.update(answer=expected, output=text, correct=answer_matches(expected, text))


def _answers(reference: dict[str, Any], path: Path) -> dict[str, str]:
    """``{prompt key: answer}`` of the needle prompts of a ``reference.json``."""
    prompts = reference.get("prompts")
    try:
        if not isinstance(prompts, list):
            raise TypeError("no list of prompts")
        return {_key(p): p["answer"] for p in prompts if p["task"] != "fidelity"}
    except (TypeError, KeyError, ValueError) as exc:
        raise InvalidConfigError(f"reference {str(path)!r}: a prompt lacks its task, length, depth, sample or answer "
                                 f"({type(exc).__name__}: {exc}); {REFERENCE_FIX}.") from None


def _key(prompt: dict[str, Any]) -> str:
    depth = "" if prompt["depth"] is None else f"/d{float(prompt['depth']):.2f}"
    return f"{prompt['task']}/{int(prompt['length'])}{depth}/#{int(prompt['sample'])}"


def label(method: str) -> str:
    """``sparse@0.05`` -> ``tierkv sparse 5%``; ``snapkv@0.1`` -> ``SnapKV 10%``; ``full`` -> ``full attention``."""
    if method in BASELINES:
        return BASELINES[method]
    family, budget = method.split("@")
    return f"{family_label(family)} {float(budget):.0%}"


_SPARSE_LETTERS = {"page_tokens": "p", "sinks": "s", "recent": "w", "dense_layers": "d", "rest_bits": "r"}
"""The letter of each option but the block size in a sparse family's name, in order (``sparse8p4s0w32d2r2``)."""


def sparse_family(setup: dict[str, Any]) -> str:
    """The family name of a run's sparse records, from the run's cache setup: ``sparse`` with the defaults, else
    ``sparse`` and the block size, then ``p`` (pages), ``s`` (sinks), ``w`` (recent window), ``d`` (dense layers)
    and ``r`` (rest bits) for each option given: ``sparse8``, ``sparse256p16``, ``sparse16s0w32``, ``sparse8r2``."""
    defaults = CacheSetup().to_dict()
    values = {name: setup.get(name, defaults[name]) for name in RESULT_OPTIONS}
    given = "".join(f"{letter}{values[name]}" for name, letter in _SPARSE_LETTERS.items()
                    if values[name] != defaults[name])
    return "sparse" if values["block_tokens"] == DEFAULT_BLOCK_TOKENS and not given else \
        f"sparse{values['block_tokens']}{given}"


def _sparse_variant(family: str) -> dict[str, int] | None:
    """``sparse8r2`` -> ``{"block_tokens": 8, "rest_bits": 2}``: the options a sparse family's name gives; None for
    any other family."""
    letters = "".join(f"(?:{letter}(\\d+))?" for letter in _SPARSE_LETTERS.values())
    match = re.fullmatch(rf"sparse(\d+){letters}", family)
    if match is None:
        return None
    values = dict(zip(("block_tokens", *_SPARSE_LETTERS), match.groups(), strict=True))
    return {name: int(value) for name, value in values.items() if value is not None}


def family_label(family: str) -> str:
    """``snapkv`` -> ``SnapKV``; ``sparse8`` (tierkv sparse on 8-token blocks) -> ``tierkv sparse, 8-token blocks``;
    ``sparse8r2`` -> ``tierkv sparse, 8-token blocks, 2-bit rest``; another family as named, without control
    characters."""
    if family in FAMILIES:
        return FAMILIES[family]
    variant = _sparse_variant(family)
    if variant is None:
        return printable(family)  # a results file's own name: never a terminal's escape
    words = {"page_tokens": lambda n: f"{n}-token pages", "sinks": lambda n: plural(n, "sink token"),
             "recent": lambda n: plural(n, "recent token"), "dense_layers": lambda n: plural(n, "dense layer"),
             "rest_bits": lambda n: f"{n}-bit rest"}
    return ", ".join([f"tierkv sparse, {variant['block_tokens']}-token blocks",
                      *(words[name](variant[name]) for name in _SPARSE_LETTERS if name in variant)])


def family_rank(family: str) -> float:
    """Table and legend order: tierkv's families first (other block sizes after the default), then the presses."""
    if family in FAMILIES:
        return list(FAMILIES).index(family)
    variant = _sparse_variant(family)
    return 99 if variant is None else 0.5 + 0.01 * variant.get("rest_bits", 0)


def aggregate(records: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, float]]:
    """``{(task, method, length): {"accuracy" | "top1", "kl_mean", "n"}}``."""
    groups: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["task"], r["method"], r["length"])].append(r)
    out = {}
    for key, rs in groups.items():
        if key[0] == "fidelity":
            steps = sum(r["agreement"]["steps"] for r in rs)
            out[key] = {"top1": sum(r["agreement"]["top1"] * r["agreement"]["steps"] for r in rs) / steps,
                        "kl_mean": sum(r["agreement"]["kl_mean"] * r["agreement"]["steps"] for r in rs) / steps,
                        "n": len(rs), "steps": steps}
        else:
            out[key] = {"accuracy": sum(bool(r["correct"]) for r in rs) / len(rs), "n": len(rs)}
    return out


def _order(methods) -> list[str]:
    def rank(m: str) -> tuple:
        if m in BASELINES:
            return (0, list(BASELINES).index(m), "", 0.0)
        family, budget = m.split("@")
        return (1, family_rank(family), family, float(budget))

    return sorted(set(methods), key=rank)


def rows(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[tuple[str, list[str]]]]]:
    """Per task: (lengths, [(method label, cells)]) with accuracy (needles) or "top-1 / KL" (fidelity)."""
    table = aggregate(records)
    out = {}
    for task in TASKS:
        keys = [k for k in table if k[0] == task]
        if not keys:
            continue
        lengths = sorted({k[2] for k in keys})
        body = []
        for method in _order(k[1] for k in keys):
            cells = []
            for n in lengths:
                cell = table.get((task, method, n))
                if cell is None:
                    cells.append("")
                elif task == "fidelity":
                    cells.append(f"{cell['top1']:.1%} / {cell['kl_mean']:.3f}")
                else:
                    cells.append(f"{cell['accuracy']:.0%} ({cell['n']})")
            body.append((label(method), cells))
        out[task] = (lengths, body)
    return out


def summary_table(folder: str | Path, tokenizer=None):
    """A rich table for the terminal: one block of rows per task."""
    from rich.table import Table
    from rich.text import Text

    records = load_results(folder, tokenizer)
    table = Table(title="quality vs full attention: accuracy (prompts) / fidelity top-1 agreement / mean KL")
    per_task = rows(records)
    lengths = sorted({n for ls, _ in per_task.values() for n in ls})
    table.add_column("task")
    table.add_column("method")
    for n in lengths:
        table.add_column(format_tokens(n), justify="right")
    for task, (task_lengths, body) in per_task.items():
        for i, (name, cells) in enumerate(body):
            by_length = dict(zip(task_lengths, cells, strict=True))
            table.add_row(task if i == 0 else "", Text(name), *(by_length.get(n, "") for n in lengths))  # no markup
    return table


def markdown(records: list[dict[str, Any]]) -> str:
    """One markdown table per task."""
    parts = []
    for task, (lengths, body) in rows(records).items():
        what = "top-1 agreement / mean KL (nats)" if task == "fidelity" else "accuracy (prompts)"
        parts.append(f"**{task}** — {what}\n")
        parts.append("| method | " + " | ".join(format_tokens(n) for n in lengths) + " |")
        parts.append("|---|" + "---:|" * len(lengths))
        parts += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in body]
        parts.append("")
    return "\n".join(parts)


def plot(records: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Accuracy (needle, multi-needle) and top-1 agreement / KL (fidelity) against the KV budget, per length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = aggregate(records)
    lengths = sorted({k[2] for k in table})
    panels = [(t, m) for t, m in (("needle", "accuracy"), ("multi-needle", "accuracy"), ("fidelity", "top1"),
                                  ("fidelity", "kl_mean")) if any(k[0] == t for k in table)]
    fig, axes = plt.subplots(len(lengths), len(panels), figsize=(3.6 * len(panels), 2.8 * len(lengths)),
                             squeeze=False)
    for row, n in enumerate(lengths):
        for col, (task, metric) in enumerate(panels):
            ax = axes[row][col]
            methods = {k[1] for k in table if k[0] == task and k[2] == n}
            families = sorted({m.split("@")[0] for m in methods if "@" in m}, key=lambda f: (family_rank(f), f))
            for family in families:
                points = sorted((float(m.split("@")[1]), table[(task, m, n)][metric]) for m in methods
                                if m.startswith(family + "@"))
                style = dict(linewidth=2.5, color="black") if family == "sparse" else {}
                ax.plot([100 * b for b, _ in points], [v for _, v in points], marker="o",
                        label=family_label(family), **style)
            if "full" in methods:
                ax.axhline(table[(task, "full", n)][metric], color="gray", linestyle="--", label="full attention")
            ax.set_title(f"{task} {format_tokens(n)}: {metric.replace('_', ' ')}", fontsize=9)
            ax.set_xlabel("KV budget (% of context)", fontsize=8)
            if metric in ("accuracy", "top1"):
                ax.set_ylim(-0.05, 1.05)
            ax.tick_params(labelsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    path = Path(path)
    os.close(safefs.open_user_directory(path.parent))  # created 0700 if missing
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    safefs.write_file(path, [image.getvalue()])  # 0600, a link planted there replaced, never written through
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tables and plots of a quality run folder.")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--plot", type=Path, default=None, help="PNG to write")
    parser.add_argument("--markdown", default=None, help="markdown file to write, or - for stdout")
    parser.add_argument("--records", type=Path, default=None,
                        help="JSON file to write with every scored record (no token ids: small enough to commit)")
    args = parser.parse_args(argv)
    from tierkv import models

    name = read_reference(args.folder).get("model", "demo")
    _, tokenizer = models.load(name)
    records = load_results(args.folder, tokenizer)
    if args.plot:
        print(f"wrote {plot(records, args.plot, f'{name}: quality against full attention')}", file=sys.stderr)
    if args.records:
        slim = [{k: v for k, v in r.items() if k != "generated"} for r in records]
        os.close(safefs.open_user_directory(args.records.parent))  # created 0700 if missing
        safefs.write_file(args.records, [json.dumps({"model": name, "results": slim}, indent=0).encode()])
    if args.markdown:
        text = markdown(records)
        if args.markdown == "-":
            print(text)
        else:
            safefs.write_file(args.markdown, [text.encode()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
