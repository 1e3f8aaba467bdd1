"""Keeping each Coordinator's instance table equal to the Controller's ACTIVE and PAUSED
instances (docs/architecture.md, "Controller → Coordinator").

One :class:`CoordinatorPusher` per configured address remembers what that Coordinator is known
to hold. Transitions only mark the instance dirty and enqueue the address; the reconcile diffs
the dirty instances against what the Coordinator holds and sends the difference as incremental
calls (new → Add, gone → Delete, paused → Pause, resumed → Resume; Delete answering NOT_FOUND
counts as done). When that knowledge may be wrong — at start-up, after a failed call (or any
failure of a reconcile), when a response carries a new ``incarnation`` (the Coordinator
restarted), when its health Watch (push/watch.py) comes back after a break, and every
``coordinator_set_sync_interval_s`` — the next reconcile sends one full ``SetInstances``
instead. A failed call is retried with the key's backoff (a failed Set never queues a second
Set); the Watch coming back retries at once. The periodic resync diffs every instance, so a lost
event is corrected within one resync.

The same reconcile keeps the Coordinator's settings in step (docs/configuration-reload.md): the
Controller's settings revision with its Coordinator-wide values, and ``replicas``, how many
Coordinators the Controller reaches (each divides its rate limits by it). What the Coordinator
acknowledged is remembered with its incarnation; ``ApplySettings`` goes out when that differs
from what is wanted: after a reload, to a new or restarted Coordinator, and when one comes or
goes. A Coordinator that predates ApplySettings (UNIMPLEMENTED) is left alone; one that refuses
the settings (INVALID_ARGUMENT, FAILED_PRECONDITION: its tenants file, say) is tried again at
the next resync or change, not in a loop.

grpc.aio ends a call whose channel is closed with a ``CancelledError`` in the caller (and a
call on a closed channel with ``UsageError``): both are failed calls like any other, and the
pusher opens a fresh channel, since nothing more goes through that one.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

import grpc
from grpc_health.v1 import health_pb2_grpc

from motor_mesh.common import log, tasks
from motor_mesh.common.channel import open_channel
from motor_mesh.common.config import ServerConfig
from motor_mesh.common.enums import PAUSED, InstanceStatus
from motor_mesh.common.retry import Backoff
from motor_mesh.common.tasks import cancelled_from_outside
from motor_mesh.controller import state_machine as sm
from motor_mesh.controller.convert import identity_pb, instance_pb
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import DrainReport, Instance
from motor_mesh.controller.push.watch import CoordinatorWatch, Reachability
from motor_mesh.controller.reconcile.runner import DONE, REQUEUE_NOW, Reconciler, Result, Retry
from motor_mesh.gen.motor.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

CALL_TIMEOUT_S = 3.0
WARN_EVERY_S = 30.0
RESYNC_S = 30.0
# Reconcile workers: Coordinators pushed to at once (more when more are configured).
SYNC_WORKERS = 8
NOT_FOUND = grpc.StatusCode.NOT_FOUND
# How a call fails: the Coordinator's answer, or grpc.aio's for a closed channel.
_CALL_FAILED = (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError)


# The metadata every push carries (the HA leader's term); raises when no push may be sent.
PushMetadata = Callable[[], tuple[tuple[str, str], ...]]
# The settings every Coordinator is to apply: (revision, settings JSON or "", replicas).
WantedSettings = Callable[[], tuple[int, str, int]]
# Answers that refuse the settings themselves: retried at the next resync or change.
SETTINGS_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
# A Coordinator that answers these to DrainInstances has nothing of the instance to drain: it
# does not hold it (or no longer: deleted meanwhile), or it predates DrainInstances.
NOTHING_TO_DRAIN = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED)


@dataclass(frozen=True)
class Held:
    """What a Coordinator holds of one instance, as far as this Controller knows."""

    paused: bool
    identity: common_pb2.Instance  # for a Delete, after the instance itself may be forgotten


class CoordinatorPusher:
    def __init__(
        self,
        address: str,
        table: InstanceTable,
        enqueue: Callable[[str], None],
        *,
        key: str | None = None,
        tls: ServerConfig | None = None,
        max_message_bytes: int = 4 << 20,
        sync_interval_s: float = 0.0,
        call_timeout_s: float = CALL_TIMEOUT_S,
        on_reachability: Reachability | None = None,
        push_metadata: PushMetadata | None = None,
        settings: WantedSettings | None = None,
    ) -> None:
        self.address = address
        self._push_metadata = push_metadata
        # None: no settings are pushed (a pusher of the table alone).
        self._settings = settings
        # (revision, replicas, incarnation) the Coordinator acknowledged, or refused; None: none.
        self.settings_acked: tuple[int, int, str] | None = None
        self._settings_refused: tuple[int, int, str] | None = None
        self._table = table
        self._enqueue = enqueue
        self._key = key
        self._tls = tls
        self._max = max_message_bytes
        self._sync_interval_s = sync_interval_s
        self._timeout = call_timeout_s
        # What the Coordinator holds; None = unknown, so the next reconcile sends a full Set.
        self._held: dict[int, Held] | None = None
        self._dirty: set[int] = set()
        self._channel: grpc.aio.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorAsyncStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self.channel_gen = 0
        self._set_gen = 0  # the channel the last Set went out on
        # A full Set was asked for while one was in flight: that one's success does not count.
        self._stale = False
        self._watch = CoordinatorWatch(self, on_reachability)
        self._closing: set[asyncio.Task[None]] = set()
        self.incarnation = ""
        self.synced_fingerprint = ""  # of the last Set the Coordinator accepted
        self.last_set_ok = float("-inf")
        self._last_warn: tuple[str, float] = ("", float("-inf"))
        self._suppressed = 0
        self.stats = {
            "set_ok": 0,
            "set_failed": 0,
            "incremental_ok": 0,
            "incremental_failed": 0,
            "settings_ok": 0,
            "settings_failed": 0,
        }
        # Since when (monotonic) the Coordinator's table may lack a change; None: in step. A new
        # pusher has sent nothing yet.
        self.behind_since: float | None = time.monotonic()

    # ---- metrics -------------------------------------------------------------------------------

    def lag_s(self, now: float) -> float:
        """How long the Coordinator's table has been behind this Controller's; 0 in step."""
        return 0.0 if self.behind_since is None else now - self.behind_since

    @property
    def failures(self) -> int:
        """Calls (Set, Add, Delete, Pause, Resume) that failed since this pusher was made."""
        return self.stats["set_failed"] + self.stats["incremental_failed"]

    @property
    def reachable(self) -> bool:
        """Whether its health Watch says SERVING (False while not known yet)."""
        return bool(self._watch.reachable)

    def _behind(self) -> None:
        if self.behind_since is None:
            self.behind_since = time.monotonic()

    # ---- events --------------------------------------------------------------------------------

    def on_transition(self, inst: Instance, old: InstanceStatus, new: InstanceStatus, reason: str) -> None:
        if sm.is_routable(old) or sm.is_routable(new):
            self._dirty.add(inst.id)
            self._behind()
            self._enqueue(self.address)

    def request_full_sync(self, reason: str) -> None:
        if self._held is not None:
            log.event("coordinator_full_sync_queued", coordinator=self.address, reason=reason)
        self._held = None
        self._behind()  # a restarted or unreachable Coordinator may have lost its table
        self._stale = True
        self._enqueue(self.address)

    def restored(self, broken_gen: int) -> None:
        """The health Watch answers SERVING again after a break first seen on channel
        ``broken_gen``."""
        log.event("coordinator_reachable", coordinator=self.address)
        # Only a Set that went out on a channel opened after the break surely reached the process
        # answering now: one sent before may have been taken by a process on its way out.
        if self._set_gen <= broken_gen:
            self.request_full_sync("watch_restored")
        else:
            self._enqueue(self.address)  # a retry waiting out its backoff goes now

    def resync(self) -> None:
        """Diff every instance at the next reconcile (what corrects a lost event), and offer
        settings it refused again."""
        self._settings_refused = None
        self._dirty.update(self._held or ())
        self._dirty.update(i.id for i in self._table.routable())

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.reopen()
        self._watch.start()

    async def close(self) -> None:
        await self._watch.close()
        if self._channel is not None:
            await self._channel.close(grace=0.2)
        await asyncio.gather(*self._closing, return_exceptions=True)

    def reopen(self) -> None:
        """A fresh channel for every call from now on; calls on the old one get a second to end."""
        old = self._channel
        self._channel = open_channel(
            self.address, key=self._key, tls=self._tls, max_message_bytes=self._max, service="controller"
        )
        self.channel_gen += 1
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        if old is not None:
            task = tasks.start(f"coordinator-channel-close-{self.address}", old.close(grace=1.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def health_stub(self) -> health_pb2_grpc.HealthStub:
        assert self._health is not None
        return self._health

    # ---- reconcile -----------------------------------------------------------------------------

    async def reconcile(self) -> Result:
        periodic = self._sync_interval_s > 0
        if periodic and time.monotonic() - self.last_set_ok >= self._sync_interval_s:
            self._held = None
        try:
            if self._held is None:
                await self._send_set()
            else:
                await self._send_changes()
        except BaseException:
            # A failed call, or a bug halfway through the dirty set: what the Coordinator holds is
            # no longer known, and only a full Set is sure to put it right.
            self._held = None
            raise
        if self._held is None:
            # A response showed a new incarnation, or a full Set was asked for during this one.
            return REQUEUE_NOW
        if not self._dirty:  # nothing changed while the calls were in flight
            self.behind_since = None
        await self._send_settings()  # after the table: a restarted Coordinator routes at once
        if self._held is None:  # the settings' answer showed a new incarnation
            return REQUEUE_NOW
        if periodic:
            # Overdue when the calls took longer than the interval: then at once, since a
            # requeue_after of 0 or less asks for no requeue at all.
            due_in = self.last_set_ok + self._sync_interval_s - time.monotonic()
            return Result(requeue_after=due_in) if due_in > 0 else REQUEUE_NOW
        return DONE

    async def _send_set(self) -> None:
        assert self._stub is not None
        # Taken before the call: a change made while it is in flight is diffed after it.
        self._dirty.clear()
        routable = self._table.routable()
        req = coordinator_pb2.SetInstancesRequest(instances=[instance_pb(i) for i in routable])
        sent = _held_of(routable)  # what the Coordinator will hold, whatever changes meanwhile
        gen = self._set_gen = self.channel_gen
        self._stale = False
        try:
            resp = await self._stub.SetInstances(
                req, timeout=self._timeout, metadata=self._metadata(), wait_for_ready=False
            )
        except _CALL_FAILED as err:
            self.stats["set_failed"] += 1
            self._failed("set", err, gen)
        self.stats["set_ok"] += 1
        self._last_warn = ("", float("-inf"))
        self.last_set_ok = time.monotonic()
        self.incarnation = resp.incarnation
        self._held = None if self._stale else sent
        self.synced_fingerprint = hashlib.blake2b(
            req.SerializeToString(deterministic=True), digest_size=8
        ).hexdigest()
        log.event(
            "coordinator_synced",
            coordinator=self.address,
            instances=len(routable),
            revision=resp.revision,
            incarnation=resp.incarnation,
        )

    async def _send_changes(self) -> None:
        held = self._held
        assert held is not None
        dirty, self._dirty = self._dirty, set()
        adds: list[Instance] = []
        deletes: list[int] = []
        pauses: list[int] = []
        resumes: list[int] = []
        for iid in sorted(dirty):
            inst = self._table.live.get(iid)
            have = held.get(iid)
            if inst is None or not sm.is_routable(inst.status):
                if have is not None:
                    deletes.append(iid)
            elif have is None:
                adds.append(inst)
            elif (inst.status == PAUSED) != have.paused:
                (pauses if inst.status == PAUSED else resumes).append(iid)
        if deletes:
            await self._delete(held, deletes)
        if adds:
            sent = _held_of(adds)
            await self._call("add", instances=[instance_pb(i) for i in adds])
            held.update(sent)
        for kind, ids in (("pause", pauses), ("resume", resumes)):
            if ids:
                await self._call(kind, ids=ids)
                held.update((iid, Held(kind == "pause", held[iid].identity)) for iid in ids)

    async def _delete(self, held: dict[int, Held], ids: list[int]) -> None:
        try:
            await self._call("delete", instances=[held[i].identity for i in ids])
        except _NotFound:
            if len(ids) > 1:  # all-or-nothing: find which ones are still there
                for iid in ids:
                    await self._delete(held, [iid])
                return
        for iid in ids:
            held.pop(iid, None)

    async def _call(
        self, kind: str, *, instances: Sequence[common_pb2.Instance] = (), ids: Sequence[int] = ()
    ) -> None:
        stub, gen, t = self._stub, self.channel_gen, self._timeout
        assert stub is not None
        md = self._metadata()
        try:
            resp: _Answer
            if kind == "add":
                resp = await stub.AddInstances(
                    coordinator_pb2.AddInstancesRequest(instances=instances),
                    timeout=t,
                    metadata=md,
                    wait_for_ready=False,
                )
            elif kind == "delete":
                resp = await stub.DeleteInstances(
                    coordinator_pb2.DeleteInstancesRequest(instances=instances),
                    timeout=t,
                    metadata=md,
                    wait_for_ready=False,
                )
            elif kind == "pause":
                resp = await stub.PauseInstances(
                    coordinator_pb2.PauseInstancesRequest(ids=ids),
                    timeout=t,
                    metadata=md,
                    wait_for_ready=False,
                )
            else:
                resp = await stub.ResumeInstances(
                    coordinator_pb2.ResumeInstancesRequest(ids=ids),
                    timeout=t,
                    metadata=md,
                    wait_for_ready=False,
                )
        except _CALL_FAILED as err:
            if isinstance(err, grpc.aio.AioRpcError) and kind == "delete" and err.code() == NOT_FOUND:
                raise _NotFound from err
            self.stats["incremental_failed"] += 1
            self._failed(kind, err, gen)
        self.stats["incremental_ok"] += 1
        self._last_warn = ("", float("-inf"))
        self._check_incarnation(resp.incarnation)

    async def _send_settings(self) -> None:
        """ApplySettings, when what the Coordinator acknowledged is not what is wanted now."""
        if self._settings is None:
            return
        revision, text, replicas = self._settings()
        wanted = (revision, replicas, self.incarnation)
        if wanted in (self.settings_acked, self._settings_refused):
            return
        stub, gen = self._stub, self.channel_gen
        assert stub is not None
        req = coordinator_pb2.ApplySettingsRequest(
            settings_revision=revision, settings_json=text, replicas=replicas
        )
        try:
            resp = await stub.ApplySettings(
                req, timeout=self._timeout, metadata=self._metadata(), wait_for_ready=False
            )
        except _CALL_FAILED as err:
            code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
            if code == grpc.StatusCode.UNIMPLEMENTED:  # older than ApplySettings: its own file's
                if self.settings_acked != wanted:
                    log.warn("coordinator_settings_unsupported", coordinator=self.address)
                self.settings_acked = wanted
                return
            if code in SETTINGS_REFUSED:
                assert isinstance(err, grpc.aio.AioRpcError)
                log.warn(
                    "coordinator_settings_refused",
                    coordinator=self.address,
                    revision=revision,
                    code=code.name,
                    detail=err.details() or "",
                )
                self._settings_refused = wanted
                return
            self.stats["settings_failed"] += 1
            self._failed("settings", err, gen)
        self.stats["settings_ok"] += 1
        self._check_incarnation(resp.incarnation)
        self.settings_acked = (resp.settings_revision, resp.replicas, resp.incarnation)
        log.event(
            "coordinator_settings_applied",
            coordinator=self.address,
            revision=resp.settings_revision,
            replicas=resp.replicas,
        )

    async def drain(self, instance_id: int) -> DrainReport:
        """``DrainInstances`` of one instance, with the Coordinator's own grace (an instance
        already draining keeps its deadline, so calling again only reports). Changes nothing
        of what this pusher knows the Coordinator holds: the drain is kept across Sets."""
        stub, gen = self._stub, self.channel_gen
        if stub is None:  # not started
            return DrainReport(False, code="NOT_STARTED")
        try:
            resp = await stub.DrainInstances(
                coordinator_pb2.DrainInstancesRequest(ids=[instance_id]),
                timeout=self._timeout,
                metadata=self._metadata(),
                wait_for_ready=False,
            )
        except grpc.aio.AioRpcError as err:
            return DrainReport(err.code() in NOTHING_TO_DRAIN, code=err.code().name)
        except (grpc.aio.UsageError, asyncio.CancelledError) as err:
            if isinstance(err, asyncio.CancelledError) and cancelled_from_outside():
                raise
            if gen == self.channel_gen:
                self.reopen()  # nothing more goes through a closed channel
            return DrainReport(False, code="CHANNEL_CLOSED")
        entry = next((d for d in resp.drains if d.instance_id == instance_id), None)
        if entry is None:
            return DrainReport(False, code="NO_ANSWER")
        move_at = entry.move_time.ToNanoseconds() / 1e9 if entry.HasField("move_time") else 0.0
        return DrainReport(entry.requests_in_flight == 0, move_at, entry.requests_in_flight)

    async def engine_metrics(self) -> coordinator_pb2.GetEngineMetricsResponse | None:
        """The Coordinator's engine metrics by role with its own series (the planner's
        signals); None when it did not answer."""
        stub, gen = self._stub, self.channel_gen
        if stub is None:
            return None
        req = coordinator_pb2.GetEngineMetricsRequest(
            view=coordinator_pb2.ENGINE_METRICS_VIEW_ROLE, include_coordinator=True
        )
        try:
            return await stub.GetEngineMetrics(req, timeout=self._timeout, wait_for_ready=False)
        except grpc.aio.AioRpcError:
            return None
        except (grpc.aio.UsageError, asyncio.CancelledError) as err:
            if isinstance(err, asyncio.CancelledError) and cancelled_from_outside():
                raise
            if gen == self.channel_gen:
                self.reopen()
            return None

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """The leader's term on every push (HA); raises NotLeader once leadership has ended, so
        nothing is sent."""
        return self._push_metadata() if self._push_metadata is not None else ()

    def _failed(self, call: str, err: BaseException, gen: int) -> NoReturn:
        """A failed call: retried (as a full Set) with the key's backoff. One warning per new
        kind of failure, then at most one every WARN_EVERY_S while it lasts."""
        if isinstance(err, asyncio.CancelledError) and cancelled_from_outside():
            raise err
        if isinstance(err, grpc.aio.AioRpcError):
            code, detail = err.code().name, err.details() or ""
        else:
            code, detail = "CHANNEL_CLOSED", type(err).__name__
            if gen == self.channel_gen:
                self.reopen()  # nothing more goes through a closed channel
        key, now = f"{call}:{code}", time.monotonic()
        if key == self._last_warn[0] and now - self._last_warn[1] < WARN_EVERY_S:
            self._suppressed += 1
        else:
            log.warn(
                "coordinator_push_failed",
                coordinator=self.address,
                call=call,
                code=code,
                detail=detail,
                repeated=self._suppressed,
            )
            self._last_warn, self._suppressed = (key, now), 0
        raise Retry(f"{call} to {self.address} failed: {code}") from err

    def _check_incarnation(self, incarnation: str) -> None:
        if incarnation and self.incarnation and incarnation != self.incarnation:
            log.event("coordinator_restarted", coordinator=self.address, incarnation=incarnation)
            self._held = None
            self._behind()
        if incarnation:
            self.incarnation = incarnation


def _held_of(instances: list[Instance]) -> dict[int, Held]:
    return {i.id: Held(i.status == PAUSED, identity_pb(i)) for i in instances}


class _NotFound(Exception):
    """A Delete answered NOT_FOUND: the Coordinator does not hold (one of) those instances."""


class _Answer(Protocol):
    incarnation: str


class CoordinatorSync:
    """One pusher per Coordinator, all driven by one reconciler keyed by address. The set of
    addresses can change at run time (push/coordinator_set.py): a new Coordinator gets a pusher and
    a full Set, a gone one's pusher is closed."""

    def __init__(
        self,
        addresses: Sequence[str],
        table: InstanceTable,
        *,
        key: str | None = None,
        tls: ServerConfig | None = None,
        max_message_bytes: int = 4 << 20,
        sync_interval_s: float = 0.0,
        resync_s: float = RESYNC_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
        on_reachability: Reachability | None = None,
        push_metadata: PushMetadata | None = None,
        settings: Callable[[], tuple[int, str]] | None = None,
    ) -> None:
        """``settings``: the Controller's settings revision and Coordinator-wide settings JSON
        (controller/settings.py), pushed with the replicas; None pushes the table alone."""
        self._table = table
        self._on_reachability = on_reachability
        self._settings = settings
        self._new_pusher = functools.partial(
            CoordinatorPusher,
            settings=self._wanted_settings if settings is not None else None,
            push_metadata=push_metadata,
            key=key,
            tls=tls,
            max_message_bytes=max_message_bytes,
            sync_interval_s=sync_interval_s,
            call_timeout_s=call_timeout_s,
            on_reachability=self._reachability,
        )
        self.reconciler: Reconciler[str] = Reconciler(
            "coordinator",
            self._reconcile,
            workers=max(SYNC_WORKERS, len(addresses)),
            backoff=Backoff(0.1, 1.0),
            resync_s=resync_s,
            keys=self._resync_keys,
        )
        self.pushers: dict[str, CoordinatorPusher] = {}
        self._started = False
        self._closing: set[asyncio.Task[None]] = set()
        for a in addresses:
            self._add(a)

    def _add(self, address: str) -> CoordinatorPusher:
        p = self._new_pusher(address, self._table, self.reconciler.enqueue)
        self.pushers[address] = p
        self._table.subscribe(p)
        return p

    @property
    def replicas(self) -> int:
        """The Coordinators whose health Watch says reachable, at least 1: what each divides its
        rate limits by."""
        return max(1, sum(1 for p in self.pushers.values() if p.reachable))

    def _wanted_settings(self) -> tuple[int, str, int]:
        assert self._settings is not None
        revision, text = self._settings()
        return revision, text, self.replicas

    def _reachability(self, address: str, reachable: bool, why: str) -> None:
        if self._on_reachability is not None:
            self._on_reachability(address, reachable, why)
        if self._settings is not None:
            self.settings_changed()  # one came or went: the others take a new share

    def settings_changed(self) -> None:
        """The settings or the replicas changed: every Coordinator is looked at again."""
        for address in self.pushers:
            self.reconciler.enqueue(address)

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Push to exactly these Coordinators from now on."""
        wanted = set(addresses)
        for address in [a for a in self.pushers if a not in wanted]:
            gone = self.pushers.pop(address)
            self._table.unsubscribe(gone)
            log.event("coordinator_removed", coordinator=address)
            task = tasks.start(f"coordinator-pusher-close-{address}", gone.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        for address in sorted(wanted - set(self.pushers)):
            log.event("coordinator_added", coordinator=address)
            p = self._add(address)
            if self._started:
                p.start()
                self.reconciler.enqueue(address)
        if self._settings is not None and self._started:
            self.settings_changed()  # a Coordinator scaled away no longer takes a share

    async def drain(self, instance_id: int) -> dict[str, DrainReport]:
        """DrainInstances of one instance on every Coordinator pushed to now, at once."""
        pushers = list(self.pushers.values())
        reports = await asyncio.gather(*(p.drain(instance_id) for p in pushers))
        return {p.address: r for p, r in zip(pushers, reports, strict=True)}

    async def engine_metrics(self) -> dict[str, coordinator_pb2.GetEngineMetricsResponse]:
        """GetEngineMetrics (by role, with the Coordinator's own series) of every Coordinator
        pushed to now, at once; the ones that answered, by address."""
        pushers = list(self.pushers.values())
        answers = await asyncio.gather(*(p.engine_metrics() for p in pushers))
        return {p.address: a for p, a in zip(pushers, answers, strict=True) if a is not None}

    async def _reconcile(self, address: str) -> Result:
        pusher = self.pushers.get(address)
        if pusher is None:  # removed while queued
            return DONE
        return await pusher.reconcile()

    def _resync_keys(self) -> list[str]:
        for p in self.pushers.values():
            p.resync()
        return list(self.pushers)

    def start(self) -> None:
        self._started = True
        for p in self.pushers.values():
            p.start()
        self.reconciler.start()

    async def close(self) -> None:
        await self.reconciler.stop()
        await asyncio.gather(*(p.close() for p in self.pushers.values()), return_exceptions=True)
        await asyncio.gather(*self._closing, return_exceptions=True)
