"""HTTP surface of the simulated engine (business port), on motor_mesh.common.httpserver."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import os
import signal
import time
from typing import Any

from motor_mesh.common import log
from motor_mesh.common.http_errors import OpenAIError, invalid_request
from motor_mesh.common.httpmessages import Handler, Request, Responder, route_table
from motor_mesh.common.tokenizer import Builtin, Tokenizer
from motor_mesh.simengine import pd
from motor_mesh.simengine.completion import Completions, hang
from motor_mesh.simengine.config import EngineConfig
from motor_mesh.simengine.faults import FaultError, FaultState, parse_fault_body
from motor_mesh.simengine.kv_events import Publisher
from motor_mesh.simengine.latency import LatencyModel, Slots
from motor_mesh.simengine.metrics import Metrics
from motor_mesh.simengine.openai_api import dumps
from motor_mesh.simengine.prefix_cache import PrefixCache, seed_key
from motor_mesh.simengine.tokens import load_tokenizer

MAX_BODY_BYTES = 64 * 1024 * 1024
# Nominal KV capacity in sequences when --max-num-seqs is unlimited (only shapes the gauge).
NOMINAL_CAPACITY = 256
TEXT_CT = b"text/plain; charset=utf-8"
PROM_CT = b"text/plain; version=0.0.4"


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


class Engine:
    """The engine's state and routes. Build it inside the running loop; ``tokenizer``: loaded
    beforehand off the loop (else here: cheap for the built-in one)."""

    def __init__(self, cfg: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.loop = asyncio.get_running_loop()
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
        # The built-in tokenizer's counts are the whitespace words the usage numbers always were.
        self.counts_tokens = not isinstance(self.tokenizer, Builtin)
        self.kv_events = (
            Publisher(cfg.kv_events, cfg.host, cfg.data_parallel_rank) if cfg.kv_events.enabled else None
        )
        self.prefix: PrefixCache | None = None
        if cfg.enable_prefix_caching:
            emit = self.kv_events.publish if self.kv_events is not None else None
            self.prefix = PrefixCache(cfg.num_gpu_blocks, cfg.block_size, seed_key(cfg.seed), emit)
        self.model_id = cfg.model_id
        self.accepted = cfg.accepted_models
        self.latency = LatencyModel(cfg)
        self.slots = Slots(cfg.max_num_seqs)
        # --prefill-compute serial: the one compute prefills take in turn (None: each its own).
        self.compute = Slots(1) if self.latency.serial_prefill else None
        self.faults = FaultState(self.crash, cfg.fault_status, self.die)
        self.tickets = pd.TicketStore()
        self.rendezvous = pd.Rendezvous(cfg.engine_id) if cfg.sglang and cfg.role == "prefill" else None
        self.metrics = Metrics(self.model_id, self._gauges)
        # --startup-s: /health answers 503 until then, as a real engine loading its model does.
        self.ready_at = time.monotonic() + cfg.startup_s
        self._loading_said = False
        self.advertised_host = os.environ.get("VLLM_HOST_IP") or (
            cfg.host if cfg.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        )
        self.port = cfg.port
        self._ticket_fmt: tuple[int, bytes] | None = None  # (port it was made for, format)
        self.completions = Completions(self)
        created = int(time.time())
        self._models_body = _json(
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
                        "max_model_len": cfg.max_model_len,
                    }
                    for name in cfg.model_ids
                ],
            }
        )

    # -- lifecycle -------------------------------------------------------------------------

    def crash(self) -> None:
        log.error("fault_crash", mode="crash", requests=self.faults.requests)
        # A few ms late so an answer already on its way (POST /sim/fault) still leaves.
        self.loop.call_later(0.02, os._exit, 1)

    def die(self) -> None:
        """die_after_tokens: a real crash, now, mid-stream: SIGKILL (no cleanup, no last bytes;
        what was written before is already the kernel's to deliver)."""
        # `sent`, not `tokens`: the log redacts a field whose name has "token" in it.
        log.error("fault_die", mode="die_after_tokens", sent=self.faults.tokens)
        os.kill(os.getpid(), signal.SIGKILL)

    async def close(self) -> None:
        await self.completions.close()
        if self.kv_events is not None:
            await self.kv_events.close()

    @property
    def running(self) -> int:
        """Sequences in the batch: those holding a slot, less those still queued for the
        prefill compute (--prefill-compute serial), which are waiting, as in vLLM's scheduler."""
        compute = self.compute
        return self.slots.running - (compute.waiting if compute is not None else 0)

    def _gauges(self) -> tuple[int, int, float]:
        running, waiting = self.running, self.slots.waiting
        if self.compute is not None:
            waiting += self.compute.waiting  # queued for the prefill compute
        capacity = self.cfg.max_num_seqs or NOMINAL_CAPACITY
        return running, waiting, min(1.0, running / capacity)

    def handler(self) -> Handler:
        c = self.completions
        return route_table(
            {
                ("POST", "/v1/chat/completions"): functools.partial(c.handle, True),
                ("POST", "/v1/completions"): functools.partial(c.handle, False),
                ("GET", "/v1/models"): self.models,
                ("GET", "/health"): self.health,
                ("GET", "/health_generate"): self.health_generate,
                ("GET", "/metrics"): self.prom,
                ("GET", "/get_model_info"): self.model_info,
                ("GET", "/get_server_info"): self.server_info,
                ("GET", "/version"): self.version,
                ("POST", "/flush_cache"): self.flush_cache,
                ("POST", "/reset_prefix_cache"): self.reset_prefix_cache,
                ("GET", "/sim/fault"): self.get_fault,
                ("POST", "/sim/fault"): self.post_fault,
                ("POST", "/sim/ready"): self.post_ready,
            }
        )

    def ticket(self, prompt_tokens: int) -> dict[str, Any]:
        """A vLLM prefill leg's `kv_transfer_params` answer."""
        ticket, blocks = self.tickets.issue(prompt_tokens)
        return self._ticket(blocks, ticket)

    def _ticket(self, blocks: Any, ticket: str) -> dict[str, Any]:
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

    def ticket_json(self, prompt_tokens: int) -> bytes:
        """:meth:`ticket` as the answer's JSON spells it, without running the encoder: the same
        object rendered once with markers in place of the blocks and the id, kept as a format."""
        ticket, start, n = self.tickets.issue_range(prompt_tokens)
        if self._ticket_fmt is None or self._ticket_fmt[0] != self.port:
            blob = dumps(self._ticket("\x00blocks", "\x00ticket"))
            fmt = blob.replace(b"%", b"%%").replace(b'"\\u0000blocks"', b"[%s]")
            self._ticket_fmt = (self.port, fmt.replace(b'"\\u0000ticket"', b'"%s"'))
        blocks = b"%d" % start if n == 1 else b",".join(b"%d" % i for i in range(start, start + n))
        return self._ticket_fmt[1] % (blocks, ticket.encode())

    # -- small routes ----------------------------------------------------------------------
    # A `hang` fault wedges the scheduler, not the API server: these keep answering (faults.py).

    async def health(self, req: Request, out: Responder) -> None:
        faults = self.faults
        if faults.mode != "none":
            if faults.mode == "unhealthy" and faults.is_active():
                out.send(503, b"unhealthy", TEXT_CT)
                return
        if self.starting():
            out.send(503, b"starting", TEXT_CT)
            return
        out.send(200, b"", TEXT_CT)

    async def health_generate(self, req: Request, out: Responder) -> None:
        """SGLang's: it runs a one-token generation, so a wedged scheduler stalls it."""
        if self.faults.hanging():
            await hang()
        await self.health(req, out)

    def starting(self) -> bool:
        """Still in its --startup-s. Says so in one line the first time it is asked (after the
        listening line, so the line a NodeManager shows for a loading engine is this one)."""
        left = self.ready_at - time.monotonic()
        if not self.cfg.startup_s or left <= 0:
            return False
        if not self._loading_said:
            self._loading_said = True
            ready_in = "never" if left == float("inf") else round(left, 1)
            log.event("loading", model=self.model_id, ready_in_s=ready_in)
        return True

    async def models(self, req: Request, out: Responder) -> None:
        out.send(200, self._models_body)

    async def prom(self, req: Request, out: Responder) -> None:
        out.send(200, self.metrics.render(), PROM_CT)

    async def model_info(self, req: Request, out: Responder) -> None:
        out.send(
            200, _json({"model_path": self.model_id, "tokenizer_path": self.model_id, "is_generation": True})
        )

    async def server_info(self, req: Request, out: Responder) -> None:
        cfg = self.cfg
        info = {
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
        out.send(200, _json(info))

    async def version(self, req: Request, out: Responder) -> None:
        out.send(200, b'{"version": "motor-sim"}')

    def _clear_prefix_cache(self) -> None:
        if self.prefix is not None:
            self.prefix.clear()
            log.event("prefix_cache_reset")

    async def flush_cache(self, req: Request, out: Responder) -> None:
        # SGLang's: flushes its radix cache, here the prefix cache.
        self._clear_prefix_cache()
        out.send(200, b"Cache flushed.", TEXT_CT)

    async def reset_prefix_cache(self, req: Request, out: Responder) -> None:
        # vLLM's (a dev-mode route there): nothing is running mid-prefill in the sim, so it
        # always succeeds.
        self._clear_prefix_cache()
        out.send(200, b"", TEXT_CT)

    # -- fault control ---------------------------------------------------------------------

    @staticmethod
    def _loopback(peer: str) -> bool:
        if not peer:
            return False
        try:
            ip = ipaddress.ip_address(peer.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return ip.ipv4_mapped.is_loopback
        return ip.is_loopback

    def _check_loopback(self, req: Request) -> None:
        if not self._loopback(req.peer):
            raise OpenAIError(403, "/sim routes answer loopback clients only", "permission_error")

    async def get_fault(self, req: Request, out: Responder) -> None:
        self._check_loopback(req)
        out.send(200, _json(self.faults.snapshot()))

    async def post_ready(self, req: Request, out: Responder) -> None:
        """End the --startup-s start-up now: a test decides when a slow engine is ready."""
        self._check_loopback(req)
        was_starting = bool(self.cfg.startup_s) and self.ready_at > time.monotonic()
        self.ready_at = time.monotonic()
        if was_starting:
            log.event("loaded", via="/sim/ready")
        out.send(200, _json({"ready": True}))

    async def post_fault(self, req: Request, out: Responder) -> None:
        self._check_loopback(req)
        try:
            mode, after_requests, after_s, status, after_tokens = parse_fault_body(json.loads(req.body))
        except ValueError as exc:  # FaultError and JSONDecodeError alike
            msg = str(exc) if isinstance(exc, FaultError) else f"invalid JSON: {exc}"
            raise invalid_request(msg) from None
        self.faults.arm(mode, after_requests, after_s, status, after_tokens)
        log.event(
            "fault_armed",
            mode=mode,
            after_requests=after_requests,
            after_s=after_s,
            die_after=after_tokens,  # (a field named *token* would be redacted)
        )
        out.send(200, _json(self.faults.snapshot()))
