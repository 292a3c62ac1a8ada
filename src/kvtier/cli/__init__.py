"""The ``kvtier`` command line: ``demo``, ``simulate``, ``inspect``, ``selfcheck``,
``bench transfer|storage|cache|overlap|replay``.

Exit status: 0 done; 1 the command ran and failed (``selfcheck`` found a mismatch, the demo
changed tokens, an I/O error); 2 a user error (a :class:`~kvtier.errors.UsageError` or an
:class:`~kvtier.errors.UnsupportedError`, argparse's own), refused before any work starts with
one line ``kvtier CMD: error: ...`` on stderr; 70 an internal error, a bug in kvtier (any other
exception): its traceback, then one line asking to report it; 130 interrupted (Ctrl-C), one
line; 141 stdout closed by its reader (``| head``), silently.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from ..errors import UnsupportedError, UsageError
from . import bench, demo, inspect, selfcheck, simulate

# NOTE: 70 is sysexits.h's EX_SOFTWARE (internal software error)
EXIT_FAILED, EXIT_USAGE, EXIT_BUG, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 1, 2, 70, 130, 141

#: name -> (help, add_arguments, command)
COMMANDS = {
    "inspect": ("compare host layouts for a KV geometry", inspect.add_arguments, inspect.command),
    "demo": ("multi-turn chat on a tiny Hugging Face model through all three tiers", demo.add_arguments,
             demo.command),
    "simulate": ("replay a request trace through the cache policy (capacity planning)", simulate.add_arguments,
                 simulate.command),
    "selfcheck": ("round-trip random KV through every layout and backend", selfcheck.add_arguments,
                  selfcheck.command),
}


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``kvtier CMD: error: ...``, without the usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtier", description="Hierarchical KV cache tools",
                     epilog="exit status: 0 done, 1 failed, 2 user error (one line, before any work), "
                            "70 internal error (a bug: traceback), 130 interrupted, 141 output pipe closed")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, command) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=command, prog=p.prog)
    p = sub.add_parser("bench", help="benchmarks, each figure a ratio to a limit measured in the same run")
    bsub = p.add_subparsers(dest="bench", required=True)
    for name, (help_text, add_arguments, command) in bench.SUBCOMMANDS.items():
        b = bsub.add_parser(name, help=help_text, description=help_text)
        add_arguments(b)
        b.set_defaults(run=command, prog=b.prog)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command and return its exit status (argparse's own, ``--help`` included, too)."""
    prog = "kvtier"
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:
            return int(e.code or 0)
        prog = args.prog
        code = args.run(args)
        sys.stdout.flush()  # NOTE: a reader gone away surfaces here, inside the handlers below
        return code
    except KeyboardInterrupt:
        _say(f"{prog}: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except (UsageError, UnsupportedError) as e:
        _say(f"{prog}: error: {e}")
        return EXIT_USAGE
    except OSError as e:
        _say(f"{prog}: error: {e}")
        return EXIT_FAILED
    except Exception:  # NOTE: not the user's doing (an IntegrityError, a bare ValueError, ...): a bug
        traceback.print_exc()
        _say(f"{prog}: internal error (a bug): please report it with the traceback above")
        return EXIT_BUG


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _say(message: str) -> None:
    print(_one_line(message), file=sys.stderr, flush=True)


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the interpreter flushes it again at exit, which would
    otherwise print a second BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (e.g. captured in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
