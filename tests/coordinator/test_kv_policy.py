"""kv_aware: the instance whose engine holds the longest prefix of the prompt, weighed against its
load, with the KV index fed the events engines publish and targets built from the table's
Instance messages, as the Coordinator builds them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from motor_mesh.common.enums import DECODE, PREFILL, UNION, Role
from motor_mesh.coordinator.kv.index import KvIndex
from motor_mesh.coordinator.kv.policy import KvAware
from motor_mesh.coordinator.kv.prompt import Prompt
from motor_mesh.coordinator.kv.shared import SharedReader, SharedWriter
from motor_mesh.coordinator.kv.wire import BlockHash, Stored
from motor_mesh.coordinator.metrics import Metrics, use_own_process
from motor_mesh.coordinator.pd import _endpoint
from motor_mesh.coordinator.policies import least_load
from motor_mesh.coordinator.routes import DownCount, Target
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.coordinator.conftest import MODEL
from tests.coordinator.test_kv_shared import follow

BS = 4
PROMPT = list(range(500, 524))  # six blocks
DRAWS = 200


def instance(iid: int, role: Role, *ports: int) -> c.Instance:
    """An instance whose engines publish KV events (port + 2000, replay port + 2001)."""
    eps = [
        c.Endpoint(
            host="127.0.0.1",
            port=p,
            id=j,
            pid=4000 + p,
            kv_events_port=p + 2000,
            kv_events_replay_port=p + 2001,
        )
        for j, p in enumerate(ports)
    ]
    return c.Instance(
        id=iid,
        role=role,
        job_name=f"job-{iid}",
        model_name=MODEL,
        engine_type=c.ENGINE_TYPE_SIM,
        endpoints=eps,
    )


def targets(*endpoint_counts: int, role: Role = DECODE, first: int = 1) -> list[Target]:
    """One target per count, with that many endpoints (DP ranks), ids from ``first``, one table's."""
    downs = DownCount()
    out = []
    for i, n in enumerate(endpoint_counts, first):
        base = 10000 + 10 * i
        out.append(Target(instance(i, role, *range(base, base + n)), downs))
    return out


def hold(
    index: KvIndex | Shared, t: Target, blocks: int, ep: int = 0, tokens: Sequence[int] = PROMPT
) -> None:
    """The engine behind ``t``'s endpoint ``ep`` stored the first ``blocks`` blocks of ``tokens``
    (its own hashes: any, distinct per endpoint)."""
    key = t.endpoints[ep].base
    hashes: list[BlockHash] = [hash((key, i)) for i in range(blocks)]
    index.apply(key, Stored(hashes, None, list(tokens[: blocks * BS]), BS, "GPU"))


