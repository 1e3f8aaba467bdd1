"""The planner end to end: `motor up` with simulated engines whose latency follows their load
(a serial prefill compute; decode slower per running sequence), real clients (the openai SDK)
streaming greedy chats, the planner in `act` mode reading the Coordinator's real metrics.

- Prefill-heavy traffic on 1 prefill + 3 decode instances: a decode instance is switched to
  prefill. The switch shows everywhere an operator looks: the instance keeps its id and has the
  new role in the Controller's and the Coordinator's ListInstances, its engine was relaunched
  with the prefill launch line (`kv_producer` in its argv), its history has the switch, and no
  client saw an error: every answer is the fault-free one token for token.
- ScaleP2D: decode-heavy traffic on 2 + 2; an L5 fault on a decode instance separates it, and
  the planner's next decision, made at once rather than at the next interval, switches a
  prefill instance to decode; once the fault is cleared and the traffic turns prefill-heavy,
  an instance goes back to prefill."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import CONTROLLER, CallFailed, Cluster
from tests.e2e.streaming import Load, Probe, client_of, prompt_of, reference, write_config
from tests.poll import wait_until

pytestmark = pytest.mark.timeout(300)

FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def fields(line: str) -> dict[str, str]:
    return {k: v.strip('"') for k, v in FIELD.findall(line)}


def controller_events(c: Cluster, event: str, start: int = 0) -> list[dict[str, str]]:
    return [fields(s) for s in c.proc.lines[start:] if s.startswith("[controller") and f"event={event} " in s]


def planner_story(c: Cluster) -> str:
    """The planner's decisions (the first eight and the last four), its switches and the faults
    so far, for a failure's message."""
    mine = [s for s in c.proc.lines if s.startswith("[controller")]
    decisions = [s for s in mine if "event=planner_decision" in s]
    others = [s for s in mine if "event=role_switch" in s or "event=fault_" in s or "separated" in s]
    return "\n".join([*decisions[:8], "...", *decisions[-4:], *others])


def cluster(tmp: Path, prefill: int, decode: int, engine: dict[str, Any], planner: dict[str, Any]) -> Cluster:
    cfg = write_config(
        tmp,
        controller={"planner": {"mode": "act", "cooldown_s": 600, **planner}},
        coordinator={"engine_metrics_interval_s": 1, "drain_grace_s": 1},
        # Every prompt is computed afresh: repeated prompts would be served from the prefix cache.
        engine={"args": {"max_num_seqs": 64, "no_enable_prefix_caching": True, **engine}},
    )
    c = Cluster(
        tmp, "--prefill", str(prefill), "--decode", str(decode), "--config", str(cfg), nodes=prefill + decode
    )
    try:
        c.wait_ready()
        Probe(c).wait_serving(prefill=prefill, decode=decode)
    except BaseException:
        c.cleanup()
        raise
    return c


def instance(c: Cluster, iid: str, where: str) -> dict[str, Any] | None:
    if where == "controller":
        found = c.controller_instances()
    else:
        found = Probe(c).available()
    return next((i for i in found if i["id"] == iid), None)


def argv_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_prefill_heavy_traffic_switches_a_decode_instance_to_prefill_without_an_error(tmp_path: Path) -> None:
    # 300-word prompts at 2 ms a word through one serial prefill compute: 0.6 s each, so four
    # clients queue seconds of TTFT against a target of 0.8 s; decode (8 tokens of 10 ms) idles.
    c = cluster(
        tmp_path,
        1,
        3,
        engine={"prefill_compute": "serial", "prefill_ms_per_token": 2, "tpot_ms": 10},
        planner={"interval_s": 2, "ttft_p90_ms": 800, "itl_p90_ms": 200},
    )
    try:
        client = client_of(c)
        decodes = {i["id"]: i for i in Probe(c).decodes()}
        pids = {i["id"]: int(i["endpoints"][0]["pid"]) for i in decodes.values()}
        want = reference(client, [prompt_of(i, words=300) for i in range(6)], 8)
        with Load(client, want, 8, stream=True, workers=4) as load:
            done = wait_until(
                lambda: [
                    e for e in controller_events(c, "role_switch_finished") if e["outcome"] == "succeeded"
                ],
                120,
                "a role switch finished",
            )
            iid = done[0]["instance_id"]
            assert iid in decodes and done[0]["role"] == "prefill"
            load.wait_served(4)
        assert load.ok > 0 and not load.failed, load.failed[:3]
        # The same id, the new role, in routing again: at the Controller and the Coordinator.
        ctl = wait_until(lambda: instance(c, iid, "controller"), 30, retry=(CallFailed,))
        assert ctl["role"] == "ROLE_PREFILL" and ctl["status"] == "INSTANCE_STATUS_ACTIVE"
        coord = wait_until(lambda: instance(c, iid, "coordinator"), 30, retry=(CallFailed,))
        assert coord["role"] == "ROLE_PREFILL"
        # Its engine is a new process launched with the prefill line.
        pid = int(ctl["endpoints"][0]["pid"])
        assert pid != pids[iid]
        line = argv_of(pid)
        assert '"kv_role":"kv_producer"' in line and "kv_consumer" not in line, line
        ft = c.call(c.grpc(CONTROLLER), "motor.v1.Controller/GetFaultToleranceStatus", {"instance_id": iid})
        assert any("RoleSwitch decode->prefill succeeded" in h for h in ft["instances"][0]["history"])
        status = c.call(c.grpc(CONTROLLER), "motor.v1.Controller/GetPlannerStatus")
        assert status["mode"] == "act" and any(cd["instance_id"] == iid for cd in status.get("cooldowns", []))
        # The Coordinator's drain moved nothing that failed: no migration refused or exhausted.
        migrations = Probe(c).migrations()
        assert not {k: v for k, v in migrations.items() if k[1] in ("refused", "exhausted", "unroutable")}
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nthe planner's lines:\n{planner_story(c)}") from None
    finally:
        c.cleanup()


