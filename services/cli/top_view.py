"""``motor top``'s screen: the document top_model.py builds, laid out with rich (a header, a
table per role and per instance, the stale engines, migrations and alarms)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

# Active alarms shown one per line (newest first); the rest are counted.
NEWEST_ALARMS = 5
LATENCY_COLUMNS = (
    ("TTFT P50", "ttft_p50_s"),
    ("TTFT P99", "ttft_p99_s"),
    ("TPOT P50", "tpot_p50_s"),
    ("TPOT P99", "tpot_p99_s"),
)
MISSING = "-"
MIN_WIDTHS = {"ROLE": 7, "STATUS": 8}
FOLDED_MIN_WIDTH = 21  # one host:port/dpN


def count(v: float | None) -> str:
    if v is None:
        return MISSING
    return str(int(v)) if float(v).is_integer() else f"{v:.1f}"


def percent(v: float | None) -> str:
    return MISSING if v is None else f"{v * 100:.1f}%"


def rate(v: float | None) -> str:
    if v is None:
        return MISSING
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def duration(v: float | None) -> str:
    """A latency: 85ms, 4.2ms, 1.24s."""
    if v is None:
        return MISSING
    if v < 0.01:
        return f"{v * 1000:.1f}ms"
    if v < 1:
        return f"{v * 1000:.0f}ms"
    return f"{v:.2f}s"


def clock(iso_time: str | None) -> str:
    """``12:04:11Z`` of an ISO 8601 UTC time (the date is today's, or does not matter)."""
    if not iso_time:
        return "never"
    return datetime.fromisoformat(iso_time).strftime("%H:%M:%SZ")


def age(iso_time: str, now: float) -> str:
    seconds = max(0.0, now - datetime.fromisoformat(iso_time).timestamp())
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def table(*headers: str, folded: str = "") -> Table:
    """Columns as wide as their header at least, so a narrow terminal does not cut numbers short:
    the ``folded`` column (the last) takes several lines instead, and what does not fit even so
    is left off at the right."""
    t = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 2, 0, 0))
    for h in headers:
        if h == folded:
            t.add_column(h, overflow="fold", min_width=FOLDED_MIN_WIDTH)
        else:
            t.add_column(
                h,
                justify="left" if h in ("ROLE", "ID", "STATUS") else "right",
                no_wrap=True,
                min_width=max(len(h), MIN_WIDTHS.get(h, 0)),
            )
    return t


def figure_cells(f: dict[str, Any]) -> list[str]:
    return [
        count(f["running"]),
        count(f["waiting"]),
        percent(f["kv_cache_usage"]),
    ]


def rate_and_latency_cells(f: dict[str, Any]) -> list[str]:
    return [
        rate(f["prompt_tokens_per_second"]),
        rate(f["generation_tokens_per_second"]),
        *(duration(f[key]) for _, key in LATENCY_COLUMNS),
    ]


def header(doc: dict[str, Any], now: float, interval: float | None) -> Text:
    line = Text()
    line.append("motor top", style="bold")
    line.append(f"  Coordinator {doc['coordinator']}")
    if doc["collect_time"]:
        line.append(f"  collected {clock(doc['collect_time'])} ({age(doc['collect_time'], now)})")
    else:
        line.append("  no collection yet", style="yellow")
    window = doc["window_s"]
    line.append(
        f"  rates and latency over the last {window:.1f}s"
        if window
        else "  latency since the engines started"
    )
    if interval:
        line.append(f"  refresh {interval:g}s")
    return line


def roles_table(doc: dict[str, Any]) -> Table:
    t = table(
        "ROLE", "INST", "ENGINES", "RUN", "WAIT", "KV MEAN", "KV MAX", "IN TOK/S", "OUT TOK/S",
        *(h for h, _ in LATENCY_COLUMNS),
    )  # fmt: skip
    for role, f in doc["roles"].items():
        engines = Text(str(f["engines"]))
        if f["stale_engines"]:
            engines.append(f" ({f['stale_engines']} stale)", style="red")
        t.add_row(
            role,
            str(f["instances"]),
            engines,
            *figure_cells(f),
            percent(f["kv_cache_usage_max"]),
            *rate_and_latency_cells(f),
        )
    return t


