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
simulated engines at most: ``make test-fast`` runs it). The workers take files longest tier first (``TIER_ORDER``),
so none of them is left running one long chaos or e2e file while the other idles at the end.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import zmq.asyncio

from tests.procs import ROOT, Proc, motor_argv

TIERS = ("chaos", "e2e", "fuzz", "deploy", "real")
# The order files are handed to the xdist workers in: the longest tiers first.
TIER_ORDER = ("chaos", "e2e", "deploy", "fuzz", "real", "unit")


def tier_of(path: Path) -> str:
    """The tier of a test file: the first folder on its path named after one, or unit
    (tests/e2e/test_up.py and tests/controller/e2e/test_pusher.py are both e2e)."""
    folders = path.relative_to(ROOT / "tests").parts[:-1]
    return next((f for f in folders if f in TIERS), "unit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item.path)))
    # Stable: within a tier, files and tests keep their order (each worker collects the same).
    items.sort(key=lambda item: TIER_ORDER.index(tier_of(item.path)))


def pytest_configure(config: pytest.Config) -> None:
    """A shell without job control starts a background job (``make test &`` in a script) with
    SIGINT and SIGQUIT ignored, and every process it starts inherits that: the CLIs the tests
    stop with SIGINT, as a user's Ctrl-C, would never stop. Handled here, they are default in
    every child again (each xdist worker runs this too)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


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
