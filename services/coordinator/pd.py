"""Routing one inference request: vLLM hand-off, SGLang bootstrap, union and prefill-only
(docs/architecture.md, "The flow of a request").

A prefill that cannot be reached is retried on another prefill instance; a decode that cannot
be reached is retried on another pair (a fresh prefill leg with a new decode, so no ticket or
room is ever shared between two attempts). A leg that breaks after it answered (with
``migration_limit`` > 0) continues on another pair from the output already delivered
(:mod:`motor_mesh.coordinator.migration`, docs/migration.md). When no instance of a role can
be reached the client gets 502 ``upstream_unreachable``; a leg past its deadline, 504
``upstream_timeout``. Either leg failing cancels the other. Client disconnect cancels the
handler task, which closes every upstream connection still open, so both legs stop.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from motor_mesh.common import log
from motor_mesh.common.enums import ENGINE_SGLANG, PD_SGLANG, ROLE_NAMES
from motor_mesh.common.http_errors import OpenAIError, server_error
from motor_mesh.common.httpclient import Response
from motor_mesh.common.httpmessages import Headers, Responder
from motor_mesh.coordinator.bodies import (
    KV,
    _dumps,
    estimate_tokens,
    kv_params_of,
    loads,
    prefill_body,
    with_fields,
)
from motor_mesh.coordinator.migration import relay
from motor_mesh.coordinator.migration.budget import StateBudget
from motor_mesh.coordinator.migration.carry import Carry
from motor_mesh.coordinator.migration.flight import Flight, Moved
from motor_mesh.coordinator.migration.relay import Break
from motor_mesh.coordinator.policies import Policy
from motor_mesh.coordinator.precision.groups import Completed
from motor_mesh.coordinator.routes import ModelRoutes, PdGroup, Target, Upstream
from motor_mesh.coordinator.upstream import Answer, Engines, PhaseTimeout, Unreachable

if TYPE_CHECKING:  # loaded only when tracing is on (kv: only with a kv_aware policy)
    from motor_mesh.coordinator.kv.prompt import PromptView
    from motor_mesh.coordinator.kv.routing import KvRouting
    from motor_mesh.coordinator.tracing import Leg, RequestTrace

CHAT_PATH = "/v1/chat/completions"
# Times a request whose routes all failed reads newer ones before it gives up (502).
ROUTE_REFRESHES = 2


@dataclass(slots=True)
class Call:
    """One client request, parsed once."""

    out: Responder
    path: str  # "/v1/chat/completions" or "/v1/completions"
    path_b: bytes
    raw: bytes
    req: dict[str, Any]
    model: str
    prompt_tokens: int  # load estimate of a prefill
    total_tokens: int  # load estimate of a decode / whole request
    t0: float  # loop time the request arrived
    trace: RequestTrace | None = None  # its spans, when tracing is on (each leg attempt gets one)
    reply: Headers = None  # headers every answer carries (the trace's)
    prompt: PromptView | None = None  # its tokenized prompt, when a policy is kv_aware
    carry: Carry | None = None  # what continues it elsewhere, when migration is on
    avoid: frozenset[int] = frozenset()  # the instance a continuation must not go back to
    span: Any = None  # the continuation's span, while one runs (tracing on)


@dataclass(frozen=True, slots=True)
class Migration:
    """coordinator.migration_limit and migration_delay_s."""

    limit: int
    delay_s: float
    budget: StateBudget


class NoUpstream(Exception):
    def __init__(self, role: str, model: str, last: BaseException | None) -> None:
        detail = f": {last}" if last else ""
        super().__init__(f"no {role} instance of model {model!r} could be reached{detail}")
        self.role = role


# Told (p, d, what was asked) of every request a group answered successfully: precision
# detection's sampler (p = 0 for an instance that served the whole request). It must return at once.
CompletedSink = Callable[[int, int, Completed], None]


def _prefill_work(call: Call) -> int:
    """The prefill load a request puts on the instance just chosen. With kv_aware it is what the
    engine must compute, its cached prefix aside, counted in the prompt's real tokens (a prefill
    of a cached prompt is nearly free, and counting all of it would steer the next request of
    the same prefix elsewhere); otherwise the size estimate."""
    prompt = call.prompt
    return call.prompt_tokens if prompt is None else max(1, prompt.n - prompt.cached)


def _gives_ids(routes: ModelRoutes) -> bool:
    """Whether the engines of ``routes`` return token ids when asked (vLLM's and the simulated
    engine's do; SGLang's answer gets the text path)."""
    if routes.pd:
        return any(g.protocol != PD_SGLANG for g in routes.pd)
    return any(t.engine_type != ENGINE_SGLANG for t in routes.union or routes.prefill_only)


def _pick(
    policy: Policy, targets: Sequence[Target], tried: set[int], prompt: PromptView | None
) -> Target | None:
    """``policy``'s choice among the targets not ``tried`` that are still routed to: a request
    holds the routes it began with, and an instance may have left routing since (its leg would
    only be moved off again; a drain counting on no new leg must get none)."""
    while True:
        t = policy(targets, tried, prompt)
        if t is None or t.move_at is None:
            return t
        tried.add(t.id)


def _fresh(avoid: frozenset[int], targets: Sequence[Target]) -> set[int]:
    """The instances a continuation starts out not trying: the one it left, unless there is no
    other (a relaunched instance may be the only one and serve again)."""
    if avoid and any(t.id not in avoid for t in targets):
        return set(avoid)
    return set()


def _endpoint(t: Target, prompt: PromptView | None) -> Upstream:
    """The endpoint of ``t`` that serves a leg: the one kv_aware found holding the prompt's
    prefix when it chose ``t``, else the instance's own rotation."""
    if prompt is not None:
        ep = prompt.endpoint
        if ep is not None and ep.owner is t and not ep.down:
            return ep
    return t.pick_endpoint()


