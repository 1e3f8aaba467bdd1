"""The admission pieces in process: token buckets, the priority/fair queue, the gate's rate
limits and headers, and the tenants file's checks. What is asserted is what a client would see:
who gets a slot and in which order, which request is refused with which error and headers."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import os
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from motor_mesh.common.apikeys import hash_key
from motor_mesh.common.config import ConfigError, CoordinatorConfig, RateLimit
from motor_mesh.common.http_errors import OpenAIError
from motor_mesh.coordinator.admission.buckets import Bucket
from motor_mesh.coordinator.admission.gate import Gate, RateLimited
from motor_mesh.coordinator.admission.slots import LINGER_S, Account, Slots
from motor_mesh.coordinator.admission.tenants import PRIORITIES, Tenant, load_directory, parse_tenants
from motor_mesh.coordinator.workers.shares import DemandShares, decode, encode

# -- buckets ---------------------------------------------------------------------------------------


def test_a_bucket_spends_its_window_then_refills_at_its_rate() -> None:
    b = Bucket(60, 60.0, now=0.0)
    for _ in range(60):
        assert b.can_take(1, 0.0)
        b.take(1)
    assert not b.can_take(1, 0.0)
    assert b.wait_s(1, 0.0) == pytest.approx(1.0)
    assert b.can_take(1, 1.0)  # one a second after the burst
    b.take(1)
    assert not b.can_take(1, 1.5)
    assert b.reset_s(1.5) == 60  # 59.5 missing at one a second


def test_a_request_larger_than_the_bucket_passes_when_it_is_full_and_leaves_a_debt() -> None:
    b = Bucket(100, 10.0, now=0.0)
    assert b.can_take(250, 0.0)
    b.take(250)
    assert not b.can_take(1, 10.0)  # -150 + 100 refilled
    assert b.can_take(1, 15.1)


def test_settling_returns_unused_tokens_but_never_past_full() -> None:
    b = Bucket(1000, 60.0, now=0.0)
    b.take(600)
    b.give_back(500, 0.0)
    assert b.fill(0.0) == 900
    b.give_back(500, 0.0)
    assert b.fill(0.0) == 1000
    b.give_back(-300, 0.0)  # used more than charged
    assert b.fill(0.0) == 700


def test_resizing_keeps_the_tokens_held_up_to_the_new_size() -> None:
    b = Bucket(100, 60.0, now=0.0)
    b.take(25)
    b.resize(50, 60.0, 0.0)  # a second replica took half
    assert b.fill(0.0) == 50 and b.rate == pytest.approx(50 / 60)
    b.take(40)
    b.resize(100, 60.0, 0.0)  # and left again: no tokens appear, the refill doubles
    assert b.fill(0.0) == 10 and b.rate == pytest.approx(100 / 60)


# -- slots: priority classes and fair queueing ----------------------------------------------------


def _account(
    name: str, priority: str = "standard", weight: float = 1.0, cap: float = float("inf")
) -> Account:
    return Account(Tenant(name, weight, PRIORITIES.index(priority)), cap)


async def _queue(slots: Slots, account: Account, order: list[str], **kw: int) -> None:
    await slots.acquire(account, kw.get("prompt", 100), kw.get("max_tokens", 100))
    order.append(account.tenant.name)
    slots.release(account)  # the slot goes straight to the next in line


async def _served_order(slots: Slots, requests: list[Account], **kw: int) -> list[str]:
    """Queue ``requests`` behind a held slot (the only one), then let them through: the order
    they got the slot in."""
    holder = _account("holder")
    await slots.acquire(holder)
    order: list[str] = []
    waiting = [asyncio.create_task(_queue(slots, a, order, **kw)) for a in requests]
    await asyncio.sleep(0)
    assert slots.queued == len(requests)
    slots.release(holder)
    await asyncio.gather(*waiting)
    return order


async def test_classes_are_served_strictly_in_order() -> None:
    slots = Slots(1, 100, 30)
    batch, standard, interactive = _account("b", "batch"), _account("s"), _account("i", "interactive")
    order = await _served_order(slots, [batch, standard, batch, interactive, standard, interactive])
    assert order == ["i", "i", "s", "s", "b", "b"]


async def test_within_a_class_tenants_share_by_weight_whatever_they_send() -> None:
    slots = Slots(1, 1000, 30)
    heavy, light = _account("heavy"), _account("light", weight=2.0)
    # heavy queued 60 requests before light's 30 arrived
    order = await _served_order(slots, [heavy] * 60 + [light] * 30)
    first = Counter(order[:45])
    assert first["light"] == pytest.approx(30, abs=1)  # two for every one of heavy's
    assert first["heavy"] == pytest.approx(15, abs=1)


async def test_a_tenant_at_its_max_concurrent_waits_without_blocking_the_others() -> None:
    slots = Slots(3, 100, 30)
    capped, other = _account("capped", cap=1), _account("other")
    await slots.acquire(capped)
    second = asyncio.create_task(slots.acquire(capped))
    await asyncio.sleep(0)
    assert not second.done() and slots.queued == 1
    await asyncio.wait_for(slots.acquire(other), 1)  # a free slot, not held back by capped's waiter
    slots.release(capped)
    await asyncio.wait_for(second, 1)
    assert capped.running == 1 and other.running == 1


async def test_a_full_queue_refuses_batch_before_interactive() -> None:
    slots = Slots(1, 2, 30)
    holder = _account("holder")
    await slots.acquire(holder)
    batch = [asyncio.create_task(slots.acquire(_account(f"b{i}", "batch"))) for i in range(2)]
    await asyncio.sleep(0)
    assert slots.queued == 2
    interactive = []
    for i in (1, 0):  # each interactive arrival refuses the newest batch request still waiting
        interactive.append(asyncio.create_task(slots.acquire(_account(f"i{i}", "interactive"))))
        await asyncio.wait([batch[i]], timeout=5)
        with pytest.raises(OpenAIError) as refused:
            batch[i].result()
        assert refused.value.status == 429 and "higher priority" in refused.value.message
    with pytest.raises(OpenAIError) as full:  # nothing of a lower class left to refuse
        await slots.acquire(_account("i2", "interactive"))
    assert full.value.status == 429 and "queue is full" in full.value.message
    slots.release(holder)
    await asyncio.wait_for(interactive[0], 5)
    assert slots.active == 1 and slots.queued == 1
    interactive[1].cancel()


class Clock:
    """Virtual time for Slots: the tests move it, so credits and hold times are exact."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def _hold_for(slots: Slots, clock: Clock, seconds: float) -> None:
    """One request held ``seconds``: what the slots then take a slot's hold time to be."""
    warm = _account("warm")
    granted = await slots.acquire(warm, 100, 100)
    clock.t += seconds
    slots.release(warm, granted)
    clock.t += 2 * LINGER_S  # warm is no longer active


