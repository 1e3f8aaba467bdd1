"""The committed generated code must match what `make gen` produces: gen/motor from protos/ (the
buf module) and gen/etcd from etcd_protos/ (the etcd v3 API subset the Controller's client uses)."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT

# Generated package directory -> the include root its .proto files are compiled from.
SOURCES = {
    "motor/v1": "protos",
    "etcd/etcdserverpb": "etcd_protos",
    "etcd/mvccpb": "etcd_protos",
}
HANDWRITTEN = ("__init__.py", "py.typed", "__pycache__")


@pytest.mark.parametrize("package", list(SOURCES))
def test_generated_code_is_fresh(tmp_path: Path, package: str) -> None:
    include = SOURCES[package]
    protos = sorted(str(p.relative_to(ROOT / include)) for p in (ROOT / include / package).glob("*.proto"))
    assert protos, f"no .proto files in {include}/{package}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    out = tmp_path / "gen"
    out.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            *protos,
        ],
        cwd=ROOT,
        env=env,
        check=True,
    )
    fresh = sorted(p.name for p in (out / package).iterdir())
    committed = sorted(p.name for p in (ROOT / "gen" / package).iterdir() if p.name not in HANDWRITTEN)
    assert fresh == committed, f"gen/{package} has missing or extra files: run `make gen`"
    stale = [
        n for n in fresh if not filecmp.cmp(out / package / n, ROOT / "gen" / package / n, shallow=False)
    ]
    assert not stale, f"gen/{package} is stale for {stale}: run `make gen` and commit"
