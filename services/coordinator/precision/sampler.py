"""Precision detection's moving parts (docs/architecture.md, "Precision detection"): shadow
samples off the client's path, the checker's verdicts, the probe question, and the alarms.

The inference path calls :meth:`PrecisionMonitor.record` for every successful client answer. It
is synchronous and cheap (a dict lookup and a clock read): when the group is due, a background
task sends a *shadow* request to the same pair; the client's answer has already been produced and
is never touched. Everything that can go wrong in sampling fails open: an error is counted
(``result="error"``) and is no sample at all.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from motor_mesh.common import log
from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.coordinator.metrics import Metrics
from motor_mesh.coordinator.precision import checker, reporter
from motor_mesh.coordinator.precision.groups import (
    Action,
    Completed,
    GroupState,
    PrecisionGroups,
    ProbeOutcome,
)

# A sample needs only enough tokens to see a distribution and a few words; the probe enough for
# a short answer. Both are cheap next to the prompt's prefill, which is the real cost of a sample.
SAMPLE_MAX_TOKENS = 16
PROBE_MAX_TOKENS = 32
# A 16-token answer that takes longer than this is not worth waiting for: the slot is needed.
SAMPLE_TIMEOUT_S = 60.0
# Shadow requests in flight over every group (one per group at most). A sample that finds them
# all busy is dropped, never queued: detection must not pile work onto a loaded cluster.
MAX_IN_FLIGHT = 4
ANSWER_EXCERPT_CHARS = 80


class GroupGone(LookupError):
    """The pair left the routing view before the shadow request could be sent."""


class Exchange(Protocol):
    """Send one non-streamed request to the pair (p, d) as the router would (p = 0: d serves it
    whole); returns the engine's (status, body). Raises GroupGone, or anything for a failure."""

    def __call__(
        self, p: int, d: int, path: str, body: dict[str, Any], timeout_s: float
    ) -> Awaitable[tuple[int, bytes]]: ...


class AlarmSink(Protocol):
    def submit(self, alarm: Any) -> None: ...


def _is_chat(path: str) -> bool:
    return path.endswith("/chat/completions")


def _first_prompt(prompt: Any) -> Any:
    """One prompt of a completions request (a batch is sampled by its first prompt)."""
    if isinstance(prompt, str):
        return prompt or None
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], str | list):
            return prompt[0] or None
        return prompt  # token ids
    return None


def shadow_body(ctx: Completed, top_logprobs: int) -> dict[str, Any] | None:
    """The shadow request of a client request: its prompt, a few tokens, not streamed, with
    log-probabilities. Nothing else of the client's request is kept (tools, response formats
    and n would change the answer's shape, not its precision). None: no prompt to sample."""
    body: dict[str, Any] = {"model": ctx.model, "stream": False, "max_tokens": SAMPLE_MAX_TOKENS}
    if _is_chat(ctx.path):
        messages = ctx.request.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        body.update(messages=messages, logprobs=True, top_logprobs=top_logprobs)
    else:
        prompt = _first_prompt(ctx.request.get("prompt"))
        if prompt is None:
            return None
        body.update(prompt=prompt, logprobs=top_logprobs)
    return body


def probe_body(ctx: Completed, question: str) -> dict[str, Any]:
    """The probe question, in the shape of the endpoint the group was sampled on (a base model
    may serve completions only). Temperature 0: the one answer the model is surest of."""
    body: dict[str, Any] = {
        "model": ctx.model,
        "stream": False,
        "max_tokens": PROBE_MAX_TOKENS,
        "temperature": 0,
    }
    if _is_chat(ctx.path):
        body["messages"] = [{"role": "user", "content": question}]
    else:
        body["prompt"] = question
    return body


def _excerpt(text: str) -> str:
    # Alarm fields are protobuf strings: lone surrogates (JSON allows them) cannot be encoded.
    short = text[:ANSWER_EXCERPT_CHARS]
    return short.encode("utf-8", "backslashreplace").decode("utf-8")


