"""What one collection round knows: every scraped engine endpoint with its last good series.

Immutable once published; with inference workers it travels as a file (:class:`SnapshotFile`)
written whole and renamed into place, so a reader sees one round or the next, never a mix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import msgspec

# An engine's labels as (name, value) pairs sorted by name, without ``engine`` (vLLM's engine
# index, which differs per process); a histogram bucket's ``le`` comes last, out of order, so the
# aggregation finds it without a search. Tuples: they are dictionary keys as they are.
Labels = tuple[tuple[str, str], ...]
Sample = tuple[str, Labels, float]  # (sample name, labels, value), as exposed


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # the family's name (a counter's without _total), as the text parser gives it
    type: str  # counter, gauge, histogram, summary, info, untyped (prometheus_client's names)
    help: str
    samples: tuple[Sample, ...]


@dataclass(frozen=True, slots=True)
class Rates:
    """What the derived series need from one engine, over its last two good scrapes."""

    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    hits_delta: float = 0.0
    queries_delta: float = 0.0
    hits_total: float = 0.0
    queries_total: float = 0.0
    sglang_hit_rate: float | None = None  # SGLang exports the ratio, not the counters


@dataclass(frozen=True, slots=True)
class Engine:
    instance_id: int
    role: str  # prefill, decode, union
    host: str
    port: int
    dp_rank: int
    ok_at: float = 0.0  # wall-clock time of the last good scrape; 0 = none yet
    error: str = ""  # why the last scrape failed; "" when it succeeded
    families: tuple[Family, ...] = ()
    rates: Rates = field(default_factory=Rates)

    @property
    def key(self) -> tuple[int, str, int]:
        return self.instance_id, self.host, self.port

    def fresh(self, now: float, stale_s: float) -> bool:
        return self.ok_at > 0 and now - self.ok_at <= stale_s


@dataclass(frozen=True, slots=True)
class Snapshot:
    seq: int = 0  # collection rounds so far; 0 = none yet
    at: float = 0.0  # wall-clock time the round ended
    stale_s: float = 15.0
    engines: tuple[Engine, ...] = ()

    def fresh_engines(self, now: float) -> list[Engine]:
        return [e for e in self.engines if e.fresh(now, self.stale_s)]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Snapshot)


def encode(snap: Snapshot) -> bytes:
    """msgpack, typed: decoded straight into these dataclasses and tuples, several times faster
    than JSON plus the conversions (a round of 64 vLLM engines is some 2.5 MB)."""
    return _ENCODER.encode(snap)


def decode(raw: bytes) -> Snapshot:
    """Raises ValueError for bytes this module did not write."""
    try:
        return _DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not an engine-metrics snapshot: {exc}") from None


class SnapshotFile:
    """The snapshot shared with inference workers: ``engine-metrics.json`` in their directory."""

    NAME = "engine-metrics.json"

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, self.NAME)
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file last read
        self._snap = Snapshot()

    def write(self, snap: Snapshot) -> None:
        """Blocking: call off the event loop."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(encode(snap))
        os.replace(tmp, self.path)

    def read(self) -> Snapshot:
        """The newest snapshot written; the last one read while the file is unchanged, and an
        empty one before the first. Blocking: call off the event loop."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self._snap
        seen = (st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            with open(self.path, "rb") as f:
                snap = decode(f.read())
            self._snap, self._seen = snap, seen
        return self._snap
