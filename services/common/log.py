"""Structured logging: one line per event, key=value (default) or JSON.

Every line carries ``event=<name>``; values are quoted only when they need to be, so
``grep event=listening`` and ``cut``-style tooling keep working.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from typing import Any

_SERVICE = "motor"
_FORMAT = "kv"
_SECRET_HINTS = ("key", "token", "secret", "password", "authorization")


def _quote(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), default=str)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text


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
            return json.dumps(fields, separators=(",", ":"), default=str)
        return " ".join(f"{k}={_quote(v)}" for k, v in fields.items())


def setup(service: str, log_format: str = "kv", level: int = logging.INFO) -> None:
    """Configure the root logger for one process (idempotent)."""
    global _SERVICE, _FORMAT
    _SERVICE, _FORMAT = service, ("json" if log_format == "json" else "kv")
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root.addHandler(handler)
    root.setLevel(level)
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
