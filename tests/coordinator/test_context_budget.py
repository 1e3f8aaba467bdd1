"""The context budget (coordinator.clamp_max_tokens) in pieces: the arithmetic and the body
rewrite, the context of a model's routes, the engines' /v1/models answers, the prompt count, and
one process's budget following a routing view against small fake engines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import generate_latest

from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.common.enums import DECODE, PD_VLLM, PREFILL, UNION
from motor_mesh.common.http_errors import OpenAIError
from motor_mesh.common.tokenizer import Builtin, HfTokenizer, sim_chat_text
from motor_mesh.coordinator import context_budget as cb
from motor_mesh.coordinator.bodies import loads, parse_request
from motor_mesh.coordinator.kv.prompt import Tokenizers, Tokens
from motor_mesh.coordinator.metrics import Metrics
from motor_mesh.coordinator.routes import DownCount, ModelRoutes, PdGroup, RoutingView, Target
from motor_mesh.gen.motor.v1 import common_pb2 as c
from motor_mesh.simengine.openai_api import parse_request as sim_parse
from tests.metrics import Scrape
from tests.poll import until
from tests.ports import reserved_port
from tests.tokenizers import llama3_dir

MODEL = "motor-sim"
CHAT = {"messages": [{"role": "user", "content": "one two three"}]}
COMPLETION = {"prompt": "one two three"}


def limits(req: dict[str, Any], chat: bool, context: int, n: int, exact: bool = True) -> dict[str, int]:
    return cb.plan(req, chat, context, n, exact)


# -- the arithmetic -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_a_chat_limit_over_the_room_is_lowered_to_it(name: str) -> None:
    assert limits({**CHAT, name: 1000}, True, 64, 10) == {name: 54}
    assert limits({**CHAT, name: 54}, True, 64, 10) == {}  # exactly fits
    assert limits({**CHAT, name: 5}, True, 64, 10) == {}


def test_a_chat_with_both_limits_has_each_one_over_lowered() -> None:
    req = {**CHAT, "max_completion_tokens": 1000, "max_tokens": 20}
    assert limits(req, True, 64, 10) == {"max_completion_tokens": 54}
    req = {**CHAT, "max_completion_tokens": 1000, "max_tokens": 2000}
    assert limits(req, True, 64, 10) == {"max_completion_tokens": 54, "max_tokens": 54}


def test_a_chat_without_a_limit_gets_the_room_it_runs_to_anyway() -> None:
    assert limits(CHAT, True, 64, 10) == {"max_tokens": 54}
    assert limits({**CHAT, "max_tokens": None}, True, 64, 10) == {"max_tokens": 54}


def test_a_completion_without_a_limit_keeps_the_default_of_16_unless_less_fits() -> None:
    assert limits(COMPLETION, False, 64, 10) == {}
    assert limits(COMPLETION, False, 64, 48) == {}  # 16 fit
    assert limits(COMPLETION, False, 64, 50) == {"max_tokens": 14}
    # max_completion_tokens is no field of a completion: it neither counts nor is set
    assert limits({**COMPLETION, "max_completion_tokens": 1000}, False, 64, 10) == {}
    assert limits({**COMPLETION, "max_tokens": 1000}, False, 64, 10) == {"max_tokens": 54}


@pytest.mark.parametrize("chat", [True, False])
def test_a_prompt_that_fills_the_context_is_refused_naming_the_numbers(chat: bool) -> None:
    req = CHAT if chat else COMPLETION
    for n in (64, 65, 1000):
        with pytest.raises(OpenAIError) as err:
            limits({**req, "max_tokens": 8}, chat, 64, n)
        e = err.value
        assert (e.status, e.type, e.code) == (400, "invalid_request_error", "context_length_exceeded")
        assert e.param == ("messages" if chat else "prompt")
        assert "maximum context length is 64 tokens" in e.message and f"resulted in {n} tokens" in e.message
    assert limits(req, chat, 64, 63) in ({"max_tokens": 1}, {})  # one token of room is room


def test_an_estimate_lowers_a_given_limit_but_never_refuses_nor_adds_one() -> None:
    assert limits({**CHAT, "max_tokens": 1000}, True, 64, 10, exact=False) == {"max_tokens": 54}
    assert limits(CHAT, True, 64, 10, exact=False) == {}
    assert limits(COMPLETION, False, 64, 60, exact=False) == {}
    assert limits({**CHAT, "max_tokens": 8}, True, 64, 100, exact=False) == {}  # the engine decides


@pytest.mark.parametrize("bad", ["100", 0, -3, True, 12.5, [1], {"n": 1}])
def test_a_limit_that_is_not_a_count_is_left_to_the_engine(bad: Any) -> None:
    assert limits({**CHAT, "max_tokens": bad}, True, 64, 10) == {}
    assert limits({**CHAT, "max_completion_tokens": bad, "max_tokens": 1000}, True, 64, 10) == {}


# -- the rewrite ----------------------------------------------------------------------------------


def test_an_added_limit_is_spliced_into_the_clients_bytes() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    req, raw = parse_request(raw, 64)
    new, body = cb.rewrite(req, raw, {"max_tokens": 54})
    assert body.startswith(raw.strip()[:-1])  # the client's bytes as they were, then the field
    assert loads(body) == new == {**req, "max_tokens": 54}
    assert "max_tokens" not in req  # the parsed request is not changed in place


def test_a_lowered_limit_replaces_every_copy_of_the_field() -> None:
    # JSON keeps the last of duplicate keys (and may spell a key with escapes): the body is
    # written again from the parsed request, so no copy of the old value reaches an engine.
    raw = b'{"max_tokens": 5, "prompt": "x", "max_tok\\u0065ns": 9000}'
    req, raw = parse_request(raw, 64)
    new, body = cb.rewrite(req, raw, {"max_tokens": 54})
    assert loads(body) == new == {"prompt": "x", "max_tokens": 54}
    assert b"9000" not in body and body.count(b"max_tokens") == 1


def test_no_limits_no_change() -> None:
    req, raw = {"prompt": "x"}, b'{"prompt": "x"}'
    assert cb.rewrite(req, raw, {}) == (req, raw)


# -- the context of a model's routes --------------------------------------------------------------


def target(iid: int, role: int, *ports: int, pid: int = 0) -> Target:
    inst = c.Instance(
        id=iid,
        role=role,
        job_name=f"job-{iid}",
        model_name=MODEL,
        engine_type=c.ENGINE_TYPE_SIM,
        endpoints=[c.Endpoint(host="127.0.0.1", port=p, id=j, pid=pid) for j, p in enumerate(ports)],
    )
    return Target(inst, DownCount())


def test_the_context_is_the_smallest_known_length_of_every_instance() -> None:
    p, d = target(1, PREFILL, 1001), target(2, DECODE, 1002, 1003)
    u = target(3, UNION, 1004)
    routes = ModelRoutes(pd=(PdGroup(PD_VLLM, (p,), (d,)),), union=(u,))
    assert cb.context_of(routes, {}) is None  # nothing known: nothing constrains
    assert cb.context_of(routes, {p.endpoints[0]: 4096}) == 4096  # the others are not known yet
    lengths = {p.endpoints[0]: 4096, d.endpoints[0]: 8192, d.endpoints[1]: 2048, u.endpoints[0]: 3000}
    assert cb.context_of(routes, lengths) == 2048
    lengths[d.endpoints[1]] = 9000
    assert cb.context_of(routes, lengths) == 3000
    assert cb.context_of(ModelRoutes(prefill_only=(p,)), lengths) == 4096


# -- what engines answer in /v1/models ------------------------------------------------------------


def models_body(*cards: Any) -> bytes:
    return json.dumps({"object": "list", "data": list(cards)}).encode()


def test_max_model_len_as_vllm_and_sglang_report_it() -> None:
    vllm = models_body(
        {"id": "m", "object": "model", "root": "/models/m", "parent": None, "max_model_len": 32768},
        {"id": "lora-a", "object": "model", "root": "/adapters/a", "parent": "m", "max_model_len": 32768},
    )
    assert cb.max_model_len_of(vllm, "m") == 32768
    sglang = models_body({"id": "m", "object": "model", "owned_by": "sglang", "max_model_len": 4096})
    assert cb.max_model_len_of(sglang, "m") == 4096
    # The instance's own model first; a name the engine does not list: the smallest listed.
    two = models_body({"id": "a", "max_model_len": 100}, {"id": "b", "max_model_len": 50})
    assert cb.max_model_len_of(two, "a") == 100
    assert cb.max_model_len_of(two, "other") == 50
    odd = models_body({"id": ["not", "a", "name"], "max_model_len": 70}, {"max_model_len": 90}, "card")
    assert cb.max_model_len_of(odd, "m") == 70


@pytest.mark.parametrize(
    "body",
    [
        models_body({"id": "m", "max_model_len": None}),  # SGLang before it filled the field in
        models_body({"id": "m"}),  # an engine that does not say
        models_body({"id": "m", "max_model_len": "4096"}),
        models_body({"id": "m", "max_model_len": 0}),
        b'{"object": "list"}',
        b"[]",
        b"not json",
    ],
)
def test_an_answer_without_a_usable_length_says_none(body: bytes) -> None:
    assert cb.max_model_len_of(body, "m") is None


# -- counting the prompt ---------------------------------------------------------------------------


async def test_the_prompt_is_counted_as_the_simulated_engine_counts_it() -> None:
    tokens = Tokens(Builtin(), sim=True)
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]}
    n, prompt = await cb.count(tokens, chat, True, 100) or (0, None)
    assert n == len(sim_chat_text([("system", "be brief"), ("user", "a b c")]).split()) == 7
    assert [n] == sim_parse(chat, True, Builtin()).prompt_tokens  # the engine's own count
    assert prompt is not None and prompt.n == 7
    # A batch: each prompt is a sequence of its own, the longest counts; ids count as they are.
    batch = {"prompt": ["a b", "a b c d e", [1, 2, 3]]}
    counted = await cb.count(tokens, batch, False, 100)
    assert counted is not None and counted[0] == 5 and counted[1].n == 2  # (the first prompt's)
    assert max(sim_parse({"prompt": ["a b", "a b c d e"]}, False, Builtin()).prompt_tokens) == 5
    assert (await cb.count(tokens, {"prompt": [5, 6, 7, 8]}, False, 100) or (0,))[0] == 4
    # What the tokenizer cannot read is no count: the estimate takes over.
    assert await cb.count(tokens, {"prompt": []}, False, 100) is None
    assert await cb.count(tokens, {"messages": "hi"}, True, 100) is None
    assert await cb.count(tokens, {"prompt": ["a", {"x": 1}]}, False, 100) is None


async def test_a_long_prompt_is_counted_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = []
    real = asyncio.to_thread

    async def spy(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        threads.append(fn)
        return await real(fn, *args, **kw)

    monkeypatch.setattr(asyncio, "to_thread", spy)
    tokens = Tokens(Builtin(), sim=True)
    words = "w " * 40_000
    counted = await cb.count(tokens, {"prompt": words}, False, len(words) + 20)
    assert counted is not None and counted[0] == 40_000
    assert threads  # the built-in tokenizer encodes in Python: a long body goes to a thread
    threads.clear()
    assert (await cb.count(tokens, {"prompt": "a b"}, False, 20) or (0,))[0] == 2
    assert not threads


async def test_a_real_tokenizer_counts_the_rendered_chat_template() -> None:
    hf = HfTokenizer(llama3_dir() + "/tokenizer.json")
    tokens = Tokens(hf, sim=False)
    messages = [{"role": "user", "content": "What is the capital of France? " * 100}]
    text = hf.chat_text(messages)
    assert text is not None
    counted = await cb.count(tokens, {"messages": messages}, True, 4000)
    assert counted is not None and counted[0] == len(hf.encode(text, special=False)) > 700


def test_the_estimate_of_a_batch_is_its_longest_prompt() -> None:
    assert cb.estimate({"prompt": ["x" * 40, "x" * 400]}, False) == 101
    assert cb.estimate({"prompt": "x" * 400}, False) == 101
    assert cb.estimate({"messages": [{"role": "user", "content": "x" * 40}]}, True) == 11


# -- one process's budget, against fake engines ----------------------------------------------------


class FakeEngine:
    """An engine's /v1/models on a port of its own, answering ``body`` (None: a 503)."""

    def __init__(self, body: bytes | None) -> None:
        self.body = body
        self.asked = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        self.asked += 1
        if self.body is None:
            return web.Response(status=503)
        return web.Response(body=self.body, content_type="application/json")


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeEngine] = []

    async def start(body: bytes | None, port: int = 0) -> FakeEngine:
        e = await FakeEngine(body).start(port)
        started.append(e)
        return e

    yield start
    for e in started:
        await e.stop()


