"""``dns:///name:port`` Coordinators: every address the name resolves to is pushed to, and the set
follows the name (a Kubernetes headless Service over a scaled Coordinator Deployment)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from motor_mesh.common import dns
from motor_mesh.common.config import ConfigError, load
from motor_mesh.controller.alarms.sources import COORDINATOR_FAULT
from motor_mesh.controller.push import coordinator_set
from motor_mesh.controller.push.coordinator_set import CoordinatorSet, resolve
from tests.controller.fakes import FakeCoordinator, running_controller
from tests.poll import until


class Names:
    """A resolver the test answers: name -> addresses, or an OSError to raise."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str] | OSError] = {}
        self.asked = 0

    async def __call__(self, name: str, port: int) -> list[str]:
        self.asked += 1
        answer = self.answers.get(name, [])
        if isinstance(answer, OSError):
            raise answer
        return sorted(answer)


async def test_names_expand_and_a_failed_lookup_keeps_the_last_answer() -> None:
    names, told = Names(), []
    cs = CoordinatorSet(["10.0.0.9:7200", "dns:///peers:7200"], told.append, resolver=names)
    assert cs.current == ["10.0.0.9:7200"]  # before the first lookup: the plain entries
    names.answers["peers"] = ["10.0.0.1:7200", "10.0.0.2:7200"]
    assert await cs.refresh() == ["10.0.0.1:7200", "10.0.0.2:7200", "10.0.0.9:7200"]
    names.answers["peers"] = OSError("resolver down")
    assert await cs.refresh() == ["10.0.0.1:7200", "10.0.0.2:7200", "10.0.0.9:7200"]
    names.answers["peers"] = []  # the name is gone: no pod behind the Service
    assert await cs.refresh() == ["10.0.0.9:7200"]
    assert await cs.refresh() == ["10.0.0.9:7200"]
    assert told == [["10.0.0.1:7200", "10.0.0.2:7200", "10.0.0.9:7200"], ["10.0.0.9:7200"]]


async def test_a_real_name_resolves_to_its_addresses() -> None:
    found = await resolve("localhost", 7200)
    assert "127.0.0.1:7200" in found
    assert all(a.endswith(":7200") for a in found)
    if socket.has_ipv6:
        assert dns.join("::1", 7200) == "[::1]:7200"


def test_the_config_takes_dns_entries_and_refuses_bad_ones() -> None:
    cfg = load(None, env={}, overrides={"controller": {"coordinators": ["dns:///peers.motor.svc:7200"]}})
    assert cfg.controller.coordinators == ("dns:///peers.motor.svc:7200",)
    with pytest.raises(ConfigError) as err:
        load(None, env={}, overrides={"controller": {"coordinators": ["dns:///peers"]}})
    assert "controller.coordinators[0]" in err.value.errors[0]


async def test_the_controller_follows_the_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = Names()
    monkeypatch.setattr(coordinator_set, "resolve", names)
    monkeypatch.setattr(coordinator_set, "RESOLVE_S", 0.05)
    one, two = await FakeCoordinator().start(), await FakeCoordinator().start()
    names.answers["peers"] = [one.address]
    try:
        async with running_controller(
            tmp_path, coordinators=["dns:///peers:7200"], coordinator_alarm_after_s=0.2
        ) as h:
            await until(lambda: one.count("Set", ok=True) >= 1)
            assert two.count("Set") == 0
            names.answers["peers"] = [one.address, two.address]  # scaled up
            await until(lambda: two.count("Set", ok=True) >= 1)
            names.answers["peers"] = [two.address]  # scaled down: `one` leaves, then stops
            await until(lambda: one.address not in h.controller.coordinators.pushers)
            await one.stop()
            # `two` going away raises its alarm; `one`, no longer in the set, never gets one.
            await two.stop()
            [raised] = await until(lambda: h.controller.alarms.active(COORDINATOR_FAULT), timeout=20)
            assert raised.moi.endswith(f"service ip={two.address}")
    finally:
        await one.stop()
        await two.stop()
