"""Synthetic long-context retrieval in the style of RULER, and the word-level tokenizer it is written in.

Two kinds of example, both ``<bos> haystack-with-needles question`` with the answer = a needle's value::

    passkey   ... the pass key is 713 . remember it . 713 is the pass key . ...
              what is the pass key ? the pass key is                          -> 713
    multikey  ... one of the special magic numbers for falcon is 522 . ...  (plus distractor keys)
              what is the special magic number for falcon mentioned in the provided text ?
              the special magic number for falcon mentioned in the provided text is  -> 522

The haystack is random sentences (a quarter of them repeats of earlier ones) over a filler vocabulary
that is *disjoint* from every word of the needle and question templates, the key names and the numbers
(only the period is shared). So the needle's marker tokens occur exactly where the needle is, and a
retrieval (induction) head has one right place to look.

Numbers are split into groups of up to three digits and each group is one token ("71339" -> "713" "39"),
so the default 3-digit value is a single token. A multi-token value would need an induction circuit
(previous-token head + copy) to be read out digit by digit, and a ~1M-parameter model trained on two CPU
cores for half an hour did not form one (answer loss stayed at ln 10 for 1,500 steps of 5-digit values);
a one-token value is retrieved by a plain content-matching attention head, which such a model learns.

Generation works in token ids (the tokenizer is word level, one word or digit group = one id), so a
64K-token haystack is built in milliseconds and has exactly the requested length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from tierkv.errors import InvalidConfigError

KINDS = ("passkey", "multikey")

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
NUMBERS = tuple(f"{i:0{width}d}" for width in (1, 2, 3) for i in range(10**width))  # every 1-3 digit group
DEFAULT_DIGITS = 3
PUNCTUATION = (".", "?")

PASSKEY_NEEDLE = "the pass key is {value} . remember it . {value} is the pass key ."
PASSKEY_QUESTION = "what is the pass key ? the pass key is"
MULTIKEY_NEEDLE = "one of the special magic numbers for {key} is {value} ."
MULTIKEY_QUESTION = (
    "what is the special magic number for {key} mentioned in the provided text ? "
    "the special magic number for {key} mentioned in the provided text is"
)


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


KEY_NAMES = _words(
    """
    falcon otter badger heron lynx walrus gecko marmot osprey bison jackal ibis tapir quokka puffin
    koala lemur mantis narwhal ocelot panther raven salmon toucan vulture weasel yak zebra alpaca
    beaver cobra dingo egret ferret gibbon hyena iguana jaguar kestrel llama meerkat newt ostrich
    pelican quail rhino stork tortoise urchin viper wombat hornet magpie condor coyote
    """
)

FILLER_WORDS = _words(
    """
    apple river stone cloud green blue yellow red quiet loud morning evening winter summer spring autumn
    mountain valley forest meadow garden window door table chair paper pencil letter story song music
    bright dark warm cold soft hard slow fast early late small large little big old new young ancient
    walk run jump sing read write draw paint build carry bring send travel return follow gather
    village city road bridge tower castle harbor island shore ocean lake field hill desert canyon
    farmer teacher baker sailor doctor painter writer singer builder hunter traveler merchant king queen
    bread cheese honey milk butter salt sugar pepper tea coffee soup rice bean corn wheat barley
    horse sheep goat cow pig chicken duck goose dog cat mouse rabbit fox wolf bear deer owl crow
    rain snow wind storm sun moon star sky light shadow fire smoke ice water earth sand dust mud
    wood iron gold silver copper glass cloth silk wool leather rope chain wheel cart boat ship
    happy sad calm busy tired proud kind brave gentle clever wise honest curious patient careful
    often always never sometimes rarely slowly quickly gently softly loudly quietly carefully
    under over near beside behind between through across along around above below inside outside
    and but or so then while because although since until after before when where
    we they he she you people children friends family neighbors strangers travelers workers
    grass leaf tree branch root flower seed fruit berry nut vine moss fern reed bush thorn petal
    morning noon night dawn dusk hour day week month year season moment while minute
    house home room kitchen hall roof wall floor stair garden gate fence yard barn mill well
    basket bucket bottle cup plate bowl spoon knife fork pot pan kettle lamp candle mirror clock
    market fair festival harvest journey voyage path trail track lane street square corner edge
    north south east west left right center middle top bottom front back side distance place
    color shape sound smell taste touch voice word name sign mark line circle square dot
    think know see hear feel want need like love hope wish dream sleep wake rest eat drink
    open close begin finish start stop keep hold give take make find lose learn teach grow
    many few some every each all most several other another same different whole half
    beautiful ugly heavy light thin thick wide narrow deep shallow long short high low
    sweet bitter sour salty fresh stale clean dirty empty full rich poor strong weak
    wagon lantern anchor sail oar net hook feather ribbon button thread shelf drawer
    pebble cliff cave brook pond marsh swamp glacier volcano plain prairie orchard vineyard
    silent distant hidden golden wooden broken shiny dusty foggy sunny windy rainy
    """
)


def _template_words() -> set[str]:
    text = " ".join((PASSKEY_NEEDLE, PASSKEY_QUESTION, MULTIKEY_NEEDLE, MULTIKEY_QUESTION))
    words = set(text.replace("{value}", " ").replace("{key}", " ").split())
    return words - set(PUNCTUATION)


MARKER_WORDS = tuple(sorted(_template_words() | set(KEY_NAMES) | set(NUMBERS)))
"""Every token of a needle or question except punctuation; none of them occurs in the filler."""

FILLER_WORDS = tuple(w for w in dict.fromkeys(FILLER_WORDS) if w not in set(MARKER_WORDS))
VOCAB = tuple(dict.fromkeys(SPECIAL_TOKENS + PUNCTUATION + MARKER_WORDS + FILLER_WORDS))
WORD_TO_ID = {w: i for i, w in enumerate(VOCAB)}
BOS_ID = WORD_TO_ID["<bos>"]
EOS_ID = WORD_TO_ID["<eos>"]
PAD_ID = WORD_TO_ID["<pad>"]
PERIOD_ID = WORD_TO_ID["."]
_FILLER_IDS = tuple(WORD_TO_ID[w] for w in FILLER_WORDS)


def build_tokenizer() -> Tokenizer:
    """The word-level tokenizer of the demo: lowercase, split on whitespace/punctuation and into groups of
    up to three digits, one id per word or group.

    Word level (not BPE) so that one word is one token: the generator can count tokens exactly and the
    needle's markers are whole tokens the filler can never form.
    """
    tok = Tokenizer(models.WordLevel(vocab=dict(WORD_TO_ID), unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated")]
    )
    return tok


def save_tokenizer(directory: str | Path) -> Path:
    """Write ``tokenizer.json`` into ``directory`` and return its path."""
    path = Path(directory) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path))
    return path


def load_tokenizer(path: str | Path):
    """Load a saved ``tokenizer.json`` as a ``transformers.PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def encode_words(text: str) -> list[int]:
    """Ids of a template text (already lowercase and space separated, numbers grouped by the caller)."""
    return [WORD_TO_ID[w] for w in text.split()]


