"""wrk as the load generator: a Lua script that POSTs one chat completion body and prints wrk's
own summary and latency percentiles as one JSON line from the ``done()`` hook."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

MARK = "WRK_JSON "
_LUA = """\
wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{mark}{{"requests":%.0f,"duration_us":%.0f,"connect":%.0f,"read":%.0f,"write":%.0f,' ..
    '"status":%.0f,"timeout":%.0f,"p50_us":%.0f,"p99_us":%.0f,"max_us":%.0f}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.max))
end
"""


@dataclass
class WrkResult:
    requests: int
    seconds: float
    non2xx: int  # wrk counts any status > 399 here
    socket_errors: int  # connect + read + write + timeout
    p50_ms: float
    p99_ms: float
    max_ms: float

    @property
    def rps(self) -> float:
        return (self.requests - self.non2xx) / self.seconds if self.seconds else 0.0


def available() -> str | None:
    return shutil.which("wrk")


def write_script(directory: Path, name: str, body: dict[str, object]) -> Path:
    path = directory / f"{name}.lua"
    path.write_text(_LUA.format(body=json.dumps(body), mark=MARK))
    return path


async def run(url: str, script: Path, connections: int, seconds: float, threads: int = 2) -> WrkResult:
    """One wrk run; threads are capped at the connection count (wrk refuses fewer connections)."""
    proc = await asyncio.create_subprocess_exec(
        "wrk",
        f"-t{min(threads, connections)}",
        f"-c{connections}",
        f"-d{seconds:g}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    text = out.decode(errors="replace")
    line = next((ln for ln in text.splitlines() if ln.startswith(MARK)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (rc {proc.returncode}):\n{text[-2000:]}")
    d = json.loads(line[len(MARK) :])
    return WrkResult(
        requests=int(d["requests"]),
        seconds=d["duration_us"] / 1e6,
        non2xx=int(d["status"]),
        socket_errors=int(d["connect"] + d["read"] + d["write"] + d["timeout"]),
        p50_ms=d["p50_us"] / 1000,
        p99_ms=d["p99_us"] / 1000,
        max_ms=d["max_us"] / 1000,
    )
