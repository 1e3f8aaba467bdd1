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
# The instance roles, in the order NodeManagers are numbered.
PREFILL, DECODE, UNION = "prefill", "decode", "union"
ROLES = (PREFILL, DECODE, UNION)


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
    # NodeManagers: the instance's role, its number among the role's (its job's <n>) and the
    # NodeManager's own (nm-<i>, its ports and engines).
    role: str = ""
    number: int = -1
    index: int = -1
    # Being removed (a scale-down): its exit is the one asked for, never restarted.
    retiring: asyncio.Event = field(default_factory=asyncio.Event)
    supervisor: asyncio.Task[None] | None = None  # restarts it while it runs; ends with it


@dataclass
class Plan:
    etcd: Child | None  # --ha only
    controllers: list[Child]
    coordinator: Child
    nodes: list[Child]
    controller_addrs: list[str]  # where each Controller serves, in the order of ``controllers``
    coordinator_addr: str
    etcd_endpoint: str  # "" without --ha
    make_node: NodeMaker  # another NodeManager, run as the first ones are

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
    nodes, make_node = _nodemanagers(args, cfg, state, env, [*base, "nodemanager", *config], target, cores)
    return Plan(
        etcd_child, controllers, coordinator, nodes, controller_addrs, coordinator_addr, endpoint, make_node
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
) -> tuple[list[Child], NodeMaker]:
    """One NodeManager per instance, in the order prefill, decode, union, and how to make more
    the same way."""
    nm_cfg = cfg.nodemanager
    dp = args.dp or nm_cfg.parallel.dp
    nm_env = dict(env)
    if args.dp:  # replaces the configured DP size; tp, pp, ... stay as configured
        nm_env["MOTOR_NODEMANAGER_PARALLEL"] = json.dumps(asdict(replace(nm_cfg.parallel, dp=dp)))
    roles = [PREFILL] * args.prefill + [DECODE] * args.decode + [UNION] * args.union
    machine = devices.node_cores(nm_cfg.cpu_cores if cores is None else cores)
    make = NodeMaker(
        args, nm_cfg, state, nm_env, argv, target, dp, nodemanager_cores(machine, len(roles), dp), len(roles)
    )
    seen: dict[str, int] = {}
    nodes = []
    for i, role in enumerate(roles):
        n = seen[role] = seen.get(role, -1) + 1
        nodes.append(make(i, role, n))
    return nodes, make


# How many NodeManagers and engines motor up's port scheme has room for: NodeManager i's gRPC
# port 7300 + i stays under the Coordinator's HTTP 8000 and its /metrics 9300 + i under the
# engines' 10000; engine k's 10000 + 2k under their KV events ports at 12000 (by default; a
# --config moving the bases moves the ports, not these counts).
MAX_NODEMANAGERS = 700
MAX_ENGINES = 1000


@dataclass
class NodeMaker:
    """How NodeManager ``i``, the ``n``-th instance of its role, is run: the ones ``motor up``
    starts with and the ones it adds later (following the Controller's desired instance counts,
    services/cli/up_scale.py) alike, so an added one differs only in its numbers. NodeManager i
    serves on ``nodemanager.port`` + i and its /metrics on 9300 + i, owns engines i * dp ..
    i * dp + dp - 1 (engine k on ``nodemanager.ports[0]`` + 2k), its state is ``nm-<i>``, all
    moved by --port-offset; its job is ``<model>-<role>-<n>``. Its cores are the ``i``-th share
    of the split made for the NodeManagers started first (round-robin past them)."""

    args: argparse.Namespace
    nm_cfg: NodeManagerConfig
    state: Path
    env: dict[str, str]
    argv: list[str]
    target: str
    dp: int
    cores: list[list[int]]  # each first NodeManager's share of the machine
    first_nodes: int  # how many NodeManagers motor up started with

    def room(self, i: int) -> str | None:
        """Why NodeManager ``i`` cannot be run (its ports are not free of others' in the port
        scheme), or None."""
        if i >= MAX_NODEMANAGERS:
            return f"motor up's ports have room for {MAX_NODEMANAGERS} NodeManagers"
        if (i + 1) * self.dp > MAX_ENGINES:
            return f"motor up's ports have room for {MAX_ENGINES // self.dp} instances of {self.dp} engines"
        if self.nm_cfg.ucx_port_range and i >= self.first_nodes:
            # The configured range was split over the engines motor up started with: a window
            # for another one would be outside it.
            return (
                f"nodemanager.ucx_port_range is split over the {self.first_nodes * self.dp} engines "
                "motor up started with"
            )
        return None

    def __call__(self, i: int, role: str, n: int) -> Child:
        off, nm_cfg, dp = self.args.port_offset, self.nm_cfg, self.dp
        first = i * dp  # this NodeManager's engines are first .. first + dp - 1
        state_dir = self.state / f"nm-{i}"
        engine_base = nm_cfg.ports[0] + off
        ports = json.dumps([engine_base + 2 * k for k in range(first, first + dp)])
        cores = self.cores[i % len(self.cores)] if self.cores else []
        return Child(
            f"nm-{i}",
            [
                *self.argv,
                "--port",
                str(nm_cfg.port + i + off),
                "--metrics-port",
                str((nm_cfg.metrics_port or NODEMANAGER_METRICS_PORT) + i + off),
            ],
            dict(
                self.env,
                MOTOR_NODEMANAGER_CONTROLLER=self.target,
                # A model given as a path names its job by its last component.
                MOTOR_NODEMANAGER_JOB_NAME=job_name_of(self.args.model, role, n),
                MOTOR_NODEMANAGER_ROLE=role,
                MOTOR_NODEMANAGER_MODEL=self.args.model,
                MOTOR_NODEMANAGER_ENGINE_TYPE=self.args.engine_type,
                MOTOR_NODEMANAGER_SIM_PROTOCOL=self.args.sim_protocol,
                MOTOR_NODEMANAGER_PORTS=ports,
                MOTOR_NODEMANAGER_STATE_DIR=str(state_dir),
                # Read on the CPU platform only (harmless elsewhere, so always set).
                MOTOR_NODEMANAGER_CPU_CORES=json.dumps(cores),
                MOTOR_NODEMANAGER_UCX_PORT_RANGE=ucx_port_range(
                    first, dp, self.first_nodes * dp, nm_cfg, off
                ),
                # Engine output is prefixed [engine-<k>] by the NodeManager itself.
                MOTOR_UP_ENGINE_INDEX=str(first),
            ),
            state_dir=state_dir,
            role=role,
            number=n,
            index=i,
        )


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
