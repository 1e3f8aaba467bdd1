"""The planner (controller/planner/): its model, its signals, and its decisions carried out as role
switches, against an in-process Controller with fake NodeManagers and a fake Coordinator,
through the Controller's gRPC API.

What the planner measures is replaced by a stub for the decision tests (the Signals test reads
real GetEngineMetrics answers); what it does is observed where an operator would: the
NodeManagers' SwitchRole calls, ListInstances, the Coordinator's table, GetPlannerStatus,
GetFaultToleranceStatus and /metrics."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest

from motor_mesh.common import errors
from motor_mesh.controller import metrics
from motor_mesh.controller.planner import model
from motor_mesh.controller.planner.signals import RoleLoad, Sample, Signals, Window
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, coordinator_pb2
from tests.controller.fakes import (
    ACTIVE,
    INACTIVE,
    NORMAL,
    FakeCoordinator,
    FakeNodeManager,
    Harness,
    running_controller,
)
from tests.poll import until

PREFILL, DECODE = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE


@pytest.fixture(autouse=True)
def info_records(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="motor")


def logged(caplog: pytest.LogCaptureFixture, event: str) -> list[Any]:
    return [r.fields for r in caplog.records if r.getMessage() == event]  # type: ignore[attr-defined]


# ---- the model -------------------------------------------------------------------------------------


def window(p90_s: float, n: float = 100) -> Window:
    """``n`` observations whose p90 is about ``p90_s``."""
    return Window(((p90_s / 2, 0.0), (p90_s, n), (math.inf, n)))


def test_window_quantile_interpolates_inside_the_bucket() -> None:
    w = Window(((0.1, 50.0), (0.2, 90.0), (0.5, 100.0), (math.inf, 100.0)))
    assert w.quantile(0.9) == pytest.approx(0.2)
    assert w.quantile(0.5) == pytest.approx(0.1)
    assert w.quantile(0.95) == pytest.approx(0.35)
    assert w.within(0.2) == pytest.approx(0.9)
    assert Window().quantile(0.9) is None
    # Past the last finite bound: that bound.
    assert Window(((0.1, 0.0), (math.inf, 10.0))).quantile(0.9) == 0.1


def test_capacity_is_the_load_scaled_to_the_target_within_bounds() -> None:
    assert model.capacity_sample(100, 0.5, 1.0, False) == pytest.approx(200)  # room: 2x at most
    assert model.capacity_sample(100, 0.9, 1.0, False) == pytest.approx(111.1, rel=1e-3)
    assert model.capacity_sample(100, 4.0, 1.0, False) == pytest.approx(50)  # far over: 0.5x
    assert model.capacity_sample(100, 4.0, 1.0, True) == pytest.approx(80)  # queued: 0.8x
    assert model.capacity_sample(0, 0.5, 1.0, False) is None
    assert model.capacity_sample(100, None, 1.0, False) is None


def test_a_light_interval_never_lowers_what_was_learned_from_a_busy_one() -> None:
    c = model.Ewma(model.CAPACITY_ALPHA)
    model.learn_capacity(c, 100, 1.0, 1.0, saturated=False)  # busy, at the target: 100
    assert c.value == pytest.approx(100)
    for _ in range(20):  # idle: 10 per instance at a tenth of the target
        model.learn_capacity(c, 10, 0.1, 1.0, saturated=False)
    assert c.value == pytest.approx(100)
    model.learn_capacity(c, 150, 0.2, 1.0, saturated=False)  # light, but carried more: a floor
    assert c.value == pytest.approx(150)
    model.learn_capacity(c, 100, 2.0, 1.0, saturated=True)  # over the target, queued: 80
    assert c.value == pytest.approx(0.3 * 80 + 0.7 * 150)
    fresh = model.Ewma(model.CAPACITY_ALPHA)
    model.learn_capacity(fresh, 10, 0.1, 1.0, saturated=False)  # the first says what it can
    assert fresh.value == pytest.approx(20)


def test_choose_keeps_the_minimums_and_holds_when_every_split_meets_the_targets() -> None:
    # Prefill needs 4.6 instances, decode 1.15, of 4: 3:1 is the best the minimums allow.
    c = model.choose(4, 4.6, 1.15, 1, 1, current_prefill=2)
    assert (c.prefill, c.decode) == (3, 1)
    assert c.attainment > c.current
    # Both met with the split there is: nothing gains.
    c = model.choose(4, 1.0, 1.0, 1, 1, current_prefill=2)
    assert (c.prefill, c.decode) == (2, 2) and c.gain == 0
    # min_decode 2 of 4: at most 2 prefill.
    assert model.choose(4, 10, 0.5, 1, 2, current_prefill=1).prefill == 2
    # A pool smaller than both minimums keeps its split.
    c = model.choose(1, 5, 5, 1, 1, current_prefill=1)
    assert (c.prefill, c.decode, c.gain) == (1, 0, 0)


# ---- the signals -----------------------------------------------------------------------------------


def _hist(name: str, counts: dict[str, float]) -> list[coordinator_pb2.MetricSample]:
    return [
        coordinator_pb2.MetricSample(name=f"{name}_bucket", labels={"le": le}, value=v)
        for le, v in counts.items()
    ]


def _metrics(ttft: dict[str, float], itl: dict[str, float], prompt: float, finished: float) -> Any:
    def gauge(name: str, role: str, v: float) -> coordinator_pb2.MetricSample:
        return coordinator_pb2.MetricSample(name=name, labels={"role": role}, value=v)

    engines = coordinator_pb2.MetricFamily(
        name="all",
        samples=[
            gauge("vllm:num_requests_running", "decode", 12),
            gauge("vllm:num_requests_waiting", "prefill", 3),
            gauge("motor:prompt_tokens_per_second", "prefill", 5000),
            gauge("vllm:kv_cache_usage_perc", "decode", 0.4),
            gauge("vllm:prompt_tokens_total", "prefill", prompt),
            gauge("vllm:e2e_request_latency_seconds_count", "prefill", finished),
        ],
    )
    own = coordinator_pb2.MetricFamily(
        name="own",
        samples=_hist("motor_coordinator_time_to_first_byte_seconds", ttft)
        + _hist("motor_coordinator_inter_token_seconds", itl),
    )
    return coordinator_pb2.GetEngineMetricsResponse(families=[engines], coordinator_families=[own])


class Answers:
    def __init__(self) -> None:
        self.now: dict[str, Any] = {}

    async def engine_metrics(self) -> dict[str, Any]:
        return self.now


async def test_signals_are_the_change_since_the_last_read_over_every_coordinator() -> None:
    answers = Answers()
    t = [0.0]
    signals = Signals(answers, clock=lambda: t[0])
    a0 = _metrics({"0.1": 10, "1": 10, "+Inf": 10}, {"0.01": 0, "0.05": 0, "+Inf": 0}, 1000, 10)
    b0 = _metrics({"0.1": 0, "1": 0, "+Inf": 0}, {"0.01": 0, "0.05": 0, "+Inf": 0}, 1000, 10)
    answers.now = {"a:1": a0, "b:1": b0}
    assert await signals.read() is None  # the baseline
    t[0] = 2.0
    # a: 10 more TTFTs under 1 s, none under 0.1; b: 10 more under 0.1 s. ITL: 20 under 10 ms.
    answers.now = {
        "a:1": _metrics({"0.1": 10, "1": 20, "+Inf": 20}, {"0.01": 10, "0.05": 10, "+Inf": 10}, 3000, 30),
        "b:1": _metrics({"0.1": 10, "1": 10, "+Inf": 10}, {"0.01": 10, "0.05": 10, "+Inf": 10}, 3000, 30),
    }
    s = await signals.read()
    assert s is not None and s.seconds == 2.0 and s.coordinators == 2
    assert s.ttft.count == 20 and s.ttft.within(0.1) == 0.5
    assert s.ttft.quantile(0.9) == pytest.approx(0.1 + 0.9 * 0.8)
    assert s.itl.count == 20 and s.itl.quantile(0.9) == pytest.approx(0.009)
    # Engines: from one Coordinator, not summed; 2000 prompt tokens over 20 requests.
    assert s.prefill.waiting == 3 and s.prefill.prompt_tps == 5000
    assert s.prefill.prompt_tokens_per_request == pytest.approx(100)
    assert s.decode.running == 12 and s.decode.kv_usage == pytest.approx(0.4)
    # A Coordinator that restarted (its counts went down) counts from zero.
    t[0] = 3.0
    answers.now = {
        "a:1": _metrics({"0.1": 1, "1": 1, "+Inf": 1}, {"0.01": 0, "0.05": 0, "+Inf": 0}, 3000, 30),
        "b:1": _metrics({"0.1": 10, "1": 10, "+Inf": 10}, {"0.01": 10, "0.05": 10, "+Inf": 10}, 3000, 30),
    }
    s = await signals.read()
    assert s is not None and s.ttft.count == 1
    answers.now = {}
    assert await signals.read() is None


# ---- decisions carried out ---------------------------------------------------------------------------


class StubSignals:
    """What the planner measures, as the test says."""

    def __init__(self, sample: Sample | None) -> None:
        self.sample = sample

    async def read(self) -> Sample | None:
        return self.sample


def sample(
    *,
    ttft_s: float,
    itl_s: float,
    prompt_tps: float,
    running: float,
    waiting_p: float = 0,
    waiting_d: float = 0,
) -> Sample:
    return Sample(
        seconds=1.0,
        ttft=window(ttft_s),
        itl=window(itl_s),
        prefill=RoleLoad(prompt_tps=prompt_tps, waiting=waiting_p, prompt_tokens_per_request=100),
        decode=RoleLoad(running=running, waiting=waiting_d),
        coordinators=1,
    )


# 2 prefill instances at 1000 prompt tokens/s each with a TTFT p90 twice the target (1 s); 2 decode
# instances at 2 sequences each with ITL far under its target (50 ms): prefill needs ~4.6
# instances, decode ~1.2.
PREFILL_HEAVY = sample(ttft_s=2.1, itl_s=0.01, prompt_tps=2000, running=4)
# The other way round: prefill has room, decode is over its ITL target.
DECODE_HEAVY = sample(ttft_s=0.1, itl_s=0.2, prompt_tps=200, running=40)
# Both comfortably within their targets.
CALM = sample(ttft_s=0.2, itl_s=0.02, prompt_tps=200, running=4)


def planner_cfg(mode: str = "act", **kw: Any) -> dict[str, Any]:
    return {"mode": mode, "interval_s": 0.5, "cooldown_s": 300, "min_gain": 0.1, **kw}


async def cluster(
    h: Harness, node_managers: Any, prefill: int, decode: int
) -> tuple[dict[int, FakeNodeManager], dict[int, int]]:
    """Instances of one fake NodeManager each, ACTIVE; their NodeManagers and roles by id."""
    nms: dict[int, FakeNodeManager] = {}
    for i, role in enumerate([PREFILL] * prefill + [DECODE] * decode):
        nm = await node_managers()
        nm.ready = True
        agent = await h.start_node(nm, job=f"job{i}", role=role, ports=(10000 + 2 * i,))
        nms[agent.instance_id or nm.starts[-1].instance_id] = nm
    await until(lambda: len(h.controller.table.find(status=ACTIVE)) == prefill + decode)
    return nms, {i: nm.role for i, nm in nms.items()}


async def roles(h: Harness) -> dict[int, int]:
    return {i.id: i.role for i in await h.instances()}


async def status(h: Harness) -> controller_pb2.GetPlannerStatusResponse:
    return await h.stub.GetPlannerStatus(controller_pb2.GetPlannerStatusRequest(), timeout=5)


def exposition(h: Harness) -> str:
    """The Controller's /metrics page, as Prometheus would read it."""
    return generate_latest(metrics.registry(h.controller)).decode()


