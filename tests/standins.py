"""Stand-ins for the real engines: a ``vllm`` executable (first on PATH) and an
``sglang.launch_server`` module (first on PYTHONPATH) that record the argv and environment they
were launched with, then exec the simulated engine with the same flags, under the same pid. The
NodeManager cannot tell them from the real thing; the tests read what a real engine would have
received.

Each stand-in writes ``$STANDIN_RECORDS/<pid>.json``: ``{"argv", "orig_argv", "env"}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

# Written whole, then renamed: a reader never sees half a record.
RECORD = """
import json, os, sys
_path = os.path.join(os.environ["STANDIN_RECORDS"], f"{os.getpid()}.json")
with open(_path + ".tmp", "w") as f:
    json.dump({"argv": sys.argv, "orig_argv": sys.orig_argv, "env": dict(os.environ)}, f)
os.replace(_path + ".tmp", _path)
"""
# `vllm serve MODEL ...` / `python -m sglang.launch_server ...` -> `motor engine-sim ...`
BECOME_SIM = (
    'os.execv(sys.executable, [sys.executable, "-m", "motor_mesh.cli", "engine-sim", *sys.argv[1:]])\n'
)


def write_vllm(bin_dir: Path) -> Path:
    """``bin_dir/vllm``; put ``bin_dir`` first on the engine's PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "vllm"
    script.write_text(f"#!{sys.executable}\n{RECORD}\n{BECOME_SIM}")
    script.chmod(0o755)
    return bin_dir


def write_sglang(lib_dir: Path) -> Path:
    """``lib_dir/sglang/launch_server.py``; put ``lib_dir`` first on the engine's PYTHONPATH."""
    pkg = lib_dir / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(f"{RECORD}\n{BECOME_SIM}")
    return lib_dir


def prepend_path(first: Path, rest: str | None) -> str:
    """``first`` ahead of an existing PATH-like value (which may be unset or empty)."""
    return f"{first}{os.pathsep}{rest}" if rest else str(first)


def read_records(path: Path) -> dict[int, dict[str, Any]]:
    """The stand-ins' records by engine pid (the stand-in execs, so the pid is the engine's)."""
    return {int(p.stem): json.loads(p.read_text()) for p in path.glob("*.json")}
