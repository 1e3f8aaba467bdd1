"""Configuration: one JSON file, ``MOTOR_<SECTION>_<KEY>`` environment variables, CLI flags.

Precedence, key by key: CLI flag (``overrides``) > environment > file > default. Every problem
found in any layer is collected and raised together as one ``ConfigError``; each error is one line
that says where it came from::

    cfg.json: controller.portt: unknown key; did you mean 'port'?
    cfg.json:3:14: invalid JSON: Expecting ',' delimiter
    env MOTOR_CONTROLLER_PORT: must be between 0 and 65535, got 70000
    command line: coordinator.workers: must be between 1 and 256, got 0

What consumers should know:

- Every section comes back with every key filled. ``nodemanager.parallel`` always holds all of
  dp, tp, pp, ep, nnodes (the ones not given are 1).
- ``nodemanager.served_model_name`` "" means "the same as ``model``"; it stays "" here.
- ``*_s`` durations may be int or float.
- A higher layer replaces an object value (``parallel``, ``engine.args``, ``engine.env``) whole;
  objects are not merged key by key.
- ``overrides`` values that are ``None`` mean "flag not given" and are skipped, so argparse
  results can be passed straight through.
- For a text key an environment value is used verbatim unless it is a JSON string literal, so
  ``MOTOR_NODEMANAGER_JOB_NAME=2024`` is the name "2024", not an integer error.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from typing import Any

from motor_mesh.common.config.checks import describe, display_name, kind, nearest, short, unknown_key
from motor_mesh.common.config.errors import ConfigError
from motor_mesh.common.config.keyfile import read_key_file
from motor_mesh.common.config.sections import SCHEMA, SECTION_TYPES, SECTIONS, Config, typed

__all__ = ["DEFAULTS", "SECTIONS", "ConfigError", "load", "load_config", "read_key_file"]

DEFAULTS: dict[str, dict[str, Any]] = {
    section: {key: default for key, (default, _) in keys.items()} for section, keys in SCHEMA.items()
}


def load_config(
    path: str | None = None,
    *,
    section: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    text: str | None = None,
) -> dict[str, dict[str, Any]]:
    """All four sections with every key filled; raises ConfigError listing every problem.

    ``section`` is the caller's own section: what a flat file holds. ``env`` defaults to
    ``os.environ``; pass ``{}`` to ignore the environment. ``text``: the file's contents, already
    read (a file sent over the wire: ``motor config reload``); ``path`` then only names it in
    the errors.
    """
    if section is not None and section not in SECTIONS:
        raise ConfigError(f"unknown section {short(section)}; did you mean '{nearest(section, SECTIONS)}'?")
    config = copy.deepcopy(DEFAULTS)
    errors: list[str] = []
    # Where each value came from, and the keys given a refused value: for the checks of values
    # that are each fine alone but not together.
    origin: dict[tuple[str, str], str] = {}
    refused: set[tuple[str, str]] = set()

    def put(where: str, sec: str, key: str, value: Any) -> None:
        stored, problems = SCHEMA[sec][key][1](value)
        errors.extend(f"{where}{sub}: {message}" for sub, message in problems)
        if problems:
            refused.add((sec, key))
        else:
            config[sec][key] = copy.deepcopy(stored)
            origin[sec, key] = where

    if path is not None or text is not None:
        name = path if path is not None else "config"
        shown = shown_path(name)
        for sec, values in _read_file(name, section, errors, text).items():
            for key, value in values.items():
                if key in SCHEMA[sec]:
                    put(f"{shown}: {sec}.{key}", sec, key, value)
                else:
                    errors.append(f"{shown}: {sec}.{display_name(key)}: {unknown_key(key, SCHEMA[sec])}")

    for var, raw in sorted((os.environ if env is None else env).items()):
        owner = next((s for s in SECTIONS if var.startswith(f"MOTOR_{s.upper()}_")), None)
        if owner is None:
            continue  # not ours: MOTOR_FOO, PATH, ...
        prefix = f"MOTOR_{owner.upper()}_"
        key = var[len(prefix) :].lower()
        if key in SCHEMA[owner] and var == prefix + key.upper():
            put(f"env {var}", owner, key, _parse_env(raw, isinstance(DEFAULTS[owner][key], str)))
        else:
            suggestion = prefix + nearest(key, SCHEMA[owner]).upper()
            shown = prefix + display_name(var[len(prefix) :])
            errors.append(f"env {shown}: unknown key; did you mean '{suggestion}'?")

    for name, flags in (overrides or {}).items():
        if name not in SECTIONS:
            errors.append(f"command line: unknown section {short(name)}")
            continue
        for key, value in flags.items():
            if value is None:
                continue  # flag not given
            if key in SCHEMA[name]:
                put(f"command line: {name}.{key}", name, key, value)
            else:
                errors.append(f"command line: {name}.{display_name(key)}: {unknown_key(key, SCHEMA[name])}")

    errors.extend(_together(config, origin, refused))
    if errors:
        raise ConfigError(errors)
    return config


def _together(
    config: dict[str, dict[str, Any]], origin: Mapping[tuple[str, str], str], refused: set[tuple[str, str]]
) -> list[str]:
    """Problems of values that are each valid but not together. A refused value is reported
    already, not again as missing."""
    return _etcd_together(config, origin, refused) + _hang_before_suicide(config, origin, refused)


def _etcd_together(
    config: dict[str, dict[str, Any]], origin: Mapping[tuple[str, str], str], refused: set[tuple[str, str]]
) -> list[str]:
    c = config["controller"]
    if c["store"] != "etcd":
        return []
    problems = []
    where = origin.get(("controller", "store"), "controller.store")
    if not c["etcd_endpoints"] and ("controller", "etcd_endpoints") not in refused:
        problems.append(f'{where}: "etcd" needs controller.etcd_endpoints (at least one "host:port")')
    # Standbys name the leader by this address: a wildcard would send every client nowhere.
    if c["host"] in WILDCARDS and not c["advertise_address"]:
        problems.append(
            f'{where}: "etcd" with controller.host {c["host"]!r} needs controller.advertise_address '
            "(the address clients reach this Controller at)"
        )
    return problems


_HANG_KEYS = ("engine_hang_timeout_s", "suicide_check_interval_s", "suicide_threshold")


def _hang_before_suicide(
    config: dict[str, dict[str, Any]], origin: Mapping[tuple[str, str], str], refused: set[tuple[str, str]]
) -> list[str]:
    """A hung engine must be killed (and so relaunched in place) before the pod-restart
    fallback ends the whole node. The fallback counts consecutive checks from the first one
    that sees the engine ABNORMAL, which may come right after it turned so: it can act
    ``suicide_check_interval_s * (suicide_threshold - 1)`` after that, not sooner."""
    if any(("nodemanager", key) in refused for key in _HANG_KEYS):
        return []
    n = config["nodemanager"]
    hang, every, threshold = (n[key] for key in _HANG_KEYS)
    window = every * (threshold - 1)
    if hang < window:
        return []
    # Said where the operator set one of them; the hang timeout first, as the usual fix.
    key = next((k for k in _HANG_KEYS if ("nodemanager", k) in origin), _HANG_KEYS[0])
    where = origin.get(("nodemanager", key), f"nodemanager.{key}")
    return [
        f"{where}: engine_hang_timeout_s {hang:g} is not shorter than suicide_check_interval_s "
        f"{every:g} * (suicide_threshold {threshold} - 1) = {window:g} s: the pod-restart fallback "
        "could end the node before a hung engine is killed and relaunched in place; lower "
        "engine_hang_timeout_s or raise suicide_check_interval_s or suicide_threshold"
    ]


WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def load(
    path: str | None = None,
    *,
    section: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    text: str | None = None,
) -> Config:
    """Like :func:`load_config`, as typed sections (what the services read)."""
    return from_dicts(load_config(path, section=section, env=env, overrides=overrides, text=text))


def from_dicts(sections: Mapping[str, Mapping[str, Any]]) -> Config:
    """Typed sections from checked values with every key filled (what load_config returns)."""
    return Config(**{name: typed(cls, sections[name]) for name, cls in SECTION_TYPES.items()})


def _parse_env(raw: str, text_key: bool) -> Any:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    return raw if text_key and not isinstance(value, str) else value


def shown_path(path: str) -> str:
    """``path`` as error lines show it: as is, or quoted when it holds characters (a newline, a
    NUL) that would break the one-line format."""
    return path if path.isprintable() else short(path)


def _read_file(
    path: str, section: str | None, errors: list[str], text: str | None = None
) -> dict[str, dict[str, Any]]:
    """The file's values by section (``text``: its contents, already read); problems go to
    ``errors``."""
    where = shown_path(path)
    try:
        if text is None:
            with open(path, encoding="utf-8-sig") as f:
                text = f.read()
        else:
            text = text.removeprefix("\ufeff")  # as utf-8-sig reads a file
    except OSError as exc:
        errors.append(f"{where}: cannot read: {exc.strerror or type(exc).__name__}")
        return {}
    except ValueError as exc:  # UnicodeDecodeError, or a path holding a NUL
        if not isinstance(exc, UnicodeDecodeError):
            errors.append(f"{where}: cannot read: not a valid path")
            return {}
        errors.append(f"{where}: not UTF-8 text")
        return {}

    duplicates: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in items:
            if key in obj:  # json keeps the last silently; an operator meant one of them
                duplicates.append(key)
            obj[key] = value
        return obj

    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        errors.append(f"{where}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}")
        return {}
    except RecursionError:
        errors.append(f"{where}: invalid JSON: nested too deeply")
        return {}
    except ValueError as exc:  # e.g. an integer literal over Python's 4300-digit limit
        errors.append(f"{where}: invalid JSON: {exc}")
        return {}
    errors.extend(f"{where}: duplicate key {short(key)}" for key in duplicates)
    if not isinstance(data, dict):
        errors.append(f"{where}: expected a JSON object at the top level, got {kind(data)}")
        return {}

    sectioned = all(key in SECTIONS for key in data)
    # The one ambiguous shape: a flat coordinator/nodemanager file holding only its "controller"
    # address. A section name mapped to a non-object cannot be a section, so read it as flat.
    if sectioned and section is not None and all(key in SCHEMA[section] for key in data):
        sectioned = all(isinstance(value, dict) for value in data.values())
    if not sectioned:
        if section is None:
            errors.append(f"{where}: flat config needs --section")
            return {}
        return {section: data}
    result: dict[str, dict[str, Any]] = {}
    for sec, values in data.items():
        if isinstance(values, dict):
            result[sec] = values
        else:
            errors.append(f"{where}: {sec}: expected object, got {describe(values)}")
    return result
