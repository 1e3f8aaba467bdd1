"""Every motor.v1.NodeManager RPC fuzzed against a real ``motor nodemanager`` process (one for
the module: it takes a second to start), its stderr read for tracebacks. ``Stop`` ends the
process by design: it is fuzzed with bytes that do not parse on the shared process, and once
with a real request on a process of its own, which must exit cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from motor_mesh.gen.motor.v1 import nodemanager_pb2
from tests.fuzz.conftest import start_nodemanager
from tests.fuzz.harness import (
    FUZZ,
    SERVICES,
    Target,
    bad_log_lines,
    call,
    check_call,
    check_oversized,
    request_class,
)
from tests.fuzz.protogen import parses
from tests.poll import until

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVICE = "motor.v1.NodeManager"
TERMINAL = {"Stop"}  # ends the process on purpose
METHODS = [m.name for m in SERVICES[SERVICE].methods if m.name not in TERMINAL]


@pytest.mark.parametrize("method", METHODS)
@FUZZ
@given(data=st.data())
async def test_generated_messages(nm_target: Target, method: str, data: st.DataObject) -> None:
    m = nm_target.method(method)
    await check_call(nm_target, m, data.draw(nm_target.requests(m), label="request"))


@pytest.mark.parametrize("method", [*METHODS, *TERMINAL])
@FUZZ
@given(data=st.data())
async def test_raw_bytes(nm_target: Target, method: str, data: st.DataObject) -> None:
    m = nm_target.method(method)
    raws = data.draw(nm_target.garbage(m), label="bytes")
    if method in TERMINAL:  # only what cannot parse: anything else would stop the process
        raws = [r for r in raws if not parses(request_class(m).FromString, r)] or [b"\x80"]
    await check_call(nm_target, m, raws)


async def test_oversized_requests(nm_target: Target) -> None:
    for m in nm_target.methods():
        await check_oversized(nm_target, m)


async def test_stop_with_an_odd_reason_exits_cleanly(tmp_path: Path) -> None:
    nm = await start_nodemanager(tmp_path)
    try:
        stop = SERVICES[SERVICE].methods_by_name["Stop"]
        reason = "bye \x00\x1b[31m\u202e" + "é" * 60_000 + "\n" + "x" * 40_000
        out = await call(nm.channel, stop, [nodemanager_pb2.StopRequest(reason=reason).SerializeToString()])
        assert out.code is not None and out.code.name == "OK", out.details
        await until(lambda: nm.proc.popen.poll() is not None, timeout=15, what="the NodeManager to exit")
        assert nm.proc.popen.returncode == 1, nm.proc.tail()
        assert not bad_log_lines(nm.proc.lines), nm.proc.tail()
    finally:
        nm.proc.kill()
        await nm.channel.close()
