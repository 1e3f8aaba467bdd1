"""Chaos under load, the hard way: SIGKILL one piece of `motor up --prefill 2 --decode 2` at a
time (an engine, a NodeManager, the Controller, the Coordinator), then fill the Controller's
disk. One cluster for the module, one client sending completions (every fourth streaming)
throughout; each scenario starts from four ACTIVE instances with the Controller's and the
Coordinator's tables agreeing, and ends there again.

A non-streaming request may not fail while another prefill/decode pair is healthy (the
Coordinator retries another pair); a stream already flowing from an engine that is killed
cannot be saved, so streams are counted, not held to zero. Recovery times are measured
(``chaos <scenario> recovery_s=...`` lines), never asserted."""

from __future__ import annotations

import os
import re
import resource
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from motor_mesh.gen.motor.v1 import common_pb2
from tests.chaos.harness import ACTIVE, COORDINATOR, DELETED, Cluster, Load, by_job, pid_of, scenario
from tests.poll import wait_until
from tests.procs import exited

pytestmark = pytest.mark.timeout(150)

STATUS_NAMES: dict[int, str] = {
    v: k.removeprefix("INSTANCE_STATUS_") for k, v in common_pb2.InstanceStatus.items()
}

# Relaunch readiness is polled every second (the default 5 s only slows the test down).
CONFIG = {"controller": {"engine_relaunch_poll_interval_s": 1}}
# motor up numbers its NodeManagers prefill first: nm-0, nm-1 prefill, nm-2, nm-3 decode.
NM_OF = {"motor-sim-prefill-0": 0, "motor-sim-prefill-1": 1, "motor-sim-decode-0": 2, "motor-sim-decode-1": 3}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("chaos-kills"), prefill=2, decode=2, config=CONFIG)
    try:
        c.wait_ready()
        c.steady(4)
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def load(cluster: Cluster) -> Iterator[Load]:
    lg = Load(cluster.base_url).start()
    try:
        lg.wait_served(10, since=0.0)
        yield lg
    finally:
        lg.stop()


def served_again(c: Cluster, load: Load, sc_since: float) -> None:
    """The cluster is whole (four ACTIVE, tables agreeing) and requests are served."""
    c.steady(4)
    load.wait_served(10, since=sc_since)


def test_engine_sigkill_is_relaunched_in_place(cluster: Cluster, load: Load) -> None:
    with scenario("engine_sigkill", load, "SIGKILL a decode engine's process group", cluster=cluster) as sc:
        before = by_job(cluster.steady(4))
        victim = before["motor-sim-decode-0"]
        old_pid, nm_pid = pid_of(victim), cluster.nodemanager_pid(NM_OF[victim.job_name])
        sc.fault()
        os.killpg(old_pid, signal.SIGKILL)

        def relaunched() -> bool:
            inst = by_job(cluster.instances()).get(victim.job_name)
            return (
                inst is not None
                and inst.status == ACTIVE
                and pid_of(inst) not in (0, old_pid)
                and not cluster.disagreement()
            )

        wait_until(relaunched, 60, "the instance ACTIVE again with a new engine", every=0.05)
        sc.recovered()
        served_again(cluster, load, sc.recovered_at or 0)
        after = by_job(cluster.instances())
        # In place: same instance, same NodeManager, every other instance untouched.
        assert {j: i.id for j, i in after.items()} == {j: i.id for j, i in before.items()}
        assert cluster.nodemanager_pid(NM_OF[victim.job_name]) == nm_pid
        assert all(pid_of(after[j]) == pid_of(i) for j, i in before.items() if j != victim.job_name)
        failed, _, _, _ = sc.counts()
        assert failed == 0, sc.errors()


def test_nodemanager_sigkill_is_recovered(cluster: Cluster, load: Load) -> None:
    with scenario("nodemanager_sigkill", load, "SIGKILL a prefill NodeManager", cluster=cluster) as sc:
        before = by_job(cluster.steady(4))
        victim = before["motor-sim-prefill-1"]
        nm = NM_OF[victim.job_name]
        nm_pid = cluster.nodemanager_pid(nm)
        assert nm_pid
        sc.fault()
        os.kill(nm_pid, signal.SIGKILL)  # its own pid: it shares motor up's process group

        def rebuilt() -> bool:
            inst = by_job(cluster.instances()).get(victim.job_name)
            return (
                inst is not None
                and inst.status == ACTIVE
                and cluster.nodemanager_pid(nm) not in (0, nm_pid)
                and not cluster.disagreement()
            )

        wait_until(rebuilt, 60, "the job's instance ACTIVE again under a new NodeManager", every=0.05)
        sc.recovered()
        served_again(cluster, load, sc.recovered_at or 0)
        after = by_job(cluster.instances())
        sc.notes["same_instance_id"] = after[victim.job_name].id == victim.id
        assert all(after[j].id == i.id for j, i in before.items() if j != victim.job_name)
        failed, _, _, _ = sc.counts()
        assert failed == 0, sc.errors()


