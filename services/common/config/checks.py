"""Value checks for configuration keys, and the one-line wording of what was wrong.

A check takes a value as it came from JSON (file, environment or a CLI flag) and returns the
value to store (possibly normalised) with its problems as ``(sub-path, message)``; the sub-path
is "" or e.g. "[1]" / ".tp" inside a list or object. Each check also says in words what it
accepts (``spec``), which is what docs/configuration.md lists as a key's type and range.
"""

from __future__ import annotations

import collections
import difflib
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

Problem = tuple[str, str]
Result = tuple[Any, list[Problem]]


class Check:
    """A named check: ``check(value) -> (stored value, problems)``; ``spec`` describes it."""

    __slots__ = ("_fn", "spec")

    def __init__(self, spec: str, fn: Callable[[Any], Result]) -> None:
        self.spec = spec
        self._fn = fn

    def __call__(self, value: Any) -> Result:
        return self._fn(value)


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
    # cutoff=0: always name the closest key, however far off.
    return difflib.get_close_matches(str(key)[:200], list(candidates), n=1, cutoff=0)[0]


def unknown_key(key: Any, candidates: Iterable[str]) -> str:
    return f"unknown key; did you mean '{nearest(key, candidates)}'?"


def _expected(what: str, value: Any) -> Result:
    return value, [("", f"expected {what}, got {describe(value)}")]


def integer(lo: int, hi: int) -> Check:
    def check(value: Any) -> Result:
        if isinstance(value, bool) or not isinstance(value, int):
            return _expected("integer", value)
        if not lo <= value <= hi:
            return value, [("", f"must be between {lo} and {hi}, got {short(value)}")]
        return value, []

    return Check(f"integer, {lo} to {hi}", check)


def seconds(lo: float, hi: float, *, above: bool = False) -> Check:
    """A duration in seconds, int or float; ``above``: strictly greater than ``lo``."""

    def check(value: Any) -> Result:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _expected("number of seconds", value)
        # Written so that NaN fails too.
        if not ((value > lo if above else value >= lo) and value <= hi):
            low = f"greater than {lo}" if above else f"at least {lo}"
            return value, [("", f"must be {low} and at most {hi}, got {short(value)}")]
        return value, []

    low = f"> {lo}" if above else f">= {lo}"
    return Check(f"seconds (number), {low} and <= {hi}", check)


_NUL = "must not contain a NUL character"


def text(pattern: str = r"(?s:.*)", what: str = "", spec: str = "") -> Check:
    """A string matching ``pattern``; ``what`` names it in the error, ``spec`` in the docs.

    No string key takes a NUL: every one ends up in an argv, an environment, a path, an address
    or a log line, where a NUL is refused (``ValueError: embedded null byte``) or cuts it."""

    def check(value: Any) -> Result:
        if not isinstance(value, str):
            return _expected("string", value)
        if not re.fullmatch(pattern, value):
            return value, [("", f"expected {what}, got {short(value)}")]
        if "\0" in value:
            return value, [("", _NUL)]
        return value, []

    return Check(f"string: {spec or what}" if spec or what else "string", check)


def choice(*options: str) -> Check:
    allowed = ", ".join(f"'{o}'" for o in options)

    def check(value: Any) -> Result:
        if not isinstance(value, str):
            return _expected("string", value)
        if value not in options:
            return value, [("", f"must be one of {allowed}, got {short(value)}")]
        return value, []

    return Check(f"one of {allowed}", check)


def _boolean(value: Any) -> Result:
    return (value, []) if isinstance(value, bool) else _expected("boolean", value)


BOOLEAN = Check("boolean", _boolean)

_HOSTPORT_RE = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+):(\d{1,5})")


def _hostport(value: Any) -> Result:
    if not isinstance(value, str):
        return _expected("string", value)
    if "\0" in value:
        return value, [("", _NUL)]
    match = _HOSTPORT_RE.fullmatch(value)
    # Port 0 is fine for a listener but never for an address to connect to.
    if not match or not 1 <= int(match.group(1)) <= 65535:
        return value, [("", f"expected host:port with a port from 1 to 65535, got {short(value)}")]
    return value, []


HOSTPORT = Check('"host:port" (port 1 to 65535)', _hostport)


def _coordinator(value: Any) -> Result:
    if isinstance(value, str) and value.startswith("dns:///"):
        return value, _hostport(value[len("dns:///") :])[1]
    return _hostport(value)


# A Coordinator, or every address a name resolves to (a headless Service): "dns:///name:port".
COORDINATOR = Check('"host:port" or "dns:///name:port" (port 1 to 65535)', _coordinator)


