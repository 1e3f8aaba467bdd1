"""KV-aware routing in one inference process: the subscriptions, the index, the tokenizers.

Every process that serves inference (the management process with ``workers = 1``, else each
inference worker) keeps its own index, fed by its own subscription to the KV events of every
engine a kv_aware policy chooses among (ZeroMQ fans a PUB socket out to any number of
subscribers). A routing decision then reads
memory in its own process: no round trip on the request path. The cost is one event stream per
worker per engine; bench/results/kv_routing.md measures both.

Level-triggered: every ``RECONCILE_S`` the routing view is compared with the subscriptions. An
endpoint that left the table, or whose engine process changed (a new pid after a relaunch), or
whose event ports changed, loses its index entries and its subscription; a new one gets a
subscription that first replays what the engine still buffers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq.asyncio

from services.common import enums, log, tasks
from services.common.config import CoordinatorConfig
from services.common.tokenizer import Builtin, Tokenizer, load
from services.common.tokenizer import tokenizer_file as find_tokenizer
from services.coordinator.kv.index import KvIndex
from services.coordinator.kv.policy import KvAware
from services.coordinator.kv.prompt import Prompt, Tokens
from services.coordinator.kv.subscriber import Subscription
from services.coordinator.kv.wire import Batch
from services.coordinator.metrics import Metrics
from services.coordinator.routes import RoutingView, Target

RECONCILE_S = 0.25
POLICY = "kv_aware"


@dataclass(frozen=True)
class _Spec:
    host: str
    port: int
    replay_port: int
    pid: int


@dataclass
class _Sub:
    spec: _Spec
    task: asyncio.Task[None]


class KvRouting:
    """Create inside the running loop; :meth:`start` once, :meth:`stop` at the end."""

    def __init__(self, cfg: CoordinatorConfig, view: Callable[[], RoutingView], metrics: Metrics) -> None:
        self.cfg = cfg
        self._view = view
        self.index = KvIndex(cfg.kv_index_max_blocks)
        self.metrics = metrics.kv
        self.policy = KvAware(self.index, self.metrics, cfg.kv_prefix_weight, cfg.kv_load_weight)
        self._subs: dict[str, _Sub] = {}  # by endpoint (its base URL: the index's key)
        self._tokens: dict[tuple[str, int], Tokens | None] = {}  # by (model, engine type)
        # Only the roles a kv_aware policy chooses among: the others' events would be work for
        # nothing (decode_policy also chooses union instances).
        self._roles: set[int] = set()
        if cfg.prefill_policy == POLICY:
            self._roles.add(enums.PREFILL)
        if cfg.decode_policy == POLICY:
            self._roles |= {enums.DECODE, enums.UNION}
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._task = tasks.spawn("kv_reconcile", self._reconcile_loop)

    async def stop(self) -> None:
        await tasks.cancel_quietly(self._task)
        for sub in self._subs.values():
            await tasks.cancel_quietly(sub.task)
        self._subs.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # -- the request path ------------------------------------------------------------------

    def prompt(self, req: dict[str, Any], chat: bool, target: Target) -> Prompt | None:
        """The request's prompt tokenized for ``target``'s model and engine; None while its
        tokenizer is not loaded, or when the body has no prompt it can read."""
        tokens = self._tokens.get((target.model, target.engine_type))
        if tokens is None:
            return None
        prompt = tokens.prompt(req, chat)
        return prompt if prompt is not None and prompt.tokens else None

    # -- keeping up with the table ---------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        last: RoutingView | None = None
        while True:
            view = self._view()
            if view is not last:
                self.reconcile(view)
                last = view
            self.metrics.index_blocks.set(self.index.size)
            await asyncio.sleep(RECONCILE_S)

    def reconcile(self, view: RoutingView) -> None:
        want: dict[str, _Spec] = {}
        for t in view.targets:
            if t.role not in self._roles:
                continue
            self._want_tokenizer(t)
            for ep in t.endpoints:
                if ep.kv_port:
                    want[ep.base] = _Spec(ep.host, ep.kv_port, ep.kv_replay_port, ep.pid)
        for key, sub in list(self._subs.items()):
            spec = want.get(key)
            if spec != sub.spec:
                sub.task.cancel()
                del self._subs[key]
                self.index.drop(key)
                # A new pid (or new ports) is another engine process, its cache empty.
                reason = "left" if spec is None else "restart"
                self.metrics.reset(reason)
                log.event("kv_unsubscribed", endpoint=key, pid=sub.spec.pid, reason=reason)
        for key, spec in want.items():
            if key not in self._subs:
                self._subscribe(key, spec)
        self.metrics.subscriptions.set(len(self._subs))

    def _subscribe(self, key: str, spec: _Spec) -> None:
        assert self._ctx is not None
        sub: _Sub | None = None  # set below, before the task first runs

        def apply(k: object, batch: Batch) -> None:
            # A cancelled subscription's last batch must not touch its successor's entries.
            if self._subs.get(key) is sub:
                for event in batch.events:
                    self.index.apply(key, event)

        def reset(k: object, reason: str) -> None:
            if self._subs.get(key) is sub:
                self.index.drop(key)  # the subscription logged why (event=kv_events_reset)
                self.metrics.reset(reason)

        subscription = Subscription(
            self._ctx, key, spec.host, spec.port, spec.replay_port, apply, reset, self.metrics
        )
        task = tasks.spawn(f"kv_events {key}", subscription.run)
        sub = _Sub(spec, task)
        self._subs[key] = sub
        log.event("kv_subscribed", endpoint=key, events=f"{spec.host}:{spec.port}", pid=spec.pid)

    def _want_tokenizer(self, t: Target) -> None:
        key = (t.model, t.engine_type)
        if key in self._tokens:
            return
        self._tokens[key] = None
        tasks.start(f"kv_tokenizer {t.model}", self._load_tokenizer(*key))

    async def _load_tokenizer(self, model: str, engine_type: int) -> None:
        sim = engine_type == enums.ENGINE_SIM
        path = self.cfg.tokenizers.get(model) or model
        try:
            tokenizer = await asyncio.to_thread(_tokenizer_for, path, sim)
        except Exception as exc:  # any failure: route this model by load
            log.warn("kv_tokenizer_failed", model=model, path=path, error=str(exc) or type(exc).__name__)
            return
        if tokenizer is None:
            # A real engine's ids cannot be guessed: its requests go by load alone.
            log.warn("kv_no_tokenizer", model=model, hint="set coordinator.tokenizers")
            return
        self._tokens[(model, engine_type)] = Tokens(tokenizer, sim)
        log.event("kv_tokenizer", model=model, tokenizer=tokenizer.name, sim=sim)


def _tokenizer_for(path: str, sim: bool) -> Tokenizer | None:
    """The simulated engine falls back to its built-in tokenizer, as the engine itself does."""
    if find_tokenizer(path) is None:
        return Builtin() if sim else None
    return load(path)


def wanted(cfg: CoordinatorConfig) -> bool:
    return POLICY in (cfg.prefill_policy, cfg.decode_policy)
