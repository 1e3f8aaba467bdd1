"""The simulated-engine fixtures: engines in real processes (``tests.procs.SimEngine``) on
ports they bind themselves, killed by process group at teardown so nothing outlives a test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.procs import SimEngine


def metric(text: str, name: str, **labels: str) -> float:
    """One sample from Prometheus text, matched by name and the given labels."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} {labels}")


@pytest.fixture
def spawn_engine() -> Iterator[Callable[..., SimEngine]]:
    """`spawn_engine(*flags, wait=True)` starts an engine on an ephemeral port."""
    started: list[SimEngine] = []

    def spawn(*flags: str, wait: bool = True, port: bool = True) -> SimEngine:
        args = list(flags) + (["--port", "0"] if port and "--port" not in flags else [])
        eng = SimEngine(*args)
        started.append(eng)
        return eng.start() if wait else eng

    yield spawn
    for eng in started:
        eng.kill()


@pytest.fixture(scope="module")
def shared_engine() -> Iterator[SimEngine]:
    """One default engine for a whole module, for tests that leave no state behind."""
    eng = SimEngine("--port", "0").start()
    yield eng
    eng.kill()
