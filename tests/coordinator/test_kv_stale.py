"""Never stale (``coordinator.kv_events_stale_s``): an engine whose KV events go silent while it
serves, its replay socket not answering either, has its blocks dropped from the index until its
events flow again; an idle engine, or one whose replay answers, keeps them.

A KvFeed follows publishers on loopback speaking vLLM's protocol (tests/coordinator/
test_kv_subscriber.py's: numbered batches on an XPUB, a replay buffer behind a ROUTER that can be
told not to answer), one instance per publisher in its routing view."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import zmq
import zmq.asyncio

from motor_mesh.common.config import load
from motor_mesh.common.enums import PREFILL
from motor_mesh.coordinator.kv.feed import KvFeed
from motor_mesh.coordinator.kv.hashing import chain
from motor_mesh.coordinator.kv.subscriber import Subscription
from motor_mesh.coordinator.metrics import Metrics, use_own_process
from motor_mesh.coordinator.routes import DownCount, RoutingView, Target
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.coordinator.conftest import MODEL
from tests.coordinator.test_kv_subscriber import BS, Publisher
from tests.poll import until

pytestmark = pytest.mark.timeout(60)

STALE_S = 0.3
WAIT_S = 10.0


def block(seq: int) -> int:
    """Our hash of the one block the publisher's batch ``seq`` stores (tokens ``[seq] * BS``)."""
    return chain([seq] * BS, BS)[0]


@dataclass
class Fed:
    """A feed following ``pubs``: engine ``i`` is instance ``i + 1``, endpoint ``keys[i]``."""

    feed: KvFeed
    metrics: Metrics
    view: RoutingView
    pubs: list[Publisher]
    keys: list[str]

    def target(self, i: int) -> Target:
        return self.view.targets[i]

    def events(self, i: int) -> Subscription[str]:
        return self.feed._subs[self.keys[i]].events

    def credited(self, i: int, *seqs: int) -> bool:
        """Whether the index credits engine ``i`` with the blocks of batches ``seqs``."""
        return all(self.feed.index.match([block(s)]).get(self.keys[i]) == 1 for s in seqs)

    def uncredited(self, i: int, *seqs: int) -> bool:
        return all(self.keys[i] not in self.feed.index.match([block(s)]) for s in seqs)

    def stale(self) -> float | None:
        return self.metrics.registry.get_sample_value("motor_coordinator_kv_events_stale_endpoints")

    def resets(self, reason: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "motor_coordinator_kv_index_resets_total", {"reason": reason}
        )


def view_of(pubs: list[Publisher], replay: bool) -> RoutingView:
    downs = DownCount()
    targets = []
    for i, pub in enumerate(pubs):
        ep = c.Endpoint(
            host="127.0.0.1",
            port=20000 + i,  # nothing listens there: only the events are followed
            pid=4000 + i,
            kv_events_port=pub.port,
            kv_events_replay_port=pub.replay_port if replay else 0,
        )
        inst = c.Instance(
            id=i + 1,
            role=PREFILL,
            job_name=f"p{i}",
            model_name=MODEL,
            engine_type=c.ENGINE_TYPE_SIM,
            endpoints=[ep],
        )
        targets.append(Target(inst, downs))
    return RoutingView(revision=1, targets=tuple(targets))


def feed_of(view: RoutingView, stale_s: float = STALE_S) -> tuple[KvFeed, Metrics]:
    use_own_process()
    cfg = load(None, env={}, overrides={"coordinator": {"kv_events_stale_s": stale_s}}).coordinator
    metrics = Metrics()
    return KvFeed(cfg, lambda: view, metrics.kv, {PREFILL}), metrics


