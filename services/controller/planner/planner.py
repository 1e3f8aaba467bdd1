"""The planner loop: a reconcile (one key, ``planner``) that measures every
``planner.interval_s``, decides the prefill:decode split of the pool, and in ``act`` mode carries
the decision out one instance at a time (docs/planner.md).

**The pool** is every live PREFILL and DECODE instance that is not being deleted and not
separated by a fault. An instance counts for the role it serves, or for the role it is
switching to.

**A decision** (one ``planner_decision`` line with its inputs, and one span when tracing is on):

- ``learning``: not enough measured yet (the first interval only sets the baseline; each role's
  capacity is learned from an interval in which it carried load);
- ``hold``: the split there is meets the prediction as well as any (or the best one gains less
  than ``min_gain``);
- ``recommend`` (mode ``recommend``): another split would do better; exported as
  ``motor_planner_recommended_instances{role}`` and logged, nothing changed;
- ``switch`` (mode ``act``): the target split is recorded in memory and every reconcile moves one
  more instance towards it (at most ``max_switches`` switching at once), until it is reached or
  the next decision replaces it;
- ``scale`` (``max_instances`` above the pool): the desired instance counts per role are set
  (SetDesiredInstances' state, ``motor_desired_instances``) for ``motor up``, an HPA or KEDA to
  follow, instead of switching;
- ``blocked``: a safety rule stops a switch: an instance of the pool starting, INACTIVE or
  PAUSED, or a relaunch running.

**Safety**: never below ``min_prefill`` / ``min_decode``; an instance switched less than
``cooldown_s`` ago is not switched again; nothing starts while the pool is not all ACTIVE (a
switch in progress aside) or a relaunch runs. **ScaleP2D**: a decode instance separated by a
fault leaves the pool at once and the planner decides again without waiting for the interval:
when the decode instances left fall short, a prefill instance is switched to decode (keeping
``min_prefill``); once the fault is cleared the instance is back in the pool, and the traffic
decides whether an instance goes back.

What the planner learned (demand and capacity averages) lives in memory: a restarted Controller
or a new leader learns again within two intervals. What it set in motion is stored: each switch
with its instance (planner/switches.py), the desired counts in the store.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import timestamp_pb2

from motor_mesh.common import log, telemetry
from motor_mesh.common.config import ControllerConfig, Planner
from motor_mesh.common.enums import ACTIVE, DECODE, INACTIVE, PREFILL, InstanceStatus, Role, status_name
from motor_mesh.controller.desired import DesiredInstances
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance
from motor_mesh.controller.planner import model
from motor_mesh.controller.planner.signals import Sample, Signals
from motor_mesh.controller.planner.switches import RoleSwitches, role_name
from motor_mesh.controller.reconcile.runner import Result
from motor_mesh.gen.motor.v1 import common_pb2
from motor_mesh.gen.motor.v1 import controller_pb2 as pb

KEY = "planner"
ROLES: tuple[Role, Role] = (PREFILL, DECODE)
# Observations a role's latency needs in an interval before its capacity is learned from it.
MIN_OBSERVATIONS = 2
MEASURED_INTERVALS = 20


@dataclass
class RoleState:
    demand: model.Ewma = field(default_factory=lambda: model.Ewma(model.DEMAND_ALPHA))
    capacity: model.Ewma = field(default_factory=lambda: model.Ewma(model.CAPACITY_ALPHA))
    latency_p90_s: float | None = None
    instances: int = 0
    recommended: int = 0


@dataclass
class Decision:
    at: float = 0.0  # wall clock; 0 = none yet
    decision: str = ""
    reason: str = ""
    predicted: float = 0.0
    recommended: float = 0.0


class PlannerLoop:
    def __init__(
        self,
        table: InstanceTable,
        switches: RoleSwitches,
        signals: Signals,
        desired: DesiredInstances,
        settings: Callable[[], ControllerConfig],
        enqueue: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.table = table
        self.switches = switches
        self.signals = signals
        self.desired = desired
        self._cfg = settings
        self.enqueue = enqueue
        self.clock = clock
        self.wall = wall
        self.roles = {role: RoleState() for role in ROLES}
        self.last = Decision()
        self.measured: collections.deque[bool] = collections.deque(maxlen=MEASURED_INTERVALS)
        self.target: tuple[int, int] | None = None  # (prefill, decode) being carried out
        self._next_tick: float | None = None
        # Instances serving each role at the last decision: an interval in which that changed
        # (a switch ended, a fault separated one) pairs latency with the wrong count, so it
        # teaches no capacity.
        self._serving: dict[Role, int] = {}
        self._separated: set[int] = set()  # instances a fault took out of the pool
        self._last_reason = ""  # of the last act step that could not go on (logged once)

    @property
    def cfg(self) -> Planner:
        return self._cfg().planner

    # ---- events -------------------------------------------------------------------------------

    def on_transition(self, inst: Instance, old: InstanceStatus, new: InstanceStatus, reason: str) -> None:
        """An instance separated by a fault (ScaleP2D) or back from one: decide now. Any other
        instance back in routing (one that finished its switch, say) lets the decision being
        carried out go on at once: its next switch waited for the pool to be all ACTIVE."""
        if self.cfg.mode == "off" or inst.spec.role not in ROLES:
            return
        if new == INACTIVE and reason == "separated":
            self._separated.add(inst.id)
            self._next_tick = None
        elif new == ACTIVE and inst.id in self._separated:
            self._separated.discard(inst.id)
            self._next_tick = None
        elif not (old == INACTIVE and new == ACTIVE and self.target is not None):
            return
        self.enqueue()

    def switch_finished(self, inst: Instance, outcome: str) -> None:
        """The next instance of the target may go now."""
        self.enqueue()

    # ---- the reconcile ------------------------------------------------------------------------

    async def reconcile(self, key: str) -> Result:
        cfg = self.cfg
        if cfg.mode == "off":
            self.target, self._next_tick = None, None
            return Result(requeue_after=cfg.interval_s)
        now = self.clock()
        if self._next_tick is None or now >= self._next_tick:
            self._next_tick = now + cfg.interval_s
            await self._decide(cfg)
        if cfg.mode == "act" and self.target is not None:
            await self._act(cfg)
        return Result(requeue_after=max(0.05, self._next_tick - self.clock()))

    # ---- the pool -----------------------------------------------------------------------------

    def pool(self) -> list[Instance]:
        return sorted(
            (
                i
                for i in self.table.live.values()
                if i.spec.role in ROLES and i.teardown is None and not i.separated
            ),
            key=lambda i: i.id,
        )

    @staticmethod
    def effective_role(inst: Instance) -> int:
        return inst.switch.to_role if inst.switch is not None else inst.spec.role

    def blockers(self, pool: list[Instance]) -> list[str]:
        out = []
        for i in pool:
            if i.strategy.name:
                out.append(f"instance {i.id}: {i.strategy.name} running")
            elif i.switch is None and i.status != ACTIVE:
                out.append(f"instance {i.id} is {status_name(i.status)}")
        return out

    # ---- deciding -----------------------------------------------------------------------------

    async def _decide(self, cfg: Planner) -> None:
        sample = await self.signals.read()
        pool = self.pool()
        serving = {
            r: [i for i in pool if i.switch is None and i.status == ACTIVE and i.spec.role == r]
            for r in ROLES
        }
        effective = {r: sum(1 for i in pool if self.effective_role(i) == r) for r in ROLES}
        for r in ROLES:
            self.roles[r].instances = len(serving[r])
        inputs: dict[str, Any] = {}
        if sample is not None:
            inputs = self._learn(cfg, sample, {r: len(serving[r]) for r in ROLES})
        else:
            self._serving = {}
        p, d = self.roles[PREFILL], self.roles[DECODE]
        learned = all(s.capacity.value and s.demand.value is not None for s in (p, d))
        with _span(cfg, inputs) as span:
            if sample is None:
                why = (
                    "no Coordinator answered GetEngineMetrics" if self.last.at else "first interval: baseline"
                )
                self._record("learning", why, cfg, inputs, span)
                return
            if not learned:
                self._record(
                    "learning",
                    "capacity of each role not learned yet (no loaded interval)",
                    cfg,
                    inputs,
                    span,
                )
                return
            assert (
                p.capacity.value
                and d.capacity.value
                and p.demand.value is not None
                and d.demand.value is not None
            )
            need_p = model.need(p.demand.value, p.capacity.value)
            need_d = model.need(d.demand.value, d.capacity.value)
            total = effective[PREFILL] + effective[DECODE]
            choice = model.choose(total, need_p, need_d, cfg.min_prefill, cfg.min_decode, effective[PREFILL])
            p.recommended, d.recommended = choice.prefill, choice.decode
            inputs |= {"need_prefill": round(need_p, 3), "need_decode": round(need_d, 3)}
            self.last.predicted, self.last.recommended = choice.current, choice.attainment
            split = f"{effective[PREFILL]}:{effective[DECODE]}"
            best = f"{choice.prefill}:{choice.decode}"
            if cfg.max_instances > total:
                await self._scale(cfg, need_p, need_d, inputs, span)
                return
            if (choice.prefill, choice.decode) == (effective[PREFILL], effective[DECODE]):
                self.target = None
                self._record(
                    "hold",
                    f"{split} is the best split (predicted attainment {choice.current:.2f})",
                    cfg,
                    inputs,
                    span,
                )
                return
            if choice.gain < cfg.min_gain:
                self.target = None
                self._record(
                    "hold",
                    f"{best} would gain {choice.gain:.2f} over {split}, below min_gain {cfg.min_gain}",
                    cfg,
                    inputs,
                    span,
                )
                return
            gain = f"{choice.current:.2f} -> {choice.attainment:.2f}"
            why = f"{best} instead of {split}: predicted attainment {gain}"
            if cfg.mode == "recommend":
                self._record("recommend", why, cfg, inputs, span)
                return
            blocked = self.blockers(pool)
            if blocked:
                self._record("blocked", f"{why}; not now: {'; '.join(blocked)}", cfg, inputs, span)
                return
            self.target = (choice.prefill, choice.decode)
            self._record("switch", why, cfg, inputs, span)

    def _learn(self, cfg: Planner, sample: Sample, serving: dict[Role, int]) -> dict[str, Any]:
        """Demand and capacity from one interval; the inputs, for the decision's line."""
        p, d = self.roles[PREFILL], self.roles[DECODE]
        ttft = sample.ttft.quantile(0.9)
        itl = sample.itl.quantile(0.9)
        p.latency_p90_s, d.latency_p90_s = ttft, itl
        met_ttft = ttft is None or ttft * 1000 <= cfg.ttft_p90_ms
        met_itl = itl is None or itl * 1000 <= cfg.itl_p90_ms
        if ttft is not None or itl is not None:
            self.measured.append(met_ttft and met_itl)
        pre, dec = sample.prefill, sample.decode
        per_request = pre.prompt_tokens_per_request or (pre.prompt_tps / max(pre.running, 1.0))
        # The queue is spread over an interval at least: a decision made early (a fault) would
        # otherwise count it several times over.
        backlog_tps = pre.waiting * per_request / max(sample.seconds, cfg.interval_s)
        p.demand.update(pre.prompt_tps + backlog_tps)
        d.demand.update(dec.running + dec.waiting)
        steady = serving == self._serving
        self._serving = dict(serving)
        if steady and serving[PREFILL] and sample.ttft.count >= MIN_OBSERVATIONS:
            load = pre.prompt_tps / serving[PREFILL]
            model.learn_capacity(p.capacity, load, ttft, cfg.ttft_p90_ms / 1000, pre.waiting > 0)
        if steady and serving[DECODE] and sample.itl.count >= MIN_OBSERVATIONS:
            load = dec.running / serving[DECODE]
            model.learn_capacity(d.capacity, load, itl, cfg.itl_p90_ms / 1000, dec.waiting > 0)
        return {
            "interval_s": round(sample.seconds, 3),
            "prefill": serving[PREFILL],
            "decode": serving[DECODE],
            "ttft_p90_ms": None if ttft is None else round(ttft * 1000, 1),
            "itl_p90_ms": None if itl is None else round(itl * 1000, 1),
            "requests": int(sample.ttft.count),
            "prompt_tps": round(pre.prompt_tps, 1),
            "prefill_waiting": pre.waiting,
            "decode_running": dec.running,
            "decode_waiting": dec.waiting,
            "demand_prefill_tps": round(p.demand.value or 0.0, 1),
            "demand_decode_seqs": round(d.demand.value or 0.0, 2),
            "capacity_prefill_tps": round(p.capacity.value or 0.0, 1),
            "capacity_decode_seqs": round(d.capacity.value or 0.0, 2),
        }

    async def _scale(
        self, cfg: Planner, need_p: float, need_d: float, inputs: dict[str, Any], span: Any
    ) -> None:
        """The pool may grow: desired counts per role instead of switches."""
        want_p = max(cfg.min_prefill, math.ceil(need_p)) if math.isfinite(need_p) else cfg.min_prefill
        want_d = max(cfg.min_decode, math.ceil(need_d)) if math.isfinite(need_d) else cfg.min_decode
        while want_p + want_d > cfg.max_instances and (want_p > cfg.min_prefill or want_d > cfg.min_decode):
            if want_p / max(need_p, 1e-9) >= want_d / max(need_d, 1e-9) and want_p > cfg.min_prefill:
                want_p -= 1
            elif want_d > cfg.min_decode:
                want_d -= 1
            else:
                want_p -= 1
        self.roles[PREFILL].recommended, self.roles[DECODE].recommended = want_p, want_d
        self.target = None
        why = f"pool may grow to {cfg.max_instances}: desired prefill={want_p} decode={want_d}"
        if cfg.mode == "act":
            counts = self.desired.counts()
            for role, n in ((PREFILL, want_p), (DECODE, want_d)):
                if counts.get(role) != n:
                    await self.desired.set(role, n)
        self._record("scale" if cfg.mode == "act" else "recommend", why, cfg, inputs, span)

    def _record(self, decision: str, reason: str, cfg: Planner, inputs: dict[str, Any], span: Any) -> None:
        self.last.at, self.last.decision, self.last.reason = self.wall(), decision, reason
        p, d = self.roles[PREFILL], self.roles[DECODE]
        fields = {
            "mode": cfg.mode,
            "decision": decision,
            "reason": reason,
            "recommended_prefill": p.recommended,
            "recommended_decode": d.recommended,
            "predicted_attainment": round(self.last.predicted, 3),
            "recommended_attainment": round(self.last.recommended, 3),
            "measured_attainment": round(self.measured_attainment(), 3),
            **{k: v for k, v in inputs.items() if v is not None},
        }
        log.event("planner_decision", **fields)
        if span is not None:
            span.set_attributes({f"motor.planner.{k}": v for k, v in fields.items() if v is not None})

    def measured_attainment(self) -> float:
        """Fraction of the recent intervals that met both targets; -1 before the first."""
        return sum(self.measured) / len(self.measured) if self.measured else -1.0

    # ---- acting -------------------------------------------------------------------------------

    async def _act(self, cfg: Planner) -> None:
        """Start switches towards the target while it is allowed."""
        assert self.target is not None
        pool = self.pool()
        running = [i for i in pool if i.switch is not None]
        while len(running) < cfg.max_switches:
            counts = {r: sum(1 for i in pool if self.effective_role(i) == r) for r in ROLES}
            want = dict(zip(ROLES, self.target, strict=True))
            if counts == want or sum(counts.values()) != sum(want.values()):
                self.target = None  # reached, or the pool changed under it: the next decision says
                return
            donor = PREFILL if counts[PREFILL] > want[PREFILL] else DECODE
            to_role = DECODE if donor == PREFILL else PREFILL
            blocked = self.blockers(pool)
            if blocked:
                self._note(f"waiting: {'; '.join(blocked)}")
                return
            if counts[donor] - 1 < (cfg.min_prefill if donor == PREFILL else cfg.min_decode):
                self.target = None
                return
            inst = self._candidate(pool, donor, cfg)
            if inst is None:
                self._note(f"every {role_name(donor)} instance is in its cooldown ({cfg.cooldown_s:g}s)")
                return
            scale_p2d = to_role == DECODE and any(
                i.separated and i.spec.role == DECODE and i.teardown is None for i in self.table.live.values()
            )
            reason = "scale_p2d" if scale_p2d else f"planner: {self.last.reason}"
            await self.switches.begin(inst, to_role, reason)
            running.append(inst)
            self._last_reason = ""

    def _candidate(self, pool: list[Instance], role: int, cfg: Planner) -> Instance | None:
        """The instance of ``role`` switched longest ago, out of its cooldown."""
        now = self.wall()
        ready = [
            i
            for i in pool
            if i.spec.role == role
            and i.switch is None
            and i.status == ACTIVE
            and not i.strategy.name
            and now - i.switched_at >= cfg.cooldown_s
        ]
        return min(ready, key=lambda i: (i.switched_at, i.id), default=None)

    def _note(self, why: str) -> None:
        if why != self._last_reason:
            self._last_reason = why
            log.event(
                "planner_waiting",
                reason=why,
                target=f"{self.target[0]}:{self.target[1]}" if self.target else "",
            )

    # ---- status -------------------------------------------------------------------------------

    def status(self) -> pb.GetPlannerStatusResponse:
        cfg = self.cfg
        resp = pb.GetPlannerStatusResponse(mode=cfg.mode)
        if cfg.mode == "off":
            return resp
        if self.last.at:
            resp.decide_time.CopyFrom(_stamp(self.last.at))
        resp.decision, resp.reason = self.last.decision, self.last.reason
        targets = {PREFILL: cfg.ttft_p90_ms, DECODE: cfg.itl_p90_ms}
        for role in ROLES:
            s = self.roles[role]
            resp.roles.append(
                pb.PlannerRole(
                    role=common_pb2.Role.ValueType(role),
                    instances=s.instances,
                    recommended=s.recommended,
                    demand=s.demand.value or 0.0,
                    capacity_per_instance=s.capacity.value or 0.0,
                    latency_p90_ms=(s.latency_p90_s or 0.0) * 1000,
                    target_ms=targets[role],
                )
            )
        resp.predicted_attainment = self.last.predicted
        resp.recommended_attainment = self.last.recommended
        resp.measured_attainment = self.measured_attainment()
        now = self.wall()
        for inst in sorted(self.table.live.values(), key=lambda i: i.id):
            rec = inst.switch
            if rec is not None:
                resp.switches.append(
                    pb.RoleSwitch(
                        instance_id=inst.id,
                        from_role=common_pb2.Role.ValueType(rec.from_role),
                        to_role=common_pb2.Role.ValueType(rec.to_role),
                        phase=rec.phase,
                        start_time=_stamp(rec.started),
                        reason=rec.reason,
                    )
                )
            elif inst.switched_at and now - inst.switched_at < cfg.cooldown_s:
                resp.cooldowns.append(
                    pb.PlannerCooldown(
                        instance_id=inst.id, end_time=_stamp(inst.switched_at + cfg.cooldown_s)
                    )
                )
        return resp

    def recommended(self) -> dict[Role, int]:
        """What /metrics exports: the recommended instances per role, once there is a decision."""
        if self.cfg.mode == "off" or self.last.decision in ("", "learning"):
            return {}
        return {role: self.roles[role].recommended for role in ROLES}


def _stamp(wall: float) -> timestamp_pb2.Timestamp:
    t = timestamp_pb2.Timestamp()
    t.FromNanoseconds(int(wall * 1e9))
    return t


@contextlib.contextmanager
def _span(cfg: Planner, inputs: dict[str, Any]) -> Iterator[Any]:
    """One span per decision when tracing is on (its attributes are the decision's line)."""
    if not telemetry.enabled():
        yield None
        return
    tracer = telemetry.provider("controller").get_tracer("motor.planner")
    with tracer.start_as_current_span("planner.decide") as span:
        yield span
