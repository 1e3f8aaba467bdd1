"""results/scale.md from the scale benchmark's measured numbers (bench/bench_scale.py keeps them
in scale.json): the setup, one table row per Controller run (each on its store, SQLite or
etcd), the verdict against the target, etcd's own cost, and the notes.

A scale.json from before the etcd store has no ``store`` in its rows: every run was on SQLite.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

INTERVAL_S = 3.0
GENERATORS = 4
CHANNELS_PER_GENERATOR = 25
CONTROLLER_CPU, LOAD_CPU = "0", "1"
TARGET_NODES, TARGET_CPU, TARGET_P99_MS = 10_000, 60.0, 100.0
RAW_NAME = "scale.json"
STORE_NAMES = {"sqlite": "SQLite", "etcd": "etcd"}
MIB = 1 << 20

Run = dict[str, Any]
Row = tuple[Run, Run | None]  # a Controller run, and the echo run at its N when it has one


def store(c: Run) -> str:
    return str(c.get("store", "sqlite"))


def _f(v: Any, fmt: str = ".1f") -> str:
    return "—" if v is None or v != v else format(v, fmt)


def _windows(r: Run | None) -> list[dict[str, float]]:
    return r.get("server_windows", []) if r else []


def median_window(windows: list[dict[str, float]], key: str) -> float:
    return statistics.median(w[key] for w in windows)


def worst_window(windows: list[dict[str, float]]) -> dict[str, float]:
    """The 10 s window with the highest server-side ack p99: what the target is judged on."""
    return max(windows, key=lambda w: w["ack_p99_ms"])


def latency_cell(r: Run | None) -> str:
    windows = _windows(r)
    if not windows:
        return "—"
    p50, p99 = median_window(windows, "ack_p50_ms"), median_window(windows, "ack_p99_ms")
    return f"{p50:.2f} / {p99:.1f} / {worst_window(windows)['ack_p99_ms']:.1f}"


def _label(c: Run) -> str:
    return f"{c['n']:,}" + (f" (repeat {c['repeat']})" if c.get("repeat") else "")


def _name(c: Run) -> str:
    """A run in a sentence: N, store, repeat."""
    return f"N={c['n']:,} on {STORE_NAMES[store(c)]}" + (f", repeat {c['repeat']}" if c.get("repeat") else "")


def not_run(c: Run) -> str | None:
    """Why a run has no measurement: etcd missing, a failure, or no steady state."""
    if "skipped" in c:
        return str(c["skipped"])
    if "error" in c:
        return f"failed: {c['error']}"
    if "controller_exit" in c:
        return f"the Controller exited (status {c['controller_exit']}) during the run"
    if "server_cpu" not in c:
        return f"did not reach steady state: {c.get('status')}"
    return None


def misses(c: Run) -> list[str]:
    """What a measured run misses of the target: its CPU, its WORST window's p99."""
    cpu = c["server_cpu"]
    missed = [f"Controller CPU {cpu:.1f}% is over {TARGET_CPU:g}%"] if cpu >= TARGET_CPU else []
    windows = _windows(c)
    if not windows:
        missed.append("no `heartbeat_stats` window to judge the ack p99 by")
    elif (worst := worst_window(windows)["ack_p99_ms"]) >= TARGET_P99_MS:
        missed.append(f"the worst window's server ack p99 {worst:.1f} ms is over {TARGET_P99_MS:g} ms")
    return missed


def verdict(c: Run) -> str:
    """Pass or fail for one run at the target size, on its CPU and its WORST window's p99."""
    if "skipped" in c:
        return f"{_name(c)}: not run: {c['skipped']}."
    if (why := not_run(c)) is not None:
        return f"{_name(c)}: **target missed**: {why}."
    missed, windows, cpu = misses(c), _windows(c), c["server_cpu"]
    detail = ""
    if windows:
        worst, median = worst_window(windows)["ack_p99_ms"], median_window(windows, "ack_p99_ms")
        detail = (
            f" Controller CPU {cpu:.1f}% = {cpu / TARGET_CPU:.2f} x the {TARGET_CPU:g}% target; worst "
            f"window's ack p99 {worst:.1f} ms = {worst / TARGET_P99_MS:.2f} x the {TARGET_P99_MS:g} ms "
            f"target (median window {median:.1f} ms)."
        )
    head = "**target missed**: " + "; ".join(missed) + "." if missed else "target met."
    return f"{_name(c)}: {head}{detail}"