def _controllers(value: Any) -> Result:
    if isinstance(value, str) and value.startswith("dns:///"):
        return value, _hostport(value[len("dns:///") :])[1]
    if not isinstance(value, str):
        return _expected("string", value)
    parts = value.split(",")
    for i, part in enumerate(parts):
        problems = _hostport(part.strip())[1]
        if problems:
            where = f"address {i + 1}: " if len(parts) > 1 else ""
            return value, [("", where + problems[0][1])]
    if len({p.strip() for p in parts}) != len(parts):
        return value, [("", f"must not repeat an address, got {short(value)}")]
    return value, []


# The Controllers a client follows to the leader: one "host:port", several separated by commas,
# or "dns:///name:port" for every address a name resolves to.
CONTROLLERS = Check('"host:port[,host:port…]" or "dns:///name:port" (port 1 to 65535)', _controllers)


def array(item: Check, *, nonempty: bool = False) -> Check:
    def check(value: Any) -> Result:
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

    return Check(f"{'non-empty ' if nonempty else ''}array of distinct {item.spec}", check)


def _paths_by_name(value: Any) -> Result:
    if not isinstance(value, dict):
        return _expected("object", value)
    for name, path in value.items():
        if not isinstance(name, str) or not name:
            return value, [("", f"expected a non-empty name, got {short(name)}")]
        if not isinstance(path, str) or not path or "\0" in path:
            return value, [(f".{display_name(name)}", f"expected a path without NUL, got {short(path)}")]
    return value, []


PATHS_BY_NAME = Check("object of name to path", _paths_by_name)
WEIGHT = Check(
    "number >= 0 and <= 1000000",
    lambda v: (
        (v, [])
        if not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v <= 1e6
        else (v, [("", f"expected a number from 0 to 1000000, got {short(v)}")])
    ),
)

LOAD_GATE = Check(
    "number, 0 (off) or >= 1 and <= 1000",
    lambda v: (
        (v, [])
        if not isinstance(v, bool) and isinstance(v, (int, float)) and (v == 0 or 1 <= v <= 1000)
        else (v, [("", f"expected 0 (off) or a number from 1 to 1000, got {short(v)}")])
    ),
)
PARALLEL_KEYS = ("dp", "tp", "pp", "ep", "nnodes")
RATE_LIMIT_KEYS = ("max_requests", "window_s", "max_tokens_per_window", "skip_paths")
COUNT = integer(1, 1_000_000)


def _parallel(value: Any) -> Result:
    if not isinstance(value, dict):
        return _expected("object", value)
    problems: list[Problem] = []
    for key, size in value.items():
        if key not in PARALLEL_KEYS:
            problems.append((f".{display_name(key)}", unknown_key(key, PARALLEL_KEYS)))
        else:
            problems += [(f".{key}", message) for _, message in COUNT(size)[1]]
    sizes = {k: value.get(k, 1) for k in PARALLEL_KEYS}
    if not problems and sizes["nnodes"] > 1 and sizes["tp"] * sizes["pp"] % sizes["nnodes"]:
        problems.append((".nnodes", split_problem(sizes["tp"], sizes["pp"], sizes["nnodes"])))
    return sizes, problems


def split_problem(tp: int, pp: int, nnodes: int) -> str:
    # A rank spanning nodes puts an equal share of its tp * pp workers on each; vLLM and SGLang
    # both refuse to start otherwise.
    return f"must divide tp * pp ({tp} * {pp}): each node runs an equal share of a rank's workers"


PARALLEL = Check(
    "object with dp, tp, pp, ep, nnodes (each an integer >= 1; missing ones are 1; nnodes divides tp * pp)",
    _parallel,
)


def _rate_limit(value: Any) -> Result:
    if not isinstance(value, dict):
        return _expected("object", value)
    problems: list[Problem] = []
    checks = {
        "max_requests": integer(0, 1_000_000_000),
        "window_s": seconds(0, WEEK, above=True),
        "max_tokens_per_window": integer(0, 1 << 50),
        "skip_paths": array(URL_PATH),
    }
    for key, item in value.items():
        if key not in checks:
            problems.append((f".{display_name(key)}", unknown_key(key, RATE_LIMIT_KEYS)))
        else:
            problems += [(f".{key}{sub}", message) for sub, message in checks[key](item)[1]]
    return value, problems


