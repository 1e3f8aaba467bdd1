"""``kv_aware``: the instance whose engine already holds the longest prefix of the prompt,
weighed against its load.

Each candidate's cost is an estimate, in tokens, of the work ahead of this request there::

    prefix_weight * (prompt tokens the engine has not cached) + load_weight * (its in-flight tokens)

and the cheapest wins; among equal costs the instance caching the fewest blocks, then one at
random. What an engine has cached comes from the KV index the engines' own events build
(:mod:`.index`). When no candidate holds any block of the prompt (a cold index, a new prompt, an
engine that publishes no events) every prefix term is equal and the choice is ``least_load``'s,
except that a tie goes to the emptier cache: new prefixes spread over the engines.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Hashable, MutableSequence, Sequence
from typing import Protocol

from motor_mesh.common.enums import ROLE_NAMES
from motor_mesh.coordinator.kv.metrics import KvMetrics
from motor_mesh.coordinator.kv.prompt import PromptView
from motor_mesh.coordinator.policies import Policy, candidates, least_load
from motor_mesh.coordinator.routes import Target, Upstream


class IndexView(Protocol):
    """What kv_aware reads of an index: a :class:`~.index.KvIndex` or a worker's
    :class:`~.shared.SharedReader`."""

    def holder(self, prompt: PromptView, endpoints: Sequence[Upstream]) -> tuple[int, Upstream | None]: ...

    def place(
        self, prompt: PromptView, endpoints: Sequence[Upstream], tally: MutableSequence[int]
    ) -> None: ...

    def endpoint_blocks(self, ep: Hashable) -> int: ...

    def block_size(self, ep: Hashable) -> int | None: ...

    def chooser(
        self,
        tallies: dict[int, MutableSequence[int]],
        general: Policy,
        prefix_weight: float,
        load_weight: float,
    ) -> Policy | None:
        """``general`` with its usual case (nothing excluded, no endpoint down) in C against this
        index, or None where there is none."""
        ...


class KvAware:
    def __init__(
        self, index: IndexView, metrics: KvMetrics, prefix_weight: float, load_weight: float
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        # What every request's path reads, found once: the lookup (in C for a worker's shared
        # index, so no Python frame around it) and the tallies it adds to, per role.
        self._holder = index.holder
        self._place = index.place
        self._tallies: dict[int, MutableSequence[int]] = {role: metrics.tallies(role) for role in ROLE_NAMES}
        # The policy as the router calls it: for a worker, the usual case whole in C (a Python
        # frame here costs about 4 µs on a request path whose caches are cold); else choose.
        self.decide: Policy = (
            index.chooser(self._tallies, self.choose, prefix_weight, load_weight) or self.choose
        )

    def choose(
        self, targets: Sequence[Target], exclude: Collection[int] = (), prompt: PromptView | None = None
    ) -> Target | None:
        """The policy (the router calls :attr:`decide`, which is this or does what this does)."""
        if prompt is None:
            return least_load(targets, exclude)
        if len(targets) == 1 and not exclude:
            # The lone candidate, taken without the filter; one call finds what its endpoints
            # hold, writes it into the prompt and counts it (in C: a tuple unpacked and four
            # attributes set and added in Python cost 2 to 3 µs with cold caches).
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

    def __call__(
        self, targets: Sequence[Target], exclude: Collection[int] = (), prompt: PromptView | None = None
    ) -> Target | None:
        """:attr:`decide`: the policy as the router calls it."""
        return self.decide(targets, exclude, prompt)

    def _tally(self, role: int) -> MutableSequence[int]:
        return self._tallies.get(role) or self.metrics.tallies(role)

    def _cheapest(self, cands: Sequence[Target], prompt: PromptView) -> Target:
        pw, lw, n = self.prefix_weight, self.load_weight, prompt.n
        index, holder = self.index, self._holder
        best: list[tuple[Target, int, Upstream | None]] = []
        best_cost: tuple[float, int] = (0.0, 0)
        for t in cands:
            cached, where = holder(prompt, t.endpoints)
            # Equal costs (a prompt no engine holds, on idle instances) go to the engine caching
            # the least: new prefixes spread over the caches instead of piling on one by chance.
            cost = (
                pw * (n - cached) + lw * t.load,
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