class Router:
    def __init__(
        self,
        engines: Engines,
        prefill_policy: Policy,
        decode_policy: Policy,
        kv: KvRouting | None = None,
        migration: Migration | None = None,
        min_prompt_tokens: int = 0,
    ) -> None:
        self.engines = engines
        # Shorter prompts skip the prefill leg of a vLLM-protocol pair (pd_min_prompt_tokens).
        self.min_prompt_tokens = min_prompt_tokens
        self.migration = migration or Migration(0, 0.0, StateBudget(0, 0))
        self.metrics = engines.metrics
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.kv = kv
        # The KV feed of this process (one inference process), told which engines serve: one
        # whose events go silent while it serves is stale (kv_events_stale_s).
        self._feed = kv.feed if kv is not None else None
        self.completed: CompletedSink | None = None
        self._background: set[asyncio.Future[Any]] = set()

    async def route(
        self, call: Call, routes: ModelRoutes, routes_of: Callable[[], ModelRoutes | None] | None = None
    ) -> None:
        """Serve ``call`` on ``routes``; with a carry, a leg that breaks continues on the routes
        ``routes_of`` gives then (the table may have changed meanwhile)."""
        if self.kv is not None and call.prompt is None:  # (the context budget may have read it)
            some = routes.pd[0].prefill[0] if routes.pd else (routes.union or routes.prefill_only)[0]
            call.prompt = await self.kv.prompt(call.req, call.path == CHAT_PATH, some)
        if call.carry is None and self.migration.limit:
            call.carry = self._carry(call, routes)
        carry = call.carry
        refreshed = 0  # times the routes were read again after every instance of them failed
        try:
            while True:
                try:
                    await self._dispatch(call, routes)
                    break
                except Break as brk:
                    assert carry is not None  # only a carried leg raises it
                    next_routes = await self._continue(call, carry, brk, routes_of)
                    if next_routes is None:
                        break
                    routes = next_routes
                except NoUpstream:
                    # Every instance these routes name failed or left routing: the table may
                    # hold others by now (a relaunched instance comes back as a new one).
                    fresh = routes_of() if routes_of is not None else None
                    if fresh is None or fresh is routes or call.out.started or refreshed >= ROUTE_REFRESHES:
                        raise
                    refreshed += 1
                    routes = fresh
        except NoUpstream as exc:
            log.warn("no_upstream", role=exc.role, model=call.model, error=str(exc))
            if carry is not None and carry.reason:  # a continuation found nowhere to go
                self.metrics.migration(carry.reason, "unroutable")
            raise _ended(call, server_error(502, str(exc), "upstream_unreachable")) from None
        except PhaseTimeout as exc:
            log.warn("upstream_timeout", role=exc.role, model=call.model, error=str(exc))
            raise _ended(call, server_error(504, str(exc), "upstream_timeout")) from None
        finally:
            if carry is not None:
                carry.release()
                if call.out.started:
                    call.out.end()
                if carry.moves:
                    log.event(
                        "request_migrated",
                        model=call.model,
                        migrated=carry.moves,
                        tokens=carry.count,
                        status=call.out.status,
                        ended=carry.finish or ("done" if carry.done else "broken"),
                    )

    def _carry(self, call: Call, routes: ModelRoutes) -> Carry:
        """The request's continuation state. A stream asks engines that can give token ids for
        them (the carry removes them again unless the client asked too)."""
        want = bool(call.req.get("stream")) and _gives_ids(routes)
        carry = Carry(call.req, call.path == CHAT_PATH, self.migration.budget, len(call.raw), want)
        if want and not carry.client_ids:
            call.raw = with_fields(call.raw, call.req, {"return_token_ids": True})
        return carry

    async def _continue(
        self, call: Call, carry: Carry, brk: Break, routes_of: Callable[[], ModelRoutes | None] | None
    ) -> ModelRoutes | None:
        """After ``brk``: the routes to continue on, with ``call`` made the continuation; None
        when the answer ended here (it was complete, or it cannot continue: the client then gets
        the error, as an event when the stream had begun)."""
        metrics = self.metrics
        reason = brk.reason
        log.warn("upstream_broken", role=ROLE_NAMES.get(brk.target.role, "decode"), reason=reason,
                 instance_id=brk.target.id, delivered=carry.count, error=str(brk))  # fmt: skip
        if carry.over:
            # Its last events were lost, its output was not: end it as the engine would have.
            await _finish(call, carry)
            metrics.migration(reason, "completed")
            return None
        why = carry.why_not()
        if why is not None:
            log.warn("migration_refused", reason=reason, why=why, model=call.model, delivered=carry.count)
            metrics.migration(reason, "refused")
            await _give_up(call, carry, brk)
            return None
        if carry.moves >= self.migration.limit:
            metrics.migration(reason, "exhausted")
            await _give_up(call, carry, brk)
            return None
        req = carry.next_request()
        if req is None:  # the output already delivered is all max_tokens allowed
            await _finish(call, carry)
            metrics.migration(reason, "completed")
            return None
        if carry.started:
            carry.gap_from = carry.last
        span = None if call.trace is None else call.trace.continuation(carry.moves + 1, reason, carry.count)
        # No instance of the model routable (the only one relaunching): each look takes one of
        # the request's continuations.
        while True:
            await asyncio.sleep(self.migration.delay_s * 2**carry.moves)
            carry.moves += 1
            routes = routes_of() if routes_of is not None else None
            if routes is not None:
                break
            if carry.moves >= self.migration.limit:
                if span is not None:
                    span.end()
                metrics.migration(reason, "unroutable")
                await _give_up(call, carry, brk)
                return None
        carry.reason = reason
        metrics.migration(reason, "continued")
        call.req = req
        call.raw = _dumps(req)
        call.prompt = None  # a kv_aware policy reads the client's prompt, not this one
        call.prompt_tokens, call.total_tokens = estimate_tokens(req)
        call.avoid = frozenset((brk.target.id,))
        call.span = span
        return routes

    async def _dispatch(self, call: Call, routes: ModelRoutes) -> None:
        metrics = self.metrics
        try:
            if routes.pd:
                group = routes.pd[0] if len(routes.pd) == 1 else random.choice(routes.pd)
                if group.protocol == PD_SGLANG:
                    metrics.routed("sglang_pd")
                    return await self._sglang(call, group)
                if self._short(call):
                    # Conditional disaggregation: a decode engine computes a short prompt's
                    # prefill itself sooner than a hand-off can bring it (bench/results/kv_routing.md).
                    metrics.routed("decode_only")
                    return await self._whole(call, group.decode, self.decode_policy, "decode", call.raw)
                metrics.routed("vllm_pd")
                return await self._vllm(call, group)
            if routes.union:
                metrics.routed("union")
                return await self._whole(call, routes.union, self.decode_policy, "union", call.raw)
            metrics.routed("prefill_only")
            return await self._whole(call, routes.prefill_only, self.prefill_policy, "prefill", call.raw)
        finally:
            if call.span is not None:
                call.span.end()
                call.span = None

    def _short(self, call: Call) -> bool:
        """Whether the prompt is under ``min_prompt_tokens``: counted exactly when kv_aware
        tokenized it, else the body's estimate (about four characters a token)."""
        limit = self.min_prompt_tokens
        if not limit:
            return False
        prompt = call.prompt
        return (prompt.n if prompt is not None else call.prompt_tokens) < limit

    # -- vLLM: prefill first, then decode with the prefill's kv_transfer_params ----------------

    async def _vllm(self, call: Call, group: PdGroup) -> None:
        body = prefill_body(call.req)
        tried_p: set[int] = set()
        tried_d = _fresh(call.avoid, group.decode)
        last: BaseException | None = None
        loop = asyncio.get_running_loop()
        while True:
            if tried_d and all(t.id in tried_d for t in group.decode):
                # Every decode failed: a new prefill leg would have nothing to hand off to.
                raise NoUpstream("decode", call.model, last)
            p = _pick(self.prefill_policy, group.prefill, tried_p, call.prompt)
            if p is None:
                raise NoUpstream("prefill", call.model, last)
            work = _prefill_work(call)
            p.load += work
            p.legs += 1
            pep = _endpoint(p, call.prompt)
            if self._feed is not None:
                self._feed.prefill_sent(pep.base)
            leg = None if call.trace is None else call.trace.leg("prefill", pep)
            t = loop.time()
            try:
                answer = await self.engines.call(pep, call.path_b, body, "prefill", leg=leg)
            except Unreachable as exc:
                last = exc
                tried_p.add(p.id)
                self.metrics.retry("prefill")
                continue
            finally:
                p.load -= work
                p.legs -= 1
                if leg is not None:
                    leg.end()
            self.metrics.phase("prefill", loop.time() - t)
            if answer.status >= 400:
                return _answer_error(call, answer)  # the engine's own status and error body
            d = _pick(self.decode_policy, group.decode, tried_d, call.prompt)
            if d is None:
                raise NoUpstream("decode", call.model, last)
            try:
                return await self._serve_on(call, d, "decode", _vllm_decode_body(call, answer), p.id)
            except Unreachable as exc:
                # Nothing reached the client: another pair, from a fresh prefill leg.
                last = exc
                tried_d.add(d.id)
                self.metrics.retry("decode")

    # -- whole request on one instance (union, prefill-only degraded mode) --------------------

    async def _whole(
        self, call: Call, targets: Sequence[Target], policy: Policy, role: str, body: bytes
    ) -> None:
        tried = _fresh(call.avoid, targets)
        last: BaseException | None = None
        while True:
            t = _pick(policy, targets, tried, call.prompt)
            if t is None:
                raise NoUpstream(role, call.model, last)
            try:
                return await self._serve_on(call, t, role, body, 0)
            except Unreachable as exc:
                last = exc
                tried.add(t.id)
                self.metrics.retry(role)

    async def _serve_on(self, call: Call, t: Target, role: str, body: bytes, p_id: int) -> None:
        """Open the leg that answers the client on ``t`` and relay its answer.
        Raises Unreachable (nothing was sent to the client yet). With a carry the leg can be
        moved off ``t`` (a drain, the instance leaving the table) and a break raises Break."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        ep = _endpoint(t, call.prompt)
        if self._feed is not None:
            self._feed.prefill_sent(ep.base)  # a decode leg's engine serves too
        leg = None if call.trace is None else call.trace.leg(role, ep)
        # A whole request's prefill is cheaper by its cached prefix; a decode leg's is not.
        if role == "decode":
            work = call.total_tokens
        else:
            work = _prefill_work(call) + call.total_tokens - call.prompt_tokens
        t.load += work
        t.legs += 1
        carry = call.carry
        flight = None
        if carry is not None:
            flight = Flight()
            t.joined(flight)
        try:
            if flight is None:
                resp = await self.engines.open(ep, call.path_b, body, role, leg)
            else:
                resp = await self._open(call, t, ep, role, body, leg, flight)
            try:
                if carry is None or flight is None:
                    await self.engines.relay(call.out, resp, role, call.t0, call.reply, leg)
                else:
                    await self._relay_carried(call, carry, resp, t, flight, role, leg)
            finally:
                _done_with(resp)
        finally:
            if flight is not None:
                t.flights.discard(flight)
                flight.close()
            t.load -= work
            t.legs -= 1
            if leg is not None:
                leg.end()
        self.metrics.phase("decode" if role == "decode" else "whole", loop.time() - started)
        if resp.status < 400 and call.out.status < 400:
            self._completed(call, p_id, t.id)

    async def _open(
        self, call: Call, t: Target, ep: Upstream, role: str, body: bytes, leg: Leg | None, flight: Flight
    ) -> Response:
        """``engines.open`` that a move stops (Break) while it waits for the answer's head."""
        try:
            resp = await self.engines.open(ep, call.path_b, body, role, leg, flight.opening)
        except Moved as moved:
            raise Break(moved.reason, t, f"moved off the {role} instance before it answered") from None
        flight.resp = resp
        if flight.reason is not None:
            resp.interrupt(Moved(flight.reason))
        return resp

    async def _relay_carried(
        self, call: Call, carry: Carry, resp: Response, t: Target, flight: Flight, role: str, leg: Leg | None
    ) -> None:
        if resp.status < 400 and carry.stream and relay.is_stream(resp):
            await relay.stream(self.engines, call.out, resp, carry, t, flight, role, call.t0, call.reply, leg)
        elif resp.status < 500 and carry.started:
            # The continuation was refused (the engine's 4xx) after the client had output: the
            # answer ends with the engine's error as an event.
            data = await resp.read(asyncio.get_running_loop().time() + self.engines.deadlines.idle_s)
            self.metrics.upstream_error(role, "status")
            carry.finish = "error"
            await call.out.write(b"data: " + _error_body(data, resp.status) + b"\n\n")
        else:
            await relay.whole(self.engines, call.out, resp, t, flight, role, call.t0, call.reply, leg)

    # -- SGLang: both legs at once, matched by (bootstrap_host, bootstrap_port, room) ----------

    async def _sglang(self, call: Call, group: PdGroup) -> None:
        tried_p: set[int] = set()
        tried_d = _fresh(call.avoid, group.decode)
        last: BaseException | None = None
        while True:
            p = _pick(self.prefill_policy, group.prefill, tried_p, call.prompt)
            if p is None:
                raise NoUpstream("prefill", call.model, last)
            pep = _endpoint(p, call.prompt)
            if self._feed is not None:
                self._feed.prefill_sent(pep.base)
            work = _prefill_work(call)
            d = _pick(self.decode_policy, group.decode, tried_d, call.prompt)
            if d is None:
                raise NoUpstream("decode", call.model, last)
            try:
                return await self._sglang_pair(call, p, pep, work, d)
            except Unreachable as exc:
                last = exc
                if exc.role == "prefill":
                    tried_p.add(p.id)
                else:
                    tried_d.add(d.id)
                self.metrics.retry(exc.role)

    async def _sglang_pair(self, call: Call, p: Target, pep: Upstream, work: int, d: Target) -> None:
        body = with_fields(call.raw, call.req, _bootstrap(pep))
        prefill = asyncio.ensure_future(self._sglang_prefill(call, p, pep, body, work))
        loop = asyncio.get_running_loop()
        started = loop.time()
        d.load += call.total_tokens
        resp: Response | None = None
        answered = False
        dep = _endpoint(d, call.prompt)
        leg = None if call.trace is None else call.trace.leg("decode", dep)
        try:
            decode = asyncio.ensure_future(self.engines.open(dep, call.path_b, body, "decode", leg))
            try:
                # Either leg failing before the decode answers cancels the other: no decode may
                # wait on a room that will never fill.
                done, _ = await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
                if prefill in done:
                    failed = _prefill_failure(prefill)
                    if isinstance(failed, Answer):
                        return _answer_error(call, failed)  # the prefill engine's own error
                    if failed is not None:
                        raise failed
                resp = await decode
            finally:
                if not decode.done():
                    decode.cancel()
                elif resp is None and not decode.cancelled() and decode.exception() is None:
                    decode.result().close()  # answered, but the prefill failed first
            if call.carry is None:
                await self.engines.relay(call.out, resp, "decode", call.t0, call.reply, leg)
            else:
                d.legs += 1
                flight = Flight()
                flight.resp = resp
                d.joined(flight)
                try:
                    await self._relay_carried(call, call.carry, resp, d, flight, "decode", leg)
                finally:
                    d.flights.discard(flight)
                    flight.close()
                    d.legs -= 1
            answered = resp.status < 400
            if answered and call.out.status < 400:
                self._completed(call, p.id, d.id)
        finally:
            d.load -= call.total_tokens
            if resp is not None:
                _done_with(resp)
            if leg is not None:
                leg.end()
            self._settle_prefill(prefill, answered)
        self.metrics.phase("decode", loop.time() - started)

    async def _sglang_prefill(self, call: Call, p: Target, ep: Upstream, body: bytes, work: int) -> Answer:
        p.load += work
        p.legs += 1
        leg = None if call.trace is None else call.trace.leg("prefill", ep)
        try:
            return await self.engines.call(ep, call.path_b, body, "prefill", leg=leg)
        finally:
            p.load -= work
            p.legs -= 1
            if leg is not None:
                leg.end()

    def _settle_prefill(self, prefill: asyncio.Future[Any], answered: bool) -> None:
        if answered and not prefill.done():
            # The decode has its KV: the prefill leg finishes on its own, off the client's path.
            self._keep(prefill)
        elif not prefill.done():
            prefill.cancel()
        elif not prefill.cancelled():
            prefill.exception()  # already acted on (or moot): mark it retrieved

    def _keep(self, task: asyncio.Future[Any]) -> None:
        """Let a leg finish on its own; close() still cancels it."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_discard)

    def _completed(self, call: Call, p: int, d: int) -> None:
        sink = self.completed
        if sink is None or (call.carry is not None and call.carry.moves):
            return  # a continued answer came from two pairs: no sample of either
        try:
            sink(p, d, Completed(call.path, call.model, call.req))
        except Exception:  # detection fails open: the client's answer is already made
            log.exception("precision_record_failed", p=p, d=d)

    @property
    def background(self) -> int:
        """Prefill legs left to finish on their own (tests count them for leaks)."""
        return len(self._background)

    # -- one request pinned to a pair, read whole, never relayed (precision samples) ---------

    async def exchange(
        self, path: str, raw: bytes, req: dict[str, Any], p: Target | None, d: Target, timeout_s: float
    ) -> Answer:
        """Send ``req`` (``raw`` its bytes) to the pair (p, d) with the same hand-off a client's
        request gets (p None: d serves it whole), no retry on another instance, and return the
        decode's (or the prefill's error) answer within ``timeout_s`` per leg.
        Raises Unreachable / PhaseTimeout."""
        path_b = path.encode()
        prompt_tokens, total_tokens = estimate_tokens(req)
        if p is None:
            role = ROLE_NAMES.get(d.role, "decode")
            return await self._pinned(d, d.pick_endpoint(), total_tokens, path_b, raw, timeout_s, role)
        if p.protocol == PD_SGLANG:
            pep = p.pick_endpoint()
            body = with_fields(raw, req, _bootstrap(pep))
            prefill = asyncio.ensure_future(
                self._pinned(p, pep, prompt_tokens, path_b, body, timeout_s, "prefill")
            )
            decode = asyncio.ensure_future(
                self._pinned(d, d.pick_endpoint(), total_tokens, path_b, body, timeout_s, "decode")
            )
            try:
                # As for a client's request: a prefill that fails first ends the decode's wait.
                done, _ = await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
                if prefill in done:
                    failed = _prefill_failure(prefill)
                    if isinstance(failed, Answer):
                        return failed
                    if failed is not None:
                        raise failed
                return await decode
            finally:
                answered = decode.done() and not decode.cancelled() and decode.exception() is None
                if not decode.done():
                    decode.cancel()
                self._settle_prefill(prefill, answered)
        pep = p.pick_endpoint()
        answer = await self._pinned(p, pep, prompt_tokens, path_b, prefill_body(req), timeout_s, "prefill")
        if answer.status >= 400:
            return answer
        kv = kv_params_of(answer.body)
        body = with_fields(raw, req, {KV: kv}) if kv is not None else raw
        return await self._pinned(d, d.pick_endpoint(), total_tokens, path_b, body, timeout_s, "decode")

    async def _pinned(
        self, t: Target, ep: Upstream, tokens: int, path: bytes, body: bytes, timeout_s: float, role: str
    ) -> Answer:
        t.load += tokens  # the policies see this work like any other
        t.legs += 1
        try:
            return await self.engines.call(ep, path, body, role, timeout_s)
        finally:
            t.load -= tokens
            t.legs -= 1

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _ended(call: Call, err: OpenAIError) -> OpenAIError:
    """``err`` for the server to answer; once a stream began it is its last event instead."""
    out = call.out
    if out.started and not out.finished:
        out.end(b"data: " + err.body() + b"\n\n")
    return err


async def _give_up(call: Call, carry: Carry, brk: Break) -> None:
    """The answer ends with the break's error: an event when the stream began, else a status."""
    if brk.reason == "timeout":
        err = server_error(504, f"{brk}; decode_idle_timeout_s passed", "upstream_timeout")
    else:
        err = server_error(502, str(brk), "upstream_disconnected")
    if carry.started:
        await call.out.write(b"data: " + err.body() + b"\n\n")
        return None
    raise err


