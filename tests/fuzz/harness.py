"""Driving one fuzzed call against a real Motor server and judging what came back.

Every motor.v1 method is called through its path with bytes in and bytes out
(``request_serializer=None``), so generated messages and raw garbage take the same road. After
each call: the status is OK or one of the precise codes of the error table (never UNKNOWN,
INTERNAL, DEADLINE_EXCEEDED), a refusal carries the google.rpc detail the table names, the
server still answers health, its log gained no traceback, and a refused call left the
service's state (its list RPC) exactly as it was.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.rpc import error_details_pb2 as ed
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from motor_mesh.common import errors
from motor_mesh.gen.motor.v1 import controller_pb2, coordinator_pb2, nodemanager_pb2
from tests.fuzz.protogen import messages, tag, varint, wire_bytes

Code = grpc.StatusCode
PB2_MODULES = (controller_pb2, coordinator_pb2, nodemanager_pb2)
# Every service of package motor.v1, as the generated descriptors list them.
SERVICES: dict[str, ServiceDescriptor] = {
    s.full_name: s for mod in PB2_MODULES for s in mod.DESCRIPTOR.services_by_name.values()
}

# The answers a caller may get for bad input (docs/api.md, "Errors"); never UNKNOWN or INTERNAL.
ALLOWED = frozenset(
    {
        Code.OK,
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.FAILED_PRECONDITION,
        Code.ALREADY_EXISTS,
        Code.RESOURCE_EXHAUSTED,
        Code.PERMISSION_DENIED,
        Code.UNAUTHENTICATED,
        Code.OUT_OF_RANGE,
        Code.UNAVAILABLE,
        Code.ABORTED,
    }
)
# The google.rpc detail each refusal must carry (any one of them).
DETAILS: dict[Code, tuple[type[Message], ...]] = {
    Code.INVALID_ARGUMENT: (ed.BadRequest,),
    Code.NOT_FOUND: (ed.ResourceInfo,),
    Code.FAILED_PRECONDITION: (ed.PreconditionFailure, ed.ErrorInfo),
    Code.ALREADY_EXISTS: (ed.ErrorInfo,),
    Code.ABORTED: (ed.ErrorInfo,),
    # Queue full / rate limited: when to retry. (Not "metadata size exceeds": that is a status
    # too large to reach the caller, the real answer lost on the way.)
    Code.RESOURCE_EXHAUSTED: (ed.RetryInfo,),
}
# grpc's own refusal of an oversized request carries no detail; nothing else may lack one.
_GRPC_SIZE_REFUSAL = re.compile(r"Received message larger than max")
_BAD_LOG = re.compile(r"traceback|unhandled|exception was never retrieved", re.I)

CALL_TIMEOUT_S = 5.0
OVERSIZED = 4 * 1024 * 1024 + 1  # one byte past the default max_message_bytes
STREAM_OPEN_S = 0.1  # a server stream that neither answers nor fails this long is open: accepted

# Bounded and reproducible: the same examples on every run, no example database.
# MOTOR_FUZZ_SCALE=10 multiplies every example count, for a deeper run by hand.
SCALE = float(os.environ.get("MOTOR_FUZZ_SCALE", "1"))


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


FUZZ = fuzz(40)


def full_path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def request_class(method: MethodDescriptor) -> type[Message]:
    return message_factory.GetMessageClass(method.input_type)


def response_class(method: MethodDescriptor) -> type[Message]:
    return message_factory.GetMessageClass(method.output_type)


@dataclass
class Outcome:
    code: Code | None  # None: the client library lost the server's status (see _bidi)
    details: str
    trailers: Any  # trailing metadata: where the google.rpc details travel
    responses: list[Message]

    def rich_details(self) -> list[Message]:
        return errors.details_of(self)

    def trailing_metadata(self) -> Any:
        return self.trailers


class LogTrap(logging.Handler):
    """Every log record of this process, formatted with its traceback, for in-process servers."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(
            logging.Formatter("%(name)s %(levelname)s %(message)s %(fields)s", defaults={"fields": ""})
        )

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.lines.append(self.format(record))

    def __enter__(self) -> LogTrap:
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self)