@dataclass(frozen=True, slots=True)
class Example:
    """One retrieval prompt. ``prompt_ids`` has exactly the requested length and starts with ``<bos>``."""

    prompt_ids: tuple[int, ...]  # [T]
    answer: str  # the needle's value, e.g. "713"
    answer_ids: tuple[int, ...]  # one id per group of up to 3 digits
    needle_positions: tuple[int, ...]  # index of each needle's first token; the asked-for needle first
    depth: float  # fraction of the haystack in front of the asked-for needle
    kind: str


def _rng(seed: int | random.Random) -> random.Random:
    return seed if isinstance(seed, random.Random) else random.Random(seed)


def _filler(rng: random.Random, n_tokens: int) -> tuple[list[int], list[int]]:
    """``n_tokens`` filler ids as random sentences, and the sentence start offsets (plus ``n_tokens``).

    A quarter of the sentences repeat an earlier one. That gives a language-model loss on the filler
    something to predict (by copying), which is what makes induction heads form quickly in training; the
    needle's markers still never occur here.
    """
    ids: list[int] = []
    starts: list[int] = []
    sentences: list[list[int]] = []
    while len(ids) < n_tokens:
        starts.append(len(ids))
        if sentences and rng.random() < 0.25:
            sentence = rng.choice(sentences)
        else:
            sentence = rng.choices(_FILLER_IDS, k=rng.randint(4, 14)) + [PERIOD_ID]
            sentences.append(sentence)
        ids.extend(sentence)
    del ids[n_tokens:]
    starts = [s for s in starts if s < n_tokens] + [n_tokens]
    return ids, starts


