"""Loopback ports for the servers that cannot bind port 0 themselves.

Every Motor service binds port 0 when asked and says where in its ``event=listening`` line:
tests start them that way and read the line (``Proc.listening``). Some ports must be known
before anything binds them: the engine ports a NodeManager's configuration lists, ``motor up``'s
fixed ports (``--port-offset`` moves them all), a port a test points a client at before the
server comes up, a port a server must come back on after a restart.

Those are reserved here, and a reservation is what makes check-then-bind safe:

- they are taken below the kernel's ephemeral range (32768 and up), so no outgoing connection
  on the machine is ever given one of them behind the test's back;
- every test process reserves through the same lock files (``flock`` on one file per port in
  ``LOCK_DIR``): two tests, in this pytest or in another one running at the same time, never
  pick the same port, and a lock dies with its process, so nothing is left behind by a crash;
- a port is bound once (with SO_REUSEADDR, as the servers bind) when reserved, so one held by
  something that does not take part is skipped.

``reserve(pattern)`` finds one shift that frees every port of a pattern at once (``motor up``'s
ports at some offset); ``reserved_port()`` and ``reserved_pair()`` (an engine's port and port + 1)
(with its KV events ports) reserve for the rest of the test session, which is simpler than handing each one back and
cannot run out (one pytest run takes a few hundred of the 12,000).
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

LOCK_DIR = Path(tempfile.gettempdir()) / "motor-test-ports"
LOW, HIGH = 20000, 32000  # under the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range)


def port_free(port: int) -> bool:
    """Whether a server could bind ``port`` on loopback right now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Ports:
    """Ports reserved together: ``pattern`` shifted by ``shift``; held until ``close()``."""

    def __init__(self, pattern: list[int], shift: int, locks: list[int]) -> None:
        self.shift = shift
        self.ports = [p + shift for p in pattern]
        self._locks = locks

    def __getitem__(self, i: int) -> int:
        return self.ports[i]

    def close(self) -> None:
        for fd in self._locks:
            os.close(fd)  # the lock goes with the descriptor
        self._locks = []


def _lock(port: int) -> int | None:
    fd = os.open(LOCK_DIR / str(port), os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def reserve(pattern: Iterable[int], tries: int = 500) -> Ports:
    """Reserve ``p + shift`` for every ``p`` in ``pattern``, for one shift that frees them all."""
    pattern = list(pattern)
    LOCK_DIR.mkdir(exist_ok=True)
    low, high = LOW - min(pattern), HIGH - max(pattern)
    assert low < high, f"ports {pattern} do not fit in {LOW}-{HIGH}"
    for _ in range(tries):
        shift = random.randrange(low, high)
        locks: list[int] = []
        for p in pattern:
            fd = _lock(p + shift)
            if fd is None or not port_free(p + shift):
                break
            locks.append(fd)
        else:
            return Ports(pattern, shift, locks)
        if fd is not None:
            os.close(fd)
        for fd in locks:
            os.close(fd)
    raise RuntimeError(f"no free ports for {pattern} in {LOW}-{HIGH} after {tries} tries")


_SESSION: list[Ports] = []  # kept open (and referenced) until the test process exits


def reserved_port() -> int:
    """A port no one else will bind: a server started later binds it, or nothing (connections to
    it are refused)."""
    _SESSION.append(reserve([0]))
    return _SESSION[-1][0]


def reserved_pair() -> int:
    """A port P with P + 1 reserved too (an engine's port; P + 1 its SGLang bootstrap / DP RPC),
    and P + 2000, P + 2001 (the KV cache events ports a NodeManager gives that engine)."""
    _SESSION.append(reserve([0, 1, 2000, 2001]))
    return _SESSION[-1][0]
