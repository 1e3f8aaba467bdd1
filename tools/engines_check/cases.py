"""The case table: every engine, role, DP size and node count, as the launches Motor makes.

Each case is a small cluster built the way production builds it: NodeManager configs go through
Motor's config loader, their registrations through the Controller's conversions and assembly
plan, and each StartEngines command through the NodeManager's launch functions. Next to the
instance under check runs a partner instance of the other role on the same hosts, so ports that
must be unique per host (NIXL side channels, bootstrap and rendezvous ports) are checked across
instances, not only within one.

:func:`invariants` checks what no single engine can see: facts that must agree between the
processes of an instance, and ports that must not collide on a host.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypedDict

from services.common.config import EngineConfig, NodeManagerConfig, load
from services.controller import assembly, convert
from services.nodemanager import launch
from services.nodemanager.link import register_request

MODEL = "/models/tiny-moe"  # a placeholder: each engine side swaps in its generated fixture
SERVED = "tiny-moe"
DEVICE_ENV = "CUDA_VISIBLE_DEVICES"
HOSTS = ("127.0.0.1", "127.0.0.2")  # by node_rank
BASE_PORT = 10000
NM_PORT = 7300
ENGINES = ("vllm", "sglang")
ROLES = ("prefill", "decode", "union")
# A union instance has no KV partner; a prefill one still shares its hosts to test port reuse.
PARTNER = {"prefill": "decode", "decode": "prefill", "union": "prefill"}
PROGRAM = {"vllm": ("vllm", "serve"), "sglang": ("-m", "sglang.launch_server")}
SHARD_FLAGS = {
    "vllm": ("--tensor-parallel-size", "--pipeline-parallel-size"),
    "sglang": ("--tp-size", "--pp-size"),
}


@dataclass(frozen=True)
class Case:
    engine: str
    role: str
    dp: int
    nodes: int

    @property
    def name(self) -> str:
        return f"{self.engine}-{self.role}-dp{self.dp}-nodes{self.nodes}"

    @property
    def tp(self) -> int:
        # A rank spanning nodes has to split its model across them, and vLLM insists that
        # --nnodes divides the world size (dp * tp * pp): one TP shard per node.
        return self.nodes


CASES = tuple(Case(e, r, dp, n) for e in ENGINES for r in ROLES for dp in (1, 2) for n in (1, 2))


class Launch(TypedDict):
    """One engine process: where the plan put it and the command line and environment it gets."""

    case: str
    instance: str
    instance_id: int
    engine: str
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


# ---- building --------------------------------------------------------------------------------


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
                "model": MODEL,
                "served_model_name": SERVED,
                "engine_type": case.engine,
                "ports": ports,
                "device_count": len(ports) * case.tp // case.nodes,
                "parallel": {"dp": case.dp, "tp": case.tp, "nnodes": case.nodes},
                "node_rank": node_rank,
                "device_env": DEVICE_ENV,
            },
            "engine": {},
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


# ---- invariants ------------------------------------------------------------------------------


def options(launch_: Launch) -> dict[str, str]:
    """The ``--flag value`` pairs after the program words; a bare flag maps to ""."""
    words = launch_["argv"][3:]
    out: dict[str, str] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            has_value = i + 1 < len(words) and not words[i + 1].startswith("--")
            out[word] = words[i + 1] if has_value else ""
    return out


def _where(launch_: Launch) -> str:
    return f"{launch_['instance']}/ep{launch_['endpoint_id']}@{launch_['host']}"


def _heads(launches: list[Launch]) -> dict[int, Launch]:
    """Each DP rank's routable engine (node_rank 0), by rank."""
    return {x["endpoint_id"]: x for x in launches if x["node_rank"] == 0}


def _rank(launch_: Launch) -> int:
    """The endpoint's DP rank by Motor's numbering (ids are node_rank * dp + rank)."""
    return launch_["endpoint_id"] % launch_["dp"]


def invariants(launches: list[Launch]) -> list[str]:
    """Problems in one case's launches ([] = none)."""
    problems: list[str] = []
    by_instance: dict[str, list[Launch]] = defaultdict(list)
    for x in launches:
        by_instance[x["instance"]].append(x)
        problems += _common(x)
    for group in by_instance.values():
        check = _vllm_instance if group[0]["engine"] == "vllm" else _sglang_instance
        problems += check(group)
    problems += _listeners(launches)
    return problems


