"""Admission of one process serving the inference API: who is asking (key → tenant), whether
its rate limits and the Coordinator-wide ones allow it, and a slot to run in
(docs/admission.md).

Every limit is split over the processes that enforce it: the Controller tells each Coordinator
how many replicas share the deployment (``replicas``), and a Coordinator's inference workers
split its part by where the requests go (workers/shares.py; evenly until they report). With no
tenants file, no API keys file and no rate limit, a request costs a lookup of the open account
and the slot counter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from motor_mesh.common.config import CoordinatorConfig, RateLimit
from motor_mesh.common.http_errors import OpenAIError, invalid_request
from motor_mesh.common.httpmessages import Headers
from motor_mesh.coordinator.admission.buckets import Bucket
from motor_mesh.coordinator.admission.slots import Account, Slots
from motor_mesh.coordinator.admission.tenants import OPEN, Directory, Tenant

MINUTE_S = 60.0


def unauthorized() -> OpenAIError:
    return invalid_request(
        "invalid or missing API key", "invalid_api_key", status=401, headers={"WWW-Authenticate": "Bearer"}
    )


@dataclass(eq=False)
class RateLimited(OpenAIError):
    limit: str = ""  # the setting that refused (a metric label)


def rate_limited(which: str, unit: str, bucket: Bucket, n: int, window_s: float, now: float) -> RateLimited:
    retry = max(1, math.ceil(bucket.wait_s(n, now)))
    limit = math.floor(bucket.capacity)
    return RateLimited(
        429,
        f"rate limit reached for {which}: {limit} {unit} per {window_s:g} s here; retry in {retry} s",
        unit,  # OpenAI's type: "requests" or "tokens"
        "rate_limit_exceeded",
        headers={"Retry-After": str(retry), **dict(_headers(bucket, now))},
        limit=which,
    )


@dataclass(slots=True)
class Limits:
    """One set of buckets in this process: a tenant's (per minute) or the Coordinator-wide
    ones (per ``rate_limit.window_s``). None: no such limit."""

    requests: Bucket | None = None
    tokens: Bucket | None = None
    window_s: float = MINUTE_S
    names: tuple[str, str] = ("requests_per_minute", "tokens_per_minute")
    keys: tuple[str, str] = ("r", "t")  # the buckets' names between workers (workers/shares.py)

    def refuse(self, tokens: int, now: float) -> RateLimited | None:
        """The 429 when a bucket cannot give what the request needs."""
        for bucket, n, name, unit in (
            (self.requests, 1, self.names[0], "requests"),
            (self.tokens, tokens, self.names[1], "tokens"),
        ):
            if bucket is not None and not bucket.can_take(n, now):
                return rate_limited(name, unit, bucket, n, self.window_s, now)
        return None

    def take(self, tokens: int, ticket: Ticket) -> None:
        if self.requests is not None:
            self.requests.take(1)
            ticket.request_buckets.append(self.requests)
        if self.tokens is not None:
            self.tokens.take(tokens)
            ticket.token_buckets.append(self.tokens)


@dataclass(slots=True)
class Ticket:
    """One admitted request: whose it is, the tokens it was charged and where."""

    account: Account
    charged: int
    request_buckets: list[Bucket] = field(default_factory=list)
    token_buckets: list[Bucket] = field(default_factory=list)
    headers: Headers = None  # X-RateLimit-*, for every answer it gets


class Gate:
    def __init__(self, cfg: CoordinatorConfig, directory: Directory | None, workers: int, now: float) -> None:
        self._workers = workers
        self._replicas = 1
        self._directory = directory
        self._accounts: dict[str, Account] = {}
        self._limits: dict[str, Limits] = {}
        self._global = Limits()
        # This worker's part of each bucket (workers/shares.py); a bucket not named: 1 / workers.
        self._parts: dict[str, float] = {}
        # What each bucket was asked for since the last report (with workers only).
        self.demand: dict[str, float] | None = {} if workers > 1 else None
        self._skip: frozenset[str] = frozenset()
        self._rate = cfg.rate_limit
        self.slots = Slots.share(
            cfg.max_concurrent_requests, cfg.max_queued_requests, cfg.queue_timeout_s, workers
        )
        self._open = self._account(OPEN)
        self._apply_limits(now)

    # -- configuration ---------------------------------------------------------------------------

    @property
    def fraction(self) -> float:
        """This process's even part of every Coordinator-wide and tenant limit."""
        return 1.0 / (self._replicas * self._workers)

    def _part(self, key: str) -> float:
        """This process's part of bucket ``key``: the replica's share, split by demand."""
        return self._parts.get(key, 1.0 / self._workers) / self._replicas

    def set_parts(self, parts: dict[str, dict[int, float]], index: int, now: float) -> None:
        """The management process's new split of some buckets (an empty split: even again)."""
        for key, split in parts.items():
            if split and index in split:
                self._parts[key] = split[index]
            else:
                self._parts.pop(key, None)
        self._apply_limits(now)
        for name, account in self._accounts.items():
            account.spread = self._parts.get(f"s:{name}", 1.0 / self._workers) * self._workers

    def asks_for_a_slot(self, account: Account) -> None:
        """Count a request that asks for a slot here: each worker's share of a tenant's slots
        follows where the tenant's requests go, as a bucket's parts do (Slots, "within share")."""
        if self.demand is not None:
            key = f"s:{account.tenant.name}"
            self.demand[key] = self.demand.get(key, 0.0) + 1

    def take_demand(self) -> dict[str, float]:
        """What each bucket was asked for since the last call."""
        if self.demand is None:  # one process: nothing to split
            return {}
        asked, self.demand = self.demand, {}
        return asked

    @property
    def authenticates(self) -> bool:
        return self._directory is not None

    def reconfigure(
        self, cfg: CoordinatorConfig, directory: Directory | None, replicas: int, now: float
    ) -> None:
        """New settings (a reload, or the Controller's replica count). Buckets keep the tokens
        they hold (up to their new size), running counts stay: a reload neither refunds nor
        forgets what is in use."""
        self._directory = directory
        self._replicas = max(1, replicas)
        self._rate = cfg.rate_limit
        self.slots.resize(
            cfg.max_concurrent_requests, cfg.max_queued_requests, cfg.queue_timeout_s, self._workers
        )
        self._apply_limits(now)

    def set_replicas(self, replicas: int, now: float) -> None:
        if max(1, replicas) != self._replicas:
            self._replicas = max(1, replicas)
            self._apply_limits(now)

    def _account(self, tenant: Tenant) -> Account:
        account = self._accounts.get(tenant.name)
        cap = (
            math.inf
            if tenant.max_concurrent is None
            else max(1, math.ceil(tenant.max_concurrent * self.fraction))
        )
        if account is None:
            account = self._accounts[tenant.name] = Account(tenant, cap)
        else:
            account.tenant, account.cap = tenant, cap
        return account

    def _apply_limits(self, now: float) -> None:
        part = self._part
        rate: RateLimit = self._rate
        self._global = Limits(
            _bucket(self._global.requests, rate.max_requests, rate.window_s, part("r"), now),
            _bucket(self._global.tokens, rate.max_tokens_per_window, rate.window_s, part("t"), now),
            rate.window_s,
            ("rate_limit.max_requests", "rate_limit.max_tokens_per_window"),
        )
        self._skip = frozenset(rate.skip_paths)
        tenants = [] if self._directory is None else list(self._directory.tenants.values())
        limits: dict[str, Limits] = {}
        for tenant in tenants:
            old = self._limits.get(tenant.name) or Limits()
            self._account(tenant)  # made, or its tenant and cap updated
            r, t = f"r:{tenant.name}", f"t:{tenant.name}"
            limits[tenant.name] = Limits(
                _bucket(old.requests, tenant.requests_per_minute or 0, MINUTE_S, part(r), now),
                _bucket(old.tokens, tenant.tokens_per_minute or 0, MINUTE_S, part(t), now),
                keys=(r, t),
            )
        self._limits = limits
        self._open = self._account(OPEN)
        # Tenants gone from the file keep their account while requests of theirs run.
        names = {t.name for t in tenants} | {OPEN.name}
        for name in [n for n, a in self._accounts.items() if n not in names and not a.running]:
            del self._accounts[name]

    # -- the request path -------------------------------------------------------------------------

    def identify(self, header: bytes | None) -> Account | None:
        """The caller's account; None when only :meth:`identify_slowly` can tell. Raises 401."""
        directory = self._directory
        if directory is None:
            return self._open
        if not header or not header.startswith(b"Bearer "):
            raise unauthorized()
        given = header[7:].strip()
        tenant = directory.find(given)
        if tenant is None:
            if directory.needs_slow_check(given):
                return None
            raise unauthorized()
        return self._accounts.get(tenant.name) or self._account(tenant)

    async def identify_slowly(self, header: bytes) -> Account:
        """A key only a PBKDF2 entry can match, checked off the loop (and remembered)."""
        assert self._directory is not None
        tenant = await self._directory.resolve(header[7:].strip())
        if tenant is None:
            raise unauthorized()
        return self._accounts.get(tenant.name) or self._account(tenant)

    def limited(self, path: str) -> bool:
        return path not in self._skip

    def charge(self, account: Account, tokens: int, now: float) -> Ticket:
        """Take one request and ``tokens`` from every bucket that applies, or from none of them.
        Raises 429 ``rate_limit_exceeded`` naming the limit that refused."""
        ticket = Ticket(account, tokens)
        mine = self._limits.get(account.tenant.name)
        shared = self._global
        if mine is None and shared.requests is None and shared.tokens is None:
            return ticket
        demand = self.demand
        if demand is not None:
            for limits in (mine, shared):
                if limits is not None:
                    r, t = limits.keys
                    if limits.requests is not None:
                        demand[r] = demand.get(r, 0.0) + 1
                    if limits.tokens is not None:
                        demand[t] = demand.get(t, 0.0) + tokens
        for limits in (mine, shared):
            if limits is not None and (err := limits.refuse(tokens, now)) is not None:
                raise err
        if mine is not None:
            mine.take(tokens, ticket)
        shared.take(tokens, ticket)
        # The headers count down the request limit that applies (the tenant's first), else the
        # token one.
        shown = mine.requests if mine is not None and mine.requests is not None else shared.requests
        if shown is None:
            shown = mine.tokens if mine is not None and mine.tokens is not None else shared.tokens
        if shown is not None:
            ticket.headers = _headers(shown, now)
        return ticket

    def refund(self, ticket: Ticket, now: float) -> None:
        """A request refused after its charge (queue full, queue timeout, no model): it ran
        nowhere, so it costs nothing."""
        for bucket in ticket.request_buckets:
            bucket.give_back(1, now)
        for bucket in ticket.token_buckets:
            bucket.give_back(ticket.charged, now)
        ticket.request_buckets = ticket.token_buckets = []

    def settle(self, ticket: Ticket, used: int | None, now: float) -> None:
        """Correct the token charge by what the request really used (None: unknown, keep it)."""
        if used is None or not ticket.token_buckets:
            return
        refund = ticket.charged - used
        if refund:
            for bucket in ticket.token_buckets:
                bucket.give_back(refund, now)


def _bucket(old: Bucket | None, limit: int, window_s: float, fraction: float, now: float) -> Bucket | None:
    if limit <= 0:
        return None
    if old is None:
        return Bucket(limit * fraction, window_s, now)
    old.resize(limit * fraction, window_s, now)
    return old


def _headers(bucket: Bucket, now: float) -> list[tuple[str, str]]:
    """IETF-draft style counters of the limit shown: what this process allows (its share)."""
    return [
        ("X-RateLimit-Limit", str(math.floor(bucket.capacity))),
        ("X-RateLimit-Remaining", str(max(0, math.floor(bucket.level)))),
        ("X-RateLimit-Reset", str(bucket.reset_s(now))),
    ]
