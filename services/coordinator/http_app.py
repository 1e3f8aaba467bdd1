"""The OpenAI-compatible inference server: the ``/v1`` API, probes and metrics
(docs/architecture.md, "The flow of a request").

Runs on :mod:`motor_mesh.common.httpserver`. Errors are :class:`OpenAIError` bodies raised by the
handlers and answered by the server; while nothing is routable, the API answers 503
``no_routable_instance`` with ``Retry-After: 1`` (docs/operations.md, "Health and readiness").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.common.http_errors import OpenAIError, invalid_request, model_not_found
from motor_mesh.common.httpmessages import JSON_CT, Handler, Headers, Request, Responder, route_table
from motor_mesh.coordinator.admission.gate import Gate, RateLimited, Ticket
from motor_mesh.coordinator.admission.slots import Account
from motor_mesh.coordinator.admission.tenants import PRIORITIES
from motor_mesh.coordinator.admission.usage import MeteredResponder
from motor_mesh.coordinator.bodies import BadBody, estimate_tokens, parse_request
from motor_mesh.coordinator.engine_metrics.source import FORMATS, ROLES, EngineMetrics
from motor_mesh.coordinator.metrics import Metrics
from motor_mesh.coordinator.pd import Call, Router
from motor_mesh.coordinator.routes import RoutingView

if TYPE_CHECKING:  # loaded only when tracing is on (the context budget: when clamp_max_tokens is)
    from motor_mesh.coordinator.context_budget import ContextBudget
    from motor_mesh.coordinator.tracing import RequestTrace, RequestTracer

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


class InferenceApp:
    """The request handlers. One per process serving HTTP (the management process with
    ``workers = 1``, else each worker)."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        view: Callable[[], RoutingView],
        router: Router,
        metrics: Metrics,
        gate: Gate,
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
        self._gate = gate
        self._max_depth = cfg.max_json_depth
        self._tracer = tracer  # None: tracing is off
        self._engine_metrics = engine_metrics  # None: collection is off
        self._scheme = scheme
        # Set when the process starts stopping: readiness fails so load balancers move away,
        # while requests already here (and late ones) are still served during the drain.
        self.draining = False
        self.budget: ContextBudget | None = None  # coordinator.clamp_max_tokens (set by the server)

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

    async def _identify(self, req: Request) -> Account:
        """The caller's tenant account (401 without a valid key, when keys are configured)."""
        header = req.headers.get(b"authorization")
        account = self._gate.identify(header)
        if account is None:  # only a PBKDF2-stored key can match: checked off the loop
            assert header is not None
            account = await self._gate.identify_slowly(header)
        return account

    async def models(self, req: Request, out: Responder) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            account = await self._identify(req)
            headers = None
            if self._gate.limited(req.path):
                headers = self._refused_if(
                    lambda: self._gate.charge(account, 0, loop.time()), account
                ).headers
            view = self._view()
            if not view.routable:
                raise _not_routable()
            data = [
                {"id": m, "object": "model", "created": 0, "owned_by": "motor"} for m in view.model_names()
            ]
            out.send(200, json.dumps({"object": "list", "data": data}).encode(), headers=headers)
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

    def _refused_if(self, charge: Callable[[], Ticket], account: Account) -> Ticket:
        try:
            return charge()
        except RateLimited as err:
            self._metrics.refused(err.limit, PRIORITIES[account.tenant.priority])
            raise

    async def _admitted(
        self, request: Request, out: Responder, t0: float, trace: RequestTrace | None
    ) -> None:
        gate = self._gate
        account = await self._identify(request)
        view = self._view()
        if not view.routable:
            raise _not_routable()
        try:
            body = request.body
            if len(body) < OFF_LOOP_BYTES:
                req, raw = parse_request(body, self._max_depth)
            else:  # seconds of parsing for the largest bodies: let the loop serve meanwhile
                req, raw = await asyncio.to_thread(parse_request, body, self._max_depth)
        except BadBody as exc:
            raise invalid_request(str(exc), "invalid_json") from None
        model = _model_of(req, view)
        prompt_tokens, total_tokens = estimate_tokens(req)
        loop = asyncio.get_running_loop()
        ticket = None
        if gate.limited(request.path):
            ticket = self._refused_if(lambda: gate.charge(account, total_tokens, loop.time()), account)
        slots = gate.slots
        gate.asks_for_a_slot(account)
        try:
            if slots.active >= slots.max_concurrent or slots.queued:
                self._metrics.queued(1)
                try:
                    granted = await slots.acquire(account, prompt_tokens, total_tokens - prompt_tokens)
                finally:
                    self._metrics.queued(-1)
            else:
                granted = await slots.acquire(account, prompt_tokens, total_tokens - prompt_tokens)
        except OpenAIError as err:
            self._metrics.refused(
                err.code if isinstance(err.code, str) else "queue", PRIORITIES[account.tenant.priority]
            )
            if ticket is not None:
                gate.refund(ticket, loop.time())
                raise _with_headers(err, ticket.headers) from None
            raise
        meter = None
        if ticket is not None and ticket.token_buckets:
            meter = out = MeteredResponder(out)
        try:
            await self._serve(request, out, req, raw, model, prompt_tokens, total_tokens, t0, trace, ticket)
        except OpenAIError as err:
            if ticket is not None and not out.started:
                gate.refund(ticket, loop.time())
                raise _with_headers(err, ticket.headers) from None
            raise
        finally:
            slots.release(account, granted)
            if meter is not None and ticket is not None and meter.status < 400:
                used = meter.used()
                if used is not None:
                    used += meter.prompt_tokens if meter.prompt_tokens is not None else prompt_tokens
                gate.settle(ticket, used, loop.time())

    async def _serve(
        self,
        request: Request,
        out: Responder,
        req: dict[str, Any],
        raw: bytes,
        model: str,
        prompt_tokens: int,
        total_tokens: int,
        t0: float,
        trace: RequestTrace | None,
        ticket: Ticket | None,
    ) -> None:
        view = self._view()  # the newest view: the wait in the queue may have been long
        if not view.routable:
            raise _not_routable()
        routes = view.models.get(model)
        if routes is None:
            raise model_not_found(model)
        prompt = None
        if self.budget is not None:  # max_tokens fitted to the context, or a 400 (context_budget.py)
            req, raw, prompt = await self.budget.fit(req, raw, request.path == CHAT, routes)
            prompt_tokens, total_tokens = estimate_tokens(req)
        path = request.path
        call = Call(out, path, _PATHS[path], raw, req, model, prompt_tokens, total_tokens, t0, prompt=prompt)
        if ticket is not None and ticket.headers:
            call.reply = ticket.headers
        if trace is not None:
            trace.model(model)
            call.trace = trace
            call.reply = trace.reply if call.reply is None else call.reply + (trace.reply or [])
        await self._router.route(call, routes, lambda: self._view().models.get(model))


def _model_of(req: dict[str, Any], view: RoutingView) -> str:
    """The request's model: a string the table serves (404 otherwise)."""
    model = req.get("model")
    if model is None and len(view.models) == 1:
        model = next(iter(view.models))  # the engine fills in its default the same way
    if not isinstance(model, str):
        raise invalid_request("model is required and must be a string", "invalid_request", "model")
    if model not in view.models:
        raise model_not_found(model)
    return model


def _with_headers(err: OpenAIError, headers: Headers) -> OpenAIError:
    """``err`` with the rate-limit counters every answer carries."""
    if headers:
        err.headers = {**(err.headers or {}), **dict(headers)}
    return err


def _error_with(out: Responder, err: OpenAIError, extra: Headers) -> None:
    """``out.error(err)`` with ``extra`` headers besides the error's own."""
    headers = list(err.headers.items()) if err.headers else []
    out.send(err.status, err.body(), JSON_CT, headers + (extra or []))
