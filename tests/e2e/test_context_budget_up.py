"""The context budget end to end: `motor up` with `coordinator.clamp_max_tokens` on (two
inference workers, each reading the engines' max_model_len itself) in front of simulated engines
with a 48-token context (`engine.args.max_model_len`), which refuse what does not fit as vLLM
does; and the same cluster with the key off, where the engine's refusal reaches the client as it
always did. The openai SDK is the client; the engines' own /metrics witness what reached them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.cluster import Cluster
from tests.metrics import scrape
from tests.poll import wait_until

pytestmark = pytest.mark.timeout(180)

CONTEXT = 48
PREFILL, DECODE = 0, 1  # engine k: motor up's prefill instance, then its decode one
MESSAGES = [{"role": "user", "content": "how long may an answer be"}]  # "user: ..." is 7 tokens
PROMPT_TOKENS = 7


def _cluster(tmp: Path, clamp: bool) -> Cluster:
    cfg = tmp / "motor.json"
    coordinator: dict[str, Any] = {"workers": 2}
    if clamp:
        coordinator["clamp_max_tokens"] = True
    cfg.write_text(json.dumps({"coordinator": coordinator, "engine": {"args": {"max_model_len": CONTEXT}}}))
    return Cluster(tmp, "--config", str(cfg), nodes=2)


@pytest.fixture(scope="module")
def on(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = _cluster(tmp_path_factory.mktemp("context_on"), clamp=True)
    try:
        c.wait_ready()
        # Every inference worker has read both engines' max_model_len (the gauge is the fewest
        # any worker knows).
        wait_until(
            lambda: value(c, "motor_coordinator_context_lengths_known") == 2, 30, retry=(AssertionError,)
        )
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def off(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = _cluster(tmp_path_factory.mktemp("context_off"), clamp=False)
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def value(c: Cluster, name: str, **labels: str) -> float:
    return scrape(f"{c.base_url}/metrics").value(name, **labels)


def total(c: Cluster, name: str) -> float:
    """Every series of ``name`` added up (none yet: 0)."""
    return sum(s.value for s in scrape(f"{c.base_url}/metrics").samples if s.name == name)


def received(c: Cluster, k: int) -> float:
    """Completion requests engine ``k`` received, refused ones included."""
    return scrape(f"{c.engine_url(k)}/metrics").value("motor_sim_completion_requests_total")


def client(c: Cluster) -> openai.OpenAI:
    # A client per request: a new connection, which the kernel gives either inference worker.
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=30)


def test_an_over_long_max_tokens_is_answered_up_to_the_context(on: Cluster) -> None:
    legs = on.pd_legs(PREFILL).get(("prefill", "vllm"), 0), on.pd_legs(DECODE).get(("decode", "vllm"), 0)
    for _ in range(4):
        with client(on) as cl:
            chat = cl.chat.completions.create(model="motor-sim", messages=MESSAGES, max_tokens=10_000)  # type: ignore[arg-type]
        assert chat.choices[0].finish_reason == "length" and chat.usage is not None
        assert (chat.usage.prompt_tokens, chat.usage.total_tokens) == (PROMPT_TOKENS, CONTEXT)
    with client(on) as cl:
        # Without a limit a chat runs to the context too; a completion keeps its 16.
        chat = cl.chat.completions.create(model="motor-sim", messages=MESSAGES)  # type: ignore[arg-type]
        assert chat.usage is not None and chat.usage.completion_tokens == CONTEXT - PROMPT_TOKENS
        comp = cl.completions.create(model="motor-sim", prompt="a b c d", max_tokens=10_000)
        assert comp.usage is not None and comp.usage.completion_tokens == CONTEXT - 4
        comp = cl.completions.create(model="motor-sim", prompt="a b c d")
        assert comp.usage is not None and comp.usage.completion_tokens == 16
    # Each through both legs of the pair (the engines counted what they served).
    assert on.pd_legs(PREFILL)[("prefill", "vllm")] == legs[0] + 7
    assert on.pd_legs(DECODE)[("decode", "vllm")] == legs[1] + 7
    wait_until(lambda: total(on, "motor_coordinator_max_tokens_clamped_total") >= 6, 20)


def test_a_prompt_that_fills_the_context_is_refused_before_any_leg(on: Cluster) -> None:
    # The counts the workers flush every second settle first.
    wait_until(lambda: total(on, "motor_coordinator_routed_total") == received(on, DECODE), 20)
    routed = total(on, "motor_coordinator_routed_total")
    engines = received(on, PREFILL), received(on, DECODE)
    exceeded = total(on, "motor_coordinator_context_length_exceeded_total")
    long = [{"role": "user", "content": " ".join(["word"] * CONTEXT)}]
    for _ in range(3):
        with client(on) as cl, pytest.raises(openai.BadRequestError) as err:
            cl.chat.completions.create(model="motor-sim", messages=long, max_tokens=4)  # type: ignore[arg-type]
        body: Any = err.value.body
        assert (body["code"], body["param"]) == ("context_length_exceeded", "messages")
        assert f"maximum context length is {CONTEXT} tokens" in body["message"]
        assert f"resulted in {CONTEXT + 1} tokens" in body["message"]
    wait_until(lambda: total(on, "motor_coordinator_context_length_exceeded_total") == exceeded + 3, 20)
    assert (received(on, PREFILL), received(on, DECODE)) == engines  # no engine saw them
    assert total(on, "motor_coordinator_routed_total") == routed


def test_with_the_key_off_the_engines_refusal_passes_through(off: Cluster) -> None:
    prefills = off.pd_legs(PREFILL).get(("prefill", "vllm"), 0)
    with client(off) as cl, pytest.raises(openai.BadRequestError) as err:
        cl.chat.completions.create(model="motor-sim", messages=MESSAGES, max_tokens=10_000)  # type: ignore[arg-type]
    body: Any = err.value.body
    assert body["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 10000. This model's maximum context "
        f"length is {CONTEXT} tokens and your request has {PROMPT_TOKENS} input tokens "
        f"(10000 > {CONTEXT} - {PROMPT_TOKENS})."
    )
    # The decode engine refused it after the prefill engine had computed the prompt.
    assert off.pd_legs(PREFILL)[("prefill", "vllm")] == prefills + 1
    assert total(off, "motor_coordinator_max_tokens_clamped_total") == 0
    with client(off) as cl:  # what fits is answered as always
        chat = cl.chat.completions.create(model="motor-sim", messages=MESSAGES, max_tokens=5)  # type: ignore[arg-type]
        assert chat.usage is not None and chat.usage.completion_tokens == 5
