"""Engine command lines and environments.

Pure functions: given the node's configuration and one endpoint of a start command, what argv
and environment the engine process gets. Tests compare these lists exactly, and the stand-in
``vllm`` / ``sglang.launch_server`` tests record what a real engine would receive.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from motor_mesh.common import enums, telemetry
from motor_mesh.common.config import EngineConfig, NodeManagerConfig
from motor_mesh.common.config.checks import parse_port_range
from motor_mesh.gen.motor.v1 import nodemanager_pb2
from motor_mesh.nodemanager import devices, kv_events

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# Ports an engine uses besides its business port P (see docs/operations.md, "Ports"): P + 1 is
# the SGLang bootstrap / vLLM DP RPC port; these are fixed offsets too, so every engine on a
# host gets its own without coordination, because business ports are unique per host.
SIDE_CHANNEL_OFFSET = 4000  # vLLM NIXL side channel of the engine
RENDEZVOUS_OFFSET = 6000  # torch.distributed rendezvous of a multi-node instance (on its head)
# The ZMQ PUB socket of the engine's KV cache events (what the Coordinator's KV index follows);
# its replay ROUTER socket is at KV_EVENTS_OFFSET + 1. P + 2001 stays clear of the next
# engine's P + 2 + 2000 because business ports are at least 2 apart (P + 1 is taken too).
KV_EVENTS_OFFSET = 2000
# An engine's service.name in its spans (unless OTEL_SERVICE_NAME says otherwise): <this>-<role>.
TRACE_SERVICE_NAMES = {"vllm": "vllm", "sglang": "sglang", "sim": "motor-sim"}
# CPU platform: where each engine reads the cores its OpenMP threads bind to (the simulated
# engine takes vLLM's and ignores it), and vLLM's KV cache size in GiB.
VLLM_CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"
SGLANG_CPU_BIND = "SGLANG_CPU_OMP_THREADS_BIND"
VLLM_CPU_KVCACHE = "VLLM_CPU_KVCACHE_SPACE"
UCX_PORTS = "UCX_TCP_PORT_RANGE"


class LaunchError(Exception):
    """The engine cannot be launched on this node (e.g. ``vllm`` is not on PATH)."""


@dataclass(frozen=True)
class EndpointSpec:
    """One engine server: what the start command says about it."""

    id: int
    host: str
    port: int
    headless: bool = False
    device_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Head:
    """Where one DP rank's routable engine (node_rank 0) serves: its host and business port."""

    host: str
    port: int


@dataclass(frozen=True)
class LaunchParams:
    """Everything about a launch that is the same for every endpoint of the node."""

    engine_type: str  # vllm | sglang | sim
    model: str
    served_model_name: str
    role: str  # prefill | decode | union
    instance_id: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    # The instance's routable endpoints by DP rank; heads[0] is the DP master. Needed only
    # when a rank must reach another endpoint (DP > 1 or a rank spanning nodes).
    heads: tuple[Head, ...] = ()
    sim_protocol: str = "vllm"
    kv_connector: str = "NixlConnector"
    # engine.kv_transfer_config: more --kv-transfer-config fields (never kv_role or engine_id).
    kv_transfer: Mapping[str, Any] = field(default_factory=dict)
    dp_group: bool = True  # vLLM: the ranks form one data-parallel group
    args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    device_env: str = "CUDA_VISIBLE_DEVICES"  # or devices.CPU: the CPU platform
    # CPU platform: the cores this node's engines share, in the order they are split.
    cpu_cores: tuple[int, ...] = ()
    cpu_kvcache_space_gib: int = 0  # vLLM: VLLM_CPU_KVCACHE_SPACE; 0 = not set
    # nodemanager.ucx_port_range: (low, high) of the node's engines' UCX listeners; None = unset.
    ucx_ports: tuple[int, int] | None = None
    # The NodeManager's OTLP endpoint: the engines export their request spans there ("" = off).
    otlp_traces_endpoint: str = ""

    @property
    def sglang_style(self) -> bool:
        """Whether the engine speaks SGLang's bootstrap hand-off."""
        return pd_protocol(self.engine_type, self.sim_protocol) == enums.PD_SGLANG

    @property
    def disaggregated(self) -> bool:
        return self.role in KV_ROLES

    @property
    def on_cpu(self) -> bool:
        return self.device_env == devices.CPU