def test_controller_sigkill_and_restart_reattaches_every_node(cluster: Cluster, load: Load) -> None:
    with scenario(
        "controller_sigkill", load, "SIGKILL the Controller (motor up restarts it)", cluster=cluster
    ) as sc:
        before = cluster.steady(4)
        pid = cluster.component_pid("controller")
        assert pid
        sc.fault()
        t = sc.fault_at or 0.0
        os.kill(pid, signal.SIGKILL)  # motor up starts it again: same state dir, same port
        wait_until(lambda: exited(pid), 5, "the Controller gone", every=0.01)
        wait_until(
            lambda: cluster.serving(cluster.controller, "motor.v1.Controller"),
            30,
            "Controller up",
            every=0.05,
        )
        assert cluster.component_pid("controller") not in (0, pid)
        # Every NodeManager registered again and has its heartbeat stream open once more.
        for i in range(4):
            cluster.up.wait_line(stream_opened(f"[nm-{i}] "), 30, start=cluster.up.index_at(t))
        after = cluster.steady(4)
        sc.recovered()
        load.wait_served(10, since=sc.recovered_at or 0)
        # Re-attached: the same instances (ids, endpoints) with the same engines.
        assert [(i.id, i.job_name, pid_of(i)) for i in after] == [
            (i.id, i.job_name, pid_of(i)) for i in before
        ]
        assert not {d.id for d in cluster.instances(DELETED)} & {i.id for i in before}
        failed, _, _, _ = sc.counts()
        assert failed == 0, sc.errors()


def test_coordinator_sigkill_gets_its_table_back(cluster: Cluster, load: Load) -> None:
    with scenario(
        "coordinator_sigkill", load, "SIGKILL the Coordinator (motor up restarts it)", cluster=cluster
    ) as sc:
        before = cluster.steady(4)
        incarnation = cluster.coordinator_table().incarnation
        pid = cluster.component_pid("coordinator")
        assert pid
        sc.fault()
        os.kill(pid, signal.SIGKILL)

        def restored() -> bool:
            table = cluster.coordinator_table()
            return (
                table.incarnation != incarnation and len(table.available) == 4 and not cluster.disagreement()
            )

        # Until motor up has it listening again, the Coordinator refuses calls.
        wait_until(
            restored,
            60,
            "the restarted Coordinator holding the Controller's table",
            retry=(grpc.RpcError,),
            every=0.05,
        )
        sc.recovered()
        load.wait_served(10, since=sc.recovered_at or 0)
        assert [i.id for i in cluster.steady(4)] == [i.id for i in before]
        assert cluster.addr(COORDINATOR) == cluster.coordinator
        # The Coordinator is the only way in: requests sent while it was down are counted
        # (failed=...), not held to zero.


def stream_opened(prefix: str) -> Callable[[str], bool]:
    """A log line of NodeManager ``prefix`` saying its heartbeat stream carries acks again."""
    return lambda s: s.startswith(prefix) and "event=heartbeat_stream_open" in s


def controller_lines_since(c: Cluster, t: float, pattern: str) -> list[str]:
    rx = re.compile(pattern, re.I)
    return c.up.lines_since(t, lambda s: s.startswith("[controller] ") and bool(rx.search(s)))


def described(inst: common_pb2.Instance | None, old_pid: int) -> str:
    """An instance's status and whether its engine is the old one, the new one or none."""
    if inst is None:
        return "not listed"
    pid = pid_of(inst)
    engine = "no engine" if pid == 0 else "old engine" if pid == old_pid else "new engine"
    return f"{STATUS_NAMES.get(inst.status, str(inst.status))} ({engine})"


