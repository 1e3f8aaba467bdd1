"""The ``motor`` command: dispatches to each component's own entry point.

Each subcommand lives in the module that owns it and exposes ``main(argv) -> int``; importing
lazily keeps ``motor engine-sim`` from loading gRPC and ``motor --help`` fast.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("motor_mesh.cli.up", "run a whole local cluster (Controller, Coordinator, NodeManagers, engines)"),
    "controller": ("motor_mesh.controller.main", "run the Controller in the foreground"),
    "coordinator": ("motor_mesh.coordinator.main", "run the Coordinator in the foreground"),
    "nodemanager": ("motor_mesh.nodemanager.main", "run a NodeManager in the foreground"),
    "engine-sim": ("motor_mesh.simengine.cli", "run the simulated engine"),
    "register": ("motor_mesh.cli.register", "standalone mode: set/add/del/list Coordinator instances"),
    "instances": (
        "motor_mesh.cli.instances",
        "list the Controller's instances, or follow their changes (--watch)",
    ),
    "alarms": ("motor_mesh.cli.alarms", "list or watch alarms from the Controller"),
    "status": (
        "motor_mesh.cli.status",
        "the cluster on one screen: Controller, Coordinators, NodeManagers, engines",
    ),
    "drain": (
        "motor_mesh.cli.drain",
        "take instances out of routing for a planned stop and wait until their requests are done",
    ),
    "top": ("motor_mesh.cli.top", "a live view of the engines: load, KV cache, tokens/s, latency, alarms"),
    "scale": ("motor_mesh.cli.scale", "set how many instances of a role the cluster should have"),
    "faults": ("motor_mesh.cli.faults", "report or clear a node/device fault (L1-L6) on a NodeManager"),
    "config": (
        "motor_mesh.cli.config_cmd",
        "validate a configuration file (check FILE), or apply its reloadable settings (reload FILE)",
    ),
    "keys": ("motor_mesh.cli.keys", "hash a client API key read on stdin (motor keys hash), or make one"),
}


def _version() -> str:
    try:
        return metadata.version("motor-mesh")
    except metadata.PackageNotFoundError:
        return "0.0.0+local"


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: motor [--version] [--help] <command> [args]", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "Run 'motor <command> --help' for a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"motor {_version()}")
        return 0
    name = args[0]
    if name not in COMMANDS:
        print(f"motor: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(args[1:]))
