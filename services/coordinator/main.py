"""``motor coordinator``: the management gRPC server and the inference HTTP server."""

from __future__ import annotations

from motor_mesh.common.service_main import service_main
from motor_mesh.coordinator.app import serve


def main(argv: list[str]) -> int:
    return service_main("coordinator", argv, serve, flags={"--http-port": ("http_port", int)}, fast_loop=True)
