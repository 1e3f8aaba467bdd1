"""Structured logging: one line per event, key=value (default) or JSON.

Every line carries ``event=<name>``; values are quoted only when they need to be, so
``grep event=listening`` and ``cut``-style tooling keep working.

A line is always one line of printable text, whatever the values hold: a job name or a client's
string carrying ``\\r``, ``\\n`` or an ANSI escape must not forge a second line or repaint the
operator's terminal. Control characters (C0, DEL, C1), Unicode line separators and bidi overrides
are escaped (``\\x1b``, ``\\n``, ``\\u2028``), in keys as in values; JSON mode gets the same
from ``json.dumps``, which escapes everything outside printable ASCII.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import traceback
from typing import Any

_SERVICE = "motor"
_FORMAT = "kv"
_SECRET_HINTS = ("key", "token", "secret", "password", "authorization")


# Characters no log line may carry raw: C0, DEL, C1, line/paragraph separators, bidi controls.
_CONTROL = "\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROLS = re.compile(f"[{_CONTROL}]")
_ESCAPED = re.compile(f'[{_CONTROL}\\\\"]')
# What makes a value need quotes (or a key need escapes): the above, and whatever ends a pair.
_UNSAFE = re.compile(f'[{_CONTROL}\\s"=\\\\]')
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _code(c: str) -> str:
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def _in_quotes(m: re.Match[str]) -> str:
    c = m.group()
    return '\\"' if c == '"' else _NAMED.get(c) or _code(c)


def _named_or_code(m: re.Match[str]) -> str:
    return _NAMED.get(m.group()) or _code(m.group())


def printable(text: str) -> str:
    """``text`` with its control characters escaped (``\\x1b``, ``\\n``): one line, safe to
    show on a terminal. For text that is not a log value (a message printed as is)."""
    return _CONTROLS.sub(_named_or_code, text)


def _quote(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), default=str)
    if text == "" or _UNSAFE.search(text):
        return '"' + _ESCAPED.sub(_in_quotes, text) + '"'
    return text


def _key(key: Any) -> str:
    # Keys stay unquoted (``grep name=`` keeps working): a space, ``=`` or quote in one becomes
    # its hex code, like a control character.
    return _UNSAFE.sub(_named_or_code, str(key))


def _redact(fields: dict[str, Any]) -> dict[str, Any]:
    # A key *file path* is fine to log; key material never is.
    return {
        k: ("<redacted>" if any(h in k.lower() for h in _SECRET_HINTS) and not k.endswith("_file") else v)
        for k, v in fields.items()
    }


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": _SERVICE,
        }
        event = getattr(record, "event", None)
        if event is None:
            fields["event"] = "log"
            fields["msg"] = record.getMessage()
        else:
            fields["event"] = event
            fields.update(_redact(getattr(record, "fields", {})))
        if record.exc_info and record.levelno >= logging.ERROR:
            exc = record.exc_info[1]
            fields["error"] = f"{type(exc).__name__}: {exc}"
            # One line still: the kv and JSON encoders escape the newlines.
            fields["traceback"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        if _FORMAT == "json":
            # ensure_ascii (the default) is what keeps control characters out: keep it.
            return json.dumps(fields, separators=(",", ":"), default=str, ensure_ascii=True)
        return " ".join(f"{_key(k)}={_quote(v)}" for k, v in fields.items())


LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def set_level(name: str) -> None:
    """Change the least severe level logged (config ``log_level``), at once, while running."""
    logging.getLogger().setLevel(LEVELS[name])


def setup(service: str, log_format: str = "kv", level: int | str = logging.INFO) -> None:
    """Configure the root logger for one process (idempotent)."""
    global _SERVICE, _FORMAT
    _SERVICE, _FORMAT = service, ("json" if log_format == "json" else "kv")
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root.addHandler(handler)
    root.setLevel(LEVELS[level] if isinstance(level, str) else level)
    for noisy in ("aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def emit(level: int, name: str, fields: dict[str, Any]) -> None:
    logging.getLogger("motor").log(level, name, extra={"event": name, "fields": fields})


def event(name: str, **fields: Any) -> None:
    """Log one structured event: ``event("listening", grpc="127.0.0.1:7100")``."""
    emit(logging.INFO, name, fields)


def warn(name: str, **fields: Any) -> None:
    emit(logging.WARNING, name, fields)


def error(name: str, **fields: Any) -> None:
    emit(logging.ERROR, name, fields)


def exception(name: str, **fields: Any) -> None:
    """An error with the exception being handled, its traceback included (call from ``except``)."""
    logging.getLogger("motor").error(name, exc_info=True, extra={"event": name, "fields": fields})
