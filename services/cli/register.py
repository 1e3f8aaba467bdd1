"""``motor register set|add|del|list``: a Coordinator's table kept by hand (standalone mode).

For engines started outside Motor (``vllm serve``, SGLang, ``motor engine-sim``): no Controller,
no NodeManagers; the operator names each instance's role and endpoints and this command works out
the rest (docs/standalone.md). Before writing it checks each engine (``/v1/models``), waits for the
Coordinator, reads its table and refuses a conflict, so a refused command changes nothing.

Exit codes: 0 done (or nothing to change), 1 refused or failed (one line on stderr), 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.cli import client, engine_check
from motor_mesh.cli import standalone as sa
from motor_mesh.cli import table_checks as checks
from motor_mesh.cli.views import instance_rows, print_table
from motor_mesh.common import enums
from motor_mesh.common.config import ConfigError
from motor_mesh.coordinator import validation
from motor_mesh.gen.motor.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

PROG = "motor register"
ROLES = ("prefill", "decode", "union")
COORDINATOR_SERVICE = "motor.v1.Coordinator"
READY_POLL_S = 0.2


class Usage(Exception):
    """The command line asks for something that cannot be done: exit 2."""


@dataclass
class Planned:
    spec: sa.InstanceSpec
    given: common_pb2.Instance | None = None  # from --file: its fields win over derived ones
    model: str = ""


def _instance_arg(role: str) -> Callable[[str], sa.InstanceSpec]:
    def parse(text: str) -> sa.InstanceSpec:
        try:
            return sa.parse_instance(role, text)
        except sa.InputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Keep a standalone Coordinator's instance table by hand (no Controller).",
        epilog="Run 'motor register ACTION --help' for an action's flags.",
    )
    sub = p.add_subparsers(dest="action", required=True, metavar="{set,add,del,list}")
    helps = {
        "set": "replace the whole table with these instances",
        "add": "add these instances (one already registered is left as it is)",
        "del": "remove instances, named by their endpoints or by --id",
        "list": "print the table",
    }
    for action, text in helps.items():
        sp = sub.add_parser(action, help=text, description=text)
        client.add_flags(sp, controller=False)
        if action == "list":
            continue
        for role in ROLES:
            sp.add_argument(
                f"--{role}",
                dest=role,
                action="append",
                default=[],
                type=_instance_arg(role),
                metavar="H:P[:B][,H:P[:B]...]",
                help=f"one {role} instance; commas separate its DP endpoints; :B = SGLang bootstrap port",
            )
        sp.add_argument(
            "--id",
            dest="ids",
            action="append",
            default=[],
            type=client.instance_id,
            metavar="N",
            help="del: an instance to remove (repeatable); add/set: the id of the one instance "
            "given, instead of the one derived from its role and endpoints",
        )
        sp.add_argument(
            "-f", "--file", metavar="F", help='instances as JSON ({"instances": [...]}; "-" = stdin)'
        )
        sp.add_argument("--dry-run", action="store_true", help="print the request as JSON and send nothing")
        if action == "del":
            continue
        sp.add_argument("--model-name", default="", help="default: the model the engines' /v1/models lists")
        sp.add_argument("--engine-type", choices=sorted(enums.ENGINE_TYPES_BY_NAME), default="vllm")
        sp.add_argument(
            "--pd-protocol",
            choices=["vllm", "sglang"],
            default="",
            help="KV hand-off protocol (default: the engine type's own; sim speaks both)",
        )
        sp.add_argument("--no-health-check", action="store_true", help="do not check /v1/models")
        if action == "set":
            sp.add_argument("--force", action="store_true", help="replace instances a Controller manages too")
    return p.parse_args(argv)


# ---- planning ------------------------------------------------------------------------------


def _read_file(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise sa.InputError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None


def planned_of(args: argparse.Namespace) -> list[Planned]:
    plans = [Planned(spec) for role in ROLES for spec in getattr(args, role)]
    if args.file:
        for inst in sa.parse_json(_read_file(args.file), args.file):
            plans.append(Planned(sa.spec_of(inst), inst, inst.model_name))
    return plans


async def _models(plans: Sequence[Planned], args: argparse.Namespace) -> None:
    """Fill each plan's model: checked against the engines unless --no-health-check."""
    wanted = args.model_name
    if args.no_health_check:
        for plan in plans:
            plan.model = plan.model or wanted
            if not plan.model:
                raise Usage("--model-name is required with --no-health-check")
        return
    served = await asyncio.gather(
        *(engine_check.instance_model(plan.spec.endpoints, args.timeout) for plan in plans)
    )
    for plan, model in zip(plans, served, strict=True):
        expected = plan.model or wanted
        if expected and expected != model:
            raise sa.InputError(
                f"{plan.spec.describe()} serves {model!r}, not {expected!r}: requests for "
                f"{expected!r} would fail there"
            )
        plan.model = model


