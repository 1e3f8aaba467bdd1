from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Proc, motor_argv


@pytest.fixture
def motor_proc(tmp_path: Path) -> Iterator:
    """Start ``motor ARGS`` in a fresh directory; every process is killed at teardown."""
    started: list[Proc] = []

    def start(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Proc:
        p = Proc(motor_argv(*args), cwd=cwd or tmp_path, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()
