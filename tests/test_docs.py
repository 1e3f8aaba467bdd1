"""The generated API reference is fresh, and the docs stand alone (no pointers outside the repo)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from motor_mesh.common.config import DEFAULTS, reference
from motor_mesh.common.config.sections import SECTION_TYPES, docs
from tests.procs import ROOT

# Design notes that live outside the repository: a reader who cloned only the repository cannot
# follow a pointer to them. Spelled in pieces so a repository-wide search does not flag this file.
OUTSIDE_REFERENCES = "|".join(["shared" + "/design", r"behaviour\.md", r"contracts\.md"])
# The whole repository: docs, code comments, tests and benchmarks alike.
DOC_PATHS = ["."]


def test_configuration_reference_is_fresh() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == reference.render(), "docs/configuration.md is stale: run `make docs`"


def test_configuration_reference_lists_every_key_with_its_meaning() -> None:
    text = reference.render()
    for section, cls in SECTION_TYPES.items():
        meanings = docs(cls)
        for name in DEFAULTS[section]:
            assert f"| `{name}` |" in text, f"{section}.{name} missing"
            assert meanings.get(name), f"{section}.{name} has no documentation"


def test_api_reference_is_fresh() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "apidoc.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"docs/api.md is stale: run `make docs`\n{done.stdout}{done.stderr}"


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
def test_docs_do_not_point_outside_the_repository() -> None:
    # --untracked: new files count before they are committed.
    done = subprocess.run(
        ["git", "grep", "--untracked", "-nE", OUTSIDE_REFERENCES, "--", *DOC_PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode in (0, 1), f"git grep failed: {done.stderr}"
    assert done.returncode == 1, f"references to files outside the repository:\n{done.stdout}"
