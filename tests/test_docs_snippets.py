"""Every code block of README.md and docs/*.md works as written.

- A ```python block runs, in a fresh namespace and a temporary working directory. An HTML comment on the line
  before it says what it needs: ``<!-- snippet: model -->`` gives it ``model`` (a tiny random Llama) and ``ids``
  (``[1, 96]`` token ids), and ``<!-- snippet: skip: REASON -->`` keeps it from running (a block that needs
  a GPU or another machine; the reason shows in the test report). Paths under ``/nvme/`` are rewritten into the
  temporary directory. ``<!-- snippet: redis -->`` also gives ``model`` and ``ids``, and points the block's
  ``redis://localhost:6379/0`` at a real ``redis-server`` started for it (tests/redis_server.py).
- A ```bash block's ``tierkv ...`` lines parse with the command's own parser (a renamed flag fails here).
- A 4-space-indented ``tierkv ...`` command in docs/*.md (a Markdown code block without a fence) parses too,
  and passes the command's own checks of option combinations (``_check_combination``: no work done), so a
  command that exits 2 when pasted fails here. The user's own files it names (a checkpoint folder, a prompt
  file, a reference run) are made as placeholders in a temporary directory.
- A block after ``<!-- output: ARGS -->`` is what ``COLUMNS=100 tierkv ARGS`` prints, line for line.
- README command 2 is the test run of ``.ci/run``.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tierkv.cli import SUBCOMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*(snippet|output):\s*(.*?)\s*-->")

KNOWN_BROKEN: dict[tuple[str, int], str] = {}
"""Blocks that fail as written, by (file, python block number): strict xfails, so the test fails once a block
is fixed and its entry must go. Empty: every block runs."""


@dataclass(frozen=True)
class Block:
    path: Path
    language: str
    number: int  # 1-based among the file's blocks of this language
    line: int
    code: str
    marker: tuple[str, str] | None  # ("snippet", "model") / ("output", "plan ...")

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(language: str) -> list[Block]:
    """The fenced blocks of ``language`` ('' for unlabelled ones) in README.md and docs/*.md."""
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i, count = 0, 0
        while i < len(lines):
            fence = re.match(r"^```(\w*)\s*$", lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if fence.group(1) == language:
                count += 1
                before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                marker = MARKER.search(before)
                found.append(Block(path, language, count, i + 1, "\n".join(lines[i + 1 : end]),
                                   (marker.group(1), marker.group(2)) if marker else None))
            i = end + 1
    return found


def _param(block: Block):
    key = (str(block.path.relative_to(ROOT)), block.number)
    marks = [pytest.mark.xfail(reason=KNOWN_BROKEN[key], strict=True)] if key in KNOWN_BROKEN else []
    return pytest.param(block, id=block.name, marks=marks)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("block", [_param(b) for b in blocks("python")])
def test_python_block_runs(block: Block, tiny_model, tmp_path, monkeypatch, request):
    kind, arg = block.marker if block.marker and block.marker[0] == "snippet" else ("snippet", "")
    if arg.startswith("skip"):
        pytest.skip(arg.partition(":")[2].strip() or "marked skip")
    monkeypatch.chdir(tmp_path)
    code = re.sub(r"""(["'])/nvme/""", lambda m: f"{m.group(1)}{tmp_path}/nvme/", block.code)
    namespace: dict = {"__name__": "__snippet__"}
    if arg == "redis":
        server = request.getfixturevalue("redis_server")
        assert "redis://localhost:6379/0" in code, "a redis snippet names the server as redis://localhost:6379/0"
        code = code.replace("redis://localhost:6379/0", server.url)
    if arg in ("model", "redis"):
        namespace |= {"model": tiny_model, "ids": torch.randint(0, 256, (1, 96), generator=torch.Generator()
                                                                   .manual_seed(1))}
    with torch.inference_mode():
        exec(compile(code, block.name, "exec"), namespace)  # noqa: S102 - running the docs is the point


def _commands(block: Block) -> list[list[str]]:
    """The ``tierkv ...`` command lines of a bash block (continuations joined, comments dropped)."""
    text = block.code.replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True  # one word per argument; '#' starts a comment
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "|"):
                if words and words[0] == "tierkv":
                    commands.append(words[1:])
                words = []
            else:
                words.append(token)
    return commands


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in blocks("bash") if _commands(b)])
def test_bash_block_commands_parse(block: Block):
    for argv in _commands(block):
        chosen = next((a for a in argv if not a.startswith("-")), None)
        assert chosen in SUBCOMMANDS or not argv, argv
        parser = build_parser(chosen)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
            parser.parse_args(argv)
        assert err.getvalue() == "", (argv, err.getvalue())


def test_bash_blocks_use_real_commands():
    """The parse test above saw the README's commands (a collector that finds nothing proves nothing)."""
    seen = {argv[0] for block in blocks("bash") for argv in _commands(block) if argv}
    assert {"demo"} <= seen


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in blocks("")
                                   if b.marker and b.marker[0] == "output"])
def test_output_block_is_what_the_command_prints(block: Block, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(shlex.split(block.marker[1])) == 0
    printed = capsys.readouterr().out
    assert [line.rstrip() for line in printed.strip("\n").splitlines()] == \
        [line.rstrip() for line in block.code.strip("\n").splitlines()]


def test_readme_command_2_is_the_ci_test_run():
    """README's second command runs exactly the pytest command .ci/run runs first."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"^# 2\..*\n(.*)$", readme, re.M).group(1)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_run = next(line.strip() for line in ci.splitlines() if line.strip().startswith("python -m pytest"))
    assert command.split("&&")[-1].strip() == ci_run


def test_readme_command_1_uses_the_cpu_torch_index():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"^# 1\..*\n(.*)$", readme, re.M).group(1)
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in command
    assert command.strip().endswith("tierkv demo")


def test_every_python_block_was_collected():
    """README's blocks are all there (the fence regex did not silently miss them)."""
    readme = [b for b in blocks("python") if b.path.name == "README.md"]
    assert len(readme) == (ROOT / "README.md").read_text(encoding="utf-8").count("```python") >= 4
    assert all(b.marker == ("snippet", "model") for b in readme)


@dataclass(frozen=True)
class Command:
    path: Path
    line: int
    argv: list[str]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def indented_commands() -> list[Command]:
    """The ``tierkv ...`` commands of the 4-space-indented code blocks of docs/*.md (outside fences;
    continuations joined)."""
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        fenced = False
        i = 0
        while i < len(lines):
            line = lines[i]
            fenced ^= line.startswith("```")
            start = i
            if not fenced and re.match(r"^ {4}tierkv ", line):
                text = line.strip()
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                found.append(Command(path, start + 1, shlex.split(text, comments=True)[1:]))
            i += 1
    return found


def _placeholders(argv: list[str], folder: Path) -> list[str]:
    """``argv`` with the user's own files it names made in ``folder``: a checkpoint folder for a ``--model``
    path, a prompt for ``--prompt-file``, and the reference an ``--stage measure`` run reads from ``--out``."""
    from tierkv.quality.run_folder import REFERENCE_FILE

    argv = list(argv)
    for i, word in enumerate(argv[:-1]):
        value = argv[i + 1]
        if word == "--model" and "/" in value and not Path(value).exists():
            argv[i + 1] = str(folder / value.strip("/"))
            Path(argv[i + 1]).mkdir(parents=True, exist_ok=True)
            (Path(argv[i + 1]) / "config.json").write_text("{}")
        elif word == "--prompt-file":
            (folder / value).write_text("a prompt")
        elif word == "--out" and "measure" in argv:
            (folder / value).mkdir(parents=True, exist_ok=True)
            (folder / value / REFERENCE_FILE).write_text("{}")
    return argv


@pytest.mark.parametrize("command", [pytest.param(c, id=c.name) for c in indented_commands()])
def test_indented_command_works_when_pasted(command: Command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = _placeholders(command.argv, tmp_path)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    assert chosen in SUBCOMMANDS, argv
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        args = build_parser(chosen).parse_args(argv)
    assert err.getvalue() == "", (argv, err.getvalue())
    check = getattr(args._module, "_check_combination", None)
    if check is not None:
        check(args)  # an InvalidConfigError here is the command's exit status 2


def test_indented_commands_are_collected():
    """The test above saw the docs' indented commands, of more than one command (a collector that finds nothing
    proves nothing)."""
    assert {c.argv[0] for c in indented_commands()} >= {"plan", "eval", "demo"}
