"""One grammar for the sizes and token counts users type, and the formatting that reads them back.

A value is a number (``20``, ``1.5``, ``2e3``) with an optional unit, spaces allowed between them:

=========  =====================================================  ==========================
kind       units                                                  a bare number means
=========  =====================================================  ==========================
size       ``B``; ``KB MB GB TB`` and ``K M G T`` (powers of 10);  GB, like ``gpu_gb=20``
           ``KiB MiB GiB TiB`` (powers of 2)
tokens     ``K M G`` (powers of 2, as context lengths are named:   tokens
           ``128K`` = 131,072)
=========  =====================================================  ==========================

Numbers are parsed as decimals, not floats, so ``"1.5K"`` tokens is exactly 1,536 and ``"0.1GB"`` exactly
100,000,000 bytes. Python numbers are accepted too, and numpy's (``bool`` is not: ``True`` is a typo, not 1). Anything
above :data:`MAX_BYTES` / :data:`MAX_TOKENS` is refused as no machine's size, so ``"1e30"`` or ``10**400``
is an :class:`~tierkv.errors.InvalidConfigError`, never an ``OverflowError`` deeper down.
"""

from __future__ import annotations

import math
import numbers
import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation

from tierkv.errors import InvalidConfigError

SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
TOKEN_UNITS: dict[str, int] = {"k": 2**10, "m": 2**20, "g": 2**30}
MAX_BYTES = 2**63 - 1
"""The largest size accepted (8 EiB, int64's range: what torch, numpy and the OS can index)."""
MAX_TOKENS = 2**40
"""The largest token count accepted (about 10^12)."""
MAX_CHUNK_TOKENS = 2**24
"""The longest streaming chunk accepted (``chunk_tokens``, ``--chunk-tokens``): 16M tokens, beyond any model's
context. Its two device buffers are sized by it whatever the context, so a longer one is a slip no budget holds."""

_VALUE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_EXAMPLES = "'512MB', '20GiB' or 1.5 (GB)"
_TOKEN_EXAMPLES = "32768, '128K' (131072) or '1.5K' (1536)"
_SIZE_UNIT_NAMES = "B; KB, MB, GB, TB (powers of 10); KiB, MiB, GiB, TiB (powers of 2)"
_TOKEN_UNIT_NAMES = "K, M, G; binary, 1K = 1024"


def _number(value: object, name: str, what: str, examples: str, units: dict[str, int], unit_names: str,
            least: str = ">= 0") -> tuple[Decimal, str]:
    """Split ``value`` into an exact decimal and a lower-case unit ('' when none was given); ``unit_names`` and
    ``least`` are how errors spell the units and the smallest value allowed."""
    if isinstance(value, bool):
        raise InvalidConfigError(f"{name}={value!r} is a bool; give a number such as {examples}.")
    if isinstance(value, numbers.Integral):  # int and numpy's ints; clamped: a 5,000-digit int must not reach
        return Decimal(min(int(value), 10**40)), ""  # int-to-str limits
    if isinstance(value, numbers.Real):  # float and numpy's floats, read as Python floats (np.float64's repr is
        try:  # "np.float64(0.5)", no decimal)
            real = float(value)
        except OverflowError:  # a Fraction beyond floats: as absurdly large as any other
            return Decimal(10) ** 50, ""
        if not math.isfinite(real):
            raise InvalidConfigError(f"{name}={value!r} is not finite; give a value such as {examples}.")
        return Decimal(repr(real)), ""
    if not isinstance(value, str):
        raise InvalidConfigError(f"{name} must be a number or a string such as {examples}, not {type(value).__name__}.")
    text = value.strip()
    if text.startswith("-"):
        raise InvalidConfigError(f"{name}={value!r} is negative; give a value {least} such as {examples}.")
    match = _VALUE.match(text)
    if match is None or match.group(2).lower() not in ("", *units):
        raise InvalidConfigError(
            f"{name}={value!r} is not {what}; write a number with an optional unit ({unit_names}), "
            f"e.g. {examples}."
        )
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:  # an exponent beyond Decimal's: as absurdly large (or as small) as any other
        number = Decimal(0) if "e-" in match.group(1).lower() else Decimal(10) ** 50
    return number, match.group(2).lower()