async def test_the_headroom_is_kept_from_a_tenant_over_its_share_for_one_within_it() -> None:
    clock = Clock()
    slots = Slots(8, 100, 30, clock)  # headroom: 2 slots
    await _hold_for(slots, clock, 10.0)
    heavy, light = _account("heavy"), _account("light")
    await slots.acquire(light, 100, 100)
    clock.t += 10.0  # light, asking for less than its share, has credit
    for _ in range(5):  # heavy asks five requests' worth at once: over its share
        await slots.acquire(heavy, 100, 100)
    backlog = [asyncio.create_task(slots.acquire(heavy, 100, 100)) for _ in range(2)]
    await asyncio.sleep(0)
    assert slots.active == 6 and slots.queued == 2  # two slots free, kept for light
    await asyncio.wait_for(slots.acquire(light, 100, 100), 1)  # at once, ahead of heavy's backlog
    assert (light.running, heavy.running, slots.queued) == (2, 5, 2)
    slots.release(light)
    await asyncio.sleep(0)
    assert slots.active == 6  # the freed slot is headroom again, not heavy's
    slots.release(light)  # three free: one past the headroom, heavy's first waiter runs
    await asyncio.wait_for(backlog[0], 1)
    assert heavy.running == 6 and not backlog[1].done()
    slots.release(heavy)
    await asyncio.wait_for(backlog[1], 1)
    assert heavy.running == 6 and slots.active == 6 and slots.queued == 0


