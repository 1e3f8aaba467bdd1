"""``motor status`` shows the planner (GetPlannerStatus): ``off`` while it is off; its last
decision, each role's split and p90 latency against its target and the SLA attainment, the
decision's reason, the switches in progress and the cooldowns otherwise, in text and in ``-o
json``; a Controller older than GetPlannerStatus shows nothing and nothing is wrong."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import timestamp_pb2

from motor_mesh.cli import main as motor
from motor_mesh.cli import status, status_table
from motor_mesh.common import errors, server
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2
from tests.controller.fakes import FakeCoordinator, running_controller
from tests.fake_controller import FakeController, FakeControllerServer
from tests.poll import until

PREFILL, DECODE = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "SHUTDOWN_DRAIN_S", 0.0)
    monkeypatch.setattr(server, "STOP_GRACE_S", 0.2)


def stamp(text: str) -> timestamp_pb2.Timestamp:
    t = timestamp_pb2.Timestamp()
    t.FromJsonString(text)
    return t


def switching() -> controller_pb2.GetPlannerStatusResponse:
    """The planner in act mode moving instance 4 from decode to prefill, instance 3 (switched
    earlier) in its cooldown."""
    return controller_pb2.GetPlannerStatusResponse(
        mode="act",
        decide_time=stamp("2025-01-02T12:00:03Z"),
        decision="switch",
        reason="3:1 instead of 2:2: predicted attainment 0.43 -> 1.00",
        roles=[
            controller_pb2.PlannerRole(
                role=PREFILL,
                instances=2,
                recommended=3,
                demand=5123.4567,
                capacity_per_instance=1800.0,
                latency_p90_ms=2100.04,
                target_ms=1000,
            ),
            controller_pb2.PlannerRole(
                role=DECODE,
                instances=2,
                recommended=1,
                demand=10.5,
                capacity_per_instance=40.0,
                latency_p90_ms=9.2,
                target_ms=50,
            ),
        ],
        predicted_attainment=0.4321,
        recommended_attainment=1.0,
        measured_attainment=0.55,
        switches=[
            controller_pb2.RoleSwitch(
                instance_id=4,
                from_role=DECODE,
                to_role=PREFILL,
                phase="drain",
                start_time=stamp("2025-01-02T12:00:04Z"),
                reason="planner: 3:1 instead of 2:2",
            )
        ],
        cooldowns=[
            controller_pb2.PlannerCooldown(instance_id=3, end_time=stamp("2025-01-02T12:04:10Z")),
            controller_pb2.PlannerCooldown(instance_id=7, end_time=stamp("2025-01-02T12:05:04Z")),
        ],
    )


def planner_section(lines: list[str]) -> list[str]:
    """The ``planner`` line of the Controller part and the lines that run on under it."""
    start = next(k for k, s in enumerate(lines) if s.startswith("  planner "))
    section = [lines[start]]
    for s in lines[start + 1 :]:
        if not s.startswith(" " * 14) or not s.strip():
            break
        section.append(s)
    return section


def controller(planner: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "address": "10.0.0.1:7100",
        "health": "SERVING",
        "error": None,
        "instances": None,
        "strategies_running": None,
        "fault_tolerance": None,
        "alarms": None,
        "desired": {},
        "planner": planner,
    }


# ---- the document and its text -------------------------------------------------------------


def test_off_is_the_mode_and_nothing_else() -> None:
    off = status.planner_entry(controller_pb2.GetPlannerStatusResponse(mode="off"))
    assert off == {
        "mode": "off",
        "decision": None,
        "reason": None,
        "decide_time": None,
        "predicted_attainment": None,
        "recommended_attainment": None,
        "measured_attainment": None,
        "roles": {},
        "switches": [],
        "cooldowns": [],
    }
    lines = status_table.controller_lines(controller(off))
    assert lines[-2:] == ["  desired     none recorded", "  planner     off"]


def test_a_decision_with_its_switches_and_cooldowns_as_json() -> None:
    doc = status.planner_entry(switching())
    assert json.loads(json.dumps(doc)) == {
        "mode": "act",
        "decision": "switch",
        "reason": "3:1 instead of 2:2: predicted attainment 0.43 -> 1.00",
        "decide_time": "2025-01-02T12:00:03+00:00",
        "predicted_attainment": 0.432,
        "recommended_attainment": 1.0,
        "measured_attainment": 0.55,
        "roles": {
            "prefill": {
                "instances": 2,
                "recommended": 3,
                "latency_p90_ms": 2100.0,
                "target_ms": 1000.0,
                "demand": 5123.457,
                "capacity_per_instance": 1800.0,
            },
            "decode": {
                "instances": 2,
                "recommended": 1,
                "latency_p90_ms": 9.2,
                "target_ms": 50.0,
                "demand": 10.5,
                "capacity_per_instance": 40.0,
            },
        },
        "switches": [
            {
                "instance_id": 4,
                "from": "decode",
                "to": "prefill",
                "phase": "drain",
                "since": "2025-01-02T12:00:04+00:00",
                "reason": "planner: 3:1 instead of 2:2",
            }
        ],
        "cooldowns": [
            {"instance_id": 3, "until": "2025-01-02T12:04:10+00:00"},
            {"instance_id": 7, "until": "2025-01-02T12:05:04+00:00"},
        ],
    }


def test_a_decision_with_its_switches_and_cooldowns_as_text() -> None:
    lines = status_table.controller_lines(controller(status.planner_entry(switching())))
    assert planner_section(lines) == [
        "  planner     act: switch at 12:00:03Z, prefill 2 -> 3 (TTFT p90 2100/1000 ms),",
        "              decode 2 -> 1 (ITL p90 9/50 ms); attainment predicted 0.43 -> 1.00, measured 0.55",
        "              3:1 instead of 2:2: predicted attainment 0.43 -> 1.00",
        "              instance 4: decode -> prefill (drain) since 12:00:04Z",
        "              cooldown: instance 3 until 12:04:10Z, instance 7 until 12:05:04Z",
    ]
    assert max(map(len, lines)) <= status_table.WIDTH


def test_a_long_reason_is_clipped_and_a_hold_wants_no_other_split() -> None:
    got = switching()
    got.decision, got.reason = "hold", "2:2 is the best split " + "x" * 200
    for r in got.roles:
        r.recommended = r.instances
    got.recommended_attainment = got.predicted_attainment
    del got.switches[:]
    del got.cooldowns[:]
    section = planner_section(status_table.controller_lines(controller(status.planner_entry(got))))
    assert section[:2] == [
        "  planner     act: hold at 12:00:03Z, prefill 2 (TTFT p90 2100/1000 ms), decode 2 (ITL p90 9/50 ms);",
        "              attainment predicted 0.43, measured 0.55",
    ]
    assert section[2].startswith("              2:2 is the best split xxx") and section[2].endswith("…")
    assert len(section) == 3 and len(section[2]) == status_table.WIDTH


def test_before_its_first_decision_nothing_is_predicted_nor_measured() -> None:
    learning = controller_pb2.GetPlannerStatusResponse(
        mode="recommend",
        roles=[
            controller_pb2.PlannerRole(role=PREFILL, instances=1, target_ms=1000),
            controller_pb2.PlannerRole(role=DECODE, instances=1, target_ms=50),
        ],
        measured_attainment=-1,
    )
    doc = status.planner_entry(learning)
    assert (doc["decision"], doc["decide_time"], doc["measured_attainment"]) == (None, None, None)
    assert planner_section(status_table.controller_lines(controller(doc))) == [
        "  planner     recommend: no decision yet, prefill 1 (TTFT p90 -/1000 ms),",
        "              decode 1 (ITL p90 -/50 ms); attainment measured -",
    ]
    learning.decision, learning.reason = "learning", "first interval: baseline"
    learning.decide_time.CopyFrom(stamp("2025-01-02T12:00:03Z"))
    assert planner_section(status_table.controller_lines(controller(status.planner_entry(learning)))) == [
        "  planner     recommend: learning at 12:00:03Z, prefill 1 (TTFT p90 -/1000 ms),",
        "              decode 1 (ITL p90 -/50 ms); attainment measured -",
        "              first interval: baseline",
    ]


def test_an_unknown_planner_is_a_dash() -> None:
    assert status_table.controller_lines(controller(None))[-2:] == [
        "  desired     none recorded",
        "  planner     -",
    ]


# ---- motor status against a Controller ----------------------------------------------------


def motor_cmd(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    rc = motor.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    """In a thread: the command runs its own event loop, the services run in this one."""
    return await asyncio.to_thread(motor_cmd, capsys, *argv)


class PlanningController(FakeController):
    """A fake Controller whose planner answers ``answer``, or fails with ``refuse``."""

    def __init__(
        self,
        answer: controller_pb2.GetPlannerStatusResponse | None = None,
        refuse: errors.MotorError | None = None,
    ) -> None:
        super().__init__()
        self.answer = answer or controller_pb2.GetPlannerStatusResponse(mode="off")
        self.refuse = refuse
        self.asked = 0

    async def GetPlannerStatus(self, request: Any, context: Any) -> Any:
        self.asked += 1
        if self.refuse is not None:
            raise self.refuse
        return self.answer


@asynccontextmanager
async def served(fake: FakeController) -> AsyncIterator[list[str]]:
    """``fake`` and a Coordinator beside it; the flags that name them."""
    coordinator = await FakeCoordinator().start()
    controller_server = await FakeControllerServer(fake).start()
    try:
        yield ["--controller", controller_server.address, "--coordinator", coordinator.address]
    finally:
        await controller_server.kill()
        await coordinator.stop()


async def test_status_shows_the_planner_of_the_controller(capsys) -> None:
    fake = PlanningController(switching())
    async with served(fake) as where:
        rc, out, err = await run(capsys, "status", *where)
        assert (rc, err) == (0, []), err
        assert planner_section(out) == [
            "  planner     act: switch at 12:00:03Z, prefill 2 -> 3 (TTFT p90 2100/1000 ms),",
            "              decode 2 -> 1 (ITL p90 9/50 ms); attainment predicted 0.43 -> 1.00, measured 0.55",
            "              3:1 instead of 2:2: predicted attainment 0.43 -> 1.00",
            "              instance 4: decode -> prefill (drain) since 12:00:04Z",
            "              cooldown: instance 3 until 12:04:10Z, instance 7 until 12:05:04Z",
        ]
        # Right after the desired counts: every line above it is as it was.
        assert out[out.index(planner_section(out)[0]) - 1].startswith("  desired ")

        rc, out, _ = await run(capsys, "status", "-o", "json", *where)
        doc = json.loads("\n".join(out))
        assert rc == 0 and doc["ok"] is True and doc["controller"]["error"] is None
        assert doc["controller"]["planner"] == status.planner_entry(switching())
        assert fake.asked == 2


async def test_status_against_a_controller_without_get_planner_status(capsys) -> None:
    older = PlanningController(refuse=errors.unimplemented("older Controller: no GetPlannerStatus"))
    async with served(older) as where:
        rc, out, err = await run(capsys, "status", *where)
        assert (rc, err) == (0, []), err
        assert planner_section(out) == ["  planner     -"]
        rc, out, _ = await run(capsys, "status", "-o", "json", *where)
        doc = json.loads("\n".join(out))
        assert rc == 0 and doc["ok"] is True
        assert doc["controller"]["planner"] is None and doc["controller"]["error"] is None


async def test_a_failed_planner_call_is_an_error(capsys) -> None:
    broken = PlanningController(refuse=errors.MotorError(grpc.StatusCode.INTERNAL, "planner broke"))
    async with served(broken) as where:
        rc, out, err = await run(capsys, "status", "-o", "json", *where)
        doc = json.loads("\n".join(out))
        assert rc == 1 and doc["ok"] is False and doc["controller"]["planner"] is None
        assert doc["controller"]["error"] == {"code": "INTERNAL", "message": "planner broke"}
        assert doc["controller"]["instances"] is not None  # the rest is still shown
        assert err == [f"motor status: not every part answered: Controller {where[1]} (INTERNAL)"]


async def test_status_against_the_real_controller(tmp_path: Path, capsys) -> None:
    coordinator = await FakeCoordinator().start()
    try:
        async with running_controller(tmp_path / "off") as h:
            where = ["--controller", h.target, "--coordinator", coordinator.address]
            rc, out, err = await run(capsys, "status", *where)
            assert (rc, err) == (0, []), err
            assert planner_section(out) == ["  planner     off"]

        async with running_controller(tmp_path / "on", planner={"mode": "recommend"}) as h:
            # Its first interval sets the baseline.
            await until(lambda: h.controller.planner.last.decision == "learning")
            where = ["--controller", h.target, "--coordinator", coordinator.address]
            rc, out, _ = await run(capsys, "status", "-o", "json", *where)
            planner = json.loads("\n".join(out))["controller"]["planner"]
            assert rc == 0 and (planner["mode"], planner["decision"]) == ("recommend", "learning")
            assert planner["measured_attainment"] is None and planner["decide_time"]
            assert list(planner["roles"]) == ["prefill", "decode"]
            rc, out, _ = await run(capsys, "status", *where)
            section = planner_section(out)
            assert rc == 0 and section[0].startswith("  planner     recommend: learning at ")
            assert section[-1] == "              first interval: baseline"
    finally:
        await coordinator.stop()
