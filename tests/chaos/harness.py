"""What the chaos scenarios share: a ``motor up`` cluster (and NodeManagers started beside it),
the two instance tables, a paced client, and the per-scenario result line.

Processes, ports and waiting come from the tests' shared helpers (tests/procs.py,
tests/ports.py, tests/poll.py); ``motor up``'s ports from tests/e2e/cluster.py.

Every scenario prints ``chaos <scenario> recovery_s=<x> failed=<n> total=<m> ...`` and, when
``MOTOR_CHAOS_RESULTS`` names a file, appends the same result to it as one JSON object per line
(``bench/bench_chaos.py`` runs the suite that way and renders ``bench/results/chaos.md``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.gen.motor.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
)
from motor_mesh.nodemanager.statefile import StateFile
from tests.e2e.cluster import CONTROLLER, CONTROLLER_1, COORDINATOR, ENGINE, HTTP, NM, NM_METRICS, up_ports
from tests.poll import wait_until
from tests.ports import reserve
from tests.procs import Proc, child_pids, exited, motor_argv

ACTIVE, PAUSED, DELETED = (
    common_pb2.INSTANCE_STATUS_ACTIVE,
    common_pb2.INSTANCE_STATUS_PAUSED,
    common_pb2.INSTANCE_STATUS_DELETED,
)
RESULTS_ENV = "MOTOR_CHAOS_RESULTS"
RESULTS: list[dict[str, Any]] = []  # this session's results, for the terminal summary
FRESH = [("grpc.use_local_subchannel_pool", 1)]  # no shared reconnect backoff between calls


# -- the cluster ---------------------------------------------------------------------------------
class Cluster:
    """``motor up --prefill P --decode D`` (``nodes`` = P + D, one engine each) on reserved
    ports, with ``config`` (sectioned) applied to every component. ``extra_nodes`` more
    NodeManager slots (and their engines' ports) are reserved too, for NodeManagers a test starts
    itself (``start_nodemanager``)."""

    def __init__(
        self,
        tmp: Path,
        prefill: int,
        decode: int,
        config: dict[str, Any],
        extra_nodes: int = 0,
        ha: bool = False,
    ) -> None:
        self.tmp = tmp
        self.nodes = prefill + decode
        self.ha = ha
        self.ports = reserve(up_ports(self.nodes + extra_nodes, ha=ha))
        self.off = self.ports.shift
        self.state = tmp / "state"
        self.config = tmp / "chaos.json"
        self.config.write_text(json.dumps(config))
        self.own: dict[int, tuple[Proc, Path]] = {}  # NodeManagers started by the test, by index
        argv = ["up", "--prefill", str(prefill), "--decode", str(decode), "--config", str(self.config)]
        argv += ["--ha"] if ha else []
        self.up = Proc(
            motor_argv(*argv, "--port-offset", str(self.off), "--state-dir", str(self.state)), cwd=tmp
        )

    # addresses
    def addr(self, base: int) -> str:
        return f"127.0.0.1:{base + self.off}"

    @property
    def controller(self) -> str:
        """The Controller; under --ha the one that leads now (waited for)."""
        if not self.ha:
            return self.addr(CONTROLLER)
        return wait_until(self.leader, 30, "a Controller leading", every=0.05)

    @property
    def controllers(self) -> list[str]:
        """controller-0 and controller-1 (--ha)."""
        return [self.addr(CONTROLLER), self.addr(CONTROLLER_1)]

    def leader(self) -> str:
        """The --ha Controller whose motor.v1.Controller health is SERVING; "" when none is."""
        return next((a for a in self.controllers if self.serving(a, "motor.v1.Controller")), "")

    @property
    def coordinator(self) -> str:
        return self.addr(COORDINATOR)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{HTTP + self.off}"

    @property
    def db(self) -> Path:
        return self.state / "controller" / "controller.db"

    def wait_ready(self, timeout: float = 60.0) -> None:
        self.up.wait_line(lambda s: s.startswith("READY "), timeout)

    # processes
    def component_pid(self, name: str) -> int:
        """The pid of ``motor up``'s child ``name`` (controller, coordinator); 0 unless exactly
        one runs."""
        return self._child_pid(name)

    def nodemanager_pid(self, i: int) -> int:
        return self._child_pid("nodemanager", str(NM + i + self.off))

    def _child_pid(self, *words: str) -> int:
        found = [p for p in child_pids(self.up.pid, *words) if not exited(p)]
        return found[0] if len(found) == 1 else 0

    def start_nodemanager(self, i: int, role: str, job: str, controller: str) -> Proc:
        """NodeManager ``i`` (engine port ENGINE + 2i), registering with ``controller`` (an
        address of the test's choosing, such as a proxy's), started the way ``motor up`` starts
        its own."""
        state = self.state / f"own-nm-{i}"
        env = {
            "MOTOR_NODEMANAGER_CONTROLLER": controller,
            "MOTOR_NODEMANAGER_JOB_NAME": job,
            "MOTOR_NODEMANAGER_ROLE": role,
            "MOTOR_NODEMANAGER_MODEL": "motor-sim",
            "MOTOR_NODEMANAGER_ENGINE_TYPE": "sim",
            "MOTOR_NODEMANAGER_PORTS": json.dumps([ENGINE + 2 * i + self.off]),
            "MOTOR_NODEMANAGER_STATE_DIR": str(state),
            "MOTOR_UP_ENGINE_INDEX": str(i),
        }
        argv = ["nodemanager", "--config", str(self.config), "--port", str(NM + i + self.off)]
        argv += ["--metrics-port", str(NM_METRICS + i + self.off)]
        proc = Proc(motor_argv(*argv), cwd=self.tmp, env=env)
        self.own[i] = (proc, state)
        return proc

    def engine_pgids(self) -> list[int]:
        dirs = [self.state / f"nm-{i}" for i in range(self.nodes)] + [s for _, s in self.own.values()]
        pgids = []
        for d in dirs:
            with contextlib.suppress(Exception):
                pgids += [r.pgid for r in StateFile(d).read()]
        return pgids

    def close(self) -> None:
        """Everything stopped (SIGTERM, then SIGKILL to what is left), the ports handed back."""
        for proc, _ in self.own.values():
            with contextlib.suppress(subprocess.TimeoutExpired):  # killed all the same
                proc.stop(15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.up.stop(20)
        for pgid in self.engine_pgids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self.ports.close()

    # the two tables
    def instances(
        self, status: common_pb2.InstanceStatus.ValueType = common_pb2.INSTANCE_STATUS_UNSPECIFIED
    ) -> list[common_pb2.Instance]:
        """The Controller's ListInstances (live ones, or those in ``status``)."""
        with grpc.insecure_channel(self.controller, options=FRESH) as ch:
            resp = controller_pb2_grpc.ControllerStub(ch).ListInstances(
                controller_pb2.ListInstancesRequest(status=status), timeout=3
            )
        return list(resp.instances)

    def coordinator_table(self) -> coordinator_pb2.CoordinatorListInstancesResponse:
        with grpc.insecure_channel(self.coordinator, options=FRESH) as ch:
            return coordinator_pb2_grpc.CoordinatorStub(ch).ListInstances(
                coordinator_pb2.CoordinatorListInstancesRequest(), timeout=3
            )

    def serving(self, addr: str, service: str) -> bool:
        with grpc.insecure_channel(addr, options=FRESH) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=1
                )
            except grpc.RpcError:
                return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    def disagreement(self) -> str:
        """ "" when the Coordinator holds exactly what the Controller calls routable (ACTIVE and
        PAUSED instances, same identity) and routes to exactly its ACTIVE ones; else what differs."""
        ctl = self.instances()
        co = self.coordinator_table()
        want = {identity(i) for i in ctl if i.status in (ACTIVE, PAUSED)}
        held = {identity(i) for group in (co.available, co.unavailable, co.paused) for i in group}
        active = {i.id for i in ctl if i.status == ACTIVE}
        routed = {i.id for i in co.available}
        if want != held:
            return f"controller routable {sorted(want)} != coordinator held {sorted(held)}"
        if active != routed:
            return f"controller ACTIVE {sorted(active)} != coordinator available {sorted(routed)}"
        return ""

    def steady(self, count: int, timeout: float = 60.0) -> list[common_pb2.Instance]:
        """Wait for ``count`` ACTIVE instances and the two tables to agree; returns them."""

        def check() -> list[common_pb2.Instance] | None:
            live = self.instances()
            if len(live) != count or any(i.status != ACTIVE for i in live):
                return None
            diff = self.disagreement()
            if diff:
                raise AssertionError(diff)
            return live

        # Settling after a fault: a component may not answer yet (a restarted one, a Controller
        # that does not lead yet), and the tables may still differ (the last difference is shown).
        return wait_until(
            check,
            timeout,
            f"{count} ACTIVE instances, tables agreeing",
            retry=(AssertionError, grpc.RpcError),
            every=0.1,
        )

    def disk_statuses(self) -> dict[int, int]:
        """Instance id -> status as stored in the Controller's database (read-only). A database
        that cannot be read now (busy, its files changing) raises OSError, a "not yet" to polls."""
        try:
            con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5)
            try:
                return dict(con.execute("SELECT id, status FROM instances").fetchall())
            finally:
                con.close()
        except sqlite3.OperationalError as exc:
            raise OSError(f"{self.db}: {exc}") from exc


