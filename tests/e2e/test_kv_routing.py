"""KV-aware routing end to end: `motor up --prefill 2 --decode 1` with the simulated engines'
prefix caches and KV cache events, the openai SDK as the client, and each engine's own
/metrics as the witness of where prompts were prefilled."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.cluster import Cluster
from tests.metrics import scrape
from tests.poll import wait_until

pytestmark = pytest.mark.timeout(240)

BLOCK = 16
PREFILLS = (0, 1)  # engines k = 0, 1 are the prefill instances (motor up numbers prefill first)


def system_prompt(i: int, words: int) -> str:
    return " ".join(f"rule{i}x{j}" for j in range(words))


def config(tmp: Path, policy: str, blocks: int, ms_per_token: float, workers: int) -> Path:
    path = tmp / f"{policy}.json"
    engine_args = {
        "block_size": BLOCK,
        "num_gpu_blocks_override": blocks,
        "prefill_ms_per_token": ms_per_token,
    }
    cfg = {"coordinator": {"prefill_policy": policy, "workers": workers}, "engine": {"args": engine_args}}
    path.write_text(json.dumps(cfg))
    return path


def up(tmp: Path, policy: str, blocks: int = 4096, ms_per_token: float = 0.0, workers: int = 1) -> Cluster:
    cfg = config(tmp, policy, blocks, ms_per_token, workers)
    c = Cluster(tmp, "--prefill", "2", "--decode", "1", "--config", str(cfg), nodes=3)
    try:
        c.wait_ready()
        if policy == "kv_aware":  # both prefill engines' events are followed before the first request
            wait_until(lambda: coordinator_value(c, "motor_coordinator_kv_subscriptions") == 2, timeout=30)
    except BaseException:
        c.cleanup()
        raise
    return c


def coordinator_value(c: Cluster, name: str, **labels: str) -> float:
    return scrape(f"{c.base_url}/metrics").value(name, **labels)


def prefills_served(c: Cluster, k: int) -> int:
    return int(c.pd_legs(k).get(("prefill", "vllm"), 0))


def ask(client: openai.OpenAI, system: str, question: str) -> float:
    """One chat completion; its latency in seconds."""
    started = time.perf_counter()
    resp = client.chat.completions.create(
        model="motor-sim",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
    )
    assert resp.choices[0].message.content
    return time.perf_counter() - started


def client_of(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def indexed(c: Cluster, blocks: int) -> None:
    """Wait until the Coordinator's index holds at least ``blocks`` blocks."""
    wait_until(lambda: coordinator_value(c, "motor_coordinator_kv_index_blocks") >= blocks, timeout=20)


def test_a_shared_system_prompt_sticks_to_its_engine_and_moves_by_events_after_a_relaunch(
    tmp_path: Path,
) -> None:
    # Two inference workers: either may route any request, each reading the one index the
    # management process keeps for both.
    c = up(tmp_path, "kv_aware", workers=2)
    try:
        client = client_of(c)
        system = system_prompt(0, 480)  # 482 tokens with its "system:" label: 30 full blocks
        ask(client, system, "first question")
        # The prefill engine cached it: 30 blocks, one event. Only prefill engines are followed:
        # the decode policy is least_load.
        indexed(c, 30)
        wait_until(lambda: coordinator_value(c, "motor_coordinator_kv_events_total") >= 1, timeout=20)
        holder = next(k for k in PREFILLS if prefills_served(c, k) == 1)
        other = 1 - holder
        for i in range(10):
            ask(client, system, f"question number {i}")
        assert (prefills_served(c, holder), prefills_served(c, other)) == (11, 0)
        hits = scrape(f"{c.engine_url(holder)}/metrics").value("vllm:prefix_cache_hits_total")
        assert hits >= 10 * 30 * BLOCK  # every repeat found the whole system prompt cached

        # The holder's engine dies. While it is relaunched, the other one serves the prompt and
        # announces it holds it; the relaunched engine comes back empty.
        victim = next(
            i for i in c.controller_instances() if int(i["endpoints"][0]["port"]) == c.engine_port(holder)
        )
        old_pid = int(victim["endpoints"][0]["pid"])
        os.killpg(old_pid, signal.SIGKILL)
        served = prefills_served(c, other)
        wait_until(lambda: _served_once_more(c, client, system, other, served), timeout=30, every=0.2)

        def relaunched() -> bool:
            inst = next(i for i in c.controller_instances() if i["id"] == victim["id"])
            pid = int(inst["endpoints"][0].get("pid", 0))
            return inst["status"] == "INSTANCE_STATUS_ACTIVE" and pid not in (0, old_pid)

        wait_until(relaunched, timeout=90, every=0.2)
        # The Coordinator dropped what it knew of the dead engine (a new process: a new pid).
        wait_until(
            lambda: (
                sum(
                    coordinator_value(c, "motor_coordinator_kv_index_resets_total", reason=r)
                    for r in ("left", "restart")
                )
                >= 1
            )
        )
        before = prefills_served(c, other)
        for i in range(8):
            ask(client, system, f"after the relaunch {i}")
        # Every one went to the engine whose events say it holds the prompt, none to the empty
        # one (a stale index would tie them and send about half there).
        assert prefills_served(c, other) == before + 8
        assert prefills_served(c, holder) == 0
    finally:
        c.cleanup()


def _served_once_more(c: Cluster, client: openai.OpenAI, system: str, k: int, served: int) -> bool:
    try:
        ask(client, system, "while it is down")
    except openai.APIError:
        return False
    return prefills_served(c, k) > served


def _mean_latency(tmp: Path, policy: str, prompts: list[str], order: list[int]) -> tuple[float, float]:
    # Each prefill engine holds about half of the system prompts (8 prompts of 25 blocks; 112
    # blocks each), prefill costs 2 ms per uncached token: the modelled prefill, not the
    # machine's noise (this runs beside the rest of the suite), decides the means.
    c = up(tmp, policy, blocks=112, ms_per_token=2.0)
    try:
        client = client_of(c)
        times = [ask(client, prompts[i], f"question {n} about it") for n, i in enumerate(order)]
        hit = sum(
            scrape(f"{c.engine_url(k)}/metrics").value("vllm:prefix_cache_hits_total") for k in PREFILLS
        )
        asked = sum(
            scrape(f"{c.engine_url(k)}/metrics").value("vllm:prefix_cache_queries_total") for k in PREFILLS
        )
        return sum(times) / len(times), hit / asked
    finally:
        c.cleanup()


def test_kv_aware_halves_mean_latency_against_least_load_on_a_half_fitting_working_set(
    tmp_path: Path,
) -> None:
    prompts = [system_prompt(i, 400) for i in range(8)]
    rng = random.Random(16)
    order = [rng.randrange(len(prompts)) for _ in range(64)]
    results: dict[str, Any] = {}
    for policy in ("least_load", "kv_aware"):
        (tmp_path / policy).mkdir()
        results[policy] = _mean_latency(tmp_path / policy, policy, prompts, order)
    (kv_mean, kv_hits), (ll_mean, ll_hits) = results["kv_aware"], results["least_load"]
    assert kv_hits > ll_hits, results
    assert kv_mean <= ll_mean / 2, results
