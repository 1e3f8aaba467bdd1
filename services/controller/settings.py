"""The settings that change while the Controller runs (ReloadConfig, ``motor config reload``;
docs/configuration-reload.md): the configuration it runs by, the stored record of the last
reload that changed something, and what every Coordinator is pushed.

A reload is worked out first: the file is read as the Controller read its own ``--config`` (its
flags and ``MOTOR_*`` variables on top, common/config/source.py) and compared with the running
configuration; a change to a key outside the reloadable ones (common/config/reloadable.py)
refuses it whole. Then it is stored, under a new revision, and only then applied: the
Controller's own keys at once (``on_controller``), the Coordinator-wide ones pushed to every
Coordinator (``on_push``: the pusher sends them, level-triggered, push/pusher.py). A failed write
leaves the running configuration, the revision and the Coordinators as they were.

At start the stored settings are applied over the file's values, in one line
(``settings_restored``): a restarted Controller, or a standby that becomes leader, goes on with
what the last reload set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import grpc
from google.rpc import error_details_pb2

from motor_mesh.common import errors, log
from motor_mesh.common.config import (
    Config,
    ConfigError,
    ControllerConfig,
    CoordinatorConfig,
    EngineConfig,
    NodeManagerConfig,
    load,
    reloadable,
)
from motor_mesh.common.config.sections import to_json
from motor_mesh.common.config.source import Source
from motor_mesh.controller.store.interface import StateStore, StoredSettings

# The sections whose reloadable values are stored and restored: the Controller's own, and the
# Coordinators' (pushed). A nodemanager.log_level change is taken (each NodeManager applies it
# when it re-reads its own file) but is not the Controller's to keep.
STORED = ("coordinator", "controller")
NOT_RELOADABLE = "NOT_RELOADABLE"


def not_reloadable(keys: list[str]) -> errors.MotorError:
    """FAILED_PRECONDITION naming every key that changes only with a restart."""
    detail = error_details_pb2.PreconditionFailure(
        violations=[
            error_details_pb2.PreconditionFailure.Violation(
                type=NOT_RELOADABLE, subject=key, description="changes only with a restart"
            )
            for key in keys
        ]
    )
    message = f"nothing was applied: these keys change only with a restart: {', '.join(keys)}"
    return errors.MotorError(grpc.StatusCode.FAILED_PRECONDITION, message, [detail])


def starting_config(cfg: ControllerConfig, source: Source | None) -> Config:
    """What the Controller compares a reload with at first: what its own file set for every
    section (and ``cfg`` for its own), or, built in-process without one, the defaults."""
    if source is not None:
        return dataclasses.replace(source.start, controller=cfg)
    return Config(
        controller=cfg,
        coordinator=CoordinatorConfig(),
        nodemanager=NodeManagerConfig(),
        engine=EngineConfig(),
    )


class Settings:
    def __init__(
        self,
        store: StateStore,
        start: Config,
        source: Source | None = None,
    ) -> None:
        self._store = store
        self._source = source
        self.running = start
        self.revision = 0  # 0: no reload has changed anything (the file's values)
        # Set by the Controller once its parts exist: its own keys applied, the Coordinators told.
        self.on_controller: Callable[[ControllerConfig], None] = lambda cfg: None
        self.on_push: Callable[[], None] = lambda: None
        # One reload at a time: each is compared with what the one before it left.
        self._lock = asyncio.Lock()
        stored = store.load_settings()
        if stored is not None:
            self._restore(stored)

    def _restore(self, stored: StoredSettings) -> None:
        running = self.running
        over: list[str] = []
        for section, values in (("coordinator", stored.coordinator), ("controller", stored.controller)):
            typed, problems = reloadable.checked(section, values)
            for key, why in problems:  # a key this version no longer reloads, say
                log.warn("settings_restore_skipped", setting=f"{section}.{key}", reason=why)
            cfg = running.section(section)
            over += [f"{section}.{k}" for k, v in typed.items() if to_json(getattr(cfg, k)) != to_json(v)]
            replaced: dict[str, Any] = {section: dataclasses.replace(cfg, **typed)}
            running = dataclasses.replace(running, **replaced)
        self.running, self.revision = running, stored.revision
        log.event("settings_restored", revision=stored.revision, over_file=",".join(sorted(over)) or "none")

    def pushed(self) -> tuple[int, str]:
        """What every Coordinator is to apply: the revision and the reloadable coordinator keys as
        a JSON object, or "" (keep your own file's values) before any reload changed something."""
        if self.revision == 0:
            return 0, ""
        values = reloadable.values_of(self.running.coordinator, "coordinator")
        return self.revision, json.dumps(values, separators=(",", ":"), sort_keys=True)

    def _read(self, text: str) -> Config:
        if self._source is not None:
            return self._source.load(text)
        return load("config", section="controller", env={}, text=text)

    async def reload(self, text: str) -> tuple[int, list[str]]:
        """Apply the file ``text``: the revision now in force and the keys it changed. Raises
        INVALID_ARGUMENT for a bad file, FAILED_PRECONDITION (nothing applied) for a change that
        needs a restart, StateWriteError (nothing changed) when the store refused it."""
        try:
            new = await asyncio.to_thread(self._read, text)
        except ConfigError as err:
            raise errors.bad_request(
                [("config_text", line) for line in err.errors], f"invalid configuration: {err.errors[0]}"
            ) from None
        async with self._lock:
            return await self._take(new, reloadable.diff(self.running, new), "rpc")

    async def reload_own(self, new: Config) -> None:
        """SIGHUP (common/sighup.py): the controller section of the Controller's own file, read
        again; the other sections stay as they are. Stored and applied like a reload."""
        async with self._lock:
            running = dataclasses.replace(self.running, controller=new.controller)
            await self._take(running, reloadable.diff(self.running, running, ("controller",)), "sighup")

    async def _take(
        self, new: Config, found: tuple[dict[str, reloadable.Values], list[str]], via: str
    ) -> tuple[int, list[str]]:
        changed, refused = found
        if refused:
            log.warn("config_reload_refused", via=via, refused=",".join(refused))
            raise not_reloadable(refused)
        keys = reloadable.keys_of(changed)
        if not keys and via == "rpc" and new.coordinator.tenants_file:
            # The file named is the same, but what it holds may not be: every reload has the
            # Coordinators read it again (a new revision is what makes them).
            changed = {"coordinator": {}}
            keys = ["coordinator.tenants_file"]
        if not keys:
            log.event("config_reload_unchanged", via=via, revision=self.revision)
            return self.revision, []
        before = revision = self.revision
        if any(section in changed for section in STORED):
            revision += 1
            record = StoredSettings(
                revision,
                reloadable.values_of(new.coordinator, "coordinator"),
                reloadable.values_of(new.controller, "controller"),
            )
            await self._store.save_settings(record)  # first: a failed write changes nothing
        self.running, self.revision = new, revision
        if via == "rpc":  # SIGHUP's line is common/sighup.py's
            log.event("config_reloaded", via=via, revision=revision, changed=",".join(keys))
        if "controller" in changed:
            self.on_controller(new.controller)
        if revision != before:
            self.on_push()  # every Coordinator shows the revision in force, and takes its values
        return revision, keys