def set_signals(h: Harness, s: Sample | None) -> StubSignals:
    stub = StubSignals(s)
    h.controller.planner.signals = stub  # type: ignore[assignment]
    return stub


async def test_a_switch_moves_one_instance_to_the_other_role_end_to_end(
    tmp_path, node_managers, coordinator: FakeCoordinator, caplog
) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address], planner=planner_cfg()) as h:
        set_signals(h, None)
        nms, before = await cluster(h, node_managers, prefill=2, decode=2)
        await until(lambda: len(coordinator.table) == 4)
        set_signals(h, PREFILL_HEAVY)
        # One decode instance becomes a prefill instance: 3:1, the best the minimums allow.
        moved = await until(lambda: [i for i, nm in nms.items() if nm.switched], what="a switch")
        assert len(moved) == 1 and before[moved[0]] == DECODE and nms[moved[0]].switched == [PREFILL]
        iid = moved[0]
        await until(lambda: coordinator.table.get(iid) is not None and coordinator.table[iid].role == PREFILL)

        async def settled() -> bool:
            r = await roles(h)
            return list(r.values()).count(PREFILL) == 3 and r[iid] == PREFILL

        await until(settled, what="3 prefill instances")
        inst = next(i for i in await h.instances() if i.id == iid)
        assert inst.status == ACTIVE  # same id, new role, back in routing
        # It was drained first, then out of every Coordinator's table while it switched.
        drains = [r for r in coordinator.ok_calls("Drain") if iid in r.ids]
        assert drains
        deleted = [r for r in coordinator.ok_calls("Delete") if any(i.id == iid for i in r.instances)]
        assert deleted and deleted[0].instances[0].role == DECODE
        # Its history shows the switch.
        ft = await h.stub.GetFaultToleranceStatus(
            controller_pb2.GetFaultToleranceStatusRequest(instance_id=iid), timeout=5
        )
        assert any("RoleSwitch decode->prefill succeeded" in e for e in ft.instances[0].history)
        st = await status(h)
        assert st.mode == "act" and st.decision in ("switch", "hold")
        assert [c.instance_id for c in st.cooldowns] == [iid]
        assert logged(caplog, "role_switch_finished")[0]["outcome"] == "succeeded"
        assert [r.recommended for r in st.roles] == [3, 1]
        exposed = exposition(h)
        assert 'motor_planner_recommended_instances{role="prefill"} 3.0' in exposed
        assert 'motor_planner_recommended_instances{role="decode"} 1.0' in exposed
        assert 'motor_controller_role_switches_total{outcome="succeeded"} 1.0' in exposed
        # At 3:1 the minimum holds every further move: no second switch.
        seen = len(logged(caplog, "planner_decision"))
        await until(lambda: len(logged(caplog, "planner_decision")) >= seen + 3)
        assert sum(len(nm.switched) for nm in nms.values()) == 1


