"""What the monitoring files in deploy/ ask of Motor's /metrics: the metric names in PromQL
expressions (the Grafana dashboard's queries, the alerting rules), and the names a /metrics page
exports, so a test can tell a query that names a metric nobody exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.procs import ROOT

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "rules" / "motor.rules.yml"
RULE_TESTS = PROMETHEUS_DIR / "rules" / "motor.rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "motor.json"

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
