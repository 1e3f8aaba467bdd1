"""What both engine sides share: running every launch of the engine's cases under its own
environment, one result line each, then the cross-process checks of each case.

Standard library only, imported by path (``import side_runner``): the sides run in the engines'
venvs, which have neither Motor nor this package on their path.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections.abc import Callable
from typing import Any

Facts = dict[str, Any]
Launch = dict[str, Any]


def parsed(parse: Callable[..., Any], *args: Any) -> Any:
    """``parse(*args)``, with an argparse rejection (usage on stderr, then exit 2) turned into an
    exception that carries argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(*args)
    except SystemExit as exc:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        raise ValueError(lines[-1] if lines else f"exit {exc.code}") from None


def one_line(exc: BaseException) -> str:
    lines = (line.strip() for line in str(exc).splitlines())
    return f"{type(exc).__name__}: " + " | ".join(line for line in lines if line)


def run(
    engine: str,
    path: str,
    check: Callable[[Launch, str, str], Facts],
    describe: Callable[[Launch, Facts], str],
    cross_check: Callable[[list[Launch], list[Facts]], list[str]],
) -> int:
    """Check every launch of ``engine``'s cases in the launches file at ``path``; 1 on any
    failure. ``check(launch, placeholder_model, fixture_dir)`` returns what the engine resolved."""
    started = time.monotonic()
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    base_env = dict(os.environ)
    failures = total = 0
    cases = {name: ls for name, ls in doc["cases"].items() if ls and ls[0]["engine"] == engine}
    for case, launches in cases.items():
        facts: list[Facts] = []
        for launch in launches:
            total += 1
            # Each launch sees exactly its own environment on top of ours (engines read it lazily).
            os.environ.clear()
            os.environ.update(base_env)
            os.environ.update(launch["env"])
            try:
                kind = launch["model_kind"]
                facts.append(check(launch, doc["models"][kind], doc["fixtures"][kind]))
                print(f"ok {case} {describe(launch, facts[-1])}", flush=True)
            except Exception as exc:
                failures += 1
                name = f"{launch['instance']}/ep{launch['endpoint_id']}"
                print(f"FAIL {case} {name} {one_line(exc)} :: {' '.join(launch['argv'])}", flush=True)
        if len(facts) == len(launches):
            for problem in cross_check(launches, facts):
                failures += 1
                print(f"FAIL {case} {problem}", flush=True)
    elapsed = time.monotonic() - started
    print(f"{engine}: {total} launches in {len(cases)} cases, {failures} failure(s), {elapsed:.0f}s")
    return 1 if failures else 0
