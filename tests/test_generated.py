"""The committed generated code must match what `make gen` produces from protos/."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos/motor/v1").glob("*.proto"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    out = tmp_path / "gen"
    out.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iprotos",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            *protos,
        ],
        cwd=ROOT / "protos" / "..",
        env=env,
        check=True,
    )
    fresh = sorted(p.name for p in (out / "motor/v1").iterdir())
    committed = sorted(
        p.name for p in (ROOT / "gen/motor/v1").iterdir() if p.name not in ("__init__.py", "py.typed")
    )
    committed = [n for n in committed if n != "__pycache__"]
    assert fresh == committed, "gen/ has missing or extra files: run `make gen`"
    stale = [
        n for n in fresh if not filecmp.cmp(out / "motor/v1" / n, ROOT / "gen/motor/v1" / n, shallow=False)
    ]
    assert not stale, f"gen/ is stale for {stale}: run `make gen` and commit"
