"""Where server-sent events end in a byte stream: an event ends with a blank line (\\n\\n, or
\\r\\n\\r\\n), and only whole events may reach the client, so that a continuation's events join
an answer at an event boundary."""

from __future__ import annotations


def complete_end(buf: bytes) -> int:
    """How many bytes of ``buf`` are complete events (0: not even one yet)."""
    at = buf.rfind(b"\n\n")
    if b"\r" in buf:
        crlf = buf.rfind(b"\r\n\r\n")
        if crlf >= 0 and crlf + 4 > at + 2:
            return crlf + 4
    return at + 2 if at >= 0 else 0


def events_of(buf: bytes) -> tuple[list[bytes], bytes]:
    """The complete events of ``buf`` (each with its blank line) and what is left of it."""
    if b"\r" not in buf:  # the engines' own form: a split at C speed
        parts = buf.split(b"\n\n")
        rest = parts.pop()
        return [p + b"\n\n" for p in parts], rest
    events = []
    while (end := cut(buf)) >= 0:
        events.append(buf[:end])
        buf = buf[end:]
    return events, buf


def cut(buf: bytes) -> int:
    """Where the first complete event of ``buf`` ends (after its blank line); -1 when none."""
    at = buf.find(b"\n\n")
    crlf = buf.find(b"\r\n\r\n")
    if crlf >= 0 and (at < 0 or crlf < at):
        return crlf + 4
    return at + 2 if at >= 0 else -1
