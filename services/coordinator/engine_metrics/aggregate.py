"""Groups the fresh engines' series into one view and combines them by :mod:`.rules`.

A view is a set of labels added to every series: ``full`` none, ``instance`` (instance_id,
role), ``role`` (role), ``dp`` (instance_id, role, dp_rank, host), ``node`` (host). The
engines' own labels stay (but ``engine``, dropped when parsed). Label sets are tuples: the
engine's, sorted, then the view's in a fixed order, so equal sets are equal keys without a sort
per sample (the output's label order carries no meaning). The derived ``motor:*`` gauges are
computed from each engine's rates (parse.rates).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from motor_mesh.coordinator.engine_metrics.rules import Kind, kind_of
from motor_mesh.coordinator.engine_metrics.snapshot import Engine

VIEWS: dict[str, tuple[str, ...]] = {
    "full": (),
    "instance": ("instance_id", "role"),
    "role": ("role",),
    "dp": ("instance_id", "role", "dp_rank", "host"),
    "node": ("host",),
}
LabelKey = tuple[tuple[str, str], ...]
HELP = {
    "prompt": "Prompt tokens processed per second, over the last scrape interval.",
    "generation": "Tokens generated per second, over the last scrape interval.",
    "prefill_workers": "Prefill engine endpoints with fresh metrics.",
    "decode_workers": "Decode and union engine endpoints with fresh metrics.",
    "hit_rate": "Share of prompt tokens found in the prefix cache, over the last scrape interval.",
}


@dataclass(frozen=True, slots=True)
class OutFamily:
    name: str
    type: str  # counter, gauge, histogram, summary (untyped and info come out as gauge)
    help: str
    samples: tuple[tuple[str, LabelKey, float], ...]


def _view_labels(e: Engine, view: tuple[str, ...]) -> LabelKey:
    values = {"instance_id": str(e.instance_id), "role": e.role, "dp_rank": str(e.dp_rank), "host": e.host}
    return tuple((k, values[k]) for k in view)


def _le(s: str) -> float:
    return math.inf if s in ("+Inf", "Inf", "inf") else float(s)


def _le_text(b: float) -> str:
    return "+Inf" if math.isinf(b) else repr(float(b))


class _Histogram:
    """One histogram family's buckets per output label set, per engine (bounds may differ)."""

    def __init__(self) -> None:
        # (base name, label key) -> engine index -> {bound: cumulative count}
        self.buckets: dict[tuple[str, LabelKey], dict[int, dict[float, float]]] = {}

    def add(self, base: str, key: LabelKey, engine: int, bound: float, count: float) -> None:
        counts = self.buckets.setdefault((base, key), {}).setdefault(engine, {})
        counts[bound] = counts.get(bound, 0.0) + count  # one endpoint may serve several engines

    def merged(self) -> Iterable[tuple[str, LabelKey, float]]:
        for (base, key), per_engine in self.buckets.items():
            bounds = sorted({b for counts in per_engine.values() for b in counts})
            total = dict.fromkeys(bounds, 0.0)
            for counts in per_engine.values():
                if len(counts) == len(bounds):  # the usual case: every engine has the same bounds
                    for b, n in counts.items():
                        total[b] += n
                    continue
                # An engine without a bound counts what it has at its nearest bound below: its
                # cumulative count there is a lower bound of the true one.
                own = sorted(counts)
                i, last = 0, 0.0
                for b in bounds:
                    while i < len(own) and own[i] <= b:
                        last = counts[own[i]]
                        i += 1
                    total[b] += last
            name = base + "_bucket"
            for b in bounds:
                yield name, (*key, ("le", _le_text(b))), total[b]


