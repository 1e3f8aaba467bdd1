"""HTTP helpers shared by the tests of Motor's HTTP servers (the Coordinator, the simulated engine),
and the HTTP/1.1 conformance suite of the server and client themselves (the test modules here).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

# Every error body is {"error": {these}}: the OpenAI shape.
ERROR_FIELDS = {"message", "type", "param", "code"}


async def json_request(method: str, url: str, **kw: Any) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(status, headers, JSON body) of one request; the answer must be JSON."""
    async with aiohttp.ClientSession() as s, s.request(method, url, **kw) as resp:
        assert resp.content_type == "application/json"
        return resp.status, dict(resp.headers), json.loads(await resp.read())


# What a request whose handler raised gets: no detail of the failure leaves the server.
INTERNAL_ERROR = {
    "error": {
        "message": "internal server error; see the server log",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
}


def assert_internal_error(status: int, body: dict[str, Any], log: str, cause: str) -> None:
    """A 500 with the generic body, and the traceback (naming ``cause``) in the server log only."""
    assert (status, body) == (500, INTERNAL_ERROR)
    assert "http_handler_failed" in log
    assert "Traceback" in log and cause in log
