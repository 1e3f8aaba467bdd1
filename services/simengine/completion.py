"""The completion routes (/v1/chat/completions, /v1/completions): admission, PD legs, latency.

With every latency at zero this path is the benchmark floor, so it is kept short. Benchmarks
send one body over and over, and a request is a pure function of its body apart from a few
per-request values: its *plan* (the parsed request, its token counts and the whole answer
serialized once, split around the per-request id and timestamp) is kept and reused, so a repeat
is one lookup, one join and one write; no sleep, timer or task is made when nothing has to wait.
The plan also keeps the prompt's block hashes: only the prefill time depends on the prefix
cache, and it is worked out per request from the cache's state (prefix_cache.py).

Plain requests are kept by their body bytes. PD legs differ from one request to the next only in
their hand-off field (`kv_transfer_params` with its ticket, or `bootstrap_room`), so they are kept
by the body with that field's value cut out (found by a text search, the value read by the JSON
scanner itself): the leg's per-request parts (the ticket to redeem, the room, a fresh ticket in a
prefill's answer) are taken or spliced in every time, the rest is the plan's. A cut is trusted
only once a body with a marker in its place has been parsed to the marker (so the field is the
object's real top-level key); anything unusual takes the full path. A leg whose
`kv_transfer_params` carry `prompt_token_ids` (its prompt, as ids) is kept by those ids too,
re-encoded by orjson (exact: `1.0` or `true` is not `1`). Faulted requests are planned afresh
every time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from motor_mesh.common import log
from motor_mesh.common.http_errors import invalid_request, model_not_found, server_error
from motor_mesh.common.httpclient import Pool
from motor_mesh.common.httpmessages import Request, Responder
from motor_mesh.simengine import pd
from motor_mesh.simengine.faults import DIE, DIE_NOW, SEND, SEND_THEN_DIE
from motor_mesh.simengine.generation import (
    Generated,
    Token,
    choice_salt,
    context_state,
    continue_context,
    unanswered,
)
from motor_mesh.simengine.openai_api import (
    Bootstrap,
    ParsedRequest,
    RequestError,
    full_response,
    parse_request,
    stream_chunks,
)
from motor_mesh.simengine.prefix_cache import Chain
from motor_mesh.simengine.tokens import answer_tokens, output_vocab, prompt_ids, text_prompt_ids, vocab_size

if TYPE_CHECKING:  # the Engine (app.py) calls in here; tracing.py loads only when tracing is on
    from motor_mesh.simengine.app import Engine
    from motor_mesh.simengine.tracing import EngineTracer, Served

SSE_CT = b"text/event-stream"
SSE_HEADERS = [("Cache-Control", "no-cache")]
# Plans kept per route: bounded in count and bytes (request + answer) so that a load of
# distinct prompts only churns the cache. Larger bodies are not even looked up (hashing a
# body of megabytes costs more than planning it).
PLANS_MAX = 1024
PLANS_MAX_BYTES = 32 * 1024 * 1024
PLAN_MAX_BODY = 16 * 1024
PLAN_MAX_BYTES = 256 * 1024
ANSWERS_MAX = 4096
# What cached answers are rendered with, then split out again. The split is on the whole
# `{"id":"<rid>","object":...,"created":<t>,` head: a JSON string cannot contain that (its
# quotes would be escaped), so only the real heads of the answer's objects match.
_RID = "motor-sim-rid-placeholder"
_CREATED = 4102444800
# A vLLM prefill's answer is rendered with this in place of its ticket, then split around it:
# a control character is always escaped in JSON, so the text cannot come from anything else.
_HOLE = "\x00motor-sim-ticket"
_HOLE_JSON = b'"\\u0000motor-sim-ticket"'
_MARK = "\x00motor-sim-cut"
_MARK_JSON = '"\\u0000motor-sim-cut"'
# The hand-off fields a PD leg's plan is cut around, as they appear in the body.
_KV = "kv_transfer_params"
_IDS = "prompt_token_ids"  # in kv_transfer_params: the prompt as ids, part of a leg's plan
_ROOM = "bootstrap_room"
_KV_Q = '"kv_transfer_params"'
_ROOM_Q = '"bootstrap_room"'
_KV_B = _KV_Q.encode()
_ROOM_B = _ROOM_Q.encode()
_WS = " \t\n\r"  # JSON's whitespace
# json.loads' own value scanner: (value, end) of the JSON value at an index (StopIteration if none).
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


async def hang() -> None:
    await asyncio.Event().wait()


@dataclass(slots=True, eq=False)
class Template:
    """A reusable plan's whole answer: `head` is a %-format of (rid, created) and the answer is
    `head.join(left)`, or for a vLLM prefill `head.join(left) + ticket + head.join(right)`."""

    head: bytes
    left: list[bytes]
    right: list[bytes] | None
    size: int

    def render(self, rid: bytes, created: int, ticket: bytes | None) -> bytes:
        head = self.head % (rid, created)
        if self.right is None:
            return head.join(self.left)
        return head.join(self.left) + (ticket or b"null") + head.join(self.right)


@dataclass(slots=True, eq=False)
class Plan:
    req: ParsedRequest
    model: str
    side: str | None  # "prefill" | "decode" for a PD leg
    proto: str | None  # "vllm" | "sglang" for a PD leg
    n_tokens: int
    prompt_tokens: int
    gens: list[Generated]
    first_s: float  # with nothing cached
    decode_s: float
    gen_tokens: int
    chains: tuple[Chain, ...]  # each prompt's blocks (none without a prefix cache)
    prompt_ids: list[list[int]]  # each prompt's token ids (what `return_token_ids` shows)
    template: Template | None = None
    last_body: bytes | None = None  # a vLLM prefill leg's: the body it was last found by


def _template(blob: bytes, hole: bool) -> Template | None:
    start = blob.find(b'{"id":"' + _RID.encode() + b'"')
    created = b'"created":%d,' % _CREATED
    end = blob.find(created, start) + len(created)
    if start < 0 or end < len(created):  # not the layout this expects: render every answer
        return None
    head = blob[start:end]
    fmt = head.replace(b"%", b"%%").replace(_RID.encode(), b"%s").replace(b"%d" % _CREATED, b"%d")
    parts = blob.split(head)
    size = sum(map(len, parts))
    if not hole:
        return Template(fmt, parts, None, size)
    if blob.count(_HOLE_JSON) != 1:
        return None
    k = next(i for i, p in enumerate(parts) if _HOLE_JSON in p)
    before, after = parts[k].split(_HOLE_JSON)
    return Template(fmt, [*parts[:k], before], [after, *parts[k + 1 :]], size)


class Plans:
    """Reusable plans by key, oldest evicted first."""

    def __init__(self) -> None:
        self._plans: dict[Hashable, tuple[Plan, int]] = {}
        self._bytes = 0

    def get(self, key: Hashable) -> Plan | None:
        hit = self._plans.get(key)
        return hit[0] if hit is not None else None

    def put(self, key: Hashable, key_bytes: int, plan: Plan) -> None:
        if plan.template is None or key_bytes > PLAN_MAX_BODY or key in self._plans:
            return
        size = key_bytes + plan.template.size
        if size > PLAN_MAX_BYTES:
            return
        while self._plans and (len(self._plans) >= PLANS_MAX or self._bytes + size > PLANS_MAX_BYTES):
            _, old = self._plans.pop(next(iter(self._plans)))  # dicts keep insertion order
            self._bytes -= old
        self._plans[key] = (plan, size)
        self._bytes += size


@dataclass(slots=True)
class Cut:
    """A body with one hand-off field's value taken out: `text[:start] + value + text[end:]`."""

    field: str  # "kv_transfer_params" | "bootstrap_room"
    text: str
    name_at: int  # where the quoted field name starts
    start: int
    end: int
    value: Any

    def key(self, kind: str) -> tuple[str, str, str, str]:
        text = self.text
        return (self.field, kind, text[: self.name_at], text[self.end :])

    def verified(self) -> bool:
        """Whether the cut value is what a JSON parser takes as the body's top-level field (not a
        look-alike in a string or a nested object, nor one that a later duplicate overrides)."""
        text = self.text
        marked = text[: self.start] + _MARK_JSON + text[self.end :]
        try:
            obj = json.loads(marked.encode("utf-8", "surrogatepass"))
        except (ValueError, RecursionError):
            return False
        return isinstance(obj, dict) and obj.get(self.field) == _MARK