def pd_protocol(engine_type: str, sim_protocol: str) -> enums.PdProtocol:
    """The KV hand-off protocol a node's engines speak (RegisterRequest.pd_protocol): the
    engine's own, except that the simulated engine speaks the one ``sim_protocol`` names."""
    engine = enums.ENGINE_TYPES_BY_NAME[engine_type]
    sim_sglang = engine == enums.ENGINE_SIM and sim_protocol == "sglang"
    return enums.pd_protocol_of(enums.PD_SGLANG if sim_sglang else enums.PD_UNSPECIFIED, engine)


def params_for(
    req: nodemanager_pb2.StartEnginesRequest, nm: NodeManagerConfig, engine: EngineConfig, device_env: str
) -> LaunchParams:
    """What a start command means on this node (``device_env`` already resolved from auto)."""
    par = nm.parallel
    # Asked here, not at start-up only: cheap (one syscall), and it follows a changed affinity.
    cores = devices.node_cores(nm.cpu_cores) if device_env == devices.CPU else ()
    heads = req.heads or sorted((e for e in req.endpoints if not e.headless), key=lambda e: e.id)
    return LaunchParams(
        engine_type=nm.engine_type,
        model=nm.model,
        served_model_name=nm.served_model_name or nm.model,
        role=enums.ROLE_NAMES[req.role],
        instance_id=req.instance_id,
        tp=par.tp,
        pp=par.pp,
        dp=par.dp,
        nnodes=par.nnodes,
        node_rank=req.node_rank,
        heads=tuple(Head(h.host, h.port) for h in heads),
        sim_protocol=nm.sim_protocol,
        kv_connector=engine.kv_connector,
        kv_transfer=dict(engine.kv_transfer_config),
        dp_group=engine.data_parallel_group,
        args=dict(engine.args),
        env=dict(engine.env),
        device_env=device_env,
        cpu_cores=cores,
        cpu_kvcache_space_gib=engine.cpu_kvcache_space_gib,
        ucx_ports=parse_port_range(nm.ucx_port_range),
        otlp_traces_endpoint=telemetry.endpoint(),
    )


def endpoint_specs(req: nodemanager_pb2.StartEnginesRequest) -> list[EndpointSpec]:
    return [
        EndpointSpec(e.id, e.host, e.port, e.headless, tuple(e.device_ids))
        for e in sorted(req.endpoints, key=lambda e: e.id)
    ]


def dp_rank(params: LaunchParams, ep: EndpointSpec) -> int:
    """The endpoint's DP rank: the Controller numbers endpoints node_rank * dp + rank."""
    return ep.id - params.node_rank * params.dp


def head(params: LaunchParams, rank: int) -> Head:
    """The routable endpoint of DP rank ``rank`` (rank 0: the DP master)."""
    if not 0 <= rank < len(params.heads):
        raise LaunchError(f"the start command names no routable endpoint for DP rank {rank}")
    return params.heads[rank]


def offset_port(port: int, offset: int) -> int:
    """``port + offset``, or ``port - offset`` when that would pass 65535 (as SGLang does)."""
    return port + offset if port + offset <= 65535 else port - offset


def side_channel_port(ep: EndpointSpec) -> int:
    """The port this engine's NIXL side channel listens on."""
    return offset_port(ep.port, SIDE_CHANNEL_OFFSET)


def vllm_dp_rank(params: LaunchParams, ep: EndpointSpec) -> int:
    """The DP rank vLLM (or the simulated engine) is told: 0 without a DP group."""
    return dp_rank(params, ep) if params.dp_group and params.dp > 1 else 0


def kv_events_ports(params: LaunchParams, ep: EndpointSpec) -> tuple[int, int]:
    """(PUB port, replay port) the engine publishes its KV cache events on; 0 = none.

    Ours are P + 2000 and P + 2001 on every routable engine. An operator's own
    ``kv_events_config`` in engine.args replaces ours (``null`` turns events off)."""
    if ep.headless or _sglang_multi_scheduler(params):
        return 0, 0
    if "kv_events_config" in params.args:
        return kv_events.operator_ports(params.args["kv_events_config"], _kv_events_rank(params, ep))
    return offset_port(ep.port, KV_EVENTS_OFFSET), offset_port(ep.port, KV_EVENTS_OFFSET + 1)


def _kv_events_rank(params: LaunchParams, ep: EndpointSpec) -> int:
    """The DP rank the engine adds to its KV event ports (SGLang's is 0 with ``--dp-size 1``)."""
    return 0 if params.engine_type == "sglang" else vllm_dp_rank(params, ep)


