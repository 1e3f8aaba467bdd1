"""A stand-in Controller (and Coordinator) servicer for tests of the shared gRPC runtime: the
real request validators, every RPC answering UNIMPLEMENTED, and the config section to serve it
with."""

from __future__ import annotations

from typing import Any

from motor_mesh.common import errors
from motor_mesh.common.config import ControllerConfig, load
from motor_mesh.controller import validation as controller_validation
from motor_mesh.coordinator import validation as coordinator_validation
from motor_mesh.gen.motor.v1 import controller_pb2, coordinator_pb2

CONTROLLER = controller_pb2.DESCRIPTOR.services_by_name["Controller"]
COORDINATOR = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]


class StubController:
    """Just enough of a servicer to exercise the runtime: the real request validators, and
    every RPC answering UNIMPLEMENTED."""

    VALIDATORS = controller_validation.VALIDATORS

    def __getattr__(self, name: str) -> Any:
        async def unimplemented(request: Any, context: Any) -> Any:
            raise errors.unimplemented(f"stub {name}")

        return unimplemented


class StubCoordinator(StubController):
    VALIDATORS = coordinator_validation.VALIDATORS


def section(**overrides: Any) -> ControllerConfig:
    return load(None, env={}, overrides={"controller": {"port": 0, **overrides}}).controller
