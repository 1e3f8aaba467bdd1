"""The vLLM and SGLang launch lines, proved with stand-ins (tests/standins.py): a ``vllm``
executable first on PATH and an ``sglang/launch_server.py`` first on PYTHONPATH record their
argv and environment, then become the simulated engine. The NodeManager cannot tell."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.gen.motor.v1 import common_pb2
from tests.nodemanager.conftest import nm_config
from tests.poll import until
from tests.ports import reserved_pair
from tests.standins import prepend_path, read_records, write_sglang, write_vllm


def plus(port: int, offset: int) -> int:
    """Where an engine's side port lands: above the business port, below it near 65535."""
    return port + offset if port + offset <= 65535 else port - offset


async def launch(tmp_path: Path, start_nm, cfg: dict[str, Any], env: dict[str, str], **start: Any):
    rec_dir = tmp_path / "records"
    rec_dir.mkdir()
    env = {"STANDIN_RECORDS": str(rec_dir), "ASCEND_RT_VISIBLE_DEVICES": "9", **env}
    nm = await start_nm(cfg, env=env)
    resp = await nm.start_engines(**start)
    pids = [e.pid for e in resp.endpoints]
    status = await nm.wait_ready()
    assert [e.pid for e in status.endpoints] == pids
    got = await until(lambda: len(list(rec_dir.glob("*.json"))) == len(pids) and read_records(rec_dir), 10)
    return status, [got[p] for p in pids]


