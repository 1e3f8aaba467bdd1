"""The Coordinator's settings that change without a restart (docs/configuration-reload.md):
what the Controller pushes (ApplySettings) and what SIGHUP re-reads, checked and turned into
the configuration the Coordinator then runs by (``Coordinator.apply_settings`` in app.py).

Which values hold: the Coordinator's own file's until the Controller pushes a settings revision
(a non-empty ``settings_json``: every reloadable key, so every Coordinator runs by the same);
SIGHUP then applies its file's again (revision 0), until the Controller's next push (a reload,
a Coordinator coming or going, a Controller restart) brings back the Controller's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

from motor_mesh.common import errors
from motor_mesh.common.config import ConfigError, CoordinatorConfig, reloadable
from motor_mesh.common.config.checks import display_name
from motor_mesh.coordinator.admission.tenants import Directory
from motor_mesh.coordinator.inference import tenants

TENANTS_FILE_UNUSABLE = "TENANTS_FILE_UNUSABLE"


def pushed(own: CoordinatorConfig, settings_json: str) -> CoordinatorConfig:
    """``own`` (the file's section) with the values the Controller pushed; "" keeps ``own``.
    Raises INVALID_ARGUMENT (BadRequest ``settings_json[.key]``) for anything but a JSON object
    of reloadable coordinator keys with values their checks take."""
    if not settings_json:
        return own
    try:
        values = json.loads(settings_json)
    except (ValueError, RecursionError):
        raise errors.bad_request([("settings_json", "not JSON")]) from None
    if not isinstance(values, dict):
        raise errors.bad_request([("settings_json", "expected a JSON object of coordinator keys")])
    typed, problems = reloadable.checked("coordinator", values)
    if problems:
        raise errors.bad_request([(f"settings_json.{display_name(key)}", why) for key, why in problems])
    return dataclasses.replace(own, **typed)


def changed_keys(old: CoordinatorConfig, new: CoordinatorConfig) -> list[str]:
    """The reloadable keys whose value differs, sorted."""
    return sorted(reloadable.section_diff("coordinator", old, new)[0])


async def check_tenants(cfg: CoordinatorConfig) -> Directory | None:
    """Read ``tenants_file`` and ``api_keys_file`` as admission will, off the event loop:
    FAILED_PRECONDITION when they cannot be used (missing, not JSON, readable by others), so
    that nothing of the settings is applied. Every apply reads them again: an edited file is
    taken."""
    try:
        return await asyncio.to_thread(tenants, cfg)
    except ConfigError as err:
        raise errors.precondition(
            TENANTS_FILE_UNUSABLE, "coordinator.tenants_file", "; ".join(err.errors)
        ) from None