def write_limit(db: Path) -> int:
    """The size at which the Controller's next database write fails: the end of the WAL, where
    sqlite appends (its database file only grows at checkpoints), or the database file's size
    when there is no WAL."""
    wal = db.with_name(db.name + "-wal")
    if wal.exists() and wal.stat().st_size > 0:
        return wal.stat().st_size
    return db.stat().st_size


def test_controller_disk_full_then_freed(cluster: Cluster, load: Load) -> None:
    """RLIMIT_FSIZE on the Controller at the size of its database files: every write that
    grows them fails with EFBIG (Python ignores SIGXFSZ), as on a full disk. An engine is killed
    so an instance must change state. The Controller stays up and answering, says it could not
    write, and never lists a state its database does not hold; once the limit is lifted it
    catches up: the instance recovers and both tables agree."""
    with scenario(
        "controller_disk_full",
        load,
        "Controller's files capped at their size (RLIMIT_FSIZE), a decode engine SIGKILLed, then the cap lifted",
        cluster=cluster,
    ) as sc:
        before = by_job(cluster.steady(4))
        victim = before["motor-sim-decode-1"]
        old_pid = pid_of(victim)
        pid = cluster.component_pid("controller")
        assert pid
        # RLIMIT_FSIZE caps regular files only: its log must go to a pipe to stay writable.
        assert os.readlink(f"/proc/{pid}/fd/2").startswith("pipe:")
        n = write_limit(cluster.db)
        wal = cluster.db.with_name(cluster.db.name + "-wal")
        sc.notes.update(
            limit_bytes=n,
            db_bytes=cluster.db.stat().st_size,
            wal_bytes=wal.stat().st_size if wal.exists() else 0,
        )
        # The soft limit only: raising it back needs no privilege (the hard one would).
        _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (n, hard))
        lifted = False
        try:
            sc.fault()
            t = sc.fault_at or 0.0
            os.killpg(old_pid, signal.SIGKILL)
            mismatches: list[str] = []
            seen: list[str] = []  # the victim's listed status while the disk is full

            def sample() -> None:
                d1 = cluster.disk_statuses()
                live = cluster.instances()
                d2 = cluster.disk_statuses()
                state = described(by_job(live).get(victim.job_name), old_pid)
                if not seen or seen[-1] != state:
                    seen.append(state)
                if d1 == d2:  # else the file changed under us: no verdict from this sample
                    mismatches.extend(
                        f"id {i.id}: listed {STATUS_NAMES.get(i.status)}, "
                        f"stored {STATUS_NAMES.get(d1.get(i.id, -1), 'nothing')}"
                        for i in live
                        if d1.get(i.id) != i.status
                    )

            def write_error_logged() -> list[str]:
                if exited(pid):
                    return ["died"]
                sample()
                return controller_lines_since(
                    cluster, t, r"level=(error|warning).*(stor|writ|persist|disk|database|too large)"
                )

            # A database that cannot be read at the moment (disk_statuses): OSError.
            logged = wait_until(
                write_error_logged, 20, "a write error in the Controller's log", retry=(OSError,), every=0.2
            )
            assert not exited(pid), "the Controller died when its writes failed"
            sc.notes["logged"] = logged[0][:200]
            # The outage goes on for a while: long enough for the relaunch to have finished.
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                sample()
                assert not exited(pid) and cluster.component_pid("controller") == pid, "the Controller died"
                assert cluster.serving(cluster.controller, "motor.v1.Controller")
                time.sleep(0.2)
            sc.notes["victim_while_full"] = " -> ".join(seen)
            assert mismatches == [], mismatches[:5]
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
            lifted = True
            sc.clock("the cap lifted")

            def caught_up() -> bool:
                live = cluster.instances()
                inst = by_job(live).get(victim.job_name)
                disk = cluster.disk_statuses()
                return (
                    inst is not None
                    and inst.status == ACTIVE
                    and pid_of(inst) not in (0, old_pid)
                    and all(disk.get(i.id) == i.status for i in live)
                    and not cluster.disagreement()
                )

            wait_until(
                caught_up, 60, "the instance recovered, stored and routed", retry=(OSError,), every=0.1
            )
            sc.recovered()
            served_again(cluster, load, sc.recovered_at or 0)
            assert cluster.component_pid("controller") == pid, "the Controller was restarted"
            failed, _, _, _ = sc.counts()
            assert failed == 0, sc.errors()
        finally:
            if not lifted and not exited(pid):
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
