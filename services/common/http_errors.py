"""OpenAI-style HTTP errors, the one error shape of every Motor HTTP server.

Every error body is ``{"error": {"message", "type", "param", "code"}}``: OpenAI clients (the
``openai`` SDK among them) read it from any status. Handlers ``raise OpenAIError(...)`` (or one
of the builders below); :mod:`motor_mesh.common.httpserver` answers it with :meth:`OpenAIError.body`,
gives its own refusals (unknown route, wrong method, body too large, malformed HTTP) the same
shape, and answers anything else 500 with :data:`INTERNAL_MESSAGE`, never the exception's text,
which may hold addresses, paths or secrets: the traceback goes to the server's log instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

INTERNAL_MESSAGE = "internal server error; see the server log"


@dataclass(eq=False)  # compared and hashed by identity, like any exception
class OpenAIError(Exception):
    """An HTTP error answer: status, OpenAI error ``type`` and ``code``, the request ``param``
    it is about, and extra response headers (``Retry-After``, ``WWW-Authenticate``)."""

    status: int
    message: str
    type: str  # the OpenAI field's own name
    code: str | int | None = None
    param: str | None = None
    headers: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()


def invalid_request(
    message: str,
    code: str | None = None,
    param: str | None = None,
    *,
    status: int = 400,
    headers: Mapping[str, str] | None = None,
) -> OpenAIError:
    """The caller's mistake (OpenAI's ``invalid_request_error``): 400 unless ``status`` says
    otherwise (404 for what does not exist, 408 for what never came)."""
    return OpenAIError(status, message, "invalid_request_error", code, param, headers)


def server_error(status: int, message: str, code: str | int | None = None) -> OpenAIError:
    """The server's failure (or an engine's behind it), not the caller's mistake."""
    return OpenAIError(status, message, "server_error", code)


def internal_error() -> OpenAIError:
    """The answer to a handler's bug: 500, and nothing of the exception (it is logged)."""
    return server_error(500, INTERNAL_MESSAGE, "internal_error")


def model_not_found(model: str) -> OpenAIError:
    """OpenAI's (and vLLM's) answer for a model the server does not serve."""
    return invalid_request(f"The model `{model}` does not exist.", "model_not_found", "model", status=404)
