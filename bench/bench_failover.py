"""Failover: how fast a killed engine or NodeManager is noticed and serving again, under load.

`motor up --prefill 1 --decode 2` (simulated engines) with one client sending non-streaming
chat completions one after another. Each round SIGKILLs one decode instance's engine process
group (10 rounds), then one decode NodeManager (10 rounds), alternating between the two decode
instances and waiting for all three instances to be ACTIVE (and the node about to be hit to
have run for motor up's healthy-run time, so no crash-loop backoff is measured) in between. Per
round:

- detection: the kill → the Controller no longer lists the instance ACTIVE (polled every 10 ms);
- recovery overhead: the kill → a decode instance of that job is ACTIVE again with a new
  engine, minus the simulated engine's own start time (spawn → /health 200, measured alone);
- failed requests while the round ran.

Everything runs twice: with engine relaunch (the default) and with it disabled
(`controller.enable_engine_relaunch = false`: the NodeManager's pod-restart fallback instead).
Targets: detection < 1 s, overhead < 2 s, no failed request while another pair exists.

Then hung engines (5 rounds of each, relaunch on, `nodemanager.engine_probe_inference` on, every
other setting at its default), on a cluster of their own: a decode engine's process group
SIGSTOPped (/health stops answering), and the simulated engine's `hang` fault (a wedged
scheduler: /health keeps answering, only the inference probe tells), beside engine SIGKILLs on
the same cluster. Detection and overhead as above; "after detection" is serving again minus
detection minus the engine's start. Target: a hang costs at most `engine_hang_timeout_s` + 1 s
more than a crash once detected (its after-detection time, worst round, against the crash's
median); detection itself is the probes' settings, reported as measured.

Then streams (bench/loadgen/stream_failover.py): `motor up --prefill 2 --decode 2`, 200 clients
streaming greedy 256-token chat completions and one sending non-streamed requests while a decode
engine is SIGKILLed every 10 s for 2 minutes, once with continuation on another instance
(`coordinator.migration_limit`) off and once on: streams lost per kill, the share completed and
equal token for token to a fault-free run, non-streamed failures, and the token gap a client
sees across a continuation.

Then the Controller (bench/loadgen/controller_failover.py): `motor up --ha` (etcd and two
Controllers), 10 SIGKILLs of the leader, timing the new leader and the NodeManagers' re-attach.
It needs etcd; without it the report says so and the rest runs.

Last, real engines (bench/loadgen/real_failover.py): vLLM's CPU build serving a tiny model, the
decode engine SIGKILLed 3 times, detection and the relaunch's overhead over the engine's own
start. It needs `make real-engines`; without it the report says so.

    python -m bench.bench_failover [--rounds 10] [--only engine,nodemanager,hang,streams,controller,real]
                                   [--stream-duration 120] [--out DIR]
    python -m bench failover   # everything, into bench/results
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen import controller_failover, real_failover, stream_failover
from bench.loadgen.failover_load import Load, UpCluster, process_age_s
from bench.loadgen.harness import machine, publish
from bench.loadgen.up import NM
from motor_mesh.cli.up import HEALTHY_RUN_S
from motor_mesh.common.config import DEFAULTS
from motor_mesh.gen.motor.v1 import common_pb2
from tools import real_engines

RESULTS = Path(__file__).parent / "results"
REPORT = "failover.md"
KINDS = ("engine", "nodemanager")  # the instance faults; "controller" is the third part
# Hung engines, beside engine SIGKILLs on the same cluster: its process group stopped, and the
# simulated engine's `hang` fault (a wedged scheduler the inference probe finds).
HANG_KINDS = ("engine", "sigstop", "sim_hang")
# streams: streamed answers through decode engine kills, continuation off and on.
PARTS = (*KINDS, "hang", "streams", "controller", "real")  # real: real vLLM engines (make real-engines)
REAL_ROUNDS = 3  # each waits for a real engine to load: tens of seconds
HANG_ROUNDS = 5  # each waits out the hang timeout, the sim hang its detection (30 s) too
HANG_TIMEOUT_S = DEFAULTS["nodemanager"]["engine_hang_timeout_s"]
FAULTS = {
    "engine": "engine SIGKILL",
    "nodemanager": "nodemanager SIGKILL",
    "sigstop": "engine SIGSTOP",
    "sim_hang": "sim `hang` fault, inference probe",
}
DETECT_TARGET_S, OVERHEAD_TARGET_S = 1.0, 2.0
ACTIVE = common_pb2.INSTANCE_STATUS_ACTIVE
DECODE = common_pb2.ROLE_DECODE
LISTENING_HTTP = re.compile(r"event=listening .*?http=(\S+)")


@dataclass
class Round:
    kind: str
    detect_s: float
    serving_s: float
    failed: int


def engine_start_s(runs: int = 5) -> float:
    """Median time from spawning the simulated engine (on a port it picks) to its /health
    answering 200."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "motor_mesh.cli", "engine-sim", "serve", "motor-sim", "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            where = next(
                m for line in proc.stderr if (m := re.search(r"event=listening .*?http=(\S+)", line))
            )
            while True:
                try:
                    with urllib.request.urlopen(f"http://{where[1]}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.005)
            times.append(time.perf_counter() - start)
        finally:
            proc.kill()
            proc.wait()
    return statistics.median(times)


class Cluster(UpCluster):
    """``motor up --prefill 1 --decode 2``; ``nodemanager``: settings of that section (the
    defaults otherwise)."""

    def __init__(self, relaunch: bool, nodemanager: dict[str, object] | None = None) -> None:
        config = {"controller": {"enable_engine_relaunch": relaunch}, "nodemanager": nodemanager or {}}
        super().__init__(["--prefill", "1", "--decode", "2"], config, 3)

    def nodemanager_pid(self, index: int) -> int:
        """NodeManager ``index`` (motor up numbers them prefill, decode, decode)."""
        [pid] = self.up.children("nodemanager", str(NM + index + self.up.offset))
        return pid


def inject(kind: str, victim: common_pb2.Instance, nm_pid: int) -> None:
    """The fault ``kind`` (a FAULTS key) on the decode instance ``victim``."""
    ep = victim.endpoints[0]
    if kind == "engine":
        os.killpg(ep.pid, signal.SIGKILL)
    elif kind == "nodemanager":
        os.kill(nm_pid, signal.SIGKILL)
    elif kind == "sigstop":
        os.killpg(ep.pid, signal.SIGSTOP)
    else:
        arm = urllib.request.Request(
            f"http://127.0.0.1:{ep.port}/sim/fault",
            data=b'{"mode": "hang"}',
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(arm, timeout=5) as resp:
            assert resp.status == 200


def one_round(c: Cluster, load: Load, kind: str, target: int) -> Round:
    """Hit decode instance number ``target`` (0 or 1 by job) the ``kind`` way; time it."""
    decodes = sorted((i for i in c.all_active() if i.role == DECODE), key=lambda i: i.job_name)
    victim = decodes[target]
    nm_index = 1 + target  # motor up numbers NodeManagers prefill, decode, decode
    # motor up restarts a child that crashed within HEALTHY_RUN_S of its last start with a
    # growing delay (crash-loop backoff): every kill waits until the node has run that long, so
    # each round measures the failover, not the backoff.
    nm_pid = c.nodemanager_pid(nm_index)
    time.sleep(max(0.0, HEALTHY_RUN_S + 1 - process_age_s(nm_pid)))
    failed_before, errors_before = load.failed, len(load.errors)
    start = time.perf_counter()
    inject(kind, victim, nm_pid)
    detect = serving = 0.0
    while True:
        now = time.perf_counter() - start
        mine = [i for i in c.instances() if i.job_name == victim.job_name]
        if not detect and not any(i.id == victim.id and i.status == ACTIVE for i in mine):
            detect = now
        if detect and any(
            i.status == ACTIVE and i.endpoints[0].pid not in (0, victim.endpoints[0].pid) for i in mine
        ):
            serving = now
            break
        if now > 120:
            states = [(i.id, i.job_name, i.status, [(e.pid, e.status) for e in i.endpoints]) for i in mine]
            raise RuntimeError(f"{kind} round did not recover in 120 s: {states}")
        time.sleep(0.01)
    result = Round(kind, detect, serving, load.failed - failed_before)
    for error in load.errors[errors_before:]:
        print(f"  {kind} round: a request failed: {error}", file=sys.stderr)
    print(
        f"{kind} round: detect {detect:.3f}s serving {serving:.2f}s failed {result.failed}", file=sys.stderr
    )
    return result


def run_mode(
    relaunch: bool,
    rounds: int,
    kinds: list[str] | tuple[str, ...],
    nodemanager: dict[str, object] | None = None,
) -> list[Round]:
    c = Cluster(relaunch, nodemanager)
    load = Load(c.url)
    thread = threading.Thread(target=load.run, daemon=True)
    try:
        c.all_active()
        thread.start()
        out = [one_round(c, load, kind, r % 2) for kind in kinds for r in range(rounds)]
        c.all_active()
        return out
    finally:
        load.stop.set()
        thread.join(40)
        c.close()


def summary(rounds: list[Round], kind: str, engine_s: float) -> list[str]:
    mine = [r for r in rounds if r.kind == kind]
    detect = sorted(r.detect_s for r in mine)
    overhead = sorted(max(0.0, r.serving_s - engine_s) for r in mine)
    return [
        f"{statistics.median(detect):.3f}",
        f"{detect[-1]:.3f}",
        f"{statistics.median(overhead):.2f}",
        f"{overhead[-1]:.2f}",
        str(sum(r.failed for r in mine)),
    ]


def after_detection(rounds: list[Round], kind: str, engine_s: float) -> list[float]:
    """Detection → serving again, minus the engine's own start, of each ``kind`` round, sorted."""
    return sorted(max(0.0, r.serving_s - r.detect_s - engine_s) for r in rounds if r.kind == kind)


def hang_section(rounds: list[Round], engine_s: float) -> list[str]:
    rows = []
    for kind in HANG_KINDS:
        *timings, failed = summary(rounds, kind, engine_s)
        tail = after_detection(rounds, kind, engine_s)
        cells = [*timings, f"{statistics.median(tail):.2f}", f"{tail[-1]:.2f}", failed]
        rows.append(f"| {FAULTS[kind]} | " + " | ".join(cells) + " |")
    crash = statistics.median(after_detection(rounds, "engine", engine_s))
    limit = crash + HANG_TIMEOUT_S + 1
    verdicts = []
    for kind in HANG_KINDS[1:]:
        worst = after_detection(rounds, kind, engine_s)[-1]
        met = "met" if worst <= limit else "**missed**"
        verdicts.append(f"- {FAULTS[kind]}: {met} (worst {worst:.2f} s after detection, limit {limit:.2f} s)")
    return [
        "| fault | detection p50 s | detection max s | overhead p50 s | overhead max s"
        " | after detection p50 s | after detection max s | failed requests |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Target: a hang costs at most engine_hang_timeout_s + 1 s = {HANG_TIMEOUT_S + 1:g} s more "
        f"than a crash once detected: worst after-detection time ≤ the crash's median ({crash:.2f} s) "
        f"+ {HANG_TIMEOUT_S + 1:g} s = {limit:.2f} s. Detection is the probes' own: two failed health "
        "probes (one a second, each with a 2 s deadline) for a stopped engine, six failed inference "
        "probes (one every 5 s, each with a 5 s deadline) for a wedged scheduler.",
        "",
        *verdicts,
        "",
    ]


def verdict(rounds: list[Round], engine_s: float) -> str:
    detect = max(r.detect_s for r in rounds)
    overhead = max(r.serving_s - engine_s for r in rounds)
    failed = sum(r.failed for r in rounds)
    missed = [
        name
        for name, bad in (
            (f"detection (worst {detect:.3f} s ≥ {DETECT_TARGET_S:.0f} s)", detect >= DETECT_TARGET_S),
            (f"overhead (worst {overhead:.2f} s ≥ {OVERHEAD_TARGET_S:.0f} s)", overhead >= OVERHEAD_TARGET_S),
            (f"failed requests ({failed})", failed > 0),
        )
        if bad
    ]
    return "all targets met" if not missed else "**missed: " + "; ".join(missed) + "**"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_failover")
    p.add_argument(
        "--rounds", type=int, default=10, help=f"kills of each kind per mode (hangs: {HANG_ROUNDS} at most)"
    )
    p.add_argument(
        "--only",
        default=",".join(PARTS),
        metavar="PARTS",
        help=f"comma-separated parts to run, of {','.join(PARTS)} (default: all)",
    )
    p.add_argument(
        "--stream-duration",
        type=float,
        default=stream_failover.DURATION_S,
        metavar="S",
        help="seconds of decode engine kills (one every 10 s) in each mode of the streams part",
    )
    p.add_argument("--out", type=Path, default=RESULTS, metavar="DIR", help=f"where {REPORT} goes")
    args = p.parse_args(argv)
    asked = {part.strip() for part in args.only.split(",") if part.strip()}
    if not asked or asked - set(PARTS):
        p.error(f"--only takes a comma-separated list of {', '.join(PARTS)}")
    args.only = [part for part in PARTS if part in asked]  # in the order they run
    return args


def instance_section(results: dict[str, list[Round]], kinds: list[str], engine_s: float) -> list[str]:
    rows = [
        f"| {mode} | {kind} SIGKILL | " + " | ".join(summary(rounds, kind, engine_s)) + " |"
        for mode, rounds in results.items()
        for kind in kinds
    ]
    return [
        f"Engine's own start time (spawn → /health 200, median of 5): {engine_s:.2f} s, subtracted from "
        "the time to serving again.",
        "",
        "| mode | fault | detection p50 s | detection max s | overhead p50 s | overhead max s"
        " | failed requests |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Targets: detection < {DETECT_TARGET_S:.0f} s, overhead < {OVERHEAD_TARGET_S:.0f} s, "
        "0 failed requests while another pair exists.",
        "",
        *(f"- {mode}: {verdict(rounds, engine_s)}" for mode, rounds in results.items()),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv or [])  # `python -m bench failover` runs the defaults: everything
    kinds = [k for k in KINDS if k in args.only]
    hang_rounds = min(args.rounds, HANG_ROUNDS)
    lines = [
        "# Failover under load",
        "",
        f"{time.strftime('%Y-%m-%d')}, {machine()}, {args.rounds} kills of each kind per mode, one client "
        "sending non-streaming requests back to back",
        "",
        *([] if args.only == list(PARTS) else [f"Parts run: {', '.join(args.only)} (--only).", ""]),
    ]
    engine_s = engine_start_s() if kinds or "hang" in args.only else 0.0
    if kinds:
        lines += [
            "## Simulated engines: engine and NodeManager SIGKILLs (motor up --prefill 1 --decode 2)",
            "",
            "Engine: the simulated engine (`motor engine-sim`, every latency at zero).",
            "",
        ]
        modes = ("relaunch on", "relaunch off")
        results = {mode: run_mode(mode == "relaunch on", args.rounds, kinds) for mode in modes}
        lines += instance_section(results, kinds, engine_s)
    if "hang" in args.only:
        lines += [
            "## Simulated engines: hung engines (motor up --prefill 1 --decode 2, relaunch on)",
            "",
            f"{hang_rounds} rounds of each fault on a decode engine, "
            "`nodemanager.engine_probe_inference` on and every other setting at its default "
            f"(engine_hang_timeout_s {HANG_TIMEOUT_S:g} s), the same client load. Engine's own start "
            f"time: {engine_s:.2f} s, subtracted as above. After detection: serving "
            "again minus detection minus the engine's start.",
            "",
        ]
        hung = run_mode(True, hang_rounds, HANG_KINDS, {"engine_probe_inference": True})
        lines += hang_section(hung, engine_s)
    if "streams" in args.only:
        lines += stream_failover.section(
            stream_failover.run(args.stream_duration), duration_s=args.stream_duration
        )
    if "controller" in args.only:
        ran = controller_failover.run(args.rounds) if controller_failover.available() else None
        lines += controller_failover.section(ran)
    if "real" in args.only:
        why = real_engines.unavailable()  # one line, said in the report
        real = None if why else real_failover.run(min(args.rounds, REAL_ROUNDS))
        lines += real_failover.section(real, why)
    return publish(args.out / REPORT, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
