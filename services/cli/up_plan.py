"""What ``motor up`` runs: every child's command line and environment (up.py starts, watches and
stops them).

Under ``--ha`` an etcd comes first, and two Controllers share the state in it: one leads, the
other stands by and takes over when the leader goes. Everything that talks to the Controller is
given both addresses and follows the leader.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from services.common import retry
from services.common.config import Config
from services.common.config.loader import WILDCARDS

# /metrics of Controller i (+ i) and of NodeManager i (+ i), where the configuration leaves it off.
CONTROLLER_METRICS_PORT, NODEMANAGER_METRICS_PORT = 9100, 9300
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
HA_CONTROLLERS = 2
ETCD_PREFIX = "/motor"
# `motor controller`'s exit status when it lost its lease (services/controller/ha.py): it comes
# back as a standby, so even before READY that is a restart, not a failed start.
LOST_LEADERSHIP_EXIT = 3
NO_ETCD = "motor up --ha needs etcd (Debian package etcd-server; `make system-deps` installs it)"


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    state_dir: Path | None = None  # NodeManagers: where engines.json records their engines
    # etcd does not watch its stdin: it is stopped by SIGTERM, and runs in a session of its own
    # so a terminal's Ctrl-C does not stop it before the Controllers that still write to it.
    foreign: bool = False
    restart_codes: frozenset[int] = frozenset()  # exits that are restarts even before READY
    proc: asyncio.subprocess.Process | None = None
    pump: asyncio.Task[None] | None = None
    restarts: int = 0
    # A child that was running fine is back at once (its work waits on it); one that keeps
    # crashing slows down to one try every 10 s.
    backoff: retry.Backoff = field(default_factory=lambda: retry.Backoff(initial=0.1, maximum=10.0))
    started: float = 0.0
    last_error: str | None = None  # the last line of its output that can say why it failed


@dataclass
class Plan:
    etcd: Child | None  # --ha only
    controllers: list[Child]
    coordinator: Child
    nodes: list[Child]
    controller_addrs: list[str]  # where each Controller serves, in the order of ``controllers``
    coordinator_addr: str
    etcd_endpoint: str  # "" without --ha

    @property
    def children(self) -> list[Child]:
        return [*([self.etcd] if self.etcd else []), *self.controllers, self.coordinator, *self.nodes]

    @property
    def controller_target(self) -> str:
        """What NodeManagers and the Coordinator are told: every Controller, comma-separated."""
        return ",".join(self.controller_addrs)


def etcd_binary() -> str | None:
    """etcd on PATH, else Debian's (a PATH without /usr/bin still finds it)."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)


def plan(args: argparse.Namespace, cfg: Config, state: Path, etcd: str = "etcd") -> Plan:
    """Every child of ``motor up ARGS`` on ``cfg``, with state under ``state``; ``etcd`` is the
    binary run under ``--ha``."""
    off = args.port_offset
    base = [sys.executable, "-m", "services.cli"]
    config = ["--config", args.config] if args.config else []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ctl, co = cfg.controller, cfg.coordinator
    coordinator_addr = f"{co.host}:{co.port + off}"
    count = HA_CONTROLLERS if args.ha else 1
    # Under --ha each Controller advertises its address: a wildcard host there would be dialled.
    host = "127.0.0.1" if args.ha and ctl.host in WILDCARDS else ctl.host
    controller_addrs = [f"{host}:{ctl.port + i + off}" for i in range(count)]
    target = ",".join(controller_addrs)
    ctl_env = dict(env, MOTOR_CONTROLLER_COORDINATORS=json.dumps([coordinator_addr]))
    etcd_child, endpoint = None, ""
    if args.ha:
        etcd_child, endpoint = _etcd(etcd, state / "etcd", off)
        ctl_env |= {
            "MOTOR_CONTROLLER_STORE": "etcd",
            "MOTOR_CONTROLLER_ETCD_ENDPOINTS": json.dumps([endpoint]),
            "MOTOR_CONTROLLER_ETCD_PREFIX": ETCD_PREFIX,
            # Our etcd speaks plaintext on loopback, whatever the configuration says of another.
            "MOTOR_CONTROLLER_ETCD_CA_FILE": "",
            "MOTOR_CONTROLLER_ETCD_CERT_FILE": "",
            "MOTOR_CONTROLLER_ETCD_KEY_FILE": "",
        }
    controllers = []
    for i in range(count):
        name = f"controller-{i}" if args.ha else "controller"
        argv = [*base, "controller", *config, "--port", str(ctl.port + i + off)]
        argv += ["--metrics-port", str((ctl.metrics_port or CONTROLLER_METRICS_PORT) + i + off)]
        own = {"MOTOR_CONTROLLER_STATE_DIR": str(state / name)}
        if args.ha:  # what the other names as the leader's address while this one leads
            own["MOTOR_CONTROLLER_ADVERTISE_ADDRESS"] = controller_addrs[i]
        controllers.append(
            Child(
                name,
                argv,
                dict(ctl_env, **own),
                restart_codes=frozenset({LOST_LEADERSHIP_EXIT}) if args.ha else frozenset(),
            )
        )
    coordinator = Child(
        "coordinator",
        [*base, "coordinator", *config, "--port", str(co.port + off), "--http-port", str(co.http_port + off)],
        dict(env, **_coordinator_env(cfg, target)),
    )
    return Plan(
        etcd_child,
        controllers,
        coordinator,
        _nodemanagers(args, cfg, state, env, [*base, "nodemanager", *config], target),
        controller_addrs,
        coordinator_addr,
        endpoint,
    )


