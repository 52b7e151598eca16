"""Shared fixtures. ``default_model_path`` builds the default MoE model once per session (cached
under $EPQLAB_CACHE, default ~/.cache/epqlab, so only the first run on a machine pays ~1-2 min)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_path():
    from epqlab.models import default_model

    return default_model(progress=False)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``epqlab.models.synthesize(..., "tiny")``: a 4-layer, 8-expert qwen3moe with random weights
    and SmolLM2's tokenizer (~35 MB), written once per test session."""
    from epqlab.models import synthesize

    p = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    synthesize(p, "tiny", progress=False)
    return p


@pytest.fixture(scope="session")
def mini_gguf(tiny_gguf, tmp_path_factory):
    """``tiny_gguf`` cut to a 512-token vocabulary (tests/ggufs.py shrink_vocab): ~7 MB, a 15 KiB
    header, a Session opens in ~0.3 s; for tests that open many sessions or rewrite headers."""
    from ggufs import shrink_vocab

    return shrink_vocab(tiny_gguf, tmp_path_factory.mktemp("mini") / "mini.gguf", 512)


@pytest.fixture(scope="session")
def default_path(default_model_path):
    return default_model_path


@pytest.fixture(scope="session")
def ref(default_path):
    """Plain llama.cpp's greedy trace of tests/exact.py's prompt on the default model."""
    from exact import greedy_ref

    return greedy_ref(default_path)


@pytest.fixture(scope="session")
def mini_ref(mini_gguf):
    from exact import greedy_ref

    return greedy_ref(mini_gguf)


@pytest.fixture(scope="session")
def keyed_server(default_model_path):
    """``epqlab serve`` on the default model with an API key and limits (tests/test_serve_api.py ``keyed``), ready:
    ``(url, process)``. One for the session: the Anthropic and the Responses modules share it (a start loads the
    model), and neither leaves state the other reads (the prompt cache reuses whole 512-token ubatches, which their
    short prompts never fill)."""
    from test_serve_api import keyed

    with keyed(default_model_path) as up:
        yield up
