"""Routing one inference request: vLLM hand-off, SGLang bootstrap, union and prefill-only
(docs/architecture.md, "The flow of a request").

Retries happen only before any byte reached the client: a prefill that cannot be reached is
retried on another prefill instance; a decode that cannot be reached is retried on another
pair (a fresh prefill leg with a new decode, so no ticket or room is ever shared between two
attempts). When no instance of a role can be reached the client gets 502
``upstream_unreachable``; a leg past its deadline, 504 ``upstream_timeout``. Either leg failing
cancels the other. Client disconnect cancels the handler task, which closes every upstream
connection still open, so both legs stop.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from motor_mesh.common import log
from motor_mesh.common.enums import PD_SGLANG, ROLE_NAMES
from motor_mesh.common.http_errors import server_error
from motor_mesh.common.httpclient import Response
from motor_mesh.common.httpmessages import Headers, Responder
from motor_mesh.coordinator.bodies import KV, estimate_tokens, kv_params_of, prefill_body, with_fields
from motor_mesh.coordinator.policies import Policy
from motor_mesh.coordinator.precision.groups import Completed
from motor_mesh.coordinator.routes import ModelRoutes, PdGroup, Target, Upstream
from motor_mesh.coordinator.upstream import Answer, Engines, PhaseTimeout, Unreachable

if TYPE_CHECKING:  # loaded only when tracing is on (kv: only with a kv_aware policy)
    from motor_mesh.coordinator.kv.prompt import PromptView
    from motor_mesh.coordinator.kv.routing import KvRouting
    from motor_mesh.coordinator.tracing import RequestTrace

CHAT_PATH = "/v1/chat/completions"


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
        self, engines: Engines, prefill_policy: Policy, decode_policy: Policy, kv: KvRouting | None = None
    ) -> None:
        self.engines = engines
        self.metrics = engines.metrics
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.kv = kv
        self.completed: CompletedSink | None = None
        self._background: set[asyncio.Future[Any]] = set()

    async def route(self, call: Call, routes: ModelRoutes) -> None:
        metrics = self.metrics
        if self.kv is not None:
            some = routes.pd[0].prefill[0] if routes.pd else (routes.union or routes.prefill_only)[0]
            call.prompt = self.kv.prompt(call.req, call.path == CHAT_PATH, some)
        try:
            if routes.pd:
                group = routes.pd[0] if len(routes.pd) == 1 else random.choice(routes.pd)
                if group.protocol == PD_SGLANG:
                    metrics.routed("sglang_pd")
                    return await self._sglang(call, group)
                metrics.routed("vllm_pd")
                return await self._vllm(call, group)
            if routes.union:
                metrics.routed("union")
                return await self._whole(call, routes.union, self.decode_policy, "union", call.raw)
            metrics.routed("prefill_only")
            return await self._whole(call, routes.prefill_only, self.prefill_policy, "prefill", call.raw)
        except NoUpstream as exc:
            log.warn("no_upstream", role=exc.role, model=call.model, error=str(exc))
            raise server_error(502, str(exc), "upstream_unreachable") from None
        except PhaseTimeout as exc:
            log.warn("upstream_timeout", role=exc.role, model=call.model, error=str(exc))
            raise server_error(504, str(exc), "upstream_timeout") from None

    # -- vLLM: prefill first, then decode with the prefill's kv_transfer_params ----------------

    async def _vllm(self, call: Call, group: PdGroup) -> None:
        body = prefill_body(call.req)
        tried_p: set[int] = set()
        tried_d: set[int] = set()
        last: BaseException | None = None
        loop = asyncio.get_running_loop()
        while True:
            if tried_d and all(t.id in tried_d for t in group.decode):
                # Every decode failed: a new prefill leg would have nothing to hand off to.
                raise NoUpstream("decode", call.model, last)
            p = self.prefill_policy(group.prefill, tried_p, call.prompt)
            if p is None:
                raise NoUpstream("prefill", call.model, last)
            work = _prefill_work(call)
            p.load += work
            pep = _endpoint(p, call.prompt)
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
                if leg is not None:
                    leg.end()
            self.metrics.phase("prefill", loop.time() - t)
            if answer.status >= 400:
                return answer.send(call.out, call.reply)  # the engine's own status and error body
            d = self.decode_policy(group.decode, tried_d, call.prompt)
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
        tried: set[int] = set()
        last: BaseException | None = None
        while True:
            t = policy(targets, tried, call.prompt)
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
        Raises Unreachable (nothing was sent to the client yet)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        ep = _endpoint(t, call.prompt)
        leg = None if call.trace is None else call.trace.leg(role, ep)
        # A whole request's prefill is cheaper by its cached prefix; a decode leg's is not.
        if role == "decode":
            work = call.total_tokens
        else:
            work = _prefill_work(call) + call.total_tokens - call.prompt_tokens
        t.load += work
        try:
            resp = await self.engines.open(ep, call.path_b, body, role, leg)
            try:
                await self.engines.relay(call.out, resp, role, call.t0, call.reply, leg)
            finally:
                _done_with(resp)
        finally:
            t.load -= work
            if leg is not None:
                leg.end()
        self.metrics.phase("decode" if role == "decode" else "whole", loop.time() - started)
        if resp.status < 400 and call.out.status < 400:
            self._completed(call, p_id, t.id)

    # -- SGLang: both legs at once, matched by (bootstrap_host, bootstrap_port, room) ----------

    async def _sglang(self, call: Call, group: PdGroup) -> None:
        tried_p: set[int] = set()
        tried_d: set[int] = set()
        last: BaseException | None = None
        while True:
            p = self.prefill_policy(group.prefill, tried_p, call.prompt)
            if p is None:
                raise NoUpstream("prefill", call.model, last)
            pep = _endpoint(p, call.prompt)
            work = _prefill_work(call)
            d = self.decode_policy(group.decode, tried_d, call.prompt)
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
                        return failed.send(call.out, call.reply)  # the prefill engine's own error
                    if failed is not None:
                        raise failed
                resp = await decode
            finally:
                if not decode.done():
                    decode.cancel()
                elif resp is None and not decode.cancelled() and decode.exception() is None:
                    decode.result().close()  # answered, but the prefill failed first
            await self.engines.relay(call.out, resp, "decode", call.t0, call.reply, leg)
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
        leg = None if call.trace is None else call.trace.leg("prefill", ep)
        try:
            return await self.engines.call(ep, call.path_b, body, "prefill", leg=leg)
        finally:
            p.load -= work
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
        if sink is None:
            return
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
        try:
            return await self.engines.call(ep, path, body, role, timeout_s)
        finally:
            t.load -= tokens

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


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
    return with_fields(call.raw, call.req, {KV: kv}) if kv is not None else call.raw


def _prefill_failure(task: asyncio.Future[Answer]) -> BaseException | Answer | None:
    """What went wrong with a finished SGLang prefill leg: an exception, an error answer, or None."""
    if task.cancelled():
        return asyncio.CancelledError()
    exc = task.exception()
    if exc is not None:
        return exc
    answer = task.result()
    return answer if answer.status >= 400 else None
