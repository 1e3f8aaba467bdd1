"""Cross-process invariants of the case table (cases.py): what no single engine can see.

Facts that must agree between the processes of an instance, and ports that must not collide on a
host. :func:`check` returns a case's problems.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable

from motor_mesh.nodemanager import launch

from .cases import Launch

PROGRAM = {"vllm": ("vllm", "serve"), "sglang": ("-m", "sglang.launch_server")}
SHARD_FLAGS = {
    "vllm": ("--tensor-parallel-size", "--pipeline-parallel-size"),
    "sglang": ("--tp-size", "--pp-size"),
}
DP_MASTER_FLAGS = ("--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-rank")
VLLM_NODE_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port")


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


def check(launches: list[Launch]) -> list[str]:
    """Problems in one case's launches ([] = none)."""
    problems: list[str] = []
    by_instance: dict[str, list[Launch]] = defaultdict(list)
    for x in launches:
        by_instance[x["instance"]].append(x)
        problems += _common(x)
    for group in by_instance.values():
        if group[0]["engine"] == "sglang":
            problems += _sglang_instance(group)
        elif group[0]["dp_group"]:
            problems += _vllm_instance(group)
        else:
            problems += _vllm_dense_instance(group)
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
            for flag in DP_MASTER_FLAGS:
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
            for flag in VLLM_NODE_FLAGS:
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


def _vllm_dense_instance(group: list[Launch]) -> list[str]:
    """No DP group (engine.data_parallel_group false): every rank is its own vLLM, and a rank
    spanning nodes is its own multi-node world meeting at its own head."""
    problems: list[str] = []
    nnodes = group[0]["nnodes"]
    heads = _heads(group)
    parts: dict[int, list[tuple[str | None, str | None]]] = defaultdict(list)
    routable: list[int] = []
    for x in group:
        opts = options(x)
        _expect(problems, x, opts, "--data-parallel-size", "1")
        for flag in DP_MASTER_FLAGS:
            _expect(problems, x, opts, flag, None)
        if not x["headless"]:
            routable.append(_rank(x))
        head = heads.get(_rank(x))
        if nnodes > 1 and head is None:
            problems.append(f"{_where(x)}: no routable endpoint for DP rank {_rank(x)}")
        elif nnodes > 1:
            _expect(problems, x, opts, "--nnodes", str(nnodes))
            _expect(problems, x, opts, "--node-rank", str(x["node_rank"]))
            _expect(problems, x, opts, "--master-addr", head["host"])
            port = launch.offset_port(head["port"], launch.RENDEZVOUS_OFFSET)
            _expect(problems, x, opts, "--master-port", str(port))
            rendezvous = (opts.get("--master-addr"), opts.get("--master-port"))
            parts[_rank(x)].append((f"{rendezvous[0]}:{rendezvous[1]}", opts.get("--node-rank")))
        else:
            for flag in VLLM_NODE_FLAGS:
                _expect(problems, x, opts, flag, None)
        _expect(problems, x, opts, "--headless", "" if x["headless"] else None)
        _kv_transfer(problems, x, opts)
    where, dp = group[0]["instance"], group[0]["dp"]
    if sorted(routable) != list(range(dp)):
        problems.append(f"{where}: routable engines have DP ranks {sorted(routable)}, expected 0..{dp - 1}")
    problems += _parts_meet(where, parts, nnodes, "independent DP ranks share a rendezvous")
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
    problems += _parts_meet(where, parts, nnodes, "DP ranks share a --dist-init-addr")
    return problems


def _parts_meet(
    where: str, parts: dict[int, list[tuple[str | None, str | None]]], nnodes: int, shared: str
) -> list[str]:
    """Each rank's parts (rendezvous address, node rank) meet at one address with node ranks
    0 .. nnodes-1, and no two ranks share an address (``shared`` names that problem)."""
    problems = []
    for rank, rank_parts in parts.items():
        addrs = {a for a, _ in rank_parts}
        node_ranks = sorted(str(r) for _, r in rank_parts)
        if len(addrs) != 1 or node_ranks != [str(k) for k in range(nnodes)]:
            problems.append(f"{where}: rank {rank}'s parts do not meet: {sorted(rank_parts, key=str)}")
    firsts = [rank_parts[0][0] for rank_parts in parts.values()]
    if len(set(firsts)) != len(firsts):
        problems.append(f"{where}: {shared}: {firsts}")
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
        # The rendezvous store: on the DP master, or (no DP group) on each rank's head.
        hosts_store = x["endpoint_id"] == 0 if x["dp_group"] else x["node_rank"] == 0
        if hosts_store and "--master-port" in opts:
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
