"""Generate gen/ (``make gen``): Python, gRPC and typing stubs for Motor's API (protos/motor/v1)
and for the etcd v3 API subset the Controller's etcd client uses (etcd_protos/).

protoc names generated modules after the .proto paths (``motor.v1.common_pb2``), but everything
Motor installs lives under one import package, ``motor_mesh`` (gen/ is ``motor_mesh.gen``), so
that it cannot collide with the ``motor`` (MongoDB) and ``etcd`` distributions on PyPI. This
rewrites the generated imports and module names to ``motor_mesh.gen.…``. The wire names (the
proto packages ``motor.v1`` and ``etcdserverpb``, the service ``motor.v1.Controller``) are those
of the .proto files and do not change.

    python -m tools.gen [--out DIR]     # DIR defaults to gen/; tests/test_generated.py uses a temp dir
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "motor_mesh.gen"
# Include root -> the .proto files compiled from it (paths relative to the root).
SOURCES = {
    "protos": ("motor/v1/*.proto",),
    "etcd_protos": ("etcd/etcdserverpb/rpc.proto", "etcd/mvccpb/kv.proto"),
}
# The top-level proto path components whose generated modules move under PACKAGE.
ROOTS = ("motor", "etcd")
# Written by hand, not by protoc: package markers and the PEP 561 typing marker.
MARKERS = ("__init__.py", "py.typed")

_IMPORT = re.compile(rf"^(\s*from )({'|'.join(ROOTS)})(\.[\w.]+ import )", re.M)
_MODULE_NAME = re.compile(rf"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')({'|'.join(ROOTS)})\.")


def protoc(out: Path) -> None:
    # protoc finds its mypy plugins (mypy-protobuf) beside this interpreter.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for include, patterns in SOURCES.items():
        protos = sorted(
            str(p.relative_to(REPO / include)) for pat in patterns for p in (REPO / include).glob(pat)
        )
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
            cwd=REPO,
            env=env,
            check=True,
        )


def rehome(out: Path) -> None:
    """Point every generated import and module name at PACKAGE and add the package markers."""
    for path in out.rglob("*.py*"):
        text = path.read_text()
        new = _MODULE_NAME.sub(rf"\g<1>{PACKAGE}.\g<2>.", _IMPORT.sub(rf"\g<1>{PACKAGE}.\g<2>\g<3>", text))
        if new != text:
            path.write_text(new)
    (out / "__init__.py").write_text('"""Generated code (make gen): never edit by hand."""\n')
    for package in {p.parent for p in out.rglob("*_pb2.py")} | {out / root for root in ROOTS}:
        (package / "__init__.py").touch()
    for package in {p.parent for p in out.rglob("*_pb2.py")}:
        (package / "py.typed").touch()


def generate(out: Path) -> None:
    for root in ROOTS:
        shutil.rmtree(out / root, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    protoc(out)
    rehome(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "gen")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