def _common(x: Launch) -> list[str]:
    problems: list[str] = []
    argv, opts, program = x["argv"], options(x), PROGRAM[x["engine"]]
    if tuple(argv[:2] if x["engine"] == "vllm" else argv[1:3]) != program:
        problems.append(f"{_where(x)}: argv does not start with {' '.join(program)}: {argv[:3]}")
    words = [w for w in argv[3:] if w.startswith("--")]
    for flag, n in Counter(words).items():
        if n > 1:
            problems.append(f"{_where(x)}: {flag} given {n} times")
    # Each node of a rank runs whole TP/PP shards: both engines refuse (tp * pp) % nnodes != 0.
    tp_flag, pp_flag = SHARD_FLAGS[x["engine"]]
    if int(opts.get(tp_flag, "1")) * int(opts.get(pp_flag, "1")) % x["nnodes"]:
        problems.append(f"{_where(x)}: {tp_flag} * {pp_flag} does not split over {x['nnodes']} nodes")
    if (opts.get("--host"), opts.get("--port")) != (x["host"], str(x["port"])):
        got = f"{opts.get('--host')}:{opts.get('--port')}"
        problems.append(f"{_where(x)}: --host/--port {got} is not its own")
    return problems


def _expect(problems: list[str], x: Launch, opts: dict[str, str], flag: str, want: str | None) -> None:
    """``flag`` has value ``want`` (None: the flag is absent)."""
    got = opts.get(flag)
    if got != want:
        problems.append(f"{_where(x)}: {flag} is {got!r}, expected {want!r}")


def _kv_transfer(problems: list[str], x: Launch, opts: dict[str, str]) -> None:
    if x["role"] not in launch.KV_ROLES:
        _expect(problems, x, opts, "--kv-transfer-config", None)
        return
    try:
        kv = json.loads(opts.get("--kv-transfer-config", ""))
    except json.JSONDecodeError:
        problems.append(f"{_where(x)}: --kv-transfer-config is not JSON")
        return
    want = {"kv_role": launch.KV_ROLES[x["role"]], "engine_id": str(x["instance_id"])}
    if {k: kv.get(k) for k in want} != want:
        problems.append(f"{_where(x)}: --kv-transfer-config {kv} does not name {want}")


def _vllm_instance(group: list[Launch]) -> list[str]:
    """External-LB DP across one instance, and multi-node ranks counted over the instance."""
    problems: list[str] = []
    dp, nnodes = group[0]["dp"], group[0]["nnodes"]
    master = _heads(group).get(0)
    if master is None:
        return [f"{group[0]['instance']}: no routable endpoint for DP rank 0"]
    rpc_pairs: set[tuple[str | None, str | None]] = set()
    rendezvous: set[tuple[str | None, str | None]] = set()
    node_ranks: list[int] = []
    routable: list[int] = []
    for x in group:
        opts = options(x)
        _expect(problems, x, opts, "--data-parallel-size", str(dp))
        rank = int(opts.get("--data-parallel-rank", "0"))
        if rank != _rank(x):
            problems.append(f"{_where(x)}: --data-parallel-rank {rank}, but its endpoint is rank {_rank(x)}")
        if not x["headless"]:
            routable.append(rank)
        if dp > 1:
            rpc_pairs.add((opts.get("--data-parallel-address"), opts.get("--data-parallel-rpc-port")))
            _expect(problems, x, opts, "--data-parallel-address", master["host"])
            _expect(problems, x, opts, "--data-parallel-rpc-port", str(master["port"] + 1))
        else:
            for flag in ("--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-rank"):
                _expect(problems, x, opts, flag, None)
        if nnodes > 1:
            node_rank = int(opts.get("--node-rank", "-1"))
            node_ranks.append(node_rank)
            total = int(opts.get("--nnodes", "0"))
            if total != dp * nnodes or not 0 <= node_rank < total:
                problems.append(
                    f"{_where(x)}: --node-rank {node_rank} of --nnodes {total} (dp {dp} * {nnodes})"
                )
            # vLLM derives the rank's part from the node rank: it must be this node's part.
            if divmod(node_rank, nnodes) != (rank, x["node_rank"]):
                problems.append(
                    f"{_where(x)}: --node-rank {node_rank} is not rank {rank}'s part {x['node_rank']}"
                )
            rendezvous.add((opts.get("--master-addr"), opts.get("--master-port")))
            _expect(problems, x, opts, "--master-addr", master["host"])
            port = launch.offset_port(master["port"], launch.RENDEZVOUS_OFFSET)
            _expect(problems, x, opts, "--master-port", str(port))
        else:
            for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port"):
                _expect(problems, x, opts, flag, None)
        _expect(problems, x, opts, "--headless", "" if x["headless"] else None)
        _kv_transfer(problems, x, opts)
    where = group[0]["instance"]
    if len(rpc_pairs) > 1:
        problems.append(f"{where}: ranks disagree on the DP master address/RPC port: {sorted(rpc_pairs)}")
    if len(rendezvous) > 1:
        problems.append(f"{where}: parts disagree on --master-addr/--master-port: {sorted(rendezvous)}")
    if sorted(routable) != list(range(dp)):
        problems.append(f"{where}: routable engines have DP ranks {sorted(routable)}, expected 0..{dp - 1}")
    if len(set(node_ranks)) != len(node_ranks):
        problems.append(f"{where}: --node-rank values repeat: {sorted(node_ranks)}")
    return problems


