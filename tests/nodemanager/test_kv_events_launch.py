"""Where each engine publishes its KV cache events: the ``--kv-events-config`` it is launched
with and the ports its NodeManager reports for it (P + 2000 and P + 2001 wherever the engine
ends up binding them, none for headless parts, an operator's own config instead of ours)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.gen.motor.v1 import common_pb2
from motor_mesh.nodemanager import launch
from motor_mesh.nodemanager.launch import EndpointSpec, Head, LaunchParams
from tests.nodemanager.conftest import ControllerServer, nm_config
from tests.poll import until
from tests.ports import reserve

HEADS = (Head("10.0.0.5", 10000), Head("10.0.0.5", 10002))
RANK0 = EndpointSpec(id=0, host="10.0.0.5", port=10000)
RANK1 = EndpointSpec(id=1, host="10.0.0.5", port=10002)


def params(engine_type: str, **kw: Any) -> LaunchParams:
    base: dict[str, Any] = {
        "engine_type": engine_type,
        "model": "/data/llama",
        "served_model_name": "llama",
        "role": "union",
        "instance_id": 9,
    }
    return LaunchParams(**{**base, **kw})


def flag(argv: list[str]) -> str | None:
    """The value of the one --kv-events-config in ``argv`` (None: not there)."""
    found = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-events-config"]
    assert len(found) <= 1, argv
    return found[0] if found else None


def ours(endpoint: int, replay: int) -> str:
    return (
        '{"enable_kv_cache_events":true,"publisher":"zmq",'
        f'"endpoint":"tcp://*:{endpoint}","replay_endpoint":"tcp://*:{replay}","topic":""}}'
    )


@pytest.mark.parametrize("engine_type", ["vllm", "sim", "sglang"])
def test_a_single_rank_publishes_at_its_port_plus_2000(engine_type: str) -> None:
    p = params(engine_type)
    argv = launch.build_argv(p, RANK0)
    assert flag(argv) == ours(12000, 12001)
    assert launch.kv_events_ports(p, RANK0) == (12000, 12001)


@pytest.mark.parametrize("engine_type", ["vllm", "sim"])
def test_a_dp_rank_is_subtracted_since_the_engine_adds_it(engine_type: str) -> None:
    p = params(engine_type, dp=2, heads=HEADS)
    argv = launch.build_argv(p, RANK1)
    assert argv[argv.index("--data-parallel-rank") + 1] == "1"
    # The engine binds 12001 + 1 and 12002 + 1: its business port + 2000 and + 2001.
    assert flag(argv) == ours(12001, 12002)
    assert launch.kv_events_ports(p, RANK1) == (12002, 12003)
    assert flag(launch.build_argv(p, RANK0)) == ours(12000, 12001)


def test_ranks_without_a_dp_group_are_each_rank_0() -> None:
    p = params("vllm", dp=2, heads=HEADS, dp_group=False)
    assert flag(launch.build_argv(p, RANK1)) == ours(12002, 12003)
    assert launch.kv_events_ports(p, RANK1) == (12002, 12003)


def test_sglang_ranks_are_separate_servers_of_dp_size_1() -> None:
    p = params("sglang", dp=2, heads=HEADS)
    assert flag(launch.build_argv(p, RANK1)) == ours(12002, 12003)
    assert launch.kv_events_ports(p, RANK1) == (12002, 12003)


@pytest.mark.parametrize("key", ["dp_size", "data_parallel_size"])
def test_sglang_with_several_schedulers_behind_one_endpoint_publishes_none(key: str) -> None:
    p = params("sglang", args={key: 2, "enable_dp_attention": True})
    argv = launch.build_argv(p, RANK0)
    assert flag(argv) is None
    assert "--" + key.replace("_", "-") in argv  # theirs, after Motor's --dp-size 1
    assert launch.kv_events_ports(p, RANK0) == (0, 0)
    assert launch.kv_events_ports(params("sglang", args={key: 1}), RANK0) == (12000, 12001)


@pytest.mark.parametrize("engine_type", ["vllm", "sim", "sglang"])
def test_headless_parts_publish_none(engine_type: str) -> None:
    heads = (Head("10.0.0.5", 10000), Head("10.0.0.7", 10004))
    p = params(engine_type, dp=2, nnodes=2, node_rank=1, heads=heads, tp=2)
    headless = EndpointSpec(id=3, host="10.0.0.6", port=10002, headless=True)
    assert flag(launch.build_argv(p, headless)) is None
    assert launch.kv_events_ports(p, headless) == (0, 0)


def test_ports_near_the_top_are_offset_downwards() -> None:
    top = EndpointSpec(id=0, host="h", port=64000)
    assert launch.kv_events_ports(params("vllm"), top) == (62000, 61999)
    assert flag(launch.build_argv(params("vllm"), top)) == ours(62000, 61999)


OPERATOR = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:7000",
    "replay_endpoint": "tcp://0.0.0.0:7100",
    "buffer_steps": 50,
}


@pytest.mark.parametrize("form", ["object", "json text"])
def test_an_operator_config_replaces_ours(form: str) -> None:
    value = OPERATOR if form == "object" else json.dumps(OPERATOR)
    p = params("vllm", dp=2, heads=HEADS, args={"kv_events_config": value})
    argv = launch.build_argv(p, RANK1)
    # Theirs, passed as it is by the engine.args rule (once), and not ours.
    assert flag(argv) == (json.dumps(OPERATOR, separators=(",", ":")) if form == "object" else value)
    # vLLM rank 1 binds their ports + 1.
    assert launch.kv_events_ports(p, RANK1) == (7001, 7101)
    assert launch.kv_events_ports(p, RANK0) == (7000, 7100)
    sglang = params("sglang", args={"kv_events_config": value})
    assert launch.kv_events_ports(sglang, RANK1) == (7000, 7100)


@pytest.mark.parametrize(
    ("value", "ports"),
    [
        pytest.param(None, (0, 0), id="null turns events off"),
        pytest.param(False, (0, 0), id="false turns events off"),
        pytest.param({**OPERATOR, "enable_kv_cache_events": False}, (0, 0), id="disabled"),
        pytest.param({**OPERATOR, "publisher": "null"}, (0, 0), id="another publisher"),
        pytest.param({**OPERATOR, "endpoint": "ipc:///tmp/kv"}, (0, 0), id="not tcp"),
        pytest.param({**OPERATOR, "endpoint": "tcp://*:notaport"}, (0, 0), id="no port"),
        pytest.param("{not json", (0, 0), id="not JSON"),
        pytest.param({"enable_kv_cache_events": True}, (5557, 0), id="the engines' defaults"),
        pytest.param({**OPERATOR, "replay_endpoint": None}, (7000, 0), id="no replay"),
        pytest.param({**OPERATOR, "endpoint": "tcp://[::1]:7000"}, (7000, 7100), id="IPv6 host"),
    ],
)
def test_what_an_operator_config_reports(value: Any, ports: tuple[int, int]) -> None:
    p = params("sim", args={"kv_events_config": value})
    argv = launch.build_argv(p, RANK0)
    assert argv.count("--kv-events-config") == (0 if value in (None, False) else 1)
    if value not in (None, False):
        assert flag(argv) != ours(12000, 12001)
    assert launch.kv_events_ports(p, RANK0) == ports


def test_the_flag_comes_before_engine_args_for_every_engine() -> None:
    # engine.args come last, so an operator's flag wins over any of ours.
    for engine_type, marker in (("vllm", "serve"), ("sim", "engine-sim"), ("sglang", "sglang.launch_server")):
        argv = launch.build_argv(params(engine_type, args={"zzz": 1}), RANK0)
        assert marker in argv
        assert argv[-4:] == ["--kv-events-config", ours(12000, 12001), "--zzz", "1"], engine_type


# ---- reported by a running NodeManager ----------------------------------------------------------


async def test_reported_in_the_start_answer_status_and_beats(tmp_path: Path, start_nm) -> None:
    # Two engines on one node, each with its events ports held for the test too (the simulated
    # engine may bind them).
    held = [reserve([0, 1, 2000, 2001]), reserve([0, 1, 2000, 2001])]
    ports = [h[0] for h in held]
    ctl = await ControllerServer().start()
    try:
        cfg = nm_config(tmp_path, ports, role="union", job_name="job-a", controller=ctl.address)
        nm = await start_nm(cfg)
        await until(lambda: ctl.fake.beats(), 15, "first beat")
        want = [(p, p + 2000, p + 2001) for p in ports]

        def reported(endpoints: Any) -> list[tuple[int, int, int]]:
            return [(e.port, e.kv_events_port, e.kv_events_replay_port) for e in endpoints]

        started = await nm.start_engines()
        assert reported(started.endpoints) == want
        status = await nm.wait_ready()
        assert reported(status.endpoints) == want
        beat = await until(
            lambda: next(
                (
                    b
                    for b in ctl.fake.beats()
                    if [e.status for e in b.endpoints] == [common_pb2.ENDPOINT_STATUS_NORMAL] * 2
                ),
                None,
            ),
            10,
            "a beat with both endpoints NORMAL",
        )
        assert reported(beat.endpoints) == want
    finally:
        await ctl.stop()
        for h in held:
            h.close()
