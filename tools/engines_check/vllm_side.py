"""Feed Motor's vLLM launch lines through vLLM itself (run with the vLLM venv's python).

For every launch: ``vllm serve``'s own parser and argument validation, its own dispatch (which
server a process becomes: one API server, headless engines or headless workers), then the
engine config that path builds, all on vLLM's CPU platform. The resulting VllmConfig is compared
with where Motor's plan put the engine, and facts that must agree between processes (DP master,
rendezvous, NIXL side channels) are compared across each case. A launch without a DP group
(``dp_group`` false, a dense model) must resolve to a vLLM of its own: DP size 1, rank 0, and a
rank spanning nodes meeting at its own head.

Deliberately free of Motor imports: it runs in a venv that has vLLM and not Motor.
Usage: python vllm_side.py LAUNCHES.json
"""

from __future__ import annotations

import os
import sys
import types
from collections import defaultdict
from typing import Any
from unittest import mock

import side_runner  # beside this file: the sides run as scripts in the engines' venvs
from side_runner import Facts, Launch, parsed

# The platform is resolved lazily from this on first use; without it a machine with no GPU gets
# vLLM's "unspecified" platform, which cannot build a device config.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
# vLLM logs to stdout by default; keep stdout for the result lines.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


def serve_command() -> tuple[Any, Any]:
    """``vllm serve``'s parser and subcommand, assembled as vllm's own CLI main does."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    return parser, cmd


def dispatch(cmd: Any, args: Any) -> str:
    """Run ``vllm serve``'s dispatch with every server start replaced by a recorder: which path
    would this process take? (It also applies serve's own checks and defaults to ``args``.)"""
    from vllm.entrypoints.cli import serve

    taken: list[str] = []

    def record(name: str) -> Any:
        return lambda *_a, **_k: taken.append(name)

    with (
        mock.patch.object(serve, "run_server", record("api-server")),
        mock.patch.object(serve, "run_headless", record("headless")),
        mock.patch.object(serve, "run_multi_api_server", record("multi-api-server")),
        mock.patch.object(serve, "run_dp_supervisor", record("dp-supervisor")),
        mock.patch.object(serve, "uvloop", types.SimpleNamespace(run=lambda _coro: None)),
    ):
        cmd.cmd(args)
    if len(taken) != 1:
        raise RuntimeError(f"vllm serve took {taken or 'no'} start-up path(s)")
    return taken[0]


def engine_config(args: Any, mode: str) -> Any:
    """The VllmConfig the chosen path builds (run_server and run_headless alike)."""
    import vllm
    from vllm.entrypoints.common.cli_args import propagate_flash_late_interaction
    from vllm.usage.usage_lib import UsageContext

    engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
    propagate_flash_late_interaction(args, engine_args)
    return engine_args.create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER, headless=mode == "headless"
    )


def check_launch(launch: dict[str, Any], placeholder: str, fixture: str, parser: Any, cmd: Any) -> Facts:
    """What vLLM makes of one launch line; raises on anything vLLM or the plan disagrees with."""
    import vllm.envs as envs

    argv = list(launch["argv"])
    if argv[:3] != ["vllm", "serve", placeholder]:
        raise ValueError(f"argv does not start with 'vllm serve {placeholder}': {argv[:3]}")
    argv[2] = fixture
    args = parsed(parser.parse_args, argv[1:])
    cmd.validate(args)
    mode = dispatch(cmd, args)
    cfg = engine_config(args, mode)
    pc = cfg.parallel_config
    if mode == "headless":
        # run_headless starts only workers on a rank's later nodes, engines on its first.
        mode = "headless-workers" if pc.node_rank_within_dp > 0 else "headless-engines"
    kv = cfg.kv_transfer_config
    facts: Facts = {
        "mode": mode,
        "dp_rank": pc.data_parallel_rank,
        "dp_size": pc.data_parallel_size,
        "external_lb": pc.data_parallel_external_lb,
        "dp_master": (pc.data_parallel_master_ip, pc.data_parallel_rpc_port),
        "node_rank": pc.node_rank,
        "nnodes": pc.nnodes,
        "part": pc.node_rank_within_dp,
        "parts": pc.nnodes_within_dp,
        "rendezvous": (pc.master_addr, pc.master_port),
        "kv_role": kv.kv_role if kv is not None else None,
        # What the NIXL scheduler listens on and advertises (nixl/base_scheduler.py).
        "side_channel": (
            envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
            envs.VLLM_NIXL_SIDE_CHANNEL_PORT + pc.data_parallel_index,
        ),
    }
    rank = launch["endpoint_id"] % launch["dp"]
    grouped = launch["dp_group"]
    expected = {
        "mode": "headless-workers" if launch["headless"] else "api-server",
        "dp_rank": rank if grouped else 0,
        "dp_size": launch["dp"] if grouped else 1,
        "external_lb": grouped and launch["dp"] > 1,
        "part": launch["node_rank"],
        "parts": launch["nnodes"],
        "kv_role": KV_ROLE.get(launch["role"]),
    }
    wrong = {k: f"{facts[k]!r} (expected {v!r})" for k, v in expected.items() if facts[k] != v}
    if facts["side_channel"][0] != launch["host"]:
        wrong["side_channel"] = f"{facts['side_channel']} is not on the engine's host {launch['host']}"
    if wrong:
        raise AssertionError("vLLM resolved " + ", ".join(f"{k}={v}" for k, v in wrong.items()))
    return facts


