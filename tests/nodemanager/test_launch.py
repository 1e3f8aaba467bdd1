"""Engine argv and environment, as pure functions."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.gen.motor.v1 import common_pb2
from motor_mesh.nodemanager import launch
from motor_mesh.nodemanager.launch import EndpointSpec, Head, LaunchError, LaunchParams

EP0 = EndpointSpec(id=0, host="10.0.0.5", port=10000)
EP = EndpointSpec(id=1, host="10.0.0.5", port=10002, device_ids=(2, 3))
HEADS = (Head("10.0.0.5", 10000), Head("10.0.0.5", 10002))


def kv_events(pub: int) -> list[str]:
    """The --kv-events-config of an engine of DP rank 0 publishing on ``pub`` (replay: + 1)."""
    config = (
        f'{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{pub}",'
        f'"replay_endpoint":"tcp://*:{pub + 1}","topic":""}}'
    )
    return ["--kv-events-config", config]


def params(**kw: Any) -> LaunchParams:
    base: dict[str, Any] = {
        "engine_type": "sim",
        "model": "/data/llama",
        "served_model_name": "llama",
        "role": "prefill",
        "instance_id": 9,
    }
    return LaunchParams(**{**base, **kw})


def test_sim_vllm_style_prefill() -> None:
    argv = launch.build_argv(params(), EP)
    assert argv == [
        sys.executable, "-m", "motor_mesh.cli", "engine-sim", "serve", "/data/llama",
        "--served-model-name", "llama",
        "--host", "10.0.0.5",
        "--port", "10002",
        "--tensor-parallel-size", "1",
        "--data-parallel-size", "1",
        "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"9"}',
        "--protocol", "vllm",
        *kv_events(12002),
    ]  # fmt: skip


def test_sim_sglang_style_decode_gets_bootstrap_port() -> None:
    p = params(sim_protocol="sglang", role="decode")
    argv = launch.build_argv(p, EP)
    assert argv[-6:] == ["--protocol", "sglang", "--bootstrap-port", "10003", *kv_events(12002)]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_consumer"
    assert launch.bootstrap_port(p, EP) == 10003
    assert launch.bootstrap_port(params(role="union", sim_protocol="sglang"), EP) == 0
    assert launch.bootstrap_port(params(), EP) == 0


def test_vllm_union_has_no_kv_config() -> None:
    assert launch.build_argv(params(engine_type="vllm", role="union"), EP0) == [
        "vllm", "serve", "/data/llama",
        "--served-model-name", "llama", "--host", "10.0.0.5", "--port", "10000",
        "--tensor-parallel-size", "1", "--data-parallel-size", "1",
        *kv_events(12000),
    ]  # fmt: skip


def test_vllm_ranks_meet_the_master_wherever_it_runs() -> None:
    # DP 2, each rank spanning 2 nodes: rank 1's part on node_rank 1 (id 1 * 2 + 1 = 3).
    heads = (Head("10.0.0.5", 10000), Head("10.0.0.7", 10004))
    p = params(engine_type="vllm", dp=2, nnodes=2, node_rank=1, heads=heads, pp=2)
    headless = EndpointSpec(id=3, host="10.0.0.6", port=10002, headless=True)
    argv = launch.build_argv(p, headless)
    i = argv.index("--tensor-parallel-size")
    assert argv[i:] == [
        "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "2",
        "--data-parallel-size", "2",
        "--data-parallel-address", "10.0.0.5",
        "--data-parallel-rpc-port", "10001",
        "--data-parallel-rank", "1",
        "--nnodes", "4",
        "--node-rank", "3",
        "--master-addr", "10.0.0.5",
        "--master-port", "16000",
        "--headless",
        "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"9"}',
    ]  # fmt: skip
    env = launch.build_env(p, headless, {})
    # vLLM listens on the variable + its DP rank: exactly port + 4000
    assert (env["VLLM_NIXL_SIDE_CHANNEL_HOST"], env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("10.0.0.6", "14001")


def test_vllm_ranks_of_a_dense_model_are_independent() -> None:
    # engine.data_parallel_group false: no DP group; a rank spanning nodes is its own world.
    heads = (Head("10.0.0.5", 10000), Head("10.0.0.7", 10004))
    p = params(engine_type="vllm", role="decode", dp=2, nnodes=2, node_rank=1, heads=heads, dp_group=False)
    headless = EndpointSpec(id=3, host="10.0.0.6", port=10002, headless=True)
    argv = launch.build_argv(p, headless)
    assert argv[argv.index("--data-parallel-size") : argv.index("--kv-transfer-config")] == [
        "--data-parallel-size", "1",
        "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.7", "--master-port", "16004",  # rank 1's head
        "--headless",
    ]  # fmt: skip
    assert launch.build_env(p, headless, {})["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "14002"  # vLLM adds 0


def test_a_missing_head_is_a_launch_error() -> None:
    with pytest.raises(LaunchError, match="no routable endpoint for DP rank 0"):
        launch.build_argv(params(engine_type="vllm", dp=2), EP)


def test_ports_near_the_top_are_offset_downwards() -> None:
    assert launch.offset_port(60000, launch.SIDE_CHANNEL_OFFSET) == 64000
    assert launch.offset_port(62000, launch.SIDE_CHANNEL_OFFSET) == 58000
    assert launch.side_channel_port(EndpointSpec(id=0, host="h", port=65000)) == 61000


def test_sglang_one_process_per_rank_and_multinode_flags() -> None:
    argv = launch.build_argv(params(engine_type="sglang", role="union", tp=4, dp=2, heads=HEADS), EP)
    assert argv == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "/data/llama", "--served-model-name", "llama",
        "--host", "10.0.0.5", "--port", "10002", "--tp-size", "4", "--dp-size", "1",
        "--enable-metrics", *kv_events(12002),
    ]  # fmt: skip
    heads = (Head("10.0.0.5", 10000), Head("10.0.0.7", 10004))
    p = params(engine_type="sglang", role="decode", dp=2, nnodes=2, node_rank=1, heads=heads)
    headless = EndpointSpec(id=3, host="10.0.0.6", port=10002, headless=True)
    argv = launch.build_argv(p, headless)
    assert argv[argv.index("--dp-size") :] == [
        "--dp-size", "1",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.7:16004",
        # every part of rank 1 names its head's bootstrap port
        "--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", "10005",
        "--enable-metrics",
    ]  # fmt: skip
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in launch.build_env(p, headless, {})
    assert launch.bootstrap_port(p, headless) == 0  # only the head serves it


def test_engine_args_rules() -> None:
    args = {
        "zeta": 1.5,
        "alpha_beta": True,
        "off": False,
        "none": None,
        "repeat": ["x", 2, True],
        "obj": {"b": [1, {"c": None}], "a": "s"},
        "empty": [],
    }
    assert launch.extra_args(args) == [
        "--alpha-beta",
        "--obj", '{"b":[1,{"c":null}],"a":"s"}',
        "--repeat", "x", "--repeat", "2", "--repeat", "true",
        "--zeta", "1.5",
    ]  # fmt: skip
    assert launch.build_argv(params(args={"max_num_seqs": 4}), EP)[-2:] == ["--max-num-seqs", "4"]


def test_environment() -> None:
    base = {"PATH": "/bin", "ASCEND_RT_VISIBLE_DEVICES": "7", "KEEP": "1"}
    p = params(env={"HF_TOKEN": "t", "VLLM_HOST_IP": "x"}, device_env="ASCEND_RT_VISIBLE_DEVICES", dp=2)
    env = launch.build_env(p, EP, base)
    assert env == {
        "PATH": "/bin",
        "KEEP": "1",
        "HF_TOKEN": "t",
        "ASCEND_RT_VISIBLE_DEVICES": "2,3",
        "VLLM_HOST_IP": "10.0.0.5",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "14001",  # rank 1: vLLM listens on 14001 + 1 = port + 4000
    }
    no_devices = EndpointSpec(id=0, host="h", port=1)
    assert "ASCEND_RT_VISIBLE_DEVICES" not in launch.build_env(p, no_devices, base)
    sg = launch.build_env(params(engine_type="sglang", device_env="CUDA_VISIBLE_DEVICES"), EP, base)
    assert sg["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "true"
    assert sg["CUDA_VISIBLE_DEVICES"] == "2,3" and sg["ASCEND_RT_VISIBLE_DEVICES"] == "7"


def test_pd_protocol() -> None:
    assert launch.pd_protocol("vllm", "sglang") == common_pb2.PD_PROTOCOL_VLLM
    assert launch.pd_protocol("sim", "vllm") == common_pb2.PD_PROTOCOL_VLLM
    assert launch.pd_protocol("sim", "sglang") == common_pb2.PD_PROTOCOL_SGLANG
    assert launch.pd_protocol("sglang", "vllm") == common_pb2.PD_PROTOCOL_SGLANG


def test_resolve_looks_up_the_engines_own_path(tmp_path: Path) -> None:
    exe = tmp_path / "vllm"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert launch.resolve(["vllm", "serve"], {"PATH": str(tmp_path)}) == [str(exe), "serve"]
    with pytest.raises(LaunchError, match="not found on PATH"):
        launch.resolve(["vllm", "serve"], {"PATH": str(tmp_path / "nowhere")})
    assert launch.resolve([sys.executable, "-m", "x"], {"PATH": ""})[0] == sys.executable
