"""An engine's ``/metrics`` text into :class:`~.snapshot.Family` tuples, with
``prometheus_client``'s parser.

Only the engine's own families are kept (:data:`~.rules.PREFIXES`): lines of any other family
are dropped before parsing, which is most of the work saved on a vLLM exposition. ``*_created``
samples (a counter's or histogram's start time) are dropped: they do not add up.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from prometheus_client.parser import text_string_to_metric_families

from motor_mesh.coordinator.engine_metrics import rules
from motor_mesh.coordinator.engine_metrics.rules import PREFIXES
from motor_mesh.coordinator.engine_metrics.snapshot import Family, Rates, Sample

DROPPED = frozenset({"engine"})  # vLLM's per-process engine index: it would keep engines apart
_KEEP_COMMENTS = tuple(f"# {word} {p}" for word in ("HELP", "TYPE") for p in PREFIXES)


PR_SET_PDEATHSIG = 1


def init_process(parent: int) -> None:
    """The parse process's start: it ends with the Coordinator however that ends (the kernel
    kills it when its parent goes, SIGKILL included), and leaves Ctrl-C to the Coordinator."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent was gone before that was armed
        os._exit(1)


def _engine_lines(text: str) -> str:
    keep = [
        line for line in text.splitlines() if line.startswith(PREFIXES) or line.startswith(_KEEP_COMMENTS)
    ]
    keep.append("")
    return "\n".join(keep)


def parse(text: str) -> tuple[Family, ...]:
    """Raises ValueError (the parser's error) for text that is not an exposition. Runs in the
    collector's parse process (see collector.py): what it returns is pickled back."""
    out = []
    for fam in text_string_to_metric_families(_engine_lines(text)):
        samples: list[Sample] = []
        for s in fam.samples:
            # The text format gives a counter's _created its own family (a gauge): both go.
            if s.name.endswith("_created"):
                continue
            labels = s.labels
            le = labels.get("le") if s.name.endswith("_bucket") else None
            pairs = tuple(sorted((k, v) for k, v in labels.items() if k not in DROPPED and k != "le"))
            if le is not None:
                pairs += (("le", le),)
            samples.append((s.name, pairs, float(s.value)))
        if samples:
            out.append(Family(fam.name, fam.type, fam.documentation, tuple(samples)))
    return tuple(out)


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
