"""The context budget (``coordinator.clamp_max_tokens``; docs/operations.md, "Context budget"): a
completion's output limit lowered to what its model's context leaves after the prompt, and a
prompt that alone fills the context refused, before any leg is sent.

Without it an engine refuses a request whose prompt and ``max_tokens`` together pass its
``max_model_len``: in a vLLM pair the decode engine does, after the prefill engine computed the
whole prompt for nothing. The context of a model is the smallest ``max_model_len`` among its
engines (prefill, decode, union and prefill-only alike: a request may go to any of them), which
each endpoint reports in ``GET /v1/models`` (``data[i].max_model_len``, in vLLM and SGLang). It
is read off the request path, by one supervised task in each process that serves HTTP, once
when an endpoint joins that process's routing view, and again when the endpoint comes back as a
new one (a relaunched engine has a new pid, so a new :class:`~.routes.Target`). Every read has a
deadline, and a failed one is tried again after a growing delay. **An endpoint whose length is
not known** (not read yet, unreachable, or an engine that does not say) **does not constrain**:
while none of a model's engines is known, its requests pass as they came.

The prompt is counted exactly when the model has a tokenizer: the one kv_aware reads prompts
with (:class:`~.kv.prompt.Tokenizers`: ``coordinator.tokenizers``, the model name as a local
path, or the simulated engine's built-in one), a long prompt encoded off the event loop. Then

- a prompt that fills the context: 400 ``context_length_exceeded`` (``param`` ``messages`` or
  ``prompt``), naming both numbers;
- a ``max_tokens`` (and a chat's ``max_completion_tokens``) over the room the prompt leaves:
  lowered to that room;
- a chat that sets neither, whose engines' default is "up to the context": set to the room, so
  the decode leg cannot run past the smaller context; a completion that sets none keeps the
  engines' default (16) unless the room is smaller.

Of a batch of completion prompts, the longest counts. Without a tokenizer (a real engine's model
with none configured) the prompt's size is only estimated (about four characters a token,
:func:`~.bodies.estimate_tokens`): a limit the request gives is lowered by the estimate, but
nothing is refused and no limit is added, since an estimate under the truth would turn a request
the engine accepts with its own default into a refusal; the engine keeps the last word, as it
does for values that are not a count of tokens.

The rewritten body is what every leg is built from (the vLLM prefill leg from the parsed
request, the others from its bytes), so both legs, a kv_aware choice and a continuation on
another instance (docs/migration.md) all see the clamped limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import Counter, Gauge

from motor_mesh.common import log, tasks
from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.common.http_errors import OpenAIError, invalid_request
from motor_mesh.common.httpclient import Disconnected, Pool, Refused, UpstreamTimeout
from motor_mesh.common.retry import Backoff
from motor_mesh.common.tokenizer import HfTokenizer, is_token_ids
from motor_mesh.coordinator.bodies import estimate_tokens, loads, with_fields
from motor_mesh.coordinator.kv.prompt import Prompt, Tokenizers, Tokens
from motor_mesh.coordinator.metrics import Metrics
from motor_mesh.coordinator.routes import ModelRoutes, RoutingView, Target, Upstream

FOLLOW_S = 0.25  # how often the task looks for a new routing view
FETCH_TIMEOUT_S = 3.0  # one read of an endpoint's /v1/models, connection included
RETRY_S, RETRY_MAX_S = 1.0, 30.0  # after a failed read, doubling
COMPLETION_DEFAULT = 16  # max_tokens of a completion request that sets none (OpenAI, vLLM, SGLang)
# Bodies past this many bytes are counted in a thread when the tokenizer is the built-in one,
# which encodes in Python (a Hugging Face tokenizer's long texts go to a thread anyway).
INLINE_BYTES = 64 * 1024
_LIMITS = {True: ("max_completion_tokens", "max_tokens"), False: ("max_tokens",)}  # by chat


# -- the arithmetic (pure) ----------------------------------------------------------------------


def targets(routes: ModelRoutes) -> Iterator[Target]:
    """Every instance a request of ``routes`` may be sent to."""
    for group in routes.pd:
        yield from group.prefill
        yield from group.decode
    yield from routes.union
    yield from routes.prefill_only


def context_of(routes: ModelRoutes, lengths: Mapping[Upstream, int]) -> int | None:
    """The smallest ``max_model_len`` known among the endpoints of ``routes``; None when none is
    known (an endpoint not in ``lengths`` does not constrain)."""
    known = [n for t in targets(routes) for ep in t.endpoints if (n := lengths.get(ep)) is not None]
    return min(known) if known else None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def too_long(context: int, prompt_tokens: int, chat: bool) -> OpenAIError:
    """The refusal of a prompt that leaves no room for a single output token (OpenAI's code)."""
    what = "messages" if chat else "prompt"
    return invalid_request(
        f"This model's maximum context length is {context} tokens. However, your {what} resulted "
        f"in {prompt_tokens} tokens, which leaves no room for the completion. Please reduce the "
        f"length of the {what}.",
        "context_length_exceeded",
        what,
    )


def plan(req: dict[str, Any], chat: bool, context: int, prompt_tokens: int, exact: bool) -> dict[str, int]:
    """The output limits to set so that ``prompt_tokens`` and the output fit in ``context``
    ({}: the request fits as it is, or is left to the engine). Raises the 400 of
    :func:`too_long` when the prompt alone fills the context and its count is ``exact``."""
    room = context - prompt_tokens
    if room < 1:
        if exact:
            raise too_long(context, prompt_tokens, chat)
        return {}  # an estimate: the engine counts and decides
    given: dict[str, int] = {}
    for name in _LIMITS[chat]:
        value = req.get(name)
        if value is None:
            continue
        if not _is_count(value):
            return {}  # the engine refuses it as it is
        given[name] = value
    if given:
        return {name: room for name, value in given.items() if value > room}
    if not exact:
        return {}  # the engine's default, counted by the engine, beats one from an estimate
    if chat or room < COMPLETION_DEFAULT:
        return {"max_tokens": room}
    return {}


def rewrite(req: dict[str, Any], raw: bytes, limits: dict[str, int]) -> tuple[dict[str, Any], bytes]:
    """The request with ``limits`` set, parsed and as bytes (spliced into the client's bytes
    when none of them was there, else serialised again: bodies.with_fields)."""
    if not limits:
        return req, raw
    return {**req, **limits}, with_fields(raw, req, limits)


def estimate(req: dict[str, Any], chat: bool) -> int:
    """The body's estimate of its (longest) prompt's tokens."""
    batch = None if chat else _batch(req.get("prompt"))
    if batch is None:
        return estimate_tokens(req)[0]
    return max(estimate_tokens({"prompt": p})[0] for p in batch)


def _batch(prompt: Any) -> list[Any] | None:
    """A completion's prompts when it has several (strings or id lists), else None."""
    if isinstance(prompt, list) and len(prompt) > 1 and not is_token_ids(prompt):
        return prompt
    return None


def max_model_len_of(body: bytes, model: str) -> int | None:
    """``max_model_len`` in an engine's ``/v1/models`` answer: the entry of ``model``, else the
    smallest listed; None when the answer gives none."""
    try:
        obj = loads(body)
    except (ValueError, RecursionError):
        return None
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return None
    lengths: dict[str | None, int] = {}  # by the model id each entry names
    for card in data:
        n = card.get("max_model_len") if isinstance(card, dict) else None
        if isinstance(n, int) and _is_count(n):
            name = card.get("id")
            lengths.setdefault(name if isinstance(name, str) else None, n)
    return lengths.get(model, min(lengths.values(), default=None))


async def count(tokens: Tokens, req: dict[str, Any], chat: bool, size: int) -> tuple[int, Prompt] | None:
    """(the longest prompt's tokens, the first prompt) as the engine counts them; None when the
    body has a prompt ``tokens`` cannot read. ``size``: the body's bytes."""
    batch = None if chat else _batch(req.get("prompt"))
    bodies = [req] if batch is None else [{"prompt": p} for p in batch]
    if size > INLINE_BYTES and not isinstance(tokens.tokenizer, HfTokenizer):
        read = await asyncio.to_thread(lambda: [tokens.read(b, chat) for b in bodies])
    else:
        read = [await tokens.prompt(b, chat) for b in bodies]
    prompts = [p for p in read if p is not None]
    if len(prompts) < len(read) or not prompts:
        return None
    return max(p.n for p in prompts), prompts[0]


# -- one inference process's budget ---------------------------------------------------------------


class _Ask:
    """An endpoint whose length is still to be read: when next, and how long after a failure."""

    __slots__ = ("at", "backoff", "failed")

    def __init__(self) -> None:
        self.at = 0.0
        self.backoff = Backoff(RETRY_S, RETRY_MAX_S)
        self.failed = False


class Unread(Exception):
    """An endpoint's /v1/models could not be read (the message says why)."""


class ContextBudget:
    """Create inside the running loop; :meth:`start` it, :meth:`pause` it and start it again
    as the key is turned off and on, and :meth:`stop` it at the end. ``tokenizers``: kv_aware's,
    when it runs in this process (each tokenizer is loaded once, and the prompt counted here is
    the one kv_aware routes by); None: this budget loads its own."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        view: Callable[[], RoutingView],
        metrics: Metrics,
        tokenizers: Tokenizers | None = None,
    ) -> None:
        self._view = view
        self._shares_prompt = tokenizers is not None
        self._tokenizers = tokenizers if tokenizers is not None else Tokenizers(cfg.tokenizers, "context")
        self.lengths: dict[Upstream, int] = {}  # max_model_len by endpoint, those known
        self._asks: dict[Upstream, _Ask] = {}  # endpoints still to be read
        self.rounds = 0  # looks at the view done: "nothing more was asked" is a count, not a time
        self._silent: set[Upstream] = set()  # endpoints that answered without a length
        self._memo: dict[str, tuple[ModelRoutes, int | None]] = {}  # context by model, per routes
        self._pool: Pool | None = None  # its own: never a connection of the request path
        self._task: asyncio.Task[None] | None = None
        r, tallies = metrics.registry, metrics.tallies
        clamped = Counter(
            "motor_coordinator_max_tokens_clamped",
            "Completion requests whose output limit the context budget (clamp_max_tokens) set: "
            "lowered to what the context leaves after the prompt (why=over), or given where the "
            "request had none (why=unset).",
            ["why"],
            registry=r,
        )
        exceeded = Counter(
            "motor_coordinator_context_length_exceeded",
            "Completion requests refused with 400 before any leg: the prompt alone fills the context "
            "(clamp_max_tokens).",
            registry=r,
        )
        self._known = Gauge(
            "motor_coordinator_context_lengths_known",
            "Engine endpoints of the routing view whose max_model_len the context budget knows "
            "(with inference workers: the fewest any worker knows).",
            registry=r,
            multiprocess_mode="livemin",
        )
        self._over = tallies.counter(lambda: clamped.labels("over"))
        self._unset = tallies.counter(lambda: clamped.labels("unset"))
        self._exceeded = tallies.counter(lambda: exceeded)

    def start(self) -> None:
        """Follow the routing view (again, after :meth:`pause`); nothing when already following."""
        if self._task is None:
            self._pool = Pool(FETCH_TIMEOUT_S)
            self._task = tasks.spawn("context_budget", self._follow)

    def pause(self) -> None:
        """Stop following and forget every length (a later :meth:`start` reads them afresh)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self.lengths.clear()
        self._asks.clear()
        self._silent.clear()
        self._memo.clear()
        self._known.set(0)

    async def stop(self) -> None:
        task = self._task
        self.pause()
        await tasks.cancel_quietly(task)

    # -- the request path ------------------------------------------------------------------

    async def fit(
        self, req: dict[str, Any], raw: bytes, chat: bool, routes: ModelRoutes
    ) -> tuple[dict[str, Any], bytes, Prompt | None]:
        """The request (parsed, and its bytes) with its output limit fitted to the context of
        ``routes``, and its prompt when it was tokenized for kv_aware's use (else None).
        Raises a 400 OpenAIError when the prompt alone fills the context."""
        context = self.context(routes)
        if context is None:
            return req, raw, None  # no engine of the model has said its length yet
        some = next(targets(routes))  # the instance kv_aware tokenizes for, too (pd.Router.route)
        tokens = self._tokenizers.get(some.model, some.engine_type)
        counted = None if tokens is None else await count(tokens, req, chat, len(raw))
        if counted is None:
            n, prompt = estimate(req, chat), None
        else:
            n, prompt = counted
        try:
            limits = plan(req, chat, context, n, exact=counted is not None)
        except OpenAIError:
            self._exceeded.n += 1
            raise
        if limits:
            given = any(req.get(name) is not None for name in limits)
            (self._over if given else self._unset).n += 1
            req, raw = rewrite(req, raw, limits)
        if not self._shares_prompt or prompt is None or not prompt.n:
            prompt = None
        return req, raw, prompt

    def context(self, routes: ModelRoutes) -> int | None:
        """The context of ``routes`` (remembered per model until a view or a length changes)."""
        model = next(targets(routes)).model
        hit = self._memo.get(model)
        if hit is not None and hit[0] is routes:
            return hit[1]
        n = context_of(routes, self.lengths)
        self._memo[model] = (routes, n)
        return n

    # -- following the routing view --------------------------------------------------------

    async def _follow(self) -> None:
        loop = asyncio.get_running_loop()
        last: RoutingView | None = None
        while True:
            view = self._view()
            if view is not last:
                self._joined(view)
                last = view
            now = loop.time()
            due = [ep for ep, ask in self._asks.items() if ask.at <= now]
            if due:
                # At once, each within FETCH_TIMEOUT_S: a silent engine holds the others that long.
                await asyncio.gather(*(self._ask(ep) for ep in due))
                self._known.set(len(self.lengths))
            self.rounds += 1
            await asyncio.sleep(FOLLOW_S)

    def _joined(self, view: RoutingView) -> None:
        """Forget the endpoints that left ``view``; ask the new ones."""
        here = {ep for t in view.targets for ep in t.endpoints}
        gone = [ep for ep in self.lengths if ep not in here]
        for ep in gone:
            del self.lengths[ep]
        for ep in [ep for ep in self._asks if ep not in here]:
            del self._asks[ep]
        self._silent &= here
        for ep in here:
            if ep not in self.lengths and ep not in self._asks and ep not in self._silent:
                self._asks[ep] = _Ask()
        for t in view.targets:
            self._tokenizers.want(t.model, t.engine_type)
        self._memo.clear()
        self._known.set(len(self.lengths))

    async def _ask(self, ep: Upstream) -> None:
        ask = self._asks[ep]
        t = ep.owner
        try:
            n = await self._read(ep)
        except Unread as exc:
            delay = ask.backoff.next()
            ask.at = asyncio.get_running_loop().time() + delay
            if not ask.failed:  # one line per endpoint, not one per attempt
                ask.failed = True
                log.warn("max_model_len_unread", instance_id=t.id, endpoint=ep.base, error=str(exc))
            return
        del self._asks[ep]
        if n is None:
            self._silent.add(ep)
            log.warn("max_model_len_unknown", instance_id=t.id, endpoint=ep.base, model=t.model)
            return
        self.lengths[ep] = n
        self._memo.clear()
        log.event("max_model_len", instance_id=t.id, endpoint=ep.base, model=t.model, max_model_len=n)

    async def _read(self, ep: Upstream) -> int | None:
        """The endpoint's max_model_len for its instance's model (None: it does not say).
        Raises Unread."""
        deadline = asyncio.get_running_loop().time() + FETCH_TIMEOUT_S
        pool = self._pool
        assert pool is not None  # only the task reads, and it runs between start and pause
        try:
            resp = await pool.request(
                ep.host, ep.port, b"GET", b"/v1/models", b"", b"Connection: close\r\n", deadline=deadline
            )
            try:
                body = await resp.read(deadline)
            finally:
                resp.release()
        except (Refused, Disconnected, UpstreamTimeout) as exc:
            raise Unread(str(exc) or type(exc).__name__) from None
        if resp.status != 200:
            raise Unread(f"GET /v1/models answered {resp.status}")
        return max_model_len_of(body, ep.owner.model)