async def test_with_nobody_within_its_share_the_headroom_is_anyones() -> None:
    clock = Clock()
    slots = Slots(8, 100, 30, clock)
    await _hold_for(slots, clock, 10.0)
    a, b = _account("a"), _account("b")
    for _ in range(4):
        await slots.acquire(a, 100, 100)
        await slots.acquire(b, 100, 100)  # both far over their share, nothing waits: all 8 run
    assert slots.active == 8 and slots.queued == 0


async def test_a_tenant_within_its_share_goes_ahead_of_one_far_over_it() -> None:
    clock = Clock()
    slots = Slots(1, 100, 30, clock)  # one slot: no headroom, only the order counts
    await _hold_for(slots, clock, 10.0)
    near, flood = _account("near"), _account("flood")
    slots.release(near, await slots.acquire(near, 100, 100))
    clock.t += 10.0  # near asks for less than its share (one slot held 10 s): credit again
    held = await slots.acquire(flood, 100, 100)
    waiting = [asyncio.create_task(slots.acquire(flood, 100, 100)) for _ in range(10)]
    await asyncio.sleep(0)
    mine = asyncio.create_task(slots.acquire(near, 100, 100))  # behind flood's ten by arrival
    await asyncio.sleep(0)
    assert slots.queued == 11
    slots.release(flood, held)
    await asyncio.wait_for(mine, 1)  # the slot went to near, whose credit is not spent
    assert near.running == 1 and flood.running == 0 and slots.queued == 10
    for task in waiting:
        task.cancel()


async def _simulate(
    slots: Slots, clock: Clock, senders: list[tuple[Account, float, float]], until: float, hold: float
) -> dict[str, list[tuple[float, float]]]:
    """Open-loop senders (account, requests per second, start) against ``slots`` in virtual
    time, each request holding its slot for ``hold`` s give or take half (seeded, so the run is
    the same every time). Returns, per tenant, (sent, waited) of every granted request."""
    rng = random.Random(7)
    events: list[tuple[float, int, str, Account, float]] = []
    seq = itertools.count()
    t0 = clock.t
    for account, rate, start in senders:
        at = t0 + start
        while (at := at + rng.expovariate(rate)) < t0 + until:
            heapq.heappush(events, (at, next(seq), "send", account, 0.0))
    granted: dict[str, list[tuple[float, float]]] = {a.tenant.name: [] for a, _, _ in senders}

    async def one(account: Account) -> None:
        sent = clock.t
        with contextlib.suppress(OpenAIError):
            got = await slots.acquire(account, 100, 100)
            granted[account.tenant.name].append((sent - t0, got - sent))
            heapq.heappush(events, (got + hold * rng.uniform(0.5, 1.5), next(seq), "end", account, got))

    tasks = []
    while events:
        at, _, what, account, since = heapq.heappop(events)
        clock.t = at
        if what == "send":
            tasks.append(asyncio.create_task(one(account)))
        else:
            slots.release(account, since)
        for _ in range(3):
            await asyncio.sleep(0)  # the granted waiters note their slot
    for task in tasks:
        task.cancel()
    return granted


async def test_a_tenant_at_its_share_waits_for_nothing_while_another_floods_at_ten_times_its_own() -> None:
    clock = Clock()
    slots = Slots(64, 64, 1e9, clock)  # a bench worker's part of 128 slots
    hold = 16.0
    share = 64 / hold / 2  # requests per second: half of what the slots serve
    flood, fair = _account("flood"), _account("fair")
    got = await _simulate(slots, clock, [(fair, share, 0.0), (flood, 10 * share, 30.0)], 300.0, hold)
    waits = sorted(w for sent, w in got["fair"] if sent >= 30.0)
    assert len(waits) > 300 and waits[int(0.99 * len(waits))] == 0.0  # as if alone
    served = sum(1 for sent, _ in got["flood"] if 60 <= sent < 270) / 210
    assert served > 0.4 * share  # and the flood has what is left (less the headroom)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 3.0)])
