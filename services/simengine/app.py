"""HTTP surface of the simulated engine (business port)."""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import os
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from services.common import log
from services.common.http_errors import JSON_CT, OpenAIError, error_middleware, model_not_found
from services.simengine import pd
from services.simengine.config import EngineConfig
from services.simengine.faults import FaultError, FaultState, parse_fault_body
from services.simengine.generation import Generated, generate, known_answer, seed_of
from services.simengine.latency import LatencyModel, Slots, pause
from services.simengine.metrics import Metrics
from services.simengine.openai_api import (
    MAX_MODEL_LEN,
    ParsedRequest,
    RequestError,
    full_response,
    parse_request,
    stream_chunks,
)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
MAX_BODY_BYTES = 64 * 1024 * 1024
# Nominal KV capacity in sequences when --max-num-seqs is unlimited (only shapes the gauge).
NOMINAL_CAPACITY = 256


async def _hang() -> None:
    await asyncio.Event().wait()


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.model_id = cfg.model_id
        self.accepted = cfg.accepted_models
        self.latency = LatencyModel(cfg)
        self.slots = Slots(cfg.max_num_seqs)
        self.faults = FaultState(self.crash, cfg.fault_status)
        self.tickets = pd.TicketStore()
        self.rendezvous = pd.Rendezvous(cfg.engine_id) if cfg.sglang and cfg.role == "prefill" else None
        self.metrics = Metrics(self.model_id, self._gauges)
        self.ready_at = time.monotonic() + cfg.startup_s
        self.advertised_host = os.environ.get("VLLM_HOST_IP") or (
            cfg.host if cfg.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        )
        self.port = cfg.port
        self._session: aiohttp.ClientSession | None = None
        self._ids = itertools.count(1)
        self._id_prefix = uuid.uuid4().hex[:8]
        created = int(time.time())
        self._models_body = json.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": created,
                        "owned_by": "motor-sim",
                        "root": self.model_id,
                        "parent": None,
                        "max_model_len": MAX_MODEL_LEN,
                    }
                    for name in cfg.model_ids
                ],
            }
        ).encode()

    # -- lifecycle -------------------------------------------------------------------------

    def crash(self) -> None:
        log.error("fault_crash", mode="crash", requests=self.faults.requests)
        # A few ms late so an answer already on its way (POST /sim/fault) still leaves.
        asyncio.get_running_loop().call_later(0.02, os._exit, 1)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _gauges(self) -> tuple[int, int, float]:
        running, waiting = self.slots.running, self.slots.waiting
        capacity = self.cfg.max_num_seqs or NOMINAL_CAPACITY
        return running, waiting, min(1.0, running / capacity)

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[error_middleware])
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/metrics", self.prom)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/version", self.version)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/sim/fault", self.get_fault)
        r.add_post("/sim/fault", self.post_fault)
        return app

    # -- small routes ----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.faults.mode != "none":
            if self.faults.hanging():
                await _hang()
            if self.faults.mode == "unhealthy" and self.faults.is_active():
                return web.Response(status=503, text="unhealthy")
        if self.cfg.startup_s and time.monotonic() < self.ready_at:
            return web.Response(status=503, text="starting")
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        if self.faults.hanging():
            await _hang()
        return web.Response(body=self._models_body, content_type=JSON_CT)

    async def prom(self, request: web.Request) -> web.Response:
        if self.faults.hanging():
            await _hang()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def model_info(self, request: web.Request) -> web.Response:
        if self.faults.hanging():
            await _hang()
        return web.json_response(
            {"model_path": self.model_id, "tokenizer_path": self.model_id, "is_generation": True}
        )

    async def server_info(self, request: web.Request) -> web.Response:
        if self.faults.hanging():
            await _hang()
        cfg = self.cfg
        return web.json_response(
            {
                "model_path": self.model_id,
                "served_model_name": self.model_id,
                "tp_size": cfg.tp,
                "dp_size": cfg.dp,
                "disaggregation_mode": cfg.role if cfg.role != "union" else "null",
                "disaggregation_bootstrap_port": cfg.bootstrap_port if self.rendezvous else None,
                "max_running_requests": cfg.max_num_seqs or None,
                "protocol": cfg.protocol,
                "engine_id": cfg.engine_id,
            }
        )

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "motor-sim"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # SGLang routers call this on every worker; there is no cache to flush.
        return web.Response(text="Cache flushed.")

    # -- fault control ---------------------------------------------------------------------

    @staticmethod
    def _loopback(request: web.Request) -> bool:
        host = request.remote
        if not host:
            return False
        try:
            ip = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return ip.ipv4_mapped.is_loopback
        return ip.is_loopback

    def _check_loopback(self, request: web.Request) -> None:
        if not self._loopback(request):
            raise OpenAIError(403, "/sim routes answer loopback clients only", "permission_error")

    async def get_fault(self, request: web.Request) -> web.Response:
        self._check_loopback(request)
        if self.faults.hanging():
            await _hang()
        return web.json_response(self.faults.snapshot())

    async def post_fault(self, request: web.Request) -> web.Response:
        self._check_loopback(request)
        if self.faults.hanging():
            await _hang()
        try:
            mode, after_requests, after_s, status = parse_fault_body(json.loads(await request.read()))
        except ValueError as exc:  # FaultError and JSONDecodeError alike
            msg = str(exc) if isinstance(exc, FaultError) else f"invalid JSON: {exc}"
            raise OpenAIError(400, msg, "invalid_request_error") from None
        self.faults.arm(mode, after_requests, after_s, status)
        log.event("fault_armed", mode=mode, after_requests=after_requests, after_s=after_s)
        return web.json_response(self.faults.snapshot())

    # -- completions -----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, chat=False)

    async def _completion(self, request: web.Request, chat: bool) -> web.StreamResponse:
        fault = self.faults.on_completion() if self.faults.mode != "none" else None
        if fault is not None:
            self.metrics.faults[fault] = self.metrics.faults.get(fault, 0) + 1
            if fault in ("hang", "crash"):
                await _hang()
            if fault == "error":
                raise OpenAIError(self.faults.status, "injected fault", "server_error", self.faults.status)
        try:
            req = parse_request(json.loads(await request.read()), chat)
        except RequestError as exc:
            raise OpenAIError(400, str(exc), "invalid_request_error", "invalid_request", exc.param) from None
        except ValueError as exc:
            raise OpenAIError(
                400, f"invalid JSON body: {exc}", "invalid_request_error", "invalid_json"
            ) from None
        if req.model is not None and req.model not in self.accepted:
            raise model_not_found(req.model)
        if fault == "disconnect" and not req.stream:
            _drop(request)
            return web.Response()
        side, proto = self._leg(req)
        if (
            side == "decode"
            and proto == "sglang"
            and any(b.host is None or b.port is None for b in req.bootstrap)
        ):
            raise OpenAIError(
                400, "a decode leg needs bootstrap_host and bootstrap_port", "invalid_request_error"
            )
        arrived = asyncio.get_running_loop().time()  # TTFT includes the wait for a slot
        await self.slots.acquire()
        try:
            return await self._serve(request, req, fault, side, proto, arrived)
        finally:
            self.slots.release()

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

    async def _serve(
        self,
        request: web.Request,
        req: ParsedRequest,
        fault: str | None,
        side: str | None,
        proto: str | None,
        arrived: float,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        prompt_tokens = sum(req.prompt_tokens)
        if side == "decode":
            if proto == "sglang":
                try:
                    await self._await_rooms(req)
                except pd.RoomTimeout as exc:
                    self.metrics.bootstrap_timeouts += 1
                    log.warn("bootstrap_timeout", rooms=[b.room for b in req.bootstrap])
                    raise OpenAIError(504, str(exc), "server_error", "bootstrap_timeout") from None
            else:
                known = self.tickets.redeem((req.kv_params or {}).get("remote_request_id"))
                self.metrics.tickets["known" if known else "unknown"] += 1
        n_tokens = 1 if side == "prefill" else req.max_tokens
        first = self.latency.first_token_s(prompt_tokens, kv_transfer=side == "decode")
        gens = self._generate(req, n_tokens, garbled=fault == "precision")
        await pause(first)
        extra: dict[str, Any] | None = None
        if side == "prefill":
            if proto == "vllm":
                extra = {"kv_transfer_params": self._ticket(prompt_tokens)}
            elif self.rendezvous is not None:
                for b in req.bootstrap:
                    self.rendezvous.register(b.room, {"prompt_tokens": prompt_tokens})
        m = self.metrics
        m.ttft.observe(loop.time() - arrived)
        if side is not None and proto is not None:
            m.legs[(side, proto)] += 1
        rid = f"{'chatcmpl' if req.chat else 'cmpl'}-{self._id_prefix}{next(self._ids):x}"
        created = int(time.time())
        model = req.model or self.model_id
        finished = "length"
        if req.stream:
            try:
                resp = await self._stream(request, req, rid, created, model, gens, extra, fault)
            except ConnectionResetError:
                # The client went away mid-stream: what vLLM counts as an aborted request.
                m.success["abort"] += 1
                return web.StreamResponse()
        else:
            await pause(self.latency.decode_s(n_tokens))
            body = full_response(req, rid, created, model, gens, finished, extra)
            resp = web.Response(body=body, content_type=JSON_CT)
        if n_tokens > 1:
            m.tpot.observe(self.latency.tpot_s)
        m.success[finished] += 1
        m.prompt_tokens += prompt_tokens
        m.generation_tokens += sum(len(g.tokens) for g in gens)
        return resp

    def _generate(self, req: ParsedRequest, n_tokens: int, garbled: bool) -> list[Generated]:
        gens = []
        for prompt in req.prompts:
            seed = seed_of(prompt, self.cfg.seed)
            answer = known_answer(req.question if req.chat else prompt)
            for j in range(req.n):
                gens.append(generate(seed ^ (j * 0x9E3779B1), n_tokens, answer, req.top_k, garbled))
        return gens

    def _ticket(self, prompt_tokens: int) -> dict[str, Any]:
        ticket, blocks = self.tickets.issue(prompt_tokens)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.cfg.engine_id,
            "remote_block_ids": blocks,
            "remote_host": self.advertised_host,
            "remote_port": self.port,
            "remote_request_id": ticket,
            "tp_size": self.cfg.tp,
        }

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

    async def _stream(
        self,
        request: web.Request,
        req: ParsedRequest,
        rid: str,
        created: int,
        model: str,
        gens: list[Generated],
        extra: dict[str, Any] | None,
        fault: str | None,
    ) -> web.StreamResponse:
        prelude, steps, tail = stream_chunks(req, rid, created, model, gens, "length", extra)
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        if fault == "disconnect":
            # One write (for chat: the role delta and the first token), then the cut.
            await resp.write(prelude + steps[0])
            _drop(request)
            return resp
        tpot = self.latency.tpot_s
        if tpot <= 0:
            await resp.write(prelude + b"".join(steps) + tail)
        else:
            await resp.write(prelude + steps[0])
            for step in steps[1:]:
                await asyncio.sleep(tpot)
                if self.faults.hanging():
                    await _hang()
                await resp.write(step)
            await resp.write(tail)
        await resp.write_eof()
        return resp


def _drop(request: web.Request) -> None:
    """Close the client connection without finishing the response (disconnect fault)."""
    transport = request.transport
    if transport is not None:
        transport.close()
