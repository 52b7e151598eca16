"""The README's first llama-cpp-python style call, as written (model.gguf = the default model), answers with text:
its greedy completion is several tokens of non-empty text (the example printed "" when its prompt's first token
was a stop)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _call():
    """(prompt, keyword arguments) of the README's ``out = llm(...)`` line."""
    line = next(l for l in README.read_text().splitlines() if re.match(r"out = llm\(", l))
    call = ast.parse(line.split("  #")[0].strip()).body[0].value
    return ast.literal_eval(call.args[0]), {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def test_readme_llama_style_example_gives_text(default_model_path):
    from epqlab import Session

    prompt, kw = _call()
    assert kw.get("temperature") == 0, "the example is greedy, so it prints the same text on every run"
    with Session(str(default_model_path), ram_budget="auto") as llm:
        out = llm(prompt, **kw)
    text = out["choices"][0]["text"]
    assert text.strip() and out["usage"]["completion_tokens"] > 3, out
