"""nodemanager.pod_index: one StatefulSet per role holds whole instances. Pods are grouped by
ordinal, ``parallel.nnodes`` per instance: ordinal i is node_rank ``i % nnodes`` of the job
``<job_name>-<i // nnodes>``, and that is what the NodeManager registers with."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from motor_mesh.common.config import load
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2
from motor_mesh.nodemanager.app import by_pod_index
from motor_mesh.nodemanager.link import register_request
from tests.nodemanager.conftest import ControllerServer, nm_config
from tests.poll import until
from tests.ports import reserved_pair


@pytest.mark.parametrize(
    ("pod_index", "nnodes", "job", "rank"),
    [
        (0, 1, "motor-prefill-0", 0),
        (3, 1, "motor-prefill-3", 0),
        (0, 2, "motor-prefill-0", 0),
        (1, 2, "motor-prefill-0", 1),
        (5, 2, "motor-prefill-2", 1),
        (6, 2, "motor-prefill-3", 0),
        (7, 4, "motor-prefill-1", 3),
    ],
)
def test_the_ordinal_gives_the_job_and_the_rank(pod_index: int, nnodes: int, job: str, rank: int) -> None:
    cfg = load(
        None,
        env={
            "MOTOR_NODEMANAGER_POD_INDEX": str(pod_index),
            "MOTOR_NODEMANAGER_JOB_NAME": "motor-prefill",
            "MOTOR_NODEMANAGER_NODE_RANK": "9",  # ignored once pod_index is set
            "MOTOR_NODEMANAGER_PARALLEL": f'{{"tp": {nnodes}, "nnodes": {nnodes}}}',
        },
    ).nodemanager
    got = by_pod_index(cfg)
    assert (got.job_name, got.node_rank, got.pod_index) == (job, rank, pod_index)
    req = register_request(got, 7300)
    assert (req.job_name, req.node_rank, req.parallel.nnodes) == (job, rank, nnodes)


def test_unset_it_changes_nothing() -> None:
    cfg = load(
        None, env={"MOTOR_NODEMANAGER_JOB_NAME": "motor-prefill", "MOTOR_NODEMANAGER_NODE_RANK": "1"}
    ).nodemanager
    assert cfg.pod_index == -1
    assert by_pod_index(cfg) is cfg


def test_an_empty_job_name_stays_empty() -> None:
    # "" means "do not register"; an ordinal does not turn that into a job named "-2".
    cfg = load(
        None, env={"MOTOR_NODEMANAGER_POD_INDEX": "5", "MOTOR_NODEMANAGER_PARALLEL": '{"tp": 2, "nnodes": 2}'}
    ).nodemanager
    got = by_pod_index(cfg)
    assert (got.job_name, got.node_rank) == ("", 1)


async def test_a_nodemanager_registers_as_its_ordinals_job_and_rank(
    tmp_path: Path, start_nm, controller: ControllerServer
) -> None:
    port = reserved_pair()
    cfg = nm_config(
        tmp_path,
        [port],
        job_name="job-a",
        controller=controller.address,
        parallel={"dp": 1, "tp": 2, "nnodes": 2},
    )
    # As in deploy/k8s: the ordinal comes from the environment (the pod-index label).
    proc = await start_nm(cfg, env={"MOTOR_NODEMANAGER_POD_INDEX": "5"})
    line = await proc.wait_line("event=pod_index")
    for field in ("pod_index=5", "nnodes=2", "job_name=job-a-2", "node_rank=1"):
        assert field in line, line
    fake = controller.fake
    await until(lambda: fake.registers, 15, "a Register")
    reg: controller_pb2.RegisterRequest = fake.registers[0]
    assert (reg.job_name, reg.node_rank) == ("job-a-2", 1)
    assert reg.parallel == common_pb2.ParallelConfig(dp=1, tp=2, pp=1, ep=1, nnodes=2)
    # The supervisor checks StartEngines against the effective job too: the base name is not it.
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await proc.start_engines(
            job_name="job-a",
            node_rank=1,
            endpoints=[common_pb2.Endpoint(id=1, host="127.0.0.1", port=port, headless=True)],
        )
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "job_name 'job-a' is not this node's job 'job-a-2'" in (exc.value.details() or "")
