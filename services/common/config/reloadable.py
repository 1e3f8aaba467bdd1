"""The keys that may change while a service runs (``motor config reload``, SIGHUP), and the
comparison of a new configuration with the running one.

Everything else binds a port, opens a file or a store, sizes a structure or starts a process at
start-up, so it changes only with a restart: a reload that changes any other key is refused
whole, naming every such key, and applies nothing. docs/configuration-reload.md says what each
reloadable key does to work already under way.

Why some keys that look like timings are not here:

- ``controller.heartbeat_interval_s`` is told to each NodeManager when it registers and then
  paces its beats: a NodeManager registered before a reload would keep the old interval until it
  registers again, so a live change would leave the fleet on two intervals.
- ``controller.instance_assemble_timeout_s``, ``coordinator_set_sync_interval_s`` and the others
  set loops and clocks up once, at start.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from motor_mesh.common.config.sections import SCHEMA, SECTION_TYPES, Config, ServerConfig, to_json

# Every section: the log level, which each service sets at once (services/common/log.py).
_EVERY = frozenset({"log_level"})

WHITELIST: dict[str, frozenset[str]] = {
    "controller": _EVERY
    | {
        "instance_heartbeat_timeout_s",
        "start_command_retries",
        "engine_relaunch_complete_timeout_s",
        "engine_relaunch_poll_interval_s",
        "engine_relaunch_dispatch_retries",
        "engine_relaunch_nm_unreachable_threshold",
        "planner",
    },
    # Coordinator-wide: what the Controller pushes to every Coordinator (ApplySettings).
    "coordinator": _EVERY
    | {
        "max_concurrent_requests",
        "max_queued_requests",
        "queue_timeout_s",
        "prefill_timeout_s",
        "decode_first_byte_timeout_s",
        "decode_idle_timeout_s",
        "migration_limit",
        "migration_delay_s",
        "drain_grace_s",
        "prefill_policy",
        "decode_policy",
        "kv_prefix_weight",
        "kv_load_weight",
        "kv_load_gate",
        "kv_affinity_load_gate_topn",
        "pd_min_prompt_tokens",
        "rate_limit",
        "tenants_file",
        "clamp_max_tokens",
        "congestion_raise_s",
    },
    "nodemanager": _EVERY,
    "engine": _EVERY,
}

# The keys of a section as a JSON object: {key: value}.
Values = dict[str, Any]


def reloadable(section: str, key: str) -> bool:
    return key in WHITELIST.get(section, ())


def diff(
    running: Config, new: Config, sections: Iterable[str] = tuple(SECTION_TYPES)
) -> tuple[dict[str, Values], list[str]]:
    """What ``new`` changes of ``running`` in ``sections``: the reloadable keys that change, with
    their new values in their JSON form, by section; and every other key that changes, as
    ``section.key``, sorted. A reload applies the first only when the second is empty."""
    changed: dict[str, Values] = {}
    refused: list[str] = []
    for section in sections:
        values, keys = section_diff(section, running.section(section), new.section(section))
        if values:
            changed[section] = values
        refused += [f"{section}.{key}" for key in keys]
    return changed, sorted(refused)


def section_diff(section: str, old: ServerConfig, new: ServerConfig) -> tuple[Values, list[str]]:
    """:func:`diff` for one section: the reloadable keys that change (new JSON values), and the
    other keys that change."""
    changed: Values = {}
    refused: list[str] = []
    for f in dataclasses.fields(old):
        after = to_json(getattr(new, f.name))
        if to_json(getattr(old, f.name)) == after:
            continue
        if reloadable(section, f.name):
            changed[f.name] = after
        else:
            refused.append(f.name)
    return changed, refused


def values_of(cfg: ServerConfig, section: str) -> Values:
    """Every reloadable key of ``section`` in ``cfg``, in its JSON form, by key."""
    return {key: to_json(getattr(cfg, key)) for key in sorted(WHITELIST[section])}


def checked(section: str, values: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``values`` (reloadable keys of ``section`` as JSON) checked by each key's own check and
    made typed, ready for ``dataclasses.replace``; and the problems as ``(key path, message)``.
    A key that is not reloadable is a problem too."""
    fields = {f.name: f for f in dataclasses.fields(SECTION_TYPES[section])}
    typed: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for key, raw in values.items():
        if not reloadable(section, key):
            what = "unknown key" if key not in fields else "not a reloadable key (it needs a restart)"
            problems.append((str(key), what))
            continue
        stored, found = SCHEMA[section][key][1](raw)
        if found:
            problems += [(f"{key}{sub}", message) for sub, message in found]
            continue
        typed[key] = _typed(fields[key], stored)
    return typed, problems


def _typed(f: dataclasses.Field[Any], raw: Any) -> Any:
    """One checked JSON value as the section holds it (sections.typed, for one field)."""
    convert = f.metadata["typed"]
    if convert is not None:
        return convert(raw)
    if isinstance(raw, list):
        return tuple(raw)
    if isinstance(raw, dict):
        return MappingProxyType(copy.deepcopy(raw))
    return raw


def keys_of(changed: Mapping[str, Values]) -> list[str]:
    """The changed keys as ``section.key``, sorted."""
    return sorted(f"{section}.{key}" for section, values in changed.items() for key in values)
