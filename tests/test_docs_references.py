"""Every name README.md and docs/*.md give a newcomer still names something in the code.

The docs are read as a reference: a path, a test, a ``tierkv.`` name, a ``TIERKV_*`` variable or a ``tierkv``
command-line option they name must exist. Each test collects the references it can recognise without doubt
and reports every stale one as ``file:line: reference (why)``:

- repository paths (``tierkv/attention/split.py``, ``tests/test_split.py``, ``docs/quality.md``) in inline
  code, fenced blocks, prose and relative Markdown links, and test files named bare (``test_scale.py``, looked
  up under tests/ and benchmarks/) exist (globs and ``<placeholders>`` are not paths);
- ``tests/test_x.py::test_name`` and ``benchmarks/x.py::test_name[param]`` name a function (or
  ``Class::method``) defined in that file;
- dotted ``tierkv.module.name`` references import and resolve with ``getattr``;
- ``Class.attribute`` in inline code, where ``Class`` is one class of tierkv (``TieredCache.min_device_bytes``),
  names a class attribute or one its ``__init__``/methods assign to ``self``;
- every ``TIERKV_*`` variable is a setting of ``tierkv.settings.SETTINGS`` or a knob a benchmark reads;
- every ``--option`` of a ``tierkv COMMAND ...`` line (fenced blocks and inline code) is an option of that
  command's parser, spelt in full.

No model, no network: only the docs, the sources' syntax trees and imports of ``tierkv`` modules.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tierkv.cli import SUBCOMMANDS, build_parser
from tierkv.settings import SETTINGS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

ROOTS = ("tierkv", "tests", "benchmarks", "native", "docs", ".ci")
PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(map(re.escape, ROOTS)) + r")/[\w./-]*)(::[\w:\[\]./-]+)?")
"""A repository path, optionally with a ``::test`` suffix; it must not continue into a glob or placeholder."""
NOT_A_PATH = re.compile(r"[*?<{]")
DOTTED = re.compile(r"(?<![\w./-])tierkv(?:\.[A-Za-z_]\w*)+")
VARIABLE = re.compile(r"\bTIERKV_[A-Z0-9_]*[A-Z0-9]\b(?!\*)")
INLINE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Text:
    """A piece of a doc: an inline code span, a line of a fenced block, or a whole prose line."""

    path: Path
    line: int
    kind: str  # "inline", "fenced", "prose"
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _texts_of(path: Path, content: str) -> list[Text]:
    found = []
    fenced = False
    for number, line in enumerate(content.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            found.append(Text(path, number, "fenced", line))
            continue
        found.append(Text(path, number, "prose", line))
        found += [Text(path, number, "inline", m.group(2)) for m in INLINE.finditer(line)]
    return found


def _texts() -> list[Text]:
    return [text for path in DOCS for text in _texts_of(path, path.read_text(encoding="utf-8"))]


TEXTS = _texts()


def _code(texts: list[Text]) -> list[Text]:
    return [t for t in texts if t.kind != "prose"]


def _report(problems: list[str]) -> None:
    assert not problems, "stale references in the docs:\n" + "\n".join(problems)


def _check(found: tuple[int, list[str]], what: str) -> None:
    """A check's ``(references seen, problems)``: some seen (else the recogniser is broken), none stale."""
    seen, problems = found
    assert seen, f"no {what} found: the recogniser is broken"
    _report(problems)


BARE_TEST = re.compile(r"(?<![\w./~$-])(test_\w+\.py)(::[\w:\[\]./-]+)?")
"""A test file named without its folder (``test_scale.py::test_overlap``): looked up under tests/ and benchmarks/."""
TEST_DIRS = (ROOT / "tests", ROOT / "benchmarks")


@dataclass(frozen=True)
class Reference:
    text: Text
    shown: str  # as the doc names it
    files: tuple[Path, ...]  # what it may name; empty: nothing does
    suffix: str | None  # "::test_name[param]"


