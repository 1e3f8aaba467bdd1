"""A NodeManager with ``OTEL_EXPORTER_OTLP_ENDPOINT`` in its environment launches its engines
with their own tracing flags and names them apart in their spans, proved with the stand-ins of
test_launch_lines.py (what a real vLLM or SGLang would have been given)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from motor_mesh.gen.motor.v1 import common_pb2
from tests.e2e.test_tracing import Collector
from tests.nodemanager.conftest import nm_config
from tests.nodemanager.e2e.test_launch_lines import launch
from tests.ports import reserved_pair
from tests.standins import prepend_path, write_sglang, write_vllm


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()  # the NodeManager's own spans go somewhere real: its exit does not wait
    yield c
    c.stop()


@pytest.mark.parametrize("engine_type", ["vllm", "sglang"])
async def test_engines_export_where_the_nodemanager_does(
    tmp_path: Path, start_nm, collector: Collector, engine_type: str
) -> None:
    port = reserved_pair()
    if engine_type == "vllm":
        write_vllm(tmp_path / "bin")
        env = {"PATH": prepend_path(tmp_path / "bin", os.environ.get("PATH"))}
    else:
        write_sglang(tmp_path / "pylib")
        env = {"PYTHONPATH": prepend_path(tmp_path / "pylib", os.environ.get("PYTHONPATH"))}
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_RESOURCE_ATTRIBUTES": "team=llm"}
    cfg = nm_config(tmp_path, [port], role="decode", engine_type=engine_type, model="m1")
    endpoints = [common_pb2.Endpoint(id=0, host="127.0.0.1", port=port)]
    _, (rec,) = await launch(tmp_path, start_nm, cfg, env, instance_id=41, endpoints=endpoints)

    argv = rec["orig_argv"]
    if engine_type == "vllm":
        assert argv[-2:] == ["--otlp-traces-endpoint", collector.endpoint]
    else:  # SGLang's switch, and its endpoint as host:port
        assert argv[-3:] == ["--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{collector.port}"]
    env_ = rec["env"]
    assert env_["OTEL_SERVICE_NAME"] == f"{engine_type}-decode"
    assert env_["OTEL_RESOURCE_ATTRIBUTES"] == (
        "team=llm,motor.instance_id=41,motor.endpoint_id=0,motor.role=decode"
    )


async def test_no_tracing_flags_without_an_endpoint(tmp_path: Path, start_nm) -> None:
    write_vllm(tmp_path / "bin")
    port = reserved_pair()
    cfg = nm_config(tmp_path, [port], engine_type="vllm")
    env = {"PATH": prepend_path(tmp_path / "bin", os.environ.get("PATH"))}
    endpoints = [common_pb2.Endpoint(id=0, host="127.0.0.1", port=port)]
    _, (rec,) = await launch(tmp_path, start_nm, cfg, env, endpoints=endpoints)
    assert not [a for a in rec["orig_argv"] if "trace" in a]
    assert not {"OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"} & rec["env"].keys()
