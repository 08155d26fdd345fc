"""The prompts every method is measured on: needles in a haystack, and real-text continuations.

Three tasks, each a list of :class:`Prompt` records (token ids, so a second environment — kvpress's — reads
exactly the same prompts from JSON):

    needle        one fact "The special magic number for Lisbon is 48213." at a given depth of the
                  haystack; the question asks for it and the answer's first digits must match
    multi-needle  four such facts with different keys at random depths (the asked-for one at the given
                  depth); the question asks for one of them, the other three are distractors
    fidelity      ``length`` tokens of real text and the next ``steps`` tokens of the same text: the method's
                  next-token distributions over those steps (teacher-forced on the real continuation) are
                  compared with full attention's

Two writers build them. :class:`TextTaskWriter` is for a real pretrained model with a Hugging Face tokenizer:
the haystack is the Python Language Reference (:mod:`tierkv.quality.text`), needles are inserted at line
boundaries, and the answer is started for the model ("The special magic number for Lisbon is"), so the next
tokens are the digits. An instruction-tuned model (SmolLM2) gets the question through its chat template; a
base model without one (Gemma 3 270M) gets a plain "Question: ... Answer:" frame after the tokens its
tokenizer starts every text with (Gemma's BOS, which its attention relies on). :class:`DemoTaskWriter` is for
the shipped demo model, which knows only its own 1,634-word synthetic vocabulary and cannot read real text:
its passkey (one needle) and multikey (four keys) haystacks from :mod:`tierkv.demo.task`, and for fidelity a
continuation of that synthetic filler.

Each prompt is split into ``context_ids`` (the document) and ``question_ids`` (what follows it): a KV
compressor prunes the context before the question is seen, as kvpress's pipeline does; tierkv's sparse
executor sees the whole prompt and picks blocks per decode step.
"""

from __future__ import annotations

import functools
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from tierkv.errors import InvalidConfigError

TASKS = ("needle", "multi-needle", "fidelity")
NEEDLE_KEYS = 4  # facts in a multi-needle prompt (the asked-for one and three distractors)

KEYS = (
    "Lisbon", "Nairobi", "Oslo", "Lima", "Hanoi", "Dakar", "Quito", "Riga", "Tunis", "Perth", "Accra", "Bergen",
    "Cusco", "Dublin", "Geneva", "Havana", "Kyoto", "Luanda", "Malmo", "Porto", "Seville", "Tallinn", "Vienna",
    "Zagreb",
)  # fmt: skip
NEEDLE = "The special magic number for {key} is {value}.\n"
INSTRUCTION = "Read the document below and answer the question after it.\n\n<document>\n"
QUESTION = "</document>\n\nWhat is the special magic number for {key} mentioned in the document?"
ANSWER_START = "The special magic number for {key} is"
PLAIN_QUESTION = "</document>\n\nQuestion: What is the special magic number for {key} mentioned in the document?\n" \
    "Answer: "  # a base model's frame (no chat template)
DOC_MARK = "\x00DOCUMENT\x00"  # stands for the document while the chat template is rendered
VALUE_DIGITS = 5


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of one task, as token ids.

    ``length`` is ``len(context_ids) + len(question_ids)``, the context length the task is measured at.
    """

    task: str
    length: int
    sample: int
    context_ids: tuple[int, ...]  # [C] the document (and the chat header before it)
    question_ids: tuple[int, ...]  # [Q] the question and the started answer; empty for fidelity
    depth: float | None = None  # where the asked-for needle sits, 0 (start) .. 1 (end of the context)
    answer: str | None = None  # the needle's value ("48213"); None for fidelity
    answer_tokens: int = 0  # tokens to generate greedily for the answer
    continuation_ids: tuple[int, ...] = field(default=())  # [S] fidelity: the real next tokens

    @property
    def ids(self) -> tuple[int, ...]:
        return self.context_ids + self.question_ids

    @property
    def key(self) -> str:
        """A name for the prompt in tables and JSON: ``needle/8192/d0.50/#1``."""
        depth = "" if self.depth is None else f"/d{self.depth:.2f}"
        return f"{self.task}/{self.length}{depth}/#{self.sample}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: Any) -> Prompt:
        """The prompt a ``reference.json`` record describes; ValueError (a phrase saying what is wrong) unless it
        is a record :meth:`to_dict` could have written: a file another program or a person changed would else
        feed the model ids of nothing or fail mid-run in a traceback."""
        if not isinstance(record, dict):
            raise ValueError(f"a prompt is {type(record).__name__}, not an object")
        names = set(cls.__dataclass_fields__)
        unknown, missing = sorted(set(record) - names), sorted(_REQUIRED - set(record))
        if unknown or missing:
            shown = ", ".join(map(_shown, unknown[:5]))
            raise ValueError(f"a prompt has {'unknown fields ' + shown if unknown else ''}"
                             f"{' and ' if unknown and missing else ''}"
                             f"{'no ' + ', '.join(missing) if missing else ''}")
        fields: dict[str, Any] = {k: _ids(k, v) if k in _ID_FIELDS else v for k, v in record.items()}
        prompt = cls(**fields)
        problem = prompt._problem()
        if problem:
            raise ValueError(f"a prompt of task {_shown(prompt.task)}, sample {_shown(prompt.sample)}: {problem}")
        return prompt

    def _problem(self) -> str | None:
        """What makes this prompt one no task writes (a phrase), or None."""
        if self.task not in TASKS:
            return f"task {_shown(self.task)} is not one of {', '.join(TASKS)}"
        counts = {"length": self.length, "sample": self.sample, "answer_tokens": self.answer_tokens}
        wrong = [name for name, value in counts.items() if not _is_count(value)]
        if wrong:
            return f"{', '.join(wrong)} must be whole numbers >= 0"
        if self.length != len(self.ids) or not self.ids:
            return f"length {self.length} is not its {len(self.ids)} ids"
        if self.task == "fidelity":
            return None if self.depth is None and self.answer is None and self.continuation_ids else \
                "a fidelity prompt has a continuation and no depth or answer"
        if isinstance(self.depth, bool) or not isinstance(self.depth, int | float) or not 0.0 <= self.depth <= 1.0:
            return f"depth {_shown(self.depth)} is not in [0, 1]"
        if not isinstance(self.answer, str) or not self.answer.isdigit() or self.answer_tokens < 1:
            return f"answer {_shown(self.answer)} is not the digits of a needle (with answer_tokens >= 1)"
        return None


