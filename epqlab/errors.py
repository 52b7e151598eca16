"""Exceptions raised by epqlab. Each message names the file or value at fault and what to do.

All derive from :class:`EpqlabError`, so ``except epqlab.EpqlabError`` catches every problem
epqlab itself diagnoses.
"""
from __future__ import annotations


class EpqlabError(Exception):
    """Base class of every error epqlab raises on purpose."""


class UsageError(EpqlabError, ValueError):
    """A command-line value refused before any work (a model load, a study): ``epqlab`` prints its message on one
    line and exits 2, as argparse does for a usage error."""


class ModelNotFoundError(EpqlabError, FileNotFoundError):
    """The model path does not exist (or is not a regular file)."""


class NotGGUFError(EpqlabError, ValueError):
    """The file is not a GGUF file (bad magic or unsupported version)."""


class TruncatedModelError(EpqlabError, ValueError):
    """Tensor data (or the header) extends past the end of the file: an incomplete download or copy."""


class NotMoEError(EpqlabError, ValueError):
    """The model has no routed experts (``blk.N.ffn_*_exps.weight``): a dense model cannot be paged."""


class UnsupportedArchError(EpqlabError, ValueError):
    """A MoE architecture whose graph epqlab cannot page (llama.cpp runs it; the hook cannot follow its
    routing); the message names the architecture and why (:data:`epqlab.loader_checks.UNPAGEABLE_ARCHS`)."""


class SplitModelError(EpqlabError, ValueError):
    """A broken split GGUF: a shard missing, misnamed, from another split run, or a tensor count
    that disagrees with ``split.tensors.count``. (Complete split sets are supported.)"""


class ArenaTooSmall(EpqlabError, ValueError):
    """The RAM budget or arena cannot hold one layer's top-k experts; the message states the minimum."""


class PagerIOError(EpqlabError, OSError):
    """A read of expert bytes failed or came back short; names the file, offset and errno."""


class BudgetTooLargeError(EpqlabError, ValueError):
    """``ram_budget`` is more than the machine (its memory cgroup, or MemAvailable) can give this process: the
    kernel would kill it once the arena fills. The message names the numbers and what ``"auto"`` would choose."""


class ModelChangedError(EpqlabError, OSError):
    """The model file changed on disk while a Session had it open (its inode written in place: size or
    mtime; the path gone; or replaced by a file with other bytes): decoding would mix old and new bytes.
    Reopen the Session. (``chmod``, a hard link, or a replacement with identical bytes are not changes:
    :mod:`epqlab.engine.file_watch`.) ``change``: what changed, without the fix (a server words its own), or None."""
    change: str | None = None


class ContextFullError(EpqlabError, ValueError):
    """A prompt, or a prompt plus ``max_tokens``, that does not fit the context. The message tells a Python
    caller to open the Session with a larger ``n_ctx``; :meth:`worded` puts another fix in its place (a server:
    its ``--n-ctx`` flag)."""

    FIX = "open the Session with a larger n_ctx"

    def __init__(self, template: str):
        """``template``: the message with ``{fix}`` where the way to a larger context goes."""
        self.template = template
        super().__init__(template.format(fix=self.FIX))

    def worded(self, fix: str) -> str:
        return self.template.format(fix=fix)


class LlamaCppError(EpqlabError, RuntimeError):
    """llama.cpp refused to load the model or create its context (e.g. the KV cache of ``n_ctx``
    does not fit in memory); the message carries llama.cpp's own error lines."""


class ProbeFileTooSmallError(EpqlabError, ValueError):
    """The probed file is smaller than the largest request size; the message names both sizes."""


class RouteLogError(EpqlabError, ValueError):
    """A route log (file or arrays) does not follow the format of docs/DESIGN.md §6."""