def build_all(plans: Sequence[Planned], args: argparse.Namespace) -> list[common_pb2.Instance]:
    if args.ids and (len(plans) != 1 or len(args.ids) != 1):
        raise Usage(
            f"--id gives the id of exactly one instance; {len(plans)} instance(s), {len(args.ids)} --id"
        )
    out = []
    for plan in plans:
        inst = sa.build(
            plan.spec, plan.model, args.engine_type, args.pd_protocol, args.ids[0] if args.ids else 0
        )
        if plan.given is not None:
            inst = _fill(plan.given, inst)
        out.append(inst)
    checks.refuse_overlaps(out)
    # The Coordinator's own request checks, here too, so a dry run shows what it would refuse.
    bad = validation.instance_list(out)
    if bad:
        raise sa.InputError("; ".join(f"{path}: {problem}" for path, problem in bad))
    return out


def _fill(given: common_pb2.Instance, derived: common_pb2.Instance) -> common_pb2.Instance:
    """The instance from the file, with what it left out taken from the derived one."""
    inst = common_pb2.Instance()
    inst.CopyFrom(given)
    for name in ("id", "job_name", "model_name", "engine_type", "pd_protocol", "status"):
        if not getattr(inst, name):
            setattr(inst, name, getattr(derived, name))
    if not inst.HasField("parallel"):
        inst.parallel.CopyFrom(derived.parallel)
    return inst


# ---- the Coordinator -----------------------------------------------------------------------


async def _wait_ready(args: argparse.Namespace) -> None:
    """Until the Coordinator's management service is SERVING (it may be starting or restarting).
    Each check fails fast rather than waiting for the channel, so the last failure (refused, a
    TLS handshake that fails) is what the operator reads if it never gets ready."""
    async with client.channel(args, args.coordinator, None, retries=False) as ch:
        await _poll_ready(health_pb2_grpc.HealthStub(ch), args)


async def _poll_ready(health: health_pb2_grpc.HealthStub, args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.timeout
    while True:
        try:
            resp = await health.Check(
                health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE),
                timeout=max(0.1, min(deadline - loop.time(), 2.0)),
                wait_for_ready=False,
            )
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.aio.AioRpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            last = f"{err.code().name}: {(err.details() or '').strip()[:300]}"
        if loop.time() >= deadline:
            raise sa.InputError(
                f"cannot reach the Coordinator at {args.coordinator}: "
                f"not ready after {args.timeout:g} s ({last})"
            )
        await asyncio.sleep(READY_POLL_S)


class _Answer(Protocol):
    revision: int
    instance_count: int


