"""The ``epqlab`` command line. Each subcommand lives in ``epqlab/commands/<name>.py`` and
defines ``register(subparsers)``, which adds its parser and sets ``func(args) -> int``."""
from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .errors import EpqlabError, UsageError
from .results import check_writable

# Output-file options of the subcommands (argparse dests), checked before a command runs (a study, a model load),
# not after it: each is written whole or not at all (epqlab.results.atomic_path), so its folder must be writable.
OUTPUT_FILES = ("json",)

# Subcommand modules, in the order `epqlab --help` lists them.
COMMANDS = ["info", "plan", "tune", "run", "serve", "demo", "ppl", "strict", "ablate", "probe", "routes", "predictor", "model", "report"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epqlab", description="Expert paging for MoE GGUF models on small machines.")
    p.add_argument("--version", action="version", version=f"epqlab {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f".commands.{name}", __package__).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        for dest in OUTPUT_FILES:
            if getattr(args, dest, None):
                try:
                    check_writable(getattr(args, dest), atomic=True)
                except OSError as e:  # a usage error: nothing has run yet
                    raise UsageError(str(e)) from None
        return int(args.func(args) or 0)
    except UsageError as e:  # a value refused before any work: argparse's exit code for usage errors
        print(f"epqlab: error: {e}", file=sys.stderr)
        return 2
    except (EpqlabError, ValueError, OSError, RuntimeError, MemoryError, IndexError) as e:
        # Our own errors, bad values and files, and llama.cpp's (std::runtime_error reaches
        # Python as RuntimeError, std::bad_alloc as MemoryError): one clean line, no traceback.
        print(f"epqlab: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