async def test_two_backlogged_tenants_are_served_by_their_weights(weights: tuple[float, float]) -> None:
    clock = Clock()
    slots = Slots(32, 32, 1e9, clock)
    hold = 10.0
    a, b = _account("a", weight=weights[0]), _account("b", weight=weights[1])
    both = 2 * 32 / hold  # each sends twice what the slots serve
    got = await _simulate(slots, clock, [(a, both, 0.0), (b, both, 0.0)], 400.0, hold)
    na, nb = (sum(1 for sent, w in got[t] if 50 <= sent + w < 350) for t in ("a", "b"))
    want = weights[0] / sum(weights)
    assert na / (na + nb) == pytest.approx(want, rel=0.05)


async def test_alone_a_tenant_uses_every_slot() -> None:
    slots = Slots(8, 100, 30)
    only = _account("only")
    for _ in range(8):
        await asyncio.wait_for(slots.acquire(only), 1)
    assert slots.active == 8 and slots.queued == 0


async def test_a_full_queue_refuses_the_tenant_furthest_ahead_of_its_share() -> None:
    slots = Slots(1, 3, 30)
    holder = _account("holder")
    await slots.acquire(holder)
    flood = _account("flood")
    waiting = [asyncio.create_task(slots.acquire(flood, 100, 100)) for _ in range(3)]
    await asyncio.sleep(0)
    assert slots.queued == 3
    with pytest.raises(OpenAIError) as own:  # flood's next is behind its own queue: refused
        await slots.acquire(flood, 100, 100)
    assert own.value.status == 429 and "queue is full" in own.value.message
    fair = asyncio.create_task(slots.acquire(_account("fair"), 100, 100))
    await asyncio.wait([waiting[2]], timeout=5)  # flood's newest gave way
    with pytest.raises(OpenAIError) as pushed:
        waiting[2].result()
    assert pushed.value.status == 429 and "fair share" in pushed.value.message
    slots.release(holder)
    await asyncio.wait_for(fair, 1)  # and fair goes first
    assert not waiting[0].done()
    for task in waiting[:2]:
        task.cancel()


async def test_a_wait_past_the_queue_timeout_is_503_and_gives_up_its_place() -> None:
    slots = Slots(1, 10, 0.05)
    holder = _account("holder")
    await slots.acquire(holder)
    with pytest.raises(OpenAIError) as waited:
        await slots.acquire(_account("late"))
    assert waited.value.status == 503 and waited.value.code == "queue_timeout"
    assert slots.queued == 0
    slots.release(holder)
    assert slots.active == 0


# -- the gate: rate limits, shares, headers --------------------------------------------------------


def _cfg(**rate: object) -> CoordinatorConfig:
    return replace(CoordinatorConfig(), rate_limit=RateLimit.from_json(rate))


def test_the_global_request_limit_counts_down_in_its_headers_then_refuses() -> None:
    gate = Gate(_cfg(max_requests=3, window_s=60), None, workers=1, now=0.0)
    account = gate.identify(None)
    assert account is not None
    remaining = []
    for _ in range(3):
        ticket = gate.charge(account, 10, 0.0)
        headers = dict(ticket.headers or [])
        assert headers["X-RateLimit-Limit"] == "3"
        remaining.append(headers["X-RateLimit-Remaining"])
    assert remaining == ["2", "1", "0"]
    with pytest.raises(RateLimited) as refused:
        gate.charge(account, 10, 0.0)
    err = refused.value
    assert err.status == 429 and err.code == "rate_limit_exceeded" and err.type == "requests"
    assert err.limit == "rate_limit.max_requests"
    assert err.headers is not None and err.headers["Retry-After"] == "20"  # one every 20 s
    assert err.headers["X-RateLimit-Remaining"] == "0"