def aggregate(engines: list[Engine], view: str) -> list[OutFamily]:
    """``engines``: the fresh ones, already filtered by role. An unknown view is ``full``."""
    labels_of = VIEWS.get(view, ())
    sums: dict[str, dict[tuple[str, LabelKey], float]] = {}
    means: dict[str, dict[LabelKey, list[float]]] = {}
    hists: dict[str, _Histogram] = {}
    meta: dict[str, tuple[str, str, Kind]] = {}
    for idx, e in enumerate(engines):
        extra = _view_labels(e, labels_of)
        for fam in e.families:
            known = meta.get(fam.name)
            if known is None:
                known = meta[fam.name] = (fam.type, fam.help, kind_of(fam.name, fam.type))
            kind = known[2]
            if kind is Kind.HISTOGRAM:
                h = hists.setdefault(fam.name, _Histogram())
                acc = sums.setdefault(fam.name, {})
                for sname, labels, value in fam.samples:
                    if labels and labels[-1][0] == "le":  # parse.py puts a bucket's le last
                        h.add(fam.name, labels[:-1] + extra, idx, _le(labels[-1][1]), value)
                    elif sname.endswith(("_count", "_sum")):
                        k = (sname, labels + extra)
                        acc[k] = acc.get(k, 0.0) + value
            elif kind is Kind.MEAN:
                acc_m = means.setdefault(fam.name, {})
                for _, labels, value in fam.samples:
                    acc_m.setdefault(labels + extra, []).append(value)
            else:
                acc = sums.setdefault(fam.name, {})
                for sname, labels, value in fam.samples:
                    k = (sname, labels + extra)
                    if kind is Kind.SUMMARY and any(n == "quantile" for n, _ in labels):
                        continue  # quantiles of different engines cannot be combined
                    if kind is Kind.MAX:
                        acc[k] = max(acc.get(k, -math.inf), value)
                    else:
                        acc[k] = acc.get(k, 0.0) + value
    out: list[OutFamily] = []
    for name, (typ, help_, kind) in meta.items():
        if kind is Kind.MEAN:
            groups = means.get(name, {})
            out.append(
                OutFamily(name, "gauge", f"{help_} (mean over engines)",
                          tuple((name, k, sum(v) / len(v)) for k, v in groups.items()))
            )  # fmt: skip
            out.append(
                OutFamily(f"{name}_max", "gauge", f"{help_} (highest engine)",
                          tuple((f"{name}_max", k, max(v)) for k, v in groups.items()))
            )  # fmt: skip
            continue
        samples = [(s, k, v) for (s, k), v in sums.get(name, {}).items()]
        if kind is Kind.HISTOGRAM and name in hists:
            samples = [*hists[name].merged(), *samples]
        out_type = typ if typ in ("counter", "histogram", "summary") else "gauge"
        if typ == "gaugehistogram":
            out_type = "histogram"
        out.append(OutFamily(name, out_type, help_, tuple(samples)))
    out.extend(_derived(engines, labels_of))
    out.sort(key=lambda f: f.name)
    return out


def _derived(engines: list[Engine], labels_of: tuple[str, ...]) -> list[OutFamily]:
    # Tokens per second carry the role whatever the view: prefill and decode tokens mean
    # different work.
    by_role = tuple(dict.fromkeys((*labels_of, "role")))
    prompt: dict[LabelKey, float] = {}
    generation: dict[LabelKey, float] = {}
    prefill_workers: dict[LabelKey, float] = {}
    decode_workers: dict[LabelKey, float] = {}
    hits: dict[LabelKey, list[float]] = {}  # [delta hits, delta queries, hits, queries]
    sglang_rates: dict[LabelKey, list[float]] = {}
    for e in engines:
        rk = _view_labels(e, by_role)
        gk = _view_labels(e, labels_of)
        r = e.rates
        prompt[rk] = prompt.get(rk, 0.0) + r.prompt_tps
        generation[rk] = generation.get(rk, 0.0) + r.generation_tps
        if "role" not in labels_of:  # a group of one role would only add a 0 for the other
            prefill_workers.setdefault(gk, 0.0)
            decode_workers.setdefault(gk, 0.0)
        if e.role == "prefill":
            prefill_workers[gk] = prefill_workers.get(gk, 0.0) + 1
        else:  # decode and union engines both generate
            decode_workers[gk] = decode_workers.get(gk, 0.0) + 1
        acc = hits.setdefault(gk, [0.0, 0.0, 0.0, 0.0])
        acc[0] += r.hits_delta
        acc[1] += r.queries_delta
        acc[2] += r.hits_total
        acc[3] += r.queries_total
        if r.sglang_hit_rate is not None:
            sglang_rates.setdefault(gk, []).append(r.sglang_hit_rate)
    hit_rate: list[tuple[str, LabelKey, float]] = []
    name = "motor:prefix_cache_hit_rate"
    for gk, (dh, dq, h, q) in hits.items():
        if dq > 0:
            hit_rate.append((name, gk, dh / dq))
        elif q > 0:
            hit_rate.append((name, gk, h / q))
        elif gk in sglang_rates:
            rates = sglang_rates[gk]
            hit_rate.append((name, gk, sum(rates) / len(rates)))

    def gauge(name: str, help_: str, values: dict[LabelKey, float]) -> OutFamily:
        return OutFamily(name, "gauge", help_, tuple((name, k, v) for k, v in values.items()))

    return [
        gauge("motor:prompt_tokens_per_second", HELP["prompt"], prompt),
        gauge("motor:generation_tokens_per_second", HELP["generation"], generation),
        gauge("motor:active_prefill_workers", HELP["prefill_workers"], prefill_workers),
        gauge("motor:active_decode_workers", HELP["decode_workers"], decode_workers),
        OutFamily(name, "gauge", HELP["hit_rate"], tuple(hit_rate)),
    ]