def _shown(value: object) -> str:
    """A value of a ``reference.json`` in a message: its repr (control characters escaped), cut to 40 characters
    (a planted one can be megabytes)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_ID_FIELDS = ("context_ids", "question_ids", "continuation_ids")
_REQUIRED = frozenset({"task", "length", "sample", "context_ids", "question_ids"})
MAX_TOKEN_ID = 1 << 31  # above any vocabulary (the model's own size is checked where it runs them)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ids(name: str, value: Any) -> tuple[int, ...]:
    """``value`` as token ids: a list of whole numbers in ``[0, 2**31)``; ValueError naming ``name`` else."""
    if not isinstance(value, list | tuple) or not all(_is_count(i) and i < MAX_TOKEN_ID for i in value):
        raise ValueError(f"a prompt's {name} is not a list of token ids")
    return tuple(value)


def answer_matches(expected: str, output: str) -> bool:
    """Whether the first run of digits in ``output`` is ``expected`` (" 48213." matches "48213")."""
    digits = ""
    for ch in output:
        if ch.isdigit():
            digits += ch
        elif digits:
            break
    return digits == expected


class TextTaskWriter:
    """Prompts for a real model with a Hugging Face tokenizer, over real text (see the module docstring)."""

    def __init__(self, tokenizer) -> None:
        from tierkv.quality.text import reference_text

        self.tokenizer = tokenizer
        self.prefix = _text_prefix(tokenizer)  # what the tokenizer puts before any text (a BOS, or nothing)
        self.haystack = self._encode(reference_text())  # [~190K] ids of the whole reference text
        newline = {i for i in set(self.haystack) if "\n" in tokenizer.decode([i])}
        # positions right after a token that ends a line: a needle inserted there starts a line of its own
        self.line_starts = [p + 1 for p, i in enumerate(self.haystack[:-1]) if i in newline]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @functools.cache  # noqa: B019 (one writer per run, a handful of keys)
    def _frame(self, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ids before the document, ids after it) for a question about ``key``, from the chat template if the
        tokenizer has one."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            head = self.prefix + tuple(self._encode(INSTRUCTION))
            return head, tuple(self._encode(PLAIN_QUESTION.format(key=key) + ANSWER_START.format(key=key)))
        messages = [{"role": "user", "content": INSTRUCTION + DOC_MARK + QUESTION.format(key=key)}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, tail = text.split(DOC_MARK)
        return tuple(self._encode(head)), tuple(self._encode(tail + ANSWER_START.format(key=key)))

    def needle(self, length: int, depth: float, sample: int, seed: int = 0, keys: int = 1) -> Prompt:
        """A needle prompt of exactly ``length`` tokens with ``keys`` facts (1: single needle)."""
        _check_depth(depth)
        task = "needle" if keys == 1 else "multi-needle"
        rng = random.Random(f"{task}/{seed}/{length}/{depth}/{sample}")
        names = rng.sample(KEYS, keys)
        values = [str(rng.randrange(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS)) for _ in names]
        needles = [self._encode(NEEDLE.format(key=k, value=v)) for k, v in zip(names, values, strict=True)]
        head, tail = self._frame(names[0])
        n_filler = length - len(head) - len(tail) - sum(map(len, needles))
        if n_filler < 64:
            raise InvalidConfigError(f"a {task} prompt needs more than {length} tokens; give a longer length.")
        start = rng.choice([s for s in self.line_starts if s + n_filler < len(self.haystack)])
        filler = self.haystack[start : start + n_filler]
        lines = [s - start for s in self.line_starts if start < s < start + n_filler]
        target = min(lines, key=lambda s: abs(s - depth * n_filler)) if lines else round(depth * n_filler)
        placed = sorted([(target, 0)] + [(rng.choice(lines or [target]), i) for i in range(1, keys)])
        context, cursor = list(head), 0
        for at, index in placed:
            context += filler[cursor:at] + needles[index]
            cursor = at
        context += filler[cursor:]
        answer_tokens = len(self._encode(" " + values[0] + ".")) + 1
        return Prompt(task, length, sample, tuple(context), tail, depth, values[0], answer_tokens)

    def fidelity(self, length: int, sample: int, steps: int, seed: int = 0) -> Prompt:
        """``length`` tokens (the tokenizer's prefix, then real text from a line start), and the ``steps`` tokens
        of text that follow them."""
        rng = random.Random(f"fidelity/{seed}/{length}/{sample}")
        text = length - len(self.prefix)
        start = rng.choice([s for s in self.line_starts if s + text + steps < len(self.haystack)])
        ids = self.haystack[start : start + text + steps]
        return Prompt("fidelity", length, sample, self.prefix + tuple(ids[:text]), (),
                      continuation_ids=tuple(ids[text:]))


class DemoTaskWriter:
    """Prompts for the shipped demo model in its own synthetic vocabulary (see the module docstring)."""

    def __init__(self) -> None:
        from tierkv.demo.task import WORD_TO_ID

        self.question_start = WORD_TO_ID["what"]  # a marker word: it occurs only where the question starts

    def needle(self, length: int, depth: float, sample: int, seed: int = 0, keys: int = 1) -> Prompt:
        from tierkv.demo.task import make_example

        _check_depth(depth)
        task = "needle" if keys == 1 else "multi-needle"
        kind = "passkey" if keys == 1 else "multikey"
        example = make_example(random.Random(f"{task}/{seed}/{length}/{depth}/{sample}"), length, depth, kind,
                               num_keys=max(keys, 1))
        ids = list(example.prompt_ids)
        split = len(ids) - 1 - ids[::-1].index(self.question_start)
        return Prompt(task, length, sample, tuple(ids[:split]), tuple(ids[split:]), depth, example.answer,
                      len(example.answer_ids))

    def fidelity(self, length: int, sample: int, steps: int, seed: int = 0) -> Prompt:
        """The demo's synthetic filler: ``length`` tokens (a passkey haystack's start) and the next ``steps``."""
        from tierkv.demo.task import make_example

        example = make_example(random.Random(f"fidelity/{seed}/{length}/{sample}"), length + steps + 64, 0.5)
        ids = example.prompt_ids
        return Prompt("fidelity", length, sample, tuple(ids[:length]), (),
                      continuation_ids=tuple(ids[length : length + steps]))


def task_writer(model_name: str, tokenizer) -> TextTaskWriter | DemoTaskWriter:
    """The writer that fits the model: the demo's synthetic tasks for ``demo``, real text for the others."""
    return DemoTaskWriter() if model_name == "demo" else TextTaskWriter(tokenizer)


def build_prompts(writer, tasks, lengths, depths, samples: int, steps: int, seed: int = 0) -> list[Prompt]:
    """Every prompt of a run: per task and length, ``samples`` per depth (fidelity: ``samples`` in all)."""
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise InvalidConfigError(f"unknown task {', '.join(unknown)}; valid: {', '.join(TASKS)}.")
    prompts = []
    for task in tasks:
        for length in lengths:
            if task == "fidelity":
                prompts += [writer.fidelity(length, s, steps, seed) for s in range(samples)]
                continue
            keys = 1 if task == "needle" else NEEDLE_KEYS
            prompts += [writer.needle(length, d, s, seed, keys) for d in depths for s in range(samples)]
    return prompts


def _text_prefix(tokenizer) -> tuple[int, ...]:
    """The ids a tokenizer adds before a text by default (Gemma: its BOS; SmolLM2: none)."""
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    return tuple(full[: len(full) - len(bare)]) if full[len(full) - len(bare):] == bare else ()


def _check_depth(depth: float) -> None:
    if not 0.0 <= depth <= 1.0:
        raise InvalidConfigError(f"needle depth must be in [0, 1], got {depth}")
