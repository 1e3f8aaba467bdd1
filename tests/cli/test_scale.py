"""``motor scale`` against a real (in-process) Controller: it records a role's desired count and
says so in one line (or JSON), lists what is recorded, refuses bad usage with one line and exit
2, and a failed call with one line and exit 1. ``motor status`` shows the desired counts beside
the instances that run, and a Controller without ListDesiredInstances does not break it."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.cli import main as motor
from motor_mesh.cli import scale
from motor_mesh.common import errors, server
from motor_mesh.common.server import MotorServer
from motor_mesh.controller import validation
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2
from tests.controller.fakes import FakeCoordinator, FakeNodeManager, Harness, running_controller
from tests.poll import until
from tests.ports import reserved_port

DECODE = common_pb2.ROLE_DECODE


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "SHUTDOWN_DRAIN_S", 0.0)
    monkeypatch.setattr(server, "STOP_GRACE_S", 0.2)


def motor_cmd(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    """(exit code, stdout lines, stderr lines) of ``motor ARGV``."""
    rc = motor.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    """In a thread: the command runs its own event loop, the Controller runs in this one."""
    return await asyncio.to_thread(motor_cmd, capsys, *argv)


def listed(h: Harness) -> list[tuple[int, int]]:
    return [(d.role, d.replicas) for d in h.controller.desired.entries()]


async def test_it_records_a_count_and_says_so(tmp_path: Path, capsys) -> None:
    async with running_controller(tmp_path) as h:
        rc, out, err = await run(
            capsys, "scale", "--role", "decode", "--replicas", "3", "--controller", h.target
        )
        assert (rc, out, err) == (0, ["decode: 3 instances desired"], [])
        rc, out, err = await run(
            capsys, "scale", "--role", "prefill", "--replicas", "1", "--controller", h.target
        )
        assert (rc, out, err) == (0, ["prefill: 1 instance desired"], [])
        assert listed(h) == [(common_pb2.ROLE_PREFILL, 1), (DECODE, 3)]
        rc, out, _ = await run(
            capsys, "scale", "--role", "union", "--replicas", "0", "-o", "json", "--controller", h.target
        )
        doc = json.loads("\n".join(out))
        assert rc == 0 and (doc["role"], doc["replicas"]) == ("union", 0)
        assert doc["update_time"].endswith("+00:00")


async def test_it_lists_the_recorded_counts(tmp_path: Path, capsys) -> None:
    async with running_controller(tmp_path) as h:
        rc, out, err = await run(capsys, "scale", "--list", "--controller", h.target)
        assert (rc, err) == (0, []) and out == [
            "no desired instance counts recorded (motor scale --role ROLE --replicas N records one)"
        ]
        await h.controller.desired.set(DECODE, 4)
        await h.controller.desired.set(common_pb2.ROLE_PREFILL, 2)
        rc, out, err = await run(capsys, "scale", "--controller", h.target)  # no --role: the list
        assert (rc, err) == (0, [])
        assert out[0].split() == ["ROLE", "DESIRED", "SET_AT"]
        assert [line.split()[:2] for line in out[1:]] == [["prefill", "2"], ["decode", "4"]]
        rc, out, _ = await run(capsys, "scale", "--list", "-o", "json", "--controller", h.target)
        assert rc == 0 and [(e["role"], e["replicas"]) for e in json.loads("\n".join(out))] == [
            ("prefill", 2),
            ("decode", 4),
        ]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--role", "encode", "--replicas", "1"], "invalid choice: 'encode'"),
        (["--role", "decode", "--replicas", "1025"], "must be 0..1024"),
        (["--role", "decode", "--replicas", "-1"], "must be 0..1024"),
        (["--role", "decode", "--replicas", "many"], "expected a number of instances"),
        (["--role", "decode"], "--role needs --replicas N"),
        (["--replicas", "2"], "--replicas needs --role"),
        (["--list", "--role", "decode", "--replicas", "2"], "--list takes no --role or --replicas"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(capsys, argv: list[str], says: str) -> None:
    # Nothing listens there: usage is refused before any call.
    rc, out, err = motor_cmd(capsys, "scale", *argv, "--controller", f"127.0.0.1:{reserved_port()}")
    assert rc == 2 and out == []
    assert len(err) == 1 and err[0].startswith("motor scale: ") and says in err[0], err


def test_it_is_a_motor_command_with_help(capsys) -> None:
    assert motor.main(["--help"]) == 0
    assert "  scale " in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        scale.main(["--help"])
    assert done.value.code == 0 and "--replicas" in capsys.readouterr().out


async def test_an_unreachable_controller_is_one_line_and_exit_1(capsys) -> None:
    gone = f"127.0.0.1:{reserved_port()}"
    for argv in (["--role", "decode", "--replicas", "1"], ["--list"]):
        rc, out, err = await run(capsys, "scale", *argv, "--controller", gone, "--timeout", "1")
        assert rc == 1 and out == []
        assert len(err) == 1 and err[0].startswith(f"motor scale: cannot reach the Controller at {gone}"), err


async def test_a_refused_write_is_one_line_and_changes_nothing(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_controller(tmp_path) as h:
        await h.controller.desired.set(DECODE, 2)

        def full(fn: Any, args: Any) -> Any:
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(h.controller.store._writer, "_transaction", full)
        rc, out, err = await run(
            capsys, "scale", "--role", "decode", "--replicas", "5", "--controller", h.target, "--timeout", "3"
        )
        assert rc == 1 and out == [] and len(err) == 1
        assert err[0].startswith(
            f"motor scale: the Controller at {h.target} could not store it, nothing changed"
        )
        assert "database or disk is full" in err[0]
        assert listed(h) == [(DECODE, 2)]


async def test_the_management_key_file_is_sent(tmp_path: Path, capsys) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    key.chmod(0o600)
    async with running_controller(tmp_path / "state", management_key_file=str(key)) as h:
        rc, _, err = await run(
            capsys, "scale", "--role", "decode", "--replicas", "2", "--controller", h.target
        )
        assert rc == 1 and len(err) == 1 and "UNAUTHENTICATED" in err[0]
        rc, out, err = await run(
            capsys,
            "scale",
            "--role",
            "decode",
            "--replicas",
            "2",
            "--controller",
            h.target,
            "--key-file",
            str(key),
        )
        assert (rc, out, err) == (0, ["decode: 2 instances desired"], [])


# ---- motor status ----------------------------------------------------------------------------


class OlderController:
    """The Controller as served by a version without the desired counts: those two RPCs answer
    UNIMPLEMENTED, every other goes to the real servicer."""

    VALIDATORS = validation.VALIDATORS

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name in ("SetDesiredInstances", "ListDesiredInstances"):

            async def unimplemented(request: Any, context: Any) -> Any:
                raise errors.unimplemented(f"older Controller: no {name}")

            return unimplemented
        return getattr(self._inner, name)


@asynccontextmanager
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[Harness, FakeCoordinator, FakeNodeManager]]:
    """A Controller with one ACTIVE decode instance, and a Coordinator to show beside it."""
    coordinator = await FakeCoordinator().start()
    nm = await FakeNodeManager().start()
    try:
        async with running_controller(tmp_path) as h:
            await h.start_node(nm, job="d", role=DECODE)
            await until(lambda: h.instances(status=common_pb2.INSTANCE_STATUS_ACTIVE))
            yield h, coordinator, nm
    finally:
        await nm.stop()
        await coordinator.stop()


async def test_status_shows_the_desired_counts_beside_the_running_instances(tmp_path: Path, capsys) -> None:
    async with cluster(tmp_path) as (h, coordinator, _):
        where = ["--controller", h.target, "--coordinator", coordinator.address]
        rc, out, err = await run(capsys, "status", *where)
        assert (rc, err) == (0, []), err
        assert [line.split() for line in out if line.split()[:1] == ["desired"]] == [
            ["desired", "none", "recorded"]
        ]

        await h.controller.desired.set(DECODE, 3)
        await h.controller.desired.set(common_pb2.ROLE_PREFILL, 1)
        rc, out, err = await run(capsys, "status", *where)
        assert (rc, err) == (0, []), err
        assert out[1].split()[:3] == ["instances", "decode", "1"]  # the lines before it are as they were
        (line,) = [line for line in out if line.split()[:1] == ["desired"]]
        assert line.split() == ["desired", "prefill", "1", "(0", "running),", "decode", "3", "(1", "running)"]

        rc, out, _ = await run(capsys, "status", "-o", "json", *where)
        desired = json.loads("\n".join(out))["controller"]["desired"]
        assert rc == 0 and list(desired) == ["prefill", "decode"]
        assert {r: (d["replicas"], d["running"]) for r, d in desired.items()} == {
            "prefill": (1, 0),
            "decode": (3, 1),
        }
        assert all(d["update_time"] for d in desired.values())


async def test_status_against_a_controller_without_desired_counts(tmp_path: Path, capsys) -> None:
    async with cluster(tmp_path) as (h, coordinator, _):
        older = MotorServer(
            "controller",
            h.controller.cfg,
            [
                (
                    controller_pb2.DESCRIPTOR.services_by_name["Controller"],
                    OlderController(h.controller.servicer),
                )
            ],
            port=0,
        )
        await older.start()
        try:
            target = f"127.0.0.1:{older.port}"
            where = ["--controller", target, "--coordinator", coordinator.address]
            rc, out, err = await run(capsys, "status", *where)
            assert (rc, err) == (0, []), err
            assert out[0] == f"Controller {target}: SERVING"
            assert [line.split() for line in out if line.split()[:1] == ["desired"]] == [["desired", "-"]]
            rc, out, _ = await run(capsys, "status", "-o", "json", *where)
            doc = json.loads("\n".join(out))
            assert rc == 0 and doc["ok"] is True
            assert doc["controller"]["desired"] is None and doc["controller"]["error"] is None
            assert doc["controller"]["instances"]["decode"]["ACTIVE"] == 1

            rc, out, err = await run(capsys, "scale", "--list", "--controller", target)
            assert rc == 1 and err == [
                f"motor scale: the Controller at {target} records no desired counts (UNIMPLEMENTED: an older version)"
            ]
        finally:
            await older.stop()