async def test_recommend_mode_changes_nothing(tmp_path, node_managers, coordinator, caplog) -> None:
    async with running_controller(
        tmp_path, coordinators=[coordinator.address], planner=planner_cfg("recommend")
    ) as h:
        set_signals(h, None)
        nms, before = await cluster(h, node_managers, prefill=2, decode=2)
        set_signals(h, PREFILL_HEAVY)
        decisions = await until(
            lambda: [d for d in logged(caplog, "planner_decision") if d["decision"] == "recommend"]
        )
        assert decisions[0]["recommended_prefill"] == 3 and decisions[0]["recommended_decode"] == 1
        st = await status(h)
        assert st.decision == "recommend" and [r.recommended for r in st.roles] == [3, 1]
        # Several decisions later: no NodeManager was asked anything, roles as they were.
        await until(lambda: len(logged(caplog, "planner_decision")) >= 4)
        assert all(nm.switch_calls == 0 for nm in nms.values())
        assert await roles(h) == before


async def test_never_below_the_minimum_per_role(tmp_path, node_managers, coordinator, caplog) -> None:
    async with running_controller(
        tmp_path, coordinators=[coordinator.address], planner=planner_cfg(min_decode=2)
    ) as h:
        set_signals(h, None)
        nms, before = await cluster(h, node_managers, prefill=1, decode=2)
        set_signals(h, PREFILL_HEAVY)
        holds = await until(
            lambda: [d for d in logged(caplog, "planner_decision") if d["decision"] == "hold"]
        )
        assert holds[0]["recommended_decode"] == 2
        await until(lambda: len(logged(caplog, "planner_decision")) >= 3)
        assert all(nm.switch_calls == 0 for nm in nms.values())
        assert await roles(h) == before


