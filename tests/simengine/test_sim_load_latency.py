"""The load-dependent latency model (opt-in): `--prefill-compute serial` makes prefills share one
compute in arrival order, the wait counted in TTFT and in vllm:num_requests_waiting;
`--tpot-ms-per-seq X` makes each output token take `tpot + X x (running - 1)`, which
vllm:time_per_output_token_seconds observes. Timings are compared by ratios with wide margins,
never against tight absolute bounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from motor_mesh.common.httpserver import HttpServer
from motor_mesh.simengine import app as sim_app
from motor_mesh.simengine.cli import parse
from motor_mesh.simengine.config import EngineConfig
from tests.poll import until
from tests.procs import SimEngine

from .conftest import metric

pytestmark = pytest.mark.timeout(60)

PREFILL_MS_PER_TOKEN = 4
PROMPT_WORDS = 100  # one token per word (the built-in tokenizer): a 400 ms prefill
PREFILL_S = PREFILL_MS_PER_TOKEN * PROMPT_WORDS / 1000
TPOT_MS = 10
PER_SEQ_MS = 10
OTHERS = 4  # streams running beside the measured one: its tokens take 10 + 10 x 4 = 50 ms


def prompt(tag: str) -> str:
    """A prompt of PROMPT_WORDS tokens sharing no prefix block with another tag's."""
    return " ".join(f"{tag}{i}" for i in range(PROMPT_WORDS))


