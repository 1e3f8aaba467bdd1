"""``motor config check FILE [--section S]``: validate a configuration file.
``motor config reload FILE``: apply its settings that may change while the services run.

Only the file is checked: ``MOTOR_*`` environment variables are deliberately not applied, so the
verdict is about the file and does not depend on the shell it runs in. Key file permissions are
checked by each service when it starts, not here (the files may live on another machine).

``reload`` checks the file the same way, then sends its text to the Controller
(``ReloadConfig``), which reads it as it read its own ``--config``, refuses it whole when it
changes a key that needs a restart, and otherwise stores and applies it and pushes the
Coordinators' part to every Coordinator (docs/configuration-reload.md). Exit codes: 0 applied
(or nothing to change), 1 refused or the call failed (one line on stderr), 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc
from google.rpc import error_details_pb2

from motor_mesh.cli import client
from motor_mesh.common import errors
from motor_mesh.common.config import SECTIONS, ConfigError, load_config
from motor_mesh.gen.motor.v1 import controller_pb2

RELOAD = "motor config reload"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="motor config", description="Configuration tools.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    check = commands.add_parser(
        "check",
        help="validate a configuration file",
        description="Validate a configuration file: print OK, or each error on one line (exit 1).",
    )
    check.add_argument("file", metavar="FILE", help="the JSON configuration file")
    check.add_argument("--section", choices=SECTIONS, help="the section a flat (unsectioned) file holds")
    reload = commands.add_parser(
        "reload",
        help="apply a configuration file's reloadable settings to the running services",
        description="Send a configuration file to the Controller: the keys that may change while "
        "the services run (log levels, the Coordinators' limits, timeouts, policies, tenants file; "
        "the Controller's timings) apply at once, on the Controller and every Coordinator. A file "
        "that changes any other key is refused whole, naming the keys. A flat file is the "
        "controller section.",
        epilog="Exit codes: 0 applied (or nothing changed), 1 refused or the call failed.",
    )
    reload.add_argument("file", metavar="FILE", help="the JSON configuration file")
    client.add_flags(reload, coordinator=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse: --help exits 0, a usage error 2
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "reload":
        return reload(args)
    try:
        load_config(args.file, section=args.section, env={})
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    print("OK")
    return 0


def reload(args: argparse.Namespace) -> int:
    try:
        with open(args.file, encoding="utf-8-sig") as f:
            text = f.read()
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        print(f"{RELOAD}: cannot read {args.file}: {why}", file=sys.stderr)
        return 1
    try:
        # Its mistakes are said here, by line and key, as `motor config check` says them.
        load_config(args.file, section="controller", env={}, text=text)
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    try:
        resp = asyncio.run(_send(args, client.key_of(args), text))
    except ConfigError as err:
        print(f"{RELOAD}: {err.errors[0]}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as err:
        print(failure_line(args.controller, err), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    keys = list(resp.changed_keys)
    if args.output == "json":
        print(json.dumps({"settings_revision": resp.settings_revision, "changed_keys": keys}))
    elif not keys:
        print(f"nothing changed (settings revision {resp.settings_revision})")
    else:
        print(f"settings revision {resp.settings_revision}: {', '.join(keys)}")
        if any(k.startswith("nodemanager.") for k in keys):
            print("nodemanager keys apply as each NodeManager re-reads its own file (kill -HUP)")
    return 0


async def _send(args: argparse.Namespace, key: str | None, text: str) -> controller_pb2.ReloadConfigResponse:
    target = client.controller_target(args, key)
    try:
        req = controller_pb2.ReloadConfigRequest(config_text=text)
        resp: controller_pb2.ReloadConfigResponse = await target.call("ReloadConfig", req, args.timeout)
        return resp
    finally:
        await target.close()


def failure_line(address: str, err: grpc.aio.AioRpcError) -> str:
    """The one line a failed reload prints."""
    refused = [
        v.subject
        for d in errors.details_of(err)
        if isinstance(d, error_details_pb2.PreconditionFailure)
        for v in d.violations
        if v.type == "NOT_RELOADABLE"
    ]
    if refused:
        # A status carries a few violations at most; the message names every key (when it fits).
        named = (err.details() or "").rsplit(": ", 1)[-1].split(", ")
        keys = named if len(named) > len(refused) and all(map(_key_like, named)) else refused
        return f"{RELOAD}: refused, nothing was applied: these keys need a restart: {', '.join(keys)}"
    failure = errors.RpcFailure.of(err)
    if failure.reason == "STATE_WRITE_FAILED":
        return (
            f"{RELOAD}: the Controller at {address} could not store it, nothing changed ({failure.message})"
        )
    if err.code() == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"{RELOAD}: the Controller at {address} cannot reload settings (UNIMPLEMENTED: an older version)"
        )
    return client.rpc_error_line(RELOAD, "Controller", address, err)


def _key_like(text: str) -> bool:
    section, _, key = text.partition(".")
    return section in SECTIONS and key.isidentifier()


if __name__ == "__main__":
    sys.exit(main())