async def test_one_switch_at_a_time(tmp_path, node_managers, coordinator) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address], planner=planner_cfg()) as h:
        set_signals(h, None)
        nms, _ = await cluster(h, node_managers, prefill=1, decode=4)
        for nm in nms.values():
            nm.switch_delay = 0.5  # each switch takes a while to answer
        set_signals(h, sample(ttft_s=3.0, itl_s=0.005, prompt_tps=1000, running=2))
        most = 0

        def two_done() -> bool:
            nonlocal most
            most = max(most, len(h.controller.switches.running()))
            return sum(len(nm.switched) for nm in nms.values()) >= 2 and not h.controller.switches.running()

        await until(two_done, timeout=30, every=0.005)
        assert most == 1


async def test_an_instance_in_its_cooldown_is_not_switched(tmp_path, node_managers, coordinator) -> None:
    async with running_controller(
        tmp_path, coordinators=[coordinator.address], planner=planner_cfg(cooldown_s=1.5)
    ) as h:
        set_signals(h, None)
        nms, _before = await cluster(h, node_managers, prefill=2, decode=2)
        table = h.controller.table
        for inst in list(table.live.values()):
            if inst.spec.role == DECODE:
                await table.update(inst, switched_at=time.time())  # as if just switched
        set_signals(h, PREFILL_HEAVY)
        st = await until(lambda: _cooling(h), what="the cooldowns listed")
        assert len(st.cooldowns) == 2
        assert all(nm.switch_calls == 0 for nm in nms.values())
        # Once the cooldown is over the decision is carried out.
        await until(lambda: any(nm.switched for nm in nms.values()), timeout=15)