def _shown(value: object) -> str:
    """``repr`` short enough for a one-line error (``10**400`` is not printed digit by digit)."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"~1e{int(abs(value).bit_length() * 0.30103)}"
    return repr(value)


def parse_size(value: float | int | str, *, name: str = "size") -> int:
    """Bytes from a number of GB (``20``, ``0.5``) or a size string (``"512MB"``, ``"20GiB"``, ``"4096B"``).

    Fractions of a byte round to the nearest byte.

    >>> parse_size("512MiB"), parse_size(0.5), parse_size("1.5 KB")
    (536870912, 500000000, 1500)
    """
    number, unit = _number(value, name, "a size", _SIZE_EXAMPLES, SIZE_UNITS, _SIZE_UNIT_NAMES)
    if number < 0:
        raise InvalidConfigError(f"{name}={value!r} is negative; budgets and sizes must be >= 0.")
    nbytes = number * (SIZE_UNITS[unit] if unit else 10**9) if number <= MAX_BYTES else number
    if nbytes > MAX_BYTES:
        raise InvalidConfigError(
            f"{name}={_shown(value)} is beyond any machine (more than {format_bytes(MAX_BYTES)}); a bare number "
            f"counts GB: give e.g. {_SIZE_EXAMPLES}, or '4096B' for bytes."
        )
    whole = int(nbytes.to_integral_value())
    if nbytes > 0 and whole == 0:  # "1e-30" was 0 bytes: an empty budget the caller never asked for
        raise InvalidConfigError(f"{name}={_shown(value)} is less than half a byte; give 0 for none, or a size "
                                 f"such as {_SIZE_EXAMPLES}.")
    return whole


def parse_tokens(value: int | float | str, *, name: str = "context", minimum: int = 1,
                 examples: str | None = None, maximum: int = MAX_TOKENS) -> int:
    """A whole token count: ``32768``, ``"128K"`` (131072), ``"1.5K"`` (1536), ``"1M"`` (1048576), from ``minimum``
    to ``maximum``. ``examples``: what errors suggest instead of context lengths (for a count of new tokens:
    ``"16, 64 or '1K' (1024)"``).

    >>> parse_tokens("1.5K"), parse_tokens(4096)
    (1536, 4096)
    """
    examples = examples or _TOKEN_EXAMPLES
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    number, unit = _number(value, name, "a token count", examples, TOKEN_UNITS, _TOKEN_UNIT_NAMES,
                           least=f"of at least {plural(minimum, 'token')}")
    count = number * (TOKEN_UNITS[unit] if unit else 1) if number <= MAX_TOKENS else number
    if count != count.to_integral_value():
        whole = max(minimum, int(count.to_integral_value(rounding=ROUND_CEILING)))
        raise InvalidConfigError(
            f"{name}={value!r} is {count.normalize():f} tokens; give a whole number of tokens, e.g. {whole}."
        )
    if count < minimum:
        raise InvalidConfigError(
            f"{name}={value!r} must be at least {plural(minimum, 'token')}; e.g. {examples}."
        )
    if count > maximum:
        raise InvalidConfigError(f"{name}={_shown(value)} is more than {maximum:,} tokens; e.g. {examples}.")
    return int(count)


def parse_token_list(text: str, *, name: str = "lengths") -> list[int]:
    """Comma-separated token counts, ``"4K,16K,1.5K"`` -> ``[4096, 16384, 1536]``; at least one."""
    counts = [parse_tokens(part, name=name) for part in text.split(",") if part.strip()]
    if not counts:
        raise InvalidConfigError(f"{name}={text!r} has no token counts; give e.g. '4K,16K,32K'.")
    return counts


def format_bytes(nbytes: float | Decimal) -> str:
    """Binary units throughout, so 128 KiB/token x 1M tokens reads as 128 GiB: ``'1.50 GiB'``, ``'0 B'``."""
    value = float(nbytes)
    for unit, scale in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
                        ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,.0f} B"


def format_size_option(nbytes: int) -> str:
    """The shortest spelling of at least ``nbytes`` that :func:`parse_size` reads back and a command line takes as
    one word, in the decimal units of the ``--*-gb`` options (rounded up, so a minimum stays a minimum): ``'11'``
    (GB) for 10.2e9 bytes, ``'1.29'`` for 1.281e9, ``'1.29MB'`` for 1,282,322, ``'512B'``."""
    nbytes = max(int(nbytes), 0)
    for unit, scale in (("", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            if nbytes >= 10 * scale and unit == "":
                return str(-(-nbytes // scale))
            hundredths = -(-nbytes * 100 // scale)
            whole, cents = divmod(hundredths, 100)
            return (f"{whole}.{cents:02d}".rstrip("0").rstrip(".") if cents else str(whole)) + unit
    return f"{nbytes}B"


def format_gb(nbytes: float) -> str:
    """Bytes in the decimal units the ``--*-gb`` options count in, one decimal: ``'137.4 GB'``, ``'1.3 MB'``."""
    value = float(nbytes)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if value >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value:,.0f} B"


def format_tokens(count: int) -> str:
    """``65536`` -> ``'64K'``, ``1536`` -> ``'1.5K'``, ``1048576`` -> ``'1M'``: the spelling that parses back
    to the same count; counts that are no short multiple of K stay numbers (``1000``)."""
    for unit, scale in (("M", 2**20), ("K", 2**10)):
        if count >= scale and count * 100 % scale == 0:  # at most two decimals, exactly
            return f"{count / scale:g}{unit}"
    return str(count)


def plural(count: int, word: str, plural_word: str | None = None) -> str:
    """``plural(1, 'haystack')`` -> ``'1 haystack'``, ``plural(4, 'haystack')`` -> ``'4 haystacks'``."""
    return f"{count:,} {word if count == 1 else plural_word or word + 's'}"
