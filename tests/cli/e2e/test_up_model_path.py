"""``motor up --engine-type vllm --model /an/absolute/path``, end to end with the stand-in
``vllm`` of tests/standins.py: the NodeManagers register under job names the Controller accepts
(the instances reach its table), clients ask for the model by the path, and on this machine
(no accelerator: the CPU platform) every engine binds its own share of the cores."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest

from motor_mesh.nodemanager import devices
from tests.e2e.cluster import Cluster
from tests.poll import wait_until
from tests.standins import prepend_path, read_records, write_vllm

pytestmark = pytest.mark.timeout(120)

MODEL = "/some/abs/path/qwen3-30b-a3b"


def test_a_model_path_registers_and_serves(tmp_path: Path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    env = {
        "STANDIN_RECORDS": str(records),
        "PATH": prepend_path(write_vllm(tmp_path / "bin"), os.environ.get("PATH")),
    }
    c = Cluster(tmp_path, "--engine-type", "vllm", "--model", MODEL, env=env)
    try:
        c.wait_ready()
        active = wait_until(
            lambda: (
                len(
                    got := [
                        i for i in c.controller_instances() if i.get("status") == "INSTANCE_STATUS_ACTIVE"
                    ]
                )
                == 2
                and got
            )
        )
        assert sorted(i["job_name"] for i in active) == ["qwen3-30b-a3b-decode-0", "qwen3-30b-a3b-prefill-0"]
        assert {i["model_name"] for i in active} == {MODEL}
        client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=30)
        messages = [{"role": "user", "content": "Which model?"}]
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        assert resp.choices[0].message.content
        recs = sorted(
            read_records(records).values(), key=lambda r: int(r["argv"][r["argv"].index("--port") + 1])
        )
        assert [r["argv"][2] for r in recs] == [MODEL, MODEL]  # vllm serve MODEL
        if devices.detect()[0] != devices.CPU:
            return  # an accelerator here: engines get devices, not cores
        # The machine's cores split over both engines (round-robin on a one-core machine).
        expected = [devices.cpuset(s) for s in devices.split_cores(devices.available_cores(), 2)]
        assert [r["env"]["VLLM_CPU_OMP_THREADS_BIND"] for r in recs] == expected
    finally:
        c.cleanup()