async def test_vllm_launch_line(tmp_path: Path, start_nm) -> None:
    write_vllm(tmp_path / "bin")
    ports = [reserved_pair(), reserved_pair()]
    engine = {
        "args": {
            "max_num_seqs": 8,
            "enforce_eager": True,
            "disable_log_stats": False,
            "kv_events_config": None,
            "middleware": ["a", "b"],
            "compilation_config": {"level": 3, "cudagraph": [1, 2]},
        },
        "env": {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "overridden-by-nm"},
        "kv_connector": "MooncakeConnector",
    }
    cfg = nm_config(
        tmp_path,
        ports,
        role="decode",
        engine_type="vllm",
        model="/models/m1",
        served_model_name="served-1",
        parallel={"dp": 2, "tp": 2},
        device_env="ASCEND_RT_VISIBLE_DEVICES",
        engine=engine,
    )
    endpoints = [
        common_pb2.Endpoint(id=0, host="127.0.0.1", port=ports[0], device_ids=[0, 1]),
        common_pb2.Endpoint(id=1, host="127.0.0.1", port=ports[1]),
    ]
    env = {"PATH": prepend_path(tmp_path / "bin", os.environ.get("PATH"))}
    status, recs = await launch(
        tmp_path, start_nm, cfg, env, instance_id=77, endpoints=endpoints, master_host="127.0.0.1"
    )
    kv = '{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","engine_id":"77"}'
    # Every rank meets rank 0 (the DP master) at its business port + 1.
    for i, (rec, port) in enumerate(zip(recs, ports, strict=True)):
        assert rec["argv"][0] == str(tmp_path / "bin" / "vllm")
        assert rec["argv"][1:] == [
            "serve", "/models/m1",
            "--served-model-name", "served-1",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--tensor-parallel-size", "2",
            "--data-parallel-size", "2",
            "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(ports[0] + 1),
            "--data-parallel-rank", str(i),
            "--kv-transfer-config", kv,
            "--compilation-config", '{"level":3,"cudagraph":[1,2]}',
            "--enforce-eager",
            "--max-num-seqs", "8",
            "--middleware", "a",
            "--middleware", "b",
        ]  # fmt: skip
        env_ = rec["env"]
        assert env_["HF_HUB_OFFLINE"] == "1"
        assert env_["VLLM_HOST_IP"] == "127.0.0.1"
        assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION" not in env_
        # vLLM listens on the env port + its DP rank: each engine's own business port + 4000.
        assert env_["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert int(env_["VLLM_NIXL_SIDE_CHANNEL_PORT"]) + i == plus(port, 4000)
    assert recs[0]["env"]["ASCEND_RT_VISIBLE_DEVICES"] == "0,1"
    assert "ASCEND_RT_VISIBLE_DEVICES" not in recs[1]["env"]  # no devices: unset, not inherited
    # The operator's kv_events_config (null: none) replaces ours: no events to follow.
    assert [
        (e.port, e.bootstrap_port, list(e.device_ids), e.kv_events_port, e.kv_events_replay_port)
        for e in status.endpoints
    ] == [(ports[0], 0, [0, 1], 0, 0), (ports[1], 0, [], 0, 0)]


async def test_sglang_launch_line(tmp_path: Path, start_nm) -> None:
    write_sglang(tmp_path / "pylib")
    port = reserved_pair()
    cfg = nm_config(
        tmp_path,
        [port],
        role="prefill",
        engine_type="sglang",
        model="m1",
        served_model_name="",
        device_env="CUDA_VISIBLE_DEVICES",
        engine={"args": {"mem_fraction_static": 0.8}, "env": {"SGLANG_LOG": "x"}},
    )
    endpoints = [common_pb2.Endpoint(id=0, host="127.0.0.1", port=port, device_ids=[3])]
    env = {"PYTHONPATH": prepend_path(tmp_path / "pylib", os.environ.get("PYTHONPATH"))}
    status, (rec,) = await launch(tmp_path, start_nm, cfg, env, endpoints=endpoints)
    assert rec["orig_argv"] == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "m1",
        "--served-model-name", "m1",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--tp-size", "1",
        "--dp-size", "1",
        "--disaggregation-mode", "prefill",
        "--disaggregation-bootstrap-port", str(port + 1),
        "--enable-metrics",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"publisher":"zmq",'
        f'"endpoint":"tcp://*:{plus(port, 2000)}","replay_endpoint":"tcp://*:{plus(port, 2001)}","topic":""}}',
        "--mem-fraction-static", "0.8",
    ]  # fmt: skip
    assert rec["argv"][0] == str(tmp_path / "pylib" / "sglang" / "launch_server.py")
    env_ = rec["env"]
    assert env_["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "true"
    assert env_["CUDA_VISIBLE_DEVICES"] == "3"
    assert env_["ASCEND_RT_VISIBLE_DEVICES"] == "9"  # not the device variable of this node: untouched
    assert env_["VLLM_HOST_IP"] == "127.0.0.1"
    assert env_["SGLANG_LOG"] == "x"
    assert not {"VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"} & env_.keys()
    (ep,) = status.endpoints
    assert (ep.port, ep.bootstrap_port) == (port, port + 1)
    assert (ep.kv_events_port, ep.kv_events_replay_port) == (plus(port, 2000), plus(port, 2001))


async def test_vllm_on_the_cpu_platform(tmp_path: Path, start_nm) -> None:
    # Each engine binds its own cores; the cores, the KV cache size and the connector's extra
    # fields reach the engine as a real vLLM CPU build would read them.
    write_vllm(tmp_path / "bin")
    rec_dir = tmp_path / "records"
    rec_dir.mkdir()
    ports = [reserved_pair(), reserved_pair()]
    cfg = nm_config(
        tmp_path,
        ports,
        role="prefill",
        engine_type="vllm",
        model="/models/m1",
        served_model_name="",
        device_env="cpu",
        cpu_cores="2-5",
        engine={"kv_transfer_config": {"kv_buffer_device": "cpu"}, "cpu_kvcache_space_gib": 6},
    )
    env = {
        "STANDIN_RECORDS": str(rec_dir),
        "PATH": prepend_path(tmp_path / "bin", os.environ.get("PATH")),
        "CUDA_VISIBLE_DEVICES": "0",  # stale: a CPU build must not see it
        "VLLM_CPU_OMP_THREADS_BIND": "auto",  # every engine of the host on the same cores: replaced
    }
    nm = await start_nm(cfg, env=env)
    await nm.wait_line("event=cpu_cores cores=2-5 configured=true engines=2-3;4-5")
    endpoints = [common_pb2.Endpoint(id=i, host="127.0.0.1", port=p) for i, p in enumerate(ports)]
    pids = [e.pid for e in (await nm.start_engines(instance_id=31, endpoints=endpoints)).endpoints]
    status = await nm.wait_ready()
    got = await until(lambda: len(list(rec_dir.glob("*.json"))) == 2 and read_records(rec_dir), 10)
    recs = [got[p] for p in pids]
    assert [r["env"]["VLLM_CPU_OMP_THREADS_BIND"] for r in recs] == ["2-3", "4-5"]
    for rec in recs:
        assert "CUDA_VISIBLE_DEVICES" not in rec["env"]
        assert rec["env"]["VLLM_CPU_KVCACHE_SPACE"] == "6"
        argv = rec["argv"]
        assert argv[argv.index("--served-model-name") + 1] == "/models/m1"
        assert argv.count("--kv-transfer-config") == 1
        assert argv[argv.index("--kv-transfer-config") + 1] == (
            '{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"31","kv_buffer_device":"cpu"}'
        )
    assert [list(e.device_ids) for e in status.endpoints] == [[], []]  # cores are not devices


def _allowed_cores(pid: int) -> str:
    """The cores a process may run on, as the kernel lists them (``0-1``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


@pytest.mark.skipif(
    len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2, reason="needs two cores to give out"
)
async def test_each_cpu_engine_runs_whole_on_its_own_cores(tmp_path: Path, start_nm) -> None:
    # Not only the OpenMP threads the binding variable places: every thread and child process
    # of the engine (what NIXL and vLLM's own processes start) is confined to its slice.
    write_vllm(tmp_path / "bin")
    rec_dir = tmp_path / "records"
    rec_dir.mkdir()
    first, second = sorted(os.sched_getaffinity(0))[:2]
    ports = [reserved_pair(), reserved_pair()]
    cfg = nm_config(
        tmp_path,
        ports,
        role="decode",
        engine_type="vllm",
        model="m",
        device_env="cpu",
        cpu_cores=[first, second],
    )
    env = {"STANDIN_RECORDS": str(rec_dir), "PATH": prepend_path(tmp_path / "bin", os.environ.get("PATH"))}
    nm = await start_nm(cfg, env=env)
    endpoints = [common_pb2.Endpoint(id=i, host="127.0.0.1", port=p) for i, p in enumerate(ports)]
    pids = [e.pid for e in (await nm.start_engines(instance_id=32, endpoints=endpoints)).endpoints]
    await nm.wait_ready()
    assert [_allowed_cores(p) for p in pids] == [str(first), str(second)]
