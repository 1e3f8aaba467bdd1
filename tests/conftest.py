"""Fixtures for every test. The shared helpers, one of each, are modules beside this one:

- tests/procs.py: ``Proc`` (any real process: its own process group, output read line by line,
  ``wait_line`` / ``await_line``, ``listening``, ``stop``, ``kill``), ``SimEngine``,
  ``motor_argv``, and the /proc readers (``child_pids``, ``pids_with``, ``exited``,
  ``group_alive``, ``group_gone``);
- tests/poll.py: ``until`` (async) and ``wait_until`` (sync), the one way to wait for something;
- tests/ports.py: ports for what cannot bind port 0 (``reserved_port``, ``reserved_pair``,
  ``reserve`` for ``motor up``'s offset) and ``port_free``;
- tests/http/__init__.py: HTTP requests and the error body shapes (tests/http/ is also the
  conformance suite of our HTTP server and client).

Tiers: every test is marked by the folder it is in (``tier_of``): ``chaos``, ``e2e``, ``fuzz``,
``deploy`` and ``real`` are folders of those names (a component's tests that start Motor's own
processes or etcd are in its ``e2e/`` subfolder, those that kill or hang its engines in its
``chaos/``, beside the fixtures they share), and everything else is ``unit`` (in process,
simulated engines at most: ``make test-fast`` runs it).

Order: the xdist workers take whole files (``--dist loadfile``), longest first, by the seconds
each took in a recorded run (tests/durations.json; ``make test-durations`` records it anew; a
file not in it counts as ``NEW_FILE_S`` of its tier), so no worker is left running one long
chaos or e2e file while the others idle at the end. ``--no-loadscope-reorder`` keeps xdist from
reordering them by their number of tests.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import zmq.asyncio
from prometheus_client import values

from motor_mesh.coordinator.metrics import MULTIPROC_ENV
from tests.procs import ROOT, Proc, motor_argv

TIERS = ("chaos", "e2e", "fuzz", "deploy", "real")
DURATIONS = ROOT / "tests" / "durations.json"
# What a file not yet in tests/durations.json is taken to cost, by tier: enough to go out early.
NEW_FILE_S = {"chaos": 40.0, "e2e": 30.0, "deploy": 30.0, "real": 60.0, "fuzz": 10.0, "unit": 5.0}


def tier_of(path: Path) -> str:
    """The tier of a test file: the first folder on its path named after one, or unit
    (tests/e2e/test_up.py and tests/controller/e2e/test_pusher.py are both e2e)."""
    folders = path.relative_to(ROOT / "tests").parts[:-1]
    return next((f for f in folders if f in TIERS), "unit")


def pytest_configure(config: pytest.Config) -> None:
    """A shell without job control starts a background job (``make test &`` in a script) with
    SIGINT and SIGQUIT ignored, and every process it starts inherits that: the CLIs the tests
    stop with SIGINT, as a user's Ctrl-C, would never stop. Handled here, they are default in
    every child again (each xdist worker runs this too)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write the seconds each test file took to tests/durations.json (make test-durations)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        costs: dict[str, float] = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        costs = {}
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item.path)))

    def cost(item: pytest.Item) -> float:
        return costs.get(item.nodeid.split("::")[0], NEW_FILE_S[tier_of(item.path)])

    # Stable: a file's tests stay together and in order (every worker collects the same order).
    items.sort(key=cost, reverse=True)


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    file = report.nodeid.split("::")[0]
    _SECONDS[file] = _SECONDS.get(file, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With --record-durations, the controller (not an xdist worker) merges what ran into
    tests/durations.json (a partial run updates the files it ran)."""
    if not session.config.getoption("--record-durations") or hasattr(session.config, "workerinput"):
        return
    try:
        recorded = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        recorded = {}
    recorded.update({f: round(s, 1) for f, s in _SECONDS.items()})
    kept = {f: s for f, s in sorted(recorded.items()) if (ROOT / f).exists()}  # moved or deleted: gone
    DURATIONS.write_text(json.dumps(kept, indent=1) + "\n")


@pytest.fixture
def motor_proc(tmp_path: Path) -> Iterator:
    """Start ``motor ARGS`` in a fresh directory; every process is killed at teardown."""
    started: list[Proc] = []

    def start(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Proc:
        p = Proc(motor_argv(*args), cwd=cwd or tmp_path, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A ZeroMQ context for a test's own sockets (KV event subscriptions), destroyed after it."""
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture(autouse=True)
def _metric_values_restored() -> Iterator[None]:
    """A Coordinator with inference workers started in process points prometheus_client's values
    at its shared files for the rest of the process (metrics.use_shared_dir): a later test's
    metrics would share those files' entries (two registries' "h" one value). Put it back."""
    value_class = values.ValueClass
    shared = os.environ.get(MULTIPROC_ENV)
    yield
    values.ValueClass = value_class
    if shared is None:
        os.environ.pop(MULTIPROC_ENV, None)
    else:
        os.environ[MULTIPROC_ENV] = shared


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """A test that configures logging in process (``log.setup``) leaves the root logger as it
    found it: its handler writes to that test's captured stderr, which pytest closes after it,
    and a later test's thread logging there (httpx, under the chaos harness) printed
    "--- Logging error ---" in the middle of the run."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
