"""Fault injection state.

A fault is *armed* by a start flag or `POST /sim/fault` and becomes *active* once N further
completion requests have been served AND S seconds have passed since arming (0 = at once).
Request number N+1 is the first one that sees the fault. Only completion requests are counted,
so health probes and metric scrapes never move a fault forward.

`hang` is a wedged scheduler: once active, completion requests (`/v1/completions`,
`/v1/chat/completions`, and `/health_generate`, which generates in SGLang) never answer, and a
stream already flowing stops between two tokens; requests caught by it stay stuck until the
process dies. Every other route keeps answering as the engine's API server would: `/health`
200, `/v1/models`, `/metrics`, `/sim/fault`. Only a real request tells, which is what the
NodeManager's inference probe (`nodemanager.engine_probe_inference`) sends; it then kills the
engine `engine_hang_timeout_s` later. The SGLang bootstrap port keeps answering, but a hung
prefill engine registers no more rooms, so its decode peers time out as they would for real. A
whole process that stops answering (a SIGSTOP, a machine that froze) is no mode here: stop
the engine's process group itself (`kill -STOP -<pgid>`).

`die_after_tokens` (`after_tokens` N, flag `--fault-after-tokens`) is an engine that dies in the
middle of its work: once active, it counts the output tokens it sends, across all requests, and
after the Nth it SIGKILLs itself, a real crash: a stream in flight stops between two tokens and
its connection drops, no `[DONE]`, no error event; the workers follow their leader. A
non-streamed answer that would take it past N is never sent (it died generating it); one that
ends exactly at N goes out first. While it is armed every answer is sent token by token, so the
count is exact even with no `--tpot-ms`. It is what a router's continue-on-another-engine path
is tested against (docs/sim-engine.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

MODES = ("none", "crash", "hang", "unhealthy", "error", "disconnect", "precision", "die_after_tokens")
DIE = "die_after_tokens"
# What send_tokens tells its caller to do with the tokens it is about to send.
SEND, SEND_THEN_DIE, DIE_NOW = 0, 1, 2


class FaultError(ValueError):
    """A /sim/fault body that does not describe a fault."""


class FaultState:
    def __init__(
        self,
        on_crash: Callable[[], None],
        default_status: int = 500,
        on_die: Callable[[], None] | None = None,
    ) -> None:
        self._on_crash = on_crash
        # die_after_tokens: kills the process (an engine in a test process gets a stand-in).
        self.on_die = on_die or on_crash
        self.default_status = default_status
        self.mode = "none"
        self.after_requests = 0
        self.after_s = 0.0
        self.after_tokens = 0
        self.tokens = 0  # output tokens sent while die_after_tokens was active
        self.status = default_status
        self.requests = 0
        self._armed_at = time.monotonic()
        self._active = False
        self._timer: asyncio.TimerHandle | None = None

    def arm(
        self,
        mode: str,
        after_requests: int = 0,
        after_s: float = 0.0,
        status: int | None = None,
        after_tokens: int = 0,
    ) -> None:
        if mode not in MODES:
            raise FaultError(f"unknown fault mode {mode!r}; one of {', '.join(MODES)}")
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.mode = mode
        self.after_requests = after_requests
        self.after_s = after_s
        self.status = self.default_status if status is None else status
        self.after_tokens = after_tokens
        self.tokens = 0
        self.requests = 0
        self._armed_at = time.monotonic()
        self._active = False
        # A crash must fire on time even when no request arrives to notice it.
        if mode == "crash":
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(after_s, self._crash_if_due)

    def _crash_if_due(self) -> None:
        self._timer = None
        if self.mode == "crash" and self.is_active():
            self._on_crash()

    def is_active(self) -> bool:
        if self._active:
            return True
        if self.mode == "none" or self.requests < self.after_requests:
            return False
        if self.after_s and time.monotonic() - self._armed_at < self.after_s:
            return False
        self._active = True
        return True

    def on_completion(self) -> str | None:
        """Count one completion request; returns the fault mode it must suffer, if any."""
        if self.mode == "none":
            return None
        active = self.is_active()
        self.requests += 1
        if not active:
            return None
        if self.mode == "crash":
            self._on_crash()
        return self.mode

    def hanging(self) -> bool:
        return self.mode == "hang" and self.is_active()

    def send_tokens(self, n: int) -> int:
        """Under an active die_after_tokens, count ``n`` output tokens about to be sent: SEND,
        SEND_THEN_DIE (they make exactly N) or DIE_NOW (they would go past N: the engine dies
        before they leave). SEND for any other fault."""
        if self.mode != DIE or not self.is_active():
            return SEND
        left = self.after_tokens - self.tokens
        if n > left:
            self.tokens = self.after_tokens
            return DIE_NOW
        self.tokens += n
        return SEND_THEN_DIE if n == left else SEND

    def snapshot(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "armed": self.mode != "none",
            "active": self.is_active(),
            "after_requests": self.after_requests,
            "after_s": self.after_s,
            "after_tokens": self.after_tokens,
            "tokens": self.tokens,
            "status": self.status,
            "requests": self.requests,
            "armed_for_s": round(time.monotonic() - self._armed_at, 3),
        }


def parse_fault_body(body: Any) -> tuple[str, int, float, int | None, int]:
    """Validate a `POST /sim/fault` body: {"mode", "after_requests"?, "after_s"?, "status"?,
    "after_tokens"?}."""
    if not isinstance(body, dict):
        raise FaultError("body must be a JSON object")
    unknown = set(body) - {"mode", "after_requests", "after_s", "status", "after_tokens"}
    if unknown:
        raise FaultError(f"unknown field(s): {', '.join(sorted(unknown))}")
    mode = body.get("mode")
    if not isinstance(mode, str) or mode not in MODES:
        raise FaultError(f"mode must be one of {', '.join(MODES)}")
    after_requests = body.get("after_requests") or 0
    if isinstance(after_requests, bool) or not isinstance(after_requests, int) or after_requests < 0:
        raise FaultError("after_requests must be an integer >= 0")
    after_s = body.get("after_s") or 0
    if isinstance(after_s, bool) or not isinstance(after_s, int | float) or not 0 <= after_s < 1e9:
        raise FaultError("after_s must be a number >= 0")
    status = body.get("status")
    if status is not None and (
        isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599
    ):
        raise FaultError("status must be an HTTP status code (100-599)")
    after_tokens = body.get("after_tokens") or 0
    if isinstance(after_tokens, bool) or not isinstance(after_tokens, int) or after_tokens < 0:
        raise FaultError("after_tokens must be an integer >= 0")
    return mode, after_requests, float(after_s), status, after_tokens
