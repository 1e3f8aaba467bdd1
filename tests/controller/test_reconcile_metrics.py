"""The reconcile loops on the Controller's ``/metrics``: queue depth, adds, retries, failed
reconciles by kind, the duration histogram and the oldest reconcile in flight, per loop (label
``name``), as the Controller's collector renders them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from motor_mesh.common.retry import Backoff
from motor_mesh.controller import metrics
from motor_mesh.controller.reconcile.runner import Reconciler, Result, Retry, Terminal
from tests.controller.fakes import running_controller
from tests.metrics import Scrape
from tests.poll import until
from tests.ports import reserved_port

FAST = Backoff(0.01, 0.04, jitter=0)
W = "motor_controller_workqueue_"


class Loops(Collector):
    def __init__(self, *loops: Reconciler[str]) -> None:
        self._loops = loops

    def collect(self) -> list[Metric]:
        return list(metrics.workqueue_metrics(self._loops))


def loop_value(m: Scrape, metric: str, loop: str, **labels: str) -> float:
    """``Scrape.value`` for the loop labelled ``name=loop`` (``name`` is its own parameter)."""
    want = {"name": loop, **labels}.items()
    found = [s.value for s in m.samples if s.name == metric and want <= s.labels.items()]
    assert len(found) == 1, f"{len(found)} samples {metric} name={loop} {labels}"
    return float(found[0])


def rendered(*loops: Reconciler[str]) -> Scrape:
    """The ``/metrics`` text the Controller's collector makes of ``loops``."""
    r = CollectorRegistry()
    r.register(Loops(*loops))
    return Scrape(generate_latest(r).decode())


class Demo:
    """A reconcile per key: "flaky" fails with Retry once, "buggy" raises once, "doomed" is
    Terminal, "slow" waits for ``gate``; everything else succeeds."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calls: list[str] = []

    async def __call__(self, key: str) -> Result | None:
        self.calls.append(key)
        first = self.calls.count(key) == 1
        if key == "flaky" and first:
            raise Retry("peer unreachable")
        if key == "buggy" and first:
            raise ValueError("a bug")
        if key == "doomed":
            raise Terminal("cannot ever work")
        if key == "slow":
            await self.gate.wait()
        return None


@pytest.fixture
async def demo() -> AsyncIterator[tuple[Demo, Reconciler[str]]]:
    d = Demo()
    loop: Reconciler[str] = Reconciler("demo", d, workers=1, backoff=FAST)
    yield d, loop
    d.gate.set()
    await loop.stop()


async def test_a_fresh_loop_exports_every_family_at_zero(demo) -> None:
    _, loop = demo
    m = rendered(loop)
    for family in ("depth", "adds_total", "retries_total", "longest_running_reconcile_seconds"):
        assert loop_value(m, W + family, "demo") == 0, family
    for kind in ("retry", "exception", "terminal"):
        assert loop_value(m, W + "reconcile_errors_total", "demo", kind=kind) == 0
    assert loop_value(m, W + "reconcile_duration_seconds_count", "demo") == 0
    assert loop_value(m, W + "reconcile_duration_seconds_bucket", "demo", le="0.001") == 0
    assert loop_value(m, W + "reconcile_duration_seconds_bucket", "demo", le="60.0") == 0


async def test_failures_retries_depth_durations_and_the_oldest_in_flight(demo) -> None:
    d, loop = demo
    loop.start()
    for key in ("flaky", "buggy", "doomed", "ok"):
        loop.enqueue(key)
    # flaky and buggy twice (failed, then retried after their backoff), doomed and ok once.
    await until(lambda: loop_value(rendered(loop), W + "reconcile_duration_seconds_count", "demo") == 6)
    m = rendered(loop)
    assert loop_value(m, W + "adds_total", "demo") == 6
    assert loop_value(m, W + "retries_total", "demo") == 2
    assert loop_value(m, W + "reconcile_errors_total", "demo", kind="retry") == 1
    assert loop_value(m, W + "reconcile_errors_total", "demo", kind="exception") == 1
    assert loop_value(m, W + "reconcile_errors_total", "demo", kind="terminal") == 1
    assert loop_value(m, W + "depth", "demo") == 0
    assert loop_value(m, W + "longest_running_reconcile_seconds", "demo") == 0
    assert loop_value(m, W + "reconcile_duration_seconds_bucket", "demo", le="+Inf") == 6

    # The one worker is held by "slow": keys queued meanwhile wait, and the gauge grows.
    loop.enqueue("slow")
    await until(lambda: d.calls[-1] == "slow")
    loop.enqueue("x")
    loop.enqueue("y")
    loop.enqueue("x")  # already waiting: neither queued nor counted again

    def held_for_a_while() -> Scrape | None:
        m = rendered(loop)
        return m if loop_value(m, W + "longest_running_reconcile_seconds", "demo") > 0.01 else None

    m = await until(held_for_a_while, what="slow in flight for over 0.01 s")
    assert loop_value(m, W + "depth", "demo") == 2
    assert loop_value(m, W + "adds_total", "demo") == 9

    d.gate.set()
    await until(lambda: loop_value(rendered(loop), W + "reconcile_duration_seconds_count", "demo") == 9)
    m = rendered(loop)
    assert loop_value(m, W + "depth", "demo") == 0
    assert loop_value(m, W + "longest_running_reconcile_seconds", "demo") == 0
    # "slow" ran for longer than the 0.01 s the gauge showed: it is past the 0.01 bucket.
    over = loop_value(m, W + "reconcile_duration_seconds_count", "demo") - loop_value(
        m, W + "reconcile_duration_seconds_bucket", "demo", le="0.01"
    )
    assert over >= 1
    assert loop_value(m, W + "reconcile_duration_seconds_sum", "demo") > 0.01


async def test_the_controller_exports_its_three_loops(tmp_path: Path) -> None:
    gone = f"127.0.0.1:{reserved_port()}"  # a Coordinator nobody serves: its pushes fail
    async with running_controller(tmp_path, coordinators=[gone]) as h:
        registry = metrics.registry(h.controller)

        def push_failed() -> Scrape | None:
            m = Scrape(generate_latest(registry).decode())
            failed = loop_value(m, W + "reconcile_errors_total", "coordinator", kind="retry")
            return m if failed >= 1 else None

        m = await until(push_failed, what="a failed push counted")
        assert loop_value(m, W + "retries_total", "coordinator") >= 1
        assert loop_value(m, W + "adds_total", "coordinator") >= 1
        for name in ("assembly", "instance"):
            assert loop_value(m, W + "depth", name) == 0
            assert loop_value(m, W + "reconcile_errors_total", name, kind="exception") == 0
            assert loop_value(m, W + "reconcile_duration_seconds_count", name) == 0
