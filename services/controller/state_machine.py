"""The instance state machine as pure functions (docs/architecture.md,
"The instance state machine").

    INITIAL ──all ready──▶ ACTIVE ◀──resume── PAUSED
       │                  │   └──paused──────▶ │
       └───any ABNORMAL───┴──────▶ INACTIVE ◀──┘  (ACTIVE again when all ready, unless separated
                                                    or switching role)
    any ──heartbeat timeout / dropped──▶ DELETED (terminal)

"Ready" means every routable endpoint NORMAL and every headless one at least WAIT_TO_START.
Nothing here touches I/O, clocks or the database: the instance table feeds in the endpoint
statuses and applies what comes out.
"""

from __future__ import annotations

from collections.abc import Iterable

from motor_mesh.common.enums import (
    ACTIVE,
    DELETED,
    EP_ABNORMAL,
    EP_INITIAL,
    EP_NORMAL,
    EP_PAUSED,
    EP_WAIT,
    INACTIVE,
    INITIAL,
    PAUSED,
    InstanceStatus,
    status_name,
)

# The statuses are re-exported: callers read the state machine with its own vocabulary.
__all__ = [
    "ACTIVE",
    "DELETED",
    "EP_ABNORMAL",
    "EP_INITIAL",
    "EP_NORMAL",
    "EP_PAUSED",
    "EP_WAIT",
    "INACTIVE",
    "INITIAL",
    "PAUSED",
    "is_routable",
    "name",
    "next_status",
]

# A headless endpoint (no HTTP server) is ready once its process runs.
_HEADLESS_READY = frozenset({EP_WAIT, EP_NORMAL, EP_PAUSED})

name = status_name  # ``ACTIVE`` for INSTANCE_STATUS_ACTIVE (for logs)


def next_status(
    current: InstanceStatus,
    endpoints: Iterable[tuple[int, bool]],
    *,
    separated: bool = False,
    switching: bool = False,
) -> tuple[InstanceStatus, str]:
    """The status after observing ``endpoints`` (``(status, headless)`` pairs), and why.
    ``separated`` (a fault) and ``switching`` (a role switch past its drain) keep it INACTIVE.

    Returns ``(current, "")`` when nothing changes.
    """
    if current == DELETED:
        return current, ""
    routable: list[int] = []
    headless_ready = True
    abnormal = False
    for status, headless in endpoints:
        if status == EP_ABNORMAL:
            abnormal = True
        if headless:
            headless_ready = headless_ready and status in _HEADLESS_READY
        else:
            routable.append(status)
    if abnormal:
        return (INACTIVE, "endpoint_abnormal") if current != INACTIVE else (current, "")
    if separated or switching:
        why = "separated" if separated else "role_switch"
        return (INACTIVE, why) if current != INACTIVE else (current, "")
    usable = bool(routable) and headless_ready
    all_normal = usable and all(s == EP_NORMAL for s in routable)
    paused = usable and all(s in (EP_NORMAL, EP_PAUSED) for s in routable) and EP_PAUSED in routable
    if current == INITIAL and all_normal:
        return ACTIVE, "endpoints_ready"
    if current == INACTIVE and all_normal:
        return ACTIVE, "endpoints_ready"
    if current == ACTIVE and paused:
        return PAUSED, "endpoints_paused"
    if current == PAUSED and all_normal:
        return ACTIVE, "endpoints_resumed"
    return current, ""


def is_routable(status: int) -> bool:
    """What the Coordinators hold: ACTIVE instances, and PAUSED ones (held but not routed to)."""
    return status in (ACTIVE, PAUSED)
