"""The configuration schema: every key of every section, its default and its check.

contracts.md ("Configuration") lists the keys and defaults; behaviour.md gives the ranges that
matter to behaviour. Other bounds are sanity limits that catch typos and unit mistakes.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

SECTIONS = ("controller", "coordinator", "nodemanager", "engine")

# A check returns the value to store (possibly normalised) and its problems as (sub-path, message),
# the sub-path being "" or e.g. "[1]" / ".tp" inside a list or object.
Problem = tuple[str, str]
Check = Callable[[Any], tuple[Any, list[Problem]]]


def kind(value: Any) -> str:
    if value is None:
        return "null"
    for types, name in (
        (bool, "boolean"),
        (int, "integer"),
        (float, "number"),
        (str, "string"),
        (list, "array"),
        (dict, "object"),
    ):
        if isinstance(value, types):
            return name
    return type(value).__name__  # only reachable through ``overrides`` passed by code


def short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(value: Any) -> str:
    scalar = isinstance(value, (bool, int, float, str))
    return f"{kind(value)} {short(value)}" if scalar else kind(value)


def display_name(key: Any) -> str:
    # Keys come from the file or the environment: quote anything that could break the one-line
    # error format or flood the terminal.
    text = str(key)
    return text if re.fullmatch(r"[\w.-]{1,60}", text, re.ASCII) else short(text)


def nearest(key: Any, candidates: Iterable[str]) -> str:
    # cutoff=0: always name the closest key, however far off, as the contract asks.
    return difflib.get_close_matches(str(key)[:200], list(candidates), n=1, cutoff=0)[0]


def unknown_key(key: Any, candidates: Iterable[str]) -> str:
    return f"unknown key; did you mean '{nearest(key, candidates)}'?"


def _expected(what: str, value: Any) -> tuple[Any, list[Problem]]:
    return value, [("", f"expected {what}, got {describe(value)}")]


def _integer(lo: int, hi: int) -> Check:
    def check(value: Any) -> tuple[Any, list[Problem]]:
        if isinstance(value, bool) or not isinstance(value, int):
            return _expected("integer", value)
        if not lo <= value <= hi:
            return value, [("", f"must be between {lo} and {hi}, got {short(value)}")]
        return value, []

    return check


def _seconds(lo: float, hi: float, *, above: bool = False) -> Check:
    """A duration in seconds, int or float; ``above``: strictly greater than ``lo``."""

    def check(value: Any) -> tuple[Any, list[Problem]]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _expected("number of seconds", value)
        # Written so that NaN fails too.
        if not ((value > lo if above else value >= lo) and value <= hi):
            low = f"greater than {lo}" if above else f"at least {lo}"
            return value, [("", f"must be {low} and at most {hi}, got {short(value)}")]
        return value, []

    return check


def _text(pattern: str = r"(?s:.*)", what: str = "") -> Check:
    def check(value: Any) -> tuple[Any, list[Problem]]:
        if not isinstance(value, str):
            return _expected("string", value)
        if not re.fullmatch(pattern, value):
            return value, [("", f"expected {what}, got {short(value)}")]
        return value, []

    return check


def _choice(*options: str) -> Check:
    allowed = ", ".join(f"'{o}'" for o in options)

    def check(value: Any) -> tuple[Any, list[Problem]]:
        if not isinstance(value, str):
            return _expected("string", value)
        if value not in options:
            return value, [("", f"must be one of {allowed}, got {short(value)}")]
        return value, []

    return check


def _boolean(value: Any) -> tuple[Any, list[Problem]]:
    return (value, []) if isinstance(value, bool) else _expected("boolean", value)


_HOSTPORT_RE = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+):(\d{1,5})")


def _hostport(value: Any) -> tuple[Any, list[Problem]]:
    if not isinstance(value, str):
        return _expected("string", value)
    match = _HOSTPORT_RE.fullmatch(value)
    # Port 0 is fine for a listener but never for an address to connect to.
    if not match or not 1 <= int(match.group(1)) <= 65535:
        return value, [("", f"expected host:port with a port from 1 to 65535, got {short(value)}")]
    return value, []


def _list(item: Check, *, nonempty: bool = False) -> Check:
    def check(value: Any) -> tuple[Any, list[Problem]]:
        if not isinstance(value, list):
            return _expected("array", value)
        if nonempty and not value:
            return value, [("", "must not be empty")]
        for i, element in enumerate(value):
            problems = item(element)[1]
            if problems:  # the first bad element is enough: one line per key
                sub, message = problems[0]
                return value, [(f"[{i}]{sub}", message)]
        if len(set(value)) != len(value):
            return value, [("", f"must not contain duplicates, got {short(value)}")]
        return value, []

    return check


_PARALLEL_KEYS = ("dp", "tp", "pp", "ep", "nnodes")
_COUNT = _integer(1, 1_000_000)


def _parallel(value: Any) -> tuple[Any, list[Problem]]:
    if not isinstance(value, dict):
        return _expected("object", value)
    problems: list[Problem] = []
    for key, size in value.items():
        if key not in _PARALLEL_KEYS:
            problems.append((f".{display_name(key)}", unknown_key(key, _PARALLEL_KEYS)))
        else:
            problems += [(f".{key}", message) for _, message in _COUNT(size)[1]]
    return {k: value.get(k, 1) for k in _PARALLEL_KEYS}, problems


def _json_object(value: Any) -> tuple[Any, list[Problem]]:
    # engine.args: any JSON values; the NodeManager decides how each becomes a flag.
    return (value, []) if isinstance(value, dict) else _expected("object", value)


def _environment(value: Any) -> tuple[Any, list[Problem]]:
    if not isinstance(value, dict):
        return _expected("object", value)
    for name, setting in value.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            return value, [("", f"invalid environment variable name {short(name)}")]
        # The value is never shown: engine environments carry tokens (HF_TOKEN and the like).
        if not isinstance(setting, str) or "\0" in setting:
            return value, [(f".{display_name(name)}", f"expected string without NUL, got {kind(setting)}")]
    return value, []


_PORT = _integer(0, 65535)  # 0: let the OS pick (tests bind port 0)
# Upper bounds catch unit mistakes (milliseconds typed as seconds) and keep every wait finite.
_WEEK = 7 * 24 * 3600
_DURATION = _seconds(0, _WEEK, above=True)
_FILE = _text(r"[^\0]*", "a path without NUL")  # "" = not set; NUL would make open() raise
_NONEMPTY = _text(r"(?s:.+)", "a non-empty string")
_DIR = _text(r"[^\0]+", "a non-empty path without NUL")
_POLICY = _choice("round_robin", "least_load", "power_of_two")

_COMMON: dict[str, tuple[Any, Check]] = {
    "host": ("127.0.0.1", _text(r"\S+", "a host name or address")),
    "management_key_file": ("", _FILE),
    "tls_cert_file": ("", _FILE),
    "tls_key_file": ("", _FILE),
    "tls_ca_file": ("", _FILE),
    # gRPC takes the limit as a C int.
    "max_message_bytes": (4194304, _integer(1024, 2**31 - 1)),
    "log_format": ("kv", _choice("kv", "json")),
}

SCHEMA: dict[str, dict[str, tuple[Any, Check]]] = {
    "controller": {
        "port": (7100, _PORT),
        "coordinators": (["127.0.0.1:7200"], _list(_hostport)),
        "state_dir": (".motor/controller", _DIR),
        "heartbeat_interval_s": (3, _DURATION),
        "instance_heartbeat_timeout_s": (10, _DURATION),
        "instance_assemble_timeout_s": (600, _DURATION),
        "start_command_retries": (3, _integer(0, 100)),
        "coordinator_set_sync_interval_s": (300, _DURATION),
        "enable_engine_relaunch": (True, _boolean),
        # The EngineRelaunchStrategy ranges come from behaviour.md.
        "engine_relaunch_complete_timeout_s": (600, _seconds(60, 3600)),
        "engine_relaunch_poll_interval_s": (5, _seconds(1, 60)),
        "engine_relaunch_dispatch_retries": (3, _integer(0, 10)),
        "engine_relaunch_nm_unreachable_threshold": (3, _integer(1, 10)),
        "precision_auto_recovery_enabled": (False, _boolean),
        "alarm_webhook_url": ("", _text(r"(?:https?://\S+)?", 'an http:// or https:// URL or ""')),
        "coordinator_key_file": ("", _FILE),
        "nodemanager_key_file": ("", _FILE),
        **_COMMON,
    },
    "coordinator": {
        "port": (7200, _PORT),
        "http_port": (8000, _PORT),
        "workers": (1, _integer(1, 256)),
        "prefill_policy": ("least_load", _POLICY),
        "decode_policy": ("least_load", _POLICY),
        "api_keys_file": ("", _FILE),
        "controller": ("127.0.0.1:7100", _hostport),
        "controller_key_file": ("", _FILE),
        "precision_check_enabled": (False, _boolean),
        "precision_interval_s": (30, _DURATION),
        "precision_logprobs": (5, _integer(1, 20)),  # engines cap top_logprobs at 20
        "precision_issue_threshold": (10, _COUNT),
        "precision_clear_threshold": (10, _COUNT),
        "precision_probe_question": ("What is the capital of France? Answer with one word.", _NONEMPTY),
        "precision_probe_expected": ("Paris", _NONEMPTY),
        "probe_max_attempts": (3, _COUNT),
        "probe_timeout_s": (600, _DURATION),
        **_COMMON,
    },
    "nodemanager": {
        "port": (7300, _PORT),
        "controller": ("127.0.0.1:7100", _hostport),
        "controller_key_file": ("", _FILE),
        "job_name": ("", _text()),  # "" = do not register
        "role": ("prefill", _choice("prefill", "decode", "union")),
        "model": ("motor-sim", _NONEMPTY),
        "served_model_name": ("", _text()),  # "" = model
        "engine_type": ("sim", _choice("vllm", "sglang", "sim")),
        "sim_protocol": ("vllm", _choice("vllm", "sglang")),
        # Engine k also uses port + 1 (bootstrap / DP RPC), hence 65534; 0 cannot be probed.
        "ports": ([10000], _list(_integer(1, 65534), nonempty=True)),
        "device_count": (0, _integer(0, 4096)),
        "device_env": ("ASCEND_RT_VISIBLE_DEVICES", _text(r"[A-Za-z_][A-Za-z0-9_]*", "a variable name")),
        "node_rank": (0, _integer(0, 1_000_000)),
        "parallel": ({k: 1 for k in _PARALLEL_KEYS}, _parallel),
        "state_dir": (".motor/nm", _DIR),
        "status_poll_interval_s": (1, _DURATION),
        "status_probe_timeout_s": (2, _DURATION),
        "max_probe_failures": (2, _COUNT),
        "engine_startup_timeout_s": (1800, _DURATION),
        "engine_hang_timeout_s": (30, _DURATION),
        "engine_stop_grace_s": (10, _seconds(0, _WEEK)),  # 0: kill at once
        "suicide_check_interval_s": (3, _DURATION),
        "suicide_threshold": (5, _COUNT),
        "engine_restart_wait_timeout_s": (180, _DURATION),
        "engine_restart_freeze_s": (720, _DURATION),
        **_COMMON,
    },
    "engine": {
        "args": ({}, _json_object),
        "kv_connector": ("NixlConnector", _NONEMPTY),
        "env": ({}, _environment),
        **_COMMON,
    },
}

DEFAULTS: dict[str, dict[str, Any]] = {
    section: {key: default for key, (default, _) in keys.items()} for section, keys in SCHEMA.items()
}