@dataclass
class Target:
    """One running server and what the fuzzer needs to know about it."""

    service: ServiceDescriptor
    channel: grpc.aio.Channel
    log_lines: Callable[[], Sequence[str]]  # everything the server logged so far
    # The state a refused call must leave unchanged (any comparable value); None: not checked.
    snapshot: Callable[[], Awaitable[Any]] | None = None
    seeds: dict[str, list[Message]] = field(default_factory=dict)  # method name -> plausible requests
    # Told of every accepted call (method, request, responses), to keep snapshot() honest about
    # what an accepted call may change later on its own.
    on_accepted: Callable[[MethodDescriptor, Message | None, list[Message]], None] = lambda m, r, rs: None
    # What of a snapshot must be equal before and after a refused call, judged after the call
    # (on_accepted may have learnt meanwhile what is still changing on its own).
    comparable: Callable[[Any], Any] = lambda state: state
    log_seen: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)  # method/code
    _strategies: dict[tuple[str, str], st.SearchStrategy[Any]] = field(default_factory=dict)

    def methods(self, skip: Iterable[str] = ()) -> list[MethodDescriptor]:
        return [m for m in self.service.methods if m.name not in set(skip)]

    def method(self, name: str) -> MethodDescriptor:
        return self.service.methods_by_name[name]

    def requests(self, method: MethodDescriptor) -> st.SearchStrategy[list[bytes]]:
        """Generated messages, serialized: one per call, a short sequence for a client stream."""
        return self._cached(method, "msg", lambda: self._wrap(method, self._messages(method)))

    def garbage(self, method: MethodDescriptor) -> st.SearchStrategy[list[bytes]]:
        return self._cached(
            method, "raw", lambda: self._wrap(method, wire_bytes(method.input_type, self._messages(method)))
        )

    def _messages(self, method: MethodDescriptor) -> st.SearchStrategy[Any]:
        return messages(method.input_type, self.seeds.get(method.name, ()))

    def _cached(self, method: MethodDescriptor, kind: str, make: Callable[[], st.SearchStrategy[Any]]) -> Any:
        key = (method.name, kind)
        if key not in self._strategies:
            self._strategies[key] = make()
        return self._strategies[key]

    @staticmethod
    def _wrap(method: MethodDescriptor, one: st.SearchStrategy[Any]) -> st.SearchStrategy[list[bytes]]:
        as_bytes = one.map(lambda m: m if isinstance(m, bytes) else m.SerializeToString())
        if method.client_streaming:
            return st.lists(as_bytes, min_size=1, max_size=4)
        return as_bytes.map(lambda b: [b])

    def new_log(self) -> list[str]:
        lines = list(self.log_lines())
        fresh, self.log_seen = lines[self.log_seen :], len(lines)
        return fresh


async def call(
    channel: grpc.aio.Channel, method: MethodDescriptor, raws: list[bytes], open_s: float = STREAM_OPEN_S
) -> Outcome:
    """One call of ``method`` with the encoded request(s) ``raws``; the stream kinds too. A
    server stream quiet for ``open_s`` is taken as accepted."""
    path, resp_cls = full_path(method), response_class(method)
    responses: list[Message] = []
    try:
        if method.client_streaming:
            return await _bidi(channel, path, resp_cls, raws)
        if method.server_streaming:
            stream = channel.unary_stream(path, request_serializer=None, response_deserializer=None)(
                raws[0], timeout=CALL_TIMEOUT_S
            )
            try:
                while True:
                    item = await asyncio.wait_for(stream.read(), open_s)
                    if item is grpc.aio.EOF:
                        break
                    responses.append(resp_cls.FromString(item))
            except TimeoutError:  # (cancelling a read cancels the call: that is wanted here)
                return Outcome(Code.OK, "", (), responses)  # open and quiet: the request was taken
            return await _ended(stream, responses)
        raw_resp = await channel.unary_unary(path, request_serializer=None, response_deserializer=None)(
            raws[0], timeout=CALL_TIMEOUT_S
        )
        return Outcome(Code.OK, "", (), [resp_cls.FromString(raw_resp)])
    except grpc.aio.AioRpcError as err:
        return Outcome(err.code(), err.details() or "", err.trailing_metadata(), responses)


