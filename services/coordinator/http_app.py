"""The OpenAI-compatible inference server (contracts.md "Inference API")."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from services.coordinator.bodies import estimate_tokens
from services.coordinator.metrics import Metrics
from services.coordinator.pd import Call, Router
from services.coordinator.routes import RoutingView
from services.coordinator.upstream import JSON_CT, error_response

MAX_BODY_BYTES = 64 * 1024 * 1024
# contracts.md: the exact body while nothing is routable.
NO_ROUTE_BODY = json.dumps(
    {
        "error": {
            "message": "no routable instance",
            "type": "service_unavailable",
            "param": None,
            "code": "no_routable_instance",
        }
    }
).encode()


def _no_route() -> web.Response:
    return web.Response(status=503, body=NO_ROUTE_BODY, headers={"Content-Type": JSON_CT, "Retry-After": "1"})


def _model_not_found(model: str) -> web.Response:
    body = {
        "error": {
            "message": f"The model `{model}` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    return web.Response(status=404, body=json.dumps(body).encode(), content_type=JSON_CT)


def _bad_request(message: str, code: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return web.Response(status=400, body=json.dumps(body).encode(), content_type=JSON_CT)


class ApiKeys:
    """Client keys from ``coordinator.api_keys_file`` (one per line), compared in constant time."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @classmethod
    def from_file(cls, path: str) -> ApiKeys:
        with open(path, encoding="utf-8") as f:
            keys = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
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
        app = web.Application(client_max_size=MAX_BODY_BYTES)
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

    def _denied(self, request: web.Request) -> web.Response | None:
        if self._keys is None or self._keys.allows(request.headers.get("Authorization")):
            return None
        return error_response(
            401, "invalid or missing API key", "invalid_request_error", "invalid_api_key",
            **{"WWW-Authenticate": "Bearer"},
        )  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        t0 = time.monotonic()
        resp = self._denied(request) or self._models()
        self._metrics.observe("/v1/models", resp.status, time.monotonic() - t0)
        return resp

    def _models(self) -> web.Response:
        view = self._view()
        if not view.routable:
            return _no_route()
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "motor"} for m in view.model_names()]
        return web.Response(body=json.dumps({"object": "list", "data": data}).encode(), content_type=JSON_CT)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "/v1/completions")

    async def _completion(self, request: web.Request, path: str) -> web.StreamResponse:
        metrics = self._metrics
        t0 = time.monotonic()
        metrics.in_flight.inc()
        status = 500
        try:
            resp = await self._serve(request, path)
            status = resp.status
            return resp
        except BaseException:
            status = 499  # client went away (cancelled) or a bug: counted, never hidden
            raise
        finally:
            metrics.in_flight.dec()
            metrics.observe(path, status, time.monotonic() - t0)

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        denied = self._denied(request)
        if denied is not None:
            return denied
        view = self._view()
        if not view.routable:
            return _no_route()
        raw = await request.read()
        try:
            req: Any = json.loads(raw)
        except ValueError as exc:
            return _bad_request(f"invalid JSON body: {exc}", "invalid_json")
        if not isinstance(req, dict):
            return _bad_request("request body must be a JSON object", "invalid_json")
        model = req.get("model")
        if model is None and len(view.models) == 1:
            model = next(iter(view.models))  # the engine fills in its default the same way
        if not isinstance(model, str):
            return _bad_request("model is required and must be a string", "invalid_request", "model")
        routes = view.models.get(model)
        if routes is None:
            return _model_not_found(model)
        prompt_tokens, total_tokens = estimate_tokens(req)
        call = Call(request, path, raw, req, model, prompt_tokens, total_tokens)
        return await self._router.route(call, routes)
