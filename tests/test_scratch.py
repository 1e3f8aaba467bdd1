"""Scratch directories named after their process: what a killed one left is removed by the next."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from motor_mesh.common import scratch
from tests.procs import Proc

PREFIX = "motor-test-"


def test_what_a_killed_process_left_is_removed_by_the_next(tmp_path: Path) -> None:
    gone = Proc([sys.executable, "-c", "pass"])
    gone.popen.wait(timeout=10)  # a pid no process has now
    left = tmp_path / f"{PREFIX}{gone.pid}-abc"
    alive = tmp_path / f"{PREFIX}{os.getpid()}-def"
    others = [
        tmp_path / f"{PREFIX}notapid",
        tmp_path / f"other-{gone.pid}-x",
        tmp_path / f"{PREFIX}{2**80}-x",
    ]
    for d in (left, alive, *others):
        d.mkdir()
        (d / "file").write_bytes(b"x")
    made = scratch.make(PREFIX, str(tmp_path))
    assert os.path.basename(made).startswith(f"{PREFIX}{os.getpid()}-")
    assert os.stat(made).st_mode & 0o777 == 0o700
    assert not left.exists() and alive.exists() and all(d.exists() for d in others)


def test_a_missing_parent_is_nothing_to_sweep(tmp_path: Path) -> None:
    scratch.sweep(str(tmp_path / "nowhere"), PREFIX)
