"""ListAlarms pages (AIP-158): newest first, an opaque token naming where the next page starts.

The token carries the sequence below which the next page starts and the filters it was made
for, so it stays right while alarms are stored between pages (new ones are newer than any page
already handed out) and cannot be replayed against other filters.
"""

from __future__ import annotations

import base64
import binascii
import json

from motor_mesh.controller.alarms.store import AlarmStore
from motor_mesh.gen.motor.v1 import controller_pb2 as pb

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


class BadToken(ValueError):
    pass


def encode_token(before_sequence: int, req: pb.ListAlarmsRequest) -> str:
    raw = json.dumps([1, before_sequence, req.active_only, req.alarm_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_token(req: pb.ListAlarmsRequest) -> int:
    """The sequence the page starts below (0: the first page); BadToken for a token this server
    did not make for these filters."""
    if not req.page_token:
        return 0
    try:
        padded = req.page_token + "=" * (-len(req.page_token) % 4)
        version, before, active_only, alarm_id = json.loads(base64.urlsafe_b64decode(padded))
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise BadToken("not a page token of ListAlarms") from exc
    except RecursionError:  # "[[[[…": JSON nested past the parser's depth
        raise BadToken("not a page token of ListAlarms") from None
    if version != 1 or not isinstance(before, int) or isinstance(before, bool) or before < 1:
        raise BadToken("not a page token of ListAlarms")
    if (active_only, alarm_id) != (req.active_only, req.alarm_id):
        raise BadToken("the token was made for other filters (active_only, alarm_id)")
    return before


def page_size(req: pb.ListAlarmsRequest) -> int:
    return min(req.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def list_page(store: AlarmStore, req: pb.ListAlarmsRequest) -> pb.ListAlarmsResponse:
    """One page; the request was validated (its token decodes)."""
    size = page_size(req)
    resp = pb.ListAlarmsResponse()
    found = store.newest_first(
        active_only=req.active_only, alarm_id=req.alarm_id, before_sequence=decode_token(req)
    )
    for alarm in found:
        if len(resp.alarms) == size:
            resp.next_page_token = encode_token(resp.alarms[-1].sequence, req)
            break
        resp.alarms.append(alarm)
    return resp
