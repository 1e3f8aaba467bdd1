"""Every motor.v1.Controller and motor.v1.Coordinator RPC (streams included), fuzzed against an
in-process server with generated messages and raw bytes. The Controller holds two ACTIVE
instances, the Coordinator a prefill, a decode and a union instance; every instance-set request
is all-or-nothing, so a refused one leaves ListInstances as it was. The methods come from the
generated descriptors, so a new RPC is fuzzed too."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import FUZZ, SERVICES, Target, check_call, check_oversized

# Each service and the fixture that serves it (tests/fuzz/conftest.py).
SERVED = {"motor.v1.Controller": "controller_target", "motor.v1.Coordinator": "coordinator_target"}
CASES = [(service, m.name) for service in SERVED for m in SERVICES[service].methods]


@pytest.fixture
def target(request: pytest.FixtureRequest) -> Target:
    return request.getfixturevalue(SERVED[request.param])  # type: ignore[no-any-return]


@pytest.mark.parametrize(("target", "method"), CASES, indirect=["target"])
@FUZZ
@given(data=st.data())
async def test_generated_messages(target: Target, method: str, data: st.DataObject) -> None:
    m = target.method(method)
    await check_call(target, m, data.draw(target.requests(m), label="request"))


@pytest.mark.parametrize(("target", "method"), CASES, indirect=["target"])
@FUZZ
@given(data=st.data())
async def test_raw_bytes(target: Target, method: str, data: st.DataObject) -> None:
    m = target.method(method)
    await check_call(target, m, data.draw(target.garbage(m), label="bytes"))


@pytest.mark.parametrize("target", list(SERVED), indirect=True)
async def test_oversized_requests(target: Target) -> None:
    for m in target.methods():
        await check_oversized(target, m)