def _etcd(binary: str, data_dir: Path, off: int) -> tuple[Child, str]:
    endpoint = f"127.0.0.1:{ETCD_CLIENT_PORT + off}"
    client, peer = f"http://{endpoint}", f"http://127.0.0.1:{ETCD_PEER_PORT + off}"
    argv = [
        binary,
        "--name=motor-up",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=motor-up={peer}",
        # etcd 3.4 logs every step at info; warnings and errors are what an operator needs.
        "--logger=zap",
        "--log-outputs=stderr",
        "--log-level=warn",
    ]
    # An ETCD_* variable that repeats one of these flags makes etcd refuse to start.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    return Child("etcd", argv, env, foreign=True), endpoint


def _coordinator_env(cfg: Config, target: str) -> dict[str, str]:
    """Where the Coordinator reports precision alarms: this cluster's Controllers (their ports
    move with --port-offset), with the key they require unless the configuration names
    another."""
    env = {"MOTOR_COORDINATOR_CONTROLLER": target}
    co, ctl = cfg.coordinator, cfg.controller
    if not co.controller_key_file and ctl.management_key_file:
        env["MOTOR_COORDINATOR_CONTROLLER_KEY_FILE"] = ctl.management_key_file
    return env


def _nodemanagers(
    args: argparse.Namespace, cfg: Config, state: Path, env: dict[str, str], argv: list[str], target: str
) -> list[Child]:
    """One NodeManager per instance, in the order prefill, decode, union."""
    off, nm_cfg = args.port_offset, cfg.nodemanager
    dp = args.dp or nm_cfg.parallel.dp
    nm_env = dict(env)
    if args.dp:  # replaces the configured DP size; tp, pp, ... stay as configured
        nm_env["MOTOR_NODEMANAGER_PARALLEL"] = json.dumps(asdict(replace(nm_cfg.parallel, dp=dp)))
    engine_base = nm_cfg.ports[0] + off
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode + ["union"] * args.union
    seen: dict[str, int] = {}
    nodes = []
    for i, role in enumerate(roles):
        n = seen[role] = seen.get(role, -1) + 1
        first = i * dp  # this NodeManager's engines are first .. first + dp - 1
        state_dir = state / f"nm-{i}"
        ports = json.dumps([engine_base + 2 * k for k in range(first, first + dp)])
        nodes.append(
            Child(
                f"nm-{i}",
                [
                    *argv,
                    "--port",
                    str(nm_cfg.port + i + off),
                    "--metrics-port",
                    str((nm_cfg.metrics_port or NODEMANAGER_METRICS_PORT) + i + off),
                ],
                dict(
                    nm_env,
                    MOTOR_NODEMANAGER_CONTROLLER=target,
                    MOTOR_NODEMANAGER_JOB_NAME=f"{args.model}-{role}-{n}",
                    MOTOR_NODEMANAGER_ROLE=role,
                    MOTOR_NODEMANAGER_MODEL=args.model,
                    MOTOR_NODEMANAGER_ENGINE_TYPE=args.engine_type,
                    MOTOR_NODEMANAGER_SIM_PROTOCOL=args.sim_protocol,
                    MOTOR_NODEMANAGER_PORTS=ports,
                    MOTOR_NODEMANAGER_STATE_DIR=str(state_dir),
                    # Engine output is prefixed [engine-<k>] by the NodeManager itself.
                    MOTOR_UP_ENGINE_INDEX=str(first),
                ),
                state_dir=state_dir,
            )
        )
    return nodes
