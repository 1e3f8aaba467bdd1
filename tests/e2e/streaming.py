"""Streaming clients and cluster probes shared by the "no stream lost" end-to-end tests
(test_no_stream_lost.py, test_drain_up.py): real clients (the ``openai`` SDK) against a
``motor up`` cluster of simulated engines, whose every token is a deterministic function of
the whole context, so a greedy answer continued on another engine is the fault-free answer
token for token.

- ``Answer`` / ``stream_chat`` / ``whole_chat``: one request and what the client saw of it;
- ``Streams``: many streamed requests at once on a thread pool, each answer kept by prompt;
- ``Load``: clients sending streamed or non-streamed requests back to back until stopped, each
  answer checked against a fault-free reference;
- ``Probe``: what the tests read off the cluster (the Coordinator's table and /metrics, an
  engine's requests running) and the SIGKILL of a decode engine's process group.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import urllib.request
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from tests.e2e.cluster import COORDINATOR, CallFailed, Cluster
from tests.metrics import scrape
from tests.poll import wait_until

MODEL = "motor-sim"
MIGRATIONS = "motor_coordinator_migrations_total"


def write_config(tmp: Path, name: str = "cfg.json", **sections: dict[str, Any]) -> Path:
    path = tmp / name
    path.write_text(json.dumps(sections))
    return path


def client_of(c: Cluster, timeout: float = 120) -> openai.OpenAI:
    # max_retries=0: a request the SDK retried behind the test's back would hide a failure.
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=timeout)


def prompt_of(i: int, words: int = 0) -> str:
    """Prompt number ``i``: each its own, so each has its own answer; ``words`` more of it."""
    return f"question {i}: tell me about disaggregated serving" + "".join(f" w{i}x{j}" for j in range(words))


@dataclass
class Answer:
    """What the client saw: each content delta (one token each on the simulated engine), the
    finish reasons, the usage (streams ask for it), and the answer ids (one answer: one id)."""

    pieces: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    usage: tuple[int, int] | None = None
    ids: set[str] = field(default_factory=set)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def stream_chat(client: openai.OpenAI, prompt: str, max_tokens: int) -> Answer:
    """A greedy streamed chat completion, read to its end. An error event in the stream raises
    (the SDK's APIError), as does a stream cut short (httpx's error)."""
    out = Answer()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        out.ids.add(chunk.id)
        if chunk.usage is not None:
            out.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        for choice in chunk.choices:
            if choice.delta.content:
                out.pieces.append(choice.delta.content)
            if choice.finish_reason:
                out.finish.append(choice.finish_reason)
    return out


def whole_chat(client: openai.OpenAI, prompt: str, max_tokens: int) -> Answer:
    """A greedy non-streamed chat completion, as an Answer of one piece."""
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
    )
    (choice,) = resp.choices
    usage = None if resp.usage is None else (resp.usage.prompt_tokens, resp.usage.completion_tokens)
    return Answer([choice.message.content or ""], [choice.finish_reason], usage, {resp.id})


class Streams:
    """Streamed chat completions of ``prompts`` on ``concurrency`` threads; ``submit`` more
    while they run. ``results()`` waits for all: {prompt: Answer or the exception it raised}."""

    def __init__(self, client: openai.OpenAI, max_tokens: int, concurrency: int) -> None:
        self.client = client
        self.max_tokens = max_tokens
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="stream")
        self.futures: dict[str, Future[Answer]] = {}

    def submit(self, prompts: Iterable[str]) -> Streams:
        for p in prompts:
            self.futures[p] = self.pool.submit(stream_chat, self.client, p, self.max_tokens)
        return self

    def results(self, timeout: float = 120) -> dict[str, Answer | BaseException]:
        out: dict[str, Answer | BaseException] = {}
        for p, f in self.futures.items():
            try:
                out[p] = f.result(timeout)
            except Exception as exc:
                out[p] = exc
        self.pool.shutdown(wait=False, cancel_futures=True)
        return out


def reference(client: openai.OpenAI, prompts: list[str], max_tokens: int) -> dict[str, Answer]:
    """The fault-free answers of ``prompts`` (streamed, all at once), every one of them whole."""
    got = Streams(client, max_tokens, len(prompts)).submit(prompts).results()
    bad = {p: a for p, a in got.items() if not isinstance(a, Answer)}
    assert not bad, f"the fault-free reference run failed: {bad}"
    answers = {p: a for p, a in got.items() if isinstance(a, Answer)}
    for a in answers.values():
        assert len(a.pieces) == max_tokens and a.finish == ["length"], a
    return answers


def differences(got: dict[str, Answer | BaseException], want: dict[str, Answer]) -> dict[str, str]:
    """Each prompt whose answer failed or is not the reference's token for token, and how."""
    out: dict[str, str] = {}
    for p, a in got.items():
        ref = want[p]
        if isinstance(a, BaseException):
            out[p] = f"failed: {type(a).__name__}: {a}"
        elif a.pieces != ref.pieces:
            same = next(
                (i for i, (x, y) in enumerate(zip(a.pieces, ref.pieces, strict=False)) if x != y), None
            )
            at = min(len(a.pieces), len(ref.pieces)) if same is None else same
            out[p] = (
                f"{len(a.pieces)} tokens, not the reference's {len(ref.pieces)}; first difference at {at}"
            )
        elif a.finish != ref.finish or a.usage != ref.usage or len(a.ids) != 1:
            out[p] = f"finish {a.finish} usage {a.usage} ids {a.ids}; reference {ref.finish} {ref.usage}"
    return out


