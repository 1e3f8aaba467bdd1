"""kv_aware's load gate: a prefix every request shares does not pile the traffic onto the engine
that cached it first, and prefix reuse still works where loads allow it.

The routing scenarios simulate a router in front of four prefill instances: requests arrive with
a fixed number in flight (each completes when ``DEPTH`` later requests have arrived), an
instance's load is the tokens its requests in flight leave to compute (what the Coordinator
charges a prefill: ``pd._prefill_work``), and the engine that takes a request caches its prompt
at once (the index learns its blocks). What is asserted is where the requests went."""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Hashable, MutableSequence, Sequence

import pytest

from motor_mesh.common.enums import PREFILL
from motor_mesh.coordinator.kv.policy import KvAware
from motor_mesh.coordinator.kv.prompt import Prompt, PromptView, place
from motor_mesh.coordinator.metrics import Metrics, use_own_process
from motor_mesh.coordinator.routes import DownCount, Target, Upstream
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.coordinator.conftest import MODEL

BS = 16  # the engines' block size
N = 4  # prefill instances
DEPTH = 8  # requests in flight
REQUESTS = 2000
GATE = 1.5  # coordinator.kv_load_gate's default


def targets(n: int) -> list[Target]:
    """``n`` prefill instances of one routing table, one endpoint each, ids from 1."""
    downs = DownCount()
    return [
        Target(
            c.Instance(
                id=i,
                role=PREFILL,
                job_name=f"job-{i}",
                model_name=MODEL,
                engine_type=c.ENGINE_TYPE_SIM,
                endpoints=[c.Endpoint(host="127.0.0.1", port=10000 + i, pid=4000 + i)],
            ),
            downs,
        )
        for i in range(1, n + 1)
    ]


class Blocks:
    """A KV index that knows what it was told: per endpoint, the chained hashes of the blocks of
    the prompts it took (each hash stands for the whole prefix up to its block)."""

    def __init__(self) -> None:
        self.held: dict[Hashable, set[int]] = {}

    def learn(self, ep: Upstream, prompt: PromptView) -> None:
        """The engine behind ``ep`` computed ``prompt``: it caches its full blocks."""
        self.held.setdefault(ep.base, set()).update(prompt.hashes(BS))

    def hold(self, t: Target, tokens: Sequence[int]) -> None:
        self.learn(t.endpoints[0], Prompt(list(tokens)))

    # What kv_aware reads of an index (policy.IndexView).

    def holder(self, prompt: PromptView, endpoints: Sequence[Upstream]) -> tuple[int, Upstream | None]:
        cached, where = 0, None
        hashes = prompt.hashes(BS)
        for ep in endpoints:
            held = self.held.get(ep.base)
            if not held or ep.down:
                continue
            run = 0
            for h in hashes:
                if h not in held:
                    break
                run += 1
            if run * BS > cached:
                cached, where = run * BS, ep
        return min(cached, prompt.n), where

    def place(self, prompt: PromptView, endpoints: Sequence[Upstream], tally: MutableSequence[int]) -> None:
        place(self.holder, prompt, endpoints, tally)

    def endpoint_blocks(self, ep: Hashable) -> int:
        return len(self.held.get(ep, ()))

    def block_size(self, ep: Hashable) -> int | None:
        return BS if ep in self.held else None


def make(load_gate: float = GATE, gate_topn: int = 0, load_weight: float = 1.0) -> tuple[KvAware, Blocks]:
    use_own_process()  # as a one-process Coordinator does: an earlier test may have left workers' mode on
    index = Blocks()
    return KvAware(index, Metrics().kv, 1.0, load_weight, load_gate=load_gate, gate_topn=gate_topn), index