def cut_handoff(body: bytes) -> Cut | None:
    """The body's one hand-off field (kv_transfer_params or bootstrap_room) cut out, when it has
    exactly one of them, spelled once, whose value scans as JSON; else None."""
    has_kv = _KV_B in body
    if has_kv == (_ROOM_B in body):  # neither (a plain request), or both (planned in full)
        return None
    try:
        text = body.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    field, quoted = (_KV, _KV_Q) if has_kv else (_ROOM, _ROOM_Q)
    at = text.find(quoted)
    if at < 0 or text.find(quoted, at + 1) >= 0:
        return None
    i = at + len(quoted)
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    if i >= n or text[i] != ":":
        return None
    i += 1
    while i < n and text[i] in _WS:
        i += 1
    if text.startswith("{", i):
        # An object (kv_transfer_params) without nested objects ends at the first "}": orjson
        # reads that much at a third of the cost. Whatever it refuses goes to json's scanner.
        close = text.find("}", i) + 1
        try:
            return Cut(field, text, at, i, close, orjson.loads(text[i:close]))
        except ValueError:  # orjson.JSONDecodeError, or a str that is not UTF-8
            pass
    try:
        value, end = _scan(text, i)
    except (StopIteration, ValueError, RecursionError):
        return None
    return Cut(field, text, at, i, end, value)


