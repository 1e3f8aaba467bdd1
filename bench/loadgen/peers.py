"""The routers Motor is compared with, and the simulated engines behind every target.

Peers (vllm-router, sglang-router) live in their own venv, ``.bench-venv/``, made once by
``ensure_venv``. They run offline (``HF_HUB_OFFLINE=1``, a dead ``HF_ENDPOINT``) on loopback only.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from bench.loadgen.harness import CLK_TCK, PORT_TAKEN, REPO, PortTaken, Proc, T, clean_env

VENV = REPO / ".bench-venv"
PINS = ("vllm-router==0.1.17", "sglang-router==0.3.2")
STAMP = VENV / ".installed"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9", "NO_PROXY": "*", "no_proxy": "*"}
MODEL = "motor-sim"


def ensure_venv() -> str:
    """Create ``.bench-venv`` with the pinned peers unless its stamp says it is done; returns the
    installed versions (``pip`` output line per package)."""
    py = VENV / "bin" / "python"
    if not STAMP.exists() or STAMP.read_text() != "\n".join(PINS):
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        print(f"  installing {' '.join(PINS)} into {VENV.name}/", file=sys.stderr)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PINS], check=True)
        STAMP.write_text("\n".join(PINS))
    out = subprocess.run(
        [str(py), "-m", "pip", "list", "--format", "freeze"], capture_output=True, text=True, check=True
    ).stdout
    return ", ".join(ln for ln in out.splitlines() if ln.split("==")[0] in ("vllm-router", "sglang-router"))


def group_cpu(pid: int) -> float:
    """CPU seconds of every live process in ``pid``'s session (the child started its own)."""
    total = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        f = raw[raw.rindex(")") + 2 :].split()
        if int(f[3]) == pid:
            total += (int(f[11]) + int(f[12])) / CLK_TCK
    return total


async def on_free_ports(launch: Callable[[int], Awaitable[T]], tries: int = 4) -> T:
    """``launch(port)`` for a server that binds ``port`` and ``port + 1`` and cannot be given port
    0 (the peer routers refuse it): an even port under the kernel's ephemeral range, and another
    if the server reports it taken."""
    for _ in range(tries):
        port = random.randrange(10_000, 32_000, 2)
        try:
            return await launch(port)
        except PortTaken as exc:
            print(f"  {exc}; another port", file=sys.stderr)
    raise RuntimeError(f"a port was taken {tries} times in a row")


async def engine(name: str, model_dir: Path, tmp: Path, extra: list[str]) -> tuple[Proc, str, str | None]:
    """A zero-latency sim engine; returns it, its base URL and its SGLang bootstrap port if any."""
    args = ["-m", "motor_mesh.cli", "engine-sim", "serve", str(model_dir), "--served-model-name", MODEL]
    proc = await Proc.start(name, [*args, "--port", "0", *extra], tmp / f"{name}.log")
    where = await proc.listening()
    boot = where.get("bootstrap")
    return proc, f"http://{where['http']}", boot.rsplit(":", 1)[1] if boot else None


async def start_router(name: str, argv: list[str], tmp: Path) -> Proc:
    log = tmp / f"{name}.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            env=clean_env(**OFFLINE),
            cwd=tmp,
            start_new_session=True,
        )
    return Proc(name, proc, log)


def vllm_router_argv(
    port: int | str, prefill: str, decode: str, metrics: int | str = "METRICS_PORT"
) -> list[str]:
    return [
        str(VENV / "bin" / "vllm-router"),
        *("--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"),
        *("--prefill", prefill, "--decode", decode, "--policy", "random", "--log-level", "warning"),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)),
    ]


def sglang_router_argv(
    port: int | str, prefill: str, bootstrap: str, decode: str, metrics: int | str = "METRICS_PORT"
) -> list[str]:
    return [
        str(VENV / "bin" / "python"),
        *("-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)),
        *("--pd-disaggregation", "--prefill", prefill, bootstrap, "--decode", decode),
        *("--policy", "random", "--log-level", "warn"),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)),
    ]


async def wait_serving(proc: Proc, url: str, body: bytes, timeout_s: float = 60.0) -> None:
    """Until one chat completion through ``url`` answers 200; raises with the log's tail."""
    deadline = time.monotonic() + timeout_s
    last = ""
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.proc.returncode is not None:
                break
            try:
                async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    last = f"HTTP {r.status}: {(await r.text())[:300]}"
                    if r.status == 200:
                        return
            except aiohttp.ClientError as exc:
                last = repr(exc)
            await asyncio.sleep(0.25)
    log = proc.log.read_text(errors="replace")
    if PORT_TAKEN.search(log):
        raise PortTaken(f"{proc.name}: its port is taken")
    tail = [ln.strip() for ln in log.splitlines() if ln.strip()][-2:]
    raise RuntimeError(f"{proc.name} not serving ({last[:200]}); its log ends: {' / '.join(tail)}")


async def prefill_legs(base: str) -> float:
    """``motor_sim_pd_legs_total{side="prefill"}`` of one sim engine, all protocols."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as r:
        text = await r.text()
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("motor_sim_pd_legs_total") and 'side="prefill"' in ln
    )
