"""Per-PD-group precision state: when a group is due for a sample, what a verdict leads to.

Pure state, no I/O and no clock of its own (callers pass ``now``), so the rules are tested
directly and the same object could sit behind a queue fed by several inference workers: what it
is fed (:class:`Completed`, verdicts, probe outcomes) is plain data, never a request object.

A group is (p, d): the prefill and the decode instance that served a request together; a union
instance (or a prefill instance serving whole requests) is the group (0, d).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

GroupKey = tuple[int, int]  # (p, d); p = 0 for an instance that serves whole requests


@dataclass(frozen=True, slots=True)
class Completed:
    """A client request a group answered successfully, as the inference path reports it.

    ``request`` is the client's parsed JSON body (plain data, never mutated here): the sampler
    takes the prompt from it only when the group is due, so reporting costs nothing more."""

    path: str  # "/v1/chat/completions" or "/v1/completions"
    model: str
    request: Mapping[str, Any]


class Action(enum.Enum):
    NONE = "none"
    PROBE = "probe"  # ask the probe question before raising anything
    RAISE = "raise"  # report the ALARM
    CLEAR = "clear"  # report the CLEAR of the active alarm


class ProbeOutcome(enum.Enum):
    PASS = "pass"  # a right answer: the samples were wrong about the group
    FAIL = "fail"  # a wrong answer on every attempt
    ERROR = "error"  # no attempt answered right and at least one failed to answer at all


@dataclass(eq=False, slots=True)
class GroupState:
    p: int
    d: int
    anomalies: int = 0  # consecutive anomalous samples
    normals: int = 0  # consecutive normal samples while the alarm is active
    alarm_moi: str = ""  # the moi of the active ALARM ("" = none); its CLEAR carries the same
    busy: bool = False  # a sample (or the probe after it) is in flight
    last_sample: float = float("-inf")
    samples: int = 0
    anomalous_samples: int = 0
    last_kind: str = ""  # the last anomaly's kind

    @property
    def key(self) -> GroupKey:
        return (self.p, self.d)

    @property
    def alarm_active(self) -> bool:
        return bool(self.alarm_moi)


class PrecisionGroups:
    def __init__(self, interval_s: float, issue_threshold: int, clear_threshold: int) -> None:
        self.interval_s = interval_s
        self.issue_threshold = issue_threshold
        self.clear_threshold = clear_threshold
        self._groups: dict[GroupKey, GroupState] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def get(self, p: int, d: int) -> GroupState | None:
        return self._groups.get((p, d))

    def current(self, state: GroupState) -> bool:
        """Whether ``state`` is still the group's state (not dropped since a sample started)."""
        return self._groups.get(state.key) is state

    def take_sample(self, p: int, d: int, now: float) -> GroupState | None:
        """The group's state, marked busy, when a sample is due; else None. Every group served
        gets a state here, which is what ClearPrecisionAlarm later finds."""
        state = self._groups.get((p, d))
        if state is None:
            state = self._groups[(p, d)] = GroupState(p, d)
        if state.busy or now - state.last_sample < self.interval_s:
            return None
        state.busy = True
        state.last_sample = now
        return state

    def observe(self, state: GroupState, anomalous: bool, kind: str = "") -> Action:
        """A sample's verdict. Anomalies only count towards a probe while no alarm is active;
        normal samples only count towards a clear while one is."""
        state.samples += 1
        if anomalous:
            state.anomalous_samples += 1
            state.anomalies += 1
            state.normals = 0
            state.last_kind = kind
            if not state.alarm_active and state.anomalies >= self.issue_threshold:
                return Action.PROBE
            return Action.NONE
        state.anomalies = 0
        if state.alarm_active:
            state.normals += 1
            if state.normals >= self.clear_threshold:
                return Action.CLEAR
        return Action.NONE

    def probed(self, state: GroupState, outcome: ProbeOutcome) -> Action:
        """The probe's outcome. PASS forgets the anomalies; ERROR keeps them, so the next
        anomalous sample probes again (a probe that could not be asked proves nothing)."""
        if outcome is ProbeOutcome.FAIL:
            return Action.RAISE
        if outcome is ProbeOutcome.PASS:
            state.anomalies = 0
        return Action.NONE

    def raised(self, state: GroupState, moi: str) -> None:
        state.alarm_moi = moi
        state.anomalies = 0
        state.normals = 0

    def cleared(self, state: GroupState) -> None:
        state.alarm_moi = ""
        state.normals = 0

    def drop(self, p: int, d: int) -> list[GroupState]:
        """Forget group (p, d), or with p = 0 every group whose decode instance is d; returns
        the states dropped."""
        if p:
            state = self._groups.pop((p, d), None)
            return [state] if state is not None else []
        keys = [k for k in self._groups if k[1] == d]
        return [self._groups.pop(k) for k in keys]

    def retain(self, instance_ids: Collection[int]) -> list[GroupState]:
        """Forget the groups with an instance outside ``instance_ids``; returns them."""
        gone = [k for k in self._groups if k[1] not in instance_ids or (k[0] and k[0] not in instance_ids)]
        return [self._groups.pop(k) for k in gone]

    def active_alarms(self) -> int:
        return sum(1 for s in self._groups.values() if s.alarm_active)
