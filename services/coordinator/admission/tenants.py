"""Who may call the inference API, and on what terms: the tenants of ``coordinator.tenants_file``
and the keys of ``coordinator.api_keys_file`` (docs/admission.md, "Tenants").

The tenants file is a JSON list::

    [{"name": "search", "keys": ["sha256:…"], "weight": 2, "priority": "interactive",
      "requests_per_minute": 600, "tokens_per_minute": 200000, "max_concurrent": 64}]

``weight`` (default 1) is the tenant's share when requests queue; ``priority`` (default
``standard``) its class; a limit left out (or null) does not apply. The keys of
``api_keys_file`` are one more tenant, ``default``, with no limits. Errors name the entry and
field and never show a key.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from motor_mesh.common.apikeys import KeyRing
from motor_mesh.common.config import ConfigError, read_private_file

PRIORITIES = ("interactive", "standard", "batch")  # served in this order
STANDARD = PRIORITIES.index("standard")
DEFAULT_TENANT = "default"  # the api_keys_file's keys
OPEN_TENANT = "-"  # every request when neither file is set
MAX_FILE_BYTES = 16 * 1024 * 1024
_FIELDS = ("name", "keys", "weight", "priority", "requests_per_minute", "tokens_per_minute", "max_concurrent")
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    priority: int = STANDARD  # an index into PRIORITIES
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None


OPEN = Tenant(OPEN_TENANT)


class Directory:
    """Tenants by key. ``find`` is the request path's lookup (one SHA-256 and a dict lookup);
    a key only a PBKDF2 entry can match takes ``resolve``, off the loop."""

    def __init__(self, tenants: list[Tenant], keys: Iterable[tuple[str, Tenant]]) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.keys = KeyRing(keys)

    def find(self, given: bytes) -> Tenant | None:
        return self.keys.find(given)

    def needs_slow_check(self, given: bytes) -> bool:
        return self.keys.needs_slow_check(given)

    async def resolve(self, given: bytes) -> Tenant | None:
        return await self.keys.resolve(given)


def _nearest(key: str) -> str:
    match = difflib.get_close_matches(key, _FIELDS, n=1, cutoff=0)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _limit(where: str, name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 50:
        raise ValueError(f"{where}.{name}: expected an integer >= 1 or null, got {type(value).__name__}")
    return value


def parse_tenants(doc: Any) -> list[tuple[Tenant, list[str]]]:
    """The tenants of a decoded tenants file with their stored keys. Raises ValueError naming
    the first bad entry and field."""
    if not isinstance(doc, list):
        raise ValueError("expected a JSON list of tenants")
    out: list[tuple[Tenant, list[str]]] = []
    names: set[str] = set()
    for i, entry in enumerate(doc):
        where = f"[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: expected an object")
        for key in entry:
            if key not in _FIELDS:
                raise ValueError(f"{where}: unknown field {str(key)[:40]!r}{_nearest(str(key))}")
        name = entry.get("name")
        if not isinstance(name, str) or not name or len(name) > 128 or not name.isprintable():
            raise ValueError(f"{where}.name: expected a printable name of 1 to 128 characters")
        if name in names or name in (DEFAULT_TENANT, OPEN_TENANT):
            raise ValueError(f"{where}.name: {name!r} is already taken")
        names.add(name)
        keys = entry.get("keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"{where}.keys: expected a non-empty list of non-empty strings")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1e6:
            raise ValueError(f"{where}.weight: expected a number above 0 and at most 1000000")
        priority = entry.get("priority", "standard")
        if priority not in PRIORITIES:
            raise ValueError(f"{where}.priority: expected one of {', '.join(PRIORITIES)}")
        limits = {k: _limit(where, k, entry.get(k)) for k in _LIMITS}
        tenant = Tenant(name, float(weight), PRIORITIES.index(priority), **limits)
        out.append((tenant, keys))
    return out


def load_directory(tenants_file: str, api_keys_file: str) -> Directory | None:
    """The tenants and keys of both files; None when neither is set (the API is open).

    Raises ConfigError (one line per problem, naming the key and file, never a key)."""
    if not tenants_file and not api_keys_file:
        return None
    tenants: list[Tenant] = []
    keys: list[tuple[str, Tenant]] = []
    if tenants_file:
        try:
            data = read_private_file(tenants_file, "tenants file", MAX_FILE_BYTES)
            for tenant, stored in parse_tenants(json.loads(data)):
                tenants.append(tenant)
                keys.extend((k, tenant) for k in stored)
        except ConfigError as err:
            raise ConfigError([f"coordinator.tenants_file: {e}" for e in err.errors]) from None
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            msg = f"coordinator.tenants_file: cannot use {tenants_file}: {_no_key(exc)}"
            raise ConfigError(msg) from None
    if api_keys_file:
        default = Tenant(DEFAULT_TENANT)
        tenants.append(default)
        try:
            text = read_private_file(api_keys_file, "API keys file", MAX_FILE_BYTES).decode("utf-8")
        except ConfigError as err:
            raise ConfigError([f"coordinator.api_keys_file: {e}" for e in err.errors]) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"coordinator.api_keys_file: cannot use {api_keys_file}: {exc}") from None
        lines = [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]
        if not lines:
            raise ConfigError(
                f"coordinator.api_keys_file: cannot use {api_keys_file}: no API key in the file"
            )
        keys.extend((k, default) for k in lines)
    try:
        return Directory(tenants, keys)
    except ValueError as exc:  # the same key twice for two tenants, a malformed hash
        raise ConfigError(f"coordinator.tenants_file: {exc}") from None


def _no_key(exc: BaseException) -> str:
    """A decoding error's message: json's quotes no document text, so no key leaks."""
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    return str(exc)


def share(limit: int | None, fraction: float) -> float:
    """This process's part of a limit (``inf`` for none)."""
    return math.inf if limit is None else limit * fraction
