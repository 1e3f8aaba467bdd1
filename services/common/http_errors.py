"""OpenAI-style HTTP errors, the one error shape of every Motor HTTP server.

Every error body is ``{"error": {"message", "type", "param", "code"}}``: OpenAI clients (the
``openai`` SDK among them) read it from any status. Handlers ``raise OpenAIError(...)``;
:func:`error_middleware` answers it, gives aiohttp's own errors (unknown route, wrong method, body
too large) the same shape, and answers anything else 500 without the exception's text, which
may hold addresses, paths or secrets: the traceback goes to the server's log instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler

from services.common import log

JSON_CT = "application/json"
INTERNAL_MESSAGE = "internal server error; see the server log"

# Codes for the errors aiohttp raises itself; any other status is named after its HTTPStatus.
_AIOHTTP_CODES = {404: "unknown_route", 405: "method_not_allowed", 413: "request_too_large"}
# Headers of aiohttp's plain-text error responses that describe that body, not the error.
_BODY_HEADERS = frozenset({"content-type", "content-length"})


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

    def response(self) -> web.Response:
        headers = {hdrs.CONTENT_TYPE: JSON_CT, **(self.headers or {})}
        return web.Response(status=self.status, body=self.body(), headers=headers)


def model_not_found(model: str) -> OpenAIError:
    """OpenAI's (and vLLM's) answer for a model the server does not serve."""
    return OpenAIError(
        404, f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found", "model"
    )


def _of_http_error(request: web.Request, exc: web.HTTPError) -> OpenAIError:
    status = exc.status
    if status == 404:
        message = f"no route {request.method} {request.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.path}"
    else:
        message = exc.text or exc.reason
    code = _AIOHTTP_CODES.get(status) or HTTPStatus(status).name.lower()
    kind = "server_error" if status >= 500 else "invalid_request_error"
    headers = {k: v for k, v in exc.headers.items() if k.lower() not in _BODY_HEADERS}  # Allow on 405
    return OpenAIError(status, message, kind, code, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except OpenAIError as err:
        return err.response()
    except web.HTTPError as exc:
        return _of_http_error(request, exc).response()
    except Exception:
        log.exception("http_handler_failed", method=request.method, path=request.path)
        if request.writer.output_size > 0:
            # The response is already under way: a second one cannot follow it, so aiohttp
            # drops the connection (and logs the error once more).
            raise
        return OpenAIError(500, INTERNAL_MESSAGE, "server_error", "internal_error").response()
