"""The table's way to the inference workers (services/coordinator/workers): the codec, the hub
and its links over real ipc sockets in one process, and real worker processes under the
supervisor (tests/coordinator/fake_worker.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_mesh.coordinator.precision.groups import Completed
from motor_mesh.coordinator.table import Drain, TableState, engines
from motor_mesh.coordinator.workers import codec
from motor_mesh.coordinator.workers.hub import WorkerHub, WorkersUnavailable
from motor_mesh.coordinator.workers.link import WorkerLink
from motor_mesh.coordinator.workers.procs import WorkerSupervisor
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.poll import until
from tests.procs import ROOT, exited

pytestmark = pytest.mark.timeout(30)


def instance(iid: int) -> c.Instance:
    endpoint = c.Endpoint(host="127.0.0.1", port=9000 + iid)
    return c.Instance(id=iid, role=c.ROLE_UNION, job_name=f"job-{iid}", model_name="m", endpoints=[endpoint])


def table(revision: int, *ids: int, paused: tuple[int, ...] = ()) -> TableState:
    insts = {i: instance(i) for i in ids}
    return TableState(insts, frozenset(paused), revision)


# ---- codec ---------------------------------------------------------------------------------------


def test_state_round_trip() -> None:
    state = table(7, 1, 2, 3, paused=(2,))
    state.instances[3].status = c.INSTANCE_STATUS_PAUSED
    assert codec.decode_state(codec.encode_state(state)) == state
    assert codec.decode_state(codec.encode_state(TableState())) == TableState()


def test_a_drain_reaches_the_workers_with_its_deadline() -> None:
    base = table(7, 1, 2)
    drained = TableState(base.instances, base.paused, 7, {2: Drain(1.75e9, engines(base.instances[2]), 7)})
    got = codec.decode_state(codec.encode_state(drained))
    # The revision that began it stays with the management process (it judges the reports).
    assert got.draining == {2: Drain(1.75e9, engines(base.instances[2]))}


def test_a_report_carries_loads_legs_and_the_revision_routed_by() -> None:
    report = codec.encode_report({1: 30, 2: 5}, {1: 2}, 9)
    assert codec.decode_report(report)[:3] == ({1: 30, 2: 5}, {1: 2}, 9)
    with pytest.raises(codec.CodecError):
        codec.decode_report(report[:-1])


def test_loads_and_sample_round_trip() -> None:
    loads = {1: 3, 2**64 - 1: 0, 5: -1}
    assert codec.decode_loads(codec.encode_loads(loads)) == loads
    per_worker = {0: loads, 3: {}, 7: {1: 1}}
    assert codec.decode_worker_loads(codec.encode_worker_loads(per_worker)) == per_worker
    # A lone surrogate is what json.loads makes of "\ud800": it must survive the trip too.
    done = Completed("/v1/chat/completions", "m", {"messages": [{"content": "h\u00e9\ud800"}], "n": 1.5})
    assert codec.decode_sample(codec.encode_sample(3, 4, done)) == (3, 4, done)


@pytest.mark.parametrize(
    "decode, data",
    [
        (codec.decode_state, b""),
        (codec.decode_state, b"\x09" + codec.encode_state(TableState())[1:]),  # another format
        (codec.decode_state, codec.encode_state(table(1, 1))[:-3]),
        (codec.decode_state, codec.encode_state(table(1, 1)) + b"x"),
        (codec.decode_loads, codec.encode_loads({1: 2})[:-1]),
        (codec.decode_worker_loads, b"\x01\x00\x00\x00"),
        (codec.decode_sample, b"\x00" * 16 + b"{not json"),
        (codec.decode_sample, b"\x00" * 16 + b'{"path": "/x"}'),
        (codec.unpack_peer, b"\x00"),
    ],
)
def test_malformed_bytes_are_codec_errors(decode: Callable[[bytes], Any], data: bytes) -> None:
    with pytest.raises(codec.CodecError):
        decode(data)


def test_unencodable_values_are_codec_errors() -> None:
    with pytest.raises(codec.CodecError):
        codec.encode_sample(1, 2, Completed("/v1/completions", "m", {"x": object()}))
    with pytest.raises(codec.CodecError):
        codec.encode_loads({-1: 0})


U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
endpoints = st.builds(
    c.Endpoint,
    id=U32,
    host=st.text(max_size=12),
    port=st.integers(0, 65535),
    bootstrap_port=st.integers(0, 65535),
    status=st.sampled_from(list(c.EndpointStatus.values())),
    headless=st.booleans(),
    device_ids=st.lists(U32, max_size=3),
    pid=st.integers(-(2**63), 2**63 - 1),
)
instances = st.builds(
    c.Instance,
    id=U64,
    role=st.sampled_from(list(c.Role.values())),
    job_name=st.text(max_size=12),
    model_name=st.text(max_size=12),
    engine_type=st.sampled_from(list(c.EngineType.values())),
    status=st.sampled_from(list(c.InstanceStatus.values())),
    endpoints=st.lists(endpoints, max_size=3),
    node_managers=st.lists(st.text(max_size=8), max_size=2),
)
states = st.builds(
    lambda insts, paused, rev: TableState({i.id: i for i in insts}, paused, rev),
    st.lists(instances, max_size=4),
    st.frozensets(U64, max_size=4),
    U64,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=50, deadline=None)
@given(states)
def test_state_round_trip_any(state: TableState) -> None:
    assert codec.decode_state(codec.encode_state(state)) == state


@given(st.dictionaries(U32, st.dictionaries(U64, st.integers(-(2**63), 2**63 - 1), max_size=4), max_size=4))
def test_worker_loads_round_trip_any(per_worker: dict[int, dict[int, int]]) -> None:
    assert codec.decode_worker_loads(codec.encode_worker_loads(per_worker)) == per_worker


@given(U64, U64, st.text(), st.text(), st.dictionaries(st.text(), json_values, max_size=4))
def test_sample_round_trip_any(p: int, d: int, path: str, model: str, request: dict[str, Any]) -> None:
    done = Completed(path, model, request)
    assert codec.decode_sample(codec.encode_sample(p, d, done)) == (p, d, done)


# ---- hub and links in one process ---------------------------------------------------------------


@pytest.fixture
def sock_dir() -> Iterator[str]:
    # Not tmp_path: a Unix socket path is at most 107 bytes. mkdtemp makes it mode 0700.
    path = tempfile.mkdtemp(prefix="motor-w-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def hub(sock_dir: str) -> AsyncIterator[WorkerHub]:
    h = WorkerHub(sock_dir, ack_timeout_s=5.0)
    await h.start()
    yield h
    await h.close()


class Worker:
    """A link and what its callbacks saw."""

    def __init__(self, sock_dir: str, index: int, **kw: Any) -> None:
        self.states: list[TableState] = []
        self.loads: dict[int, int] | None = None
        self.lost: list[str] = []
        self.fail = False  # on_state raises while set: the link does not acknowledge
        self.link = WorkerLink(sock_dir, index, self._state, self._loads, on_lost=self.lost.append, **kw)

    def _state(self, state: TableState) -> None:
        if self.fail:
            raise RuntimeError("cannot apply")
        self.states.append(state)

    def _loads(self, loads: dict[int, int]) -> None:
        self.loads = loads

    @property
    def revision(self) -> int:
        return self.states[-1].revision if self.states else -1


StartWorker = Callable[..., Awaitable[Worker]]


@pytest.fixture
async def worker(sock_dir: str) -> AsyncIterator[StartWorker]:
    started: list[Worker] = []

    async def start(index: int, **kw: Any) -> Worker:
        w = Worker(sock_dir, index, **kw)
        started.append(w)
        await w.link.start(timeout_s=5.0)
        return w

    yield start
    for w in started:
        await w.link.close()


async def test_start_returns_with_the_snapshot(hub: WorkerHub, worker: StartWorker) -> None:
    hub.set_state(table(4, 1, 2, paused=(2,)))
    w = await worker(0)
    assert w.states == [table(4, 1, 2, paused=(2,))]
    assert hub.live() == {0: os.getpid()}
    await until(lambda: hub.acked() == {0: 4}, timeout=5, what="the snapshot's ack")
    assert hub.serving() == {}
    w.link.serving()
    await hub.wait_serving(1, timeout=5)
    assert hub.serving() == {0: os.getpid()}
    with pytest.raises(TimeoutError):
        await hub.wait_serving(2, timeout=0.05)


async def test_publish_returns_once_every_worker_applied_it(hub: WorkerHub, worker: StartWorker) -> None:
    a, b = await worker(0), await worker(1)
    for revision in (1, 2, 3):
        state = table(revision, *range(1, revision + 1), paused=(1,))
        await hub.publish(state)
        # Nothing more awaited: each link had applied the state before publish returned.
        assert a.states[-1] == state and b.states[-1] == state
    assert [s.revision for s in a.states] == [0, 1, 2, 3]


async def test_an_older_or_equal_state_is_not_applied_again(hub: WorkerHub, worker: StartWorker) -> None:
    w = await worker(0)
    await hub.publish(table(2, 1))
    await hub.publish(table(1, 5))  # older than the hub's own: nothing new is sent
    await hub.publish(table(2, 1))  # the same revision again: acknowledged, not re-applied
    assert [s.revision for s in w.states] == [0, 2]
    assert hub.state == table(2, 1)


async def test_a_worker_that_missed_a_revision_asks_for_a_snapshot(
    hub: WorkerHub, worker: StartWorker
) -> None:
    a, b = await worker(0), await worker(1)
    # Stored, never published: only the beat tells the links there is something newer.
    hub.set_state(table(5, 7, 8))
    await until(lambda: a.revision == 5 and b.revision == 5, timeout=5, what="catch-up from the beat")
    assert a.states[-1] == table(5, 7, 8) == b.states[-1]
    await until(lambda: hub.acked() == {0: 5, 1: 5}, timeout=5, what="acks of the snapshots")


async def test_a_worker_that_does_not_acknowledge_makes_publish_unavailable(
    hub: WorkerHub, worker: StartWorker
) -> None:
    hub.ack_timeout_s = 0.3
    good, bad = await worker(0), await worker(1)
    bad.fail = True
    with pytest.raises(WorkersUnavailable) as err:
        await hub.publish(table(1, 1))
    assert err.value.missing == [1] and err.value.revision == 1
    assert good.revision == 1 and bad.revision == 0
    # Once it can apply again it catches up by itself (the beat shows it is behind).
    bad.fail = False
    await until(lambda: bad.revision == 1 and hub.acked()[1] == 1, timeout=5, what="catch-up")
    await hub.publish(table(2, 1, 2))
    assert bad.states[-1] == table(2, 1, 2)


async def test_a_forgotten_worker_is_not_waited_for(
    hub: WorkerHub, worker: StartWorker, sock_dir: str
) -> None:
    w = await worker(0)
    # A peer that says hello and then never acknowledges anything (a hung worker).
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(codec.addresses(sock_dir).snapshot)
    try:
        await dealer.send_multipart([codec.HELLO, codec.pack_peer(9, 42), codec.pack_u64(99999)])
        await hub.wait_live(2, timeout=5)
        assert hub.live() == {0: os.getpid(), 9: 99999}
        publishing = asyncio.create_task(hub.publish(table(1, 1)))
        await until(lambda: w.revision == 1, timeout=5, what="the healthy worker applied it")
        assert not publishing.done()
        hub.forget(9, 99999)  # its process exited: the write no longer waits for it
        await asyncio.wait_for(publishing, 5)
        assert hub.live() == {0: os.getpid()}
        # A hello the dead process still had queued does not make it live again.
        await dealer.send_multipart([codec.HELLO, codec.pack_peer(9, 42), codec.pack_u64(99999)])
        await hub.publish(table(2, 1))
        assert hub.live() == {0: os.getpid()}
    finally:
        dealer.close(linger=0)
        ctx.term()


async def test_a_restarted_worker_replaces_the_old_one(hub: WorkerHub, worker: StartWorker) -> None:
    old = await worker(0)
    await hub.publish(table(1, 1))
    await old.link.close()  # died without the supervisor noticing yet
    new = await worker(0)
    assert new.states == [table(1, 1)]
    assert list(hub.live()) == [0]
    await hub.publish(table(2, 1, 2))  # waits for the new link only
    assert new.revision == 2 and old.revision == 1


async def test_loads_are_shared_without_the_workers_own(hub: WorkerHub, worker: StartWorker) -> None:
    a, b, c_ = await worker(0), await worker(1), await worker(2)
    a.link.report_loads(lambda: {1: 3, 2: 1})
    b.link.report_loads(lambda: {1: 5})
    mine = {3: 4}
    c_.link.report_loads(lambda: dict(mine))
    await until(lambda: a.loads == {1: 5, 3: 4}, timeout=5, what="worker 0's view")
    await until(lambda: b.loads == {1: 3, 2: 1, 3: 4}, timeout=5, what="worker 1's view")
    await until(lambda: c_.loads == {1: 8, 2: 1}, timeout=5, what="worker 2's view")
    mine[3] = 0
    await until(lambda: a.loads == {1: 5, 3: 0}, timeout=5, what="a changed load")
    await b.link.close()
    hub.forget(1)  # a forgotten worker's loads leave everyone's sums
    await until(lambda: a.loads == {3: 0}, timeout=5, what="worker 1's loads gone")


async def test_samples_reach_the_hub(sock_dir: str, worker: StartWorker) -> None:
    got: list[tuple[int, int, Completed]] = []
    hub = WorkerHub(sock_dir, on_sample=lambda p, d, done: got.append((p, d, done)))
    await hub.start()
    try:
        w = await worker(0)
        done = Completed("/v1/completions", "m", {"prompt": "hi", "max_tokens": 4})
        w.link.send_sample(3, 4, done)
        w.link.send_sample(1, 2, Completed("/v1/completions", "m", {"bad": object()}))  # dropped
        await until(lambda: got, timeout=5, what="the sample")
        assert got == [(3, 4, done)]
        assert w.link.dropped_samples == 1
    finally:
        await hub.close()


async def test_a_worker_notices_the_hub_is_gone(sock_dir: str, worker: StartWorker) -> None:
    hub = WorkerHub(sock_dir)
    await hub.start()
    w = await worker(0, lost_after_s=0.5)
    await hub.close()
    await until(lambda: w.lost, timeout=5, what="on_lost")
    assert w.link.lost


async def test_a_worker_notices_the_hub_was_replaced(sock_dir: str, worker: StartWorker) -> None:
    first = WorkerHub(sock_dir)
    await first.start()
    w = await worker(0, lost_after_s=30)
    await first.close()
    second = WorkerHub(sock_dir)  # a new management process: its revisions start over
    await second.start()
    try:
        await until(lambda: w.lost, timeout=5, what="on_lost on another hub's beat")
    finally:
        await second.close()


async def test_the_socket_directory_must_be_private(sock_dir: str) -> None:
    os.chmod(sock_dir, 0o755)
    with pytest.raises(PermissionError):
        await WorkerHub(sock_dir).start()


def test_the_supervisor_does_not_import_grpc() -> None:
    code = "import sys, motor_mesh.coordinator.workers.procs; assert 'grpc' not in sys.modules, 'grpc'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=30)


# ---- real worker processes -----------------------------------------------------------------------


async def test_worker_processes(sock_dir: str, worker: StartWorker) -> None:
    """Two fake_worker processes (one on uvloop) under the supervisor: a SIGKILLed one is
    forgotten and restarted with the full table; a SIGSTOPped one makes a write UNAVAILABLE and
    catches up after SIGCONT."""
    applied: list[tuple[int, int, Completed]] = []
    hub = WorkerHub(sock_dir, ack_timeout_s=1.0, on_sample=lambda p, d, done: applied.append((p, d, done)))
    hub.set_state(table(1, 1, 2))
    await hub.start()

    def argv(i: int) -> list[str]:
        cmd = [sys.executable, "-m", "tests.coordinator.fake_worker", sock_dir, str(i), "--load", str(10 + i)]
        return cmd + (["--uvloop"] if i == 1 else [])

    def seen(index: int, pid: int) -> dict[int, dict[str, Any]]:
        """revision -> what worker ``index`` (process ``pid``) applied."""
        return {d: dict(done.request) for p, d, done in applied if p == index and done.model == str(pid)}

    exits: list[tuple[int, int]] = []
    sup = WorkerSupervisor(
        2, argv, hub, env={"PYTHONPATH": str(ROOT)}, on_exit=lambda i, pid: exits.append((i, pid))
    )
    await sup.start()
    try:
        await hub.wait_serving(2, timeout=20)
        pids = sup.pids()
        assert hub.live() == pids == hub.serving()
        await until(lambda: all(1 in seen(i, pid) for i, pid in pids.items()), timeout=10, what="snapshots")
        await hub.publish(table(2, 1, 2, 3))
        await until(lambda: all(2 in seen(i, pid) for i, pid in pids.items()), timeout=5, what="samples")

        observer = await worker(5)  # sees both processes' loads, not its own
        observer.link.report_loads(lambda: {1: 100})
        await until(lambda: observer.loads == {1: 21}, timeout=5, what="the processes' loads")

        # SIGKILL: forgotten at once, so the next write does not wait for it (it would time out).
        os.kill(pids[0], signal.SIGKILL)
        await until(lambda: hub.live().get(0) != pids[0], timeout=5, what="worker 0 forgotten")
        assert exits == [(0, pids[0])]
        await hub.publish(table(3, 1, 2, 3, 4, paused=(4,)))
        # Restarted, and its first table is the full current one.
        await until(lambda: sup.pids().get(0) not in (None, pids[0]), timeout=5, what="a new worker 0")
        new = sup.pids()[0]
        await until(lambda: 3 in seen(0, new), timeout=10, what="the new worker's snapshot")
        assert seen(0, new)[3] == {"ids": [1, 2, 3, 4], "paused": [4]}
        assert min(seen(0, new)) == 3
        await until(lambda: hub.live().get(0) == new, timeout=5, what="the new worker live")

        # SIGSTOP: live but silent, so the write is UNAVAILABLE naming it.
        os.kill(pids[1], signal.SIGSTOP)
        try:
            with pytest.raises(WorkersUnavailable) as err:
                await hub.publish(table(4, 1))
            assert err.value.missing == [1]
        finally:
            os.kill(pids[1], signal.SIGCONT)
        await until(lambda: hub.acked().get(1) == 4, timeout=5, what="worker 1 caught up")
        await hub.publish(table(5, 1, 2))
        assert sup.pids() == {0: new, 1: pids[1]}
    finally:
        await sup.stop(5.0)
        await hub.close()
    assert sup.pids() == {}
    assert sorted(exits) == sorted([(0, pids[0]), (0, new), (1, pids[1])])
    assert all(exited(pid) for pid in (*pids.values(), new))