def _references(texts: list[Text]) -> Iterator[Reference]:
    """Every repository path in code spans, fenced blocks, prose and relative links, and every bare test file
    name in code."""
    for text in texts:
        line = INLINE.sub(" ", LINK.sub("] ", text.text)) if text.kind == "prose" else text.text
        for match in PATH.finditer(line):
            path, suffix = match.group(1).rstrip(".-"), match.group(2)
            rest = line[match.end():]
            if NOT_A_PATH.match(rest) or (not suffix and rest.startswith("[")):
                continue  # tierkv/commands/<name>.py, tests/test_hf_*.py
            yield Reference(text, path, (ROOT / path,) if (ROOT / path).exists() else (), suffix)
        if text.kind == "prose":
            continue
        for match in BARE_TEST.finditer(text.text):
            if NOT_A_PATH.match(text.text[match.end():]):
                continue
            files = tuple(p for d in TEST_DIRS for p in sorted(d.rglob(match.group(1))))
            yield Reference(text, match.group(1), files, match.group(2))
    for text in texts:
        if text.kind != "prose":
            continue
        for match in LINK.finditer(text.text):
            target = match.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # anchors, http:, mailto:
                continue
            resolved = (text.path.parent / target).resolve()
            yield Reference(text, target, (resolved,) if resolved.exists() else (), None)


def _path_problems(texts: list[Text]) -> list[str]:
    return [f"{ref.text.where()}: {ref.shown} (no such file or directory)"
            for ref in _references(texts) if not ref.files]


def test_paths_exist():
    assert any(ref.files for ref in _references(TEXTS)), "no path found: the recogniser is broken"
    _report(_path_problems(TEXTS))


def _defined(path: Path) -> set[str]:
    """``name`` for each top-level function and class, ``Class::method`` for each method."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{item.name}" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def _test_name(suffix: str) -> str:
    """``test_x`` of ``::test_x[param]``, ``Class::test_x`` of ``::Class::test_x``."""
    return re.sub(r"\[.*$", "", suffix[2:]).rstrip(":")


def _test_problems(texts: list[Text]) -> tuple[int, list[str]]:
    """(how many path::test references were checked, the stale ones)."""
    problems = []
    seen = 0
    for ref in _references(texts):
        files = [f for f in ref.files if f.suffix == ".py" and f.is_file()]
        if not ref.suffix or not files:
            continue  # a missing file is test_paths_exist's report
        seen += 1
        name = _test_name(ref.suffix)
        if not any(name in _defined(f) for f in files):
            where = " or ".join(str(f.relative_to(ROOT)) for f in files)
            problems.append(f"{ref.text.where()}: {ref.shown}{ref.suffix} (no {name} in {where})")
    return seen, problems


def test_test_references_name_defined_tests():
    _check(_test_problems(TEXTS), "path::test reference")


EXTENSIONS = set(re.findall(r"""["'](tierkv(?:\.\w+)+)["']""", (ROOT / "setup.py").read_text(encoding="utf-8")))
"""The C libraries setup.py builds under module names (``tierkv.io._native``): loaded with ctypes, never imported,
and absent where no compiler was found, so a name of theirs is valid without an import."""


def _resolve(dotted: str) -> str | None:
    """None if ``dotted`` resolves from ``tierkv`` by getattr and submodule imports, else why not."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, attr in enumerate(parts[1:], 1):
        prefix = ".".join(parts[: i + 1])
        if prefix in EXTENSIONS and i == len(parts) - 1:
            return None
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif hasattr(obj, "__path__") and importlib.util.find_spec(prefix) is not None:
            obj = importlib.import_module(prefix)
        else:
            return f"{'.'.join(parts[:i])} has no attribute or submodule {attr!r}"
    return None


def _dotted_problems(texts: list[Text]) -> tuple[int, list[str]]:
    """(how many ``tierkv.`` names were checked, the stale ones)."""
    problems = []
    checked: dict[str, str | None] = {}
    for text in texts:
        line = INLINE.sub(" ", text.text) if text.kind == "prose" else text.text  # spans are "inline" texts
        for match in DOTTED.finditer(line):
            name = match.group(0)
            if line[match.end():].startswith(("/", "-")):
                continue  # tierkv.egg-info and the like
            if name not in checked:
                checked[name] = _resolve(name)
            if checked[name]:
                problems.append(f"{text.where()}: {name} ({checked[name]})")
    return len(checked), problems


def test_dotted_names_resolve():
    _check(_dotted_problems(TEXTS), "tierkv.* name")


def _classes() -> dict[str, list[str]]:
    """Class name -> the modules of tierkv that define a class of that name."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tierkv").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


