"""Engine output on its way to the NodeManager's stdout: lines read from each engine's pipe
(:func:`pump`), prefixed, cut when overlong, and queued for a thread that writes them
(:class:`Output`), so neither a chatty engine nor a stdout nobody reads can stall the loop. The
last few lines of each engine are kept too (:class:`Tail`): what GetStatus shows of an engine
that is slow to start, and what the start-up timeout's warning quotes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading
from collections import deque

from motor_mesh.common import log
from motor_mesh.common.lines import MAX_LINE, read_lines

# The longest engine output line passed on whole; a longer one is cut to this, with a note.
LINE_LIMIT = MAX_LINE
# Engine output waiting for our stdout; beyond this, lines are dropped (and counted).
OUTPUT_QUEUE_BYTES = 4 << 20
# The tail kept per engine: its last lines, each cut to this many characters.
TAIL_LINES = 20
TAIL_CHARS = 400
# Bytes of a line kept for the tail: room for TAIL_CHARS characters of UTF-8.
_TAIL_BYTES = TAIL_CHARS * 4


class Tail:
    """The last :data:`TAIL_LINES` non-blank lines of one engine. ``add`` runs for every line on
    the loop, so it only slices and appends raw bytes; decoding, escaping and cutting to
    :data:`TAIL_CHARS` happen when someone reads them (GetStatus, a warning)."""

    def __init__(self, size: int = TAIL_LINES) -> None:
        self._lines: deque[bytes] = deque(maxlen=size)

    def add(self, line: bytes) -> None:
        if not line.isspace():
            self._lines.append(line[:_TAIL_BYTES])

    def lines(self) -> list[str]:
        """Oldest first, each one printable line of at most :data:`TAIL_CHARS` characters."""
        return [_shown(raw) for raw in self._lines]


def _shown(raw: bytes) -> str:
    text = raw.decode(errors="replace").rstrip("\r\n")
    # A progress bar redraws itself with carriage returns: what is on screen is the last part.
    text = text.rsplit("\r", 1)[-1] or text
    text = log.printable(text)
    return text if len(text) <= TAIL_CHARS else text[: TAIL_CHARS - 1] + "…"


class Output:
    """Our stdout, for engine output: a bounded queue that a daemon thread writes out.

    A pipe nobody reads (or a slow terminal) blocks a write; on the event loop that would stall
    everything else, the heartbeats included. Here the loop only queues: when the queue is full
    a line is dropped and counted, and ``event=log_lines_dropped`` says how many, once a second
    at most. The thread writes to the file descriptor, not through ``sys.stdout``: a daemon
    thread stuck in a write while holding the buffer's lock would make the interpreter abort at
    exit."""

    def __init__(self, fd: int = 1, max_bytes: int = OUTPUT_QUEUE_BYTES) -> None:
        self._fd = fd
        self._max = max_bytes
        self._cond = threading.Condition()
        self._lines: deque[bytes] = deque()
        self._bytes = 0  # queued or being written
        self._dropped = 0  # since the last report
        self.dropped_total = 0  # since the start (/metrics)
        self._why = ""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._report_loop: asyncio.AbstractEventLoop | None = None  # where a report is pending

    def put(self, line: bytes) -> bool:
        """Queue one line (on the loop; never blocks). False: dropped."""
        self._loop = asyncio.get_running_loop()
        with self._cond:
            if self._bytes + len(line) > self._max:
                self._dropped += 1
                self.dropped_total += 1
                self._why = "stdout is not keeping up"
                queued = False
            else:
                self._lines.append(line)
                self._bytes += len(line)
                self._cond.notify_all()
                queued = True
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="engine-output", daemon=True)
                self._thread.start()
        if not queued:
            self._schedule_report()
        return queued

    async def drained(self, timeout_s: float) -> bool:
        """Wait (off the loop) until everything queued was written, at most ``timeout_s``."""
        with self._cond:
            if self._bytes == 0:
                return True
        return await asyncio.to_thread(self._wait_empty, timeout_s)

    def _wait_empty(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._bytes == 0, timeout_s)

    def _schedule_report(self) -> None:
        loop = self._loop
        # A report pending on a loop that has since ended (tests run one loop each) never comes.
        if loop is None or self._report_loop is loop:
            return
        self._report_loop = loop
        loop.call_later(1.0, self._log_dropped)

    def _log_dropped(self) -> None:
        self._report_loop = None
        with self._cond:
            count, why, self._dropped = self._dropped, self._why, 0
        if count:
            log.warn("log_lines_dropped", count=count, reason=why)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._lines))
                batch = list(self._lines)
                self._lines.clear()
            size = sum(map(len, batch))
            try:
                self._write(b"".join(batch))
            except OSError as exc:  # stdout closed (EPIPE) or gone: the lines are lost
                with self._cond:
                    self._dropped += len(batch)
                    self.dropped_total += len(batch)
                    self._why = f"stdout write failed: {exc.strerror or exc}"
                if self._loop is not None:
                    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
                        self._loop.call_soon_threadsafe(self._schedule_report)
            except Exception:
                log.exception("engine_output_failed")
            finally:
                with self._cond:
                    self._bytes -= size
                    self._cond.notify_all()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view) :]
            except BlockingIOError:  # someone made our stdout non-blocking: wait until writable
                select.select([], [self._fd], [], 1.0)


STDOUT = Output()


async def pump(stream: asyncio.StreamReader, prefix: bytes, out: Output, tail: Tail | None = None) -> None:
    """Pass ``stream``'s lines to ``out``, each with ``prefix``, until EOF, keeping the last ones
    in ``tail``; a line longer than :data:`LINE_LIMIT` is cut, with a note, and the lines after
    it come through as usual."""

    def on_line(line: bytes) -> None:
        if tail is not None:
            tail.add(line)
        out.put(prefix + line)

    await read_lines(stream, on_line)
