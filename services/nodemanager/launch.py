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

from services.common import enums

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


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
class LaunchParams:
    """Everything about a launch that is the same for every endpoint of the node."""

    engine_type: str  # vllm | sglang | sim
    model: str
    served_model_name: str
    role: str  # prefill | decode | union
    instance_id: int
    tp: int = 1
    dp: int = 1
    nnodes: int = 1
    master_host: str = ""
    sim_protocol: str = "vllm"
    kv_connector: str = "NixlConnector"
    args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    device_env: str = "ASCEND_RT_VISIBLE_DEVICES"

    @property
    def sglang_style(self) -> bool:
        """Whether the engine speaks SGLang's bootstrap hand-off."""
        return pd_protocol(self.engine_type, self.sim_protocol) == enums.PD_SGLANG

    @property
    def disaggregated(self) -> bool:
        return self.role in KV_ROLES


def pd_protocol(engine_type: str, sim_protocol: str) -> enums.PdProtocol:
    """The KV hand-off protocol a node's engines speak (RegisterRequest.pd_protocol): the
    engine's own, except that the simulated engine speaks the one ``sim_protocol`` names."""
    engine = enums.ENGINE_TYPES_BY_NAME[engine_type]
    sim_sglang = engine == enums.ENGINE_SIM and sim_protocol == "sglang"
    return enums.pd_protocol_of(enums.PD_SGLANG if sim_sglang else enums.PD_UNSPECIFIED, engine)


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
    return json.dumps(
        {
            "kv_connector": params.kv_connector,
            "kv_role": KV_ROLES[params.role],
            "engine_id": str(params.instance_id),
        },
        separators=(",", ":"),
    )


def _vllm_flags(params: LaunchParams, ep: EndpointSpec) -> list[str]:
    """The flags after ``vllm serve MODEL`` (the simulated engine takes the same)."""
    flags = [
        "--served-model-name",
        params.served_model_name,
        "--host",
        ep.host,
        "--port",
        str(ep.port),
        "--tensor-parallel-size",
        str(params.tp),
        "--data-parallel-size",
        str(params.dp),
    ]
    # One engine per DP rank (external load balancing); a multi-node instance needs the master
    # address on every node, headless ones included.
    if params.dp > 1 or params.nnodes > 1:
        flags += [
            "--data-parallel-address",
            params.master_host or ep.host,
            "--data-parallel-rpc-port",
            str(ep.port + 1),
            "--data-parallel-rank",
            str(ep.id),
        ]
    if ep.headless:
        flags.append("--headless")
    if params.disaggregated:
        flags += ["--kv-transfer-config", kv_transfer_config(params)]
    return flags


def build_argv(params: LaunchParams, ep: EndpointSpec) -> list[str]:
    """The engine's argv; ``vllm`` stays a bare name (see :func:`resolve`)."""
    if params.engine_type == "vllm":
        argv = ["vllm", "serve", params.model, *_vllm_flags(params, ep)]
    elif params.engine_type == "sglang":
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            params.model,
            "--served-model-name",
            params.served_model_name,
            "--host",
            ep.host,
            "--port",
            str(ep.port),
            "--tp-size",
            str(params.tp),
            "--dp-size",
            str(params.dp),
        ]
        if params.disaggregated:
            argv += [
                "--disaggregation-mode",
                params.role,
                "--disaggregation-bootstrap-port",
                str(ep.port + 1),
            ]
    elif params.engine_type == "sim":
        argv = [sys.executable, "-m", "services.cli", "engine-sim", "serve", params.model]
        argv += _vllm_flags(params, ep)
        argv += ["--protocol", "sglang" if params.sglang_style else "vllm"]
        if params.sglang_style:
            argv += ["--bootstrap-port", str(ep.port + 1)]
    else:
        raise LaunchError(f"unknown engine type {params.engine_type!r}")
    return argv + extra_args(params.args)


def build_env(
    params: LaunchParams, ep: EndpointSpec, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The engine's environment: ours, then ``engine.env``, the device slice, VLLM_HOST_IP."""
    env = dict(os.environ if base is None else base)
    env.update(params.env)
    if ep.device_ids:
        env[params.device_env] = ",".join(str(d) for d in ep.device_ids)
    else:
        env.pop(params.device_env, None)
    env["VLLM_HOST_IP"] = ep.host
    if params.engine_type == "sglang":
        # Readiness relies on /health generating a token, not only answering.
        env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "true"
    return env


def resolve(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """Look ``argv[0]`` up on the engine's own PATH; a clear error when it is missing."""
    if os.sep in argv[0]:
        return argv
    found = shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if found is None:
        raise LaunchError(f"{argv[0]!r} not found on PATH")
    return [found, *argv[1:]]
