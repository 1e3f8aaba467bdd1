"""The case table: every engine, role, DP size and node count, as the launches Motor makes.

Each case is a small cluster built the way production builds it: NodeManager configs go through
Motor's config loader, their registrations through the Controller's conversions and assembly
plan, and each StartEngines command through the NodeManager's launch functions. Next to the
instance under check runs a partner instance of the other role on the same hosts, so ports that
must be unique per host (NIXL side channels, bootstrap and rendezvous ports) are checked across
instances, not only within one.

Two model kinds: the grouped cases serve a mixture-of-experts model (vLLM accepts external data
parallelism, ``--data-parallel-rank``, only for those); the dense cases serve a dense model with
``engine.data_parallel_group`` false, so every vLLM rank is an independent vLLM.

The cross-process checks of the table are in invariants.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from motor_mesh.common.config import EngineConfig, NodeManagerConfig, load
from motor_mesh.controller import assembly, convert
from motor_mesh.nodemanager import launch
from motor_mesh.nodemanager.link import register_request

# Placeholders by model kind: each engine side swaps in the generated fixture of that kind.
MODELS = {"moe": "/models/tiny-moe", "dense": "/models/tiny-llama"}
SERVED = {"moe": "tiny-moe", "dense": "tiny-llama"}
DEVICE_ENV = "CUDA_VISIBLE_DEVICES"
HOSTS = ("127.0.0.1", "127.0.0.2")  # by node_rank
BASE_PORT = 10000
NM_PORT = 7300
ENGINES = ("vllm", "sglang")
ROLES = ("prefill", "decode", "union")
# A union instance has no KV partner; a prefill one still shares its hosts to test port reuse.
PARTNER = {"prefill": "decode", "decode": "prefill", "union": "prefill"}


@dataclass(frozen=True)
class Case:
    engine: str
    role: str
    dp: int
    nodes: int
    dense: bool = False  # a dense model, launched with engine.data_parallel_group false

    @property
    def name(self) -> str:
        kind = "-dense" if self.dense else ""
        return f"{self.engine}{kind}-{self.role}-dp{self.dp}-nodes{self.nodes}"

    @property
    def model_kind(self) -> str:
        return "dense" if self.dense else "moe"

    @property
    def tp(self) -> int:
        # A rank spanning nodes has to split its model across them, and vLLM insists that
        # --nnodes divides the world size (dp * tp * pp): one TP shard per node.
        return self.nodes


GROUPED = tuple(Case(e, r, dp, n) for e in ENGINES for r in ROLES for dp in (1, 2) for n in (1, 2))
# SGLang ranks are always independent (engine.data_parallel_group is vLLM's only).
DENSE = tuple(Case("vllm", r, dp, n, dense=True) for r in ROLES for dp in (1, 2) for n in (1, 2))
CASES = GROUPED + DENSE


class Launch(TypedDict):
    """One engine process: where the plan put it and the command line and environment it gets."""

    case: str
    instance: str
    instance_id: int
    engine: str
    model_kind: str  # moe | dense: which fixture the engine sides substitute
    dp_group: bool  # vLLM: the instance's ranks form one DP group (engine.data_parallel_group)
    role: str
    dp: int
    nnodes: int
    host: str
    port: int
    node_rank: int
    endpoint_id: int
    headless: bool
    argv: list[str]
    env: dict[str, str]


def node_config(
    case: Case, role: str, node_rank: int, ports: list[int], nm_port: int
) -> tuple[NodeManagerConfig, EngineConfig]:
    """One NodeManager's config, checked and typed by Motor's loader (no file, no env)."""
    cfg = load(
        env={},
        overrides={
            "nodemanager": {
                "host": HOSTS[node_rank],
                "port": nm_port,
                "job_name": f"{case.name}-{role}",
                "role": role,
                "model": MODELS[case.model_kind],
                "served_model_name": SERVED[case.model_kind],
                "engine_type": case.engine,
                "ports": ports,
                "device_count": len(ports) * case.tp // case.nodes,
                "parallel": {"dp": case.dp, "tp": case.tp, "nnodes": case.nodes},
                "node_rank": node_rank,
                "device_env": DEVICE_ENV,
            },
            "engine": {"data_parallel_group": False} if case.dense else {},
        },
    )
    return cfg.nodemanager, cfg.engine


def instance_launches(case: Case, instance_id: int, role: str, first_port: int) -> list[Launch]:
    """Every engine of one instance: one NodeManager per node_rank, each with ``dp`` ports."""
    ports = [first_port + 2 * i for i in range(case.dp)]  # each engine owns P and P + 1
    nodes = [node_config(case, role, k, ports, NM_PORT + instance_id) for k in range(case.nodes)]
    requests = [register_request(nm, nm.port) for nm, _ in nodes]
    spec = convert.spec_of(requests[0])
    members = [convert.member_of(r) for r in requests]
    if any(convert.spec_of(r) != spec for r in requests) or not assembly.is_complete(spec, members):
        raise AssertionError(f"{case.name}: the registrations do not assemble into one instance")
    plan = assembly.plan(instance_id, nodes[0][0].job_name, spec, members)
    out: list[Launch] = []
    for nm, engine in nodes:
        req = plan.commands[f"{nm.host}:{nm.port}"]
        params = launch.params_for(req, nm, engine, DEVICE_ENV)
        for ep in launch.endpoint_specs(req):
            out.append(
                Launch(
                    case=case.name,
                    instance=f"{role}-{instance_id}",
                    instance_id=instance_id,
                    engine=case.engine,
                    model_kind=case.model_kind,
                    dp_group=params.dp_group,
                    role=role,
                    dp=case.dp,
                    nnodes=case.nodes,
                    host=ep.host,
                    port=ep.port,
                    node_rank=req.node_rank,
                    endpoint_id=ep.id,
                    headless=ep.headless,
                    argv=launch.build_argv(params, ep),
                    env=launch.build_env(params, ep, base={}),
                )
            )
    return out


def case_launches(case: Case) -> list[Launch]:
    """The instance under check (id 1) and its partner (id 2) on the ports after it."""
    subject = instance_launches(case, 1, case.role, BASE_PORT)
    return subject + instance_launches(case, 2, PARTNER[case.role], BASE_PORT + 2 * case.dp)


def build() -> dict[str, list[Launch]]:
    return {case.name: case_launches(case) for case in CASES}