class Holder:
    """The routing view a budget follows, swapped by the test."""

    def __init__(self) -> None:
        self.view = RoutingView()

    def set(self, *targets: Target) -> ModelRoutes:
        p = tuple(t for t in targets if t.role == PREFILL)
        d = tuple(t for t in targets if t.role == DECODE)
        routes = ModelRoutes(pd=(PdGroup(PD_VLLM, p, d),))
        self.view = RoutingView(self.view.revision + 1, {MODEL: routes}, targets, True)
        return routes


def exposition(metrics: Metrics) -> Scrape:
    metrics.flush()
    return Scrape(generate_latest(metrics.registry).decode())


def known(metrics: Metrics) -> float:
    return exposition(metrics).value("motor_coordinator_context_lengths_known")


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cb, "FOLLOW_S", 0.02)
    monkeypatch.setattr(cb, "RETRY_S", 0.05)
    monkeypatch.setattr(cb, "RETRY_MAX_S", 0.1)


async def test_the_budget_reads_each_endpoint_once_as_it_joins_and_again_when_relaunched(
    fakes: Callable[..., Any], metrics: Metrics
) -> None:
    p = await fakes(models_body({"id": MODEL, "max_model_len": 100}))
    d = await fakes(models_body({"id": MODEL, "max_model_len": 60}))
    holder = Holder()
    budget = cb.ContextBudget(CoordinatorConfig(), lambda: holder.view, metrics)
    budget.start()
    try:
        routes = holder.set(target(1, PREFILL, p.port, pid=11), target(2, DECODE, d.port, pid=12))
        await until(lambda: budget.context(routes) == 60, 5)
        assert known(metrics) == 2
        # The table changes (another instance joins, nothing else): no endpoint is read twice.
        holder.set(*holder.view.targets, target(3, DECODE, d.port, pid=12))
        await until(lambda: d.asked == 2, 5)  # (instance 3's endpoint is a new one)
        seen = budget.rounds
        await until(lambda: budget.rounds >= seen + 2, 5)  # a whole round more: nothing else asked
        assert (p.asked, d.asked) == (1, 2)
        # The prefill engine is relaunched (a new pid: a new endpoint) with a smaller context.
        p.body = models_body({"id": MODEL, "max_model_len": 40})
        routes = holder.set(target(1, PREFILL, p.port, pid=21), *holder.view.targets[1:])
        await until(lambda: budget.context(routes) == 40, 5)
        assert p.asked == 2
        # An engine that leaves the table no longer counts.
        routes = holder.set(*holder.view.targets[1:], target(4, PREFILL, d.port, pid=12))
        await until(lambda: budget.context(routes) == 60, 5)
    finally:
        await budget.stop()
    assert known(metrics) == 0


