"""Every name a notebook's ``parameters`` cell assigns is a parameter papermill can set: its own parser
(``papermill.inspect_notebook``, what ``--help-notebook`` prints) finds every one. A comment that papermill
misreads (it skipped lines whose comment said "None = ...") would drop a parameter silently."""
from __future__ import annotations

import ast
import json

import pytest

from notebooks import NOTEBOOKS

papermill = pytest.importorskip("papermill")


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_papermill_sees_every_parameter(path):
    cells = [c for c in json.loads(path.read_text())["cells"]
             if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, "one cell tagged parameters"
    names = {t.id for node in ast.parse("".join(cells[0]["source"])).body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}
    seen = set(papermill.inspect_notebook(str(path)))
    assert names and names == seen
