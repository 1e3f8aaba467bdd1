"""The instance state machine (behaviour.md "Instance state machine"), as pure functions.

    INITIAL ──all ready──▶ ACTIVE ◀──resume── PAUSED
       │                  │   └──paused──────▶ │
       └───any ABNORMAL───┴──────▶ INACTIVE ◀──┘  (ACTIVE again when all ready, unless separated)
    any ──heartbeat timeout / dropped──▶ DELETED (terminal)

"Ready" means every routable endpoint NORMAL and every headless one at least WAIT_TO_START.
Nothing here touches I/O, clocks or the database: the instance table feeds in the endpoint
statuses and applies what comes out.
"""

from __future__ import annotations

from collections.abc import Iterable

from motor.v1 import common_pb2

from .model import Status

INITIAL = common_pb2.INSTANCE_STATUS_INITIAL
ACTIVE = common_pb2.INSTANCE_STATUS_ACTIVE
INACTIVE = common_pb2.INSTANCE_STATUS_INACTIVE
PAUSED = common_pb2.INSTANCE_STATUS_PAUSED
DELETED = common_pb2.INSTANCE_STATUS_DELETED

EP_INITIAL = common_pb2.ENDPOINT_STATUS_INITIAL
EP_WAIT = common_pb2.ENDPOINT_STATUS_WAIT_TO_START
EP_NORMAL = common_pb2.ENDPOINT_STATUS_NORMAL
EP_ABNORMAL = common_pb2.ENDPOINT_STATUS_ABNORMAL
EP_PAUSED = common_pb2.ENDPOINT_STATUS_PAUSED

# A headless endpoint (no HTTP server) is ready once its process runs.
_HEADLESS_READY = frozenset({EP_WAIT, EP_NORMAL, EP_PAUSED})


def name(status: int) -> str:
    """``ACTIVE`` for INSTANCE_STATUS_ACTIVE (for logs)."""
    return common_pb2.InstanceStatus.Name(common_pb2.InstanceStatus.ValueType(status)).removeprefix(
        "INSTANCE_STATUS_"
    )


def next_status(
    current: Status, endpoints: Iterable[tuple[int, bool]], *, separated: bool = False
) -> tuple[Status, str]:
    """The status after observing ``endpoints`` (``(status, headless)`` pairs), and why.

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
    if separated:
        return (INACTIVE, "separated") if current != INACTIVE else (current, "")
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


def after_heartbeat_timeout(current: Status) -> Status:
    """No heartbeat from one of the instance's NodeManagers for the timeout: gone for good."""
    return DELETED


def is_live(status: int) -> bool:
    return status != DELETED


def is_routable(status: int) -> bool:
    """What the Coordinators hold: ACTIVE instances, and PAUSED ones (held but not routed to)."""
    return status in (ACTIVE, PAUSED)
