"""Routing one inference request: vLLM hand-off, SGLang bootstrap, union and prefill-only
(docs/architecture.md, "The flow of a request").

Retries only happen before any byte reached the client: a prefill that cannot be reached is
retried on another prefill instance, a decode on another decode (the vLLM prefill's KV ticket is
kept: any decode can pull it) or, for SGLang, on another pair with a fresh room. When no instance
of a role can be reached the client gets 502 ``upstream_unreachable``; a leg that does not answer
in time, 504 ``upstream_timeout``. Client disconnect cancels the handler task (aiohttp
``handler_cancellation``), which closes every upstream connection still open, so both legs stop.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from services.common import log
from services.common.enums import PD_SGLANG, ROLE_NAMES
from services.common.http_errors import OpenAIError
from services.coordinator.bodies import KV, estimate_tokens, kv_params_of, prefill_body, with_fields
from services.coordinator.policies import Policy
from services.coordinator.precision.groups import Completed
from services.coordinator.routes import ModelRoutes, PdGroup, Target, Upstream
from services.coordinator.upstream import (
    DECODE_TIMEOUT,
    PREFILL_TIMEOUT,
    Answer,
    Engines,
    PhaseTimeout,
    Unreachable,
    discard,
)


@dataclass(slots=True)
class Call:
    """One client request, parsed once."""

    request: web.Request
    path: str  # "/v1/chat/completions" or "/v1/completions"
    raw: bytes
    req: dict[str, Any]
    model: str
    prompt_tokens: int  # load estimate of a prefill
    total_tokens: int  # load estimate of a decode / whole request


class NoUpstream(Exception):
    def __init__(self, role: str, model: str, last: BaseException | None) -> None:
        detail = f": {last}" if last else ""
        super().__init__(f"no {role} instance of model {model!r} could be reached{detail}")
        self.role = role


# Told (p, d, what was asked) of every request a group answered successfully: precision
# detection's sampler (p = 0 for an instance that served the whole request). It must return at once.
CompletedSink = Callable[[int, int, Completed], None]


class Router:
    def __init__(self, engines: Engines, prefill_policy: Policy, decode_policy: Policy) -> None:
        self.engines = engines
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.completed: CompletedSink | None = None
        self._background: set[asyncio.Task[Any]] = set()

    async def route(self, call: Call, routes: ModelRoutes) -> web.StreamResponse:
        metrics = self.engines.metrics
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
                return await self._whole(call, routes.union, self.decode_policy, "union")
            metrics.routed("prefill_only")
            return await self._whole(call, routes.prefill_only, self.prefill_policy, "prefill")
        except NoUpstream as exc:
            log.warn("no_upstream", role=exc.role, model=call.model, error=str(exc))
            raise OpenAIError(502, str(exc), "server_error", "upstream_unreachable") from None
        except PhaseTimeout as exc:
            log.warn("upstream_timeout", role=exc.role, model=call.model)
            raise OpenAIError(504, str(exc), "server_error", "upstream_timeout") from None

    # -- vLLM: prefill first, then decode with the prefill's kv_transfer_params ----------------

    async def _vllm(self, call: Call, group: PdGroup) -> web.StreamResponse:
        body = prefill_body(call.req)
        tried: set[int] = set()
        last: BaseException | None = None
        answer: Answer | None = None
        p_id = 0
        while answer is None:
            p = self.prefill_policy(group.prefill, tried)
            if p is None:
                raise NoUpstream("prefill", call.model, last)
            tried.add(p.id)
            p_id = p.id
            p.load += call.prompt_tokens
            try:
                answer = await self.engines.call(
                    p.pick_endpoint(), call.path, body, PREFILL_TIMEOUT, "prefill"
                )
            except Unreachable as exc:
                last = exc
            finally:
                p.load -= call.prompt_tokens
        if answer.status >= 400:
            return answer.response()  # the engine's own status and error body
        decode_body = _vllm_decode_body(call.raw, call.req, answer)
        return await self._whole(call, group.decode, self.decode_policy, "decode", decode_body, p_id)

    # -- whole request on one instance (decode leg, union, prefill-only degraded mode) --------

    async def _whole(
        self,
        call: Call,
        targets: Sequence[Target],
        policy: Policy,
        role: str,
        body: bytes | None = None,
        p_id: int = 0,
    ) -> web.StreamResponse:
        data = call.raw if body is None else body
        tried: set[int] = set()
        last: BaseException | None = None
        while True:
            t = policy(targets, tried)
            if t is None:
                raise NoUpstream(role, call.model, last)
            tried.add(t.id)
            t.load += call.total_tokens
            try:
                try:
                    resp = await self.engines.open(t.pick_endpoint(), call.path, data, DECODE_TIMEOUT, role)
                except Unreachable as exc:
                    last = exc
                    continue
                try:
                    out = await self.engines.relay(call.request, resp, role)
                finally:
                    _done_with(resp)
                if resp.status < 400 and out.status < 400:
                    self._completed(call, p_id, t.id)
                return out
            finally:
                t.load -= call.total_tokens

    # -- SGLang: both legs at once, matched by (bootstrap_host, bootstrap_port, room) ----------

    async def _sglang(self, call: Call, group: PdGroup) -> web.StreamResponse:
        tried_p: set[int] = set()
        tried_d: set[int] = set()
        last: BaseException | None = None
        while True:
            p = self.prefill_policy(group.prefill, tried_p)
            if p is None:
                raise NoUpstream("prefill", call.model, last)
            d = self.decode_policy(group.decode, tried_d)
            if d is None:
                raise NoUpstream("decode", call.model, last)
            try:
                return await self._sglang_pair(call, p, d)
            except Unreachable as exc:
                last = exc
                if exc.role == "prefill":
                    tried_p.add(p.id)
                else:
                    tried_d.add(d.id)

    async def _sglang_pair(self, call: Call, p: Target, d: Target) -> web.StreamResponse:
        pep = p.pick_endpoint()
        body = with_fields(call.raw, call.req, _bootstrap(pep))
        prefill = asyncio.create_task(self._sglang_prefill(call, p, pep, body))
        d.load += call.total_tokens
        resp: aiohttp.ClientResponse | None = None
        answered = False
        try:
            decode = asyncio.ensure_future(
                self.engines.open(d.pick_endpoint(), call.path, body, DECODE_TIMEOUT, "decode")
            )
            try:
                # Either leg failing before the decode answers cancels the other: no decode may
                # wait on a room that will never fill.
                done, _ = await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
                if prefill in done:
                    failed = _prefill_failure(prefill)
                    if isinstance(failed, Answer):
                        return failed.response()  # the prefill engine's own error
                    if failed is not None:
                        raise failed
                resp = await decode
            finally:
                if not decode.done():
                    decode.cancel()
                elif resp is None and not decode.cancelled() and decode.exception() is None:
                    _done_with(decode.result())  # answered, but the prefill failed first
            out = await self.engines.relay(call.request, resp, "decode")
            answered = resp.status < 400
            if answered and out.status < 400:
                self._completed(call, p.id, d.id)
            return out
        finally:
            d.load -= call.total_tokens
            if resp is not None:
                _done_with(resp)
            self._settle_prefill(prefill, answered)

    async def _sglang_prefill(self, call: Call, p: Target, ep: Upstream, body: bytes) -> Answer:
        p.load += call.prompt_tokens
        try:
            return await self.engines.call(ep, call.path, body, PREFILL_TIMEOUT, "prefill")
        finally:
            p.load -= call.prompt_tokens

    def _settle_prefill(self, prefill: asyncio.Task[Any], answered: bool) -> None:
        if answered and not prefill.done():
            # The decode has its KV: the prefill leg finishes on its own, off the client's path.
            self._keep(prefill)
        elif not prefill.done():
            prefill.cancel()
        elif not prefill.cancelled():
            prefill.exception()  # already acted on (or moot): mark it retrieved

    def _keep(self, task: asyncio.Task[Any]) -> None:
        """Let a leg finish on its own; close() still cancels it."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(discard)

    def _completed(self, call: Call, p: int, d: int) -> None:
        sink = self.completed
        if sink is None:
            return
        try:
            sink(p, d, Completed(call.path, call.model, call.req))
        except Exception:  # detection fails open: the client's answer is already made
            log.exception("precision_record_failed", p=p, d=d)

    # -- one request pinned to a pair, read whole, never relayed (precision samples) ---------

    async def exchange(
        self,
        path: str,
        raw: bytes,
        req: dict[str, Any],
        p: Target | None,
        d: Target,
        deadline: aiohttp.ClientTimeout,
    ) -> Answer:
        """Send ``req`` (``raw`` its bytes) to the pair (p, d) with the same hand-off a client's
        request gets (p None: d serves it whole), no retry on another instance, and return the
        decode's (or the prefill's error) answer. Raises Unreachable / PhaseTimeout."""
        prompt_tokens, total_tokens = estimate_tokens(req)
        if p is None:
            role = ROLE_NAMES.get(d.role, "decode")
            return await self._pinned(d, d.pick_endpoint(), total_tokens, path, raw, deadline, role)
        if p.protocol == PD_SGLANG:
            return await self._sglang_exchange(path, raw, req, p, d, deadline, prompt_tokens, total_tokens)
        pep = p.pick_endpoint()
        answer = await self._pinned(p, pep, prompt_tokens, path, prefill_body(req), deadline, "prefill")
        if answer.status >= 400:
            return answer
        body = _vllm_decode_body(raw, req, answer)
        return await self._pinned(d, d.pick_endpoint(), total_tokens, path, body, deadline, "decode")

    async def _pinned(
        self,
        t: Target,
        ep: Upstream,
        tokens: int,
        path: str,
        body: bytes,
        deadline: aiohttp.ClientTimeout,
        role: str,
    ) -> Answer:
        t.load += tokens  # the policies see this work like any other
        try:
            return await self.engines.call(ep, path, body, deadline, role)
        finally:
            t.load -= tokens

    async def _sglang_exchange(
        self,
        path: str,
        raw: bytes,
        req: dict[str, Any],
        p: Target,
        d: Target,
        deadline: aiohttp.ClientTimeout,
        prompt_tokens: int,
        total_tokens: int,
    ) -> Answer:
        pep = p.pick_endpoint()
        body = with_fields(raw, req, _bootstrap(pep))
        prefill = asyncio.ensure_future(self._pinned(p, pep, prompt_tokens, path, body, deadline, "prefill"))
        decode = asyncio.ensure_future(
            self._pinned(d, d.pick_endpoint(), total_tokens, path, body, deadline, "decode")
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

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _done_with(resp: aiohttp.ClientResponse) -> None:
    """Back to the pool when fully read; otherwise close, so the engine sees the client leave."""
    if resp.content.at_eof():
        resp.release()
    else:
        resp.close()


def _room() -> int:
    return random.getrandbits(63)


def _bootstrap(pep: Upstream) -> dict[str, Any]:
    """The SGLang rendezvous both legs carry: the prefill endpoint's bootstrap server, a new room."""
    return {"bootstrap_host": pep.host, "bootstrap_port": pep.bootstrap_port, "bootstrap_room": _room()}


def _vllm_decode_body(raw: bytes, req: dict[str, Any], prefill: Answer) -> bytes:
    """The vLLM decode leg: the request with the prefill's kv_transfer_params spliced in."""
    kv = kv_params_of(prefill.body)
    return with_fields(raw, req, {KV: kv}) if kv is not None else raw


def _prefill_failure(task: asyncio.Task[Answer]) -> BaseException | Answer | None:
    """What went wrong with a finished SGLang prefill leg: an exception, an error answer, or None."""
    if task.cancelled():
        return asyncio.CancelledError()
    exc = task.exception()
    if exc is not None:
        return exc
    answer = task.result()
    return answer if answer.status >= 400 else None