class Shared:
    """The index as an inference worker reads it: a KvIndex mirrored into shared tables."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir()
        self.writer = SharedWriter(str(directory), max_blocks_per_endpoint=1000)
        self.writer.open()
        self.reader = SharedReader(str(directory))
        self.index = KvIndex(1000, self.writer)
        self._installed: set[str] = set()

    def apply(self, key: str, event: Stored) -> None:
        if key not in self._installed:
            self._installed.add(key)
            self.writer.install(key, self.writer.create(key))
            assert follow(self.reader)
        self.index.apply(key, event)

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


# Every test runs against the index in process, and as a worker reads it.
KINDS = ["in process", "shared"]
_made: list[tuple[str, Path, list[Shared]]] = []


@pytest.fixture(autouse=True, params=KINDS)
def index_kind(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[None]:
    kind: str = request.param
    shared: list[Shared] = []
    _made.append((kind, tmp_path, shared))
    yield
    for s in shared:
        s.close()
    _made.pop()


def make(prefix_weight: float = 1.0, load_weight: float = 1.0) -> tuple[KvAware, Any, Metrics]:
    use_own_process()  # as a one-process Coordinator does: an earlier test may have left workers' mode on
    metrics = Metrics()
    kind, tmp, shared = _made[-1]
    if kind == "in process":
        index = KvIndex()
        return KvAware(index, metrics.kv, prefix_weight, load_weight), index, metrics
    s = Shared(tmp / f"index-{len(shared)}")
    shared.append(s)
    return KvAware(s.reader, metrics.kv, prefix_weight, load_weight), s, metrics


def picks(
    policy: KvAware, ts: Sequence[Target], tokens: Sequence[int] = PROMPT, exclude: Collection[int] = ()
) -> Counter[int]:
    """How often each target is chosen for the prompt of ``tokens``, over many draws."""
    out: Counter[int] = Counter()
    for _ in range(DRAWS):
        chosen = policy(ts, exclude, Prompt(list(tokens)))
        assert chosen is not None
        out[chosen.id] += 1
    return out


def test_the_longer_prefix_wins() -> None:
    policy, index, _ = make()
    a, b, cc = ts = targets(1, 1, 1)
    hold(index, a, 2)
    hold(index, b, 5)
    hold(index, cc, 6, tokens=[9, *PROMPT[1:]])  # six blocks of another prompt: no prefix
    prompt = Prompt(PROMPT)
    assert policy(ts, prompt=prompt) is b
    assert prompt.cached == 5 * BS and prompt.endpoint is b.endpoints[0]
    assert picks(policy, ts) == {b.id: DRAWS}
    # A prompt that goes on past the cached blocks matches them just the same.
    longer = [*PROMPT, *range(9000, 9010)]
    assert policy(ts, prompt=(p := Prompt(longer))) is b and p.cached == 5 * BS


def test_enough_load_outweighs_the_prefix() -> None:
    policy, index, _ = make(prefix_weight=1.0, load_weight=1.0)
    a, b = ts = targets(1, 1)
    hold(index, a, 4)  # a: 8 of 24 tokens to prefill; b: all 24
    a.load = 10  # 8 + 10 < 24 + 0
    assert policy(ts, prompt=Prompt(PROMPT)) is a
    a.load = 20  # 8 + 20 > 24
    prompt = Prompt(PROMPT)
    assert policy(ts, prompt=prompt) is b
    assert prompt.cached == 0 and prompt.endpoint is None
    a.load = 16  # 8 + 16 == 24 + 0: equal costs, the emptier cache wins
    assert picks(policy, ts) == {b.id: DRAWS}
    b.load = 5  # b's load counts the same way
    assert picks(policy, ts) == {a.id: DRAWS}
    # The weights scale the two terms: the prefix counts twice here, a's load no longer outweighs.
    heavy, index2, _ = make(prefix_weight=2.0, load_weight=1.0)
    a2, _ = ts2 = targets(1, 1)
    hold(index2, a2, 4)
    a2.load = 20  # 2 * 8 + 20 < 2 * 24
    assert heavy(ts2, prompt=Prompt(PROMPT)) is a2


def test_prefix_weight_zero_is_least_load() -> None:
    policy, index, _ = make(prefix_weight=0.0, load_weight=1.0)
    a, b, cc = ts = targets(1, 1, 1)
    hold(index, a, 6)
    a.load, b.load, cc.load = 5, 1, 9
    assert picks(policy, ts) == {b.id: DRAWS}
    assert least_load(ts) is b
    b.load = 5
    assert picks(policy, ts) == {b.id: DRAWS}  # tied loads: the emptier cache takes new prefixes


def test_nothing_indexed_is_least_load() -> None:
    policy, index, _ = make()
    a, b, cc = ts = targets(1, 1, 1)
    a.load, b.load, cc.load = 7, 3, 3
    assert set(picks(policy, ts)) == {b.id, cc.id}  # ties at random: both chosen
    prompt = Prompt(PROMPT)
    policy(ts, prompt=prompt)
    assert prompt.cached == 0 and prompt.endpoint is None
    # No prompt (no tokenizer yet, an unreadable body) and a prompt too short for one block.
    assert set(picks(policy, ts, tokens=PROMPT[:3])) == {b.id, cc.id}
    assert {policy(ts).id for _ in range(DRAWS)} == {b.id, cc.id}  # type: ignore[union-attr]
    # Blocks of another prompt only: every prefix term is the same, load decides.
    hold(index, a, 6, tokens=list(range(24)))
    assert set(picks(policy, ts)) == {b.id, cc.id}
    assert policy([], prompt=Prompt(PROMPT)) is None


def test_excluded_and_down_are_skipped() -> None:
    policy, index, _ = make()
    a, b, cc = ts = targets(1, 1, 1)
    hold(index, a, 6)
    hold(index, b, 3)
    assert picks(policy, ts, exclude={a.id}) == {b.id: DRAWS}
    assert policy(ts, exclude={1, 2, 3}, prompt=Prompt(PROMPT)) is None
    a.set_down(a.endpoints[0], True)
    try:
        prompt = Prompt(PROMPT)
        assert policy(ts, prompt=prompt) is b and prompt.endpoint is b.endpoints[0]
        b.set_down(b.endpoints[0], True)
        assert picks(policy, ts) == {cc.id: DRAWS}
        # Every candidate down: still one of them (the breaker never leaves a role empty).
        assert policy([a], prompt=Prompt(PROMPT)) is a
    finally:
        a.set_down(a.endpoints[0], False)
        b.set_down(b.endpoints[0], False)


def test_dp_instance_routes_to_the_rank_holding_the_blocks() -> None:
    policy, index, _ = make()
    dp, single = ts = targets(2, 1)
    hold(index, dp, 5, ep=1)  # rank 1 holds the prefix, rank 0 a shorter one
    hold(index, dp, 2, ep=0)
    hold(index, single, 3)
    prompt = Prompt(PROMPT)
    assert policy(ts, prompt=prompt) is dp
    assert prompt.endpoint is dp.endpoints[1] and prompt.cached == 5 * BS
    # The leg goes to that rank every time, not round-robin over the instance's ranks.
    assert {_endpoint(dp, prompt) for _ in range(10)} == {dp.endpoints[1]}
    assert {_endpoint(dp, None) for _ in range(10)} == set(dp.endpoints)
    # Chosen for another instance (a retry elsewhere) or gone down since: the instance's rotation.
    assert _endpoint(single, prompt) is single.endpoints[0]
    dp.set_down(dp.endpoints[1], True)
    try:
        assert _endpoint(dp, prompt) is dp.endpoints[0]
        # A rank that is down holds nothing usable: rank 0's 2 blocks against single's 3.
        again = Prompt(PROMPT)
        assert policy(ts, prompt=again) is single and again.endpoint is single.endpoints[0]
    finally:
        dp.set_down(dp.endpoints[1], False)


def sample(metrics: Metrics, name: str, role: str) -> float:
    value = metrics.registry.get_sample_value(name, {"role": role})
    assert value is not None, name
    return value


def test_metrics_count_prompt_and_cached_tokens_by_role() -> None:
    policy, index, metrics = make()
    decode = targets(1, 1)
    prefill = targets(1, role=PREFILL, first=3)
    union = targets(1, role=UNION, first=4)
    hold(index, decode[0], 3)
    hold(index, prefill[0], 6)
    for _ in range(2):
        policy(decode, prompt=Prompt(PROMPT))  # 24 tokens, 12 cached
    policy(prefill, prompt=Prompt([*PROMPT, 1, 2]))  # 26 tokens, 24 cached
    policy(union, prompt=Prompt(PROMPT[:10]))  # 10 tokens, nothing indexed for it
    policy(union)  # no prompt: nothing to count
    # The request path counts in plain integers: nothing shows before a flush.
    assert sample(metrics, "motor_coordinator_kv_prompt_tokens_total", "decode") == 0
    metrics.flush()
    prompt_total, cached_total = (
        "motor_coordinator_kv_prompt_tokens_total",
        "motor_coordinator_kv_cached_prompt_tokens_total",
    )
    assert sample(metrics, prompt_total, "decode") == 48
    assert sample(metrics, cached_total, "decode") == 24
    assert sample(metrics, prompt_total, "prefill") == 26
    assert sample(metrics, cached_total, "prefill") == 24
    assert sample(metrics, prompt_total, "union") == 10
    assert sample(metrics, cached_total, "union") == 0
    text = generate_latest(metrics.registry).decode()
    assert 'motor_coordinator_kv_cached_prompt_tokens_total{role="prefill"} 24.0' in text


def test_engines_with_different_block_sizes_are_each_matched_at_their_own() -> None:
    policy, index, _ = make()
    a, b = targets(1, 1)
    hold(index, a, 2)  # 8 tokens in blocks of 4
    key = b.endpoints[0].base
    # b's engine caches blocks of 8: its first two hold 16 tokens of the prompt.
    index.apply(key, Stored([hash((key, 0)), hash((key, 1))], None, PROMPT[:16], 8, "GPU"))
    prompt = Prompt(list(PROMPT))
    assert policy([a, b], (), prompt) is b
    assert prompt.cached == 16


def test_a_prefill_of_a_cached_prompt_loads_its_instance_by_what_is_left_to_compute() -> None:
    from types import SimpleNamespace

    from motor_mesh.coordinator.pd import _prefill_work

    policy, index, _ = make()
    a, b = targets(1, 1)
    hold(index, a, 5)  # 20 of the prompt's 24 tokens
    prompt = Prompt(list(PROMPT))
    assert policy([a, b], (), prompt) is a
    call = SimpleNamespace(prompt=prompt, prompt_tokens=99)  # 99: a byte-size estimate
    a.load += _prefill_work(call)  # type: ignore[arg-type]
    assert a.load == 4
    # The next request of the same prefix, while that one is in flight, still goes to a.
    assert picks(policy, [a, b]) == Counter({a.id: DRAWS})
    assert _prefill_work(SimpleNamespace(prompt=None, prompt_tokens=99)) == 99  # type: ignore[arg-type]


def test_new_prefixes_spread_over_the_caches() -> None:
    policy, index, _ = make()
    a, b = ts = targets(1, 1)
    other = list(range(900, 924))
    hold(index, a, 3, tokens=other)  # a caches another prompt's blocks
    # Nobody holds this prompt and both are idle: the engine caching less takes it.
    assert picks(policy, ts) == {b.id: DRAWS}
    hold(index, b, 3, tokens=list(range(700, 724)))
    assert set(picks(policy, ts)) == {a.id, b.id}  # as full as each other: at random
