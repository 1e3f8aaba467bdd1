"""KV-aware routing on real engines: two real vLLM engines publishing their own KV cache events
(ZMQ, BlockStored with token ids), the Coordinator tokenizing prompts with the real Llama 3
tokenizer and chat template.

`motor up --engine-type vllm --model <tiny model path> --union 2` with ``decode_policy =
kv_aware`` (the policy that chooses union instances): each request goes whole to the engine the
index its events feed chooses. Not two prefill engines and a decode engine: three vLLM engines
with NIXL on this machine's two cores do not work, because NIXL keeps one core busy per engine
polling for transfers (the decode engine's first pull then stalled until its health probes
failed), and a Coordinator with prefill instances only is not routable. The prefill side of
`kv_aware` reads the same index through the same code; test_vllm_pd.py tests the hand-off.
Precision sampling runs here too: its shadow requests go to a real engine. The last test kills
an engine: a stream on it continues on the other one.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.metrics import scrape
from tests.poll import wait_until
from tests.real.engines import RealCluster, chat, client, running, unique
from tools.real_engines import TINY_MODEL, unavailable

WHY = unavailable()
pytestmark = [pytest.mark.real, pytest.mark.skipif(bool(WHY), reason=WHY), pytest.mark.timeout(600)]

MODEL = str(TINY_MODEL)
ENGINES = (0, 1)
START_S = 420.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    c = RealCluster(
        tmp_path_factory.mktemp("real-kv"),
        prefill=0,
        decode=0,
        union=2,
        decode_policy="kv_aware",
        precision_check_enabled=True,
        precision_interval_s=1,
        # The tiny model's answers are noise: samples are judged, but never raise an alarm that
        # would take an instance out of routing.
        precision_issue_threshold=1_000_000,
    )
    with running(c, START_S):
        yield c


def long_chat(seed: str) -> list[Any]:
    """A conversation whose system prompt runs to many KV blocks (hundreds of tokens)."""
    system = f"{seed} " + " ".join(f"Rule {i}: answer with care and cite section {i}." for i in range(60))
    return [{"role": "system", "content": system}, {"role": "user", "content": "First question?"}]


def test_a_repeated_prefix_goes_to_the_engine_holding_it(cluster: RealCluster) -> None:
    """The engines' own KV events reach the Coordinator's index, and a conversation coming back
    goes to the engine that holds its prefix: that engine's prefix cache is hit, the other's is
    not. The Coordinator matches blocks only if it tokenized the prompt exactly as
    vLLM did (the real tokenizer and chat template)."""
    api = client(cluster)
    coordinator = f"{cluster.base_url}/metrics"
    block_size = cluster.engine_block_size(0)
    for round_ in range(3):  # three conversations: a holder picked by chance every time is 1 in 8
        messages = long_chat(uuid.uuid4().hex)
        blocks = scrape(coordinator).value("motor_coordinator_kv_index_blocks")
        first = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        assert first.usage is not None
        # Every full block of this prompt is new (it starts with a fresh id): wait until the
        # index holds them all, not merely until some event arrived (the previous round's last
        # request may still be publishing).
        new = first.usage.prompt_tokens // block_size
        wait_until(
            lambda blocks=blocks, new=new: (
                scrape(coordinator).value("motor_coordinator_kv_index_blocks") >= blocks + new
            ),
            30,
            f"the {new} blocks of the conversation in the Coordinator's index",
        )
        hits = {k: cluster.engine_counter(k, "vllm:prefix_cache_hits_total") for k in ENGINES}
        cached = scrape(coordinator).value("motor_coordinator_kv_cached_prompt_tokens_total", role="union")
        again = [*messages, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "And?"}]
        api.chat.completions.create(model=MODEL, messages=again, max_tokens=2, temperature=0)
        grown = {k: cluster.engine_counter(k, "vllm:prefix_cache_hits_total") - hits[k] for k in ENGINES}
        assert sorted(grown.values())[0] == 0 and sorted(grown.values())[1] > 0, (round_, grown)
        # The Coordinator counted the prefix as cached where it sent the request (its workers
        # publish their counts to /metrics a moment later). At most what the engine hit: the
        # precision sampler's shadow requests hit the engine's cache too, unrouted.
        hit = max(grown.values())

        def counted(cached: float = cached) -> float:
            return (
                scrape(coordinator).value("motor_coordinator_kv_cached_prompt_tokens_total", role="union")
                - cached
            )

        wait_until(lambda: counted() > 0, 10, "cached tokens counted by the Coordinator")
        assert counted() <= hit, round_


def test_precision_samples_are_judged_on_real_engines(cluster: RealCluster) -> None:
    """The precision sampler's shadow requests (with logprobs) are accepted by the real engines
    and their answers parsed into a verdict (normal or anomalous: the tiny model's answers are
    noise, so which one is not asserted)."""
    api = client(cluster)
    coordinator = f"{cluster.base_url}/metrics"

    def judged() -> float:
        m = scrape(coordinator)
        return m.value("motor_coordinator_precision_samples_total", result="normal") + m.value(
            "motor_coordinator_precision_samples_total", result="anomalous"
        )

    errors = scrape(coordinator).value("motor_coordinator_precision_samples_total", result="error")

    def sample_taken() -> bool:
        api.chat.completions.create(model=MODEL, messages=chat(unique()), max_tokens=4)
        return judged() > 0

    wait_until(sample_taken, 60, "a judged precision sample", every=1.0)
    assert scrape(coordinator).value("motor_coordinator_precision_samples_total", result="error") == errors


def _streamed(stream: Any, on_chunk: Any = None) -> tuple[list[int], str, list[str]]:
    """(output token ids, text, finish reasons) of a streamed chat answer; ``on_chunk(n)`` is
    called after the n-th chunk that carried output."""
    ids: list[int] = []
    text: list[str] = []
    finish: list[str] = []
    n = 0
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.model_extra or {}
            ids.extend(extra.get("token_ids") or [])
            text.append(choice.delta.content or "")
            if choice.finish_reason:
                finish.append(choice.finish_reason)
            if extra.get("token_ids"):
                n += 1
                if on_chunk is not None:
                    on_chunk(n)
    return ids, "".join(text), finish


def test_a_stream_whose_engine_is_killed_continues_on_the_other_token_for_token(cluster: RealCluster) -> None:
    """Last: it kills an engine. A greedy chat stream whose engine is SIGKILLed mid-answer
    continues on the other engine from the token ids already delivered (vLLM's return_token_ids,
    then kv_transfer_params.prompt_token_ids: no text round trip), and the client's tokens are
    the fault-free answer's, with nothing repeated or missing."""
    api = client(cluster)
    messages = chat(unique())
    ask = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 160,
        "temperature": 0,
        "stream": True,
        # The client asks for the ids too, to compare tokens rather than text; ignore_eos: the
        # random model must not stop before the kill.
        "extra_body": {"return_token_ids": True, "ignore_eos": True},
    }
    ref_ids, ref_text, ref_finish = _streamed(api.chat.completions.create(**ask))
    assert len(ref_ids) == 160 and ref_finish == ["length"]
    coordinator = f"{cluster.base_url}/metrics"
    before = scrape(coordinator).value(
        "motor_coordinator_migrations_total", reason="disconnect", outcome="continued"
    )
    # A precision sample the reference's completion triggered runs on its own: let it end, so
    # the one engine busy below is the one serving the stream.
    wait_until(
        lambda: all(cluster.engine_counter(k, "vllm:num_requests_running") == 0 for k in ENGINES),
        30,
        "both engines idle",
    )
    killed: list[int] = []

    def kill_once(n: int) -> None:
        if n != 8 or killed:
            return

        def serving() -> list[int]:
            return [k for k in ENGINES if cluster.engine_counter(k, "vllm:num_requests_running") > 0]

        # The stream's engine; a precision sample on the other one may overlap for a moment.
        (k,) = wait_until(lambda: (busy := serving()) and len(busy) == 1 and busy, 10, "one engine serving")
        pid = cluster.engine_pid(k)
        os.killpg(pid, signal.SIGKILL)
        killed.append(k)

    ids, text, finish = _streamed(api.chat.completions.create(**ask), kill_once)
    assert killed, "the stream ended before the kill"
    assert ids == ref_ids and text == ref_text and finish == ["length"]
    after = scrape(coordinator).value(
        "motor_coordinator_migrations_total", reason="disconnect", outcome="continued"
    )
    assert after == before + 1
