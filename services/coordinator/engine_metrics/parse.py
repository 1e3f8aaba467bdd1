"""An engine's ``/metrics`` text into :class:`~.snapshot.Family` tuples, with
``prometheus_client``'s parser reading each series once (:class:`Parser`).

Only the engine's own families are kept (:data:`~.rules.PREFIXES`): lines of any other family
are dropped before parsing. ``*_created``
samples (a counter's or histogram's start time) are dropped: they do not add up.
"""

from __future__ import annotations

import re

from prometheus_client.metrics_core import METRIC_TYPES
from prometheus_client.parser import text_string_to_metric_families

from motor_mesh.coordinator.engine_metrics import rules
from motor_mesh.coordinator.engine_metrics.rules import PREFIXES
from motor_mesh.coordinator.engine_metrics.snapshot import Family, Labels, Rates, Sample

DROPPED = frozenset({"engine"})  # vLLM's per-process engine index: it would keep engines apart
_KEEP_COMMENTS = tuple(f"# {word} {p}" for word in ("HELP", "TYPE") for p in PREFIXES)


def _kept(text: str) -> list[str]:
    return [
        line for line in text.splitlines() if line.startswith(PREFIXES) or line.startswith(_KEEP_COMMENTS)
    ]


def _pairs(name: str, labels: dict[str, str]) -> Labels:
    le = labels.get("le") if name.endswith("_bucket") else None
    pairs = tuple(sorted((k, v) for k, v in labels.items() if k not in DROPPED and k != "le"))
    return (*pairs, ("le", le)) if le is not None else pairs


def _family(name: str, doc: str, typ: str, samples: list[Sample]) -> Family | None:
    """As prometheus_client builds a family (untyped is "unknown", a counter is named without
    its _total), without the ``*_created`` samples; None when nothing is left."""
    typ = "unknown" if typ == "untyped" else typ
    if typ not in METRIC_TYPES:
        raise ValueError(f"invalid metric type: {typ}")
    if typ == "counter":
        if name.endswith("_total"):
            name = name[:-6]
        else:
            samples = [(s + "_total", labels, v) for s, labels, v in samples]
    kept = tuple(s for s in samples if not s[0].endswith("_created"))
    return Family(name, typ, doc, kept) if kept else None


def whole(text: str) -> tuple[Family, ...]:
    """prometheus_client's parser over the engine's own lines. Raises ValueError for text that
    is not an exposition."""
    out = []
    for fam in text_string_to_metric_families("\n".join(_kept(text)) + "\n"):
        samples: list[Sample] = [(s.name, _pairs(s.name, s.labels), float(s.value)) for s in fam.samples]
        built = Family(
            fam.name, fam.type, fam.documentation, tuple(x for x in samples if not x[0].endswith("_created"))
        )
        if built.samples:
            out.append(built)
    return tuple(out)


class _Unusual(Exception):
    """A line the fast path leaves to prometheus_client (a quoted name, a stray token)."""


_ALLOWED = {
    "counter": ("",),
    "gauge": ("",),
    "summary": ("_count", "_sum", ""),
    "histogram": ("_count", "_sum", "_bucket"),
}
_HELP_ESCAPE = re.compile(r"\\[\\n]")


def _unescape_help(text: str) -> str:
    return _HELP_ESCAPE.sub(lambda m: "\\" if m.group(0) == "\\\\" else "\n", text)


