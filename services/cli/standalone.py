"""What ``motor register`` sends, worked out without any I/O (docs/standalone.md).

An instance registered by hand has no Controller to number it, so its id is derived from what
identifies it: ``0x40000000 | (crc32("<role>|<host>:<port>|…") & 0x3FFFFFFF)``, endpoints sorted
by (host, port), host lower-cased and not resolved. The same engines give the same id whatever
order they are named in, from any machine, and bit 30 keeps these ids apart from the
Controller's, which count up from 1. The job name is ``<model>-<role>-<host>-<port>`` of the
first endpoint in that order (the model as :func:`model_stem` makes it a job name: a path's last
component), and endpoints are numbered 0.. in that order.
"""

from __future__ import annotations

import difflib
import json
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor

from motor_mesh.common import enums
from motor_mesh.gen.motor.v1 import common_pb2, coordinator_pb2

STANDALONE_BIT = 0x40000000
_LOW_BITS = 0x3FFFFFFF


class InputError(ValueError):
    """Something the operator gave cannot be used; the message is the whole explanation."""


@dataclass(frozen=True, order=True)
class EndpointSpec:
    host: str
    port: int
    bootstrap_port: int = 0

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class InstanceSpec:
    """One ``--prefill/--decode/--union`` occurrence: a role and its DP endpoints, sorted."""

    role: str
    endpoints: tuple[EndpointSpec, ...]

    @property
    def key(self) -> str:
        return "|".join([self.role, *(f"{e.host}:{e.port}" for e in self.endpoints)])

    def describe(self) -> str:
        return f"{self.role} " + ",".join(e.address for e in self.endpoints)