async def _bidi(channel: grpc.aio.Channel, path: str, resp_cls: type[Message], raws: list[bytes]) -> Outcome:
    """One message at a time, each followed by its answer (or a short quiet spell), the way a
    NodeManager talks. Writing after the server ended the call would only earn a client-side
    INTERNAL ("Internal error from Core") in place of the server's status; when a write races
    the end anyway, the outcome's code is None: the client library lost the server's status."""
    bidi = channel.stream_stream(path, request_serializer=None, response_deserializer=None)(
        timeout=CALL_TIMEOUT_S
    )
    responses: list[Message] = []
    arrived: asyncio.Queue[bool] = asyncio.Queue()

    async def reader() -> None:
        # A read of its own: cancelling a pending read() would cancel the whole call.
        try:
            async for item in bidi:
                responses.append(resp_cls.FromString(item))
                arrived.put_nowait(True)
        except grpc.aio.AioRpcError:
            pass
        arrived.put_nowait(False)

    task = asyncio.create_task(reader())
    lost = False
    try:
        for raw in raws:
            if bidi.done() or task.done():
                break
            try:
                await bidi.write(raw)
            except grpc.aio.AioRpcError:
                lost = True
                break
            try:
                if not await asyncio.wait_for(arrived.get(), STREAM_OPEN_S):
                    break  # the call ended
            except TimeoutError:
                continue
        if not bidi.done():
            with contextlib.suppress(grpc.aio.AioRpcError):
                await bidi.done_writing()
        await asyncio.wait_for(task, CALL_TIMEOUT_S)
    finally:
        task.cancel()
    out = await _ended(bidi, responses)
    if lost and out.code == Code.INTERNAL and out.details == "Internal error from Core":
        out.code = None
    return out


async def _ended(c: Any, responses: list[Message]) -> Outcome:
    return Outcome(await c.code(), await c.details() or "", await c.trailing_metadata(), responses)


async def serving(channel: grpc.aio.Channel, service: str) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _summary(raws: list[bytes], request: Message | None) -> str:
    if request is not None:
        text = str(request)
        return text if len(text) < 600 else text[:600] + f"... ({len(text)} chars)"
    return " | ".join(repr(r[:80]) + (f"... ({len(r)} bytes)" if len(r) > 80 else "") for r in raws)


async def check_call(
    target: Target, method: MethodDescriptor, raws: list[bytes], open_s: float = STREAM_OPEN_S
) -> Outcome:
    """Send one fuzzed call and assert everything the contract promises about the answer."""
    before = await target.snapshot() if target.snapshot is not None else None
    out = await call(target.channel, method, raws, open_s)
    parsed: Message | None = None
    with contextlib.suppress(Exception):
        parsed = request_class(method).FromString(raws[0])
    where = f"{full_path(method)} with {_summary(raws, parsed)}"
    target.outcomes[f"{method.name}/{out.code.name if out.code else 'LOST'}"] += 1
    if os.environ.get("MOTOR_FUZZ_STATS") == "2" and out.code != Code.OK:
        print(method.name, out.code, out.details[:200], sum(map(len, raws)))
    if out.code is not None:
        assert out.code in ALLOWED, f"{out.code.name} ({out.details!r}) from {where}"
        assert "Traceback" not in out.details, f"a traceback in the status message of {where}"
        if out.code in DETAILS and not _GRPC_SIZE_REFUSAL.search(out.details):
            kinds = DETAILS[out.code]
            got = out.rich_details()
            assert any(isinstance(d, kinds) for d in got), (
                f"{out.code.name} without a {'/'.join(k.__name__ for k in kinds)} detail "
                f"(details {got}, message {out.details!r}) from {where}"
            )
    bad = bad_log_lines(target.new_log())
    assert not bad, f"the server logged a failure after {where}:\n" + "\n".join(bad)
    assert await serving(target.channel, target.service.full_name), f"not SERVING after {where}"
    if out.code == Code.OK or out.responses:
        # Accepted, or a stream that took some messages before it refused one.
        target.on_accepted(method, parsed, out.responses)
    if out.code != Code.OK and target.snapshot is not None:
        after = await target.snapshot()
        assert target.comparable(after) == target.comparable(before), (
            f"a refused call ({out.code.name if out.code else 'ended'}) changed the state: {where}"
        )
    return out


def bad_log_lines(lines: Iterable[str]) -> list[str]:
    return [line[:4000] for line in lines if _BAD_LOG.search(line)]


async def check_oversized(target: Target, method: MethodDescriptor) -> None:
    """A request over max_message_bytes (4 MiB): RESOURCE_EXHAUSTED, and the server goes on."""
    big = tag(999, 2) + varint(OVERSIZED) + b"\x00" * OVERSIZED  # unknown field 999
    await check_call(target, method, [big], open_s=CALL_TIMEOUT_S)
    assert target.outcomes[f"{method.name}/RESOURCE_EXHAUSTED"], f"{full_path(method)} took {len(big)} bytes"


def finally_clean(target: Target) -> None:
    """At the end of a test: nothing logged late (a task that failed after its call answered)."""
    if os.environ.get("MOTOR_FUZZ_STATS"):
        print(f"\n{target.service.name}: {dict(sorted(target.outcomes.items()))}")
    bad = bad_log_lines(target.new_log())
    assert not bad, "the server logged a failure:\n" + "\n".join(bad)
