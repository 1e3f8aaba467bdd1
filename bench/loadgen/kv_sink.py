"""A bare subscriber to an engine's KV events, discarding them.

An engine's PUB socket with no subscriber drops a batch in the sending call; with one, its I/O
thread sends every batch. bench/bench_kv_routing.py runs this beside a least_load cluster to
measure what an engine publishing to anyone costs, before any work of Motor's own.

    python -m bench.loadgen.kv_sink tcp://127.0.0.1:PORT

Prints ``ready`` once connected, and the number of batches received when sent SIGTERM.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

import zmq

POLL_MS = 100


def main() -> int:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(sys.argv[1])
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    received = 0
    while not stopping:
        if sub.poll(POLL_MS):
            sub.recv_multipart()
            received += 1
    print(received, flush=True)
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