async def _cooling(h: Harness) -> Any:
    st = await status(h)
    return st if st.decision == "switch" and st.cooldowns else None


async def test_no_switch_while_a_relaunch_runs(tmp_path, node_managers, coordinator, caplog) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address], planner=planner_cfg()) as h:
        set_signals(h, None)
        nms, before = await cluster(h, node_managers, prefill=2, decode=2)
        # A prefill engine dies: the fault manager relaunches it, and the relaunch hangs.
        victim = next(i for i, r in before.items() if r == PREFILL)
        nms[victim].ready = False
        agent = next(a for a in h.agents if a.nm is nms[victim])
        await agent.event(nms[victim].starts[-1].endpoints[0].id, 40000)
        await until(lambda: h.controller.table.live[victim].strategy.name == "EngineRelaunch")
        set_signals(h, DECODE_HEAVY)
        blocked = await until(
            lambda: [d for d in logged(caplog, "planner_decision") if d["decision"] == "blocked"]
        )
        assert "EngineRelaunch running" in blocked[0]["reason"]
        assert all(nm.switch_calls == 0 for nm in nms.values())
        # The relaunch over, the decision goes ahead.
        nms[victim].ready = True
        await agent.beat(NORMAL)
        await until(lambda: any(nm.switched for nm in nms.values()), timeout=20)


async def test_a_refused_switch_rolls_back(tmp_path, node_managers, coordinator, caplog) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address], planner=planner_cfg()) as h:
        set_signals(h, None)
        nms, _before = await cluster(h, node_managers, prefill=2, decode=2)
        for nm in nms.values():
            nm.switch_error = errors.precondition("ROLE_NOT_SWITCHABLE", "node/x", "test: refused")
        set_signals(h, PREFILL_HEAVY)
        done = await until(lambda: logged(caplog, "role_switch_finished"))
        assert done[0]["outcome"] == "rolled_back"
        iid = done[0]["instance_id"]
        # Back in routing with the role it had, its history says so.
        await until(lambda: h.controller.table.live[iid].status == ACTIVE)
        assert (await roles(h))[iid] == DECODE
        await until(lambda: iid in coordinator.table)
        ft = await h.stub.GetFaultToleranceStatus(
            controller_pb2.GetFaultToleranceStatusRequest(instance_id=iid), timeout=5
        )
        assert any("RoleSwitch decode->prefill rolled_back" in e for e in ft.instances[0].history)


