"""Every motor.v1.Controller RPC (the heartbeat stream and the alarm watch included), fuzzed
against an in-process Controller holding two ACTIVE instances: generated messages and raw
bytes. The methods come from the generated descriptor, so a new RPC is fuzzed too."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import FUZZ, SERVICES, Target, check_call, check_oversized

METHODS = [m.name for m in SERVICES["motor.v1.Controller"].methods]


@pytest.mark.parametrize("method", METHODS)
@FUZZ
@given(data=st.data())
async def test_generated_messages(controller_target: Target, method: str, data: st.DataObject) -> None:
    m = controller_target.method(method)
    await check_call(controller_target, m, data.draw(controller_target.requests(m), label="request"))


@pytest.mark.parametrize("method", METHODS)
@FUZZ
@given(data=st.data())
async def test_raw_bytes(controller_target: Target, method: str, data: st.DataObject) -> None:
    m = controller_target.method(method)
    await check_call(controller_target, m, data.draw(controller_target.garbage(m), label="bytes"))


async def test_oversized_requests(controller_target: Target) -> None:
    for m in controller_target.methods():
        await check_oversized(controller_target, m)