CLASS_ATTRIBUTE = re.compile(r"(?<![\w.])(_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)\.([A-Za-z_]\w*)")
"""``TieredCache.min_device_bytes``, ``DiskFile.close()``: checked where the class is one class of tierkv."""


def _instance_attributes(cls: type) -> set[str]:
    """What the tierkv classes of ``cls``'s MRO assign to ``self.X`` or annotate (dataclass fields)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("tierkv"):
            continue
        names |= set(getattr(klass, "__annotations__", {}))
        tree = ast.parse(Path(inspect.getsourcefile(klass)).read_text(encoding="utf-8"))
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == klass.__name__)
        names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                  and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return names


def _attribute_problems(texts: list[Text]) -> tuple[int, list[str]]:
    """(how many ``Class.attribute`` names of tierkv classes were checked, the stale ones)."""
    classes = _classes()
    problems = []
    seen = 0
    for text in texts:
        if text.kind != "inline":
            continue
        for match in CLASS_ATTRIBUTE.finditer(text.text):
            name, attribute = match.groups()
            if len(classes.get(name, [])) != 1:
                continue  # not a tierkv class (DynamicCache), or two of that name: ambiguous
            cls = getattr(importlib.import_module(classes[name][0]), name)
            seen += 1
            if not hasattr(cls, attribute) and attribute not in _instance_attributes(cls):
                problems.append(f"{text.where()}: {name}.{attribute} ({classes[name][0]}.{name} has no attribute "
                                f"{attribute!r})")
    return seen, problems


def test_class_attributes_exist():
    _check(_attribute_problems(TEXTS), "Class.attribute of a tierkv class")


def _benchmark_knobs() -> set[str]:
    """The ``TIERKV_*`` variables the benchmarks read: quoted in their Python, or expanded in their shell."""
    knobs: set[str] = set()
    for path in (ROOT / "benchmarks").rglob("*"):
        if path.suffix == ".py":
            knobs |= set(re.findall(r"""["'](TIERKV_[A-Z0-9_]+)["']""", path.read_text(encoding="utf-8")))
        elif path.suffix == ".sh":
            knobs |= set(re.findall(r"\$\{?(TIERKV_[A-Z0-9_]+)", path.read_text(encoding="utf-8")))
    return knobs


def _variable_problems(texts: list[Text]) -> tuple[int, list[str]]:
    """(how many ``TIERKV_*`` names were checked, the unknown ones)."""
    valid = {setting.variable for setting in SETTINGS.values()} | _benchmark_knobs()
    problems = []
    seen = 0
    for text in texts:
        if text.kind == "inline":
            continue  # the prose line holds it too
        for match in VARIABLE.finditer(text.text):
            seen += 1
            if match.group(0) not in valid:
                problems.append(f"{text.where()}: {match.group(0)} (not in tierkv.settings.SETTINGS "
                                "nor read by a benchmark)")
    return seen, problems


def test_variables_are_settings_or_benchmark_knobs():
    _check(_variable_problems(TEXTS), "TIERKV_* variable")


def _command_lines(texts: list[Text]) -> Iterator[tuple[Text, str, list[str]]]:
    """(where, command, words) for each ``tierkv COMMAND ...`` line of a fenced block or an inline span."""
    fenced = [t for t in texts if t.kind == "fenced"]
    joined: list[Text] = []
    for i, text in enumerate(fenced):  # join "\" continuations onto the line they continue
        if i and joined and fenced[i - 1].text.rstrip().endswith("\\") and fenced[i - 1].line + 1 == text.line:
            last = joined.pop()
            text = Text(last.path, last.line, "fenced", last.text.rstrip()[:-1] + " " + text.text)
        joined.append(text)
    for text in [*joined, *(t for t in texts if t.kind == "inline")]:
        line = re.sub(r"^\s*\$\s+", "", text.text)  # a "$ " prompt
        words = line.split()
        if len(words) < 2 or words[0] != "tierkv" or words[1] not in SUBCOMMANDS:
            continue
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True  # one word per argument; '#' starts a comment
            words = list(lexer)
        except ValueError:
            continue
        end = next((i for i, w in enumerate(words) if w in ("&&", "||", ";", "|", ">", ">>", "2>")), len(words))
        yield text, words[1], words[2:end]


def _options(command: str) -> set[str]:
    """Every option string of ``tierkv COMMAND`` (its own and the top-level ones: ``--debug``)."""
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(parser._option_string_actions) | set(sub.choices[command]._option_string_actions)


def _option_problems(texts: list[Text]) -> tuple[int, list[str]]:
    """(how many ``--options`` of ``tierkv`` command lines were checked, the unknown ones)."""
    options: dict[str, set[str]] = {}
    problems = []
    seen = 0
    for text, command, words in _command_lines(texts):
        if command not in options:
            options[command] = _options(command)
        for word in words:
            if not word.startswith("--") or word == "--":
                continue
            seen += 1
            option = word.split("=", 1)[0]
            if option not in options[command]:
                problems.append(f"{text.where()}: tierkv {command} {option} (not an option of tierkv {command})")
    return seen, problems


def test_cli_options_exist():
    _check(_option_problems(TEXTS), "tierkv COMMAND --option")


GOOD = """\
See `tierkv/attention/split.py`, `tests/test_docs_references.py::test_paths_exist[x]`, `test_split.py`,
[the quality page](quality.md#top), `tierkv.attention.lse.merge_all`, TIERKV_DISK_ENGINE, `KVStore.unrecovered`,
`TieredCache.min_device_bytes`, tierkv/cli.py.

```bash
tierkv demo --context 8K \\
    --debug
```
"""
STALE = """\
See `tierkv/attention/no_such_module.py`, `tests/test_docs_references.py::test_no_such_test[x]`,
`test_no_such_file.py`, [a page](no-such-page.md), `tierkv.attention.lse.no_such_function`,
TIERKV_NO_SUCH_SETTING, `TieredCache._no_such_attribute`, tierkv/no_such_file.py.

```bash
tierkv demo --context 8K \\
    --no-such-option
```
"""


def _doc(tmp_path: Path, content: str) -> list[Text]:
    path = ROOT / "docs" / "example.md"  # read from tmp_path, named as a doc (links resolve from docs/)
    (tmp_path / "example.md").write_text(content, encoding="utf-8")
    return _texts_of(path, (tmp_path / "example.md").read_text(encoding="utf-8"))


@pytest.mark.parametrize("check", [_path_problems, _test_problems, _dotted_problems, _variable_problems,
                                   _option_problems, _attribute_problems])
def test_the_checks_pass_a_current_reference_and_fail_a_stale_one(check, tmp_path):
    """Each recogniser sees its kind of reference, and a reference to something removed fails."""
    def problems(content: str) -> list[str]:
        result = check(_doc(tmp_path, content))
        return result if isinstance(result, list) else result[1]

    assert problems(GOOD) == []
    stale = problems(STALE)
    assert stale and all(p.startswith("docs/example.md:") for p in stale), stale
