"""Markdown pieces for the papers: tables from records and figures copied (and shrunk) beside the paper."""
from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd

from ..results import atomic_path

MAX_FIGURE_BYTES = 200_000  # figures committed under papers/ stay below this (bytes)


def _cell(v, pct: bool, floatfmt: str) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if pct:
        return f"{100 * float(v):.1f}"
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (float, np.floating)):
        return format(float(v), floatfmt)
    return str(v)


def table(records, columns: dict, floatfmt: str = ".3g") -> str:
    """A Markdown table (``pandas.DataFrame.to_markdown``, which needs ``tabulate``) of ``records`` (a list of
    dicts or a DataFrame), keeping the ``columns`` that exist, renamed ``{column: header}``. A column whose
    header ends in ``%`` is shown as a percentage with one decimal, other floats with ``floatfmt``; missing
    values print as ``-``. Cells are formatted here, so tabulate prints them as given."""
    df = records if isinstance(records, pd.DataFrame) else pd.DataFrame(list(records))
    keep = [c for c in columns if c in df.columns]
    out = pd.DataFrame({columns[c]: [_cell(v, columns[c].endswith("%"), floatfmt) for v in df[c]] for c in keep})
    align = ["right" if pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]) else "left"
             for c in keep]
    return out.to_markdown(index=False, disable_numparse=True, colalign=align)


def _shrink_png(src: Path, dst: Path, max_bytes: int) -> None:
    """Copy the PNG ``src`` to ``dst``, whole or not at all (:func:`epqlab.results.atomic_path`); if it is larger
    than ``max_bytes``, re-encode it with an adaptive 256-colour palette and, if still too large, halve its size
    until it fits."""
    if src.stat().st_size <= max_bytes:
        with atomic_path(dst) as tmp:
            shutil.copyfile(src, tmp)
        return
    from PIL import Image

    img = Image.open(src).convert("RGB")
    while True:
        buf = io.BytesIO()
        img.convert("P", palette=Image.Palette.ADAPTIVE, colors=256).save(buf, format="PNG", optimize=True)
        if buf.tell() <= max_bytes or min(img.size) < 200:
            with atomic_path(dst) as tmp:
                Path(tmp).write_bytes(buf.getvalue())
            return
        img = img.resize((img.width // 2, img.height // 2), Image.Resampling.LANCZOS)


def figure(src: str | os.PathLike, out_dir: Path, rel_dir: str, caption: str,
           max_bytes: int = MAX_FIGURE_BYTES) -> str:
    """Copy figure ``src`` into ``out_dir/rel_dir`` (shrunk below ``max_bytes`` bytes) and return the Markdown
    image line linking it relative to ``out_dir``."""
    src = Path(src)
    dst_dir = Path(out_dir) / rel_dir
    dst_dir.mkdir(parents=True, exist_ok=True)
    _shrink_png(src, dst_dir / src.name, max_bytes)
    return f"![{caption}]({rel_dir}/{src.name})"


__all__ = ["table", "figure", "MAX_FIGURE_BYTES"]