class PrecisionMonitor:
    """The per-group state and the tasks that feed it: samples, probes, alarms. ``exchange``
    sends a request to a pair; ``alarms`` takes the ALARM and CLEAR messages to deliver."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        exchange: Exchange,
        alarms: AlarmSink,
        metrics: Metrics,
        service_ip: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.groups = PrecisionGroups(
            cfg.precision_interval_s, cfg.precision_issue_threshold, cfg.precision_clear_threshold
        )
        self._exchange = exchange
        self._alarms = alarms
        self._metrics = metrics
        self._ip = service_ip
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()

    # -- fed by the inference path and the management plane -------------------------------

    def record(self, p: int, d: int, ctx: Completed) -> None:
        """Group (p, d) answered a client request successfully. Starts a sample when one is due
        and a slot is free; returns at once either way."""
        if len(self._tasks) >= MAX_IN_FLIGHT:
            return
        state = self.groups.take_sample(p, d, self._clock())
        if state is None:
            return
        task = asyncio.get_running_loop().create_task(
            self._sample(state, ctx), name=f"precision_sample_{p}_{d}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def dismiss(self, p: int, d: int) -> bool:
        """ClearPrecisionAlarm: forget group (p, d) (p = 0: every group of decode instance d), so
        it is sampled afresh. No CLEAR is reported: the caller cleared the alarm already."""
        dropped = self.groups.drop(p, d)
        for s in dropped:
            log.event("precision_dismissed", p=s.p, d=s.d, alarm_active=s.alarm_active)
        self._publish()
        return bool(dropped)

    def retain(self, instance_ids: set[int]) -> None:
        """The table changed: forget the groups with an instance no longer in it."""
        for s in self.groups.retain(instance_ids):
            log.event("precision_forgotten", p=s.p, d=s.d, alarm_active=s.alarm_active)
        self._publish()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- one sample, and what follows from it ---------------------------------------------

    async def _sample(self, state: GroupState, ctx: Completed) -> None:
        try:
            await self._judge(state, ctx)
        except Exception:  # a bug; the sample counts as none, and the next one is taken as usual
            log.exception("task_failed", task=f"precision_sample_{state.p}_{state.d}")
        finally:
            state.busy = False

    async def _judge(self, state: GroupState, ctx: Completed) -> None:
        verdict = await self._shadow(state, ctx)
        # A group dismissed or forgotten meanwhile has a new state (or none): the
        # outcome belongs to nobody.
        if verdict is None or not self.groups.current(state):
            return
        if verdict.anomalous:
            log.warn(
                "precision_anomaly",
                p=state.p,
                d=state.d,
                kind=verdict.kind,
                kinds=",".join(verdict.kinds),
                consecutive=state.anomalies + 1,
                median_top1=verdict.median_top1,
            )
        action = self.groups.observe(state, verdict.anomalous, verdict.kind)
        probe: dict[str, str] = {}
        if action is Action.PROBE:
            outcome, probe = await self._probe(state, ctx)
            if not self.groups.current(state):
                return
            action = self.groups.probed(state, outcome)
        if action is Action.RAISE:
            self._raise(state, ctx, probe)
        elif action is Action.CLEAR:
            self._clear(state)

    async def _ask(self, state: GroupState, ctx: Completed, body: dict[str, Any], timeout_s: float) -> Any:
        """The engine's parsed answer. Raises GroupGone, or anything for a failed request."""
        status, data = await self._exchange(state.p, state.d, ctx.path, body, timeout_s)
        if status >= 400:
            raise RuntimeError(f"engine answered HTTP {status}")
        return json.loads(data)

    async def _shadow(self, state: GroupState, ctx: Completed) -> checker.Verdict | None:
        body = shadow_body(ctx, self.cfg.precision_logprobs)
        if body is None:
            return None
        try:
            verdict = checker.check(await self._ask(state, ctx, body, SAMPLE_TIMEOUT_S))
            if verdict is None:
                raise ValueError("the answer holds nothing to judge")
        except GroupGone:
            return None
        except Exception as exc:  # fail open: whatever went wrong, this is no sample
            self._metrics.precision_sample("error")
            log.warn("precision_sample_failed", p=state.p, d=state.d, error=f"{type(exc).__name__}: {exc}")
            return None
        self._metrics.precision_sample("anomalous" if verdict.anomalous else "normal")
        return verdict

    async def _probe(self, state: GroupState, ctx: Completed) -> tuple[ProbeOutcome, dict[str, str]]:
        cfg = self.cfg
        body = probe_body(ctx, cfg.precision_probe_question)
        wrong = 0
        last = ""
        for attempt in range(1, cfg.probe_max_attempts + 1):
            try:
                text = checker.answer_text(await self._ask(state, ctx, body, cfg.probe_timeout_s))
                if text is None:
                    raise ValueError("not a completion")
            except GroupGone:
                return ProbeOutcome.ERROR, {}
            except Exception as exc:
                log.warn(
                    "precision_probe", p=state.p, d=state.d, kind=state.last_kind, attempt=attempt,
                    result="error", error=f"{type(exc).__name__}: {exc}",
                )  # fmt: skip
                continue
            if checker.answers(text, cfg.precision_probe_expected):
                log.event(
                    "precision_probe", p=state.p, d=state.d, kind=state.last_kind, attempt=attempt,
                    result="pass",
                )  # fmt: skip
                self._metrics.precision_probe("pass")
                return ProbeOutcome.PASS, {}
            wrong += 1
            last = _excerpt(text)
            log.warn(
                "precision_probe", p=state.p, d=state.d, kind=state.last_kind, attempt=attempt,
                result="wrong", answer=last,
            )  # fmt: skip
        # Only wrong answers convict: an attempt that got no answer at all proves nothing.
        outcome = ProbeOutcome.FAIL if wrong == cfg.probe_max_attempts else ProbeOutcome.ERROR
        self._metrics.precision_probe(outcome.value)
        return outcome, {"probe_attempts": str(cfg.probe_max_attempts), "probe_answer": last}

    def _raise(self, state: GroupState, ctx: Completed, probe: Mapping[str, str]) -> None:
        consecutive = state.anomalies
        moi = reporter.moi_of(self._ip, state.p, state.d)
        self.groups.raised(state, moi)
        attempts = probe.get("probe_attempts", "0")
        reason = (
            f"{consecutive} consecutive anomalous samples (last: {state.last_kind}), and the probe "
            f"question got a wrong answer on all {attempts} attempts"
        )
        info = {
            "model": ctx.model,
            "samples": str(state.samples),
            "anomalous_samples": str(state.anomalous_samples),
            "consecutive_anomalous_samples": str(consecutive),
            "last_anomaly_kind": state.last_kind,
            "probe_question": self.cfg.precision_probe_question,
            "probe_expected": self.cfg.precision_probe_expected,
            **probe,
        }
        log.error("precision_alarm", p=state.p, d=state.d, kind=state.last_kind, moi=moi, reason=reason)
        self._alarms.submit(reporter.precision_alarm(reporter.ALARM, moi, state.p, state.d, reason, info))
        self._publish()

    def _clear(self, state: GroupState) -> None:
        moi, normals = state.alarm_moi, state.normals
        self.groups.cleared(state)
        reason = f"{normals} consecutive normal samples"
        info = {
            "samples": str(state.samples),
            "anomalous_samples": str(state.anomalous_samples),
            "consecutive_normal_samples": str(normals),
            "last_anomaly_kind": state.last_kind,
        }
        log.event("precision_clear", p=state.p, d=state.d, kind=state.last_kind, moi=moi, reason=reason)
        self._alarms.submit(reporter.precision_alarm(reporter.CLEAR, moi, state.p, state.d, reason, info))
        self._publish()

    def _publish(self) -> None:
        self._metrics.precision_alarms_active.set(self.groups.active_alarms())