def _port(text: str, what: str, spec: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise InputError(f"{spec!r}: {what} must be 1..65535, got {text!r}")
    return int(text)


def parse_endpoint(text: str) -> EndpointSpec:
    """``HOST:PORT[:BOOTSTRAP]``; an IPv6 host in brackets: ``[::1]:8000``."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise InputError(f"{text!r}: expected [IPV6]:PORT[:BOOTSTRAP]")
        parts = rest[1:].split(":")
    else:
        host, *parts = text.split(":")
    if not host or not 1 <= len(parts) <= 2:
        raise InputError(f"{text!r}: expected HOST:PORT[:BOOTSTRAP]")
    port = _port(parts[0], "the port", text)
    bootstrap = _port(parts[1], "the bootstrap port", text) if len(parts) == 2 else 0
    return EndpointSpec(host.lower(), port, bootstrap)


def parse_instance(role: str, text: str) -> InstanceSpec:
    """One occurrence of ``--<role> H:P[:B][,H:P[:B]…]``: commas separate DP endpoints."""
    endpoints = sorted(parse_endpoint(t.strip()) for t in text.split(",") if t.strip())
    if not endpoints:
        raise InputError(f"--{role} needs at least one HOST:PORT")
    seen: set[tuple[str, int]] = set()
    for e in endpoints:
        if (e.host, e.port) in seen:
            raise InputError(f"--{role} {text!r}: {e.address} is named twice")
        seen.add((e.host, e.port))
    return InstanceSpec(role, tuple(endpoints))


def derive_id(role: str, endpoints: Iterable[tuple[str, int]]) -> int:
    ordered = sorted((h.lower(), p) for h, p in endpoints)
    key = "|".join([role, *(f"{h}:{p}" for h, p in ordered)])
    return STANDALONE_BIT | (zlib.crc32(key.encode()) & _LOW_BITS)


# What the Controller accepts as a job name (services/controller/validation.py, JOB_NAME):
# letters, digits, '.', '_', '-', starting with a letter or digit, at most 128 characters.
JOB_NAME_MAX = 128
_NOT_IN_JOB_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def model_stem(model: str) -> str:
    """The model as the first part of a job name: a path's last component (an ``org/name`` id's
    name), every run of other characters than letters, digits, '.', '_' and '-' as one '-',
    starting with a letter or digit; "model" when nothing is left."""
    last = model.rstrip("/").rsplit("/", 1)[-1]
    return _NOT_IN_JOB_NAME.sub("-", last).lstrip("._-") or "model"


def job_name_of(model: str, *parts: object) -> str:
    """``<model stem>-<part>-…``, cut to what a job name may hold: the stem is shortened first,
    so the parts that tell jobs of one model apart stay whole."""
    tail = "".join("-" + _NOT_IN_JOB_NAME.sub("-", str(p)) for p in parts)
    room = max(1, JOB_NAME_MAX - len(tail))
    return (model_stem(model)[:room] + tail)[:JOB_NAME_MAX]


def job_name(model: str, spec: InstanceSpec) -> str:
    first = spec.endpoints[0]
    return job_name_of(model, spec.role, first.host, first.port)


def build(
    spec: InstanceSpec, model: str, engine_type: str, pd_protocol: str, instance_id: int = 0
) -> common_pb2.Instance:
    """The instance as the Coordinator will store it (ACTIVE, endpoints NORMAL)."""
    engine = enums.ENGINE_TYPES_BY_NAME[engine_type]
    return common_pb2.Instance(
        id=instance_id or derive_id(spec.role, ((e.host, e.port) for e in spec.endpoints)),
        role=enums.ROLES_BY_NAME[spec.role],
        job_name=job_name(model, spec),
        model_name=model,
        engine_type=engine,
        pd_protocol=enums.pd_protocol_of(_PD_BY_NAME.get(pd_protocol, enums.PD_UNSPECIFIED), engine),
        status=enums.ACTIVE,
        endpoints=[
            common_pb2.Endpoint(
                id=i,
                host=e.host,
                port=e.port,
                bootstrap_port=e.bootstrap_port,
                status=common_pb2.ENDPOINT_STATUS_NORMAL,
            )
            for i, e in enumerate(spec.endpoints)
        ],
        parallel=common_pb2.ParallelConfig(dp=len(spec.endpoints), tp=1, pp=1, ep=1, nnodes=1),
    )


_PD_BY_NAME = {"vllm": enums.PD_VLLM, "sglang": enums.PD_SGLANG}


def spec_of(inst: common_pb2.Instance) -> InstanceSpec:
    """The spec an instance from a JSON file stands for (to derive what it leaves out)."""
    role = enums.ROLE_NAMES.get(inst.role)
    if role is None:
        raise InputError(f"instance {inst.id or '(no id)'}: role is required")
    eps = sorted(EndpointSpec(e.host.lower(), e.port, e.bootstrap_port) for e in inst.endpoints)
    if not eps:
        raise InputError(f"instance {inst.id or '(no id)'}: at least one endpoint is required")
    return InstanceSpec(role, tuple(eps))


# ---- JSON input ----------------------------------------------------------------------------


def _unknown_fields(value: Any, desc: Descriptor, path: str) -> list[str]:
    """Every key that names no field, as ``path: unknown field 'x'; did you mean 'y'?``. Both
    the proto names and their lowerCamelCase JSON names are accepted, as protobuf's parser does."""
    if not isinstance(value, dict):
        return []
    by_name = {f.name: f for f in desc.fields} | {f.json_name: f for f in desc.fields}
    problems = []
    for key, sub in value.items():
        field = by_name.get(key)
        where = f"{path}.{key}" if path else str(key)
        if field is None:
            near = difflib.get_close_matches(str(key), [f.name for f in desc.fields], n=1, cutoff=0)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            problems.append(f"{where}: unknown field{hint}")
        elif field.message_type is not None:
            items = sub if field.is_repeated and isinstance(sub, list) else [sub]
            for i, item in enumerate(items):
                item_path = f"{where}[{i}]" if field.is_repeated else where
                problems += _unknown_fields(item, field.message_type, item_path)
    return problems


def parse_json(text: str, source: str) -> list[common_pb2.Instance]:
    """Instances from JSON: ``{"instances": [...]}`` (what ``--dry-run`` prints) or a bare list.
    A misspelled field is refused by name rather than silently dropped."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{source}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    if isinstance(data, list):
        data = {"instances": data}
    if not isinstance(data, dict):
        raise InputError(f'{source}: expected {{"instances": [...]}} or a list of instances')
    problems = _unknown_fields(data, coordinator_pb2.SetInstancesRequest.DESCRIPTOR, "")
    if problems:
        raise InputError(f"{source}: " + "; ".join(problems))
    request = coordinator_pb2.SetInstancesRequest()
    try:
        json_format.ParseDict(data, request)
    except json_format.ParseError as exc:
        raise InputError(f"{source}: {exc}") from None
    return list(request.instances)


def to_json(instances: Sequence[common_pb2.Instance]) -> str:
    request = coordinator_pb2.SetInstancesRequest(instances=instances)
    return json_format.MessageToJson(request, preserving_proto_field_name=True, indent=2)
