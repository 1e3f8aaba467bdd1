"""The planner against every static prefill:decode split, on traffic that swings from
prefill-heavy to decode-heavy.

Each configuration runs on a fresh ``motor up`` with 8 instances (8 NodeManagers, one simulated
engine each): the planner (``controller.planner.mode`` act, starting from 4:4) and the static
splits 1:7 ... 7:1 (planner off). All replay the same trace (bench/loadgen/planner_load.py).

**Latency model** (docs/sim-engine.md, "Latency model"), every engine alike:

- prefill is compute-bound (``prefill_compute: serial``): an engine's prefills run one after
  another, in arrival order, each ``ttft_ms + prefill_ms_per_token x prompt tokens`` = 20 ms +
  1 ms per token (a 400-token prompt holds the engine's compute 420 ms: one prefill instance
  serves about 2.4 such requests, 950 prompt tokens, a second);
- decode is memory-bound (``tpot_ms_per_seq``): after a 5 ms KV transfer, each output token of
  a stream takes ``tpot_ms + tpot_ms_per_seq x (running - 1)`` = 40 ms + 20 ms per other
  sequence running on its engine (1 stream: 40 ms a token; 6 streams: 140 ms); at most 16 run
  on an engine (``max_num_seqs``), the others wait for a slot. An engine's decode throughput so
  tends to 50 tokens/s, and its inter-token latency climbs steeply near that.

**Trace** (seeded, open-loop Poisson arrivals, streamed ``/v1/completions``): a warm-up of kind
A (``WARMUP_S``, not scored: the same for every configuration, it lets the planner learn and
leave its 4:4 start), then a phase A and a phase B of ``PHASE_S`` each, scored.

- A: long prompts (300-500 words, one token each), short answers (2-6 tokens), 10 requests/s:
  about 4,000 prompt tokens/s, so prefill needs 5 instances or more (4 would run at 105 % of
  their compute); the answers, about 40 tokens/s, need 2 decode instances (one would run near
  its decode throughput, just past the inter-token target);
- B: short prompts (10-30 words), long answers (40-80 tokens), 3 requests/s: about 180 tokens/s
  of decode, so decode needs 5 instances or more (4 would run at 90 % of their throughput, far
  past the inter-token target), while prefill takes a few % of one instance.

No split of 8 serves both kinds; the right split for each does. Times are scaled up from a real
GPU's (targets of 1.5 s to the first token and 150 ms between tokens) so that this machine's two
cores relay every token on time: about 200 token chunks/s per cluster at most.

**Scoring**: 30 s windows of the scored part; a window meets the SLA when the p90 time to first
token of the requests sent in it is within ``TTFT_TARGET_MS`` and the p90 of the inter-token
gaps that ended in it is within ``ITL_TARGET_MS`` (both as the client measures them; a request
without a first token counts as infinitely late). Attainment = windows met / windows. Also
reported: requests and tokens served (scored part), errors (the whole run, warm-up included: a
non-200, an error event, a stream ended without ``[DONE]`` or short of its ``max_tokens``, a
request given up: no token within ``FIRST_TOKEN_S`` or no whole answer within ``ANSWER_S``), and
for the planner its role switches (motor up's ``role_switch_finished`` lines) and a timeline of
its decisions. Targets: the planner's attainment at least the best static split's + 10 points,
and no error in the planner's run.

Four clusters run at a time (``--parallel``; one client process drives them all), on port
offsets 20000 and up (clear of ``make up`` and of the other benches' 10000-20000). About 9
minutes on 2 cores.

    python -m bench planner
    python -m bench.bench_planner [--quick] [--configs planner,5:3] [--order AB] [--parallel 4]
        [--keep DIR] [--out FILE]

``--quick`` (or ``MOTOR_BENCH_QUICK=1``): the planner and 5:3 only, shorter phases (a check that
it all runs; its numbers mean little). ``--keep DIR`` keeps every cluster's config and log there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.loadgen import planner_load
from bench.loadgen.harness import machine, publish
from bench.loadgen.planner_load import Answer, Phase, Window
from bench.loadgen.up import Up

RESULTS = Path(__file__).parent / "results" / "planner.md"
SEED = 20261207
INSTANCES = 8
WINDOW_S = 30.0
SETTLE_S = 2.0  # after READY, before the trace starts
# A client gives a request up (an error: "timeout") when no token came within FIRST_TOKEN_S, or
# the answer is not whole within ANSWER_S.
FIRST_TOKEN_S = 10.0
ANSWER_S = 60.0

# The latency model: engine.args of every engine.
ENGINE_ARGS = {
    "prefill_compute": "serial",
    "ttft_ms": 20,
    "prefill_ms_per_token": 1.0,
    "kv_transfer_ms": 5,
    "tpot_ms": 40,
    "tpot_ms_per_seq": 20,
    "max_num_seqs": 16,
}
TTFT_TARGET_MS = 1500.0
ITL_TARGET_MS = 150.0

# Per phase kind: requests/s, prompt words (= tokens), answer tokens (uniform, inclusive).
KINDS: dict[str, tuple[float, tuple[int, int], tuple[int, int]]] = {
    "A": (10.0, (300, 500), (2, 6)),
    "B": (3.0, (10, 30), (40, 80)),
}
WARMUP_S = 30.0
PHASE_S = 90.0
ORDER = "AB"

PLANNER = {
    "mode": "act",
    "interval_s": 2,
    "ttft_p90_ms": TTFT_TARGET_MS,
    "itl_p90_ms": ITL_TARGET_MS,
    "cooldown_s": 20,
    "min_gain": 0.05,
    "max_switches": 1,
}
COORDINATOR = {"drain_grace_s": 1, "engine_metrics_interval_s": 1}

EVENTS = re.compile(r"event=(planner_decision|role_switch_\w+|planner_waiting)\b")
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


@dataclass(frozen=True)
class Setup:
    name: str
    prefill: int
    decode: int
    planner: bool = False


@dataclass
class Run:
    setup: Setup
    answers: list[Answer] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    events: list[tuple[float, dict[str, str]]] = field(default_factory=list)  # (trace time, fields)
    ready_s: float = 0.0
    wall_s: float = 0.0

    @property
    def attainment(self) -> float:
        return sum(w.met for w in self.windows) / len(self.windows) if self.windows else 0.0

    @property
    def errors(self) -> list[Answer]:
        return [a for a in self.answers if a.error]

    def switches(self, outcome: str | None = None) -> int:
        return sum(
            1
            for _, f in self.events
            if f.get("event") == "role_switch_finished" and (outcome is None or f.get("outcome") == outcome)
        )


def setups(names: list[str] | None) -> list[Setup]:
    every = [Setup("planner", 4, 4, planner=True)] + [
        Setup(f"{p}:{INSTANCES - p}", p, INSTANCES - p) for p in range(1, INSTANCES)
    ]
    if not names:
        return every
    by_name = {s.name: s for s in every}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def phases(quick: bool, order: str = ORDER) -> list[Phase]:
    warm, length = (20.0, 30.0) if quick else (WARMUP_S, PHASE_S)
    kinds = [(order[0], warm, False)] + [(k, length, True) for k in order]
    return [Phase(k, s, *KINDS[k], scored=scored) for k, s, scored in kinds]


def _fields(line: str) -> dict[str, str]:
    return {k: v[1:-1] if v.startswith('"') else v for k, v in FIELD.findall(line)}


async def _follow(log: Path, t0: float, out: list[tuple[float, dict[str, str]]], stop: asyncio.Event) -> None:
    """The planner's and the switches' log lines, stamped with the trace time they appeared at."""
    pos, rest = 0, b""
    while True:
        with log.open("rb") as f:
            f.seek(pos)
            chunk = f.read()
        pos += len(chunk)
        *lines, rest = (rest + chunk).split(b"\n")
        now = time.monotonic() - t0
        for raw in lines:
            line = raw.decode(errors="replace")
            if EVENTS.search(line):
                out.append((now, _fields(line)))
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


def _config(setup: Setup) -> dict[str, object]:
    planner = PLANNER if setup.planner else {"mode": "off"}
    return {"controller": {"planner": planner}, "coordinator": COORDINATOR, "engine": {"args": ENGINE_ARGS}}


def _write_config(setup: Setup, workdir: Path) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "config.json"
    cfg.write_text(json.dumps(_config(setup)))
    return cfg


def _keep(base: Path, keep: Path | None) -> None:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        for d in base.iterdir():
            shutil.copytree(d, keep / d.name, dirs_exist_ok=True)
    shutil.rmtree(base, ignore_errors=True)


async def run_one(
    setup: Setup, trace: list[planner_load.Request], plan: list[Phase], slot: int, workdir: Path
) -> Run:
    run = Run(setup)
    cfg = _write_config(setup, workdir)
    args = ["--prefill", str(setup.prefill), "--decode", str(setup.decode), "--config", str(cfg)]
    # Offsets 25 apart per slot (at most 4 slots): a cluster's ports span less than 20 above
    # each base port, and the base ports are 100 apart, so two slots' clusters never share one.
    offsets = range(20_000 + 25 * slot, 20_600, 100)
    started = time.monotonic()
    up = await asyncio.to_thread(Up, args, workdir, 120.0, 4, None, offsets)
    run.ready_s = up.ready_s
    stop = asyncio.Event()
    try:
        await asyncio.sleep(SETTLE_S)
        t0 = time.monotonic()
        follower = asyncio.create_task(_follow(up.log, t0, run.events, stop))
        print(f"  {setup.name}: READY in {up.ready_s:.1f} s (offset {up.offset}), replaying", file=sys.stderr)
        run.answers = await planner_load.replay(up.url, trace, FIRST_TOKEN_S, ANSWER_S)
        stop.set()
        await follower
    finally:
        stop.set()
        await asyncio.to_thread(up.stop, 20.0)
    run.wall_s = time.monotonic() - started
    run.windows = planner_load.score(run.answers, plan, WINDOW_S, TTFT_TARGET_MS / 1000, ITL_TARGET_MS / 1000)
    met = sum(w.met for w in run.windows)
    print(
        f"  {setup.name}: {met}/{len(run.windows)} windows met, {len(run.errors)} errors, "
        f"{run.switches()} switches, {run.wall_s:.0f} s",
        file=sys.stderr,
    )
    return run


async def run_all(chosen: list[Setup], plan: list[Phase], parallel: int, keep: Path | None) -> list[Run]:
    trace = planner_load.trace(plan, SEED)
    slots: asyncio.Queue[int] = asyncio.Queue()
    for s in range(parallel):
        slots.put_nowait(s)
    base = Path(tempfile.mkdtemp(prefix="bench-planner-"))

    async def one(setup: Setup) -> Run:
        slot = await slots.get()
        try:
            return await run_one(setup, trace, plan, slot, base / setup.name.replace(":", "-"))
        finally:
            slots.put_nowait(slot)

    try:
        return list(await asyncio.gather(*(one(s) for s in chosen)))
    finally:
        _keep(base, keep)


# ---- the report -------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return "∞" if seconds == float("inf") else f"{seconds * 1000:.0f}"


def _trace_lines(plan: list[Phase], trace: list[planner_load.Request]) -> list[str]:
    rows = []
    for i, p in enumerate(plan):
        reqs = [r for r in trace if r.phase == i]
        prompt = sum(r.prompt_tokens for r in reqs)
        answer = sum(r.max_tokens for r in reqs)
        rows.append(
            f"| {i + 1} | {p.kind}{'' if p.scored else ' (warm-up, not scored)'} | {p.seconds:g} | "
            f"{p.rate:g} | {'-'.join(map(str, p.prompt_words))} | {'-'.join(map(str, p.answer_tokens))} | "
            f"{len(reqs)} | {prompt / p.seconds:.0f} | {answer / p.seconds:.0f} |"
        )
    return [
        "| phase | kind | s | requests/s | prompt tokens, each | answer tokens, each | requests | "
        "prompt tokens/s | answer tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def _decisions(run: Run) -> str:
    counts: dict[str, int] = {}
    for _, f in run.events:
        if f.get("event") == "planner_decision":
            counts[f.get("decision", "")] = counts.get(f.get("decision", ""), 0) + 1
    return (
        f"{sum(counts.values())} decisions (" + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) + ")"
    )


def _timeline(run: Run) -> list[str]:
    rows = []
    for t, f in run.events:
        ev = f.get("event", "")
        if ev == "planner_decision" and f.get("decision") in ("learning", "hold"):
            continue
        if ev == "planner_decision":
            g = f.get
            what = (
                f"{g('decision')}: {g('reason', '')} (demand prefill {g('demand_prefill_tps', '-')} tok/s, "
                f"decode {g('demand_decode_seqs', '-')} seqs; capacity per instance "
                f"{g('capacity_prefill_tps', '-')} tok/s, {g('capacity_decode_seqs', '-')} seqs; "
                f"p90 TTFT {g('ttft_p90_ms', '-')} ms, ITL {g('itl_p90_ms', '-')} ms)"
            )
        elif ev == "role_switch_started":
            what = f"started: instance {f.get('instance_id')}, {f.get('from_role')} → {f.get('to_role')}"
        elif ev == "role_switch_finished":
            what = (
                f"switch finished: instance {f.get('instance_id')} now {f.get('role')}, "
                f"{f.get('outcome')} in {f.get('seconds')} s"
            )
        elif ev == "role_switch_drained":
            what = (
                f"drained: instance {f.get('instance_id')} in {f.get('seconds')} s, "
                f"{f.get('in_flight')} in flight"
            )
        else:
            what = f"{ev}: {f.get('reason', '')}"
        rows.append(f"| {t:.1f} | {what} |")
    return ["| trace s | event |", "|---|---|", *rows] if rows else ["(no decision other than hold/learning)"]


def _static_summary(statics: list[Run], plan: list[Phase]) -> list[str]:
    """Which static splits serve which phase kind, from the windows measured."""
    if not statics:
        return []
    # The first window of a phase that follows one of the other kind carries that phase's backlog.
    firsts, t = set(), 0.0
    for before, p in zip([None, *plan], plan, strict=False):
        if p.scored and before is not None and before.kind != p.kind:
            firsts.add(round(t, 3))
        t += p.seconds
    kinds = sorted({w.kind for w in statics[0].windows})
    lines = []
    for kind in kinds:
        serve = [
            r.setup.name
            for r in statics
            if all(w.met for w in r.windows if w.kind == kind and round(w.start, 3) not in firsts)
        ]
        lines.append(
            f"- every window of kind {kind} (the first after a change aside): {', '.join(serve) or 'none'}"
        )
    both = [r.setup.name for r in statics if all(any(w.met for w in r.windows if w.kind == k) for k in kinds)]
    lines.append(f"- at least one window of each kind: {', '.join(both) or 'none'}")
    return [
        "Static splits that met:",
        "",
        *lines,
        "",
        "A static split overloaded in one phase starts the next with that phase's backlog (the "
        f"requests its clients still wait for, up to {FIRST_TOKEN_S:g} s deep), which costs it the "
        "next phase's first window too.",
    ]


def report(runs: list[Run], plan: list[Phase], wall_s: float, quick: bool, parallel: int) -> str:
    trace = planner_load.trace(plan, SEED)
    statics = [r for r in runs if not r.setup.planner]
    planner = next((r for r in runs if r.setup.planner), None)
    first = runs[0].windows
    head = " | ".join(f"{w.start:.0f}-{w.start + WINDOW_S:.0f} s ({w.kind})" for w in first)
    out = [
        "# The planner against static prefill:decode splits",
        "",
        f"Generated by `python -m bench planner`{' (--quick: its numbers mean little)' if quick else ''} "
        f"({machine()}). Whole bench: **{wall_s / 60:.1f} min** wall time, "
        f"{len(runs)} configurations, {min(len(runs), parallel)} clusters at a time (one client "
        f"process drives them all); `motor up` READY in {min(r.ready_s for r in runs):.0f}-"
        f"{max(r.ready_s for r in runs):.0f} s, each configuration start to stop in "
        f"{min(r.wall_s for r in runs):.0f}-{max(r.wall_s for r in runs):.0f} s.",
        "",
        "## Set-up",
        "",
        f"Each configuration: a fresh `motor up` with {INSTANCES} instances (8 NodeManagers, one simulated "
        "engine each), `coordinator.drain_grace_s` 1, `coordinator.engine_metrics_interval_s` 1. The "
        "planner starts from 4:4 with `controller.planner` = "
        f"`{json.dumps(PLANNER, separators=(', ', ': '))}`; the static splits run with the planner off.",
        "",
        "**Latency model** (every engine, `engine.args` "
        f"`{json.dumps(ENGINE_ARGS, separators=(', ', ': '))}`):",
        "",
        f"- prefill, compute-bound: an engine's prefills run one after another (FIFO), each "
        f"{ENGINE_ARGS['ttft_ms']} ms + {ENGINE_ARGS['prefill_ms_per_token']:g} ms per prompt token "
        "(a 400-token prompt: 420 ms; one instance serves about 950 prompt tokens/s);",
        f"- decode, memory-bound: {ENGINE_ARGS['kv_transfer_ms']} ms KV transfer, then each token of a "
        f"stream takes {ENGINE_ARGS['tpot_ms']} ms + {ENGINE_ARGS['tpot_ms_per_seq']} ms per other "
        f"running sequence of its engine (at most {ENGINE_ARGS['max_num_seqs']} running, the rest wait "
        "for a slot): an engine's decode throughput tends to 50 tokens/s and its latency rises steeply "
        "near it.",
        "",
        f"**Trace** (seed {SEED}, open-loop Poisson arrivals, streamed `/v1/completions`; prompt tokens "
        "= words, each prompt starting with a word of its own so nothing is a prefix-cache hit):",
        "",
        *_trace_lines(plan, trace),
        "",
        "Phase A needs 5+ prefill instances (4 would run at about 105 % of their compute) and 2 decode "
        "(its 40 answer tokens/s would take one near its decode throughput, just past the inter-token "
        "target); phase B needs 5+ decode instances (4 would run at about 90 % of their decode "
        "throughput, far past the inter-token target) and 1 prefill. No static split of 8 serves both.",
        "",
        f"**Targets** (as the client measures them): p90 time to first token ≤ {TTFT_TARGET_MS:g} ms "
        f"over the requests sent in a {WINDOW_S:g} s window, and p90 inter-token gap ≤ "
        f"{ITL_TARGET_MS:g} ms over the gaps that ended in it. Attainment = windows meeting both / "
        f"windows of the scored part (the warm-up is not scored). A client gives a request up after "
        f"{FIRST_TOKEN_S:g} s without a token, or {ANSWER_S:g} s without the whole answer. Requests and "
        "tokens served count the scored part; errors the whole run (warm-up included).",
        "",
        "## Results",
        "",
        "| configuration | attainment | windows met | requests | tokens served | errors | of which "
        "timeouts | role switches |",
        "|---|---|---|---|---|---|---|---|",
    ]
    scored_from = sum(p.seconds for p in plan if not p.scored)
    for r in runs:
        scored = [a for a in r.answers if a.request.at >= scored_from]
        met = sum(w.met for w in r.windows)
        timeouts = sum(1 for a in r.errors if a.error == "timeout")
        switches = f"{r.switches('succeeded')} ({r.switches()} finished)" if r.setup.planner else "-"
        out.append(
            f"| {r.setup.name} | {r.attainment * 100:.0f} % | {met}/{len(r.windows)} | {len(scored)} | "
            f"{sum(a.tokens for a in scored)} | {len(r.errors)} | {timeouts} | {switches} |"
        )
    out += [
        "",
        "Per window: p90 time to first token / p90 inter-token gap, ms (✓ both within target):",
        "",
        f"| configuration | {head} |",
        "|---|" + "---|" * len(first),
    ]
    for r in runs:
        cells = [f"{_ms(w.ttft_p90)} / {_ms(w.itl_p90)} {'✓' if w.met else '✗'}" for w in r.windows]
        out.append(f"| {r.setup.name} | {' | '.join(cells)} |")
    out += ["", *_static_summary(statics, plan)]
    if planner is not None:
        kinds: dict[str, int] = {}
        for a in planner.errors:
            kinds[a.error] = kinds.get(a.error, 0) + 1
        out += [
            "",
            "## The planner's run",
            "",
            f"{_decisions(planner)}. Its decisions other than hold and learning, and its switches "
            f"(trace time; the warm-up is 0-{scored_from:g} s):",
            "",
            *_timeline(planner),
        ]
        if kinds:
            out += ["", "Errors: " + ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))]
    out += ["", "## Verdict", ""]
    if planner is not None and statics:
        best = max(statics, key=lambda r: r.attainment)
        ties = ", ".join(r.setup.name for r in statics if r.attainment == best.attainment)
        gap = (planner.attainment - best.attainment) * 100
        out.append(
            f"- planner minus best static ({ties}): {planner.attainment * 100:.0f} % - "
            f"{best.attainment * 100:.0f} % = **{gap:+.0f} points** (target ≥ +10): "
            f"{'PASS' if gap >= 10 - 1e-9 else 'MISS'}"
        )
    if planner is not None:
        n = len(planner.errors)
        out.append(
            f"- errors in the planner's run, through its {planner.switches('succeeded')} role switches: "
            f"**{n}** (target 0): {'PASS' if n == 0 else 'MISS'}"
        )
    out.append("")
    return "\n".join(out)


PARALLEL = 4


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_planner")
    p.add_argument("--quick", action="store_true", help="planner and 5:3 only, short phases")
    p.add_argument("--configs", help="comma-separated: planner, 1:7 ... 7:1 (default: all)")
    p.add_argument("--parallel", type=int, default=PARALLEL, help=f"clusters at a time (default {PARALLEL})")
    p.add_argument("--order", default=ORDER, help=f"phase kinds after the warm-up (default {ORDER})")
    p.add_argument("--keep", type=Path, help="keep every cluster's state and log in this directory")
    p.add_argument("--out", type=Path, default=RESULTS, help="results file")
    args = p.parse_args(argv)
    args.quick = args.quick or os.environ.get("MOTOR_BENCH_QUICK", "") not in ("", "0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse([] if argv is None else argv)
    parallel = min(4, max(1, args.parallel))  # port offsets fit 4 clusters
    names = args.configs.split(",") if args.configs else (["planner", "5:3"] if args.quick else None)
    chosen = setups(names)
    plan = phases(args.quick, args.order)
    t0 = time.monotonic()
    runs = asyncio.run(run_all(chosen, plan, parallel, args.keep))
    return publish(args.out, report(runs, plan, time.monotonic() - t0, args.quick, parallel))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