PLANNER_KEYS = (
    "mode",
    "interval_s",
    "ttft_p90_ms",
    "itl_p90_ms",
    "min_prefill",
    "min_decode",
    "cooldown_s",
    "min_gain",
    "max_switches",
    "max_instances",
)


def _fraction(value: Any) -> Result:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return value, [("", f"expected a number from 0 to 1, got {short(value)}")]
    return value, []


def _planner(value: Any) -> Result:
    if not isinstance(value, dict):
        return _expected("object", value)
    problems: list[Problem] = []
    checks = {
        "mode": choice("off", "recommend", "act"),
        "interval_s": seconds(0.5, 86400),
        "ttft_p90_ms": seconds(0, 3_600_000, above=True),
        "itl_p90_ms": seconds(0, 3_600_000, above=True),
        "min_prefill": integer(1, 1024),
        "min_decode": integer(1, 1024),
        "cooldown_s": seconds(0, WEEK),
        "min_gain": Check("number, 0 to 1", _fraction),
        "max_switches": integer(1, 64),
        "max_instances": integer(0, 4096),
    }
    for key, item in value.items():
        if key not in checks:
            problems.append((f".{display_name(key)}", unknown_key(key, PLANNER_KEYS)))
        else:
            problems += [(f".{key}{sub}", message) for sub, message in checks[key](item)[1]]
    return value, problems


def _json_object(value: Any) -> Result:
    # engine.args: any JSON values; the NodeManager decides how each becomes a flag. Each key
    # becomes a flag name and every string an argument: neither may be empty / hold a NUL.
    if not isinstance(value, dict):
        return _expected("object", value)
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            return value, [("", f"flag names must not be empty, got {short(key)}")]
        if "\0" in key:
            return value, [("", f"flag name {short(key)} {_NUL}")]
        if _holds_nul(item):
            return value, [(f".{display_name(key)}", _NUL)]
    return value, []


