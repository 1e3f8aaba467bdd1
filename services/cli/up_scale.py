"""``motor up`` following the Controller's desired instance counts (``SetDesiredInstances``,
``motor scale``), as an HPA scales a role's StatefulSet in Kubernetes.

At start, once a Controller leads, the counts of ``--prefill``/``--decode``/``--union`` are
recorded as the desired ones, every role's (0 included): they are the operator's explicit ask,
and they replace whatever an earlier run with the same ``--state-dir`` left in the store. Until
that is done nothing is followed (a count left by an earlier run must not start anything); it is
retried with backoff while the Controller is not there yet. A Controller that refuses it for good
(UNIMPLEMENTED: an older one; a wrong management key) leaves ``motor up`` running what it started,
with one line saying so.

From READY on, every ``POLL_S`` the desired counts are read (``ListDesiredInstances``) and each
role's compared with the NodeManagers ``motor up`` runs for it that are not being removed: level
triggered, so a missed poll, a Controller that restarted or a change of leader changes nothing,
and a role with no recorded count is left alone.

- More desired: NodeManagers are started as the first ones were (up_plan.NodeMaker), each on the
  lowest NodeManager number ``i`` no running one holds (its ports, engines and ``nm-<i>`` state
  follow from ``i``: they are free of every other NodeManager's) and the lowest job number ``n`` of
  the role no running one holds (job ``<model>-<role>-<n>``). They register, the Controller
  assembles their instances and pushes them to the Coordinator, and they serve.
- Fewer: the role's highest-numbered instances are removed, each in the background: the
  Controller is asked to ``TerminateInstance`` it (it drains the instance on every Coordinator,
  so no client request fails, then sends its NodeManager ``Stop``; the NodeManager stops its
  engines and exits), and once that is done the NodeManager is waited for, at most
  ``EXIT_WAIT_S``; then it gets SIGTERM (a drained stop of its own), then SIGKILL, and its
  recorded engines are killed. An instance the Controller does not list (not assembled yet) is
  stopped by SIGTERM at once. The exit is not a crash: nothing restarts it.

Each change is one line on stderr: ``motor up: scaled decode: 1 -> 3 instances (started nm-2,
nm-3)``; a count that cannot be reached (the port scheme is full) is one line too, once per
count asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import TYPE_CHECKING

import grpc

from motor_mesh.cli.up_plan import ROLES, Child, Plan
from motor_mesh.common import enums, log, retry, tasks
from motor_mesh.common.config import ConfigError, read_key_file
from motor_mesh.common.errors import RpcFailure
from motor_mesh.common.leader_target import ControllerTarget
from motor_mesh.gen.motor.v1 import controller_pb2 as pb
from motor_mesh.nodemanager.statefile import StateFile, kill_recorded_engines

if TYPE_CHECKING:  # the Cluster runs the Scaler (up.py imports this module)
    from motor_mesh.cli.up import Cluster

POLL_S = 1.0  # how often the desired counts are read
RPC_TIMEOUT_S = 5.0  # the deadline of every call but TerminateInstance
RECORD_BACKOFF = (0.2, 5.0)  # retrying the first SetDesiredInstances while no Controller leads
# TerminateInstance's deadline beyond nodemanager.drain_wait_s (the Coordinators' drain grace
# plus the Controller's margin): its Stop round.
TERMINATE_EXTRA_S = 15.0
EXIT_WAIT_S = 15.0  # after the Controller's Stop: the NodeManager stops its engines and exits
SIGTERM_EXTRA_S = 10.0  # after SIGTERM, beyond nodemanager.drain_wait_s (it may drain first)
KILL_WAIT_S = 5.0  # after SIGKILL: the exit is reaped and its output read


class Terminated(Enum):
    STOPPED = "stopped"  # every NodeManager of the instance accepted Stop
    PENDING = "pending"  # the Controller carries the teardown on (the call's deadline passed)
    NOT_DONE = "not_done"  # no such instance, or the Controller would not: we stop it ourselves


class Scaler:
    """Records ``motor up``'s counts, then follows the desired ones while the cluster runs."""

    def __init__(
        self,
        cluster: Cluster,
        start_node: Callable[[Child], Awaitable[None]],
    ) -> None:
        self.cluster = cluster
        self.plan: Plan = cluster.plan
        self.stopping = cluster.stopping
        self._start_node = start_node
        args = cluster.args
        self.initial = {"prefill": args.prefill, "decode": args.decode, "union": args.union}
        self.retiring: set[asyncio.Task[None]] = set()
        self._refused: dict[str, int] = {}  # per role, the count last said to be out of reach
        self._list_failing: str = ""  # the code ListDesiredInstances last failed with
        self._target: ControllerTarget | None = None

    # -- the loop --------------------------------------------------------------------------------
    async def run(self, ready: asyncio.Event) -> None:
        """Record the initial counts, then (from ``ready`` on) follow the desired ones until
        ``stopping``."""
        cfg = self.cluster.cfg.controller
        key = await asyncio.to_thread(_key, cfg.management_key_file)
        self._target = ControllerTarget(self.plan.controller_target, key=key, tls=cfg, service="up")
        try:
            if not await self.record():
                return
            await tasks.first_of(self.stopping, ready)
            while not self.stopping.is_set():
                desired = await self.read()
                if desired is not None:
                    await self.step(desired)
                await tasks.first_of(self.stopping, within=POLL_S)
        finally:
            await self._target.close()

    async def close(self) -> None:
        """Stop every removal under way (the cluster's shutdown stops their NodeManagers)."""
        for task in list(self.retiring):
            await tasks.cancel_quietly(task)

    async def record(self) -> bool:
        """``SetDesiredInstances`` of every role to ``motor up``'s count, retried with backoff
        while the Controller is not there; False when it refuses for good."""
        assert self._target is not None
        backoff = retry.Backoff(*RECORD_BACKOFF)
        pending = list(ROLES)
        while pending:
            if self.stopping.is_set():
                return False
            role = pending[0]
            req = pb.SetDesiredInstancesRequest(role=enums.ROLES_BY_NAME[role], replicas=self.initial[role])
            try:
                await self._target.call("SetDesiredInstances", req, RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                failure = RpcFailure.of(err)
                if failure.code in retry.TERMINAL_CODES:
                    say(
                        "not following the desired instance counts: SetDesiredInstances refused "
                        f"({failure.code.name}: {failure.message})"
                    )
                    return False
                await tasks.first_of(self.stopping, within=backoff.next(failure.retry_after))
                continue
            pending.pop(0)
            backoff.reset()
        log.event("desired_instances_recorded", component="up", **self.initial)
        return True

    async def read(self) -> dict[str, int] | None:
        """The desired count of each role that has one; None when the Controller did not say."""
        assert self._target is not None
        try:
            resp = await self._target.call(
                "ListDesiredInstances", pb.ListDesiredInstancesRequest(), RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as err:
            code = err.code().name
            if code != self._list_failing:  # once per outage, not every second
                log.warn("desired_instances_unread", component="up", code=code, reason=err.details() or "")
            self._list_failing = code
            return None
        if self._list_failing:
            log.event("desired_instances_read_again", component="up")
            self._list_failing = ""
        return {enums.ROLE_NAMES[d.role]: d.replicas for d in resp.desired if d.role in enums.ROLE_NAMES}

    # -- one step toward the desired counts ------------------------------------------------------
    def running(self, role: str) -> list[Child]:
        """The role's NodeManagers that are not being removed."""
        return [c for c in self.plan.nodes if c.role == role and not c.retiring.is_set()]

    async def step(self, desired: dict[str, int]) -> None:
        for role in ROLES:
            if role not in desired or self.stopping.is_set():
                continue
            want, have = desired[role], len(self.running(role))
            if want > have:
                await self.add(role, have, want)
            elif want < have:
                self.remove(role, have, want)
            else:
                self._refused.pop(role, None)

    async def add(self, role: str, have: int, want: int) -> None:
        started: list[Child] = []
        for _ in range(want - have):
            if self.stopping.is_set():
                break
            i = _lowest_free({c.index for c in self.plan.nodes})
            why = self.plan.make_node.room(i)
            if why is not None:
                if self._refused.get(role) != want:
                    self._refused[role] = want
                    say(f"cannot scale {role} to {want} instances: {why}")
                break
            n = _lowest_free({c.number for c in self.plan.nodes if c.role == role})
            child = self.plan.make_node(i, role, n)
            try:
                await self._start_node(child)
            except OSError as exc:
                log.exception("spawn_failed", component=child.name)
                say(f"cannot start {child.name} for {role}: {exc}")
                break
            self.plan.nodes.append(child)
            started.append(child)
        if started:
            names = ", ".join(c.name for c in started)
            say(f"scaled {role}: {have} -> {have + len(started)} instances (started {names})")

    def remove(self, role: str, have: int, want: int) -> None:
        victims = sorted(self.running(role), key=lambda c: c.number, reverse=True)[: have - want]
        reason = f"motor up: scaled {role} from {have} to {want} instances"
        for child in victims:
            child.retiring.set()
            task = tasks.start(f"retire-{child.name}", self.retire(child, reason))
            self.retiring.add(task)
            task.add_done_callback(self.retiring.discard)
        names = ", ".join(c.name for c in victims)
        say(f"scaled {role}: {have} -> {want} instances (draining and stopping {names})")

    # -- removing one instance ---------------------------------------------------------------
    async def retire(self, child: Child, reason: str) -> None:
        """Have the Controller drain and stop ``child``'s instance, see that its NodeManager
        exits (SIGTERM, then SIGKILL, when it does not), and forget it."""
        drain_wait = self.cluster.cfg.nodemanager.drain_wait_s
        outcome = await self.terminate(child, reason, drain_wait + TERMINATE_EXTRA_S)
        gone = outcome is not Terminated.NOT_DONE and await self._exited(child, EXIT_WAIT_S)
        if not gone and not await self._exited(child, drain_wait + SIGTERM_EXTRA_S, signal.SIGTERM):
            log.warn("retire_killed", component=child.name, reason="did not exit after SIGTERM")
            await self._exited(child, KILL_WAIT_S, signal.SIGKILL)
        if child.state_dir is not None:  # engines a NodeManager killed hard left behind
            await kill_recorded_engines(StateFile(child.state_dir), self.cluster.reaper)
            await asyncio.to_thread(shutil.rmtree, child.state_dir, True)
        # Only now may another NodeManager take its number (its ports and state directory).
        with contextlib.suppress(ValueError):
            self.plan.nodes.remove(child)
        rc = child.proc.returncode if child.proc is not None else None
        log.event("retired", component=child.name, job=_job(child), terminated=outcome.value, rc=rc)

    async def terminate(self, child: Child, reason: str, budget: float) -> Terminated:
        """``TerminateInstance`` of ``child``'s instance (found by its job name), retried while
        the Controller cannot be reached, within ``budget`` seconds."""
        assert self._target is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        backoff = retry.Backoff(*RECORD_BACKOFF)
        job = _job(child)
        while not self.stopping.is_set() and not _done(child):
            try:
                listed = await self._target.call("ListInstances", pb.ListInstancesRequest(), RPC_TIMEOUT_S)
                ids = [i.id for i in listed.instances if i.job_name == job]
                if not ids:
                    log.event("retire_unassembled", component=child.name, job=job)
                    return Terminated.NOT_DONE
                left = max(deadline - loop.time(), 1.0)
                log.event("retire_terminating", component=child.name, job=job, instance_id=ids[0])
                req = pb.TerminateInstanceRequest(instance_id=ids[0], reason=reason)
                resp = await self._target.call("TerminateInstance", req, left)
                return Terminated.STOPPED if resp.terminated else Terminated.PENDING
            except grpc.aio.AioRpcError as err:
                failure = RpcFailure.of(err)
                if failure.code == grpc.StatusCode.NOT_FOUND:
                    return Terminated.NOT_DONE  # deleted meanwhile
                if failure.code in retry.TERMINAL_CODES or loop.time() >= deadline:
                    log.warn(
                        "retire_terminate_failed",
                        component=child.name,
                        job=job,
                        code=failure.code.name,
                        reason=failure.message,
                    )
                    return Terminated.NOT_DONE
                wait = min(backoff.next(failure.retry_after), max(deadline - loop.time(), 0.0))
                await tasks.first_of(self.stopping, within=wait)
        return Terminated.NOT_DONE

    async def _exited(self, child: Child, within: float, sig: signal.Signals | None = None) -> bool:
        """Whether ``child`` is gone within ``within`` s (after ``sig``, if given): its
        supervisor ends with it."""
        if sig is not None and child.proc is not None and child.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(sig)
        if child.supervisor is None:
            return child.proc is None or child.proc.returncode is not None
        done, _ = await asyncio.wait({child.supervisor}, timeout=within)
        return bool(done)


def say(text: str) -> None:
    """One line of ``motor up``'s own on stderr."""
    print(f"motor up: {log.printable(text)}", file=sys.stderr, flush=True)


def _job(child: Child) -> str:
    return child.env.get("MOTOR_NODEMANAGER_JOB_NAME", "")


def _done(child: Child) -> bool:
    return child.supervisor is not None and child.supervisor.done()


def _lowest_free(used: set[int]) -> int:
    i = 0
    while i in used:
        i += 1
    return i


def _key(path: str) -> str | None:
    """The Controller's management key, when one is required and can be read (a Controller
    that requires an unreadable one refuses us, which says so)."""
    if not path:
        return None
    try:
        return read_key_file(path)
    except (ConfigError, OSError):
        return None
