"""The OpenAI-compatible inference server: the ``/v1`` API, probes and metrics
(docs/architecture.md, "The flow of a request").

Errors are :class:`OpenAIError` bodies, raised by the handlers and answered by the shared error
middleware; while nothing is routable, the API answers 503 ``no_routable_instance`` with
``Retry-After: 1`` (docs/operations.md, "Health and readiness").
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.common.config import read_private_file
from services.common.http_errors import JSON_CT, OpenAIError, error_middleware, model_not_found
from services.coordinator.bodies import estimate_tokens
from services.coordinator.metrics import Metrics
from services.coordinator.pd import Call, Router
from services.coordinator.routes import RoutingView

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_API_KEYS_BYTES = 1024 * 1024


def _not_routable() -> OpenAIError:
    return OpenAIError(
        503,
        "no routable instance",
        "service_unavailable",
        "no_routable_instance",
        headers={"Retry-After": "1"},
    )


def _bad_request(message: str, code: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", code, param)


class ApiKeys:
    """Client keys from ``coordinator.api_keys_file`` (one per line), compared in constant time."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @classmethod
    def from_file(cls, path: str) -> ApiKeys:
        """Raises ConfigError when group or others can read the file (the keys grant access),
        UnicodeDecodeError or ValueError when its content is unusable."""
        text = read_private_file(path, "API keys file", MAX_API_KEYS_BYTES).decode("utf-8")
        keys = [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]
        if not keys:
            raise ValueError(f"{path}: no API key in the file")
        return cls(keys)

    def allows(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        given = header[7:].strip().encode()
        ok = False
        for key in self._keys:  # every key is compared: the time does not tell which one matched
            ok |= hmac.compare_digest(given, key)
        return ok


class InferenceApp:
    def __init__(
        self, view: Callable[[], RoutingView], router: Router, metrics: Metrics, keys: ApiKeys | None
    ) -> None:
        self._view = view
        self._router = router
        self._metrics = metrics
        self._keys = keys
        # Set when the process starts stopping: readiness fails so load balancers move away,
        # while requests already here (and late ones) are still served during the drain.
        self.draining = False

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[error_middleware])
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/readiness", self.readiness)
        r.add_get("/metrics", self.prom)
        return app

    # -- probes and metrics (never need a key) --------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type=JSON_CT)

    async def readiness(self, request: web.Request) -> web.Response:
        if self._view().routable and not self.draining:
            return web.Response(body=b'{"status":"ready"}', content_type=JSON_CT)
        return web.Response(
            status=503, body=b'{"status":"not ready"}', headers={"Content-Type": JSON_CT, "Retry-After": "1"}
        )

    async def prom(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    # -- OpenAI API -----------------------------------------------------------------------

    def _check_key(self, request: web.Request) -> None:
        if self._keys is not None and not self._keys.allows(request.headers.get("Authorization")):
            raise OpenAIError(
                401, "invalid or missing API key", "invalid_request_error", "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    async def _observed(self, route: str, answer: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """Await the answer to one API request; count it by route and the status the client got."""
        t0 = time.monotonic()
        status = 500  # a bug: the error middleware answers it 500
        try:
            resp = await answer
            status = resp.status
            return resp
        except (OpenAIError, web.HTTPError) as err:  # answered with this status by the middleware
            status = err.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self._metrics.observe(route, status, time.monotonic() - t0)

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._observed("/v1/models", self._models(request))

    async def _models(self, request: web.Request) -> web.Response:
        self._check_key(request)
        view = self._view()
        if not view.routable:
            raise _not_routable()
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "motor"} for m in view.model_names()]
        return web.Response(body=json.dumps({"object": "list", "data": data}).encode(), content_type=JSON_CT)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "/v1/completions")

    async def _completion(self, request: web.Request, path: str) -> web.StreamResponse:
        in_flight = self._metrics.in_flight
        in_flight.inc()
        try:
            return await self._observed(path, self._serve(request, path))
        finally:
            in_flight.dec()

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        self._check_key(request)
        view = self._view()
        if not view.routable:
            raise _not_routable()
        raw = await request.read()
        try:
            req: Any = json.loads(raw)
        except ValueError as exc:
            raise _bad_request(f"invalid JSON body: {exc}", "invalid_json") from None
        if not isinstance(req, dict):
            raise _bad_request("request body must be a JSON object", "invalid_json")
        model = req.get("model")
        if model is None and len(view.models) == 1:
            model = next(iter(view.models))  # the engine fills in its default the same way
        if not isinstance(model, str):
            raise _bad_request("model is required and must be a string", "invalid_request", "model")
        routes = view.models.get(model)
        if routes is None:
            raise model_not_found(model)
        prompt_tokens, total_tokens = estimate_tokens(req)
        call = Call(request, path, raw, req, model, prompt_tokens, total_tokens)
        return await self._router.route(call, routes)