def test_a_refused_request_takes_nothing_from_the_other_buckets() -> None:
    gate = Gate(_cfg(max_requests=100, max_tokens_per_window=1000), None, workers=1, now=0.0)
    account = gate.identify(None)
    assert account is not None
    gate.charge(account, 900, 0.0)
    with pytest.raises(RateLimited) as refused:
        gate.charge(account, 200, 0.0)
    assert refused.value.limit == "rate_limit.max_tokens_per_window" and refused.value.type == "tokens"
    ticket = gate.charge(account, 100, 0.0)  # the refused one took no request either
    assert dict(ticket.headers or [])["X-RateLimit-Remaining"] == "98"


def test_every_limit_is_split_over_replicas_and_workers() -> None:
    gate = Gate(_cfg(max_requests=120), None, workers=2, now=0.0)
    account = gate.identify(None)
    assert account is not None
    assert dict(gate.charge(account, 1, 0.0).headers or [])["X-RateLimit-Limit"] == "60"
    gate.set_replicas(3, 0.0)
    assert dict(gate.charge(account, 1, 0.0).headers or [])["X-RateLimit-Limit"] == "20"


def test_settling_corrects_the_token_charge_by_the_real_usage() -> None:
    gate = Gate(_cfg(max_tokens_per_window=1000), None, workers=1, now=0.0)
    account = gate.identify(None)
    assert account is not None
    ticket = gate.charge(account, 800, 0.0)  # prompt + max_tokens
    gate.settle(ticket, 50, 0.0)  # it stopped early
    gate.charge(account, 900, 0.0)  # 950 were left
    with pytest.raises(RateLimited):
        gate.charge(account, 100, 0.0)


def _tenants_file(tmp_path: Path, tenants: list[dict[str, object]]) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(tenants))
    os.chmod(path, 0o600)
    return str(path)


def test_tenant_limits_apply_to_their_keys_only(tmp_path: Path) -> None:
    path = _tenants_file(
        tmp_path,
        [
            {"name": "a", "keys": [hash_key("key-a")], "requests_per_minute": 2},
            {"name": "b", "keys": ["key-b"], "priority": "batch", "weight": 3},
        ],
    )
    gate = Gate(replace(CoordinatorConfig(), tenants_file=path), load_directory(path, ""), workers=1, now=0.0)
    a, b = gate.identify(b"Bearer key-a"), gate.identify(b"Bearer key-b")
    assert a is not None and b is not None
    assert (a.tenant.name, b.tenant.name, b.tenant.priority, b.tenant.weight) == ("a", "b", 2, 3.0)
    gate.charge(a, 1, 0.0)
    gate.charge(a, 1, 0.0)
    with pytest.raises(RateLimited) as refused:
        gate.charge(a, 1, 0.0)
    assert refused.value.limit == "requests_per_minute"
    for _ in range(10):
        assert gate.charge(b, 1, 0.0).headers is None  # no limit, no counters
    for header in (None, b"Bearer key-c", b"Bearer key-", b"Basic key-a", b"Bearer "):
        with pytest.raises(OpenAIError) as denied:
            gate.identify(header)
        assert denied.value.status == 401


def test_the_api_keys_file_is_the_default_tenant(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# clients\nk1\nsha256:" + hash_key("k2").split(":")[1] + "\n")
    os.chmod(keys, 0o600)
    directory = load_directory("", str(keys))
    assert directory is not None
    for key in (b"k1", b"k2"):
        tenant = directory.find(key)
        assert tenant is not None and tenant.name == "default"
    assert directory.find(b"k3") is None


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ({"name": "a"}, "expected a JSON list"),
        ([{"name": "a", "keys": []}], "[0].keys: expected a non-empty list"),
        ([{"name": "a", "keys": ["k"], "wieght": 2}], "unknown field 'wieght' (did you mean 'weight'?)"),
        ([{"name": "a", "keys": ["k"], "priority": "urgent"}], "[0].priority: expected one of"),
        ([{"name": "a", "keys": ["k"], "weight": 0}], "[0].weight"),
        ([{"name": "a", "keys": ["k"], "requests_per_minute": 0}], "[0].requests_per_minute"),
        ([{"name": "a", "keys": ["k"]}, {"name": "a", "keys": ["j"]}], "[1].name: 'a' is already taken"),
        ([{"name": "default", "keys": ["k"]}], "'default' is already taken"),
    ],
)
def test_a_bad_tenants_file_names_the_entry_and_field(tenants: object, message: str) -> None:
    with pytest.raises(ValueError, match=None) as bad:
        parse_tenants(tenants)
    assert message in str(bad.value)


