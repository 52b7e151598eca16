"""What the API modules of one app share: the session, the model's name, the batcher and the thread pools."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..engine.batch import Batcher


@dataclass
class Served:
    """One app's shared state (:func:`epqlab.server.app.create_app` makes it; each API module's ``add_routes``
    reads it). ``waiters``: requests wait (and streams read their queues) on their own pool; ``stats_pool``: the
    stats and tokenizer endpoints' own thread, so neither a crowd of queued streams nor a busy one delays them."""
    session: object
    name: str
    batcher: Batcher
    waiters: ThreadPoolExecutor
    stats_pool: ThreadPoolExecutor
    created: int
