"""Instance selection policies (``coordinator.prefill_policy`` / ``decode_policy``).

Each policy picks one :class:`Target` out of a candidate tuple. Candidates known to refuse
connections are skipped, but when every candidate is down the policy still picks among all of
them: the circuit breaker never takes the last instance of a role out of rotation.

These run on every request, so the common case (nothing excluded, nothing down) does no
per-candidate Python work beyond what the policy itself needs.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from motor_mesh.coordinator.routes import Target

if TYPE_CHECKING:
    from motor_mesh.coordinator.kv.prompt import PromptView


class Policy(Protocol):
    """Picks one of ``targets`` not in ``exclude``; ``prompt`` is the request's tokenized prompt
    when a KV-aware policy is configured (load policies ignore it)."""

    def __call__(
        self, targets: Sequence[Target], exclude: Collection[int] = (), prompt: PromptView | None = None
    ) -> Target | None: ...


_load = attrgetter("load")


def candidates(targets: Sequence[Target], exclude: Collection[int]) -> Sequence[Target]:
    if exclude:
        targets = [t for t in targets if t.id not in exclude]
    # Every candidate is of one table: its count says whether any endpoint of it is out.
    if len(targets) > 1 and targets[0].downs.n:
        healthy = [t for t in targets if t.healthy]
        return healthy or targets
    return targets


class RoundRobin:
    """Cycles through the candidates; one cursor per candidate tuple (model, role)."""

    def __init__(self) -> None:
        self._cursor: dict[int, int] = {}

    def __call__(
        self, targets: Sequence[Target], exclude: Collection[int] = (), prompt: PromptView | None = None
    ) -> Target | None:
        cands = candidates(targets, exclude)
        if len(cands) <= 1:
            return cands[0] if cands else None
        # Keyed by the routing view's own tuple, so retries and breaker changes keep the
        # rotation; a rebuilt view starts a new cursor.
        key = id(targets)
        n = self._cursor.get(key, 0)
        self._cursor[key] = n + 1
        if len(self._cursor) > 4096:  # table churn must not grow this without bound
            self._cursor.clear()
        return cands[n % len(cands)]


def least_load(
    targets: Sequence[Target], exclude: Collection[int] = (), prompt: PromptView | None = None
) -> Target | None:
    """The candidate with the fewest in-flight tokens; ties broken at random so an idle
    cluster still spreads requests."""
    cands = candidates(targets, exclude)
    if len(cands) <= 1:
        return cands[0] if cands else None
    loads = list(map(_load, cands))
    low = min(loads)
    # The first least-loaded candidate at or after a random offset (all C-level scans).
    start = random.randrange(len(loads))
    try:
        return cands[loads.index(low, start)]
    except ValueError:
        return cands[loads.index(low)]


def power_of_two(
    targets: Sequence[Target], exclude: Collection[int] = (), prompt: PromptView | None = None
) -> Target | None:
    """Two random candidates, the less loaded wins: near least-load balance at O(1) cost."""
    cands = candidates(targets, exclude)
    n = len(cands)
    if n <= 1:
        return cands[0] if cands else None
    i = random.randrange(n)
    j = random.randrange(n - 1)
    a, b = cands[i], cands[j + 1 if j >= i else j]
    if a.load == b.load:
        return a if random.random() < 0.5 else b
    return a if a.load < b.load else b


def make_policy(name: str) -> Policy:
    """A load policy by name (``kv_aware`` is built with its index: kv/routing.py)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return least_load
    if name == "power_of_two":
        return power_of_two
    raise ValueError(f"unknown policy {name!r}")
