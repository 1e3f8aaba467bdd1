"""The routing view: what the inference path reads, rebuilt from the table on every change.

A :class:`RoutingView` is immutable and swapped as one reference, so a request that started
routing on one revision finishes on it. The per-instance *runtime* state (in-flight load, the
round-robin cursor over its endpoints, endpoints that refused connections) lives in
:class:`Target` / :class:`Upstream` objects that are carried over from one view to the next
while the instance keeps its identity, so a table change never resets load accounting or
re-admits an endpoint the circuit breaker took out. How many endpoints are out is counted per
routing table (:class:`DownCount`, shared by the views built one from the other), never per
process: several Coordinators in one process (tests start many) keep their own count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from motor_mesh.common.enums import DECODE, PD_SGLANG, PD_VLLM, PREFILL, ROLE_NAMES, UNION, pd_protocol_of
from motor_mesh.coordinator.table import TableState, identity
from motor_mesh.gen.motor.v1 import common_pb2


def netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DownCount:
    """Endpoints out of rotation in one routing table: shared by its targets and views.

    Zero almost always, and then the policies skip the health filter entirely: a routing
    decision stays O(1) in the common case.
    """

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class Upstream:
    """One serving engine endpoint."""

    __slots__ = (
        "base",
        "bootstrap_port",
        "down",
        "host",
        "kv_port",
        "kv_replay_port",
        "owner",
        "pid",
        "port",
    )

    def __init__(self, owner: Target, ep: common_pb2.Endpoint) -> None:
        self.owner = owner
        self.host = ep.host
        self.port = ep.port
        self.bootstrap_port = ep.bootstrap_port
        # Where the engine publishes its KV cache events and replays them (0 = none), and the
        # engine process they come from (0 = not known, e.g. a standalone Coordinator).
        self.kv_port = ep.kv_events_port
        self.kv_replay_port = ep.kv_events_replay_port
        self.pid = ep.pid
        self.base = f"http://{netloc(ep.host, ep.port)}"
        # Set when a connection was refused; cleared by the health prober.
        self.down = False


class Target:
    """One routable instance and its runtime state."""

    __slots__ = (
        "_rr",
        "downs",
        "endpoints",
        "engine_type",
        "flights",
        "id",
        "key",
        "legs",
        "load",
        "model",
        "move_at",
        "n_down",
        "protocol",
        "remote",
        "role",
    )

    def __init__(self, inst: common_pb2.Instance, downs: DownCount) -> None:
        self.id = inst.id
        self.role = inst.role
        self.model = inst.model_name
        self.engine_type = inst.engine_type  # which tokenizer reads a prompt as the engine does
        self.protocol = pd_protocol_of(inst.pd_protocol, inst.engine_type)
        self.endpoints = tuple(Upstream(self, ep) for ep in inst.endpoints if not ep.headless)
        self.key = _runtime_key(inst)
        # In-flight token estimate the policies compare: this process's own plus ``remote``,
        # the other inference workers' (their load broadcast), so one add per request suffices.
        self.load = 0
        self.remote = 0
        self.n_down = 0
        self.downs = downs  # the count of the table this target belongs to
        self._rr = 0
        # Legs (prefill or answering) this process has on the instance now: a drain is over
        # when every process counts none.
        self.legs = 0
        # The answering legs that can continue elsewhere, told when this target leaves routing.
        self.flights: set[Movable] = set()
        # Once retired: when its flights move (wall time; 0: at once, inf: never, as for a
        # pause) and why (drain or left); None while it is routed to.
        self.move_at: tuple[float, str] | None = None

    @property
    def local_load(self) -> int:
        return self.load - self.remote

    def set_remote(self, remote: int) -> None:
        self.load += remote - self.remote
        self.remote = remote

    @property
    def healthy(self) -> bool:
        return self.n_down < len(self.endpoints)

    def set_down(self, ep: Upstream, down: bool) -> None:
        if ep.down != down:
            ep.down = down
            step = 1 if down else -1
            self.n_down += step
            self.downs.n += step

    def retire(self, move_at: float, reason: str = "left") -> None:
        """This target left the routing view: its endpoints no longer count as down, and a
        refusal still reported for one (a request that was in flight) counts in no table.
        Streams on it move to other instances at ``move_at`` (wall time): at once when the
        instance was removed, went down or was relaunched; after the grace when drained;
        never (inf) when it was only paused."""
        self.downs.n -= self.n_down
        self.n_down = 0
        self.downs = DownCount()
        self.moves(move_at, reason)

    def moves(self, move_at: float, reason: str) -> None:
        """Streams on this retired target move at ``move_at`` for ``reason`` (drain or left); a
        later table may change it (a paused instance drained, a draining one deleted)."""
        if (move_at, reason) != self.move_at:
            self.move_at = (move_at, reason)
            for flight in tuple(self.flights):
                flight.move_at(move_at, reason)

    def joined(self, flight: Movable) -> None:
        """``flight`` now answers from this instance; one that left routing tells it when to move."""
        self.flights.add(flight)
        if self.move_at is not None:
            flight.move_at(*self.move_at)

    def pick_endpoint(self) -> Upstream:
        """Round-robin over the endpoints that are not known to refuse connections."""
        eps = self.endpoints
        n = len(eps)
        if n == 1:
            return eps[0]
        start = self._rr
        self._rr = start + 1
        if self.n_down:
            for k in range(n):
                ep = eps[(start + k) % n]
                if not ep.down:
                    return ep
        return eps[start % n]

    def __repr__(self) -> str:
        return f"Target({self.id}, {ROLE_NAMES.get(self.role, self.role)}, {self.model!r})"


class Movable(Protocol):
    """A leg answering a client that can continue on another instance (migration.Flight)."""

    def move_at(self, when: float, reason: str) -> None: ...


def _runtime_key(inst: common_pb2.Instance) -> tuple[object, ...]:
    # The pid and KV event ports too: what the KV index knows of an endpoint's cache holds for
    # one engine process only, so a relaunched engine (or one publishing elsewhere) is a new
    # Target, with no load, cursor or down marks carried over from the old process either.
    eps = tuple(
        sorted(
            (
                ep.host,
                ep.port,
                ep.bootstrap_port,
                ep.headless,
                ep.pid,
                ep.kv_events_port,
                ep.kv_events_replay_port,
            )
            for ep in inst.endpoints
        )
    )
    return (*identity(inst)[:2], inst.model_name, pd_protocol_of(inst.pd_protocol, inst.engine_type), eps)


@dataclass(frozen=True)
class PdGroup:
    protocol: int
    prefill: tuple[Target, ...]
    decode: tuple[Target, ...]


@dataclass(frozen=True)
class ModelRoutes:
    """How one served model can be reached, in order of preference."""

    pd: tuple[PdGroup, ...] = ()
    union: tuple[Target, ...] = ()
    # Prefill instances with no decode to pair with serve whole requests (vLLM only: a
    # disaggregated SGLang prefill server cannot answer without a decode peer).
    prefill_only: tuple[Target, ...] = ()


@dataclass(frozen=True)
class RoutingView:
    revision: int = 0
    models: dict[str, ModelRoutes] = field(default_factory=dict)
    targets: tuple[Target, ...] = ()
    # routable: one usable prefill+decode pair of the same model (and protocol) or one union.
    routable: bool = False
    downs: DownCount = field(default_factory=DownCount, compare=False)
    # Targets that left routing with legs still on them (a drain waits for them to end).
    retired: tuple[Target, ...] = field(default=(), compare=False)

    @property
    def down_total(self) -> int:
        """Endpoints of this view's table out of rotation (the circuit breaker's count)."""
        return self.downs.n

    def model_names(self) -> list[str]:
        return sorted(self.models)

    def legs(self) -> dict[int, int]:
        """Legs in flight per instance id, routed or retired (targets with none left out)."""
        legs: dict[int, int] = {}
        for t in (*self.targets, *self.retired):
            if t.legs:
                legs[t.id] = legs.get(t.id, 0) + t.legs
        return legs


def _move_time(state: TableState, t: Target) -> tuple[float, str]:
    """When streams on ``t``, out of routing, move: after the grace for a drain, never while
    the same engines are paused or serve again, at once otherwise (removed, down, relaunched)."""
    inst = state.instances.get(t.id)
    if inst is None or _runtime_key(inst) != t.key:
        return 0.0, "left"
    drain = state.draining.get(t.id)
    if drain is not None:
        return drain.move_at, "drain"
    if state.is_paused(inst) or state.is_available(inst):
        return math.inf, "left"
    return 0.0, "left"


def build_view(
    state: TableState, previous: Iterable[Target] = (), retired: Iterable[Target] = ()
) -> RoutingView:
    """The routing view of ``state``, reusing the runtime state of unchanged instances.

    ``previous`` are the targets of the view this one replaces: the new view counts its down
    endpoints with theirs (one count per table, whatever else the process routes). ``retired``:
    that view's targets which had left routing with legs on them."""
    previous = tuple(previous)
    downs = previous[0].downs if previous else DownCount()
    old = {t.id: t for t in previous}
    targets: list[Target] = []
    for inst in sorted(state.available(), key=lambda i: i.id):
        prev = old.get(inst.id)
        target = prev if prev is not None and prev.key == _runtime_key(inst) else Target(inst, downs)
        if target.endpoints:
            targets.append(target)
    kept = {id(t) for t in targets}
    leaving = [t for t in previous if id(t) not in kept]
    for t in leaving:
        t.retire(*_move_time(state, t))
    lingering = tuple(t for t in retired if t.legs and id(t) not in kept)
    for t in lingering:
        t.moves(*_move_time(state, t))
    lingering += tuple(t for t in leaving if t.legs)
    by_model: dict[str, list[Target]] = {}
    for t in targets:
        by_model.setdefault(t.model, []).append(t)
    models: dict[str, ModelRoutes] = {}
    routable = False
    for model, ts in by_model.items():
        union = tuple(t for t in ts if t.role == UNION)
        groups = []
        for proto in (PD_VLLM, PD_SGLANG):
            p = tuple(t for t in ts if t.role == PREFILL and t.protocol == proto)
            d = tuple(t for t in ts if t.role == DECODE and t.protocol == proto)
            if p and d:
                groups.append(PdGroup(proto, p, d))
        paired = {t.id for g in groups for t in g.prefill}
        prefill_only = tuple(
            t for t in ts if t.role == PREFILL and t.protocol == PD_VLLM and t.id not in paired
        )
        routable = routable or bool(groups or union)
        if groups or union or prefill_only:
            models[model] = ModelRoutes(tuple(groups), union, prefill_only)
    return RoutingView(state.revision, models, tuple(targets), routable, downs, lingering)