@contextlib.asynccontextmanager
async def fed(ctx: zmq.asyncio.Context, engines: int, *, replay: bool = True) -> AsyncIterator[Fed]:
    """Publishers and a feed following them, each engine's first two batches credited."""
    pubs = [await Publisher(ctx).start() for _ in range(engines)]
    view = view_of(pubs, replay)
    feed, metrics = feed_of(view)
    f = Fed(feed, metrics, view, pubs, [t.endpoints[0].base for t in view.targets])
    await feed.start()
    try:
        await until(lambda: all(p.subscriptions for p in pubs), WAIT_S, "the subscriptions")
        for pub in pubs:
            await pub.publish()
            await pub.publish()
        await until(lambda: all(f.credited(i, 0, 1) for i in range(engines)), WAIT_S, "batches 0, 1")
        assert f.stale() == 0
        yield f
    finally:
        await feed.stop()
        for pub in pubs:
            await pub.close()


def logged(caplog: pytest.LogCaptureFixture, event: str) -> list[str]:
    """The endpoints named by the ``event`` lines logged so far."""
    return [r.fields["endpoint"] for r in caplog.records if getattr(r, "event", None) == event]


async def test_an_engine_serving_in_silence_goes_stale_and_rejoins_when_its_events_flow(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="motor")
    async with fed(ctx, 1) as f:
        pub, key = f.pubs[0], f.keys[0]
        # The publisher wedges: nothing is published, replay requests go unanswered; requests
        # keep reaching the engine (a prefill leg in flight, as the router counts it).
        pub.answer = False
        f.target(0).legs = 1
        await until(lambda: f.stale() == 1, WAIT_S, "the engine found stale")
        assert f.uncredited(0, 0, 1)  # its blocks are unknown: it is weighed by load alone
        assert f.resets("stale") == 1
        [record] = [r for r in caplog.records if getattr(r, "event", None) == "kv_events_stale"]
        assert record.levelno == logging.WARNING and record.fields["endpoint"] == key
        assert record.fields["silent_s"] >= STALE_S and record.fields["replay"] == "unanswered"
        assert record.fields["served"] is True

        # Still silent: still probed, still stale, logged once.
        unanswered = f.events(0).unanswered
        await until(lambda: f.events(0).unanswered >= unanswered + 2, WAIT_S, "two more probes unanswered")
        assert f.stale() == 1 and logged(caplog, "kv_events_stale") == [key]
        assert logged(caplog, "kv_events_resumed") == []

        # The publisher comes back: its new batch arrives, and the catch-up (the gap's, or a
        # probe's) asks for the engine's buffer from its first batch.
        pub.answer = True
        await pub.release()  # the probes' late answers, to sockets closed since
        await pub.publish()
        await until(lambda: f.credited(0, 0, 1, 2), WAIT_S, "every batch credited again")
        assert f.stale() == 0 and logged(caplog, "kv_events_resumed") == [key]

        # Healthy again, still serving: its (empty) answers keep it so.
        probes, unanswered = f.events(0).probes, f.events(0).unanswered
        await until(lambda: f.events(0).probes >= probes + 2, WAIT_S, "two more probes")
        assert f.events(0).unanswered == unanswered
        assert f.stale() == 0 and f.credited(0, 0, 1, 2)
        assert logged(caplog, "kv_events_stale") == [key] and logged(caplog, "kv_events_resumed") == [key]


async def test_a_rejoin_the_replay_cannot_fill_credits_what_follows(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="motor")
    async with fed(ctx, 1) as f:
        pub, key = f.pubs[0], f.keys[0]
        pub.answer = False
        f.feed.prefill_sent(key)  # as the router tells of each prefill leg it sends
        await until(lambda: f.stale() == 1, WAIT_S, "the engine found stale")
        # Batches flow again, its replay still silent: the first one rejoins it, and is applied
        # once its catch-up timed out. What it stores counts; what was cached before is unknown.
        await pub.publish()
        await until(lambda: f.credited(0, 2), WAIT_S, "batch 2 credited")
        assert f.uncredited(0, 0, 1)
        assert f.stale() == 0 and logged(caplog, "kv_events_resumed") == [key]
        # Silent again, but told of no prefill since: idle, not stale.
        unanswered = f.events(0).unanswered
        await until(lambda: f.events(0).unanswered >= unanswered + 2, WAIT_S, "two more probes")
        assert f.stale() == 0 and f.credited(0, 2)
        assert logged(caplog, "kv_events_stale") == [key]


