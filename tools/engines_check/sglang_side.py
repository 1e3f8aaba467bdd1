"""Feed Motor's SGLang launch lines through SGLang itself (run with the SGLang venv's python).

For every launch: ``sglang.launch_server``'s own argument preparation (``prepare_server_args``),
the resolution pass the launcher runs (``resolve_once``) and the launch-time validation
(``check_server_args``). The resolved arguments are compared with where Motor's plan put the
engine, and facts that must agree between processes (a rank's rendezvous and bootstrap server,
schedulers per host) are compared across each case.

CPU: SGLang resolves its device before anything else and, with no accelerator, stops with "No
accelerator ... is available"; ``--device cpu`` is appended to every line. Motor's lines carry
no ``--device``, so the appended flag changes the device and nothing Motor chose.

Deliberately free of Motor imports: it runs in a venv that has SGLang and not Motor.
Usage: python sglang_side.py LAUNCHES.json
"""

from __future__ import annotations

import sys
import warnings
from collections import defaultdict
from typing import Any

import side_runner  # beside this file: the sides run as scripts in the engines' venvs
from side_runner import Facts, parsed

CPU_ARGS = ["--device", "cpu"]


def resolve(args: list[str]) -> Any:
    """What launch_server resolves ``args`` to (raises what it would raise)."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    server_args = parsed(prepare_server_args, args)
    server_args.resolve_once()
    server_args.check_server_args()
    return resolving_view(server_args)


def host_of(addr: str) -> str:
    host = addr.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def check_launch(launch: dict[str, Any], placeholder: str, fixture: str) -> Facts:
    """What SGLang makes of one launch line; raises on anything SGLang or the plan disagrees with."""
    argv = list(launch["argv"])
    if argv[1:3] != ["-m", "sglang.launch_server"]:
        raise ValueError(f"argv does not run sglang.launch_server: {argv[:3]}")
    args = argv[3:]
    at = args.index("--model-path") + 1 if "--model-path" in args else -1
    if at < 1 or at >= len(args) or args[at] != placeholder:
        raise ValueError(f"no --model-path {placeholder} in argv")
    args[at] = fixture
    cfg = resolve(args + CPU_ARGS)
    disagg = cfg.disaggregation_mode
    facts: Facts = {
        # launch_server returns before starting HTTP on node_rank >= 1 (schedulers only).
        "mode": "http" if cfg.node_rank == 0 else "follower",
        "host": cfg.host,
        "port": cfg.port,
        "dp_size": cfg.dp_size,
        "tp_size": cfg.tp_size,
        "nnodes": cfg.nnodes,
        "node_rank": cfg.node_rank,
        "dist_init_addr": cfg.dist_init_addr,
        "disaggregation_mode": disagg,
        # Where this process finds its bootstrap server (disaggregation/common/conn.py,
        # register_to_bootstrap): the rendezvous host when multi-node, else its own host.
        "bootstrap": (
            (
                host_of(cfg.dist_init_addr) if cfg.dist_init_addr else cfg.host,
                cfg.disaggregation_bootstrap_port,
            )
            if disagg != "null"
            else None
        ),
    }
    expected = {
        "mode": "follower" if launch["headless"] else "http",
        "host": launch["host"],
        "port": launch["port"],
        "dp_size": 1,
        "nnodes": launch["nnodes"],
        "node_rank": launch["node_rank"],
        "disaggregation_mode": launch["role"] if launch["role"] in ("prefill", "decode") else "null",
    }
    wrong = {k: f"{facts[k]!r} (expected {v!r})" for k, v in expected.items() if facts[k] != v}
    if wrong:
        raise AssertionError("SGLang resolved " + ", ".join(f"{k}={v}" for k, v in wrong.items()))
    return facts


def cross_check(launches: list[dict[str, Any]], facts: list[Facts]) -> list[str]:
    """Facts that must agree between one case's processes, as SGLang resolved them."""
    problems: list[str] = []
    ranks: dict[tuple[str, int], list[tuple[dict[str, Any], Facts]]] = defaultdict(list)
    schedulers: dict[tuple[str, str], int] = defaultdict(int)
    ranks_on: dict[tuple[str, str], set[int]] = defaultdict(set)
    for launch, f in zip(launches, facts, strict=True):
        rank = launch["endpoint_id"] % launch["dp"]
        ranks[launch["instance"], rank].append((launch, f))
        schedulers[launch["instance"], launch["host"]] += f["dp_size"]
        ranks_on[launch["instance"], launch["host"]].add(rank)
    for key, n in schedulers.items():
        if n > len(ranks_on[key]):
            problems.append(
                f"{key[0]}: {n} DP schedulers on {key[1]}, which holds {len(ranks_on[key])} rank(s)"
            )
    servers: dict[tuple[str, int], str] = {}
    for (instance, rank), parts in ranks.items():
        head = next((f for launch, f in parts if not launch["headless"]), None)
        if head is None:
            problems.append(f"{instance}: DP rank {rank} has no HTTP part")
            continue
        if sorted(f["node_rank"] for _, f in parts) != list(range(head["nnodes"])):
            problems.append(f"{instance}: rank {rank} has node ranks {[f['node_rank'] for _, f in parts]}")
        addrs = {f["dist_init_addr"] for _, f in parts}
        if len(addrs) != 1 or (head["dist_init_addr"] and host_of(head["dist_init_addr"]) != head["host"]):
            problems.append(f"{instance}: rank {rank}'s parts rendezvous at {sorted(map(str, addrs))}")
        if head["bootstrap"] is None:
            continue
        # The head serves the bootstrap server on its own host; every part must look there.
        served = (head["host"], head["bootstrap"][1])
        for launch, f in parts:
            if f["bootstrap"] != served:
                problems.append(
                    f"{instance}/ep{launch['endpoint_id']}: bootstrap {f['bootstrap']}, head serves {served}"
                )
        if served in servers:
            problems.append(f"{instance} rank {rank} and {servers[served]} both serve bootstrap on {served}")
        servers.setdefault(served, f"{instance} rank {rank}")
    return problems


def describe(launch: dict[str, Any], f: Facts) -> str:
    text = (
        f"{launch['instance']}/ep{launch['endpoint_id']}@{launch['host']} {f['mode']} dp_size={f['dp_size']}"
    )
    text += f" tp={f['tp_size']}"
    if f["nnodes"] > 1:
        text += f" node_rank={f['node_rank']}/{f['nnodes']} dist_init={f['dist_init_addr']}"
    text += f" disagg={f['disaggregation_mode']}"
    if f["bootstrap"]:
        text += f" bootstrap={f['bootstrap'][0]}:{f['bootstrap'][1]}"
    return text


def main(path: str) -> int:
    warnings.simplefilter("ignore")  # import-time notices about CUDA-only kernels
    print(f"sglang: CPU forced by appending {' '.join(CPU_ARGS)} to every launch line", flush=True)
    return side_runner.run("sglang", path, check_launch, describe, cross_check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
