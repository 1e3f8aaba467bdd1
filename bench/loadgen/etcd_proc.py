"""A one-member etcd for the control-plane benchmarks: Debian's ``/usr/bin/etcd`` (``make
system-deps``) on two free loopback ports, its data in a directory of the run's own, pinned to
given CPUs like the other processes of a benchmark (so its CPU time is read from /proc the same
way), stopped by SIGTERM to its group.

Ports are picked below the kernel's ephemeral range and checked free; when etcd still finds one
taken (someone bound it in between) it is started again on others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.loadgen.harness import Proc, clean_env, port_free

NOT_INSTALLED = "etcd not installed (`make system-deps` installs Debian etcd-server)"
# etcd's default quota is 2 GiB; the Controller never compacts, so every write of every instance
# stays in the database. 8 GiB is etcd's own suggested maximum, far above what 10,000 need.
QUOTA_BYTES = 8 << 30
_PORTS = range(12_000, 30_000)  # under the ephemeral range: no outgoing connection is given one
_TAKEN = re.compile(r"address already in use", re.I)
# Like harness.Proc's trampoline, for a binary that is not Python: pin, then exec.
_PIN = (
    "import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)
# Prometheus text lines of etcd's /metrics that say how large the database grew.
_SIZES = {
    "db_bytes": "etcd_mvcc_db_total_size_in_bytes",
    "db_in_use_bytes": "etcd_mvcc_db_total_size_in_use_in_bytes",
    "revision": "etcd_debugging_mvcc_current_revision",
    "keys": "etcd_debugging_mvcc_keys_total",
}


def etcd_binary() -> str | None:
    """etcd on PATH, else Debian's (a PATH without /usr/bin still finds it)."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)


def etcd_version(binary: str) -> str:
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    m = re.search(r"etcd Version: (\S+)", done.stdout)
    return m.group(1) if m else "unknown"


def filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on (ext4, tmpfs, ...): etcd fsyncs every write."""
    best, kind = "", "unknown"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _dev, mount, fstype, *_ = line.split()
        if (str(path) + "/").startswith(mount.rstrip("/") + "/") and len(mount) >= len(best):
            best, kind = mount, fstype
    return kind


def _two_free_ports() -> tuple[int, int]:
    while True:
        port = random.choice(_PORTS[:-1])
        if port_free(port) and port_free(port + 1):
            return port, port + 1


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return str(resp.read().decode())


class Etcd:
    """A started etcd: ``endpoint`` (host:port) for clients, ``proc`` for its pid and CPU."""

    def __init__(self, proc: Proc, endpoint: str) -> None:
        self.proc = proc
        self.endpoint = endpoint

    @classmethod
    async def start(cls, binary: str, data_dir: Path, log: Path, *, cpus: str, tries: int = 4) -> Etcd:
        attempt = 0
        while True:
            client, peer = _two_free_ports()
            proc = await _spawn(binary, data_dir, log, cpus, client, peer)
            etcd = cls(proc, f"127.0.0.1:{client}")
            if await etcd._healthy(30.0):
                return etcd
            await proc.stop()
            text, attempt = await asyncio.to_thread(log.read_text, errors="replace"), attempt + 1
            if not _TAKEN.search(text) or attempt >= tries:
                raise RuntimeError(f"etcd did not come up:\n{text[-2000:]}")
            shutil.rmtree(data_dir, ignore_errors=True)

    async def _healthy(self, timeout_s: float) -> bool:
        """Until /health says true (the member has a leader and serves requests), or it exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.proc.returncode is None:
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                body = await asyncio.to_thread(_get, f"http://{self.endpoint}/health")
                if json.loads(body).get("health") == "true":
                    return True
            await asyncio.sleep(0.1)
        return False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu(self) -> float:
        return self.proc.cpu()

    async def sizes(self) -> dict[str, float]:
        """The database's size on disk and in use, its revision and key count, from /metrics."""
        text = await asyncio.to_thread(_get, f"http://{self.endpoint}/metrics")
        out = {}
        for name, metric in _SIZES.items():
            m = re.search(rf"(?m)^{metric} (\S+)$", text)
            if m:
                out[name] = float(m.group(1))
        return out

    async def stop(self) -> None:
        await self.proc.stop()


async def _spawn(binary: str, data_dir: Path, log: Path, cpus: str, client: int, peer: int) -> Proc:
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    argv = [
        binary,
        "--name=bench",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=bench={peer_url}",
        f"--quota-backend-bytes={QUOTA_BYTES}",
        # etcd 3.4 logs every step at info; the warnings (slow fsync, slow apply) are what matter.
        "--logger=zap",
        "--log-outputs=stderr",
        "--log-level=warn",
    ]
    # An ETCD_* variable that repeats one of these flags makes etcd refuse to start.
    env = {k: v for k, v in clean_env().items() if not k.startswith("ETCD_")}
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _PIN,
            cpus,
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,
        )
    return Proc("etcd", proc, log)