def route(
    policy: KvAware, index: Blocks, ts: Sequence[Target], prompts: Sequence[Sequence[int]]
) -> Counter[int]:
    """Each prompt routed as it arrives, ``DEPTH`` in flight; how many each instance took."""
    in_flight: deque[tuple[Target, int]] = deque()
    took: Counter[int] = Counter()
    for tokens in prompts:
        while len(in_flight) >= DEPTH:  # the oldest completes
            done, work = in_flight.popleft()
            done.load -= work
            done.legs -= 1
        prompt = Prompt(list(tokens))
        chosen = policy(ts, prompt=prompt)
        assert chosen is not None
        # What the Coordinator charges a prefill: what the engine must compute past its cache.
        work = max(1, prompt.n - prompt.cached)
        chosen.load += work
        chosen.legs += 1
        in_flight.append((chosen, work))
        index.learn(prompt.endpoint or chosen.endpoints[0], prompt)
        took[chosen.id] += 1
    while in_flight:
        done, work = in_flight.popleft()
        done.load -= work
        done.legs -= 1
    return took


def spread(took: Counter[int]) -> float:
    """The busiest instance's requests over the mean per instance."""
    return max(took.values()) / (sum(took.values()) / N)


def distinct_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out, nxt = [], 10**6
    for _ in range(REQUESTS):
        n = rng.randrange(64, 1024)
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


SYSTEM = list(range(1, 1025))  # a 1024-token system prompt every request starts with


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """``SYSTEM``, then a short question of its own (16 to 64 tokens)."""
    rng = random.Random(seed)
    out, nxt = [], 10**6
    for _ in range(REQUESTS):
        n = rng.randrange(16, 65)
        out.append([*SYSTEM, *range(nxt, nxt + n)])
        nxt += n
    return out


def hot_workload(load_gate: float, seed: int) -> Counter[int]:
    """The shared prefix's traffic, after its first request met an idle cluster (a quiet hour):
    one engine cached it before the others saw any of it."""
    random.seed(seed)  # kv_aware's tie-breaks
    policy, index = make(load_gate=load_gate)
    ts = targets(N)
    prompts = shared_prefix_prompts(seed)
    first = route(policy, index, ts, prompts[:1])  # served alone
    (hot,) = first
    took = route(policy, index, ts, prompts[1:])
    took[hot] += 1
    assert all(t.load == 0 and t.legs == 0 for t in ts)
    return took


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_distinct_prompts_spread_evenly(seed: int) -> None:
    random.seed(seed)
    policy, index = make()
    ts = targets(N)
    took = route(policy, index, ts, distinct_prompts(seed))
    assert sum(took.values()) == REQUESTS
    assert spread(took) <= 1.3, took


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_prefix_every_request_shares_does_not_pile_onto_one_engine(seed: int) -> None:
    took = hot_workload(GATE, seed)
    # No engine's load exceeds 1.5 x the mean for long, so the prefix spreads until the engines
    # holding it cannot all be past the gate at once: here three of the four share it (the
    # fourth would have to compute the whole prefix again to join them).
    assert len(took) >= 3 and spread(took) <= 2.0, took
    # The control: the gate off, the engine that cached the prefix first takes nearly all of it.
    hotspot = hot_workload(0.0, seed)
    assert spread(hotspot) > 2.0, hotspot
    assert max(hotspot.values()) > 0.9 * REQUESTS, hotspot


PROMPT = list(range(500, 756))  # 256 tokens, 16 blocks


def test_prefix_reuse_still_wins_under_the_gate() -> None:
    policy, index = make()
    holder, *others = ts = targets(N)
    index.hold(holder, PROMPT)
    for t in ts:
        t.legs, t.load = 2, 100  # balanced
    prompt = Prompt(PROMPT)
    assert policy(ts, prompt=prompt) is holder
    assert prompt.cached == len(PROMPT) and prompt.endpoint is holder.endpoints[0]
    # Busier than the others, within the gate (3 requests in flight, 1.5 x the mean of 2.25 is
    # 3.375): still it.
    holder.legs = 3
    prompt = Prompt(PROMPT)
    assert policy(ts, prompt=prompt) is holder and prompt.cached == len(PROMPT)
    # Past it (4 > 1.5 x 2.5): weighed as if it cached nothing, the request goes elsewhere.
    holder.legs = 4
    prompt = Prompt(PROMPT)
    assert policy(ts, prompt=prompt) in others
    assert prompt.cached == 0 and prompt.endpoint is None
    # The same loads with the gate off: the prefix outweighs the load.
    ungated, index2 = make(load_gate=0.0)
    index2.hold(holder, PROMPT)
    assert ungated(ts, prompt=Prompt(PROMPT)) is holder
    # All idle: nothing is gated; nor is one request in flight, however the others idle.
    for t in ts:
        t.legs = t.load = 0
    assert policy(ts, prompt=Prompt(PROMPT)) is holder
    holder.legs, holder.load = 1, 100
    assert policy(ts, prompt=Prompt(PROMPT)) is holder


