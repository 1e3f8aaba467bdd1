"""What a request keeps to continue elsewhere, read off the events relayed to its client: the
bytes the client gets (token ids it did not ask for removed, nothing else changed) and the
request that would continue it, whether the events arrive one by one or many at once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from motor_mesh.coordinator.migration.budget import StateBudget
from motor_mesh.coordinator.migration.carry import Carry

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 20}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(text: str, ids: list[int] | None, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": {"content": text},
        "logprobs": None,
        "finish_reason": finish,
    }
    if ids is not None:
        choice["token_ids"] = ids
    return _event(
        {"id": "c-1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [choice]}
    )


def _stream(ids: bool) -> list[bytes]:
    first = {
        "id": "c-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    if ids:
        first["prompt_token_ids"] = [5, 6, 7]
    words = [" a", " b", " c", " d"]
    events = [_event(first)]
    events += [_chunk(w, [100 + i] if ids else None) for i, w in enumerate(words)]
    events.append(_chunk(" e", [104] if ids else None, "length"))
    events.append(b"data: [DONE]\n\n")
    return events


def _carry(req: dict[str, Any] = CHAT, want_ids: bool = True) -> Carry:
    return Carry(req, True, StateBudget(1 << 20, 1 << 30), 100, want_ids)


@pytest.mark.parametrize("ids", [True, False])
def test_one_block_or_event_by_event_the_client_gets_the_same_and_the_same_is_kept(ids: bool) -> None:
    events = _stream(ids)
    whole, one = _carry(want_ids=ids), _carry(want_ids=ids)
    sent_whole = whole.feed_block(b"".join(events))
    sent_one = b"".join(one.feed_block(e) for e in events)
    assert sent_whole == sent_one
    assert b"token_ids" not in sent_whole  # the client did not ask for them
    expected = b"".join(events).replace(b',"prompt_token_ids":[5,6,7]', b"")
    for i in range(100, 105):
        expected = expected.replace(b',"token_ids":[%d]' % i, b"")
    assert sent_whole == expected  # and nothing else changed
    for c in (whole, one):
        assert (c.count, c.finish, c.done) == (5, "length", True)


def test_the_continuation_carries_the_ids_delivered() -> None:
    c = _carry()
    c.feed_block(b"".join(_stream(True)[:3]))  # the role event and two tokens, then a break
    assert c.why_not() is None
    req = c.next_request()
    assert req is not None
    assert req["kv_transfer_params"] == {"prompt_token_ids": [5, 6, 7, 100, 101]}
    assert req["max_tokens"] == 18 and req["return_token_ids"] is True


def test_without_ids_the_continuation_carries_the_text() -> None:
    c = _carry()  # asked for ids, the engine gave none (an engine without return_token_ids)
    c.feed_block(b"".join(_stream(False)[:3]))
    req = c.next_request()
    assert req is not None
    assert req["messages"][-1] == {"role": "assistant", "content": " a b"}
    assert req["continue_final_message"] is True and req["add_generation_prompt"] is False
    assert req["max_tokens"] == 18


def test_ids_the_client_asked_for_stay() -> None:
    c = _carry({**CHAT, "return_token_ids": True})
    sent = c.feed_block(b"".join(_stream(True)))
    assert b'"prompt_token_ids":[5,6,7]' in sent and b'"token_ids":[103]' in sent


def test_a_continuation_keeps_the_first_id_and_counts_usage_once() -> None:
    c = _carry({**CHAT, "stream_options": {"include_usage": True}})
    c.feed_block(b"".join(_stream(True)[:3]))
    c.next_request()
    c.moves = 1
    role = {"id": "c-2", "object": "chat.completion.chunk", "created": 9, "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            "prompt_token_ids": [5, 6, 7, 100, 101]}  # fmt: skip
    usage = {"id": "c-2", "object": "chat.completion.chunk", "created": 9, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}  # fmt: skip
    sent = c.feed_block(_event(role) + _chunk(" c", [102]).replace(b'"c-1"', b'"c-2"') + _event(usage))
    got = [json.loads(line[6:]) for line in sent.split(b"\n\n") if line.startswith(b"data: {")]
    assert [g["id"] for g in got] == ["c-1", "c-1"]  # the role event dropped, the id the first's
    assert got[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
