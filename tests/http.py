"""HTTP helpers shared by the tests of Motor's HTTP servers (the Coordinator, the simulated engine)."""

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