async def test_an_unreachable_engine_does_not_constrain_until_it_answers(
    fakes: Callable[..., Any], metrics: Metrics
) -> None:
    d = await fakes(models_body({"id": MODEL, "max_model_len": 60}))
    failing = await fakes(None)  # 503 first
    holder = Holder()
    port = reserved_port()  # nothing listens there yet
    budget = cb.ContextBudget(CoordinatorConfig(), lambda: holder.view, metrics)
    budget.start()
    try:
        routes = holder.set(
            target(1, PREFILL, port), target(2, DECODE, d.port), target(3, DECODE, failing.port)
        )
        await until(lambda: budget.context(routes) == 60, 5)
        await until(lambda: failing.asked >= 2, 5)  # tried again, after a delay
        assert known(metrics) == 1
        failing.body = models_body({"id": MODEL, "max_model_len": 50})
        await until(lambda: budget.context(routes) == 50, 5)
        late = await fakes(models_body({"id": MODEL, "max_model_len": 30}), port)
        await until(lambda: budget.context(routes) == 30, 5)
        assert late.asked == 1 and known(metrics) == 3
    finally:
        await budget.stop()


async def test_an_engine_that_does_not_say_is_not_asked_again(
    fakes: Callable[..., Any], metrics: Metrics
) -> None:
    silent = await fakes(models_body({"id": MODEL}))
    holder = Holder()
    budget = cb.ContextBudget(CoordinatorConfig(), lambda: holder.view, metrics)
    budget.start()
    try:
        routes = holder.set(target(1, PREFILL, silent.port), target(2, DECODE, silent.port))
        await until(lambda: silent.asked == 2, 5)
        seen = budget.rounds
        await until(lambda: budget.rounds >= seen + 2, 5)  # a whole round more: not asked again
        assert silent.asked == 2 and budget.context(routes) is None
        # Nothing known: a request passes as it came, without being counted.
        req = {"model": MODEL, "messages": [{"role": "user", "content": "x " * 1000}], "max_tokens": 10**6}
        raw = json.dumps(req).encode()
        assert await budget.fit(req, raw, True, routes) == (req, raw, None)
    finally:
        await budget.stop()