def report_fault(c: Cluster, nm: str, cleared: bool = False) -> None:
    host, port = nm.rsplit(":", 1)
    fault: dict[str, Any] = {"host": host, "nm_port": int(port), "code": "hbm"}
    fault |= {"cleared": True} if cleared else {"level": "FAULT_LEVEL_L5", "reason": "test: HBM ECC"}
    c.call(c.grpc(CONTROLLER), "motor.v1.Controller/ReportFaults", {"faults": [fault]})


def test_scale_p2d_a_lost_decode_is_replaced_by_a_prefill_and_traffic_brings_it_back(tmp_path: Path) -> None:
    # Decode: 20 ms a token plus 6 ms per other sequence running. Twelve streams over two decode
    # instances: ~50 ms; over one: ~86 ms; the ITL target is 75 ms. Prefill: 2 ms a word, serial.
    c = cluster(
        tmp_path,
        2,
        2,
        engine={"prefill_compute": "serial", "prefill_ms_per_token": 2, "tpot_ms": 20, "tpot_ms_per_seq": 6},
        planner={"interval_s": 4, "ttft_p90_ms": 1500, "itl_p90_ms": 75},
    )
    try:
        client = client_of(c)
        probe = Probe(c)
        prefills = {i["id"] for i in probe.available() if i["role"] == "ROLE_PREFILL"}
        victim = probe.decodes()[0]
        # A few at a time: two dozen streams at once would be a decode burst the planner answers.
        prompts = [prompt_of(i) for i in range(24)]
        want = {}
        for k in range(0, len(prompts), 4):
            want |= reference(client, prompts[k : k + 4], 60)
        with Load(client, want, 60, stream=True, workers=12) as load:
            # Learned and content: the planner holds 2:2 under this load.
            wait_until(
                lambda: [e for e in controller_events(c, "planner_decision") if e["decision"] == "hold"],
                90,
                "the planner holding 2:2",
            )
            start = len(c.proc.lines)
            report_fault(c, victim["node_managers"][0])
            started = wait_until(
                lambda: controller_events(c, "role_switch_started", start), 60, "a switch started"
            )
            assert started[0]["reason"] == "scale_p2d" and started[0]["instance_id"] in prefills
            # Within one interval: decided at once on the separation (the interval being mostly
            # from before the fault, that decision may still hold) or at the next periodic one.
            decisions = [e["decision"] for e in controller_events(c, "planner_decision", start)]
            assert "switch" in decisions[:2], decisions[:4]
            moved = started[0]["instance_id"]
            wait_until(
                lambda: [
                    e
                    for e in controller_events(c, "role_switch_finished", start)
                    if e["instance_id"] == moved
                ],
                60,
                "the switch finished",
            )
            load.wait_served(12)
        assert load.ok > 0 and not load.failed, load.failed[:3]
        assert instance(c, moved, "controller")["role"] == "ROLE_DECODE"
        # The fault cleared, the traffic turns prefill-heavy: an instance goes back to prefill.
        start = len(c.proc.lines)
        report_fault(c, victim["node_managers"][0], cleared=True)
        wait_until(lambda: instance(c, victim["id"], "coordinator"), 60, retry=(CallFailed,))
        heavy = reference(client, [prompt_of(100 + i, words=400) for i in range(6)], 4)
        with Load(client, heavy, 4, stream=True, workers=6) as load:
            back = wait_until(
                lambda: [
                    e
                    for e in controller_events(c, "role_switch_finished", start)
                    if e["role"] == "prefill" and e["outcome"] == "succeeded"
                ],
                120,
                "an instance switched back to prefill",
            )
        assert not load.failed, load.failed[:3]
        roles = [i["role"] for i in c.controller_instances() if i["status"] == "INSTANCE_STATUS_ACTIVE"]
        assert roles.count("ROLE_PREFILL") >= 2, (back, roles)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nthe planner's lines:\n{planner_story(c)}") from None
    finally:
        c.cleanup()
