"""The ``tierkv`` console command: ``demo``, ``bench``, ``plan`` and ``eval``.

Each subcommand lives in ``tierkv/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; they are imported only when chosen, so ``tierkv plan`` never imports torch-heavy code
it does not need, and ``tierkv``, ``tierkv --help`` and ``tierkv --version`` import none of them (nor torch).

Failures read the same in every command: one line on stderr that says what is wrong and how to fix it,
exit status 2 for a usage error (a bad argument, a budget that cannot work) and 1 for a failure while
running (a disk error, a KV that no longer fits); Ctrl-C exits 130, SIGTERM (``timeout``, ``kill``, a
scheduler's stop) ends a command the same way, its temporary files removed, and exits 143. ``--debug`` (or
``TIERKV_DEBUG=1``) shows the traceback instead. A command module may list more exception types that count as
usage errors in ``USAGE_ERRORS`` (``plan``: a KV that does not fit the budgets given is the user's input, not a
failure), and the file settings it uses in ``FILE_SETTINGS`` (``profile``, ``trace``: checked before it starts).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import importlib
import importlib.metadata
import io
import os
import re
import signal
import stat
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from tierkv.errors import TierKVError, out_of_memory
from tierkv.units import format_bytes

SUBCOMMANDS = {
    "demo": "decode a long context through all three tiers and check the answer",
    "bench": "measure the bandwidth of every link on this host (memory, PCIe, disk)",
    "plan": "predict tokens/s and placement for a model, context and hardware",
    "eval": "retrieval accuracy of the demo model over lengths and needle depths",
}
USAGE, FAILURE, INTERRUPTED = 2, 1, 130


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``tierkv demo: error: --context='0' must be at least 1 token; ...``.

    ``command`` names the subcommand chosen on the command line, so an error the top-level parser finds
    (an option the subcommand does not know) still names ``tierkv demo``, not ``tierkv``."""

    command: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes only "-5" and "-1.5" for negative values: "--context -4K" would read "-4K" as an option
        # ("expected one argument"). Anything that starts with "-" and a digit is a value here (no option looks so),
        # so the option's own type refuses it as negative, naming the fix.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)  # for error(): options this parser lacks
        return super().parse_known_args(args, namespace)

    def _options(self) -> list[str]:
        """The long options of this parser, and of the subcommand chosen (the top-level parser reports the
        subcommand's unrecognized arguments)."""
        names = [o for o in self._option_string_actions if o.startswith("--")]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and self.command in action.choices:
                names += action.choices[self.command]._option_string_actions
        return names

    def _unknown(self, words: list[str]) -> list[str]:
        """The ``--options`` of ``words`` that no option of this parser is, nor a unique prefix of one."""
        options = self._options()
        unknown = []
        for word in words:
            name = word.split("=", 1)[0]
            if name.startswith("--") and name != "--" and name not in options and \
                    len([o for o in options if o.startswith(name)]) != 1:
                unknown.append(name)
        return unknown

    def _did_you_mean(self, unknown: list[str]) -> str:
        """``" (did you mean --context?)"`` for the first unknown option close to a real one, else ``""``."""
        for name in unknown:
            close = difflib.get_close_matches(name, self._options(), n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
        return ""

    def error(self, message: str) -> NoReturn:
        # argparse says "argument --context: --context='0' must ..."; the option is named once is enough.
        message = re.sub(r"^argument (\S+): (?=\1)", "", message)
        # A misspelt option ("--contxt 8K") leaves a required one missing, and argparse reports the missing one
        # first: the user sees "--context is required" after typing it. Name the misspelling instead.
        unknown = self._unknown(getattr(self, "_given", []))
        if unknown and message.startswith("the following arguments are required"):
            message = f"unrecognized arguments: {' '.join(unknown)}"
        if message.startswith("unrecognized arguments"):
            unknown = unknown or self._unknown(message.split(": ", 1)[-1].split())
            message += self._did_you_mean(unknown)
        if message.startswith("the following arguments are required: command"):
            message += f" ({', '.join(SUBCOMMANDS)})"
        typo = re.match(r"argument command: invalid choice: '(.*?)'", message)
        if typo:  # a misspelt command ("tierkv bnch"): named as a misspelt option is
            close = difflib.get_close_matches(typo.group(1), list(SUBCOMMANDS), n=1, cutoff=0.6)
            if close:
                message = f"invalid choice: {typo.group(1)!r} (did you mean {close[0]}?)"
        prog = f"{self.prog} {self.command}" if self.command and self.prog == "tierkv" else self.prog
        hint = "" if message.endswith(".") else f"; see {prog} --help"
        self.exit(USAGE, f"{prog}: error: {message}{hint}\n")


class _VersionAction(argparse.Action):
    """``--version``: the versions are looked up only when asked for (package metadata reads take time)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the versions of tierkv, Python, torch and transformers")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(_version())  # stdout, as argparse's own version action
        parser.exit(0)


def _version() -> str:
    """``tierkv 0.1.0 (python 3.11.9, torch 2.13.0, transformers 5.24.0)``, without importing torch."""
    from tierkv import __version__

    def installed(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    py = ".".join(map(str, sys.version_info[:3]))
    return f"tierkv {__version__} (python {py}, torch {installed('torch')}, transformers {installed('transformers')})"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the arguments of subcommand ``only`` (only its module is imported); without ``only``
    the subcommands are listed by name and help text, and no command module is imported."""
    parser = _Parser(prog="tierkv", description="Tiered KV-cache offloading for LLM decoding.",
                     epilog="Run 'tierkv COMMAND --help' for a command's options.")
    parser.command = only
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also: TIERKV_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                title="commands")
    for name, help_text in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if only == name:
            module = importlib.import_module(f"tierkv.commands.{name}")
            module.add_arguments(sub_parser)
            sub_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                    help="show tracebacks (also: TIERKV_DEBUG=1)")
            sub_parser.set_defaults(_module=module)
    return parser


