"""KV-aware routing on a real tokenizer, end to end: `motor up --prefill 2 --decode 1 --model
<Llama 3 tokenizer directory>`, whose simulated engines render Llama 3's chat template and encode
it with its tokenizer.json as vLLM does, and a Coordinator that tokenizes the same way. The
engines' own /metrics witness what they found cached; the openai SDK is the client.

Also conditional disaggregation: with `coordinator.pd_min_prompt_tokens`, a short prompt goes
straight to a decode instance, which computes its prefill itself."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.cluster import Cluster
from tests.metrics import scrape
from tests.poll import wait_until
from tests.tokenizers import llama3_dir

pytestmark = pytest.mark.timeout(300)

PREFILLS = (0, 1)  # engines k = 0, 1 are the prefill instances, 2 the decode one
DECODE = 2
SHORT = 64  # pd_min_prompt_tokens

WORDS = "the cache holds every block of a prompt its engine has computed before so routing there saves work".split()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = llama3_dir()
    tmp = tmp_path_factory.mktemp("kv_real")
    cfg = tmp / "motor.json"
    cfg.write_text(
        json.dumps(
            {
                "coordinator": {"prefill_policy": "kv_aware", "pd_min_prompt_tokens": SHORT},
                "engine": {"args": {"block_size": 16, "num_gpu_blocks_override": 65536}},
            }
        )
    )
    c = Cluster(tmp, "--prefill", "2", "--decode", "1", "--model", model, "--config", str(cfg), nodes=3)
    try:
        c.wait_ready()
        wait_until(lambda: value(c, "motor_coordinator_kv_subscriptions") == 2, timeout=60)
        # Every inference worker loads Llama 3's tokenizer on its own, off its loop: until it has,
        # it routes by load and counts no prompt tokens (the tests wait on those counts).
        workers = max(1, sum("event=worker_serving " in line for line in c.proc.lines))
        wait_until(lambda: sum("event=kv_tokenizer " in line for line in c.proc.lines) >= workers, timeout=60)
        yield c
    finally:
        c.cleanup()


def value(c: Cluster, name: str, **labels: str) -> float:
    return scrape(f"{c.base_url}/metrics").value(name, **labels)


def routed(c: Cluster, mode: str) -> float:
    """Requests routed in ``mode`` (no sample before the first)."""
    return sum(
        s.value
        for s in scrape(f"{c.base_url}/metrics").samples
        if s.name == "motor_coordinator_routed_total" and s.labels.get("mode") == mode
    )


def engine_value(c: Cluster, k: int, name: str) -> float:
    return scrape(f"{c.engine_url(k)}/metrics").value(name)


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def client_of(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def test_the_blocks_kv_aware_expects_cached_are_the_engines_hits(cluster: Cluster) -> None:
    """Per request, the tokens the Coordinator expected the chosen engine to hold (its
    kv_cached_prompt_tokens counter) are the tokens that engine found cached (its own
    vllm:prefix_cache_hits), turn after turn of interleaved conversations."""
    client = client_of(cluster)
    model = llama3_dir()
    rng = random.Random(4)
    systems = [text(rng, 300), text(rng, 200)]
    conversations: list[list[dict[str, str]]] = [
        [{"role": "system", "content": systems[i % 2]}] for i in range(4)
    ]
    order = [i for i in range(4) for _ in range(4)]
    rng.shuffle(order)
    predicted_total = actual_total = 0.0
    for i in order:
        messages = conversations[i]
        messages.append({"role": "user", "content": text(rng, 40)})  # > SHORT: through the prefill leg
        events = value(cluster, "motor_coordinator_kv_events_total")
        routed = value(cluster, "motor_coordinator_kv_prompt_tokens_total", role="prefill")
        predicted = value(cluster, "motor_coordinator_kv_cached_prompt_tokens_total", role="prefill")
        actual = sum(engine_value(cluster, k, "vllm:prefix_cache_hits_total") for k in PREFILLS)
        resp = client.chat.completions.create(model=model, messages=messages, max_tokens=8)  # type: ignore[arg-type]
        answer = resp.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        # The inference workers add their counts to /metrics every so often: until this request's
        # (its prompt tokens: a long prompt no engine holds is only partly encoded, its length
        # estimated, so the count need not be the engine's).
        wait_until(
            lambda r=routed: value(cluster, "motor_coordinator_kv_prompt_tokens_total", role="prefill") > r,
            timeout=20,
        )
        d_predicted = (
            value(cluster, "motor_coordinator_kv_cached_prompt_tokens_total", role="prefill") - predicted
        )
        d_actual = sum(engine_value(cluster, k, "vllm:prefix_cache_hits_total") for k in PREFILLS) - actual
        assert d_predicted == d_actual, (
            f"conversation {i}: expected {d_predicted} cached, the engine hit {d_actual}"
        )
        predicted_total += d_predicted
        actual_total += d_actual
        # The prefill stored new blocks: the next request is routed knowing them.
        wait_until(lambda e=events: value(cluster, "motor_coordinator_kv_events_total") > e, timeout=20)
    assert actual_total > 0.5 * 16 * len(order) * 16  # most turns found their history cached


def test_a_short_prompt_skips_the_prefill_leg(cluster: Cluster) -> None:
    client = client_of(cluster)
    model = llama3_dir()
    legs_before = [cluster.pd_legs(k).get(("prefill", "vllm"), 0) for k in PREFILLS]
    decode_only = routed(cluster, "decode_only")
    decode_prefilled = engine_value(cluster, DECODE, "vllm:prefix_cache_queries_total")
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=8
    )
    assert resp.choices[0].message.content
    # (The inference workers add their counts to /metrics every so often.)
    wait_until(lambda: routed(cluster, "decode_only") == decode_only + 1, timeout=20)
    assert [cluster.pd_legs(k).get(("prefill", "vllm"), 0) for k in PREFILLS] == legs_before
    # The decode engine computed the prompt itself (a hand-off leg's KV comes by transfer).
    assert (
        engine_value(cluster, DECODE, "vllm:prefix_cache_queries_total")
        == decode_prefilled + resp.usage.prompt_tokens
    )  # type: ignore[union-attr]

    # A prompt over the threshold goes through a prefill instance as before.
    pd = routed(cluster, "vllm_pd")
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text(random.Random(1), 3 * SHORT)}],
        max_tokens=8,
        stream=True,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    wait_until(lambda: routed(cluster, "vllm_pd") == pd + 1, timeout=20)
    assert sum(cluster.pd_legs(k).get(("prefill", "vllm"), 0) for k in PREFILLS) == sum(legs_before) + 1
