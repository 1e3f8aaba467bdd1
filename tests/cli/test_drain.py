"""``motor drain``: DrainInstances on every Coordinator given, one line per instance, then (unless
--no-wait) asked again until nothing is in flight anywhere; one stderr line and exit 1 for a
failed call (NOT_FOUND names the id), --max-wait bounds the wait. Against in-process fake
Coordinators (tests/controller/fakes.py) that answer as the Coordinator does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest

from motor_mesh.cli import drain
from motor_mesh.cli import main as motor
from motor_mesh.common import server
from motor_mesh.gen.motor.v1 import common_pb2
from tests.controller.fakes import FakeCoordinator, FakeNodeManager
from tests.poll import until


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "SHUTDOWN_DRAIN_S", 0.0)
    monkeypatch.setattr(server, "STOP_GRACE_S", 0.2)
    monkeypatch.setattr(drain, "POLL_S", 0.05)


@pytest.fixture
async def coordinators() -> AsyncIterator[Callable[..., asyncio.Future[FakeCoordinator]]]:
    started: list[FakeCoordinator] = []

    async def start(*ids: int) -> FakeCoordinator:
        c = await FakeCoordinator().start()
        c.table = {i: common_pb2.Instance(id=i) for i in ids}
        started.append(c)
        return c

    yield start  # type: ignore[misc]
    for c in started:
        await c.stop()


def motor_drain(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    """(exit code, stdout lines, stderr lines) of ``motor drain ARGV``."""
    rc = motor.main(["drain", *argv])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


async def test_it_drains_waits_until_nothing_is_in_flight_and_says_so(coordinators, capsys) -> None:
    c = await coordinators(7)
    c.in_flight[7] = 2
    run = asyncio.create_task(asyncio.to_thread(motor_drain, capsys, "7", "--coordinator", c.address))
    await until(lambda: len(c.ok_calls("Drain")) >= 3)  # asked again while requests remain
    assert not run.done()
    c.in_flight[7] = 0
    rc, out, err = await run
    assert (rc, err) == (0, [])
    assert out[0].startswith("instance 7: requests move at ") and out[0].endswith(", 2 in flight")
    assert out[1:] == [out[-2], out[-1]] and out[-2] == "instance 7: drained"
    assert out[-1].startswith("drained: nothing in flight on instance(s) 7 on 1 Coordinator(s) after ")
    # No grace given: the Coordinator's own.
    assert not c.ok_calls("Drain")[0].HasField("grace")
    assert [list(r.ids) for r in c.ok_calls("Drain")] == [[7]] * len(c.ok_calls("Drain"))


async def test_no_wait_starts_the_drain_prints_it_and_exits(coordinators, capsys) -> None:
    c = await coordinators(7, 9)
    c.in_flight.update({7: 3, 9: 1})
    rc, out, err = await asyncio.to_thread(
        motor_drain, capsys, "7", "0x9", "--grace", "0", "--no-wait", "--coordinator", c.address
    )
    assert (rc, err) == (0, [])
    assert [line.split(":")[0] for line in out] == ["instance 7", "instance 9"]
    assert out[0].endswith(", 3 in flight") and out[1].endswith(", 1 in flight")
    (req,) = c.ok_calls("Drain")
    assert list(req.ids) == [7, 9] and req.HasField("grace") and req.grace.ToNanoseconds() == 0
    assert set(c.draining) == {7, 9}


async def test_every_coordinator_is_drained_and_waited_for(coordinators, capsys) -> None:
    a, b = await coordinators(7), await coordinators(7)
    b.in_flight[7] = 1
    both = f"{a.address},{b.address}"
    run = asyncio.create_task(
        asyncio.to_thread(motor_drain, capsys, "7", "--coordinator", both, "-o", "json")
    )
    await until(lambda: len(b.ok_calls("Drain")) >= 2)
    assert not run.done() and a.ok_calls("Drain")
    b.in_flight[7] = 0
    rc, out, err = await run
    assert (rc, err) == (0, [])
    first, *_, last = (json.loads(line) for line in out)
    assert first["instance_id"] == 7 and first["requests_in_flight"] == 1
    assert [(x["address"], x["requests_in_flight"]) for x in first["coordinators"]] == [
        (a.address, 0),
        (b.address, 1),
    ]
    assert last["drained"] is True and last["instance_ids"] == [7]


async def test_an_unknown_id_is_named(coordinators, capsys) -> None:
    c = await coordinators(7)
    rc, out, err = await asyncio.to_thread(motor_drain, capsys, "7", "8", "--coordinator", c.address)
    assert rc == 1 and out == []
    assert err == [f"motor drain: the Coordinator at {c.address} holds no instance 8 (NOT_FOUND)"]
    assert not c.draining  # all or nothing


async def test_an_older_coordinator_is_said_to_be_one(coordinators, capsys) -> None:
    c = await coordinators(7)
    c.drain_unimplemented = True
    rc, _, err = await asyncio.to_thread(motor_drain, capsys, "7", "--coordinator", c.address)
    assert rc == 1 and err == [
        f"motor drain: the Coordinator at {c.address} cannot drain (UNIMPLEMENTED: an older version)"
    ]


async def test_an_unreachable_coordinator_fails_with_one_line(coordinators, capsys) -> None:
    c = await coordinators(7)
    address = c.address
    await c.stop()
    rc, out, err = await asyncio.to_thread(
        motor_drain, capsys, "7", "--coordinator", address, "--timeout", "2"
    )
    assert rc == 1 and out == []
    assert len(err) == 1 and err[0].startswith(f"motor drain: cannot reach the Coordinator at {address}")


async def test_max_wait_gives_up_and_the_drain_stays(coordinators, capsys) -> None:
    c = await coordinators(7)
    c.in_flight[7] = 4
    rc, out, err = await asyncio.to_thread(
        motor_drain, capsys, "7", "--coordinator", c.address, "--max-wait", "0.3"
    )
    assert rc == 1 and out[0].endswith(", 4 in flight")
    assert err == ["motor drain: still in flight after 0.3s: 4 on instance 7 (the drain stays)"]
    assert 7 in c.draining


async def test_an_instance_deleted_while_waiting_has_nothing_left(coordinators, capsys) -> None:
    c = await coordinators(7, 9)
    c.in_flight.update({7: 1, 9: 1})
    run = asyncio.create_task(asyncio.to_thread(motor_drain, capsys, "7", "9", "--coordinator", c.address))
    await until(lambda: len(c.ok_calls("Drain")) >= 2)
    del c.table[7]  # the Controller deleted it: its requests continue elsewhere
    c.in_flight[7] = 0
    await until(lambda: [list(r.ids) for r in c.ok_calls("Drain")][-1] == [9])
    c.in_flight[9] = 0
    rc, out, err = await run
    assert (rc, err) == (0, []) and out[-1].startswith("drained: nothing in flight on instance(s) 7 9")


async def test_the_instance_of_a_nodemanager(coordinators, capsys) -> None:
    c = await coordinators(5)
    nm = await FakeNodeManager().start()
    try:
        nm.instance_id = 5
        rc, out, err = await asyncio.to_thread(
            motor_drain,
            capsys,
            "--nodemanager",
            f"{nm.host}:{nm.port}",
            "--coordinator",
            f"dns:///127.0.0.1:{c.port}",
        )
        assert (rc, err) == (0, []) and out[0].startswith("instance 5: ")
        nm.instance_id = 0
        rc, out, err = await asyncio.to_thread(
            motor_drain, capsys, "--nodemanager", f"{nm.host}:{nm.port}", "--coordinator", c.address
        )
        assert rc == 1 and err == [
            f"motor drain: the NodeManager at {nm.host}:{nm.port} serves no instance yet"
        ]
    finally:
        await nm.stop()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "name at least one instance ID"),
        (["7", "7"], "an instance ID is named twice"),
        (["0"], "instance id must be 1..2^64-1"),
        (["x"], "expected an instance id"),
        (["7", "--grace", "-1"], "must be 0 or more seconds"),
    ],
)
def test_bad_usage_exits_2(capsys, argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as done:
        drain.main(argv)
    assert done.value.code == 2 and says in capsys.readouterr().err


def test_it_is_a_motor_command_with_help(capsys) -> None:
    assert motor.main(["--help"]) == 0
    assert "  drain " in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        drain.main(["--help"])
    assert done.value.code == 0 and "--no-wait" in capsys.readouterr().out
