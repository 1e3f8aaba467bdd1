"""What one collection round knows: every scraped engine endpoint with its last good series.

Immutable once published; with inference workers it travels as a file (:class:`SnapshotFile`)
written whole and renamed into place, so a reader sees one round or the next, never a mix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import orjson

Labels = dict[str, str]
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


def encode(snap: Snapshot) -> bytes:
    return orjson.dumps(
        {
            "seq": snap.seq,
            "at": snap.at,
            "stale_s": snap.stale_s,
            "engines": [
                {
                    "instance_id": e.instance_id,
                    "role": e.role,
                    "host": e.host,
                    "port": e.port,
                    "dp_rank": e.dp_rank,
                    "ok_at": e.ok_at,
                    "error": e.error,
                    "families": [[f.name, f.type, f.help, f.samples] for f in e.families],
                    "rates": [
                        e.rates.prompt_tps,
                        e.rates.generation_tps,
                        e.rates.hits_delta,
                        e.rates.queries_delta,
                        e.rates.hits_total,
                        e.rates.queries_total,
                        e.rates.sglang_hit_rate,
                    ],
                }
                for e in snap.engines
            ],
        }
    )


def _number(v: float | None) -> float:
    return math.nan if v is None else float(v)  # orjson writes NaN and the infinities as null


def decode(raw: bytes) -> Snapshot:
    """Raises ValueError (orjson.JSONDecodeError is one), KeyError or TypeError for a file this
    module did not write."""
    d = orjson.loads(raw)
    engines = []
    for e in d["engines"]:
        fams = tuple(
            Family(name, typ, help_, tuple((s[0], s[1], _number(s[2])) for s in samples))
            for name, typ, help_, samples in e["families"]
        )
        engines.append(
            Engine(
                int(e["instance_id"]),
                str(e["role"]),
                str(e["host"]),
                int(e["port"]),
                int(e["dp_rank"]),
                float(e["ok_at"]),
                str(e["error"]),
                fams,
                Rates(*e["rates"]),
            )
        )
    return Snapshot(int(d["seq"]), float(d["at"]), float(d["stale_s"]), tuple(engines))


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
