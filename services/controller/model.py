"""The Controller's in-memory records: job specs, NodeManager members, sessions, pending
assemblies and instances. Conversions to protobuf and to database rows live in convert.py.

Endpoints are kept as live ``common_pb2.Endpoint`` messages: a beat updates their status, pid
and KV event ports in place, and every read (ListInstances, the event pusher) copies them into a
fresh Instance.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from motor_mesh.common.enums import InstanceStatus
from motor_mesh.gen.motor.v1 import common_pb2


def observe_kv_ports(ep: common_pb2.Endpoint, reported: common_pb2.Endpoint) -> None:
    """Where the engine publishes its KV cache events, as its NodeManager reports them: the
    Coordinators get them with the instance. They come from the launch, so they are copied with
    every report and a relaunch keeps them."""
    ep.kv_events_port = reported.kv_events_port
    ep.kv_events_replay_port = reported.kv_events_replay_port


@dataclass(frozen=True)
class JobSpec:
    """What every registration of one job must agree on."""

    role: int
    model_name: str
    engine_type: int
    pd_protocol: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    nnodes: int = 1

    def differences(self, other: JobSpec) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(eq=False)
class Session:
    """One registration of one NodeManager: what its heartbeat stream must present."""

    node_id: int
    epoch: int
    member: Member
    valid: bool = True


@dataclass(eq=False)
class Member:
    """One NodeManager's part of a pending or assembled instance."""

    node_rank: int
    host: str
    nm_port: int
    ports: list[int]
    device_count: int = 0
    incarnation: int = 0  # the NodeManager process that registered (RegisterRequest.incarnation)
    # Liveness (monotonic clock). A beat sets last_heard; so does a stream ending, which is how
    # "a broken stream starts the clock at once" works.
    last_heard: float = 0.0
    session: Session | None = None
    open_streams: int = 0
    # Its last stream broke and no other is open: the instance reconcile asks whether the
    # NodeManager is still there (a dead one's engines are about to go too).
    stream_lost: bool = False
    instance: Instance | None = None  # None while the instance is still assembling
    # Assembled members only: the instance's endpoints this NodeManager serves, looked up by the
    # id it was given in StartEngines, or by port for a NodeManager that reports local ids.
    by_id: dict[int, common_pb2.Endpoint] = field(default_factory=dict)
    by_port: dict[int, common_pb2.Endpoint] = field(default_factory=dict)
    # (id, status, pid) of every endpoint in the last applied beat: an unchanged beat is skipped.
    beat_fingerprint: tuple[tuple[int, int, int], ...] | None = None
    dead_pids: set[int] = field(default_factory=set)
    # Whether the NodeManager runs this instance's engines: True once it acknowledged
    # StartEngines or beats with endpoints, False when they still have to be started, None
    # when not known yet (loaded from the database: its first beat tells).
    started: bool | None = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.nm_port}"

    @property
    def slots(self) -> set[tuple[str, int]]:
        return {(self.host, p) for p in self.ports}

    def attach(self, endpoints: list[common_pb2.Endpoint]) -> None:
        self.by_id = {ep.id: ep for ep in endpoints}
        self.by_port = {ep.port: ep for ep in endpoints}
        self.beat_fingerprint = None

    @property
    def endpoints(self) -> list[common_pb2.Endpoint]:
        return list(self.by_id.values())


@dataclass(eq=False)
class Pending:
    """Registrations of one job waiting for the rest of their instance."""

    id: int
    job_name: str
    spec: JobSpec
    members: list[Member] = field(default_factory=list)
    last_registration: float = 0.0  # wall clock, so the expiry survives a restart


class Removal(enum.StrEnum):
    """Why an instance is (to be) deleted: stored with it, and what its alarm is decided on."""

    HEARTBEAT_TIMEOUT = "heartbeat_timeout"  # a NodeManager silent for the timeout
    START_FAILED = "start_failed"  # StartEngines failed for good
    NODE_MANAGER_RESTARTED = "node_manager_restarted"  # a member registered as a new process
    RELAUNCH_FAILED = "relaunch_failed"  # the fault manager's escalation after a failed relaunch
    TERMINATED = "terminated"  # TerminateInstance: an operator's removal
    PRECISION_RECOVERY = "precision_recovery"  # automatic recovery of a precision alarm
    ROLE_SWITCH_FAILED = "role_switch_failed"  # a role switch that could not even be rolled back

    @property
    def on_purpose(self) -> bool:
        """A deliberate removal clears the instance's fault alarm; any other raises it."""
        return self in (Removal.TERMINATED, Removal.PRECISION_RECOVERY)


