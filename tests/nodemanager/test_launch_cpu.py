"""The CPU platform (each engine its own cores) and engine.kv_transfer_config, as pure launch
functions: what argv and environment each engine gets."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from motor_mesh.common.config import ConfigError, from_dicts, load_config
from motor_mesh.gen.motor.v1 import common_pb2, nodemanager_pb2
from motor_mesh.nodemanager import devices, launch
from motor_mesh.nodemanager.launch import EndpointSpec, Head, LaunchParams

HOST = "10.0.0.5"
EPS = [EndpointSpec(id=k, host=HOST, port=10000 + 2 * k) for k in range(3)]
HEADS = tuple(Head(HOST, e.port) for e in EPS)
BASE = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0", "VLLM_CPU_OMP_THREADS_BIND": "auto"}


def params(**kw: Any) -> LaunchParams:
    base: dict[str, Any] = {
        "engine_type": "vllm",
        "model": "/data/llama",
        "served_model_name": "llama",
        "role": "prefill",
        "instance_id": 9,
        "device_env": "cpu",
        "cpu_cores": tuple(range(8)),
        "dp": 3,
        "heads": HEADS,
    }
    return LaunchParams(**{**base, **kw})


def binds(p: LaunchParams, var: str = "VLLM_CPU_OMP_THREADS_BIND") -> list[str | None]:
    return [launch.build_env(p, ep, BASE).get(var) for ep in EPS[: p.dp]]


# --- cores --------------------------------------------------------------------------------------


def test_vllm_engines_get_their_own_cores_and_no_device_variable() -> None:
    p = params()
    # 8 cores over 3 engines, contiguous, the first ones one larger; a stale inherited binding
    # ("auto": every engine of the host on the same cores) is replaced.
    assert binds(p) == ["0-2", "3-5", "6-7"]
    env = launch.build_env(p, EPS[1], BASE)
    assert "CUDA_VISIBLE_DEVICES" not in env  # a CPU build never sees a stale one
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in env
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # vLLM's default unless configured
    # Devices named in the start command do not bring the variable back.
    with_devices = EndpointSpec(id=0, host=HOST, port=10000, device_ids=(0, 1))
    assert "CUDA_VISIBLE_DEVICES" not in launch.build_env(p, with_devices, BASE)


def test_sglang_engines_get_sglangs_variable_and_the_cpu_device() -> None:
    p = params(engine_type="sglang")
    assert binds(p, "SGLANG_CPU_OMP_THREADS_BIND") == ["0-2", "3-5", "6-7"]
    env = launch.build_env(p, EPS[0], BASE)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"  # not SGLang's: left as inherited
    assert "CUDA_VISIBLE_DEVICES" not in env
    argv = launch.build_argv(p, EPS[0])
    assert argv[argv.index("--dp-size") :] == [
        "--dp-size", "1",
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "10001",
        "--enable-metrics",
        "--device", "cpu",  # SGLang stops at start-up without it on a machine with no accelerator
        "--kv-events-config", launch.kv_events.config(12000, 12001, 0),
    ]  # fmt: skip
    # The operator's own device wins, and off the CPU platform Motor names none.
    mine = launch.build_argv(params(engine_type="sglang", args={"device": "xpu"}), EPS[0])
    assert mine.count("--device") == 1 and mine[mine.index("--device") + 1] == "xpu"
    assert "--device" not in launch.build_argv(
        params(engine_type="sglang", device_env="CUDA_VISIBLE_DEVICES"), EPS[0]
    )


def test_the_simulated_engine_gets_vllms_variable() -> None:
    assert binds(params(engine_type="sim")) == ["0-2", "3-5", "6-7"]
    assert binds(params(engine_type="sim", sim_protocol="sglang")) == ["0-2", "3-5", "6-7"]
    assert "--device" not in launch.build_argv(params(engine_type="sim"), EPS[0])


def test_fewer_cores_than_engines_share_them_round_robin() -> None:
    assert binds(params(cpu_cores=(0, 1))) == ["0", "1", "0"]


def test_cores_follow_the_dp_rank_on_every_node() -> None:
    # node_rank 1 of a DP 2 instance spanning 2 nodes: ids 2 and 3 are DP ranks 0 and 1.
    p = params(dp=2, nnodes=2, node_rank=1, tp=2, cpu_cores=(0, 1, 2, 3))
    node1 = [
        EndpointSpec(id=2, host=HOST, port=10000, headless=True),
        EndpointSpec(id=3, host=HOST, port=10002, headless=True),
    ]
    # tp 2 over 2 nodes: one worker here per engine, found at its rank modulo 1 among 2 entries.
    assert [launch.build_env(p, ep, {})["VLLM_CPU_OMP_THREADS_BIND"] for ep in node1] == [
        "0-1|0-1",
        "2-3|2-3",
    ]


def test_a_multi_worker_engine_splits_its_cores_between_its_workers() -> None:
    # vLLM reads one entry per worker rank (tp * pp), SGLang one per TP rank.
    p = params(dp=1, tp=2, pp=2, cpu_cores=tuple(range(8)))
    assert launch.build_env(p, EPS[0], {})["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3|4-5|6-7"
    sg = params(engine_type="sglang", dp=1, tp=2, cpu_cores=tuple(range(6)))
    assert launch.build_env(sg, EPS[0], {})["SGLANG_CPU_OMP_THREADS_BIND"] == "0-2|3-5"
    # An engine with fewer cores than workers: one each, shared.
    one = params(dp=1, tp=4, cpu_cores=(4, 5))
    assert launch.build_env(one, EPS[0], {})["VLLM_CPU_OMP_THREADS_BIND"] == "4|5|4|5"


def test_off_the_cpu_platform_nothing_is_bound() -> None:
    p = params(device_env="CUDA_VISIBLE_DEVICES", cpu_cores=())
    env = launch.build_env(p, EndpointSpec(id=0, host=HOST, port=10000, device_ids=(2,)), BASE)
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"  # inherited, untouched


def test_kv_cache_space() -> None:
    assert launch.build_env(params(cpu_kvcache_space_gib=40), EPS[0], BASE)["VLLM_CPU_KVCACHE_SPACE"] == "40"
    assert (
        launch.build_env(params(engine_type="sim", cpu_kvcache_space_gib=2), EPS[0], {})[
            "VLLM_CPU_KVCACHE_SPACE"
        ]
        == "2"
    )
    # SGLang has no such variable.
    assert "VLLM_CPU_KVCACHE_SPACE" not in launch.build_env(
        params(engine_type="sglang", cpu_kvcache_space_gib=40), EPS[0], {}
    )
    # Motor's value replaces an inherited one.
    assert (
        launch.build_env(params(cpu_kvcache_space_gib=8), EPS[0], {"VLLM_CPU_KVCACHE_SPACE": "1"})[
            "VLLM_CPU_KVCACHE_SPACE"
        ]
        == "8"
    )


@pytest.mark.parametrize(
    ("engine_type", "var"),
    [
        ("vllm", "VLLM_CPU_OMP_THREADS_BIND"),
        ("sim", "VLLM_CPU_OMP_THREADS_BIND"),
        ("sglang", "SGLANG_CPU_OMP_THREADS_BIND"),
    ],
)
def test_the_operators_engine_env_wins(engine_type: str, var: str) -> None:
    mine = {var: "0-15", "VLLM_CPU_KVCACHE_SPACE": "100", "VLLM_HOST_IP": "not-kept"}
    p = params(engine_type=engine_type, env=mine, cpu_kvcache_space_gib=8)
    for ep in EPS:
        env = launch.build_env(p, ep, BASE)
        assert env[var] == "0-15"
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "100"
        assert env["VLLM_HOST_IP"] == HOST  # Motor's other variables still win


def test_params_for_reads_the_node_cores() -> None:
    req = nodemanager_pb2.StartEnginesRequest(
        job_name="j",
        instance_id=4,
        role=common_pb2.ROLE_DECODE,
        endpoints=[common_pb2.Endpoint(id=k, host=HOST, port=10000 + 2 * k) for k in range(2)],
    )

    def cfg(nodemanager: dict[str, Any], engine: dict[str, Any] | None = None) -> Any:
        raw = {
            "nodemanager": {"parallel": {"dp": 2}, "ports": [10000, 10002], **nodemanager},
            "engine": engine or {},
        }
        dicts = load_config(overrides=raw, env={})
        return from_dicts(dicts)

    c = cfg({"cpu_cores": "4-7"}, {"cpu_kvcache_space_gib": 3})
    p = launch.params_for(req, c.nodemanager, c.engine, "cpu")
    assert (p.cpu_cores, p.cpu_kvcache_space_gib, p.on_cpu) == ((4, 5, 6, 7), 3, True)
    assert [launch.cpu_bind(p, ep) for ep in launch.endpoint_specs(req)] == ["4-5", "6-7"]
    # Empty: whatever this process may run on.
    c = cfg({})
    assert launch.params_for(req, c.nodemanager, c.engine, "cpu").cpu_cores == devices.available_cores()
    # Not the CPU platform: no cores at all.
    assert launch.params_for(req, c.nodemanager, c.engine, "CUDA_VISIBLE_DEVICES").cpu_cores == ()


# --- kv_transfer_config -------------------------------------------------------------------------


def kv_flag(p: LaunchParams, ep: EndpointSpec = EPS[0]) -> str | None:
    argv = launch.build_argv(p, ep)
    flags = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-transfer-config"]
    assert len(flags) <= 1, argv
    return flags[0] if flags else None


def test_kv_transfer_fields_are_merged_after_motors() -> None:
    p = params(kv_transfer={"kv_port": 14579, "kv_buffer_device": "cpu"})
    # Motor's three first, then the operator's sorted by key, whatever order they were written in.
    assert kv_flag(p) == (
        '{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"9",'
        '"kv_buffer_device":"cpu","kv_port":14579}'
    )
    assert kv_flag(params(kv_transfer={"kv_buffer_device": "cpu", "kv_port": 14579})) == kv_flag(p)
    # Nothing configured: the flag as before.
    assert (
        kv_flag(params(role="decode"))
        == '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","engine_id":"9"}'
    )


def test_a_nested_object_and_a_connector_of_its_own_pass_through() -> None:
    extra = {
        "connectors": [
            {"kv_connector": "NixlConnector"},
            {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
        ]
    }
    p = params(
        kv_connector="MooncakeConnector",
        kv_transfer={"kv_connector_extra_config": extra, "kv_connector": "MultiConnector"},
    )
    got = kv_flag(p)
    assert got == (
        '{"kv_connector":"MultiConnector","kv_role":"kv_producer","engine_id":"9",'
        '"kv_connector_extra_config":{"connectors":[{"kv_connector":"NixlConnector"},'
        '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}]}}'
    )
    assert json.loads(got or "")["kv_connector_extra_config"] == extra


def test_motors_own_fields_cannot_be_overridden() -> None:
    # The config check refuses them; should they reach the launch anyway, Motor's stand.
    p = params(kv_transfer={"kv_role": "kv_both", "engine_id": "x"})
    assert json.loads(kv_flag(p) or "") == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "engine_id": "9",
    }


def test_kv_transfer_config_only_for_prefill_and_decode_vllm_engines() -> None:
    assert kv_flag(params(role="union", kv_transfer={"kv_buffer_device": "cpu"})) is None
    assert kv_flag(params(engine_type="sglang", kv_transfer={"kv_buffer_device": "cpu"})) is None


def test_an_engine_args_kv_transfer_config_replaces_motors_flag() -> None:
    mine = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    p = params(args={"kv_transfer_config": mine}, kv_transfer={"kv_buffer_device": "cpu"})
    assert kv_flag(p) == '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'  # once, the operator's
    argv = launch.build_argv(p, EPS[0])
    assert argv[0] == "vllm" and sys.executable not in argv


# --- UCX ports ----------------------------------------------------------------------------------


def test_each_engine_gets_its_own_window_of_the_nodes_ucx_ports() -> None:
    # 30 ports over 3 engines: windows of 10 that never overlap, by DP rank, on any platform.
    for device_env in ("cpu", "CUDA_VISIBLE_DEVICES"):
        p = params(ucx_ports=(20000, 20029), device_env=device_env)
        windows = [launch.build_env(p, ep, BASE).get("UCX_TCP_PORT_RANGE") for ep in EPS]
        assert windows == ["20000-20009", "20010-20019", "20020-20029"]
    # A range not dividing evenly leaves its last ports unused rather than overlapping.
    p = params(ucx_ports=(20000, 20031))
    assert [launch.ucx_window(p, ep) for ep in EPS] == ["20000-20009", "20010-20019", "20020-20029"]


def test_no_ucx_range_without_one_configured_and_the_operators_own_kept() -> None:
    assert "UCX_TCP_PORT_RANGE" not in launch.build_env(params(), EPS[0], BASE)
    mine = params(ucx_ports=(20000, 20029), env={"UCX_TCP_PORT_RANGE": "40000-40100"})
    assert launch.build_env(mine, EPS[1], BASE)["UCX_TCP_PORT_RANGE"] == "40000-40100"
    # Fewer ports than engines: none rather than a window shared by two.
    assert launch.ucx_window(params(ucx_ports=(20000, 20001)), EPS[0]) == ""


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("20000", 'expected "LOW-HIGH"'),
        ("20010-20000", "must run upwards"),
        ("0-10", "must run upwards from 1"),
        ("60000-70000", "to 65535"),
        (20000, 'string "LOW-HIGH"'),
    ],
)
def test_a_bad_ucx_port_range_is_refused(value: Any, why: str) -> None:
    with pytest.raises(ConfigError, match=r"nodemanager\.ucx_port_range") as info:
        load_config(overrides={"nodemanager": {"ucx_port_range": value}}, env={})
    assert why in str(info.value)


def test_params_for_reads_the_ucx_range() -> None:
    c = from_dicts(load_config(overrides={"nodemanager": {"ucx_port_range": "18000-18031"}}, env={}))
    req = nodemanager_pb2.StartEnginesRequest(
        instance_id=1,
        role=common_pb2.ROLE_DECODE,
        endpoints=[common_pb2.Endpoint(id=0, host=HOST, port=10000)],
    )
    assert launch.params_for(req, c.nodemanager, c.engine, "cpu").ucx_ports == (18000, 18031)
