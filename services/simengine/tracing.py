"""The simulated engine's request spans, shaped as vLLM's: one SERVER span ``llm_request`` per
completion request, child of the request's W3C ``traceparent``, with vLLM's ``gen_ai.*``
attributes (docs/tracing.md, "Engines").

On with ``--otlp-traces-endpoint URL`` (vLLM's flag) or ``OTEL_EXPORTER_OTLP_ENDPOINT``; this
module, and OpenTelemetry, are loaded only then. ``service.name`` is ``OTEL_SERVICE_NAME`` (the
NodeManager sets one per engine), else ``motor-sim``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import SpanKind, Status, StatusCode

from motor_mesh.common import telemetry
from motor_mesh.common.httpmessages import Request, Responder

if TYPE_CHECKING:  # completion.py calls the tracer with its Plan: types only
    from motor_mesh.simengine.completion import Plan

DEFAULT_SERVICE_NAME = "motor-sim"

Handle = Callable[[bool, Request, Responder, "Served"], Awaitable[None]]


class Served:
    """What one request turned out to be, filled in while it is served."""

    __slots__ = ("finish", "first_token_s", "plan", "queued_s", "rid")

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.rid = ""
        self.queued_s = 0.0
        self.first_token_s = 0.0
        self.finish = "abort"  # until the answer is complete

    def answered(self, plan: Plan, rid: bytes, first_token_s: float) -> None:
        self.plan, self.rid, self.first_token_s = plan, rid.decode(), first_token_s


class EngineTracer:
    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("motor.simengine")

    async def serve(self, handle: Handle, chat: bool, request: Request, out: Responder) -> None:
        """``handle`` the request, then record its span (its start back-dated to the arrival,
        as vLLM does when the request finishes)."""
        start_ns = time.time_ns()
        t0 = time.monotonic()
        served = Served()
        error: BaseException | None = None
        try:
            await handle(chat, request, out, served)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._record(request, out, served, start_ns, time.monotonic() - t0, error)

    def _record(
        self,
        request: Request,
        out: Responder,
        served: Served,
        start_ns: int,
        e2e_s: float,
        error: BaseException | None,
    ) -> None:
        span = self.tracer.start_span(
            "llm_request",
            context=telemetry.incoming_context(request.headers),
            kind=SpanKind.SERVER,
            start_time=start_ns,
        )
        if span.is_recording():
            attrs: dict[str, Any] = {
                "gen_ai.latency.e2e": e2e_s,
                "gen_ai.latency.time_in_queue": served.queued_s,
                "gen_ai.response.finish_reasons": json.dumps([served.finish]),
            }
            plan = served.plan
            if plan is not None:
                attrs.update(
                    {
                        "gen_ai.request.id": served.rid,
                        "gen_ai.response.model": plan.model,
                        "gen_ai.request.max_tokens": plan.req.max_tokens,
                        "gen_ai.request.n": plan.req.n,
                        "gen_ai.usage.prompt_tokens": plan.prompt_tokens,
                        "gen_ai.usage.completion_tokens": plan.gen_tokens,
                        "gen_ai.latency.time_to_first_token": served.first_token_s,
                        "motor.sim.leg": plan.side or "whole",
                    }
                )
                if plan.proto:
                    attrs["motor.sim.protocol"] = plan.proto
            if out.status:
                attrs["http.response.status_code"] = out.status
            span.set_attributes(attrs)
            if error is not None or out.status >= 500:
                span.set_status(Status(StatusCode.ERROR, type(error).__name__ if error else None))
        span.end()

    async def close(self) -> None:
        """Export what is left (off the loop: a collector that is gone makes it wait)."""
        await asyncio.to_thread(self.provider.shutdown)


def make_tracer(otlp_endpoint: str) -> EngineTracer:
    """``otlp_endpoint`` "": where the OTLP variables say."""
    name = None if os.environ.get("OTEL_SERVICE_NAME") else DEFAULT_SERVICE_NAME
    return EngineTracer(telemetry.new_provider(name, otlp_endpoint or None))