def _sglang_multi_scheduler(params: LaunchParams) -> bool:
    """SGLang with ``dp_size`` > 1 in engine.args (DP attention): several schedulers behind one
    HTTP endpoint, each publishing on the ports + its rank, so rank 1 would take the replay
    port and no single stream describes the endpoint's cache. Such an endpoint gets none."""
    if params.engine_type != "sglang":
        return False
    size = params.args.get("dp_size", params.args.get("data_parallel_size", 1))
    try:
        return int(size) > 1
    except (TypeError, ValueError):
        return False  # SGLang refuses it anyway


def _kv_events_flags(params: LaunchParams, ep: EndpointSpec) -> list[str]:
    """Nothing for an operator's own kv_events_config (engine.args passes it) or where the
    engine publishes none."""
    pub, replay = kv_events_ports(params, ep)
    if "kv_events_config" in params.args or not pub:
        return []
    return ["--kv-events-config", kv_events.config(pub, replay, _kv_events_rank(params, ep))]


def bootstrap_port(params: LaunchParams, ep: EndpointSpec) -> int:
    """The SGLang PD bootstrap port an endpoint serves (0 = none)."""
    if params.sglang_style and params.disaggregated and not ep.headless:
        return ep.port + 1
    return 0


def extra_args(args: Mapping[str, Any]) -> list[str]:
    """``engine.args`` as flags, sorted by key: True → bare flag, False/None → omitted,
    list → the flag once per value, dict → compact JSON."""
    out: list[str] = []
    for key in sorted(args):
        flag = "--" + key.replace("_", "-")
        value = args[key]
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            for item in value:
                out += [flag, _scalar(item)]
        else:
            out += [flag, _scalar(value)]
    return out


def _scalar(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, bool):  # a bool inside a list: spell it like JSON
        return "true" if value else "false"
    return str(value)


def kv_transfer_config(params: LaunchParams) -> str:
    """Motor's fields, then engine.kv_transfer_config's sorted by key (so the flag is the same
    whatever order the configuration wrote them in). Its ``kv_connector`` replaces ours in
    place; the config check refuses ``kv_role`` and ``engine_id``, which stay ours anyway."""
    theirs = {k: params.kv_transfer[k] for k in sorted(params.kv_transfer)}
    ours = {
        "kv_connector": theirs.pop("kv_connector", params.kv_connector),
        "kv_role": KV_ROLES[params.role],
        "engine_id": str(params.instance_id),
    }
    return json.dumps(ours | {k: v for k, v in theirs.items() if k not in ours}, separators=(",", ":"))


def _serving(params: LaunchParams, ep: EndpointSpec) -> list[str]:
    return ["--served-model-name", params.served_model_name, "--host", ep.host, "--port", str(ep.port)]


def _vllm_flags(params: LaunchParams, ep: EndpointSpec) -> list[str]:
    """The flags after ``vllm serve MODEL`` (the simulated engine takes the same).

    One API server per DP rank (vLLM's external load balancing): every rank gets the DP
    master's address and RPC port. A rank spanning nodes is vLLM's multi-node mode counted over
    the whole instance: ``--nnodes`` is dp * nnodes, rank r's part on node_rank k is node
    r * nnodes + k, and every part meets at the master's rendezvous port. Without a DP group
    (``engine.data_parallel_group`` false, for dense models) every rank is its own vLLM with
    ``--data-parallel-size 1``."""
    flags = [*_serving(params, ep), "--tensor-parallel-size", str(params.tp)]
    if params.pp > 1:
        flags += ["--pipeline-parallel-size", str(params.pp)]
    size, rank = (params.dp, dp_rank(params, ep)) if params.dp_group else (1, 0)
    flags += ["--data-parallel-size", str(size)]
    if size > 1:
        master = head(params, 0)
        flags += [
            "--data-parallel-address",
            master.host,
            "--data-parallel-rpc-port",
            str(master.port + 1),
            "--data-parallel-rank",
            str(rank),
        ]
    if params.nnodes > 1:
        # One torch world per vLLM deployment: the whole group's, or this rank's alone.
        leader = head(params, 0 if params.dp_group else dp_rank(params, ep))
        flags += [
            "--nnodes",
            str(size * params.nnodes),
            "--node-rank",
            str(rank * params.nnodes + params.node_rank),
            "--master-addr",
            leader.host,
            "--master-port",
            str(offset_port(leader.port, RENDEZVOUS_OFFSET)),
        ]
    if ep.headless:
        flags.append("--headless")
    # An operator's own kv_transfer_config in engine.args replaces ours (one flag, not two).
    if params.disaggregated and "kv_transfer_config" not in params.args:
        flags += ["--kv-transfer-config", kv_transfer_config(params)]
    return flags