class Load:
    """``workers`` clients, each sending requests of ``want``'s prompts in turn, back to back,
    until stopped: streamed (``stream``) or not. Each answer must be ``want[prompt]`` (the
    fault-free one, got the same way) token for token; ``failed`` says how each was not."""

    def __init__(
        self, client: openai.OpenAI, want: dict[str, Answer], max_tokens: int, stream: bool, workers: int = 1
    ) -> None:
        self.client, self.want, self.max_tokens, self.stream = client, want, max_tokens, stream
        self.ok = 0
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(workers)]

    def _run(self, worker: int) -> None:
        prompts = list(self.want)
        i = worker * 7
        while not self._stop.is_set():
            p = prompts[i % len(prompts)]
            i += 1
            try:
                got = (stream_chat if self.stream else whole_chat)(self.client, p, self.max_tokens)
            except Exception as exc:
                failed: str | None = f"{type(exc).__name__}: {exc}"
            else:
                failed = differences({p: got}, {p: self.want[p]}).get(p)
            with self._lock:
                if failed is None:
                    self.ok += 1
                else:
                    self.failed.append(f"{p!r}: {failed}")
            if failed is not None:
                self._stop.wait(0.05)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def wait_served(self, more: int, timeout: float = 60) -> None:
        """Until ``more`` requests more than now were answered (whatever they answered)."""
        base = self.ok + len(self.failed)
        wait_until(
            lambda: self.ok + len(self.failed) >= base + more, timeout, f"{more} more requests answered"
        )


def whole_reference(client: openai.OpenAI, prompts: list[str], max_tokens: int) -> dict[str, Answer]:
    return {p: whole_chat(client, p, max_tokens) for p in prompts}


class Probe:
    """What the tests read off a ``motor up`` cluster."""

    def __init__(self, c: Cluster) -> None:
        self.c = c

    def table(self) -> dict[str, Any]:
        return self.c.call(self.c.grpc(COORDINATOR), "motor.v1.Coordinator/ListInstances")

    def available(self) -> list[dict[str, Any]]:
        return self.table().get("available", [])

    def decodes(self) -> list[dict[str, Any]]:
        """The decode instances the Coordinator routes to, by id."""
        return sorted((i for i in self.available() if i["role"] == "ROLE_DECODE"), key=lambda i: int(i["id"]))

    def wait_serving(self, prefill: int, decode: int, timeout: float = 60) -> None:
        def all_there() -> bool:
            roles = [i["role"] for i in self.available()]
            return roles.count("ROLE_PREFILL") == prefill and roles.count("ROLE_DECODE") == decode

        wait_until(all_there, timeout, "every instance routable", retry=(CallFailed,), every=0.1)

    def running(self, port: int) -> float:
        """Requests the engine on ``port`` is serving now (its ``vllm:num_requests_running``)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        m = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.M)
        assert m is not None, "no vllm:num_requests_running"
        return float(m.group(1))

    def generated(self, port: int) -> float:
        """Output tokens the engine on ``port`` has sent (its ``vllm:generation_tokens_total``)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        m = re.search(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)
        assert m is not None, "no vllm:generation_tokens_total"
        return float(m.group(1))

    def wait_running(self, port: int, n: int) -> None:
        """Until the engine on ``port`` serves at least ``n`` requests."""
        wait_until(lambda: self.running(port) >= n, 30, f"{n} requests on the engine on {port}", every=0.05)

    def back(self, instance_id: str, old_pid: int) -> dict[str, Any] | None:
        """The instance once it is routable again with other engine processes (a relaunch)
        and not draining; None until then."""
        table = self.table()
        if instance_id in table.get("draining_ids", []):
            return None
        for i in table.get("available", []):
            if i["id"] == instance_id and int(i["endpoints"][0].get("pid", 0)) not in (0, old_pid):
                return i
        return None

    def wait_back(self, instance_id: str, old_pid: int, timeout: float = 60) -> dict[str, Any]:
        return wait_until(
            lambda: self.back(instance_id, old_pid),
            timeout,
            f"instance {instance_id} routable again with new engine processes",
            retry=(CallFailed,),
            every=0.1,
        )

    def migrations(self) -> dict[tuple[str, str], float]:
        """The Coordinator's migrations counter, {(reason, outcome): n} where n > 0."""
        m = scrape(f"{self.c.base_url}/metrics")
        return {
            (s.labels["reason"], s.labels["outcome"]): s.value
            for s in m.samples
            if s.name == MIGRATIONS and s.value
        }

    def coordinator_lines(self, event: str) -> list[str]:
        return [s for s in self.c.proc.lines if s.startswith("[coordinator") and f"event={event} " in s]


def kill_engine(instance: dict[str, Any]) -> int:
    """SIGKILL the instance's engine process group (its endpoint's pid is the group's id);
    returns that pid."""
    pgid = int(instance["endpoints"][0]["pid"])
    os.killpg(pgid, signal.SIGKILL)
    return pgid


def outcomes(counted: dict[tuple[str, str], float], *wanted: str) -> float:
    """How many migrations ended with one of ``wanted`` outcomes, over every reason."""
    return sum(n for (_, outcome), n in counted.items() if outcome in wanted)