def gc_note(c: Run) -> str | None:
    """What the collector did in a run's steady windows, and in its worst one."""
    windows = [w for w in _windows(c) if "gc_collections" in w]
    if not windows:
        return None
    collections = sum(int(w["gc_collections"]) for w in windows)
    longest = max(w["gc_max_ms"] for w in windows)
    quiet = sum(1 for w in windows if not w["gc_collections"])
    worst = worst_window(windows)
    line = (
        f"{_name(c)}: {collections} garbage collections over the {len(windows)} steady windows "
        f"({quiet} without any), the longest pause {longest:.1f} ms; the worst window "
        f"(ack p99 {worst['ack_p99_ms']:.1f} ms) had {int(worst['gc_collections'])}"
    )
    if worst["gc_collections"]:
        return line + f", pausing up to {worst['gc_max_ms']:.1f} ms."
    return line + ": no collection ran in it, so its tail is not a collector pause."


def _table(rows: list[Row]) -> list[str]:
    echoes = {e["n"]: e for _, e in rows if e}
    lines = [
        "| N | store | beats/s | Controller CPU % | echo CPU % | ratio | server ack ms p50 / p99 / worst p99 "
        "| echo server ack ms p50 / p99 / worst p99 | client ack ms p50 / p99 | assembly s (nodes/s) "
        "| assembly CPU ms/node | generator CPU % | errors | background CPU % (steal %) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, e in rows:
        head = f"| {_label(c)} | {STORE_NAMES[store(c)]} "
        if (why := not_run(c)) is not None:
            lines.append(f"{head}| {why} | | | | | | | | | | | |")
            continue
        # CPU per beat, Controller over echo at the same N: the two runs' beat rates differ a little.
        same_n = None if c.get("repeat") else echoes.get(c["n"])
        echo_cpu = same_n.get("server_cpu") if same_n else None
        ratio = (
            (c["server_cpu"] / c["beats_s"]) / (echo_cpu / same_n["beats_s"]) if same_n and echo_cpu else None
        )
        own_echo = e.get("server_cpu") if e else None
        n = c["n"]
        lines.append(
            f"{head}| {c['beats_s']:,.0f} | {c['server_cpu']:.1f} | {_f(own_echo)} | {_f(ratio, '.2f')} "
            f"| {latency_cell(c)} | {latency_cell(e)} | {c['client_p50']:.1f} / {c['client_p99']:.1f} "
            f"| {c['assembly_s']:.1f} ({n / c['assembly_s']:.0f}/s) | {1000 * c['assembly_cpu_s'] / n:.1f} "
            f"| {c['gen_cpu']:.0f} | {c['errors']} | {c['other_cpu']:.0f} ({c['steal']:.0f}) |"
        )
    return lines


def _verdicts(rows: list[Row]) -> list[str]:
    judged = [c for c, _ in rows if c["n"] >= TARGET_NODES]
    if not judged:
        return ["", f"No run at {TARGET_NODES:,} nodes: the target was not tried."]
    lines = [""]
    for s in dict.fromkeys(store(c) for c in judged):
        ran = [c for c in judged if store(c) == s and "skipped" not in c]
        if not ran:
            continue
        missed = sum(bool(not_run(c) or misses(c)) for c in ran)
        where = f"at {TARGET_NODES:,} nodes or more on {STORE_NAMES[s]}"
        lines.append(
            f"**The target is missed** in {missed} of {len(ran)} run(s) {where}."
            if missed
            else f"The target is met in every run {where} ({len(ran)})."
        )
    return [*lines, "", *(f"- {verdict(c)}" for c in judged)]


def _measured(rows: list[Row], s: str) -> dict[int, Run]:
    return {c["n"]: c for c, _ in rows if store(c) == s and not c.get("repeat") and not_run(c) is None}


def comparison(rows: list[Row]) -> list[str]:
    """etcd against SQLite at the largest N both were tried at (etcd installed), with the
    verdict on etcd there."""
    first = {(c["n"], store(c)): c for c, _ in rows if not c.get("repeat") and "skipped" not in c}
    tried = sorted({n for n, s in first if s == "etcd"} & {n for n, s in first if s == "sqlite"})
    if not tried:
        return []
    n = tried[-1]
    a, b = first[n, "sqlite"], first[n, "etcd"]
    under = "" if n >= TARGET_NODES else f", though this N is under the {TARGET_NODES:,} of the target"
    head = f"**etcd against SQLite at N={n:,}**: "
    if (why := not_run(b)) is not None:
        return [
            "",
            f"{head}the etcd run has no measurement ({why}): on etcd the target is **missed**{under}.",
        ]
    missed = misses(b)
    judged = (
        f"**missed** ({'; '.join(missed)})"
        if missed
        else f"**met** (under {TARGET_CPU:g}% CPU and a worst-window ack p99 under {TARGET_P99_MS:g} ms)"
    )
    verdict_text = f"On etcd the target at this N is {judged}{under}."
    if (why := not_run(a)) is not None:
        return ["", f"{head}the SQLite run has no measurement ({why}). {verdict_text}"]
    wa, wb = _windows(a), _windows(b)
    p99 = (
        f"the worst window's server ack p99 {worst_window(wb)['ack_p99_ms']:.1f} ms against "
        f"{worst_window(wa)['ack_p99_ms']:.1f} ms (median window {median_window(wb, 'ack_p99_ms'):.1f} "
        f"against {median_window(wa, 'ack_p99_ms'):.1f} ms)"
        if wa and wb
        else "no `heartbeat_stats` window to compare the ack p99 by"
    )
    return [
        "",
        f"{head}the leader's CPU {b['server_cpu']:.1f}% on etcd against {a['server_cpu']:.1f}% on SQLite "
        f"({b['server_cpu'] / a['server_cpu']:.2f} x); {p99}; assembly {b['assembly_s']:.1f} s against "
        f"{a['assembly_s']:.1f} s ({1000 * b['assembly_cpu_s'] / n:.1f} against "
        f"{1000 * a['assembly_cpu_s'] / n:.1f} ms of Controller CPU per node). {verdict_text}",
    ]


def etcd_cost(rows: list[Row]) -> list[str]:
    """etcd's own CPU and database size, per N it was measured at."""
    etcd = _measured(rows, "etcd")
    lines: list[str] = []
    if etcd:
        lines += [
            "",
            f"etcd's own cost (on CPU {LOAD_CPU}, with the generators):",
            "",
            "| N | leader CPU % | etcd CPU % | etcd CPU at assembly ms/node | etcd DB MiB (in use) "
            "| etcd revisions / node |",
            "|---|---|---|---|---|---|",
        ]
        for n, c in sorted(etcd.items()):
            lines.append(
                f"| {n:,} | {c['server_cpu']:.1f} | {_f(c.get('etcd_cpu'))} "
                f"| {_f(1000 * c['etcd_assembly_cpu_s'] / n if 'etcd_assembly_cpu_s' in c else None)} "
                f"| {_f(c.get('etcd_db_bytes', float('nan')) / MIB)} "
                f"({_f(c.get('etcd_db_in_use_bytes', float('nan')) / MIB)}) "
                f"| {_f(c.get('etcd_revision', float('nan')) / n)} |"
            )
    return lines


def _setup(raw: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [
        f"Controller pinned to CPU {CONTROLLER_CPU}; {GENERATORS} generator processes pinned to "
        f"CPU {LOAD_CPU}, "
        f"≤{CHANNELS_PER_GENERATOR} grpc.aio channels each (one TCP connection per channel); one beat per "
        f"node every {INTERVAL_S:g} s; one one-endpoint instance per node. Steady window "
        f"{args.window:g} s (Controller) / {args.echo_window:g} s (echo). CPU is % of one core. "
        f"Target: {TARGET_NODES:,} nodes under {TARGET_CPU:g}% CPU and server-side ack p99 under "
        f"{TARGET_P99_MS:g} ms in every 10 s window.",
    ]
    e = raw.get("etcd")
    if e:
        lines += [
            "",
            f"On the etcd store: a fresh one-member etcd {e['version']} for each Controller run, **pinned "
            f"to CPU {LOAD_CPU} with the generators** (its CPU competes with theirs, not with the "
            f"Controller's, and is reported apart), its data directory in the run's temporary directory "
            f"({e['fs']}), `--quota-backend-bytes` {e['quota_bytes'] / (1 << 30):g} GiB, otherwise "
            f'etcd\'s defaults (no compaction). The Controller runs with `store = "etcd"`, a fresh '
            f"`etcd_prefix` and `leader_lease_s` at its default ({e['lease_s']:g} s): it starts as a "
            "standby and, with no other candidate, wins the election at once; the generators start "
            "once it logs `event=leading`. Measured exactly as on SQLite.",
        ]
    return lines


def render(raw: dict[str, Any]) -> str:
    args = argparse.Namespace(**raw["args"])
    rows: list[Row] = [(c, e) for c, e in raw["rows"]]
    lines = [
        "# Control-plane scale: N simulated NodeManagers → one Controller",
        "",
        raw["machine"],
        "",
        *_setup(raw, args),
        "",
        *_table(rows),
        *_verdicts(rows),
        *comparison(rows),
        *etcd_cost(rows),
    ]
    notes = [
        f"{_name(c)}: no `event=heartbeat_stats` line in the Controller log."
        for c, _ in rows
        if not_run(c) is None and not _windows(c)
    ]
    gc_lines = [g for c, _ in rows if (g := gc_note(c))]
    if gc_lines:
        lines += [
            "",
            "Garbage collection in the Controller (from `heartbeat_stats`):",
            "",
            *(f"- {g}" for g in gc_lines),
        ]
    lines += [
        "",
        "- **server ack**: from the Controller's own `event=heartbeat_stats` lines (one per 10 s window: "
        "message in hand → ack handed to gRPC and the handler resumed): the median over the windows of "
        "each window's p50 and p99, and the worst window's p99. The echo server logs the same line. The "
        "target is judged on the worst window.",
        "- **client ack**: beat write → ack read in the generators; includes the generators' own queueing "
        f"(they share CPU {LOAD_CPU}), so it is an upper bound on what the Controller adds.",
        "- **assembly s**: first Register → every instance ACTIVE in `ListInstances`. The generators "
        f"keep at most {args.inflight} nodes each registered but not yet assembled (a closed loop: the "
        "Controller sets the pace; an open-loop ramp past its pace gets Register calls CANCELLED by gRPC), "
        "at most one interval's worth of nodes per second. Each node's fake NodeManager answers "
        "GetStatus/StartEngines at once and beats NORMAL right after StartEngines. **assembly CPU "
        "ms/node**: Controller CPU spent from first Register to all ACTIVE, per node (it includes the "
        "beats of the nodes already up).",
        "- **background CPU**: CPU used on the machine during the Controller's window by processes other "
        "than this benchmark's (other users), and the hypervisor's steal time; both as % of one core. "
        "Numbers taken with a busy background are pessimistic.",
        "- **ratio**: Controller CPU per beat / echo CPU per beat at the same N (the echo server acks "
        "beats on the same proto with a bare grpc.aio servicer, read/write as the Controller does: "
        "no validation, interceptors or state). One echo run per N serves every store's row.",
        *(
            [
                "- **repeat**: the largest N run again (Controller only, same settings): how far one run is "
                "from the next on this machine."
            ]
            if any(c.get("repeat") for c, _ in rows)
            else []
        ),
        "- The fake nodes of one generator share one NodeManager address (127.0.0.1, one port per "
        f"generator), so the Controller's NodeManager channel cache holds {GENERATORS} channels; a real "
        "fleet costs one connection per NodeManager at assembly.",
    ]
    if raw.get("etcd"):
        lines += [
            "- **etcd CPU %**: the etcd process's CPU over the same steady window as the leader's; **at "
            "assembly**: from first Register to all ACTIVE, per node. **DB MiB**: "
            "`etcd_mvcc_db_total_size_in_bytes` (in use: `..._in_use_in_bytes`) from etcd's /metrics at "
            "the end of the run; **revisions / node**: etcd's revision then, per node (about one per "
            "write the Controller made, the election's included).",
        ]
    lines += [
        *[f"- {n}" for n in notes],
        "",
        f"Written by `python -m bench.bench_scale`; every number is also in `{RAW_NAME}` "
        "(`--render-only` writes this file again from it).",
        "",
    ]
    return "\n".join(lines)