def _kv_side(kv: Any) -> str | None:
    """The vLLM leg a valid kv_transfer_params makes (as Completions._leg decides), else None."""
    if not isinstance(kv, dict) or not kv:
        return None
    if kv.get("do_remote_decode") is True:
        return None if kv.get("do_remote_prefill") is True else "prefill"  # both: a 400, in full
    if kv.get("do_remote_prefill") is True:
        return "decode"
    return None


class Completions:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.faults = engine.faults
        self.slots = engine.slots
        self.latency = engine.latency
        self.metrics = engine.metrics
        self.tpot_s = engine.latency.tpot_s
        self.tpot_s_per_seq = engine.latency.tpot_s_per_seq  # > 0: the interval follows the batch
        # Streams sleep between tokens: a kept plan's whole answer would never be used.
        self.paced = self.tpot_s > 0 or self.tpot_s_per_seq > 0
        self.compute = engine.compute  # --prefill-compute serial: one prefill at a time
        self.vocab = output_vocab(engine.tokenizer)
        self.vocab_size = vocab_size(engine.tokenizer)
        self._answers: dict[str, tuple[Token, ...]] = {}  # known answers as this tokenizer spells them
        self._plans = (Plans(), Plans())  # [chat]: plain requests, by body
        self._legs = (Plans(), Plans())  # [chat]: PD legs, by Cut.key
        self.leg_hits = 0  # PD legs served from a kept plan (tests look)
        self._pool: Pool | None = None
        self.tracer: EngineTracer | None = None  # set when tracing is on
        self._ids = itertools.count(1)
        prefix = uuid.uuid4().hex[:8]
        self._rid_prefix = (f"cmpl-{prefix}".encode(), f"chatcmpl-{prefix}".encode())  # [chat]

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    async def handle(
        self, chat: bool, request: Request, out: Responder, served: Served | None = None
    ) -> None:
        """``served``: filled in for the tracer, which calls this again with one."""
        if served is None:
            self.metrics.requests += 1
            if b"traceparent" in request.headers:
                self.metrics.traceparents += 1
            if self.tracer is not None:
                return await self.tracer.serve(self.handle, chat, request, out)
        faults = self.faults
        fault = None
        if faults.mode != "none":
            fault = faults.on_completion()
            if fault is not None:
                self.metrics.faults[fault] = self.metrics.faults.get(fault, 0) + 1
                if fault in ("hang", "crash"):
                    await hang()
                if fault == "error":
                    raise server_error(faults.status, "injected fault", faults.status)
        body = request.body
        plan: Plan | None = None
        cut: Cut | None = None
        key: tuple[Any, ...] | None = None
        kv: Any = None  # this request's kv_transfer_params, for a vLLM decode leg
        rooms: list[Bootstrap] = []  # this request's rooms, for an SGLang leg
        if fault is None and len(body) <= PLAN_MAX_BODY:
            plan = self._plans[chat].get(body)
            if plan is not None:
                if plan.side is not None:  # a vLLM prefill leg kept whole
                    self.leg_hits += 1
            else:
                cut = cut_handoff(body)
                if cut is not None:
                    kind = _kv_side(cut.value) if cut.field == _KV else "room"
                    if kind is not None and (kind != "room" or type(cut.value) is int):
                        key = cut.key(kind)
                        if kind != "room" and cut.value.get(_IDS) is not None:
                            key = (*key, orjson.dumps(cut.value[_IDS]))
                        plan = self._legs[chat].get(key)
                        if plan is not None:
                            self.leg_hits += 1
                            if plan.proto == "sglang":
                                b = plan.req.bootstrap[0]
                                rooms = [Bootstrap(b.host, b.port, cut.value)]
                            elif plan.side == "decode":
                                kv = cut.value
                            elif plan.last_body == body:
                                # A prefill leg's kv_transfer_params only says "prefill": a body
                                # that keeps coming back whole is then kept whole (no cut).
                                self._plans[chat].put(body, len(body), plan)
                            else:
                                plan.last_body = body
        if plan is None:
            plan = self._plan(body, chat, fault)
            kv, rooms = plan.req.kv_params, plan.req.bootstrap
            if fault is None and (not plan.req.stream or not self.paced):
                self._keep(plan, chat, body, cut, key)
        if fault == "disconnect" and not plan.req.stream:
            out.abort()  # before any byte of the answer
            return
        if (
            plan.side == "decode"
            and plan.proto == "sglang"
            and any(b.host is None or b.port is None for b in rooms)
        ):
            raise invalid_request("a decode leg needs bootstrap_host and bootstrap_port")
        arrived = self.engine.loop.time()  # TTFT includes the wait for a slot
        slots = self.slots
        if not slots.try_acquire():
            await slots.acquire()
        if served is not None:
            served.queued_s = self.engine.loop.time() - arrived
        try:
            await self._serve(out, plan, fault, arrived, kv, rooms, served)
        finally:
            slots.release()

    def _keep(
        self, plan: Plan, chat: bool, body: bytes, cut: Cut | None, key: tuple[Any, ...] | None
    ) -> None:
        """Keep a fresh plan for the requests that repeat it: a plain one by its body, a PD leg
        by its cut body when the cut is sure to be the leg's only per-request part."""
        if plan.side is None:
            plan.template = _template(self._render(plan, _RID, _CREATED, None), False)
            self._plans[chat].put(body, len(body), plan)
            return
        if cut is None or key is None:
            return
        if plan.proto == "sglang":
            if cut.field != _ROOM or len(plan.req.bootstrap) != 1:
                return
            b = plan.req.bootstrap[0]
            if plan.side == "decode" and (b.host is None or b.port is None):
                return
        elif cut.field != _KV or key[1] != plan.side:
            return
        if not cut.verified():
            return
        hole = plan.side == "prefill" and plan.proto == "vllm"
        extra = {_KV: _HOLE} if hole else None
        plan.template = _template(self._render(plan, _RID, _CREATED, extra), hole)
        self._legs[chat].put(key, len(body), plan)

    def _plan(self, body: bytes, chat: bool, fault: str | None) -> Plan:
        try:
            req = parse_request(json.loads(body), chat, self.engine.tokenizer)
        except RequestError as exc:
            raise invalid_request(str(exc), "invalid_request", exc.param) from None
        except ValueError as exc:
            raise invalid_request(f"invalid JSON body: {exc}", "invalid_json") from None
        engine = self.engine
        if req.model is not None and req.model not in engine.accepted:
            raise model_not_found(req.model)
        side, proto = self._leg(req)
        chains: tuple[Chain, ...] = ()
        cache = engine.prefix
        # Every prompt's ids: the context the answer is generated from (generation.py).
        try:
            ids = prompt_ids(engine.tokenizer, req)
        except (TypeError, ValueError) as exc:  # a Rust tokenizer refuses lone surrogates
            raise invalid_request(f"the prompt cannot be tokenized: {exc}", "invalid_prompt") from None
        if req.token_prompts is not None:
            self._check_ids(ids, req.ids_param)
        elif engine.counts_tokens:
            # (The built-in tokenizer's counts stay the whitespace words they always were: the
            # same but for an empty prompt, counted as 1.)
            req.prompt_tokens = [len(i) for i in ids]
        self._fit_context(req)
        n_tokens = 1 if side == "prefill" else req.max_tokens
        if cache is not None:
            chains = tuple(map(cache.chain, ids))
        prompt_tokens = sum(req.prompt_tokens)
        gens = self._generate(req, ids, n_tokens, garbled=fault == "precision")
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
            sum(len(g.ids) for g in gens),
            chains,
            ids,
        )

    def _fit_context(self, req: ParsedRequest) -> None:
        """vLLM's context check, on each prompt's token count: a prompt of ``--max-model-len``
        tokens or more, or a ``max_tokens`` that would run past the context, is a 400 before
        anything is computed (in vLLM's words); a ``max_tokens`` not given is cut to what the
        context leaves."""
        limit = self.cfg.max_model_len
        longest = max(req.prompt_tokens, default=0)
        if longest >= limit:
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{longest} input tokens. Please reduce the length of the input messages.",
                "invalid_request",
            )
        room = limit - longest
        if not req.max_tokens_given:
            req.max_tokens = min(req.max_tokens, room)
        elif req.max_tokens > room:
            raise invalid_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {req.max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has {longest} "
                f"input tokens ({req.max_tokens} > {limit} - {longest}).",
                "invalid_request",
            )

    def _check_ids(self, ids: list[list[int]], param: str | None) -> None:
        """Given ids must be in the vocabulary, as vLLM's renderer checks them (a 400)."""
        limit = self.vocab_size
        for one in ids:
            if not one:
                continue
            low, high = min(one), max(one)
            if low < 0:
                raise invalid_request(f"Token id {low} is out of vocabulary", "invalid_prompt", param)
            if limit is not None and high >= limit:
                raise invalid_request(f"Token id {high} is out of vocabulary", "invalid_prompt", param)

    def _leg(self, req: ParsedRequest) -> tuple[str | None, str | None]:
        kv = req.kv_params
        if kv:
            if kv.get("do_remote_decode") is True:
                return "prefill", "vllm"
            if kv.get("do_remote_prefill") is True:
                return "decode", "vllm"
        fake = all(b.host == pd.FAKE_BOOTSTRAP_HOST for b in req.bootstrap)
        if req.bootstrap and self.cfg.role != "union" and not fake:
            return self.cfg.role, "sglang"
        return None, None

    def _generate(
        self, req: ParsedRequest, ids: list[list[int]], n_tokens: int, garbled: bool
    ) -> list[Generated]:
        """Each prompt's ``n`` choices, generated from its ids (generation.py)."""
        gens = []
        seed, vocab, top_k = self.cfg.seed, self.vocab, req.top_k
        for p, context in enumerate(ids):
            forced = self._answer(req, p, context)
            state, length = context_state(context), len(context)
            for j in range(req.n):
                salt = choice_salt(seed, j)
                gens.append(continue_context(vocab, state, length, n_tokens, salt, forced, top_k, garbled))
        return gens

    def _answer(self, req: ParsedRequest, p: int, context: list[int]) -> tuple[Token, ...]:
        """The known answer prompt ``p`` begins with, as tokens (none: its tokens all come from
        the context). Its question is read from text: a completion given as ids has none. A chat
        given as ids (`kv_transfer_params.prompt_token_ids`) gets it, or what is left of it, only
        when the ids are its messages' prompt, or that and the answer's first tokens: a resent
        prompt continues the answer its messages began."""
        if req.chat:
            question = req.question
        else:
            question = req.prompts[p] if req.token_prompts is None else None
        answer = unanswered(question) if question is not None else None
        if answer is None:
            return ()
        tok = self.engine.tokenizer
        tokens = self._answers.get(answer)
        if tokens is None:
            if len(self._answers) >= ANSWERS_MAX:
                self._answers.clear()
            tokens = self._answers[answer] = answer_tokens(tok, answer)
        if req.token_prompts is None:
            return tokens
        try:
            base = text_prompt_ids(tok, req)
        except (TypeError, ValueError):
            return ()
        done = context[len(base) :]
        if context[: len(base)] != base or len(done) >= len(tokens):
            return ()
        if [i for _, i in tokens[: len(done)]] != done:
            return ()
        return tokens[len(done) :]

    async def _serve(
        self,
        out: Responder,
        plan: Plan,
        fault: str | None,
        arrived: float,
        kv: Any,
        rooms: list[Bootstrap],
        served: Served | None,
    ) -> None:
        engine, m, side = self.engine, self.metrics, plan.side
        if side == "decode":
            if plan.proto == "sglang":
                try:
                    await self._await_rooms(rooms)
                except pd.RoomTimeout as exc:
                    m.bootstrap_timeouts += 1
                    log.warn("bootstrap_timeout", rooms=[b.room for b in rooms])
                    raise server_error(504, str(exc), "bootstrap_timeout") from None
            else:
                known = engine.tickets.redeem((kv or {}).get("remote_request_id"))
                m.tickets["known" if known else "unknown"] += 1
        first_s = plan.first_s
        compute = self.compute if side != "decode" and first_s > 0 else None
        if compute is not None:
            # --prefill-compute serial: wait for the one compute, in arrival order (the prefix
            # cache is looked up once it is ours: a prefill done meanwhile may have filled it).
            if not compute.try_acquire():
                waited_from = engine.loop.time()
                await compute.acquire()
                if served is not None:
                    served.queued_s += engine.loop.time() - waited_from
        try:
            cache = engine.prefix
            if cache is not None and side != "decode":  # a decode leg's KV comes by transfer
                hit = cache.hit_tokens(plan.chains)
                m.prefix_queries += plan.prompt_tokens
                if hit:
                    m.prefix_hits += hit
                    first_s = self.latency.first_token_s(plan.prompt_tokens - hit, kv_transfer=False)
            if first_s > 0:
                await asyncio.sleep(first_s)
            if cache is not None:
                cache.store(plan.chains)
        finally:
            if compute is not None:
                compute.release()
        ticket: bytes | None = None
        if side == "prefill":
            if plan.proto == "vllm":
                ticket = engine.ticket_json(plan.prompt_tokens)
            elif engine.rendezvous is not None:
                for b in rooms:
                    engine.rendezvous.register_prefill(b.room, plan.prompt_tokens)
        first_token_s = engine.loop.time() - arrived
        m.ttft.observe(first_token_s)
        if side is not None and plan.proto is not None:
            m.legs[(side, plan.proto)] += 1
        rid = b"%s%x" % (self._rid_prefix[plan.req.chat], next(self._ids))
        if served is not None:
            served.answered(plan, rid, first_token_s)
        created = int(time.time())
        interval = self.tpot_s  # the mean interval between this answer's tokens
        try:
            if plan.req.stream:
                streamed = await self._stream(out, plan, rid, created, ticket, fault)
                if streamed is None:
                    return  # died (die_after_tokens, with a stand-in for the SIGKILL)
                if self.tpot_s_per_seq > 0:
                    interval = streamed
            else:
                decode_s = plan.decode_s
                if self.tpot_s_per_seq > 0:  # the batch as the decode starts sets its pace
                    interval = self.latency.token_interval_s(engine.running)
                    decode_s = interval * max(0, plan.n_tokens - 1)
                if decode_s > 0:
                    await asyncio.sleep(decode_s)
                body = self._body(plan, rid, created, ticket)
                verdict = self.faults.send_tokens(plan.gen_tokens) if self.faults.mode == DIE else SEND
                if verdict == DIE_NOW:  # died generating it: nothing goes out
                    self._die(out)
                    return
                out.send(200, body)
                if verdict == SEND_THEN_DIE:
                    self._die(out)
                    return
        except ConnectionResetError:
            # The client went away: what vLLM counts as an aborted request.
            m.success["abort"] += 1
            out.abort()
            return
        except asyncio.CancelledError:
            m.success["abort"] += 1  # the same, noticed by the server first
            raise
        if plan.n_tokens > 1:
            m.tpot.observe(interval)
        m.e2e.observe(engine.loop.time() - arrived)
        m.success["length"] += 1
        m.prompt_tokens += plan.prompt_tokens
        m.generation_tokens += plan.gen_tokens
        if served is not None:
            served.finish = "length"

    def _render(self, plan: Plan, rid: str, created: int, extra: dict[str, Any] | None) -> bytes:
        """The whole answer: the JSON body, or every SSE event of a stream."""
        req, ids, gens = plan.req, plan.prompt_ids, plan.gens
        if req.stream:
            prelude, steps, tail = stream_chunks(req, rid, created, plan.model, gens, "length", extra, ids)
            return prelude + b"".join(steps) + tail
        return full_response(req, rid, created, plan.model, gens, "length", extra, ids)

    def _die(self, out: Responder) -> None:
        """die_after_tokens is due: the process SIGKILLs itself. Only a stand-in (an engine in a
        test process) returns here: the connection is then cut as the crash would cut it."""
        self.faults.on_die()
        out.abort()

    def _body(self, plan: Plan, rid: bytes, created: int, ticket: bytes | None) -> bytes:
        if plan.template is not None:
            return plan.template.render(rid, created, ticket)
        return self._render(plan, rid.decode(), created, _extra(ticket))

    async def _stream(
        self,
        out: Responder,
        plan: Plan,
        rid: bytes,
        created: int,
        ticket: bytes | None,
        fault: str | None,
    ) -> float | None:
        """Send the stream; None when the engine died in it (die_after_tokens), else the mean
        interval slept between its tokens."""
        tpot = self.tpot_s
        per_seq = self.tpot_s_per_seq
        faults = self.faults
        out.start(200, SSE_CT, SSE_HEADERS)
        if not self.paced and fault != "disconnect" and faults.mode != DIE:
            # Nothing to pace: every event in one chunk (the head goes out with it).
            out.end(self._body(plan, rid, created, ticket))  # head, events and end: one write
            return 0.0
        # Token by token: paced, or a fault that needs to know how far the stream got.
        prelude, steps, tail = stream_chunks(
            plan.req, rid.decode(), created, plan.model, plan.gens, "length", _extra(ticket), plan.prompt_ids
        )
        per_step = len(plan.gens)  # tokens per event: one per choice
        slept = 0.0
        for i, step in enumerate(steps):
            if i:
                # --tpot-ms-per-seq: the batch as this token is due sets its interval.
                delay = self.latency.token_interval_s(self.engine.running) if per_seq > 0 else tpot
                if delay > 0:
                    slept += delay
                    await asyncio.sleep(delay)
                if faults.hanging():
                    await hang()
            verdict = faults.send_tokens(per_step) if faults.mode == DIE else SEND
            if verdict == DIE_NOW:
                self._die(out)
                return None
            await out.write(prelude + step if i == 0 else step)
            if verdict == SEND_THEN_DIE:
                self._die(out)
                return None
            if fault == "disconnect":
                out.abort()  # after one write (for chat: the role delta and the first token)
                return 0.0
        out.end(tail)
        return slept / (len(steps) - 1) if len(steps) > 1 else 0.0

    async def _await_rooms(self, rooms: list[Bootstrap]) -> None:
        if self._pool is None:
            self._pool = Pool(connect_timeout_s=pd.CONNECT_TIMEOUT_S)
        pool = self._pool
        timeout = self.cfg.bootstrap_timeout_s
        if len(rooms) == 1:
            b = rooms[0]
            await pd.wait_for_room(pool, str(b.host), int(b.port or 0), b.room, timeout)
            return
        await asyncio.gather(
            *(pd.wait_for_room(pool, str(b.host), int(b.port or 0), b.room, timeout) for b in rooms)
        )


def _extra(ticket: bytes | None) -> dict[str, Any] | None:
    """A prefill's ticket as the answer's extra field, for answers rendered in full."""
    return None if ticket is None else {_KV: json.loads(ticket)}