def cross_check(launches: list[dict[str, Any]], facts: list[Facts]) -> list[str]:
    """Facts that must agree between one case's processes, as vLLM resolved them."""
    problems: list[str] = []
    shared: dict[tuple[str, str], set[Any]] = defaultdict(set)
    side: dict[tuple[str, int], str] = {}
    # DP rank 0's first process hosts the DP coordinator and the rendezvous store; without a DP
    # group, each rank's first process hosts that rank's own rendezvous store.
    first = {(x["instance"], x["endpoint_id"]): x["host"] for x in launches if x["node_rank"] == 0}
    worlds: dict[str, dict[int, Any]] = defaultdict(dict)
    for launch, f in zip(launches, facts, strict=True):
        name = f"{launch['instance']}/ep{launch['endpoint_id']}"
        rank = launch["endpoint_id"] % launch["dp"]
        if launch["dp"] > 1 and launch["dp_group"]:
            shared[launch["instance"], "DP master"].add(f["dp_master"])
            if f["dp_master"][0] != first[launch["instance"], 0]:
                problems.append(f"{name}: DP master {f['dp_master'][0]} is not rank 0's host")
        if launch["nnodes"] > 1:
            world = 0 if launch["dp_group"] else rank  # the DP rank whose head hosts the store
            of = "" if launch["dp_group"] else f"rank {rank}'s "
            shared[launch["instance"], f"{of}rendezvous"].add(f["rendezvous"])
            shared[launch["instance"], f"{of}nnodes"].add(f["nnodes"])
            worlds[launch["instance"]][world] = f["rendezvous"]
            if f["rendezvous"][0] != first[launch["instance"], world]:
                problems.append(f"{name}: rendezvous {f['rendezvous'][0]} is not rank {world}'s host")
        if f["side_channel"] in side:
            problems.append(
                f"{name} and {side[f['side_channel']]} share NIXL side channel {f['side_channel']}"
            )
        side.setdefault(f["side_channel"], name)
    for instance, by_world in worlds.items():
        if len(set(by_world.values())) != len(by_world):
            problems.append(f"{instance}: separate worlds share a rendezvous: {sorted(by_world.items())}")
    for (instance, what), values in shared.items():
        if len(values) != 1:
            problems.append(f"{instance}: processes disagree on {what}: {sorted(values, key=str)}")
    return problems


def describe(launch: dict[str, Any], f: Facts) -> str:
    host, port = f["side_channel"]
    text = f"{launch['instance']}/ep{launch['endpoint_id']}@{launch['host']} {f['mode']}"
    text += f" dp_rank={f['dp_rank']}/{f['dp_size']}"
    if f["dp_size"] > 1:
        text += f" dp_master={f['dp_master'][0]}:{f['dp_master'][1]}"
    if launch["nnodes"] > 1:
        text += (
            f" node_rank={f['node_rank']}/{f['nnodes']} rendezvous={f['rendezvous'][0]}:{f['rendezvous'][1]}"
        )
    return text + f" kv_role={f['kv_role']} nixl={host}:{port}"


def main(path: str) -> int:
    parser, cmd = serve_command()
    print("vllm: CPU platform forced with VLLM_TARGET_DEVICE=cpu", flush=True)

    def check(launch: Launch, placeholder: str, fixture: str) -> Facts:
        return check_launch(launch, placeholder, fixture, parser, cmd)

    return side_runner.run("vllm", path, check, describe, cross_check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
