"""`motor up` with `--engine-type vllm|sglang` and `--dp`, end to end: real processes, with the
stand-ins of tests/standins.py in place of vLLM and SGLang. They record what each engine was
launched with (argv and environment), then run the simulated engine, so the cluster serves."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.cluster import Cluster
from tests.poll import wait_until
from tests.procs import motor_argv
from tests.standins import prepend_path, read_records, write_sglang, write_vllm

pytestmark = pytest.mark.timeout(120)

Record = dict[str, Any]


@contextmanager
def running(tmp: Path, engine: str, *args: str, dp: int = 1) -> Iterator[tuple[Cluster, list[Record]]]:
    """A READY ``motor up --engine-type <engine> *args`` (two NodeManagers of ``dp`` engines
    each) and the stand-ins' records of its engines."""
    records = tmp / "records"
    records.mkdir()
    env = {"STANDIN_RECORDS": str(records)}
    if engine == "vllm":
        env["PATH"] = prepend_path(write_vllm(tmp / "bin"), os.environ.get("PATH"))
    else:
        env["PYTHONPATH"] = prepend_path(write_sglang(tmp / "pylib"), os.environ.get("PYTHONPATH"))
    c = Cluster(tmp, "--engine-type", engine, *args, dp=dp, env=env)
    try:
        c.wait_ready()
        recs = wait_until(
            lambda: len(got := read_records(records)) == 2 * dp and list(got.values()), timeout=20
        )
        yield c, recs
    finally:
        c.cleanup()


def flag(rec: Record, name: str) -> str | None:
    """The value of ``name`` in the recorded argv (None when absent)."""
    argv = rec["argv"]
    return argv[argv.index(name) + 1] if name in argv else None


def port(rec: Record) -> int:
    return int(flag(rec, "--port") or 0)


def side_channel(rec: Record) -> int:
    """The NIXL side-channel port vLLM would listen on: the env port + its DP rank (0 when
    there is no --data-parallel-rank)."""
    return int(rec["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]) + int(flag(rec, "--data-parallel-rank") or 0)


def by_node(c: Cluster, recs: list[Record]) -> dict[int, list[Record]]:
    """The records per NodeManager, each list in port order (DP rank order)."""
    nodes: dict[int, list[Record]] = {}
    for rec in sorted(recs, key=port):
        nodes.setdefault(c.node_of_port(port(rec)), []).append(rec)
    return nodes


def chat(c: Cluster, text: str) -> None:
    client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": text}]
    resp = client.chat.completions.create(model="motor-sim", messages=messages, max_tokens=8)
    assert resp.choices[0].message.content


def active_instances(c: Cluster) -> list[dict[str, Any]]:
    return [i for i in c.controller_instances() if i.get("status") == "INSTANCE_STATUS_ACTIVE"]


def engine_lines_numbered(c: Cluster) -> None:
    """Engine k's output is prefixed [engine-<k>] and k serves on its port-scheme port."""
    for k in range(c.nodes * c.dp):
        c.proc.wait_line(lambda s, k=k: s.startswith(f"[engine-{k}] ") and f":{c.engine_port(k)} " in s, 20)


def test_vllm_engines_get_their_own_side_channel(tmp_path: Path) -> None:
    with running(tmp_path, "vllm") as (c, recs):
        assert len(by_node(c, recs)) == 2  # prefill and decode, one engine each
        for rec in recs:
            assert flag(rec, "--data-parallel-size") == "1" and flag(rec, "--data-parallel-rank") is None
            assert rec["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == flag(rec, "--host") == "127.0.0.1"
        assert len({side_channel(r) for r in recs}) == 2  # prefill and decode do not collide


def test_vllm_dp2_ranks_share_their_master_and_serve(tmp_path: Path) -> None:
    # --dp replaces the configured DP size and keeps the rest of `parallel`.
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"nodemanager": {"parallel": {"dp": 1, "tp": 2}}}))
    with running(tmp_path, "vllm", "--dp", "2", "--config", str(cfg), dp=2) as (c, recs):
        nodes = by_node(c, recs)
        assert sorted(nodes) == [0, 1]
        for i, ranks in nodes.items():
            assert [port(r) for r in ranks] == [c.engine_port(2 * i), c.engine_port(2 * i + 1)]
            assert [flag(r, "--data-parallel-rank") for r in ranks] == ["0", "1"]
            masters = {
                (flag(r, "--data-parallel-address"), flag(r, "--data-parallel-rpc-port")) for r in ranks
            }
            assert masters == {("127.0.0.1", str(c.engine_port(2 * i) + 1))}
            assert all(flag(r, "--data-parallel-size") == "2" for r in ranks)
            assert all(flag(r, "--tensor-parallel-size") == "2" for r in ranks)
        assert len({side_channel(r) for r in recs}) == 4  # every engine listens on its own
        engine_lines_numbered(c)
        instances = wait_until(lambda: len(got := active_instances(c)) == 2 and got)
        assert [len(i["endpoints"]) for i in instances] == [2, 2]  # one instance per NodeManager
        chat(c, "Two ranks, one instance.")


def test_sglang_dp2_one_scheduler_per_process(tmp_path: Path) -> None:
    with running(tmp_path, "sglang", "--dp", "2", dp=2) as (c, recs):
        nodes = by_node(c, recs)
        assert sorted(nodes) == [0, 1]
        for i, procs in nodes.items():
            assert all(r["orig_argv"][1:3] == ["-m", "sglang.launch_server"] for r in procs)
            assert [port(r) for r in procs] == [c.engine_port(2 * i), c.engine_port(2 * i + 1)]
            assert sum(int(flag(r, "--dp-size") or 1) for r in procs) == 2  # schedulers on the node
        engine_lines_numbered(c)
        chat(c, "Bootstrap rooms per rank.")


def test_dp_from_config(tmp_path: Path) -> None:
    # No --dp: the configuration's nodemanager.parallel.dp decides.
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"nodemanager": {"parallel": {"dp": 2}}}))
    c = Cluster(tmp_path, "--union", "1", "--config", str(cfg), nodes=1, dp=2)
    try:
        c.wait_ready()
        (inst,) = wait_until(lambda: active_instances(c))
        assert [int(e["port"]) for e in inst["endpoints"]] == [c.engine_port(0), c.engine_port(1)]
    finally:
        c.cleanup()


def test_what_motor_up_cannot_run_is_refused(tmp_path: Path) -> None:
    def up(*args: str) -> subprocess.CompletedProcess[str]:
        argv = motor_argv("up", *args, "--state-dir", str(tmp_path / "state"))
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    out = up("--dp", "0")
    assert (out.returncode, out.stdout) == (2, "")
    assert "--dp must be >= 1" in out.stderr
    cfg = tmp_path / "multi.json"
    cfg.write_text(json.dumps({"nodemanager": {"parallel": {"nnodes": 2, "tp": 2}}}))
    out = up("--config", str(cfg))
    assert (out.returncode, out.stdout) == (1, "")
    assert (
        out.stderr.strip() == "motor up runs each instance on one node: nodemanager.parallel.nnodes must be 1"
    )
