"""The fuzzers cover every motor.v1 service: the methods of each come from the generated
descriptors, and a service without a fuzz target fails here instead of going unfuzzed."""

from __future__ import annotations

from tests.fuzz.harness import SERVICES
from tests.fuzz.test_rpc_inprocess import SERVED
from tests.fuzz.test_rpc_nodemanager import SERVICE as NODEMANAGER


def test_every_service_has_a_fuzz_target() -> None:
    assert set(SERVICES) == {*SERVED, NODEMANAGER}, (
        "a motor.v1 service was added or renamed: serve it from a fixture in tests/fuzz/conftest.py "
        "and add it to SERVED in tests/fuzz/test_rpc_inprocess.py"
    )
