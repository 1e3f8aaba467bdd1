"""The code's shape, checked: no import cycle in motor_mesh (lazy imports included; one through
TYPE_CHECKING only where a comment says why), a Controller folder you can take in at a glance,
and the module map in docs/architecture.md as the imports draw it."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import ROOT
from tools import imports

CONTROLLER_TOP_MODULES_MAX = 12


def test_the_import_check_passes_and_prints_the_package_graph() -> None:
    run = subprocess.run([sys.executable, "-m", "tools.imports"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "controller.faults -> " in run.stdout


def test_a_cycle_is_found_lazy_or_not() -> None:
    """The check itself: a cycle closed by an import inside a function is still a cycle."""
    a = imports.Module("motor_mesh.x.a", ROOT / "services/x/a.py", "", imports={"motor_mesh.x.b"})
    b = imports.Module("motor_mesh.x.b", ROOT / "services/x/b.py", "", imports={"motor_mesh.x.a"})
    c = imports.Module("motor_mesh.x.c", ROOT / "services/x/c.py", "", typing_only={"motor_mesh.x.a"})
    assert imports.cycles(imports.module_edges({m.name: m for m in (a, b, c)})) == [[a.name, b.name]]
    a.imports, c.typing_says_why = {"motor_mesh.x.c"}, False
    assert imports.unexplained_typing_cycles({m.name: m for m in (a, b, c)}) == [[a.name, c.name]]


def test_lazy_imports_are_read() -> None:
    """controller/main.py imports leader/ha.py inside a function (SQLite never loads etcd)."""
    modules = imports.load()
    assert "motor_mesh.controller.leader.ha" in modules["motor_mesh.controller.main"].imports


def test_the_controller_folder_has_few_modules_at_its_top() -> None:
    top = sorted(p.name for p in (ROOT / "services/controller").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= CONTROLLER_TOP_MODULES_MAX, top


def test_the_module_map_in_the_architecture_doc_is_fresh() -> None:
    doc = (ROOT / "docs/architecture.md").read_text()
    begin, end = doc.index(imports.MAP_BEGIN), doc.index(imports.MAP_END) + len(imports.MAP_END)
    assert doc[begin:end] == imports.render_map(imports.load()), (
        "docs/architecture.md's module map is stale: run `make docs`"
    )
