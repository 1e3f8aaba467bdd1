"""What the operator views (``motor instances``, ``motor alarms``, ``motor status``) share: how
protobuf values are spelt in tables, the instance table, column alignment, and running a view
with the one-line error and exit code every operator command has."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from motor_mesh.cli import client
from motor_mesh.common import enums
from motor_mesh.common.config import ConfigError
from motor_mesh.gen.motor.v1 import common_pb2

if TYPE_CHECKING:
    from google.protobuf.internal.enum_type_wrapper import _EnumTypeWrapper

_V = TypeVar("_V", bound=int)

INSTANCE_HEADER = ["ID", "ROLE", "STATUS", "MODEL", "JOB", "ENDPOINTS"]


def as_dict(msg: Message) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True)


def short_enum(enum: _EnumTypeWrapper[_V], value: _V, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix)


def endpoint_text(ep: common_pb2.Endpoint) -> str:
    status = enums.endpoint_status_name(ep.status)
    extra = (f",pid={ep.pid}" if ep.pid else "") + (",headless" if ep.headless else "")
    return f"{ep.host}:{ep.port}({status}{extra})"


def instance_row(i: common_pb2.Instance, status: str = "") -> list[str]:
    """One instance in the table's columns; ``status`` overrides the instance's own (a watch
    shows a removed instance as DELETED)."""
    return [
        str(i.id),
        short_enum(common_pb2.Role, i.role, "ROLE_"),
        status or enums.status_name(i.status),
        i.model_name,
        i.job_name,
        " ".join(endpoint_text(e) for e in i.endpoints),
    ]


def instance_rows(instances: Iterable[common_pb2.Instance]) -> list[list[str]]:
    return [INSTANCE_HEADER] + [instance_row(i) for i in instances]


def column_widths(rows: list[list[str]]) -> list[int]:
    """Each column's width over the cells in it; the last cell of a row shorter than the header
    runs on (see ``table_lines``) and counts for no column."""
    n = len(rows[0])
    return [max(len(r[c]) for r in rows if c < len(r) and (len(r) == n or c < len(r) - 1)) for c in range(n)]


def aligned(row: list[str], widths: list[int]) -> str:
    return "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)).rstrip()


def table_lines(rows: list[list[str]], indent: str = "") -> list[str]:
    """``rows`` (the first is the header) in aligned columns. A row with fewer cells than the
    header fills the first columns and lets its last cell run on (an UNREACHABLE message), and
    is left out of the widths so it does not widen the columns of the others."""
    widths = column_widths(rows)
    return [indent + aligned(r, widths) for r in rows]


def print_table(rows: list[list[str]]) -> None:
    for line in table_lines(rows):
        print(line)


def parser(name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"motor {name}")
    client.add_flags(p)
    return p


def run(name: str, args: argparse.Namespace, view: Callable[[str | None], Coroutine[Any, Any, int]]) -> int:
    """Run ``view(key)``; a bad key file or a failed call to the Controller is one line on
    stderr and exit 1, Ctrl-C exits 130 without a traceback."""
    try:
        return asyncio.run(view(client.key_of(args)))
    except ConfigError as err:
        print(f"motor {name}: {err.errors[0]}", file=sys.stderr)
    except grpc.aio.AioRpcError as err:
        print(client.rpc_error_line(f"motor {name}", "Controller", args.controller, err), file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1
