"""Package data: evaluation (held-out) texts, calibration texts and a prompts file.

Sources and licences of every file are listed in ``SOURCES.md`` next to this module. Loaders:

- :func:`heldout_texts`: ``{"prose", "code", "legal"}`` evaluation texts, never used for calibration.
- :func:`calibration_texts`: the texts the default model's routers are fitted on (one per genre).
- :func:`prompts`: the prompts file (chat, code and prose prompts) used to record route logs.
- :func:`read_text`: any file of this package by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files

HELDOUT = {"prose": "heldout_prose.txt", "code": "heldout_code.txt", "legal": "heldout_legal.txt"}
CALIBRATION = {"reference": "calib_reference.txt", "code": "calib_code.txt", "legal": "calib_legal.txt",
               "prose": "calib_prose.txt", "chat": "calib_chat.txt"}
PROMPT_KINDS = ("chat", "code", "prose")


def read_text(name: str) -> str:
    """Contents of the package data file ``name`` (UTF-8).

    Raises:
        FileNotFoundError: no such file in ``epqlab/data``.
    """
    p = files(__name__).joinpath(name)
    if not p.is_file():
        raise FileNotFoundError(f"epqlab.data has no file {name!r}; see epqlab/data/SOURCES.md for the list")
    return p.read_text(encoding="utf-8")


def heldout_texts() -> dict[str, str]:
    """Held-out evaluation texts by kind: ``prose`` (CPython's ``email/architecture.rst``, expository
    English), ``code`` (the first part of CPython's ``textwrap.py``), ``legal`` (the Apache License 2.0,
    terms and conditions). None of their sources is in :func:`calibration_texts`
    (tests/test_models.py checks n-gram overlap)."""
    return {k: read_text(v) for k, v in HELDOUT.items()}


def calibration_texts() -> dict[str, str]:
    """Calibration texts by genre (Python reference prose, Python code, licences, release notes/README
    prose, chat transcripts in SmolLM2's ChatML template)."""
    return {k: read_text(v) for k, v in CALIBRATION.items()}


@dataclass(frozen=True)
class Prompt:
    """One prompt of ``prompts.jsonl``. ``kind`` is ``chat`` (a user message: wrap it in the model's
    chat template, e.g. :meth:`epqlab.Session.chat_prompt`), ``code`` (the start of a Python file to
    continue) or ``prose`` (the start of an English paragraph to continue)."""

    id: str
    kind: str
    prompt: str

    def text(self, session=None) -> str:
        """The text to feed the model: chat prompts go through ``session.chat_prompt`` when a session is
        given (otherwise the raw user message); code and prose prompts are returned as they are."""
        if self.kind == "chat" and session is not None:
            return session.chat_prompt([{"role": "user", "content": self.prompt}])
        return self.prompt


def prompts(kind: str | None = None) -> list[Prompt]:
    """The shipped prompts (``epqlab/data/prompts.jsonl``, one JSON object per line with ``id``, ``kind``,
    ``prompt``), in file order; ``kind`` keeps one kind only.

    Raises:
        ValueError: ``kind`` is not one of ``chat``, ``code``, ``prose``.
    """
    if kind is not None and kind not in PROMPT_KINDS:
        raise ValueError(f"unknown prompt kind {kind!r}; choose one of {', '.join(PROMPT_KINDS)} or None")
    out = []
    for line in read_text("prompts.jsonl").splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Prompt(d["id"], d["kind"], d["prompt"]))
    return [p for p in out if kind is None or p.kind == kind]


__all__ = ["HELDOUT", "CALIBRATION", "PROMPT_KINDS", "Prompt", "read_text", "heldout_texts", "calibration_texts",
           "prompts"]
