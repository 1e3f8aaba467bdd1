"""Each inference worker's part of every rate-limit bucket, following where the requests go
(docs/admission.md, "Limits across replicas and workers").

A Coordinator's share of a bucket is split over its workers. The kernel hands each connection to
one worker, so a client with one keep-alive connection sends all its requests to one worker:
an even split would hold it to ``1 / workers`` of its limit. Instead every worker reports, twice
a second, what each bucket was asked for (taken or refused), and the management process gives
each worker a part of each bucket in proportion to what it was asked recently (a decaying sum),
with a small floor so a worker where a client turns up next can serve it at once. The parts of a
bucket always add up to the Coordinator's share, so the deployment never admits more than the
limit; a client that moves to another worker gets its whole limit back within about a second.
A bucket no worker was asked for lately is split evenly again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

DECAY = 0.5  # per round: what was asked a few rounds ago hardly counts
FLOOR = 0.05  # of the mean: an idle worker's part, so a client arriving there is served at once
FORGET = 1e-3  # a decayed sum under this is no demand
MOVE = 0.05  # parts that moved less than this are not sent again


class DemandShares:
    """The management process's side: demand per bucket per worker, turned into parts."""

    def __init__(self) -> None:
        self._demand: dict[str, dict[int, float]] = {}
        self._sent: dict[str, dict[int, float]] = {}

    def add(self, worker: int, asked: Mapping[str, float]) -> None:
        for key, amount in asked.items():
            if amount > 0:
                per = self._demand.setdefault(key, {})
                per[worker] = per.get(worker, 0.0) + float(amount)

    def round(self, workers: Iterable[int]) -> dict[str, dict[int, float]]:
        """The parts that changed since the last round (a bucket with no demand left: an empty
        mapping, meaning even again). Decays what was asked."""
        live = sorted(workers)
        changed: dict[str, dict[int, float]] = {}
        if not live:
            return changed
        for key in list(self._demand):
            per = self._demand[key]
            total = sum(per.get(i, 0.0) for i in live)
            if total < FORGET:
                del self._demand[key]
                if self._sent.pop(key, None) is not None:
                    changed[key] = {}
                continue
            floor = FLOOR * total / len(live)
            whole = total + floor * len(live)
            parts = {i: (per.get(i, 0.0) + floor) / whole for i in live}
            before = self._sent.get(key)
            if before is None or any(abs(parts[i] - before.get(i, 0.0)) > MOVE for i in live):
                self._sent[key] = changed[key] = parts
            self._demand[key] = {i: v * DECAY for i, v in per.items() if i in live}
        return changed


def encode(parts: Mapping[str, Mapping[int, float]]) -> bytes:
    return json.dumps({k: {str(i): round(v, 4) for i, v in p.items()} for k, p in parts.items()}).encode()


def decode(body: bytes) -> dict[str, dict[int, float]]:
    """Raises ValueError for anything but the shape encode() writes."""
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("not an object")
    return {str(k): {int(i): float(v) for i, v in p.items()} for k, p in doc.items()}


def encode_demand(asked: Mapping[str, float]) -> bytes:
    return json.dumps(asked).encode()


def decode_demand(body: bytes) -> dict[str, float]:
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("not an object")
    return {str(k): float(v) for k, v in doc.items()}