async def test_fit_clamps_refuses_and_counts(fakes: Callable[..., Any], metrics: Metrics) -> None:
    e = await fakes(models_body({"id": MODEL, "max_model_len": 32}))
    holder = Holder()
    tokenizers = Tokenizers({}, "kv")  # as kv_aware's: the prompt is handed on
    budget = cb.ContextBudget(CoordinatorConfig(), lambda: holder.view, metrics, tokenizers)
    budget.start()
    try:
        routes = holder.set(target(1, PREFILL, e.port), target(2, DECODE, e.port))
        await until(lambda: budget.context(routes) == 32 and tokenizers.get(MODEL, c.ENGINE_TYPE_SIM), 5)
        req = {"model": MODEL, "messages": [{"role": "user", "content": "a b c d e"}], "max_tokens": 1000}
        new, raw, prompt = await budget.fit(req, json.dumps(req).encode(), True, routes)
        assert new["max_tokens"] == loads(raw)["max_tokens"] == 32 - 6
        assert prompt is not None and prompt.n == 6
        new, raw, _ = await budget.fit({**req, "max_tokens": 3}, b'{"max_tokens": 3}', True, routes)
        assert new["max_tokens"] == 3 and raw == b'{"max_tokens": 3}'  # fits: the same bytes
        del req["max_tokens"]
        new, _, _ = await budget.fit(req, json.dumps(req).encode(), True, routes)
        assert new["max_tokens"] == 26
        long = {"model": MODEL, "messages": [{"role": "user", "content": "w " * 40}]}
        with pytest.raises(OpenAIError) as err:
            await budget.fit(long, json.dumps(long).encode(), True, routes)
        assert err.value.code == "context_length_exceeded" and "resulted in 41 tokens" in err.value.message
        m = exposition(metrics)
        assert m.value("motor_coordinator_max_tokens_clamped_total", why="over") == 1
        assert m.value("motor_coordinator_max_tokens_clamped_total", why="unset") == 1
        assert m.value("motor_coordinator_context_length_exceeded_total") == 1
        # Off and on again (a reload): every length is read afresh.
        budget.pause()
        assert budget.context(routes) is None
        budget.start()
        await until(lambda: budget.context(routes) == 32, 5)
        assert e.asked == 4
    finally:
        await budget.stop()


async def test_without_kv_aware_the_prompt_is_not_handed_on(
    fakes: Callable[..., Any], metrics: Metrics
) -> None:
    e = await fakes(models_body({"id": MODEL, "max_model_len": 32}))
    holder = Holder()
    budget = cb.ContextBudget(CoordinatorConfig(), lambda: holder.view, metrics)
    budget.start()
    try:
        routes = holder.set(target(1, PREFILL, e.port), target(2, DECODE, e.port))
        await until(
            lambda: budget.context(routes) == 32 and budget._tokenizers.get(MODEL, c.ENGINE_TYPE_SIM), 5
        )
        req = {"model": MODEL, "prompt": "a b c", "max_tokens": 100}
        new, _, prompt = await budget.fit(req, json.dumps(req).encode(), False, routes)
        assert new["max_tokens"] == 29 and prompt is None
    finally:
        await budget.stop()
