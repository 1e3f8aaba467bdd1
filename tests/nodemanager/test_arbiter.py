"""Freeze and suicide arbitration, step by step."""

from __future__ import annotations

from dataclasses import dataclass, field

from motor_mesh.common.enums import EP_ABNORMAL, EP_NORMAL, EP_WAIT
from motor_mesh.nodemanager.arbiter import Freeze, SuicideArbiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeSpec:
    id: int = 0


@dataclass
class FakeEngine:
    status: int = EP_NORMAL
    alive: bool = True
    stopping: bool = False
    starting: bool = False
    spec: FakeSpec = field(default_factory=FakeSpec)

    def in_startup_window(self) -> bool:
        return self.starting


class FakeNode:
    def __init__(self, *engines: FakeEngine) -> None:
        self.engines = list(engines)
        self.generation = 1
        self.freeze = Freeze(Clock())
        self.relaunching = False

    def current_engines(self) -> list[FakeEngine]:
        return self.engines


def test_freeze_never_shortens_and_expires_by_itself() -> None:
    clock = Clock()
    f = Freeze(clock)
    assert not f.frozen and f.until is None
    f.freeze(100)
    f.freeze(10)  # shorter: ignored
    assert f.until == 1100
    clock.now += 99
    assert f.frozen
    clock.now += 1
    assert not f.frozen and f.until is None
    f.freeze(5)
    f.unfreeze()
    assert not f.frozen


def test_suicide_after_threshold_consecutive_bad_checks() -> None:
    engine = FakeEngine()
    node = FakeNode(engine)
    calls: list[str] = []
    arb = SuicideArbiter(node, 1, 3, calls.append)  # type: ignore[arg-type]
    assert not arb.step()
    engine.status = EP_ABNORMAL
    assert [arb.step(), arb.step()] == [False, False]
    engine.status = EP_NORMAL  # recovered: the count resets
    assert not arb.step() and arb.count == 0
    engine.status = EP_ABNORMAL
    assert [arb.step(), arb.step(), arb.step()] == [False, False, True]


def test_count_resets_on_freeze_generation_and_startup_window() -> None:
    engine = FakeEngine(status=EP_ABNORMAL)
    node = FakeNode(engine)
    arb = SuicideArbiter(node, 1, 2, lambda _: None)  # type: ignore[arg-type]
    assert not arb.step()
    node.freeze.freeze(60)
    assert not arb.step() and arb.count == 0
    node.freeze.unfreeze()
    assert not arb.step()
    node.generation += 1  # a new endpoint set
    assert not arb.step() and arb.count == 0
    engine.status, engine.starting = EP_WAIT, True
    loading = FakeEngine(status=EP_ABNORMAL, starting=True)
    node.engines = [loading]
    assert not arb.step() and not arb.step()
    # ...but a dead process counts even while another endpoint is still loading
    node.engines = [loading, FakeEngine(status=EP_ABNORMAL, alive=False)]
    assert [arb.step(), arb.step()] == [False, True]


def test_no_engines_or_relaunching_never_counts() -> None:
    node = FakeNode()
    arb = SuicideArbiter(node, 1, 1, lambda _: None)  # type: ignore[arg-type]
    assert not arb.step()
    node.engines = [FakeEngine(status=EP_ABNORMAL)]
    node.relaunching = True
    assert not arb.step()
