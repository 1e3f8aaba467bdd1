"""A simulated engine worker (stands in for a TP/DP rank process): it only lives.

It exits when its stdin reaches EOF (the leader died or closed the pipe) or when its parent
changes (belt and braces: a leader that somehow leaked the pipe still loses its workers).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="motor_mesh.simengine.worker")
    parser.add_argument("--index", type=int, default=0)
    parser.parse_args(argv)
    # Ctrl-C reaches the whole process group; the leader decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([stdin], [], [], 1.0)
        if ready and not os.read(stdin, 4096):
            return 0
        if os.getppid() != parent:
            return 0


if __name__ == "__main__":
    sys.exit(main())
