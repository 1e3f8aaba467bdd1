"""The wheel as a user installs it: `pip install dist/motor_mesh-*.whl motor python-etcd` in a
fresh virtual environment. Motor installs one import package, motor_mesh, so PyPI's `motor`
(MongoDB's asyncio driver) and `python-etcd` (the top-level `etcd`) install beside it and all
three import; `motor up` from that environment serves."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.cluster import HTTP, up_ports
from tests.ports import reserve
from tests.procs import ROOT, Proc

pytestmark = pytest.mark.timeout(900)


def _run(*argv: str | Path, cwd: Path) -> str:
    run = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{run.stdout}\n{run.stderr}"
    return run.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of what the Dockerfile copies, so the build writes nothing in the checkout."""
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src)
    for name in ("services", "gen"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src, cwd=dist)
    (built,) = dist.glob("motor_mesh-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    where = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", where / "v", cwd=where)
    try:
        _run(where / "v/bin/python", "-m", "pip", "install", "-q", wheel, "motor", "python-etcd", cwd=where)
    except AssertionError as err:
        if "Could not find a version" in str(err) or "No matching distribution" in str(err):
            pytest.skip("the package index does not serve motor or python-etcd here")
        raise
    yield where / "v"


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
        top_level = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/top_level.txt")))
    assert {t for t in tops if not t.endswith((".dist-info", ".data"))} == {"motor_mesh"}
    assert top_level.decode().split() == ["motor_mesh"]


def test_the_wheel_is_pure_python(wheel: Path) -> None:
    """Nothing to compile: it installs on any platform, a machine without a C compiler too."""
    assert wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert not [n for n in zf.namelist() if n.endswith((".so", ".pyd", ".c"))]


def test_motor_mesh_motor_and_etcd_import_side_by_side(venv: Path) -> None:
    probe = (
        "import json, etcd, motor, motor.motor_asyncio, motor_mesh, motor_mesh.cli.main;"
        "from motor_mesh.gen.motor.v1 import controller_pb2;"
        "from motor_mesh.gen.etcd.etcdserverpb import rpc_pb2;"
        "print(json.dumps({'etcd': etcd.__file__, 'motor': motor.__file__, 'mesh': motor_mesh.__file__,"
        " 'client': etcd.Client.__module__, 'service': controller_pb2.DESCRIPTOR.services_by_name['Controller'].full_name}))"
    )
    where = json.loads(_run(venv / "bin/python", "-c", probe, cwd=venv))
    site = str(venv / "lib")
    assert where["etcd"].startswith(site) and where["etcd"].endswith("etcd/__init__.py")
    assert where["motor"].startswith(site) and where["motor"].endswith("motor/__init__.py")
    assert where["mesh"].startswith(site) and where["mesh"].endswith("motor_mesh/__init__.py")
    assert where["client"] == "etcd.client"  # python-etcd's, not ours
    assert where["service"] == "motor.v1.Controller"  # the wire names did not move


def test_motor_up_from_the_installed_wheel_serves(venv: Path, tmp_path: Path) -> None:
    ports = reserve(up_ports(2))
    up = Proc(
        [
            str(venv / "bin/motor"),
            "up",
            "--port-offset",
            str(ports.shift),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=tmp_path,
    )
    try:
        line = up.wait_line(lambda s: s.startswith("READY "), 120)
        assert line == f"READY http://127.0.0.1:{HTTP + ports.shift}"
        client = openai.OpenAI(base_url=f"{line.split()[1]}/v1", api_key="none", max_retries=0, timeout=30)
        resp = client.completions.create(model="motor-sim", prompt="Say something.", max_tokens=4)
        assert resp.choices[0].text
    finally:
        up.stop()
