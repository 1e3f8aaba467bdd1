"""``motor nodemanager``: one node's engine supervisor in the foreground (wired in app.py)."""

from __future__ import annotations

from motor_mesh.common.service_main import service_main
from motor_mesh.nodemanager.app import serve


def main(argv: list[str]) -> int:
    return service_main("nodemanager", argv, serve, {"--metrics-port": ("metrics_port", int)})