def _sglang_instance(group: list[Launch]) -> list[str]:
    """One launch_server per DP rank; a rank spanning nodes meets at its own head."""
    problems: list[str] = []
    nnodes = group[0]["nnodes"]
    heads = _heads(group)
    schedulers: Counter[str] = Counter()
    ranks_on: dict[str, set[int]] = defaultdict(set)
    parts: dict[int, list[tuple[str | None, str | None]]] = defaultdict(list)
    for x in group:
        opts = options(x)
        head = heads.get(_rank(x))
        if head is None:
            problems.append(f"{_where(x)}: no routable endpoint for DP rank {_rank(x)}")
            continue
        schedulers[x["host"]] += int(opts.get("--dp-size", "1"))
        ranks_on[x["host"]].add(_rank(x))
        if nnodes > 1:
            _expect(problems, x, opts, "--nnodes", str(nnodes))
            _expect(problems, x, opts, "--node-rank", str(x["node_rank"]))
            rendezvous = launch.offset_port(head["port"], launch.RENDEZVOUS_OFFSET)
            _expect(problems, x, opts, "--dist-init-addr", f"{head['host']}:{rendezvous}")
            parts[_rank(x)].append((opts.get("--dist-init-addr"), opts.get("--node-rank")))
        else:
            for flag in ("--nnodes", "--node-rank", "--dist-init-addr"):
                _expect(problems, x, opts, flag, None)
        disaggregated = x["role"] in launch.KV_ROLES
        _expect(problems, x, opts, "--disaggregation-mode", x["role"] if disaggregated else None)
        bootstrap = str(head["port"] + 1) if disaggregated else None
        _expect(problems, x, opts, "--disaggregation-bootstrap-port", bootstrap)
    where = group[0]["instance"]
    for host, n in schedulers.items():
        if n > len(ranks_on[host]):
            problems.append(
                f"{where}: {n} DP schedulers on {host}, which has {len(ranks_on[host])} DP rank(s)"
            )
    for rank, rank_parts in parts.items():
        addrs = {a for a, _ in rank_parts}
        node_ranks = sorted(str(r) for _, r in rank_parts)
        if len(addrs) != 1 or node_ranks != [str(k) for k in range(nnodes)]:
            problems.append(f"{where}: rank {rank}'s parts do not meet: {sorted(rank_parts, key=str)}")
    firsts = [rank_parts[0][0] for rank_parts in parts.values()]
    if len(set(firsts)) != len(firsts):
        problems.append(f"{where}: DP ranks share a --dist-init-addr: {firsts}")
    return problems


def listeners(x: Launch) -> Iterable[tuple[str, int, str]]:
    """(host, port, what) each engine process listens on besides ephemeral ports."""
    opts, where = options(x), _where(x)
    if not x["headless"]:
        yield x["host"], x["port"], f"{where} HTTP"
    if x["engine"] == "vllm":
        rank = int(opts.get("--data-parallel-rank", "0"))
        # The connector listens on the env port plus its DP rank, on whichever host the env
        # names; peers are told that host, so it must be the engine's own.
        side_host = x["env"].get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
        side_port = int(x["env"].get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")) + rank
        yield side_host, side_port, f"{where} NIXL side channel"
        if x["endpoint_id"] == 0 and "--data-parallel-rpc-port" in opts:
            yield x["host"], int(opts["--data-parallel-rpc-port"]), f"{where} DP RPC"
        if x["endpoint_id"] == 0 and "--master-port" in opts:
            yield x["host"], int(opts["--master-port"]), f"{where} rendezvous"
    else:
        if not x["headless"] and "--disaggregation-bootstrap-port" in opts:
            yield x["host"], int(opts["--disaggregation-bootstrap-port"]), f"{where} bootstrap"
        if not x["headless"] and "--dist-init-addr" in opts:
            yield x["host"], int(opts["--dist-init-addr"].rsplit(":", 1)[1]), f"{where} rendezvous"


def _listeners(launches: list[Launch]) -> list[str]:
    """No two listeners on one host share a port, across every instance of the case."""
    problems: list[str] = []
    seen: dict[tuple[str, int], str] = {}
    for x in launches:
        for host, port, what in listeners(x):
            if what.endswith("side channel") and host != x["host"]:
                problems.append(f"{what}: host {host} is not the engine's host {x['host']}")
            if (host, port) in seen:
                problems.append(f"{what} and {seen[host, port]} both listen on {host}:{port}")
            seen.setdefault((host, port), what)
    return problems