async def test_an_idle_engine_or_one_whose_replay_answers_is_not_stale(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """The router tells the feed of every prefill it sends: engine 0 served, its replay silent
    (stale); engine 1 served nothing, its replay silent (idle: its cache is as it was); engine 2
    served, its replay answers with nothing new (its prefills stored nothing new)."""
    caplog.set_level(logging.INFO, logger="motor")
    async with fed(ctx, 3) as f:
        f.pubs[0].answer = f.pubs[1].answer = False
        f.feed.prefill_sent(f.keys[0])
        f.feed.prefill_sent(f.keys[2])
        await until(lambda: f.stale() == 1, WAIT_S, "engine 0 found stale")
        assert f.uncredited(0, 0, 1)
        idle, answering = f.events(1), f.events(2)
        unanswered, probes = idle.unanswered, answering.probes
        await until(
            lambda: idle.unanswered >= unanswered + 2 and answering.probes >= probes + 2,
            WAIT_S,
            "two more probes of engines 1 and 2",
        )
        assert answering.unanswered == 0
        assert f.stale() == 1 and logged(caplog, "kv_events_stale") == [f.keys[0]]
        assert f.credited(1, 0, 1) and f.credited(2, 0, 1)


async def test_without_a_replay_port_only_an_engine_seen_serving_goes_stale(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="motor")
    async with fed(ctx, 2, replay=False) as f:
        # Engine 1 was heard from last before engine 0: silent at least as long.
        await f.pubs[1].publish()
        await f.pubs[0].publish()
        await until(lambda: f.credited(0, 2) and f.credited(1, 2), WAIT_S, "batch 2 of both")
        f.target(0).legs = 1  # requests reach engine 0; nothing is known of engine 1's
        await until(lambda: f.stale() == 1, WAIT_S, "engine 0 found stale")
        [record] = [r for r in caplog.records if getattr(r, "event", None) == "kv_events_stale"]
        assert record.fields["endpoint"] == f.keys[0] and record.fields["replay"] == "none"
        # Engine 1 was judged on the same beat, as silent, and kept: nothing says it served.
        assert f.uncredited(0, 0, 1, 2) and f.credited(1, 0, 1, 2)
        assert f.events(0).probes == f.events(1).probes == 0
        # A batch from engine 0 rejoins it.
        await f.pubs[0].publish()
        await until(lambda: f.credited(0, 3), WAIT_S, "batch 3 of engine 0")
        assert logged(caplog, "kv_events_resumed") == [f.keys[0]]


async def test_zero_turns_the_check_off(ctx: zmq.asyncio.Context) -> None:
    async with fed(ctx, 1) as f:
        # A second feed following the same engine, the check off.
        f.pubs[0].pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # its subscription is told too
        off, off_metrics = feed_of(f.view, stale_s=0)
        await off.start()
        try:
            await until(lambda: f.pubs[0].subscriptions >= 2, WAIT_S, "the second subscription")
            await f.pubs[0].publish()
            await until(lambda: off.index.match([block(2)]) == {f.keys[0]: 1}, WAIT_S, "batch 2, off")
            f.pubs[0].answer = False
            f.target(0).legs = 1
            await until(lambda: f.stale() == 1, WAIT_S, "the engine found stale with the check on")
            assert off.index.match([block(2)]) == {f.keys[0]: 1}
            assert off._subs[f.keys[0]].events.probes == 0
            assert off_metrics.registry.get_sample_value("motor_coordinator_kv_events_stale_endpoints") == 0
        finally:
            await off.stop()
