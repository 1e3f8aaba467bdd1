"""KV-aware routing in one inference process: the policy, the tokenizers, and the index it reads.

The index comes from the engines' events (:mod:`.feed`). With ``workers = 1`` the inference
process runs the feed itself; with more, the management process runs it once for all, and each
worker reads the index from memory it maps (:mod:`.shared`): no event work in the workers and no
round trip on the request path. bench/results/kv_routing.md measures the choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from motor_mesh.common import enums, log, tasks
from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.common.tokenizer import Builtin, Tokenizer, load
from motor_mesh.common.tokenizer import tokenizer_file as find_tokenizer
from motor_mesh.coordinator.kv import speedups
from motor_mesh.coordinator.kv.feed import RECONCILE_S, KvFeed
from motor_mesh.coordinator.kv.policy import IndexView, KvAware
from motor_mesh.coordinator.kv.prompt import PromptView, Tokens
from motor_mesh.coordinator.kv.shared import SharedReader
from motor_mesh.coordinator.metrics import Metrics
from motor_mesh.coordinator.routes import RoutingView, Target

POLICY = "kv_aware"


def roles(cfg: CoordinatorConfig) -> set[int]:
    """The roles a kv_aware policy chooses among (``decode_policy`` also chooses union
    instances)."""
    out: set[int] = set()
    if cfg.prefill_policy == POLICY:
        out.add(enums.PREFILL)
    if cfg.decode_policy == POLICY:
        out |= {enums.DECODE, enums.UNION}
    return out


class KvRouting:
    """Create inside the running loop; :meth:`start` once, :meth:`stop` at the end. With
    ``shared_dir`` (an inference worker) the index is the management process's, read from
    there; without, this process feeds its own."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        view: Callable[[], RoutingView],
        metrics: Metrics,
        shared_dir: str | None = None,
    ) -> None:
        self.cfg = cfg
        self._view = view
        self.metrics = metrics.kv
        self._roles = roles(cfg)
        self.feed: KvFeed | None = None
        self.shared: SharedReader | None = None
        if shared_dir is None:
            self.feed = KvFeed(cfg, view, self.metrics, self._roles)
            index: IndexView = self.feed.index
        else:
            index = self.shared = SharedReader(shared_dir)
        self._index = index
        self.policy = KvAware(index, self.metrics, cfg.kv_prefix_weight, cfg.kv_load_weight)
        if speedups.native is None:
            log.warn(
                "kv_speedups_missing",
                hint="reinstall with a C compiler present: kv_aware runs its Python request path",
            )
        self._tokens: dict[tuple[str, int], Tokens | None] = {}  # by (model, engine type)
        # Their C chat readers, where they have one. ``prompt(req, chat, target)`` is the request
        # path's: a chat that one of them reads is read there in one call (a Python frame costs
        # about 4 µs on a request path whose caches other processes have evicted), the rest here.
        self._chats: dict[tuple[str, int], Any] = {}
        self.prompt = prompt_reader(self._chats, self._read)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.feed is not None:
            await self.feed.start()
        self._task = tasks.spawn("kv_routing", self._reconcile_loop)

    async def stop(self) -> None:
        await tasks.cancel_quietly(self._task)
        if self.feed is not None:
            await self.feed.stop()
        if self.shared is not None:
            self.shared.close()

    # -- the request path ------------------------------------------------------------------

    def _read(self, req: dict[str, Any], chat: bool, target: Target) -> PromptView | None:
        """:attr:`prompt` in Python: the request's prompt tokenized for ``target``'s model and
        engine; None while its tokenizer is not loaded, or when the body has no prompt it can
        read. With the C speedups, what their chat reader leaves (see :attr:`prompt`)."""
        tokens = self._tokens.get((target.model, target.engine_type))
        if tokens is None:
            return None
        prompt = tokens.read(req, chat)
        return prompt if prompt is not None and prompt.n else None

    # -- keeping up with the table and the shared index -----------------------------------

    async def _reconcile_loop(self) -> None:
        last: RoutingView | None = None
        while True:
            view = self._view()
            if view is not last:
                for t in view.targets:
                    if t.role in self._roles:
                        self._want_tokenizer(t)
                last = view
            if self.shared is not None:
                await self._follow_shared(self.shared)
            self._follow_block_sizes(view)
            await asyncio.sleep(RECONCILE_S)

    def _follow_block_sizes(self, view: RoutingView) -> None:
        # A chat is hashed, as it is read, at the block size its engines report: off the
        # request path, here.
        for t in view.targets:
            tokens = self._tokens.get((t.model, t.engine_type))
            if tokens is not None and t.role in self._roles:
                for ep in t.endpoints:
                    size = self._index.block_size(ep.base)
                    if size:
                        tokens.block_size = size
                        break

    @staticmethod
    async def _follow_shared(shared: SharedReader) -> None:
        # Mapping files blocks: in a thread. Once the directory is mapped, seeing whether it
        # changed is a memory read, cheaper than the thread. The swap is on the loop.
        changed = shared.read_directory() if shared.mapped else await asyncio.to_thread(shared.read_directory)
        if changed is not None:
            gen, names = changed
            opened = await asyncio.to_thread(shared.attach, names)
            shared.install(gen, names, opened)

    def _want_tokenizer(self, t: Target) -> None:
        key = (t.model, t.engine_type)
        if key in self._tokens:
            return
        self._tokens[key] = None
        tasks.start(f"kv_tokenizer {t.model}", self._load_tokenizer(*key))

    async def _load_tokenizer(self, model: str, engine_type: int) -> None:
        sim = engine_type == enums.ENGINE_SIM
        path = self.cfg.tokenizers.get(model) or model
        try:
            tokenizer = await asyncio.to_thread(_tokenizer_for, path, sim)
        except Exception as exc:  # any failure: route this model by load
            log.warn("kv_tokenizer_failed", model=model, path=path, error=str(exc) or type(exc).__name__)
            return
        if tokenizer is None:
            # A real engine's ids cannot be guessed: its requests go by load alone.
            log.warn("kv_no_tokenizer", model=model, hint="set coordinator.tokenizers")
            return
        tokens = self._tokens[(model, engine_type)] = Tokens(tokenizer, sim)
        if tokens.chats is not None:
            self._chats[(model, engine_type)] = tokens.chats
        log.event("kv_tokenizer", model=model, tokenizer=tokenizer.name, sim=sim)


ReadPrompt = Callable[[dict[str, Any], bool, Target], PromptView | None]


def prompt_reader(chats: dict[tuple[str, int], Any], rest: ReadPrompt) -> ReadPrompt:
    """A request's prompt for a target, ``(req, chat, target)``: a chat read by the C chat
    reader ``chats`` maps the target's (model, engine type) to, when the speedups were built;
    the rest, and everything without them, is ``rest``'s."""
    native = speedups.native
    return rest if native is None else native.Prompts(chats, rest)


def _tokenizer_for(path: str, sim: bool) -> Tokenizer | None:
    """The simulated engine falls back to its built-in tokenizer, as the engine itself does."""
    if find_tokenizer(path) is None:
        return Builtin() if sim else None
    return load(path)


def wanted(cfg: CoordinatorConfig) -> bool:
    return POLICY in (cfg.prefill_policy, cfg.decode_policy)