def test_gate_topn_weighs_the_cache_of_the_least_loaded_only() -> None:
    a, b, c = ts = targets(3)
    a.load, b.load, c.load = 10, 5, 20
    a.legs, b.legs, c.legs = 2, 1, 3  # mean 2: the 1.5 gate limits none but c
    # a holds the prompt: 0 + 10 against b's 256 + 5.
    policy, index = make(gate_topn=0)
    index.hold(a, PROMPT)
    assert policy(ts, prompt=Prompt(PROMPT)) is a
    # Only the least loaded (b) is weighed for its cache: a costs 256 + 10, b 256 + 5.
    top1, index = make(gate_topn=1)
    index.hold(a, PROMPT)
    prompt = Prompt(PROMPT)
    assert top1(ts, prompt=prompt) is b and prompt.cached == 0
    top1_only, index_only = make(load_gate=0.0, gate_topn=1)  # the top-n limit alone
    index_only.hold(a, PROMPT)
    assert top1_only(ts, prompt=Prompt(PROMPT)) is b
    # The least loaded holding the prompt is credited with it.
    index.hold(b, PROMPT)
    prompt = Prompt(PROMPT)
    assert top1(ts, prompt=prompt) is b
    assert prompt.cached == len(PROMPT) and prompt.endpoint is b.endpoints[0]
    # The two least loaded (a and b) are weighed: a's cache counts again.
    top2, index = make(gate_topn=2)
    index.hold(a, PROMPT)
    assert top2(ts, prompt=Prompt(PROMPT)) is a
    # As few in flight as the fewest counts as one of them; all idle, none is limited.
    b.load, b.legs = 10, 2
    assert top1(ts, prompt=Prompt(PROMPT)) in (a, b)
    prompt = Prompt(PROMPT)
    assert top1_only(ts, prompt=prompt) is a and prompt.cached == len(PROMPT)
    a.load = b.load = c.load = a.legs = b.legs = c.legs = 0
    assert top1_only(ts, prompt=Prompt(PROMPT)) is a


def test_a_gated_candidate_chosen_anyway_is_not_credited_with_its_cache() -> None:
    # Weighed by the prefix alone (load weight 0) a gated a ties b, whose cache is fuller: a
    # takes it, and the prompt is not counted as cached there.
    policy, index = make(load_gate=0.0, gate_topn=1, load_weight=0.0)
    a, b = ts = targets(2)
    index.hold(a, PROMPT)
    index.hold(b, range(5000, 5512))  # 32 blocks of another prompt
    a.load, b.load = 6, 5
    a.legs, b.legs = 3, 2
    prompt = Prompt(PROMPT)
    assert policy(ts, prompt=prompt) is a
    assert prompt.cached == 0 and prompt.endpoint is None


def test_the_lone_candidate_is_taken_with_its_cache() -> None:
    policy, index = make(gate_topn=1)
    a, b = ts = targets(2)
    index.hold(a, PROMPT)
    a.load, b.load = 1000, 0
    a.legs = 5
    prompt = Prompt(PROMPT)
    assert policy(ts, exclude={b.id}, prompt=prompt) is a
    assert prompt.cached == len(PROMPT) and prompt.endpoint is a.endpoints[0]


def test_gate_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        make(load_gate=0.5)
    with pytest.raises(ValueError):
        make(gate_topn=-1)