def engines_cell(engines: list[dict[str, Any]]) -> Text:
    cell = Text()
    for n, e in enumerate(engines):
        if n:
            cell.append(" ")
        cell.append(f"{e['host']}:{e['port']}")
        if len(engines) > 1:
            cell.append(f"/dp{e['dp_rank']}")
        if not e["fresh"]:
            cell.append(" STALE", style="bold red")
    return cell or Text(MISSING)


def instances_table(doc: dict[str, Any]) -> Table:
    t = table(
        "ID", "ROLE", "STATUS", "RUN", "WAIT", "KV", "IN TOK/S", "OUT TOK/S",
        *(h for h, _ in LATENCY_COLUMNS), "ENGINES", folded="ENGINES",
    )  # fmt: skip
    for i in doc["instances"]:
        status = i["status"] or MISSING
        t.add_row(
            str(i["instance_id"]),
            i["role"] or MISSING,
            Text(status, style="" if status in ("ACTIVE", MISSING) else "yellow"),
            *figure_cells(i),
            *rate_and_latency_cells(i),
            engines_cell(i["engines"]),
        )
    return t


def stale_lines(doc: dict[str, Any]) -> list[Text]:
    """One line per engine whose values are not in the aggregate, with why."""
    lines = []
    for i in doc["instances"]:
        for e in i["engines"]:
            if e["fresh"]:
                continue
            why = e["error"] or "not scraped yet"
            lines.append(
                Text(
                    f"  stale: instance {i['instance_id']} {e['host']}:{e['port']} (dp {e['dp_rank']}): "
                    f"{why}; last success {clock(e['last_success_time'])}",
                    style="red",
                )
            )
    return lines


def cluster_line(doc: dict[str, Any]) -> Text:
    line = Text()
    m = doc["migrations"]
    if m is None:
        line.append("migrations -")
    else:
        line.append(f"migrations {m['total']}")
        if m["new"]:
            line.append(f" (+{m['new']})", style="yellow")
        outcomes = ", ".join(f"{k} {v}" for k, v in m["by_outcome"].items() if v)
        if outcomes:
            line.append(f": {outcomes}")
    workers = doc["active_workers"]
    if any(v is not None for v in workers.values()):
        line.append("   workers active: " + ", ".join(f"{r} {count(v)}" for r, v in workers.items()))
    return line


def alarm_lines(doc: dict[str, Any]) -> list[Text]:
    controller, alarms = doc["controller"], doc["alarms"]
    if controller is None:
        return [
            Text(
                "no Controller (--controller ''): standalone view, no alarms or instance status", style="dim"
            )
        ]
    if alarms is None:
        err = controller["error"] or {}
        why = err.get("code", "no answer")
        if why not in ("UNAVAILABLE", "DEADLINE_EXCEEDED") and err.get("message"):
            why += f": {err['message']}"  # a refusal (UNAUTHENTICATED...): its reason
        return [
            Text(
                f"Controller {controller['address']} did not answer ({why}): no alarms or instance status",
                style="yellow",
            )
        ]
    if not alarms:
        return [Text("alarms: none active", style="green")]
    lines = [Text(f"alarms: {len(alarms)} active, newest first:", style="bold red")]
    for a in alarms[:NEWEST_ALARMS]:
        lines.append(
            Text(
                f"  {clock(a['time'])}  {a['severity']:<8}  {a['alarm_id']}  instance {a['instance_id']}  "
                f"{a['reason']}"
            )
        )
    if len(alarms) > NEWEST_ALARMS:
        lines.append(Text(f"  ... and {len(alarms) - NEWEST_ALARMS} more (motor alarms)"))
    return lines


def render(
    doc: dict[str, Any], *, now: float, interval: float | None = None, problem: str | None = None
) -> RenderableType:
    """The whole screen; ``problem``: why this refresh failed (the data shown is the last)."""
    parts: list[RenderableType] = [header(doc, now, interval)]
    if problem:
        parts.append(Text(f"{problem}; showing the last data", style="bold red"))
    parts += [Text(""), roles_table(doc), Text(""), instances_table(doc), *stale_lines(doc), Text("")]
    parts += [cluster_line(doc), *alarm_lines(doc)]
    return Group(*parts)