def _sglang_args(params: LaunchParams, ep: EndpointSpec) -> list[str]:
    """One ``launch_server`` per DP rank with ``--dp-size 1``, so each rank has its own HTTP
    endpoint the router sees. A rank spanning nodes is SGLang's multi-node mode: the rank's
    parts meet at its head's rendezvous port, and all of them name the head's bootstrap port
    (only the head serves it)."""
    args = ["--model-path", params.model, *_serving(params, ep), "--tp-size", str(params.tp)]
    if params.pp > 1:
        args += ["--pp-size", str(params.pp)]
    args += ["--dp-size", "1"]
    own_head = Head(ep.host, ep.port)
    if params.nnodes > 1:
        own_head = head(params, dp_rank(params, ep))
        args += [
            "--nnodes",
            str(params.nnodes),
            "--node-rank",
            str(params.node_rank),
            "--dist-init-addr",
            _host_port(own_head.host, offset_port(own_head.port, RENDEZVOUS_OFFSET)),
        ]
    if params.disaggregated:
        args += [
            "--disaggregation-mode",
            params.role,
            "--disaggregation-bootstrap-port",
            str(own_head.port + 1),
        ]
    # SGLang serves /metrics only when asked; the Coordinator aggregates it (docs/engine-metrics.md).
    if "enable_metrics" not in params.args:
        args.append("--enable-metrics")
    # Without an accelerator SGLang stops at start-up unless told its device.
    if params.on_cpu and "device" not in params.args:
        args += ["--device", "cpu"]
    return args


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tracing_flags(params: LaunchParams) -> list[str]:
    """Where the engine exports its request spans: vLLM (and the simulated engine) take the
    OTLP endpoint as it is; SGLang wants ``--enable-trace`` and a bare ``host:port``."""
    endpoint = params.otlp_traces_endpoint
    if not endpoint:
        return []
    if params.engine_type == "sglang":
        return ["--enable-trace", "--otlp-traces-endpoint", urlsplit(endpoint).netloc or endpoint]
    return ["--otlp-traces-endpoint", endpoint]


def build_argv(params: LaunchParams, ep: EndpointSpec) -> list[str]:
    """The engine's argv; ``vllm`` stays a bare name (see :func:`resolve`)."""
    if params.engine_type == "vllm":
        argv = ["vllm", "serve", params.model, *_vllm_flags(params, ep)]
    elif params.engine_type == "sglang":
        argv = [sys.executable, "-m", "sglang.launch_server", *_sglang_args(params, ep)]
    elif params.engine_type == "sim":
        argv = [sys.executable, "-m", "motor_mesh.cli", "engine-sim", "serve", params.model]
        argv += _vllm_flags(params, ep)
        argv += ["--protocol", "sglang" if params.sglang_style else "vllm"]
        if params.sglang_style:
            argv += ["--bootstrap-port", str(ep.port + 1)]
    else:
        raise LaunchError(f"unknown engine type {params.engine_type!r}")
    # engine.args last: an operator's own tracing flags win.
    return argv + _kv_events_flags(params, ep) + _tracing_flags(params) + extra_args(params.args)


def build_env(
    params: LaunchParams, ep: EndpointSpec, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The engine's environment: ours, then ``engine.env``, the device slice (or on the CPU
    platform its cores), VLLM_HOST_IP and (vLLM) the NIXL side channel.

    vLLM's NIXL connector listens on VLLM_NIXL_SIDE_CHANNEL_PORT + its DP rank and tells the
    other side to pull KV from VLLM_NIXL_SIDE_CHANNEL_HOST; the default (localhost:5600) would
    send a remote decode to its own host and make two engines on one host collide. Subtracting
    the rank makes the port vLLM listens on exactly :func:`side_channel_port`."""
    env = dict(os.environ if base is None else base)
    env.update(params.env)
    if params.on_cpu:
        _bind_cores(params, ep, env)
    elif ep.device_ids:
        env[params.device_env] = ",".join(str(d) for d in ep.device_ids)
    else:
        env.pop(params.device_env, None)
    if params.cpu_kvcache_space_gib and params.engine_type != "sglang" and VLLM_CPU_KVCACHE not in params.env:
        env[VLLM_CPU_KVCACHE] = str(params.cpu_kvcache_space_gib)
    window = ucx_window(params, ep)
    if window and UCX_PORTS not in params.env:
        env[UCX_PORTS] = window
    env["VLLM_HOST_IP"] = ep.host
    if not params.sglang_style:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = ep.host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port(ep) - vllm_dp_rank(params, ep))
    if params.engine_type == "sglang":
        # Readiness relies on /health generating a token, not only answering.
        env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "true"
    if params.otlp_traces_endpoint:
        _name_in_traces(params, ep, env)
    return env


def engine_cores(params: LaunchParams, ep: EndpointSpec) -> tuple[int, ...]:
    """CPU platform: the cores of this endpoint's engine, its slice of the node's cores by its
    place among the node's endpoints (its DP rank; the node runs one engine per rank)."""
    slices = devices.split_cores(params.cpu_cores, params.dp)
    return slices[dp_rank(params, ep) % len(slices)] if slices else ()


