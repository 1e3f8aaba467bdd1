"""What every failover round of bench/bench_failover.py shares: the client load it measures
failed requests with, and the age of the process it is about to kill (``motor up`` restarts a
child that crashed soon after its last start only after a growing delay, so a round waits until
its victim has run longer than that).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
from openai.types.chat import ChatCompletionMessageParam


@dataclass
class Load:
    """One client, one request at a time, counting failures (``errors``: what each said)."""

    url: str
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=30)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "failover"}]
        while not self.stop.is_set():
            try:
                client.chat.completions.create(model="motor-sim", messages=messages, max_tokens=4)
                self.ok += 1
            except Exception as exc:
                self.failed += 1
                self.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                time.sleep(0.01)


def process_age_s(pid: int) -> float:
    """How long process ``pid`` has been running."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
