"""What ``motor up`` gives each NodeManager (no process started): its share of the machine's
cores, and a job name the Controller accepts whatever the model is called."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from motor_mesh.cli import standalone
from motor_mesh.cli.up_args import parse
from motor_mesh.cli.up_plan import Plan, nodemanager_cores, plan
from motor_mesh.common.config import load
from motor_mesh.controller.validation import JOB_NAME
from motor_mesh.nodemanager import devices


def planned(tmp_path: Path, *argv: str, cores: list[int] | None = None, config: dict | None = None) -> Plan:
    args = list(argv)
    if config is not None:
        (tmp_path / "motor.json").write_text(json.dumps(config))
        args += ["--config", str(tmp_path / "motor.json")]
    parsed = parse(args)
    return plan(parsed, load(parsed.config, env={}), tmp_path / "state", cores=cores)


def node_cores(p: Plan) -> list[tuple[int, ...]]:
    """The cores each NodeManager reads from its environment (as its configuration loads them)."""
    return [load(None, env=nm.env).nodemanager.cpu_cores for nm in p.nodes]


def engine_cores(p: Plan) -> list[tuple[int, ...]]:
    """The cores every engine of the cluster gets, in engine order: each NodeManager splits its
    own between its DP ranks (services/nodemanager/launch.py)."""
    out = []
    for nm in p.nodes:
        cfg = load(None, env=nm.env).nodemanager
        out += devices.split_cores(cfg.cpu_cores, cfg.parallel.dp)
    return out


# --- cores --------------------------------------------------------------------------------------


def test_each_nodemanager_gets_its_engines_share(tmp_path: Path) -> None:
    p = planned(tmp_path, "--prefill", "1", "--decode", "1", "--dp", "2", cores=list(range(8)))
    assert node_cores(p) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert engine_cores(p) == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_a_machine_with_fewer_cores_than_engines_shares_them_round_robin(tmp_path: Path) -> None:
    # 2 cores, 3 engines: engine 0 → core 0, engine 1 → core 1, engine 2 → core 0.
    p = planned(tmp_path, "--prefill", "1", "--decode", "1", "--union", "1", cores=[0, 1])
    assert [nm.env["MOTOR_NODEMANAGER_CPU_CORES"] for nm in p.nodes] == ["[0]", "[1]", "[0]"]
    assert engine_cores(p) == [(0,), (1,), (0,)]


def test_the_cores_default_to_the_configured_ones_then_the_machines(tmp_path: Path) -> None:
    p = planned(tmp_path, config={"nodemanager": {"cpu_cores": "4-7"}})
    assert node_cores(p) == [(4, 5), (6, 7)]
    mine = devices.available_cores()
    p = planned(tmp_path)
    assert engine_cores(p) == devices.split_cores(mine, 2)


def test_every_engine_gets_its_slice_of_the_cluster_wide_split() -> None:
    for cores, nodes, dp in itertools.product(range(1, 12), range(1, 5), range(1, 5)):
        machine = [7 + 2 * c for c in range(cores)]  # any core numbers, in order
        per_node = nodemanager_cores(machine, nodes, dp)
        engines = [s for mine in per_node for s in devices.split_cores(mine, dp)]
        assert engines == devices.split_cores(machine, nodes * dp), (cores, nodes, dp)


# --- job names ----------------------------------------------------------------------------------


def job_names(p: Plan) -> list[str]:
    return [load(None, env=nm.env).nodemanager.job_name for nm in p.nodes]


def test_a_model_given_as_a_path_names_its_jobs_by_its_last_component(tmp_path: Path) -> None:
    p = planned(
        tmp_path,
        "--engine-type",
        "vllm",
        "--model",
        "/models/qwen3-30b-a3b/",
        "--prefill",
        "2",
        "--decode",
        "1",
    )
    assert job_names(p) == ["qwen3-30b-a3b-prefill-0", "qwen3-30b-a3b-prefill-1", "qwen3-30b-a3b-decode-0"]
    # Clients still ask for the model as given: it is the served name.
    cfg = load(None, env=p.nodes[0].env).nodemanager
    assert (cfg.model, cfg.served_model_name or cfg.model) == ("/models/qwen3-30b-a3b/",) * 2
    assert all(JOB_NAME.fullmatch(n) for n in job_names(p))


@pytest.mark.parametrize(
    ("model", "stem"),
    [
        ("motor-sim", "motor-sim"),
        ("Qwen/Qwen3-8B", "Qwen3-8B"),
        ("/data/models/Llama 3.1 (8B)", "Llama-3.1-8B-"),
        ("~/models/.hidden", "hidden"),
        ("/", "model"),
        ("模型", "model"),
        ("x" * 300, "x" * 300),
    ],
)
def test_job_names_are_always_valid(model: str, stem: str) -> None:
    assert standalone.model_stem(model) == stem
    for name in (standalone.job_name_of(model, "decode", 12), standalone.job_name_of(model, "union", 0)):
        assert JOB_NAME.fullmatch(name), name
    # Too long: the model part is cut, the parts that tell the jobs apart stay.
    assert standalone.job_name_of("x" * 300, "prefill", 3) == "x" * 118 + "-prefill-3"


def test_standalone_job_names_use_the_stem_too() -> None:
    spec = standalone.InstanceSpec("decode", (standalone.EndpointSpec("fe80::1", 8000),))
    name = standalone.job_name("/models/llama-3-8b", spec)
    assert name == "llama-3-8b-decode-fe80-1-8000"
    assert JOB_NAME.fullmatch(name)
    plain = standalone.InstanceSpec("decode", (standalone.EndpointSpec("10.0.0.10", 8000),))
    assert standalone.job_name("llama", plain) == "llama-decode-10.0.0.10-8000"  # as before


# --- UCX ports ----------------------------------------------------------------------------------


def test_every_engine_gets_a_ucx_window_of_its_own(tmp_path: Path) -> None:
    # Engine k's 16 ports from 18000 + 16k (+ the port offset), each NodeManager its engines'.
    p = planned(tmp_path, "--prefill", "1", "--decode", "2", "--dp", "2", "--port-offset", "100")
    ranges = [nm.env["MOTOR_NODEMANAGER_UCX_PORT_RANGE"] for nm in p.nodes]
    assert ranges == ["18100-18131", "18132-18163", "18164-18195"]
    windows = []
    for nm in p.nodes:
        cfg = load(None, env=nm.env).nodemanager
        low, high = (int(x) for x in cfg.ucx_port_range.split("-"))
        width = (high - low + 1) // cfg.parallel.dp
        windows += [range(low + r * width, low + (r + 1) * width) for r in range(cfg.parallel.dp)]
    ports = [port for w in windows for port in w]
    assert len(ports) == len(set(ports)) == 6 * 16


def test_a_configured_ucx_range_is_the_machines_split_over_every_engine(tmp_path: Path) -> None:
    cfg = {"nodemanager": {"ucx_port_range": "40000-40031"}}
    p = planned(tmp_path, "--prefill", "1", "--decode", "1", "--port-offset", "7", config=cfg)
    assert [nm.env["MOTOR_NODEMANAGER_UCX_PORT_RANGE"] for nm in p.nodes] == ["40007-40022", "40023-40038"]