def _one_line(exc: BaseException) -> str:
    """The error as one line: TierKVError messages as written, OS errors as "what: which file"; without control
    characters (a message may quote a file's or a server's text, which must not drive the terminal)."""
    from tierkv.inputs import printable

    if isinstance(exc, OSError) and not isinstance(exc, TierKVError) and exc.strerror:
        where = f": {exc.filename!r}" if exc.filename else ""
        fix = "free space there, or choose another path" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else \
            "check the path and its permissions"
        text = f"{exc.strerror}{where}; {fix}"
    else:
        text = str(exc) or type(exc).__name__
    return printable(" ".join(text.split()))


def _debug_requested(args: argparse.Namespace) -> bool:
    from tierkv import settings

    return bool(getattr(args, "debug", False)) or bool(settings.get("debug"))


def _check_settings(module: Any) -> None:
    """Every ``TIERKV_*`` variable read once before the command starts: a bad value is a usage error in
    milliseconds, not after a model loaded (or, for one the runtime reads mid-step, a traceback). The files a
    setting names are checked only for a command that uses them (its ``FILE_SETTINGS``): ``bench`` writes the
    profile ``TIERKV_PROFILE`` may name, and ``plan`` builds no cache to trace."""
    from tierkv import settings, stats

    settings.describe()
    used = getattr(module, "FILE_SETTINGS", ())
    if "profile" in used:  # $TIERKV_PROFILE read and checked before any model loads
        stats.check_profile(None)
    if "trace" in used:  # $TIERKV_TRACE's folder
        stats.check_trace_setting()
    for message in settings.unknown_variables():
        print(f"tierkv: warning: {message}", file=sys.stderr)


