"""The ``tierkv`` console command: ``demo``, ``bench``, ``plan`` and ``eval``.

Each subcommand lives in ``tierkv/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; they are imported only when chosen, so ``tierkv plan`` never imports torch-heavy code
it does not need.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "demo": "decode a long context through all three tiers and check the answer",
    "bench": "measure the bandwidth of every link on this host (memory, PCIe, disk)",
    "plan": "predict tokens/s and placement for a model, context and hardware",
    "eval": "retrieval accuracy of the demo model over lengths and needle depths",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or one that knows just subcommand ``only`` (so only its module is imported)."""
    parser = argparse.ArgumentParser(prog="tierkv", description="Tiered KV-cache offloading for LLM decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if only in (None, name):
            module = importlib.import_module(f"tierkv.commands.{name}")
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = build_parser(chosen).parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
