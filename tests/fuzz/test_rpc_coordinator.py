"""Every motor.v1.Coordinator RPC fuzzed against an in-process Coordinator (management gRPC and
inference HTTP) holding a prefill, a decode and a union instance: generated messages and raw
bytes. Each instance-set request is all-or-nothing, so a refused one leaves ListInstances as it
was."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import FUZZ, SERVICES, Target, check_call, check_oversized

METHODS = [m.name for m in SERVICES["motor.v1.Coordinator"].methods]


@pytest.mark.parametrize("method", METHODS)
@FUZZ
@given(data=st.data())
async def test_generated_messages(coordinator_target: Target, method: str, data: st.DataObject) -> None:
    m = coordinator_target.method(method)
    await check_call(coordinator_target, m, data.draw(coordinator_target.requests(m), label="request"))


@pytest.mark.parametrize("method", METHODS)
@FUZZ
@given(data=st.data())
async def test_raw_bytes(coordinator_target: Target, method: str, data: st.DataObject) -> None:
    m = coordinator_target.method(method)
    await check_call(coordinator_target, m, data.draw(coordinator_target.garbage(m), label="bytes"))


async def test_oversized_requests(coordinator_target: Target) -> None:
    for m in coordinator_target.methods():
        await check_oversized(coordinator_target, m)