async def _run(args: argparse.Namespace) -> int:
    key = client.key_of(args)
    instances: list[common_pb2.Instance] = []
    if args.action in ("set", "add"):
        plans = planned_of(args)
        if not plans:
            raise Usage(f"{args.action} needs at least one --prefill/--decode/--union or --file")
        await _models(plans, args)
        instances = build_all(plans, args)
        if args.dry_run:  # before any contact with the Coordinator: works offline
            print(sa.to_json(instances))
            return 0
    await _wait_ready(args)
    async with client.channel(args, args.coordinator, key) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        table = await stub.ListInstances(
            coordinator_pb2.CoordinatorListInstancesRequest(), timeout=args.timeout
        )
        if args.action == "list":
            return _print_list(args, table)
        held = checks.held_of(table)
        resp: _Answer
        if args.action == "del":
            targets = checks.delete_targets(_named_for_delete(args), held, args.coordinator)
            request = coordinator_pb2.DeleteInstancesRequest(
                instances=[checks.identity_only(i) for i in targets]
            )
            if args.dry_run:
                print(sa.to_json(request.instances))
                return 0
            resp = await stub.DeleteInstances(request, timeout=args.timeout)
            lines = [f"deleted {checks.describe(i)} job {i.job_name!r}" for i in targets]
        elif args.action == "add":
            checks.refuse_add_conflicts(instances, held)
            resp = await stub.AddInstances(
                coordinator_pb2.AddInstancesRequest(instances=instances), timeout=args.timeout
            )
            lines = [
                f"{'unchanged (already registered)' if i.id in held else 'added'} {_summary(i)}"
                for i in instances
            ]
        else:
            checks.refuse_set_conflicts(held, args.force)
            resp = await stub.SetInstances(
                coordinator_pb2.SetInstancesRequest(instances=instances), timeout=args.timeout
            )
            kept = {i.id for i in instances}
            lines = [f"set {_summary(i)}" for i in instances]
            lines += [f"removed {checks.describe(i)}" for i in held.values() if i.id not in kept]
    if args.output == "json":
        result = {"revision": resp.revision, "instance_count": resp.instance_count, "changes": lines}
        print(json.dumps(result, indent=2))
    else:
        print("\n".join(lines))
        print(f"revision {resp.revision}, {resp.instance_count} instance(s) on the Coordinator")
    return 0


def _summary(inst: common_pb2.Instance) -> str:
    return f"{checks.describe(inst)} job {inst.job_name!r} model {inst.model_name!r}"


def _named_for_delete(args: argparse.Namespace) -> list[tuple[int, sa.InstanceSpec | None]]:
    named: list[tuple[int, sa.InstanceSpec | None]] = [(iid, None) for iid in args.ids]
    for plan in planned_of(args):
        given = plan.given.id if plan.given is not None else 0
        derived = sa.derive_id(plan.spec.role, ((e.host, e.port) for e in plan.spec.endpoints))
        named.append((given or derived, plan.spec))
    if not named:
        raise Usage("del needs instances (--prefill/--decode/--union/--file) or --id")
    return named


def _print_list(args: argparse.Namespace, table: coordinator_pb2.CoordinatorListInstancesResponse) -> int:
    if args.output == "json":
        print(json.dumps(MessageToDict(table, preserving_proto_field_name=True), indent=2))
        return 0
    rows = [["GROUP", *instance_rows([])[0]]]
    for group in ("available", "paused", "unavailable"):
        for row in instance_rows(getattr(table, group))[1:]:
            rows.append([group, checks.hex_id(int(row[0])), *row[1:]])
    print_table(rows)
    print(f"revision {table.revision}, incarnation {table.incarnation}")
    return 0


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        return asyncio.run(_run(args))
    except Usage as err:
        print(f"{PROG} {args.action}: {err}", file=sys.stderr)
        return 2
    except sa.InputError as err:
        print(f"{PROG} {args.action}: {err}", file=sys.stderr)
    except ConfigError as err:
        print(f"{PROG} {args.action}: {err.errors[0]}", file=sys.stderr)
    except grpc.aio.AioRpcError as err:
        print(
            client.rpc_error_line(f"{PROG} {args.action}", "Coordinator", args.coordinator, err),
            file=sys.stderr,
        )
    except KeyboardInterrupt:
        return 130
    return 1
