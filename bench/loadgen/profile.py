"""Where a router's CPU goes under load: py-spy samples of every process of its session,
summed by the line each sample was executing (the "self" time of that line).

Frames name Python lines only: time inside a C call (a socket write, the event loop's poll)
counts against the Python line that made the call, which is why each row quotes its line.
"""

from __future__ import annotations

import asyncio
import collections
import linecache
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?):(?P<line>\d+)\)$")
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Hot:
    share: float  # of all samples, 0..1
    where: str  # "function (file:line)"
    code: str  # the source line


def py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def session_pids(leader: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                raw = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(raw[raw.rindex(")") + 2 :].split()[3]) == leader:
                pids.append(int(entry.name))
    return pids


async def record(pids: list[int], seconds: float, out: Path) -> list[Path]:
    spy = py_spy()
    if spy is None:
        return []
    files = [out / f"profile-{pid}.txt" for pid in pids]
    quiet = asyncio.subprocess.DEVNULL
    procs = []
    for pid, f in zip(pids, files, strict=True):
        argv = ["record", "-p", str(pid), "-d", f"{seconds:g}", "-r", "250", "-f", "raw", "-o", str(f)]
        procs.append(
            await asyncio.create_subprocess_exec(spy, *argv, "--nonblocking", stdout=quiet, stderr=quiet)
        )
    for p in procs:
        await p.wait()
    return [f for f in files if f.exists()]


def hottest(files: list[Path], top: int = 12) -> tuple[list[Hot], int]:
    """The ``top`` lines by self samples over every file, and the sample count."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for f in files:
        for row in f.read_text().splitlines():
            stack, _, count = row.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            total += int(count)
            counts[stack.split(";")[-1]] += int(count)
    rows = []
    for frame, n in counts.most_common(top):
        m = _FRAME.match(frame)
        code = ""
        where = frame
        if m:
            path = Path(m["file"])
            if not path.is_absolute():
                path = ROOT / path
            code = linecache.getline(str(path), int(m["line"])).strip()
            short = m["file"].split("site-packages/")[-1].removeprefix(str(ROOT) + "/")
            where = f"{m['func']} ({short}:{m['line']})"
        rows.append(Hot(n / total if total else 0.0, where, code))
    return rows, total
