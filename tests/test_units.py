"""tierkv.units: the one grammar for sizes and token counts, and the formatting that parses back."""

from __future__ import annotations

import pytest

from tierkv.errors import InvalidConfigError
from tierkv.units import (
    MAX_BYTES,
    format_bytes,
    format_gb,
    format_size_option,
    format_tokens,
    parse_size,
    parse_token_list,
    parse_tokens,
    plural,
)


@pytest.mark.parametrize(("value", "expected"), [
    ("512MB", 512 * 10**6), ("20GiB", 20 * 2**30), (20, 20 * 10**9), (0.5, 5 * 10**8), ("1.5 KB", 1500),
    ("0.1GB", 10**8), ("4096B", 4096), ("1e3MB", 10**9), ("2K", 2000), (" 3 mib ", 3 * 2**20),
])  # fmt: skip
def test_sizes(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize(("value", "needle"), [
    ("1e30", "beyond any machine"), pytest.param(10**400, "beyond any machine", id="10**400"),
    ("1e999999999", "beyond any machine"), pytest.param(10**5000, "beyond any machine", id="10**5000"),
    ("1e99999999999999999999", "beyond any machine"),  # (beyond Decimal's exponents: its own error before)
    (True, "bool"), ("-1GB", "negative"), (-3, "negative"), (float("inf"), "not finite"),
    ("12 apples", "not a size"), (None, "NoneType"),
    ("1e-30", "less than half a byte"), ("0.4B", "less than half a byte"),  # silently 0 bytes: an empty budget
])  # fmt: skip
def test_absurd_or_malformed_sizes_are_invalid_config(value, needle):
    with pytest.raises(InvalidConfigError, match=needle) as info:
        parse_size(value, name="gpu_gb")
    assert "gpu_gb" in str(info.value) and len(str(info.value)) < 300  # no 400-digit number in the message


def test_largest_size_is_accepted():
    assert parse_size(f"{MAX_BYTES}B") == MAX_BYTES


@pytest.mark.parametrize(("value", "expected"), [
    ("1.5K", 1536), ("128K", 131072), ("1M", 2**20), ("32768", 32768), (4096, 4096), (2.0, 2), ("0.5k", 512),
])  # fmt: skip
def test_token_counts(value, expected):
    assert parse_tokens(value) == expected


@pytest.mark.parametrize(("value", "needle"), [
    ("1.3K", "whole number"), ("0", "at least 1 token"), ("abc", "not a token count"), (True, "bool"),
    ("1e30", "more than"), ("1.5X", "not a token count"), ("4KiB", "not a token count"),
])  # fmt: skip
def test_bad_token_counts(value, needle):
    with pytest.raises(InvalidConfigError, match=needle):
        parse_tokens(value, name="--context")


def test_token_list_and_minimum():
    assert parse_token_list("4K, 1.5K,512") == [4096, 1536, 512]
    with pytest.raises(InvalidConfigError, match="no token counts"):
        parse_token_list(" , ")
    with pytest.raises(InvalidConfigError, match="at least 64 tokens"):
        parse_tokens("10", minimum=64)


@pytest.mark.parametrize("count", [1536, 65536, 2**20, 3 * 2**19, 1000, 4097, 1280])
def test_format_tokens_parses_back(count):
    assert parse_tokens(format_tokens(count)) == count


def test_format_bytes_and_plural():
    assert format_bytes(0) == "0 B" and format_bytes(1.5 * 2**30) == "1.50 GiB" and format_bytes(2**63) == "8.00 EiB"
    assert plural(1, "haystack") == "1 haystack" and plural(4, "haystack") == "4 haystacks"


# --------------------------------------------------------------------------- issue 29: messages match the grammar
@pytest.mark.parametrize(("value", "needle"), [
    ("-1", "give a value of at least 64 tokens"),  # not ">= 0": 0 is refused too
    ("1.5", "give a whole number of tokens, e.g. 64."),  # never an example below the minimum
    ("abc", "(K, M, G; binary, 1K = 1024)"),  # the units as the README spells them, not "(k, m, g)"
])  # fmt: skip
def test_token_messages_name_the_minimum_and_the_units_as_written(value, needle):
    with pytest.raises(InvalidConfigError) as info:
        parse_tokens(value, name="--context", minimum=64)
    assert needle in str(info.value), str(info.value)


def test_size_message_lists_units_with_their_case():
    with pytest.raises(InvalidConfigError) as info:
        parse_size("abc", name="--gpu-gb")
    assert "(B; KB, MB, GB, TB (powers of 10); KiB, MiB, GiB, TiB (powers of 2))" in str(info.value)


@pytest.mark.parametrize("value", ["-1", "1.5", "abc", "1.3K", "0", "1e30", "4KiB"])
def test_every_example_a_token_message_gives_parses(value):
    """Each example an error offers (``e.g. ...``, ``such as ...``) is valid input."""
    import re

    with pytest.raises(InvalidConfigError) as info:
        parse_tokens(value, name="--context", minimum=64)
    examples = re.findall(r"(?:e\.g\.|such as) (.*?)(?:\.$|$)", str(info.value))
    assert examples, str(info.value)
    for example in re.split(r", | or ", examples[0]):
        example = example.split(" (")[0].strip("'")
        assert parse_tokens(example, minimum=64) >= 64, example


@pytest.mark.parametrize("nbytes", [0, 1, 999, 1000, 1001, 40_000, 1_282_322, 10**9, 1_281_000_001, 10_200_000_000])
def test_size_option_is_one_word_at_least_the_bytes(nbytes):
    text = format_size_option(nbytes)
    assert " " not in text and parse_size(text) >= nbytes
    assert parse_size(text) <= max(nbytes * 1.01 + 1, nbytes + 10**7) or nbytes >= 10**10  # rounded up, not far


def test_format_gb_is_decimal():
    assert format_gb(137.4e9) == "137.4 GB" and format_gb(1_300_000) == "1.3 MB" and format_gb(12) == "12 B"
