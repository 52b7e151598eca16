"""The Responses API's stored responses (``previous_response_id``), in memory and bounded: the newest
:data:`KEEP` responses, fewer when their conversations together pass :data:`KEEP_CHARS` characters; the oldest go
first. A response made with ``store: false`` is never kept. Nothing survives a restart.

What is kept per response is its conversation as OpenAI chat messages (every turn before it, its own input and its
reply), not its ``instructions``: OpenAI's rule is that a previous response's instructions are not carried over
(https://platform.openai.com/docs/api-reference/responses/create#responses-create-instructions); and the response
object as it was answered, for ``GET /v1/responses/{id}`` (:meth:`ResponseStore.response`). ``DELETE`` removes both
(:meth:`ResponseStore.delete`).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

KEEP = 256  # responses kept
KEEP_CHARS = 64 << 20  # characters of kept conversations (their JSON), all together


class ResponseStore:
    """Responses by id (module docstring); safe to use from several threads."""

    def __init__(self, keep: int = KEEP, keep_chars: int = KEEP_CHARS):
        self.keep, self.keep_chars = keep, keep_chars
        self._items: OrderedDict[str, tuple[list[dict], dict | None, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, rid: str, conversation: list[dict], response: dict | None = None) -> None:
        """Keep response ``rid``: its ``conversation`` (OpenAI chat messages) and the ``response`` object answered."""
        size = len(json.dumps(conversation)) + (len(json.dumps(response)) if response is not None else 0)
        with self._lock:
            self._items[rid] = (conversation, response, size)
            self._chars += size
            while self._items and (len(self._items) > self.keep or self._chars > self.keep_chars):
                self._chars -= self._items.popitem(last=False)[1][2]

    def response(self, rid) -> dict | None:
        """The response object ``rid`` was answered with, or None when it is not kept (unknown, made with
        ``store: false``, evicted or deleted)."""
        with self._lock:
            hit = self._items.get(rid) if isinstance(rid, str) else None
        return None if hit is None else json.loads(json.dumps(hit[1]))  # a copy

    def delete(self, rid) -> bool:
        """Forget response ``rid``; False when it was not kept."""
        with self._lock:
            hit = self._items.pop(rid, None) if isinstance(rid, str) else None
            if hit is not None:
                self._chars -= hit[2]
        return hit is not None

    def conversation(self, rid) -> list[dict]:
        """The conversation through response ``rid`` (a copy). ValueError when it is not kept (unknown, made with
        ``store: false``, or evicted), naming the bound."""
        with self._lock:
            hit = self._items.get(rid) if isinstance(rid, str) else None
        if hit is None:
            raise ValueError(f"previous_response_id {rid!r} is not a stored response: this server keeps the last "
                             f"{self.keep} responses made with store=true in memory, since it started (fewer when "
                             "their conversations are long); send the whole conversation as input instead")
        return [dict(m) for m in hit[0]]
