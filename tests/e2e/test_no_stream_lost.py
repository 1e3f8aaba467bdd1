"""No stream lost, end to end: `motor up` with simulated engines, real clients (the openai SDK),
decode engines SIGKILLed in the middle of answers. Every streamed answer the Coordinator was
serving continues on another decode instance (a new prefill leg for the prompt and the output
already delivered, then a decode leg elsewhere) and the client gets one unbroken answer equal
token for token to the fault-free one; non-streamed requests meanwhile never fail.

Then the bound on what the Coordinator keeps to continue requests
(`coordinator.max_migration_state_total_bytes`): past it requests are served without
continuation (refused, and logged so), and the Coordinator's memory stays flat however many
requests come and go."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.streaming import (
    Load,
    Probe,
    Streams,
    client_of,
    differences,
    kill_engine,
    outcomes,
    prompt_of,
    reference,
    whole_reference,
    write_config,
)
from tests.poll import wait_until

pytestmark = pytest.mark.timeout(180)

TOKENS = 128
WAVE = 24  # streams at once; two waves, one engine kill each
TPOT_MS = 20  # a 128-token answer lasts about 2.6 s: long enough to be cut in the middle
WHOLE_TOKENS = 16


def test_streams_survive_decode_engine_kills_token_for_token(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, engine={"args": {"tpot_ms": TPOT_MS}})
    c = Cluster(tmp_path, "--prefill", "2", "--decode", "2", "--config", str(cfg), nodes=4)
    try:
        c.wait_ready()
        probe = Probe(c)
        probe.wait_serving(prefill=2, decode=2)
        client = client_of(c)
        first = [prompt_of(i) for i in range(WAVE)]
        second = [prompt_of(i) for i in range(WAVE, 2 * WAVE)]
        whole = [prompt_of(i) for i in range(100, 104)]
        # The fault-free answers, on the same cluster.
        want = reference(client, first + second, TOKENS)
        want_whole = whole_reference(client, whole, WHOLE_TOKENS)
        assert probe.migrations() == {}

        streams = Streams(client, TOKENS, 2 * WAVE)
        with Load(client, want_whole, WHOLE_TOKENS, stream=False) as plain:
            # Each wave is under way on both decode engines when one of them is killed: the
            # first decode's engine, then (once the first is back) the second's, so the streams
            # that moved to it the first time move again.
            for wave, victim_index in ((first, 0), (second, 1)):
                streams.submit(wave)
                victim = probe.decodes()[victim_index]
                port = int(victim["endpoints"][0]["port"])
                probe.wait_running(port, 3)
                sent = probe.generated(port)
                # Some tokens of this wave delivered, so the kill cuts answers in the middle.
                wait_until(
                    lambda port=port, sent=sent: probe.generated(port) >= sent + 10,
                    30,
                    "tokens streamed",
                    every=0.05,
                )
                old_pid = kill_engine(victim)
                probe.wait_back(victim["id"], old_pid)
            got = streams.results()
            plain.wait_served(3)  # and after the kills
        assert plain.failed == []
        assert differences(got, want) == {}

        counted = probe.migrations()
        assert outcomes(counted, "continued") >= 2, counted
        assert outcomes(counted, "refused", "exhausted", "unroutable") == 0, counted
        migrated = probe.coordinator_lines("request_migrated")
        assert migrated and all("ended=length" in line for line in migrated), migrated
        assert probe.coordinator_lines("migration_refused") == []
        # The engines really died and were relaunched in place.
        assert [line for line in c.proc.lines if "[ENGINE RELAUNCH #1 " in line]
    finally:
        c.cleanup()


# The bound: each streamed request takes its continuation state from the total a STEP (16 KiB)
# at a time, so 64 KiB holds four requests' at once; the rest are served without continuation.
STATE_TOTAL = 64 * 1024
BOUND_TOKENS = 64
BATCH = 40
BATCHES = 6
PROMPT_WORDS = 400  # a few KiB of prompt each: state worth keeping, or leaking


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.M)
    assert m is not None
    return int(m.group(1))


def arm(port: int, body: bytes) -> None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/sim/fault", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


def test_past_the_state_bound_requests_are_refused_continuation_and_memory_stays_flat(tmp_path: Path) -> None:
    # One inference worker: the management process serves HTTP and holds every request's state.
    cfg = write_config(
        tmp_path,
        coordinator={"workers": 1, "max_migration_state_total_bytes": STATE_TOTAL},
        engine={"args": {"tpot_ms": 10}},
    )
    c = Cluster(tmp_path, "--prefill", "1", "--decode", "2", "--config", str(cfg), nodes=3)
    try:
        c.wait_ready()
        probe = Probe(c)
        probe.wait_serving(prefill=1, decode=2)
        coordinator = c.component_pid("coordinator")
        assert coordinator
        client = client_of(c)
        pair = [prompt_of(i, PROMPT_WORDS) for i in range(2)]
        want = reference(client, pair, BOUND_TOKENS)
        # From now on one decode engine cuts every stream after its first token (and lives on).
        (cutter, _) = probe.decodes()
        arm(int(cutter["endpoints"][0]["port"]), b'{"mode": "disconnect"}')

        def within_the_bound() -> bool:
            """Two streams at once (one on each decode, by load), well within the bound: the
            one cut continues on the other decode, whole. True once one was cut."""
            before = outcomes(probe.migrations(), "continued")
            got = Streams(client, BOUND_TOKENS, 2).submit(pair).results()
            assert differences(got, want) == {}
            return outcomes(probe.migrations(), "continued") > before

        wait_until(within_the_bound, 60, "a stream cut and continued within the bound", every=0)

        failures: list[BaseException] = []

        def batch(n: int) -> None:
            prompts = [prompt_of(1000 + n * BATCH + i, PROMPT_WORDS) for i in range(BATCH)]
            got = Streams(client, BOUND_TOKENS, BATCH).submit(prompts).results()
            failures.extend(a for a in got.values() if isinstance(a, BaseException))

        batch(0)  # warm-up
        warm = rss_kib(coordinator)
        for n in range(1, BATCHES):
            batch(n)
        after = rss_kib(coordinator)

        # Past the bound the streams cut were refused continuation, and only for that reason:
        # each such client got its output, then the error event (the SDK raises APIError).
        counted = probe.migrations()
        refused = probe.coordinator_lines("migration_refused")
        assert failures and counted.get(("disconnect", "refused")) == len(failures), counted
        assert set(counted) == {("disconnect", "continued"), ("disconnect", "refused")}, counted
        assert len(refused) == len(failures)
        assert all("why=state_total_bytes" in line for line in refused), refused[:3]
        assert all(type(f) is openai.APIError and f.code == "upstream_disconnected" for f in failures), {
            f"{type(f).__name__}: {f}" for f in failures
        }
        # Nothing kept is left behind: within the bound a stream still continues ...
        wait_until(within_the_bound, 60, "a stream cut and continued after the batches", every=0)
        # ... and the Coordinator's memory did not grow with the requests it served.
        assert after <= warm * 1.25 + 16 * 1024, f"VmRSS {warm} kB after the warm-up, {after} kB after"
    finally:
        c.cleanup()
