"""What ``motor up`` does with a child's output: every line on to our stderr, whatever the child
writes (services/common/lines.py: never a stopped read), and the line that says why a child
failed. A line we cannot pass on is dropped, not fatal.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from motor_mesh.common import log
from motor_mesh.common.lines import read_lines

# Lines of a Python traceback that say nothing alone; its last line ("ValueError: ...") does.
_TRACEBACK_HEADS = (
    "Traceback (most recent call last):",
    "During handling of the above exception",
    "The above exception was the direct cause",
)
_KV_PAIR = re.compile(r'([^\s=]+)=("(?:[^"\\]|\\.)*"|\S*)')
_KV_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)")
_KV_NAMED = {"n": "\n", "r": "\r", "t": "\t"}
# Levels of a zap JSON line (etcd's log) that end the process or report a failure.
_ZAP_ERRORS = frozenset({"error", "dpanic", "panic", "fatal"})


async def pump(name: str, stream: asyncio.StreamReader, on_line: Callable[[bytes], None]) -> None:
    """Read ``stream`` to EOF and hand each line to ``on_line``. A failing ``on_line`` (our
    stderr closed, say) is logged once with its traceback; the reading goes on regardless."""
    failed = False

    def passed_on(line: bytes) -> None:
        nonlocal failed
        try:
            on_line(line)
        except Exception:
            if not failed:
                failed = True
                log.exception("output_failed", component=name, note="later lines may be lost")

    await read_lines(stream, passed_on)


def error_line(raw: bytes) -> str | None:
    """The line, if it can say why a child failed: a plain line (``motor controller: cannot
    bind ...``, a traceback's last line) or a structured log line at level error, shortened to
    ``<event>: <reason>`` (etcd's: ``<msg>: <error>``). None for everything else (info lines, a
    traceback's frames)."""
    text = raw.decode(errors="replace").rstrip("\r\n")
    if not text.strip() or text[0].isspace() or text.startswith(_TRACEBACK_HEADS):
        return None
    fields = _structured(text)
    if fields is None:
        return log.printable(text)
    if fields.get("level") != "error":
        return None
    event = str(fields.get("event", "error"))
    why = next((fields[k] for k in ("reason", "error", "detail", "msg") if fields.get(k)), None)
    return log.printable(f"{event}: {why}" if why is not None else event)


def _structured(text: str) -> dict[str, Any] | None:
    """The fields of one of our own log lines (kv or JSON) or of etcd's (zap JSON, read as ours),
    or None for any other line."""
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError:
            return None
        if isinstance(fields, dict) and "event" not in fields and "msg" in fields and "level" in fields:
            level = "error" if fields["level"] in _ZAP_ERRORS else fields["level"]
            return {"level": level, "event": fields["msg"], "reason": fields.get("error")}
        return fields if isinstance(fields, dict) and "event" in fields else None
    if not text.startswith("ts="):
        return None
    return {k: _kv_value(v) for k, v in _KV_PAIR.findall(text)}


def _kv_value(value: str) -> str:
    if not (len(value) >= 2 and value.startswith('"') and value.endswith('"')):
        return value

    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        if len(code) > 1:
            return chr(int(code[1:], 16))
        return _KV_NAMED.get(code, code)

    return _KV_ESCAPE.sub(one, value[1:-1])
