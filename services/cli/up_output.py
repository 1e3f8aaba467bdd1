"""What ``motor up`` does with a child's output: every line on to our stderr, whatever the child
writes, and the line that says why a child failed.

A child writes into a pipe of 64 KiB; once we stop reading, its next write blocks it for good.
So the reading never stops before EOF: a line of any length is cut (with a marker) instead of
failing the read, and a line we cannot pass on is dropped, not fatal.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from services.common import log

MAX_LINE = 64 * 1024
CHUNK = 64 * 1024
TRUNCATED = b" [motor up: line cut at %d bytes]"

# Lines of a Python traceback that say nothing alone; its last line ("ValueError: ...") does.
_TRACEBACK_HEADS = (
    "Traceback (most recent call last):",
    "During handling of the above exception",
    "The above exception was the direct cause",
)
_KV_PAIR = re.compile(r'([^\s=]+)=("(?:[^"\\]|\\.)*"|\S*)')
_KV_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)")
_KV_NAMED = {"n": "\n", "r": "\r", "t": "\t"}


class LineSplitter:
    """Bytes in, lines out (each ending in a newline). A line longer than ``max_line`` comes out
    cut to ``max_line`` bytes plus a marker; the rest of it, up to its newline, is dropped."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self._buf = bytearray()
        self._dropping = False  # inside the rest of a line already cut

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        lines: list[bytes] = []
        pos = 0  # consumed so far: the buffer is trimmed once, at the end
        while pos < len(buf):
            end = buf.find(b"\n", pos)
            if self._dropping:
                if end < 0:
                    pos = len(buf)
                    break
                pos, self._dropping = end + 1, False
            elif 0 <= end <= pos + self.max_line:
                lines.append(bytes(buf[pos : end + 1]))
                pos = end + 1
            elif end >= 0 or len(buf) - pos > self.max_line:
                lines.append(bytes(buf[pos : pos + self.max_line]) + TRUNCATED % self.max_line + b"\n")
                pos += self.max_line
                self._dropping = True
            else:
                break  # an unfinished line that may still fit: wait for more
        del buf[:pos]
        return lines

    def flush(self) -> list[bytes]:
        """At EOF: the unfinished last line (a child that died mid-line), newline added."""
        rest = b"" if self._dropping else bytes(self._buf)
        self._buf.clear()
        self._dropping = False
        return [rest + b"\n"] if rest else []


async def pump(name: str, stream: asyncio.StreamReader, on_line: Callable[[bytes], None]) -> None:
    """Read ``stream`` to EOF and hand each line to ``on_line``. A failing ``on_line`` (our
    stderr closed, say) is logged once with its traceback; the reading goes on regardless."""
    splitter = LineSplitter()
    failed = False
    while True:
        chunk = await stream.read(CHUNK)
        for line in splitter.feed(chunk) if chunk else splitter.flush():
            try:
                on_line(line)
            except Exception:
                if not failed:
                    failed = True
                    log.exception("output_failed", component=name, note="later lines may be lost")
        if not chunk:
            return


def error_line(raw: bytes) -> str | None:
    """The line, if it can say why a child failed: a plain line (``motor controller: cannot
    bind ...``, a traceback's last line) or a structured log line at level error, shortened to
    ``<event>: <reason>``. None for everything else (info lines, a traceback's frames)."""
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
    """The fields of one of our own log lines (kv or JSON), or None for any other line."""
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError:
            return None
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
