"""Following the leader among several Controllers.

With the etcd store several Controllers run and one of them leads. A standby answers every
motor.v1.Controller call with UNAVAILABLE and an ErrorInfo whose reason is ``NOT_LEADER`` and
whose ``leader`` metadata names the leader's address (empty when it knows none, as during an
election); a dead Controller's port refuses connections. A :class:`ControllerTarget` is one
client's view of the set: the address it believes leads, one channel per address (opened on
first use, kept until ``close()``), and where to go after a failure:

- NOT_LEADER naming a leader not yet tried in this round: that leader, at once;
- any other UNAVAILABLE or DEADLINE_EXCEEDED (a standby that knows no leader, a refused or dead
  connection): the next address, at once while one is untried in this round;
- every address tried without reaching a leader ends the round: the next one starts after a
  backoff (0.2 s doubling to 1 s, jittered), a ``dns:///`` target resolved afresh first (the
  pods behind a headless Service change).

A target is ``host:port``, ``host:port,host:port…`` or ``dns:///name:port``. With a single
address there is nothing to follow but a standby's hint (``following`` is False): callers keep
their own retry pacing then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from motor_mesh.common import dns, log, retry
from motor_mesh.common.channel import ClientTLS, open_channel
from motor_mesh.common.config import ServerConfig
from motor_mesh.common.errors import RpcFailure
from motor_mesh.gen.motor.v1 import controller_pb2_grpc

NOT_LEADER = "NOT_LEADER"
# Failures that say "not the leader, or not there". Any other code is an answer of the leader.
MOVE_ON = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
ROUND_BACKOFF = (0.2, 1.0)
# Rounds ``call`` makes without reaching a leader before it gives up.
CALL_ROUNDS = 3

Resolver = Callable[[str, int], Awaitable[list[str]]]


def addresses_of(target: str) -> list[str]:
    """The ``host:port`` entries of a comma-separated target, each once, in order ([] for a
    ``dns:///`` target)."""
    if dns.split_entry(target) is not None:
        return []
    return list(dict.fromkeys(a.strip() for a in target.split(",") if a.strip()))


def first_address(target: str) -> str:
    """One ``host:port`` a target names: its first address, or a ``dns:///`` target's
    ``name:port``. For a caller that needs one Controller to reason about (which local
    address reaches the Controllers)."""
    parts = dns.split_entry(target)
    if parts is not None:
        return dns.join(*parts)
    found = addresses_of(target)
    return found[0] if found else target


def moves_on(failure: RpcFailure) -> bool:
    """Whether ``failure`` says the leader was not reached (try elsewhere)."""
    return failure.code in MOVE_ON


class ControllerTarget:
    """The Controllers one client talks to, and which of them it believes leads."""

    def __init__(
        self,
        target: str,
        *,
        key: str | None = None,
        tls: ServerConfig | ClientTLS | None = None,
        max_message_bytes: int = 4 * 1024 * 1024,
        service: str = "client",
        backoff: retry.Backoff | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.target = target
        self._name = dns.split_entry(target)
        self._listed = addresses_of(target)
        self._resolver = resolver or dns.resolve
        self._resolve_due = self._name is not None
        # Until a dns:/// name is resolved, gRPC's own resolver picks an address behind it.
        self._address = self._listed[0] if self._listed else target
        self._tried: set[str] = set()
        self._backoff = backoff or retry.Backoff(*ROUND_BACKOFF)
        self._leader = ""  # the address that last answered as the leader
        self._key, self._tls, self._max, self._service = key, tls, max_message_bytes, service
        self._channels: dict[str, tuple[grpc.aio.Channel, controller_pb2_grpc.ControllerAsyncStub]] = {}

    @property
    def address(self) -> str:
        """The address currently believed to lead."""
        return self._address

    @property
    def following(self) -> bool:
        """Whether there are several Controllers to choose from."""
        return self._name is not None or len(self._listed) > 1

    def _open(self) -> tuple[grpc.aio.Channel, controller_pb2_grpc.ControllerAsyncStub]:
        opened = self._channels.get(self._address)
        if opened is None:
            # No channel-level retries: a NOT_LEADER answer is UNAVAILABLE, and repeating it on
            # the same standby would only hide where the leader is.
            ch = open_channel(
                self._address,
                key=self._key,
                tls=self._tls,
                max_message_bytes=self._max,
                service=self._service,
                retries=False,
            )
            opened = self._channels[self._address] = (ch, controller_pb2_grpc.ControllerStub(ch))
        return opened

    def channel(self) -> grpc.aio.Channel:
        """The channel to the current address (the same one every time)."""
        return self._open()[0]

    def stub(self) -> controller_pb2_grpc.ControllerAsyncStub:
        return self._open()[1]

    def reached(self) -> None:
        """The current address answered as the leader (a response, or an error of the call's
        own): the round and the backoff start afresh."""
        self._tried.clear()
        self._backoff.reset()
        if self._address != self._leader:
            self._leader = self._address
            log.event("controller_leader", address=self._address, target=self.target)

    def failed(self, err: grpc.RpcError | RpcFailure) -> float:
        """Move on after ``err`` from the current address; returns how long to wait before the
        next try: 0 while this round has somewhere left to go, else the backoff. A failure that
        is the leader's own answer (not UNAVAILABLE or DEADLINE_EXCEEDED) moves nothing and
        returns the backoff, no shorter than the RetryInfo it carries."""
        failure = err if isinstance(err, RpcFailure) else RpcFailure.of(err)
        if not moves_on(failure):
            self._tried.clear()
            return self._backoff.next(failure.retry_after)
        self._tried.add(self._address)
        leader = failure.metadata.get("leader", "") if failure.reason == NOT_LEADER else ""
        if leader and leader not in self._tried:
            self._address = leader
            return 0.0
        rest = self._after_current()
        untried = [a for a in rest if a not in self._tried]
        if untried:
            self._address = untried[0]
            return 0.0
        # A whole round without a leader. A standby may name one that just refused us: it is
        # probably coming back or being replaced, so the next round starts there.
        self._tried.clear()
        self._resolve_due = self._name is not None
        self._address = leader or (rest[0] if rest else self._address)
        return self._backoff.next()

    def _after_current(self) -> list[str]:
        """The listed addresses in the order to try them from here: the ones after the current
        one, then round to the start."""
        listed = self._listed
        if self._address not in listed:
            return list(listed)
        i = listed.index(self._address) + 1
        return listed[i:] + listed[:i]

    async def resolve(self) -> None:
        """Resolve a ``dns:///`` target when due: before its first use and after every round
        that reached no leader. A lookup that fails keeps the addresses last resolved."""
        if self._name is None or not self._resolve_due:
            return
        self._resolve_due = False
        try:
            found = await self._resolver(*self._name)
        except OSError as err:
            log.warn("controller_resolve_failed", target=self.target, error=str(err) or type(err).__name__)
            return
        if found == self._listed:
            return
        log.event("controllers_resolved", target=self.target, addresses=",".join(found) or "-")
        self._listed = list(found)
        if found and self._address not in found:
            self._address = found[0]
        for gone in [a for a in self._channels if a not in found and a != self._address]:
            await self._channels.pop(gone)[0].close(grace=None)

    async def call(
        self,
        method: str,
        request: Message,
        timeout_s: float,
        *,
        rounds: int = CALL_ROUNDS,
        wait_for_ready: bool | None = None,
    ) -> Any:
        """``method`` (a unary motor.v1.Controller RPC) on the leader, following NOT_LEADER
        hints and skipping dead addresses, within ``timeout_s`` seconds and ``rounds`` rounds.
        Raises the last error; when the leader was never reached and a standby said so, that
        NOT_LEADER refusal (so a caller can say there is no leader).

        ``wait_for_ready``: whether an attempt waits for its Controller to accept connections.
        By default a single Controller is waited for up to the deadline (it may be restarting),
        as any call does; of several, a dead one must fail at once, the next may be the leader.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        rounds_ended = 0
        refusal: grpc.aio.AioRpcError | None = None
        wait = not self.following if wait_for_ready is None else wait_for_ready
        while True:
            await self.resolve()
            left = max(deadline - loop.time(), 0.001)
            try:
                response = await getattr(self.stub(), method)(request, timeout=left, wait_for_ready=wait)
            except grpc.aio.AioRpcError as err:
                failure = RpcFailure.of(err)
                if not moves_on(failure):
                    self.reached()
                    raise
                if failure.reason == NOT_LEADER:
                    refusal = err
                delay = self.failed(failure)
                if delay:
                    rounds_ended += 1
                if rounds_ended >= rounds or loop.time() + delay >= deadline:
                    raise (refusal or err) from None
                await asyncio.sleep(delay)
                continue
            self.reached()
            return response

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for ch, _ in channels.values():
            await ch.close(grace=None)