Identity = tuple[int, str, int, tuple[tuple[str, int], ...]]


def identity(i: common_pb2.Instance) -> Identity:
    return (i.id, i.job_name, i.role, tuple(sorted((e.host, e.port) for e in i.endpoints)))


def by_job(instances: list[common_pb2.Instance]) -> dict[str, common_pb2.Instance]:
    return {i.job_name: i for i in instances}


def pid_of(inst: common_pb2.Instance) -> int:
    return int(inst.endpoints[0].pid)


# -- load ----------------------------------------------------------------------------------------
@dataclass
class Request:
    at: float  # monotonic start
    stream: bool
    error: str = ""


@dataclass
class Load:
    """One client sending /v1/completions through the Coordinator, one at a time, starting one
    every ``period`` s at most; every ``stream_every``-th request streams. Each request and its
    outcome is kept, so a scenario counts the ones it overlapped."""

    base_url: str
    period: float = 0.05
    stream_every: int = 4
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos-load")
        self.client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, timeout=20)

    def _one(self, stream: bool) -> None:
        if stream:
            text = ""
            for chunk in self.client.completions.create(
                model="motor-sim", prompt="chaos, streaming", max_tokens=4, stream=True
            ):
                text += chunk.choices[0].text if chunk.choices else ""
            assert text, "empty stream"
        else:
            resp = self.client.completions.create(model="motor-sim", prompt="chaos", max_tokens=4)
            assert resp.choices and resp.choices[0].text, "empty completion"

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            req = Request(time.monotonic(), stream=n % self.stream_every == 0)
            try:
                self._one(req.stream)
            except Exception as exc:
                req.error = f"{type(exc).__name__}: {exc}"[:300]
            with self._lock:
                self.requests.append(req)
            self._stop.wait(max(0.0, req.at + self.period - time.monotonic()))

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def since(self, t: float) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.at >= t]

    def wait_served(self, n: int, since: float, timeout: float = 30.0) -> None:
        """Until ``n`` requests started after ``since`` were served."""
        wait_until(
            lambda: sum(not r.error for r in self.since(since)) >= n,
            timeout,
            f"{n} requests served",
            every=0.05,
        )