@dataclass(frozen=True)
class Teardown:
    """The wish to delete an instance, stored with it before anything is done, and how far the
    instance reconcile (reconcile/teardown.py) has carried it out. Every deletion goes this way."""

    reason: Removal
    detail: str = ""
    # NodeManagers to get Stop (their pods restart), and once the round is over (``stopped``)
    # the ones it did not reach.
    stop: tuple[str, ...] = ()
    unreached: tuple[str, ...] = ()
    stopped: bool = False
    # The instance that must be deleted and stopped first (a PD group goes decode first).
    after: int = 0
    # The group's precision alarm is cleared with this (p, d) and every Coordinator told.
    precision: tuple[int, int] | None = None
    precision_cleared: bool = False
    precision_moi: str = ""  # of the alarm it cleared
    coordinators_told: bool = False
    # A planned removal (TerminateInstance) drains the instance before it is deleted: every
    # Coordinator stops routing to it and finishes, or moves elsewhere, the requests on it
    # (DrainInstances), until each reports none left or ``drain_until`` passes.
    drain: bool = False
    drain_started: float = 0.0  # wall clock; 0 = not started yet
    # Wall clock: the Coordinators' move time, as first answered, plus a margin; 0 = no
    # Coordinator has answered yet (the bound is then drain_started + a default).
    drain_until: float = 0.0
    drained: tuple[str, ...] = ()  # Coordinators that last reported nothing in flight on it
    drain_done: bool = False

    @property
    def draining(self) -> bool:
        """The drain has yet to finish: the instance is not deleted before it has."""
        return self.drain and not self.drain_done

    @property
    def done(self) -> bool:
        return self.stopped and (self.precision is None or self.coordinators_told)


@dataclass(frozen=True)
class DrainReport:
    """One Coordinator's answer to DrainInstances for one instance (not stored)."""

    drained: bool  # none of its requests (legs) are left on the instance there
    move_at: float = 0.0  # wall clock: when that Coordinator moves them elsewhere; 0 = not said
    in_flight: int = 0
    code: str = ""  # why there is no count: a status code name; "" = it answered one


@dataclass(frozen=True)
class StrategyRecord:
    """The recovery strategy an instance runs and how far it got, stored with the instance so a
    restarted Controller or a new leader goes on from there (faults/manager.py)."""

    name: str = ""  # "" = none running
    phase: str = ""
    level: int = 0  # the fault level it answers
    started: float = 0.0  # wall clock
    deadline: float = 0.0  # wall clock: the relaunch's engines must be ready by then
    # Per NodeManager: (incarnation, relaunch_count) before the RESTART, so a RESTART whose answer
    # was lost with the Controller is recognised as accepted instead of sent twice.
    base: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    dispatched: tuple[str, ...] = ()  # RESTART sent (the answer may not have been recorded)
    accepted: tuple[str, ...] = ()
    attempts: Mapping[str, int] = field(default_factory=dict)  # failed calls in this phase
    misses: Mapping[str, int] = field(default_factory=dict)  # unanswered polls in a row
    crashes: int = 0  # steps that raised something unexpected (a bug)
    # The strategy that ran last, when it failed (escalation), and the NodeManagers that had
    # accepted its restart: they are left to recover, never stopped by the escalation.
    failed: str = ""
    failed_accepted: tuple[str, ...] = ()


@dataclass(frozen=True)
class RoleSwitch:
    """An instance changing role (prefill <-> decode) in place, stored with it so a restarted
    Controller or a new leader carries the same switch on from where it got
    (planner/switches.py). Phases:

    - ``drain``: every Coordinator drains it (no new request; the ones on it finish there or
      continue elsewhere), the instance still ACTIVE;
    - ``switch``: out of routing (INACTIVE); ``SwitchRole`` to every NodeManager together;
    - ``wait_ready``: until every NodeManager serves ``to_role`` and is ready.

    A switch that a NodeManager refuses (or that fails past its retries) rolls back: the two
    roles swap, ``rolled_back`` says why, and every NodeManager that may have switched is asked
    for the old role again (the ones that refused outright count as accepted)."""

    from_role: int
    to_role: int
    reason: str = ""
    phase: str = "drain"
    started: float = 0.0  # wall clock
    drain_until: float = 0.0  # wall clock; 0 = no Coordinator has answered with a move time
    dispatched: tuple[str, ...] = ()  # SwitchRole sent (the answer may not have been recorded)
    accepted: tuple[str, ...] = ()
    attempts: Mapping[str, int] = field(default_factory=dict)  # failed calls per NodeManager
    deadline: float = 0.0  # wall clock: the engines must be ready by then
    rolled_back: str = ""  # why the switch was rolled back ("" = it was not)


@dataclass(eq=False)
class Instance:
    """An assembled instance (any status, DELETED included)."""

    id: int
    job_name: str
    spec: JobSpec
    status: InstanceStatus
    endpoints: list[common_pb2.Endpoint]
    members: list[Member]
    # Set by a fault-recovery strategy: the instance stays INACTIVE until it is cleared.
    separated: bool = False
    # Failed StartEngines rounds since the last one that went through.
    start_failures: int = 0
    strategy: StrategyRecord = field(default_factory=StrategyRecord)
    teardown: Teardown | None = None
    # A role switch in progress, and when the last one ended (wall clock; 0 = never): the
    # planner leaves a switched instance alone for its cooldown.
    switch: RoleSwitch | None = None
    switched_at: float = 0.0

    @property
    def switching(self) -> bool:
        """Out of routing for a role switch (its drain is over)."""
        return self.switch is not None and self.switch.phase != "drain"

    @property
    def node_managers(self) -> list[str]:
        return [m.address for m in self.members]

    def member_at(self, host: str, nm_port: int) -> Member | None:
        for m in self.members:
            if m.host == host and m.nm_port == nm_port:
                return m
        return None
