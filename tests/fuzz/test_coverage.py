"""The fuzzers cover every motor.v1 service: the methods of each come from the generated
descriptors, and a service without a fuzz target fails here instead of going unfuzzed."""

from __future__ import annotations

from tests.fuzz.harness import SERVICES

# Service -> the module that fuzzes it (each parametrizes over all of the service's methods).
FUZZED = {
    "motor.v1.Controller": "tests/fuzz/test_rpc_controller.py",
    "motor.v1.Coordinator": "tests/fuzz/test_rpc_coordinator.py",
    "motor.v1.NodeManager": "tests/fuzz/test_rpc_nodemanager.py",
}


def test_every_service_has_a_fuzz_target() -> None:
    assert set(SERVICES) == set(FUZZED), (
        "a motor.v1 service was added or renamed: start it in tests/fuzz/conftest.py and fuzz it "
        "like tests/fuzz/test_rpc_coordinator.py"
    )