# -- results -------------------------------------------------------------------------------------
@dataclass
class Scenario:
    """One fault and its recovery. ``fault()`` when the fault is injected (the load is counted
    from then), ``recovered()`` when recovery is observed."""

    name: str
    load: Load
    what: str = ""  # the fault, in words (for bench/results/chaos.md)
    timed_from: str = "the fault"
    started: float = field(default_factory=time.monotonic)
    fault_at: float | None = None  # requests are counted from here
    clock_at: float | None = None  # recovery is timed from here (the fault, unless ``clock()``)
    recovered_at: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def fault(self) -> None:
        self.fault_at = self.clock_at = time.monotonic()

    def clock(self, label: str) -> None:
        """Time recovery from now (``label`` says from what) instead of from the fault: from
        when its cause was lifted, say."""
        self.clock_at = time.monotonic()
        self.timed_from = label

    def recovered(self) -> float:
        self.recovered_at = time.monotonic()
        return self.recovery_s or 0.0

    @property
    def recovery_s(self) -> float | None:
        if self.clock_at is None or self.recovered_at is None:
            return None
        return round(self.recovered_at - self.clock_at, 3)

    def counts(self) -> tuple[int, int, int, int]:
        """(failed non-streaming, non-streaming, failed streaming, streaming) since the fault."""
        reqs = self.load.since(self.fault_at if self.fault_at is not None else self.started)
        plain = [r for r in reqs if not r.stream]
        streams = [r for r in reqs if r.stream]
        return (
            sum(bool(r.error) for r in plain),
            len(plain),
            sum(bool(r.error) for r in streams),
            len(streams),
        )

    def errors(self, limit: int = 3) -> list[str]:
        reqs = self.load.since(self.fault_at if self.fault_at is not None else self.started)
        return [r.error for r in reqs if r.error][:limit]

    def finish(self, error: BaseException | None) -> None:
        failed_plain, plain, failed_stream, streams = self.counts()
        rec = {
            "scenario": self.name,
            "what": self.what,
            "timed_from": self.timed_from,
            "ok": error is None,
            "recovery_s": self.recovery_s,
            "failed": failed_plain + failed_stream,
            "total": plain + streams,
            "failed_nonstream": failed_plain,
            "total_nonstream": plain,
            "failed_stream": failed_stream,
            "total_stream": streams,
            "notes": self.notes,
        }
        if error is not None:
            rec["error"] = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        RESULTS.append(rec)
        print(f"\n{line(rec)}", flush=True)
        path = os.environ.get(RESULTS_ENV)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")


def line(rec: dict[str, Any]) -> str:
    rs = rec["recovery_s"]
    text = (
        f"chaos {rec['scenario']} recovery_s={'-' if rs is None else f'{rs:.2f}'} "
        f"failed={rec['failed']} total={rec['total']} "
        f"(non-streaming {rec['failed_nonstream']}/{rec['total_nonstream']}, "
        f"streaming {rec['failed_stream']}/{rec['total_stream']})"
    )
    if not rec["ok"]:
        text += f" FAILED: {rec.get('error', '')}"
    return text


@contextlib.contextmanager
def scenario(name: str, load: Load, what: str, cluster: Cluster | None = None) -> Iterator[Scenario]:
    """Run one scenario; its result is recorded however it ends. When it fails, the tail of
    ``cluster``'s logs is printed (pytest shows it with the failure)."""
    sc = Scenario(name, load, what)
    try:
        yield sc
    except BaseException as exc:
        sc.finish(exc)
        if cluster is not None:
            print(f"--- motor up, last lines ---\n{cluster.up.tail(120)}")
            for i, (proc, _) in cluster.own.items():
                print(f"--- NodeManager {i} (started by the test), last lines ---\n{proc.tail(40)}")
        raise
    sc.finish(None)
