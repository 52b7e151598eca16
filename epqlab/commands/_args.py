"""Argument parsing shared by subcommands: comma lists of fractions or sizes, and text arguments."""
from __future__ import annotations

import sys
from pathlib import Path

from ..constants import MIN_N_CTX, padded_n_ctx
from ..data import HELDOUT, heldout_texts
from ..errors import UsageError


def floats_or_sizes(s: str | None) -> list:
    """A comma list of arena or budget values: numbers (fractions) as floats, sizes (``256MiB``) as strings."""
    out = []
    for x in (s or "").split(","):
        x = x.strip()
        if x:
            try:
                out.append(float(x))
            except ValueError:
                out.append(x)  # a size such as 256MiB
    return out


def load_text(text: str) -> tuple[str, str]:
    """``(name, contents)`` of a text argument: an existing file, else a held-out text by name.

    Raises:
        ValueError: neither a file nor a held-out name.
    """
    p = Path(text)
    if p.is_file():
        return p.name, p.read_text(encoding="utf-8")
    if text in HELDOUT:
        return text, heldout_texts()[text]
    raise ValueError(f"TEXT {text!r} is neither a file nor a held-out text; pass a UTF-8 file or one of "
                     f"{', '.join(HELDOUT)}")


def policy_params_arg(items) -> dict:
    """``--policy-param NAME=VALUE`` (repeated) as ``{name: float}`` (a value that is not a number, such as
    ``admit=stage``, stays a string); names, ranges and choices are checked by the Session.

    Raises:
        ValueError: an item that is not ``NAME=VALUE``.
    """
    out = {}
    for it in items or ():
        name, eq, val = str(it).partition("=")
        if not eq or not name.strip() or not val.strip():
            raise ValueError(f"--policy-param takes NAME=VALUE (e.g. half_life=64, admit=stage), got {it!r}")
        try:
            out[name.strip()] = float(val)
        except ValueError:
            out[name.strip()] = val.strip()
    return out


def check_n_ctx(n_ctx: int | None, flag: str = "--n-ctx") -> None:
    """The one context rule of every command that opens a Session (:data:`epqlab.constants.MIN_N_CTX`): below 256
    is a :class:`~epqlab.errors.UsageError` (exit 2, one line naming the minimum and the fix), before the model
    loads; a value that is not a multiple of 256 is used padded up, with a warning naming the padded context.
    None (the command's default) passes."""
    if n_ctx is None:
        return
    if n_ctx < MIN_N_CTX:
        raise UsageError(f"{flag} {n_ctx} is below llama.cpp's smallest context of {MIN_N_CTX} tokens per sequence "
                         f"(it would silently become {MIN_N_CTX}); give {flag} {MIN_N_CTX} or more")
    if n_ctx != padded_n_ctx(n_ctx):
        print(f"epqlab: warning: {flag} {n_ctx} becomes {padded_n_ctx(n_ctx)} tokens per sequence (llama.cpp pads "
              f"the context to a multiple of {MIN_N_CTX}); prompts are checked against that", file=sys.stderr)
