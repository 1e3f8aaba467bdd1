"""The completion routes (/v1/chat/completions, /v1/completions): admission, PD legs, latency.

With every latency at zero this path is the benchmark floor, so it is kept short. Benchmarks
send one body over and over, and a plain request (no PD leg, no fault) is a pure function of
its body: its *plan* (the parsed request, its token counts and the whole answer serialized
once, split around the per-request id and timestamp) is kept, keyed by the body bytes. A repeat
is then one dict lookup, one join and one write; no sleep, timer or task is made when nothing
has to wait. PD legs (tickets, rooms) and faulted requests are planned afresh every time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from services.common import log
from services.common.http_errors import OpenAIError, model_not_found
from services.common.httpserver import Request, Responder
from services.simengine import pd
from services.simengine.generation import Generated, generate, known_answer, seed_of
from services.simengine.openai_api import (
    ParsedRequest,
    RequestError,
    full_response,
    parse_request,
    stream_chunks,
)

if TYPE_CHECKING:
    from services.simengine.app import Engine

SSE_CT = b"text/event-stream"
SSE_HEADERS = [("Cache-Control", "no-cache")]
# Plans kept per route: bounded in count and bytes (request + answer) so that a load of
# distinct prompts only churns the cache. Larger bodies are not even looked up (hashing a
# body of megabytes costs more than planning it).
PLANS_MAX = 1024
PLANS_MAX_BYTES = 32 * 1024 * 1024
PLAN_MAX_BODY = 16 * 1024
PLAN_MAX_BYTES = 256 * 1024
# What cached answers are rendered with, then split out again. The split is on the whole
# `{"id":"<rid>","object":...,"created":<t>,` head: a JSON string cannot contain that (its
# quotes would be escaped), so only the real heads of the answer's objects match.
_RID = "motor-sim-rid-placeholder"
_CREATED = 4102444800


async def hang() -> None:
    await asyncio.Event().wait()


@dataclass(slots=True, eq=False)
class Plan:
    req: ParsedRequest
    model: str
    side: str | None  # "prefill" | "decode" for a PD leg
    proto: str | None  # "vllm" | "sglang" for a PD leg
    n_tokens: int
    prompt_tokens: int
    gens: list[Generated]
    first_s: float
    decode_s: float
    gen_tokens: int
    # A reusable plan's whole answer: (head as a %-format of (rid, created), the parts between heads)
    template: tuple[bytes, list[bytes]] | None = None


def _template(blob: bytes) -> tuple[bytes, list[bytes]] | None:
    start = blob.find(b'{"id":"' + _RID.encode() + b'"')
    created = b'"created":%d,' % _CREATED
    end = blob.find(created, start) + len(created)
    if start < 0 or end < len(created):  # not the layout this expects: render every answer
        return None
    head = blob[start:end]
    fmt = head.replace(b"%", b"%%").replace(_RID.encode(), b"%s").replace(b"%d" % _CREATED, b"%d")
    return fmt, blob.split(head)


class Plans:
    """Reusable plans by request body, oldest evicted first."""

    def __init__(self) -> None:
        self._plans: dict[bytes, tuple[Plan, int]] = {}
        self._bytes = 0

    def get(self, body: bytes) -> Plan | None:
        hit = self._plans.get(body) if len(body) <= PLAN_MAX_BODY else None
        return hit[0] if hit is not None else None

    def put(self, body: bytes, plan: Plan) -> None:
        if plan.template is None or len(body) > PLAN_MAX_BODY or body in self._plans:
            return
        size = len(body) + sum(map(len, plan.template[1]))
        if size > PLAN_MAX_BYTES:
            return
        while self._plans and (len(self._plans) >= PLANS_MAX or self._bytes + size > PLANS_MAX_BYTES):
            _, old = self._plans.pop(next(iter(self._plans)))  # dicts keep insertion order
            self._bytes -= old
        self._plans[body] = (plan, size)
        self._bytes += size


class Completions:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.faults = engine.faults
        self.slots = engine.slots
        self.latency = engine.latency
        self.metrics = engine.metrics
        self.tpot_s = engine.latency.tpot_s
        self._plans = (Plans(), Plans())  # [chat]
        self._session: aiohttp.ClientSession | None = None
        self._ids = itertools.count(1)
        prefix = uuid.uuid4().hex[:8]
        self._rid_prefix = (f"cmpl-{prefix}".encode(), f"chatcmpl-{prefix}".encode())  # [chat]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, chat: bool, request: Request, out: Responder) -> None:
        faults = self.faults
        fault = None
        if faults.mode != "none":
            fault = faults.on_completion()
            if fault is not None:
                self.metrics.faults[fault] = self.metrics.faults.get(fault, 0) + 1
                if fault in ("hang", "crash"):
                    await hang()
                if fault == "error":
                    raise OpenAIError(faults.status, "injected fault", "server_error", faults.status)
        body = request.body
        plans = self._plans[chat]
        plan = plans.get(body) if fault is None else None
        if plan is None:
            plan = self._plan(body, chat, fault)
            if fault is None and plan.side is None and (not plan.req.stream or self.tpot_s <= 0):
                plan.template = _template(self._render(plan, _RID, _CREATED, None))
                plans.put(body, plan)
        if fault == "disconnect" and not plan.req.stream:
            out.abort()  # before any byte of the answer
            return
        if (
            plan.side == "decode"
            and plan.proto == "sglang"
            and any(b.host is None or b.port is None for b in plan.req.bootstrap)
        ):
            raise OpenAIError(
                400, "a decode leg needs bootstrap_host and bootstrap_port", "invalid_request_error"
            )
        arrived = self.engine.loop.time()  # TTFT includes the wait for a slot
        slots = self.slots
        if not slots.try_acquire():
            await slots.acquire()
        try:
            await self._serve(out, plan, fault, arrived)
        finally:
            slots.release()

    def _plan(self, body: bytes, chat: bool, fault: str | None) -> Plan:
        try:
            req = parse_request(json.loads(body), chat)
        except RequestError as exc:
            raise OpenAIError(400, str(exc), "invalid_request_error", "invalid_request", exc.param) from None
        except ValueError as exc:
            raise OpenAIError(
                400, f"invalid JSON body: {exc}", "invalid_request_error", "invalid_json"
            ) from None
        engine = self.engine
        if req.model is not None and req.model not in engine.accepted:
            raise model_not_found(req.model)
        side, proto = self._leg(req)
        n_tokens = 1 if side == "prefill" else req.max_tokens
        prompt_tokens = sum(req.prompt_tokens)
        gens = self._generate(req, n_tokens, garbled=fault == "precision")
        return Plan(
            req,
            req.model or engine.model_id,
            side,
            proto,
            n_tokens,
            prompt_tokens,
            gens,
            self.latency.first_token_s(prompt_tokens, kv_transfer=side == "decode"),
            self.latency.decode_s(n_tokens),
            sum(len(g.tokens) for g in gens),
        )

    def _leg(self, req: ParsedRequest) -> tuple[str | None, str | None]:
        kv = req.kv_params
        if kv:
            if kv.get("do_remote_decode") is True:
                return "prefill", "vllm"
            if kv.get("do_remote_prefill") is True:
                return "decode", "vllm"
        if req.bootstrap and self.cfg.role != "union":
            return self.cfg.role, "sglang"
        return None, None

    def _generate(self, req: ParsedRequest, n_tokens: int, garbled: bool) -> list[Generated]:
        gens = []
        for prompt in req.prompts:
            seed = seed_of(prompt, self.cfg.seed)
            answer = known_answer(req.question if req.chat else prompt)
            for j in range(req.n):
                gens.append(generate(seed ^ (j * 0x9E3779B1), n_tokens, answer, req.top_k, garbled))
        return gens

    async def _serve(self, out: Responder, plan: Plan, fault: str | None, arrived: float) -> None:
        engine, m, side = self.engine, self.metrics, plan.side
        if side == "decode":
            if plan.proto == "sglang":
                try:
                    await self._await_rooms(plan.req)
                except pd.RoomTimeout as exc:
                    m.bootstrap_timeouts += 1
                    log.warn("bootstrap_timeout", rooms=[b.room for b in plan.req.bootstrap])
                    raise OpenAIError(504, str(exc), "server_error", "bootstrap_timeout") from None
            else:
                known = engine.tickets.redeem((plan.req.kv_params or {}).get("remote_request_id"))
                m.tickets["known" if known else "unknown"] += 1
        if plan.first_s > 0:
            await asyncio.sleep(plan.first_s)
        extra: dict[str, Any] | None = None
        if side == "prefill":
            if plan.proto == "vllm":
                extra = {"kv_transfer_params": engine.ticket(plan.prompt_tokens)}
            elif engine.rendezvous is not None:
                for b in plan.req.bootstrap:
                    engine.rendezvous.register(b.room, {"prompt_tokens": plan.prompt_tokens})
        m.ttft.observe(engine.loop.time() - arrived)
        if side is not None and plan.proto is not None:
            m.legs[(side, plan.proto)] += 1
        rid = b"%s%x" % (self._rid_prefix[plan.req.chat], next(self._ids))
        created = int(time.time())
        try:
            if plan.req.stream:
                await self._stream(out, plan, rid, created, extra, fault)
            else:
                if plan.decode_s > 0:
                    await asyncio.sleep(plan.decode_s)
                out.send(200, self._answer(plan, rid, created, extra))
        except ConnectionResetError:
            # The client went away: what vLLM counts as an aborted request.
            m.success["abort"] += 1
            out.abort()
            return
        except asyncio.CancelledError:
            m.success["abort"] += 1  # the same, noticed by the server first
            raise
        if plan.n_tokens > 1:
            m.tpot.observe(self.tpot_s)
        m.success["length"] += 1
        m.prompt_tokens += plan.prompt_tokens
        m.generation_tokens += plan.gen_tokens

    def _render(self, plan: Plan, rid: str, created: int, extra: dict[str, Any] | None) -> bytes:
        """The whole answer: the JSON body, or every SSE event of a stream."""
        req = plan.req
        if req.stream:
            prelude, steps, tail = stream_chunks(req, rid, created, plan.model, plan.gens, "length", extra)
            return prelude + b"".join(steps) + tail
        return full_response(req, rid, created, plan.model, plan.gens, "length", extra)

    def _answer(self, plan: Plan, rid: bytes, created: int, extra: dict[str, Any] | None) -> bytes:
        if plan.template is not None and extra is None:
            head, parts = plan.template
            return (head % (rid, created)).join(parts)
        return self._render(plan, rid.decode(), created, extra)

    async def _stream(
        self,
        out: Responder,
        plan: Plan,
        rid: bytes,
        created: int,
        extra: dict[str, Any] | None,
        fault: str | None,
    ) -> None:
        tpot = self.tpot_s
        out.start(200, SSE_CT, SSE_HEADERS)
        if tpot <= 0 and fault != "disconnect":
            # Nothing to pace: every event in one chunk (the head goes out with it).
            out.end(self._answer(plan, rid, created, extra))  # head, events and end: one write
            return
        prelude, steps, tail = stream_chunks(
            plan.req, rid.decode(), created, plan.model, plan.gens, "length", extra
        )
        await out.write(prelude + steps[0])
        if fault == "disconnect":
            out.abort()  # after one write (for chat: the role delta and the first token)
            return
        for step in steps[1:]:
            await asyncio.sleep(tpot)
            if self.faults.hanging():
                await hang()
            await out.write(step)
        out.end(tail)

    async def _await_rooms(self, req: ParsedRequest) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        session = self._session
        timeout = self.cfg.bootstrap_timeout_s
        await asyncio.gather(
            *(
                pd.wait_for_room(session, str(b.host), int(b.port or 0), b.room, timeout)
                for b in req.bootstrap
            )
        )
