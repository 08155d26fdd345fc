"""The retrieval task generator and its tokenizer (no model needed)."""

from __future__ import annotations

import random

import pytest

from tierkv.demo import task
from tierkv.errors import InvalidConfigError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return task.load_tokenizer(task.save_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("kind", task.KINDS)
def test_same_seed_same_example(kind):
    a = task.make_example(7, 3000, 0.3, kind)
    b = task.make_example(random.Random(7), 3000, 0.3, kind)
    assert a == b
    assert task.make_example(8, 3000, 0.3, kind) != a


@pytest.mark.parametrize("kind", task.KINDS)
@pytest.mark.parametrize("length", [200, 2048, 65536])
def test_exact_length_and_layout(kind, length):
    ex = task.make_example(1, length, 0.5, kind)
    assert len(ex.prompt_ids) == length
    assert ex.prompt_ids[0] == task.BOS_ID
    assert len(ex.answer) == 3 and ex.answer.isdigit()
    assert [task.VOCAB[i] for i in ex.answer_ids] == [ex.answer]
    n_needles = 1 if kind == "passkey" else 4
    assert len(ex.needle_positions) == n_needles
    # the value follows its needle's template words
    target = ex.needle_positions[0]
    window = ex.prompt_ids[target : target + 16]
    assert ex.answer_ids[0] in window


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_depth_places_the_needle(depth):
    length = 10_000
    ex = task.make_example(3, length, depth, "passkey")
    assert abs(ex.needle_positions[0] / length - depth) < 0.02


@pytest.mark.parametrize("kind", task.KINDS)
def test_markers_never_in_filler(kind):
    markers = {task.WORD_TO_ID[w] for w in task.MARKER_WORDS}
    assert not markers & {task.WORD_TO_ID[w] for w in task.FILLER_WORDS}
    needle, question = (
        (task.PASSKEY_NEEDLE, task.PASSKEY_QUESTION)
        if kind == "passkey"
        else (task.MULTIKEY_NEEDLE, task.MULTIKEY_QUESTION)
    )
    needle_len = len(task.encode_words(needle.format(key="falcon", value="123")))
    question_len = len(task.encode_words(question.format(key="falcon")))
    ex = task.make_example(5, 20_000, 0.4, kind)
    structure = {0} | set(range(len(ex.prompt_ids) - question_len, len(ex.prompt_ids)))
    for start in ex.needle_positions:
        structure.update(range(start, start + needle_len))
    filler = [tok for i, tok in enumerate(ex.prompt_ids) if i not in structure]
    assert len(filler) == len(ex.prompt_ids) - len(structure)
    assert not markers & set(filler)
    punctuation = {task.WORD_TO_ID[p] for p in task.PUNCTUATION}
    assert all(ex.prompt_ids[i] in markers | punctuation for i in structure - {0})


def test_tokenizer_round_trip(tokenizer):
    ex = task.make_example(11, 1500, 0.6, "multikey")
    text = tokenizer.decode(list(ex.prompt_ids))
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(ex.prompt_ids)
    ids = tokenizer("The pass key is 71339.", add_special_tokens=False)["input_ids"]
    assert [task.VOCAB[i] for i in ids] == ["the", "pass", "key", "is", "713", "39", "."]
    assert task.decode_answer(tokenizer, ex.answer_ids) == ex.answer
    assert task.decode_answer(tokenizer, ids) == "71339"


def test_bad_arguments():
    with pytest.raises(InvalidConfigError, match="too short"):
        task.make_example(0, 10, 0.5)
    with pytest.raises(InvalidConfigError, match="kind"):
        task.make_example(0, 1000, 0.5, "haystack")
    with pytest.raises(InvalidConfigError, match="depth"):
        task.make_example(0, 1000, 1.5)