async def test_a_controller_restart_mid_switch_finishes_it_exactly_once(
    tmp_path, node_managers, coordinator
) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address], planner=planner_cfg()) as h:
        set_signals(h, None)
        nms, _before = await cluster(h, node_managers, prefill=2, decode=2)
        for nm in nms.values():
            nm.switch_delay = 3600  # the answer never comes before the Controller goes
        set_signals(h, PREFILL_HEAVY)
        moving = await until(lambda: [i for i, nm in nms.items() if nm.switched])
        iid = moving[0]
        assert h.controller.table.live[iid].switch is not None
        for a in h.agents:
            a.drop_stream()
    # A new Controller on the same state: the stored switch goes on; the NodeManager serves
    # the role already, so it relaunches nothing twice.
    for nm in nms.values():
        nm.switch_delay = 0
    async with running_controller(
        tmp_path, coordinators=[coordinator.address], planner=planner_cfg(mode="off")
    ) as h2:
        for nm in nms.values():
            agent = h2.agent(nm=nm, job=f"job{list(nms.values()).index(nm)}", role=nm.role)
            await agent.register(instance_id=next(i for i, n in nms.items() if n is nm))
            await agent.beat(NORMAL)

        async def finished() -> bool:
            inst = h2.controller.table.live.get(iid)
            return inst is not None and inst.switch is None and inst.status == ACTIVE

        await until(finished, timeout=20)
        assert (await roles(h2))[iid] == PREFILL
        assert nms[iid].switched == [PREFILL]  # one relaunch, not two
        assert nms[iid].switch_calls >= 2  # the new leader asked again, and was told it is done


async def test_scale_p2d_moves_a_prefill_to_decode_when_a_decode_is_lost(
    tmp_path, node_managers, coordinator, caplog
) -> None:
    async with running_controller(
        tmp_path, coordinators=[coordinator.address], planner=planner_cfg(interval_s=3600)
    ) as h:
        set_signals(h, None)
        nms, before = await cluster(h, node_managers, prefill=2, decode=2)
        # Decode carries 4 sequences per instance at 40 ms ITL (target 50): two are enough (they
        # need 1.7), one is not; one prefill instance would do. The interval is an hour: only the
        # separation makes it decide again.
        load = sample(ttft_s=0.2, itl_s=0.04, prompt_tps=100, running=8)
        set_signals(h, load)
        for _ in range(2):  # the first interval with this pool sets what it is compared with
            seen = len(logged(caplog, "planner_decision"))
            h.controller.planner._next_tick = None
            h.controller.planner.enqueue()
            await until(lambda seen=seen: len(logged(caplog, "planner_decision")) > seen)
        assert logged(caplog, "planner_decision")[-1]["decision"] == "hold"
        lost = next(i for i, r in before.items() if r == DECODE)
        nm = nms[lost]
        # What the one decode instance left then shows: the same load at twice the ITL.
        set_signals(h, dataclasses.replace(load, itl=window(0.08)))
        fault = controller_pb2.NodeFault(
            host=nm.host, nm_port=nm.port, level=controller_pb2.FAULT_LEVEL_L5, code="hbm"
        )
        await h.stub.ReportFaults(controller_pb2.ReportFaultsRequest(faults=[fault]), timeout=5)
        moved = await until(
            lambda: [i for i, n in nms.items() if n.switched], what="a prefill switched to decode"
        )
        assert before[moved[0]] == PREFILL and nms[moved[0]].switched == [DECODE]
        started = logged(caplog, "role_switch_started")
        assert started[0]["reason"] == "scale_p2d"
        assert h.controller.table.live[lost].status == INACTIVE


async def test_planner_metrics_and_status_while_off(tmp_path, node_managers, coordinator) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        st = await status(h)
        assert st.mode == "off" and not st.roles and not st.decision
        exposed = exposition(h)
        assert "motor_planner_recommended_instances{" not in exposed  # no series while off
        assert 'motor_controller_role_switches_total{outcome="succeeded"} 0.0' in exposed


