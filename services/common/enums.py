"""Short names for the motor.v1 enum values the code branches on, and the conversions between
them and the names used in configuration and logs. Every module takes its enum constants from
here, so there is one spelling of each.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, nodemanager_pb2

Role: TypeAlias = common_pb2.Role.ValueType
EngineType: TypeAlias = common_pb2.EngineType.ValueType
PdProtocol: TypeAlias = common_pb2.PdProtocol.ValueType
InstanceStatus: TypeAlias = common_pb2.InstanceStatus.ValueType
EndpointStatus: TypeAlias = common_pb2.EndpointStatus.ValueType

ROLE_UNSPECIFIED = common_pb2.ROLE_UNSPECIFIED
PREFILL = common_pb2.ROLE_PREFILL
DECODE = common_pb2.ROLE_DECODE
UNION = common_pb2.ROLE_UNION
ROLE_NAMES: dict[Role, str] = {PREFILL: "prefill", DECODE: "decode", UNION: "union"}
ROLES_BY_NAME: dict[str, Role] = {name: role for role, name in ROLE_NAMES.items()}

ENGINE_VLLM = common_pb2.ENGINE_TYPE_VLLM
ENGINE_SGLANG = common_pb2.ENGINE_TYPE_SGLANG
ENGINE_SIM = common_pb2.ENGINE_TYPE_SIM
ENGINE_TYPES_BY_NAME: dict[str, EngineType] = {
    "vllm": ENGINE_VLLM,
    "sglang": ENGINE_SGLANG,
    "sim": ENGINE_SIM,
}

PD_UNSPECIFIED = common_pb2.PD_PROTOCOL_UNSPECIFIED
PD_VLLM = common_pb2.PD_PROTOCOL_VLLM
PD_SGLANG = common_pb2.PD_PROTOCOL_SGLANG

STATUS_UNSPECIFIED = common_pb2.INSTANCE_STATUS_UNSPECIFIED
INITIAL = common_pb2.INSTANCE_STATUS_INITIAL
ACTIVE = common_pb2.INSTANCE_STATUS_ACTIVE
INACTIVE = common_pb2.INSTANCE_STATUS_INACTIVE
PAUSED = common_pb2.INSTANCE_STATUS_PAUSED
DELETED = common_pb2.INSTANCE_STATUS_DELETED

EP_INITIAL = common_pb2.ENDPOINT_STATUS_INITIAL
EP_WAIT = common_pb2.ENDPOINT_STATUS_WAIT_TO_START
EP_NORMAL = common_pb2.ENDPOINT_STATUS_NORMAL
EP_ABNORMAL = common_pb2.ENDPOINT_STATUS_ABNORMAL
EP_PAUSED = common_pb2.ENDPOINT_STATUS_PAUSED

EVENT_DEAD = controller_pb2.ENGINE_EVENT_TYPE_DEAD
EVENT_UNHEALTHY = controller_pb2.ENGINE_EVENT_TYPE_UNHEALTHY
REREGISTER = controller_pb2.DIRECTIVE_REREGISTER

RESTART = nodemanager_pb2.RESTART_ACTION_RESTART
ABORT = nodemanager_pb2.RESTART_ACTION_ABORT


def pd_protocol_of(requested: int, engine_type: int) -> PdProtocol:
    """The KV hand-off protocol an instance speaks: the one it asked for, else its engine's own
    (SGLang engines hand off through bootstrap rooms; vLLM and the simulated engine through
    ``kv_transfer_params``)."""
    if requested in (PD_VLLM, PD_SGLANG):
        return common_pb2.PdProtocol.ValueType(requested)
    return PD_SGLANG if engine_type == ENGINE_SGLANG else PD_VLLM


def enum_name(enum: Any, number: int, prefix: str = "") -> str:
    """The value's name without ``prefix``; a number this build does not know (a newer peer,
    a bad one) is ``UNKNOWN(<n>)``, never an exception in a log line or a table."""
    try:
        return str(enum.Name(number)).removeprefix(prefix)
    except ValueError:
        return f"UNKNOWN({number})"


def status_name(status: int) -> str:
    """``ACTIVE`` for INSTANCE_STATUS_ACTIVE (for logs and tables)."""
    return enum_name(common_pb2.InstanceStatus, status, "INSTANCE_STATUS_")


def endpoint_status_name(status: int) -> str:
    return enum_name(common_pb2.EndpointStatus, status, "ENDPOINT_STATUS_")
