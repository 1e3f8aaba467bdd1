"""NodeManager sessions: each registration gets a node id and a fresh epoch, and its heartbeat
stream must present both. Sessions live in memory only: after a Controller restart every old
stream is told to register again (``DIRECTIVE_REREGISTER``).
"""

from __future__ import annotations

import secrets

from motor_mesh.controller.model import Member, Session


class SessionTable:
    def __init__(self) -> None:
        self._by_id: dict[int, Session] = {}
        self._next_node_id = 1

    def open(self, member: Member, now: float) -> Session:
        """A new session for ``member``; any earlier one is invalidated."""
        self.close(member)
        # A random epoch, so a stale stream from before a Controller restart can never match
        # a node id that happens to be handed out again.
        session = Session(node_id=self._next_node_id, epoch=secrets.randbits(63) | 1, member=member)
        self._next_node_id += 1
        self._by_id[session.node_id] = session
        member.session = session
        member.last_heard = now
        member.beat_fingerprint = None
        return session

    def get(self, node_id: int) -> Session | None:
        return self._by_id.get(node_id)

    def close(self, member: Member) -> None:
        """Forget the member's session: its stream gets DIRECTIVE_REREGISTER at its next message."""
        s = member.session
        if s is not None:
            s.valid = False
            self._by_id.pop(s.node_id, None)
            member.session = None

    def __len__(self) -> int:
        return len(self._by_id)
