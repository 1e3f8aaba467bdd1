"""``motor status`` as text: the document of status.py laid out in three sections (the
Controller, the Coordinators, the NodeManagers) that fit about 100 columns."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from motor_mesh.cli.views import table_lines

WIDTH = 100
UNREACHABLE = "UNREACHABLE"
COORDINATOR_HEADER = [
    "COORDINATOR",
    "HEALTH",
    "ROUTABLE",
    "REV",
    "INCARNATION",
    "AVAIL",
    "UNAVAIL",
    "PAUSED",
    "PD_GROUPS",
    "WORKERS",
]
NODEMANAGER_HEADER = ["NODEMANAGER", "INSTANCE", "READY", "UPTIME", "RESTARTS", "FROZEN", "ENGINES"]
# An engine starting for longer than this gets its last output line shown under its node: a
# model that loads in seconds needs no explaining, one that takes minutes (or hangs) does.
SHOW_OUTPUT_AFTER_S = 15.0


def duration(seconds: float) -> str:
    """``45s``, ``5m02s``, ``3h04m``, ``2d03h``: two units at most."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def clip_middle(text: str, width: int) -> str:
    """``text`` cut to ``width`` in its middle: a log line's start (time, level) and its end
    (the message) say the most."""
    if len(text) <= width:
        return text
    head = (width - 1) // 4
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def problem(err: dict[str, str]) -> str:
    """``UNREACHABLE (CODE)`` for a part that did not answer, ``ERROR CODE: message`` for one that
    refused a call (a missing management key, say)."""
    if err["code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return f"UNREACHABLE ({err['code']})"
    return clip(f"ERROR {err['code']}: {err['message']}", 60)


def yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


# ---- Controller ----------------------------------------------------------------------------


def instance_summary(counts: dict[str, dict[str, int]]) -> str:
    """``prefill 1 ACTIVE; decode 1 ACTIVE, 1 INACTIVE`` (roles and statuses with none left out)."""
    roles = []
    for role, by_status in counts.items():
        some = [f"{n} {status}" for status, n in by_status.items() if n]
        if some:
            roles.append(f"{role} " + ", ".join(some))
    return "; ".join(roles) or "none"


def desired_summary(desired: dict[str, dict[str, Any]]) -> str:
    """``prefill 1 (1 running), decode 3 (2 running)``: each role's recorded desired count, and
    its live instances."""
    if not desired:
        return "none recorded"
    parts = []
    for role, d in desired.items():
        running = f" ({d['running']} running)" if d.get("running") is not None else ""
        parts.append(f"{role} {d['replicas']}{running}")
    return ", ".join(parts)


def recovery_lines(part: dict[str, Any]) -> list[str]:
    """One line per instance with a fault level or a running strategy (the earlier outcomes of
    the others are in ``-o json``)."""
    entries = [e for e in part["fault_tolerance"] if e["fault_level"] or e["strategy"]]
    running = part["strategies_running"]
    lines = [f"{running} strategy running" if running == 1 else f"{running or 'no'} strategies running"]
    for e in entries:
        what = [f"fault L{e['fault_level']}"] if e["fault_level"] else []
        if e["strategy"]:
            what.append(f"{e['strategy']} ({e['phase'] or '-'})")
        since = f" since {e['since'][11:19]}Z" if e["since"] else ""
        last = f"; last: {e['last_outcome']}" if e["last_outcome"] else ""
        lines.append(clip(f"instance {e['instance_id']}: {', '.join(what)}{since}{last}", WIDTH - 14))
    return lines


def clock(iso_time: str | None) -> str:
    """``12:00:03Z`` of an ISO time in UTC (the date left out, as in ``recovery``)."""
    return f"{iso_time[11:19]}Z" if iso_time else "-"


def wrap(phrases: list[str], width: int) -> list[str]:
    """``phrases`` (each ending in its separator but the last) joined into lines of at most
    ``width``, broken between phrases; a phrase longer than a line is clipped."""
    lines: list[str] = []
    for phrase in phrases:
        if lines and len(lines[-1]) + 1 + len(phrase) <= width:
            lines[-1] += " " + phrase
        else:
            lines.append(phrase)
    return [clip(line, width) for line in lines]


def planner_lines(planner: dict[str, Any]) -> list[str]:
    """The last decision with the split it wants, each role's p90 latency against its target
    and the SLA attainment (``act: switch at 12:00:03Z, prefill 2 -> 3 (TTFT p90 2100/1000
    ms), decode 2 -> 1 (ITL p90 9/50 ms); attainment predicted 0.43 -> 1.00, measured 0.55``,
    run on over lines that fit), then the decision's reason, one line per switch in progress
    and one with the cooldowns. Just ``off`` while the planner is off."""
    if planner["mode"] == "off":
        return ["off"]
    width = WIDTH - 14
    decision = planner["decision"]
    # Before its first decision the planner has nothing to recommend nor to predict.
    decided = decision not in (None, "learning")
    head = f"{planner['mode']}: {decision or 'no decision yet'}"
    if planner["decide_time"]:
        head += f" at {clock(planner['decide_time'])}"
    phrases = [head]
    for role, r in planner["roles"].items():
        metric = {"prefill": "TTFT", "decode": "ITL"}.get(role, "latency")
        latency = f"{r['latency_p90_ms']:.0f}" if r["latency_p90_ms"] else "-"
        change = f" -> {r['recommended']}" if decided and r["recommended"] != r["instances"] else ""
        phrases.append(f"{role} {r['instances']}{change} ({metric} p90 {latency}/{r['target_ms']:.0f} ms)")
    attainment = []
    if decided:
        predicted, recommended = planner["predicted_attainment"], planner["recommended_attainment"]
        better = f" -> {recommended:.2f}" if recommended != predicted else ""
        attainment.append(f"predicted {predicted:.2f}{better}")
    measured = planner["measured_attainment"]
    attainment.append(f"measured {measured:.2f}" if measured is not None else "measured -")
    lines = wrap(
        [*(p + "," for p in phrases[:-1]), phrases[-1] + ";", "attainment " + ", ".join(attainment)], width
    )
    if planner["reason"]:
        lines.append(clip(planner["reason"], width))
    for w in planner["switches"]:
        since = f" since {clock(w['since'])}" if w["since"] else ""
        lines.append(
            clip(f"instance {w['instance_id']}: {w['from']} -> {w['to']} ({w['phase'] or '-'}){since}", width)
        )
    if planner["cooldowns"]:
        cooling = [f"instance {c['instance_id']} until {clock(c['until'])}" for c in planner["cooldowns"]]
        lines.append(clip("cooldown: " + ", ".join(cooling), width))
    return lines


def alarm_lines(alarms: dict[str, Any]) -> list[str]:
    if not alarms["active"]:
        return ["none active"]
    shown = alarms["most_severe"]
    head = f"{alarms['active']} active" + ("; the most severe:" if alarms["active"] > len(shown) else ":")
    lines = [head]
    for a in shown:
        inst = f"instance {a['instance_id']}" if a["instance_id"] else "-"
        lines.append(clip(f"{a['severity']:<8}  {a['alarm_id']}  {inst}  {a['reason']}", WIDTH - 14))
    return lines


def controller_lines(part: dict[str, Any]) -> list[str]:
    health = part["health"]
    if health == UNREACHABLE:
        return [f"Controller {part['address']}: {problem(part['error'])}"]
    lines = [f"Controller {part['address']}: {health}"]
    if part["error"] is not None:
        lines.append(f"  {problem(part['error'])}")
    sections = [
        ("instances", [instance_summary(part["instances"])] if part["instances"] is not None else []),
        ("recovery", recovery_lines(part) if part["fault_tolerance"] is not None else []),
        ("alarms", alarm_lines(part["alarms"]) if part["alarms"] is not None else []),
        # Last: what an older Controller cannot say (desired counts, the planner) changes no
        # line above.
        ("desired", [desired_summary(part["desired"])] if part.get("desired") is not None else []),
        ("planner", planner_lines(part["planner"]) if part.get("planner") is not None else []),
    ]
    for name, values in sections:
        for k, value in enumerate(values or ["-"]):
            lines.append(f"  {name if k == 0 else '':<10}  {value}")
    return lines


# ---- Coordinators and NodeManagers ---------------------------------------------------------


def coordinator_row(c: dict[str, Any]) -> list[str]:
    if c["health"] == UNREACHABLE:
        return [c["address"], problem(c["error"])]
    if c["revision"] is None:
        return [c["address"], c["health"], yes_no(c["routable"]), problem(c["error"])]
    workers = f"{c['inference_workers_serving']}/{c['inference_workers']}"
    n = c["instances"]
    return [
        c["address"],
        c["health"],
        yes_no(c["routable"]),
        str(c["revision"]),
        c["incarnation"][:8],
        str(n["available"]),
        str(n["unavailable"]),
        str(n["paused"]),
        str(c["routable_pd_groups"]),
        workers,
    ]


def settings_line(coordinators: list[dict[str, Any]]) -> str | None:
    """Under the Coordinator table (which has no room for a column): the settings revision each
    applies (docs/configuration-reload.md) and the share of every rate limit it takes; one
    phrase when they agree, as they should. None when no Coordinator said."""
    groups: dict[tuple[int, int], list[str]] = {}
    for c in coordinators:
        if c.get("settings_revision") is not None:
            groups.setdefault((c["settings_revision"], c["replicas"]), []).append(c["address"])
    if not groups:
        return None

    def phrase(revision: int, replicas: int) -> str:
        which = f"revision {revision}" if revision else "their own file's"
        return f"{which} (1/{replicas} of every rate limit each)"

    if len(groups) == 1:
        (revision, replicas), _ = next(iter(groups.items()))
        return clip(f"settings: {phrase(revision, replicas)} on every Coordinator", WIDTH)
    parts = [f"{phrase(*key)}: {', '.join(addresses)}" for key, addresses in sorted(groups.items())]
    return clip("settings: " + "; ".join(parts), WIDTH)


def engine_text(e: dict[str, Any]) -> str:
    pid = f"pid={e['pid']}" if e["pid"] else "no pid"
    text = f"{e['endpoint']} {pid} {e['status']}" + (" headless" if e["headless"] else "")
    if e.get("startup_elapsed_s") is not None:
        text += f" starting {duration(e['startup_elapsed_s'])}"
    return text


def output_note(e: dict[str, Any], width: int) -> str | None:
    """``last output: <its last line>``, cut to ``width``, for an engine that has been starting
    for long; None for the others."""
    elapsed = e.get("startup_elapsed_s")
    lines = e.get("last_output_lines") or []
    if elapsed is None or elapsed <= SHOW_OUTPUT_AFTER_S or not lines:
        return None
    label = "last output: "
    return label + clip_middle(lines[-1], max(width - len(label), 20))


def nodemanager_rows(nm: dict[str, Any], now: float, note_width: int = WIDTH) -> list[list[str]]:
    """The rows of one NodeManager: its first engine on its own row, one row more for each
    other engine (DP ranks), and under an engine that has been starting for long, a row whose
    text runs on from the second column: its last output line, cut to ``note_width``."""
    instance = f"{nm['instance_id']} {nm['role']}".strip() if nm["instance_id"] else "-"
    if nm["error"] is not None:
        return [[nm["address"], instance, problem(nm["error"])]]
    frozen = "no"
    if nm["frozen"]:
        left = datetime.fromisoformat(nm["frozen_until"]).timestamp() - now
        frozen = duration(max(0.0, left))
    uptime = duration(nm["uptime_s"]) if nm["uptime_s"] is not None else "-"
    first = [nm["address"], instance, yes_no(nm["ready"]), uptime, str(nm["restarts"]), frozen]
    if not nm["engines"]:
        return [[*first, "none"]]
    rows = []
    for k, e in enumerate(nm["engines"]):
        rows.append([*(first if k == 0 else [""] * 6), engine_text(e)])
        note = output_note(e, note_width)
        if note is not None:
            # Right under the engine's row. Fewer cells than the header: it runs on from the
            # second column and widens no column.
            rows.append(["", note])
    return rows


def render(doc: dict[str, Any], now: float) -> list[str]:
    """The text of ``motor status``; ``now`` (wall clock) is what a freeze's end is counted from."""
    lines = controller_lines(doc["controller"])
    lines.append("")
    lines += table_lines([COORDINATOR_HEADER] + [coordinator_row(c) for c in doc["coordinators"]])
    settings = settings_line(doc["coordinators"])
    if settings is not None:
        lines.append(settings)
    lines.append("")
    if doc["nodemanagers"] is None:
        lines.append("NodeManagers: unknown (the Controller lists them)")
    elif not doc["nodemanagers"]:
        lines.append("NodeManagers: none (no instance names one)")
    else:
        rows = [NODEMANAGER_HEADER]
        # A note row starts in the second column, after the widest address.
        indent = max(len(nm["address"]) for nm in [{"address": NODEMANAGER_HEADER[0]}, *doc["nodemanagers"]])
        for nm in doc["nodemanagers"]:
            rows += nodemanager_rows(nm, now, WIDTH - indent - 2)
        lines += table_lines(rows)
    return lines
