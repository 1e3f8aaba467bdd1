"""A stand-in inference worker for tests: a real WorkerLink in its own process, no HTTP.

``python -m tests.coordinator.fake_worker SOCK_DIR INDEX [--load N] [--uvloop]``

Each table it applies is reported back over the link itself, as a precision sample
(p = INDEX, d = revision, model = its pid, request = the instance ids and paused ids), so a test
sees what every worker process applied through the hub's ``on_sample``. It reports the load
``{1: N}``, says it is serving at once, and exits 0 on SIGTERM, 3 when the link loses the hub.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from motor_mesh.common import log
from motor_mesh.coordinator.precision.groups import Completed
from motor_mesh.coordinator.table import TableState
from motor_mesh.coordinator.workers.link import WorkerLink


async def run(sock_dir: str, index: int, load: int) -> int:
    stop = asyncio.Event()
    lost: list[str] = []
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def applied(state: TableState) -> None:
        request = {"ids": sorted(state.instances), "paused": sorted(state.paused)}
        link.send_sample(index, state.revision, Completed("/applied", str(os.getpid()), request))

    def on_lost(why: str) -> None:
        lost.append(why)
        stop.set()

    link = WorkerLink(sock_dir, index, applied, lambda loads: None, on_lost=on_lost)
    await link.start()
    link.serving()
    link.report_loads(lambda: {1: load})
    await stop.wait()
    await link.close()
    return 3 if lost else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("sock_dir")
    parser.add_argument("index", type=int)
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    log.setup(f"fake-worker-{args.index}")
    if args.uvloop:
        import uvloop

        return uvloop.run(run(args.sock_dir, args.index, args.load))
    return asyncio.run(run(args.sock_dir, args.index, args.load))


if __name__ == "__main__":
    raise SystemExit(main())
