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

from motor_mesh.common import enums, tasks
from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.coordinator.kv.feed import RECONCILE_S, KvFeed
from motor_mesh.coordinator.kv.policy import IndexView, KvAware
from motor_mesh.coordinator.kv.prompt import Prompt, PromptView, Tokenizers
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
        self.policy = KvAware(
            index,
            self.metrics,
            cfg.kv_prefix_weight,
            cfg.kv_load_weight,
            load_gate=cfg.kv_load_gate,
            gate_topn=cfg.kv_affinity_load_gate_topn,
        )
        self.tokenizers = Tokenizers(cfg.tokenizers)  # by (model, engine type)
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

    async def prompt(self, req: dict[str, Any], chat: bool, target: Target) -> PromptView | None:
        """The request's prompt tokenized for ``target``'s model and engine; None while its
        tokenizer is not loaded, or when the body has no prompt it can read."""
        tokens = self.tokenizers.get(target.model, target.engine_type)
        if tokens is None:
            return None
        prompt = await tokens.prompt(req, chat, self._held)
        return prompt if prompt is not None and prompt.n else None

    def _held(self, prompt: Prompt) -> bool:
        """Whether some engine holds every full block of ``prompt`` (the leading chunks of a
        long one: see prompt.Tokens.prompt), at the block size the engines report."""
        index = self._index
        size = next((s for ep in index.endpoints() if (s := index.block_size(ep))), None)
        if size is None:
            return False  # no engine has said what it holds
        hashes = prompt.hashes(size)
        return bool(hashes) and any(run == len(hashes) for run in index.match(hashes).values())

    # -- keeping up with the table and the shared index -----------------------------------

    async def _reconcile_loop(self) -> None:
        last: RoutingView | None = None
        while True:
            view = self._view()
            if view is not last:
                for t in view.targets:
                    if t.role in self._roles:
                        self.tokenizers.want(t.model, t.engine_type)
                last = view
            if self.shared is not None:
                await self._follow_shared(self.shared)
            await asyncio.sleep(RECONCILE_S)

    @staticmethod
    async def _follow_shared(shared: SharedReader) -> None:
        # Mapping files blocks: in a thread. Once the directory is mapped, seeing whether it
        # changed is a memory read, cheaper than the thread. The swap is on the loop.
        changed = shared.read_directory() if shared.mapped else await asyncio.to_thread(shared.read_directory)
        if changed is not None:
            gen, names = changed
            opened = await asyncio.to_thread(shared.attach, names)
            shared.install(gen, names, opened)


def wanted(cfg: CoordinatorConfig) -> bool:
    return POLICY in (cfg.prefill_policy, cfg.decode_policy)
