"""The tokens an answer really used, read off the answer on its way to the client, so a token
limit charged at admission as prompt plus ``max_tokens`` can be corrected (docs/admission.md).

Only requests of a tenant under a token limit are metered. A whole answer carries ``usage``; a
stream carries it only when the client asked (``stream_options.include_usage``), else each
``data:`` event of a choice is counted as one token, which is what vLLM and SGLang send
(their first chat event carries the role and no token, so the count may be one high).
"""

from __future__ import annotations

import re

from motor_mesh.common.http_errors import OpenAIError
from motor_mesh.common.httpmessages import JSON_CT, Headers, Responder

_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_USAGE = b'"usage"'
_EVENT = b'data: {"'


class MeteredResponder(Responder):
    """A Responder that passes everything to the real one and notes the usage it sees."""

    __slots__ = ("_inner", "completion_tokens", "events", "prompt_tokens")

    def __init__(self, inner: Responder) -> None:  # no super().__init__: the inner one answers
        self._inner = inner
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.events = 0

    # The state the router reads is the real responder's.
    started = property(lambda self: self._inner.started)
    finished = property(lambda self: self._inner.finished)
    status = property(lambda self: self._inner.status)

    def used(self) -> int | None:
        """Completion tokens: the engine's own count when it gave one, else the events seen."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.events if self.events else None

    def _note(self, data: bytes) -> None:
        at = data.rfind(_USAGE)
        if at < 0:
            return
        tail = data[at:]
        if (m := _COMPLETION.search(tail)) is not None:
            self.completion_tokens = int(m[1])
        if (m := _PROMPT.search(tail)) is not None:
            self.prompt_tokens = int(m[1])

    def send(self, status: int, body: bytes, content_type: bytes = JSON_CT, headers: Headers = None) -> None:
        if status < 400:
            self._note(body)
        self._inner.send(status, body, content_type, headers)

    def error(self, err: OpenAIError) -> None:
        self._inner.error(err)

    def start(self, status: int, content_type: bytes, headers: Headers = None) -> None:
        self._inner.start(status, content_type, headers)

    async def write(self, data: bytes) -> None:
        self.events += data.count(_EVENT)
        if _USAGE in data:
            self._note(data)
        await self._inner.write(data)

    def end(self, data: bytes = b"") -> None:
        self._inner.end(data)

    def abort(self) -> None:
        self._inner.abort()
