"""The health check ``motor register`` runs on each engine before registering it.

An engine is healthy when ``GET /v1/models`` answers 200 with exactly one model: vLLM and SGLang
list the one model they serve, and an empty list means the engine is up but has nothing loaded
(it would fail every request routed to it). The model's id is the name clients ask for, so it is
also the instance's model name unless the operator gives one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

from motor_mesh.cli.standalone import EndpointSpec, InputError

MAX_CHECK_S = 5.0


async def served_model(session: aiohttp.ClientSession, ep: EndpointSpec, deadline_s: float) -> str:
    url = f"http://{ep.address}/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=deadline_s)) as resp:
            status = resp.status
            body = await resp.json(content_type=None) if status == 200 else None
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        raise InputError(f"engine {ep.address} is not healthy: GET /v1/models: {_reason(exc)}") from None
    if status != 200:
        raise InputError(f"engine {ep.address} is not healthy: GET /v1/models answered {status}")
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise InputError(f"engine {ep.address} is not healthy: /v1/models has no model list")
    ids: list[str] = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if len(ids) != 1:
        listed = ", ".join(repr(i) for i in ids) or "none"
        raise InputError(
            f"engine {ep.address} is not healthy: /v1/models must list exactly one model, lists {listed}"
        )
    return ids[0]


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, ValueError):
        return "the answer is not JSON"
    return str(exc) or type(exc).__name__


async def instance_model(endpoints: Sequence[EndpointSpec], deadline_s: float) -> str:
    """The one model every endpoint of an instance serves."""
    async with aiohttp.ClientSession() as session:
        models = await asyncio.gather(
            *(served_model(session, ep, min(deadline_s, MAX_CHECK_S)) for ep in endpoints)
        )
    if len(set(models)) > 1:
        pairs = ", ".join(f"{ep.address} serves {m!r}" for ep, m in zip(endpoints, models, strict=True))
        raise InputError(f"the endpoints of one instance serve different models: {pairs}")
    return models[0]