def test_switch_records_survive_a_round_trip_through_the_store() -> None:
    from motor_mesh.controller.convert import instance_from_row, instance_row
    from motor_mesh.controller.model import Instance, JobSpec, RoleSwitch

    rec = RoleSwitch(
        from_role=DECODE, to_role=PREFILL, reason="r", phase="switch", started=1.5,
        dispatched=("a:1",), accepted=("a:1",), attempts={"b:2": 1}, deadline=9.0,
    )  # fmt: skip
    inst = Instance(
        id=7, job_name="j", spec=JobSpec(DECODE, "m", 3, 1), status=ACTIVE, endpoints=[], members=[],
        switch=rec, switched_at=3.25,
    )  # fmt: skip
    back = instance_from_row(7, *instance_row(inst))
    assert back.switch == rec and back.switched_at == 3.25 and back.switching


async def test_switch_role_call_failures_are_retried_then_rolled_back(
    tmp_path, node_managers, coordinator, caplog
) -> None:
    async with running_controller(
        tmp_path,
        coordinators=[coordinator.address],
        planner=planner_cfg(),
        engine_relaunch_dispatch_retries=1,
    ) as h:
        set_signals(h, None)
        nms, _before = await cluster(h, node_managers, prefill=2, decode=2)
        for nm in nms.values():
            nm.switch_error = errors.error_info(grpc.StatusCode.INTERNAL, "RELAUNCH_FAILED", "test")
        set_signals(h, PREFILL_HEAVY)
        done = await until(lambda: logged(caplog, "role_switch_finished"), timeout=20)
        # The switch and its rollback each failed: the instance is removed (its NodeManagers
        # restart), the outcome says failed.
        assert done[0]["outcome"] == "failed"
        iid = done[0]["instance_id"]
        await until(lambda: iid not in h.controller.table.live)
        await until(lambda: nms[iid].stops)


async def test_a_pool_that_may_grow_gets_desired_counts_instead_of_switches(
    tmp_path, node_managers, coordinator, caplog
) -> None:
    async with running_controller(
        tmp_path, coordinators=[coordinator.address], planner=planner_cfg(max_instances=8)
    ) as h:
        set_signals(h, None)
        nms, before = await cluster(h, node_managers, prefill=2, decode=2)
        set_signals(h, PREFILL_HEAVY)
        scaled = await until(
            lambda: [d for d in logged(caplog, "planner_decision") if d["decision"] == "scale"]
        )
        # Prefill needs ~4.6 instances: 5; decode ~1.2: 2. Recorded as the desired counts
        # (what `motor up`, an HPA or KEDA follow), and nothing switched.
        assert "desired prefill=5 decode=2" in scaled[0]["reason"]
        listed = await h.stub.ListDesiredInstances(controller_pb2.ListDesiredInstancesRequest(), timeout=5)
        assert {(d.role, d.replicas) for d in listed.desired} == {(PREFILL, 5), (DECODE, 2)}
        assert all(nm.switch_calls == 0 for nm in nms.values())
        assert await roles(h) == before


async def test_a_multi_node_instance_switches_every_rank_together(
    tmp_path, node_managers, coordinator
) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        head, rank1 = await node_managers(), await node_managers()
        for nm in (head, rank1):
            nm.ready = True
        agents = [
            h.agent(nm=nm, job="big", role=DECODE, nnodes=2, node_rank=k, ports=(10000 + 2 * k,))
            for k, nm in enumerate((head, rank1))
        ]
        for a in agents:
            await a.register()
        await until(lambda: head.starts and rank1.starts)
        for a in agents:
            await a.beat(NORMAL)
        inst = await until(lambda: next(iter(h.controller.table.find(status=ACTIVE)), None))
        await h.controller.switches.begin(inst, PREFILL, "test")
        await until(lambda: inst.switch is None and inst.status == ACTIVE)
        assert head.switched == [PREFILL] and rank1.switched == [PREFILL]
        assert (await roles(h))[inst.id] == PREFILL