def test_file_errors_never_show_a_key(tmp_path: Path) -> None:
    secret = "sk-very-secret-key"
    path = _tenants_file(tmp_path, [{"name": "a", "keys": [secret]}, {"name": "b", "keys": [secret]}])
    with pytest.raises(ConfigError) as bad:
        load_directory(path, "")
    assert "coordinator.tenants_file" in str(bad.value) and secret not in str(bad.value)
    open_file = tmp_path / "open.json"
    open_file.write_text("[]")
    os.chmod(open_file, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_directory(str(open_file), "")


# -- parts of the buckets between inference workers ----------------------------------------------


def test_parts_follow_the_demand_and_add_up_to_the_whole() -> None:
    shares = DemandShares()
    shares.add(0, {"r:a": 100.0, "r": 50.0})
    shares.add(1, {"r": 50.0})
    parts = shares.round([0, 1])
    assert sum(parts["r:a"].values()) == pytest.approx(1.0)
    assert parts["r:a"][0] > 0.95 and parts["r:a"][1] > 0  # the floor: 1 can serve a newcomer
    assert parts["r"] == {0: pytest.approx(0.5), 1: pytest.approx(0.5)}
    assert shares.round([0, 1]) == {}  # nothing moved enough to send again
    for _ in range(20):  # nobody asks any more: even again, said once
        last = shares.round([0, 1])
        if last:
            assert last == {"r:a": {}, "r": {}}
            break
    else:
        raise AssertionError("the parts never went back to even")
    wire = decode(encode(parts))
    assert wire["r:a"][0] == pytest.approx(parts["r:a"][0], abs=1e-4)


def test_a_tenants_share_of_a_workers_slots_follows_where_its_requests_go() -> None:
    """A client whose keep-alive connections happen to be on one worker sends most of its
    requests there: its share of that worker's slots grows to match (Slots, "within share")."""
    gate = Gate(CoordinatorConfig(), None, workers=2, now=0.0)
    account = gate.identify(None)
    assert account is not None
    for _ in range(3):
        gate.asks_for_a_slot(account)
    assert gate.take_demand() == {"s:-": 3.0}  # reported to the management process
    gate.set_parts({"s:-": {0: 0.75, 1: 0.25}}, index=0, now=0.0)
    assert account.spread == 1.5  # three quarters here: 1.5 times an even share
    gate.set_parts({"s:-": {}}, index=0, now=0.0)  # no demand lately: even again
    assert account.spread == 1.0
    single = Gate(CoordinatorConfig(), None, workers=1, now=0.0)
    one = single.identify(None)
    assert one is not None
    single.asks_for_a_slot(one)
    assert single.take_demand() == {}  # one worker: nothing to split


def test_a_worker_takes_its_part_of_each_bucket() -> None:
    gate = Gate(_cfg(max_requests=120), None, workers=2, now=0.0)
    account = gate.identify(None)
    assert account is not None
    assert dict(gate.charge(account, 1, 0.0).headers or [])["X-RateLimit-Limit"] == "60"
    assert gate.take_demand() == {"r": 1.0}
    gate.set_parts({"r": {0: 0.9, 1: 0.1}}, index=0, now=0.0)
    assert dict(gate.charge(account, 1, 0.0).headers or [])["X-RateLimit-Limit"] == "108"
    gate.set_parts({"r": {}}, index=0, now=0.0)  # even again
    assert dict(gate.charge(account, 1, 0.0).headers or [])["X-RateLimit-Limit"] == "60"