def cpu_bind(params: LaunchParams, ep: EndpointSpec) -> str:
    """The engine's OpenMP core binding ("" = none): its cores as a cpuset (``0-3``) when it
    runs one worker. vLLM and SGLang read one entry per worker, separated by ``|`` and indexed
    by the worker's rank (vLLM: tp * pp entries; SGLang: tp), so a larger engine's cores are
    split between the workers on this node, and a rank on another node of a multi-node engine
    finds its share at its index modulo the workers per node."""
    cores = engine_cores(params, ep)
    if not cores:
        return ""
    workers = params.tp * params.pp
    local = max(1, workers // params.nnodes)
    entries = workers
    if params.engine_type == "sglang":
        entries, local = params.tp, min(local, params.tp)
    shares = devices.split_cores(cores, local)
    return "|".join(devices.cpuset(shares[i % local]) for i in range(entries))


def ucx_window(params: LaunchParams, ep: EndpointSpec) -> str:
    """The engine's ``UCX_TCP_PORT_RANGE`` ("" = none): its equal share of the node's
    ``ucx_port_range`` by its place among the node's endpoints (its DP rank), so no two
    engines of a node share a port. A range narrower than the node's engines gives none."""
    if params.ucx_ports is None:
        return ""
    low, high = params.ucx_ports
    width = (high - low + 1) // max(params.dp, 1)
    if width < 1:
        return ""
    start = low + dp_rank(params, ep) % max(params.dp, 1) * width
    return f"{start}-{start + width - 1}"


def pinned_cores(params: LaunchParams, ep: EndpointSpec) -> tuple[int, ...]:
    """CPU platform: the cores the NodeManager confines the whole engine process group to (its
    slice); none off the CPU platform or when the operator binds the engine's threads
    themselves (their binding variable in engine.env), whose choice is theirs."""
    if not params.on_cpu or _bind_var(params) in params.env:
        return ()
    return engine_cores(params, ep)


def _bind_var(params: LaunchParams) -> str:
    """The variable the engine reads its OpenMP core binding from."""
    return SGLANG_CPU_BIND if params.engine_type == "sglang" else VLLM_CPU_BIND


def _bind_cores(params: LaunchParams, ep: EndpointSpec, env: dict[str, str]) -> None:
    """CPU platform: no device variable (a CPU build must not see a stale CUDA one) and the
    engine's own cores; an engine.env binding of the operator's is kept (``auto`` is vLLM's
    NUMA-based choice, the same cores for every engine of a host: the second one then hangs
    in start-up, which is why Motor binds)."""
    env.pop(devices.CUDA, None)
    var = _bind_var(params)
    bind = cpu_bind(params, ep)
    if bind and var not in params.env:
        env[var] = bind


def _name_in_traces(params: LaunchParams, ep: EndpointSpec, env: dict[str, str]) -> None:
    """Tell the engines apart in a trace: ``service.name`` <engine>-<role> unless the operator
    named it (OTEL_SERVICE_NAME; SGLang names itself), and the instance, endpoint and role as
    resource attributes after any the operator set."""
    name = TRACE_SERVICE_NAMES.get(params.engine_type, params.engine_type)
    env.setdefault("OTEL_SERVICE_NAME", f"{name}-{params.role}")
    ours = f"motor.instance_id={params.instance_id},motor.endpoint_id={ep.id},motor.role={params.role}"
    theirs = env.get("OTEL_RESOURCE_ATTRIBUTES", "").strip().strip(",")
    env["OTEL_RESOURCE_ATTRIBUTES"] = f"{theirs},{ours}" if theirs else ours


def resolve(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """Look ``argv[0]`` up on the engine's own PATH; a clear error when it is missing."""
    if os.sep in argv[0]:
        return argv
    found = shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if found is None:
        raise LaunchError(f"{argv[0]!r} not found on PATH")
    return [found, *argv[1:]]
