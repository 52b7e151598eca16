"""Shared fixtures. ``default_model_path`` builds the default MoE model once per session (cached
under $EPQLAB_CACHE, default ~/.cache/epqlab, so only the first run on a machine pays ~1-2 min)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_path():
    from epqlab.models import default_model

    return default_model(progress=False)
