"""SIGHUP: a service re-reads its own ``--config`` file and applies the keys of its own section
that may change while it runs (docs/configuration-reload.md).

The file is read as at start (this process's flags and ``MOTOR_*`` variables on top:
config/source.py), off the event loop, by a supervised task: the signal handler only wakes it,
and a SIGHUP that arrives during a reload is taken once that one is done. A change to any key of
the section outside the reloadable ones (config/reloadable.py) refuses the whole file in one
line, ``event=config_reload_refused keys=...``, and applies nothing; so does a file that does
not load (``event=config_reload_failed``). Otherwise the service's hook (:func:`on_reload`: the
Coordinator's settings, the leading Controller's) applies it, or, without one, the log level
changes; then ``event=config_reloaded keys=...`` names the keys that changed in the file.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

from motor_mesh.common import errors, log, tasks
from motor_mesh.common.config import Config, ConfigError, reloadable
from motor_mesh.common.config.source import Source

T = TypeVar("T")
# Applies a re-read configuration beyond the log level; raises MotorError or ConfigError to refuse
# it, having changed nothing.
Hook = Callable[[Config], Awaitable[None]]

_hook: Hook | None = None


def on_reload(hook: Hook | None) -> None:
    """Who applies a re-read file from now on (the service, once its parts run); None: the log
    level alone."""
    global _hook
    _hook = hook


class Reloader:
    def __init__(self, source: Source) -> None:
        self._source = source
        # The configuration the last reload that went through read (at first, the start's): what
        # the next file is compared with.
        self.running = source.start
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def install(self) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._wanted.set)
        self._task = tasks.spawn("config-reload", self._follow)

    async def close(self) -> None:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await tasks.cancel_quietly(self._task)

    async def _follow(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            await self.reload()

    async def reload(self) -> None:
        """Read the file again and apply it, or say in one line why not."""
        section, shown = self._source.section, self._source.path or "(no --config)"
        try:
            new = await asyncio.to_thread(self._source.load)
        except ConfigError as err:
            log.warn("config_reload_failed", file=shown, reason="; ".join(err.errors))
            return
        changed, refused = reloadable.diff(self.running, new, (section,))
        if refused:
            log.warn("config_reload_refused", file=shown, refused=",".join(refused))
            return
        try:
            if _hook is not None:
                await _hook(new)
            elif new.section(section).log_level != self.running.section(section).log_level:
                log.set_level(new.section(section).log_level)
        except (errors.MotorError, ConfigError) as err:
            why = err.message if isinstance(err, errors.MotorError) else "; ".join(err.errors)
            log.warn("config_reload_failed", file=shown, reason=why)
            return
        self.running = new
        keys = ",".join(reloadable.keys_of(changed)) or "none"
        log.event("config_reloaded", via="sighup", file=shown, changed=keys)


async def serving(source: Source, main: Awaitable[T]) -> T:
    """``main`` (a service's serve coroutine) with SIGHUP re-reading ``source``'s file."""
    reloader = Reloader(source)
    reloader.install()
    try:
        return await main
    finally:
        await reloader.close()