def _holds_nul(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if "\0" in v:
                return True
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return False


JSON_OBJECT = Check("object (any JSON values)", _json_object)


def _environment(value: Any) -> Result:
    if not isinstance(value, dict):
        return _expected("object", value)
    for name, setting in value.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            return value, [("", f"invalid environment variable name {short(name)}")]
        # The value is never shown: engine environments carry tokens (HF_TOKEN and the like).
        if not isinstance(setting, str) or "\0" in setting:
            return value, [(f".{display_name(name)}", f"expected string without NUL, got {kind(setting)}")]
    return value, []


ENVIRONMENT = Check("object of variable name to string", _environment)

URL_PATH = text(r"/[^\s?#]*", "a URL path starting with /", "a URL path")
PORT = integer(0, 65535)  # 0: let the OS pick (tests bind port 0)
# Upper bounds catch unit mistakes (milliseconds typed as seconds) and keep every wait finite.
WEEK = 7 * 24 * 3600
DURATION = seconds(0, WEEK, above=True)
RATE_LIMIT = Check(
    "object with max_requests (integer >= 0, 0 = no limit), window_s (seconds > 0),"
    " max_tokens_per_window (integer >= 0, 0 = no limit), skip_paths (array of URL paths);"
    " missing ones keep their defaults",
    _rate_limit,
)
PLANNER = Check(
    "object with mode ('off', 'recommend', 'act'), interval_s (seconds, 0.5 to 86400),"
    " ttft_p90_ms and itl_p90_ms (milliseconds > 0), min_prefill and min_decode (1 to 1024),"
    " cooldown_s (seconds >= 0), min_gain (0 to 1), max_switches (1 to 64), max_instances"
    " (0 = the pool is fixed, up to 4096); missing ones keep their defaults",
    _planner,
)
LOG_LEVEL = choice("debug", "info", "warning", "error")
FILE = text(r"[^\0]*", "a path without NUL", 'a file path, "" = not set')  # NUL: open() would raise
NONEMPTY = text(r"(?s:.+)", "a non-empty string", "not empty")
DIRECTORY = text(r"[^\0]+", "a non-empty path without NUL", "a directory path")
POLICY = choice("round_robin", "least_load", "power_of_two", "kv_aware")
STORE = choice("sqlite", "etcd")
HOST = text(r"\S+", "a host name or address")
URL = text(r"(?:https?://\S+)?", 'an http:// or https:// URL or ""')
VARIABLE = text(r"[A-Za-z_][A-Za-z0-9_]*", "a variable name", "an environment variable name")
# nodemanager.device_env: "cpu" is the CPU platform, not a variable (no engine reads one so named).
DEVICE_ENV = text(
    r"[A-Za-z_][A-Za-z0-9_]*", "a variable name", "`auto`, `cpu`, or an environment variable name"
)
# Core numbers far beyond any machine (Linux builds for at most 8192): a typo, not a core.
MAX_CORE = 65535
_CPUSET_PART = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?")


def parse_cpuset(text: str) -> list[int]:
    """The cores of a cpuset list (``0-3,6``), in the order written; ValueError says what is
    wrong. "" is no core."""
    cores: list[int] = []
    for part in text.split(",") if text.strip() else []:
        match = _CPUSET_PART.fullmatch(part.strip())
        if not match:
            raise ValueError(f'expected a cpuset such as "0-3,6", got {short(text)}')
        lo = int(match.group(1))
        hi = int(match.group(2) or lo)
        if hi < lo or hi > MAX_CORE:
            raise ValueError(f"core range {short(part.strip())} must run upwards from 0 to {MAX_CORE}")
        cores += range(lo, hi + 1)
    return cores


def _cpu_cores(value: Any) -> Result:
    # A string is a cpuset ("0-3,6", also what MOTOR_NODEMANAGER_CPU_CORES=0-3 gives), a lone
    # integer one core (MOTOR_NODEMANAGER_CPU_CORES=3 parses as JSON 3). Stored as the list.
    if isinstance(value, str):
        try:
            cores = parse_cpuset(value)
        except ValueError as exc:
            return value, [("", str(exc))]
    elif isinstance(value, int) and not isinstance(value, bool):
        cores = [value]
    elif isinstance(value, list):
        cores = value
    else:
        return _expected('an array of core numbers or a cpuset string such as "0-3,6"', value)
    for i, core in enumerate(cores):
        problems = integer(0, MAX_CORE)(core)[1]
        if problems:
            return value, [(f"[{i}]" if isinstance(value, list) else "", problems[0][1])]
    # Counted once: a cpuset such as "0-65535" is 65,536 cores, and list.count per core is quadratic.
    repeated = sorted(c for c, n in collections.Counter(cores).items() if n > 1)
    if repeated:
        return value, [("", f"must name each core once, got {', '.join(map(str, repeated[:5]))} again")]
    return list(cores), []


CPU_CORES = Check(
    f'array of distinct core numbers (0 to {MAX_CORE}) or a cpuset string such as "0-3,6"',
    _cpu_cores,
)
# engine.kv_transfer_config: fields Motor sets per engine and nobody may override.
KV_TRANSFER_OWN = {
    "kv_role": "set by Motor from the node's role (kv_producer for prefill, kv_consumer for decode)",
    "engine_id": "set by Motor to the instance id (the same on every engine of an instance)",
}


def _kv_transfer_config(value: Any) -> Result:
    # Passed to vLLM as JSON inside one argv element: keys and strings must not hold a NUL.
    if not isinstance(value, dict):
        return _expected("object", value)
    for key, item in value.items():
        if key in KV_TRANSFER_OWN:
            return value, [(f".{key}", f"{KV_TRANSFER_OWN[key]}; remove it")]
        if not isinstance(key, str) or not key or "\0" in key:
            return value, [("", f"field names must be non-empty and without NUL, got {short(key)}")]
        if _holds_nul(item):
            return value, [(f".{display_name(key)}", _NUL)]
    connector = value.get("kv_connector")
    if "kv_connector" in value and (not isinstance(connector, str) or not connector):
        return value, [(".kv_connector", f"expected a non-empty string, got {describe(connector)}")]
    return value, []


KV_TRANSFER_CONFIG = Check(
    "object (any JSON values but kv_role and engine_id)",
    _kv_transfer_config,
)


def parse_port_range(text: str) -> tuple[int, int] | None:
    """``LOW-HIGH`` as (LOW, HIGH); None for ""; ValueError says what is wrong."""
    if not text:
        return None
    match = re.fullmatch(r"(\d{1,5})-(\d{1,5})", text)
    if not match:
        raise ValueError(f'expected "LOW-HIGH" such as "18000-18063" or "", got {short(text)}')
    lo, hi = int(match.group(1)), int(match.group(2))
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"ports must run upwards from 1 to 65535, got {short(text)}")
    return lo, hi


def _port_range(value: Any) -> Result:
    if not isinstance(value, str):
        return _expected('string "LOW-HIGH" or ""', value)
    try:
        parse_port_range(value)
    except ValueError as exc:
        return value, [("", str(exc))]
    return value, []


PORT_RANGE = Check('"LOW-HIGH" (1 to 65535) or ""', _port_range)
