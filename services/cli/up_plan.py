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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from motor_mesh.cli.standalone import job_name_of
from motor_mesh.common import retry
from motor_mesh.common.config import Config, NodeManagerConfig
from motor_mesh.common.config.checks import parse_port_range
from motor_mesh.common.config.loader import WILDCARDS
from motor_mesh.nodemanager import devices

# /metrics of Controller i (+ i) and of NodeManager i (+ i), where the configuration leaves it off.
CONTROLLER_METRICS_PORT, NODEMANAGER_METRICS_PORT = 9100, 9300
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
HA_CONTROLLERS = 2
ETCD_PREFIX = "/motor"
# `motor controller`'s exit status when it lost its lease (services/controller/leader/ha.py): it comes
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


def plan(
    args: argparse.Namespace, cfg: Config, state: Path, etcd: str = "etcd", cores: Sequence[int] | None = None
) -> Plan:
    """Every child of ``motor up ARGS`` on ``cfg``, with state under ``state``; ``etcd`` is the
    binary run under ``--ha``. ``cores``: the CPU cores the engines share (default
    ``nodemanager.cpu_cores``, else every core this process may run on)."""
    off = args.port_offset
    base = [sys.executable, "-m", "motor_mesh.cli"]
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
        _nodemanagers(args, cfg, state, env, [*base, "nodemanager", *config], target, cores),
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
    args: argparse.Namespace,
    cfg: Config,
    state: Path,
    env: dict[str, str],
    argv: list[str],
    target: str,
    cores: Sequence[int] | None,
) -> list[Child]:
    """One NodeManager per instance, in the order prefill, decode, union."""
    off, nm_cfg = args.port_offset, cfg.nodemanager
    dp = args.dp or nm_cfg.parallel.dp
    nm_env = dict(env)
    if args.dp:  # replaces the configured DP size; tp, pp, ... stay as configured
        nm_env["MOTOR_NODEMANAGER_PARALLEL"] = json.dumps(asdict(replace(nm_cfg.parallel, dp=dp)))
    engine_base = nm_cfg.ports[0] + off
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode + ["union"] * args.union
    machine = devices.node_cores(nm_cfg.cpu_cores if cores is None else cores)
    node_cores = nodemanager_cores(machine, len(roles), dp)
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
                    # A model given as a path names its job by its last component.
                    MOTOR_NODEMANAGER_JOB_NAME=job_name_of(args.model, role, n),
                    MOTOR_NODEMANAGER_ROLE=role,
                    MOTOR_NODEMANAGER_MODEL=args.model,
                    MOTOR_NODEMANAGER_ENGINE_TYPE=args.engine_type,
                    MOTOR_NODEMANAGER_SIM_PROTOCOL=args.sim_protocol,
                    MOTOR_NODEMANAGER_PORTS=ports,
                    MOTOR_NODEMANAGER_STATE_DIR=str(state_dir),
                    # Read on the CPU platform only (harmless elsewhere, so always set).
                    MOTOR_NODEMANAGER_CPU_CORES=json.dumps(node_cores[i]),
                    MOTOR_NODEMANAGER_UCX_PORT_RANGE=ucx_port_range(first, dp, len(roles) * dp, nm_cfg, off),
                    # Engine output is prefixed [engine-<k>] by the NodeManager itself.
                    MOTOR_UP_ENGINE_INDEX=str(first),
                ),
                state_dir=state_dir,
            )
        )
    return nodes


def nodemanager_cores(cores: Sequence[int], nodes: int, dp: int) -> list[list[int]]:
    """The cores of each of ``nodes`` NodeManagers of ``dp`` engines: ``cores`` split over every
    engine of the cluster in engine order (devices.split_cores: contiguous, round-robin when
    there are fewer cores than engines), each NodeManager's engines' slices together, in order.
    Each NodeManager splits its list between its engines the same way, so every engine gets
    the slice this split gave it: without this, every NodeManager of one machine would bind its
    engines to the same cores (they all default to the machine's)."""
    slices = devices.split_cores(cores, nodes * dp)
    out = []
    for i in range(nodes):
        mine = [c for s in slices[i * dp : (i + 1) * dp] for c in s]
        out.append(list(dict.fromkeys(mine)))  # engines sharing a core: it is listed once
    return out


# Where the UCX listeners of `motor up`'s engines go (the transport of vLLM's NIXL connector):
# 18000 + off is clear of every other port `motor up` gives (services, engines at 10000 + 2k
# and their + 2000, + 4000, + 6000 ports) for the first thousand engines.
UCX_PORTS_BASE = 18000
UCX_PORTS_PER_WORKER = 16  # UCX takes 5 per vLLM worker process; the rest is headroom


def ucx_port_range(first: int, dp: int, engines: int, nm_cfg: NodeManagerConfig, off: int) -> str:
    """The UCX ports of the NodeManager running engines ``first`` .. ``first + dp - 1`` of
    ``engines``: its engines' windows, which it splits back into the same ones
    (launch.ucx_window). By default each engine's window is 16 ports per worker process
    (tp * pp), engine k's from 18000 + k * width; a configured `nodemanager.ucx_port_range` is
    the machine's, split evenly over every engine of the cluster. Both move with --port-offset."""
    configured = parse_port_range(nm_cfg.ucx_port_range)
    if configured is None:
        width = UCX_PORTS_PER_WORKER * max(nm_cfg.parallel.tp, 1) * max(nm_cfg.parallel.pp, 1)
        low = UCX_PORTS_BASE
    else:
        width = (configured[1] - configured[0] + 1) // max(engines, 1)
        low = configured[0]
    start = low + off + first * width
    return f"{start}-{start + dp * width - 1}"
