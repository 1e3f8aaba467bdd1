"""What the monitoring files in deploy/ ask of Motor's /metrics: the metric names in PromQL
expressions (the Grafana dashboard's queries, the alerting rules, prometheus-adapter's rules in
deploy/k8s/autoscaling), and the names a /metrics page exports, so a test can tell a query that
names a metric nobody exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.procs import ROOT

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "rules" / "motor.rules.yml"
RULE_TESTS = PROMETHEUS_DIR / "rules" / "motor.rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "motor.json"
AUTOSCALING = ROOT / "deploy" / "k8s" / "autoscaling"
ADAPTER = AUTOSCALING / "prometheus-adapter.yaml"

# Series Prometheus makes itself for every target: never on a /metrics page.
SYNTHETIC = {"up"}
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "atan2", "inf", "nan",
}  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# An identifier that is not part of a longer one, a number (1e3) or a function call.
_IDENT = re.compile(r"(?<![\w.:$])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([^,)]+?)\s*(?:,[^)]*)?\)\s*$")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, keywords, labels)."""
    m = _LABEL_VALUES.match(expr)  # a Grafana variable query: label_values(selector, label)
    if m:
        expr = m.group(1)
    for pattern in (_STRING, _MATCHERS, _RANGE, _GROUPING):
        expr = pattern.sub(" ", expr)
    return {name for name in _IDENT.findall(expr) if name.lower() not in _KEYWORDS}


def exported_names(text: str) -> set[str]:
    """Every series name a Prometheus text page exports, or will once a labelled metric has a
    first child (a family declared by ``# TYPE`` with no sample yet counts)."""
    names: set[str] = set()
    suffixes = {
        "counter": ("", "_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
    }
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.update(name + s for s in suffixes.get(kind, ("",)))
        elif line and not line.startswith("#"):
            m = re.match(r"[a-zA-Z_:][\w:]*", line)
            if m:
                names.add(m.group())
    return names


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for p in dash.get("panels", []):
        yield p
        yield from p.get("panels", [])


def dashboard_queries(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query: each panel target and each query variable."""
    for p in panels(dash):
        for t in p.get("targets", []):
            yield f"panel {p['title']!r} {t['refId']}", t["expr"]
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]
            yield f"variable {v['name']!r}", q["query"] if isinstance(q, dict) else q


def rules(path: Path = RULES) -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def rule_queries(path: Path = RULES) -> Iterator[tuple[str, str]]:
    for r in rules(path):
        yield f"rule {r.get('alert') or r.get('record')}", r["expr"]


def missing_metrics(queries: Iterable[tuple[str, str]], exported: set[str]) -> dict[str, set[str]]:
    """{where: names} for every query naming a metric that is not exported."""
    missing = {}
    for where, expr in queries:
        names = metric_names(expr) - exported - SYNTHETIC
        if names:
            missing[where] = names
    return missing


def samples(text: str) -> list[tuple[str, dict[str, str]]]:
    """(name, labels) of every sample of a Prometheus text page."""
    out = []
    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:][\w:]*)(\{.*\})?\s+\S+", line)
        if m is None or line.startswith("#"):
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out.append((m.group(1), labels))
    return out


# -- prometheus-adapter (deploy/k8s/autoscaling) ------------------------------------------------

_TEMPLATE = re.compile(r"<<\s*\.(\w+)\s*>>")
_EQUAL = re.compile(r'(\w+)\s*=\s*"([^"]*)"')


@dataclass(frozen=True)
class AdapterRule:
    """One of prometheus-adapter's ``externalRules``: which series it finds (``seriesQuery``),
    the name it gives them (``name.matches`` and ``name.as``), how it queries them
    (``metricsQuery``, a Go template over ``.Series``, ``.LabelMatchers`` and ``.GroupBy``)."""

    series_query: str
    matches: str
    as_: str
    metrics_query: str

    def series(self) -> set[str]:
        """The series names the rule finds (those its seriesQuery names)."""
        m = re.search(r'__name__\s*=\s*"([^"]+)"', self.series_query)
        return {m.group(1)} if m else metric_names(self.series_query)

    def exposed(self, series: str) -> str | None:
        """The External metric name ``series`` is served as, or None if the rule skips it (as
        the adapter does: the first match of ``matches``, ``as`` expanded, default $1 or $0)."""
        m = re.search(self.matches, series)
        if m is None:
            return None
        template = self.as_ or ("$1" if m.re.groups else "$0")
        return re.sub(r"\$\{?(\d+)\}?", lambda g: m.group(int(g.group(1))) or "", template)

    def names(self) -> set[str]:
        return {n for s in self.series() if (n := self.exposed(s)) is not None}

    def selected(self) -> dict[str, str]:
        """The label values the rule's seriesQuery selects by equality (``role="prefill"``)."""
        return dict(_EQUAL.findall(_MATCHERS.search(self.series_query).group(0)))  # type: ignore[union-attr]

    def query(self, series: str, label_matchers: str = "", group_by: str = "") -> str:
        """The PromQL the adapter sends for ``series`` with these ``LabelMatchers`` (the HPA's
        namespace and metric selector, ``namespace="motor",role="prefill"``)."""
        values = {"Series": series, "LabelMatchers": label_matchers, "GroupBy": group_by}
        return _TEMPLATE.sub(lambda m: values[m.group(1)], self.metrics_query)


def adapter_rules(path: Path = ADAPTER) -> list[AdapterRule]:
    (configmap,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    return [
        AdapterRule(r["seriesQuery"], r["name"]["matches"], r["name"].get("as", ""), r["metricsQuery"])
        for r in config["externalRules"]
    ]


def adapter_queries(path: Path = ADAPTER) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every rule, each as the adapter sends it for each series it finds."""
    for r in adapter_rules(path):
        for series in sorted(r.series()):
            yield f"adapter rule {r.exposed(series)}", r.query(series)


@dataclass(frozen=True)
class HpaMetric:
    """An External metric an HPA scales on."""

    hpa: str
    target: str  # the StatefulSet it scales
    name: str
    selector: dict[str, str]


def hpa_metrics(directory: Path = AUTOSCALING) -> list[HpaMetric]:
    """Every External metric of every HorizontalPodAutoscaler in ``directory``."""
    out = []
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "HorizontalPodAutoscaler":
                continue
            for m in doc["spec"]["metrics"]:
                assert m["type"] == "External", (
                    f"{path.name}: {doc['metadata']['name']} scales on {m['type']}"
                )
                metric = m["external"]["metric"]
                out.append(
                    HpaMetric(
                        doc["metadata"]["name"],
                        doc["spec"]["scaleTargetRef"]["name"],
                        metric["name"],
                        dict(metric.get("selector", {}).get("matchLabels", {})),
                    )
                )
    return out
