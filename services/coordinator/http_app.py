"""The OpenAI-compatible inference server: the ``/v1`` API, probes and metrics
(docs/architecture.md, "The flow of a request").

Runs on :mod:`motor_mesh.common.httpserver`. Errors are :class:`OpenAIError` bodies raised by the
handlers and answered by the server; while nothing is routable, the API answers 503
``no_routable_instance`` with ``Retry-After: 1`` (docs/operations.md, "Health and readiness").
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from motor_mesh.common.config import CoordinatorConfig, read_private_file
from motor_mesh.common.http_errors import OpenAIError, invalid_request, model_not_found
from motor_mesh.common.httpmessages import JSON_CT, Handler, Headers, Request, Responder, route_table
from motor_mesh.coordinator.admission import Admission
from motor_mesh.coordinator.bodies import BadBody, estimate_tokens, parse_request
from motor_mesh.coordinator.engine_metrics.source import FORMATS, ROLES, EngineMetrics
from motor_mesh.coordinator.metrics import Metrics
from motor_mesh.coordinator.pd import Call, Router
from motor_mesh.coordinator.routes import RoutingView

if TYPE_CHECKING:  # loaded only when tracing is on
    from motor_mesh.coordinator.tracing import RequestTrace, RequestTracer

MAX_API_KEYS_BYTES = 1024 * 1024
OFF_LOOP_BYTES = 1 << 20
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_PATHS = {CHAT: CHAT.encode(), COMPLETIONS: COMPLETIONS.encode()}


def _not_routable() -> OpenAIError:
    return OpenAIError(
        503,
        "no routable instance",
        "service_unavailable",
        "no_routable_instance",
        headers={"Retry-After": "1"},
    )


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

    def allows(self, header: bytes | None) -> bool:
        if not header or not header.startswith(b"Bearer "):
            return False
        given = header[7:].strip()
        ok = False
        for key in self._keys:  # every key is compared: the time does not tell which one matched
            ok |= hmac.compare_digest(given, key)
        return ok


class InferenceApp:
    """The request handlers. One per process serving HTTP (the management process with
    ``workers = 1``, else each worker)."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        view: Callable[[], RoutingView],
        router: Router,
        metrics: Metrics,
        keys: ApiKeys | None,
        admission: Admission,
        worker: int | None = None,
        tracer: RequestTracer | None = None,
        scheme: str = "http",
        engine_metrics: EngineMetrics | None = None,
    ) -> None:
        self._view = view
        # Which inference worker answered (``workers > 1``): tells an operator, and a test,
        # that a connection reached each of them.
        status: dict[str, object] = {"status": "ok"}
        if worker is not None:
            status["worker"] = worker
        self._health = json.dumps(status, separators=(",", ":")).encode()
        self._router = router
        self._metrics = metrics
        self._keys = keys
        self._admission = admission
        self._max_depth = cfg.max_json_depth
        self._tracer = tracer  # None: tracing is off
        self._engine_metrics = engine_metrics  # None: collection is off
        self._scheme = scheme
        # Set when the process starts stopping: readiness fails so load balancers move away,
        # while requests already here (and late ones) are still served during the drain.
        self.draining = False

    def handler(self) -> Handler:
        return route_table(
            {
                ("POST", CHAT): self.completion,
                ("POST", COMPLETIONS): self.completion,
                ("GET", "/v1/models"): self.models,
                ("GET", "/health"): self.health,
                ("GET", "/readiness"): self.readiness,
                ("GET", "/metrics"): self.prom,
                ("GET", "/metrics/engines"): self.engines,
            }
        )

    def rejected(self, path: str, status: int) -> None:
        """A request the server refused before it reached a handler (too large, malformed)."""
        if path in _PATHS:
            self._metrics.observe(path, status, 0.0)

    # -- probes and metrics (never need a key) --------------------------------------------

    async def health(self, req: Request, out: Responder) -> None:
        out.send(200, self._health)

    async def readiness(self, req: Request, out: Responder) -> None:
        if self._view().routable and not self.draining:
            out.send(200, b'{"status":"ready"}')
        else:
            out.send(503, b'{"status":"not ready"}', headers=[("Retry-After", "1")])

    async def prom(self, req: Request, out: Responder) -> None:
        body = await self._metrics.render()
        out.send(200, body, b"text/plain; version=0.0.4; charset=utf-8")

    async def engines(self, req: Request, out: Responder) -> None:
        """The engines' metrics, aggregated (docs/engine-metrics.md): ``type`` (an unknown one is
        ``full``), ``role``, ``format`` (``prometheus`` or ``opentelemetry``; another is 400)."""
        try:
            if self._engine_metrics is None:
                raise OpenAIError(
                    404, "engine metrics collection is off (coordinator.engine_metrics_interval_s = 0)",
                    "not_found_error", "engine_metrics_off",
                )  # fmt: skip
            query = parse_qs(req.query, keep_blank_values=True)
            view = query.get("type", ["full"])[-1]
            fmt = query.get("format", ["prometheus"])[-1]
            role = query.get("role", [""])[-1]
            if fmt not in FORMATS:
                raise invalid_request(f"format {fmt!r} is not one of {', '.join(FORMATS)}", "invalid_format")
            if role and role not in ROLES:
                raise invalid_request(f"role {role!r} is not one of {', '.join(ROLES)}", "invalid_role")
            content_type, body = await self._engine_metrics.body(view, role, fmt)
            out.send(200, body, content_type)
        except OpenAIError as err:
            out.error(err)

    # -- OpenAI API -----------------------------------------------------------------------

    def _check_key(self, req: Request) -> None:
        if self._keys is not None and not self._keys.allows(req.headers.get(b"authorization")):
            raise invalid_request(
                "invalid or missing API key", "invalid_api_key", status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    async def models(self, req: Request, out: Responder) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            self._check_key(req)
            view = self._view()
            if not view.routable:
                raise _not_routable()
            data = [
                {"id": m, "object": "model", "created": 0, "owned_by": "motor"} for m in view.model_names()
            ]
            out.send(200, json.dumps({"object": "list", "data": data}).encode())
        except OpenAIError as err:
            out.error(err)
        finally:
            self._metrics.observe("/v1/models", out.status or 499, loop.time() - t0)

    async def completion(self, req: Request, out: Responder) -> None:
        """Count the request by route and the status the client got, whatever happens."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        metrics = self._metrics
        metrics.in_flight_now += 1
        unanswered = 500  # a bug: the server answers it 500
        trace = None if self._tracer is None else self._tracer.start(req, self._scheme)
        try:
            await self._admitted(req, out, t0, trace)
        except OpenAIError as err:
            if not out.started:
                if trace is None:
                    out.error(err)
                else:
                    _error_with(out, err, trace.reply)
        except asyncio.CancelledError:
            unanswered = 499  # the client went away before an answer began (nginx's convention)
            raise
        finally:
            metrics.in_flight_now -= 1
            metrics.observe(req.path, out.status or unanswered, loop.time() - t0)
            if trace is not None:
                trace.end(out.status or unanswered, cancelled=not out.status and unanswered == 499)

    async def _admitted(self, req: Request, out: Responder, t0: float, trace: RequestTrace | None) -> None:
        self._check_key(req)
        view = self._view()
        if not view.routable:
            raise _not_routable()
        admission = self._admission
        if admission.active >= admission.max_concurrent:
            self._metrics.queued(1)
            try:
                await admission.acquire()
            finally:
                self._metrics.queued(-1)
        else:
            await admission.acquire()
        try:
            await self._serve(req, out, t0, trace)
        finally:
            admission.release()

    async def _serve(self, request: Request, out: Responder, t0: float, trace: RequestTrace | None) -> None:
        try:
            body = request.body
            if len(body) < OFF_LOOP_BYTES:
                req, raw = parse_request(body, self._max_depth)
            else:  # seconds of parsing for the largest bodies: let the loop serve meanwhile
                req, raw = await asyncio.to_thread(parse_request, body, self._max_depth)
        except BadBody as exc:
            raise invalid_request(str(exc), "invalid_json") from None
        view = self._view()  # the newest view: the wait in the queue may have been long
        if not view.routable:
            raise _not_routable()
        model = req.get("model")
        if model is None and len(view.models) == 1:
            model = next(iter(view.models))  # the engine fills in its default the same way
        if not isinstance(model, str):
            raise invalid_request("model is required and must be a string", "invalid_request", "model")
        routes = view.models.get(model)
        if routes is None:
            raise model_not_found(model)
        prompt_tokens, total_tokens = estimate_tokens(req)
        path = request.path
        call = Call(out, path, _PATHS[path], raw, req, model, prompt_tokens, total_tokens, t0)
        if trace is not None:
            trace.model(model)
            call.trace, call.reply = trace, trace.reply
        await self._router.route(call, routes, lambda: self._view().models.get(model))


def _error_with(out: Responder, err: OpenAIError, extra: Headers) -> None:
    """``out.error(err)`` with ``extra`` headers besides the error's own."""
    headers = list(err.headers.items()) if err.headers else []
    out.send(err.status, err.body(), JSON_CT, headers + (extra or []))