class Parser:
    """prometheus_client's text parser, reading each series once.

    What costs in that parser is a sample's name and labels (read a character at a time); an
    engine repeats the same series every scrape with new values. So a series is read by
    prometheus_client the first time this Parser meets it, and afterwards only its value is
    read. Comments, grouping into families and counter naming follow prometheus_client's own
    text parser step by step; an exposition with something this path does not handle (quoted
    metric names, a stray token) is parsed whole by prometheus_client instead. Equivalence with
    it is tested (tests/coordinator/test_engine_metrics.py)."""

    MAX_SERIES = 500_000  # a bound on memory: past it the cache starts again

    def __init__(self) -> None:
        self._series: dict[str, tuple[str, Labels]] = {}

    def parse(self, text: str) -> tuple[Family, ...]:
        """Raises ValueError for text that is not an exposition."""
        try:
            return self._fast(_kept(text))
        except _Unusual:
            return whole(text)

    def _series_of(self, key: str) -> tuple[str, Labels]:
        found = self._series.get(key)
        if found is None:
            if len(self._series) >= self.MAX_SERIES:
                self._series.clear()
            sample = next(iter(text_string_to_metric_families(key + " 0\n"))).samples[0]
            found = self._series[key] = (sample.name, _pairs(sample.name, sample.labels))
        return found

    def _fast(self, lines: list[str]) -> tuple[Family, ...]:
        out: list[Family] = []
        name, doc, typ = "", "", "untyped"
        samples: list[Sample] = []
        allowed: tuple[str, ...] = ()

        def close() -> None:
            if name:
                built = _family(name, doc, typ, samples)
                if built is not None:
                    out.append(built)

        for raw in lines:
            line = raw.strip()
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) < 3 or '"' in parts[2]:
                    raise _Unusual
                if parts[1] == "HELP":
                    if parts[2] != name:
                        close()
                        name, typ, samples, allowed = parts[2], "untyped", [], (parts[2],)
                    doc = _unescape_help(parts[3]) if len(parts) == 4 else ""
                else:  # TYPE (_kept keeps no other comment)
                    if len(parts) < 4:
                        raise ValueError(f"TYPE line without a type: {line[:120]!r}")
                    if parts[2] != name:
                        close()
                        name, doc, samples = parts[2], "", []
                    typ = parts[3]
                    allowed = tuple(name + suffix for suffix in _ALLOWED.get(typ, ("",)))
                continue
            brace = line.rfind("}")
            if brace >= 0:
                key, rest = line[: brace + 1], line[brace + 1 :].split()
            else:
                key, _, tail = line.partition(" ")
                rest = tail.split()
            if not rest or len(rest) > 2 or '"' in key.split("{", 1)[0]:
                raise _Unusual
            sname, pairs = self._series_of(key)
            value = float(rest[0])
            if sname in allowed:
                samples.append((sname, pairs, value))
                continue
            close()  # as prometheus_client does: a sample no family allows stands alone
            name, doc, typ, samples, allowed = "", "", "untyped", [], ()
            single = _family(sname, "", "untyped", [(sname, pairs, value)])
            if single is not None:
                out.append(single)
        close()
        return tuple(out)


_PARSER = Parser()


def parse(text: str) -> tuple[Family, ...]:
    """Raises ValueError for text that is not an exposition. One Parser remembers every engine's
    series (the collector's threads share it: a race only reads a series twice)."""
    return _PARSER.parse(text)


def _total(families: tuple[Family, ...], names: tuple[str, ...]) -> float | None:
    found = False
    total = 0.0
    for f in families:
        for name, _, value in f.samples:
            if name in names:
                found = True
                total += value
    return total if found else None


def _delta(now: float | None, before: float | None) -> float:
    if now is None:
        return 0.0
    if before is None or now < before:  # no earlier scrape, or the engine restarted
        return 0.0
    return now - before


def rates(families: tuple[Family, ...], prev: tuple[Family, ...], elapsed_s: float) -> Rates:
    """The derived series' inputs from this scrape and the engine's previous good one."""
    per_s = 1.0 / elapsed_s if elapsed_s > 0 else 0.0
    hits = _total(families, rules.PREFIX_HITS)
    queries = _total(families, rules.PREFIX_QUERIES)
    sglang_rate = None
    for f in families:
        if f.name == rules.SGLANG_HIT_RATE and f.samples:
            sglang_rate = sum(v for _, _, v in f.samples) / len(f.samples)
    return Rates(
        prompt_tps=_delta(_total(families, rules.PROMPT_TOKENS), _total(prev, rules.PROMPT_TOKENS)) * per_s,
        generation_tps=_delta(
            _total(families, rules.GENERATION_TOKENS), _total(prev, rules.GENERATION_TOKENS)
        )
        * per_s,
        hits_delta=_delta(hits, _total(prev, rules.PREFIX_HITS)),
        queries_delta=_delta(queries, _total(prev, rules.PREFIX_QUERIES)),
        hits_total=hits or 0.0,
        queries_total=queries or 0.0,
        sglang_hit_rate=sglang_rate,
    )