async def _finish(call: Call, carry: Carry) -> None:
    """End an answer whose output is all delivered but whose last events were lost."""
    if carry.started:
        await call.out.write(carry.ending())


def _answer_error(call: Call, answer: Answer) -> None:
    """An engine's error answer (a prefill's): as it came, or as an event once a stream began
    (a continuation's prefill refused)."""
    out = call.out
    if not out.started:
        return answer.send(out, call.reply)
    if call.carry is not None:
        call.carry.finish = "error"
    out.end(b"data: " + _error_body(answer.body, answer.status) + b"\n\n")
    return None


def _error_body(data: bytes, status: int) -> bytes:
    """An engine's error body as one SSE event's data: its JSON when it is an object with an
    ``error``, else one made of its text."""
    try:
        obj = loads(data)
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict) and "error" in obj:
        return _dumps(obj)
    text = data.decode("utf-8", "replace")[:500]
    return server_error(status, text or f"the engine answered {status}", "upstream_error").body()


def _done_with(resp: Response) -> None:
    """Back to the pool when fully read; otherwise close, so the engine sees the client leave."""
    if resp.at_eof:
        resp.release()
    else:
        resp.close()


def _discard(task: asyncio.Future[Any]) -> None:
    """Done-callback for legs left to finish on their own: retrieve the outcome so a failure is
    logged once instead of as 'Task exception was never retrieved'."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.warn("background_leg_failed", error=str(exc))


def _bootstrap(pep: Upstream) -> dict[str, Any]:
    """The SGLang rendezvous both legs carry: the prefill endpoint's bootstrap server, a new room."""
    return {
        "bootstrap_host": pep.host,
        "bootstrap_port": pep.bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }


def _vllm_decode_body(call: Call, prefill: Answer) -> bytes:
    """The vLLM decode leg: the request with the prefill's kv_transfer_params spliced in. With
    no ticket (an engine without a KV connector) the decode computes the prompt itself."""
    kv = kv_params_of(prefill.body)
    if kv is None:
        return call.raw
    carried = call.req.get(KV)  # a continuation's prompt ids (migration/carry.py) go on too
    return with_fields(call.raw, call.req, {KV: {**kv, **carried} if isinstance(carried, dict) else kv})


def _prefill_failure(task: asyncio.Future[Answer]) -> BaseException | Answer | None:
    """What went wrong with a finished SGLang prefill leg: an exception, an error answer, or None."""
    if task.cancelled():
        return asyncio.CancelledError()
    exc = task.exception()
    if exc is not None:
        return exc
    answer = task.result()
    return answer if answer.status >= 400 else None