@contextlib.contextmanager
def _terminate_as_interrupt(received: list[int]) -> Iterator[list[int]]:
    """Within: SIGTERM and SIGHUP (a closed terminal, a dropped ssh session; not where ignored, as ``nohup`` does)
    end the command as Ctrl-C does, whatever SIGINT's handler is (a store edit that holds interrupts finishes first:
    :func:`tierkv.atomic.interrupt`), so its ``finally`` blocks remove its temporary folders; the list holds the
    signal once one came."""
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def on_term(signum: int, frame: Any) -> None:
        from tierkv import atomic

        received.append(signum)
        atomic.interrupt()

    stops = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {signum: signal.signal(signum, on_term) for signum in stops
                if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _failing_streams() -> list[Any]:
    """stdout and stderr where a flush fails (a reader that left, a full disk, a terminal gone), or that are None
    (closed when the process started)."""
    failing = []
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # AttributeError: the stream is None
            failing.append(stream)
    return failing


def _silence_output() -> None:
    """Point a stream that cannot be written at /dev/null, so that the interpreter's flush at exit (of output a
    reader that left never took) prints no "Exception ignored ... BrokenPipeError" and exits 0, not 120; a stream
    that still takes its output stays (a caller of main() in-process keeps it)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in _failing_streams():
        with contextlib.suppress(AttributeError, OSError, ValueError):
            os.dup2(devnull, stream.fileno())
    os.close(devnull)


def _output_error(exc: OSError, prog: str) -> int:
    """A write to stdout or stderr that failed: a reader that left (``| head``) ends the command quietly as SIGPIPE
    would (141); a full disk under a redirection is one line on stderr (1)."""
    if not isinstance(exc, BrokenPipeError):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            print(f"{prog}: error: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
            sys.stderr.flush()
    _silence_output()
    return 128 + signal.SIGPIPE if isinstance(exc, BrokenPipeError) else FAILURE


def main(argv: list[str] | None = None) -> int:
    """Run ``tierkv`` with ``argv`` (default: the process arguments) and return the exit status."""
    # a character the locale cannot encode (LANG=C, PYTHONIOENCODING=ascii) is shown escaped, never a
    # UnicodeEncodeError traceback; an in-process caller gets its streams back as they were
    encoded = [(stream, stream.errors) for stream in (sys.stdout, sys.stderr) if isinstance(stream, io.TextIOWrapper)]
    for stream, _ in encoded:
        stream.reconfigure(errors="backslashreplace")
    try:
        return _run_main(argv)
    finally:
        for stream, errors in encoded:
            with contextlib.suppress(OSError, ValueError):
                stream.reconfigure(errors=errors)


def _run_main(argv: list[str] | None) -> int:
    from tierkv import logs

    logs.install()  # tierkv's log lines without control characters, whichever module logs first
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    prog = "tierkv" + (f" {chosen}" if chosen in SUBCOMMANDS else "")
    terminated: list[int] = []  # SIGTERM or SIGHUP came: its status, even where the terminal is gone (EIO)
    try:
        try:
            code = _main(argv, chosen, prog, terminated)
        except SystemExit as exc:  # rich ends a print to a closed pipe with SystemExit(1)
            if isinstance(exc.__context__, BrokenPipeError):
                return _output_error(exc.__context__, prog)
            raise
        if sys.stdout is not None:
            sys.stdout.flush()  # here, not at exit: a failure is reported as one line, not as "Exception ignored"
        return code
    except OSError as exc:
        if terminated:
            _silence_output()
            return 128 + terminated[0]
        if not _output_failed(exc):
            raise
        return _output_error(exc, prog)


def _output_failed(exc: OSError) -> bool:
    """Whether ``exc`` is a failed write to stdout or stderr: a closed pipe, or a full disk or an I/O error (a plain
    OSError naming no file: the tiers raise TierKVErrors that name theirs) where stdout or stderr still cannot be
    flushed, or refuses writes though nothing is left to flush (unbuffered, ``PYTHONUNBUFFERED=1``, a failed write
    is dropped whole)."""
    if isinstance(exc, BrokenPipeError):
        return True
    if isinstance(exc, TierKVError) or exc.filename is not None or exc.errno not in (errno.ENOSPC, errno.EDQUOT,
                                                                                      errno.EIO):
        return False
    return bool(_failing_streams()) or any(_refuses_writes(stream) for stream in (sys.stdout, sys.stderr))


def _refuses_writes(stream: Any) -> bool:
    """Whether ``stream``'s file cannot take output now: a device that fails even an empty write (``/dev/full``, a
    terminal hung up), or a file on a filesystem with no space left (for this user: root has the reserved part)."""
    try:
        fd = stream.fileno()
        status = os.fstat(fd)
    except (OSError, ValueError, AttributeError):  # None, closed, or no file (an in-process caller's StringIO)
        return False
    try:
        if stat.S_ISCHR(status.st_mode):
            os.write(fd, b"")
        elif stat.S_ISREG(status.st_mode):
            space = os.fstatvfs(fd)
            return (space.f_bfree if os.geteuid() == 0 else space.f_bavail) == 0
    except OSError:
        return True
    return False


def _main(argv: list[str], chosen: str | None, prog: str, terminated: list[int]) -> int:
    debug = "--debug" in argv
    usage_errors: tuple[type[BaseException], ...] = (ValueError,)
    with _terminate_as_interrupt(terminated):
        try:
            try:
                args = build_parser(chosen if chosen in SUBCOMMANDS else None).parse_args(argv)
            except SystemExit as exc:  # --help, --version, or a usage error already printed on one line
                return exc.code if isinstance(exc.code, int) else USAGE
            debug = _debug_requested(args)
            _check_settings(args._module)
            usage_errors += tuple(getattr(args._module, "USAGE_ERRORS", ()))
            return int(args._module.run(args) or 0)
        except KeyboardInterrupt:
            if debug:
                raise
            if terminated:
                print(f"{prog}: terminated", file=sys.stderr)
                return 128 + terminated[0]
            fresh_line = "\n" if sys.stderr.isatty() else ""  # after the terminal's echoed ^C
            print(f"{fresh_line}{prog}: interrupted", file=sys.stderr)
            return INTERRUPTED
        except (TierKVError, OSError) as exc:
            if terminated and isinstance(exc, OSError):
                raise  # the write after a hangup failed (EIO): main() returns 128 + the signal
            if isinstance(exc, OSError) and _output_failed(exc):
                raise  # stdout or stderr could not be written (its reader left, a full disk): main() says so
            if debug:
                raise
            print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
            return USAGE if isinstance(exc, usage_errors) else FAILURE
        except (MemoryError, RuntimeError) as exc:  # torch's allocators raise RuntimeError
            if debug or not out_of_memory(exc):
                raise
            asked = re.search(r"allocate (\d+) bytes", str(exc))  # torch's CPU allocator names the size
            more = f" {format_bytes(int(asked.group(1)))} more" if asked else " the memory the run needs"
            print(f"{prog}: error: out of memory: this process could not get{more} (other processes, a ulimit -v, a "
                  "container's memory limit); give smaller budgets or a shorter context, or free memory",
                  file=sys.stderr)
            return FAILURE


if __name__ == "__main__":
    sys.exit(main())
