"""Overload protection: at most ``max_concurrent_requests`` completions at once, a bounded queue
behind them, and a queue timeout (docs/admission.md, "Priority classes and fair queueing").

The queue has one line per priority class, served strictly in class order. Within a class,
tenants take turns by weighted fair queueing (self-clocked): each waiter's tag is its tenant's
previous tag, or the class's virtual time less a credit if later, plus its cost over the
tenant's weight, and the smallest tag goes first. The credit (``max_concurrent`` in tag units)
lets a tenant that used less than its share go ahead of a backlog after a lull; a waiter that
leaves unserved gives its charge back, its tenant's later waiters moving up. The cost charges
prompt tokens to the prefill pool and ``max_tokens`` to the decode pool, each over its recent
mean per request, so a request twice as long as usual on either pool counts twice on that
pool. A tenant's waiters keep their order, so each line is a heap of tenants keyed by their
first waiter's tag.

Three rules keep a tenant that sends far more than its share from hurting the others:

- **Within share first.** Each tenant has a credit, a token bucket: it fills at ``SHARE_SLACK``
  times the tenant's share of what the slots can serve (each slot turns over once per mean
  hold, measured as requests end; the share is by weight among the tenants active now), holds
  up to the tenant's share of the slots, and each request takes its cost from it, down to one
  request below zero. A request the credit covered when it came (within its share) goes ahead of
  those it did not, tags deciding among each kind: a tenant near its share is served as if
  alone, bursts included, and one flooding the queue gets what is left. When every tenant asks
  for more than its share, as when all are backlogged, the tags alone decide and the weights
  hold. The credit starts at one request when a tenant becomes active, so a flood does not
  first take a share's worth of slots. (A rate measured over a few seconds would not do: a
  tenant sending at its share crosses any threshold near it whenever its arrivals bunch up,
  and what the slots served in a few seconds swings with the slots that happened to end then.
  Nor may a tenant's credit, rather than its request's, decide: a flood's credit touching zero
  for an instant would let its whole line through.)
- **Headroom.** The last ``headroom`` free slots (a quarter) are kept from requests beyond
  their tenant's share while another active tenant is within its share: that tenant then finds
  a slot at once instead of waiting for one to end (the number of requests a tenant at its
  share runs swings well above its mean; the headroom covers the swing), and the tenant
  flooding the queue runs on the other slots. When no other active tenant is within its share
  the headroom is anyone's, so no slot idles while requests wait for it.
- **Fair drop.** A full queue makes room by refusing the newest waiter of the lowest class below
  the newcomer's, else, in the newcomer's class, the newest waiter of the tenant with the
  longest line for its weight, when that is not the newcomer's tenant. Otherwise the newcomer
  is refused. Both are 429 ``too_many_requests``; a wait past ``queue_timeout_s`` is 503. Both
  carry ``Retry-After``.

A tenant at its ``max_concurrent`` waits without blocking the others. When nothing waits and
slots are free beyond the headroom, admission is a few counters: no future, no lock.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
import time
from collections.abc import Callable

from motor_mesh.common.http_errors import OpenAIError
from motor_mesh.coordinator.admission.tenants import PRIORITIES, Tenant

# Admissions over which the mean prompt and max_tokens are averaged (the cost's unit).
MEAN_OVER = 256
# A tenant stays active (the headroom kept for it) this long after its last request ended: a
# client sending one request at a time is between two requests, not gone.
LINGER_S = 2.0
HEADROOM_FRACTION = 4  # headroom = max_concurrent / this, rounded up
# A tenant's credit fills at this many times its share of what the slots serve: one sending at
# its share keeps a full credit and goes ahead of tenants over theirs, one flooding the queue
# keeps none and gets what is left. When every tenant's credit is spent, the tags alone decide.
SHARE_SLACK = 1.25
HOLD_OVER = 64  # releases over which the mean time a slot is held is averaged
# A request's cost is about this much on average (prompt and max_tokens, each over its mean):
# the credit holds the tenant's share of the slots, in requests of the average cost.
MEAN_COST = 2.0


def too_many(limit: int, why: str = "the queue is full") -> OpenAIError:
    return OpenAIError(
        429,
        f"too many requests: {limit} are being served and {why}; retry later",
        "rate_limit_error",
        "too_many_requests",
        headers={"Retry-After": "1"},
    )


BY_PRIORITY = "a request of a higher priority took its place in the queue"
BY_SHARE = "a request of a tenant within its fair share took its place in the queue"


def queue_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(
        503,
        f"the request waited queue_timeout_s ({seconds:g} s) for a free slot; retry later",
        "service_unavailable",
        "queue_timeout",
        headers={"Retry-After": "1"},
    )


class Account:
    """One tenant's place in this process's admission (kept across reloads by name)."""

    __slots__ = (
        "active", "cap", "counted", "credit", "credit_at", "idle_at", "last_tag", "queue", "running",
        "spread", "tenant",
    )  # fmt: skip

    def __init__(self, tenant: Tenant, cap: float) -> None:
        self.tenant = tenant
        self.cap = cap  # its max_concurrent share here (inf: none)
        self.running = 0
        self.last_tag = 0.0
        self.queue: dict[int, Waiter] = {}  # its waiters by arrival (tags grow with it)
        self.active = False  # running, waiting, or idle for less than LINGER_S
        self.counted = 0.0  # the weight it adds to the active tenants' total while active
        self.credit = 0.0  # what it may ask above its share (Slots._credit)
        self.credit_at = 0.0
        # Its requests' part here over an even part (1: even; with one keep-alive connection
        # and two workers, 2 here and 0 at the other): its share here follows where it sends.
        self.spread = 1.0
        self.idle_at = 0.0


class Waiter:
    __slots__ = ("account", "charge", "cls", "fut", "seq", "tag", "within")

    def __init__(
        self,
        account: Account,
        cls: int,
        tag: float,
        charge: float,
        seq: int,
        fut: asyncio.Future[None],
        within: bool,
    ) -> None:
        self.account = account
        self.within = within  # its tenant's credit covered it when it came (within its share)
        self.cls = cls
        self.tag = tag
        self.charge = charge  # what it added to its tenant's tags (its cost over the weight)
        self.seq = seq
        self.fut = fut


class _Line:
    """One priority class: tenants with waiters, in a heap by their first waiter's tag (entries
    whose waiter has left are skipped when met)."""

    __slots__ = ("accounts", "count", "heap", "vtime")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Account]] = []
        self.accounts: set[Account] = set()
        self.count = 0
        self.vtime = 0.0


class Slots:
    def __init__(
        self,
        max_concurrent: int,
        max_queued: int,
        queue_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock  # the tests' virtual time; the queue timeout is the loop's
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.headroom = _headroom(max_concurrent)
        self.active = 0
        self.queued = 0
        self._lines = [_Line() for _ in PRIORITIES]
        self._seq = itertools.count()
        self._mean_prompt = 0.0  # 0: no admission yet (the first one sets them)
        self._mean_max_tokens = 0.0
        self._actives: set[Account] = set()
        self._weight = 0.0  # of the active tenants
        self._hold = 0.0  # the mean seconds a slot is held (0: none ended yet)
        self._lingering: collections.deque[Account] = collections.deque()

    @classmethod
    def share(cls, max_concurrent: int, max_queued: int, queue_timeout_s: float, workers: int) -> Slots:
        """One worker's part of the Coordinator-wide limits (rounded up: never zero)."""
        return cls(math.ceil(max_concurrent / workers), math.ceil(max_queued / workers), queue_timeout_s)

    def resize(self, max_concurrent: int, max_queued: int, queue_timeout_s: float, workers: int) -> None:
        """New limits from a reload; slots freed by a larger limit go to the waiters at once."""
        self.max_concurrent = math.ceil(max_concurrent / workers)
        self.max_queued = math.ceil(max_queued / workers)
        self.queue_timeout_s = queue_timeout_s
        self.headroom = _headroom(self.max_concurrent)
        self._hand_over()

    # -- who may run -----------------------------------------------------------------------------

    def _eligible(self, account: Account, within: bool, protected: list[bool | None]) -> bool:
        """Whether a request of ``account`` (``within`` its share when it came) may take a slot
        now. ``protected`` caches, for one decision, whether another active tenant within its
        share keeps the headroom from it."""
        free = self.max_concurrent - self.active
        if free <= 0 or account.running >= account.cap:
            return False
        if free > self.headroom or within:
            return True
        if protected[0] is None:
            self._expire()
            now = self._clock()
            protected[0] = any(self._credit(a, now) >= 0 for a in self._actives if a is not account)
        return not protected[0]

    def _activate(self, account: Account, now: float) -> None:
        if not account.active:
            account.active = True
            account.credit, account.credit_at = MEAN_COST, now  # one request's worth: earned after
            account.counted = account.tenant.weight
            self._weight += account.counted
            self._actives.add(account)

    def _credit(self, account: Account, now: float) -> float:
        """The tenant's credit now: what it has left of its share (docstring, "Within share
        first"). Not below zero means it asks for no more than SHARE_SLACK times its share."""
        if not account.active or self._weight <= 0:
            return math.inf  # inactive tenants are not counted
        part = account.counted / self._weight * account.spread
        depth = MEAN_COST * max(1.0, self.max_concurrent * part)  # at least one request
        if not self._hold:
            return min(depth, account.credit)  # no slot has ended yet: no rate to earn credit at
        rate = SHARE_SLACK * depth / self._hold  # its share of the slots, turned over once a hold
        return min(depth, account.credit + (now - account.credit_at) * rate)

    def _spend(self, account: Account, cost: float, now: float) -> bool:
        """Take a request's cost from the tenant's credit: whether it was within its share."""
        left = self._credit(account, now) - cost
        account.credit = max(-MEAN_COST, left)
        account.credit_at = now
        return left >= 0

    def _maybe_idle(self, account: Account) -> None:
        if not account.running and not account.queue and account.active:
            account.idle_at = self._clock()
            self._lingering.append(account)
            self._expire()  # keeps the deque to the tenants idle for less than LINGER_S

    def _expire(self) -> None:
        horizon = self._clock() - LINGER_S
        lingering = self._lingering
        while lingering and lingering[0].idle_at <= horizon:
            account = lingering.popleft()
            idle = not account.running and not account.queue
            if idle and account.active and account.idle_at <= horizon:
                account.active = False
                self._weight -= account.counted
                self._actives.discard(account)

    # -- taking and giving back a slot -----------------------------------------------------------

    async def acquire(self, account: Account, prompt_tokens: int = 0, max_tokens: int = 0) -> float:
        """Take a slot, waiting in line if need be; returns when (its clock), for
        ``release``. Raises OpenAIError 429 / 503."""
        if not self._mean_prompt:
            self._mean_prompt, self._mean_max_tokens = max(prompt_tokens, 1), max(max_tokens, 1)
        self._mean_prompt += (max(prompt_tokens, 1) - self._mean_prompt) / MEAN_OVER
        self._mean_max_tokens += (max(max_tokens, 1) - self._mean_max_tokens) / MEAN_OVER
        cost = prompt_tokens / self._mean_prompt + max_tokens / self._mean_max_tokens
        now = self._clock()
        self._activate(account, now)
        within = self._spend(account, cost, now)
        if not self.queued and self._eligible(account, within, [None]):
            self.active += 1
            account.running += 1
            return now
        cls = account.tenant.priority
        line = self._lines[cls]
        charge = cost / account.tenant.weight
        # A tenant that used less than its share keeps up to `max_concurrent` of it: its next
        # requests go ahead of a backlog by that much (a burst after a lull), never more.
        tag = max(line.vtime - self.max_concurrent, account.last_tag) + charge
        if self.queued >= self.max_queued:
            victim, why = self._victim(cls, account)
            if victim is None:
                self._maybe_idle(account)
                raise too_many(self.max_concurrent)
            self._remove(victim, served=False)
            victim.fut.set_exception(too_many(self.max_concurrent, why))
        fut = asyncio.get_running_loop().create_future()
        waiter = Waiter(account, cls, tag, charge, next(self._seq), fut, within)
        account.last_tag = tag
        if not account.queue:
            heapq.heappush(line.heap, (tag, waiter.seq, account))
            line.accounts.add(account)
        account.queue[waiter.seq] = waiter
        line.count += 1
        self.queued += 1
        self._hand_over()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await fut  # _grant() gave us a slot: active and running already count us
        except (TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(account)  # the slot arrived just as we gave up: pass it on
            elif waiter.seq in account.queue:
                self._remove(waiter, served=False)
            if isinstance(exc, TimeoutError):
                raise queue_timeout(self.queue_timeout_s) from None
            raise
        finally:
            if not fut.done():
                fut.cancel()
        return self._clock()

    def release(self, account: Account, since: float | None = None) -> None:
        """Give back a slot taken at ``since`` (what ``acquire`` returned; None: not measured)."""
        account.running -= 1
        self.active -= 1
        if since is not None:
            held = self._clock() - since
            self._hold = held if not self._hold else self._hold + (held - self._hold) / HOLD_OVER
        self._maybe_idle(account)
        self._hand_over()

    def _hand_over(self) -> None:
        """Give free slots to the first eligible waiters."""
        while self.queued and self.active < self.max_concurrent:
            waiter = self._next()
            if waiter is None:
                return
            if waiter.fut.done():  # its wait ended (timed out, cancelled) and it is yet to leave
                self._remove(waiter, served=False)
                continue
            waiter.account.running += 1  # first: leaving the line must not look like going idle
            self.active += 1
            self._remove(waiter)
            line = self._lines[waiter.cls]
            if waiter.tag > line.vtime:
                line.vtime = waiter.tag
            waiter.fut.set_result(None)

    def _next(self) -> Waiter | None:
        """The first waiter, by class, then tenants within their share first, then tag, whose
        tenant may run now."""
        self._expire()
        protected: list[bool | None] = [None]
        for line in self._lines:
            if not line.count:
                continue
            heap = line.heap
            passed: list[tuple[float, int, Account]] = []
            found = None
            while heap:
                entry = heapq.heappop(heap)
                account = entry[2]
                head = next(iter(account.queue.values()), None)
                if head is None or head.seq != entry[1]:
                    continue  # that waiter left; the tenant's next one has its own entry
                passed.append(entry)
                if self._eligible(account, head.within, protected):
                    if found is None:
                        found = head
                    if head.within:
                        found = head
                        break
            for entry in passed:
                heapq.heappush(heap, entry)
            if found is not None:
                return found
        return None

    def _remove(self, waiter: Waiter, served: bool = True) -> None:
        """Take ``waiter`` out of line: granted (``served``), or refused, timed out, cancelled.
        A request that leaves unserved takes its charge back, from its tenant's later waiters
        too: a tenant is not pushed back in line for requests it never got (a flooding tenant
        whose requests time out would otherwise fall ever further behind its share)."""
        account = waiter.account
        line = self._lines[waiter.cls]
        first = next(iter(account.queue))
        del account.queue[waiter.seq]
        if not served:
            for later in account.queue.values():
                if later.seq > waiter.seq:
                    later.tag -= waiter.charge
            account.last_tag -= waiter.charge
        line.count -= 1
        self.queued -= 1
        if account.queue:
            if first == waiter.seq:  # the tenant's next waiter now leads its entry
                head = next(iter(account.queue.values()))
                heapq.heappush(line.heap, (head.tag, head.seq, account))
        else:
            line.accounts.discard(account)
            self._maybe_idle(account)

    def _victim(self, cls: int, account: Account) -> tuple[Waiter | None, str]:
        """Whom a newcomer of class ``cls`` from ``account`` may push out of a full queue: the
        newest waiter of the lowest class below ``cls``; else, in ``cls``, the newest waiter of
        the tenant with the longest line for its weight, unless that is the newcomer's own."""
        for lower in range(len(self._lines) - 1, cls, -1):
            line = self._lines[lower]
            if line.count:
                newest = max((next(reversed(a.queue.values())) for a in line.accounts), key=lambda w: w.seq)
                return newest, BY_PRIORITY
        line = self._lines[cls]
        if line.count:
            longest = max(line.accounts, key=lambda a: len(a.queue) / a.tenant.weight)
            if len(longest.queue) / longest.tenant.weight > (len(account.queue) + 1) / account.tenant.weight:
                return next(reversed(longest.queue.values())), BY_SHARE
        return None, ""


def _headroom(max_concurrent: int) -> int:
    return math.ceil(max_concurrent / HEADROOM_FRACTION) if max_concurrent > 1 else 0
