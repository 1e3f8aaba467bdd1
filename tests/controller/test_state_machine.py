"""Every transition of the instance state machine (pure functions, no I/O)."""

from __future__ import annotations

import pytest

from motor_mesh.controller import state_machine as sm

N, W, A, P, INI = sm.EP_NORMAL, sm.EP_WAIT, sm.EP_ABNORMAL, sm.EP_PAUSED, sm.EP_INITIAL


def r(*statuses: int) -> list[tuple[int, bool]]:
    """Routable endpoints."""
    return [(s, False) for s in statuses]


def h(*statuses: int) -> list[tuple[int, bool]]:
    """Headless endpoints."""
    return [(s, True) for s in statuses]


@pytest.mark.parametrize(
    ("current", "endpoints", "expected"),
    [
        # INITIAL -> ACTIVE only when every routable endpoint is NORMAL, headless >= WAIT_TO_START
        (sm.INITIAL, r(N), sm.ACTIVE),
        (sm.INITIAL, r(N, N), sm.ACTIVE),
        (sm.INITIAL, r(N) + h(W), sm.ACTIVE),
        (sm.INITIAL, r(N) + h(N), sm.ACTIVE),
        (sm.INITIAL, r(N, W), sm.INITIAL),
        (sm.INITIAL, r(INI), sm.INITIAL),
        (sm.INITIAL, r(N) + h(INI), sm.INITIAL),
        (sm.INITIAL, h(N), sm.INITIAL),  # nothing routable: never ACTIVE
        (sm.INITIAL, [], sm.INITIAL),
        (sm.INITIAL, r(P), sm.INITIAL),
        # any ABNORMAL endpoint (routable or headless) -> INACTIVE
        (sm.INITIAL, r(N, A), sm.INACTIVE),
        (sm.ACTIVE, r(A), sm.INACTIVE),
        (sm.ACTIVE, r(N) + h(A), sm.INACTIVE),
        (sm.PAUSED, r(P, A), sm.INACTIVE),
        (sm.INACTIVE, r(A), sm.INACTIVE),
        # INACTIVE -> ACTIVE when all ready again
        (sm.INACTIVE, r(N) + h(W), sm.ACTIVE),
        (sm.INACTIVE, r(W), sm.INACTIVE),
        (sm.INACTIVE, r(P), sm.INACTIVE),
        # ACTIVE <-> PAUSED
        (sm.ACTIVE, r(P), sm.PAUSED),
        (sm.ACTIVE, r(N, P), sm.PAUSED),
        (sm.ACTIVE, r(N), sm.ACTIVE),
        (sm.ACTIVE, r(N, W), sm.ACTIVE),  # not ABNORMAL: stays
        (sm.PAUSED, r(N), sm.ACTIVE),
        (sm.PAUSED, r(P), sm.PAUSED),
        (sm.PAUSED, r(N, W), sm.PAUSED),
        # DELETED is terminal
        (sm.DELETED, r(N), sm.DELETED),
        (sm.DELETED, r(A), sm.DELETED),
    ],
)
def test_next_status(current: int, endpoints: list[tuple[int, bool]], expected: int) -> None:
    new, reason = sm.next_status(current, endpoints)  # type: ignore[arg-type]
    assert sm.name(new) == sm.name(expected)
    assert bool(reason) == (new != current)


@pytest.mark.parametrize("current", [sm.INITIAL, sm.ACTIVE, sm.PAUSED])
def test_separated_instance_goes_inactive(current: int) -> None:
    assert sm.next_status(current, r(N), separated=True) == (sm.INACTIVE, "separated")  # type: ignore[arg-type]


def test_separated_instance_does_not_come_back() -> None:
    assert sm.next_status(sm.INACTIVE, r(N), separated=True)[0] == sm.INACTIVE
    assert sm.next_status(sm.INACTIVE, r(N), separated=False)[0] == sm.ACTIVE


def test_reasons_name_the_cause() -> None:
    assert sm.next_status(sm.INITIAL, r(N))[1] == "endpoints_ready"
    assert sm.next_status(sm.ACTIVE, r(A))[1] == "endpoint_abnormal"
    assert sm.next_status(sm.ACTIVE, r(P))[1] == "endpoints_paused"
    assert sm.next_status(sm.PAUSED, r(N))[1] == "endpoints_resumed"


def test_routable_statuses() -> None:
    assert [s for s in (sm.INITIAL, sm.ACTIVE, sm.INACTIVE, sm.PAUSED, sm.DELETED) if sm.is_routable(s)] == [
        sm.ACTIVE,
        sm.PAUSED,
    ]
