"""Motor's import graph: which module imports which, read from the source (services/ is the
package motor_mesh), every import counted wherever it is written, lazy ones inside functions
included. Imports under ``if TYPE_CHECKING:`` never run, so they are not a cycle Python trips on;
a cycle that closes through them is allowed only where each such ``if TYPE_CHECKING:`` line on it
carries a comment saying why.

    python -m tools.imports            # the package graph; exit 1 and name them on a cycle
    python -m tools.imports --modules  # every module with what it imports
    python -m tools.imports --map      # the module map of docs/architecture.md (markdown)
    python -m tools.imports --write    # put that map into docs/architecture.md (make docs)

tests/test_imports.py runs the check and compares docs/architecture.md's map with --map.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "services"
PACKAGE = "motor_mesh"
MAP_BEGIN = "<!-- module map: python -m tools.imports --map -->"
MAP_END = "<!-- end of module map -->"
ARCHITECTURE = REPO / "docs" / "architecture.md"


@dataclass
class Module:
    name: str
    path: Path
    doc: str
    imports: set[str] = field(default_factory=set)  # run when the module (or a function) runs
    typing_only: set[str] = field(default_factory=set)  # under `if TYPE_CHECKING:`
    typing_says_why: bool = True  # every `if TYPE_CHECKING:` line carries a comment

    @property
    def package(self) -> str:
        return self.name if self.path.name == "__init__.py" else self.name.rpartition(".")[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.Module, module: str, is_package: bool, known: dict[str, Module]
) -> Iterator[tuple[str, bool]]:
    """(imported module, typing only) for every import statement in the module."""
    typing_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            typing_nodes |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    base = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        typing = id(node) in typing_nodes
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, typing
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                origin = ".".join(parts[: len(parts) - node.level + 1])
                origin = f"{origin}.{node.module}" if node.module else origin
            else:
                origin = node.module or ""
            for alias in node.names:
                # `from pkg import mod` imports the module pkg.mod when there is one (the package
                # itself is then already initialised: it is the parent); otherwise a name
                # defined in pkg/__init__.py.
                sub = f"{origin}.{alias.name}"
                yield (sub if sub in known else origin), typing


def load() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    parsed: dict[str, tuple[ast.Module, list[str]]] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        name, source = module_name(path), path.read_text()
        tree = ast.parse(source, str(path))
        doc = (ast.get_docstring(tree) or "").strip().split("\n\n")[0].replace("\n", " ")
        modules[name] = Module(name, path, doc)
        parsed[name] = (tree, source.splitlines())
    # Every module is known before imports are resolved: `from pkg import x` is the module
    # pkg.x when there is one.
    for name, mod in modules.items():
        tree, lines = parsed[name]
        mod.typing_says_why = all(
            "#" in lines[node.lineno - 1]
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and _is_type_checking(node.test)
        )
        for target, typing in _imports(tree, name, mod.path.name == "__init__.py", modules):
            if target in modules and target != name:
                (mod.typing_only if typing else mod.imports).add(target)
    for mod in modules.values():
        mod.typing_only -= mod.imports
    return modules


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def module_edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module -> the modules it imports at run time. Importing ``a.b.c`` runs ``a/__init__`` and
    ``a/b/__init__`` first, but a package's own modules importing their ``__init__`` is not a
    cycle Python trips on unless the ``__init__`` imports them back, which the edges show."""
    return {name: set(mod.imports) for name, mod in modules.items()}


def unexplained_typing_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Cycles that close only through ``if TYPE_CHECKING:`` imports, where a module on the cycle
    imports that way without a comment on its ``if TYPE_CHECKING:`` line saying why."""
    edges = {name: mod.imports | mod.typing_only for name, mod in modules.items()}
    return [
        cycle
        for cycle in cycles(edges)
        if any(modules[m].typing_only & set(cycle) and not modules[m].typing_says_why for m in cycle)
    ]


def package_edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for mod in modules.values():
        deps = edges.setdefault(mod.package, set())
        for target in mod.imports:
            other = modules[target].package
            # A package importing its own subpackage (or the reverse) is layering, not a cycle.
            if other != mod.package and not other.startswith(mod.package + "."):
                deps.add(other)
    return edges


def _short(name: str) -> str:
    return name.removeprefix(PACKAGE + ".") or PACKAGE


def render_map(modules: dict[str, Module]) -> str:
    """Each package, its modules with the first sentence of their docstrings, and the packages it
    imports (so the layering is visible at a glance)."""
    packages = package_edges(modules)
    lines = [MAP_BEGIN, ""]
    for package in sorted(packages):
        members = [m for m in modules.values() if m.package == package and m.path.name != "__init__.py"]
        if package.startswith(f"{PACKAGE}.gen") or not members:
            continue
        path = modules[package].path.parent.relative_to(REPO) if package in modules else package
        uses = ", ".join(
            f"`{_short(p)}`" for p in sorted(packages[package]) if not p.startswith(f"{PACKAGE}.gen")
        )
        lines.append(f"**`{_short(package)}`** (`{path}/`) uses: {uses or 'nothing of Motor'}")
        lines.append("")
        for mod in sorted(members, key=lambda m: m.name):
            first = mod.doc.split(". ")[0].rstrip(".")
            lines.append(f"- `{mod.path.stem}`: {first}" if first else f"- `{mod.path.stem}`")
        lines.append("")
    lines.append(MAP_END)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", action="store_true", help="every module and what it imports")
    parser.add_argument("--map", action="store_true", help="the module map of docs/architecture.md")
    parser.add_argument("--write", action="store_true", help="write the map into docs/architecture.md")
    args = parser.parse_args()
    modules = load()
    if args.map:
        print(render_map(modules))
        return 0
    if args.write:
        doc = ARCHITECTURE.read_text()
        begin, end = doc.index(MAP_BEGIN), doc.index(MAP_END) + len(MAP_END)
        ARCHITECTURE.write_text(doc[:begin] + render_map(modules) + doc[end:])
        return 0
    if args.modules:
        for name, mod in sorted(modules.items()):
            print(f"{_short(name)} -> {', '.join(sorted(map(_short, mod.imports))) or '-'}")
    else:
        for package, deps in sorted(package_edges(modules).items()):
            if not package.startswith(f"{PACKAGE}.gen"):
                shown = sorted(_short(d) for d in deps if not d.startswith(f"{PACKAGE}.gen"))
                print(f"{_short(package)} -> {', '.join(shown) or '-'}")
    found = cycles(module_edges(modules))
    for cycle in found:
        print(f"import cycle: {' <-> '.join(map(_short, cycle))}", file=sys.stderr)
    typing = unexplained_typing_cycles(modules)
    for cycle in typing:
        shown = " <-> ".join(map(_short, cycle))
        print(f"import cycle through TYPE_CHECKING with no comment saying why: {shown}", file=sys.stderr)
    return 1 if found or typing else 0


if __name__ == "__main__":
    sys.exit(main())