async def scrape(s: aiohttp.ClientSession, base: str) -> str:
    async with s.get(base + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def timed_completion(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """Seconds until the whole (non-streamed) answer is in."""
    t0 = time.monotonic()
    async with s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()
    return time.monotonic() - t0


async def stream_times(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[float]:
    """When each token event of a stream arrived (monotonic seconds)."""
    times: list[float] = []
    async with s.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.monotonic())
    return times


def mean_gap(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


def tpot_hist(text: str) -> tuple[float, float]:
    return (
        metric(text, "vllm:time_per_output_token_seconds_sum"),
        metric(text, "vllm:time_per_output_token_seconds_count"),
    )


# -- flags -----------------------------------------------------------------------------------


def test_flags_parse_and_default_to_the_load_independent_model() -> None:
    cfg, _ = parse([])
    assert cfg.prefill_compute == "parallel" and cfg.tpot_ms_per_seq == 0.0
    cfg, unknown = parse(["serve", "m", "--prefill-compute", "serial", "--tpot-ms-per-seq", "2.5"])
    assert cfg.prefill_compute == "serial" and cfg.tpot_ms_per_seq == 2.5 and unknown == []
    for bad in (["--prefill-compute", "batched"], ["--tpot-ms-per-seq", "-1"]):
        with pytest.raises(SystemExit):
            parse(bad)


# -- --prefill-compute serial ------------------------------------------------------------------


async def _two_prefills(eng: SimEngine, watch: bool) -> tuple[float, float, float]:
    """Two long prompts, the second sent just after the first: (first's seconds, second's
    seconds, most requests seen waiting in /metrics meanwhile)."""
    url = eng.v1 + "/completions"
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(timed_completion(s, url, {"prompt": prompt("a"), "max_tokens": 1}))

        async def first_in() -> bool:  # it holds a slot (and, serial, the compute) before the second
            return metric(await scrape(s, eng.base), "vllm:num_requests_running") >= 1

        await until(first_in, 10, "the first request running")
        second = asyncio.create_task(timed_completion(s, url, {"prompt": prompt("b"), "max_tokens": 1}))
        most_waiting = 0.0
        while watch and not second.done():
            text = await scrape(s, eng.base)
            waiting = metric(text, "vllm:num_requests_waiting")
            if waiting >= 1:
                # The one queued for the compute waits; only the one prefilling runs.
                assert metric(text, "vllm:num_requests_running") == 1
            most_waiting = max(most_waiting, waiting)
            await asyncio.sleep(0.02)
        a, b = await first, await second
        if watch:
            assert metric(await scrape(s, eng.base), "vllm:num_requests_waiting") == 0
    return a, b, most_waiting


async def test_serial_prefills_run_one_after_another(
    spawn_engine: Callable[..., SimEngine],
) -> None:
    eng = spawn_engine("--prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN), "--prefill-compute", "serial")
    a, b, most_waiting = await _two_prefills(eng, watch=True)
    # The second prefill waited for the first (about one prefill), then ran its own.
    assert a >= PREFILL_S * 0.9
    assert b >= 1.6 * a, (a, b)
    assert most_waiting >= 1  # a prefill queue the planner can see
    async with aiohttp.ClientSession() as s:
        text = await scrape(s, eng.base)
    # The engine's TTFT (from arrival) has the wait in it: about 1 + 2 prefills in all.
    assert metric(text, "vllm:time_to_first_token_seconds_count") == 2
    assert metric(text, "vllm:time_to_first_token_seconds_sum") >= 2.5 * PREFILL_S


async def test_parallel_prefills_finish_together(spawn_engine: Callable[..., SimEngine]) -> None:
    eng = spawn_engine("--prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN))  # the default: parallel
    a, b, _ = await _two_prefills(eng, watch=False)
    assert a >= PREFILL_S * 0.9 and b >= PREFILL_S * 0.9
    assert b <= 1.3 * a, (a, b)


async def test_serial_prefill_finds_the_prefix_its_predecessor_computed(
    spawn_engine: Callable[..., SimEngine],
) -> None:
    """The prefix cache is looked up once the compute is the request's: the same prompt queued
    behind its twin is cached by then (in parallel both look it up before either stored it)."""
    eng = spawn_engine("--prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN), "--prefill-compute", "serial")
    url = eng.v1 + "/completions"
    body = {"prompt": prompt("same"), "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        await asyncio.gather(timed_completion(s, url, body), timed_completion(s, url, body))
        text = await scrape(s, eng.base)
    full_blocks = PROMPT_WORDS // 16 * 16
    assert metric(text, "vllm:prefix_cache_hits_total") == full_blocks


async def test_decode_legs_do_not_take_the_prefill_compute(
    spawn_engine: Callable[..., SimEngine],
) -> None:
    """A decode leg's first token is its KV transfer, not a prefill: it never queues."""
    eng = spawn_engine(
        "--kv-transfer-config", '{"kv_role": "kv_consumer"}', "--kv-transfer-ms", "400",
        "--prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN), "--prefill-compute", "serial",
    )  # fmt: skip
    url = eng.v1 + "/completions"
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": "x"}
    async with aiohttp.ClientSession() as s:
        a, b = await asyncio.gather(
            *(
                timed_completion(s, url, {"prompt": prompt(t), "max_tokens": 1, "kv_transfer_params": kv})
                for t in "ab"
            )
        )
    assert min(a, b) >= 0.4 * 0.9
    assert max(a, b) <= 1.3 * min(a, b), (a, b)


# -- --tpot-ms-per-seq -------------------------------------------------------------------------


async def test_tokens_slow_down_as_the_batch_grows(spawn_engine: Callable[..., SimEngine]) -> None:
    eng = spawn_engine("--tpot-ms", str(TPOT_MS), "--tpot-ms-per-seq", str(PER_SEQ_MS))
    url = eng.v1 + "/completions"
    body = {"prompt": "measure me", "max_tokens": 11}
    async with aiohttp.ClientSession() as s:
        # Alone: a stream, then the same answer whole (kept as a plan for the repeat below).
        alone_gap = mean_gap(await stream_times(s, url, body))
        alone_whole = await timed_completion(s, url, body)
        alone_hist = tpot_hist(await scrape(s, eng.base))
        assert alone_hist[1] == 2
        assert alone_hist[0] / alone_hist[1] == pytest.approx(TPOT_MS / 1000)

        # OTHERS long streams running beside it (they never end within the test).
        others = [
            asyncio.create_task(stream_times(s, url, {"prompt": f"other {i}", "max_tokens": 1000}))
            for i in range(OTHERS)
        ]
        try:

            async def all_running() -> bool:
                return metric(await scrape(s, eng.base), "vllm:num_requests_running") >= OTHERS

            await until(all_running, 10, "the other streams running")
            loaded_gap = mean_gap(await stream_times(s, url, body))
            stream_hist = tpot_hist(await scrape(s, eng.base))
            loaded_whole = await timed_completion(s, url, body)  # from the kept plan
            whole_hist = tpot_hist(await scrape(s, eng.base))
        finally:
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

    loaded_interval = (TPOT_MS + PER_SEQ_MS * OTHERS) / 1000  # 5 x the lone interval
    # Measured by the client: the gaps grew (ideally 5x), as did the whole answer's time.
    assert loaded_gap >= 2.5 * alone_gap, (alone_gap, loaded_gap)
    assert loaded_whole >= 2.5 * alone_whole, (alone_whole, loaded_whole)
    # The histogram observed each answer's own mean interval: the batch's, not --tpot-ms.
    assert stream_hist[1] - alone_hist[1] == 1
    assert stream_hist[0] - alone_hist[0] == pytest.approx(loaded_interval, rel=0.01)
    assert whole_hist[1] - stream_hist[1] == 1
    assert whole_hist[0] - stream_hist[0] == pytest.approx(loaded_interval, rel=0.01)


# -- kept plans never skip the load-dependent time (in process: the batch is set by hand) -----


@pytest.fixture
async def zero_tpot_engine() -> AsyncIterator[tuple[sim_app.Engine, str]]:
    """--tpot-ms 0 --tpot-ms-per-seq 20: alone an instant engine, whose plans (streams too, by
    --tpot-ms alone) would be kept and answered whole."""
    engine = sim_app.Engine(EngineConfig(tpot_ms=0.0, tpot_ms_per_seq=20.0))
    server = HttpServer(engine.handler(), max_body_bytes=1 << 20)
    port = await server.listen("127.0.0.1", 0)
    yield engine, f"http://127.0.0.1:{port}"
    await server.close(1.0)
    await engine.close()


async def test_kept_plans_follow_the_batch(zero_tpot_engine: tuple[sim_app.Engine, str]) -> None:
    engine, base = zero_tpot_engine
    url = base + "/v1/completions"
    body = {"prompt": "kept plan", "max_tokens": 6}
    async with aiohttp.ClientSession() as s:
        # Alone: no wait at all, and each body is planned once and then repeated.
        for _ in range(2):
            assert len(await stream_times(s, url, body)) == 6
            await timed_completion(s, url, body)
        before = tpot_hist(await scrape(s, base))
        assert before == (0.0, 4)
        # Three more sequences in the batch: each token now takes 20 x 3 = 60 ms.
        for _ in range(3):
            assert engine.slots.try_acquire()
        try:
            gaps = [mean_gap(await stream_times(s, url, body)) for _ in range(2)]
            wholes = [await timed_completion(s, url, body) for _ in range(2)]
        finally:
            for _ in range(3):
                engine.slots.release()
        after = tpot_hist(await scrape(s, base))
    assert min(gaps) >= 0.06 * 0.8, gaps
    assert min(wholes) >= 5 * 0.06 * 0.8, wholes
    assert after[1] - before[1] == 4
    assert after[0] - before[0] == pytest.approx(4 * 0.06, rel=0.01)
