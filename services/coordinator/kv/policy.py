"""``kv_aware``: the instance whose engine already holds the longest prefix of the prompt,
weighed against its load.

Each candidate's cost is an estimate, in tokens, of the work ahead of this request there::

    prefix_weight * (prompt tokens the engine has not cached) + load_weight * (its in-flight tokens)

and the cheapest wins; among equal costs the instance caching the fewest blocks, then one at
random. What an engine has cached comes from the KV index the engines' own events build
(:mod:`.index`). When no candidate holds any block of the prompt (a cold index, a new prompt, an
engine that publishes no events) every prefix term is equal and the choice is ``least_load``'s,
except that a tie goes to the emptier cache: new prefixes spread over the engines.

The load gate (``coordinator.kv_load_gate``, ``kv_affinity_load_gate_topn``). A prefix every
request shares (a long system prompt) makes the engine that cached it first the cheapest for all
of them: a request there is charged only what it adds to the prefix, so that engine's in-flight
tokens grow by a short suffix per request while every other engine is priced at the whole
prompt, and the traffic piles onto it while the others idle (nor do they ever learn the prefix).
Tokens cannot see that pile (its requests are cheap ones), so the gate counts requests: a
candidate with more than one request in flight, and more than ``load_gate`` times the
candidates' mean, is weighed by load alone, as if it cached nothing: its prefix term is the
whole prompt and, should it still win, the prompt is not credited with its cached tokens
(``prompt.cached`` 0, no endpoint). The next request of that prefix goes to a less busy engine,
which then caches it too. With ``gate_topn`` > 0 only the ``gate_topn`` candidates with the
fewest requests in flight (and any with as few as the last of them) are weighed for their cache,
the others by load alone. A single request in flight never gates (a conversation's next turn,
sent while another client's request is on its engine, still goes where its history is); 0
turns either off. One candidate is taken as it is, gate or not. The requests counted are this
inference worker's own: each worker spreads its share.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Collection, Hashable, MutableSequence, Sequence
from operator import attrgetter
from typing import Protocol

from motor_mesh.common.enums import ROLE_NAMES
from motor_mesh.coordinator.kv.metrics import KvMetrics
from motor_mesh.coordinator.kv.prompt import PromptView
from motor_mesh.coordinator.policies import candidates, least_load
from motor_mesh.coordinator.routes import Target, Upstream

_legs = attrgetter("legs")  # requests in flight (this process's)


class IndexView(Protocol):
    """What kv_aware reads of an index: a :class:`~.index.KvIndex` or a worker's
    :class:`~.shared.SharedReader`."""

    def holder(self, prompt: PromptView, endpoints: Sequence[Upstream]) -> tuple[int, Upstream | None]: ...

    def place(
        self, prompt: PromptView, endpoints: Sequence[Upstream], tally: MutableSequence[int]
    ) -> None: ...

    def endpoint_blocks(self, ep: Hashable) -> int: ...

    def endpoints(self) -> list[Hashable]: ...

    def match(self, hashes: Sequence[int], eps: Collection[Hashable] | None = None) -> dict[Hashable, int]:
        """How many leading blocks of ``hashes`` each endpoint holding any holds."""
        ...

    def block_size(self, ep: Hashable) -> int | None: ...


class KvAware:
    def __init__(
        self,
        index: IndexView,
        metrics: KvMetrics,
        prefix_weight: float,
        load_weight: float,
        load_gate: float = 0.0,
        gate_topn: int = 0,
    ) -> None:
        if load_gate != 0 and not load_gate >= 1:
            raise ValueError(f"load_gate must be 0 (off) or at least 1, not {load_gate!r}")
        if gate_topn < 0:
            raise ValueError(f"gate_topn must be 0 (no limit) or more, not {gate_topn!r}")
        self.index = index
        self.metrics = metrics
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        # The load gate (see the module's doc): a candidate above either bound is weighed by
        # load alone.
        self.load_gate = load_gate
        self.gate_topn = gate_topn
        # What every request's path reads, found once: the lookup and the tallies it adds to,
        # per role.
        self._holder = index.holder
        self._place = index.place
        self._tallies: dict[int, MutableSequence[int]] = {role: metrics.tallies(role) for role in ROLE_NAMES}

    def __call__(
        self, targets: Sequence[Target], exclude: Collection[int] = (), prompt: PromptView | None = None
    ) -> Target | None:
        """The policy (a :data:`~motor_mesh.coordinator.policies.Policy`)."""
        if prompt is None:
            return least_load(targets, exclude)
        if len(targets) == 1 and not exclude:
            # The lone candidate, taken without the filter; one call finds what its endpoints
            # hold, writes it into the prompt and counts it.
            chosen = targets[0]
            tally = self._tallies.get(chosen.role) or self.metrics.tallies(chosen.role)
            self._place(prompt, chosen.endpoints, tally)
            return chosen
        cands = candidates(targets, exclude)
        if not cands:
            return None
        if len(cands) == 1:
            chosen = cands[0]
            self._place(prompt, chosen.endpoints, self._tally(chosen.role))
            return chosen
        chosen = self._cheapest(cands, prompt)
        tally = self._tally(chosen.role)
        tally[0] += prompt.n
        tally[1] += prompt.cached
        return chosen

    def _tally(self, role: int) -> MutableSequence[int]:
        return self._tallies.get(role) or self.metrics.tallies(role)

    def _cheapest(self, cands: Sequence[Target], prompt: PromptView) -> Target:
        pw, lw, n = self.prefix_weight, self.load_weight, prompt.n
        index, holder = self.index, self._holder
        # The load gate: a candidate with more requests in flight than ``limit`` is weighed as
        # if it cached nothing.
        limit: float = math.inf
        gate, topn = self.load_gate, self.gate_topn
        if gate or topn:
            total = sum(map(_legs, cands))
            if total > 1:  # none or one request in flight: nothing gated
                if gate:
                    limit = max(1.0, gate * total / len(cands))
                if 0 < topn < len(cands):
                    # The topn-th fewest (a heap of topn, no sort); ties with it count in.
                    limit = min(limit, max(1, heapq.nsmallest(topn, map(_legs, cands))[-1]))
        best: list[tuple[Target, int, Upstream | None]] = []
        best_cost: tuple[float, int] = (0.0, 0)
        for t in cands:
            load = t.load
            if t.legs > limit:
                cached, where = 0, None
            else:
                cached, where = holder(prompt, t.endpoints)
            # Equal costs (a prompt no engine holds, on idle instances) go to the engine caching
            # the least: new prefixes spread over the caches instead of piling on one by chance.
            cost = (
                pw * (n - cached) + lw * load,
                sum(index.endpoint_blocks(ep.base) for ep in t.endpoints),
            )
            if not best or cost < best_cost:
                best, best_cost = [(t, cached, where)], cost
            elif cost == best_cost:
                best.append((t, cached, where))
        t, cached, where = best[0] if len(best) == 1 else random.choice(best)
        prompt.cached = cached
        prompt.endpoint = where
        return t
