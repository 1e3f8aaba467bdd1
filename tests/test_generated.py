"""The committed generated code must match what `make gen` (tools/gen.py) produces: gen/motor
from protos/ (the buf module) and gen/etcd from etcd_protos/ (the etcd v3 API subset the
Controller's client uses), imports pointed at motor_mesh.gen."""

from __future__ import annotations

import filecmp
from pathlib import Path

from tests.procs import ROOT
from tools import gen


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    gen.generate(out)
    fresh, committed = _files(out), _files(ROOT / "gen")
    assert fresh == committed, f"gen/ has missing or extra files {sorted(fresh ^ committed)}: run `make gen`"
    stale = sorted(n for n in fresh if not filecmp.cmp(out / n, ROOT / "gen" / n, shallow=False))
    assert not stale, f"gen/ is stale for {stale}: run `make gen` and commit"


def test_generated_imports_stay_inside_motor_mesh() -> None:
    """No generated module imports a top-level `motor` or `etcd` (other distributions' names)."""
    leaks = [
        f"{p.relative_to(ROOT)}: {line}"
        for p in (ROOT / "gen").rglob("*.py*")
        for line in p.read_text().splitlines()
        if line.lstrip().startswith(("from motor.", "from etcd.", "import motor", "import etcd"))
    ]
    assert not leaks, leaks