def _value(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _grouped(value: str) -> str:
    return " ".join(value[i : i + 3] for i in range(0, len(value), 3))


def make_example(
    seed: int | random.Random,
    context_tokens: int,
    depth: float,
    kind: str = "passkey",
    *,
    num_keys: int = 4,
    digits: int = DEFAULT_DIGITS,
) -> Example:
    """A deterministic retrieval prompt of exactly ``context_tokens`` tokens.

    ``depth`` in [0, 1] places the asked-for needle at that fraction of the haystack (at the nearest
    sentence boundary). For ``kind="multikey"`` there are ``num_keys`` needles with distinct keys; the
    ``num_keys - 1`` distractors sit at random depths. The same ``seed`` always gives the same example.
    """
    if kind not in KINDS:
        raise InvalidConfigError(f"unknown task kind {kind!r}; choose one of {', '.join(KINDS)}")
    if not 0.0 <= depth <= 1.0:
        raise InvalidConfigError(f"needle depth must be in [0, 1], got {depth}")
    if digits < 1:
        raise InvalidConfigError(f"digits must be >= 1, got {digits}")
    if kind == "multikey" and not 1 <= num_keys <= len(KEY_NAMES):
        raise InvalidConfigError(f"num_keys must be in [1, {len(KEY_NAMES)}], got {num_keys}")
    rng = _rng(seed)
    answer = _value(rng, digits)
    if kind == "passkey":
        needles = [encode_words(PASSKEY_NEEDLE.format(value=_grouped(answer)))]
        question = encode_words(PASSKEY_QUESTION)
    else:
        keys = rng.sample(KEY_NAMES, num_keys)
        values = [answer] + [_value(rng, digits) for _ in keys[1:]]
        needles = [
            encode_words(MULTIKEY_NEEDLE.format(key=k, value=_grouped(v))) for k, v in zip(keys, values, strict=True)
        ]
        question = encode_words(MULTIKEY_QUESTION.format(key=keys[0]))
    n_filler = context_tokens - 1 - sum(map(len, needles)) - len(question)
    if n_filler < 0:
        raise InvalidConfigError(
            f"context_tokens={context_tokens} is too short for a {kind} example; "
            f"it needs at least {context_tokens - n_filler} tokens"
        )
    filler, starts = _filler(rng, n_filler)
    target_at = min(starts, key=lambda s: abs(s - depth * n_filler))
    # (boundary, order, needle index): the target first at its boundary, distractors anywhere.
    placed = [(target_at, 0, 0)] + [(rng.choice(starts), rng.random(), i) for i in range(1, len(needles))]
    placed.sort()
    ids = [BOS_ID]
    positions = [0] * len(needles)
    cursor = 0
    for boundary, _, index in placed:
        ids.extend(filler[cursor:boundary])
        cursor = boundary
        positions[index] = len(ids)
        ids.extend(needles[index])
    ids.extend(filler[cursor:])
    ids.extend(question)
    return Example(
        prompt_ids=tuple(ids),
        answer=answer,
        answer_ids=tuple(encode_words(_grouped(answer))),
        needle_positions=tuple(positions),
        depth=depth,
        kind=kind,
    )


def decode_answer(tokenizer, ids) -> str:
    """The digits of generated ids, in order: ``["713", "39", <unk>]`` -> ``"71339"``."""
    return "".join(ch for ch in tokenizer.decode(list(ids), skip_special_tokens=True) if ch.isdigit())
